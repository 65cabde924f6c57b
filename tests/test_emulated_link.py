"""The emulated interconnect (``fxoverlap/kernels/emulated_link.py``): an injected group stand-in
(``EmulatedGroup``) that every transport tells of its exchanges in every mode, its presets and
arithmetic, the folded routing of an EP-N rank (``MoEConfig.expert_fold``) and the bench's flags.
CPU: a counting stand-in replaces the hold."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fxoverlap
from fxoverlap.bench.cli import emulated_config, parse_args
from fxoverlap.bench.run import hidden_share
from fxoverlap.config import ConfigError, OverlapConfig
from fxoverlap.kernels import a2a
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
    counter, cpu = el.Counter(), torch.device("cpu")
    group = el.EmulatedGroup(None)
    with el.standin(counter):
        group.exchanged("dispatch", 10**6, cpu)
        assert counter.calls == [] and not group.takes_sms()
        with group.using(el.preset("nvlink")):
            assert group.link.name == "nvlink" and group.takes_sms()
            group.exchanged("dispatch", 10**6, cpu)
        assert group.link is None
    assert counter.calls == [("dispatch", 10**6, pytest.approx(el.preset("nvlink").seconds(10**6)))]
    assert group.stats.calls == 1 and group.stats.nbytes == 10**6
    with group.using(el.Link(1e-9, ep=2)), pytest.raises(el.LinkError, match="units"):
        group.exchanged("dispatch", 10**6, cpu)  # a 500 000 s hold: refused, never spun
    with pytest.raises(el.LinkError, match="Link or None"):
        group.link = 100.0


def test_the_group_is_a_process_group_found_by_its_name():
    """What lets the group be injected as a real one: a ProcessGroup of one rank that the comm ops'
    ``group_name`` resolves to, shared (not copied) by a model's copies, refused under a taken name."""
    import gc

    from fxoverlap.inputs import check_group

    group = el.EmulatedGroup(el.preset("nvlink", ep=4), name="emu_test_found")
    assert isinstance(group, torch.distributed.ProcessGroup) and isinstance(group, a2a.GroupStandIn)
    assert torch.distributed.get_world_size(group) == 1 and group.size() == 1 and group.rank() == 0
    assert a2a.group_name_of(group) == "emu_test_found" and a2a.resolve_group("emu_test_found") is group
    assert a2a.world_size(group) == 1 and a2a.one_rank(group) and a2a.one_rank(None)
    check_group(group, "ep_group")  # accepted where optimize takes a group
    assert copy.deepcopy(group) is group
    model = MoETransformer(MoEConfig.tiny(**CFG), group)
    assert copy.deepcopy(model).layers[0].moe.ep_group is group
    with pytest.raises(a2a.GroupStandInError, match="taken"):
        el.EmulatedGroup(None, name="emu_test_found")
    # whether a comm kernel runs beside the compute: the group decides
    assert not a2a.exchange_takes_sms(None) and a2a.exchange_takes_sms(group)
    with group.using(None):
        assert not a2a.exchange_takes_sms(group)
    assert not a2a.exchange_takes_sms(a2a.GroupStandIn("emu_test_plain"))  # a stand-in that holds nothing
    # the chokepoint tells the group only; any other group hears nothing
    with el.standin(counter := el.Counter()):
        a2a.exchanged(None, "dispatch", [torch.ones(4, 2)], 4)
        a2a.exchanged(group, "dispatch", [torch.ones(4, 2)], 4)
    assert counter.calls == [("dispatch", 32, pytest.approx(group.link.seconds(32)))]
    del model, group
    gc.collect()
    with pytest.raises(Exception):  # gone with its group: the name no longer resolves
        a2a.resolve_group("emu_test_found")


def test_production_ops_do_not_reference_the_emulated_link():
    """``fxoverlap/ops.py`` and ``fxoverlap/dispatch_ops.py`` neither import nor name
    ``emulated_link`` (the import-linter contract checks the imports on the installed layout,
    tests/test_layers_rule.py), and importing fxoverlap and its ops loads no emulated link."""
    for rel in ("fxoverlap/ops.py", "fxoverlap/dispatch_ops.py"):
        with open(os.path.join(ROOT, rel)) as f:
            tree = ast.parse(f.read())
        names = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Name):
                names.add(n.id)
            elif isinstance(n, ast.Attribute):
                names.add(n.attr)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names |= {a.name for a in n.names} | {getattr(n, "module", None) or ""}
        assert not {x for x in names if "emulated" in x}, (rel, sorted(x for x in names if "emulated" in x))
        assert not {x for x in names if x.startswith("hold")}, rel  # no hold call left in an op
    code = ("import sys, fxoverlap, fxoverlap.ops, fxoverlap.dispatch_ops; "
            "print(sorted(m for m in sys.modules if 'emulated' in m))")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_cuda_pieces_import_on_cpu():
    # the Triton kernel is defined where Triton is installed; spin() is only called on CUDA
    assert callable(el.spin) and el.HOLD_BLOCKS == 16 and el.HOLD_WARPS * 32 == 512


