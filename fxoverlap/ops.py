"""fxoverlap's custom ops: EP ``dispatch`` / ``combine`` (a token once per selected
expert), ``token_dispatch`` / ``token_combine`` (a token once per destination rank,
with its routing) and the expert grouped GEMM.

They are ``torch.library.custom_op``s with fake kernels and autograd, so the
capture pass sees each as one node and the backward of a dispatch is one comm op
too. Dropless routing gives the dispatch output a data-dependent row count: its
fake kernel returns an unbacked size, so one capture serves every routing outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from fxoverlap import fp8_ops
from fxoverlap.kernels import a2a, dedup, grouped_gemm
from fxoverlap.ir.errors import FxOverlapError


class DispatchRowsError(FxOverlapError, RuntimeError):
    """``fxoverlap::dispatch`` received a different number of rows than its caller promised (``out_rows``)."""

# ---------------------------------------------------------------- dispatch / combine


@torch.library.custom_op("fxoverlap::dispatch", mutates_args=())
def _dispatch(
    x: torch.Tensor,
    send_counts: torch.Tensor,
    group_name: str,
    recv_counts: torch.Tensor | None,
    out_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, recv = a2a.dispatch_tokens(x, send_counts, a2a.resolve_group(group_name), recv_counts)
    if out_rows >= 0 and y.shape[0] != out_rows:
        raise DispatchRowsError(
            f"fxoverlap::dispatch received {y.shape[0]} rows but the caller promised "
            f"{out_rows} (capacity routing must send the same number of rows to every expert)"
        )
    return y, recv


@_dispatch.register_fake
def _(x, send_counts, group_name, recv_counts, out_rows):
    ep = a2a.world_size(a2a.resolve_group(group_name))
    rows = out_rows if out_rows >= 0 else torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(rows, x.shape[1]), send_counts.new_empty(ep, send_counts.shape[0] // ep)


def _dispatch_setup(ctx, inputs, output):
    x, send_counts, group_name, _, _ = inputs
    ctx.save_for_backward(send_counts, output[1])
    ctx.group_name = group_name
    ctx.x_rows = x.shape[0]


def _dispatch_backward(ctx, grad_y, _grad_recv):
    send_counts, recv_counts = ctx.saved_tensors
    grad_x = _combine(grad_y, recv_counts, send_counts, ctx.group_name, ctx.x_rows)
    return grad_x, None, None, None, None


_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


@torch.library.custom_op("fxoverlap::combine", mutates_args=())
def _combine(
    y: torch.Tensor,
    recv_counts: torch.Tensor,
    send_counts: torch.Tensor,
    group_name: str,
    out_rows: int,
) -> torch.Tensor:
    return a2a.combine_tokens(y, recv_counts, send_counts, a2a.resolve_group(group_name))


@_combine.register_fake
def _(y, recv_counts, send_counts, group_name, out_rows):
    return y.new_empty(out_rows, y.shape[1])


def _combine_setup(ctx, inputs, output):
    y, recv_counts, send_counts, group_name, _ = inputs
    ctx.save_for_backward(recv_counts, send_counts)
    ctx.group_name = group_name
    ctx.y_rows = y.shape[0]


def _combine_backward(ctx, grad_x):
    recv_counts, send_counts = ctx.saved_tensors
    grad_y, _ = _dispatch(grad_x, send_counts, ctx.group_name, recv_counts, ctx.y_rows)
    return grad_y, None, None, None, None


_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


def dispatch(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    static_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send rows of ``x`` (sorted by global expert) to the ranks that own their experts.

    Returns ``(y, recv_counts)``: ``y`` grouped by local expert, ``recv_counts[ep, El]``
    the rows from each source rank for each local expert. ``static_rows=True``
    promises that every rank sends the same number of rows to every expert
    (capacity routing), so ``y`` has as many rows as ``x`` and shapes stay static.
    """
    out_rows = x.shape[0] if static_rows else -1
    return _dispatch(x, tokens_per_expert, a2a.group_name_of(group), None, out_rows)


def combine(
    y: torch.Tensor,
    recv_counts: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    group: dist.ProcessGroup | None,
    out_rows: int,
) -> torch.Tensor:
    """Inverse of :func:`dispatch`: return expert outputs to the ranks that sent the tokens."""
    return _combine(y, recv_counts, tokens_per_expert, a2a.group_name_of(group), out_rows)


# ---------------------------------------------------------------- chunks along local experts
# The chunk pass (``passes/chunk.py``) writes these into the captured joint graph: no autograd
# (they never meet a tracer), each a comm op the program runs on the comm stream.


