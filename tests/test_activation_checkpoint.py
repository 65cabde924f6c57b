"""Activation checkpointing (issue 16): the user's AC keeps its memory saving under fxoverlap.

- 2 gloo ranks (one spawn per model; the torchtitan-style model's is `slow`): full AC
  (``MoEConfig.activation_checkpoint``, and ``checkpoint_wrapper`` on the torchtitan-style
  model) and selective AC (matmuls saved) equal eager with the same AC, bitwise; the
  interleaved program's peak live bytes with full AC are at most half those without; what
  the program keeps for the backward is what eager keeps (measured with saved-tensor hooks)
  plus the all-to-all outputs, which eager would communicate again and fxoverlap by default
  does not replay; with ``ac_replay_comm=True`` it replays them too (recompute stages on the
  comm stream, right before their readers) and keeps what eager keeps, still bitwise;
- one rank: a checkpointed layer keeps its attn / experts / mlp split (``checkpoint``
  inside the layer, ``checkpoint_wrapper``, a layer whose ``forward`` is replaced by a
  checkpoint partial), under ``optimize`` and the torch.compile backend; the backend
  also keeps the saving;
- a snapshot of the recompute stage of a checkpointed layer (full and selective);
- ``use_reentrant=True`` is refused with a message that names the fix.
"""

from __future__ import annotations

import dataclasses
import functools

import expecttest
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ac_cases
import fxoverlap
import fxoverlap.backend as fxb
from fxoverlap.ir.meta import SAVED_COMM_KEY
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.passes import capture, split, tag
from fxoverlap.passes.capture import CaptureError
from fxoverlap.passes.recompute import recompute
from fxoverlap.pipeline import build_program, build_stages
from fxoverlap.testing import grad_diff, run_distributed
from snapshot_utils import requires_pinned_torch

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()

# The default suite runs the reference MoE model's cases; the torchtitan-style model's are
# `slow` (CI's second step). One spawn per model for its 2-rank cases.
_TWO: dict[str, list] = {}
MODELS = ["moe", pytest.param("titan", marks=pytest.mark.slow)]


def _two_ranks(model: str) -> list[dict]:
    if model not in _TWO:
        _TWO[model] = run_distributed(ac_cases.two_ranks, (model,))
    return _TWO[model]


@pytest.mark.parametrize("model", MODELS)
def test_numerics_equal_eager_with_the_same_ac(model):
    for rank, cases in enumerate(_two_ranks(model)):
        for name, rows in cases.items():
            for row in rows:
                assert row["exact"], (rank, name, row["n"], row["diff"], row["scale"])
            recompute_stages = [s for s, kind in rows[0]["stages"] if kind == "recompute"]
            layers = 2 if name.startswith("titan") else 4
            if name.endswith("/none"):
                assert recompute_stages == [], (name, recompute_stages)
            elif name.endswith("/replay"):  # phases around the replayed all-to-alls of each MoE layer
                assert {s.rsplit("_", 1)[0] for s in recompute_stages} == {
                    f"bwd_l{i}" for i in range(layers)}, recompute_stages
            else:  # one replay per checkpointed layer, right before its backward
                assert recompute_stages == [f"bwd_l{i}_recompute" for i in reversed(range(layers))], recompute_stages
            # the all-to-alls stay in comm stages, each direction, AC or not
            names = [s for s, _ in rows[0]["stages"]]
            moe_layers = range(2) if name.startswith("titan") else (0, 2, 3)
            for d in ("fwd", "bwd"):
                assert all(f"{d}_l{i}_{k}" in names for i in moe_layers for k in ("dispatch", "combine")), names


