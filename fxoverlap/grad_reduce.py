"""Data parallelism around expert parallelism: the groups, and the runtime of the gradient
reductions that ``passes/reduce.py`` places in the program.

fxoverlap runs the backward itself and adds into ``p.grad`` from program nodes, so DDP's
and FSDP's autograd hooks never fire; the reductions are program nodes instead. After
``forward_backward`` a parameter's gradient is that of the mean loss over the DP ranks:

* dense parameter (replicated on every rank of ``dp_group``): the sum over ``dp_group``
  of the local gradients, divided by ``|dp_group|``;
* expert parameter (replicated on the ranks of ``expert_dp_group``, which hold the same
  EP index): the sum over ``expert_dp_group``, divided by ``|dp_group|`` too: an
  expert's local gradient already sums over the tokens of its whole EP group.

``grad_reduce="all_reduce"``: ``p.grad`` holds it on every rank (a view into its bucket's
flat buffer). ``"reduce_scatter"`` (ZeRO-2): ``p.grad`` is ``None`` afterwards and each
rank holds only the shard of each bucket it owns (layout: ``passes/reduce.py``), as the
``.grad`` of :meth:`GradReduction.shard_parameters`' views, which an optimizer steps;
:meth:`GradReduction.gather_parameters` then all-gathers the updated shards.

Accumulation over calls: a call reduces only its own gradients and adds the average into
what ``p.grad`` (ZeRO-2: the shard's ``.grad``) held before it, which is taken as already
reduced (a previous call's result) and is never reduced again (:meth:`BucketReducer.begin`).

Everything is ``torch.distributed``: ``all_reduce`` / ``reduce_scatter_single`` (``reduce_scatter_tensor``
before torch 2.13) with ``async_op=True`` on flat buffers, ``all_gather_single`` for the parameters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from fxoverlap.ir.capture import Capture
from fxoverlap.ir.bucket import Bucket
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.kernels.a2a import GroupStandIn


class GradReduceConfigError(FxOverlapError, ValueError):
    """The groups or parameters given for data parallelism (``optimize(..., dp_group=...,
    expert_dp_group=...)``, ``pipeline_schedule(..., dp_group=..., expert_dp_group=...)``,
    ``OverlapConfig.grad_reduce``) do not fit together; the message says how."""


class GradReduceError(FxOverlapError, RuntimeError):
    """The gradient reduction cannot go on as asked (no data parallelism, buckets that differ
    between signatures or ranks, shards asked for before capture); the message says why."""

# torch 2.13 names them reduce_scatter_single / all_gather_single (the old names warn);
# an older torch (the GPU machine has 2.11) may have only reduce_scatter_tensor / all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def emulated_dp(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is an emulated DP group: a group stand-in (``a2a.GroupStandIn``) that
    sizes the shards (``emulated_size``: M) and runs the collectives (``collective(op, nbytes,
    device, local) -> work``), as ``kernels.emulated_link.EmulatedDPGroup`` does. Production code
    never imports the emulated link (the group is injected, as the EP stand-in is)."""
    return isinstance(group, GroupStandIn) and callable(getattr(group, "collective", None))


