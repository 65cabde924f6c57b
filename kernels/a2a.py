"""Expert-parallel token all-to-all over ``torch.distributed.all_to_all_single``.

Layout contract (the ``fxoverlap::dispatch`` / ``fxoverlap::combine`` ops rely on it):

* The sender's tokens are sorted by *global* expert id; ``send_counts[E]`` counts
  them per global expert. Rank ``r`` owns experts ``[r * El, (r + 1) * El)``.
* The receiver gets its tokens grouped by *local* expert (expert-major, source
  rank minor), and ``recv_counts[ep, El]``: rows from source ``s`` for local
  expert ``e``. ``recv_counts.sum(0)`` are the group sizes for a grouped GEMM.

The same code runs on gloo and NCCL; one rank (``group=None``) needs no process
group at all.

This module also holds the group stand-ins (:class:`GroupStandIn`): a process group of one
rank that stands in for a larger one, registered by name so that the comm ops reach it
through their ``group_name`` argument as they reach a real group. Each transport (the
``all_to_all`` here, the token-once ``dedup._all_to_all``, the static ``padded`` and
``symm_mem`` ones through ``static_ep._carry``) tells it, right after its local copy, what
an exchange over the larger group would have carried (:func:`exchanged`); the emulated
interconnect (``kernels/emulated_link.py``) is one. The comm ops themselves know nothing
of it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.kernels.copy_labels import CHUNK_ROWS, ONE_RANK_EXCHANGE, copy_label


class ExpertSplitError(FxOverlapError, ValueError):
    """The experts cannot be split evenly over the expert-parallel group."""


class GroupStandInError(FxOverlapError, ValueError):
    """A group stand-in's name is taken (by another stand-in of this process)."""

# Host copies of the split sizes, keyed by the recv_counts tensor object they were
# computed for. A dispatch pays one device-to-host sync for its counts; the combine
# of the same tokens and both backward all-to-alls reuse the lists instead of
# syncing again. Entries die with their tensor (so an id is never reused while
# cached), and the version counter guards against in-place edits. The token-once
# dispatcher (dedup.py) caches its own split lists here the same way.
_host_splits: dict[int, tuple[int, tuple[list[int], ...]]] = {}


# A chunk's rows in the sender's buffer (``dispatch_chunk``), keyed like ``_host_splits`` by the
# chunk's recv_counts, so the backward exchange selects the same rows without a host read; and
# the host counts of one exchange, keyed by its send counts, shared by all its chunks.
_chunk_ranges: dict[int, tuple[int, list[tuple[int, int]]]] = {}
_chunk_plans: dict[int, tuple[int, tuple]] = {}


def _remember(counts: torch.Tensor, splits, store: dict = _host_splits) -> None:
    key = id(counts)
    store[key] = (counts._version, splits)
    weakref.finalize(counts, store.pop, key, None)


def _recall(counts: torch.Tensor, store: dict = _host_splits):
    hit = store.get(id(counts))
    return hit[1] if hit is not None and hit[0] == counts._version else None


# ---------------------------------------------------------------- process groups and stand-ins

# The stand-ins of this process by name; an entry goes with its group (the compiled graphs only
# name it: the model or the engine that was given the group keeps it alive).
_standins: weakref.WeakValueDictionary[str, GroupStandIn] = weakref.WeakValueDictionary()


class GroupStandIn(dist.ProcessGroup):
    """A process group of one rank standing in for an exchange over more ranks.

    Compute sees one rank (``size() == 1``, so every transport takes its one-rank path and
    no collective runs over it); after each exchange's local copy the transport calls
    :meth:`exchanged` with the bytes the larger exchange would have moved. It is a
    ``ProcessGroup`` (of no backend) so that it passes wherever a group is taken
    (``MoETransformer(cfg, group)``, ``fxoverlap.optimize(model, group)``,
    ``dist.get_world_size(group)``), and it is registered under its ``group_name`` so that
    :func:`resolve_group` finds it from the name the comm ops carry. A subclass overrides
    :meth:`exchanged`, :meth:`token_rows` and :meth:`takes_sms`; this base holds nothing.
    """

    def __init__(self, name: str):
        super().__init__(0, 1)
        if name in _standins:
            raise GroupStandInError(f"group stand-in {name!r}: the name is taken by {_standins[name]!r}; "
                                    f"give each stand-in its own name")
        self._name = name
        _standins[name] = self

    @property
    def group_name(self) -> str:  # the name the comm ops carry (torch's own needs a backend)
        return self._name

    def __deepcopy__(self, memo: dict) -> GroupStandIn:
        return self  # a group is shared by the copies of a model, as a real one is

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name!r})"

    def abort(self) -> None:
        """Nothing to tear down (``Engine`` aborts the EP group when a stage fails)."""

    def exchanged(self, op: str, nbytes: int, device: torch.device) -> None:
        """An exchange ``op`` would have moved ``nbytes`` (all the rows this rank sends) on
        ``device``; called on the op's current stream, right after its local copy."""

    def token_rows(self, tokens: int, top_k: int) -> float:
        """Rows a token-once exchange of ``tokens`` tokens (``top_k`` experts each) moves:
        each token once per destination rank. One rank: each token once."""
        return float(tokens)

    def takes_sms(self) -> bool:
        """Whether its exchanges run a kernel beside the compute (the SM carveout asks)."""
        return False