@pytest.mark.parametrize("model", MODELS)
def test_full_ac_keeps_its_memory_saving(model):
    for rank, cases in enumerate(_two_ranks(model)):
        if model == "moe":
            none, full, sel = (cases[f"moe/{k}"][-1] for k in ("none", "full", "matmuls"))
            # the interleaved program (3 microbatches): peak live bytes at most half
            assert full["peak"] <= 0.5 * none["peak"], (rank, full["peak"], none["peak"])
            assert full["peak"] < sel["peak"] < none["peak"], (rank, full["peak"], sel["peak"], none["peak"])
        else:
            titan_none, titan_full = cases["titan/none"][-1], cases["titan/full"][-1]
            assert titan_full["peak"] < 0.75 * titan_none["peak"], (rank, titan_full["peak"], titan_none["peak"])
        for name in (f"{model}/full", f"{model}/matmuls"):  # all-to-alls saved
            for row in cases[name]:
                # what crosses to the backward: eager's saved tensors plus the all-to-all outputs
                # (eager replays the all-to-alls; 1 % for the layout of a few small values)
                assert row["saved"] <= 1.01 * (row["eager_saved"] + row["comm_saved"]), (rank, name, row)
                assert row["comm_saved"] > 0, (rank, name, row)
        if model == "moe":  # and without AC the program keeps what eager keeps (no less)
            assert none["saved"] <= 1.01 * none["eager_saved"], (rank, none)
            assert full["saved"] < 0.3 * none["saved"], (rank, full["saved"], none["saved"])


@pytest.mark.parametrize("model", MODELS)
def test_replayed_all_to_alls_keep_what_eager_keeps(model):
    """OverlapConfig(ac_replay_comm=True): the checkpointed regions' all-to-alls are replayed
    in the backward, as eager's checkpoint does, in recompute stages on the comm stream, so
    the program keeps what eager keeps and no all-to-all output; results stay bitwise."""
    for rank, cases in enumerate(_two_ranks(model)):
        saved, replayed = cases[f"{model}/full"], cases[f"{model}/full/replay"]
        for keep, rep in zip(saved, replayed):
            assert rep["exact"] and rep["comm_saved"] == 0, (rank, model, rep)
            assert rep["saved"] <= 1.01 * rep["eager_saved"], (rank, model, rep)
            assert rep["saved"] <= keep["saved"] - keep["comm_saved"], (rank, model, rep, keep)
            assert rep["peak"] < keep["peak"], (rank, model, rep["peak"], keep["peak"])
        kinds = dict(replayed[0]["stages"])
        moe_layers = (0, 1) if model == "titan" else (0, 2, 3)
        for i in moe_layers:  # dispatch and combine replayed, compute split around them
            assert kinds[f"bwd_l{i}_recompute_comm"] == kinds[f"bwd_l{i}_recompute_comm1"] == "recompute_comm"
            assert kinds[f"bwd_l{i}_recompute2"] == "recompute"
        assert "bwd_l1_recompute_comm" not in kinds or model == "titan"  # the dense layer has none


def test_replayed_all_to_alls_run_on_the_comm_stream_before_their_readers():
    stages = _replay_stages()
    by = {s.name: s for s in stages}
    assert by["bwd_l0_recompute_comm"].stream.value == "comm" and by["bwd_l0_recompute1"].stream.value == "comp"
    assert not by["bwd_l0_recompute_comm"].capturable
    program = build_program(stages, _replay_capture[0], 3, fxoverlap.OverlapConfig())
    order = [(n.meta["fxoverlap_step"].stage, n.meta["fxoverlap_step"].microbatch) for n in program.graph.nodes
             if "fxoverlap_step" in n.meta and n.meta["fxoverlap_step"].stage]
    for mb in range(3):
        pos = {name: i for i, (name, m) in enumerate(order) if m == mb}
        chain = ["bwd_l0_recompute", "bwd_l0_recompute_comm", "bwd_l0_recompute1", "bwd_l0_recompute_comm1",
                 "bwd_l0_recompute2"]
        assert [pos[c] for c in chain] == sorted(pos[c] for c in chain), (mb, [pos[c] for c in chain])
        first_reader = min(pos[s.name] for s in stages if set(by["bwd_l0_recompute2"].outputs) & set(s.inputs))
        assert pos["bwd_l0_recompute2"] < first_reader


@pytest.mark.parametrize("replay", [False, True])
def test_saved_all_to_alls_are_named(replay, capsys):
    """By default the compile says which layers keep their checkpointed all-to-all outputs,
    and how to replay them instead; with the replay, it has nothing to say."""
    build_stages(capture(_model("config"), _batch()), fxoverlap.OverlapConfig(ac_replay_comm=replay), "cpu")
    err = capsys.readouterr().err
    assert ("keeps the all-to-all outputs of layers 0 for the backward" in err) is not replay, err
    gm = recompute(tag(capture(_model("config"), _batch())), CFG.n_layers, replay_comm=replay)
    assert gm.meta[SAVED_COMM_KEY] == ([] if replay else [0])
    plain = recompute(tag(capture(_model("none"), _batch())), CFG.n_layers)
    assert plain.meta[SAVED_COMM_KEY] == []


