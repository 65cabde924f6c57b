"""The search: the defaults' program timed and profiled, the other programs ranked by the step
model and timed in that order until ``budget_s`` is spent, the fastest chosen where it beats the
defaults by more than noise (:func:`choose`; :func:`search`, its answer a :class:`TuneResult`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from collections.abc import Sequence

import torch
import torch.fx

from fxoverlap.config import OverlapConfig
from fxoverlap.ir.stage import StreamKind
from fxoverlap.tune.candidates import Candidate, program_groups
from fxoverlap.tune.errors import TuneWarning
from fxoverlap.tune.session import Session, set_runtime_knobs
from fxoverlap.tune.step_model import StageProfile, predict_ms, stream_busy_ms
from fxoverlap.tune.timers import step_readings

#: Peak memory above this share of the device's memory: the headroom warning.
HEADROOM_SHARE = 0.9
#: Microbatch counts the report predicts the chosen setting's step for.
REPORT_MICROBATCHES = (4, 8, 16)
#: A candidate replaces the defaults only when its measured step is at least this share faster.
#: Below it, differences were run-to-run noise on the H200 (bench tune, seventeenth session:
#: settings within 0.1 % of the defaults; the same program re-timed 3.5 % apart), and the
#: defaults are the setting measured most.
KEEP_DEFAULTS_MARGIN = 0.01
#: A candidate's timed steps spread more than this (max - min over the median): the warning that
#: the comparison is less sure than the margin assumes. (From run to run, Qwen3's defaults at
#: 300 GB/s measured 68-92 ms on an H100, eighteenth session; the spread within one timing is
#: what a single tune can see of that.)
NOISY_SPREAD = 0.10


@dataclasses.dataclass
class TuneResult:
    """:func:`tune_with_report`'s answer: the config, the candidate it is, where it came from
    (``"timed"``, ``"cache"``, ``"defaults"``: skipped), the table of what was tried (one row per
    candidate: its fields, ``predicted_ms``, ``measured_ms`` (slowest rank's median), ``spread``
    ((max - min) / median of its timed steps, the widest rank's; None from a timer that gives only
    a median), ``status``),
    the predicted step of the choice at other microbatch counts, the seconds spent, and the
    defaults' stage times the step model used (ms per call by stage name; empty without a
    stage profile): with them the step model replays any program of the same stages offline."""

    config: OverlapConfig
    choice: Candidate | None
    source: str
    table: list[dict] = dataclasses.field(default_factory=list)
    microbatch_prediction: dict[int, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    cache_path: str | None = None
    stage_ms: dict[str, float] = dataclasses.field(default_factory=dict)

    def format_table(self) -> str:
        rows = [("candidate", "predicted ms", "measured ms", "spread", "status")]
        for r in self.table:
            p, m, sp = r.get("predicted_ms"), r.get("measured_ms"), r.get("spread")
            rows.append((r["label"], "-" if p is None else f"{p:.2f}", "-" if m is None else f"{m:.2f}",
                         "-" if sp is None else f"{sp:.1%}", r["status"]))
        widths = [max(len(x[i]) for x in rows) for i in range(5)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def search(s: Session, candidates: list[Candidate], budget_s: float, iters: int, warmup: int,
           exhaustive: bool, t_start: float) -> TuneResult:
    """Time the program groups of ``candidates`` on ``s`` (the defaults' first, the others in the step
    model's order while ``budget_s`` lasts from ``t_start``; ``exhaustive``: all) and choose the fastest."""
    groups = program_groups(candidates)
    rows = {c: {"label": c.label(), **c.fields(), "predicted_ms": None, "measured_ms": None, "spread": None,
                "status": "not timed"} for c in candidates}
    # 1. the defaults' program (the first group): timed always, and its stages profiled once
    measured: dict[Candidate, float] = {}
    t0 = time.perf_counter()
    engine = s.engine(groups[0][0].config(s.base))
    _time_group(s, engine, groups[0], warmup, iters, measured, rows)
    group_cost = s.ranks.max([time.perf_counter() - t0])[0]  # compile + steps of one program
    profile = s.profile(engine, s.timer)
    # 2. the step model ranks the other programs (the first rank's order, so every rank agrees)
    order = list(range(1, len(groups)))
    if profile is not None:
        s.seed_structure(groups[0][0], engine)
        base_stages, base_program = s.structure(groups[0][0])
        prof = StageProfile(profile, list(base_stages))
        _warn_link(prof, base_program)
        predicted = {}
        for i, g in enumerate(groups):
            stages, program = s.structure(g[0])
            predicted[i] = predict_ms(program, stages, prof)
            for c in g:
                rows[c]["predicted_ms"] = predicted[i]
        order.sort(key=lambda i: (predicted[i], i))
        order = s.ranks.first(order)
    # 3. time the programs in that order while the budget lasts (the slowest rank's clock)
    for i in order:
        spent = s.ranks.max([time.perf_counter() - t_start])[0]
        if not exhaustive and spent + group_cost > budget_s:
            for c in (c for j in order[order.index(i):] for c in groups[j]):
                rows[c]["status"] = "skipped (budget)"
            break
        t0 = time.perf_counter()
        try:
            engine = s.engine(groups[i][0].config(s.base))
            _time_group(s, engine, groups[i], warmup, iters, measured, rows)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            warnings.warn(TuneWarning(f"fxoverlap.tune: {groups[i][0].label()} ran out of device memory; left out"))
            for c in groups[i]:
                rows[c]["status"] = "out of memory"
        group_cost = max(group_cost, time.perf_counter() - t0)
    best = choose(measured, candidates)
    rows[best]["status"] += ", chosen"
    _warn_noise([rows[c] for c in dict.fromkeys((candidates[0], best)) if c in measured], iters)
    result = TuneResult(best.config(s.base), best, "timed", [rows[c] for c in candidates], stage_ms=profile or {})
    if profile is not None and not s.forward_only:
        for n in REPORT_MICROBATCHES:
            stages, program = s.structure(best, n)
            result.microbatch_prediction[n] = predict_ms(program, stages, prof)
    return result


def choose(measured: dict[Candidate, float], candidates: Sequence[Candidate],
           margin: float = KEEP_DEFAULTS_MARGIN) -> Candidate:
    """The fastest measured candidate, unless it beats the defaults (``candidates[0]``) by less
    than ``margin`` of the defaults' step: then the defaults. Ties go to the earlier candidate."""
    best = min(measured, key=lambda c: (measured[c], candidates.index(c)))
    default = candidates[0]
    if default in measured and measured[best] > (1.0 - margin) * measured[default]:
        return default
    return best


def _time_group(s: Session, engine, group: list[Candidate], warmup: int, iters: int,
                measured: dict[Candidate, float], rows: dict) -> None:
    """Compile ``group``'s program (the warm-up steps) and time each of its runtime variants
    on it; every rank's times reduced with MAX."""
    step = s.step(engine)
    runner = _compiled_runner(s, engine)  # compiles the program the step runs
    set_runtime_knobs(runner, group[0], s.device)
    cuda = s.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(s.device)
    for _ in range(max(warmup, 1)):
        step()
    mine, spreads, single = [], [], []
    for c in group:
        set_runtime_knobs(runner, c, s.device)
        readings = step_readings(s.timer, c, step, iters)
        median = statistics.median(readings)
        mine.append(median)
        spreads.append((max(readings) - min(readings)) / median if median > 0 else 0.0)
        single.append(len(readings) == 1)  # a median alone: no spread to tell
    times, spreads = s.ranks.max(mine), s.ranks.max(spreads)
    for c, t, sp, one in zip(group, times, spreads, single):
        measured[c] = t
        rows[c]["measured_ms"] = t
        rows[c]["spread"] = None if one else sp
        rows[c]["status"] = "timed"
    if cuda:
        peak = torch.cuda.max_memory_allocated(s.device)
        total = torch.cuda.get_device_properties(s.device).total_memory
        if peak > HEADROOM_SHARE * total:
            warnings.warn(TuneWarning(
                f"fxoverlap.tune: {group[0].label()} peaked at {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
                f"(over {HEADROOM_SHARE:.0%}): little headroom for the optimizer or a longer sequence"))


def _compiled_runner(s: Session, engine):
    """The runner the engine's step uses (its program compiled on first use)."""
    return s.runner(engine)[0].runner


def _warn_noise(rows: list[dict], iters: int) -> None:
    """One warning for the defaults and the choice whose timed steps spread past NOISY_SPREAD."""
    noisy = [r for r in rows if r["spread"] is not None and r["spread"] > NOISY_SPREAD]
    if noisy:
        which = "; ".join(f"{r['label']}: {r['spread']:.0%} around {r['measured_ms']:.1f} ms" for r in noisy)
        warnings.warn(TuneWarning(
            f"fxoverlap.tune: the timed steps spread more than {NOISY_SPREAD:.0%} ({which}), more than the "
            f"{KEEP_DEFAULTS_MARGIN:.0%} a candidate must win by, so the choice is less sure: time more steps "
            f"(iters={max(2 * iters, 5)}), keep other work off the GPU, or look for a host-paced step (many kernel "
            f"launches or host syncs in a torch.profiler trace)"))


def _warn_link(profile: StageProfile, program: torch.fx.GraphModule) -> None:
    busy = stream_busy_ms(program, {st.name: profile.estimate(st, profile.stages) for st in profile.stages})
    comp, comm = busy[StreamKind.COMP.value], busy[StreamKind.COMM.value]
    if comm > comp > 0:
        warnings.warn(TuneWarning(
            f"fxoverlap.tune: the link is slower than the compute can hide: the exchanges take {comm:.1f} ms a "
            f"step and the compute {comp:.1f} ms, so at least {comm - comp:.1f} ms of exchange stay exposed "
            f"whatever the settings (more microbatches or a faster link hide more)"))
