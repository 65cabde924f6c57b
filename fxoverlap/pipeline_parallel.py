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

- every schedule: each local ``PipelineStage``'s ``forward_maybe_with_nosync`` (the one
  place pipelining calls ``self.submod(...)``) is replaced, on that stage instance only, by a
  call of the fxoverlap-compiled stage module. ``stage.submod`` stays the user's module, so
  ``parameters()``, ``scale_grads`` and DDP/FSDP checks see what they always see, and
  pipelining's own torch.compile check (DualPipeV refuses compiled submodules) holds;
- multi-stage schedules (``_PipelineScheduleRuntime``: Interleaved1F1B, DualPipeV): an
  ``OVERLAP_F_B`` custom function (``register_custom_function``) runs the merged step. Today
  it runs F(i) then B(j), each an fxoverlap program, with pipelining's receives, loss and
  V-schedule hand-offs exactly as the runtime's own ``_perform_action`` does them; a single
  merged fxoverlap program for F(i) ⊗ B(j) is not built yet;
- ZeroBubble splits (``BACKWARD_INPUT`` / ``BACKWARD_WEIGHT``, which DualPipeV emits):
  fxoverlap's backward is one autograd node that hands out input and weight gradients
  together, which ``torch.autograd.grad(inputs=...)`` cannot split. Each stage gets
  pipelining's own ``dw_builder`` slot: ``BACKWARD_INPUT`` runs the whole backward (weight
  gradients included) and ``BACKWARD_WEIGHT`` has nothing left to do. Gradients are exact;
  the weight-gradient delay of a ZeroBubble schedule is not kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxoverlap.config import OverlapConfig
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.stage import Stage

__all__ = ["PipelineError", "UnsupportedSchedule", "StageLayersNotFound", "pipeline_schedule",
           "supported_schedules"]


class PipelineError(FxOverlapError, RuntimeError):
    """fxoverlap cannot run a pipeline stage's F/B as asked; the message says why."""


class UnsupportedSchedule(FxOverlapError, TypeError):
    """A schedule class :func:`pipeline_schedule` does not run."""


class StageLayersNotFound(PipelineError):
    """A stage module runs all-to-alls, but no decoder-layer list holding them was found."""


def supported_schedules() -> tuple[type, ...]:
    """The ``torch.distributed.pipelining`` schedule classes :func:`pipeline_schedule` runs."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    return (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleDualPipeV)


def _is_multi_stage(cls: type) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(cls, PipelineScheduleMulti)


class _StageCompiler:
    """One local ``PipelineStage``: its module compiled by fxoverlap's backend (on the first
    call, as torch.compile does), the compiled steps it built, and the stage's forward."""

    def __init__(self, stage, config: OverlapConfig, registry: dict[int, list[Stage]]):
        self.stage = stage
        self.config = config
        self.registry = registry
        self.steps: list = []  # backend.CompiledStep, one per Dynamo graph of the stage module
        self.forward_calls = 0  # F steps run (each a call of the compiled stage module)
        self.module = stage.submod
        self.compiled = torch.compile(stage.submod, backend=self._backend, dynamic=False, fullgraph=False)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        from fxoverlap import backend as fxb

        where = f"pipeline stage {self.stage.stage_index} ({type(self.module).__name__})"
        if not torch.is_grad_enabled():  # eval(): nothing to overlap with
            return gm.forward
        try:
            step = fxb.compile_step(gm, example_inputs, self.config)
        except (fxb._Unsupported, *fxb.FALLBACK_ERRORS) as e:
            # no silent fallback: the user asked for fxoverlap on this stage
            raise PipelineError(f"fxoverlap cannot compile {where}: {type(e).__name__}: {e}") from e
        if step.capture.num_layers == 0 and fxb._has_all_to_all(gm):
            raise StageLayersNotFound(
                f"{where}: the stage module runs all-to-alls but fxoverlap found no decoder-layer list "
                f"holding them; a stage module's decoder layers must be the entries of one nn.ModuleList or "
                f"nn.ModuleDict (torchtitan's PP split keeps `layers` as a ModuleDict with the original "
                f"names), or name the container with OverlapConfig(layer_container='...')")
        self.steps.append(step)
        self.registry.setdefault(self.stage.stage_index, []).extend(step.stages)
        return step

    def forward(self, *args, **kwargs):
        from torch._dynamo.exc import BackendCompilerFailed

        sub = self.stage.submod
        self.forward_calls += 1
        try:
            if isinstance(sub, nn.parallel.DistributedDataParallel):
                with sub.no_sync():
                    return self.compiled(*args, **kwargs)
            return self.compiled(*args, **kwargs)
        except BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, FxOverlapError):
                raise inner from e
            raise


