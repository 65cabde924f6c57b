"""Token-once all-to-all: each token goes to each destination rank once, not once per expert.

The per-expert dispatcher (``a2a.py``) sends a token once for every expert it picked;
with top-8 of 32 experts on 2 ranks that is ~4 copies to the remote rank. Here a
token travels once to every rank that owns at least one of its experts, together with
its routing for that rank (local expert ids and weights, one packed all-to-all). The
receiver expands its rows into (row, expert) pairs grouped by local expert, ready for
a grouped GEMM; the combine sums each row's (weighted) pair outputs, sends one row
back per (token, rank), and the sender sums a token's rows over ranks. DeepEP and
HybridEP do the same in custom kernels; this is plain ``all_to_all_single``, so it
runs on NCCL and gloo.

Layout:

* ``slot[T, ep]``: the row of (token t, rank r) in the sender's buffer, -1 if t sends
  nothing to r. Rows are rank-major, tokens in order within a rank.
* The receiver's ``R`` rows are source-rank-major; ``pair_index[P]`` lists its valid
  top-k slots ``row * k + j``, ordered by local expert (stable: source rank, then
  token), so pair ``p`` is row ``pair_index[p] // k``. ``recv_pairs[ep, El]``: pairs
  from each source rank per local expert; ``recv_pairs.sum(0)`` are the group sizes.

One host sync per dispatch (the exchanged counts); the combine and both backward
all-to-alls reuse the host split lists, cached on the ``recv_rows`` tensor. A row's
pair outputs are summed in slot order with an fp32 accumulator (``row_sum.py``), so
the combine is deterministic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxoverlap.kernels.a2a import ExpertSplitError, _recall, _remember, exchanged, one_rank, world_size
from fxoverlap.kernels.row_sum import sum_per_row


def _all_to_all(out_rows: list[int], parts: list[torch.Tensor], in_rows: list[int], group, op: str | None = None,
                tokens: tuple[int, int] | None = None) -> list[torch.Tensor]:
    """One all-to-all for several ``[rows, cols]`` tensors (any dtypes), packed as bytes: the
    token-once transport. On one rank the parts are copied, and then a stand-in group hears of
    the exchange ``op`` of ``tokens = (T, top_k)`` tokens (``a2a.exchanged``). The counts
    exchanges pass no ``op``: an op pays the link once, for its rows."""
    if one_rank(group):
        out = [p.clone() for p in parts]
        if op is not None:
            exchanged(group, op, out, tokens=tokens)
        return out
    widths = [p.shape[1] * p.element_size() for p in parts]
    packed = torch.cat([p.contiguous().view(torch.uint8) for p in parts], 1) if len(parts) > 1 else (
        parts[0].contiguous().view(torch.uint8))
    out = packed.new_empty(sum(out_rows), packed.shape[1])
    dist.all_to_all_single(out, packed, out_rows, in_rows, group=group)
    if len(parts) == 1:
        return [out.view(parts[0].dtype)]
    return [c.contiguous().view(p.dtype) for c, p in zip(torch.split(out, widths, 1), parts)]


def _rows_of_slots(slot: torch.Tensor, rows: int) -> torch.Tensor:
    """The token of each of the ``rows`` send rows (inverse of ``slot``)."""
    t, ep = slot.shape
    where = torch.where(slot >= 0, slot, rows).flatten()
    tokens = torch.arange(t, device=slot.device).repeat_interleave(ep)
    # Unused (t, r) pairs all land on the spare row ``rows``, which is dropped.
    return torch.zeros(rows + 1, dtype=torch.long, device=slot.device).scatter_(0, where, tokens)[:rows]


def _host_splits(slot: torch.Tensor, recv_rows: torch.Tensor) -> tuple[list[int], list[int]]:
    cached = _recall(recv_rows)
    if cached is not None:
        return cached
    ep = slot.shape[1]
    host = torch.cat([(slot >= 0).sum(0), recv_rows]).tolist()
    splits = (host[:ep], host[ep:])
    _remember(recv_rows, splits)
    return splits


def _sum_per_token(back: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum over ranks r of back[slot[t, r]]`` (0 where slot is -1), in rank order."""
    padded = torch.cat([back, back.new_zeros(1, *back.shape[1:])])
    return padded[torch.where(slot >= 0, slot, back.shape[0])].sum(1)


