"""Benchmark: fxoverlap's interleaved program against eager sequential, on one model.

Run one process per rank; the expert-parallel group is the whole world::

    torchrun --nproc-per-node 2 -m fxoverlap.bench                      # GPU, the peer's shape
    torchrun --nproc-per-node 2 -m fxoverlap.bench --tiny --device cpu  # CPU, gloo, tiny shape

Builds ``MoETransformer(MoEConfig.benchmark())`` (the shape of the Megatron-Core
peer measurement in DESIGN.md; other shapes by flags), then in one run, on the
same weights and microbatches:

* **eager**: ``for mb in microbatches: model(*mb).backward()``
* **compile**: the same loop through ``torch.compile(model)`` (Inductor, no overlap): the
  strongest no-overlap alternative a user has, and the baseline to beat
* **backend**: the same loop through ``torch.compile(model, backend="fxoverlap")``
* **fxoverlap**: ``fxoverlap.optimize(model, group).forward_backward(microbatches)``

Each mode: warm-up, then the median of ``--iters`` steps timed with CUDA events
(wall clock on CPU); the step time is the slowest rank's median. Gradients are
zeroed (set to None) before every step; peak memory
(``torch.cuda.max_memory_allocated``) is reset after the warm-up of each mode.

``T_serial`` and ``T_bound`` (DESIGN.md, "Benchmark definitions") come from the
same program run by a :class:`~fxoverlap.runtime.ProgramRunner` with
``time_stages=True``, which runs each stage alone (synchronised):
``T_serial`` = sum of all stage times; ``T_bound`` = for each merged-step slot
(``meta["slot"]``) max(sum of compute-stream stage times, sum of comm-stream
stage times), plus every stage time outside the slots. Stage times are combined
over ranks: a compute stage counts with its slowest rank (the others wait for it
at the next all-to-all), a comm stage with its fastest rank (the all-to-all's
time on the other ranks includes waiting for the last rank to arrive), so the
sums describe one lockstep serial step of the whole group. Per-rank sums are in
the JSON as well. A first stage-timed run is not counted (warm-up); each stage's
time is its median over ``--stage-reps`` runs. Overlap efficiency =
(T_serial - T_fx) / (T_serial - T_bound).

Numerics: the per-microbatch losses of both modes, and fxoverlap's gradients
against eager's (max abs difference, bitwise or not) beside eager's own
run-to-run difference (a second eager step on the same data).

One more fxoverlap step is run with CUDA events around every stage call (the
timeline): ``timeline_stats`` in the JSON gives, per rank, how busy each stream
was and how much of the comm stream's time ran under compute, and per
(direction, kind) the stages' time inside the interleaved step against their
time alone, i.e. what running side by side costs each of them.

Writes under ``--out`` (default ``bench_out/``): ``<name>.json`` with every
number, ``<name>_trace.json.gz`` (a ``torch.profiler`` Chrome trace of one
fxoverlap step on rank 0, stages labelled by ``record_function``) and
``<name>_timeline.png`` (which stage ran when on the compute and comm stream of
every rank during one fxoverlap step, from CUDA events around each stage;
needs matplotlib, skipped with a message without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.config import OverlapConfig
from fxoverlap.models.moe import MoEConfig, MoETransformer
from fxoverlap.program_ops import stage_calls
from fxoverlap.runtime import ProgramRunner, accumulate_into, static_values

MODES = ("eager", "compile", "backend", "fxoverlap")
COMP, COMM = "comp", "comm"


# ---------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fxoverlap.bench",
        description="fxoverlap vs eager sequential on the reference MoE model (run under torchrun).",
    )
    shape = p.add_argument_group("shape (defaults: MoEConfig.benchmark(), or MoEConfig.tiny() with --tiny)")
    shape.add_argument("--tiny", action="store_true", help="a few-millisecond shape for CPU smoke tests")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--dim", type=int, help="hidden size")
    shape.add_argument("--heads", type=int)
    shape.add_argument("--experts", type=int)
    shape.add_argument("--top-k", type=int)
    shape.add_argument("--expert-dim", type=int, help="expert FFN hidden size")
    shape.add_argument("--shared-expert-dim", type=int, help="0: no shared expert")
    shape.add_argument("--vocab", type=int)
    shape.add_argument("--seq", type=int, help="sequence length (default 4096; 32 with --tiny)")
    shape.add_argument("--microbatches", type=int, help="default 8; 3 with --tiny")
    shape.add_argument("--micro-batch-size", type=int, help="sequences per microbatch (default 1; 2 with --tiny)")
    shape.add_argument("--routing", choices=("dropless", "capacity", "dedup"),
                       help="dedup: dropless, each token sent once per destination rank (MoEConfig.token_dedup)")
    shape.add_argument("--capacity-factor", type=float)
    run = p.add_argument_group("run")
    run.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    run.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                     help="auto: bf16 on GPU, fp32 on CPU")
    run.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    run.add_argument("--warmup", type=int, help="warm-up steps per mode (default 3; 1 with --tiny)")
    run.add_argument("--iters", type=int, help="timed steps per mode (default 8; 3 with --tiny)")
    run.add_argument("--no-stage-timing", action="store_true",
                     help="skip the stage-timed runs (T_serial, T_bound), the timeline and the trace")
    run.add_argument("--stage-reps", type=int, default=3,
                     help="runs of the stage-timed program for T_serial/T_bound (median per stage)")
    run.add_argument("--overlap-config", default="",
                     help="OverlapConfig fields, e.g. comm_stream_priority=0,delay_wgrad=1")
    run.add_argument("--seed", type=int, default=1234)
    run.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds")
    run.add_argument("--nccl-high-priority", type=int, choices=(0, 1), default=1,
                     help="run NCCL's internal stream at high priority (ProcessGroupNCCL option); the "
                          "all-to-all kernels run there, not on fxoverlap's comm stream")
    run.add_argument("--nccl-max-ctas", type=int, default=None,
                     help="cap the CTAs (SMs) NCCL kernels may take, leaving more to the GEMMs")
    run.add_argument("--no-grad-check", action="store_true",
                     help="skip comparing fxoverlap's gradients with eager's (needs a host copy of the grads)")
    out = p.add_argument_group("output")
    out.add_argument("--out", default="bench_out", help="output folder")
    out.add_argument("--name", default="bench", help="file name stem of the outputs (e.g. a regime tag)")
    out.add_argument("--no-trace", action="store_true", help="skip the Chrome trace")
    out.add_argument("--no-timeline", action="store_true", help="skip the timeline PNG")
    out.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown mode(s) {bad}; choose from {list(MODES)}")
    args.modes = modes
    defaults = dict(seq=32, microbatches=3, micro_batch_size=2, warmup=1, iters=3) if args.tiny else dict(
        seq=4096, microbatches=8, micro_batch_size=1, warmup=3, iters=8)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.iters < 1 or args.warmup < 0 or args.stage_reps < 1:
        p.error("need --iters >= 1, --warmup >= 0, --stage-reps >= 1")
    try:
        args.overlap = parse_overlap_config(args.overlap_config)
    except ValueError as e:
        p.error(str(e))
    return args


def parse_overlap_config(text: str) -> OverlapConfig:
    """``"comm_stream_priority=0,delay_wgrad=1"`` -> ``OverlapConfig(...)``."""
    fields = {f.name: f for f in dataclasses.fields(OverlapConfig)}
    kw: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, val = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"--overlap-config: {item!r} is not FIELD=VALUE with FIELD one of {sorted(fields)}")
        default = fields[key].default
        if isinstance(default, bool):
            kw[key] = val.lower() in ("1", "true", "yes", "on")
        elif isinstance(default, int):
            kw[key] = int(val)
        elif isinstance(default, float):
            kw[key] = float(val)
        else:
            kw[key] = None if val.lower() == "none" else val
    return OverlapConfig(**kw)


def routing_fields(routing: str | None) -> dict:
    """``MoEConfig`` fields of a routing name; "dedup" is dropless with each token sent once per rank."""
    if routing == "dedup":
        return dict(routing="dropless", token_dedup=True)
    return dict(routing=routing)


def model_config(args: argparse.Namespace) -> MoEConfig:
    over = {
        "n_layers": args.layers, "dim": args.dim, "n_heads": args.heads, "n_experts": args.experts,
        "top_k": args.top_k, "expert_dim": args.expert_dim, "shared_expert_dim": args.shared_expert_dim,
        "vocab_size": args.vocab, "capacity_factor": args.capacity_factor, **routing_fields(args.routing),
    }
    over = {k: v for k, v in over.items() if v is not None}
    cfg = MoEConfig.tiny(**over) if args.tiny else MoEConfig.benchmark(**over)
    if cfg.max_seq_len < args.seq:
        cfg = dataclasses.replace(cfg, max_seq_len=args.seq)
    return cfg


# ---------------------------------------------------------------- T_serial / T_bound


@dataclasses.dataclass(frozen=True)
class ProgramCall:
    """One stage call of a program: its node name, stage, microbatch, stream and slot."""

    name: str
    stage: str
    microbatch: int
    stream: str
    slot: tuple | None


def program_calls(program: torch.fx.GraphModule) -> list[ProgramCall]:
    """The stage calls of ``program`` in the order the runtime makes them."""
    return [ProgramCall(n.name, st.stage, st.microbatch, st.stream.value, st.slot) for n, st in stage_calls(program)]


def serial_and_bound(calls: Sequence[ProgramCall], times: dict[str, float]) -> dict[str, float]:
    """T_serial (all stage times added) and T_bound (per slot the larger stream's sum,
    plus everything outside slots), in the unit of ``times``, with their parts."""
    slots: dict[tuple, dict[str, float]] = {}
    outside = comp = comm = 0.0
    for c in calls:
        t = times[c.name]
        if c.stream == COMM:
            comm += t
        else:
            comp += t
        if c.slot is None:
            outside += t
        else:
            per = slots.setdefault(tuple(c.slot), {COMP: 0.0, COMM: 0.0})
            per[COMM if c.stream == COMM else COMP] += t
    in_slots_bound = sum(max(v[COMP], v[COMM]) for v in slots.values())
    hideable = sum(min(v[COMP], v[COMM]) for v in slots.values())
    return {
        "T_serial": comp + comm,
        "T_bound": outside + in_slots_bound,
        "comp": comp,
        "comm": comm,
        "outside_slots": outside,
        "in_slots_comp": sum(v[COMP] for v in slots.values()),
        "in_slots_comm": sum(v[COMM] for v in slots.values()),
        "hideable": hideable,
        "slots": len(slots),
    }


def combine_rank_times(calls: Sequence[ProgramCall], per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """One lockstep time per stage: slowest rank for compute, fastest rank for comm."""
    return {
        c.name: (min if c.stream == COMM else max)(r[c.name] for r in per_rank) for c in calls
    }


def overlap_efficiency(t_serial: float, t_bound: float, t_fx: float) -> float | None:
    denom = t_serial - t_bound
    return None if denom <= 0 else (t_serial - t_fx) / denom


def _overlap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted lists of disjoint intervals."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            tot += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def _disjoint(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    iv = sorted(iv)
    out: list[tuple[float, float]] = []
    for s, e in iv:
        if out and s < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def timeline_stats(timelines: Sequence[Sequence[dict]], stage_ms: dict[str, float]) -> dict[str, Any]:
    """From one probed step: per rank, how busy each stream was and how much of the comm
    stream's time ran while the compute stream was busy; per (direction, kind) on rank 0,
    the time of the stages inside the interleaved step against their time alone
    (``stage_ms``), which shows what running side by side costs each of them."""
    ranks = []
    for tl in timelines:
        comp = _disjoint([(e["start"], e["end"]) for e in tl if e["stream"] != COMM])
        comm = _disjoint([(e["start"], e["end"]) for e in tl if e["stream"] == COMM])
        comp_busy, comm_busy = sum(e - s for s, e in comp), sum(e - s for s, e in comm)
        ov = _overlap(comp, comm)
        ranks.append({
            "step_ms": max((e["end"] for e in tl), default=0.0),
            "comp_busy_ms": comp_busy,
            "comm_busy_ms": comm_busy,
            "comm_overlapped_ms": ov,
            "comm_overlapped_frac": ov / comm_busy if comm_busy else None,
        })
    kinds: dict[str, dict[str, float]] = {}
    for e in timelines[0] if timelines else []:
        key = f"{e['name'][0]} {_kind_of(e['stage'])}"
        k = kinds.setdefault(key, {"in_step_ms": 0.0, "alone_ms": 0.0, "calls": 0})
        k["in_step_ms"] += e["end"] - e["start"]
        k["alone_ms"] += stage_ms.get(e["name"], 0.0)
        k["calls"] += 1
    return {"per_rank": ranks, "by_kind_rank0": kinds}


# ---------------------------------------------------------------- stage probes


class _StageTimer:
    """A runner hook that runs each stage alone (synchronised) and records its time in ms
    under its program node name: for T_serial / T_bound."""

    def __init__(self, cuda: bool, device: torch.device):
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


class _Probe:
    """A runner hook that labels each stage call for the profiler and marks its start and end."""

    def __init__(self, recorder: "_Recorder"):
        self.recorder = recorder

    def __call__(self, node, stage, run):
        call = self.recorder.next_call(node.name)
        with torch.profiler.record_function(f"fxoverlap.stage {call.name}"):
            if self.recorder.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = run()
                end.record()
                self.recorder.marks.append((call, start, end))
            else:
                t0 = time.perf_counter()
                out = run()
                self.recorder.marks.append((call, t0, time.perf_counter()))
        return out


class _Recorder:
    def __init__(self, calls: Sequence[ProgramCall], cuda: bool):
        self.calls, self.cuda, self.i = list(calls), cuda, 0
        self.marks: list[tuple[ProgramCall, Any, Any]] = []
        self.origin: Any = None

    def next_call(self, node_name: str) -> ProgramCall:
        if self.i >= len(self.calls) or self.calls[self.i].name != node_name:
            want = self.calls[self.i].name if self.i < len(self.calls) else "nothing"
            raise RuntimeError(f"bench probe: the runtime called {node_name} where the program has {want}")
        self.i += 1
        return self.calls[self.i - 1]

    def timeline(self) -> list[dict]:
        """[{name, stage, mb, stream, slot, start, end}] in ms from the step's start."""
        rows = []
        for call, s, e in self.marks:
            if self.cuda:
                start, end = self.origin.elapsed_time(s), self.origin.elapsed_time(e)
            else:
                start, end = (s - self.origin) * 1e3, (e - self.origin) * 1e3
            rows.append({"name": call.name, "stage": call.stage, "mb": call.microbatch, "stream": call.stream,
                         "slot": list(call.slot) if call.slot else None, "start": start, "end": end})
        return rows


