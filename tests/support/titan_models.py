"""A MoE transformer written the torchtitan way: functional collectives, no fxoverlap import.

Expert parallelism with ``all_to_all_single_autograd`` over equal splits (each
rank sends ``capacity`` token slots to every expert), experts as a batched
matmul. Used to check that fxoverlap recognises EP it did not write.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd


class TitanMoE(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, group: dist.ProcessGroup, capacity: int):
        super().__init__()
        self.group, self.capacity, self.n_experts = group, capacity, n_experts
        self.ep = dist.get_world_size(group)
        n_local = n_experts // self.ep
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(n_local, dim, hidden) * 0.05)
        self.w_out = nn.Parameter(torch.randn(n_local, hidden, dim) * 0.05)
        self.shared = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        probs = self.gate(tokens).softmax(-1)
        weight, expert = probs.max(-1)  # top-1
        one_hot = F.one_hot(expert, self.n_experts)
        pos = (one_hot.cumsum(0) * one_hot).sum(1) - 1
        slot = torch.where(pos < self.capacity, expert * self.capacity + pos, self.n_experts * self.capacity)
        buf = torch.zeros(self.n_experts * self.capacity + 1, d, dtype=x.dtype)
        buf = buf.index_put((slot,), tokens)
        send = buf[:-1]
        recv = all_to_all_single_autograd(send, None, None, self.group)
        # [ep, n_local, capacity, d] -> [n_local, ep * capacity, d]
        n_local = self.n_experts // self.ep
        h = recv.view(self.ep, n_local, self.capacity, d).transpose(0, 1).reshape(n_local, -1, d)
        out = torch.bmm(F.gelu(torch.bmm(h, self.w_in)), self.w_out)
        out = out.view(n_local, self.ep, self.capacity, d).transpose(0, 1).reshape(-1, d)
        back = all_to_all_single_autograd(out, None, None, self.group)
        back = torch.cat([back, back.new_zeros(1, d)])
        routed = back[slot] * weight.unsqueeze(-1)
        return (routed + self.shared(tokens)).view(b, s, d)


class TitanBlock(nn.Module):
    def __init__(self, dim: int, n_experts: int, group, capacity: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = nn.MultiheadAttention(dim, 2, batch_first=True, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.moe = TitanMoE(dim, 2 * dim, n_experts, group, capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.moe(self.ffn_norm(x))


class TitanTransformer(nn.Module):
    def __init__(self, group, vocab: int = 64, dim: int = 32, n_layers: int = 2, n_experts: int = 4, capacity: int = 16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, n_experts, group, capacity) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return F.cross_entropy(self.output(self.norm(h)).flatten(0, 1), labels.flatten())