_replay_capture: list = []


def _replay_stages():
    model = _model("config")
    tokens, labels = _batch()
    cap = capture(model, (tokens, labels))
    _replay_capture[:] = [cap]
    config = fxoverlap.OverlapConfig(ac_replay_comm=True)
    return build_stages(cap, config, "cpu")


# ------------------------------------------------------------------ one rank

CFG = MoEConfig.tiny(n_layers=2, dim=32, n_heads=2, n_experts=4, expert_dim=16, vocab_size=64,
                     layer_pattern=("moe", "dense"), shared_expert_dim=16)


def _model(ac: str, **overrides) -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(dataclasses.replace(CFG, activation_checkpoint=ac == "config", **overrides))
    if ac == "wrapper":
        ac_cases.checkpoint_layers(model)
    elif ac == "partial":  # a layer's forward replaced by a checkpoint of itself
        for layer in model.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    return model


def _batch(step: int = 0):
    g = torch.Generator().manual_seed(step)
    return tuple(torch.randint(0, CFG.vocab_size, (2, 16), generator=g) for _ in range(2))


def _forward_stages(stages) -> list[str]:
    return [s.name for s in stages if s.direction.value == "fwd"]


@pytest.mark.parametrize("ac", ["config", "wrapper", "partial"])
def test_one_rank_layer_children_keep_their_split(ac):
    plain = split(tag(capture(_model("none"), _batch())), CFG.n_layers)
    cap = capture(_model(ac), _batch())
    stages = split(recompute(tag(cap), cap.num_layers), cap.num_layers)
    assert _forward_stages(stages) == _forward_stages(plain)
    assert "fwd_l1_attn" in _forward_stages(stages) and "fwd_l1_mlp" in _forward_stages(stages)
    assert [s.name for s in stages if s.kind.value == "recompute"] == ["bwd_l1_recompute", "bwd_l0_recompute"]


def test_one_rank_forward_only():
    model = _model("wrapper")
    tokens, _ = _batch()
    with torch.no_grad():
        ref = model(tokens)
    engine = fxoverlap.optimize(model)
    assert torch.equal(engine(tokens), ref)


_COMPILED: dict = {}


def _compiled(mode: str) -> tuple[list, int]:
    """torch.compile(backend="fxoverlap") vs eager, two steps, bitwise; the stages and
    the bytes they keep for the backward (capacity routing: static sizes)."""
    if mode not in _COMPILED:
        eager, model = _model(mode, routing="capacity"), _model(mode, routing="capacity")
        torch._dynamo.reset()
        fxb.reset()
        compiled = torch.compile(model, backend="fxoverlap", dynamic=False)
        for step in range(2):
            batch = _batch(step)
            ref = eager(*batch)
            ref.backward()
            loss = compiled(*batch)
            loss.backward()
            assert torch.equal(loss, ref), (mode, step)
        worst, scale, bitwise = grad_diff(model, {n: p.grad for n, p in eager.named_parameters()})
        assert bitwise, (mode, worst, scale)
        step_obj = fxb.last_compiled()
        assert step_obj is not None, f"{mode}: the backend fell back"
        _COMPILED[mode] = (step_obj.stages, ac_cases.crossing_bytes(step_obj.stages))
    return _COMPILED[mode]


@pytest.mark.parametrize("ac", ["config", "wrapper"])
def test_backend_keeps_split_numerics_and_saving(ac):
    (plain, plain_bytes), (stages, ac_bytes) = _compiled("none"), _compiled(ac)
    assert _forward_stages(stages) == _forward_stages(plain)
    assert [s.name for s in stages if s.kind.value == "recompute"] == ["bwd_l1_recompute", "bwd_l0_recompute"]
    assert ac_bytes < 0.5 * plain_bytes, (ac_bytes, plain_bytes)


@pytest.mark.filterwarnings("ignore:Error detected in CheckpointFunctionBackward")  # torch's anomaly note
def test_reentrant_checkpoint_is_refused():
    model = _model("none")
    for layer in model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=True)
    with pytest.raises(CaptureError, match=r"use_reentrant=True.*pass use_reentrant=False"):
        capture(model, _batch())


