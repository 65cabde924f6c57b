"""ZeRO-2 against ZeRO-3 as one rank of DP M x EP N, on one device (emulated links).

    python -m fxoverlap.bench dp --emulate-dp 8 --dp-link 45 --emulate-ep 8 --link-gbps 100 --shape peer --out DIR

One process (a world of one rank, set up here: no torchrun needed) runs one rank's share of a
DP-M x EP-N job: the model is built on an emulated EP group (``EmulatedGroup``, as ``bench run
--emulate-ep`` does: E/N local experts) and optimized with ``dp_group`` an ``EmulatedDPGroup`` of
size M (fxoverlap/kernels/emulated_link.py). Under ZeRO-3 (``OverlapConfig(shard_params=True)``)
each dense parameter is then 1/M of its first dimension (experts: 1/M_e, M_e = M / N = 1 by
default: they are whole), each unshard gathers a real full-size buffer whose data is the local
shard tiled M times (the values are not the model's), and every DP collective holds a stream of
its own for ``latency + bytes * (M - 1) / M / bandwidth`` (``--dp-link`` GB/s per rank).

Per mode (``zero2``: ``grad_reduce="reduce_scatter"``; ``zero3``: ``shard_params=True``;
``zero3@MB``: with ``keep_gathered_mb=MB``, e.g. ``zero3@inf``: each unit gathered once per step;
a ``/aN`` suffix: ``unshard_ahead=N``, e.g. ``zero3/a2``), one
child process each (the peak memory of one mode per process; ``--one-process`` runs them in
this one, resetting the peak between modes), the median ``forward_backward`` time of three link
settings after a compile step with no links:

* ``t_step_ms``: both links on;
* ``t_no_dp_ms``: the DP link off (its collectives still run, holding nothing);
* ``t_no_ep_ms``: the EP link off.

``dp_hidden = 1 - (t_step - t_no_dp) / dp_hold`` (``dp_hold``: the DP holds per step, from the
group's stats), ``ep_hidden = 1 - (t_step - t_no_ep) / ep_hold``; ``dp_floor_ms``, the DP hold no
placement can hide: the step's first all-gather (its first stage waits for it, with nothing to run
before) plus its last reduce-scatter (issued after its last stage, with nothing to run after), both
the embedding's in the reference model, and ``dp_hidden_bound = 1 - dp_floor / dp_hold``, the
most ``dp_hidden`` can be (it rises with ``--layers``: more units between the two); peak GPU memory
(``torch.cuda.max_memory_allocated`` over the timed steps); held parameter bytes (the model's
parameters after sharding) against ``P_d / M + P_e / M_e``; ZeRO-2's ``gather_parameters`` (the
all-gather after its optimizer step, not in the step) timed apart. The summary row compares the
modes: ``zero3_over_zero2`` (target <= 1.03), ``dp_hidden`` of ZeRO-3 (>= 0.9) and
``ep_hidden_diff`` (|ZeRO-3 - ZeRO-2| <= 0.02). Rows print as ``DPE {json}`` lines; DIR/gpu_dp_emulated.json.
On CPU (``--device cpu``, ``--shape tiny``) it is a smoke run (the holds sleep).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.bench.cli import emulated_config, routing_fields
from fxoverlap.bench.gpu_dp import sync
from fxoverlap.ir.program import program_of, unshard
from fxoverlap.kernels.emulated_link import EmulatedDPGroup, EmulatedGroup, Link, per_step
from fxoverlap.models import MoETransformer

MODES = ("zero2", "zero3")


def _file_tag(mode: str) -> str:
    """The mode in a file name (``zero3@inf/a2`` -> ``zero3_keepinf_a2``)."""
    return mode.replace("@", "_keep").replace("/a", "_a")


def parse_mode(mode: str) -> tuple[str, float, int] | None:
    """``("zero2", 0, 1)`` or ``("zero3", keep_gathered_mb, unshard_ahead)`` (``zero3``: 0, 1;
    ``zero3@MB``: keep MB; a ``/aN`` suffix: ``unshard_ahead=N``, e.g. ``zero3/a2``,
    ``zero3@inf/a2``), or ``None`` for a name that is neither."""
    rest, _, ahead = mode.partition("/a")
    name, _, keep = rest.partition("@")
    try:
        mb, n = float(keep) if keep else 0.0, int(ahead) if ahead else 1
    except ValueError:
        return None
    if name == "zero2":
        return ("zero2", 0.0, 1) if not keep and not ahead else None
    return ("zero3", mb, n) if name == "zero3" and n >= 1 else None


def add_args(p: argparse.ArgumentParser) -> None:
    """The emulation's flags (on ``bench dp``'s parser)."""
    g = p.add_argument_group("emulated DP (one process: one rank of DP M x EP N; gpu_dp_emulated.py)")
    g.add_argument("--emulate-dp", type=int, metavar="M", help="run one rank of DP M (ZeRO-2 vs ZeRO-3)")
    g.add_argument("--dp-link", type=float, default=45.0, metavar="GBPS",
                   help="the emulated DP link, GB/s per rank (default 45: ib400's measured rate)")
    g.add_argument("--dp-link-latency-us", type=float, default=20.0)
    g.add_argument("--emulate-ep", type=int, default=8, metavar="N", help="emulated EP size (default 8)")
    g.add_argument("--link-gbps", type=float, default=100.0, help="the emulated EP link, GB/s (default 100)")
    g.add_argument("--link-latency-us", type=float, default=20.0)
    g.add_argument("--layers", type=int, help="the shape's layer count, overridden (more units between the "
                   "step's first gather and last reduce-scatter)")
    g.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated subset of zero2,zero3,zero3@MB (OverlapConfig.keep_gathered_mb=MB, e.g. "
                        "zero3@inf: each unit gathered once per step), zero3/aN (unshard_ahead=N)")
    g.add_argument("--one-process", action="store_true",
                   help="every mode in this process (peak memory reset between modes) instead of one child each")


def _init(device: torch.device) -> None:
    if not dist.is_initialized():  # a world of one rank of our own (no torchrun)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise SystemExit(f"--emulate-dp runs one rank in one process; got a world of {dist.get_world_size()}")


def measure(args: argparse.Namespace, mode: str, device: torch.device,
            inspect: Callable[..., None] | None = None) -> dict:
    """One mode's row (see the module docstring); ``inspect(engine, model, dp_group, dp_link)``,
    if given, runs before the engine closes (the tests read the units and buckets there)."""
    from fxoverlap.bench.gpu_dp import SHAPES, make_batches

    _init(device)
    m, n_ep = args.emulate_dp, args.emulate_ep
    layers = {"n_layers": args.layers} if args.layers else {}
    cfg, seq, mbs, n = SHAPES[args.shape]({**routing_fields(args.routing), **layers})
    n = args.microbatches or n
    cfg = emulated_config(cfg, n_ep)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    ep_link = None if n_ep == 1 else Link(args.link_gbps, args.link_latency_us, ep=n_ep,
                                          experts=cfg.n_experts * n_ep, name=f"ep{args.link_gbps:g}GB/s")
    dp_link = Link(args.dp_link, args.dp_link_latency_us, ep=m, name=f"dp{args.dp_link:g}GB/s")
    ep_group = EmulatedGroup(None) if n_ep > 1 else None
    dp_group = EmulatedDPGroup(m)
    torch.manual_seed(0)
    with torch.device(device):
        model = MoETransformer(cfg, ep_group)
    model.to(dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    p_e = sum(p.numel() for name, p in model.named_parameters() if ".moe.experts." in name) * esize
    p_d = sum(p.numel() for p in model.parameters()) * esize - p_e
    m_e = m if ep_group is None else 1  # expert_dp_group=None under emulated EP: M_e = M / N = 1 (N = M)
    batches = make_batches(cfg, n, mbs, seq, device)
    kind, keep, ahead = parse_mode(mode)
    config = fxoverlap.OverlapConfig(grad_reduce="reduce_scatter", shard_params=kind == "zero3",
                                     keep_gathered_mb=keep, unshard_ahead=ahead,
                                     compiler=args.compiler, delay_wgrad=args.delay_wgrad,
                                     reduce_bucket_mb=args.bucket_mb, progress=False)
    engine = fxoverlap.optimize(model, ep_group, config, dp_group=dp_group)

    def clear() -> None:
        model.zero_grad(set_to_none=True)
        if mode == "zero2":
            for v in engine.shard_parameters():
                v.grad = None

    def step() -> None:
        engine.forward_backward(batches)

    t0 = time.perf_counter()
    step()  # capture, compile, shard (ZeRO-3), no links
    sync(device)
    first_s = time.perf_counter() - t0
    clear()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def timed(ep_on: bool, dp_on: bool) -> dict:
        links = (ep_group.using(ep_link if ep_on else None) if ep_group is not None else contextlib.nullcontext(),
                 dp_group.using(dp_link if dp_on else None))
        with links[0], links[1]:
            for _ in range(args.warmup):
                clear()
                step()
            sync(device)
            dp_group.stats.reset()
            if ep_group is not None:
                ep_group.stats.reset()
            times = []
            for _ in range(args.iters):
                clear()
                sync(device)
                t = time.perf_counter()
                if device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    sync(device)
                    times.append(start.elapsed_time(end))
                else:
                    step()
                    times.append((time.perf_counter() - t) * 1e3)
        dp_stats = dp_group.stats.as_dict()
        ep_stats = ep_group.stats.as_dict() if ep_group is not None else {"ms": 0.0, "calls": 0}
        return dict(ms=statistics.median(times), iters_ms=times, dp_hold_ms=dp_stats["ms"] / args.iters,
                    ep_hold_ms=ep_stats["ms"] / args.iters,
                    dp_by_op={k: per_step(row, args.iters) for k, row in dp_stats["by_op"].items()})

    on = timed(True, True)
    floor = dp_floor_ms(on["dp_by_op"])
    no_dp = timed(True, False)
    no_ep = timed(False, True)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    row = dict(kind="mode", mode=mode, M=m, M_e=m_e, ep=n_ep, shape=args.shape, microbatches=n, seq=seq,
               micro_batch_size=mbs, dtype=str(dtype), dp_link=dp_link.describe(),
               ep_link=None if ep_link is None else ep_link.describe(), first_step_s=round(first_s, 2),
               t_step_ms=on["ms"], t_no_dp_ms=no_dp["ms"], t_no_ep_ms=no_ep["ms"], iters_ms=on["iters_ms"],
               dp_hold_ms=on["dp_hold_ms"], ep_hold_ms=on["ep_hold_ms"], dp_by_op=on["dp_by_op"],
               dp_exposed_ms=on["ms"] - no_dp["ms"], ep_exposed_ms=on["ms"] - no_ep["ms"],
               dp_hidden=_hidden(on["ms"], no_dp["ms"], on["dp_hold_ms"]),
               dp_floor_ms=floor, dp_hidden_bound=_hidden(floor, 0.0, on["dp_hold_ms"]),
               layers=cfg.n_layers,
               ep_hidden=_hidden(on["ms"], no_ep["ms"], on["ep_hold_ms"]),
               peak_gib=peak, process="one" if args.one_process else "own",
               P_d=p_d, P_e=p_e, held_expected=p_d // m + p_e // m_e)
    params = {id(p): p for p in model.parameters()}.values()
    row["held_bytes"] = sum(p.numel() * p.element_size() for p in params)
    if kind == "zero3":
        sharding = engine.sharding
        row.update(units=len(sharding.units), gathered_peak_bytes=sharding.peak_bytes,
                   unshards_per_step=sum(1 for node in engine.program.graph.nodes if node.target is unshard),
                   gathered_peak_units=getattr(program_of(engine.program), "gathered_peak", None),
                   shard_rows_ok=all(dict(model.named_parameters(remove_duplicate=False))[fqn].shape[0] * m
                                     == shape[0] for fqn, shape in sharding.program_shapes.items()))
    else:  # ZeRO-2's all-gather after its optimizer step (not in forward_backward), with the DP link
        with dp_group.using(dp_link):
            times = []
            for _ in range(max(args.iters, 1)):
                sync(device)
                t = time.perf_counter()
                engine.gather_parameters()
                sync(device)
                times.append((time.perf_counter() - t) * 1e3)
        row["gather_parameters_ms"] = statistics.median(times)
    if inspect is not None:
        inspect(engine, model, dp_group, dp_link)
    engine.close()
    return row


def dp_floor_ms(by_op: dict) -> float:
    """The DP hold per step that no placement can hide: the first all-gather's (nothing runs before
    the stage that waits for it) and the last reduce-scatter's (nothing runs after it), for a model
    whose first stage reads the first gathered unit and whose last stage writes the last reduced
    gradient (the reference model's embedding does both)."""
    return by_op.get("all_gather", {}).get("first_ms", 0.0) + by_op.get("reduce_scatter", {}).get("last_ms", 0.0)


def _hidden(t_step: float, t_without: float, hold: float) -> float | None:
    """1 - exposed / hold: the share of the link's hold time that ran under other work."""
    return None if hold <= 0 else 1.0 - (t_step - t_without) / hold


def summary(rows: list[dict]) -> dict:
    """Each ZeRO-3 mode against ZeRO-2: the issue's three targets (``zero3``'s at the top level,
    every ZeRO-3 mode's under ``by_mode``)."""
    by = {r["mode"]: r for r in rows if r.get("kind") == "mode"}
    out: dict = dict(kind="summary")
    if "zero2" not in by:
        return out
    for mode in by:
        if mode != "zero2":
            one = _against_zero2(by["zero2"], by[mode])
            out.setdefault("by_mode", {})[mode] = one
            if mode == "zero3":
                out.update(one)
    return out


def _against_zero2(z2: dict, z3: dict) -> dict:
    out: dict = {}
    out.update(zero3_over_zero2=z3["t_step_ms"] / z2["t_step_ms"],
               zero3_dp_hidden=z3["dp_hidden"], zero2_dp_hidden=z2["dp_hidden"],
               zero3_dp_hidden_bound=z3.get("dp_hidden_bound"), zero2_dp_hidden_bound=z2.get("dp_hidden_bound"),
               ep_hidden_zero2=z2["ep_hidden"], ep_hidden_zero3=z3["ep_hidden"],
               ep_hidden_diff=(None if None in (z2["ep_hidden"], z3["ep_hidden"])
                               else z3["ep_hidden"] - z2["ep_hidden"]),
               peak_gib=dict(zero2=z2["peak_gib"], zero3=z3["peak_gib"]),
               held_bytes=dict(zero2=z2["held_bytes"], zero3=z3["held_bytes"],
                               zero3_expected=z3["held_expected"]))
    out["targets"] = dict(step=out["zero3_over_zero2"] <= 1.03,
                          dp_hidden=z3["dp_hidden"] is not None and z3["dp_hidden"] >= 0.9,
                          ep_hidden=out["ep_hidden_diff"] is not None and abs(out["ep_hidden_diff"]) <= 0.02,
                          held=z3["held_bytes"] == z3["held_expected"])
    return out


def main(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """``bench dp --emulate-dp M``: each mode in a child process (or here with ``--one-process``)."""
    if args.emulate_dp < 1:
        raise SystemExit(f"--emulate-dp must be >= 1, got {args.emulate_dp}")
    want = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda", 0) if want == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    if bad := [x for x in modes if parse_mode(x) is None]:
        raise SystemExit(f"--modes: unknown {bad}; choose from {list(MODES)} or zero3@MB (keep_gathered_mb=MB), "
                         f"zero3/aN (unshard_ahead=N)")
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print("DPE " + json.dumps(row, default=str), flush=True)

    os.makedirs(args.out, exist_ok=True)
    for mode in modes:
        if args.one_process or len(modes) == 1:
            emit(measure(args, mode, device))
            continue
        from fxoverlap.bench.commands import subprocess_env

        path = os.path.join(args.out, f"gpu_dp_emulated_{_file_tag(mode)}.json")
        cmd = [sys.executable, "-m", "fxoverlap.bench", "dp", *argv, "--modes", mode]
        subprocess.run(cmd, check=True, env=subprocess_env())
        with open(path) as f:
            emit(next(r for r in json.load(f) if r.get("kind") == "mode"))
    if len(modes) > 1:
        emit(summary(rows))
    name = "gpu_dp_emulated.json" if len(modes) > 1 else f"gpu_dp_emulated_{_file_tag(modes[0])}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows
