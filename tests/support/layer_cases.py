"""Models for the layer-finder tests: experts in an ``nn.ModuleList`` longer than the
decoder-layer list (the longest list is not the layer list)."""

from __future__ import annotations

import torch
import torch.nn as nn

from fxoverlap import ops


class ListExperts(nn.Module):
    """An MoE FFN whose local experts are an ``nn.ModuleList``; each expert takes a fixed
    equal share of the rows (capacity-style, static shapes), one rank (``group=None``)."""

    def __init__(self, dim: int = 8, n_experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(dim, 1)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, n = x.shape[0], len(self.experts)
        counts = torch.full((n,), rows // n, dtype=torch.int64, device=x.device)
        y, recv = ops.dispatch(x * torch.sigmoid(self.gate(x)), counts, None, static_rows=True)
        out = torch.cat([e(chunk) for e, chunk in zip(self.experts, y.chunk(n))])
        return ops.combine(out, recv, counts, None, rows)


class Block(nn.Module):
    def __init__(self, dim: int = 8, n_experts: int = 4):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.ffn = ListExperts(dim, n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.attn(x))
        return x + self.ffn(x)


class ListExpertModel(nn.Module):
    """Two decoder layers (``blocks``), each with four experts in a ModuleList
    (``blocks.<i>.ffn.experts``): the experts lists are the longest."""

    def __init__(self, dim: int = 8, n_layers: int = 2, n_experts: int = 4):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, n_experts) for _ in range(n_layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
