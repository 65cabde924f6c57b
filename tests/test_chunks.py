"""Chunks inside a microbatch (``passes/chunk.py``, ``OverlapConfig(chunks=K)``).

Each MoE layer's dispatch -> experts -> combine is cut into K chunks along its local
experts. Against eager PyTorch on the same weights and data (2 gloo ranks unless said):

- ``optimize``, 1-3 microbatches, K = 2 and 4, with delayed weight-grads, user
  activation checkpointing and capacity routing: losses bitwise,
  gradients within 1e-5 of the largest (the issue's bound; measured ~3e-11 on 2 ranks,
  bitwise on one; the cause of the last bits was not traced), and the stages of each chunk
  in ``engine.stages``;
- the issue order of F(0) and B(N-1): chunk c+1's exchange right after chunk c's experts;
- the ``torch.compile`` backend (one microbatch per call), and forward-only calls
  (``engine(x)``, the backend under ``no_grad`` + ``eval``): logits within 1e-6;
- a Hugging Face family after ``expert_parallel`` (Qwen3-MoE), optimize and backend;
- torchtitan's Qwen3-MoE and DeepSeek-V3 with their own EP (functional all-to-alls, host split
  sizes; ``passes/chunk_functional.py``): optimize (2, 3 and 4 chunks), the backend forward and
  backward, the backend under ``no_grad``, forward-only pairs: every MoE layer cut, bitwise eager;
- experts that draw random numbers stay whole (their draws would change); with the experts'
  dropout off the layers are cut while the embedding, attention, shared expert and router
  draw: losses bitwise, and the generator ends where eager's does;
- the pass on its own: ``chunks=1`` changes nothing, the chunk ops' row bookkeeping.
"""

from __future__ import annotations

import pytest
import torch

import fxoverlap
from fxoverlap.config import ConfigError
from fxoverlap.kernels import a2a
from fxoverlap.testing import run_distributed, run_distributed_once
import chunk_cases

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()

OPTIMIZE = [
    dict(config=dict(chunks=2), ns=[1, 3]),
    dict(config=dict(chunks=4, delay_wgrad=True), ns=[2]),
    dict(cfg=dict(activation_checkpoint=True), config=dict(chunks=2), ns=[2]),
    dict(cfg=dict(routing="capacity"), config=dict(chunks=2), ns=[2]),
    dict(config=dict(chunks=2, chunks_in_merged_steps=True), ns=[3]),
]


def _close(r: dict) -> None:
    assert r["losses_equal"], r["loss_rel"]
    assert r["grad_rel"] <= 1e-5, r["grad_rel"]


@pytest.mark.parametrize("i", range(len(OPTIMIZE)))
def test_optimize_matches_eager(i):
    v = OPTIMIZE[i]
    for rank in run_distributed_once(chunk_cases.optimize_vs_eager, OPTIMIZE):
        rows = [r for r in rank if r["variant"] == v]
        assert rows
        k = v["config"]["chunks"]
        for r in rows:
            _close(r)
            assert r["ep_size"] == 2  # the dispatcher pass read the exchanges' group
            chunked = [s for s in r["stages"] if s[4] is not None and not s[0].endswith("_wgrad")]
            # every MoE layer: k chunks of each of the six kinds x directions
            for layer in (0, 1):
                for kind in ("dispatch", "experts", "combine"):
                    for direction in ("fwd", "bwd"):
                        got = sorted(s[4] for s in chunked if s[1:4] == (kind, direction, layer))
                        assert got == list(range(k)), (kind, direction, layer, got)
            assert "experts c1" in r["table"]
            if v["config"].get("delay_wgrad"):  # every chunk's weight gradient in a part of its own
                wgrad = {s[0] for s in r["stages"] if s[0].endswith("_wgrad")}
                for layer in (0, 1):
                    missing = [c for c in range(k) if f"bwd_l{layer}_experts_c{c}_wgrad" not in wgrad]
                    assert not missing, (layer, missing, sorted(wgrad))


