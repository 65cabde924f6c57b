"""Token-once all-to-all: each token goes to each destination rank once, not once per expert.

The per-expert dispatcher (``a2a.py``) sends a token once for every expert it picked;
with top-8 of 32 experts on 2 ranks that is ~4 copies to the remote rank. Here a
token travels once to every rank that owns at least one of its experts, together with
its routing for that rank (local expert ids, weights); the receiver expands rows into
(row, expert) pairs for the grouped GEMM and reduces the weighted expert outputs back
to one row per token before the combine. DeepEP and HybridEP do the same in custom
kernels; this is plain ``all_to_all_single`` so it runs on NCCL and gloo.

Layout:

* ``slot[T, ep]``: the row of (token t, rank r) in the sender's buffer, -1 if t sends
  nothing to r. Rows are rank-major, tokens in order within a rank.
* The receiver's rows are source-rank-major. ``recv_ids[R, k]`` holds each row's local
  expert per top-k slot (``El`` where that slot's expert lives on another rank) and
  ``recv_w[R, k]`` its weight (0 there). ``pair_index[P]`` lists the valid slots
  ``row * k + j`` ordered by local expert (stable: source rank, then token), so
  ``recv_x[pair_index // k]`` is the grouped GEMM input and ``recv_pairs[ep, El]``
  (rows from each source for each local expert) gives its group sizes.

One host sync per dispatch (the exchanged counts); the combine and both backward
all-to-alls reuse the host split lists, cached on the ``recv_rows`` tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxoverlap.kernels.a2a import _recall, _remember, world_size


def _all_to_all(out_rows: list[int], x: torch.Tensor, in_rows: list[int], group) -> torch.Tensor:
    if group is None:
        return x.clone()
    out = x.new_empty(sum(out_rows), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group)
    return out


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


def _gather_per_token(back: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum over ranks r of back[slot[t, r]]`` (0 where slot is -1), in rank order."""
    rows = back.shape[0]
    padded = torch.cat([back, back.new_zeros(1, *back.shape[1:])])
    return padded[torch.where(slot >= 0, slot, rows)].sum(1)


def dispatch(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, n_experts: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, ...]:
    """Returns ``(recv_x, recv_w, pair_index, recv_pairs, slot, recv_rows)`` (see the module doc)."""
    ep = world_size(group)
    if n_experts % ep:
        raise ValueError(
            f"fxoverlap token_dispatch: {n_experts} experts cannot be split over an expert-parallel "
            f"group of {ep} ranks; make the expert count a multiple of the group size"
        )
    el = n_experts // ep
    t, k = idx.shape
    dest = idx // el
    hit = torch.zeros(t, ep, dtype=torch.bool, device=idx.device).scatter_(1, dest, True)
    send_rows = hit.sum(0)
    base = send_rows.cumsum(0) - send_rows
    slot = torch.where(hit, hit.long().cumsum(0) - 1 + base, -1)
    pairs = torch.bincount(idx.flatten(), minlength=n_experts).view(ep, el)
    msg = torch.cat([send_rows.unsqueeze(1), pairs], 1)  # row r: what rank r will receive from us
    recv_msg = _all_to_all([1] * ep, msg, [1] * ep, group)
    recv_rows, recv_pairs = recv_msg[:, 0].clone(), recv_msg[:, 1:].clone()  # outputs must not alias
    # The one host sync: split sizes and the received pair count.
    host = torch.cat([send_rows, recv_rows, recv_pairs.sum().view(1)]).tolist()
    send_list, recv_list, n_pairs = host[:ep], host[ep : 2 * ep], host[-1]
    _remember(recv_rows, (send_list, recv_list))

    rows = sum(send_list)
    token = _rows_of_slots(slot, rows)
    rank_of_row = torch.arange(ep, device=idx.device).repeat_interleave(send_rows, output_size=rows)
    idx_rows = idx.index_select(0, token)
    mine = idx_rows // el == rank_of_row.unsqueeze(1)
    send_ids = torch.where(mine, idx_rows % el, el)
    send_w = torch.where(mine, w.index_select(0, token), 0)

    recv_x = _all_to_all(recv_list, x.index_select(0, token), send_list, group)
    recv_ids = _all_to_all(recv_list, send_ids, send_list, group)
    recv_w = _all_to_all(recv_list, send_w, send_list, group)
    pair_index = torch.argsort(recv_ids.flatten(), stable=True)[:n_pairs]
    return recv_x, recv_w, pair_index, recv_pairs, slot, recv_rows


def dispatch_backward(
    grad_x: torch.Tensor, grad_w: torch.Tensor, idx: torch.Tensor, slot: torch.Tensor,
    recv_rows: torch.Tensor, n_experts: int, group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``dispatch`` for ``x`` (summed over ranks) and ``w`` (from the owning rank)."""
    send_list, recv_list = _host_splits(slot, recv_rows)
    back_x = _all_to_all(send_list, grad_x, recv_list, group)
    back_w = _all_to_all(send_list, grad_w, recv_list, group)
    el = n_experts // slot.shape[1]
    rows = back_w.shape[0]
    padded = torch.cat([back_w, back_w.new_zeros(1, back_w.shape[1])])
    row_of_pick = torch.where(slot >= 0, slot, rows).gather(1, idx // el)  # [T, k]
    return _gather_per_token(back_x, slot), padded[row_of_pick, torch.arange(idx.shape[1], device=idx.device)]


def combine(y: torch.Tensor, slot: torch.Tensor, recv_rows: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send each received row's reduced expert output home; sum a token's rows over ranks."""
    send_list, recv_list = _host_splits(slot, recv_rows)
    return _gather_per_token(_all_to_all(send_list, y, recv_list, group), slot)


def combine_backward(grad_out: torch.Tensor, slot: torch.Tensor, recv_rows: torch.Tensor,
                     group: dist.ProcessGroup | None) -> torch.Tensor:
    """Gradient of ``combine``: each token's gradient goes to every rank it was sent to."""
    send_list, recv_list = _host_splits(slot, recv_rows)
    token = _rows_of_slots(slot, sum(send_list))
    return _all_to_all(recv_list, grad_out.index_select(0, token), send_list, group)
