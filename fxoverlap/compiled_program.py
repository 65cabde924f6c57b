"""One compile entry and the program value the front ends run.

:func:`compile_program` turns a capture and its stages into a :class:`CompiledProgram` for one
:class:`ProgramSpec` (microbatch count, forward-only, gradient reduction): the program graph,
its runner and its CUDA graphs. :class:`CompiledModel` is what the engine caches under one
:class:`~fxoverlap.program_key.ProgramKey`: the capture and stages (built once: the trace and
the Inductor compiles) and the programs made from them, one per spec.

Nothing here is bound to parameter objects: a run takes the parameters and buffers
(``static``) and the gradient sink it is given, so a program outlives ``model.to()``,
``load_state_dict(assign=True)`` or ``copy.deepcopy``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.fx

from fxoverlap.config import OverlapConfig
from fxoverlap.cudagraphs import GraphCache
from fxoverlap.ir.capture import Capture
from fxoverlap.ir.stage import Stage, format_stage_table
from fxoverlap.pipeline import build_program, build_stages, make_runner
from fxoverlap.runtime import GradSink, ProgramRunner, RunState, StageHook


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """What one program of a capture does: how many microbatches, forward only or not,
    whether it reduces gradients over data parallelism, and (one microbatch: the backend's
    pipeline stages) whether its backward computes the ``delay_wgrad`` weight gradients last."""

    microbatches: int
    forward_only: bool = False
    reduce_grads: bool = False
    weight_last: bool = False


@dataclasses.dataclass
class CompiledProgram:
    """A runnable program: its spec, the program graph over the capture's stages, and its
    runner (streams, events, CUDA graphs, the reduction's runtime)."""

    spec: ProgramSpec
    capture: Capture
    stages: list[Stage]
    program: torch.fx.GraphModule
    runner: ProgramRunner

    def run(self, static: dict[str, torch.Tensor], microbatches: Sequence[tuple], *, grads: GradSink | None = None,
            on_error: Callable | None = None, params: dict[str, torch.Tensor] | None = None) -> RunState:
        """Run over ``microbatches`` with the parameters and buffers ``static`` (by placeholder
        name); gradients go to ``grads`` (None: handed out with the outputs); ``params``: the
        call's parameters by name, for the gradient reduction (None: it looks them up)."""
        return self.runner.run(static, microbatches, on_error=on_error, grads=grads, params=params)

    def stage_table(self) -> str:
        return format_stage_table(self.stages)


def compile_program(capture: Capture, stages: list[Stage], config: OverlapConfig, spec: ProgramSpec,
                    device: torch.device, *, graphs: GraphCache | None = None,
                    reducer: Callable[[torch.fx.GraphModule], object] | None = None,
                    hook: StageHook | None = None, sharding=None) -> CompiledProgram:
    """The one compile entry: the program for ``spec`` over ``stages`` (phase "program" of the
    pass list), and its runner. ``reducer(program)`` makes the runtime of the gradient reductions
    the program places (``spec.reduce_grads``); ``hook`` wraps every stage call (the benchmark's
    timing); ``sharding`` (a :class:`fxoverlap.param_shard.ParamSharding` that adopted its units):
    the program gathers its parameter units (ZeRO-3)."""
    program = build_program(stages, capture, spec.microbatches, config, forward_only=spec.forward_only,
                            reduce_grads=spec.reduce_grads, weight_last=spec.weight_last,
                            units=() if sharding is None else sharding.units)
    runner = make_runner(program, stages, capture, device, config,
                         cuda_graphs=None if graphs is None else graphs.get(program, stages, capture, device),
                         reducer=None if reducer is None else reducer(program), hook=hook, sharding=sharding)
    return CompiledProgram(spec, capture, stages, program, runner)


@dataclasses.dataclass
class CompiledModel:
    """What one :class:`~fxoverlap.program_key.ProgramKey` compiled: the capture, its stages
    (traced and compiled once) and the programs over them, by spec."""

    capture: Capture
    stages: list[Stage]
    programs: dict[ProgramSpec, CompiledProgram] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, capture: Capture, config: OverlapConfig, device: torch.device, train: bool) -> CompiledModel:
        return cls(capture, build_stages(capture, config, device.type, train))

    def program(self, spec: ProgramSpec, make: Callable[[ProgramSpec], CompiledProgram]) -> CompiledProgram:
        prog = self.programs.get(spec)
        if prog is None:
            prog = self.programs[spec] = make(spec)
        return prog

    def close(self, graphs: GraphCache) -> None:
        """Release the CUDA graphs of every program (when the cache evicts this entry)."""
        for prog in self.programs.values():
            graphs.release(prog.program)
        self.programs.clear()
