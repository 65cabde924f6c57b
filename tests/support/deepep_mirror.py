"""torchtitan 0.3.0's DeepEP / HybridEP custom ops, mirrored on CPU for one rank.

torchtitan registers ``deepep::dispatch/combine`` (torchtitan/distributed/deepep/deepep.py)
and ``hybridep::dispatch/combine`` (+ ``dispatch_bwd``/``combine_bwd``, hybridep.py), but
neither module imports here: ``deepep.py`` raises ImportError without DeepEP V2
(``deep_ep.ElasticBuffer``), and ``hybridep.py`` imports ``CustomClassBase`` from
``torch._library.opaque_object``, which torch 2.13 does not have. So this module defines
the ops in torchtitan's real namespaces with torchtitan's own schema strings (copied
verbatim below; ``test_deepep.py`` checks them against torchtitan's source), with CPU
kernels that behave as DeepEP does on one EP rank (every token is received once, combine
is the identity on the deduplicated rows), plus fake kernels so the ops can be traced.

Deviations from torchtitan, all forced by the missing packages, none in what the tag pass
sees (op names, inputs, outputs, autograd structure):

* the "buffer" is :class:`_OneRankBuffer`; its exchange is a copy (``clone``) so each
  backward exchange is a node of the joint graph, as the real one would be;
* torchtitan's ``deepep::`` ops have no fake kernel (they run under SAC, not a tracer)
  and their autograd looks the handle up with ``handle_id.item()``; here the fakes assume
  one rank (a real fake could not know ``combine``'s row count: it is in the handle) and
  the backward needs no handle;
* HybridEP's opaque ``DispatchHandle`` (a ``CustomClassBase``) is a CPU int64 tensor
  here, as DeepEP's ``handle_id`` is; torchtitan's schema strings are kept otherwise.

The call pattern (``dispatch_tokens`` / ``combine_tokens``) is torchtitan's, shortened to
the training path (``cudagraphable=False``, HybridEP blocking).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxoverlap.ops import grouped_mm

# torchtitan/distributed/deepep/deepep.py, _lib.define(...) verbatim.
DEEPEP_SCHEMAS = {
    "dispatch": (
        "dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, "
        "int num_experts, int num_tokens_per_rank, bool cudagraphable) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "combine": "combine(Tensor x, Tensor handle_id, bool will_backward) -> Tensor",
}
# torchtitan/distributed/deepep/hybridep.py, the schemas torch.library.custom_op infers from
# its signatures, with ``DispatchHandle`` as ``Tensor`` (see the module docstring).
HYBRIDEP_SCHEMAS = {
    "dispatch": (
        "dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int ep_size, "
        "str group_name, bool non_blocking=False, float? moe_expert_capacity_factor=None, "
        "int? pad_multiple=None) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "combine": "combine(Tensor x, Tensor handle, int num_tokens, int? pad_multiple=None) -> Tensor",
    "dispatch_bwd": (
        "dispatch_bwd(Tensor grad_combined, Tensor handle, int num_permuted_tokens, "
        "int? pad_multiple=None) -> Tensor"
    ),
    "combine_bwd": (
        "combine_bwd(Tensor grad_hidden, Tensor grad_scores, Tensor handle, int num_tokens, "
        "int num_experts) -> (Tensor, Tensor)"
    ),
}


class _OneRankBuffer:
    """What DeepEP's buffer does with one rank: every exchange is a copy."""

    @staticmethod
    def exchange(x: torch.Tensor) -> torch.Tensor:
        return x.clone()


_LIBS: list[torch.library.Library] = []


def _has(ns: str, op: str) -> bool:
    return hasattr(getattr(torch.ops, ns), op)


# ----------------------------------------------------------------------------- deepep::


