"""Where the merged steps F(i+1) x B(i) lose the link's time: per slot, comm against compute,
and the step's lost share split by where it arises (issue 24, item 3).

    python -m fxoverlap.bench slot-balance BENCH_JSON [--microbatches N] [--link-gbps 100 --ep 8]
        [--overlap-config delay_wgrad=1] [--wgrad-share experts=0.5,attn=0.35]
        [--measured-json LINKED_JSON] [--json-out OUT.json]

BENCH_JSON is a bench run with stage timing (``stage_timing.stage_ms``: every program node's
time, alone). Its program's calls (slot, stream, what each reads) come from the JSON
(``stage_timing.calls``, stored by the bench since 2026-12-02) or, for older JSONs, with another
microbatch count or with ``--overlap-config`` changes, from the same program rebuilt on CPU at a
tiny shape with the JSON's layers, experts and OverlapConfig (compiler eager): the program
depends on the stage graph's structure, not on its shape. Each call then takes the median time
of its stage over the measured microbatches.

The link: when the JSON was timed with an emulated link, the comm stages' times hold it and the
JSON says what each call held (``stage_timing.hold_ms``); otherwise every dispatch/combine call
is given the hold the emulated link would ask for, 20 us + bytes x (N-1)/N / bandwidth, bytes =
seq x micro-batch x top-k rows x dim x dtype size (a chunk's: / chunks): "emulated, predicted".

The replay (``fxoverlap.bench.metrics.loss_breakdown``) runs the calls on two in-order streams
from these times, without and with the holds; it leaves out the host and the slow-down of
compute beside a comm kernel, so what a measured step (``--measured-json``, or the JSON itself
when it ran with a link) loses beyond it is "runtime/contention".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
from typing import Any

from fxoverlap.bench.metrics import (
    COMM,
    calls_from_records,
    exchange_hold_ms,
    loss_breakdown,
    slot_sums,
)

SLOT_WHAT = {1: "B combine | F attn", 2: "F dispatch | B experts", 3: "B dispatch | F experts",
             4: "F combine | B attn"}
REGION_ORDER = ("fill", "slot 1", "slot 2", "slot 3", "slot 4", "merged, outside slots", "drain", "tail",
                "comm copies")
_CHUNK = re.compile(r"_c(\d+)(_wgrad)?$")


def key(name: str) -> str:
    """A call's stage, direction kept, microbatch dropped: ``F3_l0_attn`` -> ``F_l0_attn``."""
    return re.sub(r"^([FB])\d+_", r"\1_", name)


def rebuild_calls(r: dict[str, Any], microbatches: int, overrides: dict[str, Any]):
    """The program of ``r``'s run, rebuilt on CPU at a tiny shape (same layers, experts, routing,
    OverlapConfig; compiler eager), for ``microbatches``, with ``overrides`` applied."""
    import torch  # noqa: F401

    import fxoverlap
    from fxoverlap.bench.metrics import program_calls
    from fxoverlap.config import OverlapConfig
    from fxoverlap.models.moe import MoEConfig, MoETransformer
    from fxoverlap.testing import token_batches

    c = r["config"]
    keep = ("n_layers", "layer_pattern", "n_experts", "top_k", "expert_fold", "router", "routing",
            "capacity_factor", "token_dedup", "mhc_rate", "mtp", "activation_checkpoint")
    shape = {k: (tuple(c[k]) if isinstance(c.get(k), list) else c[k]) for k in keep if k in c}
    if c.get("shared_expert_dim"):
        shape["shared_expert_dim"] = 32
    cfg = MoEConfig.tiny(**shape)
    oc = {k: (tuple(v) if isinstance(v, list) else v) for k, v in r["run"]["overlap_config"].items()}
    device = str(r.get("meta", {}).get("device", "cuda"))
    # the run's chunks as resolved on its device (None means 1 on CPU)
    oc["chunks"] = OverlapConfig(chunks=oc.get("chunks")).resolved_chunks("cuda" if "cuda" in device else "cpu")
    oc.update(compiler="eager", cuda_graphs=False, progress=False, compile_options=None)
    oc.update(overrides)
    fields = {f.name for f in dataclasses.fields(OverlapConfig)}
    oc = {k: v for k, v in oc.items() if k in fields}
    model = MoETransformer(cfg, None)
    engine = fxoverlap.optimize(model, None, config=OverlapConfig(**oc))
    try:
        plan = engine.plan(token_batches(cfg.vocab_size, microbatches, (1, 16), seed=0, device="cpu"))
        return program_calls(plan.program)
    finally:
        engine.close()


