"""Fully sharded parameters (ZeRO-3, ``OverlapConfig(shard_params=True)``): the model's
``Shard(0)`` DTensor parameters, and the runtime of the ``unshard`` / ``wait_unshard`` /
``reshard`` nodes that ``passes/shard.py`` places in the program.

Between uses each rank holds only its shard of every sharded parameter: the model's parameter
*is* a DTensor over its group (``dp_group`` for dense parameters, ``expert_dp_group`` for
expert ones), sharded along its first dimension, as FSDP2 lays it out. So an optimizer steps
``model.parameters()`` directly, ``model.state_dict()`` holds DTensors, and
``torch.distributed.checkpoint`` saves and loads the sharded layout.

Inside a step the program gathers a unit (``unshard``: this rank's shards packed into one
buffer and all-gathered, asynchronously, on the parameter stream over a communicator of its
own, so a gather never queues behind the EP all-to-all or a gradient reduction), waits for it
right before its first reader (``wait_unshard``: the full parameters are copied out of the
gathered blocks and put into the value stores under their placeholder names), and drops it
after its last (``reshard``: the stores let go of them, so their memory is freed).

Gradients: the microbatches' local gradients of a sharded parameter accumulate in
:attr:`ParamSharding.held` (full size, as ZeRO-2's do in ``p.grad``); the last microbatch's
reduction (``fxoverlap.grad_reduce.BucketReducer``) adds them up, reduce-scatters them over
the group in the same row layout and adds this rank's rows, divided by ``|dp_group|``, into
the DTensor's ``.grad``.

Emulated DP (a benchmark on one device): ``dp_group`` an
:class:`~fxoverlap.kernels.emulated_link.EmulatedDPGroup` of size M on a world of one rank.
Each sharded parameter is then 1/M of its first dimension, as a *plain* parameter of the
shard's shape (a DTensor over a one-rank mesh whose local tensor is 1/M of its global shape
would be inconsistent: ``full_tensor()``, redistribution and checkpoints would read it
wrong); each gather allocates the full buffer, so the held and gathered memory are a DP-M
rank's, but its data is the local shard tiled M times (``grad_reduce.dp_collective``), so the
values are not the model's. The gathers and reduce-scatters hold their streams as the
group's link says.
"""

from __future__ import annotations

import gc
import logging
import math
import time
import weakref
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from fxoverlap.grad_reduce import GradReduceConfigError, ReduceGroups, dp_collective
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.unit import ParamUnit

log = logging.getLogger("fxoverlap")


class ShardParamsError(FxOverlapError, RuntimeError):
    """Sharded parameters cannot go on as asked (an optimizer that already stepped the full
    parameters, units that differ between programs); the message says why and what to do."""


def _dtensor():
    from torch.distributed.tensor import DTensor, Shard

    return DTensor, Shard


