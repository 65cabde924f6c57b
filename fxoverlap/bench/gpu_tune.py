"""``fxoverlap.tune`` against an exhaustive sweep of the same knobs and against the defaults, per
model and emulated link speed (issue 40's "done when"; docs/tune.md).

    python -m fxoverlap.bench tune --out $OUT [--models peer,qwen3_moe,deepseek_v3] [--gbps 45,100,300]
                                   [--budget 60] [--microbatches 8] [--iters 3] [--no-sweep]
    python -m fxoverlap.bench tune --tiny --device cpu --quick --out /tmp/t   # CPU smoke: host clock

One GPU, one process: each model is one rank of emulated EP (``EmulatedGroup``; the peer's shape at
EP 8 with E/8 local experts, the HF layers as ``bench hf --real`` builds them), and for each link
speed (the group's link set between runs, nothing recompiled for it):

1. ``sweep``: ``tune_with_report(exhaustive=True)``: every candidate program compiled and every
   candidate timed (``--no-sweep`` skips it: it takes minutes per link at the real shapes);
2. ``tuned``: ``tune_with_report(budget_s=--budget)`` (cache off), its wall time is the tuning cost;
3. the defaults' config, the tuned config and the sweep's best, each timed again (a fresh engine per
   distinct config, ``--warmup`` rounds, then ``--iters`` rounds of one step of each between CUDA
   events, the median per config: interleaved, so drift falls on all alike, and equal configs get
   one figure), so the comparison does not depend on when the tables were measured.

Writes one JSON line per (model, link) to ``--out``/``tune.jsonl``: the three re-timed steps (the
median as ``*_ms``, every reading as ``*_ms_all``), the
ratios (tuned / sweep best: the criterion is <= 1.02; tuned / defaults: <= 1.00; each holds by
identity where the choice is that setting, :func:`verdicts`), the tuning cost against the budget,
the choice, the predicted step at 4/8/16 microbatches, and both tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import fxoverlap
from fxoverlap.bench.commands import SupportModule
from fxoverlap.kernels import emulated_link as el
from fxoverlap.tune import Candidate, CudaEventTimer, Space, WallTimer, tune_with_report

hf_cases = SupportModule("hf_cases")


def build(name: str, device: torch.device, tiny: bool, microbatches: int | None):
    """(model, microbatches, loss_fn, ep, global experts, group) for ``name``."""
    from fxoverlap.testing import token_batches

    if name == "peer":
        from fxoverlap.bench.cli import emulated_config
        from fxoverlap.models import MoEConfig, MoETransformer

        ep = 2 if tiny else 8
        cfg = MoEConfig.tiny() if tiny else MoEConfig.benchmark()
        experts = cfg.n_experts
        cfg = emulated_config(cfg, ep)
        group = el.EmulatedGroup(None)
        torch.manual_seed(0)
        with torch.device(device):
            model = MoETransformer(cfg, group)
        model.to(torch.float32 if device.type == "cpu" else torch.bfloat16)
        n = microbatches or (3 if tiny else 8)
        mbs = token_batches(cfg.vocab_size, n, (2, 16) if tiny else (1, 4096), seed=0, device=device)
        return model, mbs, None, ep, experts, group
    from fxoverlap.bench import hf_gpu

    _, ep, experts, _ = hf_gpu.REAL[name]
    group = el.EmulatedGroup(None)
    model = fxoverlap.expert_parallel(hf_gpu._real_model(name), group)
    g = torch.Generator().manual_seed(0)
    n = microbatches or hf_gpu.N_MB
    mbs = [torch.randint(0, hf_gpu.VOCAB_REAL, (1, hf_gpu.SEQ), generator=g).to(device) for _ in range(n)]
    return model, mbs, hf_cases.next_token_loss, ep, experts, group


def parse_space(text: str, base: Space) -> Space:
    """``'chunks=1,2;sm_carveout=0,24'`` -> ``base`` with those fields' values."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(Space)}
    changes = {}
    for part in filter(None, (x.strip() for x in text.split(";"))):
        name, _, values = part.partition("=")
        if name not in fields:
            raise SystemExit(f"--space: unknown field {name!r}; the fields: {', '.join(fields)}")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if name == "dispatchers":
            changes[name] = tuple(items)
        elif name == "chunks_in_merged_steps" or name == "delay_wgrad":
            changes[name] = tuple(v.lower() in ("1", "true", "yes") for v in items)
        else:
            changes[name] = tuple(int(v) for v in items)
    return dataclasses.replace(base, **changes)


def time_configs(model, group, mbs, loss_fn, cfgs: dict, timer, warmup: int, iters: int) -> dict[str, list[float]]:
    """Each of ``cfgs``' ``iters`` step readings (ms), one engine per distinct config,
    timed round by round (one step of each per round) after ``warmup`` rounds: drift over the run
    (clocks, the allocator, other work on the machine) falls on every config alike, and equal configs
    get one engine and one figure."""
    distinct: list = []
    for cfg in cfgs.values():
        if cfg not in distinct:
            distinct.append(cfg)
    engines = [fxoverlap.optimize(model, group, cfg) for cfg in distinct]

    def step_of(engine):
        def step():
            model.zero_grad(set_to_none=True)
            return engine.forward_backward(mbs, loss_fn)
        return step

    steps = [step_of(e) for e in engines]
    for _ in range(warmup):
        for step in steps:
            step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(iters):
        for k, step in enumerate(steps):
            times[k].append(timer.step_ms(Candidate(), step, 1))
    for e in engines:
        e.close()
    model.zero_grad(set_to_none=True)
    return {name: times[distinct.index(cfg)] for name, cfg in cfgs.items()}