def parse_pairs(text: str | None) -> dict[str, str]:
    out = {}
    for item in filter(None, (text or "").split(",")):
        k, _, v = item.partition("=")
        out[k.strip()] = v.strip()
    return out


def analyse(r: dict[str, Any], args: argparse.Namespace, measured: dict[str, Any] | None) -> dict[str, Any]:
    st = r["stage_timing"]
    stage_ms: dict[str, float] = st["stage_ms"]
    run = r["run"]
    emu = r.get("emulation") or {}
    link = emu.get("link")
    mbs = args.microbatches or run["microbatches"]
    overrides = {}
    if args.overlap_config:
        from fxoverlap.bench.cli import parse_overlap_config

        given = parse_overlap_config(args.overlap_config)
        overrides = {f: getattr(given, f) for f in parse_pairs(args.overlap_config)}
    if "calls" in st and mbs == run["microbatches"] and not overrides:
        calls, source = calls_from_records(st["calls"]), "the JSON's program"
    else:
        calls, source = rebuild_calls(r, mbs, overrides), "the program rebuilt on CPU (tiny shape, same structure)"

    # stage times without the link, and the holds
    measured_holds = st.get("hold_ms") or {}
    cfg = r["config"]
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[run["dtype"]]
    exchange_bytes = run["seq"] * run["micro_batch_size"] * cfg["top_k"] * cfg["dim"] * itemsize
    gbps = args.link_gbps or (link or {}).get("gbps") or 100.0
    ep = args.ep or (link or {}).get("ep") or emu.get("ep") or run.get("ep") or 8
    latency = args.latency_us if args.latency_us is not None else (link or {}).get("latency_us", 20.0)
    skew = args.skew or (link or {}).get("skew", 1.0)
    if cfg.get("token_dedup"):
        raise SystemExit("slot_balance: token-once routing's bytes are not modelled here")
    chunks_of: dict[str, int] = {}
    for c in calls:
        m = _CHUNK.search(c.stage)
        if m and c.stream == COMM:
            base = _CHUNK.sub("", c.stage)
            chunks_of[base] = max(chunks_of.get(base, 1), int(m.group(1)) + 1)

    def analytic_hold(c) -> float:
        m = _CHUNK.search(c.stage)
        k = chunks_of.get(_CHUNK.sub("", c.stage), 1) if m else 1
        return exchange_hold_ms(exchange_bytes / k, gbps, ep, latency, skew)

    if link and not measured_holds:  # an older linked JSON: the holds are inside, take the analytic ones out
        measured_holds = {c.name: analytic_hold(c) for c in calls if c.stream == COMM and c.name in stage_ms}
    by_key: dict[str, list[float]] = {}
    hold_key: dict[str, list[float]] = {}
    for name, ms in stage_ms.items():
        by_key.setdefault(key(name), []).append(ms - measured_holds.get(name, 0.0))
        if name in measured_holds:
            hold_key.setdefault(key(name), []).append(measured_holds[name])
    base_ms = {k: statistics.median(v) for k, v in by_key.items()}
    wshare = {k: float(v) for k, v in parse_pairs(args.wgrad_share).items()}
    names = {key(c.name) for c in calls}
    synthesized = []
    times: dict[str, float] = {}
    for c in calls:
        k = key(c.name)
        if k in base_ms and not (k + "_wgrad" in names and k + "_wgrad" not in base_ms):
            times[c.name] = base_ms[k]
            continue
        # a dgrad/wgrad pair the JSON timed whole: split the whole by --wgrad-share (an assumption)
        whole = k[: -len("_wgrad")] if k.endswith("_wgrad") else k
        kind = next((w for w in wshare if re.search(rf"_{w}(_c\d+)?$", whole)), None)
        if whole not in base_ms or kind is None:
            raise SystemExit(f"slot_balance: no time for {c.name} ({k}); the JSON's program has other stages "
                             f"(a --wgrad-share for its kind splits a whole stage's time)")
        share = wshare[kind]
        times[c.name] = base_ms[whole] * (share if k.endswith("_wgrad") else 1 - share)
        synthesized.append(k)
    emulated_source = ("emulated, measured holds (the stage timing ran with the link)" if st.get("hold_ms") else
                       "emulated, predicted: holds taken out analytically from a linked run" if link else
                       "emulated, predicted: holds added analytically to stage times measured without a link")
    holds = {}
    for c in calls:
        if c.stream == COMM:
            hk = hold_key.get(key(c.name))
            holds[c.name] = statistics.median(hk) if hk and not args.link_gbps else analytic_hold(c)
    br = loss_breakdown(calls, times, holds)
    slots = slot_sums(calls, {n: t + holds.get(n, 0.0) for n, t in times.items()})
    out = {
        "json": args.json, "microbatches": mbs, "calls_from": source, "overrides": overrides,
        "link": {"gbps": gbps, "ep": ep, "latency_us": latency, "skew": skew, "source": emulated_source,
                 "exchange_bytes": exchange_bytes},
        "synthesized_wgrad": sorted(set(synthesized)), "wgrad_share": wshare,
        "slots": {f"{j},{k}": v for (j, k), v in slots.items()},
        "breakdown": br,
        "meta": {k: r.get("meta", {}).get(k) for k in ("date", "commit", "gpu", "torch")},
    }
    if measured:
        fx = measured["modes"]["fxoverlap"]
        out["measured"] = {k: fx.get(k) for k in ("T_step_ms", "T_compute_ms", "T_comm_ms", "hidden_share")}
        out["measured"]["microbatches"] = measured["run"]["microbatches"]
        out["measured"]["json"] = args.measured_json or args.json
    return out