def resolve_group(group_name: str) -> dist.ProcessGroup | None:
    """The group the comm ops name: None for ``""`` (one rank), a registered stand-in, or
    torch's process group of that name."""
    if not group_name:
        return None
    standin = _standins.get(group_name)
    if standin is not None:
        return standin
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def group_name_of(group: dist.ProcessGroup | None) -> str:
    return "" if group is None else group.group_name


def world_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def one_rank(group: dist.ProcessGroup | None) -> bool:
    """No peer to exchange with: no group, or a stand-in (a real group of one rank still
    runs its collectives)."""
    return group is None or isinstance(group, GroupStandIn)


def row_bytes(x: torch.Tensor) -> int:
    """Bytes of one row (dim 0) of ``x``."""
    return (math.prod(x.shape[1:]) if x.dim() else 1) * x.element_size()


def exchanged(group: dist.ProcessGroup | None, op: str, parts: Sequence[torch.Tensor], rows: int | None = None,
              tokens: tuple[int, int] | None = None) -> None:
    """The chokepoint every transport calls right after its local copy: a stand-in group
    hears what the exchange would have moved; any other group, nothing.

    ``parts``: the tensors whose rows travel side by side (a row's bytes are theirs together);
    ``rows``: how many rows this rank sends (the per-expert layout: all it has, the stand-in
    applies the share that would leave it), or ``tokens = (T, top_k)`` for the token-once
    layout, whose rows the stand-in knows (:meth:`GroupStandIn.token_rows`)."""
    if not isinstance(group, GroupStandIn):
        return
    n = rows if tokens is None else group.token_rows(*tokens)
    group.exchanged(op, int(round(n * sum(row_bytes(p) for p in parts))), parts[0].device)


def exchange_takes_sms(group: dist.ProcessGroup | None) -> bool:
    """Whether an exchange over ``group`` runs a comm kernel beside the compute here: a real
    group of more than one rank, or a stand-in whose exchanges do (the emulated link's hold)."""
    if isinstance(group, GroupStandIn):
        return group.takes_sms()
    return world_size(group) > 1


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
        with copy_label(ONE_RANK_EXCHANGE):
            return _one_rank(group, "dispatch", x.clone()), recv_counts.clone()
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
        with copy_label(ONE_RANK_EXCHANGE):
            return _one_rank(group, "combine", y.clone())
    el = recv_counts.shape[1]
    send_per_rank, recv_per_src, recv_flat = _split_counts(send_counts, recv_counts, ep, el)
    # expert-major -> source-major: chunk (e, s) has recv_counts[s, e] rows
    sizes_em = [recv_flat[s * el + e] for e in range(el) for s in range(ep)]
    src_major = torch.cat(_reorder_chunks(y, sizes_em, el, ep)) if y.shape[0] else y
    out = y.new_empty(sum(send_per_rank), y.shape[1])
    dist.all_to_all_single(out, src_major.contiguous(), send_per_rank, recv_per_src, group=group)
    return out


def _one_rank(group: dist.ProcessGroup | None, op: str, rows: torch.Tensor) -> torch.Tensor:
    """The ``all_to_all`` transport on one rank: ``rows``, the local copy, is what arrives (and
    all of what would have been sent); a stand-in group hears of it (:func:`exchanged`)."""
    exchanged(group, op, (rows,), rows.shape[0])
    return rows


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


# ---------------------------------------------------------------- chunks along local experts
#
# Chunk ``c`` of ``K`` holds the rows of the global experts whose *local* index lies in
# ``chunk_bounds(El, c, K)`` on every rank: each rank's share of a chunk is one contiguous run
# of the sender's expert-sorted rows, so selecting it is ``ep`` slices, and every expert's rows
# are in exactly one chunk (``docs/design.md``, "Chunks").


def chunk_bounds(local_experts: int, chunk: int, chunks: int) -> tuple[int, int]:
    """The local experts ``[lo, hi)`` of chunk ``chunk`` of ``chunks``."""
    return chunk * local_experts // chunks, (chunk + 1) * local_experts // chunks