def test_issue_order_of_the_plain_steps():
    """F(0) and B(N-1): chunk c+1's first exchange is issued right after chunk c's experts,
    and chunk c's second exchange right after that, so each exchange has experts to run under."""
    r = run_distributed_once(chunk_cases.optimize_vs_eager, OPTIMIZE)[0][0]
    calls = r["calls"]
    f0 = [c for c in calls if c.startswith("F0_l0_")]
    # the side part here is a pair of index-range checks (ge/lt + _assert_async: torch 2.13 traces them; 2.11
    # does not trace them, and the layer keeps one attn stage)
    side = ["F0_l0_attn_side"] if "F0_l0_attn_side" in calls else []
    assert f0 == ["F0_l0_attn", "F0_l0_dispatch_c0", *side, "F0_l0_experts_c0", "F0_l0_dispatch_c1",
                  "F0_l0_combine_c0", "F0_l0_experts_c1", "F0_l0_combine_c1", "F0_l0_post"], f0
    if torch.__version__ >= "2.13":
        assert side, f0
    b0 = [c for c in calls if c.startswith("B0_l1_")]
    assert b0 == ["B0_l1_post", "B0_l1_combine_c0", "B0_l1_attn_early", "B0_l1_experts_c0", "B0_l1_combine_c1",
                  "B0_l1_dispatch_c0", "B0_l1_experts_c1", "B0_l1_dispatch_c1", "B0_l1_attn"], b0


def test_chunks_where_no_other_microbatch_runs_beside():
    """With 3 microbatches, 0 and 2 run each layer's chunks (F(0) and B(2) have no other
    microbatch beside them; B(0) and F(2) are the other halves of theirs) and 1 the whole
    exchange (the engine holds both); ``chunks_in_merged_steps=True``: every microbatch
    runs the chunks. Both match eager (test_optimize_matches_eager)."""
    rows = run_distributed_once(chunk_cases.optimize_vs_eager, OPTIMIZE)[0]
    for r in rows:
        if r["n"] != 3:
            continue
        everywhere = r["variant"]["config"].get("chunks_in_merged_steps", False)
        for mb in range(3):
            for d in "FB":
                exchanges = [c for c in r["calls"] if c.startswith(f"{d}{mb}_l0_") and "dispatch" in c]
                want = (["_c0", "_c1"] if everywhere or mb != 1 else [""])
                assert [c[len(f"{d}{mb}_l0_dispatch"):] for c in exchanges] == want, (mb, d, exchanges)
        whole = [s for s in r["stages"] if s[1] == "dispatch" and s[4] is None]
        assert bool(whole) != everywhere, whole


def test_backend_matches_eager():
    for r in run_distributed_once(chunk_cases.one_microbatch_modes, 2):
        r = r["backend"]
        assert r["fallbacks"] == []
        _close(r)
        assert {s[0] for s in r["stages"]} >= {"fwd_l0_experts_c0", "fwd_l0_experts_c1", "bwd_l1_dispatch_c1"}


def test_forward_only():
    for r in run_distributed_once(chunk_cases.one_microbatch_modes, 2):
        r = r["forward_only"]
        assert r["engine_rel"] <= 1e-6 and r["backend_rel"] <= 1e-6, r
        for key in ("engine_stages", "backend_stages"):
            names = {s[0] for s in r[key]}
            assert {"fwd_l1_dispatch_c1", "fwd_l1_experts_c1"} <= names, (key, names)
            assert all(s[2] == "fwd" for s in r[key])
        # engine.forward_only: the backend keeps no whole chains (one microbatch per call), the
        # engine does, for its pairs
        assert "fwd_l0_dispatch" not in {s[0] for s in r["backend_stages"]}
        assert r["paired_bitwise"]
        calls = r["paired_calls"]
        order = [c for c in calls if c.startswith(("F0_l0_", "F1_l0_")) and not c.endswith("_side")]
        assert order[:6] == ["F0_l0_attn", "F0_l0_dispatch", "F1_l0_attn", "F1_l0_dispatch",
                             "F0_l0_experts", "F0_l0_combine"], order
        assert calls.index("F1_l1_combine") < min(i for i, c in enumerate(calls) if c.startswith("F2_"))  # odd one last
        assert {c for c in calls if c.startswith("F2_l0_experts")} == {"F2_l0_experts_c0", "F2_l0_experts_c1"}
        assert not any(c.startswith("F0_l0_experts_c") for c in calls)