class ParamSharding:
    """The engine's fully sharded parameters: the units, the model's DTensors, the gathers.

    :meth:`adopt` runs once, at the first capture: it fixes the units (``passes/shard.py``'s
    :func:`~fxoverlap.passes.shard.param_units`), makes each sharded parameter a DTensor (the
    model keeps no full copy) and creates the gathers' communicators. Each run then calls
    :meth:`begin`, and the program's nodes :meth:`start_gather`, :meth:`finish_gather`.

    ``trace``: set to a list to record ``(event, unit, time.perf_counter(), extra)`` for
    ``"gather"`` (issued), ``"wait"`` and ``"drop"`` (``extra``: how many of the unit's
    gathered tensors something other than the stores still holds: 0 when the drop freed them).
    :attr:`peak_bytes`: the most bytes of gathered parameters held at once in the last run.
    """

    def __init__(self, groups: ReduceGroups, ep_group: dist.ProcessGroup | None = None):
        self.groups, self.ep_group = groups, ep_group
        # the sharded parameters' shapes as the program reads them (an expert DTensor's global
        # shape counts every EP rank's experts; the program reads this rank's)
        self.program_shapes: dict[str, torch.Size] = {}
        self.local_only: frozenset[str] = frozenset()  # DTensors over EP alone: read in place, not gathered
        self.units: tuple[ParamUnit, ...] | None = None
        self.fqns: frozenset[str] = frozenset()  # the sharded parameters
        self._checked: tuple[str, ...] = ()  # what check_params reads each run, in a fixed order
        self.held: dict[str, torch.Tensor] = {}  # this run's local gradients of sharded parameters
        self.trace: list | None = None
        self._gather_groups: dict[str, dist.ProcessGroup] = {}
        self._meshes: dict[str, object] = {}
        self._params: Mapping[str, torch.Tensor] = {}
        self._pending: dict[int, tuple] = {}
        self._stream = None
        self._model: nn.Module | None = None
        self.live_bytes = self.peak_bytes = 0
        self._alive: dict[int, list] = {}  # trace: weak references to each gathered unit's tensors

    @property
    def ranks(self) -> dict[str, int]:
        """The group size per role (``"dense"``, ``"expert"``)."""
        return {"dense": self.groups.dp_size, "expert": len(self.groups.expert_dp_ranks)}

    def sharded(self, role: str) -> bool:
        """Whether ``role``'s parameters are split over their group: where other ranks hold them,
        and on a world of one rank (the same program, its gathers one-rank collectives: how one GPU
        runs the parameter stream's code)."""
        return self.ranks[role] > 1 or self.groups.dp_size == 1

    @property
    def sharded_ranks(self) -> dict[str, int]:
        """The group size per sharded role (``passes/shard.py``'s ``param_units``)."""
        return {role: n for role, n in self.ranks.items() if self.sharded(role)}

    # ---------------------------------------------------------------- once
    def adopt(self, units: tuple[ParamUnit, ...], model: nn.Module, experts: Sequence[str] = ()) -> None:
        """At the first capture: take the units (``passes/shard.py``'s ``param_units``) and shard
        the model (every rank of the groups calls it: it creates communicators). ``experts``: the
        expert parameters (by name); where their role is not sharded (no other rank holds these
        experts) and EP has several ranks, they become DTensors over the EP mesh all the same,
        read in place by the program (:attr:`local_only`): one parameter type for the optimizer's
        ``foreach`` kernels, and checkpoints that keep each EP rank's experts apart."""
        if self.units is not None:
            return
        t0 = time.perf_counter()
        self._model = model
        self._make_groups(model)
        replaced = self._shard_model(model, units)
        if not self.sharded("expert") and "expert" in self._meshes:
            replaced.update(self._wrap_in_place(model, [e for e in experts if e not in self.program_shapes]))
        # every name of a sharded parameter (a tied one's gradient arrives under each of its names)
        self.units, self.fqns = units, frozenset(name for u in units for p in u.params for name in p.names)
        self._checked = tuple(sorted(self.fqns | self.local_only))  # (sorted: errors name the same one)
        log.info("fxoverlap: sharded %d parameters into %d units in %.2f s (%s)", len(self.fqns), len(units),
                 time.perf_counter() - t0, ", ".join(u.name for u in units))
        _retarget_optimizers(replaced)

    def _make_groups(self, model: nn.Module) -> None:
        """A communicator of its own per group for the gathers (all ranks create every group,
        in one order: ``dist.new_group`` is collective over the world)."""
        device = next(model.parameters()).device
        mine = {"dense": self.groups.dp_ranks, "expert": self.groups.expert_dp_ranks}
        if self.groups.emulated:  # one rank standing in for DP M: the stand-ins gather (no mesh: plain shards)
            for role, (group, _) in (("dense", self.groups.of("dense")), ("expert", self.groups.of("expert"))):
                if self.sharded(role):
                    self._gather_groups[role] = group
            return
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, tuple(r for role, r in mine.items() if self.sharded(role)))
        for ranks in sorted({r for per_rank in every for r in per_rank}):
            group = dist.new_group(list(ranks))
            for role, r in mine.items():
                if r == ranks and self.sharded(role):
                    self._gather_groups[role] = group
        from torch.distributed.device_mesh import DeviceMesh

        if self.sharded("dense"):
            self._meshes["dense"] = DeviceMesh.from_group(self.groups.dp_group, device.type)
        if self.sharded("expert"):
            self._meshes["expert"] = self._expert_mesh(device.type)
        elif self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            self._meshes["expert"] = DeviceMesh.from_group(self.ep_group, device.type, mesh_dim_names=("ep",))

    def _expert_mesh(self, device_type: str):
        """The experts' mesh: ("ep", "edp") over ``dp_group``, so an expert parameter is one DTensor
        holding every EP rank's experts (its first dimension split over EP, then over expert-DP):
        checkpoints then keep each EP rank's experts apart (one name, other rows)."""
        from torch.distributed.device_mesh import DeviceMesh

        ep_ranks = (dist.get_rank(),) if self.ep_group is None else tuple(dist.get_process_group_ranks(self.ep_group))
        if len(ep_ranks) == 1:
            return DeviceMesh.from_group(self.groups.expert_dp_group, device_type)
        me = dist.get_rank()
        coords: list = [None] * self.groups.dp_size
        dist.all_gather_object(coords, (me, ep_ranks.index(me), self.groups.expert_dp_ranks.index(me)),
                               group=self.groups.dp_group)
        mesh = torch.empty(len(ep_ranks), len(self.groups.expert_dp_ranks), dtype=torch.int)
        for rank, e, d in coords:
            mesh[e, d] = rank
        return DeviceMesh.from_group([self.ep_group, self.groups.expert_dp_group], device_type, mesh=mesh,
                                     mesh_dim_names=("ep", "edp"))

    def _shard_model(self, model: nn.Module, units: tuple[ParamUnit, ...]) -> dict[int, nn.Parameter]:
        """Each sharded parameter becomes a ``Shard(0)`` DTensor parameter, under every name the
        model holds it by (tied weights stay tied); returns old id -> new parameter."""
        DTensor, Shard = _dtensor()
        holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for mod in model.modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append((mod, name))
        # every name (the capture names a tied parameter by its last one, as AOTAutograd lists them)
        params = dict(model.named_parameters(remove_duplicate=False))
        replaced = {}
        for unit in units:
            rank = self._rank(unit.role)
            for up in unit.params:
                old = params[up.fqn]
                if isinstance(old, DTensor):
                    raise GradReduceConfigError(
                        f"fxoverlap: OverlapConfig(shard_params=True) shards plain parameters; {up.fqn} is a "
                        f"DTensor already (FSDP, tensor parallelism, or another engine with shard_params that "
                        f"sharded this model, e.g. copy.deepcopy of one: keep one engine per model)")
                if not old.is_contiguous():
                    raise GradReduceConfigError(f"fxoverlap: OverlapConfig(shard_params=True) needs contiguous "
                                                f"parameters; {up.fqn} is not (make it contiguous before optimize)")
                rows = unit.rows(up)
                local = old.detach()[rank * rows:(rank + 1) * rows].clone()
                if self.groups.emulated:  # a plain parameter of the shard's shape (module docstring)
                    new = nn.Parameter(local, requires_grad=old.requires_grad)
                else:
                    mesh = self._meshes[unit.role]
                    shape = (old.shape[0] * (mesh.size() // unit.ranks), *old.shape[1:])  # experts: every EP rank's
                    new = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim, run_check=False,
                                                          shape=torch.Size(shape), stride=old.stride()),
                                       requires_grad=old.requires_grad)
                self.program_shapes[up.fqn] = old.shape
                for mod, name in holders[id(old)]:
                    mod._parameters[name] = new
                replaced[id(old)] = new
                old.data = torch.empty(0, dtype=old.dtype, device=old.device)  # the full copy is gone
        return replaced

    def _wrap_in_place(self, model: nn.Module, names: Sequence[str]) -> dict[int, nn.Parameter]:
        """The unsharded expert parameters as ``Shard(0)`` DTensors over the EP mesh, their local
        tensor the parameter's own storage (nothing gathered, nothing copied)."""
        DTensor, Shard = _dtensor()
        mesh = self._meshes["expert"]
        params = dict(model.named_parameters(remove_duplicate=False))
        replaced = {}
        for name in names:
            old = params[name]
            if id(old) in replaced or isinstance(old, DTensor):
                continue
            new = nn.Parameter(DTensor.from_local(old.detach(), mesh, [Shard(0)], run_check=False,
                                                  shape=torch.Size((old.shape[0] * mesh.size(), *old.shape[1:])),
                                                  stride=old.stride()), requires_grad=old.requires_grad)
            for mod in model.modules():
                for k, p in list(mod._parameters.items()):
                    if p is old:
                        mod._parameters[k] = new
            replaced[id(old)] = new
            self.program_shapes[name] = old.shape
        self.local_only = frozenset(n for n, p in model.named_parameters(remove_duplicate=False)
                                    if id(p) in {id(v) for v in replaced.values()})
        return replaced

    def _rank(self, role: str) -> int:
        ranks = self.groups.dp_ranks if role == "dense" else self.groups.expert_dp_ranks
        return ranks.index(dist.get_rank())

    # ---------------------------------------------------------------- each run
    def check_params(self, params: Mapping[str, torch.Tensor]) -> None:
        """Each run: every sharded parameter is still its shard (a DTensor; under the emulated
        DP group a plain tensor of the shard's shape), and carries no tensor hook (it would never
        see its gradient: the local one is summed aside and reduce-scattered). Refused by name."""
        DTensor, _ = _dtensor()
        for fqn in self._checked:
            p = params[fqn]
            if not self.groups.emulated and not isinstance(p, DTensor):
                raise ShardParamsError(
                    f"fxoverlap: {fqn} is a plain {type(p).__name__} of shape {list(p.shape)}, but "
                    f"OverlapConfig(shard_params=True) made it a DTensor shard at the first step: something "
                    f"replaced it since, e.g. model.load_state_dict(sd, assign=True) with full tensors. Load "
                    f"with assign=False (each shard is copied in place from the full tensor), or through "
                    f"torch.distributed.checkpoint (dcp.load / set_model_state_dict), which keeps the shards")
            if p._backward_hooks:
                raise ShardParamsError(
                    f"fxoverlap: {fqn} has a tensor hook (p.register_hook), but with OverlapConfig(shard_params=True) "
                    f"its gradient is reduce-scattered into the DTensor's .grad without passing through it; use "
                    f"p.register_post_accumulate_grad_hook (runs on the reduced gradient) or remove the hook")

    def begin(self, params: Mapping[str, torch.Tensor] | None) -> None:
        """A run begins: its parameters by name (None: looked up on the model); no local
        gradient held."""
        self._params = params if params is not None else dict(self._model.named_parameters(remove_duplicate=False))
        self._pending.clear()
        self.held.clear()
        self.live_bytes = self.peak_bytes = 0

    def start_gather(self, index: int) -> None:
        """Pack this rank's shards of unit ``index`` and all-gather them, asynchronously."""
        unit = self.units[index]
        DTensor, _ = _dtensor()
        first = self._params[unit.params[0].fqn]
        device = first.device
        send = torch.empty(unit.shard_numel, dtype=unit.dtype, device=device)
        for up in unit.params:
            p = self._params[up.fqn]
            local = p._local_tensor if isinstance(p, DTensor) else p
            n = unit.shard_elems(up)
            send[up.offset:up.offset + n].copy_(local.detach().reshape(-1))
        recv = torch.empty(unit.ranks * unit.shard_numel, dtype=unit.dtype, device=device)
        group = self._gather_groups[unit.role]
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # send is written, recv allocated
            with torch.cuda.stream(self._stream):
                work = dp_collective("all_gather", recv, send, group)
                # Ordered after the collective's issue on this stream: the reader's stream waits on it
                # besides work.wait(), which orders it after NCCL's own stream only. Without it the
                # CUDA sanitizer, which sees the collective issued on this stream and knows nothing of
                # NCCL's, reports the experts stage's read of the gathered weight as a race.
                issued = torch.cuda.Event()
                issued.record(self._stream)
        else:
            work, issued = dp_collective("all_gather", recv, send, group), None
        self._pending[index] = (work, recv, send, issued)
        if self.trace is not None:
            self.trace.append(("gather", index, time.perf_counter(), None))

    def finish_gather(self, index: int) -> dict[str, torch.Tensor]:
        """Wait for unit ``index``'s gather (the current stream waits) and return its full
        parameters by name, each contiguous: copied out of the rank-major buffer (with one rank,
        a view of it, freed with the unit's last tensor)."""
        work, recv, _, issued = self._pending.pop(index)
        work.wait()
        if issued is not None:
            torch.cuda.current_stream(recv.device).wait_event(issued)
        unit = self.units[index]
        blocks = recv.view(unit.ranks, unit.shard_numel)
        out = {up.fqn: blocks[:, up.offset:up.offset + unit.shard_elems(up)].reshape(up.shape)
               for up in unit.params}
        self.live_bytes += unit.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self.trace is not None:
            self.trace.append(("wait", index, time.perf_counter(), None))
            self._alive[index] = [weakref.ref(t) for t in out.values()]
        return out

    def dropped(self, index: int) -> None:
        """Unit ``index``'s tensors left the stores (``reshard``)."""
        self.live_bytes -= self.units[index].nbytes
        if self.trace is not None:
            alive = sum(r() is not None for r in self._alive.pop(index, []))
            self.trace.append(("drop", index, time.perf_counter(), alive))

    def local_bytes(self, model: nn.Module) -> int:
        """Bytes of parameter storage this rank holds (shards of the sharded ones, whole others)."""
        DTensor, _ = _dtensor()
        total = 0
        for p in {id(p): p for p in model.parameters()}.values():
            t = p._local_tensor if isinstance(p, DTensor) else p
            total += t.numel() * t.element_size()
        return total


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    expert_params=(), ep_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients that are DTensors on several meshes
    (ZeRO-3: dense ones over ``dp_group``'s mesh, expert ones over the ("ep", "edp") mesh), which
    torch's refuses (it stacks the per-mesh norms: "All operands in aten.stack.default must have
    the same mesh"): each mesh's norm is reduced over that mesh, then the norms are combined;
    returns the total norm (a plain tensor, the same on every rank) and scales every gradient by
    ``min(1, max_norm / (total + 1e-6))`` as torch does.

    Plain gradients count as replicated, except those of ``expert_params`` (a role not sharded:
    each EP rank holds other experts), whose norms are combined over ``ep_group``."""
    from torch.distributed.tensor import DTensor, Replicate

    experts = {id(p) for p in expert_params}
    groups: dict[object, list[torch.Tensor]] = {}
    for p in {id(p): p for p in parameters}.values():  # a tied parameter once
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else ("ep" if id(p) in experts else None)
            groups.setdefault(key, []).append(p.grad)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for key, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        elif key == "ep" and ep_group is not None and dist.get_world_size(ep_group) > 1:
            inf = math.isinf(norm_type)
            norm = norm.clone() if inf else norm.pow(norm_type)
            dist.all_reduce(norm, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=ep_group)
            norm = norm if inf else norm.pow(1.0 / norm_type)
        norms.append(norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for key, grads in groups.items():
        c = coef.to(grads[0].device)
        if isinstance(key, str) or key is None:
            torch._foreach_mul_(grads, c)
        else:  # a DTensor gradient is scaled by a replicated DTensor of its mesh
            c = DTensor.from_local(c, key, [Replicate()] * key.ndim, run_check=False)
            for g in grads:
                g.mul_(c)
    return total


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each name of a parameter the model holds under several (tied weights) -> its first name
    (``model.named_parameters()``'s)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def check_shardable(model: nn.Module, groups: ReduceGroups | None) -> ReduceGroups:
    """``OverlapConfig(shard_params=True)`` needs data parallelism and plain parameters: the
    groups, or a named error."""
    if groups is None:
        raise GradReduceConfigError(
            "fxoverlap.optimize: OverlapConfig(shard_params=True) needs dp_group (the ranks the dense parameters "
            "are sharded over; expert_dp_group for the experts), e.g. optimize(model, ep_group, config, "
            "dp_group=dist.group.WORLD, expert_dp_group=...)")
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = ()
    for name, mod in model.named_modules():
        if FSDPModule and isinstance(mod, FSDPModule):
            raise GradReduceConfigError(
                f"fxoverlap.optimize: OverlapConfig(shard_params=True) and fully_shard on {name or 'the model'}: "
                f"both shard the parameters; drop fully_shard (fxoverlap gathers them inside its program)")
    return groups


def _retarget_optimizers(replaced: Mapping[int, nn.Parameter]) -> None:
    """An optimizer built on the full parameters before they were sharded (not stepped yet)
    steps the DTensors instead: its parameter groups are updated in place."""
    if not replaced:
        return
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.optim.Optimizer):  # (isinstance would touch lazy attributes)
            continue
        hit = False
        for group in obj.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) in replaced:
                    if p in obj.state and obj.state[p]:
                        raise ShardParamsError(
                            f"fxoverlap: an optimizer ({type(obj).__name__}) stepped the full parameters before "
                            f"OverlapConfig(shard_params=True) sharded them at the first step; build the "
                            f"optimizer after engine.plan(...) or the first forward_backward")
                    group["params"][i] = replaced[id(p)]
                    hit = True
        if hit:
            log.info("fxoverlap: %s now steps the sharded parameters", type(obj).__name__)


def shard_bytes(unit: ParamUnit) -> int:
    """Bytes one rank holds of ``unit``."""
    return unit.shard_numel * torch.empty((), dtype=unit.dtype).element_size()