# ---------------------------------------------------------------- the benchmark


class Bench:
    def __init__(self, args: argparse.Namespace, group: dist.ProcessGroup, device: torch.device):
        self.args, self.group, self.device = args, group, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.cuda = device.type == "cuda"
        self.dtype = {
            "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
            "auto": torch.bfloat16 if self.cuda else torch.float32,
        }[args.dtype]
        self.cfg = model_config(args)
        torch.manual_seed(args.seed + self.rank)
        with torch.device(device):
            self.model = MoETransformer(self.cfg, group)
        self.model.to(self.dtype)
        g = torch.Generator().manual_seed(args.seed + 1000 * self.rank)
        shape = (args.micro_batch_size, args.seq)
        self.mbs = [
            tuple(torch.randint(0, self.cfg.vocab_size, shape, generator=g).to(device) for _ in range(2))
            for _ in range(args.microbatches)
        ]
        self.engine = fxoverlap.optimize(self.model, group, config=args.overlap)
        self._compiled = self._backend = None
        self.tokens_per_step = self.world * args.microbatches * args.micro_batch_size * args.seq
        self.result: dict[str, Any] = {}

    # -- helpers
    def log(self, msg: str) -> None:
        if self.rank == 0 and not self.args.quiet:
            print(f"[bench] {msg}", flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def zero_grads(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def step_eager(self) -> list[torch.Tensor]:
        losses = []
        for mb in self.mbs:
            loss = self.model(*mb)
            loss.backward()
            losses.append(loss.detach())
        return losses

    def step_fx(self) -> list[torch.Tensor]:
        return self.engine.forward_backward(self.mbs)

    def _loop(self, fn) -> list[torch.Tensor]:
        losses = []
        for mb in self.mbs:
            loss = fn(*mb)
            loss.backward()
            losses.append(loss.detach())
        return losses

    def step_compile(self) -> list[torch.Tensor]:
        if self._compiled is None:
            self._compiled = torch.compile(self.model)
        return self._loop(self._compiled)

    def step_backend(self) -> list[torch.Tensor]:
        if self._backend is None:
            cfg = self.args.overlap
            options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                       if getattr(cfg, f.name) != f.default and f.name != "compile_options"}
            options.update(cfg.compile_options or {})
            self._backend = torch.compile(self.model, backend="fxoverlap", options=options or None)
        return self._loop(self._backend)

    # -- one mode
    def time_mode(self, mode: str, step: Callable[[], list[torch.Tensor]]) -> dict[str, Any]:
        a = self.args
        res: dict[str, Any] = {}
        for i in range(a.warmup):
            self.zero_grads()
            t0 = time.perf_counter()
            step()
            self.sync()
            dt = time.perf_counter() - t0
            if i == 0:
                res["first_step_s"] = round(dt, 3)
            self.log(f"{mode} warm-up {i + 1}/{a.warmup} {dt * 1e3:.1f} ms (wall)")
        self.zero_grads()
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        times, wall = [], []
        losses: list[torch.Tensor] = []
        for i in range(a.iters):
            self.zero_grads()
            dist.barrier(group=self.group)
            self.sync()
            t0 = time.perf_counter()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                losses = step()
                end.record()
                self.sync()
                ms = start.elapsed_time(end)
            else:
                losses = step()
                ms = (time.perf_counter() - t0) * 1e3
            wall.append((time.perf_counter() - t0) * 1e3)
            times.append(ms)
            self.log(f"{mode} iter {i + 1}/{a.iters} {ms:.1f} ms")
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None
        mine = {"median_ms": statistics.median(times), "wall_median_ms": statistics.median(wall),
                "peak_gib": peak, "losses": [float(x) for x in losses], "iters_ms": times}
        ranks = self.gather(mine)
        step_ms = max(r["median_ms"] for r in ranks)
        res.update({
            "step_ms": step_ms,
            "step_ms_per_rank": [r["median_ms"] for r in ranks],
            "wall_step_ms": max(r["wall_median_ms"] for r in ranks),
            "iters_ms_rank0": ranks[0]["iters_ms"],
            "tokens_per_s": self.tokens_per_step / (step_ms / 1e3),
            "peak_mem_gib": None if peak is None else max(r["peak_gib"] for r in ranks),
            "peak_mem_gib_per_rank": [r["peak_gib"] for r in ranks],
            "losses_per_rank": [r["losses"] for r in ranks],
        })
        return res

    def grads_to_host(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().to("cpu", copy=True) for n, p in self.model.named_parameters() if p.grad is not None}

    def grad_check(self, ref: dict[str, torch.Tensor]) -> dict[str, Any]:
        worst = scale = 0.0
        bitwise, missing = True, []
        for n, p in self.model.named_parameters():
            r = ref.get(n)
            if (r is None) != (p.grad is None):
                missing.append(n)
                continue
            if r is None:
                continue
            g = p.grad.detach()
            r = r.to(g.device)
            # exact for bf16/fp16 grads in fp32, and for fp32 grads in fp64
            dt = torch.float64 if g.dtype == torch.float32 else torch.float32
            worst = max(worst, (g.to(dt) - r.to(dt)).abs().max().item())
            scale = max(scale, r.to(dt).abs().max().item())
            bitwise &= torch.equal(g, r)
            del r
        mine = {"max_abs_diff": worst, "max_abs_eager": scale, "bitwise": bitwise, "missing": missing}
        ranks = self.gather(mine)
        return {
            "grad_max_abs_diff": max(r["max_abs_diff"] for r in ranks),
            "grad_max_abs_eager": max(r["max_abs_eager"] for r in ranks),
            "grads_bitwise": all(r["bitwise"] for r in ranks),
            "grads_missing": sorted({m for r in ranks for m in r["missing"]}),
        }

    # -- stage timing
    def program(self):
        view = self.engine.plan(self.mbs)
        return view, view.program

    def run_program(self, plan, prog, hook) -> None:
        runner = ProgramRunner(prog, plan.stages, plan.capture, self.device,
                               grads=accumulate_into(self.model, plan.capture),
                               comm_stream_priority=self.engine.config.comm_stream_priority, hook=hook)
        runner.run(static_values(plan.capture, self.model), self.mbs)

    def stage_timing(self) -> dict[str, Any]:
        plan, prog = self.program()
        calls = program_calls(prog)
        reps: list[dict[str, float]] = []
        # One run first that is not counted: the first stage-timed run on a GPU was
        # seen 4x slower than the next for a small shape (allocator, new streams).
        for r in range(-1, self.args.stage_reps):
            self.zero_grads()
            dist.barrier(group=self.group)
            timer = _StageTimer(self.cuda, self.device)
            self.run_program(plan, prog, timer)
            self.sync()
            label = "warm-up" if r < 0 else f"{r + 1}/{self.args.stage_reps}"
            self.log(f"stage timing {label}: {sum(timer.times.values()):.1f} ms serial")
            if r >= 0:
                reps.append(timer.times)
        mine = {c.name: statistics.median(rep[c.name] for rep in reps) for c in calls}
        per_rank = self.gather(mine)
        combined = combine_rank_times(calls, per_rank)
        out = {k: v for k, v in serial_and_bound(calls, combined).items()}
        out["per_rank"] = [serial_and_bound(calls, t) for t in per_rank]
        out["stage_ms"] = combined
        out["stage_ms_per_rank"] = per_rank
        return out

    # -- one probed step: timeline and trace
    def probed_step(self, profile: bool) -> list[dict]:
        plan, prog = self.program()
        rec = _Recorder(program_calls(prog), self.cuda)
        self.zero_grads()
        dist.barrier(group=self.group)
        self.sync()
        prof = None
        if profile:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        try:
            if self.cuda:
                rec.origin = torch.cuda.Event(enable_timing=True)
                rec.origin.record()
            else:
                rec.origin = time.perf_counter()
            self.run_program(plan, prog, _Probe(rec))
            self.sync()
        finally:
            if prof is not None:
                prof.__exit__(None, None, None)
        if prof is not None:
            path = os.path.join(self.args.out, f"{self.args.name}_trace.json.gz")
            prof.export_chrome_trace(path)
            self.result.setdefault("files", {})["trace"] = path
        return rec.timeline()

    # -- the whole run
    def run(self) -> dict[str, Any]:
        a = self.args
        r = self.result
        r["meta"] = run_meta(a, self.device, self.world)
        r["config"] = dataclasses.asdict(self.cfg)
        r["run"] = {
            "seq": a.seq, "microbatches": a.microbatches, "micro_batch_size": a.micro_batch_size,
            "dtype": str(self.dtype).replace("torch.", ""), "warmup": a.warmup, "iters": a.iters,
            "stage_reps": a.stage_reps, "world_size": self.world, "ep": self.world,
            "overlap_config": dataclasses.asdict(self.engine.config),
            "tokens_per_step_global": self.tokens_per_step,
            "nccl_high_priority": a.nccl_high_priority, "nccl_max_ctas": a.nccl_max_ctas,
            "params_per_rank": sum(p.numel() for p in self.model.parameters()),
        }
        r["modes"] = {}
        self.log(f"{self.world} ranks on {self.device.type}, {r['run']['dtype']}, "
                 f"{self.tokens_per_step} tokens/step; modes {','.join(a.modes)}")
        ref = None
        if "eager" in a.modes:
            r["modes"]["eager"] = self.time_mode("eager", self.step_eager)
            if any(m in a.modes for m in ("compile", "backend", "fxoverlap")) and not a.no_grad_check:
                ref = self.grads_to_host()
                # Run-to-run noise of eager itself (non-deterministic GPU kernels), to
                # judge fxoverlap's difference against.
                self.zero_grads()
                self.step_eager()
                rerun = self.grad_check(ref)
                r["numerics"] = {
                    "eager_rerun_grad_max_abs_diff": rerun["grad_max_abs_diff"],
                    "eager_rerun_grads_bitwise": rerun["grads_bitwise"],
                }
            self.write()
        for mode, step in (("compile", self.step_compile), ("backend", self.step_backend)):
            if mode in a.modes:
                r["modes"][mode] = self.time_mode(mode, step)
                if ref is not None:
                    r.setdefault("numerics", {})[mode] = self.grad_check(ref)
                self.write()
        if "fxoverlap" in a.modes:
            r["modes"]["fxoverlap"] = fx = self.time_mode("fxoverlap", self.step_fx)
            fx["stages"] = len(self.engine.stages)
            fx["runs_as"] = {k: sum(s.runs_as == k for s in self.engine.stages) for k in ("inductor", "eager", "graphed")}
            if ref is not None:
                r.setdefault("numerics", {}).update(self.grad_check(ref))
                del ref
            self.write()
            self.zero_grads()
            if a.no_stage_timing:
                return self._finish(r)
            r["stage_timing"] = st = self.stage_timing()
            r["T_serial_ms"], r["T_bound_ms"], r["T_fx_ms"] = st["T_serial"], st["T_bound"], fx["step_ms"]
            r["overlap_efficiency"] = overlap_efficiency(st["T_serial"], st["T_bound"], fx["step_ms"])
            self.write()
            if not a.no_timeline:
                self.log("probing one fxoverlap step for the timeline")
                tl = self.gather(self.probed_step(profile=False))
                r["timeline"] = tl
                r["timeline_stats"] = timeline_stats(tl, st["stage_ms"])
                if self.rank == 0:
                    png = os.path.join(a.out, f"{a.name}_timeline.png")
                    if plot_timeline(tl, png, title=self.title(), stage_ms=st["stage_ms"]):
                        r.setdefault("files", {})["timeline"] = png
            if not a.no_trace:
                self.log("profiling one fxoverlap step for the Chrome trace")
                self.probed_step(profile=self.rank == 0)
        return self._finish(r)

    def _finish(self, r: dict[str, Any]) -> dict[str, Any]:
        self._compare(r)
        self.zero_grads()
        self.write()
        if self.rank == 0 and not self.args.quiet:
            print(summary(r), flush=True)
        return r

    @staticmethod
    def _compare(r: dict[str, Any]) -> None:
        """Speed-ups of every mode against eager and against torch.compile(model)."""
        modes = r["modes"]
        r["speedups"] = {base: {m: modes[base]["step_ms"] / v["step_ms"] for m, v in modes.items()}
                         for base in ("eager", "compile") if base in modes}
        if "eager" in modes and modes["eager"].get("peak_mem_gib"):
            r["peak_mem_vs_eager"] = {m: v["peak_mem_gib"] / modes["eager"]["peak_mem_gib"] for m, v in modes.items()}
        if "fxoverlap" in modes:  # the fxoverlap figures under their earlier names
            r["speedup_vs_eager"] = r["speedups"].get("eager", {}).get("fxoverlap")
            r["peak_mem_ratio_vs_eager"] = r.get("peak_mem_vs_eager", {}).get("fxoverlap")
        if "eager" in r["modes"]:
            r["T_eager_ms"] = r["modes"]["eager"]["step_ms"]
        if "eager" in r["modes"] and "fxoverlap" in r["modes"]:
            e, f = r["modes"]["eager"], r["modes"]["fxoverlap"]
            diffs = [abs(x - y) for le, lf in zip(e["losses_per_rank"], f["losses_per_rank"]) for x, y in zip(le, lf)]
            r.setdefault("numerics", {}).update({
                "loss_max_abs_diff": max(diffs) if diffs else None,
                "losses_equal": all(d == 0 for d in diffs),
            })

    def title(self) -> str:
        c = self.cfg
        return (f"fxoverlap one step: {self.world} ranks, {c.n_layers} layers, dim {c.dim}, {c.n_experts} experts "
                f"top-{c.top_k}, seq {self.args.seq}x{self.args.micro_batch_size}, {self.args.microbatches} microbatches, "
                f"{c.routing}{' (token dedup)' if c.token_dedup else ''}, {os.environ.get('NCCL_P2P_DISABLE') and 'P2P off' or 'P2P default'}")

    def write(self) -> None:
        if self.rank != 0:
            return
        os.makedirs(self.args.out, exist_ok=True)
        path = os.path.join(self.args.out, f"{self.args.name}.json")
        self.result.setdefault("files", {})["json"] = path
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1, default=_json_default)
        os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, (torch.dtype, torch.device)):
        return str(o)
    if isinstance(o, tuple):
        return list(o)
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return str(o)


