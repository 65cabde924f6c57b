"""``fxoverlap.optimize``: the engine that captures, splits, schedules and runs a model."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn

from fxoverlap.config import OverlapConfig
from fxoverlap.cudagraphs import GraphCache
from fxoverlap.dispatch_ops import overflow_guard  # dispatcher branch: overflow check around a step
from fxoverlap.passes.capture import Capture, capture, input_signature
from fxoverlap.passes.cudagraph import cudagraph
from fxoverlap.passes.dispatcher import dispatcher  # dispatcher branch: lowers dispatch/combine
from fxoverlap.passes.free import free
from fxoverlap.passes.recompute import recompute
from fxoverlap.passes.schedule import schedule
from fxoverlap.passes.split import split
from fxoverlap.passes.streams import streams
from fxoverlap.passes.tag import tag
from fxoverlap.runtime import ProgramRunner
from fxoverlap.stage import Stage

log = logging.getLogger("fxoverlap")


@dataclasses.dataclass
class Plan:
    """Everything built for one input signature and loss function."""

    capture: Capture
    stages: list[Stage]
    programs: dict[int, torch.fx.GraphModule] = dataclasses.field(default_factory=dict)


def _as_tuple(mb) -> tuple:
    return (mb,) if isinstance(mb, torch.Tensor) else tuple(mb)


def _check_expert_split(model: nn.Module, ep_group: dist.ProcessGroup | None) -> None:
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    for name, mod in model.named_modules():
        for holder in (mod, getattr(mod, "cfg", None), getattr(mod, "config", None)):
            n = getattr(holder, "n_experts", None) or getattr(holder, "num_experts", None)
            if isinstance(n, int) and n % ep:
                raise ValueError(
                    f"fxoverlap.optimize: {name or 'model'} has {n} experts, which an expert-parallel "
                    f"group of {ep} ranks cannot split evenly; use a group size that divides {n}"
                )


class Engine:
    """Runs a model's train steps as fxoverlap programs. Build with :func:`optimize`."""

    def __init__(self, model: nn.Module, ep_group: dist.ProcessGroup | None, config: OverlapConfig):
        _check_expert_split(model, ep_group)
        self.model, self.ep_group, self.config = model, ep_group, config
        self._plans: dict[tuple, Plan] = {}
        self._fwd_plans: dict[tuple, Plan] = {}
        self._last: tuple[Plan, int] | None = None
        self.memory_trace: list[tuple[str, int, int]] = []
        self._cudagraphs = GraphCache(config.cuda_graphs)  # captured CUDA graphs; see close()

    # ---------------------------------------------------------------- building
    def _device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _build(self, inputs: Sequence[torch.Tensor], loss_fn: Callable | None, train: bool = True) -> Plan:
        cache = self._plans if train else self._fwd_plans
        key = (input_signature(inputs), loss_fn if train else None)
        plan = cache.get(key)
        if plan is None:
            log.info("fxoverlap: capturing %s for input signature %s", type(self.model).__name__, key[0])
            cap = capture(self.model, inputs, loss_fn, self.config.layer_container, train=train)
            dispatcher(cap.graph_module, self.config.dispatcher, self.config.dispatch_capacity_factor)  # dispatcher branch
            gm = tag(cap)
            if train and self.config.mhc_recompute_group is not None:
                gm = recompute(gm, cap.num_layers, self.config.mhc_recompute_group)
            stages = split(gm, cap.num_layers, delay_wgrad=self.config.delay_wgrad and train)
            plan = cache[key] = Plan(cap, stages)
        return plan

    def _program(self, plan: Plan, n: int) -> torch.fx.GraphModule:
        prog = plan.programs.get(n)
        if prog is None:
            prog = schedule(plan.stages, n, plan.capture.num_layers)
            prog = streams(prog, plan.stages)
            if self.config.cuda_graphs:  # before free: free leaves graph-owned outputs alone
                prog = cudagraph(prog, plan.stages)
            if self.config.free_early:
                prog = free(prog, plan.stages, plan.capture)
            plan.programs[n] = prog
        return prog

    # ---------------------------------------------------------------- running
    def forward_backward(
        self, microbatches: Sequence, loss_fn: Callable | None = None
    ) -> list[torch.Tensor]:
        """Forward and backward over ``microbatches``, interleaved; returns detached losses.

        Accumulates into ``p.grad`` exactly as ``for mb in microbatches:
        loss_fn(model(*mb), *mb).backward()`` would (``loss_fn=None``: the model's
        output is the loss).
        """
        mbs = [_as_tuple(mb) for mb in microbatches]
        if not mbs:
            raise ValueError("forward_backward: got an empty list of microbatches; pass at least one")
        sig0 = input_signature(mbs[0])
        for i, mb in enumerate(mbs[1:], 1):
            if input_signature(mb) != sig0:
                raise ValueError(
                    f"forward_backward: microbatch {i} has inputs {_describe(mb)} but microbatch 0 has "
                    f"{_describe(mbs[0])}; all microbatches of one call must share shapes and dtypes "
                    f"(a later call may use new shapes: it is captured anew)"
                )
        plan = self._build(mbs[0], loss_fn)
        prog = self._program(plan, len(mbs))
        self._last = (plan, len(mbs))
        runner = self._runner(plan, prog, record_memory=self.config.record_memory)
        with overflow_guard(plan.capture.graph_module, self.model):  # dispatcher branch
            losses = runner.run(mbs, on_error=self._abort_group)
        self.memory_trace = runner.memory_trace
        return losses

    def __call__(self, *inputs: torch.Tensor):
        """Forward only, through the forward stage graphs; returns the model's output."""
        plan = self._build(inputs, None, train=False)
        prog = self._program(plan, 1)
        with overflow_guard(plan.capture.graph_module, self.model):  # dispatcher branch
            return self._runner(plan, prog).run([inputs], on_error=self._abort_group)[0]

    def _runner(self, plan: Plan, prog: torch.fx.GraphModule, **kw) -> ProgramRunner:
        device = self._device()
        return ProgramRunner(
            prog, plan.stages, plan.capture, self.model, device,
            comm_stream_priority=self.config.comm_stream_priority,
            cuda_graphs=self._cudagraphs.get(prog, plan.stages, plan.capture, device), **kw,
        )

    def close(self) -> None:
        """Release the CUDA graphs this engine captured (and their memory pools).

        Call it before ``dist.destroy_process_group()``: no graph may outlive the
        process group. It waits for the device first. Comm stages are never captured
        (they stay eager), so no NCCL kernel is in any graph; DESIGN.md reports that
        processes that had captured an all-to-all hung in ``destroy_process_group()``.
        Explicit, never from ``atexit``. The engine stays usable: a later step
        captures its graphs anew. A no-op without ``cuda_graphs``.
        """
        self._cudagraphs.close()

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
        """The program of the last ``forward_backward`` call."""
        return None if self._last is None else self._last[0].programs[self._last[1]]

    @property
    def stages(self) -> list[Stage]:
        """The stages of the last ``forward_backward`` call, in plain order."""
        return [] if self._last is None else self._last[0].stages

    def stage_table(self) -> str:
        return format_stage_table(self.stages)


def _describe(mb: Sequence[torch.Tensor]) -> str:
    return "(" + ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in mb) + ")"


def format_stage_table(stages: Sequence[Stage]) -> str:
    """One line per stage: name, layer, kind, direction, stream, #ops, inputs, outputs."""
    rows = [("stage", "layer", "kind", "dir", "stream", "ops", "in", "out", "capturable")]
    for s in stages:
        rows.append((s.name, str(s.layer), str(s.kind), str(s.direction), str(s.stream),
                     str(len(s.op_list())), str(len(s.inputs)), str(len(s.outputs)),
                     "yes" if s.capturable else f"no: {s.not_capturable_reason}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows
    )


def optimize(
    model: nn.Module, ep_group: dist.ProcessGroup | None = None, config: OverlapConfig | None = None
) -> Engine:
    """Wrap ``model`` in an :class:`Engine` that runs interleaved 1F1B train steps.

    ``ep_group``: the expert-parallel process group the model's dispatch/combine
    use (NCCL on GPU, gloo on CPU), or None for one rank.
    """
    return Engine(model, ep_group, config or OverlapConfig())