# ---------------------------------------------------------------- wired into every mode


def _step_counts(mode: str, dispatcher: str, routing: str) -> dict:
    """The holds of one step of ``mode`` over an injected ``EmulatedGroup``: the model is built on
    it and ``optimize`` is given it, as a real EP group would be; its link is set after the first
    (compiling) step."""
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(**CFG, routing="dropless", token_dedup=True) if routing == "dedup" else \
        MoEConfig.tiny(**CFG, routing=routing)
    group = el.EmulatedGroup(None)
    model = MoETransformer(cfg, group)
    mbs = token_batches(cfg.vocab_size, MBS, SHAPE, seed=1, device=torch.device("cpu"))
    if mode == "optimize":
        engine = fxoverlap.optimize(model, group, config=OverlapConfig(dispatcher=dispatcher))
        step = lambda: engine.forward_backward(mbs)  # noqa: E731
    else:
        if mode == "eager":
            fn = model
        elif mode == "compile":
            # torch.compile(model) through Dynamo and AOTAutograd (aot_eager: Inductor calls the comm
            # ops' bodies the same way, as opaque extern kernels, at many times the CPU compile time)
            frames = CompileCounterWithBackend("aot_eager")
            fn = torch.compile(model, backend=frames)
        else:
            fn = torch.compile(model, backend="fxoverlap",
                               options={"dispatcher": dispatcher} if dispatcher != "auto" else None)

        def step():
            for mb in mbs:
                fn(*mb).backward()
    step()  # the capture / compile: the ops' fake kernels only, and one real step
    counter = el.Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxoverlap.backend.FallbackWarning)
        with group.using(el.preset("nvlink", ep=2, experts=8)), el.standin(counter):
            step()
    if mode == "compile":
        assert frames.frame_count == 1  # setting the group's link recompiled nothing
    torch._dynamo.reset()
    assert group.stats.calls == len(counter.calls)
    return counter.by_op()


# the generic ops with dropless routing and a static lowering with capacity routing (the other two
# pairings hold the same ops: kept out of CI for its time; test_every_transport_reports_as_the_generic_ops)
@pytest.mark.parametrize("dispatcher,routing", [("auto", "dropless"), ("padded", "capacity")])
def test_same_calls_and_bytes_in_every_mode(dispatcher, routing):
    """One step of 2 microbatches of the 2-layer model: per microbatch and layer a forward
    dispatch and combine and, in the backward, their adjoints (a combine and a dispatch). Eager,
    torch.compile, the backend and the engine pay the same holds over the same group."""
    modes = ("eager", "compile", "backend", "optimize") if dispatcher == "auto" else ("eager", "backend", "optimize")
    got = {mode: _step_counts(mode, dispatcher, routing) for mode in modes}
    rows = SHAPE[0] * SHAPE[1] * CFG["top_k"]  # T x k rows each way (capacity factor 1: the same)
    row = CFG["dim"] * 4  # fp32
    want = {"combine": (2 * 2 * MBS, 2 * 2 * MBS * rows * row), "dispatch": (2 * 2 * MBS, 2 * 2 * MBS * rows * row)}
    assert got["eager"] == want, got
    assert all(got[m] == got["eager"] for m in modes), got


def test_token_once_ops_hold_too():
    got = _step_counts("eager", "auto", "dedup")
    assert set(got) == {"token_dispatch", "token_combine", "token_dispatch_backward", "token_combine_backward"}
    assert all(calls == 2 * MBS for calls, _ in got.values()), got
    assert _step_counts("optimize", "auto", "dedup") == got