def test_forward_only_with_random_draws_runs_microbatches_in_order():
    """A forward that draws (dropout in training mode under no_grad): ``forward_only`` runs the
    microbatches one after the other (pairs would interleave their draws): eager's outputs and
    generator state."""
    for r in run_distributed_once(chunk_cases.one_microbatch_modes, 2):
        r = r["random_elsewhere"]["forward_only"]
        assert r["bitwise"] and r["generator_equal"]
        calls = r["calls"]
        assert max(i for i, c in enumerate(calls) if c.startswith("F0_")) < min(
            i for i, c in enumerate(calls) if c.startswith("F1_")), calls


@pytest.mark.slow
def test_hugging_face_family():
    for r in run_distributed(chunk_cases.hf_family, "qwen3_moe", 2):
        for mode in ("optimize", "backend"):
            _close(r[mode])
            assert "fwd_l1_experts_c1" in {s[0] for s in r[mode]["stages"]}, mode
        assert r["forward_only_bitwise"]  # engine.forward_only's pair and odd one: eager's logits


TITAN_MOE_LAYERS = {"qwen3_moe": [0, 1], "deepseek_v3": [1, 2]}  # DeepSeek-V3's first layer is dense


def _titan() -> list[dict]:
    pytest.importorskip("torchtitan.models.qwen3", reason="torchtitan 0.3.0 is not installed")
    return run_distributed_once(chunk_cases.titan_two_ranks)


def _titan_exact(r: dict) -> None:
    assert r["losses_equal"] and all(r["losses_equal"]), r["losses_equal"]
    assert r["grads"] and all(v is True for v in r["grads"].values()), {k: v for k, v in r["grads"].items() if v is not True}


def _dispatch_stages(names, layer: int, direction: str = "fwd") -> list[str]:
    return [n for n in names if n.startswith(f"{direction}_l{layer}_dispatch")]


@pytest.mark.slow  # one shared 2-rank spawn of ~3.5 min on CPU
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_torchtitan_optimize_cuts_its_all_to_alls(family):
    """torchtitan's own EP (functional all_to_all_single, host split sizes) through ``optimize`` with
    chunks=2, 3 microbatches: every MoE layer cut, its exchanges on the comm stream, and the step
    bitwise eager's (losses, every gradient and its DTensor kind, the load-balance buffers): each
    chunk runs the layer's own ops on its rows, and each expert's rows are in one chunk."""
    for rank in _titan():
        r = rank[f"{family}/optimize"]
        _titan_exact(r)
        assert r["buffers"] and all(r["buffers"].values()), r["buffers"]
        assert r["misplaced"] == {}, r["misplaced"]
        assert not r["log"], r["log"]  # nothing left whole
        for i in TITAN_MOE_LAYERS[family]:
            # the chunks (microbatches 0 and 2) and the whole exchange (microbatch 1, merged steps)
            assert _dispatch_stages(r["stage_names"], i) == [f"fwd_l{i}_dispatch_c0", f"fwd_l{i}_dispatch_c1",
                                                             f"fwd_l{i}_dispatch"], r["stage_names"]
            assert f"bwd_l{i}_dispatch_c1" in r["stage_names"] and f"fwd_l{i}_experts_c1" in r["stage_names"]
            # chunk 0: the counts exchange and the first chunk's rows; chunk 1: its rows; backward one each
            assert {k: v for k, v in r["comm_stages"].items() if f"_l{i}_" in k and k[-1].isdigit()} == {
                f"{d}_l{i}_{kind}_c{c}": 2 if (d, kind, c) == ("fwd", "dispatch", 0) else 1
                for d in ("fwd", "bwd") for kind in ("dispatch", "combine") for c in (0, 1)}, r["comm_stages"]


