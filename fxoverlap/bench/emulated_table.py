"""The emulated-EP table from the bench's JSON files (one per mode and configuration).

    python -m fxoverlap.bench table DIR [--out FILE.md]

Reads every ``DIR/*.json`` that ``python -m fxoverlap.bench --emulate-ep N`` wrote
(the ``emulated`` and ``rows`` subcommands run one process per mode) and prints one row per
(EP, link, routing, microbatches, mode): T_step, T_compute (the same mode with no link),
T_comm (what the emulated link held per step), hidden share =
(T_compute + T_comm - T_step) / min(T_compute, T_comm), the speed-up over
``torch.compile(model)`` of the same configuration (forward-only modes: over the forward
of ``torch.compile(model)``), and peak memory. Every figure is from an emulated link.
"""

from __future__ import annotations

import argparse
import glob
import json
import os


def _f(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def rows(folder: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        e = r.get("emulation")
        if not e:
            continue
        link = e.get("link") or {}
        cfg = r.get("config", {})
        key = (e["ep"], link.get("name", "none"), link.get("skew", 1.0), cfg.get("routing"),
               r["run"]["microbatches"], r["run"]["overlap_config"].get("dispatcher"))
        chunks = r["run"]["overlap_config"].get("chunks")
        for mode, m in r["modes"].items():
            if mode not in ("eager", "compile", "fwd_eager", "fwd_compile"):  # OverlapConfig(chunks=) applies
                mode = f"{mode} chunks={'default' if chunks is None else chunks}"
            out.append({"key": key, "mode": mode, "m": m, "file": os.path.basename(path),
                        "fold": e.get("expert_fold"), "local": e.get("local_experts")})
    return out


def table(folder: str) -> str:
    rs = rows(folder)
    base = {(r["key"], r["mode"]): r["m"] for r in rs}
    lines = [
        "All figures below come from an **emulated** interconnect (fxoverlap/kernels/emulated_link.py): one EP-N "
        "rank's work on one GPU, every dispatch/combine holding its stream for latency + bytes x (N-1)/N x skew "
        "/ bandwidth.",
        "",
        "| EP (emulated) | link (emulated) | routing | microbatches | local experts | mode | T_step ms | "
        "T_compute ms | T_comm ms (emulated) | hidden share | vs compile | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rs, key=lambda r: (r["key"][1] != "nvlink", r["key"][0], str(r["key"][3]), -r["key"][4],
                                        r["mode"])):
        ep, link, skew, routing, mbs, _ = r["key"]
        m = r["m"]
        ref = base.get((r["key"], "fwd_compile" if r["mode"].startswith("fwd_") else "compile"))
        t_step = m.get("T_step_ms", m.get("step_ms"))
        speed = ref.get("T_step_ms", ref.get("step_ms")) / t_step if ref and t_step else None
        link_txt = link + (f" skew {skew:g}" if skew and skew != 1.0 else "")
        fold = f"{r['local']}" + (f" (fold {r['fold']})" if r["fold"] and r["fold"] > 1 else "")
        lines.append(
            f"| {ep} | {link_txt} | {routing} | {mbs} | {fold} | {r['mode']} | {_f(t_step)} | "
            f"{_f(m.get('T_compute_ms'))} | {_f(m.get('T_comm_ms'))} | {_f(m.get('hidden_share'), '.2f')} | "
            f"{_f(speed, '.3f')}{'×' if speed else ''} | {_f(m.get('peak_mem_gib'), '.2f')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--out")
    a = p.parse_args()
    text = table(a.folder)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
