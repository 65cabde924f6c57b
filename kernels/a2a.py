"""Expert-parallel token all-to-all over ``torch.distributed.all_to_all_single``.

Layout contract (the ``fxoverlap::dispatch`` / ``fxoverlap::combine`` ops rely on it):

* The sender's tokens are sorted by *global* expert id; ``send_counts[E]`` counts
  them per global expert. Rank ``r`` owns experts ``[r * El, (r + 1) * El)``.
* The receiver gets its tokens grouped by *local* expert (expert-major, source
  rank minor), and ``recv_counts[ep, El]``: rows from source ``s`` for local
  expert ``e``. ``recv_counts.sum(0)`` are the group sizes for a grouped GEMM.

The same code runs on gloo and NCCL; one rank (``group=None``) needs no process
group at all.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from fxoverlap.ir.errors import FxOverlapError


class ExpertSplitError(FxOverlapError, ValueError):
    """The experts cannot be split evenly over the expert-parallel group."""

# Host copies of the split sizes, keyed by the recv_counts tensor object they were
# computed for. A dispatch pays one device-to-host sync for its counts; the combine
# of the same tokens and both backward all-to-alls reuse the lists instead of
# syncing again. Entries die with their tensor (so an id is never reused while
# cached), and the version counter guards against in-place edits. The token-once
# dispatcher (dedup.py) caches its own split lists here the same way.
_host_splits: dict[int, tuple[int, tuple[list[int], ...]]] = {}


def _remember(counts: torch.Tensor, splits: tuple[list[int], ...]) -> None:
    key = id(counts)
    _host_splits[key] = (counts._version, splits)
    weakref.finalize(counts, _host_splits.pop, key, None)


def _recall(counts: torch.Tensor) -> tuple[list[int], ...] | None:
    hit = _host_splits.get(id(counts))
    return hit[1] if hit is not None and hit[0] == counts._version else None


def resolve_group(group_name: str) -> dist.ProcessGroup | None:
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def group_name_of(group: dist.ProcessGroup | None) -> str:
    return "" if group is None else group.group_name


def world_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``send_counts[E]`` (per global expert) -> ``recv_counts[ep, El]``."""
    ep = world_size(group)
    if send_counts.numel() % ep:
        raise ExpertSplitError(
            f"fxoverlap dispatch: {send_counts.numel()} experts cannot be split over an "
            f"expert-parallel group of {ep} ranks; make the expert count a multiple of "
            f"the group size"
        )
    if ep == 1:
        return send_counts.reshape(1, -1).clone()
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv.view(ep, -1)


def _reorder_chunks(x: torch.Tensor, sizes: list[int], rows: int, cols: int) -> list[torch.Tensor]:
    """``x`` holds ``rows * cols`` chunks in row-major order; return them column-major."""
    chunks = torch.split(x, sizes)
    return [chunks[r * cols + c] for c in range(cols) for r in range(rows)]


def dispatch_tokens(
    x: torch.Tensor,
    send_counts: torch.Tensor,
    group: dist.ProcessGroup | None,
    recv_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    ep = world_size(group)
    if recv_counts is None:
        recv_counts = exchange_counts(send_counts, group)
    if ep == 1:
        return x.clone(), recv_counts.clone()
    el = recv_counts.shape[1]
    splits = _split_counts(send_counts, recv_counts, ep, el)
    send_per_rank, recv_per_src, recv_flat = splits
    out = x.new_empty(sum(recv_per_src), x.shape[1])
    dist.all_to_all_single(out, x.contiguous(), recv_per_src, send_per_rank, group=group)
    # source-major -> expert-major
    y = torch.cat(_reorder_chunks(out, recv_flat, ep, el)) if out.shape[0] else out
    recv_out = recv_counts.clone()
    _remember(recv_out, splits)
    return y, recv_out


def combine_tokens(
    y: torch.Tensor,
    recv_counts: torch.Tensor,
    send_counts: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    ep = world_size(group)
    if ep == 1:
        return y.clone()
    el = recv_counts.shape[1]
    send_per_rank, recv_per_src, recv_flat = _split_counts(send_counts, recv_counts, ep, el)
    # expert-major -> source-major: chunk (e, s) has recv_counts[s, e] rows
    sizes_em = [recv_flat[s * el + e] for e in range(el) for s in range(ep)]
    src_major = torch.cat(_reorder_chunks(y, sizes_em, el, ep)) if y.shape[0] else y
    out = y.new_empty(sum(send_per_rank), y.shape[1])
    dist.all_to_all_single(out, src_major.contiguous(), send_per_rank, recv_per_src, group=group)
    return out


def _split_counts(
    send_counts: torch.Tensor, recv_counts: torch.Tensor, ep: int, el: int
) -> tuple[list[int], list[int], list[int]]:
    cached = _recall(recv_counts)
    if cached is not None:
        return cached
    # One device-to-host copy for all split lists: the only host sync.
    host = torch.cat(
        [send_counts.view(ep, el).sum(1), recv_counts.sum(1), recv_counts.flatten()]
    ).tolist()
    return host[:ep], host[ep : 2 * ep], host[2 * ep :]
