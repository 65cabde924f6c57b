"""Sync-free EP dispatch and combine with static shapes: a fixed row capacity per link.

The generic ops (``a2a.py``, ``dedup.py``) size every buffer by the routing outcome, so
each dispatch reads its split sizes on the host. Here every rank-to-rank link carries at
most ``C`` rows (``capacity``), every buffer has a size known at capture time, and all
index maps are computed on the device from the exchanged counts: no host read at all.

How rows travel is a *transport* (``padded.py``: one equal-split ``all_to_all_single``;
``symm_mem.py``: direct writes of the real rows into the peers' symmetric memory), with
one contract: ``transport(parts, group, C)`` takes ``(src, sel)`` pairs, ``sel[p * C + j]``
the row of ``src`` that goes to rank ``p`` as its ``j``-th row from us (-1: nothing), and
returns for each part the *landing* buffer ``[ep * C, ...]``, where row ``s * C + j`` is
the ``j``-th row rank ``s`` sent us (unspecified where ``s`` sent fewer).

Layouts (``ep`` ranks, ``El`` local experts, ``R_max = ep * C``):

* Per-expert (``dispatch``/``combine``): the sender's ``N`` rows are sorted by global
  expert (as for ``a2a.py``); the ``j``-th row for rank ``p`` is ``start[p] + j``. The
  receiver gathers its landing rows into ``y[R_max, D]`` grouped by local expert (expert
  major, source rank minor, exactly the generic order) with the real rows first; rows
  past them are zero. ``recv_counts[ep, El]`` are the rows that arrived, so
  ``recv_counts.sum(0)`` are the grouped GEMM's group sizes and its offsets end at the
  real rows (``torch._grouped_mm`` spends no FLOPs on the padding).
* Token-once (``token_*``): ``slot[T, ep] = r * C + j`` for the ``j``-th token sent to
  rank ``r`` (-1: none). The receiver's pairs are its valid (landing row, top-k slot)
  pairs ordered by local expert (stable, so in the generic order), padded to
  ``P_max = R_max * min(k, El)``; ``pair_index`` is -1 past the real pairs.

Rows past a link's capacity are dropped (never written out of bounds); the dispatch
records the busiest link's row count in ``overflow[site]`` so the caller can raise.
All maps are gathers (no atomics), so results equal the generic ops' bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from fxoverlap.kernels.a2a import exchanged, world_size
from fxoverlap.kernels.dedup import _sum_per_token, weight_grads
from fxoverlap.kernels.row_sum import sum_at

# transport(parts: [(src, sel)], group, capacity) -> landing buffers, one per part
Transport = Callable[[Sequence[tuple[torch.Tensor, torch.Tensor]], dist.ProcessGroup | None, int], list[torch.Tensor]]


def masked_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]`` along dim 0, with zero rows where ``index < 0``."""
    if src.shape[0] == 0:
        return src.new_zeros(index.shape[0], *src.shape[1:])
    rows = src.index_select(0, index.clamp_min(0))
    return torch.where((index >= 0).view(-1, *[1] * (src.dim() - 1)), rows, 0)


def _record_overflow(overflow: torch.Tensor, site: int, needed: torch.Tensor) -> None:
    # A running max over the step's microbatches, on the device (no host read).
    flag = overflow.narrow(0, site, 1)
    torch.maximum(flag, needed.view(1).to(flag.dtype), out=flag)