def verdicts(row: dict, tuned: Candidate, defaults: Candidate, sweep: Candidate | None) -> dict:
    """The issue's checks on a row's re-timed steps (``*_ms``). Where the tuned choice *is* the
    defaults or the sweep's choice, the check holds by identity: re-timing one setting in a fresh
    engine spreads by a few per cent (3.5 % measured on the H200), which a ratio of two re-timings
    would report as a difference."""
    out = {"tuned_is_defaults": tuned == defaults, "tuned_vs_defaults": row["tuned_ms"] / row["defaults_ms"]}
    out["not_slower_than_defaults"] = out["tuned_is_defaults"] or out["tuned_vs_defaults"] <= 1.0
    if sweep is not None:
        out["tuned_is_sweep_choice"] = tuned == sweep
        out["tuned_vs_sweep_best"] = row["tuned_ms"] / row["sweep_best_ms"]
        out["within_2pct"] = out["tuned_is_sweep_choice"] or out["tuned_vs_sweep_best"] <= 1.02
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m fxoverlap.bench tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help="peer (the Megatron peer's shape) and/or bench hf --real's names (qwen3_moe, "
                   "deepseek_v3, ...); default: peer,qwen3_moe,deepseek_v3 (peer with --tiny)")
    p.add_argument("--gbps", default="45,100,300", help="emulated link speeds, GB/s")
    p.add_argument("--budget", type=float, default=60.0, help="tune's budget_s")
    p.add_argument("--microbatches", type=int, help="default: 8 (peer), 4 (HF)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3, help="timed steps per candidate and per re-timed row")
    p.add_argument("--no-sweep", action="store_true", help="skip the exhaustive sweep")
    p.add_argument("--tiny", action="store_true", help="MoEConfig.tiny (the peer model only), for smoke runs")
    p.add_argument("--quick", action="store_true", help="a small space (chunks 1/2, carve-out 0/24): smoke runs")
    p.add_argument("--space", default="",
                   help="the knobs searched, as 'field=v1,v2;field=v1' over tune.Space's fields (e.g. "
                        "'chunks=1,2;sm_carveout=0,24'); the fields not named keep Space()'s values")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    a = p.parse_args()
    if a.models is None:
        a.models = "peer" if a.tiny else "peer,qwen3_moe,deepseek_v3"
    elif a.tiny and set(a.models.split(",")) - {"peer", ""}:
        p.error("--tiny builds the peer model only (MoEConfig.tiny); drop --tiny or use --models peer")
    os.makedirs(a.out, exist_ok=True)
    fxoverlap.enable_dynamic_output_shapes()
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    timer = CudaEventTimer(device) if device.type == "cuda" else WallTimer()  # CPU: smoke only, host clock
    space = Space(chunks=(1, 2), chunks_in_merged_steps=(False,), sm_carveout=(0, 24), comm_stream_priority=(-1,)) \
        if a.quick else Space()
    if a.space:
        space = parse_space(a.space, space)
    cfg = fxoverlap.OverlapConfig(progress=False)
    path = os.path.join(a.out, "tune.jsonl")
    for name in [m for m in a.models.split(",") if m]:
        model, mbs, loss_fn, ep, experts, group = build(name, device, a.tiny, a.microbatches)
        for gbps in [float(x) for x in a.gbps.split(",") if x]:
            group.link = el.Link(gbps, ep=ep, experts=experts, name=f"{gbps:g}GB/s")
            row = {"model": name, "gbps": gbps, "ep": ep, "emulated": True, "microbatches": len(mbs),
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "torch": torch.__version__, "budget_s": a.budget, "timer": type(timer).__name__}
            kw = dict(config=cfg, timer=timer, space=space, cache=False, iters=a.iters, warmup=a.warmup)
            sweep = None
            if not a.no_sweep:
                t0 = time.perf_counter()
                sweep = tune_with_report(model, group, mbs, loss_fn, **kw, exhaustive=True)
                row["sweep_s"] = round(time.perf_counter() - t0, 1)
                row["sweep_table"] = sweep.table
            tuned = tune_with_report(model, group, mbs, loss_fn, budget_s=a.budget, **kw)
            row.update(tune_s=round(tuned.seconds, 1), choice=tuned.choice.fields(), tuned_table=tuned.table,
                       stage_ms_table=tuned.stage_ms,
                       predicted_ms_by_microbatches=tuned.microbatch_prediction,
                       timed_programs=sum(1 for r in tuned.table if r["status"].startswith("timed")))
            configs = {"defaults": cfg, "tuned": tuned.config}
            if sweep is not None:
                configs["sweep_best"] = sweep.config
                row["sweep_choice"] = sweep.choice.fields()
            for what, readings in time_configs(model, group, mbs, loss_fn, configs, timer, a.warmup,
                                               a.iters).items():
                row[f"{what}_ms"], row[f"{what}_ms_all"] = statistics.median(readings), readings
            defaults = Candidate(**{k: tuned.table[0][k] for k in tuned.choice.fields()})  # tune's first row
            row.update(verdicts(row, tuned.choice, defaults, None if sweep is None else sweep.choice))
            row["cost_within_budget"] = tuned.seconds <= a.budget
            with open(path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
            print("TUNE", json.dumps({k: v for k, v in row.items() if not k.endswith("_table")}, default=str),
                  flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
