"""The benchmark's text summary of one run's results (printed by rank 0)."""

from __future__ import annotations

import math
from typing import Any

from fxoverlap.bench.metrics import COMM, COMP, stream_sums


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def summary(r: dict[str, Any]) -> str:
    """The table of modes, T_serial / T_bound / T_fx, the probed step and the numerics."""
    lines = ["", "mode        step ms   tokens/s   peak GiB   vs eager   vs compile   first step s"]
    sp = r.get("speedups", {})
    for mode, m in r["modes"].items():
        lines.append(f"{mode:<10} {_fmt(m['step_ms']):>8} {_fmt(m['tokens_per_s'], '.0f'):>10} "
                     f"{_fmt(m['peak_mem_gib'], '.2f'):>10} {_fmt(sp.get('eager', {}).get(mode), '.3f'):>9} "
                     f"{_fmt(sp.get('compile', {}).get(mode), '.3f'):>11} {_fmt(m.get('first_step_s'), '.1f'):>13}")
    if "emulation" in r:
        lines += emulated_lines(r)
    if "T_serial_ms" in r:
        st = r["stage_timing"]
        lines.append(
            f"T_serial {_fmt(r['T_serial_ms'])} ms (comp {_fmt(st['comp'])}, comm {_fmt(st['comm'])}, "
            f"outside slots {_fmt(st['outside_slots'])}), T_bound {_fmt(r['T_bound_ms'])} ms, "
            f"T_fx {_fmt(r['T_fx_ms'])} ms, overlap efficiency {_fmt(r['overlap_efficiency'], '.3f')}")
    if "timeline_stats" in r and r["timeline_stats"]["per_rank"]:
        t = r["timeline_stats"]["per_rank"][0]
        inside, alone = stream_sums(r["timeline_stats"]["by_kind_rank0"])
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



def emulated_lines(r: dict[str, Any]) -> list[str]:
    """The emulated-link rows: per mode T_step, T_compute (no link), T_comm, hidden share, vs compile, peak."""
    e = r["emulation"]
    link = e.get("link")
    if link is None:
        return [f"emulated EP-{e['ep']} rank ({e['local_experts']} local experts, fold {e['expert_fold']}): "
                f"no link (compute only)"]
    head = (f"emulated EP-{e['ep']} rank over an emulated {link['name']} link ({link['gbps']:g} GB/s, "
            f"{link['latency_us']:g} us, skew {link['skew']:g}); {e['local_experts']} local experts, "
            f"fold {e['expert_fold']}")
    lines = [head, "mode (emulated)  T_step ms  T_compute ms  T_comm ms  hidden   vs compile   peak GiB"]
    sp = r.get("speedups", {})
    for mode, m in r["modes"].items():
        if not m.get("emulated"):
            continue
        base = "fwd_compile" if mode.startswith("fwd_") else "compile"
        lines.append(f"{mode:<16} {_fmt(m['T_step_ms']):>9} {_fmt(m['T_compute_ms']):>13} {_fmt(m['T_comm_ms']):>10} "
                     f"{_fmt(m['hidden_share'], '.2f'):>7} {_fmt(sp.get(base, {}).get(mode), '.3f'):>12} "
                     f"{_fmt(m['peak_mem_gib'], '.2f'):>10}")
    return lines