def dp_collective(op: str, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup):
    """Issue the data-parallel collective ``op`` (``"all_reduce"`` of ``out`` in place,
    ``"reduce_scatter"`` of ``inp`` into ``out``, ``"all_gather"`` of ``inp`` into ``out``)
    asynchronously over ``group``; returns its work. The one place the DP collectives meet an
    emulated group (:class:`~fxoverlap.kernels.emulated_link.EmulatedDPGroup`, one rank of DP M
    on one device): there the group runs a local stand-in of the data (this rank is rank 0 of M
    and every virtual rank holds the same values: a sum of M equal copies, the local shard tiled
    M times) and holds a stream for the bytes a real one would move; any other group, torch's."""
    if emulated_dp(group):
        m = group.emulated_size
        if op == "all_reduce":
            return group.collective(op, 2 * out.numel() * out.element_size(), out.device, lambda: out.mul_(m), (out,))
        if op == "reduce_scatter":  # rank 0's block of the sum over M equal ranks
            return group.collective(op, inp.numel() * inp.element_size(), out.device,
                                    lambda: torch.mul(inp[:out.numel()], m, out=out), (out, inp))
        return group.collective(op, out.numel() * out.element_size(), out.device,
                                lambda: out.view(m, -1).copy_(inp.reshape(1, -1).expand(m, -1)), (out, inp))
    if op == "all_reduce":
        return dist.all_reduce(out, group=group, async_op=True)
    if op == "reduce_scatter":
        return reduce_scatter_single(out, inp, group=group, async_op=True)
    return all_gather_single(out, inp, group=group, async_op=True)

# ---------------------------------------------------------------- groups


@dataclasses.dataclass(frozen=True)
class ReduceGroups:
    """The two groups gradients reduce over, checked against each other and the EP group.
    With an emulated ``dp_group`` (:class:`~fxoverlap.kernels.emulated_link.EmulatedDPGroup`)
    the ranks are virtual: ``range(M)``, this rank being 0 (:attr:`emulated`)."""

    dp_group: dist.ProcessGroup
    expert_dp_group: dist.ProcessGroup | None  # None: no other rank holds this rank's experts
    dp_ranks: tuple[int, ...]
    expert_dp_ranks: tuple[int, ...]

    def of(self, role: str) -> tuple[dist.ProcessGroup | None, tuple[int, ...]]:
        """The group (None: this rank alone) and its global ranks for a bucket role."""
        if role == "expert":
            return self.expert_dp_group, self.expert_dp_ranks
        return self.dp_group, self.dp_ranks

    @property
    def dp_size(self) -> int:
        return len(self.dp_ranks)

    @property
    def emulated(self) -> bool:
        """Whether ``dp_group`` is an emulated group (one rank standing in for DP M)."""
        return emulated_dp(self.dp_group)


def _ranks(group: dist.ProcessGroup, name: str, caller: str = "fxoverlap.optimize") -> tuple[int, ...]:
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise GradReduceConfigError(
            f"{caller}: rank {dist.get_rank()} is not a member of {name} (a rank outside "
            f"the ranks given to dist.new_group gets a placeholder, not a group); pass each rank "
            f"the {name} it belongs to"
        )
    return tuple(dist.get_process_group_ranks(group))