def dispatch(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, n_experts: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, ...]:
    """Returns ``(pairs_x [P, D], pairs_w [P], recv_pairs [ep, El], pair_index [P], slot, recv_rows)``."""
    ep = world_size(group)
    if n_experts % ep:
        raise ExpertSplitError(
            f"fxoverlap token_dispatch: {n_experts} experts cannot be split over an expert-parallel "
            f"group of {ep} ranks; make the expert count a multiple of the group size"
        )
    el = n_experts // ep
    t, k = idx.shape
    dev = idx.device
    hit = torch.zeros(t, ep, dtype=torch.bool, device=dev).scatter_(1, idx // el, True)
    send_rows = hit.sum(0)
    slot = torch.where(hit, hit.long().cumsum(0) - 1 + (send_rows.cumsum(0) - send_rows), -1)
    # pairs per global expert (scatter_add, not bincount: bincount syncs with the host on CUDA)
    pairs = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(
        0, idx.flatten(), torch.ones(idx.numel(), dtype=torch.long, device=dev))
    msg = torch.cat([send_rows.unsqueeze(1), pairs.view(ep, el)], 1)  # row r: what rank r gets from us
    (recv_msg,) = _all_to_all([1] * ep, [msg], [1] * ep, group)
    recv_rows, recv_pairs = recv_msg[:, 0].clone(), recv_msg[:, 1:].clone()  # outputs must not alias
    # The one host sync: split sizes and the received pair count.
    host = torch.cat([send_rows, recv_rows, recv_pairs.sum().view(1)]).tolist()
    send_list, recv_list, n_pairs = host[:ep], host[ep : 2 * ep], host[-1]
    _remember(recv_rows, (send_list, recv_list))

    rows = sum(send_list)
    token = _rows_of_slots(slot, rows)
    rank_of_row = torch.arange(ep, device=dev).repeat_interleave(send_rows, output_size=rows)
    idx_rows = idx.index_select(0, token)
    mine = idx_rows // el == rank_of_row.unsqueeze(1)
    send_ids = torch.where(mine, idx_rows % el, el).to(torch.int32)
    send_w = torch.where(mine, w.index_select(0, token), 0)
    recv_x, recv_ids, recv_w = _all_to_all(recv_list, [x.index_select(0, token), send_ids, send_w], send_list, group,
                                           "token_dispatch", (t, k))
    pair_index = torch.argsort(recv_ids.flatten(), stable=True)[:n_pairs]
    pairs_x = recv_x.index_select(0, pair_index // k)
    pairs_w = recv_w.flatten().index_select(0, pair_index)
    return pairs_x, pairs_w, recv_pairs, pair_index, slot, recv_rows


def dispatch_backward(
    grad_x: torch.Tensor, grad_w: torch.Tensor, idx: torch.Tensor, pair_index: torch.Tensor,
    slot: torch.Tensor, recv_rows: torch.Tensor, n_experts: int, group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``dispatch`` for ``x`` (summed over pairs and ranks) and ``w`` (from the owning rank)."""
    send_list, recv_list = _host_splits(slot, recv_rows)
    rows, k = sum(recv_list), idx.shape[1]
    row_gx = sum_per_row(grad_x, pair_index, rows, k)
    row_gw = grad_w.new_zeros(rows * k).index_copy_(0, pair_index, grad_w).view(rows, k)
    back_x, back_w = _all_to_all(send_list, [row_gx, row_gw], recv_list, group, "token_dispatch_backward",
                                 (idx.shape[0], k))
    return _sum_per_token(back_x, slot), weight_grads(back_w, slot, idx, n_experts // slot.shape[1])


def weight_grads(back_w: torch.Tensor, slot: torch.Tensor, idx: torch.Tensor, el: int) -> torch.Tensor:
    """``[T, k]``: each pick's weight gradient, from the row its expert's rank sent back."""
    padded = torch.cat([back_w, back_w.new_zeros(1, back_w.shape[1])])
    row_of_pick = torch.where(slot >= 0, slot, back_w.shape[0]).gather(1, idx // el)  # [T, k]
    return padded[row_of_pick, torch.arange(idx.shape[1], device=idx.device)]


def combine(y: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor, recv_rows: torch.Tensor, k: int,
            group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum each received row's pair outputs, send the rows home, sum a token's rows over ranks."""
    send_list, recv_list = _host_splits(slot, recv_rows)
    rows = sum_per_row(y, pair_index, sum(recv_list), k)
    (back,) = _all_to_all(send_list, [rows], recv_list, group, "token_combine", (slot.shape[0], k))
    return _sum_per_token(back, slot)


def combine_backward(grad_out: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor,
                     recv_rows: torch.Tensor, k: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Gradient of ``combine``: each token's gradient goes to every pair it was sent to."""
    send_list, recv_list = _host_splits(slot, recv_rows)
    token = _rows_of_slots(slot, sum(send_list))
    (rows,) = _all_to_all(recv_list, [grad_out.index_select(0, token)], send_list, group, "token_combine_backward",
                          (slot.shape[0], k))
    return rows.index_select(0, pair_index // k)
