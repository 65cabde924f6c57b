"""One tuning run's engines and structures (:class:`Session`), the stage profile it measures, and
the model's state kept across it.

Tuning runs real steps: ``p.grad`` and the model's buffers (load-balance counters) are saved
before and restored after, as are the RNG states (:func:`preserved`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from fxoverlap.config import OverlapConfig
from fxoverlap.ir.program import stage_calls
from fxoverlap.ir.stage import StreamKind
from fxoverlap.tune.candidates import Candidate


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """Run real steps on ``model`` and leave its ``p.grad``, buffers and the RNG states as found."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def set_runtime_knobs(runner, candidate: Candidate, device: torch.device) -> None:
    """Apply the candidate's ``"runtime"`` fields to a compiled program's runner (no recompile).
    A CUDA-graphed experts stage keeps the carve-out of the run that captured it."""
    runner.sm_carveout = candidate.sm_carveout
    if device.type == "cuda" and runner.streams:
        runner.streams[StreamKind.COMM] = torch.cuda.Stream(device, priority=candidate.comm_stream_priority)


class Session:
    """One tuning run: the engines, the structures and the timings of one model and call."""

    def __init__(self, model, ep_group, mbs, fn, forward_only, base, timer, ranks, dp_group, expert_dp_group):
        self.model, self.ep_group, self.mbs, self.fn = model, ep_group, list(mbs), fn
        self.forward_only, self.base, self.timer, self.ranks = forward_only, base, timer, ranks
        self.dp_group, self.expert_dp_group = dp_group, expert_dp_group
        p = next(model.parameters(), None)
        self.device = p.device if p is not None else torch.device("cpu")
        self._structures: dict[tuple, tuple] = {}

    def engine(self, cfg: OverlapConfig):
        from fxoverlap.engine import optimize

        return optimize(self.model, self.ep_group, cfg, dp_group=self.dp_group, expert_dp_group=self.expert_dp_group)

    def step(self, engine) -> Callable[[], Any]:
        if self.forward_only:
            def fwd():
                with torch.no_grad():
                    return engine.forward_only(self.mbs, self.fn)
            return fwd

        def train():
            self.model.zero_grad(set_to_none=True)
            return engine.forward_backward(self.mbs, self.fn)
        return train

    def runner(self, engine, hook=None):
        """The runner the engine's step runs with (compiled by now), or one like it through ``hook``."""
        checked = engine._check(self.mbs, self.fn, "tune", "output_fn" if self.forward_only else "loss_fn")
        entry, tensors = engine._entry(checked[0], self.fn, train=not self.forward_only)
        prog = engine._program(entry, len(checked), train=not self.forward_only, hook=hook)
        return prog, entry, tensors, checked

    def seed_structure(self, cand: Candidate, engine) -> None:
        """Take ``cand``'s capture and stages from its compiled engine (no second capture)."""
        _, entry, _, _ = self.runner(engine)
        self._structures[cand.stages_part()] = (entry.capture, entry.stages)

    def profile(self, engine, timer) -> dict[str, float] | None:
        """Each stage's time alone (ms per call, median over its calls), from the second of two
        synchronised runs: the hooked runner is a new one, and its first run captures the CUDA
        graphs of its stages (measured on an H100, 2026-12-05: attention stages 5 ms in that run,
        a 24 ms step predicted as 126 ms)."""
        from fxoverlap.runtime import accumulate_into, static_values

        hook = timer.stage_hook()
        if hook is None:
            return None
        prog, entry, tensors, checked = self.runner(engine, hook)
        for _ in range(2):
            hook.times.clear()
            self.model.zero_grad(set_to_none=True)
            grads = None if self.forward_only else accumulate_into(tensors, entry.capture)
            with torch.no_grad() if self.forward_only else contextlib.nullcontext():
                prog.run(static_values(entry.capture, tensors), checked, grads=grads)
        by_stage: dict[str, list[float]] = {}
        names = {n.name: st.stage for n, st in stage_calls(prog.program)}
        for node, ms in hook.times.items():
            by_stage.setdefault(names[node], []).append(ms)
        stages = sorted(by_stage)
        mine = [statistics.median(by_stage[s]) for s in stages]
        # one lockstep step: compute with its slowest rank, comm with its fastest
        comm = {s.name for s in entry.stages if s.stream is StreamKind.COMM}
        hi, lo = self.ranks.max(mine), self.ranks.min(mine)
        return {s: (lo[i] if s in comm else hi[i]) for i, s in enumerate(stages)}

    def structure(self, cand: Candidate, n: int | None = None):
        """The stages and the program of ``cand`` for ``n`` microbatches (default: this call's),
        built with eager stages (no compile: the structure only)."""
        from fxoverlap.pipeline import build_program

        key = cand.stages_part()
        if key not in self._structures:
            cfg = dataclasses.replace(cand.config(self.base), compiler="eager", cuda_graphs=False, progress=False)
            eng = self.engine(cfg)
            checked = eng._check(self.mbs, self.fn, "tune", "output_fn" if self.forward_only else "loss_fn")
            entry = eng._compiled(checked[0], self.fn, train=not self.forward_only)
            self._structures[key] = (entry.capture, entry.stages)
        cap, stages = self._structures[key]
        cfg = cand.config(self.base)
        program = build_program(stages, cap, n or len(self.mbs), cfg, forward_only=self.forward_only)
        return stages, program
