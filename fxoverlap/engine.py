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
from fxoverlap.dispatch_ops import overflow_guard
from fxoverlap.passes.capture import Capture, capture, input_signature
from fxoverlap.pipeline import build_program, build_stages
from fxoverlap.runtime import ProgramRunner, accumulate_into, static_values
from fxoverlap.stage import Stage

log = logging.getLogger("fxoverlap")


@dataclasses.dataclass
class Plan:
    """What fxoverlap built for one input signature (and loss function): the capture,
    the stages, and one program per microbatch count (``programs[n]``)."""

    capture: Capture
    stages: list[Stage]
    programs: dict[int, torch.fx.GraphModule] = dataclasses.field(default_factory=dict)
    runners: dict[int, ProgramRunner] = dataclasses.field(default_factory=dict, repr=False)


@dataclasses.dataclass(frozen=True)
class PlanView:
    """:meth:`Engine.plan`'s answer: the stages and the program for those microbatches."""

    capture: Capture
    stages: list[Stage]
    program: torch.fx.GraphModule

    def stage_table(self) -> str:
        return format_stage_table(self.stages)


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
        self._last: tuple[Plan, int] | None = None
        self.memory_trace: list[tuple[str, int, int]] = []
        self.leftover: dict[int, list[str]] = {}  # record_memory: values left in the stores at the end
        self._cudagraphs = GraphCache(config.cuda_graphs)  # captured CUDA graphs; see close()

    # ---------------------------------------------------------------- building
    def _device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def _plan(self, inputs: Sequence[torch.Tensor], loss_fn: Callable | None, train: bool) -> Plan:
        key = (input_signature(inputs), loss_fn if train else None, train)
        plan = self._plans.get(key)
        if plan is None:
            log.info("fxoverlap: capturing %s for input signature %s", type(self.model).__name__, key[0])
            cap = capture(self.model, inputs, loss_fn, self.config.layer_container, train=train)
            plan = self._plans[key] = Plan(cap, build_stages(cap, self.config, self._device().type, train))
        return plan

    def _program(self, plan: Plan, n: int, train: bool = True) -> torch.fx.GraphModule:
        prog = plan.programs.get(n)
        if prog is None:
            prog = plan.programs[n] = build_program(plan.stages, plan.capture, n, self.config, forward_only=not train)
        return prog

    def _runner(self, plan: Plan, n: int, train: bool = True) -> ProgramRunner:
        runner = plan.runners.get(n)
        if runner is None:
            prog, device = self._program(plan, n, train), self._device()
            runner = plan.runners[n] = ProgramRunner(
                prog, plan.stages, plan.capture, device,
                grads=accumulate_into(self.model, plan.capture) if train else None,
                comm_stream_priority=self.config.comm_stream_priority,
                cuda_graphs=self._cudagraphs.get(prog, plan.stages, plan.capture, device),
                record_memory=self.config.record_memory,
            )
        return runner

    def plan(self, microbatches: Sequence, loss_fn: Callable | None = None) -> PlanView:
        """Capture and build (or reuse) what ``forward_backward(microbatches, loss_fn)`` would
        run, without running it: the stages and the program."""
        mbs = self._check(microbatches)
        plan = self._plan(mbs[0], loss_fn, train=True)
        return PlanView(plan.capture, plan.stages, self._program(plan, len(mbs)))

    # ---------------------------------------------------------------- running
    def _check(self, microbatches: Sequence) -> list[tuple]:
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
        return mbs

    def forward_backward(
        self, microbatches: Sequence, loss_fn: Callable | None = None
    ) -> list[torch.Tensor]:
        """Forward and backward over ``microbatches``, interleaved; returns detached losses.

        Accumulates into ``p.grad`` exactly as ``for mb in microbatches:
        loss_fn(model(*mb), *mb).backward()`` would (``loss_fn=None``: the model's
        output is the loss). Buffers the forward updates in place end as eager leaves them.
        """
        mbs = self._check(microbatches)
        plan = self._plan(mbs[0], loss_fn, train=True)
        runner = self._runner(plan, len(mbs))
        self._last = (plan, len(mbs))
        with overflow_guard(plan.capture.graph_module, self.model):
            state = runner.run(static_values(plan.capture, self.model), mbs, on_error=self._abort_group)
        if self.config.record_memory:
            self.memory_trace = state.memory_trace
            static = set(plan.capture.static_placeholders)
            self.leftover = {mb: names for mb, st in enumerate(state.stores)
                             if (names := [v for v in st if v not in static])}
        return [out[plan.capture.loss_name] for out in state.outputs]

    def __call__(self, *inputs: torch.Tensor):
        """Forward only, through the forward stage graphs; returns the model's output."""
        plan = self._plan(inputs, None, train=False)
        runner = self._runner(plan, 1, train=False)
        with overflow_guard(plan.capture.graph_module, self.model):
            state = runner.run(static_values(plan.capture, self.model), [inputs], on_error=self._abort_group)
        return state.outputs[0][plan.capture.outputs[0]]

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

    def cuda_graph_summary(self) -> list[dict]:
        """Per program: graphs captured, stages graphed, copies, pools, stages that fell back to eager."""
        return self._cudagraphs.summaries()


def _describe(mb: Sequence[torch.Tensor]) -> str:
    return "(" + ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in mb) + ")"


def format_stage_table(stages: Sequence[Stage]) -> str:
    """One line per stage: name, layer, kind, direction, stream, #ops, inputs, outputs, how it
    runs (``inductor`` / ``eager`` / ``graphed``), and whether a CUDA graph can hold it."""
    rows = [("stage", "layer", "kind", "dir", "stream", "ops", "in", "out", "runs", "capturable")]
    for s in stages:
        rows.append((s.name, str(s.layer), str(s.kind), str(s.direction), str(s.stream),
                     str(len(s.op_list())), str(len(s.inputs)), str(len(s.outputs)), s.runs_as,
                     "yes" if s.capturable else f"no: {s.not_capturable_reason.split(': ', 1)[-1]}"))
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
