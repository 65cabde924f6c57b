"""Pipeline parallelism with the overlap inside: ``fxoverlap.pipeline_schedule``.

``torch.distributed.pipelining`` owns the pipeline: its schedule decides which F/B step of
which stage and microbatch runs when, its ``PipelineStage`` owns the P2P sends and receives
of activations and gradients, their buffers, the loss (``loss_fn(output, target)``) and the
gradient scaling (``scale_grads``). fxoverlap owns what runs inside each F and B: each
stage module is compiled by fxoverlap's ``torch.compile`` backend on its first step (Dynamo
graph -> capture -> tag -> side -> split -> the stage program), so a stage's F runs the
forward part of its fxoverlap program inside one autograd.Function and its B (pipelining's
``torch.autograd.backward`` on the stage's outputs with the received gradients) runs the
backward part of it, handing back the gradients of the stage's input activations, which
pipelining sends on.

What is hooked, and where (``docs/pipeline_parallel.md``):

- every schedule: the schedule runs :class:`_OverlapStage` objects, a subclass of each user
  stage's class built from it, whose ``forward_maybe_with_nosync`` (the one place pipelining
  calls ``self.submod(...)``) calls the fxoverlap-compiled stage module instead.
  ``stage.submod`` stays the user's module, so ``parameters()``, ``scale_grads`` and DDP/FSDP
  checks see what they always see, and
  pipelining's own torch.compile check (DualPipeV refuses compiled submodules) holds. The
  stage is traced with ``capture_scalar_outputs`` on (host reads of split sizes stay in the
  graph) and its DTensor inputs read only through ``to_local()`` (torchtitan's EP expert
  weights) enter the program as their local shards (:func:`_unwrap_dtensor_inputs`);
- multi-stage schedules (``_PipelineScheduleRuntime``: Interleaved1F1B, the ZeroBubble ones,
  DualPipeV): custom functions (``register_custom_function``) run ``FULL_BACKWARD``,
  ``BACKWARD_INPUT``, ``BACKWARD_WEIGHT``, ``REDUCE_GRAD`` and ``OVERLAP_F_B``, with
  pipelining's receives, loss and V-schedule hand-offs as the runtime's own
  ``_perform_action`` does them (``FORWARD`` stays the runtime's: its ``forward_one_chunk``
  is what reaches ``forward_maybe_with_nosync``). ``OVERLAP_F_B`` runs the merged step
  F(i) ⊗ B(j): F(i)'s forward program and B(j)'s backward program in turns, each stopping
  after each of its comm stages, B(j) outside autograd (:func:`_merged_backward`); F then
  B through autograd where B cannot leave it exactly. Its P2P (:class:`_EarlySends`): each
  receive is waited right before its data is used (B's after F's first chunk), F's output
  is sent as soon as F has returned (before the rest of B), B's input gradients as soon as
  B is done, with pipelining's own ops; the schedule's later ``SEND_F`` / ``SEND_B`` action
  for them (which takes no custom function) then finds nothing left to send
  (``get_fwd_send_ops`` / ``get_bwd_send_ops`` of :class:`_OverlapStage`). The single-stage
  schedules (Schedule1F1B, GPipe) take no custom functions: their stages
  (:class:`_SingleScheduleStage`) count backwards in ``backward_one_chunk`` and hold the
  gradient scaling in ``perform_reduce_grad`` (``dp_group``);
- ZeroBubble splits (``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT``: the ZeroBubble schedules and
  DualPipeV): fxoverlap's backward is one autograd node that hands out input and weight
  gradients together, which ``torch.autograd.grad(inputs=...)`` cannot split, so a
  ``BACKWARD_INPUT`` runs pipelining's full backward. For these schedules a stage is
  compiled with the expert, attention and MLP weight gradients cut off into ``delay_wgrad``
  parts and scheduled after all of its backward's other work
  (``compile_step(weight_last=True)``). ``BACKWARD_INPUT`` runs the backward up to them
  (the input gradients, sent on, and the other parameters' gradients), leaving its calls
  (:func:`_deferrable_runs`) to the schedule's ``BACKWARD_WEIGHT``, which runs them and adds
  their gradients into ``p.grad`` (:meth:`_StageCompiler.weight_step`). Where a call cannot
  defer (a DDP/FSDP module or gradient hooks, which autograd must run; DTensor local
  shards), ``BACKWARD_INPUT`` runs the whole backward and ``BACKWARD_WEIGHT`` has nothing
  left to do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.weak import WeakTensorKeyDictionary

from fxoverlap import pipelining_privates as pl
from fxoverlap.config import PIPELINE, OverlapConfig, refused_fields
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.stage import Stage

__all__ = ["PipelineError", "PipelineInputError", "UnsupportedSchedule", "StageLayersNotFound", "pipeline_schedule",
           "pp_ep_groups", "stage_layout", "supported_schedules"]


class PipelineError(FxOverlapError, RuntimeError):
    """fxoverlap cannot run a pipeline stage's F/B as asked; the message says why."""


class UnsupportedSchedule(FxOverlapError, TypeError):
    """A schedule class :func:`pipeline_schedule` does not run."""


class PipelineInputError(FxOverlapError, TypeError):
    """An argument of :func:`pipeline_schedule` is not what it takes (the message says what is)."""


class StageLayersNotFound(PipelineError):
    """A stage module runs all-to-alls, but no decoder-layer list holding them was found."""


