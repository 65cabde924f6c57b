"""The benchmark's arithmetic: T_serial, T_bound, overlap efficiency and timeline statistics.

Pure functions of a program's stage calls and measured times (no process group, no
device), so each is unit-tested on hand-made numbers (``tests/test_bench.py``). The
definitions are in docs/benchmarks.md, "What is measured".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch.fx

from fxoverlap.ir.program import stage_calls
from fxoverlap.ir.stage import COMM_KINDS, StageKind, StreamKind

COMP, COMM = StreamKind.COMP.value, StreamKind.COMM.value
_COMM_KIND_NAMES = frozenset(k.value for k in COMM_KINDS)

Interval = tuple[float, float]


@dataclasses.dataclass(frozen=True)
class ProgramCall:
    """One stage call of a program: its node name, stage, microbatch, stream and slot."""

    name: str
    stage: str
    microbatch: int
    stream: str
    slot: tuple | None


def program_calls(program: torch.fx.GraphModule) -> list[ProgramCall]:
    """The stage calls of ``program`` in the order the runtime makes them."""
    return [ProgramCall(n.name, st.stage, st.microbatch, st.stream.value, st.slot) for n, st in stage_calls(program)]


def serial_and_bound(calls: Sequence[ProgramCall], times: dict[str, float]) -> dict[str, float]:
    """T_serial (all stage times added) and T_bound (per slot the larger stream's sum,
    plus everything outside slots), in the unit of ``times``, with their parts."""
    slots: dict[tuple, dict[str, float]] = {}
    outside = 0.0
    total = {COMP: 0.0, COMM: 0.0}
    for c in calls:
        t, stream = times[c.name], COMM if c.stream == COMM else COMP
        total[stream] += t
        if c.slot is None:
            outside += t
        else:
            slots.setdefault(tuple(c.slot), {COMP: 0.0, COMM: 0.0})[stream] += t
    return {
        "T_serial": total[COMP] + total[COMM],
        "T_bound": outside + sum(max(v[COMP], v[COMM]) for v in slots.values()),
        "comp": total[COMP],
        "comm": total[COMM],
        "outside_slots": outside,
        "in_slots_comp": sum(v[COMP] for v in slots.values()),
        "in_slots_comm": sum(v[COMM] for v in slots.values()),
        "hideable": sum(min(v[COMP], v[COMM]) for v in slots.values()),
        "slots": len(slots),
    }


def combine_rank_times(calls: Sequence[ProgramCall], per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """One lockstep time per stage: slowest rank for compute (the others wait for it at the
    next all-to-all), fastest rank for comm (on the others it includes that wait)."""
    return {
        c.name: (min if c.stream == COMM else max)(r[c.name] for r in per_rank) for c in calls
    }


def overlap_efficiency(t_serial: float, t_bound: float, t_fx: float) -> float | None:
    """(T_serial - T_fx) / (T_serial - T_bound); None when nothing can be hidden."""
    denom = t_serial - t_bound
    return None if denom <= 0 else (t_serial - t_fx) / denom


def merge_intervals(intervals: Sequence[Interval]) -> list[Interval]:
    """``intervals`` as a sorted list of disjoint intervals covering the same time."""
    out: list[Interval] = []
    for s, e in sorted(intervals):
        if out and s < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def intersection_length(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Total length of the intersection of two sorted lists of disjoint intervals."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            tot += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def timeline_stats(timelines: Sequence[Sequence[dict]], stage_ms: dict[str, float]) -> dict[str, Any]:
    """From one probed step: per rank, how busy each stream was and how much of the comm
    stream's time ran while the compute stream was busy; per (direction, kind) on rank 0,
    the time of the stages inside the interleaved step against their time alone
    (``stage_ms``), which shows what running side by side costs each of them."""
    ranks = []
    for tl in timelines:
        comp = merge_intervals([(e["start"], e["end"]) for e in tl if e["stream"] != COMM])
        comm = merge_intervals([(e["start"], e["end"]) for e in tl if e["stream"] == COMM])
        comp_busy, comm_busy = sum(e - s for s, e in comp), sum(e - s for s, e in comm)
        ov = intersection_length(comp, comm)
        ranks.append({
            "step_ms": max((e["end"] for e in tl), default=0.0),
            "comp_busy_ms": comp_busy,
            "comm_busy_ms": comm_busy,
            "comm_overlapped_ms": ov,
            "comm_overlapped_frac": ov / comm_busy if comm_busy else None,
        })
    kinds: dict[str, dict[str, float]] = {}
    for e in timelines[0] if timelines else []:
        key = f"{e['name'][0]} {e['kind']}"
        k = kinds.setdefault(key, {"in_step_ms": 0.0, "alone_ms": 0.0, "calls": 0})
        k["in_step_ms"] += e["end"] - e["start"]
        k["alone_ms"] += stage_ms.get(e["name"], 0.0)
        k["calls"] += 1
    return {"per_rank": ranks, "by_kind_rank0": kinds}


def stream_sums(by_kind: dict[str, dict]) -> tuple[dict[str, float], dict[str, float]]:
    """Per stream, the stages' time inside the probed step and alone, from
    ``timeline_stats(...)["by_kind_rank0"]`` (keys ``"<F|B> <kind>"``)."""
    inside, alone = {COMP: 0.0, COMM: 0.0}, {COMP: 0.0, COMM: 0.0}
    for key, v in by_kind.items():
        stream = COMM if key.split()[1] in _COMM_KIND_NAMES else COMP
        inside[stream] += v["in_step_ms"]
        alone[stream] += v["alone_ms"]
    return inside, alone
