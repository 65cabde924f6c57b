"""A DeepSeek-V3-shaped MoE transformer in plain PyTorch.

Embedding, RMSNorm, SDPA attention with RoPE, a top-k router (softmax, or
sigmoid with a selection bias), an optional shared expert, routed experts with
expert parallelism through ``fxoverlap.ops.dispatch`` / ``combine``, a per-layer
pattern of dense and MoE layers, LM head and cross-entropy loss. Optional:
manifold-constrained hyper-connections (``mhc_rate``, see ``mhc.py``) and a
DeepSeek-V3-style multi-token-prediction head of depth 1 (``mtp``).

Routing modes: ``"dropless"`` (variable split sizes; the dispatch output has a
data-dependent row count) and ``"capacity"`` (drop-and-pad to a fixed number of
rows per expert; every shape is static). ``token_dedup=True`` (dropless) sends
each token once per destination rank with its routing (``ops.token_dispatch``);
the receiving rank sums a token's weighted expert outputs before the combine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fxoverlap import ops
from fxoverlap.models.mhc import HyperConnection, contract_streams, expand_streams
from fxoverlap.ir.errors import FxOverlapError


class ModelConfigError(FxOverlapError, ValueError):
    """A reference model's config (``MoEConfig``) or its expert-parallel split is inconsistent;
    the message names the field."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 256
    dim: int = 64
    n_heads: int = 4
    n_layers: int = 2
    # "moe" or "dense" per layer; None: every layer is MoE.
    layer_pattern: tuple[str, ...] | None = None
    n_experts: int = 8
    top_k: int = 2
    expert_dim: int = 32
    dense_dim: int = 128
    shared_expert_dim: int = 0  # 0: no shared expert
    router: Literal["softmax", "sigmoid"] = "softmax"
    routing: Literal["dropless", "capacity"] = "dropless"
    capacity_factor: float = 1.0
    # Dropless only: send each token once per destination rank with its routing
    # (fxoverlap.ops.token_dispatch) instead of once per selected expert.
    token_dedup: bool = False
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # mHC: the residual stream widened to this many copies (the paper's n = 4); None: off.
    mhc_rate: int | None = None
    # A multi-token-prediction module of depth 1; its loss is added with this weight.
    mtp: bool = False
    mtp_loss_weight: float = 0.3
    # Emulating one rank of EP-N on one device where top_k > E/N (fxoverlap.bench --emulate-ep):
    # the router scores n_experts * expert_fold experts and folds each choice e onto local
    # expert e mod n_experts, so a rank with n_experts experts still gets top_k rows per token.
    # 1: off (the router scores n_experts experts).
    expert_fold: int = 1
    # Full activation checkpointing: each decoder layer runs under
    # torch.utils.checkpoint.checkpoint(..., use_reentrant=False), so eager keeps only its
    # input and replays it in the backward (fxoverlap replays it too, never its all-to-alls).
    activation_checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.mhc_rate is not None and self.mhc_rate < 1:
            raise ModelConfigError(
                f"MoEConfig.mhc_rate is the number of residual streams of mHC and must be >= 1 "
                f"(or None for off), got {self.mhc_rate}"
            )
        pattern = self.pattern
        if len(pattern) != self.n_layers:
            raise ModelConfigError(f"layer_pattern has {len(pattern)} entries for {self.n_layers} layers")
        if bad := [p for p in pattern if p not in ("moe", "dense")]:
            raise ModelConfigError(f"layer_pattern entries must be 'moe' or 'dense', got {bad}")
        if self.dim % self.n_heads:
            raise ModelConfigError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.token_dedup and self.routing != "dropless":
            raise ModelConfigError(
                "MoEConfig.token_dedup needs routing='dropless' (capacity routing sends fixed-size buffers "
                "per expert); set routing='dropless' or token_dedup=False"
            )
        if self.expert_fold < 1:
            raise ModelConfigError(f"MoEConfig.expert_fold must be >= 1 (1: off), got {self.expert_fold}")
        if not 1 <= self.top_k <= self.routed_experts:
            raise ModelConfigError(f"top_k must be in [1, n_experts * expert_fold], got {self.top_k}")
        if self.expert_fold > 1 and self.token_dedup:
            raise ModelConfigError(
                "MoEConfig.expert_fold folds several of a token's experts onto one local expert, which the "
                "token-once dispatch (token_dedup) does not take; use token_dedup=False with expert_fold")

    @property
    def routed_experts(self) -> int:
        """The experts the router scores: ``n_experts * expert_fold``."""
        return self.n_experts * self.expert_fold

    @property
    def pattern(self) -> tuple[str, ...]:
        return self.layer_pattern if self.layer_pattern is not None else ("moe",) * self.n_layers

    @classmethod
    def tiny(cls, **overrides) -> "MoEConfig":
        """A few-layer model for CPU tests: runs a step in milliseconds."""
        return cls(**overrides)

    @classmethod
    def benchmark(cls, **overrides) -> "MoEConfig":
        """The shape of the Megatron-Core peer measurement (docs/benchmarks.md)."""
        base = dict(
            vocab_size=32768, dim=4096, n_heads=32, n_layers=4, n_experts=32, top_k=8,
            expert_dim=1024, dense_dim=16384, max_seq_len=4096,
        )
        base.update(overrides)
        return cls(**base)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, S, hd]; rotate the two halves of the head dimension.
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[2]].to(x.dtype), sin[: x.shape[2]].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        cos, sin = rope_tables(self.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, self.rope_cos, self.rope_sin), apply_rope(k, self.rope_cos, self.rope_sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    """SwiGLU MLP: the dense layers' FFN and the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.kind, self.top_k = cfg.router, cfg.top_k
        self.n_experts, self.fold = cfg.n_experts, cfg.expert_fold
        self.gate = nn.Linear(cfg.dim, cfg.routed_experts, bias=False)
        if cfg.router == "sigmoid":
            # DeepSeek-V3's load-balancing bias: shifts selection, not the weights.
            self.register_buffer("expert_bias", torch.zeros(cfg.routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()
        if self.kind == "softmax":
            weights, idx = logits.softmax(-1).topk(self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            idx = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, idx)
            weights = weights / weights.sum(-1, keepdim=True)
        if self.fold > 1:  # expert e of n_experts * fold lands on expert e mod n_experts
            idx = idx % self.n_experts
        return weights.to(x.dtype), idx


class GroupedExperts(nn.Module):
    """This rank's experts; tokens arrive grouped by local expert."""

    def __init__(self, n_local: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_local, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_local, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_local, hidden, dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        h = F.silu(ops.grouped_mm(x, self.w1, offs)) * ops.grouped_mm(x, self.w3, offs)
        return ops.grouped_mm(h, self.w2, offs)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig, ep_group: dist.ProcessGroup | None):
        super().__init__()
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        if cfg.n_experts % ep:
            raise ModelConfigError(
                f"MoE: {cfg.n_experts} experts cannot be split over an expert-parallel "
                f"group of {ep} ranks; choose n_experts as a multiple of {ep}"
            )
        self.cfg, self.ep_group = cfg, ep_group
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.n_experts // ep, cfg.dim, cfg.expert_dim)
        self.shared_expert = FeedForward(cfg.dim, cfg.shared_expert_dim) if cfg.shared_expert_dim else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, idx = self.router(tokens)
        if self.cfg.routing == "capacity":
            out = self._capacity(tokens, weights, idx)
        elif self.cfg.token_dedup:
            out = self._token_once(tokens, weights, idx)
        else:
            out = self._dropless(tokens, weights, idx)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(shape)

    def _dropless(self, tokens, weights, idx):
        n_tok, k, e = tokens.shape[0], self.cfg.top_k, self.cfg.n_experts
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = F.one_hot(flat, e).sum(0)
        routed = tokens.index_select(0, order // k)
        received, recv_counts = ops.dispatch(routed, counts, self.ep_group)
        expert_out = ops.expert_rows(self.experts, received, recv_counts.sum(0))
        back = ops.combine(expert_out, recv_counts, counts, self.ep_group, n_tok * k)
        unsorted = torch.zeros_like(back).index_copy(0, order, back)
        return (unsorted.view(n_tok, k, -1) * weights.unsqueeze(-1)).sum(1)

    def _token_once(self, tokens, weights, idx):
        sent = ops.token_dispatch(tokens, idx, weights, self.cfg.n_experts, self.ep_group)
        expert_out = ops.expert_rows(self.experts, sent.x, sent.tokens_per_expert)
        return ops.token_combine(expert_out * sent.weights.unsqueeze(-1), sent, self.ep_group)

    def _capacity(self, tokens, weights, idx):
        n_tok, k, e = tokens.shape[0], self.cfg.top_k, self.cfg.n_experts
        cap = max(1, math.ceil(self.cfg.capacity_factor * n_tok * k / e))
        flat = idx.reshape(-1)
        one_hot = F.one_hot(flat, e)
        pos = (torch.cumsum(one_hot, 0) * one_hot).sum(1) - 1  # rank within its expert
        # Assignments past capacity go to a dump slot that is never sent.
        slot = torch.where(pos < cap, flat * cap + pos, e * cap)
        assignment_of_slot = torch.full((e * cap + 1,), n_tok * k, dtype=torch.long, device=tokens.device)
        assignment_of_slot = assignment_of_slot.scatter(0, slot, torch.arange(n_tok * k, device=tokens.device))
        padded = torch.cat([tokens.repeat_interleave(k, dim=0), tokens.new_zeros(1, tokens.shape[1])])
        send = padded.index_select(0, assignment_of_slot[: e * cap])
        counts = torch.full((e,), cap, dtype=torch.long, device=tokens.device)
        received, recv_counts = ops.dispatch(send, counts, self.ep_group, static_rows=True)
        expert_out = ops.expert_rows(self.experts, received, recv_counts.sum(0))
        back = ops.combine(expert_out, recv_counts, counts, self.ep_group, e * cap)
        per_assignment = torch.cat([back, back.new_zeros(1, back.shape[1])]).index_select(0, slot)
        return (per_assignment.view(n_tok, k, -1) * weights.unsqueeze(-1)).sum(1)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, kind: str, ep_group: dist.ProcessGroup | None, mhc_rate: int | None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if kind == "moe":
            self.moe = MoE(cfg, ep_group)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.dense_dim)
        if mhc_rate is not None:
            self.attention_hc = HyperConnection(mhc_rate, cfg.dim, cfg.norm_eps)
            self.ffn_hc = HyperConnection(mhc_rate, cfg.dim, cfg.norm_eps)
        self.activation_checkpoint = cfg.activation_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[B, S, D]``, or ``[B, S, n, D]`` with mHC."""
        if self.activation_checkpoint:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        if not hasattr(self, "attention_hc"):
            h = x + self.attention(self.attention_norm(x))
            return h + ffn(self.ffn_norm(h))
        h, h_post, h_res = self.attention_hc.pre(x)
        x = self.attention_hc.post(x, self.attention(self.attention_norm(h)), h_post, h_res)
        h, h_post, h_res = self.ffn_hc.pre(x)
        return self.ffn_hc.post(x, ffn(self.ffn_norm(h)), h_post, h_res)


class MTP(nn.Module):
    """Multi-token prediction of depth 1 (DeepSeek-V3): from the main model's last
    hidden state and the embedding of the next token, predict the token after it.
    One transformer block with a dense FFN (no all-to-all outside the decoder layers)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        if cfg.mhc_rate is not None:
            self.hc_contract = nn.Parameter(torch.full((cfg.mhc_rate,), 1.0 / cfg.mhc_rate))
        self.hidden_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.embed_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        # part of the head, not a decoder layer: activation_checkpoint is about the layers
        self.block = Block(dataclasses.replace(cfg, activation_checkpoint=False), "dense", None, None)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        """``h``: the main model's hidden state before the final norm (``[B, S, n, D]``
        before contraction with mHC); ``next_embed``: embeddings of tokens shifted by one."""
        if hasattr(self, "hc_contract"):
            h = contract_streams(h, self.hc_contract)
        h = self.proj(torch.cat([self.hidden_norm(h), self.embed_norm(next_embed)], dim=-1))
        return self.norm(self.block(h))


class MoETransformer(nn.Module):
    """``forward(tokens, labels=None)``: logits, or the mean cross-entropy loss given labels
    (plus ``mtp_loss_weight`` times the MTP loss with ``cfg.mtp``)."""

    def __init__(self, cfg: MoEConfig, ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, kind, ep_group, cfg.mhc_rate) for kind in cfg.pattern)
        if cfg.mhc_rate is not None:
            self.hc_contract = nn.Parameter(torch.full((cfg.mhc_rate,), 1.0 / cfg.mhc_rate))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.mtp:
            self.mtp = MTP(cfg)  # not in self.layers: it is part of the head

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.cfg.mhc_rate is not None:
            h = expand_streams(h, self.cfg.mhc_rate)
        for layer in self.layers:
            h = layer(h)
        streams = h
        if self.cfg.mhc_rate is not None:
            h = contract_streams(h, self.hc_contract)
        logits = self.output(self.norm(h))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        if not self.cfg.mtp:
            return loss
        # Position i sees token i+1 and predicts label i+1 (the token after next);
        # the last position has no next token and is left out of the loss.
        next_tokens = F.pad(tokens[:, 1:], (0, 1), value=0)
        mtp_logits = self.output(self.mtp(streams, self.tok_embeddings(next_tokens)))
        mtp_loss = F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return loss + self.cfg.mtp_loss_weight * mtp_loss


class MoEStage(nn.Module):
    """One pipeline stage of a :class:`MoETransformer` (``torch.distributed.pipelining``): the
    embedding (first stage), the layers ``layer_ids`` under their original indices (a
    ``ModuleDict``, as torchtitan splits its models), the final norm and output (last stage).
    It shares the model's modules; ``forward(h)`` takes tokens (first) or hidden states."""

    def __init__(self, model: MoETransformer, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.cfg = model.cfg
        self.first, self.last = first, last
        if first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        if last:
            if model.cfg.mhc_rate is not None:
                self.hc_contract = model.hc_contract
            self.norm, self.output = model.norm, model.output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.tok_embeddings(h)
            if self.cfg.mhc_rate is not None:
                h = expand_streams(h, self.cfg.mhc_rate)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.last else h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last stage's final norm and output projection."""
        if self.cfg.mhc_rate is not None:
            h = contract_streams(h, self.hc_contract)
        return self.output(self.norm(h))
