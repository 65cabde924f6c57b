"""``fxoverlap.optimize``: the engine that captures, splits, schedules and runs a model."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn

from fxoverlap.config import OverlapConfig
from fxoverlap.cudagraphs import GraphCache
from fxoverlap.dispatch_ops import overflow_guard
from fxoverlap.expert_parallel import explain_capture_error
from fxoverlap import torchtitan_experts
from fxoverlap.fp8_ops import check_expert_dtype, check_fp8_applied, expert_math
from fxoverlap.grad_reduce import GradReduceConfigError, GradReduceError, GradReduction, check_groups
from fxoverlap.ir.bucket import Bucket
from fxoverlap.ir.stage import Stage, format_stage_table, render_rows as _render
from fxoverlap.compiled_program import CompiledModel, CompiledProgram, ProgramSpec, compile_program
from fxoverlap.inputs import (  # noqa: F401  (the errors and check_group: re-exported, public here before)
    InputChecks, InputError, Microbatch, MicrobatchError, MicrobatchMismatch, check_group)
from fxoverlap.param_shard import ParamSharding, check_shardable, tied_names
from fxoverlap.passes.capture import Capture, capture, input_signature
from fxoverlap.passes.reduce import parameter_roles
from fxoverlap.passes.shard import param_units
from fxoverlap.pipeline import check_disable_passes
from fxoverlap.program_key import (ModelState, ProgramCache, ProgramKey, model_state, program_key, refuse_unsupported,
                                   wrapped_by_ddp)
from fxoverlap.runtime import (NamedTensors, ProgramRunner, StageHook, accumulate_into, run_post_accumulate_hooks,
                               static_values)
from fxoverlap.ir.program import program_of

log = logging.getLogger("fxoverlap")


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class PlanView:
    """:meth:`Engine.plan`'s answer: the stages and the program for those microbatches."""

    capture: Capture
    stages: list[Stage]
    program: torch.fx.GraphModule

    def stage_table(self) -> str:
        return format_stage_table(self.stages)


