"""The dispatcher pass: backends chosen by OverlapConfig(dispatcher=...), lowered before tag.

2 gloo ranks (two spawns, shared by the tests that read them): the ``padded`` backend
equals eager bitwise with zero host reads in a step after the capture; ``all_to_all``
reads the split sizes (which shows the counter counts); capacity factors, overflow.
In-process: the host-read counter itself, errors, and expecttest snapshots of the
lowered graph (one rank). Regenerate snapshots with EXPECTTEST_ACCEPT=1.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn as nn

import dispatcher_cases as cases
import fxoverlap
from fxoverlap import ops
from fxoverlap.engine import format_stage_table
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.models.moe import GroupedExperts
from fxoverlap.passes import capture, split, tag
from fxoverlap.passes.dispatcher import DispatcherError, dispatcher
from fxoverlap.ir.meta import TAG_KEY, op_name
from fxoverlap.testing import run_distributed_once
from snapshot_utils import requires_pinned_torch

ROUTINGS = ["dropless", "dedup", "capacity"]


def _rows(backend: str) -> list[dict]:
    rows = [r for rank in run_distributed_once(cases.backends_match_eager, ROUTINGS, ["all_to_all", "padded"])
            for r in rank]
    return [r for r in rows if r["backend"] == backend]


@pytest.mark.parametrize("routing", ROUTINGS)
def test_padded_matches_eager_bitwise_without_host_reads(routing):
    for r in (r for r in _rows("padded") if r["routing"] == routing):
        assert r["losses_equal"] and r["bitwise"], r
        assert r["python_reads"] == {} and r["aten_syncs"] == {}, r
        assert r["experts"] and all(ok for _, ok in r["experts"]), r  # static shapes: CUDA-graph capturable


@pytest.mark.parametrize("routing", ROUTINGS)
def test_all_to_all_reads_split_sizes_on_the_host(routing):
    for r in (r for r in _rows("all_to_all") if r["routing"] == routing):
        assert r["losses_equal"] and r["bitwise"], r
        # one read per forward dispatch (2 layers x 2 microbatches); the rest reuse it
        assert r["python_reads"] == {"tolist": 4} and r["aten_syncs"] == {}, r
        # dropless shapes are data-dependent; capacity routing is static already
        assert all(ok for _, ok in r["experts"]) == (routing == "capacity"), r


def test_capacity_factor_reads_one_flag_and_overflow_raises_cleanly():
    for r in run_distributed_once(cases.overflow_and_edges):
        roomy, tight = r["roomy"], r["tight"]
        assert roomy["losses_equal"] and roomy["bitwise"] and roomy["wgrad_stages"] > 0, roomy
        assert roomy["python_reads"] == {"tolist": 1} and roomy["aten_syncs"] == {}, roomy  # the end-of-step read
        msg = tight["raised"]
        assert msg is not None and tight["grads_kept"], tight
        # names the layer, the rows needed and the capacity (factor 0.25 of 64 / 2 rows per link: 8)
        assert "layer 0 (dispatch)" in msg and "layer 1 (dispatch_" in msg and "capacity 8 (worst case 64)" in msg, msg
        assert "rows on one rank-to-rank link" in msg and "dispatch_capacity_factor to at least" in msg, msg
        assert r["forward_only"]


def test_static_ops_on_skewed_routing_equal_the_generic_ones():
    for r in run_distributed_once(cases.overflow_and_edges):
        o = r["ops"]
        assert o["dispatch"] and o["padding_zero"] and o["counts"] and o["combine"] and o["backward_dispatch"], o


def test_counter_sees_python_reads_and_syncing_ops_inside_custom_ops():
    t, offs = torch.tensor([0, 2, 1]), torch.tensor([1, 3], dtype=torch.int32)
    with cases.count_host_reads() as reads:
        t.tolist(), int(t[1]), bool(t[0]), t[1].item()
        torch.nonzero(t), t.repeat_interleave(t), t.repeat_interleave(t, output_size=3), t[t > 0]
        ops.grouped_mm(torch.zeros(3, 4), torch.zeros(2, 4, 4), offs)  # torch._grouped_mm: no read
    assert reads["python"] == {"tolist": 1, "__int__": 1, "__bool__": 1, "item": 1}, reads
    assert reads["aten"] == {"aten._local_scalar_dense.default": 3, "aten.nonzero.default": 1,
                             "aten.repeat_interleave.Tensor": 1, "aten.index.Tensor": 1}, reads
    with cases.count_host_reads() as reads:  # inside a custom op: the loop fallback's offs.tolist()
        ops.grouped_mm(torch.zeros(3, 3), torch.zeros(2, 3, 3), offs)  # unaligned: the loop
    assert reads["python"] == {"tolist": 1}, reads


# ---------------------------------------------------------------- one rank, in process

CFG = dict(n_layers=1, dim=32, n_heads=2, n_experts=4, expert_dim=16, vocab_size=32)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)


def _lowered(backend="padded", factor=None, model=None, **kw):
    torch.manual_seed(0)
    cap = capture(model or MoETransformer(MoEConfig.tiny(**CFG, **kw)), _batch())
    dispatcher(cap.graph_module, backend, factor)
    return cap


def render_comm(gm: torch.fx.GraphModule) -> str:
    """One line per fxoverlap comm node: tag, name, op(inputs; constants) -> output shapes."""
    lines = []
    for n in gm.graph.nodes:
        name = op_name(n)
        if n.op != "call_function" or not name.startswith("fxoverlap.") or "grouped_mm" in name:
            continue
        t = n.meta[TAG_KEY]
        ins = ", ".join(a.name for a in n.all_input_nodes)
        consts = ", ".join(repr(a) for a in n.args if not isinstance(a, torch.fx.Node))
        vals = n.meta["val"] if isinstance(n.meta["val"], (tuple, list)) else (n.meta["val"],)
        shapes = " ".join(str(list(v.shape)) for v in vals)
        lines.append(f"{t.direction} {t.layer} {t.kind.value:<8} {n.name} = {name}({ins}; {consts}) -> {shapes}")
    return "\n".join(lines)


@requires_pinned_torch
class TestSnapshots(expecttest.TestCase):
    def test_padded_per_expert_ops(self):
        """Four comm nodes per layer with static shapes. N = 32 rows (16 tokens x top-2); factor
        0.5: capacity ceil(0.5 x N / ep) = 16 rows per link, R_max = ep x 16; below the worst
        case (N) the forward dispatch also writes the overflow buffer (site 0)."""
        cap = _lowered(factor=0.5)
        self.assertExpectedInline(render_comm(tag(cap)), """\
