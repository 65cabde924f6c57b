"""The step model: a candidate's step time predicted from stage times measured once.

Each stage's time is measured once, on the defaults' program (:meth:`fxoverlap.tune.session.Session.profile`:
a synchronised run through the runner's stage hook, combined over ranks as one lockstep step:
compute with its slowest rank, comm with its fastest); a candidate's program is built without
compiling (eager stages: its structure only) and replayed on two in-order streams
(:func:`replay`), its stages' times derived from the measured ones (:meth:`StageProfile.estimate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch.fx

from fxoverlap.ir.program import stage_calls
from fxoverlap.ir.stage import Direction, Part, Stage, StageKind, StreamKind

#: Step-model constants (documented in docs/tune.md, "The step model"). A chunk of K costs
#: 1/K of its whole stage plus this share (smaller GEMMs, the rows' copies; the 12-02
#: measurements put chunks 4 at ~15 % more compute on the experts: ~5 % a chunk).
CHUNK_COST = 0.05
#: The weight-gradient share of a backward attn/experts/mlp stage when only the unsplit stage
#: was measured (dX and dW of a linear layer are GEMMs of equal FLOPs).
WGRAD_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Call:
    """One stage call of a program: node name, stage, stream, and the earlier calls it reads."""

    name: str
    stage: str
    stream: str
    deps: tuple[str, ...] = ()


def calls_of(program: torch.fx.GraphModule) -> list[Call]:
    """The stage calls of ``program`` in the runtime's order, with what each reads."""
    producer: dict[tuple[int, str], str] = {}
    out = []
    for n, st in stage_calls(program):
        deps = tuple(dict.fromkeys(producer[(st.microbatch, v)] for v in st.reads if (st.microbatch, v) in producer))
        out.append(Call(n.name, st.stage, st.stream.value, deps))
        for v in st.writes:
            producer[(st.microbatch, v)] = n.name
    return out


def replay(calls: Sequence[Call], stage_ms: Mapping[str, float]) -> float:
    """The step time of ``calls`` run on two in-order streams (compute, comm), each call starting
    when its stream is free and the calls it reads have ended, each taking its stage's time
    (``stage_ms`` by stage name): what the schedule's events allow, without the host or
    contention."""
    end: dict[str, float] = {}
    free = {StreamKind.COMP.value: 0.0, StreamKind.COMM.value: 0.0}
    for c in calls:
        s = StreamKind.COMM.value if c.stream == StreamKind.COMM.value else StreamKind.COMP.value
        t0 = max([free[s], *(end[d] for d in c.deps if d in end)])
        end[c.name] = free[s] = t0 + stage_ms[c.stage]
    return max(free.values())


_SPLIT_KINDS = (StageKind.ATTN, StageKind.EXPERTS, StageKind.MLP)


def _role(stage: Stage) -> tuple:
    return (stage.direction.value, stage.layer, stage.kind.value)


@dataclasses.dataclass
class StageProfile:
    """Stage times measured once (ms per call, by stage name) on one program's stages, and the
    rules that derive the time of a stage of another candidate's program from them.

    Per role (direction, layer, kind) and part, the *whole* time: the unchunked stage's, or the sum
    of its chunks' less :data:`CHUNK_COST` each. A candidate's stage then takes: its measured time
    if the same stage was measured; else its part's whole time (a backward attn/experts/mlp stage
    not split into weight gradients: main + wgrad; split where only the whole was measured:
    :data:`WGRAD_SHARE` of it to the wgrad part), divided by its layer's chunk count K and
    times (1 + CHUNK_COST) for a chunk. A role never measured takes 0."""

    stage_ms: dict[str, float]
    stages: list[Stage]
    chunk_cost: float = CHUNK_COST
    wgrad_share: float = WGRAD_SHARE

    def __post_init__(self) -> None:
        whole: dict[tuple, dict[str, float]] = {}
        chunked: dict[tuple, dict[str, list[float]]] = {}
        for s in self.stages:
            t = self.stage_ms.get(s.name)
            if t is None:
                continue
            part = s.part.value
            if s.chunk is None:
                whole.setdefault(_role(s), {})[part] = t
            else:
                chunked.setdefault(_role(s), {}).setdefault(part, []).append(t)
        self._chunks = {(role, part): len(ts) for role, parts in chunked.items() for part, ts in parts.items()}
        for role, parts in chunked.items():
            for part, ts in parts.items():
                cost = 1 + (self.chunk_cost if len(ts) > 1 else 0.0)
                whole.setdefault(role, {}).setdefault(part, sum(ts) / cost)
        self._whole = whole

    def estimate(self, stage: Stage, stages: Sequence[Stage]) -> float:
        """The time of ``stage``, one of ``stages`` (a candidate's), by the rules above."""
        role, part = _role(stage), stage.part
        parts = self._whole.get(role, {})
        main, wgrad = parts.get(Part.MAIN.value), parts.get(Part.WGRAD.value)
        splits = part in (Part.MAIN, Part.WGRAD) and stage.direction is Direction.BWD and stage.kind in _SPLIT_KINDS
        split_here = splits and any(_role(s) == role and s.part is Part.WGRAD for s in stages)
        k = sum(1 for s in stages if _role(s) == role and s.part is part and s.chunk is not None)
        if (stage.name in self.stage_ms and split_here == (splits and wgrad is not None)
                and (stage.chunk is None or self._chunks.get((role, part.value)) == k)):
            return self.stage_ms[stage.name]  # the same stage was measured (same split, same chunks)
        if splits:
            combined = (main or 0.0) + (wgrad or 0.0)
            if part is Part.WGRAD:
                t = wgrad if wgrad is not None else combined * self.wgrad_share
            elif split_here:
                t = main if wgrad is not None else combined * (1 - self.wgrad_share)
            else:
                t = combined
        else:
            t = parts.get(part.value, 0.0)
        if stage.chunk is not None:
            t = t / max(k, 1) * (1 + (self.chunk_cost if k > 1 else 0.0))
        return t

    def sums(self) -> dict[str, float]:
        """Per stream, the measured stage times of the profiled program, per call (``comp``, ``comm``)."""
        out = {StreamKind.COMP.value: 0.0, StreamKind.COMM.value: 0.0}
        for s in self.stages:
            out[s.stream.value] += self.stage_ms.get(s.name, 0.0)
        return out


def predict_ms(program: torch.fx.GraphModule, stages: Sequence[Stage], profile: StageProfile) -> float:
    """The step model's time for ``program`` over ``stages``: :func:`replay` with
    :meth:`StageProfile.estimate` per stage."""
    times = {s.name: profile.estimate(s, stages) for s in stages}
    return replay(calls_of(program), times)


def stream_busy_ms(program: torch.fx.GraphModule, stage_ms: Mapping[str, float]) -> dict[str, float]:
    """Per stream, the sum of the times of the program's stage calls (``stage_ms`` by stage)."""
    out = {StreamKind.COMP.value: 0.0, StreamKind.COMM.value: 0.0}
    for c in calls_of(program):
        out[StreamKind.COMM.value if c.stream == StreamKind.COMM.value else StreamKind.COMP.value] += stage_ms[c.stage]
    return out