@torch.library.custom_op("fxoverlap::dispatch_chunk", mutates_args=())
def _dispatch_chunk(
    x: torch.Tensor,
    send_counts: torch.Tensor,
    group_name: str,
    recv_counts: torch.Tensor | None,
    out_rows: int,
    chunk: int,
    chunks: int,
    first: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dispatch`` of chunk ``chunk`` of ``chunks``: ``x`` has every row; only the chunk's travel.
    ``first``: the first chunk's receive counts (its host counts are reused; None for it)."""
    y, recv, _ = a2a.dispatch_chunk(x, send_counts, a2a.resolve_group(group_name), recv_counts, chunk, chunks,
                                    first)
    return y, recv


@_dispatch_chunk.register_fake
def _(x, send_counts, group_name, recv_counts, out_rows, chunk, chunks, first):
    ep = a2a.world_size(a2a.resolve_group(group_name))
    rows = out_rows if not isinstance(out_rows, int) or out_rows >= 0 else torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(rows, x.shape[1]), send_counts.new_empty(ep, send_counts.shape[0] // ep)


@torch.library.custom_op("fxoverlap::combine_chunk", mutates_args=())
def _combine_chunk(
    y: torch.Tensor, recv_counts: torch.Tensor, send_counts: torch.Tensor, group_name: str, chunk: int, chunks: int
) -> torch.Tensor:
    """``combine`` of one chunk: the chunk's rows back, in the order ``dispatch_chunk`` took them."""
    return a2a.combine_chunk(y, recv_counts, send_counts, a2a.resolve_group(group_name), chunk, chunks)


@_combine_chunk.register_fake
def _(y, recv_counts, send_counts, group_name, chunk, chunks):
    return y.new_empty(torch.library.get_ctx().new_dynamic_size(), y.shape[1])


@torch.library.custom_op("fxoverlap::merge_chunks", mutates_args=())
def _merge_chunks(parts: list[torch.Tensor], send_counts: torch.Tensor, ep: int, out_rows: int,
                  first: torch.Tensor) -> torch.Tensor:
    """The chunks' rows back in the sender's order (``first``: the first chunk's receive counts)."""
    return a2a.merge_chunks(list(parts), send_counts, ep, out_rows, first)


@_merge_chunks.register_fake
def _(parts, send_counts, ep, out_rows, first):
    return parts[0].new_empty(out_rows, parts[0].shape[1])


# ---------------------------------------------------------------- token-once dispatch / combine


@torch.library.custom_op("fxoverlap::token_dispatch", mutates_args=())
def _token_dispatch(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, n_experts: int, group_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return dedup.dispatch(x, idx, w, n_experts, a2a.resolve_group(group_name))


@_token_dispatch.register_fake
def _(x, idx, w, n_experts, group_name):
    ep = a2a.world_size(a2a.resolve_group(group_name))
    pairs = torch.library.get_ctx().new_dynamic_size()
    return (
        x.new_empty(pairs, x.shape[1]), w.new_empty(pairs), idx.new_empty(ep, n_experts // ep),
        idx.new_empty(pairs), idx.new_empty(idx.shape[0], ep), idx.new_empty(ep),
    )


def _token_dispatch_setup(ctx, inputs, output):
    _, idx, _, n_experts, group_name = inputs
    ctx.save_for_backward(idx, output[3], output[4], output[5])
    ctx.n_experts, ctx.group_name = n_experts, group_name


def _token_dispatch_backward(ctx, grad_x, grad_w, *_):
    idx, pair_index, slot, recv_rows = ctx.saved_tensors
    gx, gw = _token_dispatch_backward_op(grad_x, grad_w, idx, pair_index, slot, recv_rows, ctx.n_experts, ctx.group_name)
    return gx, None, gw, None, None


_token_dispatch.register_autograd(_token_dispatch_backward, setup_context=_token_dispatch_setup)


@torch.library.custom_op("fxoverlap::token_dispatch_backward", mutates_args=())
def _token_dispatch_backward_op(
    grad_x: torch.Tensor, grad_w: torch.Tensor, idx: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor,
    recv_rows: torch.Tensor, n_experts: int, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return dedup.dispatch_backward(
        grad_x, grad_w, idx, pair_index, slot, recv_rows, n_experts, a2a.resolve_group(group_name))


@_token_dispatch_backward_op.register_fake
def _(grad_x, grad_w, idx, pair_index, slot, recv_rows, n_experts, group_name):
    return grad_x.new_empty(idx.shape[0], grad_x.shape[1]), grad_w.new_empty(idx.shape)


@torch.library.custom_op("fxoverlap::token_combine", mutates_args=())
def _token_combine(
    y: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor, recv_rows: torch.Tensor, top_k: int, group_name: str
) -> torch.Tensor:
    return dedup.combine(y, pair_index, slot, recv_rows, top_k, a2a.resolve_group(group_name))


@_token_combine.register_fake
def _(y, pair_index, slot, recv_rows, top_k, group_name):
    return y.new_empty(slot.shape[0], y.shape[1])


def _token_combine_setup(ctx, inputs, output):
    _, pair_index, slot, recv_rows, top_k, group_name = inputs
    ctx.save_for_backward(pair_index, slot, recv_rows)
    ctx.top_k, ctx.group_name = top_k, group_name


def _token_combine_backward(ctx, grad_out):
    pair_index, slot, recv_rows = ctx.saved_tensors
    grad_y = _token_combine_backward_op(grad_out, pair_index, slot, recv_rows, ctx.top_k, ctx.group_name)
    return grad_y, None, None, None, None, None


_token_combine.register_autograd(_token_combine_backward, setup_context=_token_combine_setup)


@torch.library.custom_op("fxoverlap::token_combine_backward", mutates_args=())
def _token_combine_backward_op(
    grad_out: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor, recv_rows: torch.Tensor, top_k: int,
    group_name: str,
) -> torch.Tensor:
    return dedup.combine_backward(grad_out, pair_index, slot, recv_rows, top_k, a2a.resolve_group(group_name))


@_token_combine_backward_op.register_fake
def _(grad_out, pair_index, slot, recv_rows, top_k, group_name):
    return grad_out.new_empty(pair_index.shape[0], grad_out.shape[1])


class TokenDispatch(NamedTuple):
    """What :func:`token_dispatch` returns; :func:`token_combine` takes it back."""

    x: torch.Tensor  # [P, D] one row per (received token, local expert), grouped by local expert
    weights: torch.Tensor  # [P] the routing weight of each pair
    recv_pairs: torch.Tensor  # [ep, El] pairs from each source rank per local expert
    pair_index: torch.Tensor  # [P] the pair's top-k slot (received row * k + j)
    slot: torch.Tensor  # [T, ep] send row of (token, rank), -1 where none
    recv_rows: torch.Tensor  # [ep] rows (tokens) from each source rank
    top_k: int

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """Group sizes of ``x`` for a grouped GEMM."""
        return self.recv_pairs.sum(0)


def token_dispatch(
    x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, n_experts: int, group: dist.ProcessGroup | None
) -> TokenDispatch:
    """Send each token once to every rank owning one of its experts (``idx[T, k]``: global ids).

    The DeepEP-style alternative to :func:`dispatch`: one copy per rank instead of
    one per expert, with the routing alongside; the receiver gets one row per
    (token, local expert) pair, grouped by expert. See ``fxoverlap.kernels.dedup``.
    """
    return TokenDispatch(*_token_dispatch(x, idx, weights, n_experts, a2a.group_name_of(group)), idx.shape[1])


def token_combine(y: torch.Tensor, sent: TokenDispatch, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Inverse of :func:`token_dispatch`: ``out[t] = sum of y over t's pairs on every rank``, ``[T, D]``."""
    return _token_combine(y, sent.pair_index, sent.slot, sent.recv_rows, sent.top_k, a2a.group_name_of(group))


# ---------------------------------------------------------------- grouped GEMM


@torch.library.custom_op("fxoverlap::grouped_mm", mutates_args=())
def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return grouped_gemm.grouped_mm(x, w, offs)


@_grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("fxoverlap::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return grouped_gemm.grouped_mm_wgrad(x, dy, offs)


@_grouped_mm_wgrad.register_fake
def _(x, dy, offs):
    return x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])


grouped_gemm.register_split_backward(_grouped_mm, _grouped_mm_wgrad)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ w[g]`` for each group; ``offs``: int32 cumulative row ends. Under
    ``fp8_ops.expert_math("fp8_rowwise")`` (``OverlapConfig.expert_dtype``) the FP8 rowwise op."""
    if fp8_ops.current().dtype == "fp8_rowwise":
        return fp8_ops.grouped_mm_fp8(x, w, offs)
    return _grouped_mm(x, w, offs)


# ---------------------------------------------------------------- expert row groups padded


class PaddedGroups(NamedTuple):
    """What :func:`pad_groups` returns; :func:`unpad_groups` takes it back."""

    x: torch.Tensor  # [R + G * (align - 1), D]: group g's rows from a multiple of align, zeros elsewhere
    tokens_per_expert: torch.Tensor  # [G] each group's rows rounded up to align (cumsum: aligned offsets)
    index: torch.Tensor  # [R] the padded row of each real row
    source: torch.Tensor  # [R + G * (align - 1)] the real row of each padded row (R: a padding row)


def pad_groups(x: torch.Tensor, tokens_per_expert: torch.Tensor, align: int, tail: bool = False) -> PaddedGroups:
    """Rows of ``x`` (grouped by expert, ``tokens_per_expert[G]`` rows each) laid out so that each
    group starts at a multiple of ``align`` rows. No host read: the padded row count is the bound
    ``R + G * (align - 1)`` (the rows past the last group are zeros no group reads), and the rows
    move by one scatter each way (a copy: the values are exact; each one's gradient a gather).
    ``tail``: ``x`` may have rows past its groups (a capacity dispatcher's, e.g. torchtitan's
    HybridEP); they keep their order after the padded groups. Without it the groups must fill
    ``x`` (what ``passes/chunk`` recognises)."""
    rows, groups = x.shape[0], tokens_per_expert.shape[0]
    counts = tokens_per_expert.to(torch.int64)
    padded = (counts + align - 1) // align * align
    start = torch.cumsum(counts, 0) - counts
    padded_start = torch.cumsum(padded, 0) - padded
    shift, repeats, labels = padded_start - start, counts, torch.arange(groups, device=x.device)
    if tail:  # one more group: the rows past the groups, moved as far as the padding moved the end
        shift = torch.cat([shift, (padded.sum() - counts.sum()).reshape(1)])
        repeats = torch.cat([counts, (rows - counts.sum()).reshape(1)])
        labels = torch.arange(groups + 1, device=x.device)
    group = torch.repeat_interleave(labels, repeats, output_size=rows)
    real = torch.arange(rows, device=x.device)
    index = real + shift.index_select(0, group)
    source = real.new_full((rows + groups * (align - 1),), rows).index_copy(0, index, real)
    out = x.new_zeros(rows + groups * (align - 1), *x.shape[1:]).index_copy(0, index, x)
    return PaddedGroups(out, padded.to(tokens_per_expert.dtype), index, source)


def unpad_groups(y: torch.Tensor, padded: PaddedGroups) -> torch.Tensor:
    """The real rows of ``y`` (laid out as ``padded.x``), in the order :func:`pad_groups` took them.
    A scatter of every padded row (the padding ones onto one extra row, dropped), not the gather
    ``y[index]``: its gradient is then the gather ``grad[source]``, where the gather's would be a
    scatter-add (``index_add``: atomics, 0.6 ms for the Qwen3 layer's rows in bf16 on an H100,
    2026-12-05). Both directions' gradients are gathers."""
    rows = padded.index.shape[0]
    return y.new_zeros(rows + 1, *y.shape[1:]).index_copy(0, padded.source, y)[:rows]


def group_of_rows(tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows]``: the group (local expert) of each row of an experts input. Inside
    :func:`expert_rows` with padding the groups end before the rows do: a row past them gets
    ``G`` (no group: no GEMM reads or writes it, so its values are unspecified; see :func:`bias_rows`)."""
    local = torch.arange(tokens_per_expert.shape[0], device=tokens_per_expert.device)
    if fp8_ops.current().row_align == 1:  # the rows are exactly the groups' (output_size: no host read)
        return torch.repeat_interleave(local, tokens_per_expert, output_size=rows)
    ends = torch.cumsum(tokens_per_expert, 0)
    return torch.searchsorted(ends, torch.arange(rows, device=ends.device, dtype=ends.dtype), right=True)


def bias_rows(b: torch.Tensor, row_group: torch.Tensor) -> torch.Tensor:
    """``b[row_group]`` in fp32 (``b[G, N]``: one bias per expert; ``row_group`` from
    :func:`group_of_rows`). With padding, rows of no group get a zero row whose gradient is
    dropped: the grouped GEMMs leave those rows unspecified, and the bias gradient (a sum over
    each group's rows) must not read them."""
    if fp8_ops.current().row_align == 1:
        return b.float().index_select(0, row_group)
    return torch.cat([b.float(), b.new_zeros(1, *b.shape[1:], dtype=torch.float32)]).index_select(0, row_group)


def expert_rows(experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                tokens_per_expert: torch.Tensor, row_align: int | None = None, tail: bool = False) -> torch.Tensor:
    """``experts(x, tokens_per_expert)``, with each expert's rows padded to ``row_align`` (default:
    the active ``fp8_ops.expert_math``'s, 16 under FP8) and the padding dropped from the result.
    With an alignment of 1 it is the plain call (the graph is unchanged). ``tail``: as
    :func:`pad_groups`'s."""
    align = fp8_ops.current().row_align if row_align is None else row_align
    if align == 1:
        return experts(x, tokens_per_expert)
    p = pad_groups(x, tokens_per_expert, align, tail)
    return unpad_groups(experts(p.x, p.tokens_per_expert), p)


DISPATCH_OP = torch.ops.fxoverlap.dispatch.default
COMBINE_OP = torch.ops.fxoverlap.combine.default
DISPATCH_CHUNK_OP = torch.ops.fxoverlap.dispatch_chunk.default
COMBINE_CHUNK_OP = torch.ops.fxoverlap.combine_chunk.default
MERGE_CHUNKS_OP = torch.ops.fxoverlap.merge_chunks.default
GROUPED_MM_WGRAD_OP = torch.ops.fxoverlap.grouped_mm_wgrad.default