fwd 0 dispatch dispatch = fxoverlap.dispatch_static(index_select, sum_1, _fxoverlap_dispatch_overflow; '', None, 16, 'padded', 0) -> [16, 32] [1, 4]
fwd 0 combine  combine = fxoverlap.combine_static(grouped_mm_2, getitem_11, sum_1; '', 32, 16, 'padded') -> [32, 32]
bwd 0 combine  dispatch_1 = fxoverlap.dispatch_static(expand_2, sum_1, getitem_11; '', 16, 'padded', None, 0) -> [16, 32] [1, 4]
bwd 0 dispatch combine_1 = fxoverlap.combine_static(add_26, getitem_11, sum_1; '', 32, 16, 'padded') -> [32, 32]""")

    def test_padded_token_once_ops(self):
        """Worst case: a link carries every token once (16); pairs padded to ep x 16 x min(k, El)."""
        cap = _lowered(token_dedup=True)
        self.assertExpectedInline(render_comm(tag(cap)), """\
fwd 0 dispatch token_dispatch = fxoverlap.token_dispatch_static(view_7, getitem_7, getitem_6; 4, '', 16, 'padded', None, 0) -> [32, 32] [32] [1, 4] [32] [16, 1] [1]
fwd 0 combine  token_combine = fxoverlap.token_combine_static(mul_28, getitem_11, getitem_12, getitem_13; 2, '', 16, 'padded') -> [16, 32]
bwd 0 combine  token_combine_backward = fxoverlap.token_combine_backward_static(view_16, getitem_11, getitem_12, getitem_13; 2, '', 16, 'padded') -> [32, 32]
bwd 0 dispatch token_dispatch_backward = fxoverlap.token_dispatch_backward_static(add_36, squeeze, getitem_7, getitem_11, getitem_12, getitem_13; 4, '', 16, 'padded') -> [16, 32] [16, 2]""")

    def test_padded_stage_table(self):
        """Worst-case capacity (R_max = ep x N): every expert stage is capturable, no size node is left."""
        cap = _lowered()
        self.assertExpectedInline(format_stage_table(split(tag(cap), cap.num_layers)), """\
