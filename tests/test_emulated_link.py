"""The emulated interconnect (``fxoverlap/kernels/emulated_link.py``): wired into every comm op
in every mode, its presets and arithmetic, the folded routing of an EP-N rank
(``MoEConfig.expert_fold``) and the bench's flags. CPU: a counting stand-in replaces the hold."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import fxoverlap
from fxoverlap.bench.cli import emulated_config, parse_args
from fxoverlap.bench.run import hidden_share
from fxoverlap.config import ConfigError, OverlapConfig
from fxoverlap.kernels import emulated_link as el
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.models.moe import ModelConfigError, Router
from fxoverlap.testing import token_batches

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = dict(n_layers=2, dim=32, n_heads=4, n_experts=4, top_k=2, expert_dim=16, vocab_size=64)
MBS, SHAPE = 2, (2, 8)  # 2 microbatches of 2 x 8 tokens


# ---------------------------------------------------------------- the link's numbers


def test_presets_and_arithmetic():
    assert {k: (v.gbps, v.latency_us) for k, v in el.PRESETS.items()} == {
        "nvlink": (294.0, 20.0), "p2p_off": (23.5, 20.0), "ib400": (45.0, 20.0)}
    link = el.preset("nvlink", ep=4)
    assert link.remote_share == 0.75
    # latency + bytes x (N-1)/N / bandwidth: 1 GB over EP-4 NVLink
    assert link.seconds(10**9) == pytest.approx(20e-6 + 0.75 / 294)
    assert link.replace(skew=1.3).seconds(10**9) == pytest.approx(20e-6 + 1.3 * 0.75 / 294)
    assert el.preset("ib400", ep=1).seconds(10**9) == pytest.approx(20e-6)  # EP-1: nothing leaves
    assert el.Link(100.0, latency_us=5.0, ep=2).seconds(0) == pytest.approx(5e-6)
    # token-once rows per token: distinct destination ranks of k distinct experts of E
    assert el.Link(1.0, ep=8, experts=32).token_ranks(8) == pytest.approx(
        8 * (1 - math.comb(28, 8) / math.comb(32, 8)))
    assert el.Link(1.0, ep=2, experts=32).token_ranks(1) == pytest.approx(1.0)
    assert el.Link(1.0, ep=4).token_ranks(2) == pytest.approx(4 * (1 - 0.75 ** 2))
    for bad in (dict(gbps=0), dict(gbps=1, ep=0), dict(gbps=1, skew=0.5), dict(gbps=1, latency_us=-1)):
        with pytest.raises(el.LinkError):
            el.Link(**bad)
    with pytest.raises(el.LinkError, match="presets"):
        el.preset("pcie")
    assert el.LinkError.__mro__[1:3] == (fxoverlap.FxOverlapError, ValueError)


def test_hold_without_a_link_is_free_and_using_restores():
    counter = el.Counter()
    with el.standin(counter):
        el.hold("dispatch", 10**6, torch.device("cpu"))
        assert counter.calls == []
        with el.using(el.preset("nvlink")):
            assert el.get_link().name == "nvlink"
            el.hold("dispatch", 10**6, torch.device("cpu"))
        assert el.get_link() is None
    assert counter.calls == [("dispatch", 10**6, pytest.approx(el.preset("nvlink").seconds(10**6)))]
    with el.using(el.Link(1e-9, ep=2)), pytest.raises(el.LinkError, match="units"):
        el.hold("dispatch", 10**6, torch.device("cpu"))  # a 500 000 s hold: refused, never spun


def test_cuda_pieces_import_on_cpu():
    # the Triton kernel is defined where Triton is installed; spin() is only called on CUDA
    assert callable(el.spin) and el.HOLD_BLOCKS == 16 and el.HOLD_WARPS * 32 == 512


# ---------------------------------------------------------------- wired into every mode


def _step_counts(mode: str, dispatcher: str, routing: str) -> dict:
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(**CFG, routing="dropless", token_dedup=True) if routing == "dedup" else \
        MoEConfig.tiny(**CFG, routing=routing)
    model = MoETransformer(cfg)
    mbs = token_batches(cfg.vocab_size, MBS, SHAPE, seed=1, device=torch.device("cpu"))
    if mode == "optimize":
        engine = fxoverlap.optimize(model, None, config=OverlapConfig(dispatcher=dispatcher))
        step = lambda: engine.forward_backward(mbs)  # noqa: E731
    else:
        fn = model if mode == "eager" else torch.compile(
            model, backend="fxoverlap", options={"dispatcher": dispatcher} if dispatcher != "auto" else None)

        def step():
            for mb in mbs:
                fn(*mb).backward()
    step()  # the capture / compile: the ops' fake kernels only, and one real step
    counter = el.Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxoverlap.backend.FallbackWarning)
        with el.using(el.preset("nvlink", ep=2, experts=8)), el.standin(counter):
            step()
    torch._dynamo.reset()
    return counter.by_op()


# the generic ops with dropless routing and a static lowering with capacity routing (the other two
# pairings hold the same ops: kept out of CI for its time)
@pytest.mark.parametrize("dispatcher,routing", [("auto", "dropless"), ("padded", "capacity")])
def test_same_calls_and_bytes_in_every_mode(dispatcher, routing):
    """One step of 2 microbatches of the 2-layer model: per microbatch and layer a forward
    dispatch and combine and, in the backward, their adjoints (a combine and a dispatch)."""
    got = {mode: _step_counts(mode, dispatcher, routing) for mode in ("eager", "backend", "optimize")}
    rows = SHAPE[0] * SHAPE[1] * CFG["top_k"]  # T x k rows each way (capacity factor 1: the same)
    row = CFG["dim"] * 4  # fp32
    want = {"combine": (2 * 2 * MBS, 2 * 2 * MBS * rows * row), "dispatch": (2 * 2 * MBS, 2 * 2 * MBS * rows * row)}
    assert got["eager"] == want, got
    assert got["backend"] == got["eager"] and got["optimize"] == got["eager"], got


def test_token_once_ops_hold_too():
    got = _step_counts("eager", "auto", "dedup")
    assert set(got) == {"token_dispatch", "token_combine", "token_dispatch_backward", "token_combine_backward"}
    assert all(calls == 2 * MBS for calls, _ in got.values()), got
    assert _step_counts("optimize", "auto", "dedup") == got


# ---------------------------------------------------------------- an EP-N rank's model


def test_fold_routes_to_local_experts_only():
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    folded = Router(MoEConfig.tiny(**{**CFG, "n_experts": 2, "top_k": 4, "expert_fold": 4}))
    w, idx = folded(x)
    assert folded.gate.out_features == 8  # scores E = 8 experts
    assert idx.shape == (64, 4) and w.shape == (64, 4)
    assert int(idx.min()) >= 0 and int(idx.max()) < 2  # folded onto the 2 local experts
    assert (idx >= 2).sum() == 0 and len(idx.unique()) == 2
    # top-k <= E/N: no fold, routing over E/N experts, the same shapes
    plain = Router(MoEConfig.tiny(**{**CFG, "n_experts": 4, "top_k": 2}))
    fold = Router(MoEConfig.tiny(**{**CFG, "n_experts": 4, "top_k": 2, "expert_fold": 2}))
    (wp, ip), (wf, i_f) = plain(x), fold(x)
    assert ip.shape == i_f.shape and wp.shape == wf.shape and int(i_f.max()) < 4
    # a whole folded model trains one step on one rank
    m = MoETransformer(MoEConfig.tiny(**{**CFG, "n_experts": 2, "top_k": 4, "expert_fold": 4}))
    (mb,) = token_batches(64, 1, SHAPE, seed=0, device=torch.device("cpu"))
    m(*mb).backward()
    with pytest.raises(ModelConfigError, match="expert_fold"):
        MoEConfig.tiny(expert_fold=2, token_dedup=True)


def test_emulated_config_of_the_peer_shape():
    peer = MoEConfig.benchmark()  # 32 experts top-8
    for n, (local, fold) in {2: (16, 1), 4: (8, 1), 8: (4, 2 * 4), 16: (2, 16), 32: (1, 32)}.items():
        c = emulated_config(peer, n)
        assert (c.n_experts, c.top_k) == (local, 8)
        assert c.expert_fold == (1 if 8 <= local else n), (n, c)
        assert c.routed_experts in (local, 32)
    with pytest.raises(ConfigError):
        emulated_config(peer, 3)


def test_hidden_share():
    assert hidden_share(10.0, 10.0, 4.0) == 1.0  # comm fully under compute
    assert hidden_share(14.0, 10.0, 4.0) == 0.0  # serial
    assert hidden_share(12.0, 10.0, 4.0) == 0.5
    assert hidden_share(10.0, 10.0, 0.0) is None


# ---------------------------------------------------------------- the bench's flags


def test_bench_flags():
    a = parse_args(["--tiny", "--emulate-ep", "4", "--link", "ib400", "--skew", "1.3"])
    assert a.emulated_link == el.preset("ib400", ep=4, skew=1.3)
    a = parse_args(["--emulate-ep", "2", "--link-gbps", "100", "--link-latency-us", "5"])
    assert (a.emulated_link.gbps, a.emulated_link.latency_us, a.emulated_link.ep) == (100.0, 5.0, 2)
    assert parse_args(["--emulate-ep", "2"]).emulated_link.name == "nvlink"  # the default link
    assert parse_args(["--emulate-ep", "2", "--link", "none"]).emulated_link is None
    assert parse_args(["--modes", "fwd_eager,fwd_fxoverlap"]).modes == ["fwd_eager", "fwd_fxoverlap"]
    for bad in (["--link", "nvlink"], ["--skew", "2"], ["--emulate-ep", "2", "--link", "nvlink", "--link-gbps", "1"],
                ["--emulate-ep", "2", "--skew", "0.5"], ["--emulate-ep", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_bench_cpu_emulated_smoke(tmp_path):
    """``--tiny --device cpu --emulate-ep 2 --link nvlink`` in one process (no torchrun), with
    a counting stand-in (no sleeps); every figure from the link says it is emulated."""
    code = (
        "import sys\n"
        "from fxoverlap.kernels import emulated_link as el\n"
        "from fxoverlap.bench import main\n"
        "with el.standin(el.Counter()):\n"
        "    main(sys.argv[1:])\n"
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", code, "--tiny", "--device", "cpu", "--emulate-ep", "2", "--link", "nvlink",
           "--modes", "eager,fxoverlap,fwd_fxoverlap", "--warmup", "1", "--iters", "1", "--microbatches", "2",
           "--no-stage-timing", "--no-grad-check", "--out", str(out), "--name", "emu"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads((out / "emu.json").read_text())
    e = r["emulation"]
    assert e["emulated"] and e["ep"] == 2 and e["link"]["name"] == "nvlink" and e["link"]["emulated"]
    assert (e["local_experts"], e["expert_fold"]) == (4, 1)  # tiny: 8 experts top-2 -> 4 local
    assert r["config"]["n_experts"] == 4
    link = el.preset("nvlink", ep=2, experts=8)
    tokens, k, dim = 2 * 32, 2, 64  # micro-batch 2 x seq 32, fp32 rows of dim 64
    per_call = link.seconds(tokens * k * dim * 4) * 1e3
    # 2 layers x 2 microbatches x (dispatch, combine; backward: their adjoints)
    for mode, calls in (("eager", 16), ("fxoverlap", 16), ("fwd_fxoverlap", 8)):
        m = r["modes"][mode]
        assert m["emulated"] and m["link"]["emulated"], m
        assert m["link"]["calls"] == calls and m["T_comm_ms"] == pytest.approx(calls * per_call), m
        assert m["link"]["bytes"] == calls * tokens * k * dim * 4
        assert m["T_step_ms"] == m["step_ms"] > 0 and m["T_compute_ms"] > 0 and "hidden_share" in m
    assert "emulated EP-2 rank over an emulated nvlink link" in proc.stdout
    assert "mode (emulated)" in proc.stdout


def test_sm_carveout_is_set_for_the_experts_stages_and_restored():
    """``OverlapConfig(sm_carveout=N)``: where the exchanges run comm kernels (here the emulated
    link's: one rank), every experts stage call sees torch's SM carveout at N (its grouped GEMMs
    leave N SMs to them), every other stage the caller's setting, which is back after the step,
    also when a stage fails. One rank without the link runs no comm kernel: no carveout. Bad
    values are refused with the field's name."""
    from fxoverlap.runtime import static_values

    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(n_layers=2, n_experts=8))
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="eager", sm_carveout=8))
    mbs = token_batches(64, 2, (2, 8))
    seen = []

    def hook(node, stage, run):
        seen.append((str(stage.kind), torch._C._get_sm_carveout_experimental()))
        return run()

    before = torch._C._get_sm_carveout_experimental()
    runner = engine.runner(mbs, hook=hook)
    static = static_values(engine.plan(mbs).capture, model)
    runner.run(static, mbs)  # one rank, no link: nothing beside the experts
    assert seen and {c for _, c in seen} == {before}
    seen.clear()
    with el.using(el.preset("nvlink", ep=2, experts=8)), el.standin(el.Counter()):
        runner.run(static, mbs)
    assert {c for k, c in seen if k == "experts"} == {8}
    assert {c for k, c in seen if k != "experts"} == {before}
    assert {k for k, _ in seen} >= {"experts", "attn", "dispatch"}
    assert torch._C._get_sm_carveout_experimental() == before

    def failing(node, stage, run):
        if str(stage.kind) == "experts":  # inside the carveout
            raise RuntimeError("boom")
        return run()

    with pytest.raises(Exception, match="boom"), el.using(el.preset("nvlink", ep=2, experts=8)):
        engine.runner(mbs, hook=failing).run(static, mbs)
    assert torch._C._get_sm_carveout_experimental() == before
    for bad in (-1, True, 1.5):
        with pytest.raises(fxoverlap.ConfigError, match="sm_carveout"):
            fxoverlap.OverlapConfig(sm_carveout=bad)
    # when a comm kernel runs: more than one rank or an unknown group, or the emulated link
    assert (el.exchange_takes_sms(1), el.exchange_takes_sms(2), el.exchange_takes_sms(None)) == (False, True, True)
    with el.using(el.preset("nvlink", ep=2)):
        assert el.exchange_takes_sms(1)
