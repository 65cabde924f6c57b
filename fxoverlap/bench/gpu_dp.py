"""Data-parallel gradient reduction inside the program, measured: EP 1 x DP N by default.

    torchrun --nproc-per-node N -m fxoverlap.bench dp [--shape peer|small|tiny] [--ep 1] [--out DIR]

Any world size (1 works: the reductions are one-rank collectives). For each reduce mode
(``all_reduce``, ``reduce_scatter``), on the same model, weights and data (median of
``--iters`` steps after ``--warmup``):

* ``T_local``: ``forward_backward`` with no reduction (an engine without ``dp_group``,
  sharing the same compiled stages);
* ``T_dp``: with the reductions in the program (``optimize(..., dp_group=WORLD)``),
  issued in the last microbatch's backward as each bucket's gradients are final;
* ``T_after``: the local step, then the same buckets reduced by hand, one after another
  (flat copy, collective, scale: what a step without overlap costs);
* ``T_reduce``: those reductions alone.

Hidden share = ``(T_after - T_dp) / (T_after - T_local)``: 1 when the reduction costs
nothing on top of the step, 0 when it is fully exposed (``hidden_vs_alone`` uses
``T_reduce`` instead of ``T_after - T_local``). Also: peak memory per mode, and the
gradients of ``T_dp`` against the local ones reduced by hand parameter by parameter
(``all_reduce`` then ``/ N``; rel-L2 per parameter and whether bitwise: with 2 ranks a
sum has one order, so bitwise is expected). ``--csan`` runs one step of each mode under
``torch.cuda._sanitizer`` at the end. ``--shard-params`` (EP 1) adds a ZeRO-3 engine
(``OverlapConfig(shard_params=True)``) on a copy of the model, taken before any engine runs: its
gradients against the same reference, its step time and peak memory, and its CSAN step; with one
rank each gather is a one-rank collective, so this checks the parameter stream's code and
synchronisation on a GPU, not the sharding's saving. Rank 0 prints ``DP {json}`` lines and writes
``DIR/gpu_dp.json``. On CPU (``--device cpu``, gloo) it runs as a smoke test.

``--emulate-dp M`` (one process, no torchrun): ZeRO-2 against ZeRO-3 as one rank of DP M x EP N
with emulated links, :mod:`fxoverlap.bench.gpu_dp_emulated`.

Run on the lent machine (2 GPUs), e.g.:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m fxoverlap.bench dp --out $OUT
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m fxoverlap.bench dp --shape small --csan --out $OUT
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fxoverlap
from fxoverlap.bench import routing_fields
from fxoverlap.grad_reduce import reduce_scatter_single
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import rel_l2, share_plans
from fxoverlap.ir.program import program_of

# shape: (model config, sequence length, sequences per microbatch, microbatches)
SHAPES = {
    "peer": lambda r: (MoEConfig.benchmark(**r), 4096, 1, 8),
    "small": lambda r: (MoEConfig.tiny(**{**dict(dim=1024, n_heads=8, n_layers=4, n_experts=8, top_k=2, expert_dim=1024,
                                              shared_expert_dim=1024, vocab_size=8192, max_seq_len=1024), **r}),
                        1024, 2, 4),
    "tiny": lambda r: (MoEConfig.tiny(**r), 32, 2, 3),
}
MODES = ("all_reduce", "reduce_scatter")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="peer")
    p.add_argument("--routing", choices=("dropless", "capacity", "dedup"), default="dropless")
    p.add_argument("--microbatches", type=int, help="default: the shape's")
    p.add_argument("--ep", type=int, default=1, help="EP size (DP = world / ep); default 1")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="OverlapConfig.reduce_bucket_mb")
    p.add_argument("--compiler", choices=("inductor", "eager"), default=None, help="default: inductor on CUDA")
    p.add_argument("--delay-wgrad", action="store_true")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--csan", action="store_true", help="one step of each mode under CSAN, at the end")
    p.add_argument("--shard-params", action="store_true", help="also a ZeRO-3 engine (EP 1 only)")
    p.add_argument("--out", default="bench_out/gpu_dp")
    from fxoverlap.bench.gpu_dp_emulated import add_args

    add_args(p)
    return p.parse_args(argv)


def setup(args) -> torch.device:
    want = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    timeout = datetime.timedelta(seconds=900)
    if want == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(cfg: MoEConfig, n: int, mbs: int, seq: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 1000 * dist.get_rank())
    return [tuple(torch.randint(0, cfg.vocab_size, (mbs, seq), generator=g).to(device) for _ in range(2))
            for _ in range(n)]


def clear(model, engine) -> None:
    model.zero_grad(set_to_none=True)
    if engine is not None and engine.grad_reduction is not None and engine.config.grad_reduce == "reduce_scatter":
        for v in engine.shard_parameters():
            v.grad = None


def reduce_by_hand(model, buckets, groups, mode: str) -> None:
    """The engine's buckets reduced after the step, one after another: flat copy, collective, scale."""
    params = dict(model.named_parameters())
    for b in buckets:
        group, ranks = groups.of(b.role)
        grads = [params[s.param].grad for s in b.slots]
        flat = torch.zeros(b.padded_numel(len(ranks)), dtype=b.dtype, device=grads[0].device)
        for s, g in zip(b.slots, grads):
            flat[s.offset:s.offset + s.numel].copy_(g.reshape(-1))
        if mode == "all_reduce":
            if group is not None:
                dist.all_reduce(flat, group=group)
            flat.div_(groups.dp_size)
            for s, g in zip(b.slots, grads):
                g.copy_(flat[s.offset:s.offset + s.numel].view(s.shape))
        else:
            start, stop = b.shard(ranks.index(dist.get_rank()), len(ranks))
            out = flat.new_empty(stop - start)
            if group is not None:
                reduce_scatter_single(out, flat, group=group)
            else:
                out.copy_(flat)
            out.div_(groups.dp_size)


