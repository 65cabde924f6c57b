"""The program's vocabulary: what its nodes do, and the dataflow record each one carries.

A program is an FX graph emitted by ``passes/schedule.py`` and finished by
``reduce`` (with data parallelism), ``shard`` (with sharded parameters), ``streams`` and ``free``. Its nodes, in order, are:

* stage calls: ``call_module`` on a :class:`StageCall` placeholder (``self.fwd_l0_attn(mb)``);
* ``call_function`` on the markers below: the runtime (``fxoverlap.runtime``) has
  one method per marker; calling a marker directly does nothing.

Every stage call and every ``output`` / ``accumulate`` / ``mutate`` /
``reduce_grads`` / ``finish_reduce`` node carries a :class:`Step` under
``node.meta[STEP_KEY]``: its microbatch, stream, and the values of that
microbatch's store it reads and writes. The schedule records
them once; ``streams``, ``free``, the CUDA-graph runtime, the benchmark and the
backend read them (see :func:`steps`) instead of working them out again.
"""

from __future__ import annotations

import dataclasses

import torch.fx
import torch.nn as nn

from fxoverlap.ir.bucket import Bucket
from fxoverlap.ir.unit import ParamUnit
from fxoverlap.ir.meta import PROGRAM_KEY, STEP_KEY
from fxoverlap.ir.stage import StreamKind
from fxoverlap.ir.errors import FxOverlapError


class ProgramError(FxOverlapError, RuntimeError):
    """A program marker was used as a module (a program is walked by the runtime, not called)."""


@dataclasses.dataclass
class Program:
    """The facts about a program that are not nodes: ``schedule`` makes it, ``reduce`` adds the
    buckets. ``graph_module`` is the program itself (what ``engine.program`` returns); it
    carries this record as ``graph_module.meta[PROGRAM_KEY]`` (:func:`program_of`)."""

    graph_module: torch.fx.GraphModule
    num_microbatches: int
    num_layers: int
    forward_only: bool = False
    buckets: tuple[Bucket, ...] = ()  # reduce: the gradient buckets, in the order they are issued
    units: tuple[ParamUnit, ...] = ()  # shard: the parameter units the program gathers and drops
    gathered_peak: int = 0  # shard: the most units gathered (or being gathered) at any point
    gathered_peak_bytes: int = 0  # shard: the most bytes of them


def program_of(program: torch.fx.GraphModule) -> Program:
    """The :class:`Program` record of a program ``schedule`` emitted."""
    return program.meta[PROGRAM_KEY]


@dataclasses.dataclass(frozen=True)
class Step:
    """What one program node does with its microbatch's value store."""

    microbatch: int
    stream: StreamKind
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    stage: str | None = None  # the stage a stage call runs
    slot: tuple[int, int, int] | None = None  # (merged step, layer pair, slot), None outside the slots
    bucket: int | None = None  # reduce_grads / finish_reduce: the bucket
    # streams: positions in ``reads`` of the values written on the other stream (the inputs,
    # parameters and buffers count as the compute stream's): the runtime keeps their memory
    # from being reused on the writer's stream until this node's stream is done with them
    cross: tuple[int, ...] = ()


class StageCall(nn.Module):
    """Placeholder module that names a stage in the program; the runtime executes it."""

    def __init__(self, stage_name: str):
        super().__init__()
        self.stage_name = stage_name

    def forward(self, microbatch: int):  # pragma: no cover - the runtime interprets the program
        raise ProgramError("a program is walked by fxoverlap.runtime.ProgramRunner, not called")


def record_event(name: str, stream: str) -> None:
    """Record event ``name`` on ``stream`` after the work issued there so far."""


def wait_event(name: str, stream: str) -> None:
    """Make ``stream`` wait for event ``name`` before running further work."""


def free(microbatch: int, *values: str) -> None:
    """Drop ``values`` of ``microbatch`` from the value store (their last use has run)."""


def output(microbatch: int, *values: str) -> None:
    """Hand ``values`` (the loss, or the step's outputs) of ``microbatch`` to the caller."""


def accumulate(microbatch: int, *values: str) -> None:
    """Add the parameter gradients ``values`` of ``microbatch`` into their parameters' ``.grad``."""


def mutate(microbatch: int, *values: str) -> None:
    """Copy the new values of buffers (or inputs) the forward updates in place into them."""


def reduce_grads(microbatch: int, bucket: int, *values: str) -> None:
    """Add the last microbatch's gradients ``values`` to what their parameters' ``.grad``
    hold, into bucket ``bucket``'s flat buffer, and start reducing it over its group
    (comm stream). Writes the pending reduction to the store as ``bucket_value(bucket)``."""


def finish_reduce(microbatch: int, bucket: int) -> None:
    """Wait for bucket ``bucket``'s reduction, scale it, and hand it to ``p.grad`` (or to
    the rank's gradient shard)."""


def unshard(unit: int) -> None:
    """Start gathering parameter unit ``unit`` (an all-gather of every rank's shards on the
    parameter stream, over the unit's own communicator)."""


def wait_unshard(unit: int) -> None:
    """Wait for unit ``unit``'s gather (the compute stream waits) and put its full parameters
    into the value stores, under their placeholder names."""


def reshard(unit: int) -> None:
    """Drop unit ``unit``'s full parameters from the value stores (its last reader has run):
    each rank holds its shards only again."""


def bucket_value(bucket: int) -> str:
    """The store name of bucket ``bucket``'s pending reduction (no graph value has a ``#``)."""
    return f"bucket#{bucket}"


MARKERS = (record_event, wait_event, free, output, accumulate, mutate, reduce_grads, finish_reduce,
           unshard, wait_unshard, reshard)
# markers whose dataflow is a Step (their args are derived from it); the others carry their args only
STEP_MARKERS = (output, accumulate, mutate, reduce_grads, finish_reduce)


def marker_args(marker, step: Step) -> tuple:
    """The arguments of a marker that carries a Step, derived from it: the one encoding of the
    node's dataflow (the args only make the program's code readable; the runtime binds these).
    A mutation's reads are its new values, then the buffers or inputs they go into, pairwise."""
    if marker is reduce_grads:
        return (step.microbatch, step.bucket, *step.reads)
    if marker is finish_reduce:
        return (step.microbatch, step.bucket)
    if marker is mutate:
        return (step.microbatch, *step.reads[: len(step.reads) // 2])
    return (step.microbatch, *step.reads)


def add_marker(graph: torch.fx.Graph, marker, step: Step, name: str | None = None) -> torch.fx.Node:
    """A marker node at the graph's insertion point, its args derived from ``step`` (:func:`marker_args`)."""
    node = graph.create_node("call_function", marker, marker_args(marker, step), name=name)
    node.meta[STEP_KEY] = step
    return node
for _f in MARKERS:
    _f.__module__ = "fxoverlap.program"


def steps(program: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, Step]]:
    """The program's nodes that carry a :class:`Step`, in program order."""
    return [(n, n.meta[STEP_KEY]) for n in program.graph.nodes if STEP_KEY in n.meta]


def stage_calls(program: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, Step]]:
    """The stage calls among :func:`steps`."""
    return [(n, s) for n, s in steps(program) if s.stage is not None]