@pytest.mark.slow  # one shared 2-rank spawn of ~3.5 min on CPU
@pytest.mark.parametrize("k", [3, 4])
def test_torchtitan_more_chunks(k):
    """8 experts (4 local): 3 chunks (uneven, 1 + 1 + 2 local experts) and 4, bitwise eager's."""
    for rank in _titan():
        r = rank[f"qwen3_moe/chunks={k}"]
        _titan_exact(r)
        for i in TITAN_MOE_LAYERS["qwen3_moe"]:
            assert _dispatch_stages(r["stage_names"], i) == [f"fwd_l{i}_dispatch_c{c}" for c in range(k)] + [
                f"fwd_l{i}_dispatch"], r["stage_names"]


@pytest.mark.slow  # one shared 2-rank spawn of ~3.5 min on CPU
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_torchtitan_backend_chunks(family):
    """``torch.compile(model, backend="fxoverlap", options={"chunks": 2})`` on torchtitan's EP model
    (its expert shards as plain parameters: the backend takes no DTensor): no fallback, each MoE
    layer's forward and backward in 2 chunks, losses and gradients bitwise eager's over 2 steps."""
    for rank in _titan():
        r = rank[f"{family}/backend"]
        _titan_exact(r)
        names = [s[0] for s in r["stages"]]
        for i in TITAN_MOE_LAYERS[family]:
            assert _dispatch_stages(names, i) == [f"fwd_l{i}_dispatch_c0", f"fwd_l{i}_dispatch_c1"], names
            assert _dispatch_stages(names, i, "bwd") == [f"bwd_l{i}_dispatch_c0", f"bwd_l{i}_dispatch_c1"], names
        comm = {s[0]: s[2] for s in r["stages"] if s[1] in ("dispatch", "combine")}
        assert set(comm.values()) == {"comm"}, comm


@pytest.mark.slow  # one shared 2-rank spawn of ~3.5 min on CPU
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_torchtitan_backend_forward_only_chunks(family):
    """The backend under ``torch.no_grad()`` (the prefill case), chunks=2: each MoE layer's forward in
    2 chunks, logits bitwise the model's own."""
    for rank in _titan():
        r = rank[f"{family}/no_grad"]
        assert r["bitwise"]
        names = [s[0] for s in r["stages"]]
        assert not any(n.startswith("bwd_") for n in names), names
        for i in TITAN_MOE_LAYERS[family]:
            assert _dispatch_stages(names, i) == [f"fwd_l{i}_dispatch_c0", f"fwd_l{i}_dispatch_c1"], names


@pytest.mark.slow  # one shared 2-rank spawn of ~3.5 min on CPU
def test_torchtitan_forward_only_pairs_and_odd_chunks():
    """``engine.forward_only`` with chunks=2 over 3 microbatches: the pair runs torchtitan's whole
    all-to-alls, each under the other's compute; the odd one its chunks. Logits bitwise."""
    for rank in _titan():
        fo = rank["forward_only"]
        assert fo["bitwise"]
        calls = [c for c in fo["calls"] if c.startswith(("F0_l0_", "F1_l0_"))]
        assert calls.index("F1_l0_dispatch") < calls.index("F0_l0_experts"), calls
        assert {c for c in fo["calls"] if c.startswith("F2_l0_dispatch")} == {"F2_l0_dispatch_c0", "F2_l0_dispatch_c1"}


def test_random_experts_stay_whole():
    for r in run_distributed_once(chunk_cases.one_microbatch_modes, 2):
        r = r["random_experts"]
        assert r["losses_equal"] and r["grads_bitwise"] and r["generator_equal"], r
        assert r["log"] and "its experts draw random numbers" in r["log"][0], r["log"]
        assert not any(s[4] is not None for s in r["stages"])


def test_random_ops_outside_the_chunks_draw_what_eager_draws():
    """Layers cut into chunks, random ops in the embedding, attention, shared expert and router,
    3 microbatches (0 and 2 run the chunks, 1 the whole exchange): losses and the generator's
    final state bitwise eager's (a draw out of place would change
    both), gradients within the chunks' bound (measured 4.5e-11, as without random ops)."""
    for r in run_distributed_once(chunk_cases.one_microbatch_modes, 2):
        r = r["random_elsewhere"]
        _close(r)
        assert r["generator_equal"], r
        # the chunks (microbatches 0 and 2) and the whole exchange (microbatch 1): both draw in order
        assert {s[4] for s in r["stages"] if s[1] == "experts"} == {None, 0, 1}, r["stages"]