def supported_schedules() -> tuple[type, ...]:
    """The ``torch.distributed.pipelining`` schedule classes :func:`pipeline_schedule` runs."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    return (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleDualPipeV, ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble)


# the schedules that split a backward into BACKWARD_INPUT and a later BACKWARD_WEIGHT
_WEIGHT_SPLIT_SCHEDULES = frozenset({"ScheduleDualPipeV", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"})


def _is_multi_stage(cls: type) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(cls, PipelineScheduleMulti)


class _StageReduction:
    """``pipeline_schedule(dp_group=..., expert_dp_group=...)``: the data-parallel reduction of
    one stage's gradients, as ``fxoverlap.optimize`` reduces them (``grad_reduce`` module doc):
    dense parameters summed over ``dp_group``, expert parameters over ``expert_dp_group``
    (nothing to sum where it is this rank alone), each divided by ``|dp_group|``. Which
    parameters are expert comes from the stage's compiled graphs
    (:meth:`_StageCompiler.expert_parameters`), so the reducers, one
    :class:`~fxoverlap.grad_reduce.GradAllReduce` per group (the roles of one group share
    it: with EP 1, one), are built at the first :meth:`start`, when every graph of the stage
    has been compiled (its first step's backwards have run)."""

    def __init__(self, compiler: _StageCompiler, groups, bucket_bytes: int):
        self.compiler, self.groups, self.bucket_bytes = compiler, groups, bucket_bytes
        self.reducers: list | None = None  # grad_reduce.GradAllReduce, once built
        self.roles: dict[str, str] = {}  # parameter name (in the stage module) -> "dense" / "expert"
        self.started = False
        self._graphs = 0  # the stage's compiled graphs the roles were read from

    def _build(self) -> None:
        from fxoverlap.grad_reduce import GradAllReduce

        expert = self.compiler.expert_parameters()
        roles = {name: "expert" if id(p) in expert else "dense"
                 for name, p in self.compiler.module.named_parameters()}
        if self.reducers is not None:
            if roles != self.roles:  # a graph compiled after the first step changed a role
                changed = sorted(k for k in roles if roles[k] != self.roles.get(k))
                raise PipelineError(
                    f"pipeline stage {self.compiler.stage.stage_index}: a graph compiled after the first step "
                    f"reads parameters {changed[:5]} in another role (expert or dense) than the first step's "
                    f"graphs; their gradients reduce over the group the first step chose")
            self._graphs = len(self.compiler.steps)
            return
        by_group: dict[int | None, tuple] = {}
        for name, p in self.compiler.module.named_parameters():
            group, _ = self.groups.of(roles[name])
            by_group.setdefault(None if group is None else id(group), (group, []))[1].append(p)
        self.reducers = [GradAllReduce(ps, group, self.bucket_bytes, divisor=self.groups.dp_size)
                         for group, ps in by_group.values()]
        self.roles, self._graphs = roles, len(self.compiler.steps)

    def buckets(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket of every reducer, in the order they are issued."""
        return [b for r in self.reducers or () for b in r.buckets()]

    def start(self) -> None:
        """Issue every reducer's all-reduces (after the stage's last backward of the step)."""
        if self.reducers is None or self._graphs != len(self.compiler.steps):
            self._build()
        self.started = True
        for r in self.reducers:
            r.start()

    def finish(self) -> None:
        for r in self.reducers:
            r.finish()
        self.started = False


class _StageCompiler:
    """One local ``PipelineStage``: its module compiled by fxoverlap's backend (on the first
    call, as torch.compile does), the compiled steps it built, and the stage's forward."""

    def __init__(self, stage, config: OverlapConfig, registry: dict[int, list[Stage]], n_microbatches: int,
                 weight_last: bool):
        self.stage = stage
        self.config = config
        self.registry = registry
        self.steps: list = []  # backend_autograd.CompiledStep, one per Dynamo graph of the stage module
        # (dp_group) for each of steps: its graph inputs that are parameters of the stage module
        # (Dynamo passes the parameter objects), by input index; whose roles the reduction reads
        self.graph_params: list[dict[int, nn.Parameter]] = []
        self.forward_calls = 0  # F steps run (each a call of the compiled stage module)
        self.backwards = 0  # backwards of this stage run in this step (through autograd or merged)
        self.n_microbatches = n_microbatches
        # pipeline_schedule(dp_group=...): the stage's gradients averaged over the DP group,
        # issued after its last backward, finished at the end of the step, where pipelining's
        # gradient scaling (deferred to then: scale_factor) follows
        self.reducer: _StageReduction | None = None
        self.scale_factor: int | None = None
        # (forward?, microbatch) of the sends an OVERLAP_F_B step issued early (_EarlySends);
        # the schedule's own SEND_F / SEND_B action for them finds no ops left
        self.sent: set[tuple[bool, int]] = set()
        # a ZeroBubble schedule (BACKWARD_WEIGHT actions): weight gradients computed last, so
        # BACKWARD_INPUT can leave them to BACKWARD_WEIGHT; by microbatch, the calls whose
        # weight part a BACKWARD_INPUT left (backend_autograd.StepRun)
        self.weight_last = weight_last
        self.weight_runs: dict[int, list] = {}
        # merged steps (OVERLAP_F_B): the backward another call of this rank runs in turns with
        # the next forward of this stage's compiled steps
        from fxoverlap.backend_autograd import Turns

        self.turns = Turns()
        # the local shard -> DTensor of each DTensor input of this stage's calls (_LocalShards), for
        # the backward outside autograd: keyed weakly by the shard object (identity, not id(): an
        # entry goes with its shard, so a later tensor at the same address is never taken for one)
        self.shards = WeakTensorKeyDictionary()
        self.module = stage.submod
        self.compiled = torch.compile(stage.submod, backend=self._backend, dynamic=False, fullgraph=False)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        from fxoverlap.backend_autograd import compile_step
        from fxoverlap.backend_fallback import FALLBACK_ERRORS, BackendUnsupported, has_all_to_all

        where = f"pipeline stage {self.stage.stage_index} ({type(self.module).__name__})"
        if not torch.is_grad_enabled():  # eval(): nothing to overlap with
            return gm.forward
        if self.reducer is not None:
            own = {id(p) for p in self.module.parameters()}
            params = {i: t for i, t in enumerate(example_inputs) if isinstance(t, nn.Parameter) and id(t) in own}
        example_inputs, unwrapped = _unwrap_dtensor_inputs(gm, list(example_inputs), where)
        try:
            step = compile_step(gm, example_inputs, self.config, weight_last=self.weight_last, turns=self.turns)
        except (BackendUnsupported, *FALLBACK_ERRORS) as e:
            # no silent fallback: the user asked for fxoverlap on this stage
            raise PipelineError(f"fxoverlap cannot compile {where}: {type(e).__name__}: {e}") from e
        if step.capture.num_layers == 0 and has_all_to_all(gm):
            raise StageLayersNotFound(
                f"{where}: the stage module runs all-to-alls but fxoverlap found no decoder-layer list "
                f"holding them; a stage module's decoder layers must be the entries of one nn.ModuleList or "
                f"nn.ModuleDict (torchtitan's PP split keeps `layers` as a ModuleDict with the original "
                f"names), or name the container with OverlapConfig(layer_container='...')")
        step.keep_args = True  # for OVERLAP_F_B's backward outside autograd (backward_in_turns)
        self.steps.append(step)
        if self.reducer is not None:
            self.graph_params.append(params)
        self.registry.setdefault(self.stage.stage_index, []).extend(step.stages)
        return _LocalShards(step, unwrapped, self.shards) if unwrapped else step

    def expert_parameters(self) -> set[int]:
        """The ids of the stage module's parameters that are ``"expert"`` in every compiled
        graph that reads them (``passes/reduce.py: parameter_roles``: only experts stages read
        them); a parameter no graph reads is not among them (it counts as dense)."""
        from fxoverlap.passes.reduce import parameter_roles

        roles: dict[int, set[str]] = {}
        for step, params in zip(self.steps, self.graph_params):
            for name, role in parameter_roles(step.capture).items():
                p = params.get(step.index_of.get(name, -1))
                if p is not None:
                    roles.setdefault(id(p), set()).add(role)
        return {i for i, r in roles.items() if r == {"expert"}}

    def backward_finished(self, mb: int, deferred: list) -> None:
        """Microbatch ``mb``'s backward (B or I) ran; ``deferred``: the calls whose weight part it
        left to ``BACKWARD_WEIGHT`` (:func:`_deferrable_runs`; then it counts done there)."""
        if deferred:
            self.weight_runs[mb] = deferred
        else:
            self.backward_done()

    def weight_step(self, mb: int) -> None:
        """A ``BACKWARD_WEIGHT``: the weight gradients microbatch ``mb``'s ``BACKWARD_INPUT`` left,
        added into ``p.grad``; nothing where it left none (then that backward was counted done)."""
        runs = self.weight_runs.pop(mb, None)
        if not runs:
            return
        for run in runs:
            _accumulate(run.args, run.step.weight_grads(run), self.shards)
        self.backward_done()

    def backward_done(self) -> None:
        """One backward of this stage ran; after its last of the step, the DP reduction starts."""
        self.backwards += 1
        if self.reducer is not None and self.backwards == self.n_microbatches:
            self.reducer.start()

    def begin_step(self) -> None:
        self.backwards = 0
        self.weight_runs.clear()
        self.sent.clear()

    def take_sent(self, fwd: bool, mb: int) -> bool:
        """Whether an OVERLAP_F_B step already sent this (forward?, microbatch); forgets it."""
        if (fwd, mb) in self.sent:
            self.sent.discard((fwd, mb))
            return True
        return False

    def finish_step(self) -> None:
        """End of the step: the DP reduction lands in ``p.grad``, then pipelining's gradient scaling."""
        if self.reducer is None:
            return
        if not self.reducer.started:
            raise PipelineError(f"pipeline stage {self.stage.stage_index}: the step ended after {self.backwards} "
                                f"backwards of this stage, not {self.n_microbatches}; its gradients were not reduced "
                                f"over dp_group")
        self.reducer.finish()
        if self.scale_factor is not None:
            self.stage.scale_grads(self.scale_factor)
            self.scale_factor = None

    def forward(self, *args, **kwargs):
        from torch._dynamo.exc import BackendCompilerFailed

        sub = self.stage.submod
        self.forward_calls += 1
        # split sizes read on the host (torchtitan's all-to-all dispatcher: .tolist()) stay in
        # the graph as unbacked sizes, so the stage is one graph with whole layers; a break
        # there would leave pieces of layers, which the stage compile refuses
        try:
            with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
                if isinstance(sub, nn.parallel.DistributedDataParallel):
                    with sub.no_sync():
                        return self.compiled(*args, **kwargs)
                return self.compiled(*args, **kwargs)
        except BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, FxOverlapError):
                raise inner from e
            raise


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _unwrap_dtensor_inputs(gm: torch.fx.GraphModule, example_inputs: list,
                           where: str) -> tuple[list, tuple[int, ...]]:
    """Make the DTensor inputs of a stage's Dynamo graph plain: the graph then takes each
    one's local shard (``to_local()``) in its place. torchtitan's EP holds its expert weights
    as DTensors and its experts only read ``w.to_local()``; the backend compiles plain
    tensors. Returns the new example inputs and the indices of the inputs unwrapped (the
    call passes ``w.to_local()`` for them: :class:`_LocalShards`), so autograd's own
    ``to_local`` backward turns each local gradient into the parameter's DTensor gradient,
    as in eager. A DTensor input the graph uses other than through ``to_local()`` raises."""
    phs = list(gm.graph.find_nodes(op="placeholder"))
    unwrapped = []
    for i, (ph, t) in enumerate(zip(phs, example_inputs)):
        if not _is_dtensor(t):
            continue
        users = list(ph.users)
        other = [u for u in users if not (u.op == "call_method" and u.target == "to_local" and len(u.args) == 1
                                          and all(v is None for v in u.kwargs.values()))]
        if other or not users:
            uses = ", ".join(f"{u.op} {getattr(u.target, '__name__', u.target)}" for u in other[:3])
            raise PipelineError(
                f"{where}: graph input {ph.name} is a DTensor that the stage module uses "
                f"{'in ' + uses if uses else 'nowhere'}; "
                f"fxoverlap compiles a pipeline stage whose DTensor parameters are read only through "
                f"to_local() (as torchtitan's expert-parallel experts read theirs), the local shards being "
                f"plain tensors. Read the parameter with .to_local() in the module, or use "
                f"fxoverlap.optimize(model, ep_group) without pipeline parallelism, which traces DTensors")
        local = t.to_local().detach()
        ph.meta["example_value"] = users[0].meta.get("example_value", local)  # Dynamo's fake local shard
        for u in users:
            u.replace_all_uses_with(ph)
            gm.graph.erase_node(u)
        example_inputs[i] = local.requires_grad_(t.requires_grad)
        unwrapped.append(i)
    if unwrapped:
        gm.graph.lint()
        gm.recompile()
    return example_inputs, tuple(unwrapped)