class Engine:
    """Runs a model's train steps as fxoverlap programs. Build with :func:`optimize`."""

    def __init__(self, model: nn.Module, ep_group: dist.ProcessGroup | None, config: OverlapConfig,
                 dp_group: dist.ProcessGroup | None = None, expert_dp_group: dist.ProcessGroup | None = None):
        self._inputs = InputChecks(model, ep_group, dp_group, expert_dp_group)  # groups, expert split
        refuse_unsupported(model)  # a DDP wrapper, a module backward hook: refused before any capture
        check_disable_passes(config.disable_passes)  # before any capture: the error comes first
        # FP8 experts on a device that cannot run them: refused before any capture (and again at each
        # capture, for a model moved since)
        check_expert_dtype(config.expert_dtype, _device_of(model))
        self.model, self.ep_group, self.config = model, ep_group, config
        self._groups = {"ep": ep_group, "dp": dp_group, "expert_dp": expert_dp_group}
        groups = check_groups(ep_group, dp_group, expert_dp_group)
        if groups is None and config.grad_reduce != "all_reduce":
            raise GradReduceConfigError(f"fxoverlap.optimize: OverlapConfig(grad_reduce={config.grad_reduce!r}) needs "
                             f"dp_group (the ranks the gradients are reduced over)")
        # ZeRO-3: the parameters become DTensor shards at the first capture (fxoverlap/param_shard.py)
        self.sharding = None if not config.shard_params else ParamSharding(check_shardable(model, groups), ep_group)
        # data parallelism: the gradient reductions inside the program (None: p.grad stays local)
        self.grad_reduction = None if groups is None else GradReduction(groups, config.grad_reduce, self.sharding)
        self._cudagraphs = GraphCache(config.cuda_graphs)  # captured CUDA graphs; see close()
        # the compiled programs, by everything that changes their answer (fxoverlap/program_key.py)
        self.cache: ProgramCache[CompiledModel] = ProgramCache(
            config.max_programs, close=lambda entry: entry.close(self._cudagraphs))
        self._last: tuple[CompiledModel, CompiledProgram] | None = None
        self.memory_trace: list[tuple[str, int, int]] = []
        self.leftover: dict[int, list[str]] = {}  # record_memory: values left in the stores at the end
        self.tune_result = None  # OverlapConfig(autotune=True): what the first call's tuning chose and tried

    def __deepcopy__(self, memo: dict) -> Engine:
        """A new engine over a deep copy of the model, with the same groups and config and an
        empty program cache (process groups cannot be copied; compiled programs are cheap to
        rebuild next to a copied model and hold nothing of the old one)."""
        import copy

        return Engine(copy.deepcopy(self.model, memo), self.ep_group, self.config, self._groups["dp"],
                      self._groups["expert_dp"])

    # ---------------------------------------------------------------- building
    def _device(self) -> torch.device:
        return _device_of(self.model)

    def _compiled(self, inputs: Sequence[torch.Tensor], fn: Callable | None, train: bool,
                  state: ModelState | None = None) -> CompiledModel:
        """The capture and stages for calling the model on ``inputs`` with ``fn`` as its loss
        (``train``) or output function, in the model's current state (``state``: this call's
        ``model_state``, taken here when None): from the cache when the
        :class:`~fxoverlap.program_key.ProgramKey` matches, else traced and compiled anew."""
        key = program_key(self.model, inputs, getattr(inputs, "keywords", ()), fn, "train" if train else "forward",
                          self.config, self._groups, state)
        entry = self.cache.get(key)
        if entry is None:
            why = self.cache.why_new(key, fn)
            log.info("fxoverlap: compiling %s's %s program for inputs %s (%s)", type(self.model).__name__,
                     key.role, input_signature(inputs), why)
            if (ddp := wrapped_by_ddp(self.model)) is not None:
                raise ddp
            check_expert_dtype(self.config.expert_dtype, self._device())
            with expert_math(self.config.expert_dtype), self._expert_seams():  # the experts' GEMMs in that dtype
                cap = capture(self.model, inputs, fn, self.config.layer_container, train=train,
                              explain=explain_capture_error,
                              plain_params=None if self.sharding is None else self.sharding.program_shapes)
            check_fp8_applied(self.config.expert_dtype, cap.graph_module, type(self.model).__name__)
            # ep_group=None: the group the comm ops use (the key keeps the group the user passed)
            self.ep_group = self._inputs.adopt_group(cap)
            entry = CompiledModel.build(cap, self.config, self._device(), train)
            self.cache.put(key, entry)
            if self.sharding is not None and self.sharding.units is None:
                # the first capture fixes the units and shards the model: its parameters are DTensors
                # from now on, which is what the next call's key sees
                experts = [fqn for fqn, role in parameter_roles(cap).items() if role == "expert"]
                self.sharding.adopt(param_units(cap, self.sharding.sharded_ranks, tied_names(self.model)), self.model, experts)
                self.cache.put(program_key(self.model, inputs, getattr(inputs, "keywords", ()), fn,
                                           key.role, self.config, self._groups), entry)
        return entry

    def _expert_seams(self) -> contextlib.AbstractContextManager:
        """With ``expert_dtype`` set, torchtitan's experts run fxoverlap's grouped GEMM while traced."""
        if self.config.expert_dtype is None:
            return contextlib.nullcontext()
        return torchtitan_experts.fxoverlap_gemms(self.model)

    def _entry(self, inputs: Sequence[torch.Tensor], fn: Callable | None,
               train: bool) -> tuple[CompiledModel, NamedTensors]:
        """:meth:`_compiled` for this call, and the parameters and buffers the call runs with.

        The model is walked once per call (:func:`~fxoverlap.program_key.model_state`): the key,
        the static values, the gradient sink and the reduction's ``begin`` share that one
        lookup by name (the program holds no parameter: ``load_state_dict(assign=True)`` or
        ``model.to()`` make new ones, found here at the next call). A call that compiles looks
        them up again after the capture, which runs the model's code."""
        state = model_state(self.model)
        compiles = self.cache.compiles
        entry = self._compiled(inputs, fn, train, state)
        if self.cache.compiles != compiles:
            return entry, NamedTensors.of(self.model)
        return entry, state.tensors

    def _program(self, entry: CompiledModel, n: int, train: bool = True,
                 hook: StageHook | None = None) -> CompiledProgram:
        spec = ProgramSpec(n, forward_only=not train, reduce_grads=train and self.grad_reduction is not None)

        def make(spec: ProgramSpec) -> CompiledProgram:
            reduction = self.grad_reduction if spec.reduce_grads else None
            return compile_program(
                entry.capture, entry.stages, self.config, spec, self._device(), graphs=self._cudagraphs, hook=hook,
                reducer=None if reduction is None else (
                    lambda program: reduction.bind(program_of(program).buckets, entry.capture, self.model)),
                sharding=self.sharding)

        return make(spec) if hook is not None else entry.program(spec, make)

    def runner(self, microbatches: Sequence, loss_fn: Callable | None = None,
               hook: StageHook | None = None) -> ProgramRunner:
        """The runner ``forward_backward(microbatches, loss_fn)`` uses (its CUDA graphs and gradient
        reduction), or with ``hook``, a new one like it whose every stage call goes through the
        hook (the benchmark's stage timing). Run it with ``runner.run(static_values(...), mbs,
        grads=accumulate_into(model, capture))``."""
        mbs = self._check(microbatches, loss_fn, "runner")
        return self._program(self._compiled(mbs[0], loss_fn, train=True), len(mbs), hook=hook).runner

    def plan(self, microbatches: Sequence, loss_fn: Callable | None = None) -> PlanView:
        """Capture and build (or reuse) what ``forward_backward(microbatches, loss_fn)`` would
        run, without running it: the stages and the program. With data parallelism it also
        fixes the gradient buckets (so :meth:`shard_parameters` is known), checking with the
        other ranks of each group that they bucket alike."""
        mbs = self._check(microbatches, loss_fn, "plan")
        entry = self._compiled(mbs[0], loss_fn, train=True)
        prog = self._program(entry, len(mbs))  # binds the buckets (every rank of the groups must call plan)
        return PlanView(entry.capture, entry.stages, prog.program)

    # ---------------------------------------------------------------- running
    def _check(self, microbatches: Sequence, loss_fn: Callable | None = None,
               what: str = "forward_backward", fn_name: str = "loss_fn") -> list[Microbatch]:
        """The microbatches as :class:`Microbatch` es, checked (``fxoverlap.inputs``)."""
        return self._inputs.check(microbatches, loss_fn, what, fn_name)

    def forward_backward(
        self, microbatches: Sequence, loss_fn: Callable | None = None
    ) -> list[torch.Tensor]:
        """Forward and backward over ``microbatches``, interleaved; returns detached losses.

        Accumulates into ``p.grad`` exactly as ``for mb in microbatches:
        loss_fn(model(*mb), *mb).backward()`` would (``loss_fn=None``: the model's
        output is the loss). Buffers the forward updates in place end as eager leaves them.
        With ``dp_group``, the program reduces this call's gradients over the data-parallel
        groups, overlapped with the last microbatch's backward (see :meth:`grad_table`), and
        adds the average into what ``p.grad`` held (taken as already reduced: accumulation
        over calls gives the average of the sum); every reduction has finished when this returns.
        """
        if self.config.autotune:
            self._autotune(microbatches, loss_fn, forward_only=False)
        mbs = self._check(microbatches, loss_fn)
        entry, tensors = self._entry(mbs[0], loss_fn, train=True)
        prog = self._program(entry, len(mbs))
        self._last = (entry, prog)
        cap = entry.capture
        reduced = prog.spec.reduce_grads
        with overflow_guard(cap, self.model):
            sharding = self.sharding
            if sharding is not None:
                sharding.check_params(tensors.params)
            grads = accumulate_into(tensors, cap, post_hooks=not reduced, held=None if sharding is None else sharding.held,
                                    sharded=frozenset() if sharding is None else sharding.fqns | sharding.local_only)
            state = prog.run(static_values(cap, tensors), mbs, on_error=self._abort_group, grads=grads,
                             params=tensors.params)
        if reduced:  # with data parallelism the hooks see the reduced gradient, once, when it is final
            run_post_accumulate_hooks(tensors, cap)
        if self.config.record_memory:
            self.memory_trace = state.memory_trace
            static = set(cap.static_placeholders)
            self.leftover = {mb: names for mb, st in enumerate(state.stores)
                             if (names := [v for v in st if v not in static])}
        return [out[cap.loss_name] for out in state.outputs]

    def __call__(self, *inputs: torch.Tensor, **kwargs: torch.Tensor):
        """Forward only, through the forward stage graphs; returns ``model(*inputs, **kwargs)``."""
        return self._forward_only([self._inputs.call(inputs, kwargs)], None)[0]

    def forward_only(self, microbatches: Sequence, output_fn: Callable | None = None) -> list:
        """The model's output for each of ``microbatches``, forward only (inference, evaluation),
        as ``[model(*mb) for mb in microbatches]`` under ``torch.no_grad()`` gives it; with
        ``output_fn``, ``[output_fn(model(*mb), *mb) ...]``, which must be one tensor (e.g.
        ``lambda out, ids: out.logits`` for a Hugging Face model's output object).

        The program runs the microbatches in pairs, each one's all-to-alls under the other's
        compute (two-batch overlap; a last odd one runs alone, cut into ``OverlapConfig.chunks``),
        unless pairs would reorder what eager does in order: random draws (dropout in training
        mode), or the updates of a buffer the forward changes in place that two layers share.
        Then one after the other, each cut into chunks, as ``engine(*mb)`` runs them.
        """
        if self.config.autotune:
            self._autotune(microbatches, output_fn, forward_only=True)
        return self._forward_only(self._check(microbatches, output_fn, "forward_only", "output_fn"), output_fn)

    def _autotune(self, microbatches: Sequence, fn: Callable | None, forward_only: bool) -> None:
        """``OverlapConfig(autotune=True)``, first call: tune on these microbatches
        (:func:`fxoverlap.tune.tune_with_report`; on CPU one ``TuneSkipped`` warning and the config
        kept) and run with the result from now on (``self.tune_result`` holds its table)."""
        from fxoverlap.tune import tune_with_report

        mbs = self._check(microbatches, fn, "forward_only" if forward_only else "forward_backward",
                          "output_fn" if forward_only else "loss_fn")  # the input errors first
        del mbs
        self.tune_result = tune_with_report(self.model, self.ep_group, microbatches, fn, config=self.config,
                                            forward_only=forward_only, dp_group=self._groups["dp"],
                                            expert_dp_group=self._groups["expert_dp"])
        self.config = self.tune_result.config  # autotune off: tuned once
        self.clear_cache()

    def _forward_only(self, mbs: list[tuple], output_fn: Callable | None) -> list:
        entry, tensors = self._entry(mbs[0], output_fn, train=False)
        prog = self._program(entry, len(mbs), train=False)
        self._last = (entry, prog)
        with overflow_guard(entry.capture, self.model):
            state = prog.run(static_values(entry.capture, tensors), mbs, on_error=self._abort_group)
        return [out[entry.capture.outputs[0]] for out in state.outputs]

    def close(self) -> None:
        """Release the CUDA graphs this engine captured (and their memory pools).

        Call it before ``dist.destroy_process_group()``: no graph may outlive the
        process group. It waits for the device first. Comm stages are never captured
        (they stay eager), so no NCCL kernel is in any graph (on the GPU machine,
        processes that had captured an all-to-all hung in ``destroy_process_group()``).
        Explicit, never from ``atexit``. The engine stays usable: a later step
        captures its graphs anew. A no-op without ``cuda_graphs``.
        """
        self._cudagraphs.close()

    def clear_cache(self) -> None:
        """Drop every compiled program (and its CUDA graphs): the next call compiles anew."""
        self.cache.clear()
        self._last = None

    def _abort_group(self, exc: BaseException) -> None:
        """A stage raised: tear the EP group down so peers blocked in a collective fail, not hang."""
        if self.ep_group is None:
            return
        log.error("fxoverlap: stage failed (%s); aborting the expert-parallel group", exc)
        try:
            abort = getattr(self.ep_group, "abort", None)
            if abort is not None:
                abort()
            else:
                dist.destroy_process_group(self.ep_group)
        except Exception:  # best effort: the original error is what matters
            log.exception("fxoverlap: aborting the process group failed")

    # ---------------------------------------------------------------- introspection
    @property
    def program(self) -> torch.fx.GraphModule | None:
        """The program of the last call (``forward_backward`` or ``engine(*inputs)``)."""
        return None if self._last is None else self._last[1].program

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the model's gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``
        does on one process: every rank gets the same total norm, each gradient counted once
        (dense ones replicated over ``dp_group``, every EP rank's experts summed). Works where
        torch's does not: ZeRO-3's DTensor gradients on two meshes, and expert gradients that
        differ between EP ranks. Returns the total norm."""
        from fxoverlap.param_shard import clip_grad_norm_

        experts = ()
        if self._last is not None:
            names = {s.param for b in program_of(self._last[1].program).buckets if b.role == "expert"
                     for s in b.slots}
            experts = [p for n, p in self.model.named_parameters(remove_duplicate=False) if n in names]
        return clip_grad_norm_(self.model.parameters(), max_norm, norm_type, experts, self.ep_group)

    @property
    def stages(self) -> list[Stage]:
        """The stages of the last call (``forward_backward`` or ``engine(*inputs)``), in plain order."""
        return [] if self._last is None else self._last[0].stages

    def stage_table(self) -> str:
        return format_stage_table(self.stages)

    def grad_table(self) -> str:
        """One line per parameter gradient of the last ``forward_backward``: its role
        (``expert``: read only by experts stages), the group it reduces over and that
        group's ranks, its bucket, and the stage after which the bucket is issued."""
        if self.grad_reduction is None:
            return "no data parallelism: gradients stay local (optimize(..., dp_group=...) reduces them)"
        if self._last is None:
            return "no forward_backward yet"
        buckets = program_of(self.program).buckets
        return format_grad_table(buckets, self.grad_reduction)

    def shard_parameters(self) -> list[torch.Tensor]:
        """What the optimizer steps. ``grad_reduce="reduce_scatter"`` (ZeRO-2): this rank's shard of
        the gradient buckets, as leaf views of the parameters whose ``.grad`` is the averaged
        gradient (then :meth:`gather_parameters`). ``shard_params=True`` (ZeRO-3): the model's
        parameters, DTensor shards where sharded. Known after the first :meth:`plan` or step."""
        if self.sharding is not None:
            if self.sharding.units is None:
                raise GradReduceError("fxoverlap: the parameters are sharded at the first capture: call "
                                      "engine.plan(...) or engine.forward_backward(...) first")
            return list(self.model.parameters())
        return self._reduction().shard_parameters()

    def gather_parameters(self) -> None:
        """``grad_reduce="reduce_scatter"``: all-gather the shards the optimizer stepped, so
        every rank holds the updated parameters. ``shard_params=True``: nothing to do (the
        program gathers each unit when it needs it)."""
        if self.sharding is not None:
            return
        self._reduction().gather_parameters()

    def _reduction(self) -> GradReduction:
        if self.grad_reduction is None:
            raise GradReduceError("fxoverlap: no data parallelism (build the engine with optimize(..., dp_group=...))")
        return self.grad_reduction

    def cuda_graph_summary(self) -> list[dict]:
        """Per program: graphs captured, stages graphed, copies, pools, stages that fell back to eager."""
        return self._cudagraphs.summaries()


def format_grad_table(buckets: Sequence[Bucket], reduction: GradReduction) -> str:
    """One line per gradient: parameter, role, group (and its ranks), bucket, issued after."""
    rows = [("param", "role", "reduces over", "ranks", "bucket", "issued after")]
    for b in buckets:
        name = "expert_dp_group" if b.role == "expert" else "dp_group"
        ranks = reduction.groups.of(b.role)[1]
        for s in b.slots:
            rows.append((s.param, b.role, name, str(list(ranks)), str(b.index), b.after))
    return _render(rows)


def optimize(
    model: nn.Module,
    ep_group: dist.ProcessGroup | None = None,
    config: OverlapConfig | None = None,
    *,
    dp_group: dist.ProcessGroup | None = None,
    expert_dp_group: dist.ProcessGroup | None = None,
) -> Engine:
    """Wrap ``model`` in an :class:`Engine` that runs interleaved 1F1B train steps.

    ``ep_group``: the expert-parallel process group the model's dispatch/combine
    use (NCCL on GPU, gloo on CPU), or None for one rank.

    Data parallelism (``docs/data_parallel.md``): ``dp_group``, the ranks over which the
    non-expert parameters are replicated (usually ``dist.group.WORLD``), and
    ``expert_dp_group``, the ranks over which this rank's experts are replicated (the
    same EP index in every EP group; may be left out with EP 1, or when ``ep_group`` is
    all of ``dp_group``). The program then leaves in ``p.grad`` the gradient of the mean
    loss over the DP ranks: dense parameters summed over ``dp_group``, experts over
    ``expert_dp_group``, both divided by ``|dp_group|``. The groups are checked here.
    """
    return Engine(model, ep_group, config or OverlapConfig(), dp_group, expert_dp_group)