stage            layer  kind      dir  stream  ops  in  out  runs   capturable
fwd_model_embed  -1     embed     fwd  comp    1    2   1    eager  yes
fwd_l0_attn      0      attn      fwd  comp    93   10  33   eager  yes
fwd_l0_dispatch  0      dispatch  fwd  comm    3    2   2    eager  no: communication stage (stays eager on the comm stream)
fwd_l0_experts   0      experts   fwd  comp    8    5   6    eager  yes
fwd_l0_combine   0      combine   fwd  comm    1    3   1    eager  no: communication stage (stays eager on the comm stream)
fwd_l0_post      0      post      fwd  comp    7    4   2    eager  yes
fwd_model_head   1      head      fwd  comp    18   4   10   eager  yes
bwd_model_head   1      head      bwd  comp    29   12  3    eager  yes
bwd_l0_post      0      post      bwd  comp    9    4   2    eager  yes
bwd_l0_combine   0      combine   bwd  comm    2    3   1    eager  no: communication stage (stays eager on the comm stream)
bwd_l0_experts   0      experts   bwd  comp    13   10  4    eager  yes
bwd_l0_dispatch  0      dispatch  bwd  comm    1    3   1    eager  no: communication stage (stays eager on the comm stream)
bwd_l0_attn      0      attn      bwd  comp    120  35  8    eager  yes
bwd_model_embed  -1     embed     bwd  comp    1    2   1    eager  yes""")


def test_all_to_all_and_auto_on_cpu_leave_the_graph_alone():
    for backend in ("all_to_all", "auto"):
        cap = _lowered(backend)
        targets = {op_name(n) for n in cap.graph_module.graph.nodes if n.op == "call_function"}
        assert "fxoverlap.dispatch" in targets and not any(t.endswith("_static") for t in targets), backend


def test_errors_name_the_option_and_the_fix():
    with pytest.raises(ValueError, match=r"OverlapConfig.dispatcher must be one of .*'padded'.*got 'nccl'"):
        fxoverlap.OverlapConfig(dispatcher="nccl")
    with pytest.raises(ValueError, match=r"dispatch_capacity_factor must be > 0"):
        fxoverlap.OverlapConfig(dispatch_capacity_factor=0)
    with pytest.raises(DispatcherError, match=r"dispatch_capacity_factor must be > 0"):
        _lowered(factor=-1.0)
    with pytest.raises(DispatcherError, match=r"dispatcher='symm_mem'\) cannot run here: the model is on cpu.*"
                                              r"Use dispatcher='padded'"):
        _lowered("symm_mem")
    with pytest.raises(DispatcherError, match=r"needs a static dispatcher.*set dispatcher='padded'"):
        _lowered("all_to_all", factor=1.0)


class _BiasedExperts(GroupedExperts):
    """Experts with a bias shared by all rows: its gradient sums over the padded rows."""

    def __init__(self, n_local, dim, hidden):
        super().__init__(n_local, dim, hidden)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x, tokens_per_expert):
        return super().forward(x, tokens_per_expert) + self.bias


def test_a_reduction_over_padded_rows_is_refused():
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(**CFG))
    model.layers[0].moe.experts = _BiasedExperts(4, 32, 16)
    with pytest.raises(DispatcherError, match=r"layer 0: node sum_\w+ \(aten.sum.dim_IntList\) reduces over the padded "
                                              r"rows of an expert input \(getitem_\d+, shape \[32, 32\]\).*"
                                              r"dispatcher='all_to_all'"):
        _lowered(model=model)
