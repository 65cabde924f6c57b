"""A small MoE transformer that draws random numbers everywhere eager users put them.

Dropout on the embeddings, after attention and inside the routed experts; a shared
expert with dropout written *before* the router (the ``side`` pass moves it under the
dispatch, after the router's draw) or *after* the routed experts (``tag`` puts it into
attn, before the experts' draw); a router that draws in training: noisy top-k gating
(``randn_like``, Shazeer et al. 2017) or sampled experts (``multinomial``); optional
user activation checkpointing and mHC hyper-connections (for mHC recompute). Used by
tests/test_rng.py and its spawned ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fxoverlap import ops
from fxoverlap.models.mhc import HyperConnection, contract_streams, expand_streams
from fxoverlap.models.moe import Attention, FeedForward, GroupedExperts, MoEConfig, RMSNorm


class DropoutExperts(GroupedExperts):
    def __init__(self, n_local: int, dim: int, hidden: int, p: float):
        super().__init__(n_local, dim, hidden)
        self.p = p

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        h = F.silu(ops.grouped_mm(x, self.w1, offs)) * ops.grouped_mm(x, self.w3, offs)
        return ops.grouped_mm(F.dropout(h, self.p, self.training), self.w2, offs)


class RandomMoE(nn.Module):
    def __init__(self, cfg: MoEConfig, ep_group: dist.ProcessGroup | None, p: float, router: str,
                 shared_first: bool):
        super().__init__()
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.cfg, self.ep_group, self.p, self.router = cfg, ep_group, p, router
        self.shared_first = shared_first
        self.shared_expert = FeedForward(cfg.dim, cfg.expert_dim)
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.noise = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = DropoutExperts(cfg.n_experts // ep, cfg.dim, cfg.expert_dim, p)

    def _route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(tokens)
        if self.training and self.router == "noisy":
            logits = logits + torch.randn_like(logits) * F.softplus(self.noise(tokens))
        probs = logits.softmax(-1)
        if self.training and self.router == "sample":
            idx = torch.multinomial(probs.detach(), self.cfg.top_k)
            return probs.gather(-1, idx), idx
        return probs.topk(self.cfg.top_k, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        if self.shared_first:
            shared = F.dropout(self.shared_expert(tokens), self.p, self.training)
        weights, idx = self._route(tokens)
        n_tok, k, e = tokens.shape[0], self.cfg.top_k, self.cfg.n_experts
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = F.one_hot(flat, e).sum(0)
        received, recv_counts = ops.dispatch(tokens.index_select(0, order // k), counts, self.ep_group)
        expert_out = self.experts(received, recv_counts.sum(0))
        back = ops.combine(expert_out, recv_counts, counts, self.ep_group, n_tok * k)
        unsorted = torch.zeros_like(back).index_copy(0, order, back)
        routed = (unsorted.view(n_tok, k, -1) * weights.unsqueeze(-1)).sum(1)
        if not self.shared_first:
            shared = F.dropout(self.shared_expert(tokens), self.p, self.training)
        return (routed + shared).view(shape)


class RandomBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, ep_group, p: float, router: str, shared_first: bool, ac: bool):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = RandomMoE(cfg, ep_group, p, router, shared_first)
        if cfg.mhc_rate is not None:
            self.attention_hc = HyperConnection(cfg.mhc_rate, cfg.dim, cfg.norm_eps)
            self.ffn_hc = HyperConnection(cfg.mhc_rate, cfg.dim, cfg.norm_eps)
        self.p, self.ac = p, ac

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.attention(self.attention_norm(x)), self.p, self.training)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "attention_hc"):
            h = x + self._attention(x)
            return h + self.moe(self.ffn_norm(h))
        h, h_post, h_res = self.attention_hc.pre(x)
        x = self.attention_hc.post(x, self._attention(h), h_post, h_res)
        h, h_post, h_res = self.ffn_hc.pre(x)
        return self.ffn_hc.post(x, self.moe(self.ffn_norm(h)), h_post, h_res)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._forward, x, use_reentrant=False) if self.ac else self._forward(x)


class RandomTransformer(nn.Module):
    """``forward(tokens, labels)``: the mean cross-entropy loss."""

    def __init__(self, cfg: MoEConfig, ep_group=None, p: float = 0.25, router: str = "noisy",
                 shared_first: bool = True, ac: bool = False):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(RandomBlock(cfg, ep_group, p, router, shared_first, ac)
                                    for _ in range(cfg.n_layers))
        if cfg.mhc_rate is not None:
            self.hc_contract = nn.Parameter(torch.full((cfg.mhc_rate,), 1.0 / cfg.mhc_rate))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.p = p

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.tok_embeddings(tokens), self.p, self.training)
        if self.cfg.mhc_rate is not None:
            h = expand_streams(h, self.cfg.mhc_rate)
        for layer in self.layers:
            h = layer(h)
        if self.cfg.mhc_rate is not None:
            h = contract_streams(h, self.hc_contract)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