def check_groups(
    ep_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    expert_dp_group: dist.ProcessGroup | None,
    caller: str = "fxoverlap.optimize",
) -> ReduceGroups | None:
    """Check the groups against each other on this rank, with no communication; None
    when there is no data parallelism (no ``dp_group``). ``caller`` starts each error's
    message (``fxoverlap.optimize``, ``fxoverlap.pipeline_schedule``).

    ``|dp_group|`` must divide the world, ``ep_group`` and ``expert_dp_group`` lie in
    ``dp_group`` with ``|dp_group| = |ep_group| · |expert_dp_group|``, and the two meet
    in this rank only. ``expert_dp_group=None`` means ``dp_group`` with EP 1, and this
    rank alone when ``ep_group`` is all of ``dp_group``.
    """
    if dp_group is None:
        if expert_dp_group is not None:
            raise GradReduceConfigError(f"{caller}: expert_dp_group needs dp_group (the ranks over which the "
                                        f"non-expert parameters are replicated: dist.group.WORLD without "
                                        f"pipeline parallelism)")
        return None
    if not dist.is_initialized():
        raise GradReduceConfigError(f"{caller}: dp_group given but torch.distributed is not initialized")
    if emulated_dp(dp_group):
        return _emulated_groups(ep_group, dp_group, expert_dp_group, caller)
    me, world = dist.get_rank(), dist.get_world_size()
    dp = _ranks(dp_group, "dp_group", caller)
    if world % len(dp):
        raise GradReduceConfigError(f"{caller}: dp_group has {len(dp)} ranks {list(dp)}, which does not "
                         f"divide the world of {world} ranks")
    ep = (me,) if ep_group is None else _ranks(ep_group, "ep_group", caller)
    if not set(ep) <= set(dp):
        raise GradReduceConfigError(f"{caller}: ep_group {list(ep)} is not inside dp_group {list(dp)}; expert "
                         f"parallelism runs inside data parallelism")
    if len(dp) % len(ep):
        raise GradReduceConfigError(f"{caller}: ep_group has {len(ep)} ranks, which does not divide "
                         f"dp_group's {len(dp)}")
    want = len(dp) // len(ep)
    if expert_dp_group is None:
        if len(ep) == 1:
            return ReduceGroups(dp_group, dp_group, dp, dp)
        if want == 1:
            return ReduceGroups(dp_group, None, dp, (me,))
        raise GradReduceConfigError(
            f"{caller}: with ep_group of {len(ep)} and dp_group of {len(dp)} ranks, pass "
            f"expert_dp_group: the {want} ranks that hold the same experts as rank {me} (the same EP "
            f"index), e.g. init_device_mesh(device, ({want}, {len(ep)}), mesh_dim_names=('edp', 'ep'))"
            f"['edp'].get_group()"
        )
    edp = _ranks(expert_dp_group, "expert_dp_group", caller)
    if len(edp) != want:
        raise GradReduceConfigError(
            f"{caller}: expert_dp_group has {len(edp)} ranks {list(edp)}, but |dp_group| / "
            f"|ep_group| = {len(dp)} / {len(ep)} = {want}: each rank's experts are replicated on one "
            f"rank of every EP group"
        )
    if not set(edp) <= set(dp) or set(edp) & set(ep) != {me}:
        raise GradReduceConfigError(
            f"{caller}: expert_dp_group {list(edp)} must lie in dp_group {list(dp)} and meet "
            f"ep_group {list(ep)} in rank {me} only (its ranks hold rank {me}'s experts, one per EP group)"
        )
    return ReduceGroups(dp_group, None if len(edp) == 1 else expert_dp_group, dp, edp)


def _emulated_groups(ep_group: dist.ProcessGroup | None, dp_group: GroupStandIn,
                     expert_dp_group: dist.ProcessGroup | None, caller: str) -> ReduceGroups:
    """The groups of one rank standing in for DP M (``dp_group`` an ``EmulatedDPGroup``) on a
    world of one rank: the virtual ranks ``range(M)``, this rank 0. The experts' group, as
    :func:`check_groups` says for real groups: with EP 1, ``dp_group``; under an emulated EP
    group (a ``GroupStandIn``), ``expert_dp_group``: None for M_e = 1 (this rank's experts are
    its own), or an ``EmulatedDPGroup`` of size M_e = M / N."""
    if dist.get_world_size() != 1:
        raise GradReduceConfigError(
            f"{caller}: an emulated dp_group ({dp_group!r}) stands for DP {dp_group.emulated_size} on a world of "
            f"one rank, but the world has {dist.get_world_size()}; pass a real dp_group on several ranks")
    m = tuple(range(dp_group.emulated_size))
    if ep_group is None or not isinstance(ep_group, GroupStandIn):
        if expert_dp_group not in (None, dp_group):
            raise GradReduceConfigError(f"{caller}: with EP 1 the experts shard over dp_group; pass "
                                        f"expert_dp_group=None with an emulated dp_group")
        return ReduceGroups(dp_group, dp_group, m, m)
    if expert_dp_group is None:
        return ReduceGroups(dp_group, None, m, (0,))
    if not emulated_dp(expert_dp_group) or dp_group.emulated_size % expert_dp_group.emulated_size:
        raise GradReduceConfigError(
            f"{caller}: with an emulated dp_group of {len(m)} ranks, expert_dp_group is None (M_e = 1) or an "
            f"EmulatedDPGroup whose size M_e divides {len(m)}; got {expert_dp_group!r}")
    me = tuple(range(expert_dp_group.emulated_size))
    return ReduceGroups(dp_group, None if len(me) == 1 else expert_dp_group, m, me)