def run_meta(args: argparse.Namespace, device: torch.device, world: int) -> dict[str, Any]:
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", *cmd], cwd=here, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except Exception:
            return None

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        # a copy of the tree without .git (the lent GPU machine's) can pass it in
        "commit": git("rev-parse", "--short", "HEAD") or os.environ.get("FXOVERLAP_COMMIT"),
        "dirty": None,
        "torch": torch.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "world_size": world,
        "env": {k: os.environ.get(k) for k in (
            "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_MAX_CTAS",
            "CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")},
    }
    status = git("status", "--porcelain")
    if status is not None:
        meta["dirty"] = bool(status)
    return meta


# ---------------------------------------------------------------- reporting


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def summary(r: dict[str, Any]) -> str:
    lines = ["", "mode        step ms   tokens/s   peak GiB   vs eager   vs compile   first step s"]
    sp = r.get("speedups", {})
    for mode, m in r["modes"].items():
        lines.append(f"{mode:<10} {_fmt(m['step_ms']):>8} {_fmt(m['tokens_per_s'], '.0f'):>10} "
                     f"{_fmt(m['peak_mem_gib'], '.2f'):>10} {_fmt(sp.get('eager', {}).get(mode), '.3f'):>9} "
                     f"{_fmt(sp.get('compile', {}).get(mode), '.3f'):>11} {_fmt(m.get('first_step_s'), '.1f'):>13}")
    if "T_serial_ms" in r:
        st = r["stage_timing"]
        lines.append(
            f"T_serial {_fmt(r['T_serial_ms'])} ms (comp {_fmt(st['comp'])}, comm {_fmt(st['comm'])}, "
            f"outside slots {_fmt(st['outside_slots'])}), T_bound {_fmt(r['T_bound_ms'])} ms, "
            f"T_fx {_fmt(r['T_fx_ms'])} ms, overlap efficiency {_fmt(r['overlap_efficiency'], '.3f')}")
    if "timeline_stats" in r and r["timeline_stats"]["per_rank"]:
        t = r["timeline_stats"]["per_rank"][0]
        kinds = r["timeline_stats"]["by_kind_rank0"]
        inside = {s: sum(v["in_step_ms"] for k, v in kinds.items() if (k.split()[1] in ("dispatch", "combine")) == (s == COMM))
                  for s in (COMP, COMM)}
        alone = {s: sum(v["alone_ms"] for k, v in kinds.items() if (k.split()[1] in ("dispatch", "combine")) == (s == COMM))
                 for s in (COMP, COMM)}
        lines.append(
            f"probed step (rank 0): {_fmt(t['step_ms'])} ms, compute busy {_fmt(t['comp_busy_ms'])} ms "
            f"({_fmt(inside[COMP] / alone[COMP] if alone[COMP] else None, '.2f')}x its stages alone), comm busy "
            f"{_fmt(t['comm_busy_ms'])} ms ({_fmt(inside[COMM] / alone[COMM] if alone[COMM] else None, '.2f')}x alone), "
            f"{_fmt(100 * t['comm_overlapped_frac'] if t['comm_overlapped_frac'] is not None else None, '.0f')} % "
            f"of comm time under compute")
    if "numerics" in r:
        n = r["numerics"]
        lines.append("numerics: " + ", ".join(f"{k} {v}" for k, v in n.items() if k != "grads_missing"))
    lines.append(f"written: {', '.join(r.get('files', {}).values())}")
    return "\n".join(lines)