def _register_deepep() -> None:
    if _has("deepep", "dispatch"):
        return
    lib = torch.library.Library("deepep", "DEF")
    _LIBS.append(lib)
    for schema in DEEPEP_SCHEMAS.values():
        lib.define(schema)

    def dispatch_cpu(x, topk_idx, topk_weights, num_experts, num_tokens_per_rank, cudagraphable):
        assert not cudagraphable, "the mirror has the training (compact) path only"
        counts = torch.bincount(topk_idx[topk_idx >= 0].flatten(), minlength=num_experts).to(torch.int32)
        return (_OneRankBuffer.exchange(x), topk_idx.clone(), topk_weights.clone(), counts,
                torch.zeros(1, dtype=torch.int64))

    def dispatch_fake(x, topk_idx, topk_weights, num_experts, num_tokens_per_rank, cudagraphable):
        return (x.new_empty(x.shape), topk_idx.new_empty(topk_idx.shape), topk_weights.new_empty(topk_weights.shape),
                x.new_empty(num_experts, dtype=torch.int32, device="cpu"),
                x.new_empty(1, dtype=torch.int64, device="cpu"))

    def combine_cpu(x, handle_id, will_backward):
        return _OneRankBuffer.exchange(x)

    def combine_fake(x, handle_id, will_backward):
        return x.new_empty(x.shape)

    lib.impl("dispatch", dispatch_cpu, "CPU")
    lib.impl("combine", combine_cpu, "CPU")
    torch.library.register_fake("deepep::dispatch", dispatch_fake, lib=lib)
    torch.library.register_fake("deepep::combine", combine_fake, lib=lib)

    def dispatch_setup(ctx, inputs, output):
        ctx.input_dtype = inputs[0].dtype

    def dispatch_backward(ctx, grad_x, grad_idx, grad_scores, grad_num, grad_handle):
        # torchtitan: buffer.combine(grad_recv_x, handle=..., topk_weights=grad_recv_scores)
        grad_w = _OneRankBuffer.exchange(grad_scores) if grad_scores is not None else None
        return _OneRankBuffer.exchange(grad_x).to(ctx.input_dtype), None, grad_w, None, None, None

    def combine_backward(ctx, grad):
        # torchtitan: buffer.dispatch(grad_combined, handle=handle, ...)
        return _OneRankBuffer.exchange(grad), None, None

    torch.library.register_autograd("deepep::dispatch", dispatch_backward, setup_context=dispatch_setup, lib=lib)
    torch.library.register_autograd("deepep::combine", combine_backward, setup_context=lambda ctx, inputs, output: None,
                                    lib=lib)


@dataclass
class DeepEPState:
    handle_id: torch.Tensor
    num_recv_tokens: int
    permuted_indices: torch.Tensor
    permuted_scores: torch.Tensor


def _permute_tokens(hidden_states, dispatched_indices, dispatched_scores):
    """torchtitan's deepep._permute_tokens, verbatim."""
    mask = dispatched_indices != -1
    valid_expert_ids = dispatched_indices[mask]
    valid_scores = dispatched_scores[mask]
    sort_order = torch.argsort(valid_expert_ids, stable=True)
    permuted_indices = torch.arange(
        len(hidden_states), device=hidden_states.device
    ).repeat_interleave(mask.sum(dim=1))[sort_order]
    permuted_hidden_states = hidden_states.index_select(0, permuted_indices)
    permuted_scores = valid_scores[sort_order]
    return permuted_hidden_states, permuted_scores, permuted_indices


def _unpermute_tokens(permuted_hidden_states, permuted_indices, num_tokens):
    """torchtitan's deepep._unpermute_tokens, verbatim."""
    hidden_dim = permuted_hidden_states.shape[1]
    out = torch.zeros((num_tokens, hidden_dim), dtype=permuted_hidden_states.dtype,
                      device=permuted_hidden_states.device)
    out.scatter_add_(0, permuted_indices.unsqueeze(1).expand(-1, hidden_dim), permuted_hidden_states)
    return out


def deepep_dispatch_tokens(hidden_states, selected_experts_indices, top_scores, num_experts):
    """torchtitan's deepep.dispatch_tokens, training path (``cudagraphable=False``)."""
    selected_experts_indices = selected_experts_indices.contiguous()
    top_scores = top_scores.contiguous()
    selected_experts_indices = selected_experts_indices.masked_fill(top_scores == 0, -1)
    if top_scores.dtype != torch.float32:
        top_scores = top_scores.float()
    recv_x, recv_topk_idx, recv_scores, num_recv_per_expert, handle_id = torch.ops.deepep.dispatch(
        hidden_states, selected_experts_indices, top_scores,
        num_experts=num_experts, num_tokens_per_rank=hidden_states.shape[0], cudagraphable=False,
    )
    num_tokens_per_expert = num_recv_per_expert.to(recv_x.device)
    routed_input, permuted_scores, permuted_indices = _permute_tokens(recv_x, recv_topk_idx, recv_scores)
    state = DeepEPState(handle_id, recv_x.shape[0], permuted_indices, permuted_scores)
    return routed_input, num_tokens_per_expert, state


def deepep_combine_tokens(hidden_states, state: DeepEPState):
    """torchtitan's deepep.combine_tokens, training path."""
    will_backward = torch.is_grad_enabled()
    hidden_states = hidden_states * state.permuted_scores.to(hidden_states.dtype).reshape(-1, 1)
    hidden_states = _unpermute_tokens(hidden_states, state.permuted_indices, state.num_recv_tokens)
    return torch.ops.deepep.combine(hidden_states, state.handle_id, will_backward)