def test_every_transport_reports_as_the_generic_ops():
    """Each transport's chokepoint (the all_to_all one, chunks included; the token-once one; the
    static ``padded`` transport through ``static_ep._carry``), op by op over the group's name: the
    same op names and bytes for the same exchange."""
    torch.manual_seed(0)
    ops = torch.ops.fxoverlap
    group = el.EmulatedGroup(el.preset("nvlink", ep=2, experts=8))
    name = group.group_name
    t, d, e, k = 12, 8, 4, 2
    x, w = torch.randn(t, d), torch.rand(t, k)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    counts = torch.full((e,), t * k // e, dtype=torch.long)
    xs = torch.randn(t * k, d)

    def held(fn) -> dict:
        with el.standin(counter := el.Counter()):
            fn()
        return counter.by_op()

    def per_expert(static: bool) -> None:
        if static:
            y, recv = ops.dispatch_static(xs, counts, name, None, t * k, "padded", None, 0)
            ops.combine_static(y, recv, counts, name, t * k, t * k, "padded")
        else:
            y, recv = ops.dispatch(xs, counts, name, None, -1)
            ops.combine(y, recv, counts, name, t * k)

    def chunked() -> None:
        first = None
        for c in range(2):
            y, recv = ops.dispatch_chunk(xs, counts, name, None, -1, c, 2, first)
            first = recv if first is None else first
            ops.combine_chunk(y, recv, counts, name, c, 2)

    def token_once(static: bool) -> None:
        cap = (t, "padded") if static else ()
        sfx = "_static" if static else ""
        pairs_x, pairs_w, _, pair_index, slot, recv_rows = getattr(ops, "token_dispatch" + sfx)(
            x, idx, w, e, name, *cap, *((None, 0) if static else ()))
        getattr(ops, "token_combine" + sfx)(pairs_x, pair_index, slot, recv_rows, k, name, *cap)
        getattr(ops, "token_combine_backward" + sfx)(x, pair_index, slot, recv_rows, k, name, *cap)
        getattr(ops, "token_dispatch_backward" + sfx)(pairs_x, pairs_w, idx, pair_index, slot, recv_rows, e, name,
                                                       *cap)

    generic = held(lambda: per_expert(False))
    assert generic == {"combine": (1, t * k * d * 4), "dispatch": (1, t * k * d * 4)}
    assert held(lambda: per_expert(True)) == generic
    assert held(chunked) == {"combine": (2, t * k * d * 4), "dispatch": (2, t * k * d * 4)}
    tokens = held(lambda: token_once(False))
    rows = t * group.link.token_ranks(k)  # each token once per expected destination rank
    assert tokens == {"token_combine": (1, round(rows * d * 4)), "token_combine_backward": (1, round(rows * d * 4)),
                      "token_dispatch": (1, round(rows * (d * 4 + k * 4 + k * 4))),  # + k int32 ids, k weights
                      "token_dispatch_backward": (1, round(rows * (d * 4 + k * 4)))}, tokens
    assert held(lambda: token_once(True)) == tokens


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


@pytest.mark.slow  # a benchmark run on CPU (the slow step runs it)
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
    also when a stage fails. One rank without the link runs no comm kernel: no carveout (the
    group says, at each run). Bad values are refused with the field's name."""
    from fxoverlap.pipeline import comm_kernels_run
    from fxoverlap.runtime import static_values

    torch.manual_seed(0)
    group = el.EmulatedGroup(None)
    model = MoETransformer(MoEConfig.tiny(n_layers=2, n_experts=8), group)
    engine = fxoverlap.optimize(model, group, fxoverlap.OverlapConfig(compiler="eager", sm_carveout=8))
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
    with group.using(el.preset("nvlink", ep=2, experts=8)), el.standin(el.Counter()):
        runner.run(static, mbs)
    assert {c for k, c in seen if k == "experts"} == {8}
    assert {c for k, c in seen if k != "experts"} == {before}
    assert {k for k, _ in seen} >= {"experts", "attn", "dispatch"}
    assert torch._C._get_sm_carveout_experimental() == before

    def failing(node, stage, run):
        if str(stage.kind) == "experts":  # inside the carveout
            raise RuntimeError("boom")
        return run()

    with pytest.raises(Exception, match="boom"), group.using(el.preset("nvlink", ep=2, experts=8)):
        engine.runner(mbs, hook=failing).run(static, mbs)
    assert torch._C._get_sm_carveout_experimental() == before
    for bad in (-1, True, 1.5):
        with pytest.raises(fxoverlap.ConfigError, match="sm_carveout"):
            fxoverlap.OverlapConfig(sm_carveout=bad)
    # when a comm kernel runs: the exchanges' groups (read by the dispatcher pass) decide at each run;
    # a graph without fxoverlap's exchanges has a group not known: assumed to run one
    capture = engine.plan(mbs).capture
    assert capture.ep_groups == (group.group_name,) and capture.ep_size == 1
    asks = comm_kernels_run(capture)
    assert not asks()
    with group.using(el.preset("nvlink", ep=2)):
        assert asks()
    assert comm_kernels_run(dataclasses.replace(capture, ep_groups=None))()
    assert not comm_kernels_run(dataclasses.replace(capture, ep_groups=("",)))()  # "": no group, one rank


def test_expert_parallel_hf_model_over_an_emulated_group_matches_eager():
    """``bench hf``'s path: transformers' model made EP over the stand-in group (one rank
    for compute; not in torch's group registry), every exchange counted, outputs and grads eager's."""
    import hf_cases

    torch.manual_seed(0)
    group = el.EmulatedGroup(None)
    model = fxoverlap.expert_parallel(hf_cases.build("qwen3_moe"), group)
    ref = copy.deepcopy(model)  # the same EP model in eager (a stand-in group is shared by copies)
    mbs = hf_cases.batches(0)
    ref_losses = hf_cases.eager_losses(ref, mbs)
    engine = fxoverlap.optimize(model, group, OverlapConfig(compiler="eager"))
    counter = el.Counter()
    with el.standin(counter), group.using(el.Link(100, ep=8, experts=64)):
        losses = engine.forward_backward(mbs, loss_fn=hf_cases.next_token_loss)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert counter.calls