def chunk_counts(send_counts: torch.Tensor, ep: int, chunk: int, chunks: int) -> torch.Tensor:
    """``send_counts`` with every expert outside the chunk set to 0."""
    lo, hi = chunk_bounds(send_counts.numel() // ep, chunk, chunks)
    masked = torch.zeros_like(send_counts).view(ep, -1)
    masked[:, lo:hi] = send_counts.view(ep, -1)[:, lo:hi]
    return masked.view(-1)


def _chunk_rows(host_counts: list[int], ep: int, chunk: int, chunks: int) -> list[tuple[int, int]]:
    """The sender's row runs ``(start, end)`` of the chunk, one per destination rank."""
    el = len(host_counts) // ep
    lo, hi = chunk_bounds(el, chunk, chunks)
    starts = [0]
    for c in host_counts:
        starts.append(starts[-1] + c)
    return [(starts[r * el + lo], starts[r * el + hi]) for r in range(ep)]


def _take_rows(x: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of ``runs``, packed: a new tensor (an op's output may not alias its input)."""
    with copy_label(CHUNK_ROWS):
        return torch.cat([x[a:b] for a, b in runs]) if len(runs) > 1 else x[runs[0][0]:runs[0][1]].clone()


def _chunk_plan(send_counts: torch.Tensor, group: dist.ProcessGroup | None, first: torch.Tensor | None
                ) -> tuple[list[int], torch.Tensor, list[int]]:
    """Every expert's send count on the host, the whole receive counts (device) and on the host:
    one counts exchange and one host read per exchange of a layer, made by its first chunk and
    found by the others through ``first``, the first chunk's receive counts. (Not keyed by
    ``send_counts``: a CUDA-graphed stage hands out the same tensor with new values for another
    microbatch; a comm stage's output is new on every call.)"""
    plan = _recall(first, _chunk_plans) if first is not None else None
    if plan is None:
        recv = exchange_counts(send_counts, group)
        host = torch.cat([send_counts, recv.flatten()]).tolist()
        plan = (host[:send_counts.numel()], recv, host[send_counts.numel():])
    return plan


def dispatch_chunk(
    x: torch.Tensor,
    send_counts: torch.Tensor,
    group: dist.ProcessGroup | None,
    recv_counts: torch.Tensor | None,
    chunk: int,
    chunks: int,
    first: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`dispatch_tokens` of one chunk: ``x`` holds every row (sorted by global expert);
    only the chunk's rows travel. Returns the chunk's rows grouped by local expert, its
    ``recv_counts`` (0 for experts outside the chunk), and how many rows it sent. The chunks
    of one exchange share one counts exchange and one host read, the first chunk's (``first``:
    its ``recv_counts``); with ``recv_counts`` given (the backward's exchange of the same
    chunk), the rows and split sizes are the ones remembered for it."""
    ep = world_size(group)
    runs = _recall(recv_counts, _chunk_ranges) if recv_counts is not None else None
    if runs is not None:
        recv_counts = recv_counts.clone()  # an op's output may not be its input (the backward ignores it)
    else:
        plan = _chunk_plan(send_counts, group, first)
        host_send, recv_full, host_recv = plan
        el = send_counts.numel() // ep
        lo, hi = chunk_bounds(el, chunk, chunks)
        runs = _chunk_rows(host_send, ep, chunk, chunks)
        rc = [n if lo <= i % el < hi else 0 for i, n in enumerate(host_recv)]
        splits = ([b - a for a, b in runs], [sum(rc[s * el:(s + 1) * el]) for s in range(ep)], rc)
        recv_counts = torch.zeros_like(recv_full)
        recv_counts[:, lo:hi] = recv_full[:, lo:hi]
        _remember(recv_counts, splits)
        _remember(recv_counts, runs, _chunk_ranges)
        if first is None:
            _remember(recv_counts, plan, _chunk_plans)
    x_c = _take_rows(x, runs)
    if ep == 1:  # nothing travels: the chunk's rows are already grouped by (local) expert
        return _one_rank(group, "dispatch", x_c), recv_counts, x_c.shape[0]
    y, _ = dispatch_tokens(x_c, chunk_counts(send_counts, ep, chunk, chunks), group, recv_counts)
    return y, recv_counts, x_c.shape[0]


def combine_chunk(y: torch.Tensor, recv_counts: torch.Tensor, send_counts: torch.Tensor,
                  group: dist.ProcessGroup | None, chunk: int, chunks: int) -> torch.Tensor:
    """:func:`combine_tokens` of one chunk: its rows back, in the order :func:`dispatch_chunk`
    took them (the split sizes are the ones it remembered for ``recv_counts``)."""
    ep = world_size(group)
    if ep == 1:
        with copy_label(ONE_RANK_EXCHANGE):
            return _one_rank(group, "combine", y.clone())
    return combine_tokens(y, recv_counts, chunk_counts(send_counts, ep, chunk, chunks), group)


def merge_chunks(parts: list[torch.Tensor], send_counts: torch.Tensor, ep: int, out_rows: int,
                 first: torch.Tensor | None = None) -> torch.Tensor:
    """The chunks' rows (each in its own send order, as :func:`dispatch_chunk` took them) back in
    the sender's order, ``[out_rows, D]``, each row copied once, by slices. The host counts are
    the exchange's (``first``: the first chunk's receive counts), read again only without them."""
    plan = _recall(first, _chunk_plans) if first is not None else None
    host_send = plan[0] if plan is not None else send_counts.tolist()
    out = parts[0].new_empty(out_rows, parts[0].shape[1])
    with copy_label(CHUNK_ROWS):
        for c, part in enumerate(parts):
            at = 0
            for a, b in _chunk_rows(host_send, ep, c, len(parts)):
                out[a:b].copy_(part[at:at + b - a])
                at += b - a
    return out