def test_chunks_one_is_off():
    """chunks=1 (the CPU default) runs no chunk pass: the same stages, bitwise eager."""
    from fxoverlap.models import MoEConfig, MoETransformer
    from fxoverlap.testing import eager_steps, grad_diff, take_grads, token_batches

    assert fxoverlap.OverlapConfig().resolved_chunks("cpu") == 1
    assert fxoverlap.OverlapConfig().resolved_chunks("cuda") >= 2
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(n_layers=2, n_experts=8))
    mbs = token_batches(64, 2, (2, 8))
    ref_losses = eager_steps(model, mbs)
    ref = take_grads(model)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="eager", chunks=1))
    losses = engine.forward_backward(mbs)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert grad_diff(model, ref)[2]
    assert all(s.chunk is None for s in engine.stages)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_config_refuses_bad_chunks(bad):
    with pytest.raises(ConfigError, match="chunks"):
        fxoverlap.OverlapConfig(chunks=bad)


@pytest.mark.parametrize("ep,experts,chunks", [(1, 4, 2), (2, 8, 2), (2, 8, 3), (4, 8, 2)])
def test_chunk_rows_go_back_in_place(ep, experts, chunks):
    """Every sender row is in exactly one chunk, and ``merge_chunks`` (here without the first
    chunk's counts: it reads them) puts the chunks' rows back in the sender's order (with
    experts of no rows, too)."""
    torch.manual_seed(ep * 100 + experts + chunks)
    counts = torch.randint(0, 4, (experts,))
    counts[1] = 0
    x = torch.randn(int(counts.sum()), 3)
    parts, sent = [], 0
    for c in range(chunks):
        runs = a2a._chunk_rows(counts.tolist(), ep, c, chunks)
        parts.append(a2a._take_rows(x, runs))
        sent += parts[-1].shape[0]
        assert torch.equal(a2a.chunk_counts(counts, ep, c, chunks).sum(), torch.tensor(parts[-1].shape[0]))
    assert sent == x.shape[0]
    assert torch.equal(a2a.merge_chunks(parts, counts, ep, x.shape[0]), x)