def _install(stage, compiler: _StageCompiler) -> None:
    if getattr(stage, "_fxoverlap", None) is not None:
        raise PipelineError(f"pipeline stage {stage.stage_index} is already run by another fxoverlap schedule")
    stage._fxoverlap = compiler
    # the one place pipelining calls the stage module (forward_one_chunk); instance-local
    stage.forward_maybe_with_nosync = compiler.forward
    # ZeroBubble: BACKWARD_INPUT runs the whole backward, BACKWARD_WEIGHT nothing (module doc)
    stage.dw_builder = lambda: (lambda: None)


def _overlap_f_b(schedule, action, ctx) -> None:
    """The ``OVERLAP_F_B`` step: F(i) of one stage, then B(j) of another (or the same), each
    an fxoverlap program. Receives, loss and local hand-offs as ``_PipelineScheduleRuntime``
    runs a FORWARD and a FULL_BACKWARD / BACKWARD_INPUT action."""
    from torch.distributed.pipelining.schedules import (
        BACKWARD_INPUT,
        FORWARD,
        FULL_BACKWARD,
        _wait_batch_p2p,
    )

    schedule.fxoverlap_overlap_steps += 1
    if action.sub_actions is None:
        raise PipelineError(f"OVERLAP_F_B action {action} carries no sub_actions")
    stages = {s.stage_index: s for s in schedule._stages}
    for sub in action.sub_actions:
        kind, mb, idx = sub.computation_type, sub.microbatch_index, sub.stage_index
        stage = stages[idx]
        next_local, prev_local = idx + 1 in stages, idx - 1 in stages
        if kind == FORWARD:
            if not stage.is_first and not prev_local:
                if (idx, mb) not in schedule.fwd_recv_ops:
                    raise PipelineError(f"computing {sub} before receiving its input")
                _wait_batch_p2p(schedule.fwd_recv_ops.pop((idx, mb)))
            output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb],
                                             save_forward_output=schedule._fxoverlap_step_args["return_outputs"])
            schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb,
                                         schedule._fxoverlap_step_args["loss_kwargs"])
            if next_local:
                stages[idx + 1].set_local_fwd_input(output, mb)
        elif kind in (FULL_BACKWARD, BACKWARD_INPUT):
            if not stage.is_last and not next_local:
                if (idx, mb) not in schedule.bwd_recv_ops:
                    raise PipelineError(f"computing {sub} before receiving its gradients")
                _wait_batch_p2p(schedule.bwd_recv_ops.pop((idx, mb)))
            loss = schedule._maybe_get_loss(stage, mb)
            full = kind == FULL_BACKWARD
            last = False
            if full:
                schedule.backward_counter[idx] += 1
                last = schedule.backward_counter[idx] == schedule._n_microbatches
            stage.backward_one_chunk(mb, loss=loss, full_backward=full, last_backward=last)
            if prev_local:
                stages[idx - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
        else:
            raise PipelineError(f"OVERLAP_F_B sub-action {sub} is neither a forward nor a backward")


@functools.cache
def _schedule_class(cls: type) -> type:
    """``cls`` with its step's ``return_outputs`` and ``loss_kwargs`` kept where the
    ``OVERLAP_F_B`` custom function reads them (its ``ctx`` does not carry them)."""

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None):
        self._fxoverlap_step_args = {"return_outputs": return_outputs, "loss_kwargs": loss_kwargs}
        try:
            return cls._step_microbatches(self, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs,
                                          loss_kwargs=loss_kwargs)
        finally:
            self._fxoverlap_step_args = None

    return type(cls.__name__, (cls,), {
        "_step_microbatches": _step_microbatches,
        "__doc__": f"{cls.__name__} whose F/B steps run as fxoverlap programs (fxoverlap.pipeline_schedule).",
        "__module__": __name__,
        "__qualname__": f"pipeline_schedule.{cls.__name__}",
    })


