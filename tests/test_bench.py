"""The benchmark (``python -m fxoverlap.bench``): its T_serial / T_bound arithmetic
(``fxoverlap.bench.metrics``), and a CPU smoke run of the real command under torchrun on
2 gloo ranks for a tiny shape, every mode, tabulated by the ``summary`` subcommand; the subcommands'
plumbing (``python -m fxoverlap.bench SUBCOMMAND``: dispatch, ``--help``, the one-process-per-row runner)."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys

import pytest

from fxoverlap.bench import MODES, commands, parse_args, parse_overlap_config, routing_fields
from fxoverlap.bench.metrics import (
    ProgramCall,
    call_record,
    call_regions,
    calls_from_records,
    combine_rank_times,
    exchange_hold_ms,
    loss_breakdown,
    program_calls,
    simulate_streams,
    slot_sums,
    overlap_efficiency,
    serial_and_bound,
    stream_sums,
    timeline_stats,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict[str, str]:
    # a child running -m fxoverlap.bench finds this checkout, one thread (2 shared CPU cores)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))


def _calls():
    # embed + attn outside slots; one merged step with two slots; head outside.
    return [
        ProgramCall("F0_embed", "fwd_model_embed", 0, "comp", None),
        ProgramCall("F0_dispatch", "fwd_l0_dispatch", 0, "comm", None),
        ProgramCall("F1_attn", "fwd_l0_attn", 1, "comp", (1, 0, 1)),
        ProgramCall("B0_post", "bwd_l0_post", 0, "comp", (1, 0, 1)),
        ProgramCall("B0_combine", "bwd_l0_combine", 0, "comm", (1, 0, 1)),
        ProgramCall("B0_experts", "bwd_l0_experts", 0, "comp", (1, 0, 2)),
        ProgramCall("F1_dispatch", "fwd_l0_dispatch", 1, "comm", (1, 0, 2)),
        ProgramCall("F1_head", "fwd_model_head", 1, "comp", None),
    ]


def test_serial_and_bound():
    times = {"F0_embed": 1.0, "F0_dispatch": 2.0, "F1_attn": 3.0, "B0_post": 1.0, "B0_combine": 5.0,
             "B0_experts": 4.0, "F1_dispatch": 1.5, "F1_head": 0.5}
    r = serial_and_bound(_calls(), times)
    assert r["T_serial"] == pytest.approx(18.0)
    # outside: 1 + 2 + 0.5; slot 1: max(3 + 1, 5); slot 2: max(4, 1.5)
    assert r["T_bound"] == pytest.approx(3.5 + 5.0 + 4.0)
    assert r["comm"] == pytest.approx(8.5) and r["comp"] == pytest.approx(9.5)
    assert r["hideable"] == pytest.approx(4.0 + 1.5) and r["slots"] == 2
    assert r["T_serial"] - r["T_bound"] == pytest.approx(r["hideable"])
    assert overlap_efficiency(18.0, 12.5, 18.0) == 0.0
    assert overlap_efficiency(18.0, 12.5, 12.5) == 1.0
    assert overlap_efficiency(10.0, 10.0, 9.0) is None


def test_combine_rank_times_takes_slowest_compute_and_fastest_comm():
    calls = _calls()[:2]
    got = combine_rank_times(calls, [{"F0_embed": 1.0, "F0_dispatch": 7.0}, {"F0_embed": 3.0, "F0_dispatch": 2.0}])
    assert got == {"F0_embed": 3.0, "F0_dispatch": 2.0}


def test_timeline_stats():
    tl = [
        {"name": "F1_l0_attn", "stage": "fwd_l0_attn", "kind": "attn", "stream": "comp", "start": 0.0, "end": 4.0},
        {"name": "B0_l0_combine", "stage": "bwd_l0_combine", "kind": "combine", "stream": "comm", "start": 1.0, "end": 6.0},
        {"name": "B0_l0_experts", "stage": "bwd_l0_experts", "kind": "experts", "stream": "comp", "start": 5.0, "end": 8.0},
    ]
    st = timeline_stats([tl], {"F1_l0_attn": 3.0, "B0_l0_combine": 4.0, "B0_l0_experts": 3.0})
    r = st["per_rank"][0]
    assert (r["step_ms"], r["comp_busy_ms"], r["comm_busy_ms"]) == (8.0, 7.0, 5.0)
    assert r["comm_overlapped_ms"] == pytest.approx(4.0)  # [1, 4] and [5, 6]
    assert st["by_kind_rank0"]["B combine"] == {"in_step_ms": 5.0, "alone_ms": 4.0, "calls": 1}
    inside, alone = stream_sums(st["by_kind_rank0"])
    assert (inside, alone) == ({"comp": 7.0, "comm": 5.0}, {"comp": 6.0, "comm": 4.0})


def _chain():
    # F(0)'s attn and dispatch, one slot (B experts after the dispatch | a combine), a drain stage
    return [
        ProgramCall("A", "fwd_l0_attn", 0, "comp", None),
        ProgramCall("D", "fwd_l0_dispatch", 0, "comm", None, ("A",)),
        ProgramCall("X", "fwd_l0_experts", 0, "comp", (1, 0, 1), ("D",)),
        ProgramCall("C", "bwd_l0_combine", 0, "comm", (1, 0, 1), ("A",)),
        ProgramCall("Y", "fwd_l0_post", 0, "comp", None, ("C",)),
    ]


def test_exchange_hold_ms_is_the_emulated_links():
    from fxoverlap.kernels.emulated_link import Link

    nbytes = 32768 * 4096 * 2  # the peer's shape: seq 4096 x top-8 rows of 4096 bf16
    assert exchange_hold_ms(nbytes, 100.0, 8) == pytest.approx(0.02 + nbytes * 7 / 8 / 1e11 * 1e3)
    assert exchange_hold_ms(nbytes, 100.0, 8) == pytest.approx(2.36881, abs=1e-5)
    assert exchange_hold_ms(nbytes, 45.0, 16, 10.0, 1.3) == pytest.approx(Link(45.0, 10.0, 16, 1.3).seconds(nbytes) * 1e3)


def test_simulate_streams_in_order_with_deps():
    calls = _chain()
    times = {"A": 1.0, "D": 2.0, "X": 3.0, "C": 2.0, "Y": 1.0}
    sim = simulate_streams(calls, times)
    # A 0-1; D 1-3; X waits for D: 3-6; C waits for the comm stream: 3-5; Y after X: 6-7
    assert sim["start"] == {"A": 0.0, "D": 1.0, "X": 3.0, "C": 3.0, "Y": 6.0}
    assert sim["step"] == 7.0
    assert sim["idle"] == {"comp": {"X": 2.0}, "comm": {"D": 1.0}}
    assert sim["tail"] == {"comp": 0.0, "comm": 2.0}
    with pytest.raises(ValueError, match="not called before"):
        simulate_streams(list(reversed(calls)), times)


def test_regions_and_slot_sums():
    assert call_regions(_chain()) == {"A": "fill", "D": "fill", "X": "slot 1", "C": "slot 1", "Y": "drain"}
    calls = [
        ProgramCall("X1", "s", 1, "comp", (1, 0, 1)), ProgramCall("C1", "s", 0, "comm", (1, 0, 1)),
        ProgramCall("H", "s", 1, "comp", None),
        ProgramCall("X2", "s", 2, "comp", (2, 0, 1)), ProgramCall("C2", "s", 1, "comm", (2, 0, 1)),
    ]
    assert call_regions(calls)["H"] == "merged, outside slots"
    got = slot_sums(calls, {"X1": 3.0, "C1": 2.0, "H": 9.0, "X2": 1.0, "C2": 4.0})
    assert got == {(0, 1): {"comp": 4.0, "comm": 6.0, "bound": 7.0, "steps": 2}}


def test_loss_breakdown_compute_busier():
    times = {"A": 1.0, "D": 0.0, "X": 3.0, "C": 0.0, "Y": 1.0}
    br = loss_breakdown(_chain(), times, {"D": 2.0, "C": 2.0})
    # no link: 5 ms; with it X waits 2 ms for D's hold: 7 ms
    assert (br["T_compute"], br["T_step"], br["T_comm"]) == (5.0, 7.0, 4.0)
    assert br["hidden_share"] == pytest.approx((5 + 4 - 7) / 4)
    assert br["busy_stream"] == "comp"
    assert {k: v for k, v in br["lost_ms"].items() if v} == {"slot 1": 2.0}
    assert sum(br["lost_share"].values()) == pytest.approx(1 - br["hidden_share"])
    assert br["holds_outside_slots"] == 2.0
    assert br["slot_imbalance"] == 0.0  # one slot: max(3, 2) - max(3, 2)


def test_loss_breakdown_comm_busier_counts_its_waits_and_copies():
    calls = [c for c in _chain() if c.name in ("A", "D")] + [ProgramCall("Y", "p", 0, "comp", None, ("D",))]
    br = loss_breakdown(calls, {"A": 1.0, "D": 0.5, "Y": 1.0}, {"D": 5.0})
    # no link: 2.5 ms; with it: D 1-6.5, Y 6.5-7.5; the comm stream waits 1 before D and 1 after it
    assert (br["T_compute"], br["T_step"], br["T_comm"], br["busy_stream"]) == (2.5, 7.5, 5.0, "comm")
    assert br["lost_ms"] == {"fill": 1.0, "tail": 1.0, "comm copies": 0.5}
    assert br["hidden_share"] == pytest.approx(0.0)
    assert sum(br["lost_share"].values()) == pytest.approx(1.0)


def test_program_calls_deps_and_records():
    import torch.fx

    from fxoverlap.ir.meta import STEP_KEY
    from fxoverlap.ir.program import Step
    from fxoverlap.ir.stage import StreamKind

    g = torch.fx.Graph()
    for name, mb, stream, reads, writes, slot in (
        ("F0_attn", 0, StreamKind.COMP, ("x",), ("h",), None),
        ("F1_attn", 1, StreamKind.COMP, ("x",), ("h",), (1, 0, 1)),
        ("F0_dispatch", 0, StreamKind.COMM, ("h", "x"), ("r",), None),
        ("F1_dispatch", 1, StreamKind.COMM, ("h",), ("r",), (1, 0, 2)),
    ):
        n = g.call_function(print, ())
        n.name = name
        n.meta[STEP_KEY] = Step(mb, stream, reads, writes, "stage_" + name.split("_", 1)[1], slot)
    calls = program_calls(type("P", (), {"graph": g})())
    assert [c.deps for c in calls] == [(), (), ("F0_attn",), ("F1_attn",)]  # same microbatch only; x is an input
    assert calls_from_records([call_record(c) for c in calls]) == calls


def test_stage_timer_records_what_the_link_held():
    import torch

    from fxoverlap.bench.probe import StageTimer
    from fxoverlap.kernels import emulated_link

    link = emulated_link.Link(100.0, ep=8)
    group = emulated_link.EmulatedGroup(link)
    timer = StageTimer(False, torch.device("cpu"), group.stats)
    node = type("N", (), {"name": "F0_l0_dispatch"})()
    with emulated_link.standin(emulated_link.Counter()):
        timer(node, None, lambda: group.exchanged("dispatch", 10**9, torch.device("cpu")))
        timer(type("N", (), {"name": "F0_l0_experts"})(), None, lambda: None)
    assert timer.holds == {"F0_l0_dispatch": pytest.approx(link.seconds(10**9) * 1e3)}
    assert set(timer.times) == {"F0_l0_dispatch", "F0_l0_experts"}


@pytest.mark.slow  # a benchmark run on CPU (the slow step runs it)
def test_slot_balance_script_on_a_stored_run(tmp_path):
    """The slot-balance subcommand on the stored H200 stage timing (4 microbatches, no link): the program
    rebuilt on CPU matches the JSON's nodes, and the lost share adds up."""
    out = tmp_path / "sb.json"
    src = os.path.join(ROOT, "docs", "gpu_runs_2026-12-01", "chunks", "stage_timing_chunks1.json")
    proc = subprocess.run([sys.executable, "-m", "fxoverlap.bench", "slot-balance", src,
                           "--link-gbps", "100", "--ep", "8", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    o = json.loads(out.read_text())
    br = o["breakdown"]
    assert o["microbatches"] == 4 and "rebuilt on CPU" in o["calls_from"]
    # 4 microbatches x 4 layers x 4 exchanges of 32768 rows x 4096 bf16 at 100 GB/s (EP 8, 20 us)
    assert br["T_comm"] == pytest.approx(64 * 2.36881, rel=1e-4)
    assert 0.3 < br["hidden_share"] < 0.9
    assert sum(br["lost_share"].values()) == pytest.approx(1 - br["hidden_share"])
    assert set(o["slots"]) == {f"{j},{k}" for j in range(4) for k in range(1, 5)}
    assert "emulated, predicted" in proc.stdout and "| all | 4 | F combine | B attn |" in proc.stdout


def test_args():
    a = parse_args([])
    assert (a.seq, a.microbatches, a.micro_batch_size) == (4096, 8, 1)
    a = parse_args(["--tiny", "--overlap-config", "comm_stream_priority=0,delay_wgrad=1"])
    assert a.seq == 32 and a.overlap.comm_stream_priority == 0 and a.overlap.delay_wgrad is True
    with pytest.raises(ValueError, match="not FIELD=VALUE"):
        parse_overlap_config("no_such_field=1")
    assert parse_args([]).modes == list(MODES) == ["eager", "compile", "backend", "fxoverlap"]
    a = parse_args(["--modes", "eager,fxoverlap", "--no-stage-timing"])
    assert a.modes == ["eager", "fxoverlap"] and a.no_stage_timing
    with pytest.raises(SystemExit):
        parse_args(["--modes", "eager,nope"])
    assert routing_fields("dedup") == dict(routing="dropless", token_dedup=True)


# `slow`: torchrun starts 3 fresh interpreters and the compile mode runs Inductor. By default the
# bench's CPU run is tested in one process (test_emulated_link.py's test_bench_cpu_emulated_smoke)
# and its rows (test_rows_cpu_one_process_per_row).
@pytest.mark.slow
def test_bench_cpu_two_ranks(tmp_path, capsys):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fxoverlap.bench", "--tiny", "--device", "cpu", "--warmup", "1", "--iters", "2",
           "--stage-reps", "1", "--out", str(out), "--name", "smoke"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "[bench] fxoverlap iter 2/2" in proc.stdout
    r = json.loads((out / "smoke.json").read_text())

    ts, tb, tfx = r["T_serial_ms"], r["T_bound_ms"], r["T_fx_ms"]
    assert all(math.isfinite(x) and x > 0 for x in (ts, tb, tfx))
    assert ts >= tb > 0
    st = r["stage_timing"]
    assert st["slots"] > 0 and st["comm"] > 0 and st["comp"] > 0
    # every call with its slot and what it reads, for the slot-balance subcommand
    assert [c["name"] for c in st["calls"]] == list(st["stage_ms"])
    assert any(c["slot"] for c in st["calls"]) and any(c["deps"] for c in st["calls"]) and "hold_ms" not in st
    assert r["overlap_efficiency"] is not None and math.isfinite(r["overlap_efficiency"])
    assert list(r["modes"]) == list(MODES)  # every mode by default
    for mode in MODES:
        m = r["modes"][mode]
        assert m["step_ms"] > 0 and m["tokens_per_s"] > 0 and len(m["step_ms_per_rank"]) == 2
    # speed-ups of every mode against eager and against torch.compile(model)
    for base in ("eager", "compile"):
        sp = r["speedups"][base]
        assert sp[base] == 1.0
        for mode in MODES:
            assert sp[mode] == pytest.approx(r["modes"][base]["step_ms"] / r["modes"][mode]["step_ms"])
    assert r["speedup_vs_eager"] == r["speedups"]["eager"]["fxoverlap"]
    assert r["run"]["tokens_per_step_global"] == 2 * 3 * 2 * 32

    # Same weights and data in both modes: the losses (and, fp32 on CPU, the grads) agree.
    e, f = r["modes"]["eager"]["losses_per_rank"], r["modes"]["fxoverlap"]["losses_per_rank"]
    assert len(e) == 2 and all(len(x) == 3 for x in e)
    for le, lf in zip(e, f):
        assert lf == pytest.approx(le, rel=1e-6, abs=1e-6)
    n = r["numerics"]
    assert n["grad_max_abs_diff"] <= 1e-6 * n["grad_max_abs_eager"] and not n["grads_missing"]
    for mode in ("compile", "backend"):  # Inductor's fused kernels: close, not bitwise
        assert n[mode]["grad_max_abs_diff"] <= 1e-5 * n[mode]["grad_max_abs_eager"] and not n[mode]["grads_missing"]
    assert n["eager_rerun_grads_bitwise"] is True  # CPU kernels are deterministic
    ranks = r["timeline_stats"]["per_rank"]
    assert len(ranks) == 2 and all(x["comm_busy_ms"] > 0 and x["comp_busy_ms"] > 0 for x in ranks)

    # One timeline row per stage call, on both ranks; the trace names the stages.
    assert len(r["timeline"]) == 2 and len(r["timeline"][0]) == len(st["stage_ms"])
    with gzip.open(out / "smoke_trace.json.gz", "rt") as fh:
        trace = json.load(fh)
    assert any(e.get("name", "").startswith("fxoverlap.stage ") for e in trace["traceEvents"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipping the timeline PNG" in proc.stdout
    else:
        assert (out / "smoke_timeline.png").stat().st_size > 0

    # the summary subcommand tabulates the run: one row per mode, with both speed-ups
    capsys.readouterr()
    assert commands.main(["summary", str(out)]) == 0
    table = capsys.readouterr().out
    for mode in MODES:
        row = next(line for line in table.splitlines() if line.startswith(f"| smoke | {mode} |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[5] == f"{r['speedups']['eager'][mode]:.3f}×" and cells[6] == f"{r['speedups']['compile'][mode]:.3f}×"


@pytest.mark.slow
def test_pp_bench_cpu_two_ranks(tmp_path):
    """The PP x EP mode (the pp subcommand, fxoverlap.bench.pp) on 2 gloo ranks: PP 2 x EP 1, DualPipeV."""
    out = tmp_path / "pp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fxoverlap.bench", "pp", "--pp", "2", "--schedule", "ScheduleDualPipeV", "--tiny", "--device", "cpu",
           "--microbatches", "4", "--modes", "eager,fxoverlap", "--warmup", "1", "--iters", "1", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "PP 2 x EP 1 (2 ranks), ScheduleDualPipeV" in proc.stdout
    r = json.loads((out / "pp_bench.json").read_text())
    assert (r["pp"], r["ep"], r["world"]) == (2, 1, 2) and list(r["modes"]) == ["eager", "fxoverlap"]
    for mode in ("eager", "fxoverlap"):
        assert r["modes"][mode]["step_ms"] > 0 and r["modes"][mode]["tokens_per_s"] > 0
    fx = r["modes"]["fxoverlap"]["ranks"]
    # the same weights and data: the first step's losses agree with eager's (rank 0 holds the last stage)
    assert fx[0]["first_losses"] and len(fx[0]["first_losses"]) == 4
    assert fx[0]["max_loss_diff_vs_eager"] <= 1e-6
    assert all(len(x["fxoverlap_stages"]) == 2 and x["overlap_f_b_steps"] > 0 for x in fx)
    assert all(x["merged_steps"] == x["overlap_f_b_steps"] for x in fx)


# ---------------------------------------------------------------- the subcommands' plumbing (CPU)


def test_subcommand_dispatch_keeps_the_benchmark_the_default(capsys):
    assert commands.split([]) == ("run", [])
    assert commands.split(["--tiny", "--device", "cpu"]) == ("run", ["--tiny", "--device", "cpu"])
    assert commands.split(["rows", "--budget", "1"]) == ("rows", ["--budget", "1"])
    assert commands.split(["run", "--tiny"]) == ("run", ["--tiny"])
    with pytest.raises(SystemExit, match="unknown subcommand 'nope'"):
        commands.main(["nope"])
    commands.main(["--help"])
    out = capsys.readouterr().out
    assert all(f"    {name}" in out for name in commands.COMMANDS) and "the subcommand is 'run'" in out


def test_every_subcommand_has_help_and_imports_without_side_effects(capsys):
    """``python -m fxoverlap.bench NAME --help`` for every subcommand, in this process: each module
    imports on CPU (no CUDA, no tests/support import, no transformers) and leaves Dynamo's config as it was."""
    import torch._dynamo

    before = torch._dynamo.config.capture_dynamic_output_shape_ops
    for name, c in commands.COMMANDS.items():
        with pytest.raises(SystemExit) as e:
            commands.main([name, "--help"])
        assert e.value.code == 0, name
        out = capsys.readouterr().out
        assert out.startswith(f"usage: python -m fxoverlap.bench {'[run]' if name == 'run' else name}"), (name, out[:200])
    assert torch._dynamo.config.capture_dynamic_output_shape_ops == before
    assert {"rows", "hf", "checks", "dp", "summary", "slots"} <= set(commands.COMMANDS)


def test_runner_time_limit_budget_and_env(tmp_path):
    from fxoverlap.bench.rows import Runner, Step

    lines = []
    r = Runner(str(tmp_path), "t", budget_s=100, est_s=30, timeout_s=1, echo=lines.append)
    code = "import os, sys; print('got', os.environ['FXO_X'], 'PATH' in os.environ); sys.exit(3)"
    assert r.run(Step("env", [sys.executable, "-c", code], {"FXO_X": "7"}, timeout_s=60)) == 3
    assert (tmp_path / "env.log").read_text().strip() == "got 7 True"
    # over its time limit: the process group is ended, status 124 as timeout(1)
    assert r.run(Step("slow", [sys.executable, "-c", "import time; time.sleep(60)"])) == 124
    assert r.failed == ["env(rc=3)", "slow(rc=124)"]
    r.t0 -= 71  # 71 s used + 30 expected > 100: skipped, not started
    assert r.run(Step("late", [sys.executable, "-c", "raise SystemExit(9)"])) is None
    assert not (tmp_path / "late.log").exists() and "skip late (budget:" in lines[-1]
    log = (tmp_path / "t.log").read_text()
    assert "step env" in log and "FXO_X=7" in log and "failed (rc 124)" in log
    # gpu_bench.sh's budget: a step gets what is left less a reserve, and is skipped under est_s
    c = Runner(str(tmp_path), "c", budget_s=100, est_s=45, timeout_s=200, clip_reserve_s=30, echo=lines.append)
    assert c.limit(Step("a", [])) == pytest.approx(70, abs=2)
    c.t0 -= 30
    assert c.limit(Step("a", [])) is None


def test_rows_and_emulated_dry_run_commands(tmp_path):
    """The rows' commands: what scripts/gpu_rows.sh and gpu_emulated.sh ran, one torchrun rank each."""
    from fxoverlap.bench import rows

    lines = []
    args = ["--out", str(tmp_path), "--no-install", "--dry-run"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rows.Runner, "say", lambda self, msg: lines.append(msg))
        assert rows.rows_main(["--rows", "a|fxoverlap|8|chunks=2||TORCH_BLAS_PREFER_CUBLASLT=1;b|compile|4||--emulate-ep 2 --link nvlink|",
                               *args]) == 0
        steps = [x for x in lines if x.startswith("step ")]
        assert len(steps) == 2
        assert steps[0].startswith("step a (timeout 150s): TORCH_BLAS_PREFER_CUBLASLT=1 ")
        assert ("-m torch.distributed.run --standalone --nproc-per-node 1 -m fxoverlap.bench run --out "
                f"{tmp_path} --name a --emulate-ep 8 --link-gbps 100 --routing dropless --microbatches 8 --modes "
                "fxoverlap --warmup 1 --iters 3 --no-stage-timing --no-grad-check --overlap-config chunks=2") in steps[0]
        assert "--name b --emulate-ep 2 --link nvlink --microbatches 4 --modes compile" in steps[1]
        lines.clear()
        assert rows.emulated_main(["--tiers", "1", "4", *args]) == 0
        steps = [x for x in lines if x.startswith("step ")]
        assert steps[0].startswith("step emucheck") and " -m fxoverlap.bench link --out " in steps[0]
        assert len(steps) == 1 + 14 + 14
        c2 = next(x for x in steps if x.startswith("step ep8_gbps100_dropless_mb8_fwd_backend_c2 "))
        assert "--link-gbps 100 --skew 1.0 --routing dropless --microbatches 8 --modes fwd_backend" in c2
        assert c2.endswith("--overlap-config chunks=2")
    with pytest.raises(SystemExit, match="is not name"):
        rows.parse_rows(["only|two"])
    assert [r.name for r in rows.parse_rows(["a|m|8\n\n b | m | 4 | x=1 | --f | E=1"])] == ["a", "b"]


@pytest.mark.slow  # a benchmark run on CPU (the slow step runs it)
def test_rows_cpu_one_process_per_row(tmp_path):
    """A real row on CPU (tiny shape, emulated EP 2) in its own process, its table excerpt in the log,
    and the emulated table of the folder."""
    out = tmp_path / "rows"
    row = "cpu|fxoverlap|2|chunks=1|--tiny --device cpu --emulate-ep 2 --link nvlink|OMP_NUM_THREADS=1"
    # the runner in this process (python -m fxoverlap.bench rows ...), the row in its own
    assert commands.main(["rows", "--rows", row, "--out", str(out), "--no-install", "--launcher", "python",
                          "--warmup", "0", "--iters", "1", "--budget", "300", "--timeout", "240"]) == 0
    assert (out / "cpu.log").exists(), (out / "gpu_rows.log").read_text()
    r = json.loads((out / "cpu.json").read_text())
    assert r["emulation"]["ep"] == 2 and r["modes"]["fxoverlap"]["T_step_ms"] > 0
    assert r["run"]["overlap_config"]["chunks"] == 1
    log = (out / "gpu_rows.log").read_text()
    assert "row cpu: modes fxoverlap, 2 microbatches" in log and "mode (emulated)" in log and "failed" not in log
    assert "| 2 | nvlink | dropless | 2 |" in (out / "emulated_table.md").read_text()


def test_hf_real_rows_carry_chunks_nolink_and_forward_modes(tmp_path, capsys):
    """``bench hf --real``'s plumbing, no GPU: one process per (model, mode, chunks) with ``--chunks K``
    and ``--nolink`` on its command line (torch.compile's rows once, first), the forward rows' speed-up
    against ``compile_forward``; ``--one`` hands chunks and the link to ``run_real_one``; so does
    ``hf-timeline``."""
    import types

    from fxoverlap.bench import hf_gpu, hf_timeline

    cmds = []

    def fake_run(cmd, stdout, stderr, text, env, timeout):  # a row's process: its RESULT line
        cmds.append(cmd)
        i = cmd.index("--one")
        chunks = int(cmd[cmd.index("--chunks") + 1]) if "--chunks" in cmd else None
        ms = {"compile": 100.0, "compile_forward": 40.0}.get(cmd[i + 2], 50.0)
        row = dict(model=cmd[i + 1], mode=cmd[i + 2], chunks=chunks, step_ms=ms)
        if cmd[i + 2] in ("compile", "backend"):  # bf16 gradients against eager's
            row["grad_rel"] = {None: 0.1, 1: 0.12, 3: 0.2}[chunks]
        return subprocess.CompletedProcess(cmd, 0, stdout="noise\nRESULT " + json.dumps(row) + "\n")

    fake_subprocess = types.SimpleNamespace(run=fake_run, PIPE=subprocess.PIPE, TimeoutExpired=subprocess.TimeoutExpired)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_gpu, "subprocess", fake_subprocess)
        commands.main(["hf", "--real", "--out", str(tmp_path), "--models", "qwen3_moe,deepseek_v3", "--modes",
                       "backend_forward,forward_only,compile_forward,backend", "--chunks", "1,3", "--nolink"])
    assert all(c[:4] == [sys.executable, "-m", "fxoverlap.bench", "hf"] and c[-1] == "--nolink" for c in cmds)
    got = [(c[c.index("--one") + 1], c[c.index("--one") + 2], c[c.index("--chunks") + 1] if "--chunks" in c else None)
           for c in cmds]
    per_model = [("compile_forward", None), *((m, k) for m in ("backend_forward", "forward_only", "backend")
                                              for k in ("1", "3"))]
    assert got == [(n, m, k) for n in ("qwen3_moe", "deepseek_v3") for m, k in per_model]
    rows = [json.loads(ln) for ln in (tmp_path / "hf_gpu_real.jsonl").read_text().splitlines()]
    assert len(rows) == 14 and (tmp_path / "deepseek_v3_backend_c3_nolink.log").exists()
    # forward rows against compile_forward (40 / 50 ms); no compile row, so the training backend has none
    assert [r.get("speedup_vs_compile") for r in rows[:7]] == [None, 0.8, 0.8, 0.8, 0.8, None, None]
    # a training row is judged against torch.compile's own bf16 difference too
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_gpu, "subprocess", fake_subprocess)
        commands.main(["hf", "--real", "--out", str(tmp_path / "t"), "--models", "olmoe", "--modes", "backend,compile",
                       "--chunks", "1,3"])
    rows = [json.loads(ln) for ln in (tmp_path / "t" / "hf_gpu_real.jsonl").read_text().splitlines()]
    assert [(r["mode"], r.get("grad_rel_compile"), r.get("ok_vs_compile")) for r in rows] == [
        ("compile", None, None), ("backend", 0.1, True), ("backend", 0.1, False)]
    assert hf_gpu.row_command("olmoe", "optimize", 3) == [sys.executable, "-m", "fxoverlap.bench", "hf", "--one",
                                                          "olmoe", "optimize", "--iters", "3"]  # as before
    assert hf_gpu.row_command("olmoe", "backend", 3, chunks=1, gbps=45)[-4:] == ["--gbps", "45", "--chunks", "1"]
    assert hf_gpu.row_command("olmoe", "backend", 3, overlap_options=["cuda_graphs=0"])[-2:] == [
        "--overlap-option", "cuda_graphs=0"]
    with pytest.raises(hf_gpu.BenchCommandError, match="torch.compile's own"):
        hf_gpu.run_real_one("qwen3_moe", "compile", 1, overlap_options={"cuda_graphs": False})
    with pytest.raises(SystemExit, match="unknown mode 'fwd'"):
        commands.main(["hf", "--real", "--out", str(tmp_path), "--modes", "fwd"])
    with pytest.raises(hf_gpu.BenchCommandError, match="torch.compile's own"):
        hf_gpu.run_real_one("qwen3_moe", "compile_forward", 1, chunks=2)  # refused before any CUDA work

    class Exited(Exception):
        pass

    def fake_exit(code):
        raise Exited(code)

    seen = []

    def fake_one(name, mode, iters, stage_options=None, **kw):
        seen.append((name, mode, iters, stage_options, kw))
        return dict(model=name, mode=mode, chunks=kw["chunks"], step_ms=1.0)

    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_gpu, "run_real_one", fake_one)
        mp.setattr(os, "_exit", fake_exit)
        with pytest.raises(Exited):  # the row process (what main_real starts)
            commands.main(["hf", "--one", "deepseek_v3", "backend_forward", "--iters", "2", "--chunks", "4", "--nolink"])
        assert seen.pop() == ("deepseek_v3", "backend_forward", 2, None, dict(chunks=4, link=False, gbps=100.0, overlap_options={}))
        assert '"chunks": 4' in capsys.readouterr().out
        with pytest.raises(Exited):  # no flags: the defaults, as before
            commands.main(["hf", "--one", "qwen3_moe", "optimize"])
        assert seen.pop() == ("qwen3_moe", "optimize", 3, None, dict(chunks=None, link=True, gbps=100.0, overlap_options={}))
        with pytest.raises(Exited):  # another link speed
            commands.main(["hf", "--one", "qwen3_moe", "compile", "--gbps", "45"])
        assert seen.pop()[4] == dict(chunks=None, link=True, gbps=45.0, overlap_options={})
        with pytest.raises(Exited):  # OverlapConfig fields for the fxoverlap rows
            commands.main(["hf", "--one", "qwen3_moe", "backend", "--overlap-option", "cuda_graphs=0",
                           "--overlap-option", "sm_carveout=8"])
        assert seen.pop()[4]["overlap_options"] == {"cuda_graphs": False, "sm_carveout": 8}
        with pytest.raises(Exited):  # 1/0 are bools for bool fields only: chunks=1 stays a count
            commands.main(["hf", "--one", "qwen3_moe", "backend", "--overlap-option", "chunks=1",
                           "--overlap-option", "sm_carveout=0", "--overlap-option", "delay_wgrad=1"])
        got = seen.pop()[4]["overlap_options"]
        assert got == {"chunks": 1, "sm_carveout": 0, "delay_wgrad": True}
        assert type(got["chunks"]) is int and type(got["sm_carveout"]) is int
        with pytest.raises(Exited):
            hf_timeline.main(["--model", "qwen3_moe", "--mode", "backend", "--chunks", "3", "--nolink",
                              "--out", str(tmp_path / "tl")])
        name, mode, _, _, kw = seen.pop()
        assert (name, mode, kw["chunks"], kw["link"], callable(kw["timed"])) == ("qwen3_moe", "backend", 3, False, True)
        assert json.loads((tmp_path / "tl" / "rows.jsonl").read_text())["tag"] == "qwen3_moe_backend_c3_nolink"
        with pytest.raises(Exited):
            hf_timeline.main(["--model", "qwen3_moe", "--mode", "compile", "--gbps", "45", "--out", str(tmp_path / "tl45")])
        assert seen.pop()[4]["gbps"] == 45.0
        assert json.loads((tmp_path / "tl45" / "rows.jsonl").read_text())["tag"] == "qwen3_moe_compile_45GBps"
        with pytest.raises(SystemExit):  # chunks are fxoverlap's: not for torch.compile's row
            hf_timeline.main(["--model", "qwen3_moe", "--mode", "compile", "--chunks", "2"])


def test_hf_timeline_charges_device_copies_to_what_issued_them():
    """``hf-timeline --deep``'s attribution on kineto-like events: each device copy's GPU time goes
    to the op and Python frame that issued it (through the launch's correlation id), so a clone
    off graph memory and a copy into a graph's buffer are told apart; a GPU idle gap goes to the
    op that launched the next kernel."""
    import types

    import torch

    from fxoverlap.bench.hf_timeline import attribute_events

    cpu_t, cuda_t = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(kind, name, a, b, corr=0, thread=1):
        return types.SimpleNamespace(device_type=lambda: kind, name=lambda: name, start_ns=lambda: a,
                                     end_ns=lambda: b, duration_ns=lambda: b - a, correlation_id=lambda: corr,
                                     start_thread_id=lambda: thread)

    evs = [ev(cpu_t, "fxoverlap/runtime.py(762): output", 0, 1_000),
           ev(cpu_t, "aten::clone", 100, 200), ev(cpu_t, "cudaMemcpyAsync", 150, 160, corr=7),
           ev(cpu_t, "fxoverlap/cudagraphs.py(218): load", 2_000, 3_000),
           ev(cpu_t, "fxoverlap.copy static-input fwd_l0_post.combine", 2_050, 2_250),  # copy_labels' range
           ev(cpu_t, "aten::copy_", 2_100, 2_200), ev(cpu_t, "cudaMemcpyAsync", 2_150, 2_160, corr=8),
           ev(cpu_t, "aten::mm", 5_000, 5_100), ev(cpu_t, "cudaLaunchKernel", 5_050, 5_060, corr=9),
           ev(cuda_t, "Memcpy DtoD (Device -> Device)", 10_000, 30_000, corr=7),
           ev(cuda_t, "Memcpy DtoD (Device -> Device)", 31_000, 35_000, corr=8),
           ev(cuda_t, "gemm", 100_000, 110_000, corr=9)]
    out = attribute_events(evs)
    copies = {k: (c, ms) for k, c, ms in out["copies"]}
    assert copies == {"aten::clone | fxoverlap/runtime.py(762): output": (1, 0.02),
                      "aten::copy_ [static-input] | fxoverlap/cudagraphs.py(218): load": (1, 0.004)}
    assert out["copies_total_ms"] == 0.024
    assert out["copies_by_value"] == [["static-input fwd_l0_post.combine", 1, 0.004]]  # the clone names nothing
    assert out["gaps"] == [["aten::mm | ", 1, 0.065]]  # 35 us -> 100 us idle before the gemm