_KIND_COLORS = {
    "embed": "#7f7f7f", "attn": "#1f77b4", "dispatch": "#d62728", "experts": "#2ca02c", "mlp": "#2ca02c",
    "combine": "#ff7f0e", "post": "#9467bd", "head": "#8c564b", "recompute": "#e377c2",
}


def _kind_of(stage_name: str) -> str:
    # stage names: "<dir>_<layer>_<kind>[suffix]" (fxoverlap.stage.stage_name)
    parts = stage_name.split("_", 2)
    tail = parts[2] if len(parts) == 3 else stage_name
    for k in _KIND_COLORS:
        if tail.startswith(k):
            return k
    return "other"


def plot_timeline(timelines: Sequence[Sequence[dict]], path: str, title: str = "",
                  stage_ms: dict[str, float] | None = None) -> bool:
    """PNG: one row per (rank, stream), a bar per stage call of one step; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("[bench] matplotlib is not installed: skipping the timeline PNG "
              "(pip install matplotlib, or the 'bench' extra)", flush=True)
        return False
    rows = [(r, s) for r in range(len(timelines)) for s in (COMP, COMM)]
    end = max((e["end"] for tl in timelines for e in tl), default=1.0) or 1.0
    n = max(len(tl) for tl in timelines) if timelines else 1
    width = min(80.0, max(14.0, n / 12))
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.9 * len(rows)))
    for y, (rank, stream) in enumerate(rows):
        for e in timelines[rank]:
            if e["stream"] != stream:
                continue
            kind = _kind_of(e["stage"])
            bwd = e["name"].startswith("B")
            ax.broken_barh([(e["start"], max(e["end"] - e["start"], end * 1e-4))], (y - 0.38, 0.76),
                           facecolors=_KIND_COLORS.get(kind, "#bcbd22"), edgecolor="black", linewidth=0.2,
                           hatch="////" if bwd else None, alpha=0.9)
            if e["end"] - e["start"] > end * 0.006:
                ax.text((e["start"] + e["end"]) / 2, y, e["name"], ha="center", va="center", fontsize=4.5,
                        rotation=90, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {s}" for r, s in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("ms since the step's start on each rank (events around each stage: a stage's bar also "
                  "spans its wait for the stream's earlier work and the cross-stream events)")
    handles = [Patch(facecolor=c, label=k) for k, c in _KIND_COLORS.items() if k != "mlp"]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="backward"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.25 / len(rows)), fontsize=7,
              ncol=len(handles), frameon=False)
    if stage_ms:
        title += f"   (serial sum of stages {sum(stage_ms.values()):.1f} ms, this step {end:.1f} ms)"
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", linewidth=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- entry points


def nccl_options(args: argparse.Namespace):
    """ProcessGroupNCCL options from the --nccl-* flags (None: NCCL's defaults)."""
    if not args.nccl_high_priority and args.nccl_max_ctas is None:
        return None
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=bool(args.nccl_high_priority))
    if args.nccl_max_ctas is not None:
        opts.config.max_ctas = args.nccl_max_ctas
    return opts


def setup(args: argparse.Namespace) -> tuple[dist.ProcessGroup, torch.device, bool]:
    """The world group and this rank's device; initialises the process group if needed."""
    want = args.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owns = not dist.is_initialized()
    if owns:
        timeout = datetime.timedelta(seconds=args.timeout)
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=timeout, pg_options=nccl_options(args))
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return dist.group.WORLD, device, owns


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    group, device, owns = setup(args)
    try:
        if dist.get_rank() == 0:
            os.makedirs(args.out, exist_ok=True)
        dist.barrier()
        bench = Bench(args, group, device)
        result = bench.run()
        dist.barrier()
        return result
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