def pipeline_schedule(schedule_cls: type, stages, n_microbatches: int, *, loss_fn: Callable | None = None,
                      ep_group: dist.ProcessGroup | None = None, config: OverlapConfig | None = None,
                      **schedule_kwargs: Any):
    """A ``torch.distributed.pipelining`` schedule whose F and B steps run as fxoverlap programs.

    ``schedule_cls`` is the pipelining schedule class, ``stages`` what it takes (one
    ``PipelineStage`` for single-stage schedules such as ``Schedule1F1B``, a list for
    multi-stage ones such as ``ScheduleDualPipeV``), ``n_microbatches``, ``loss_fn(output,
    target)`` and ``schedule_kwargs`` (``scale_grads``, chunk specs, ...) are passed on to
    it. ``ep_group`` is the expert-parallel group of the stage modules' MoE layers (checked;
    the layers hold it themselves); ``config`` the :class:`OverlapConfig` of every stage.

    Returns an instance of a subclass of ``schedule_cls`` (of the same name; it keeps
    ``step``'s ``return_outputs`` and ``loss_kwargs`` for the ``OVERLAP_F_B`` function): ``schedule.step(x, target=y, losses=losses)`` as
    with pipelining. After the first step, ``schedule.fxoverlap_stages`` maps each local
    pipeline stage's index to its fxoverlap ``Stage`` objects.
    """
    supported = supported_schedules()
    if not isinstance(schedule_cls, type) or schedule_cls not in supported:
        name = getattr(schedule_cls, "__name__", repr(schedule_cls))
        raise UnsupportedSchedule(
            f"fxoverlap.pipeline_schedule runs {', '.join(c.__name__ for c in supported)}; got {name}. "
            f"ZeroBubble schedules whose BACKWARD_WEIGHT must run apart from BACKWARD_INPUT "
            f"(ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) and custom CSV schedules are not "
            f"supported yet (docs/pipeline_parallel.md)")
    if ep_group is not None and not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(f"ep_group must be a torch.distributed ProcessGroup or None, got {type(ep_group).__name__}")
    config = config or OverlapConfig()
    from fxoverlap.backend import UNSUPPORTED_FIELDS

    fields = {f: getattr(OverlapConfig(), f) for f in UNSUPPORTED_FIELDS}
    if refused := [f for f in UNSUPPORTED_FIELDS if getattr(config, f) != fields[f]]:
        raise PipelineError(f"pipeline_schedule cannot honour OverlapConfig fields {refused}: "
                            + "; ".join(UNSUPPORTED_FIELDS[f] for f in refused))
    multi = _is_multi_stage(schedule_cls)
    local = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    if not multi and isinstance(stages, (list, tuple)):
        raise TypeError(f"{schedule_cls.__name__} takes one PipelineStage, got a {type(stages).__name__}")
    registry: dict[int, list[Stage]] = {}
    for st in local:
        _install(st, _StageCompiler(st, config, registry))
    schedule = _schedule_class(schedule_cls)(stages, n_microbatches, loss_fn=loss_fn, **schedule_kwargs)
    if multi:
        from torch.distributed.pipelining.schedules import OVERLAP_F_B

        schedule.register_custom_function(OVERLAP_F_B, functools.partial(_overlap_f_b, schedule))
    schedule.fxoverlap_stages = registry
    schedule.fxoverlap_overlap_steps = 0  # OVERLAP_F_B steps run by the custom function
    schedule.fxoverlap_ep_group = ep_group
    schedule.fxoverlap_config = config
    return schedule
