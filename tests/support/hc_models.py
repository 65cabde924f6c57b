"""A hyper-connection MoE transformer written as a user would, without ``fxoverlap.models``.

Expert parallelism is torchtitan-style: capacity routing (fixed slots per expert,
overflow dropped) so every rank sends equal static splits through
``all_to_all_single_autograd``. The only fxoverlap import is the region marker
around the hyper-connection code. Decoder layers live in ``self.layers``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd

from fxoverlap import region


class HyperConnection(nn.Module):
    """``x <- H_res x + H_post * fn(H_pre x)`` over ``n`` streams, H's from the normed stream."""

    def __init__(self, n: int, dim: int):
        super().__init__()
        self.n = n
        self.norm = nn.RMSNorm(n * dim)
        self.proj = nn.Linear(n * dim, 2 * n + n * n)  # H_pre, H_post, H_res logits in one
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor, fn) -> torch.Tensor:
        n = self.n
        with region("mhc"):
            pre, post, res = self.proj(self.norm(x.flatten(-2))).split([n, n, n * n], dim=-1)
            res = res.unflatten(-1, (n, n)).exp()
            for _ in range(20):  # Sinkhorn-Knopp: doubly stochastic
                res = res / res.sum(-1, keepdim=True)
                res = res / res.sum(-2, keepdim=True)
            h = torch.einsum("bsn,bsnd->bsd", pre.sigmoid(), x)
        out = fn(h)
        with region("mhc"):
            return torch.einsum("bsij,bsjd->bsid", res, x) + 2 * post.sigmoid().unsqueeze(-1) * out.unsqueeze(-2)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, group: dist.ProcessGroup):
        super().__init__()
        self.group, self.n_experts, self.top_k = group, n_experts, top_k
        self.ep = dist.get_world_size(group)
        self.n_local = n_experts // self.ep
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(self.n_local, dim, hidden) * 0.02)
        self.w_out = nn.Parameter(torch.randn(self.n_local, hidden, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, 1)
        t, d, e, k = tokens.shape[0], tokens.shape[1], self.n_experts, self.top_k
        weights, idx = self.gate(tokens).softmax(-1).topk(k, dim=-1)
        cap = t * k // e
        one_hot = F.one_hot(idx.flatten(), e)
        pos = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)
        slot = torch.where(pos < cap, idx.flatten() * cap + pos, e * cap)  # e * cap: dropped
        send = tokens.new_zeros(e * cap + 1, d).index_add(0, slot, tokens.repeat_interleave(k, 0))[:-1]
        splits = [self.n_local * cap] * self.ep
        recv = all_to_all_single_autograd(send, splits, splits, self.group)
        recv = recv.view(self.ep, self.n_local, cap, d).transpose(0, 1).reshape(self.n_local, -1, d)
        out = torch.bmm(F.silu(torch.bmm(recv, self.w_in)), self.w_out)
        out = out.view(self.n_local, self.ep, cap, d).transpose(0, 1).reshape(-1, d)
        back = all_to_all_single_autograd(out, splits, splits, self.group)
        back = torch.cat([back, back.new_zeros(1, d)])[slot]
        return (back.view(t, k, d) * weights.unsqueeze(-1)).sum(1).view_as(x)


class Layer(nn.Module):
    def __init__(self, dim: int, n_heads: int, n: int, ffn: nn.Module):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn = ffn
        self.attn_hc, self.ffn_hc = HyperConnection(n, dim), HyperConnection(n, dim)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_hc(x, self.attention)
        return self.ffn_hc(x, lambda h: self.ffn(self.ffn_norm(h)))


class HCMoETransformer(nn.Module):
    """``forward(tokens, labels) -> loss``; ``pattern``: "moe" or "dense" per layer."""

    def __init__(self, group, pattern=("moe", "moe"), vocab=128, dim=32, n_heads=4, n_streams=4,
                 n_experts=4, top_k=2, hidden=32):
        super().__init__()
        self.n = n_streams
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            Layer(dim, n_heads, n_streams,
                  MoE(dim, hidden, n_experts, top_k, group) if kind == "moe"
                  else nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)))
            for kind in pattern
        )
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        with region("mhc"):
            x = h.unsqueeze(2).repeat(1, 1, self.n, 1)
        for layer in self.layers:
            x = layer(x)
        with region("mhc"):
            h = x.sum(2)
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), labels.flatten())
