"""``fxoverlap.tune`` on CPU: the candidate enumeration, the step model on synthetic stage times,
the cache key and its reuse, rank agreement on 2 gloo ranks (stand-in timers), the refusal
without CUDA, and ``OverlapConfig(autotune=...)``. The GPU measurement is
``python -m fxoverlap.bench tune`` (docs/tune.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings

import pytest
import torch

import fxoverlap
from fxoverlap.config import BACKEND, PIPELINE, ConfigError, field_phase, refused_fields
from fxoverlap.ir.stage import Direction, Part, Stage, StageKind, Tag, stage_name
from fxoverlap.kernels import emulated_link as el
from fxoverlap.testing import eager_steps, run_distributed, take_grads
from fxoverlap.tune import (Call, Candidate, Space, StageProfile, TuneCache, TuneSkipped, cache_key,
                            default_candidate, enumerate_candidates, program_groups, replay, tune_with_report)
from tune_cases import CANDS, TableTimer, ranks_agree, tiny

CUDA_DEFAULTS = fxoverlap.OverlapConfig()


# ---------------------------------------------------------------- enumeration

def test_enumeration_cuda_ep8():
    cands = enumerate_candidates(CUDA_DEFAULTS, microbatches=8, ep_size=8, device_type="cuda", local_experts=4)
    assert cands[0] == default_candidate(CUDA_DEFAULTS, "cuda") == Candidate(
        chunks=2, delay_wgrad=True, expert_wgrad_slot=2, dispatcher="auto", sm_carveout=24)
    assert len(set(cands)) == len(cands)
    assert {c.chunks for c in cands} == {1, 2, 3, 4}
    assert {c.dispatcher for c in cands} == {"auto", "all_to_all", "padded"}
    assert all(c.chunks == 1 and not c.chunks_in_merged_steps for c in cands if c.dispatcher == "padded")
    assert all(c.expert_wgrad_slot == 2 for c in cands if not c.delay_wgrad)  # the slot only with delay_wgrad
    assert not any(c.chunks_in_merged_steps for c in cands if c.chunks == 1)
    assert {c.sm_carveout for c in cands} == {0, 8, 16, 24, 32} and {c.comm_stream_priority for c in cands} == {-1, 0}
    assert not any(c.chunks_in_merged_steps for c in cands)  # Space()'s default leaves it out
    # (whole, per chunk count 2-4, padded) x wgrad settings, times the runtime knobs
    programs = ((1 + 3) * 2 + 1) * 3
    groups = program_groups(cands)
    assert len(groups) == programs and len(cands) == programs * 10
    for g in groups:  # the runtime knobs share one program
        assert len({c.program_part() for c in g}) == 1 and len(g) == 10
        assert {field_phase(k) for k, _ in g[0].runtime_part()} == {"runtime"}
    assert {k for k, _ in cands[0].program_part()} == {"chunks", "chunks_in_merged_steps", "delay_wgrad",
                                                       "expert_wgrad_slot", "dispatcher"}


def test_enumeration_forward_only_cpu_and_limits():
    fwd = enumerate_candidates(CUDA_DEFAULTS, forward_only=True, microbatches=4, ep_size=1, device_type="cuda",
                               comm_kernels=False)
    assert not any(c.delay_wgrad for c in fwd) and {c.dispatcher for c in fwd} == {"auto"}
    assert {c.sm_carveout for c in fwd} == {0}  # no comm kernel beside the experts: the runtime reads none
    assert len(fwd) == (1 + 3) * 2  # chunks x priority
    merged = enumerate_candidates(CUDA_DEFAULTS, space=Space(chunks_in_merged_steps=(False, True)), forward_only=True,
                                  microbatches=4, ep_size=1, device_type="cuda", comm_kernels=False)
    assert len(merged) == (1 + 3 * 2) * 2 and any(c.chunks_in_merged_steps for c in merged)  # when asked for
    cpu = enumerate_candidates(fxoverlap.OverlapConfig(), microbatches=1, ep_size=2, device_type="cpu",
                               local_experts=2)
    assert cpu[0] == Candidate(dispatcher="auto")  # the CPU defaults: chunks 1, no delayed wgrads
    assert {c.chunks for c in cpu} == {1, 2} and not any(c.chunks_in_merged_steps for c in cpu)  # one microbatch
    assert {(c.sm_carveout, c.comm_stream_priority) for c in cpu} == {(0, -1)}
    assert {c.dispatcher for c in cpu} == {"auto", "padded"}
    small = enumerate_candidates(CUDA_DEFAULTS, space=Space(chunks=(1,), delay_wgrad=(False,), sm_carveout=(0,),
                                                            comm_stream_priority=(-1,)), device_type="cuda")
    assert small[0] == default_candidate(CUDA_DEFAULTS, "cuda") and len(small) == 2  # the defaults always in
    assert small[0].config(fxoverlap.OverlapConfig(autotune=True)).autotune is False


# ---------------------------------------------------------------- the step model

def _stage(direction, layer, kind, part=Part.MAIN, chunk=None) -> Stage:
    tag = Tag(Direction(direction), layer, StageKind(kind), part, chunk=chunk)
    return Stage(stage_name(tag), tag, None, [], [])


def test_replay_two_streams():
    calls = [Call("a", "A", "comp"), Call("d", "D", "comm", ("a",)), Call("b", "B", "comp"),
             Call("e", "E", "comp", ("d",))]
    # a 0-10; d 10-15 (waits for a); b 10-13 under d; e 15-19 (waits for d)
    assert replay(calls, {"A": 10, "D": 5, "B": 3, "E": 4}) == 19
    assert replay(calls, {"A": 10, "D": 1, "B": 3, "E": 4}) == 17  # d hidden under b: e starts at 13


def test_stage_profile_derives_chunks_and_wgrad_parts():
    measured = [_stage("fwd", 0, "experts"), _stage("fwd", 0, "dispatch"), _stage("bwd", 0, "experts")]
    prof = StageProfile({"fwd_l0_experts": 8.0, "fwd_l0_dispatch": 4.0, "bwd_l0_experts": 10.0}, measured)
    chunked = [_stage("fwd", 0, "experts", chunk=i) for i in range(2)] + \
              [_stage("bwd", 0, "experts"), _stage("bwd", 0, "experts", Part.WGRAD)]
    assert prof.estimate(chunked[0], chunked) == pytest.approx(8.0 / 2 * 1.05)
    assert prof.estimate(chunked[2], chunked) == pytest.approx(5.0)  # split: WGRAD_SHARE of the whole
    assert prof.estimate(chunked[3], chunked) == pytest.approx(5.0)
    assert prof.estimate(measured[2], measured) == 10.0  # measured: as measured
    assert prof.estimate(_stage("fwd", 3, "attn"), measured) == 0.0  # never measured
    # measured split, asked whole: main + wgrad; chunks measured, asked whole: their sum less the chunk cost
    split = StageProfile({"bwd_l0_experts": 3.0, "bwd_l0_experts_wgrad": 7.0, "fwd_l0_experts_c0": 2.1,
                          "fwd_l0_experts_c1": 2.1}, chunked[2:] + chunked[:2])
    assert split.estimate(_stage("bwd", 1, "experts"), []) == 0.0
    whole_bwd = _stage("bwd", 0, "experts")
    assert split.estimate(dataclasses.replace(whole_bwd, name="x"), [whole_bwd]) == pytest.approx(10.0)
    whole_fwd = dataclasses.replace(_stage("fwd", 0, "experts"), name="y")
    assert split.estimate(whole_fwd, [whole_fwd]) == pytest.approx(4.0)


def test_step_model_ranks_synthetic_programs():
    """Comm-bound: a program whose exchange runs beside the other microbatch's compute beats the
    serial one, and the model says by how much."""
    t = {"F": 4.0, "X": 6.0, "B": 8.0}
    serial = [Call("f0", "F", "comp"), Call("x0", "X", "comm", ("f0",)), Call("b0", "B", "comp", ("x0",)),
              Call("f1", "F", "comp", ("b0",)), Call("x1", "X", "comm", ("f1",)), Call("b1", "B", "comp", ("x1",))]
    overlapped = [Call("f0", "F", "comp"), Call("x0", "X", "comm", ("f0",)), Call("f1", "F", "comp"),
                  Call("x1", "X", "comm", ("f1",)), Call("b0", "B", "comp", ("x0",)), Call("b1", "B", "comp", ("x1",))]
    assert replay(serial, t) == 36.0
    # f0 0-4; x0 4-10 with f1 4-8 under it; x1 10-16 with b0 10-18 under it; b1 18-26
    assert replay(overlapped, t) == 26.0
    ranked = sorted([("serial", serial), ("overlapped", overlapped)], key=lambda p: replay(p[1], t))
    assert [n for n, _ in ranked] == ["overlapped", "serial"]


# ---------------------------------------------------------------- the cache

class _Group:  # a stand-in for a group of `n` ranks (only its size is read)
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def test_cache_key_changes_with_each_part(monkeypatch):
    model, mbs = tiny()
    cpu = torch.device("cpu")
    cands = CANDS
    base = dict(device=cpu, ep_group=None, dp_group=None, base=fxoverlap.OverlapConfig(), forward_only=False,
                candidates=cands)
    ref = cache_key(model, mbs, **base)
    assert cache_key(model, mbs, **base) == ref
    # the knobs tuned, autotune and progress are not in it: a tuned config finds its own entry
    assert cache_key(model, mbs, **{**base, "base": fxoverlap.OverlapConfig(chunks=3, autotune=True,
                                                                            progress=False)}) == ref
    other_model, _ = tiny()
    other_model.extra = torch.nn.Linear(2, 2)  # one more module and parameters
    link100 = el.EmulatedGroup(el.Link(100.0, ep=8))
    changed = {
        "model": cache_key(other_model, mbs, **base),
        "shapes": cache_key(model, [(t[:, :4] for t in mb) for mb in mbs], **base),
        "dtype": cache_key(model, [tuple(t.to(torch.int32) for t in mb) for mb in mbs], **base),
        "count": cache_key(model, mbs[:1], **base),
        "device": cache_key(model, mbs, **{**base, "device": torch.device("meta")}),
        "ep": cache_key(model, mbs, **{**base, "ep_group": _Group(2)}),
        "dp": cache_key(model, mbs, **{**base, "dp_group": _Group(4)}),
        "link": cache_key(model, mbs, **{**base, "ep_group": link100}),
        "link speed": cache_key(model, mbs, **{**base, "ep_group": el.EmulatedGroup(el.Link(45.0, ep=8))}),
        "config": cache_key(model, mbs, **{**base, "base": fxoverlap.OverlapConfig(side_stages=False)}),
        "forward_only": cache_key(model, mbs, **{**base, "forward_only": True}),
        "candidates": cache_key(model, mbs, **{**base, "candidates": cands[:1]}),
    }
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    changed["torch"] = cache_key(model, mbs, **base)
    for part, key in changed.items():
        assert key != ref, part
    assert changed["link"]["link"]["kind"] == "emulated" and changed["link"]["link"]["gbps"] == 100.0


def test_cache_reuse_skips_timing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FXOVERLAP_TUNE_CACHE", str(tmp_path / "c"))
    model, mbs = tiny()
    cfg = fxoverlap.OverlapConfig(progress=False)
    timer = TableTimer(lambda c: {0: 3.0, 8: 2.0}[c.sm_carveout])
    first = tune_with_report(model, None, mbs, config=cfg, timer=timer, candidates=CANDS, iters=1)
    assert first.source == "timed" and timer.calls == 2 and first.choice == CANDS[1]
    assert first.config == dataclasses.replace(cfg, sm_carveout=8, dispatcher="auto", chunks=1, delay_wgrad=False)
    assert [r["measured_ms"] for r in first.table] == [3.0, 2.0] and "chosen" in first.table[1]["status"]
    files = os.listdir(tmp_path / "c")
    assert files == [os.path.basename(first.cache_path)]  # atomic: no temporary file left
    entry = json.loads((tmp_path / "c" / files[0]).read_text())
    assert entry["choice"]["sm_carveout"] == 8 and entry["key"]["device"] == "cpu"
    assert all(p.grad is None for p in model.parameters())  # tuning left p.grad as it found it
    with caplog.at_level(logging.INFO, logger="fxoverlap.tune"):
        again = tune_with_report(model, None, mbs, config=cfg, timer=timer, candidates=CANDS)
    assert again.source == "cache" and again.config == first.config and timer.calls == 2  # no timing
    assert any("using cached entry" in r.getMessage() and files[0] in r.getMessage() for r in caplog.records)
    # another key (another microbatch count) times again; cache=False neither reads nor writes
    tune_with_report(model, None, mbs[:1], config=cfg, timer=timer, candidates=CANDS, iters=1, cache=False)
    assert timer.calls == 4 and len(os.listdir(tmp_path / "c")) == 1
    # a corrupt entry is a miss, not an error
    (tmp_path / "c" / files[0]).write_text("{not json")
    assert TuneCache(str(tmp_path / "c")).load(first_key(model, mbs, cfg)) is None


def first_key(model, mbs, cfg):
    return cache_key(model, mbs, device=torch.device("cpu"), base=dataclasses.replace(cfg, autotune=False),
                     forward_only=False, candidates=CANDS)


# ---------------------------------------------------------------- CPU refusal, autotune

def test_cpu_without_timer_keeps_the_config_with_a_named_warning():
    model, mbs = tiny()
    cfg = fxoverlap.OverlapConfig(chunks=2, progress=False)
    with pytest.warns(TuneSkipped, match="tuning needs CUDA events") as rec:
        got = fxoverlap.tune(model, None, mbs, config=cfg)
    assert got == cfg and len(rec) == 1
    assert issubclass(TuneSkipped, fxoverlap.TuneWarning)


def test_autotune_field():
    assert fxoverlap.OverlapConfig().autotune is False and field_phase("autotune") == "front end"
    with pytest.raises(ConfigError, match="autotune"):
        fxoverlap.OverlapConfig(autotune="yes")
    cfg = fxoverlap.OverlapConfig(autotune=True)
    assert "autotune" in refused_fields(cfg, BACKEND) and "autotune" in refused_fields(cfg, PIPELINE)


def test_autotune_on_cpu_warns_once_and_steps_as_eager():
    model, mbs = tiny()
    ref_model, _ = tiny()
    ref_losses = eager_steps(ref_model, mbs)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(autotune=True, progress=False))
    with pytest.warns(TuneSkipped, match="CUDA events") as rec:
        losses = engine.forward_backward(mbs)
    assert len([w for w in rec if issubclass(w.category, TuneSkipped)]) == 1
    assert engine.config.autotune is False and engine.tune_result.source == "defaults"
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    ref = take_grads(ref_model)
    assert all(torch.equal(p.grad, ref[n]) for n, p in model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuneSkipped)
        engine.forward_backward(mbs)  # tuned once: no second warning


# ---------------------------------------------------------------- ranks

def test_ranks_agree_slowest_rank_decides():
    r0, r1 = run_distributed(ranks_agree)
    for r in (r0, r1):
        assert "different candidate lists" in r["mismatch"] and r["mismatch_timed"] == 0
        assert r["choice"] == 8 and r["measured"] == [10.0, 6.0]  # MAX over the ranks, on both
        assert r["grads_none"]


def test_step_model_on_a_real_program_and_the_budget():
    """The whole flow on CPU with the host clock: the defaults' program timed and its stages
    profiled, the other program predicted from its structure (no compile), then left out by a
    budget of 0 s; the choice is the defaults', with its predicted step at 4/8/16 microbatches."""
    from fxoverlap.tune import WallTimer

    model, mbs = tiny(n=2)
    cfg = fxoverlap.OverlapConfig(progress=False)
    cands = [Candidate(), Candidate(delay_wgrad=True)]
    res = tune_with_report(model, None, mbs, config=cfg, timer=WallTimer(), candidates=cands, budget_s=0.0,
                           cache=False, iters=1)
    assert res.choice == cands[0] and res.config == cands[0].config(cfg)
    assert [r["status"] for r in res.table] == ["timed, chosen", "skipped (budget)"]
    assert all(r["predicted_ms"] > 0 for r in res.table) and res.table[0]["measured_ms"] > 0
    # the stage times it predicted from, by stage name (bench tune records them)
    assert res.stage_ms and all(t >= 0 for t in res.stage_ms.values())
    assert any(n.startswith("fwd_l0_experts") for n in res.stage_ms)
    p = res.microbatch_prediction
    assert sorted(p) == [4, 8, 16] and 0 < p[4] < p[8] < p[16]
    assert all(p.grad is None for p in model.parameters())


