"""The pass pipeline for both entry points (``optimize`` and the backend), and the reference order.

The pass list and its manager live in ``fxoverlap.passes.manager`` (:data:`PASSES`, readable as
``fxoverlap.passes.PASSES``); this module is what the entry points call: :func:`build_stages`
(phase "stages", once per plan), :func:`build_program` (phase "program", once per microbatch
count), and :func:`run_plain`, one microbatch with the stages in plain order, which is the
reference the interleaved program must equal (it runs a program, so it sits above the runtime).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from fxoverlap.ir.capture import Capture
from fxoverlap.ir.stage import Stage
from fxoverlap.passes.free import free
from fxoverlap.passes.manager import (PASSES, SWITCHABLE, Pass, PassState, build_program, build_stages,
                                      check_disable_passes, emit_artifacts, format_plan, run_passes)
from fxoverlap.passes.schedule import schedule
from fxoverlap.passes.streams import streams
from fxoverlap.config import OverlapConfig
from fxoverlap.kernels import a2a
from fxoverlap.runtime import GradSink, ProgramRunner, StageHook, accumulate_into, static_values

__all__ = ["PASSES", "SWITCHABLE", "Pass", "PassState", "build_program", "build_stages", "check_disable_passes",
           "emit_artifacts", "format_plan", "make_runner", "run_passes", "run_plain"]


def make_runner(program: torch.fx.GraphModule, stages: Sequence[Stage], capture: Capture, device: torch.device,
                config: OverlapConfig, *, grads: GradSink | None = None, cuda_graphs=None, reducer=None,
                hook: StageHook | None = None, sharding=None) -> ProgramRunner:
    """The one place a :class:`ProgramRunner` is made (the engine, the backend and the benchmark):
    the config's runtime options (comm stream priority, SM carveout, memory recording) applied alike."""
    return ProgramRunner(program, stages, capture, device, grads=grads,
                         comm_stream_priority=config.comm_stream_priority,
                         sm_carveout=config.resolved_sm_carveout(device.type),
                         comm_kernels_run=comm_kernels_run(capture),
                         cuda_graphs=cuda_graphs,
                         record_memory=config.record_memory, reducer=reducer, hook=hook, sharding=sharding)


def comm_kernels_run(capture: Capture) -> Callable[[], bool]:
    """Asked at each run: do the exchanges run comm kernels beside the compute? Yes over a group of
    more than one rank or a group not known (the dispatcher pass found none of fxoverlap's
    exchanges), and over a stand-in whose exchanges hold (an emulated link that is set now): the
    group decides (``a2a.exchange_takes_sms``), resolved from the names the comm ops carry when
    asked, as the ops resolve them (a group the runner cannot find, the ops cannot either)."""
    names = capture.ep_groups
    if names is None:
        return lambda: True
    return lambda: any(a2a.exchange_takes_sms(a2a.resolve_group(name)) for name in names)


def run_plain(stages: Sequence[Stage], capture: Capture, model: nn.Module,
              inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """One microbatch, stages in plain order (all forward, then all backward), gradients
    into ``p.grad``; returns the loss. The reference the interleaved program must equal."""
    program = free(streams(schedule(list(stages), capture, 1)), capture)
    device = next(model.parameters()).device
    runner = make_runner(program, stages, capture, device, OverlapConfig(), grads=accumulate_into(model, capture))
    state = runner.run(static_values(capture, model), [inputs])
    return state.outputs[0][capture.loss_name]
