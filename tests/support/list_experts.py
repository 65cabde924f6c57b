"""Experts kept as a list of MLPs: a small model of our own, Switch Transformers, and the 2-rank
workers of ``tests/test_hf_models.py``'s list-expert tests.

``ListMoEModel``: a decoder-only model whose MoE block routes top-k and calls
``self.experts(hidden[T, D], indices[T, k], weights[T, k])``, where ``experts`` is an
``nn.ModuleList`` of SwiGLU MLPs (``gate_proj`` / ``up_proj`` / ``down_proj``, a bias on
``down_proj``) whose own forward loops over the experts that were hit, as transformers' eager
experts do. Spawned ranks import this module by name.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxoverlap
import hf_cases
from fxoverlap.expert_parallel import find_experts
from fxoverlap.testing import take_grads

VOCAB = 64


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ListExperts(nn.ModuleList):
    """``experts[i]`` is expert i; called with the routing, loops over the experts that were hit."""

    def forward(self, hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in torch.unique(indices).tolist():
            token, slot = torch.where(indices == e)
            out.index_add_(0, token, self[e](hidden[token]) * weights[token, slot, None])
        return out


class MoEBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, mlp=MLP):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = ListExperts([mlp(dim, hidden) for _ in range(num_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = self.router(h).softmax(-1)
        weights, indices = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(h, indices, weights).reshape(shape)


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, moe: MoEBlock):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.o(a)
        return x + self.mlp(self.norm2(x))


class ListMoEModel(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 16, num_experts: int = 4, top_k: int = 2, layers: int = 2,
                 heads: int = 4, mlp=MLP):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList([Layer(dim, heads, MoEBlock(dim, hidden, num_experts, top_k, mlp))
                                     for _ in range(layers)])
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_own(**kw) -> ListMoEModel:
    torch.manual_seed(0)
    model = ListMoEModel(**kw)
    with torch.no_grad():  # a bias that is not zero makes the bias path count
        for name, p in model.named_parameters():
            if name.endswith("down_proj.bias"):
                p.normal_(0.0, 0.1)
    return model


def own_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def build_switch() -> nn.Module:
    """Switch Transformers (encoder-decoder), a sparse layer in each stack, 4 experts kept as
    an ``nn.ModuleDict`` of ``expert_<i>`` MLPs, called with one-hot masks [T, 1, E]."""
    import transformers

    torch.manual_seed(0)
    config = transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, num_heads=4, num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=4, expert_capacity=64,
        dropout_rate=0.0, router_jitter_noise=0.0)
    return transformers.SwitchTransformersForConditionalGeneration(config)


def switch_loss(out, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), decoder_ids[:, 1:].flatten())


def _data(rank: int, n: int = 2) -> list[torch.Tensor]:
    return hf_cases.batches(rank, n)


def _run_eager(model, mbs, kind: str) -> list[torch.Tensor]:
    losses = []
    for ids in mbs:
        if kind == "switch":
            loss = switch_loss(model(input_ids=ids, decoder_input_ids=ids.flip(-1)), ids, ids.flip(-1))
        else:
            loss = own_loss(model(ids), ids)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _reference(full, rank: int, world: int, kind: str):
    model = copy.deepcopy(full)
    losses = _run_eager(model, _data(rank), kind)
    own = take_grads(model)
    for r in range(world):
        _run_eager(model, _data(r), kind)
    return losses, own, take_grads(model)


def _summary(model, losses, ref_losses, want) -> dict:
    rel = hf_cases.rel({n: p.grad for n, p in model.named_parameters()}, want)
    worst = max(rel, key=rel.get)
    return dict(loss_rel=max(abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(losses, ref_losses)),
                grad_rel=rel[worst], worst=worst)


def on_two_ranks(rank: int, world: int) -> dict:
    """The own model (eager and through optimize) and Switch Transformers (eager) after
    expert_parallel, against the unsharded models."""
    group = dist.group.WORLD
    out = {}
    full = build_own()
    ref_losses, own, total = _reference(full, rank, world, "own")
    sharded = fxoverlap.expert_parallel(copy.deepcopy(full), group)
    want = hf_cases.rank_view_of(sharded, own, total, rank)
    out["own_names"] = sorted(n for n, _ in sharded.named_parameters())
    out["full_names"] = sorted(n for n, _ in full.named_parameters())
    eager = copy.deepcopy(sharded)
    out["own/eager"] = _summary(eager, _run_eager(eager, _data(rank), "own"), ref_losses, want)
    optimized = copy.deepcopy(sharded)
    engine = fxoverlap.optimize(optimized, group, config=fxoverlap.OverlapConfig(layer_container="layers"))
    losses = engine.forward_backward(_data(rank), loss_fn=own_loss)
    out["own/optimize"] = dict(_summary(optimized, losses, ref_losses, want), stages=[s.name for s in engine.stages])
    engine.close()

    full = build_switch()
    ref_losses, own, total = _reference(full, rank, world, "switch")
    sharded = fxoverlap.expert_parallel(copy.deepcopy(full), group)
    want = hf_cases.rank_view_of(sharded, own, total, rank)
    out["switch_experts"] = [n for n, _ in find_experts(sharded)]
    out["switch_names"] = sorted(n for n, _ in sharded.named_parameters() if ".experts." in n)
    out["switch/eager"] = _summary(sharded, _run_eager(sharded, _data(rank), "switch"), ref_losses, want)
    return out