def _arange(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(n, device=like.device)


def _carry(transport: Transport, parts: Sequence[tuple[torch.Tensor, torch.Tensor]], group, capacity: int, op: str,
           rows: int | None = None, tokens: tuple[int, int] | None = None) -> list[torch.Tensor]:
    """``transport(parts, group, capacity)`` for the rows of exchange ``op``, then the chokepoint of
    the static transports (``padded`` and ``symm_mem`` alike): a stand-in group hears of the real
    rows (``rows`` sent, or ``tokens = (T, top_k)``), as the generic ops report them; the padded
    transport's padding is not counted (``a2a.exchanged``)."""
    landing = transport(parts, group, capacity)
    exchanged(group, op, [src for src, _ in parts], rows, tokens)
    return landing


def _exchange(msg: torch.Tensor, group, transport: Transport) -> torch.Tensor:
    """Row ``p`` of ``msg [ep, W]`` goes to rank ``p``; returns what each rank sent us."""
    return transport([(msg, _arange(msg.shape[0], msg))], group, 1)[0].clone()


def _landing_rows(rows_from: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[ep * C]``: each landing slot's own index where a row arrived, else -1."""
    ep = rows_from.shape[0]
    j = _arange(capacity, rows_from)
    idx = _arange(ep * capacity, rows_from).view(ep, capacity)
    return torch.where(j < rows_from.clamp(max=capacity)[:, None], idx, -1).flatten()


# ---------------------------------------------------------------- per-expert layout


def _sender(send_counts: torch.Tensor, ep: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows per destination rank, and where each rank's rows start among ours."""
    per_link = send_counts.view(ep, -1).sum(1)
    return per_link, per_link.cumsum(0) - per_link


def _row_of_send_slot(per_link: torch.Tensor, start: torch.Tensor, capacity: int) -> torch.Tensor:
    j = _arange(capacity, per_link)
    kept = per_link.clamp(max=capacity)
    return torch.where(j < kept[:, None], start[:, None] + j, -1).flatten()


def _send_slot_of_row(per_link: torch.Tensor, start: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
    ep = per_link.shape[0]
    i = _arange(rows, per_link)
    p = torch.searchsorted(per_link.cumsum(0), i, right=True)  # destination rank of row i
    pc = p.clamp(max=ep - 1)
    j = i - start[pc]
    return torch.where((p < ep) & (j < capacity), pc * capacity + j, -1)


def _receiver(recv_counts: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per source rank and local expert: rows up to this expert that fit, rows that arrived."""
    got = recv_counts.cumsum(1).clamp(max=capacity)
    return got, torch.diff(got, dim=1, prepend=torch.zeros_like(got[:, :1]))


def _block_starts(arrived: torch.Tensor) -> torch.Tensor:
    """``[ep, El]``: first output row of block (expert e, source s), expert-major."""
    sizes = arrived.t().flatten()
    return (sizes.cumsum(0) - sizes).view(arrived.shape[1], arrived.shape[0]).t()


def _landing_slot_of_row(got: torch.Tensor, arrived: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[R_max]``: the landing slot of each expert-major output row, -1 past the real rows."""
    ep, el = arrived.shape
    starts = _block_starts(arrived).t().flatten()  # block (e, s) at e * ep + s
    first = (_arange(ep, got)[:, None] * capacity + got - arrived).t().flatten()  # its landing slot
    q = _arange(ep * capacity, got)
    b = torch.searchsorted(starts + arrived.t().flatten(), q, right=True)
    bc = b.clamp(max=ep * el - 1)
    return torch.where(b < ep * el, first[bc] + q - starts[bc], -1)


def _row_of_landing_slot(got: torch.Tensor, arrived: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[ep * C]``: the expert-major row of each landing slot, -1 where nothing arrived."""
    ep, el = arrived.shape
    j = _arange(capacity, got).expand(ep, capacity).contiguous()
    e = torch.searchsorted(got, j, right=True)  # local expert of slot (s, j)
    ec = e.clamp(max=el - 1)
    q = _block_starts(arrived).gather(1, ec) + j - (got - arrived).gather(1, ec)
    return torch.where(e < el, q, -1).flatten()


def dispatch(
    x: torch.Tensor, send_counts: torch.Tensor, group, recv_counts: torch.Tensor | None, capacity: int,
    transport: Transport, overflow: torch.Tensor | None = None, site: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [ep * C, D], recv_counts [ep, El])``; ``recv_counts`` given: the backward's reuse."""
    ep = world_size(group)
    if recv_counts is None:
        recv_counts = _exchange(send_counts.view(ep, -1), group, transport)
    per_link, start = _sender(send_counts, ep, capacity)
    if overflow is not None:
        _record_overflow(overflow, site, torch.maximum(per_link.max(), recv_counts.sum(1).max()))
    (landing,) = _carry(transport, [(x, _row_of_send_slot(per_link, start, capacity))], group, capacity, "dispatch",
                        x.shape[0])
    got, arrived = _receiver(recv_counts, capacity)
    return masked_rows(landing, _landing_slot_of_row(got, arrived, capacity)), arrived


def combine(
    y: torch.Tensor, recv_counts: torch.Tensor, send_counts: torch.Tensor, group, out_rows: int, capacity: int,
    transport: Transport,
) -> torch.Tensor:
    """Inverse of :func:`dispatch`: ``[out_rows, D]``, rows back in the sender's order."""
    got, arrived = _receiver(recv_counts, capacity)
    (landing,) = _carry(transport, [(y, _row_of_landing_slot(got, arrived, capacity))], group, capacity, "combine",
                        out_rows)
    per_link, start = _sender(send_counts, world_size(group), capacity)
    return masked_rows(landing, _send_slot_of_row(per_link, start, out_rows, capacity))


# ---------------------------------------------------------------- token-once layout


def _token_of_send_slot(slot: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[ep * C]``: the token of each outgoing slot (slots are handed out in token order)."""
    cum = (slot >= 0).long().cumsum(0).t().contiguous()  # [ep, T]
    j = _arange(capacity, slot).expand(cum.shape[0], capacity).contiguous()
    tok = torch.searchsorted(cum, j, right=True)
    return torch.where(j < cum[:, -1:], tok, -1).flatten()


def _pair_positions(pair_index: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """``[rows, k]``: the pair of each landing top-k slot, ``P`` where it has none."""
    n = pair_index.numel()
    dump = rows * k  # padding pairs (-1) all land here; it is cut off
    where = torch.where(pair_index >= 0, pair_index, dump)
    pos = torch.full((dump + 1,), n, dtype=torch.long, device=pair_index.device)
    return pos.scatter_(0, where, _arange(n, pair_index))[:dump].view(rows, k)


def _row_of_pair(pair_index: torch.Tensor, k: int) -> torch.Tensor:
    return torch.where(pair_index >= 0, pair_index // k, -1)


def token_dispatch(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, n_experts: int, group, capacity: int,
    transport: Transport, overflow: torch.Tensor | None = None, site: int = 0,
) -> tuple[torch.Tensor, ...]:
    """``(pairs_x, pairs_w, recv_pairs, pair_index, slot, recv_rows)`` as ``dedup.dispatch``, static shapes."""
    ep = world_size(group)
    el, (t, k) = n_experts // ep, idx.shape
    ranks = _arange(ep, idx)
    owner = idx // el
    hit = torch.zeros(t, ep, dtype=torch.bool, device=idx.device).scatter_(1, owner, True)
    pos = hit.long().cumsum(0) - 1
    send_rows = hit.sum(0)
    slot = torch.where(hit & (pos < capacity), ranks * capacity + pos, -1)
    pairs = torch.zeros(n_experts, dtype=torch.long, device=idx.device).scatter_add_(
        0, idx.flatten(), torch.ones(idx.numel(), dtype=torch.long, device=idx.device))
    recv_msg = _exchange(torch.cat([send_rows.unsqueeze(1), pairs.view(ep, el)], 1), group, transport)
    if overflow is not None:
        _record_overflow(overflow, site, torch.maximum(send_rows.max(), recv_msg[:, 0].max()))

    # Each (token, rank) entry carries the token's local expert ids there (el: not there) and weights.
    mine = owner.unsqueeze(1) == ranks.view(1, ep, 1)  # [T, ep, k]
    ids = torch.where(mine, (idx % el).unsqueeze(1), el).to(torch.int32).view(t * ep, k)
    ws = torch.where(mine, w.unsqueeze(1), 0).view(t * ep, k)
    token = _token_of_send_slot(slot, capacity)
    entry = torch.where(token >= 0, token * ep + _arange(ep * capacity, idx) // capacity, -1)
    land_x, land_ids, land_w = _carry(transport, [(x, token), (ids, entry), (ws, entry)], group, capacity,
                                      "token_dispatch", tokens=(t, k))

    recv_rows = recv_msg[:, 0].clamp(max=capacity)
    rows = _landing_rows(recv_rows, capacity)
    ids = torch.where((rows >= 0).unsqueeze(1), land_ids, el).flatten()
    p_max = ep * capacity * min(k, el)
    order = torch.argsort(ids, stable=True)[:p_max]
    pair_index = torch.where(_arange(p_max, idx) < (ids < el).sum(), order, -1)
    # pairs that arrived, per source rank and local expert (the slot el counts the rest)
    src = _arange(ep * capacity * k, idx) // (capacity * k)
    recv_pairs = torch.zeros(ep * (el + 1), dtype=torch.long, device=idx.device).scatter_add_(
        0, src * (el + 1) + ids, torch.ones_like(src)).view(ep, el + 1)[:, :el]
    pairs_x = masked_rows(land_x, _row_of_pair(pair_index, k))
    return pairs_x, masked_rows(land_w.flatten(), pair_index), recv_pairs, pair_index, slot, recv_rows


def token_dispatch_backward(
    grad_x: torch.Tensor, grad_w: torch.Tensor, idx: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor,
    recv_rows: torch.Tensor, n_experts: int, group, capacity: int, transport: Transport,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`token_dispatch` for ``x`` and ``w``, as ``dedup.dispatch_backward``."""
    rows, k = recv_rows.shape[0] * capacity, idx.shape[1]
    pos = _pair_positions(pair_index, rows, k)
    row_gx = sum_at(grad_x, pos)
    row_gw = masked_rows(grad_w, torch.where(pos < grad_w.shape[0], pos, -1).flatten()).view(rows, k)
    sel = _landing_rows(recv_rows, capacity)
    back_x, back_w = _carry(transport, [(row_gx, sel), (row_gw, sel)], group, capacity, "token_dispatch_backward",
                            tokens=(idx.shape[0], k))
    return _sum_per_token(back_x, slot), weight_grads(back_w, slot, idx, n_experts // slot.shape[1])


def token_combine(
    y: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor, recv_rows: torch.Tensor, k: int, group,
    capacity: int, transport: Transport,
) -> torch.Tensor:
    """``out[t]`` = sum of ``y`` over t's pairs on every rank, ``[T, D]``, as ``dedup.combine``."""
    rows = sum_at(y, _pair_positions(pair_index, recv_rows.shape[0] * capacity, k))
    (back,) = _carry(transport, [(rows, _landing_rows(recv_rows, capacity))], group, capacity, "token_combine",
                     tokens=(slot.shape[0], k))
    return _sum_per_token(back, slot)


def token_combine_backward(
    grad_out: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor, recv_rows: torch.Tensor, k: int, group,
    capacity: int, transport: Transport,
) -> torch.Tensor:
    """Gradient of :func:`token_combine`: each token's gradient to every pair it was sent to."""
    (landing,) = _carry(transport, [(grad_out, _token_of_send_slot(slot, capacity))], group, capacity,
                        "token_combine_backward", tokens=(slot.shape[0], k))
    return masked_rows(landing, _row_of_pair(pair_index, k))