class _LocalShards:
    """A compiled stage graph whose DTensor inputs were unwrapped (:func:`_unwrap_dtensor_inputs`):
    called with Dynamo's inputs, it passes ``to_local()`` of each of those (through autograd,
    as the module's own ``to_local()`` did) and records each local shard's DTensor in
    ``shards`` (the stage's :attr:`_StageCompiler.shards`), for the backward outside autograd
    (:func:`_merged_backward`, :func:`_accumulate`): the call keeps the shards in its
    ``StepRun.args`` until then, so each entry lives exactly as long as it is needed."""

    def __init__(self, step, unwrapped: tuple[int, ...], shards: WeakTensorKeyDictionary):
        self.step, self.unwrapped, self.shards = step, unwrapped, shards

    def __call__(self, *args):
        args = list(args)
        for i in self.unwrapped:
            shard = args[i].to_local()
            self.shards[shard] = args[i]
            args[i] = shard
        return self.step(*args)


class _OverlapStage:
    """The ``PipelineStage`` (the user's stage class, subclassed: :func:`_stage_class`) whose F
    and B run as fxoverlap programs, built from the user's stage: it takes over that stage's
    state as pipelining built it (module, index, group, metadata), so the user's object is
    not used after :func:`pipeline_schedule`. What it changes (module doc):

    - ``forward_maybe_with_nosync``, the one place pipelining calls the stage module: the
      fxoverlap-compiled module instead (``submod`` stays the user's module);
    - ``get_fwd_send_ops`` / ``get_bwd_send_ops``: nothing for what an ``OVERLAP_F_B`` step
      already sent (:class:`_EarlySends`), so nothing is sent twice and the ``bwd_cache``
      entry (which ``get_bwd_send_ops`` pops) is popped once. (The runtime's ``SEND_F`` /
      ``SEND_B`` actions take no custom function.)

    The multi-stage schedules run their backward actions and ``REDUCE_GRAD`` through the
    custom functions :func:`pipeline_schedule` registers; the single-stage ones, which take
    none, through :class:`_SingleScheduleStage`."""

    def __init__(self, stage, config: OverlapConfig, registry: dict[int, list[Stage]], n_microbatches: int,
                 weight_last: bool, groups) -> None:
        vars(self).update(vars(stage))
        self.fxoverlap_state = _StageCompiler(self, config, registry, n_microbatches, weight_last)
        if groups is not None:
            self.fxoverlap_state.reducer = _StageReduction(self.fxoverlap_state, groups,
                                                           int(config.reduce_bucket_mb * 2**20))

    def forward_maybe_with_nosync(self, *args, **kwargs):
        return self.fxoverlap_state.forward(*args, **kwargs)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return [] if self.fxoverlap_state.take_sent(True, fwd_chunk_id) else super().get_fwd_send_ops(fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        return [] if self.fxoverlap_state.take_sent(False, bwd_chunk_id) else super().get_bwd_send_ops(bwd_chunk_id)


class _SingleScheduleStage(_OverlapStage):
    """:class:`_OverlapStage` for ``Schedule1F1B`` / ``ScheduleGPipe``, which call the stage's
    methods directly (no custom functions): ``backward_one_chunk`` counts the stage's backwards
    (the ``dp_group`` reduction starts after the last), and ``perform_reduce_grad`` with
    ``dp_group`` leaves the gradient scaling to the end of the step, after the reduction
    (:meth:`_StageCompiler.finish_step`), as :func:`_reduce_grad_action` does for the others."""

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward)
        self.fxoverlap_state.backward_done()
        return out

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.fxoverlap_state.reducer is None:
            return super().perform_reduce_grad(grad_scale_factor)
        self.fxoverlap_state.scale_factor = grad_scale_factor


