"""mHC recompute: numerics equal eager, recompute lowers the live-bytes peak, snapshots, errors."""

from __future__ import annotations

import expecttest
import pytest
import torch

import fxoverlap
import recompute_cases
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.passes import capture, split, tag
from fxoverlap.passes.recompute import RecomputeError, recompute
from fxoverlap.passes.schedule import schedule
from fxoverlap.testing import run_distributed
from snapshot_utils import render_program, requires_pinned_torch

MHC = dict(mhc_rate=4, n_layers=3)
CASES = [
    # (model config, recompute group): mHC on/off x recompute on/off x final layer x MTP
    (dict(n_layers=3, layer_pattern=("moe", "moe", "dense")), None),
    (dict(MHC, layer_pattern=("moe", "dense", "moe"), mtp=True), None),
    (dict(MHC, layer_pattern=("moe", "dense", "moe"), mtp=True), 2),
    (dict(MHC, layer_pattern=("moe", "moe", "dense")), 1),
    (dict(MHC, layer_pattern=("moe", "moe", "dense"), mtp=True), 2),
]
NS = [1, 2, 3]
# The default suite runs CASES 1 and 2 (mHC + MTP, without and with recompute: the peak test
# compares them) at 1 and 3 microbatches (2 is 3's interleaved path, fewer in flight); the
# others are `slow` (CI's second step), at NS. Each group shares one spawn.
FAST_CASES = [1, 2]
FAST_NS = [1, 3]
_RESULTS: dict = {}


def _reference(i: int = FAST_CASES[0]) -> dict[int, list]:
    """Rank -> {case index: rows} for the cases of ``i``'s group (one spawn per group)."""
    fast = i in FAST_CASES
    if fast not in _RESULTS:
        idx = [j for j in range(len(CASES)) if (j in FAST_CASES) == fast]
        ranks = run_distributed(recompute_cases.reference, [CASES[j] for j in idx], FAST_NS if fast else NS)
        _RESULTS[fast] = [dict(zip(idx, rows)) for rows in ranks]
    return _RESULTS[fast]


def _assert_exact(row):
    assert row["losses_equal"], row
    assert row["diff"] <= 1e-6 * row["scale"] and row["bitwise"], row


@pytest.mark.parametrize("i", [pytest.param(i, id=f"{c[0]}-group{c[1]}",
                                            marks=() if i in FAST_CASES else pytest.mark.slow)
                               for i, c in enumerate(CASES)])
def test_mhc_numerics_match_eager(i):
    """Per microbatch count (FAST_NS or NS); with 2+ microbatches in flight, an MTP gradient that
    strayed to the wrong microbatch would show up as a gradient mismatch."""
    for rank_rows in _reference(i):
        for row in rank_rows[i]:
            _assert_exact(row)
        recompute_stages = rank_rows[i][0]["recompute"]
        group = CASES[i][1]
        if group is None:
            assert recompute_stages == []
        else:  # one stage per group, named after the group's top layer; 3 layers
            tops = sorted({min(g + group, 3) - 1 for g in range(0, 3, group)}, reverse=True)
            assert recompute_stages == [f"bwd_l{t}_recompute" for t in tops]


def test_recompute_lowers_live_bytes_peak():
    for rank_rows in _reference():
        off = [r["peak"] for r in rank_rows[1]]  # mtp, final moe, no recompute
        on = [r["peak"] for r in rank_rows[2]]  # same model, group 2
        assert all(b < 0.85 * a for a, b in zip(off, on)), (off, on)


@pytest.mark.slow
def test_standalone_hyper_connection_model():
    results = run_distributed(recompute_cases.standalone, [None, 1, 2])
    for rank_rows in results:
        for rows in rank_rows:
            for row in rows:
                _assert_exact(row)
        assert rank_rows[0][0]["recompute"] == []
        assert rank_rows[1][0]["recompute"] == ["bwd_l2_recompute", "bwd_l1_recompute", "bwd_l0_recompute"]
        assert rank_rows[2][0]["peak"] < rank_rows[0][0]["peak"]


def _mhc_stages(group: int):
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(mhc_rate=2, n_layers=3, dim=16, n_heads=2, n_experts=4, expert_dim=16,
                         vocab_size=32, layer_pattern=("moe", "dense", "moe"))
    model = MoETransformer(cfg)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 32, (1, 8), generator=g), torch.randint(0, 32, (1, 8), generator=g))
    cap = capture(model, batch)
    gm = recompute(tag(cap), cap.num_layers, group)
    return cap, split(gm, cap.num_layers)


