"""Manifold-constrained hyper-connections (mHC, arXiv 2512.24880).

The residual stream is widened to ``n`` copies, ``x: [B, S, n, D]``. Around each
sublayer ``F`` (attention, MoE or dense FFN)::

    h     = sum_i H_pre[i] * x[i]                    # read:  [B, S, D]
    x'[j] = sum_i H_res[j, i] * x[i] + H_post[j] * F(h)   # write: [B, S, n, D]

with ``H_pre = sigmoid(.)``, ``H_post = 2 sigmoid(.)`` and ``H_res`` the
Sinkhorn-Knopp projection of ``exp(.)`` onto the doubly stochastic matrices, all
computed per token from an RMSNorm of the flattened stream ``x.flatten(-2)``.

Every op of the hyper-connection runs inside ``fxoverlap.region("mhc")`` (the
sublayer ``F`` does not), which is how the compiler's recompute pass finds it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxoverlap.region import region


def sinkhorn(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """Doubly stochastic matrices from ``logits[..., n, n]``: alternate row and column
    normalisation of ``exp(logits)``, ``iters`` times each.

    Columns sum to 1 exactly after the last step; rows converge at a rate set by
    the spread of the logits: for n = 4 and 20 iterations, within 1e-6 while the
    logits stay within a few units of each other, ~1e-3 beyond."""
    m = logits.exp()
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


class HyperConnection(nn.Module):
    """The mHC read (``pre``) and write (``post``) around one sublayer."""

    def __init__(self, n: int, dim: int, eps: float, sinkhorn_iters: int = 20):
        super().__init__()
        self.n, self.eps, self.sinkhorn_iters = n, eps, sinkhorn_iters
        self.norm_weight = nn.Parameter(torch.ones(n * dim))
        self.pre_proj = nn.Linear(n * dim, n)
        self.post_proj = nn.Linear(n * dim, n)
        self.res_proj = nn.Linear(n * dim, n * n)
        # Small data-dependent part; the biases start the maps near the plain
        # residual: H_pre ~ 1/n (0.5 for n = 1), H_post ~ 1, H_res diagonal-heavy
        # (diagonal ~0.47 for n = 4). A larger diagonal bias makes 20 Sinkhorn
        # iterations fall short of doubly stochastic (row sums off by 1e-3 at 4 * I).
        for proj in (self.pre_proj, self.post_proj, self.res_proj):
            nn.init.normal_(proj.weight, std=0.01)
        with torch.no_grad():
            self.pre_proj.bias.fill_(-math.log(n - 1) if n > 1 else 0.0)
            self.post_proj.bias.zero_()
            self.res_proj.bias.copy_(torch.eye(n).flatten())

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: [B, S, n, D]`` -> ``(h [B, S, D], H_post [B, S, n], H_res [B, S, n, n])``."""
        with region("mhc"):
            flat = x.flatten(-2)
            flat = F.rms_norm(flat, (flat.shape[-1],), self.norm_weight, self.eps)
            h_pre = self.pre_proj(flat).sigmoid()
            h_post = 2 * self.post_proj(flat).sigmoid()
            h_res = sinkhorn(self.res_proj(flat).unflatten(-1, (self.n, self.n)), self.sinkhorn_iters)
            h = (h_pre.unsqueeze(-2) @ x).squeeze(-2)
        return h, h_post, h_res

    def post(self, x: torch.Tensor, out: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> torch.Tensor:
        """The new stream: ``H_res @ x + H_post * out`` (``out``: the sublayer's ``[B, S, D]``)."""
        with region("mhc"):
            return h_res @ x + h_post.unsqueeze(-1) * out.unsqueeze(-2)


def expand_streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """Model entry: ``[B, S, D]`` -> ``n`` copies ``[B, S, n, D]``."""
    with region("mhc"):
        return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1])


def contract_streams(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Model exit: a learned weighted sum of the ``n`` copies, ``[B, S, n, D]`` -> ``[B, S, D]``."""
    with region("mhc"):
        return (weight.unsqueeze(-1) * x).sum(-2)
