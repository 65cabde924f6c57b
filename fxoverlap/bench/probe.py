"""Runner hooks of the benchmark (``ProgramRunner(hook=...)``): time each stage alone, or
mark every stage call of one interleaved step for the timeline and the profiler."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from fxoverlap.bench.metrics import ProgramCall
from fxoverlap.ir.errors import FxOverlapError


class ProbeError(FxOverlapError, RuntimeError):
    """The bench probe's runtime called a program node other than the one the program has next."""


class _Clock:
    """Start/end marks on the device (CUDA events) or the host (``perf_counter``)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


class StageTimer:
    """Runs each stage alone (synchronised before and after) and records its time in ms
    under its program node name: for T_serial / T_bound. With the ``stats`` of an emulated
    group (``EmulatedGroup.stats``), also what its link held each call for (``holds``, ms;
    calls that held nothing are left out)."""

    def __init__(self, cuda: bool, device: torch.device, stats: Any = None):
        self.clock, self.device, self.stats = _Clock(cuda), device, stats
        self.times: dict[str, float] = {}
        self.holds: dict[str, float] = {}

    def __call__(self, node, stage, run):
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        held = 0.0 if self.stats is None else self.stats.seconds
        start = self.clock.mark()
        outs = run()
        end = self.clock.mark()
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        self.times[node.name] = self.clock.ms(start, end)
        if self.stats is not None and self.stats.seconds > held:
            self.holds[node.name] = (self.stats.seconds - held) * 1e3
        return outs


class TimelineProbe:
    """Labels each stage call for the profiler (``record_function``) and marks its start
    and end, without synchronising: the step runs as it would, interleaved.

    Checks that the runtime calls the stages in the program's order (``calls``);
    :meth:`timeline` gives the marks in ms from :meth:`start`.
    """

    def __init__(self, calls: Sequence[ProgramCall], cuda: bool):
        self.calls, self.clock, self.i = list(calls), _Clock(cuda), 0
        self.marks: list[tuple[ProgramCall, str, Any, Any]] = []  # (call, its stage's kind, start, end)
        self.origin: Any = None

    def start(self) -> None:
        """The step's origin: call right before the program runs."""
        self.origin = self.clock.mark()

    def __call__(self, node, stage, run):
        call = self._next_call(node.name)
        with torch.profiler.record_function(f"fxoverlap.stage {call.name}"):
            start = self.clock.mark()
            out = run()
            self.marks.append((call, stage.kind.value, start, self.clock.mark()))
        return out

    def _next_call(self, node_name: str) -> ProgramCall:
        if self.i >= len(self.calls) or self.calls[self.i].name != node_name:
            want = self.calls[self.i].name if self.i < len(self.calls) else "nothing"
            raise ProbeError(f"bench probe: the runtime called {node_name} where the program has {want}")
        self.i += 1
        return self.calls[self.i - 1]

    def timeline(self) -> list[dict]:
        """[{name, stage, kind, mb, stream, slot, start, end}] in ms from the step's start."""
        return [
            {"name": call.name, "stage": call.stage, "kind": kind, "mb": call.microbatch, "stream": call.stream,
             "slot": list(call.slot) if call.slot else None,
             "start": self.clock.ms(self.origin, s), "end": self.clock.ms(self.origin, e)}
            for call, kind, s, e in self.marks
        ]