# ---------------------------------------------------------------- runtime


@dataclasses.dataclass
class Pending:
    """A bucket's reduction in flight: what ``finish`` waits for and hands out."""

    bucket: Bucket
    work: object | None  # the c10d Work, None for a one-rank group
    flat: torch.Tensor  # the bucket's flat buffer (reduced in place by all_reduce; kept until done)
    out: torch.Tensor  # what the reduction leaves: flat (all_reduce) or this rank's shard


@dataclasses.dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter inside this rank's shard of a bucket."""

    param: str
    bucket: int
    start: int  # first element of the piece in the flattened parameter
    shard_offset: int  # first element of the piece in this rank's shard
    view: torch.Tensor  # the parameter's elements [start, start + numel), a leaf view


def _layout(buckets: Sequence[Bucket]) -> tuple:
    return tuple((b.role, str(b.dtype), tuple((s.param, s.shape, s.offset) for s in b.slots)) for b in buckets)


class GradReduction:
    """The engine's data parallelism: groups, mode, and (``reduce_scatter``) the rank's shard views."""

    def __init__(self, groups: ReduceGroups, mode: str, sharding=None):
        # ``sharding`` (fxoverlap.param_shard.ParamSharding): ZeRO-3, the gradients of its sharded
        # parameters are reduce-scattered into their DTensors' .grad (``mode`` is then "shard_params")
        self.groups, self.mode, self.sharding = groups, ("shard_params" if sharding is not None else mode), sharding
        self.layout: tuple | None = None  # reduce_scatter: the bucket layout the shards follow
        self.buckets: tuple[Bucket, ...] = ()
        self._params: dict[str, nn.Parameter] = {}
        self._pieces: list[ShardPiece] = []
        self._checked: set[tuple] = set()  # layouts the ranks of each group agreed on

    def bind(self, buckets: Sequence[Bucket], capture: Capture, model: nn.Module) -> BucketReducer:
        """The runtime of one program's reduction nodes."""
        layout = _layout(buckets)
        if layout not in self._checked:
            params = dict(model.named_parameters(remove_duplicate=False))
            self._params.update({s.param: params[s.param] for b in buckets for s in b.slots})
            if buckets:
                self._check_same_layout_on_every_rank(buckets, self._params[buckets[0].slots[0].param].device)
            self._checked.add(layout)
        if self.mode == "reduce_scatter":
            if self.layout is None:
                self.layout, self.buckets = layout, tuple(buckets)
                self._pieces = self._make_pieces()
            elif layout != self.layout:
                raise GradReduceError(
                    "fxoverlap: the gradient buckets of this input signature differ from the first one's "
                    "(another capture gave other gradients); the shards an optimizer holds must stay "
                    "fixed: use one engine per model structure"
                )
        return BucketReducer(self, tuple(buckets), {v: p for v, p in capture.grads.items() if p in self._params},
                             model)

    def _check_same_layout_on_every_rank(self, buckets: Sequence[Bucket], device: torch.device) -> None:
        """Every rank of a group must reduce the same buckets, or the collectives mismatch
        (a hang, or sums of unrelated gradients): compare a digest once, at the first bind."""
        for role in ("dense", "expert"):
            group, ranks = self.groups.of(role)
            if group is None or len(ranks) == 1 or emulated_dp(group):  # (one real rank)
                continue
            digest = hashlib.sha256(repr(_layout([b for b in buckets if b.role == role])).encode()).digest()
            mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64, device=device)
            every = torch.empty(len(ranks), dtype=torch.int64, device=device)
            all_gather_single(every, mine, group=group)
            if (every != mine).any():
                raise GradReduceError(
                    f"fxoverlap: the ranks {list(ranks)} of the {role} parameters' group bucket their "
                    f"gradients differently (their models or captures differ); every rank of a group "
                    f"must run the same model structure"
                )

    # ---- reduce_scatter: the rank's shard
    def _make_pieces(self) -> list[ShardPiece]:
        pieces = []
        for b in self.buckets:
            _, ranks = self.groups.of(b.role)
            start, stop = b.shard(ranks.index(dist.get_rank()), len(ranks))
            for s in b.slots:
                lo, hi = max(start, s.offset), min(stop, s.offset + s.numel)
                if lo >= hi:
                    continue
                p = self._params[s.param]
                if not p.is_contiguous():
                    raise GradReduceConfigError(f"fxoverlap: grad_reduce='reduce_scatter' needs contiguous parameters; "
                                     f"{s.param} is not (make it contiguous before optimize)")
                view = p.detach().view(-1)[lo - s.offset:hi - s.offset]
                view.requires_grad_(True)
                pieces.append(ShardPiece(s.param, b.index, lo - s.offset, lo - start, view))
        return pieces

    def shard_parameters(self) -> list[torch.Tensor]:
        """This rank's shard of every bucket, as leaf views of the parameters whose ``.grad``
        is the averaged gradient there: hand them to an optimizer."""
        if self.mode != "reduce_scatter":
            raise GradReduceError("fxoverlap: shard_parameters() is for OverlapConfig(grad_reduce='reduce_scatter'); "
                               "with 'all_reduce' every p.grad holds the whole averaged gradient")
        if self.layout is None:
            raise GradReduceError("fxoverlap: the shards are known once the model is captured: call "
                               "engine.forward_backward(...) (or engine.plan(...)) first")
        return [piece.view for piece in self._pieces]

    def shard_pieces(self) -> list[ShardPiece]:
        self.shard_parameters()
        return list(self._pieces)

    def gather_parameters(self) -> None:
        """After the optimizer stepped this rank's shards: all-gather every bucket, so each
        rank holds the updated parameters (``all_gather_single``; returns when done)."""
        self.shard_parameters()
        gathers = []
        for b in self.buckets:
            group, ranks = self.groups.of(b.role)
            if group is None or len(ranks) == 1:
                continue  # this rank's shard is the whole bucket: the optimizer updated it in place
            start, stop = b.shard(ranks.index(dist.get_rank()), len(ranks))
            device = self._params[b.slots[0].param].device
            mine = torch.zeros(stop - start, dtype=b.dtype, device=device)
            for piece in self._pieces:
                if piece.bucket == b.index:
                    mine[piece.shard_offset:piece.shard_offset + piece.view.numel()].copy_(piece.view.detach())
            full = torch.empty(b.padded_numel(len(ranks)), dtype=b.dtype, device=device)
            gathers.append((b, full, dp_collective("all_gather", full, mine, group)))
        for b, full, work in gathers:
            work.wait()
            for s in b.slots:
                self._params[s.param].detach().view(-1).copy_(full[s.offset:s.offset + s.numel])