def test_bench_tune_tiny_is_the_peer_model_only(monkeypatch, capsys):
    """``bench tune --tiny`` defaults to the peer model (the HF layers have no tiny shape), and
    refuses HF names by name instead of building a released-shape model on the wrong device."""
    import sys

    from fxoverlap.bench import gpu_tune

    monkeypatch.setattr(sys, "argv", ["tune", "--tiny", "--device", "cpu", "--models", "peer,qwen3_moe"])
    with pytest.raises(SystemExit) as e:
        gpu_tune.main()
    assert e.value.code == 2 and "--tiny builds the peer model only" in capsys.readouterr().err


def test_stage_profile_is_a_warm_run():
    """The stage profile comes from a second run of the hooked runner: a first run (where a GPU
    captures the stages' CUDA graphs, 5x slower on an H100) never reaches the step model."""
    from fxoverlap.tune import WallTimer

    class FirstCallSlow:
        def __init__(self):
            self.times, self.seen = {}, set()

        def __call__(self, node, stage, run):
            outs = run()
            self.times[node.name] = 1.0 if node.name in self.seen else 1000.0
            self.seen.add(node.name)
            return outs

    class Timer(WallTimer):
        def stage_hook(self):
            return FirstCallSlow()

    model, mbs = tiny(n=2)
    res = tune_with_report(model, None, mbs, config=fxoverlap.OverlapConfig(progress=False), timer=Timer(),
                           candidates=[Candidate()], cache=False, iters=1)
    assert res.stage_ms and set(res.stage_ms.values()) == {1.0}, res.stage_ms


