"""GPU check of CUDA graphs (``OverlapConfig(cuda_graphs=True)``) with NCCL:

    torchrun --nproc-per-node N -m fxoverlap.bench cudagraph [--out results.jsonl]

Any number of GPUs (EP = N). The capacity-routed
reference model in bf16 (dim 1024, 4 MoE layers, 16 experts top-4, seq 1024,
microbatch size 2, 4 microbatches) runs eagerly, through fxoverlap with
``cuda_graphs`` off, and with it on (plain, and with delayed weight-grad, whose last
microbatch replays its graphs in another order, so one copy uses a memory pool per
graph). Per variant:

* numerics: losses and every parameter gradient against eager, by relative L2 per
  parameter, on the capture step and on two replay steps. Tolerance as in
  the ``checks`` subcommand (``fxoverlap/bench/gpu_checks.py``): eager is run twice to measure its own run-to-run noise
  (atomics in index/scatter backward kernels make bf16 sums order-dependent), and
  ``torch.compile(model)`` once for the difference fused kernels make; we require
  rel-L2 <= max(4 x eager noise, 2 x compile-vs-eager, 2^-7). A graph replays the
  kernels the ungraphed stage runs (Inductor's, by default on CUDA), on the same
  inputs, so graphs on must equal graphs off bitwise (``bitwise_vs_off``).
* time: one ``forward_backward`` step with graphs on and off (and eager sequential),
  CUDA events, median of 5 after 2 warm-up steps; peak ``max_memory_allocated``.
* teardown: ``engine.close()`` for every engine, then ``dist.destroy_process_group()``,
  under a 60 s watchdog thread that prints ``TEARDOWN HANG`` and exits with status 3
  if they do not return (a process that had captured NCCL kernels hung there,
  docs/design.md; comm stages are never captured, and the graphs are released first).

Rank 0 prints one ``CUDAGRAPH {json}`` line after teardown. Exit status: 0 when
every check passed, 1 when one failed, 3 on a teardown hang.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import eager_steps, rel_l2, take_grads, token_batches

SHAPE = dict(dim=1024, n_heads=8, n_layers=4, n_experts=16, top_k=4, expert_dim=512, shared_expert_dim=512,
             vocab_size=8192, max_seq_len=1024, routing="capacity")
SEQ, MBS, N_MB = 1024, 2, 4
TEARDOWN_TIMEOUT_S = 60


def _batches(cfg, device, seed=0):
    return token_batches(cfg.vocab_size, N_MB, (MBS, SEQ), seed=seed + 1000 * dist.get_rank(), device=device)


def _grads(model):
    return take_grads(model, torch.float32)


def _eager(model, batches):
    return [x.float() for x in eager_steps(model, batches)]


def _loss_err(ref, got) -> float:
    return max(abs(a - b).item() / max(abs(a).item(), 1e-30) for a, b in zip(ref, [x.float() for x in got]))


def _time_step(fn, model) -> tuple[float, float]:
    """Median ms of 5 steps after 2 warm-ups, and peak bytes allocated in a step."""
    for _ in range(2):
        fn()
        model.zero_grad(set_to_none=True)
    times = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        model.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def run_variant(name, cfg, model, batches, ref_losses, ref_grads, tol, extra, engines):
    off = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(**extra))
    on = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(cuda_graphs=True, **extra))
    engines += [off, on]
    r: dict = {"variant": name, "config": extra}
    l_off = off.forward_backward(batches)
    g_off = _grads(model)
    r["off_rel_l2"], _ = rel_l2(ref_grads, g_off)
    r["off_loss_rel_err"] = _loss_err(ref_losses, l_off)
    steps = []
    bitwise = True
    for step in range(3):  # step 0 captures (and replays once), steps 1-2 only replay
        t0 = time.perf_counter()
        l_on = on.forward_backward(batches)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        g_on = _grads(model)
        err, worst = rel_l2(ref_grads, g_on)
        steps.append(dict(step=step, wall_s=round(wall, 3), rel_l2=err, worst_param=worst,
                          loss_rel_err=_loss_err(ref_losses, l_on)))
        bitwise &= all(torch.equal(g_off[k], g_on[k]) for k in g_off) and all(
            torch.equal(a.float(), b.float()) for a, b in zip(l_off, l_on))
    r["on_steps"] = steps
    r["bitwise_vs_off"] = bitwise
    r["graphs"] = on.cuda_graph_summary()
    r["graphed_stages"] = sorted(s.name for s in on.stages if s.graphed)
    r["runs_as"] = {s.name: s.runs_as for s in on.stages}
    skipped = {s.name: s.not_capturable_reason for s in on.stages if not s.graphed}
    r["comm_stages_eager"] = sum("communication stage" in why for why in skipped.values())
    r["other_stages_eager"] = {k: why for k, why in skipped.items() if "communication stage" not in why}
    # Capacity routing: every compute stage is marked, and every marked one captured.
    capture_ok = bool(r["graphs"]) and all(s["graphs"] > 0 and not s["eager_fallbacks"] for s in r["graphs"])
    comp_all_graphed = not r["other_stages_eager"]
    r["ok_numerics"] = (bitwise and r["off_rel_l2"] <= tol
                        and all(s["rel_l2"] <= tol and s["loss_rel_err"] <= tol for s in steps))
    r["ok_capture"] = capture_ok and comp_all_graphed
    r["ms_off"], r["peak_GiB_off"] = _time_step(lambda: off.forward_backward(batches), model)
    r["ms_on"], r["peak_GiB_on"] = _time_step(lambda: on.forward_backward(batches), model)
    r["peak_GiB_off"] /= 2**30
    r["peak_GiB_on"] /= 2**30
    r["speedup_on_vs_off"] = r["ms_off"] / r["ms_on"]
    return r  # the graphs stay captured until teardown() closes the engine


def teardown(engines) -> float:
    """close() every engine, then destroy the process group, under a watchdog."""
    done = threading.Event()
    rank = dist.get_rank()

    def watch():
        if not done.wait(TEARDOWN_TIMEOUT_S):
            print(f"TEARDOWN HANG rank {rank}: engine.close() + destroy_process_group() did not return "
                  f"in {TEARDOWN_TIMEOUT_S} s", flush=True)
            os._exit(3)

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.perf_counter()
    for e in engines:
        e.close()
    dist.destroy_process_group()
    done.set()
    return time.perf_counter() - t0


def _setup() -> torch.device:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=120))
    return device


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="plain,wgrad")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = _setup()
    rank = dist.get_rank()

    cfg = MoEConfig.tiny(**SHAPE)
    torch.manual_seed(0)
    model = MoETransformer(cfg, dist.group.WORLD).to(device=device, dtype=torch.bfloat16)
    batches = _batches(cfg, device)
    ref_losses = _eager(model, batches)
    ref_grads = _grads(model)
    _eager(model, batches)
    noise, _ = rel_l2(ref_grads, _grads(model))
    _eager(torch.compile(model), batches)
    compile_err, _ = rel_l2(ref_grads, _grads(model))
    tol = max(4 * noise, 2 * compile_err, 2.0 ** -7)
    eager_ms, eager_peak = _time_step(lambda: _eager(model, batches), model)

    engines: list = []
    variants = {"plain": {}, "wgrad": {"delay_wgrad": True}}
    results = [run_variant(v, cfg, model, batches, ref_losses, ref_grads, tol, variants[v], engines)
               for v in args.variants.split(",")]
    ok_local = all(r["ok_numerics"] and r["ok_capture"] for r in results)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ok_local)
    dist.barrier()
    teardown_s = teardown(engines)

    summary = dict(check="cudagraph", date=datetime.datetime.now().isoformat(timespec="seconds"),
                   torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device), shape=SHAPE, seq=SEQ,
                   micro_batch_size=MBS, microbatches=N_MB, eager_noise_rel_l2=noise, compile_vs_eager_rel_l2=compile_err,
                   tolerance=tol,
                   eager_ms=eager_ms, eager_peak_GiB=eager_peak / 2**30, variants=results,
                   ok_per_rank=gathered, teardown_s=round(teardown_s, 3), ok=all(gathered))
    if rank == 0:
        line = json.dumps(summary, default=str)
        print("CUDAGRAPH " + line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