def median_ms(step, model, engine, device, warmup: int, iters: int, timed=None) -> tuple[float, float]:
    """Median step time (ms) and peak memory (GiB) of ``step()``; ``timed`` (optional) returns
    the part of the step to time, run after ``step``."""
    times = []
    for i in range(warmup + iters):
        clear(model, engine)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        step()
        if timed is not None:
            sync(device)
            t0 = time.perf_counter()
            timed()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def main() -> None:
    args = parse_args()
    if args.emulate_dp is not None:  # one process, one rank of DP M x EP N (gpu_dp_emulated.py)
        from fxoverlap.bench import gpu_dp_emulated

        gpu_dp_emulated.main(args, sys.argv[1:])
        return
    device = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    emit_rows: list[dict] = []

    def emit(row: dict) -> None:
        emit_rows.append(row)
        if rank == 0:
            print("DP " + json.dumps(row), flush=True)

    if world % args.ep:
        raise SystemExit(f"--ep {args.ep} does not divide the world of {world} ranks")
    ep_group = edp_group = None
    if args.ep > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // args.ep, args.ep), mesh_dim_names=("edp", "ep"))
        ep_group, edp_group = mesh["ep"].get_group(), mesh["edp"].get_group()
    cfg, seq, mbs, n = SHAPES[args.shape](routing_fields(args.routing))
    n = args.microbatches or n
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    torch.manual_seed(0)
    model = MoETransformer(cfg, ep_group).to(device=device, dtype=dtype)
    if args.shard_params and args.ep != 1:
        raise SystemExit("--shard-params: EP 1 only (the reference here is the local gradients reduced by hand)")
    z_model = copy.deepcopy(model) if args.shard_params else None
    batches = make_batches(cfg, n, mbs, seq, device)
    base = dict(compiler=args.compiler, delay_wgrad=args.delay_wgrad, reduce_bucket_mb=args.bucket_mb, progress=False)
    meta = dict(kind="meta", world=world, ep=args.ep, dp=world, shape=args.shape, routing=args.routing,
                microbatches=n, seq=seq, micro_batch_size=mbs, dtype=str(dtype), bucket_mb=args.bucket_mb,
                torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                params=sum(p.numel() for p in model.parameters()))

    engines = {}
    for mode in MODES:
        engines[mode] = fxoverlap.optimize(model, ep_group, fxoverlap.OverlapConfig(grad_reduce=mode, **base),
                                           dp_group=dist.group.WORLD, expert_dp_group=edp_group)
        if mode != MODES[0]:
            share_plans(engines[MODES[0]], engines[mode])
        t0 = time.perf_counter()
        engines[mode].forward_backward(batches)  # capture + compile (the first engine), program build
        sync(device)
        meta[f"first_step_s_{mode}"] = round(time.perf_counter() - t0, 2)
        clear(model, engines[mode])
    local = fxoverlap.optimize(model, ep_group, fxoverlap.OverlapConfig(**base))
    share_plans(engines[MODES[0]], local)
    buckets = program_of(engines[MODES[0]].program).buckets
    groups = engines[MODES[0]].grad_reduction.groups
    meta.update(buckets=len(buckets), bucket_roles=[b.role for b in buckets],
                bucket_mib=[round(b.numel * b.dtype.itemsize / 2**20, 2) for b in buckets])
    emit(meta)

    # numerics: the in-program reduction against the local gradients reduced by hand
    clear(model, local)
    local.forward_backward(batches)
    ref = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        group = edp_group if (args.ep > 1 and ".moe.experts." in name) else dist.group.WORLD
        if group is not None:
            dist.all_reduce(g, group=group)
        ref[name] = g.div_(world)
    clear(model, local)
    engines["all_reduce"].forward_backward(batches)
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    worst, where = rel_l2(ref, got)
    emit(dict(kind="numerics", mode="all_reduce", worst_rel_l2=worst, param=where,
              bitwise=all(torch.equal(ref[k], got[k]) for k in ref), ok=worst <= 2**-7))
    clear(model, engines["reduce_scatter"])
    engines["reduce_scatter"].forward_backward(batches)
    pieces = engines["reduce_scatter"].grad_reduction.shard_pieces()
    got = {f"{q.param}#{i}": q.view.grad for i, q in enumerate(pieces)}
    want = {f"{q.param}#{i}": ref[q.param].reshape(-1)[q.start:q.start + q.view.numel()] for i, q in enumerate(pieces)}
    worst, where = rel_l2(want, got)
    emit(dict(kind="numerics", mode="reduce_scatter", worst_rel_l2=worst, param=where,
              bitwise=all(torch.equal(want[k], got[k]) for k in want), ok=worst <= 2**-7))
    z_engine = None
    if z_model is not None:
        z_engine = fxoverlap.optimize(z_model, ep_group, fxoverlap.OverlapConfig(shard_params=True, **base),
                                      dp_group=dist.group.WORLD, expert_dp_group=edp_group)
        t0 = time.perf_counter()
        z_engine.forward_backward(batches)
        sync(device)
        got = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
               for name, p in z_model.named_parameters()}
        worst, where = rel_l2(ref, got)
        emit(dict(kind="numerics", mode="shard_params", first_step_s=round(time.perf_counter() - t0, 2),
                  worst_rel_l2=worst, param=where, ok=worst <= 2**-7,
                  param_types=sorted({type(p).__name__ for p in z_model.parameters()}),
                  gathered_peak=getattr(program_of(z_engine.program), "gathered_peak", None)))
    del ref, got, want

    # timing
    t_local, peak_local = median_ms(lambda: local.forward_backward(batches), model, local, device, args.warmup, args.iters)
    for mode in MODES:
        engine = engines[mode]
        t_dp, peak_dp = median_ms(lambda: engine.forward_backward(batches), model, engine, device,
                                  args.warmup, args.iters)
        t_after, _ = median_ms(lambda: (local.forward_backward(batches), reduce_by_hand(model, buckets, groups, mode)),
                               model, local, device, args.warmup, args.iters)
        t_reduce, _ = median_ms(lambda: local.forward_backward(batches), model, local, device, args.warmup,
                                args.iters, timed=lambda: reduce_by_hand(model, buckets, groups, mode))
        exposed_after = t_after - t_local
        emit(dict(kind="timing", mode=mode, t_local_ms=t_local, t_dp_ms=t_dp, t_after_ms=t_after,
                  t_reduce_ms=t_reduce, exposed_ms=t_dp - t_local,
                  hidden=(t_after - t_dp) / exposed_after if exposed_after > 0 else None,
                  hidden_vs_alone=1 - (t_dp - t_local) / t_reduce if t_reduce > 0 else None,
                  speedup_vs_after=t_after / t_dp, peak_gib_local=peak_local, peak_gib_dp=peak_dp))

    if z_engine is not None:
        t_z, peak_z = median_ms(lambda: z_engine.forward_backward(batches), z_model, None, device, args.warmup,
                                args.iters)
        emit(dict(kind="timing", mode="shard_params", t_local_ms=t_local, t_dp_ms=t_z, exposed_ms=t_z - t_local,
                  peak_gib_local=peak_local, peak_gib_dp=peak_z))
        engines["shard_params"] = z_engine

    if args.csan:
        import torch.cuda._sanitizer as csan

        csan.enable_cuda_sanitizer()
        for mode, engine in engines.items():
            error = None
            try:
                m = z_model if mode == "shard_params" else model
                clear(m, None if mode == "shard_params" else engine)
                engine.forward_backward(make_batches(cfg, n, mbs, seq, device, seed=1))
                sync(device)
            except Exception as e:  # CSAN raises CUDASanitizerErrors on a race
                error = f"{type(e).__name__}: {str(e)[:2000]}"
            emit(dict(kind="csan", mode=mode, error=error, ok=error is None))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_dp.json"), "w") as f:
            json.dump(emit_rows, f, indent=1, default=str)
    dist.barrier()
    for engine in (*engines.values(), local):
        engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