def test_a_candidate_replaces_the_defaults_only_beyond_noise():
    """The fastest candidate is chosen only where it beats the defaults (the first candidate) by
    at least KEEP_DEFAULTS_MARGIN; within it the defaults stay (the peer's H200 tune picked a
    setting 0.1 % from the defaults). With the defaults untimed, the fastest as before."""
    from fxoverlap.tune.search import KEEP_DEFAULTS_MARGIN, choose

    d, a, b = Candidate(), Candidate(sm_carveout=8), Candidate(chunks=2)
    cands = [d, a, b]
    assert choose({d: 100.0, a: 99.5, b: 99.9}, cands) == d
    assert choose({d: 100.0, a: 100.0 * (1 - 2 * KEEP_DEFAULTS_MARGIN), b: 99.9}, cands) == a
    assert choose({d: 100.0, a: 97.0, b: 97.0}, cands) == a  # a tie: the earlier candidate
    assert choose({a: 5.0, b: 4.0}, cands) == b
    assert choose({d: 100.0, a: 101.0}, cands) == d


def test_bench_tune_verdicts_hold_by_identity_and_compare_otherwise():
    """bench tune's checks: a choice that is the defaults' (or the sweep's) setting passes its
    check however its re-timings differ (the H200's DeepSeek row: one setting re-timed 65.5 and
    67.8 ms); another setting is judged by the re-timed ratio."""
    from fxoverlap.bench.gpu_tune import verdicts

    d, other = Candidate(), Candidate(sm_carveout=8)
    row = {"defaults_ms": 65.47, "tuned_ms": 67.80, "sweep_best_ms": 65.67}
    v = verdicts(row, d, d, d)
    assert v["tuned_is_defaults"] and v["not_slower_than_defaults"] and v["within_2pct"]
    assert round(v["tuned_vs_defaults"], 3) == 1.036
    v = verdicts(row, other, d, d)
    assert not v["not_slower_than_defaults"] and not v["within_2pct"] and not v["tuned_is_sweep_choice"]
    v = verdicts({"defaults_ms": 450.0, "tuned_ms": 449.0, "sweep_best_ms": 445.0}, other, d, None)
    assert v["not_slower_than_defaults"] and "within_2pct" not in v