# ------------------------------------------------------------------ snapshot


def render_recompute(stages, layer: int) -> str:
    """The recompute stage of ``layer``: where each input comes from, then its ops."""
    producer = {o: s.name for s in stages for o in s.outputs}
    rec = next(s for s in stages if s.name == f"bwd_l{layer}_recompute")
    by_stage: dict[str, list[str]] = {}
    for v in rec.inputs:
        by_stage.setdefault(producer.get(v, "parameter/input"), []).append(v)
    readers = sorted({s.name for s in stages if set(rec.outputs) & set(s.inputs)})
    lines = [f"reads {k}: {', '.join(vs)}" for k, vs in by_stage.items()]
    lines.append(f"read by: {', '.join(readers)}")
    lines.append("ops: " + " ".join(o.split(".")[-1] for o in rec.op_list()))
    return "\n".join(lines)


@requires_pinned_torch
class TestRecomputeStageSnapshot(expecttest.TestCase):
    def _stages(self, policy=None):
        torch.manual_seed(0)
        model = MoETransformer(MoEConfig.tiny(n_layers=1, dim=16, n_heads=2, n_experts=4, expert_dim=16, vocab_size=32))
        ac_cases.checkpoint_layers(model, policy)
        g = torch.Generator().manual_seed(0)
        cap = capture(model, tuple(torch.randint(0, 32, (1, 8), generator=g) for _ in range(2)))
        return split(recompute(tag(cap), cap.num_layers), cap.num_layers)

    def test_full_ac(self):
        self.assertExpectedInline(render_recompute(self._stages(), 0), """\
reads fwd_l0_combine: combine
reads fwd_model_embed: embedding
reads parameter/input: primals_2, primals_3, primals_14, primals_15, primals_4, primals_5, primals_6, primals_7, primals_8, primals_9, primals_10
reads fwd_l0_dispatch: getitem_10, getitem_11
read by: bwd_l0_attn, bwd_l0_combine, bwd_l0_dispatch, bwd_l0_experts, bwd_l0_post
ops: zeros_like pow mean add rsqrt mul mul view t mm _unsafe_view view transpose split getitem slice mul getitem slice mul sub mul mul add cat view t mm _unsafe_view view transpose split getitem slice mul getitem slice mul sub mul mul add cat view t mm _unsafe_view view transpose _scaled_dot_product_flash_attention_for_cpu getitem transpose clone _unsafe_view view t mm _unsafe_view add pow mean add rsqrt mul mul view t mm _softmax topk getitem view sort getitem index_copy view getitem unsqueeze unsqueeze arange eq _to_copy sum sym_size sum cumsum _to_copy grouped_mm silu grouped_mm mul floor_divide detach detach detach getitem detach""")

    def test_matmuls_saved(self):
        self.assertExpectedInline(render_recompute(self._stages(ac_cases.save_matmuls), 0), """\
reads fwd_l0_combine: combine
reads fwd_l0_attn: mm_4, mm_3, mm, mm_1, mm_2
reads fwd_l0_dispatch: getitem_10, getitem_11
reads fwd_l0_experts: grouped_mm, grouped_mm_1
reads fwd_model_embed: embedding
reads parameter/input: primals_7, primals_8, primals_14, primals_15, primals_6, primals_2, primals_5, primals_4, primals_3
read by: bwd_l0_attn, bwd_l0_combine, bwd_l0_dispatch, bwd_l0_experts, bwd_l0_post
ops: zeros_like detach _softmax topk getitem view sort getitem index_copy view getitem unsqueeze unsqueeze arange detach eq _to_copy sum sym_size sum cumsum _to_copy silu mul floor_divide detach _unsafe_view add pow mean add rsqrt mul mul view t detach _unsafe_view view transpose split getitem slice mul getitem slice mul sub mul mul add cat _unsafe_view view transpose split getitem slice mul getitem slice mul sub mul mul add cat _unsafe_view view transpose _scaled_dot_product_flash_attention_for_cpu getitem transpose clone _unsafe_view view t detach getitem pow mean add rsqrt mul mul view t view t view t detach""")
