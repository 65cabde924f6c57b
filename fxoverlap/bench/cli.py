"""The benchmark's flags, and what they make: the ``OverlapConfig`` and the ``MoEConfig``.

``python -m fxoverlap.bench run --help`` lists every flag (``run`` is the default subcommand,
:mod:`fxoverlap.bench.commands`); docs/benchmarks.md says how to run it on CPU and on the GPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from fxoverlap.config import ConfigError, OverlapConfig
from fxoverlap.kernels.emulated_link import PRESETS, Link, preset
from fxoverlap.models.moe import MoEConfig

MODES = ("eager", "compile", "backend", "fxoverlap")
# Forward only, under torch.no_grad(): the model, torch.compile(model), the backend (which
# runs its plain graph without grad) and the engine's forward (``engine(*mb)``).
FORWARD_MODES = ("fwd_eager", "fwd_compile", "fwd_backend", "fwd_fxoverlap", "fwd_fxoverlap_each")
ALL_MODES = MODES + FORWARD_MODES


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fxoverlap.bench [run]",
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
    emu = p.add_argument_group(
        "emulated interconnect (one rank of EP-N on one device; fxoverlap/kernels/emulated_link.py)")
    emu.add_argument("--emulate-ep", type=int, metavar="N",
                     help="run one EP-N rank's work: E/N experts with the same top-k (top-k <= E/N), else "
                          "routing over E folded onto E/N local experts (MoEConfig.expert_fold); one process")
    emu.add_argument("--link", choices=(*PRESETS, "none"),
                     help="the emulated link every dispatch/combine holds its stream for (default with "
                          "--emulate-ep: nvlink, unless --link-gbps): nvlink 294 GB/s, p2p_off 23.5 GB/s, "
                          "ib400 45 GB/s; none: the EP-N rank's compute only")
    emu.add_argument("--link-gbps", type=float, help="an explicit link bandwidth in GB/s (instead of --link)")
    emu.add_argument("--link-latency-us", type=float, help="latency per all-to-all in us (default 20)")
    emu.add_argument("--skew", type=float, default=1.0,
                     help="routing skew: the busiest link carries SKEW x the balanced bytes and sets the time")
    run = p.add_argument_group("run")
    run.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    run.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                     help="auto: bf16 on GPU, fp32 on CPU")
    run.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(ALL_MODES))
    run.add_argument("--warmup", type=int, help="warm-up steps per mode (default 3; 1 with --tiny)")
    run.add_argument("--iters", type=int, help="timed steps per mode (default 8; 3 with --tiny)")
    run.add_argument("--no-stage-timing", action="store_true",
                     help="skip the stage-timed runs (T_serial, T_bound), the timeline and the trace")
    run.add_argument("--stage-reps", type=int, default=3,
                     help="runs of the stage-timed program for T_serial/T_bound (median per stage)")
    run.add_argument("--overlap-config", default="",
                     help="OverlapConfig fields, e.g. comm_stream_priority=0,delay_wgrad=1")
    run.add_argument("--expert-math", choices=("model", "fp8_rowwise", "torchao_fp8"), default="model",
                     help="the experts' GEMMs: the model's dtype; fp8_rowwise: fxoverlap's FP8 ops in every mode "
                          "(OverlapConfig(expert_dtype='fp8_rowwise') for fxoverlap, fp8_ops.expert_math for eager "
                          "and torch.compile); torchao_fp8: torchao's own fused FP8 grouped GEMM in eager and "
                          "torch.compile (the baseline; not the fxoverlap or backend modes). python -m "
                          "fxoverlap.bench fp8 runs the rows")
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
    if bad := [m for m in modes if m not in ALL_MODES]:
        p.error(f"--modes: unknown mode(s) {bad}; choose from {list(ALL_MODES)}")
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
        if args.expert_math == "fp8_rowwise":
            args.overlap = dataclasses.replace(args.overlap, expert_dtype="fp8_rowwise")
        args.emulated_link = parse_link(args)
    except ValueError as e:
        p.error(str(e))
    return args


def parse_link(args: argparse.Namespace) -> Link | None:
    """The emulated link of the flags (None: no link), for ``--emulate-ep`` N."""
    explicit = args.link_gbps is not None or args.link_latency_us is not None
    if args.emulate_ep is None:
        if args.link not in (None, "none") or explicit or args.skew != 1.0:
            raise ConfigError("--link, --link-gbps, --link-latency-us and --skew need --emulate-ep N")
        return None
    if args.emulate_ep < 1:
        raise ConfigError(f"--emulate-ep must be >= 1, got {args.emulate_ep}")
    if args.link is not None and args.link_gbps is not None:
        raise ConfigError("give either --link or --link-gbps, not both")
    if args.link == "none":
        return None
    over = {"ep": args.emulate_ep, "skew": args.skew}
    if args.link_latency_us is not None:
        over["latency_us"] = args.link_latency_us
    if args.link_gbps is not None:
        return Link(args.link_gbps, name=f"{args.link_gbps:g}GB/s", **over)
    return preset(args.link or "nvlink", **over)


def emulated_config(cfg: MoEConfig, ep: int) -> MoEConfig:
    """The model one rank of EP-``ep`` runs: E/N experts with the same top-k where top-k <= E/N,
    else routing over E folded onto the E/N local experts (``expert_fold``)."""
    if ep == 1:
        return cfg
    if cfg.n_experts % ep:
        raise ConfigError(f"--emulate-ep {ep}: {cfg.n_experts} experts cannot be split over {ep} ranks")
    local = cfg.n_experts // ep
    fold = 1 if cfg.top_k <= local else ep
    return dataclasses.replace(cfg, n_experts=local, expert_fold=fold)


def parse_overlap_config(text: str) -> OverlapConfig:
    """``"comm_stream_priority=0,delay_wgrad=1"`` -> ``OverlapConfig(...)``."""
    fields = {f.name: f for f in dataclasses.fields(OverlapConfig)}
    kw: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, val = item.partition("=")
        if not sep or key not in fields:
            raise ConfigError(f"--overlap-config: {item!r} is not FIELD=VALUE with FIELD one of {sorted(fields)}")
        default = fields[key].default
        if default is None:  # an optional field: its annotation says the type ("int | None")
            kind = str(fields[key].type).split("|")[0].strip()
            if val.lower() == "none":
                kw[key] = None
                continue
            default = {"int": 0, "float": 0.0, "bool": False}.get(kind, "")
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
    if getattr(args, "emulate_ep", None):
        cfg = emulated_config(cfg, args.emulate_ep)
    return cfg
