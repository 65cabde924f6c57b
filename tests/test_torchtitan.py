"""torchtitan 0.3.0's Qwen3-MoE and DeepSeek-V3 as shipped, in training mode, through ``fxoverlap.optimize``.

The models, their MoE (``tokens_per_expert_E`` counted in every training forward),
their token dispatcher and, on 2 gloo ranks, their expert parallelism
(``model.parallelize(ParallelDims(ep=2, spmd_backend="partial_dtensor"))``: expert
weights are ``Shard(0)`` DTensors) are torchtitan's own; ``support/titan_real.py`` lists the
two test-side changes (SDPA attention on CPU; a CPU mesh). Against eager on the same
model and data (``loss.backward()`` per microbatch), 3 microbatches: losses, every
gradient (its kind too: DTensor placements and mesh) and every buffer are bitwise
equal, and on 2 ranks every all-to-all, forward and backward, runs in a dispatch or
combine stage on the comm stream.

Needs ``pip install --no-deps torchtitan==0.3.0`` (the README's test command does it);
torchtitan 0.3.0 needs torch >= 2.12, so a machine with an older torch skips these.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.qwen3", reason="torchtitan 0.3.0 is not installed (or needs a newer torch)")
pytest.importorskip("torchtitan.models.deepseek_v3")

import titan_real  # noqa: E402
from fxoverlap.testing import run_distributed  # noqa: E402

N = 3
FAMILIES = ["qwen3_moe", "deepseek_v3"]
MOE_LAYERS = {"qwen3_moe": [0, 1], "deepseek_v3": [1, 2]}  # DeepSeek-V3's first layer is dense
TOP_K = 2


def _check_exact(r: dict, family: str) -> None:
    assert r["losses_equal"] == [True] * N, r["losses_equal"]
    assert r["grads"] and all(v is True for v in r["grads"].values()), {k: v for k, v in r["grads"].items() if v is not True}
    assert r["buffers"] and all(r["buffers"].values()), r["buffers"]
    # the load-balance counters moved: every microbatch's tokens, top-k each, once
    assert r["counted"] == {f"layers.{i}.moe.tokens_per_expert_E": float(N * 32 * TOP_K) for i in MOE_LAYERS[family]}


# DeepSeek-V3 on one rank is `slow`: test_two_ranks_torchtitan_expert_parallel[deepseek_v3] runs
# the family by default, with its expert parallelism on top.
@pytest.mark.parametrize("family", [f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_one_rank(family):
    r = titan_real.train_vs_eager(family, ep=1, n=N)
    _check_exact(r, family)
    assert r["comm_stages"] == {} and r["dtensor_grads"] == []


def test_one_rank_fp8_experts(fp8_here):
    """``OverlapConfig(expert_dtype="fp8_rowwise")`` on torchtitan's Qwen3-MoE with its own token
    dispatcher: the experts' GEMMs go through torchtitan's ``_grouped_mm`` seam to fxoverlap's FP8
    ops (their row groups padded to 16), bitwise eager's with the same FP8 ops, the weight
    gradients in their own delayed stages; the option changed the numbers (not bf16's)."""
    r = titan_real.train_vs_eager("qwen3_moe", ep=1, n=N, delay_wgrad=True, config=dict(expert_dtype="fp8_rowwise"))
    _check_exact(r, "qwen3_moe")
    ops = r["stage_ops"]
    for layer in MOE_LAYERS["qwen3_moe"]:
        assert ops[f"fwd_l{layer}_mlp"].count("fxoverlap.grouped_mm_fp8") == 3, ops[f"fwd_l{layer}_mlp"]
        wgrad = [name for name in ops if name.startswith(f"bwd_l{layer}_") and name.endswith("_wgrad")]
        assert sum(ops[name].count("fxoverlap.grouped_mm_fp8_wgrad") for name in wgrad) == 3, wgrad
    assert not any("_grouped_mm" in op.split(".")[-1] and "fp8" not in op for o in ops.values() for op in o)
    bf16 = titan_real.train_vs_eager("qwen3_moe", ep=1, n=1)
    assert r["grads"] and bf16["losses_equal"] == [True]
    assert r["fp8_loss0"] != bf16["fp8_loss0"]


def test_one_rank_through_the_backend(monkeypatch):
    """torch.compile(model, backend="fxoverlap") on torchtitan's Qwen3-MoE as shipped: no
    fallback, bitwise losses, gradients and load-balance counters over accumulating
    microbatches, with the backward in one segment per gradient hand-out."""
    import fxoverlap.backend as fxb

    monkeypatch.setattr(fxb.fxoverlap_backend, "segment_min_grad_bytes", 0)
    r = titan_real.backend_vs_eager("qwen3_moe", n=N)
    _check_exact(r, "qwen3_moe")
    assert r["segments"] > 2, r["segments"]
    assert [name for name, *_ in r["stages"] if name.startswith("fwd_l")] == [
        "fwd_l0_attn", "fwd_l0_mlp", "fwd_l1_attn", "fwd_l1_mlp"]


def test_one_rank_activation_checkpointing():
    """torchtitan's FullAC: each checkpointed layer is replayed by a recompute stage, the numerics
    are eager's, and each token is counted once, where eager's replay counts it twice
    (torchtitan's MoE notes this; its bias update only reads the sign)."""
    r = titan_real.train_vs_eager("qwen3_moe", ep=1, n=N, wrap=titan_real.full_activation_checkpointing)
    assert r["losses_equal"] == [True] * N and all(v is True for v in r["grads"].values()), r
    assert [name for name, kind, _ in r["stages"] if kind == "recompute"] == ["bwd_l1_recompute", "bwd_l0_recompute"]
    wrapped = [f"layers.{i}._checkpoint_wrapped_module.moe.tokens_per_expert_E" for i in MOE_LAYERS["qwen3_moe"]]
    assert r["counted"] == {k: float(N * 32 * TOP_K) for k in wrapped}, r["counted"]
    assert r["eager_counted"] == {k: 2.0 * N * 32 * TOP_K for k in wrapped}, r["eager_counted"]


_TWO: list = []


def _two_ranks() -> list[dict]:
    if not _TWO:  # one spawn for every 2-rank case
        _TWO.append(run_distributed(titan_real.two_ranks, N))
    return _TWO[0]


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe/delay_wgrad", "deepseek_v3"])
def test_two_ranks_torchtitan_expert_parallel(case):
    family = case.split("/")[0]
    for rank_results in _two_ranks():
        r = rank_results[case]
        _check_exact(r, family)
        if case.endswith("delay_wgrad"):  # the experts' three weight-gradient GEMMs too, not only attention's
            ops = r["stage_ops"]
            assert all(ops[f"bwd_l{i}_experts_wgrad"].count("aten._grouped_mm") == 3 and
                       ops[f"bwd_l{i}_experts"].count("aten._grouped_mm") == 3 for i in MOE_LAYERS[family]), ops
        experts = [f"layers.{i}.moe.routed_experts.inner_experts.{w}" for i in MOE_LAYERS[family]
                   for w in ("w1_EFD", "w2_EDF", "w3_EFD")]
        assert r["dtensor_grads"] == sorted(experts), r["dtensor_grads"]
        assert r["misplaced"] == {}, r["misplaced"]
        # per MoE layer: forward dispatch (token counts + tokens) and combine, backward both
        assert r["comm_stages"] == {k: v for i in MOE_LAYERS[family] for k, v in {
            f"fwd_l{i}_dispatch": 2, f"fwd_l{i}_combine": 1, f"bwd_l{i}_dispatch": 1, f"bwd_l{i}_combine": 1}.items()}
        comm = {name: stream for name, kind, stream in r["stages"] if kind in ("dispatch", "combine")}
        assert comm and set(comm.values()) == {"comm"}, comm
        assert (r["wgrad_stages"] > 0) == case.endswith("delay_wgrad"), r["wgrad_stages"]


def test_two_ranks_fp8_experts_in_chunks():
    """torchtitan's EP (its dispatcher, DTensor expert weights), FP8 experts, 2 chunks and the
    delayed weight gradient: bitwise eager's with the same FP8 ops; each experts chunk runs the FP8
    ops, and the weight-gradient GEMMs are in wgrad stages."""
    for rank_results in _two_ranks():
        r = rank_results["qwen3_moe/fp8_chunks"]
        _check_exact(r, "qwen3_moe")
        ops = r["stage_ops"]
        for i in MOE_LAYERS["qwen3_moe"]:
            for c in (0, 1):
                assert ops[f"fwd_l{i}_experts_c{c}"].count("fxoverlap.grouped_mm_fp8") == 3, ops[f"fwd_l{i}_experts_c{c}"]
            wgrad = [name for name in ops if name.startswith(f"bwd_l{i}_experts") and name.endswith("_wgrad")]
            assert sum(ops[name].count("fxoverlap.grouped_mm_fp8_wgrad") for name in wgrad) >= 6, wgrad
        assert not any(op == "aten._grouped_mm" for o in ops.values() for op in o)


def test_fsdp_wrapped_model_is_refused():
    for rank_results in _two_ranks():
        msg = rank_results["fsdp_error"]
        assert "layers.0.attention is wrapped by FSDP2 (fully_shard)" in msg and "Leave data parallelism" in msg, msg


@pytest.mark.parametrize("tail", [0, 7], ids=["rows_are_the_groups", "capacity_tail"])
def test_gpt_oss_experts_padded_through_the_seam(monkeypatch, tail):
    """torchtitan's GPT-OSS experts (biases, clamped SwiGLU, its own tail-slack handling) through
    the seam with each group padded to 16 rows equal the unpadded seam bitwise in bf16: output,
    input and every weight and bias gradient. With a capacity dispatcher's tail (rows past the
    groups, no gradient back), ``ops.pad_groups(tail=True)`` carries the rows along."""
    import torch
    from torchtitan.models.gpt_oss import _make_gptoss_experts_config

    from fxoverlap import fp8_ops, torchtitan_experts

    monkeypatch.setattr(torchtitan_experts, "_groups_fill_rows", lambda model, name: tail == 0)
    torch.manual_seed(0)
    routed = _make_gptoss_experts_config(dim=32, hidden_dim=16, num_experts=4, layer_id=0, top_k=2,
                                         moe_comm_backend="standard").build()
    routed.init_states()
    routed = routed.to(torch.bfloat16)
    counts = torch.tensor([5, 0, 17, 18])
    x0 = torch.randn(int(counts.sum()) + tail, 32, dtype=torch.bfloat16)
    dy = torch.randn_like(x0)
    dy[int(counts.sum()):] = 0  # rows past the groups: the combine drops them
    runs = []
    for align in (1, 16):
        routed.zero_grad()
        x = x0.clone().requires_grad_()
        with fp8_ops.expert_math(None, row_align=align), torchtitan_experts.fxoverlap_gemms(routed) as names:
            y = routed.inner_experts(x, counts)
        assert names == ["inner_experts"]
        y.backward(dy)
        runs.append([y[:int(counts.sum())].detach(), x.grad[:int(counts.sum())],
                     *(p.grad for p in routed.inner_experts.parameters())])
    assert "forward" not in vars(routed.inner_experts) and "_grouped_mm" not in vars(routed.inner_experts)
    assert len(runs[0]) == 6 and all(torch.equal(a, b) for a, b in zip(*runs))


def test_fp8_refuses_experts_already_quantized_by_torchtitan():
    """A GroupedExperts whose class replaced the seam (what torchtitan's Float8/MXFP8 converters
    build): one quantizer at a time, named, and nothing left patched."""
    import torch.nn as nn
    from torchtitan.models.common.moe import GroupedExperts

    from fxoverlap import Fp8ExpertError, torchtitan_experts

    class Float8Experts(GroupedExperts):
        def _grouped_mm(self, *, A, B_t, offs):
            return super()._grouped_mm(A=A, B_t=B_t, offs=offs)

    model = nn.Sequential(Float8Experts(Float8Experts.Config(dim=32, hidden_dim=16, num_experts=4)))
    with pytest.raises(Fp8ExpertError, match=r"0 \(.*Float8Experts\) already runs its own _grouped_mm"):
        with torchtitan_experts.fxoverlap_gemms(model):
            pass
    assert "forward" not in vars(model[0]) and "_grouped_mm" not in vars(model[0])