def test_bench_tune_retimes_configs_interleaved_one_engine_per_distinct_config(monkeypatch):
    """bench tune's re-timing: one engine per distinct config (equal configs share one figure), the
    steps taken round by round (each config once per round) so drift falls on all alike."""
    from fxoverlap.bench import gpu_tune

    made, order = [], []

    class Engine:
        def __init__(self, cfg):
            self.cfg, self.closed = cfg, False
            made.append(self)

        def forward_backward(self, mbs, loss_fn=None):
            order.append(self.cfg.chunks)

        def close(self):
            self.closed = True

    class Timer:
        def step_ms(self, candidate, step, iters):
            step()
            return 3.0 if order[-1] == 3 else 1.0

    monkeypatch.setattr(gpu_tune.fxoverlap, "optimize", lambda model, group, cfg: Engine(cfg))
    model = torch.nn.Linear(2, 2)
    base = fxoverlap.OverlapConfig(progress=False)
    cfgs = {"defaults": base, "tuned": base, "sweep_best": dataclasses.replace(base, chunks=3)}
    ms = gpu_tune.time_configs(model, None, [], None, cfgs, Timer(), warmup=1, iters=2)
    assert len(made) == 2 and all(e.closed for e in made)
    assert order == [None, 3] * 3  # 1 warm-up round, 2 timed rounds, interleaved
    assert ms == {"defaults": [1.0, 1.0], "tuned": [1.0, 1.0], "sweep_best": [3.0, 3.0]}


