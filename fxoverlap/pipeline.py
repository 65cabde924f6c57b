"""The pass pipeline, in one place for both entry points (``optimize`` and the backend).

    capture ─ dispatcher ─ tag ─ side ─ rng ─ recompute ─ split ─ cudagraph ─ inductor   (once per plan)
    schedule ─ [reduce] ─ streams ─ free                                            (once per microbatch count)

``cudagraph`` only chooses stages (``stage.graphed``), so it runs before
``inductor``, which compiles each compute stage whether it is graphed or not,
and before ``free``, which reads the choice. ``reduce`` (data parallelism) places
the gradient reductions before ``streams`` and ``free`` add their events and frees.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.fx
import torch.nn as nn

from fxoverlap.config import OverlapConfig
from fxoverlap.ir.capture import Capture
from fxoverlap.ir.meta import SAVED_COMM_KEY
from fxoverlap.ir.stage import Stage
from fxoverlap.passes.cudagraph import cudagraph
from fxoverlap.passes.dispatcher import dispatcher
from fxoverlap.passes.free import free
from fxoverlap.passes.inductor import inductor
from fxoverlap.passes.recompute import recompute
from fxoverlap.passes.reduce import reduce
from fxoverlap.passes.rng import rng
from fxoverlap.passes.schedule import schedule
from fxoverlap.passes.side import side
from fxoverlap.passes.split import split
from fxoverlap.passes.streams import streams
from fxoverlap.passes.tag import tag
from fxoverlap.runtime import ProgramRunner, accumulate_into, static_values


def _progress(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def build_stages(capture: Capture, config: OverlapConfig, device_type: str, train: bool = True) -> list[Stage]:
    """The stages of a capture, chosen for CUDA graphs and compiled as ``config`` says."""
    dispatcher(capture.graph_module, config.dispatcher, config.dispatch_capacity_factor)
    gm = tag(capture)
    if config.side_stages:
        gm = side(gm)
    gm = rng(gm, capture.num_layers)  # after every pass that moves forward nodes between stages
    if train:  # activation checkpointing, and mHC with mhc_recompute_group
        gm = recompute(gm, capture.num_layers, config.mhc_recompute_group, replay_comm=config.ac_replay_comm)
        if (layers := gm.meta.get(SAVED_COMM_KEY)) and config.progress:
            _progress(f"fxoverlap: activation checkpointing keeps the all-to-all outputs of layers "
                      f"{', '.join(map(str, layers))} for the backward, where eager's checkpoint exchanges "
                      f"them again; OverlapConfig(ac_replay_comm=True) replays them (less memory, more comm)")
    stages = split(gm, capture.num_layers, delay_wgrad=config.delay_wgrad and train)
    if config.cuda_graphs or (config.cuda_graphs is None and device_type == "cuda"):
        cudagraph(stages, config.cuda_graphs)
    if config.resolved_compiler(device_type) == "inductor":
        inductor(stages, capture, dict(config.compile_options or {}),
                 progress=_progress if config.progress else None)
    return stages


def build_program(stages: list[Stage], capture: Capture, num_microbatches: int, config: OverlapConfig,
                  forward_only: bool = False, reduce_grads: bool = False) -> torch.fx.GraphModule:
    """The program that runs ``stages`` over ``num_microbatches`` microbatches; with
    ``reduce_grads``, it also reduces the gradients over the data-parallel groups."""
    program = schedule(stages, capture, num_microbatches, forward_only=forward_only)
    if reduce_grads and not forward_only:
        program = reduce(program, capture, bucket_bytes=int(config.reduce_bucket_mb * 2**20))
    program = streams(program)
    if config.free_early:
        program = free(program, capture)
    return program


def run_plain(stages: Sequence[Stage], capture: Capture, model: nn.Module,
              inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """One microbatch, stages in plain order (all forward, then all backward), gradients
    into ``p.grad``; returns the loss. The reference the interleaved program must equal."""
    program = free(schedule(list(stages), capture, 1), capture)
    device = next(model.parameters()).device
    runner = ProgramRunner(program, stages, capture, device, grads=accumulate_into(model, capture))
    state = runner.run(static_values(capture, model), [inputs])
    return state.outputs[0][capture.loss_name]