@functools.cache
def _stage_class(cls: type, single: bool) -> type:
    """The user's stage class ``cls`` with :class:`_OverlapStage`'s changes (``single``: a
    single-stage schedule's, :class:`_SingleScheduleStage`)."""
    return type(f"FxOverlap{cls.__name__}", (_SingleScheduleStage if single else _OverlapStage, cls), {
        "__doc__": f"{cls.__name__} whose F/B steps run as fxoverlap programs (fxoverlap.pipeline_schedule).",
        "__module__": __name__,
    })


class _PipelineRun:
    """What fxoverlap keeps for one schedule (its ``fxoverlap_run``): the local stages, the
    options, the counts of ``OVERLAP_F_B`` steps, and the current step's arguments and early
    sends (:class:`_EarlySends`)."""

    def __init__(self, stages: list, registry: dict[int, list[Stage]], merge: bool, ep_group, dp_group,
                 expert_dp_group, config: OverlapConfig) -> None:
        self.stages = {st.stage_index: st for st in stages}  # _OverlapStage, by stage index
        self.registry = registry
        self.merge, self.config = merge, config
        self.ep_group, self.dp_group, self.expert_dp_group = ep_group, dp_group, expert_dp_group
        self.overlap_steps = 0  # OVERLAP_F_B steps run by the custom function
        self.merged_steps = 0  # of which F and B ran in turns (the rest: F then B)
        self.step_args: dict | None = None  # step()'s return_outputs and loss_kwargs, during a step
        self.sends: list = []  # works of the sends OVERLAP_F_B steps issued (_EarlySends)

    def begin_step(self, return_outputs: bool, loss_kwargs: dict | None) -> None:
        self.step_args = {"return_outputs": return_outputs, "loss_kwargs": loss_kwargs}
        self.sends = []
        for st in self.stages.values():
            st.fxoverlap_state.begin_step()

    def finish_step(self) -> None:
        while self.sends:  # as the runtime waits its own sends, at the end of the step
            pl.wait_batch_p2p(self.sends.pop())
        for st in self.stages.values():
            st.fxoverlap_state.finish_step()  # dp_group: the reductions issued after each stage's last backward


def _recv_works(schedule, stages, sub) -> list | None:
    """The works of what ``sub`` (a forward or backward action) receives, taken from the
    schedule as the runtime takes them (``None``: it receives nothing: first/last stage, or
    the V-schedule's local hand-off); wait on them with :func:`_wait_works`."""
    from torch.distributed.pipelining.schedules import FORWARD

    mb, idx = sub.microbatch_index, sub.stage_index
    stage = stages[idx]
    if sub.computation_type == FORWARD:
        if not stage.is_first and idx - 1 not in stages:
            if (idx, mb) not in pl.fwd_recv_ops(schedule):
                raise PipelineError(f"computing {sub} before receiving its input")
            return pl.fwd_recv_ops(schedule).pop((idx, mb))
    elif not stage.is_last and idx + 1 not in stages:
        if (idx, mb) not in pl.bwd_recv_ops(schedule):
            raise PipelineError(f"computing {sub} before receiving its gradients")
        return pl.bwd_recv_ops(schedule).pop((idx, mb))
    return None


def _wait_works(works: list | None, what: str) -> None:
    """Wait for a receive's works (``what``: ``"fwd_recv"`` / ``"bwd_recv"``, for tracing)."""
    if works is not None:
        pl.wait_batch_p2p(works)


def _wait_recv(schedule, stages, sub) -> None:
    """Wait for what ``sub`` (a forward or backward action) receives, as the runtime does."""
    from torch.distributed.pipelining.schedules import FORWARD

    _wait_works(_recv_works(schedule, stages, sub), "fwd_recv" if sub.computation_type == FORWARD else "bwd_recv")


def _after_wait(works: list | None, gen):
    """``gen`` (B's backward in turns), which waits for B's received gradients only when its
    first chunk is about to run: after F's first chunk, whose all-to-all it then runs under."""
    _wait_works(works, "bwd_recv")
    yield from gen


class _EarlySends:
    """The sends of an ``OVERLAP_F_B`` step's results, issued as soon as each is produced:
    F's output activation when F has returned (before the rest of B runs), B's input
    gradients when B is done. The schedule lists them as the ``SEND_F`` / ``SEND_B`` actions
    right after the step; only those are taken, in that order (a send waits for the ones
    before it, which keeps the order in which the peer's receives match them), and only up
    to the first action that is not one of them (a receive ``defer_pp_recv`` placed between
    them must still be issued first, for its deadlock-free order). So this rank issues its
    P2P ops in the schedule's order; only the compute after them moves. The ops are
    pipelining's (``get_fwd_send_ops`` / ``get_bwd_send_ops``, ``_batch_p2p``); the works are
    kept in the schedule's :class:`_PipelineRun` and waited at the end of ``step``, as the runtime waits its own."""

    def __init__(self, schedule, stages: dict, action, subs: list):
        from torch.distributed.pipelining.schedules import FORWARD, SEND_B, SEND_F

        self.schedule, self.stages = schedule, stages
        self.pending: list = []  # (send action, the sub-action that produces what it sends)
        self.produced: set = set()
        order = (pl.pipeline_order_with_comms(schedule) or {}).get(schedule.rank) or []
        # the runtime passes the action object of its list: find it by identity
        pos = next((i for i, a in enumerate(order) if a is action), None)
        if pos is None:
            return
        mine = {(s.stage_index, s.microbatch_index, s.computation_type == FORWARD): s for s in subs}
        for a in order[pos + 1:]:
            if a.computation_type not in (SEND_F, SEND_B):
                break
            sub = mine.get((a.stage_index, a.microbatch_index, a.computation_type == SEND_F))
            if sub is None:
                break
            self.pending.append((a, sub))

    def done(self, sub) -> None:
        """``sub`` has produced what it sends: issue every send now ready, in the schedule's order."""
        from torch.distributed.pipelining.schedules import SEND_F

        self.produced.add(sub)
        while self.pending and self.pending[0][1] in self.produced:
            send, _ = self.pending.pop(0)
            stage, mb = self.stages[send.stage_index], send.microbatch_index
            fwd = send.computation_type == SEND_F
            ops = stage.get_fwd_send_ops(mb) if fwd else stage.get_bwd_send_ops(mb)
            self.schedule.fxoverlap_run.sends.append(
                pl.batch_p2p(ops, desc="fxoverlap_fwd_send" if fwd else "fxoverlap_bwd_send"))
            stage.fxoverlap_state.sent.add((fwd, mb))