@requires_pinned_torch
class TestRecomputeSnapshot(expecttest.TestCase):
    def test_program_with_recompute_group_not_dividing_layers(self):
        cap, stages = _mhc_stages(group=2)  # 3 layers: groups {0, 1} and {2}
        self.assertExpectedInline(render_program(schedule(stages, cap, 2)), """\
def forward(self):
F0_model_embed = self.fwd_model_embed(0)
F0_l0_attn = self.fwd_l0_attn(0)
F0_l0_dispatch = self.fwd_l0_dispatch(0)
F0_l0_experts = self.fwd_l0_experts(0)
F0_l0_combine = self.fwd_l0_combine(0)
F0_l0_post = self.fwd_l0_post(0)
F0_l1_attn = self.fwd_l1_attn(0)
F0_l1_mlp = self.fwd_l1_mlp(0)
F0_l2_attn = self.fwd_l2_attn(0)
F0_l2_dispatch = self.fwd_l2_dispatch(0)
F0_l2_experts = self.fwd_l2_experts(0)
F0_l2_combine = self.fwd_l2_combine(0)
F0_l2_post = self.fwd_l2_post(0)
F0_model_head = self.fwd_model_head(0)
output_F0_model_head = fxoverlap_program_output(0, 'getitem_30')
B0_model_head = self.bwd_model_head(0)
accumulate_B0_model_head = fxoverlap_program_accumulate(0, 't_39', 'view_121', 'squeeze_6')
B0_l2_recompute = self.bwd_l2_recompute(0)
B0_l2_post = self.bwd_l2_post(0)
F1_model_embed = self.fwd_model_embed(1)
F1_l0_attn = self.fwd_l0_attn(1)
B0_l2_combine = self.bwd_l2_combine(0)
B0_l2_experts = self.bwd_l2_experts(0)
accumulate_B0_l2_experts = fxoverlap_program_accumulate(0, 'grouped_mm_wgrad', 'grouped_mm_wgrad_1', 'grouped_mm_wgrad_2')
F1_l0_dispatch = self.fwd_l0_dispatch(1)
F1_l0_experts = self.fwd_l0_experts(1)
B0_l2_dispatch = self.bwd_l2_dispatch(0)
B0_l2_attn = self.bwd_l2_attn(0)
accumulate_B0_l2_attn = fxoverlap_program_accumulate(0, <21 values>)
F1_l0_combine = self.fwd_l0_combine(1)
F1_l0_post = self.fwd_l0_post(1)
F1_l1_attn = self.fwd_l1_attn(1)
B0_l1_recompute = self.bwd_l1_recompute(0)
B0_l1_mlp = self.bwd_l1_mlp(0)
accumulate_B0_l1_mlp = fxoverlap_program_accumulate(0, 't_87', 't_91', 't_95')
F1_l1_mlp = self.fwd_l1_mlp(1)
B0_l1_attn = self.bwd_l1_attn(0)
accumulate_B0_l1_attn = fxoverlap_program_accumulate(0, <20 values>)
B0_l0_post = self.bwd_l0_post(0)
F1_l2_attn = self.fwd_l2_attn(1)
B0_l0_combine = self.bwd_l0_combine(0)
B0_l0_experts = self.bwd_l0_experts(0)
accumulate_B0_l0_experts = fxoverlap_program_accumulate(0, 'grouped_mm_wgrad_3', 'grouped_mm_wgrad_4', 'grouped_mm_wgrad_5')
F1_l2_dispatch = self.fwd_l2_dispatch(1)
F1_l2_experts = self.fwd_l2_experts(1)
B0_l0_dispatch = self.bwd_l0_dispatch(0)
B0_l0_attn = self.bwd_l0_attn(0)
accumulate_B0_l0_attn = fxoverlap_program_accumulate(0, <21 values>)
F1_l2_combine = self.fwd_l2_combine(1)
F1_l2_post = self.fwd_l2_post(1)
F1_model_head = self.fwd_model_head(1)
output_F1_model_head = fxoverlap_program_output(1, 'getitem_30')
B0_model_embed = self.bwd_model_embed(0)
accumulate_B0_model_embed = fxoverlap_program_accumulate(0, 'embedding_dense_backward')
B1_model_head = self.bwd_model_head(1)
accumulate_B1_model_head = fxoverlap_program_accumulate(1, 't_39', 'view_121', 'squeeze_6')
B1_l2_recompute = self.bwd_l2_recompute(1)
B1_l2_post = self.bwd_l2_post(1)
B1_l2_combine = self.bwd_l2_combine(1)
B1_l2_experts = self.bwd_l2_experts(1)
accumulate_B1_l2_experts = fxoverlap_program_accumulate(1, 'grouped_mm_wgrad', 'grouped_mm_wgrad_1', 'grouped_mm_wgrad_2')
B1_l2_dispatch = self.bwd_l2_dispatch(1)
B1_l2_attn = self.bwd_l2_attn(1)
accumulate_B1_l2_attn = fxoverlap_program_accumulate(1, <21 values>)
B1_l1_recompute = self.bwd_l1_recompute(1)
B1_l1_mlp = self.bwd_l1_mlp(1)
accumulate_B1_l1_mlp = fxoverlap_program_accumulate(1, 't_87', 't_91', 't_95')
B1_l1_attn = self.bwd_l1_attn(1)
accumulate_B1_l1_attn = fxoverlap_program_accumulate(1, <20 values>)
B1_l0_post = self.bwd_l0_post(1)
B1_l0_combine = self.bwd_l0_combine(1)
B1_l0_experts = self.bwd_l0_experts(1)
accumulate_B1_l0_experts = fxoverlap_program_accumulate(1, 'grouped_mm_wgrad_3', 'grouped_mm_wgrad_4', 'grouped_mm_wgrad_5')
B1_l0_dispatch = self.bwd_l0_dispatch(1)
B1_l0_attn = self.bwd_l0_attn(1)
accumulate_B1_l0_attn = fxoverlap_program_accumulate(1, <21 values>)
B1_model_embed = self.bwd_model_embed(1)
accumulate_B1_model_embed = fxoverlap_program_accumulate(1, 'embedding_dense_backward')""")


def test_recompute_errors():
    with pytest.raises(ValueError, match="mhc_recompute_group must be >= 1"):
        fxoverlap.OverlapConfig(mhc_recompute_group=0)
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny())  # no mHC
    engine = fxoverlap.optimize(model, config=fxoverlap.OverlapConfig(mhc_recompute_group=2))
    tokens = torch.randint(0, 256, (2, 16))
    with pytest.raises(RecomputeError, match=r"mhc_recompute_group=2 but no decoder-layer node is marked fxoverlap.region\('mhc'\)"):
        engine.forward_backward([(tokens, tokens)])
    with pytest.raises(ValueError, match="mhc_rate"):
        MoEConfig.tiny(mhc_rate=0)
