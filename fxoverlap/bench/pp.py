"""PP × EP benchmark: one ``torch.distributed.pipelining`` schedule, three ways.

``torchrun --nproc-per-node 4 -m fxoverlap.bench.pp --pp 2 --schedule ScheduleDualPipeV``

The world is a ``pp × ep`` mesh (``ep = world // pp``; rank ``r`` is PP rank ``r // ep``, EP
rank ``r % ep``). Every mode builds the reference MoE model from one seed, splits it into
stage modules (embedding + first layers, ..., last layers + norm + output; decoder layers in a
``ModuleDict`` under their original names) and runs the same schedule:

- ``eager``: the pipelining schedule as it is;
- ``compile``: the same, each stage module compiled in place by ``torch.compile``
  (``nn.Module.compile()``, Inductor; DualPipeV refuses an ``OptimizedModule`` wrapper; for
  the schedules that split the backward, with ``torch._functorch.config.donated_buffer=False``,
  which pipelining's retained-graph ``BACKWARD_INPUT`` needs);
- ``fxoverlap``: ``fxoverlap.pipeline_schedule`` (each stage's F/B an fxoverlap program;
  each ``OVERLAP_F_B`` the two programs in turns);
- ``fxoverlap_seq``: the same with ``merge=False`` (each ``OVERLAP_F_B`` F then B): what
  the merged step gains.

Reported per mode (rank 0, and ``--out``/pp_bench.json): median step time over ``--iters``
timed steps after ``--warmup``, tokens/s, peak memory on CUDA, and the first step's losses on
the ranks holding the last stage, with their largest difference from ``eager``'s.
Devices: CUDA + NCCL when available (``--device auto``), else CPU + gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch._functorch.config
import torch.distributed as dist
import torch.nn.functional as F

MODES = ("eager", "compile", "fxoverlap", "fxoverlap_seq")
SCHEDULES = ("Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleDualPipeV", "ScheduleInterleavedZeroBubble",
             "ScheduleZBVZeroBubble")


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fxoverlap.bench pp", description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel degree (ep = world // pp)")
    p.add_argument("--schedule", default="ScheduleDualPipeV", choices=SCHEDULES)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=None, help="default 1024 on CUDA, 16 on CPU")
    p.add_argument("--layers", type=int, default=None, help="a multiple of the number of stages")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--expert-dim", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="MoEConfig.tiny() shapes (CPU smoke)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--warmup", type=int, default=None, help="default 2 (1 on CPU)")
    p.add_argument("--iters", type=int, default=None, help="default 5 (2 on CPU)")
    p.add_argument("--out", default=None, help="folder for pp_bench.json")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict | None:
    """The benchmark on an initialised process group; rank 0 returns the report."""
    import torch.distributed.pipelining as pipelining

    import fxoverlap
    from fxoverlap.models import MoEConfig, MoEStage, MoETransformer
    from fxoverlap.pipeline_parallel import pp_ep_groups, stage_layout

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]
    if world % args.pp:
        raise SystemExit(f"world size {world} is not a multiple of --pp {args.pp}")
    ep = world // args.pp
    _, pp_rank, ep_rank, ep_group, pp_group = pp_ep_groups(ep)
    n_stages, mine = stage_layout(args.schedule, args.pp, pp_rank)
    base = MoEConfig.tiny() if (args.tiny or not cuda) else MoEConfig(dim=1024, n_heads=8, n_experts=16, top_k=4,
                                                                       expert_dim=512, vocab_size=8192,
                                                                       max_seq_len=4096)
    over = {k: v for k, v in dict(dim=args.dim, n_experts=args.experts, top_k=args.top_k,
                                  expert_dim=args.expert_dim).items() if v is not None}
    n_layers = args.layers or 2 * n_stages
    if n_layers % n_stages:
        raise SystemExit(f"--layers {n_layers} is not a multiple of the {n_stages} stages")
    cfg = MoEConfig(**{**base.__dict__, **over, "n_layers": n_layers, "layer_pattern": None})
    seq = args.seq or (1024 if cuda else 16)
    mbs, n_mb = args.micro_batch_size, args.microbatches
    g = torch.Generator().manual_seed(1000 + ep_rank)
    x = torch.randint(0, cfg.vocab_size, (n_mb * mbs, seq), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (n_mb * mbs, seq), generator=g).to(device)
    warmup = args.warmup if args.warmup is not None else (2 if cuda else 1)
    iters = args.iters if args.iters is not None else (5 if cuda else 2)
    per = n_layers // n_stages
    report: dict = {"world": world, "pp": args.pp, "ep": ep, "schedule": args.schedule, "device": str(device),
                    "dtype": str(dtype), "microbatches": n_mb, "micro_batch_size": mbs, "seq": seq,
                    "config": {k: v for k, v in cfg.__dict__.items() if not k.startswith("_")}, "modes": {}}
    ref_losses = None
    for mode in [m for m in args.modes.split(",") if m]:
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown mode {mode!r} (one of {MODES})")
        torch.manual_seed(0)
        model = MoETransformer(cfg, ep_group if ep > 1 else None).to(device=device, dtype=dtype)
        stages = []
        for s in mine:
            mod = MoEStage(model, list(range(s * per, (s + 1) * per)), s == 0, s == n_stages - 1)
            if mode == "compile":
                mod.compile()
            stages.append(pipelining.PipelineStage(mod, s, n_stages, device, group=pp_group))
        cls = getattr(pipelining, args.schedule)
        arg = stages[0] if args.schedule == "Schedule1F1B" else stages
        # pipelining's BACKWARD_INPUT (torch.autograd.grad with retain_graph) cannot run an
        # AOTAutograd backward compiled with donated buffers; torch's own advice is to turn them off
        no_donation = mode == "compile" and args.schedule in ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble",
                                                               "ScheduleDualPipeV")
        torch._functorch.config.donated_buffer = not no_donation
        if mode.startswith("fxoverlap"):
            sched = fxoverlap.pipeline_schedule(cls, arg, n_mb, loss_fn=loss_fn, ep_group=ep_group,
                                                merge=mode == "fxoverlap")
        else:
            sched = cls(arg, n_mb, loss_fn=loss_fn)
        has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        times, first_losses = [], None
        for it in range(warmup + iters):
            losses: list = []
            a = (x,) if has_first else ()
            kw = dict(target=y, losses=losses) if has_last else {}
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            sched.step(*a, **kw)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if it == 0 and has_last:
                first_losses = [float(v.detach()) for v in losses]
            if it >= warmup:
                times.append(dt)
            for p in model.parameters():
                p.grad = None
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
        row = {"step_ms": t.item() * 1e3,
               "tokens_per_s": n_mb * mbs * seq * ep / t.item(),  # each EP rank its own batch
               "first_losses": first_losses}
        if cuda:
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        if mode == "eager":
            ref_losses = first_losses
        if first_losses is not None and ref_losses is not None:
            row["max_loss_diff_vs_eager"] = max(abs(a - b) for a, b in zip(first_losses, ref_losses))
        if mode.startswith("fxoverlap"):
            row["merged_steps"] = sched.fxoverlap_merged_steps
            row["fxoverlap_stages"] = {i: len(v) for i, v in sched.fxoverlap_stages.items()}
            row["overlap_f_b_steps"] = getattr(sched, "fxoverlap_overlap_steps", None)
        rows = [None] * world
        dist.all_gather_object(rows, row)
        report["modes"][mode] = {"ranks": rows, "step_ms": rows[0]["step_ms"],
                                 "tokens_per_s": rows[0]["tokens_per_s"]}
        del sched, stages, model
    if rank != 0:
        return None
    eager = report["modes"].get("eager")
    for mode, r in report["modes"].items():
        if eager:
            r["speedup_vs_eager"] = eager["step_ms"] / r["step_ms"]
    return report


def format_report(report: dict) -> str:
    lines = [f"PP {report['pp']} x EP {report['ep']} ({report['world']} ranks), {report['schedule']}, "
             f"{report['microbatches']} microbatches x {report['micro_batch_size']} x {report['seq']} tokens, "
             f"{report['device']} {report['dtype']}",
             f"{'mode':<14} {'step ms':>10} {'tokens/s':>12} {'vs eager':>9} {'max |loss - eager|':>19}"]
    for mode, r in report["modes"].items():
        diffs = [x.get("max_loss_diff_vs_eager") for x in r["ranks"] if x.get("max_loss_diff_vs_eager") is not None]
        lines.append(f"{mode:<14} {r['step_ms']:>10.2f} {r['tokens_per_s']:>12.0f} "
                     f"{r.get('speedup_vs_eager', float('nan')):>8.3f}x "
                     f"{(max(diffs) if diffs else float('nan')):>19.3g}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        report = run(args)
        if report is not None:
            print(format_report(report), flush=True)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "pp_bench.json"), "w") as f:
                    json.dump(report, f, indent=1, default=str)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