class BucketReducer:
    """Runs one program's ``reduce_grads`` / ``finish_reduce`` nodes (``ProgramRunner`` calls it).

    ``trace``: set to a list to record ``(event, bucket, time.perf_counter(), extra)``:
    ``"issue"``, ``"done"`` (the collective completed; from its future) and ``"wait"``
    (``extra``: whether it had completed before the wait).
    """

    def __init__(self, owner: GradReduction, buckets: tuple[Bucket, ...], fqns: dict[str, str], model: nn.Module):
        self.owner, self.buckets, self.fqns, self.model = owner, buckets, fqns, model
        self.params: dict[str, nn.Parameter] = {}  # value -> the model's parameter, looked up at each begin()
        self.trace: list | None = None
        # value -> what p.grad held when the run began (already reduced): set aside by begin(),
        # the average added into it by finish(), put back by abandon()
        self._before: dict[str, torch.Tensor] = {}
        self._running: set[int] = set()  # buckets of the run in progress not finished yet
        # ids of the parameters whose .grad this run's finish has set (a tied weight has a
        # slot per name, one tensor: the second slot's average adds to the first's)
        self._given: set[int] = set()

    def begin(self, params: Mapping[str, nn.Parameter] | None = None) -> None:
        """A run begins (``ProgramRunner.start``): set aside what ``p.grad`` holds, so that the
        run's microbatches accumulate this call's local gradients alone and only those are
        reduced; :meth:`finish` adds the average into the set-aside tensor (in place), which
        becomes ``p.grad`` again. Reducing it with them would count it again: an expert
        gradient is summed over ``expert_dp_group`` but divided by ``|dp_group|``, so a
        replicated value comes back divided by ``|ep_group|`` (issue 34, item 7).

        Costs no copy: the set-aside tensor is the one ``p.grad`` held. ZeRO-2 accumulates in
        the shards' ``.grad`` and leaves ``p.grad`` ``None``, so it sets nothing aside: a full
        ``p.grad`` found there (not the engine's: an eager backward of the model) is a local
        gradient and is reduced with the call's, as before. (Refusing it instead would be a
        rank-local decision: the other ranks would wait in the program's collectives.)"""
        if self._running:  # a run that neither finished nor was abandoned (its caller never ran it to the end)
            self.abandon()
        # by name at every run: load_state_dict(assign=True) or model.to() may have made new parameters
        # (``params``: the call's own lookup, when the caller made one)
        if params is None:
            params = dict(self.model.named_parameters(remove_duplicate=False))
        self.params = {v: params[fqn] for v, fqn in self.fqns.items()}
        self._given.clear()
        for b in self.buckets:
            if self._whole(b):
                for s in b.slots:
                    p = self.params[s.value]
                    if p.grad is not None:
                        self._before[s.value] = p.grad
                        p.grad = None
        self._running = set(range(len(self.buckets)))

    def _whole(self, b: Bucket) -> bool:
        """Whether bucket ``b``'s result is the whole averaged gradient in ``p.grad`` (all-reduce;
        with sharded parameters, a role whose group is this rank alone), not a rank's shard."""
        return self.owner.mode == "all_reduce" or (self.owner.mode == "shard_params" and not self._sharded(b))

    def _sharded(self, b: Bucket) -> bool:
        """ZeRO-3: bucket ``b``'s parameters are DTensors (sharded, or experts read in place)."""
        sharding = self.owner.sharding
        return self.owner.mode == "shard_params" and (
            sharding.sharded(b.role) or (b.role == "expert" and bool(sharding.local_only)))

    def abandon(self) -> None:
        """The run failed: drop its partial local gradients and put back what :meth:`begin`
        set aside, so ``p.grad`` is as the call found it (buckets already finished keep theirs)."""
        for i in sorted(self._running):
            for s in self.buckets[i].slots:
                self.params[s.value].grad = self._before.pop(s.value, None)
        self._running = set()
        self._before.clear()

    def start(self, index: int, grads: Sequence[torch.Tensor]) -> Pending:
        """Add the last gradients to this call's local ones (``p.grad``, microbatches 0..N-2)
        into the flat buffer and issue the collective (async); runs under the comm stream, so
        its buffers belong to it. ``p.grad`` is dropped once copied: the buffer holds it now."""
        b = self.buckets[index]
        group, ranks = self.owner.groups.of(b.role)
        if self._sharded(b):
            return self._start_sharded(index, b, group, len(ranks), grads)
        flat = torch.zeros(b.padded_numel(len(ranks)), dtype=b.dtype, device=grads[0].device)
        for s, g in zip(b.slots, grads):
            view = flat[s.offset:s.offset + s.numel].view(s.shape)
            p = self.params[s.value]
            held = p.grad
            if held is None:
                view.copy_(g)
            else:
                torch.add(held, g, out=view)  # p.grad + g, as AccumulateGrad adds
                if held.is_cuda:  # made on the compute stream, read here: keep its block until then
                    held.record_stream(torch.cuda.current_stream(held.device))
                p.grad = None  # not kept to the finish: one full local copy less at the end of the backward
        work, out = None, flat
        if group is not None and len(ranks) > 1:
            if self._whole(b):
                work = dp_collective("all_reduce", flat, flat, group)
            else:
                start, stop = b.shard(ranks.index(dist.get_rank()), len(ranks))
                out = flat.new_empty(stop - start)
                work = dp_collective("reduce_scatter", out, flat, group)
        elif self.owner.mode == "reduce_scatter":
            out = flat  # a one-rank group owns the whole bucket
        return self._issued(index, Pending(b, work, flat, out))

    def _issued(self, index: int, pending: Pending) -> Pending:
        if self.trace is not None:
            self.trace.append(("issue", index, time.perf_counter(), None))
            if pending.work is not None:
                pending.work.get_future().then(
                    lambda _, i=index: self.trace.append(("done", i, time.perf_counter(), None)))
        return pending

    def _start_sharded(self, index: int, b: Bucket, group, n: int, grads: Sequence[torch.Tensor]) -> Pending:
        """ZeRO-3: the local gradients (held for microbatches 0..N-2, plus the last one's), laid
        out rank-major (rank r's rows of every parameter together, in slot order), reduce-scattered:
        this rank gets its rows of each, the rows its DTensor shard holds."""
        held = self.owner.sharding.held
        width = sum(s.numel // n for s in b.slots)
        flat = torch.empty(n, width, dtype=b.dtype, device=grads[0].device)
        at = 0
        for s, g in zip(b.slots, grads):
            k = s.numel // n
            h = held.pop(s.param, None)
            total = g if h is None else torch.add(h, g)
            if h is not None and h.is_cuda:  # made on the compute stream, read here: keep its block until then
                h.record_stream(torch.cuda.current_stream(h.device))
            flat[:, at:at + k].copy_(total.reshape(n, k))
            at += k
        if n == 1:  # experts no other rank holds: nothing to reduce, only the division follows
            return self._issued(index, Pending(b, None, flat, flat.view(-1)))
        out = flat.new_empty(width)
        work = dp_collective("reduce_scatter", out, flat.view(-1), group)
        return self._issued(index, Pending(b, work, flat, out))

    def finish(self, pending: Pending, compute_stream=None) -> None:
        """Wait (the current stream waits, on CUDA), divide by ``|dp_group|``, hand out."""
        b = pending.bucket
        if self.trace is not None:
            done = pending.work is None or pending.work.is_completed()
            self.trace.append(("wait", b.index, time.perf_counter(), done))
        if pending.work is not None:
            pending.work.wait()
        self._running.discard(b.index)
        out = pending.out
        out.div_(self.owner.groups.dp_size)
        if compute_stream is not None:
            out.record_stream(compute_stream)  # allocated on the comm stream, used on this one from now on
        if self._sharded(b):
            self._finish_sharded(b, out)
            return
        if self._whole(b):
            for s in b.slots:
                avg = out[s.offset:s.offset + s.numel].view(s.shape)
                p = self.params[s.value]
                before = self._before.pop(s.value, None)
                if id(p) in self._given:  # a tied weight's other name: its gradient adds to the first's
                    p.grad = p.grad + avg
                elif before is None:
                    p.grad = avg  # a view: the flat buffer lives on as p.grad
                else:  # accumulation: into what p.grad held (the flat buffer is freed after this)
                    p.grad = before.add_(avg)
                self._given.add(id(p))
            return
        for s in b.slots:
            self.params[s.value].grad = None  # ZeRO-2: the full local gradient is not kept
        for piece in self.owner._pieces:
            if piece.bucket == b.index:
                g = out[piece.shard_offset:piece.shard_offset + piece.view.numel()]
                if piece.view.grad is None:
                    piece.view.grad = g
                else:
                    piece.view.grad.add_(g)


    def _finish_sharded(self, b: Bucket, out: torch.Tensor) -> None:
        """Add this rank's rows into each DTensor parameter's ``.grad`` (a ``Shard(0)`` DTensor;
        under an emulated ``dp_group`` the parameters are plain tensors of the shard's shape, and
        so is their ``.grad``)."""
        from torch.distributed.tensor import DTensor

        n = len(self.owner.groups.of(b.role)[1])
        at = 0
        for s in b.slots:
            k = s.numel // n
            p = self.params[s.value]
            local = out[at:at + k].view(s.shape[0] // n, *s.shape[1:])
            at += k
            grad = local if not isinstance(p, DTensor) else DTensor.from_local(
                local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)


# ---------------------------------------------------------------- gradients final before the reduction (pipeline stages)


class GradAllReduce:
    """The data-parallel average of some parameters' gradients over one group, issued at once.

    For gradients that are final before anything reduces them: a pipeline stage's, after its
    last backward of a step (``fxoverlap.pipeline_schedule(..., dp_group=...)``), where each
    backward is a separate program run, so no program holds the last gradients' hand-out and
    the reduction nodes ``passes/reduce.py`` places. :meth:`start` packs the gradients into flat
    buckets (per dtype and device, in reverse parameter order, each closed once it holds
    ``bucket_bytes``) and issues an asynchronous ``all_reduce`` of each; :meth:`finish` waits,
    divides by ``divisor`` (the group size by default) and copies the results into ``p.grad``.
    ``group=None``: this rank alone (no collective; the gradients are only divided: the
    expert parameters of a rank whose experts no other rank holds, divided by ``|dp_group|``).
    A parameter without a gradient counts as zeros (and gets the average), so every rank of the
    group reduces the same buckets; the ranks must hold the same parameters in the same order.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, bucket_bytes: int,
                 divisor: int | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.divisor = self.size if divisor is None else divisor
        self.bucket_bytes = bucket_bytes
        self.steps = 0  # reductions finished
        self.started = False  # start() ran in this step, finish() not yet
        self._pending: list[tuple[object | None, torch.Tensor, list[nn.Parameter]]] = []

    def buckets(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in the order the buckets are issued."""
        out, open_, held = [], {}, {}
        for p in reversed(self.params):  # the backward makes the last parameters' gradients first
            key = (p.dtype, p.device)
            open_.setdefault(key, []).append(p)
            held[key] = held.get(key, 0) + p.numel() * p.element_size()
            if held[key] >= self.bucket_bytes:
                out.append(open_.pop(key))
                held[key] = 0
        out.extend(open_.values())
        return out

    def start(self) -> None:
        """Issue the all-reduce of every bucket (asynchronous)."""
        if self.started:
            raise GradReduceError("fxoverlap: a data-parallel gradient reduction was started twice in one step")
        self.started = True
        with torch.no_grad():
            for ps in self.buckets():
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
                work = None
                if self.group is not None and self.size > 1:
                    work = dist.all_reduce(flat, group=self.group, async_op=True)
                self._pending.append((work, flat, ps))

    def finish(self) -> None:
        """Wait for every bucket, divide by ``divisor``, copy into ``p.grad``."""
        with torch.no_grad():
            for work, flat, ps in self._pending:
                if work is not None:
                    work.wait()
                flat.div_(self.divisor)
                offset = 0
                for p in ps:
                    g = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
        self._pending = []
        self.started = False
        self.steps += 1
