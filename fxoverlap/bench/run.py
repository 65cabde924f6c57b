"""One benchmark run: :class:`Bench` runs the modes, the stage timing and the probed
step on one model, and writes the JSON (rank 0)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
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
from fxoverlap.bench.cli import FORWARD_MODES, model_config, parse_args
from fxoverlap.bench.metrics import (
    call_record,
    combine_rank_times,
    overlap_efficiency,
    program_calls,
    serial_and_bound,
    timeline_stats,
)
from fxoverlap.bench.plot import plot_timeline
from fxoverlap.bench.probe import StageTimer, TimelineProbe
from fxoverlap.bench.report import summary
from fxoverlap.config import ConfigError
from fxoverlap.kernels import emulated_link
from fxoverlap import fp8_ops
from fxoverlap.models.moe import MoETransformer
from fxoverlap.passes.inductor import stage_route
from fxoverlap.engine import PlanView
from fxoverlap.runtime import StageHook, accumulate_into, static_values
from fxoverlap.testing import grad_compare, token_batches


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
        self.ep = args.emulate_ep or self.world  # the EP size whose rank this process runs
        self.link: emulated_link.Link | None = None
        # The model's EP group: the process group, or with --emulate-ep the emulated one, injected as a
        # real group would be (the model's layers, optimize); its link is off until run() sets it.
        self.emulated: emulated_link.EmulatedGroup | None = None
        self.ep_group: dist.ProcessGroup = group
        if args.emulate_ep:
            if self.world != 1:
                raise ConfigError(f"--emulate-ep runs one rank of EP-{args.emulate_ep} in one process; "
                                 f"got {self.world} processes")
            if args.emulated_link is not None:
                self.link = args.emulated_link.replace(experts=self.cfg.n_experts * args.emulate_ep)
            self.ep_group = self.emulated = emulated_link.EmulatedGroup(None)
        torch.manual_seed(args.seed + self.rank)
        with torch.device(device):
            self.model = MoETransformer(self.cfg, self.ep_group)
        self.model.to(self.dtype)
        self.mbs = token_batches(self.cfg.vocab_size, args.microbatches, (args.micro_batch_size, args.seq),
                                 seed=args.seed + 1000 * self.rank, device=device)
        self.engine = fxoverlap.optimize(self.model, self.ep_group, config=args.overlap)
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

    def expert_math(self):
        """The experts' GEMMs of the eager and torch.compile modes (``--expert-math``; fxoverlap's
        own modes take them from the OverlapConfig)."""
        if self.args.expert_math == "torchao_fp8":
            from fxoverlap.bench.gpu_fp8 import torchao_experts

            return torchao_experts()
        return fp8_ops.expert_math(None if self.args.expert_math == "model" else self.args.expert_math)

    def step_eager(self) -> list[torch.Tensor]:
        losses = []
        with self.expert_math():
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
        with self.expert_math():  # Dynamo traces the experts' GEMMs under it (and guards on nothing of it)
            return self._loop(self._compiled)

    def _forward_loop(self, fn) -> list[torch.Tensor]:
        with torch.no_grad(), self.expert_math():
            return [fn(*mb).detach() for mb in self.mbs]

    def step_fwd_eager(self) -> list[torch.Tensor]:
        return self._forward_loop(self.model)

    def step_fwd_compile(self) -> list[torch.Tensor]:
        if self._compiled is None:
            self._compiled = torch.compile(self.model)
        return self._forward_loop(self._compiled)

    def step_fwd_backend(self) -> list[torch.Tensor]:
        if self._backend is None:
            self.step_backend(build_only=True)
        return self._forward_loop(self._backend)

    def step_fwd_fxoverlap(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [out.detach() for out in self.engine.forward_only(self.mbs)]

    def step_fwd_fxoverlap_each(self) -> list[torch.Tensor]:
        return self._forward_loop(self.engine)

    def step_backend(self, build_only: bool = False) -> list[torch.Tensor]:
        if self._backend is None:
            cfg = self.args.overlap
            options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                       if getattr(cfg, f.name) != f.default and f.name != "compile_options"}
            options.update(cfg.compile_options or {})
            self._backend = torch.compile(self.model, backend="fxoverlap", options=options or None)
        if build_only:
            return []
        return self._loop(self._backend)

    # -- one mode
    def time_mode(self, mode: str, step: Callable[[], list[torch.Tensor]]) -> dict[str, Any]:
        """The mode's step time; with an emulated link, twice: without the link (T_compute),
        then with it (T_step, and T_comm: the holds the link asked for per step)."""
        if self.link is None:
            return self._time_mode(mode, step, self.args.warmup)
        assert self.emulated is not None  # a link comes with --emulate-ep
        with self.emulated.using(None):
            compute = self._time_mode(mode + " (no link)", step, self.args.warmup)
        with self.emulated.using(self.link):
            res = self._time_mode(mode + f" ({self.link.name})", step, min(self.args.warmup, 1), link_stats=True)
        t_step, t_comp, t_comm = res["step_ms"], compute["step_ms"], res["link"]["ms"]
        res.update({
            "emulated": True,
            "T_step_ms": t_step, "T_compute_ms": t_comp, "T_comm_ms": t_comm,
            "hidden_share": hidden_share(t_step, t_comp, t_comm),
            "first_step_s": compute.get("first_step_s"),  # the mode's first step (compiles), without the link
            "compute": {k: compute[k] for k in ("step_ms", "step_ms_per_rank", "peak_mem_gib", "first_step_s",
                                                "iters_ms_rank0") if k in compute},
        })
        return res

    def _time_mode(self, mode: str, step: Callable[[], list[torch.Tensor]], warmup: int,
                   link_stats: bool = False) -> dict[str, Any]:
        a = self.args
        res: dict[str, Any] = {}
        for i in range(warmup):
            self.zero_grads()
            t0 = time.perf_counter()
            step()
            self.sync()
            dt = time.perf_counter() - t0
            if i == 0:
                res["first_step_s"] = round(dt, 3)
            self.log(f"{mode} warm-up {i + 1}/{warmup} {dt * 1e3:.1f} ms (wall)")
        self.zero_grads()
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        times, wall = [], []
        losses: list[torch.Tensor] = []
        if self.emulated is not None:
            self.emulated.stats.reset()
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
        if link_stats and self.emulated is not None:  # what the link was asked to hold, per step
            st = self.emulated.stats.as_dict()
            res["link"] = {"emulated": True, "calls": st["calls"] / a.iters, "bytes": st["bytes"] / a.iters,
                           "ms": st["ms"] / a.iters,
                           "by_op": {k: emulated_link.per_step(v, a.iters) for k, v in st["by_op"].items()}}
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
        """The model's gradients against ``ref`` (host copies), over all ranks."""
        mine = grad_compare(self.model, ref)
        ranks = self.gather(mine)
        return {
            "grad_max_abs_diff": max(r["max_abs_diff"] for r in ranks),
            "grad_max_abs_eager": max(r["max_abs_ref"] for r in ranks),
            "grads_bitwise": all(r["bitwise"] for r in ranks),
            "grads_missing": sorted({m for r in ranks for m in r["missing"]}),
        }

    # -- stage timing
    def run_program(self, plan: PlanView, hook: StageHook) -> None:
        """The engine's program for these microbatches as the engine runs it (its CUDA graphs and
        gradient reduction), each stage call through ``hook``."""
        runner = self.engine.runner(self.mbs, hook=hook)
        runner.run(static_values(plan.capture, self.model), self.mbs, grads=accumulate_into(self.model, plan.capture))

    def stage_timing(self) -> dict[str, Any]:
        plan = self.engine.plan(self.mbs)
        calls = program_calls(plan.program)
        reps: list[dict[str, float]] = []
        holds: dict[str, float] = {}
        # One run first that is not counted: the first stage-timed run on a GPU was
        # seen 4x slower than the next for a small shape (allocator, new streams).
        for r in range(-1, self.args.stage_reps):
            self.zero_grads()
            dist.barrier(group=self.group)
            timer = StageTimer(self.cuda, self.device, None if self.emulated is None else self.emulated.stats)
            self.run_program(plan, timer)
            self.sync()
            label = "warm-up" if r < 0 else f"{r + 1}/{self.args.stage_reps}"
            self.log(f"stage timing {label}: {sum(timer.times.values()):.1f} ms serial")
            if r >= 0:
                reps.append(timer.times)
                holds = timer.holds
        mine = {c.name: statistics.median(rep[c.name] for rep in reps) for c in calls}
        per_rank = self.gather(mine)
        combined = combine_rank_times(calls, per_rank)
        out = {k: v for k, v in serial_and_bound(calls, combined).items()}
        out["per_rank"] = [serial_and_bound(calls, t) for t in per_rank]
        out["stage_ms"] = combined
        out["stage_ms_per_rank"] = per_rank
        # the program's calls (slot, stream, what each reads), for the slot-balance subcommand
        out["calls"] = [call_record(c) for c in calls]
        if holds:  # with an emulated link: what it held each comm call for (this rank), inside stage_ms
            out["hold_ms"] = holds
        return out

    # -- one probed step: timeline and trace
    def probed_step(self, profile: bool) -> list[dict]:
        plan = self.engine.plan(self.mbs)
        probe = TimelineProbe(program_calls(plan.program), self.cuda)
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
            probe.start()
            self.run_program(plan, probe)
            self.sync()
        finally:
            if prof is not None:
                prof.__exit__(None, None, None)
        if prof is not None:
            path = os.path.join(self.args.out, f"{self.args.name}_trace.json.gz")
            prof.export_chrome_trace(path)
            self.result.setdefault("files", {})["trace"] = path
        return probe.timeline()

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
        if a.emulate_ep:
            r["run"]["ep"] = a.emulate_ep
            r["emulation"] = {
                "emulated": True, "ep": a.emulate_ep,
                "link": None if self.link is None else self.link.describe(),
                "local_experts": self.cfg.n_experts, "expert_fold": self.cfg.expert_fold, "top_k": self.cfg.top_k,
                "note": "one rank of EP-N on one device; every dispatch/combine holds its stream for latency + "
                        "bytes x (N-1)/N x skew / bandwidth (fxoverlap/kernels/emulated_link.py)",
            }
            # the stage timing and the probed steps run with the link
            if self.emulated is not None:
                self.emulated.link = self.link
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
        for mode, step in (("compile", self.step_compile), ("backend", self.step_backend),
                           *((m, getattr(self, "step_" + m)) for m in FORWARD_MODES)):
            if mode in a.modes:
                r["modes"][mode] = self.time_mode(mode, step)
                if ref is not None and mode not in FORWARD_MODES:
                    r.setdefault("numerics", {})[mode] = self.grad_check(ref)
                if mode in ("backend", "fwd_backend"):
                    fxoverlap.backend.reset()  # its graph pools would count in the next mode's peak
                self.write()
        if "fxoverlap" in a.modes:
            r["modes"]["fxoverlap"] = fx = self.time_mode("fxoverlap", self.step_fx)
            fx["stages"] = len(self.engine.stages)
            fx["runs_as"] = {k: sum(stage_route(s) == k for s in self.engine.stages)
                             for k in ("inductor", "inductor+wrapper", "eager", "graphed")}
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
                         for base in ("eager", "compile", "fwd_compile") if base in modes}
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


def hidden_share(t_step: float, t_compute: float, t_comm: float) -> float | None:
    """(T_compute + T_comm - T_step) / min(T_compute, T_comm): the share of the smaller of
    compute and comm that ran under the other (1: all of it; 0: none; None: nothing to hide)."""
    small = min(t_compute, t_comm)
    return None if small <= 0 else (t_compute + t_comm - t_step) / small


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
        # Not under torchrun (no RANK): one process, a group of one (e.g. --emulate-ep).
        alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=timeout, pg_options=nccl_options(args),
                                    **alone)
        else:
            dist.init_process_group("gloo", timeout=timeout, **alone)
    return dist.group.WORLD, device, owns


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # the backend's documented setup (dropless dispatch kept in the graph); every torch.compile
    # mode, the torch.compile(model) baseline included, traces with it, as before it was explicit
    fxoverlap.enable_dynamic_output_shapes()
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


