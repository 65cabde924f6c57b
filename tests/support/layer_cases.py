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


class HostSplitMoE(nn.Module):
    """Dropless EP the older torchtitan way: functional collectives whose split sizes are
    host lists from ``.tolist()`` of the exchanged counts (a graph break under Dynamo)."""

    def __init__(self, dim: int, n_experts: int, group):
        super().__init__()
        self.group, self.n_experts = group, n_experts
        self.router = nn.Linear(dim, n_experts)
        self.expert = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        ep = torch.distributed.get_world_size(self.group)
        scores = self.router(x)
        choice = scores.argmax(-1)
        order = choice.argsort()
        counts = torch.bincount(choice, minlength=self.n_experts)
        received = all_to_all_single(counts, None, None, self.group)
        send = counts.view(ep, -1).sum(1).tolist()  # host split sizes: Dynamo breaks the graph here
        recv = received.view(ep, -1).sum(1).tolist()
        y = all_to_all_single_autograd(x[order], recv, send, self.group)
        y = torch.relu(self.expert(y))
        back = all_to_all_single_autograd(y, send, recv, self.group)
        out = torch.zeros_like(back).index_copy(0, order, back)
        return out * torch.sigmoid(scores.max(-1).values).unsqueeze(-1)


class HostSplitBlock(nn.Module):
    def __init__(self, dim: int, n_experts: int, group):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.moe = HostSplitMoE(dim, n_experts, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.attn(x))
        return x + self.moe(x)


class HostSplitModel(nn.Module):
    def __init__(self, group, dim: int = 8, n_layers: int = 2, n_experts: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(HostSplitBlock(dim, n_experts, group) for _ in range(n_layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def host_split_backend_warnings(rank: int, world: int) -> dict:
    """:class:`HostSplitModel` through the backend on this rank: the fallback warnings and
    whether the loss equals eager's."""
    import warnings

    from fxoverlap.backend import FallbackWarning

    torch.manual_seed(0)
    model = HostSplitModel(torch.distributed.group.WORLD)
    x = torch.randn(8, 8)
    ref = model(x).detach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend="fxoverlap")(x)
        loss.backward()
    return {"warnings": [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)],
            "equal": torch.equal(loss.detach(), ref)}