# ----------------------------------------------------------------------------- hybridep::


def _register_hybridep() -> None:
    if _has("hybridep", "dispatch"):
        return
    lib = torch.library.Library("hybridep", "DEF")
    _LIBS.append(lib)
    for schema in HYBRIDEP_SCHEMAS.values():
        lib.define(schema)

    def _permute(x, topk_idx, topk_weights, num_experts):
        # dispatch_with_permute on one rank: rows expert-major, one per (token, pick).
        flat = topk_idx.flatten()
        order = torch.argsort(flat, stable=True)
        rows = torch.arange(x.shape[0]).repeat_interleave(topk_idx.shape[1])[order]
        return rows, topk_weights.flatten()[order].float(), torch.bincount(flat, minlength=num_experts)

    def dispatch_cpu(x, topk_idx, topk_weights, num_experts, ep_size, group_name, non_blocking=False,
                     moe_expert_capacity_factor=None, pad_multiple=None):
        assert ep_size == 1 and not non_blocking and pad_multiple is None
        rows, scores, tpe = _permute(x, topk_idx, topk_weights, num_experts)
        handle = torch.cat([rows, topk_idx.flatten()[torch.argsort(topk_idx.flatten(), stable=True)]])
        return _OneRankBuffer.exchange(x[rows]), scores, tpe, handle

    def dispatch_fake(x, topk_idx, topk_weights, num_experts, ep_size, group_name, non_blocking=False,
                      moe_expert_capacity_factor=None, pad_multiple=None):
        n = topk_idx.numel()  # one rank, top-k picks of distinct experts: every pick is a row
        return (x.new_empty(n, x.shape[1]), x.new_empty(n, dtype=torch.float32),
                x.new_empty(num_experts // ep_size, dtype=torch.int64), x.new_empty(2 * n, dtype=torch.int64))

    def _unpermute(x, handle, num_tokens):
        rows = handle[: handle.numel() // 2]
        out = x.new_zeros(num_tokens, x.shape[1])
        return out.index_add(0, rows, x)

    def combine_cpu(x, handle, num_tokens, pad_multiple=None):
        return _OneRankBuffer.exchange(_unpermute(x, handle, num_tokens))

    def combine_fake(x, handle, num_tokens, pad_multiple=None):
        return x.new_empty(num_tokens, x.shape[1])

    def dispatch_bwd_cpu(grad_combined, handle, num_permuted_tokens, pad_multiple=None):
        rows = handle[: handle.numel() // 2]
        return _OneRankBuffer.exchange(grad_combined[rows])

    def dispatch_bwd_fake(grad_combined, handle, num_permuted_tokens, pad_multiple=None):
        return grad_combined.new_empty(num_permuted_tokens, grad_combined.shape[1])

    def combine_bwd_cpu(grad_hidden, grad_scores, handle, num_tokens, num_experts):
        grad_x = _OneRankBuffer.exchange(_unpermute(grad_hidden, handle, num_tokens))
        if grad_scores.numel() == 0:
            return grad_x, grad_hidden.new_empty(0, dtype=torch.float32)
        n = handle.numel() // 2
        rows, experts = handle[:n], handle[n:]
        dense = grad_hidden.new_zeros(num_tokens, num_experts, dtype=torch.float32)
        return grad_x, dense.index_put((rows, experts), grad_scores.float(), accumulate=True)

    def combine_bwd_fake(grad_hidden, grad_scores, handle, num_tokens, num_experts):
        grad_x = grad_hidden.new_empty(num_tokens, grad_hidden.shape[1])
        if grad_scores.numel() > 0:
            return grad_x, grad_hidden.new_empty(num_tokens, num_experts, dtype=torch.float32)
        return grad_x, grad_hidden.new_empty(0, dtype=torch.float32)

    for name, cpu, fake in (("dispatch", dispatch_cpu, dispatch_fake), ("combine", combine_cpu, combine_fake),
                            ("dispatch_bwd", dispatch_bwd_cpu, dispatch_bwd_fake),
                            ("combine_bwd", combine_bwd_cpu, combine_bwd_fake)):
        lib.impl(name, cpu, "CPU")
        torch.library.register_fake(f"hybridep::{name}", fake, lib=lib)

    # torchtitan's hybridep autograd, verbatim but for the handle type.
    def dispatch_backward(ctx, grad_hidden, grad_scores, grad_tpe, grad_handle):
        if grad_hidden is None:
            return None, None, None, None, None, None, None, None, None
        (topk_idx,) = ctx.saved_tensors
        num_tokens = topk_idx.shape[0]
        grad_x, grad_probs_dense = torch.ops.hybridep.combine_bwd(
            grad_hidden, grad_scores, ctx.dispatch_handle, num_tokens, ctx.num_experts)
        grad_x = grad_x.to(ctx.input_dtype)
        grad_weights = grad_probs_dense.gather(dim=1, index=topk_idx) if grad_probs_dense.numel() > 0 else None
        return grad_x, None, grad_weights, None, None, None, None, None, None

    def dispatch_setup(ctx, inputs, output):
        x, topk_idx, _, num_experts, _, _, _, _, _ = inputs
        ctx.dispatch_handle = output[3]
        ctx.input_dtype = x.dtype
        ctx.num_experts = num_experts
        ctx.save_for_backward(topk_idx)

    def combine_backward(ctx, grad_combined):
        grad_x = torch.ops.hybridep.dispatch_bwd(grad_combined, ctx.dispatch_handle, ctx.num_permuted_tokens,
                                                 ctx.pad_multiple)
        return grad_x, None, None, None

    def combine_setup(ctx, inputs, output):
        x, dispatch_handle, _num_tokens, pad_multiple = inputs
        ctx.dispatch_handle = dispatch_handle
        ctx.num_permuted_tokens = x.shape[0]
        ctx.pad_multiple = pad_multiple

    torch.library.register_autograd("hybridep::dispatch", dispatch_backward, setup_context=dispatch_setup, lib=lib)
    torch.library.register_autograd("hybridep::combine", combine_backward, setup_context=combine_setup, lib=lib)


@dataclass
class HybridEPState:
    handle: torch.Tensor
    permuted_scores: torch.Tensor | None = None
    num_tokens: int = 0


def hybridep_dispatch_tokens(hidden_states, selected_experts_indices, top_scores, num_experts, group_name="0"):
    """torchtitan's hybridep.dispatch_tokens, blocking mode, one rank."""
    selected_experts_indices = selected_experts_indices.contiguous()
    top_scores = top_scores.contiguous()
    hidden, permuted_scores, tokens_per_expert, dispatch_handle = torch.ops.hybridep.dispatch(
        hidden_states, selected_experts_indices, top_scores, num_experts, 1, group_name, False, None, None)
    if permuted_scores is not None and permuted_scores.dtype != hidden.dtype:
        permuted_scores = permuted_scores.to(hidden.dtype)
    state = HybridEPState(dispatch_handle, permuted_scores, hidden_states.shape[0])
    return hidden, tokens_per_expert, state


def hybridep_combine_tokens(hidden_states, state: HybridEPState, pad_multiple=None):
    """torchtitan's hybridep.combine_tokens."""
    if state.permuted_scores is not None:
        hidden_states = hidden_states * state.permuted_scores.reshape(-1, 1)
    return torch.ops.hybridep.combine(hidden_states, state.handle, state.num_tokens, pad_multiple)


def register() -> None:
    _register_deepep()
    _register_hybridep()


# ----------------------------------------------------------------------------- a tiny MoE model


class EPMoE(nn.Module):
    """Top-k router, experts as a grouped matmul over the dispatched rows (torchtitan's
    GroupedExperts, with ``fxoverlap.ops.grouped_mm``: ``torch._grouped_mm`` traces fp32 only on CUDA), a shared expert; dispatch/combine as torchtitan's DeepEP or HybridEP
    token dispatcher calls them."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, backend: str):
        super().__init__()
        self.n_experts, self.top_k, self.backend = n_experts, top_k, backend
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) * 0.1)
        self.shared = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        x_TD = x.reshape(-1, d)
        scores, ids = torch.topk(self.router(x_TD).softmax(-1), self.top_k, dim=-1)
        if self.backend == "deepep":
            routed, counts, state = deepep_dispatch_tokens(x_TD, ids, scores, self.n_experts)
        else:
            routed, counts, state = hybridep_dispatch_tokens(x_TD, ids, scores, self.n_experts)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(grouped_mm(routed, self.w1, offs))
        out = grouped_mm(h, self.w2, offs)
        if self.backend == "deepep":
            combined = deepep_combine_tokens(out, state)
        else:
            combined = hybridep_combine_tokens(out, state)
        return (combined + self.shared(x_TD)).view(b, s, d)


class Block(nn.Module):
    def __init__(self, dim: int, backend: str):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.moe = EPMoE(dim, 2 * dim, 4, 2, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.ffn_norm(x))


class EPTransformer(nn.Module):
    def __init__(self, backend: str, vocab: int = 32, dim: int = 16, n_layers: int = 2):
        super().__init__()
        register()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, backend) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.output(self.norm(h)).flatten(0, 1), labels.flatten())
