"""How tuning times (:class:`Timer`): :class:`CudaEventTimer` times whole ``forward_backward``
steps with CUDA events (the default, and the only one on CUDA); :class:`WallTimer` uses the host
clock (CPU smoke runs); a test passes its own. Without CUDA and without a timer, tuning is
skipped (:func:`fxoverlap.tune.api.tune_with_report`: one ``TuneSkipped`` warning, the config kept
as given).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fxoverlap.tune.candidates import Candidate


class Timer(Protocol):
    """How tuning times. ``step_ms(candidate, step, iters)``: the median ms of ``iters`` calls of
    ``step`` (a whole ``forward_backward``) run with ``candidate``; ``stage_hook()``: a
    ``ProgramRunner`` hook that records each stage call's time alone in its ``times`` (ms by
    program node name), or None when this timer measures no stages (no step model then).
    A timer may also have ``step_times(candidate, step, iters)``, every reading in ms: then
    the search reports how far they spread (:func:`step_readings`)."""

    def step_ms(self, candidate: Candidate, step: Callable[[], Any], iters: int) -> float: ...

    def stage_hook(self) -> Any: ...


def step_readings(timer: Timer, candidate: Candidate, step: Callable[[], Any], iters: int) -> list[float]:
    """The timer's readings of ``iters`` steps: every one where it gives them (``step_times``),
    else its median alone."""
    if hasattr(timer, "step_times"):
        return list(timer.step_times(candidate, step, iters))
    return [timer.step_ms(candidate, step, iters)]


class _StageHook:
    """Runs each stage alone (synchronised before and after on CUDA) and records its time."""

    def __init__(self, cuda: bool, device: torch.device | None):
        self.cuda, self.device = cuda, device
        self.times: dict[str, float] = {}

    def __call__(self, node, stage, run):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outs = run()
            end.record()
            torch.cuda.synchronize(self.device)
            self.times[node.name] = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            outs = run()
            self.times[node.name] = (time.perf_counter() - t0) * 1e3
        return outs


class CudaEventTimer:
    """Whole steps between two CUDA events on the current stream, synchronised around each
    (the bench's timing); stages alone through a synchronising hook."""

    def __init__(self, device: torch.device):
        self.device = device

    def step_times(self, candidate: Candidate, step: Callable[[], Any], iters: int) -> list[float]:
        times = []
        for _ in range(iters):
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(self.device)
            times.append(start.elapsed_time(end))
        return times

    def step_ms(self, candidate: Candidate, step: Callable[[], Any], iters: int) -> float:
        return statistics.median(self.step_times(candidate, step, iters))

    def stage_hook(self) -> _StageHook:
        return _StageHook(True, self.device)


class WallTimer:
    """Host wall-clock timing (``time.perf_counter``): for CPU smoke runs of the whole flow;
    on a GPU, :class:`CudaEventTimer` is the one that measures the device."""

    def step_times(self, candidate: Candidate, step: Callable[[], Any], iters: int) -> list[float]:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    def step_ms(self, candidate: Candidate, step: Callable[[], Any], iters: int) -> float:
        return statistics.median(self.step_times(candidate, step, iters))

    def stage_hook(self) -> _StageHook:
        return _StageHook(False, None)