def test_noisy_timings_are_reported_and_warned_about():
    """A timer that gives every reading (``step_times``, as CudaEventTimer does) fills each row's
    ``spread``; where the defaults' or the choice's readings spread past NOISY_SPREAD, one
    TuneWarning names them (the choice is then less sure than the 1 % margin assumes). A timer
    with medians only leaves ``spread`` None and warns of nothing."""
    import warnings

    from fxoverlap.tune import TuneWarning
    from fxoverlap.tune.search import NOISY_SPREAD
    from fxoverlap.tune.timers import step_readings

    class ReadingsTimer(TableTimer):
        def step_times(self, candidate, step, iters):
            self.calls += 1
            return self.ms(candidate)

    readings = {0: [10.0, 10.0, 10.0 * (1 + 2 * NOISY_SPREAD)], 8: [9.0, 9.0, 9.0]}
    model, mbs = tiny(n=2)
    cfg = fxoverlap.OverlapConfig(progress=False)
    with pytest.warns(TuneWarning, match="spread more than") as seen:
        res = tune_with_report(model, None, mbs, config=cfg, timer=ReadingsTimer(lambda c: readings[c.sm_carveout]),
                               candidates=CANDS, cache=False, iters=3)
    assert res.choice == CANDS[1]
    spreads = {r["sm_carveout"]: r["spread"] for r in res.table}
    assert spreads[0] == pytest.approx(2 * NOISY_SPREAD) and spreads[8] == 0.0
    noise = [str(w.message) for w in seen if "spread more than" in str(w.message)]
    assert len(noise) == 1 and CANDS[0].label() in noise[0] and CANDS[1].label() not in noise[0]
    assert "spread" in res.format_table().splitlines()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuneWarning)
        quiet = tune_with_report(model, None, mbs, config=cfg, timer=TableTimer(lambda c: 10.0 - c.sm_carveout / 8),
                                 candidates=CANDS, cache=False, iters=3)
    assert all(r["spread"] is None for r in quiet.table)
    assert step_readings(TableTimer(lambda c: 4.0), CANDS[0], lambda: None, 3) == [4.0]