def test_one_rank_chunks_share_one_host_read_and_merge_by_slices():
    """On one rank (group None): the first chunk's host counts serve the others and the merge
    (``first``); the rows come back in place."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 2, 4, 1, 0, 5, 2])
    x = torch.randn(int(counts.sum()), 4)
    parts, first = [], None
    for c in range(3):
        y, recv, sent = a2a.dispatch_chunk(x, counts, None, None, c, 3, first)
        first = recv if first is None else first
        assert sent == y.shape[0] == int(recv.sum())
        parts.append(y)
    assert a2a._recall(first, a2a._chunk_plans) is not None
    assert torch.equal(a2a.merge_chunks(parts, counts, 1, x.shape[0], first), x)
    assert torch.equal(a2a.merge_chunks(parts, counts, 1, x.shape[0]), x)  # reading the counts again agrees


def test_emulated_link_sees_the_same_bytes_in_more_calls():
    """Under the emulated link (one rank standing in for EP 2): chunks=2 moves the bytes chunks=1
    moves, in twice the dispatch/combine calls (each chunk pays the link's latency)."""
    from fxoverlap.kernels import emulated_link as el
    from fxoverlap.models import MoEConfig, MoETransformer
    from fxoverlap.testing import token_batches

    seen = {}
    for chunks in (1, 2):
        torch.manual_seed(0)
        group = el.EmulatedGroup(el.preset("nvlink", ep=2, experts=8))
        model = MoETransformer(MoEConfig.tiny(n_layers=2, n_experts=8), group)
        engine = fxoverlap.optimize(model, group, fxoverlap.OverlapConfig(compiler="eager", chunks=chunks))
        counter = el.Counter()
        with el.standin(counter):
            engine.forward_backward(token_batches(64, 2, (2, 8)))
        seen[chunks] = counter.by_op()
    assert set(seen[1]) == set(seen[2]) == {"dispatch", "combine"}
    for op in ("dispatch", "combine"):
        assert seen[2][op][0] == 2 * seen[1][op][0]
        assert seen[2][op][1] == seen[1][op][1]


def test_forward_only_keeps_a_shared_buffer_in_eager_order():
    """A buffer two layers share and update in place (an EMA both layers fold into): in pairs,
    F(1)'s layer 0 would fold in before F(0)'s layer 1. The schedule sees it and runs the
    microbatches one after the other: outputs and the buffer bitwise eager's. With a buffer per
    layer the pairs stay (and stay eager's)."""
    import copy

    from fxoverlap.ir.meta import STEP_KEY
    from fxoverlap.models import MoEConfig, MoETransformer
    from fxoverlap.testing import token_batches

    def ema(layer, args):  # folds the layer's input into the buffer, then scales the input by it
        layer.seen.mul_(0.5).add_(args[0].float().mean())
        return (args[0] * (1 + layer.seen).to(args[0].dtype), *args[1:])

    for shared in (True, False):
        torch.manual_seed(0)
        model = MoETransformer(MoEConfig.tiny(n_layers=2, n_experts=8))
        one = torch.zeros(())
        for layer in model.layers:  # inside each layer, so its update is the layer's stage's
            layer.attention.register_buffer("seen", one if shared else torch.zeros(()))
            layer.attention.register_forward_pre_hook(ema)
        ref = copy.deepcopy(model)
        mbs = [mb[:1] for mb in token_batches(64, 2, (2, 8))]
        with torch.no_grad():
            want = [ref(*mb) for mb in mbs]
        engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="eager"))
        got = engine.forward_only(mbs)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), shared
        for (name, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
            assert torch.equal(a, b), (shared, name)
        mbs_of_calls = [n.meta[STEP_KEY].microbatch for n in engine.program.graph.nodes if n.op == "call_module"]
        assert (mbs_of_calls == sorted(mbs_of_calls)) == shared, mbs_of_calls  # in order only when shared


def test_layers_left_whole_keep_their_fake_values(monkeypatch):
    """After cutting, the chunk pass recomputes fake values only through the layers it cut and what
    reads them: the forward of a layer before the cut one (left whole: its experts draw) reads what
    it read before, so its nodes, its experts' dropout among them, are not run again (torch 2.11's
    dropout decomposition guards on the experts' unbacked rows when run again; there the whole
    program failed to build)."""
    import torch.fx.passes.fake_tensor_prop as ftp

    from fxoverlap.ir.meta import TAG_KEY
    from fxoverlap.passes import chunk as chunk_pass
    from fxoverlap.testing import token_batches
    from rng_cases import CFG as RCFG
    from rng_models import RandomTransformer

    torch.manual_seed(0)
    model = RandomTransformer(fxoverlap.models.MoEConfig.tiny(**RCFG), None)
    model.layers[1].moe.experts.p = 0.0  # layer 1's experts draw nothing: it can be cut; layer 0's stay whole
    ran: list = []
    inside = [False]
    real_prop, real_run = chunk_pass.propagate_fake_values, ftp.FakeTensorProp.run_node

    def prop(*args, **kwargs):
        inside[0] = True
        try:
            return real_prop(*args, **kwargs)
        finally:
            inside[0] = False

    def run_node(self, n):
        if inside[0] and n.op == "call_function":
            ran.append(n.meta.get(TAG_KEY))
        return real_run(self, n)

    monkeypatch.setattr(chunk_pass, "propagate_fake_values", prop)
    monkeypatch.setattr(ftp.FakeTensorProp, "run_node", run_node)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="eager", chunks=2, progress=False))
    plan = engine.plan([tuple(t) for t in token_batches(RCFG["vocab_size"], 1)])
    names = {s.name for s in plan.stages}
    assert "fwd_l1_experts_c0" in names and "fwd_l0_experts" in names and "fwd_l0_experts_c0" not in names
    fwd = {t.layer for t in ran if t is not None and t.direction.value == "fwd"}
    assert ran and 1 in fwd and not fwd & {-1, 0}, fwd  # the embedding and layer 0's forward: not run again
    engine.close()