def _forward(schedule, stages, sub, ctx) -> None:
    """A FORWARD action after its receive: forward, loss, local hand-off."""
    mb, idx = sub.microbatch_index, sub.stage_index
    stage = stages[idx]
    args = schedule.fxoverlap_run.step_args
    output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=args["return_outputs"])
    pl.compute_loss(schedule, stage, output, ctx.target_mbs, mb)
    if idx + 1 in stages:
        stages[idx + 1].set_local_fwd_input(output, mb)


def _backward(schedule, stages, sub) -> None:
    """A FULL_BACKWARD / BACKWARD_INPUT action after its receive, through autograd: pipelining's
    ``backward_one_chunk`` runs the whole autograd backward (fxoverlap's backward is one node
    handing out input and weight gradients together, which ``torch.autograd.grad(inputs=...)``
    cannot split); a ``BACKWARD_INPUT`` of a ZeroBubble schedule marks the calls whose weight
    part it leaves to ``BACKWARD_WEIGHT`` first (:func:`_deferrable_runs`)."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT

    mb, idx = sub.microbatch_index, sub.stage_index
    stage = stages[idx]
    state = stage.fxoverlap_state
    deferred = (_deferrable_runs(stage, mb) if sub.computation_type == BACKWARD_INPUT and state.weight_last
                else [])
    # DDP reduces at the stage's last backward: the one that completes the step's gradients
    # (a BACKWARD_INPUT that leaves nothing to BACKWARD_WEIGHT can be it, which pipelining does
    # not flag); a deferring backward is never DDP's (_deferrable_runs)
    last = not deferred and state.backwards + 1 == state.n_microbatches
    stage.backward_one_chunk(mb, loss=pl.get_loss(schedule, stage, mb), full_backward=True, last_backward=last)
    state.backward_finished(mb, deferred)
    if idx - 1 in stages:
        stages[idx - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


def _backward_action(schedule, action, ctx) -> None:
    """The FULL_BACKWARD / BACKWARD_INPUT custom function: receive, then :func:`_backward`."""
    stages = schedule.fxoverlap_run.stages
    _wait_recv(schedule, stages, action)
    _backward(schedule, stages, action)


def _weight_action(schedule, action, ctx) -> None:
    """The BACKWARD_WEIGHT custom function: the weight gradients its BACKWARD_INPUT left."""
    stage = schedule.fxoverlap_run.stages[action.stage_index]
    if stage.has_backward:
        stage.fxoverlap_state.weight_step(action.microbatch_index)


def _reduce_grad_action(schedule, action, ctx) -> None:
    """The REDUCE_GRAD custom function (after the stage's last backward): pipelining's
    ``perform_reduce_grad``, or with ``dp_group`` the gradient scaling left to the end of the
    step, after the reduction in flight (:meth:`_StageCompiler.finish_step`)."""
    stage = schedule.fxoverlap_run.stages[action.stage_index]
    state = stage.fxoverlap_state
    factor = state.n_microbatches if schedule.scale_grads else 1
    if state.reducer is None:
        stage.perform_reduce_grad(factor)
    else:
        state.scale_factor = factor


def _reaches_only(loss: torch.Tensor, node) -> bool:
    """Whether every path of ``loss``'s autograd graph back to a leaf goes through ``node``."""
    todo, seen = [loss.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn is node or id(fn) in seen:
            continue
        seen.add(id(fn))
        if type(fn).__name__ == "AccumulateGrad":
            return False
        todo.extend(nf for nf, _ in fn.next_functions)
    return True


def _no_hooks(t: torch.Tensor) -> bool:
    return not getattr(t, "_post_accumulate_grad_hooks", None) and not getattr(t, "_backward_hooks", None)


def _calls_of(outputs: Sequence) -> list:
    """The fxoverlap calls (``backend_autograd.StepRun``) whose outputs ``outputs`` depend on, walking
    their autograd graph (a stage with graph breaks has several)."""
    from fxoverlap.backend_autograd import StepRun

    todo = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, runs = set(), {}
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        run = getattr(fn, "run", None)
        if isinstance(run, StepRun):
            runs[id(run)] = run
        todo.extend(nf for nf, _ in fn.next_functions)
    return list(runs.values())


def _deferrable_runs(stage, mb: int) -> list:
    """The calls of microbatch ``mb``'s forward whose weight gradients its ``BACKWARD_INPUT``
    leaves to its ``BACKWARD_WEIGHT``, each marked so (``StepRun.defer_weights``): every call,
    when each has a weight-gradient part and gradients that only fxoverlap accumulates (no
    DDP/FSDP module, no gradient hooks, no DTensor local shards: autograd must run those);
    else none (``BACKWARD_INPUT`` then runs the whole backward)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(stage.submod, (nn.parallel.DistributedDataParallel, FSDPModule)) or mb not in pl.fwd_cache(stage):
        return []
    runs, shards = _calls_of(pl.fwd_cache(stage)[mb][0]), stage.fxoverlap_state.shards
    for run in runs:
        grads = [t for t in run.args if isinstance(t, torch.Tensor) and t.requires_grad]
        if (run.state is None or not run.step.splits_weight_grads or run.next_segment != 0
                or any(t in shards or (t.is_leaf and not _no_hooks(t)) for t in grads)):
            return []
    for run in runs:
        run.defer_weights = True
    return runs


def _accumulate(args: Sequence, grads: dict[int, torch.Tensor], shards: WeakTensorKeyDictionary) -> None:
    """Add gradients of a call's graph inputs (by index) into their ``.grad`` as AccumulateGrad
    does: the first is taken, later ones added; a DTensor's local shard through ``to_local``'s
    backward, as autograd would (``shards``: the stage's local shard -> DTensor)."""
    local, local_grads = [], []
    for i, g in grads.items():
        t = args[i]
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            continue
        if t in shards:
            local.append(t)
            local_grads.append(g)
            continue
        if t.grad is None:
            t.grad = g
        else:
            t.grad += g
    if local:
        torch.autograd.backward(local, local_grads)


def _merged_backward(schedule, stages, sub):
    """B(j) of a merged step, run outside autograd in turns with F(i): ``(generator, finish)``,
    or ``None`` when this backward cannot be taken out of autograd (then F and B run one
    after the other, through autograd): the stage's outputs are not all outputs of one
    fxoverlap call (graph breaks, eager code after the graph), a DDP/FSDP module or a
    gradient hook that autograd must run, a loss that reaches parameters outside the
    stage program, random ops (their draws would interleave)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT

    from fxoverlap.backend_autograd import StepRun

    mb, idx = sub.microbatch_index, sub.stage_index
    stage = stages[idx]
    if not stage.has_backward or isinstance(stage.submod, (nn.parallel.DistributedDataParallel, FSDPModule)):
        return None
    if mb not in pl.fwd_cache(stage):
        return None
    stage_output, input_values = pl.fwd_cache(stage)[mb]
    outs = [t for t in stage_output if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs or len(outs) != len(stage_output):
        return None
    node = outs[0].grad_fn
    run = getattr(node, "run", None)
    if not isinstance(run, StepRun) or run.state is None or any(t.grad_fn is not node for t in outs):
        return None
    step = run.step
    # (a graph break shows here: the last piece's inputs include an activation that is no leaf)
    if not run.args or step.draws_random_numbers():
        return None
    # a local shard of a DTensor parameter (torchtitan's EP) counts as that parameter
    compiler = stage.fxoverlap_state
    leaves = [compiler.shards.get(t, t) for t in run.args if isinstance(t, torch.Tensor) and t.requires_grad]
    if any(not t.is_leaf or not _no_hooks(t) for t in leaves):
        return None
    if any(i not in {t.output_nr for t in outs} for i in step.tangent_pos):
        return None
    if stage.is_last:
        loss = pl.get_loss(schedule, stage, mb)
        if loss is None or not _reaches_only(loss, node):
            return None
        grads = torch.autograd.grad(loss, outs, allow_unused=True)
    else:
        grads = pl.retrieve_recv_grads(stage, mb)
        if len(grads) != len(outs):
            return None
    grad_outputs: list = [None] * len(step.capture.outputs)
    for t, g in zip(outs, grads):
        grad_outputs[t.output_nr] = torch.zeros_like(t) if g is None else g
    # a BACKWARD_INPUT of a ZeroBubble schedule leaves the weight gradients to its BACKWARD_WEIGHT
    deferred = (_deferrable_runs(stage, mb) if sub.computation_type == BACKWARD_INPUT and compiler.weight_last
                else [])
    del pl.fwd_cache(stage)[mb]

    args = run.args  # the generator drops them from the run when done

    def finish() -> None:
        _accumulate(args, run.grads, compiler.shards)
        compiler.backward_finished(mb, deferred)
        grad_inputs = []
        for v in input_values:  # as pipelining's stage_backward
            if isinstance(v, torch.Tensor):
                grad_inputs.append(v.grad)
                v.grad = None
            else:
                grad_inputs.append(None)
        pl.bwd_cache(stage)[mb] = tuple(grad_inputs)[: pl.stage_input_count(stage)]
        if stage.is_last and not stage.is_first:
            for t in stage_output:
                if not t._is_view():
                    t.detach_()
        if idx - 1 in stages:
            stages[idx - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    return step.backward_in_turns(run, grad_outputs), finish


def _overlap_f_b(schedule, action, ctx) -> None:
    """The ``OVERLAP_F_B`` step F(i) ⊗ B(j): the forward program of one stage and the
    backward program of another (or the same) run in turns, each stopping after each of
    its comm stages, so one's compute runs under the other's all-to-alls (on CUDA, each
    program's comm stream). Receives, loss and local hand-offs as ``_PipelineScheduleRuntime``
    runs a FORWARD and a FULL_BACKWARD / BACKWARD_INPUT action. Where B cannot be taken out
    of autograd (:func:`_merged_backward`), F then B."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, FORWARD, FULL_BACKWARD

    run = schedule.fxoverlap_run
    run.overlap_steps += 1
    if action.sub_actions is None:
        raise PipelineError(f"OVERLAP_F_B action {action} carries no sub_actions")
    stages = run.stages
    subs = list(action.sub_actions)
    for sub in subs:
        if sub.computation_type not in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT):
            raise PipelineError(f"OVERLAP_F_B sub-action {sub} is neither a forward nor a backward")
    kinds = [s.computation_type == FORWARD for s in subs]
    sends = _EarlySends(schedule, stages, action, subs)
    if len(subs) == 2 and sorted(kinds) == [False, True] and run.merge:
        f, b = (subs[0], subs[1]) if kinds[0] else (subs[1], subs[0])
        # each receive is waited right before its data is used, not both up front
        f_recv, b_recv = _recv_works(schedule, stages, f), _recv_works(schedule, stages, b)
        merged = _merged_backward(schedule, stages, b)
        if merged is not None:
            gen, finish = merged
            _wait_works(f_recv, "fwd_recv")  # F's first chunk runs first
            # F's output is sent as soon as F has returned, before the rest of B runs
            stages[f.stage_index].fxoverlap_state.turns.run(_after_wait(b_recv, gen),
                                                            lambda: _forward(schedule, stages, f, ctx),
                                                            after_forward=lambda: sends.done(f))
            finish()
            sends.done(b)
            run.merged_steps += 1
            return
        for sub, works in ((f, f_recv), (b, b_recv)) if subs[0] is f else ((b, b_recv), (f, f_recv)):
            _wait_works(works, "fwd_recv" if sub is f else "bwd_recv")
            if sub is f:
                _forward(schedule, stages, f, ctx)
            else:
                _backward(schedule, stages, b)
            sends.done(sub)
        return
    for sub in subs:
        _wait_recv(schedule, stages, sub)
        if sub.computation_type == FORWARD:
            _forward(schedule, stages, sub, ctx)
        else:
            _backward(schedule, stages, sub)
        sends.done(sub)


class _LossWithKwargs:
    """The ``loss_fn`` the schedule is built with: the user's, called with the ``loss_kwargs``
    of the step in progress (:class:`_OverlapSchedule`). fxoverlap applies them itself rather
    than passing them to pipelining's ``step``: torch 2.11's pipelining (the oldest torch
    fxoverlap supports) has no ``loss_kwargs`` and would hand them to the stage module as
    model keyword arguments; so they work the same on every torch."""

    def __init__(self, loss_fn: Callable, run: _PipelineRun) -> None:
        self.loss_fn, self.run = loss_fn, run

    def __call__(self, output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        step_kwargs = (self.run.step_args or {}).get("loss_kwargs") or {}
        return self.loss_fn(output, target, **step_kwargs, **kwargs)


class _OverlapSchedule:
    """The user's schedule class (subclassed: :func:`_schedule_class`) over :class:`_OverlapStage` objects:
    its ``step`` keeps ``return_outputs`` for the ``OVERLAP_F_B`` function (pipelining's
    custom-function context does not carry it) and ``loss_kwargs`` for the loss
    (:class:`_LossWithKwargs`; not passed on to pipelining), and after pipelining's step
    waits for the early sends and finishes the ``dp_group`` reductions. fxoverlap's state is
    its ``fxoverlap_run`` (:class:`_PipelineRun`)."""

    def __init__(self, stages, n_microbatches: int, *, fxoverlap_run: _PipelineRun, **kwargs: Any) -> None:
        super().__init__(stages, n_microbatches, **kwargs)
        self.fxoverlap_run = fxoverlap_run

    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, **kwargs):
        run = self.fxoverlap_run
        run.begin_step(return_outputs, loss_kwargs)
        try:
            out = super().step(*args, target=target, losses=losses, return_outputs=return_outputs, **kwargs)
        finally:
            run.step_args = None
        run.finish_step()
        return out

    # read-only views of fxoverlap_run, the names pipeline_schedule documents
    fxoverlap_stages = property(lambda self: self.fxoverlap_run.registry)
    fxoverlap_overlap_steps = property(lambda self: self.fxoverlap_run.overlap_steps)
    fxoverlap_merged_steps = property(lambda self: self.fxoverlap_run.merged_steps)
    fxoverlap_merge = property(lambda self: self.fxoverlap_run.merge)
    fxoverlap_ep_group = property(lambda self: self.fxoverlap_run.ep_group)
    fxoverlap_dp_group = property(lambda self: self.fxoverlap_run.dp_group)
    fxoverlap_expert_dp_group = property(lambda self: self.fxoverlap_run.expert_dp_group)
    fxoverlap_config = property(lambda self: self.fxoverlap_run.config)


@functools.cache
def _schedule_class(cls: type) -> type:
    """``cls`` with :class:`_OverlapSchedule`'s ``step``, of the same name."""
    return type(cls.__name__, (_OverlapSchedule, cls), {
        "__doc__": f"{cls.__name__} whose F/B steps run as fxoverlap programs (fxoverlap.pipeline_schedule).",
        "__module__": __name__,
        "__qualname__": f"pipeline_schedule.{cls.__name__}",
    })


def pipeline_schedule(schedule_cls: type, stages, n_microbatches: int, *, loss_fn: Callable | None = None,
                      ep_group: dist.ProcessGroup | None = None, config: OverlapConfig | None = None,
                      merge: bool = True, dp_group: dist.ProcessGroup | None = None,
                      expert_dp_group: dist.ProcessGroup | None = None, **schedule_kwargs: Any):
    """A ``torch.distributed.pipelining`` schedule whose F and B steps run as fxoverlap programs.

    ``schedule_cls`` is the pipelining schedule class, ``stages`` what it takes (one
    ``PipelineStage`` for single-stage schedules such as ``Schedule1F1B``, a list for
    multi-stage ones such as ``ScheduleDualPipeV``), ``n_microbatches``, ``loss_fn(output,
    target)`` and ``schedule_kwargs`` (``scale_grads``, chunk specs, ...) are passed on to
    it. ``merge=False`` runs each ``OVERLAP_F_B`` as F then B (for comparison). ``ep_group`` is the expert-parallel group of the stage modules' MoE layers (checked;
    the layers hold it themselves); ``config`` the :class:`OverlapConfig` of every stage.
    ``dp_group`` / ``expert_dp_group``: data parallelism, as ``fxoverlap.optimize`` takes them
    (``fxoverlap.grad_reduce``): ``dp_group`` holds the ranks over which the dense parameters
    are replicated (they hold the same stages as this rank, so it meets this rank's pipeline
    group in this rank only; it contains this rank's EP group, whose ranks see different
    tokens), ``expert_dp_group`` the ranks that hold
    this rank's experts (one per EP group; ``None``: ``dp_group`` with EP 1, this rank alone
    when ``ep_group`` is all of ``dp_group``). Dense gradients are summed over ``dp_group``,
    expert ones over ``expert_dp_group``, both divided by ``|dp_group|``. A parameter is expert
    when only experts stages of the stage's compiled graphs read it (known after its first
    compile). The reduction is issued (asynchronously, in flat buckets of
    ``config.reduce_bucket_mb``) right after the stage's last backward of the step and finished
    at the end of the step, before pipelining's gradient scaling. Plain (not DDP-wrapped)
    stage modules without DTensor parameters.

    Returns an instance of a subclass of ``schedule_cls`` (of the same name; it keeps
    ``step``'s ``return_outputs`` for the ``OVERLAP_F_B`` function and applies its
    ``loss_kwargs`` to ``loss_fn`` itself, on torch 2.11 too, whose pipelining lacks them) over
    fxoverlap's stages built from ``stages`` (:class:`_OverlapStage`: the user's stage objects
    are not used after this): ``schedule.step(x, target=y, losses=losses)`` as with
    pipelining. After the first step, ``schedule.fxoverlap_stages`` maps each local pipeline
    stage's index to its fxoverlap ``Stage`` objects; ``schedule.fxoverlap_run`` holds the
    rest of fxoverlap's state (:class:`_PipelineRun`).
    """
    supported = supported_schedules()
    if not isinstance(schedule_cls, type) or schedule_cls not in supported:
        name = getattr(schedule_cls, "__name__", repr(schedule_cls))
        raise UnsupportedSchedule(
            f"fxoverlap.pipeline_schedule runs {', '.join(c.__name__ for c in supported)}; got {name}. "
            f"Other schedules (ScheduleLoopedBFS, subclasses, schedules loaded from CSV) are not supported "
            f"yet (docs/pipeline_parallel.md)")
    if ep_group is not None and not isinstance(ep_group, dist.ProcessGroup):
        raise PipelineInputError(f"ep_group must be a torch.distributed ProcessGroup or None, got {type(ep_group).__name__}")
    for name, group in (("dp_group", dp_group), ("expert_dp_group", expert_dp_group)):
        # a rank outside a new_group's ranks gets a placeholder: grad_reduce.check_groups says so
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER and \
                not isinstance(group, dist.ProcessGroup):
            raise PipelineInputError(f"{name} must be a torch.distributed ProcessGroup or None, got "
                                     f"{type(group).__name__}")
    config = config or OverlapConfig()
    # with dp_group, the reduction's bucket size is honoured (its mode is all_reduce: checked below)
    honoured = {"grad_reduce", "reduce_bucket_mb"} if dp_group is not None else set()
    if refused := refused_fields(config, PIPELINE, honoured):
        raise PipelineError(f"pipeline_schedule cannot honour OverlapConfig fields {list(refused)}: "
                            + "; ".join(refused.values()))
    multi = _is_multi_stage(schedule_cls)
    local = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    if not multi and isinstance(stages, (list, tuple)):
        raise PipelineInputError(f"{schedule_cls.__name__} takes one PipelineStage, got a {type(stages).__name__}")
    groups = None
    if dp_group is not None or expert_dp_group is not None:
        groups = _check_dp(local, dp_group, ep_group, expert_dp_group, config)
    from torch.distributed.fsdp import FSDPModule

    if fsdp := [st.stage_index for st in local if isinstance(st.submod, FSDPModule)]:
        raise PipelineError(f"pipeline stages {fsdp}: FSDP-wrapped stage modules are not supported by "
                            f"fxoverlap.pipeline_schedule yet (DDP is; docs/pipeline_parallel.md)")
    for st in local:
        if isinstance(st, _OverlapStage):
            raise PipelineError(f"pipeline stage {st.stage_index} is already run by another fxoverlap schedule; "
                                f"pass the PipelineStage you built")
        if getattr(st, "dw_builder", None) is not None:  # pipelining would call it after our backward
            raise PipelineError(f"pipeline stage {st.stage_index} has a dw_builder of its own; fxoverlap runs the "
                                f"stage's whole backward itself and uses that slot (docs/pipeline_parallel.md)")
    registry: dict[int, list[Stage]] = {}
    weight_last = schedule_cls.__name__ in _WEIGHT_SPLIT_SCHEDULES
    ours = [_stage_class(type(st), not multi)(st, config, registry, n_microbatches, weight_last, groups)
            for st in local]
    run = _PipelineRun(ours, registry, merge, ep_group, dp_group, expert_dp_group, config)
    schedule = _schedule_class(schedule_cls)(ours if multi else ours[0], n_microbatches,
                                             loss_fn=None if loss_fn is None else _LossWithKwargs(loss_fn, run),
                                             fxoverlap_run=run, **schedule_kwargs)
    if multi:  # every supported multi-stage schedule is a _PipelineScheduleRuntime
        from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD,
                                                            OVERLAP_F_B, REDUCE_GRAD)

        for kind, fn in ((FULL_BACKWARD, _backward_action), (BACKWARD_INPUT, _backward_action),
                         (BACKWARD_WEIGHT, _weight_action), (REDUCE_GRAD, _reduce_grad_action),
                         (OVERLAP_F_B, _overlap_f_b)):
            schedule.register_custom_function(kind, functools.partial(fn, schedule))
    return schedule


def _check_dp(stages: list, dp_group: dist.ProcessGroup | None, ep_group: dist.ProcessGroup | None,
              expert_dp_group: dist.ProcessGroup | None, config: OverlapConfig):
    """What ``pipeline_schedule(..., dp_group=..., expert_dp_group=...)`` needs of the stages
    and groups, checked on this rank without communication: the groups as ``fxoverlap.optimize``
    checks them (``grad_reduce.check_groups``), then what pipelining adds. Returns the
    ``grad_reduce.ReduceGroups``."""
    from torch.distributed.tensor import DTensor

    from fxoverlap.grad_reduce import check_groups

    groups = check_groups(ep_group, dp_group, expert_dp_group, caller="fxoverlap.pipeline_schedule")
    me = dist.get_rank()
    dp = set(groups.dp_ranks)
    if config.grad_reduce != "all_reduce":
        raise PipelineError(f"pipeline_schedule(dp_group=...) reduces with all_reduce; OverlapConfig(grad_reduce="
                            f"{config.grad_reduce!r}) (sharded gradients) is not supported under pipeline parallelism")
    seen: dict[int, int] = {}
    for st in stages:
        where = f"pipeline stage {st.stage_index} ({type(st.submod).__name__})"
        if isinstance(st.submod, nn.parallel.DistributedDataParallel):
            raise PipelineInputError(f"{where} is wrapped in DistributedDataParallel and dp_group is given: the "
                                     f"gradients would be reduced twice; pass the plain stage module, or no dp_group")
        pp = set(dist.get_process_group_ranks(st.group)) if st.group is not None else set(range(dist.get_world_size()))
        if dp & pp != {me}:
            raise PipelineInputError(
                f"{where}: dp_group {sorted(dp)} and the pipeline group {sorted(pp)} share ranks {sorted(dp & pp)}; "
                f"the DP group holds one rank of each pipeline (the ranks that hold the same stages), which meets "
                f"this rank's pipeline group in this rank only")
        for name, p in st.submod.named_parameters():
            if isinstance(p, DTensor):
                raise PipelineError(f"{where}: parameter {name} is a DTensor; pipeline_schedule(dp_group=...) "
                                    f"reduces plain gradients (reduce DTensor gradients over their mesh yourself)")
            if seen.setdefault(id(p), st.stage_index) != st.stage_index:
                raise PipelineError(f"{where}: parameter {name} belongs to pipeline stage {seen[id(p)]} too; its "
                                    f"gradient is not final after either stage's last backward, where dp_group's "
                                    f"reduction starts (tied weights across stages are not supported with dp_group)")
    return groups


def stage_layout(schedule: type | str, pp: int, pp_rank: int) -> tuple[int, list[int]]:
    """(number of stages, the stage indices PP rank ``pp_rank`` of ``pp`` holds) as ``schedule``
    places them: one stage per rank for the single-stage schedules, two for the looped (rank
    r: r and r + pp) and the V-shaped ones (rank r: r and 2·pp − 1 − r)."""
    name = schedule if isinstance(schedule, str) else schedule.__name__
    if name in ("Schedule1F1B", "ScheduleGPipe"):
        return pp, [pp_rank]
    if name in ("ScheduleDualPipeV", "ScheduleZBVZeroBubble"):
        return 2 * pp, [pp_rank, 2 * pp - 1 - pp_rank]
    if name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        return 2 * pp, [pp_rank, pp_rank + pp]
    raise UnsupportedSchedule(f"stage_layout: no stage layout for schedule {name!r}")


def pp_ep_groups(ep: int) -> tuple[int, int, int, dist.ProcessGroup, dist.ProcessGroup]:
    """The PP x EP process groups of the default group, ranks laid out row-major (rank =
    pp_rank * ep + ep_rank, as ``init_device_mesh(..., (pp, ep))`` lays them): ``(pp, pp_rank,
    ep_rank, ep_group, pp_group)``. Every rank creates every group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ep:
        raise PipelineInputError(f"pp_ep_groups: world size {world} is not a multiple of the EP size {ep}")
    pp = world // ep
    pp_rank, ep_rank = rank // ep, rank % ep
    ep_group = pp_group = None
    for r in range(pp):
        g = dist.new_group(list(range(r * ep, (r + 1) * ep)))
        if r == pp_rank:
            ep_group = g
    for e in range(ep):
        g = dist.new_group(list(range(e, world, ep)))
        if e == ep_rank:
            pp_group = g
    return pp, pp_rank, ep_rank, ep_group, pp_group
