"""The benchmark's arithmetic: T_serial, T_bound, overlap efficiency, timeline statistics, and the
merged steps' balance (an in-order two-stream replay of a program from its stage times).

Pure functions of a program's stage calls and measured times (no process group, no
device), so each is unit-tested on hand-made numbers (``tests/test_bench.py``). The
definitions are in docs/benchmarks.md, "What is measured".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch.fx

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.program import stage_calls
from fxoverlap.ir.stage import COMM_KINDS, StageKind, StreamKind

COMP, COMM = StreamKind.COMP.value, StreamKind.COMM.value
_COMM_KIND_NAMES = frozenset(k.value for k in COMM_KINDS)

Interval = tuple[float, float]


class ReplayError(FxOverlapError, ValueError):
    """:func:`simulate_streams` was given a call before a call it reads."""


@dataclasses.dataclass(frozen=True)
class ProgramCall:
    """One stage call of a program: its node name, stage, microbatch, stream and slot, and
    ``deps``: the earlier stage calls whose outputs it reads (its microbatch's)."""

    name: str
    stage: str
    microbatch: int
    stream: str
    slot: tuple | None
    deps: tuple[str, ...] = ()


def program_calls(program: torch.fx.GraphModule) -> list[ProgramCall]:
    """The stage calls of ``program`` in the order the runtime makes them."""
    producer: dict[tuple[int, str], str] = {}
    out = []
    for n, st in stage_calls(program):
        deps = dict.fromkeys(producer[(st.microbatch, v)] for v in st.reads if (st.microbatch, v) in producer)
        out.append(ProgramCall(n.name, st.stage, st.microbatch, st.stream.value, st.slot, tuple(deps)))
        for v in st.writes:
            producer[(st.microbatch, v)] = n.name
    return out


def call_record(c: ProgramCall) -> dict[str, Any]:
    """``c`` as the bench's JSON stores it (``stage_timing["calls"]``)."""
    return {"name": c.name, "stage": c.stage, "mb": c.microbatch, "stream": c.stream,
            "slot": list(c.slot) if c.slot is not None else None, "deps": list(c.deps)}


def calls_from_records(rows: Sequence[dict[str, Any]]) -> list[ProgramCall]:
    """The inverse of :func:`call_record`."""
    return [ProgramCall(r["name"], r["stage"], r["mb"], r["stream"], tuple(r["slot"]) if r["slot"] else None,
                        tuple(r["deps"])) for r in rows]


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


# ---------------------------------------------------------------- the merged steps' balance
#
# What an emulated link adds to a program, and where the step loses it: a replay of the
# program's stage calls on two in-order streams (compute, comm), each call starting when its
# stream is free and the calls it reads have ended (the events ``streams`` adds), from the
# stage times measured alone. It leaves out the host (launch time, host reads) and the
# slow-down of compute beside a comm kernel (contention): what a measured step loses beyond
# the replay is theirs.


def exchange_hold_ms(nbytes: float, gbps: float, ep: int, latency_us: float = 20.0, skew: float = 1.0) -> float:
    """What the emulated link (``kernels/emulated_link.py``) holds an all-to-all of ``nbytes``
    (all rows one rank moves) for, in ms: latency + bytes x (N-1)/N x skew / bandwidth."""
    return latency_us * 1e-3 + nbytes * (ep - 1) / ep * skew / (gbps * 1e9) * 1e3


def simulate_streams(calls: Sequence[ProgramCall], times: dict[str, float]) -> dict[str, Any]:
    """Replay ``calls`` in order on two in-order streams: each starts at max(its stream free,
    the end of its ``deps``). Returns ``start``/``end`` per call, ``step`` (the last end) and
    ``idle`` per stream: the time it waited before each call ({call: ms}) and ``tail`` (from
    its last call to the step's end)."""
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    free = {COMP: 0.0, COMM: 0.0}
    idle: dict[str, dict[str, float]] = {COMP: {}, COMM: {}}
    for c in calls:
        s = COMM if c.stream == COMM else COMP
        if missing := [d for d in c.deps if d not in end]:
            raise ReplayError(f"simulate_streams: {c.name} reads {missing}, not called before it")
        t0 = max([free[s], *(end[d] for d in c.deps)])
        if t0 > free[s]:
            idle[s][c.name] = t0 - free[s]
        start[c.name], end[c.name] = t0, t0 + times[c.name]
        free[s] = end[c.name]
    step = max(free.values())
    return {"start": start, "end": end, "step": step, "idle": idle,
            "tail": {s: step - free[s] for s in free}}


def call_regions(calls: Sequence[ProgramCall]) -> dict[str, str]:
    """Where each call sits: ``"fill"`` (before the first merged-step slot: F(0)), ``"drain"``
    (after the last: B(N-1)), ``"merged, outside slots"`` (heads, embeddings between them) or
    ``"slot k"``. A program without slots is all ``"fill"``."""
    slotted = [i for i, c in enumerate(calls) if c.slot is not None]
    first, last = (slotted[0], slotted[-1]) if slotted else (len(calls), len(calls))
    out = {}
    for i, c in enumerate(calls):
        if c.slot is not None:
            out[c.name] = f"slot {c.slot[2]}"
        else:
            out[c.name] = "fill" if i < first else "drain" if i > last else "merged, outside slots"
    return out


def slot_sums(calls: Sequence[ProgramCall], times: dict[str, float]) -> dict[tuple[int, int], dict[str, float]]:
    """Per (layer pair, slot), summed over the merged steps: compute and comm stage time, the
    larger of the two per step summed (``bound``: what a step could take if each slot ended
    before the next began), and how many merged steps."""
    per_step: dict[tuple, dict[str, float]] = {}
    for c in calls:
        if c.slot is None:
            continue
        v = per_step.setdefault(tuple(c.slot), {COMP: 0.0, COMM: 0.0})
        v[COMM if c.stream == COMM else COMP] += times[c.name]
    out: dict[tuple[int, int], dict[str, float]] = {}
    for (_, pair, k), v in sorted(per_step.items()):
        o = out.setdefault((pair, k), {COMP: 0.0, COMM: 0.0, "bound": 0.0, "steps": 0})
        o[COMP] += v[COMP]
        o[COMM] += v[COMM]
        o["bound"] += max(v[COMP], v[COMM])
        o["steps"] += 1
    return out


def loss_breakdown(calls: Sequence[ProgramCall], times: dict[str, float], holds: dict[str, float]) -> dict[str, Any]:
    """Where a step loses the link's time, from stage times measured without the link
    (``times``) and the link's hold per comm call (``holds``; calls not named hold nothing).

    Replays the program without and with the holds: T_compute and T_step (predicted);
    T_comm = the holds' sum; the hidden share as the bench defines it. The lost share,
    1 - hidden = (T_step - max(T_compute, T_comm)) / min(T_compute, T_comm), is split exactly
    by where it arises (``lost_ms``, keys: :func:`call_regions`' regions and ``"tail"``):
    with T_compute >= T_comm, T_step - T_compute = what the compute stream waits more with
    the link than without, before the calls of each region (and after its last call); else
    T_step - T_comm = what the comm stream waits with the link, plus ``"comm copies"`` (the
    comm stages' own time without the link). Beside it, the slot arithmetic (T_bound's):
    the holds outside the slots, and the slots' imbalance: the sum over slots of
    max(compute, comm) less max(sum of compute, sum of comm) over the slots' calls."""
    linked = {n: t + holds.get(n, 0.0) for n, t in times.items()}
    base, link = simulate_streams(calls, times), simulate_streams(calls, linked)
    t_comp, t_step = base["step"], link["step"]
    t_comm = sum(holds.get(c.name, 0.0) for c in calls)
    regions = call_regions(calls)
    lost: dict[str, float] = {}
    busy = COMP if t_comp >= t_comm else COMM
    runs = ((link, 1.0), (base, -1.0)) if busy == COMP else ((link, 1.0),)
    for run, sign in runs:
        for name, ms in run["idle"][busy].items():
            lost[regions[name]] = lost.get(regions[name], 0.0) + sign * ms
        lost["tail"] = lost.get("tail", 0.0) + sign * run["tail"][busy]
    if busy == COMM:
        lost["comm copies"] = sum(times[c.name] for c in calls if c.stream == COMM)
    small = min(t_comp, t_comm)
    in_slots = [c for c in calls if c.slot is not None]
    slot_comp = sum(linked[c.name] for c in in_slots if c.stream != COMM)
    slot_comm = sum(linked[c.name] for c in in_slots if c.stream == COMM)
    bound = sum(v["bound"] for v in slot_sums(calls, linked).values())
    return {
        "T_compute": t_comp, "T_step": t_step, "T_comm": t_comm,
        "hidden_share": None if small <= 0 else (t_comp + t_comm - t_step) / small,
        "busy_stream": busy,
        "lost_ms": lost,
        "lost_share": {k: (v / small if small > 0 else None) for k, v in lost.items()},
        "holds_outside_slots": sum(holds.get(c.name, 0.0) for c in calls if c.slot is None),
        "slot_imbalance": bound - max(slot_comp, slot_comm),
        "slot_comp": slot_comp, "slot_comm": slot_comm,
    }