@pytest.mark.parametrize("chunks", [2, 3])
def test_chunk_weight_gradients_are_their_experts_only(chunks):
    """Each chunk's experts weight gradient covers its own experts only (``offs[lo:hi]``), and the
    layer's gradient is the chunks' parts joined with ``cat``: no full-size gradient of zeros per
    chunk, no sum. One rank, eager stages, 4 local experts: the experts' gradients and the loss
    bitwise eager's (each expert's rows in one chunk, the same products)."""
    from fxoverlap.models import MoEConfig, MoETransformer
    from fxoverlap.ops import GROUPED_MM_WGRAD_OP
    from fxoverlap.testing import eager_steps, take_grads, token_batches

    cfg = MoEConfig.tiny(n_experts=4)
    torch.manual_seed(0)
    model = MoETransformer(cfg, None)
    mbs = token_batches(cfg.vocab_size, 2)
    ref_losses = eager_steps(model, mbs)
    ref = take_grads(model)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="eager", chunks=chunks,
                                                                      delay_wgrad=True, progress=False))
    losses = engine.forward_backward(mbs)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    got = take_grads(model)
    experts = [k for k in ref if ".experts." in k]
    assert experts and all(torch.equal(got[k], ref[k]) for k in experts), experts
    assert max((got[k] - ref[k]).abs().max().item() / ref[k].abs().max().item() for k in ref) <= 1e-6
    wgrads = {s.name: s for s in engine.stages if "experts_c" in s.name and s.name.endswith("_wgrad")}
    for layer in range(cfg.n_layers):
        for c in range(chunks):
            g = wgrads[f"bwd_l{layer}_experts_c{c}_wgrad"].graph_module.graph
            parts = [n for n in g.nodes if n.target is GROUPED_MM_WGRAD_OP]
            lo, hi = c * 4 // chunks, (c + 1) * 4 // chunks
            assert parts and all(n.args[2].target is torch.ops.aten.slice.Tensor and n.args[2].args[2:] == (lo, hi)
                                 for n in parts), g
            adds = [n for n in g.nodes if n.target is torch.ops.aten.add.Tensor]
            assert not adds, adds
        last = wgrads[f"bwd_l{layer}_experts_c{chunks - 1}_wgrad"].graph_module.graph
        assert sum(n.target is torch.ops.aten.cat.default for n in last.nodes) >= 2