def report(o: dict[str, Any]) -> str:
    br, ln = o["breakdown"], o["link"]
    lines = [
        f"slot_balance: {o['json']} (measured {o['meta'].get('date')}, commit {o['meta'].get('commit')}, "
        f"{o['meta'].get('gpu')})",
        f"  {o['microbatches']} microbatches; calls from {o['calls_from']}"
        + (f"; with {o['overrides']}" if o["overrides"] else ""),
        f"  link: EP {ln['ep']} at {ln['gbps']:g} GB/s, {ln['latency_us']:g} us, skew {ln['skew']:g} "
        f"({ln['source']}; {ln['exchange_bytes'] / 2**20:.0f} MiB per exchange)",
    ]
    if o["synthesized_wgrad"]:
        lines.append(f"  ASSUMED: weight-grad parts not timed in the JSON, split from their whole stage by "
                     f"{o['wgrad_share']}: {', '.join(o['synthesized_wgrad'][:6])}"
                     + (" ..." if len(o["synthesized_wgrad"]) > 6 else ""))
    lines += ["", "Per merged-step slot (ms, summed over the merged steps; comm includes the holds):",
              "| pair | slot | comm \\| compute | comm | compute | max per step | bound by |",
              "|---|---|---|---|---|---|---|"]
    tot: dict[int, list[float]] = {}
    for jk, v in o["slots"].items():
        j, k = map(int, jk.split(","))
        diff = v["comm"] - v["comp"]
        lines.append(f"| {j} | {k} | {SLOT_WHAT.get(k, '')} | {v['comm']:.1f} | {v['comp']:.1f} | {v['bound']:.1f} | "
                     f"{'comm' if diff > 0 else 'compute'} by {abs(diff):.1f} |")
        t = tot.setdefault(k, [0.0, 0.0, 0.0])
        t[0] += v["comm"]
        t[1] += v["comp"]
        t[2] += v["bound"]
    for k, (cm, cp, b) in sorted(tot.items()):
        lines.append(f"| all | {k} | {SLOT_WHAT.get(k, '')} | {cm:.1f} | {cp:.1f} | {b:.1f} | "
                     f"{'comm' if cm > cp else 'compute'} by {abs(cm - cp):.1f} |")
    small = min(br["T_compute"], br["T_comm"])
    lines += [
        "",
        f"Replay ({ln['source'].split(':')[0]}): T_compute {br['T_compute']:.1f} ms, T_comm (holds) {br['T_comm']:.1f} ms, "
        f"T_step {br['T_step']:.1f} ms, hidden share {br['hidden_share']:.3f}",
        f"  lost share {1 - br['hidden_share']:.3f} = (T_step - max) / min, where the {br['busy_stream']} stream waits more:",
    ]
    for reg in sorted(br["lost_ms"], key=lambda x: REGION_ORDER.index(x) if x in REGION_ORDER else 99):
        ms = br["lost_ms"][reg]
        if abs(ms) > 1e-9:
            lines.append(f"    {reg:24s} {ms:8.1f} ms  {ms / small:6.3f}")
    lines += [
        f"  slot arithmetic: holds outside slots (F(0), B(N-1), heads) {br['holds_outside_slots']:.1f} ms "
        f"({br['holds_outside_slots'] / small:.3f}); slot imbalance (sum of per-slot max - max of sums) "
        f"{br['slot_imbalance']:.1f} ms ({br['slot_imbalance'] / small:.3f})",
    ]
    m = o.get("measured")
    if m and m.get("hidden_share") is not None:
        rest = (1 - m["hidden_share"]) - (1 - br["hidden_share"])
        lines.append(f"  measured ({m['json']}, {m['microbatches']} microbatches): T_step {m['T_step_ms']:.1f}, "
                     f"T_compute {m['T_compute_ms']:.1f}, T_comm {m['T_comm_ms']:.1f} ms, hidden share "
                     f"{m['hidden_share']:.3f}; beyond the replay (runtime/contention): {rest:.3f}")
    return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="a bench JSON with stage timing")
    p.add_argument("--microbatches", type=int, help="replay this many microbatches (default: the JSON's)")
    p.add_argument("--link-gbps", type=float, help="emulated bandwidth, GB/s (default: the JSON's link, else 100)")
    p.add_argument("--ep", type=int, help="emulated EP size (default: the JSON's)")
    p.add_argument("--latency-us", type=float, help="latency per all-to-all, us (default 20)")
    p.add_argument("--skew", type=float)
    p.add_argument("--overlap-config", help="OverlapConfig changes for the replayed program (a candidate)")
    p.add_argument("--wgrad-share", help="e.g. experts=0.5,attn=0.35: split whole backward stages' times into "
                                         "dgrad and wgrad parts the JSON did not time (an assumption)")
    p.add_argument("--measured-json", help="a bench JSON with the measured linked step to compare with")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    with open(args.json) as f:
        r = json.load(f)
    if "stage_timing" not in r:
        raise SystemExit(f"slot_balance: {args.json} has no stage_timing (run the bench without --no-stage-timing)")
    measured = None
    if args.measured_json:
        with open(args.measured_json) as f:
            measured = json.load(f)
    elif r.get("modes", {}).get("fxoverlap", {}).get("emulated"):
        measured = r
    o = analyse(r, args, measured)
    print(report(o))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(o, f, indent=1)
    return o


if __name__ == "__main__":
    main()