@pytest.mark.parametrize("offsets, joined", [
    (lambda rc: torch.cumsum(rc.sum(0), 0).to(torch.int32), True),  # expert_parallel's, the reference model's
    (lambda rc: torch.cumsum(rc.sum(0) * 2, 0).to(torch.int32) // 2, True),  # order-keeping, 0 -> 0
    (lambda rc: torch.cumsum(rc.sum(0) + 1, 0).to(torch.int32), False),  # an empty group would not stay empty
    (lambda rc: torch.cumsum(rc.sum(0).flip(0), 0).to(torch.int32), False),  # groups not the experts in order
    (lambda rc: torch.cumsum(rc.sum(1), 0).to(torch.int32), False),  # summed over the wrong dimension
])
def test_chunk_joins_weight_gradients_only_for_groups_in_expert_order(offsets, joined):
    """The join (``cat`` of each chunk's experts) is used only where the grouped GEMM's groups are
    the local experts in order; otherwise the chunks' full-size gradients are summed, as before."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxoverlap.ops import GROUPED_MM_WGRAD_OP
    from fxoverlap.passes.chunk import _wgrad_of_local_experts

    ep, local = 2, 4

    def f(recv_counts, x, dy):
        return torch.ops.fxoverlap.grouped_mm_wgrad(x, dy, offsets(recv_counts))

    gm = make_fx(f, tracing_mode="fake")(torch.ones(ep, local, dtype=torch.int64), torch.randn(16, 8), torch.randn(16, 6))
    recv_counts = next(iter(gm.graph.nodes))
    wgrad = next(n for n in gm.graph.nodes if n.target is GROUPED_MM_WGRAD_OP)
    assert _wgrad_of_local_experts(wgrad, recv_counts, local) is joined


def test_small_exchanges_stay_whole_where_one_microbatch_runs(monkeypatch):
    """The CUDA default where a program runs one microbatch per call (the backend): a layer
    whose forward dispatch sends fewer bytes than the measured bound stays whole, and the
    compile log says why; a set ``chunks`` cuts every layer. The pass reads the bytes from the
    dispatch's input: the microbatch's tokens times top-k rows of the model's width."""
    from fxoverlap.config import DEFAULT_CUDA_ONE_MICROBATCH_MIN_CHUNK_EXCHANGE_BYTES as BOUND
    from fxoverlap.models import MoEConfig, MoETransformer
    from fxoverlap.passes import chunk as chunk_pass
    from fxoverlap.testing import token_batches

    cfg = fxoverlap.OverlapConfig()
    assert cfg.resolved_min_chunk_exchange_bytes("cuda", one_microbatch=True) == BOUND > 0
    assert cfg.resolved_min_chunk_exchange_bytes("cuda", one_microbatch=False) == 0
    assert cfg.resolved_min_chunk_exchange_bytes("cpu", one_microbatch=True) == 0
    assert fxoverlap.OverlapConfig(chunks=2).resolved_min_chunk_exchange_bytes("cuda", one_microbatch=True) == 0

    mcfg = MoEConfig.tiny(n_layers=2, n_experts=8)
    tokens = token_batches(mcfg.vocab_size, 1, (2, 8))
    sent: list[int | None] = []
    real = chunk_pass._sent_bytes
    monkeypatch.setattr(chunk_pass, "_sent_bytes", lambda nodes: sent.append(real(nodes)) or sent[-1])
    for bound, cut in ((1, True), (2**40, False)):
        monkeypatch.setattr(fxoverlap.OverlapConfig, "resolved_min_chunk_exchange_bytes",
                            lambda self, device_type, one_microbatch, b=bound: b)
        torch.manual_seed(0)
        engine = fxoverlap.optimize(MoETransformer(mcfg), None, fxoverlap.OverlapConfig(compiler="eager", chunks=2))
        names = {s.name for s in engine.plan([tuple(t) for t in tokens]).stages}
        assert ("fwd_l0_experts_c0" in names and "fwd_l1_experts_c1" in names) is cut, names
        assert any(n.endswith("_c0") for n in names) is cut
        engine.close()
    assert sent and set(sent) == {2 * 8 * mcfg.top_k * mcfg.dim * 4}, sent  # fp32 rows


def test_sent_bytes_reads_the_rows_exchange():
    """The one-microbatch chunk rule's size: the largest exchange input of the layer's forward
    dispatch (torchtitan's functional dispatch first exchanges its per-expert counts, then the
    rows), from the fake values; unknown where a row count is data-dependent."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fxoverlap.ops import DISPATCH_OP
    from fxoverlap.passes import chunk as chunk_pass
    from fxoverlap.passes import chunk_functional

    g = torch.fx.Graph()
    counts, rows, other = g.placeholder("counts"), g.placeholder("rows"), g.placeholder("other")
    with FakeTensorMode():
        counts.meta["val"] = torch.empty(64, dtype=torch.int64)
        rows.meta["val"] = torch.empty(1024, 256, dtype=torch.bfloat16)
        other.meta["val"] = torch.empty(10**6)
    view = g.call_function(torch.ops.aten.view.default, (other, [-1]))  # not an exchange: not counted
    a = g.call_function(chunk_functional.A2A, (counts, [1], [1], "0"))
    b = g.call_function(chunk_functional.A2A, (rows, [1], [1], "0"))
    assert chunk_pass._sent_bytes([view, a, b]) == 1024 * 256 * 2
    d = g.call_function(DISPATCH_OP, (rows, counts, None))
    assert chunk_pass._sent_bytes([d]) == 1024 * 256 * 2
    assert chunk_pass._sent_bytes([view]) is None
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        n = mode.shape_env.create_unbacked_symint()
        rows.meta["val"] = torch.empty(n, 256)
    assert chunk_pass._sent_bytes([d]) is None
