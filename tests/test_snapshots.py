"""expecttest snapshots of what capture/tag/split/schedule/streams produce.

Single rank (ep_group=None): the dispatch/combine ops are in the graph all the
same. Regenerate with EXPECTTEST_ACCEPT=1 and read the diff line by line.
"""

from __future__ import annotations

import expecttest
import torch

import fxoverlap
from fxoverlap.engine import format_stage_table
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.passes import capture, split, tag
from fxoverlap.passes.schedule import schedule
from fxoverlap.passes.streams import streams
from fxoverlap.stage import StreamKind
from snapshot_utils import render_program, render_tagged, requires_pinned_torch

CFG = MoEConfig.tiny(n_layers=2, dim=32, n_heads=2, n_experts=4, expert_dim=16, dense_dim=32,
                     vocab_size=32, layer_pattern=("moe", "dense"), shared_expert_dim=16)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)


def _stages():
    torch.manual_seed(0)
    model = MoETransformer(CFG)
    cap = capture(model, _batch())
    gm = tag(cap)
    return cap, gm, split(gm, cap.num_layers)


@requires_pinned_torch
class TestSnapshots(expecttest.TestCase):
    def test_tagged_forward_graph(self):
        _, gm, _ = _stages()
        self.assertExpectedInline(render_tagged(gm, "fwd"), """\
-1 embed    embedding = aten.embedding(primals_1, primals_30)
 0 attn     pow_1 = aten.pow(embedding)
 0 attn     mean = aten.mean(pow_1)
 0 attn     add = aten.add(mean)
 0 attn     rsqrt = aten.rsqrt(add)
 0 attn     detach = aten.detach(rsqrt)
 0 attn     mul = aten.mul(embedding, rsqrt)
 0 attn     mul_1 = aten.mul(mul, primals_2)
 0 attn     t = aten.t(primals_3)
 0 attn     view = aten.view(mul_1)
 0 attn     mm = aten.mm(view, t)
 0 attn     _unsafe_view = aten._unsafe_view(mm)
 0 attn     view_1 = aten.view(_unsafe_view)
 0 attn     transpose = aten.transpose(view_1)
 0 attn     t_1 = aten.t(primals_4)
 0 attn     view_2 = aten.view(mul_1)
 0 attn     mm_1 = aten.mm(view_2, t_1)
 0 attn     _unsafe_view_1 = aten._unsafe_view(mm_1)
 0 attn     view_3 = aten.view(_unsafe_view_1)
 0 attn     transpose_1 = aten.transpose(view_3)
 0 attn     t_2 = aten.t(primals_5)
 0 attn     view_4 = aten.view(mul_1)
 0 attn     mm_2 = aten.mm(view_4, t_2)
 0 attn     _unsafe_view_2 = aten._unsafe_view(mm_2)
 0 attn     view_5 = aten.view(_unsafe_view_2)
 0 attn     transpose_2 = aten.transpose(view_5)
 0 attn     split = aten.split(transpose)
 0 attn     getitem = getitem(split)
 0 attn     getitem_1 = getitem(split)
 0 attn     slice_1 = aten.slice(primals_26)
 0 attn     slice_2 = aten.slice(primals_27)
 0 attn     mul_2 = aten.mul(getitem, slice_1)
 0 attn     mul_3 = aten.mul(getitem_1, slice_2)
 0 attn     sub = aten.sub(mul_2, mul_3)
 0 attn     mul_4 = aten.mul(getitem, slice_2)
 0 attn     mul_5 = aten.mul(getitem_1, slice_1)
 0 attn     add_1 = aten.add(mul_4, mul_5)
 0 attn     cat = aten.cat(sub, add_1)
 0 attn     split_1 = aten.split(transpose_1)
 0 attn     getitem_2 = getitem(split_1)
 0 attn     getitem_3 = getitem(split_1)
 0 attn     slice_3 = aten.slice(primals_26)
 0 attn     slice_4 = aten.slice(primals_27)
 0 attn     mul_6 = aten.mul(getitem_2, slice_3)
 0 attn     mul_7 = aten.mul(getitem_3, slice_4)
 0 attn     sub_1 = aten.sub(mul_6, mul_7)
 0 attn     mul_8 = aten.mul(getitem_2, slice_4)
 0 attn     mul_9 = aten.mul(getitem_3, slice_3)
 0 attn     add_2 = aten.add(mul_8, mul_9)
 0 attn     cat_1 = aten.cat(sub_1, add_2)
 0 attn     _scaled_dot_product_flash_attention_for_cpu = aten._scaled_dot_product_flash_attention_for_cpu(cat, cat_1, transpose_2)
 0 attn     getitem_4 = getitem(_scaled_dot_product_flash_attention_for_cpu)
 0 attn     getitem_5 = getitem(_scaled_dot_product_flash_attention_for_cpu)
 0 attn     detach_1 = aten.detach(getitem_4)
 0 attn     transpose_3 = aten.transpose(getitem_4)
 0 attn     clone = aten.clone(transpose_3)
 0 attn     _unsafe_view_3 = aten._unsafe_view(clone)
 0 attn     t_3 = aten.t(primals_6)
 0 attn     view_6 = aten.view(_unsafe_view_3)
 0 attn     mm_3 = aten.mm(view_6, t_3)
 0 attn     _unsafe_view_4 = aten._unsafe_view(mm_3)
 0 attn     add_3 = aten.add(embedding, _unsafe_view_4)
 0 attn     pow_2 = aten.pow(add_3)
 0 attn     mean_1 = aten.mean(pow_2)
 0 attn     add_4 = aten.add(mean_1)
 0 attn     rsqrt_1 = aten.rsqrt(add_4)
 0 attn     detach_2 = aten.detach(rsqrt_1)
 0 attn     mul_10 = aten.mul(add_3, rsqrt_1)
 0 attn     mul_11 = aten.mul(mul_10, primals_7)
 0 attn     view_7 = aten.view(mul_11)
 0 attn     t_4 = aten.t(primals_8)
 0 attn     mm_4 = aten.mm(view_7, t_4)
 0 attn     _softmax = aten._softmax(mm_4)
 0 attn     detach_3 = aten.detach(_softmax)
 0 attn     topk = aten.topk(_softmax)
 0 attn     getitem_6 = getitem(topk)
 0 attn     getitem_7 = getitem(topk)
 0 attn     view_8 = aten.view(getitem_7)
 0 attn     sort = aten.sort(view_8)
 0 attn     getitem_9 = getitem(sort)
 0 attn     ge = aten.ge(view_8)
 0 attn     all_1 = aten.all(ge)
 0 attn     _assert_async = aten._assert_async(all_1)
 0 attn     lt = aten.lt(view_8)
 0 attn     all_2 = aten.all(lt)
 0 attn     _assert_async_1 = aten._assert_async(all_2)
 0 attn     unsqueeze = aten.unsqueeze(view_8)
 0 attn     arange = aten.arange()
 0 attn     eq = aten.eq(unsqueeze, arange)
 0 attn     _to_copy = aten._to_copy(eq)
 0 attn     sum_1 = aten.sum(_to_copy)
 0 attn     floor_divide = aten.floor_divide(getitem_9)
 0 attn     index_select = aten.index_select(view_7, floor_divide)
 0 dispatch dispatch = fxoverlap.dispatch(index_select, sum_1)
 0 dispatch getitem_10 = getitem(dispatch)
 0 dispatch getitem_11 = getitem(dispatch)
 0 experts  sym_size_int = aten.sym_size(getitem_10)
 0 experts  sum_2 = aten.sum(getitem_11)
 0 experts  cumsum = aten.cumsum(sum_2)
 0 experts  _to_copy_1 = aten._to_copy(cumsum)
 0 experts  grouped_mm = fxoverlap.grouped_mm(getitem_10, primals_9, _to_copy_1)
 0 experts  silu = aten.silu(grouped_mm)
 0 experts  grouped_mm_1 = fxoverlap.grouped_mm(getitem_10, primals_10, _to_copy_1)
 0 experts  mul_20 = aten.mul(silu, grouped_mm_1)
 0 experts  grouped_mm_2 = fxoverlap.grouped_mm(mul_20, primals_11, _to_copy_1)
 0 combine  combine = fxoverlap.combine(grouped_mm_2, getitem_11, sum_1)
 0 post     zeros_like = aten.zeros_like(combine)
 0 post     index_copy = aten.index_copy(zeros_like, getitem_9, combine)
 0 post     view_9 = aten.view(index_copy)
 0 attn     unsqueeze_1 = aten.unsqueeze(getitem_6)
 0 post     mul_25 = aten.mul(view_9, unsqueeze_1)
 0 post     sum_3 = aten.sum(mul_25)
 0 attn     t_5 = aten.t(primals_12)
 0 attn     mm_5 = aten.mm(view_7, t_5)
 0 attn     silu_1 = aten.silu(mm_5)
 0 attn     t_6 = aten.t(primals_14)
 0 attn     mm_6 = aten.mm(view_7, t_6)
 0 attn     mul_26 = aten.mul(silu_1, mm_6)
 0 attn     t_7 = aten.t(primals_13)
 0 attn     mm_7 = aten.mm(mul_26, t_7)
 0 post     add_23 = aten.add(sum_3, mm_7)
 0 post     view_10 = aten.view(add_23)
 0 post     add_24 = aten.add(add_3, view_10)
 1 attn     pow_3 = aten.pow(add_24)
 1 attn     mean_2 = aten.mean(pow_3)
 1 attn     add_25 = aten.add(mean_2)
 1 attn     rsqrt_2 = aten.rsqrt(add_25)
 1 attn     detach_4 = aten.detach(rsqrt_2)
 1 attn     mul_27 = aten.mul(add_24, rsqrt_2)
 1 attn     mul_28 = aten.mul(mul_27, primals_15)
 1 attn     t_8 = aten.t(primals_16)
 1 attn     view_11 = aten.view(mul_28)
 1 attn     mm_8 = aten.mm(view_11, t_8)
 1 attn     _unsafe_view_5 = aten._unsafe_view(mm_8)
 1 attn     view_12 = aten.view(_unsafe_view_5)
 1 attn     transpose_4 = aten.transpose(view_12)
 1 attn     t_9 = aten.t(primals_17)
 1 attn     view_13 = aten.view(mul_28)
 1 attn     mm_9 = aten.mm(view_13, t_9)
 1 attn     _unsafe_view_6 = aten._unsafe_view(mm_9)
 1 attn     view_14 = aten.view(_unsafe_view_6)
 1 attn     transpose_5 = aten.transpose(view_14)
 1 attn     t_10 = aten.t(primals_18)
 1 attn     view_15 = aten.view(mul_28)
 1 attn     mm_10 = aten.mm(view_15, t_10)
 1 attn     _unsafe_view_7 = aten._unsafe_view(mm_10)
 1 attn     view_16 = aten.view(_unsafe_view_7)
 1 attn     transpose_6 = aten.transpose(view_16)
 1 attn     split_2 = aten.split(transpose_4)
 1 attn     getitem_12 = getitem(split_2)
 1 attn     getitem_13 = getitem(split_2)
 1 attn     slice_5 = aten.slice(primals_28)
 1 attn     slice_6 = aten.slice(primals_29)
 1 attn     mul_29 = aten.mul(getitem_12, slice_5)
 1 attn     mul_30 = aten.mul(getitem_13, slice_6)
 1 attn     sub_8 = aten.sub(mul_29, mul_30)
 1 attn     mul_31 = aten.mul(getitem_12, slice_6)
 1 attn     mul_32 = aten.mul(getitem_13, slice_5)
 1 attn     add_26 = aten.add(mul_31, mul_32)
 1 attn     cat_2 = aten.cat(sub_8, add_26)
 1 attn     split_3 = aten.split(transpose_5)
 1 attn     getitem_14 = getitem(split_3)
 1 attn     getitem_15 = getitem(split_3)
 1 attn     slice_7 = aten.slice(primals_28)
 1 attn     slice_8 = aten.slice(primals_29)
 1 attn     mul_33 = aten.mul(getitem_14, slice_7)
 1 attn     mul_34 = aten.mul(getitem_15, slice_8)
 1 attn     sub_9 = aten.sub(mul_33, mul_34)
 1 attn     mul_35 = aten.mul(getitem_14, slice_8)
 1 attn     mul_36 = aten.mul(getitem_15, slice_7)
 1 attn     add_27 = aten.add(mul_35, mul_36)
 1 attn     cat_3 = aten.cat(sub_9, add_27)
 1 attn     _scaled_dot_product_flash_attention_for_cpu_1 = aten._scaled_dot_product_flash_attention_for_cpu(cat_2, cat_3, transpose_6)
 1 attn     getitem_16 = getitem(_scaled_dot_product_flash_attention_for_cpu_1)
 1 attn     getitem_17 = getitem(_scaled_dot_product_flash_attention_for_cpu_1)
 1 attn     detach_5 = aten.detach(getitem_16)
 1 attn     transpose_7 = aten.transpose(getitem_16)
 1 attn     clone_1 = aten.clone(transpose_7)
 1 attn     _unsafe_view_8 = aten._unsafe_view(clone_1)
 1 attn     t_11 = aten.t(primals_19)
 1 attn     view_17 = aten.view(_unsafe_view_8)
 1 attn     mm_11 = aten.mm(view_17, t_11)
 1 attn     _unsafe_view_9 = aten._unsafe_view(mm_11)
 1 attn     add_28 = aten.add(add_24, _unsafe_view_9)
 1 attn     pow_4 = aten.pow(add_28)
 1 attn     mean_3 = aten.mean(pow_4)
 1 attn     add_29 = aten.add(mean_3)
 1 attn     rsqrt_3 = aten.rsqrt(add_29)
 1 attn     detach_6 = aten.detach(rsqrt_3)
 1 attn     mul_37 = aten.mul(add_28, rsqrt_3)
 1 attn     mul_38 = aten.mul(mul_37, primals_20)
 1 mlp      t_12 = aten.t(primals_21)
 1 mlp      view_18 = aten.view(mul_38)
 1 mlp      mm_12 = aten.mm(view_18, t_12)
 1 mlp      _unsafe_view_10 = aten._unsafe_view(mm_12)
 1 mlp      silu_2 = aten.silu(_unsafe_view_10)
 1 mlp      t_13 = aten.t(primals_23)
 1 mlp      view_19 = aten.view(mul_38)
 1 mlp      mm_13 = aten.mm(view_19, t_13)
 1 mlp      _unsafe_view_11 = aten._unsafe_view(mm_13)
 1 mlp      mul_39 = aten.mul(silu_2, _unsafe_view_11)
 1 mlp      t_14 = aten.t(primals_22)
 1 mlp      view_20 = aten.view(mul_39)
 1 mlp      mm_14 = aten.mm(view_20, t_14)
 1 mlp      _unsafe_view_12 = aten._unsafe_view(mm_14)
 1 mlp      add_30 = aten.add(add_28, _unsafe_view_12)
 2 head     pow_5 = aten.pow(add_30)
 2 head     mean_4 = aten.mean(pow_5)
 2 head     add_31 = aten.add(mean_4)
 2 head     rsqrt_4 = aten.rsqrt(add_31)
 2 head     detach_7 = aten.detach(rsqrt_4)
 2 head     mul_40 = aten.mul(add_30, rsqrt_4)
 2 head     mul_41 = aten.mul(mul_40, primals_24)
 2 head     t_15 = aten.t(primals_25)
 2 head     view_21 = aten.view(mul_41)
 2 head     mm_15 = aten.mm(view_21, t_15)
 2 head     _unsafe_view_13 = aten._unsafe_view(mm_15)
 2 head     view_22 = aten.view(_unsafe_view_13)
 2 head     view_23 = aten.view(primals_31)
 2 head     _log_softmax = aten._log_softmax(view_22)
 2 head     detach_8 = aten.detach(_log_softmax)
 2 head     nll_loss_forward = aten.nll_loss_forward(_log_softmax, view_23)
 2 head     getitem_18 = getitem(nll_loss_forward)
 2 head     getitem_19 = getitem(nll_loss_forward)""")

    def test_token_dedup_layer_tags(self):
        """The token-once ops: one dispatch and one combine node, the experts between, in
        both directions (backward comm ops take their forward op's kind)."""
        torch.manual_seed(0)
        cfg = MoEConfig.tiny(n_layers=1, dim=32, n_heads=2, n_experts=4, expert_dim=16, vocab_size=32,
                             token_dedup=True)
        cap = capture(MoETransformer(cfg), _batch())
        gm = tag(cap)
        lines = [
            line for d in ("fwd", "bwd") for line in render_tagged(gm, d).splitlines()
            if line.split()[1] in ("dispatch", "experts", "combine")
        ]
        self.assertExpectedInline("\n".join(lines), """\
 0 dispatch token_dispatch = fxoverlap.token_dispatch(view_7, getitem_7, getitem_6)
 0 dispatch getitem_8 = getitem(token_dispatch)
 0 dispatch getitem_9 = getitem(token_dispatch)
 0 dispatch getitem_10 = getitem(token_dispatch)
 0 dispatch getitem_11 = getitem(token_dispatch)
 0 dispatch getitem_12 = getitem(token_dispatch)
 0 dispatch getitem_13 = getitem(token_dispatch)
 0 experts  sum_1 = aten.sum(getitem_10)
 0 experts  cumsum = aten.cumsum(sum_1)
 0 experts  _to_copy = aten._to_copy(cumsum)
 0 experts  grouped_mm = fxoverlap.grouped_mm(getitem_8, primals_9, _to_copy)
 0 experts  silu = aten.silu(grouped_mm)
 0 experts  grouped_mm_1 = fxoverlap.grouped_mm(getitem_8, primals_10, _to_copy)
 0 experts  mul_22 = aten.mul(silu, grouped_mm_1)
 0 experts  grouped_mm_2 = fxoverlap.grouped_mm(mul_22, primals_11, _to_copy)
 0 experts  unsqueeze = aten.unsqueeze(getitem_9)
 0 experts  mul_28 = aten.mul(grouped_mm_2, unsqueeze)
 0 combine  token_combine = fxoverlap.token_combine(mul_28, getitem_11, getitem_12, getitem_13)
 0 combine  token_combine_backward = fxoverlap.token_combine_backward(view_16, getitem_11, getitem_12, getitem_13)
 0 experts  mul_41 = aten.mul(token_combine_backward, grouped_mm_2)
 0 experts  mul_42 = aten.mul(token_combine_backward, unsqueeze)
 0 experts  sum_4 = aten.sum(mul_41)
 0 experts  squeeze = aten.squeeze(sum_4)
 0 experts  transpose_4 = aten.transpose(primals_11)
 0 experts  grouped_mm_3 = fxoverlap.grouped_mm(mul_42, transpose_4, _to_copy)
 0 experts  grouped_mm_wgrad = fxoverlap.grouped_mm_wgrad(mul_22, mul_42, _to_copy)
 0 experts  mul_43 = aten.mul(grouped_mm_3, silu)
 0 experts  mul_44 = aten.mul(grouped_mm_3, grouped_mm_1)
 0 experts  transpose_5 = aten.transpose(primals_10)
 0 experts  grouped_mm_4 = fxoverlap.grouped_mm(mul_43, transpose_5, _to_copy)
 0 experts  grouped_mm_wgrad_1 = fxoverlap.grouped_mm_wgrad(getitem_8, mul_43, _to_copy)
 0 experts  silu_backward = aten.silu_backward(mul_44, grouped_mm)
 0 experts  transpose_6 = aten.transpose(primals_9)
 0 experts  grouped_mm_5 = fxoverlap.grouped_mm(silu_backward, transpose_6, _to_copy)
 0 experts  grouped_mm_wgrad_2 = fxoverlap.grouped_mm_wgrad(getitem_8, silu_backward, _to_copy)
 0 experts  add_36 = aten.add(grouped_mm_4, grouped_mm_5)
 0 dispatch token_dispatch_backward = fxoverlap.token_dispatch_backward(add_36, squeeze, getitem_7, getitem_11, getitem_12, getitem_13)
 0 dispatch getitem_16 = getitem(token_dispatch_backward)
 0 dispatch getitem_17 = getitem(token_dispatch_backward)""")

    def test_stage_table(self):
        _, _, stages = _stages()
        self.assertExpectedInline(format_stage_table(stages), """\
stage            layer  kind      dir  stream  ops  in  out  capturable
fwd_model_embed  -1     embed     fwd  comp    1    2   1    yes
fwd_l0_attn      0      attn      fwd  comp    101  13  41   yes
fwd_l0_dispatch  0      dispatch  fwd  comm    3    2   2    no: communication stage
fwd_l0_experts   0      experts   fwd  comp    9    5   7    no: data-dependent shape at node sym_size_int (aten.sym_size)
fwd_l0_combine   0      combine   fwd  comm    1    3   1    no: communication stage
fwd_l0_post      0      post      fwd  comp    8    5   2    yes
fwd_l1_attn      1      attn      fwd  comp    68   9   25   yes
fwd_l1_mlp       1      mlp       fwd  comp    15   5   10   yes
fwd_model_head   2      head      fwd  comp    18   4   10   yes
bwd_model_head   2      head      bwd  comp    29   12  3    yes
bwd_l1_mlp       1      mlp       bwd  comp    28   10  4    yes
bwd_l1_attn      1      attn      bwd  comp    105  29  7    yes
bwd_l0_post      0      post      bwd  comp    9    4   3    yes
bwd_l0_combine   0      combine   bwd  comm    2    4   1    no: communication stage
bwd_l0_experts   0      experts   bwd  comp    13   10  4    no: data-dependent shape at node grouped_mm_3 (fxoverlap.grouped_mm)
bwd_l0_dispatch  0      dispatch  bwd  comm    1    3   1    no: communication stage
bwd_l0_attn      0      attn      bwd  comp    143  43  11   yes
bwd_model_embed  -1     embed     bwd  comp    1    2   1    yes""")

    def test_backward_stage_graph(self):
        _, _, stages = _stages()
        s = next(s for s in stages if s.name == "bwd_l0_experts")
        self.assertExpectedInline(s.graph_module.code.strip(), """\
def forward(self, primals_11, getitem_23, _to_copy_1, mul_20, silu, grouped_mm_1, primals_10, getitem_10, grouped_mm, primals_9):
    transpose_12 = torch.ops.aten.transpose.int(primals_11, -1, -2);  primals_11 = None
    grouped_mm_3 = torch.ops.fxoverlap.grouped_mm.default(getitem_23, transpose_12, _to_copy_1);  transpose_12 = None
    grouped_mm_wgrad = torch.ops.fxoverlap.grouped_mm_wgrad.default(mul_20, getitem_23, _to_copy_1);  mul_20 = getitem_23 = None
    mul_80 = torch.ops.aten.mul.Tensor(grouped_mm_3, silu);  silu = None
    mul_81 = torch.ops.aten.mul.Tensor(grouped_mm_3, grouped_mm_1);  grouped_mm_3 = grouped_mm_1 = None
    transpose_13 = torch.ops.aten.transpose.int(primals_10, -1, -2);  primals_10 = None
    grouped_mm_4 = torch.ops.fxoverlap.grouped_mm.default(mul_80, transpose_13, _to_copy_1);  transpose_13 = None
    grouped_mm_wgrad_1 = torch.ops.fxoverlap.grouped_mm_wgrad.default(getitem_10, mul_80, _to_copy_1);  mul_80 = None
    silu_backward_2 = torch.ops.aten.silu_backward.default(mul_81, grouped_mm);  mul_81 = grouped_mm = None
    transpose_14 = torch.ops.aten.transpose.int(primals_9, -1, -2);  primals_9 = None
    grouped_mm_5 = torch.ops.fxoverlap.grouped_mm.default(silu_backward_2, transpose_14, _to_copy_1);  transpose_14 = None
    grouped_mm_wgrad_2 = torch.ops.fxoverlap.grouped_mm_wgrad.default(getitem_10, silu_backward_2, _to_copy_1);  getitem_10 = silu_backward_2 = _to_copy_1 = None
    add_45 = torch.ops.aten.add.Tensor(grouped_mm_4, grouped_mm_5);  grouped_mm_4 = grouped_mm_5 = None
    return (grouped_mm_wgrad, grouped_mm_wgrad_1, grouped_mm_wgrad_2, add_45)""")

    def test_program_2_layers_3_microbatches(self):
        _, _, stages = _stages()
        self.assertExpectedInline(render_program(schedule(stages, 3, 2)), """\
def forward(self):
F0_model_embed = self.fwd_model_embed(0)
F0_l0_attn = self.fwd_l0_attn(0)
F0_l0_dispatch = self.fwd_l0_dispatch(0)
F0_l0_experts = self.fwd_l0_experts(0)
F0_l0_combine = self.fwd_l0_combine(0)
F0_l0_post = self.fwd_l0_post(0)
F0_l1_attn = self.fwd_l1_attn(0)
F0_l1_mlp = self.fwd_l1_mlp(0)
F0_model_head = self.fwd_model_head(0)
B0_model_head = self.bwd_model_head(0)
F1_model_embed = self.fwd_model_embed(1)
F1_l0_attn = self.fwd_l0_attn(1)
B0_l1_mlp = self.bwd_l1_mlp(0)
F1_l0_dispatch = self.fwd_l0_dispatch(1)
F1_l0_experts = self.fwd_l0_experts(1)
B0_l1_attn = self.bwd_l1_attn(0)
F1_l0_combine = self.fwd_l0_combine(1)
B0_l0_post = self.bwd_l0_post(0)
F1_l0_post = self.fwd_l0_post(1)
F1_l1_attn = self.fwd_l1_attn(1)
B0_l0_combine = self.bwd_l0_combine(0)
B0_l0_experts = self.bwd_l0_experts(0)
F1_l1_mlp = self.fwd_l1_mlp(1)
B0_l0_dispatch = self.bwd_l0_dispatch(0)
B0_l0_attn = self.bwd_l0_attn(0)
F1_model_head = self.fwd_model_head(1)
B0_model_embed = self.bwd_model_embed(0)
B1_model_head = self.bwd_model_head(1)
F2_model_embed = self.fwd_model_embed(2)
F2_l0_attn = self.fwd_l0_attn(2)
B1_l1_mlp = self.bwd_l1_mlp(1)
F2_l0_dispatch = self.fwd_l0_dispatch(2)
F2_l0_experts = self.fwd_l0_experts(2)
B1_l1_attn = self.bwd_l1_attn(1)
F2_l0_combine = self.fwd_l0_combine(2)
B1_l0_post = self.bwd_l0_post(1)
F2_l0_post = self.fwd_l0_post(2)
F2_l1_attn = self.fwd_l1_attn(2)
B1_l0_combine = self.bwd_l0_combine(1)
B1_l0_experts = self.bwd_l0_experts(1)
F2_l1_mlp = self.fwd_l1_mlp(2)
B1_l0_dispatch = self.bwd_l0_dispatch(1)
B1_l0_attn = self.bwd_l0_attn(1)
F2_model_head = self.fwd_model_head(2)
B1_model_embed = self.bwd_model_embed(1)
B2_model_head = self.bwd_model_head(2)
B2_l1_mlp = self.bwd_l1_mlp(2)
B2_l1_attn = self.bwd_l1_attn(2)
B2_l0_post = self.bwd_l0_post(2)
B2_l0_combine = self.bwd_l0_combine(2)
B2_l0_experts = self.bwd_l0_experts(2)
B2_l0_dispatch = self.bwd_l0_dispatch(2)
B2_l0_attn = self.bwd_l0_attn(2)
B2_model_embed = self.bwd_model_embed(2)""")

    def test_streams_pass(self):
        _, _, stages = _stages()
        self.assertExpectedInline(render_program(streams(schedule(stages, 2, 2), stages)), """\
def forward(self):
record_event = fxoverlap_program_record_event('start', 'comp')
F0_model_embed = self.fwd_model_embed(0, stream = 'comp')
F0_l0_attn = self.fwd_l0_attn(0, stream = 'comp')
record_event_1 = fxoverlap_program_record_event('ev_F0_l0_attn', 'comp')
wait_event = fxoverlap_program_wait_event('start', 'comm')
wait_event_1 = fxoverlap_program_wait_event('ev_F0_l0_attn', 'comm')
F0_l0_dispatch = self.fwd_l0_dispatch(0, stream = 'comm')
record_event_2 = fxoverlap_program_record_event('ev_F0_l0_dispatch', 'comm')
wait_event_2 = fxoverlap_program_wait_event('ev_F0_l0_dispatch', 'comp')
F0_l0_experts = self.fwd_l0_experts(0, stream = 'comp')
record_event_3 = fxoverlap_program_record_event('ev_F0_l0_experts', 'comp')
wait_event_3 = fxoverlap_program_wait_event('ev_F0_l0_experts', 'comm')
F0_l0_combine = self.fwd_l0_combine(0, stream = 'comm')
record_event_4 = fxoverlap_program_record_event('ev_F0_l0_combine', 'comm')
wait_event_4 = fxoverlap_program_wait_event('ev_F0_l0_combine', 'comp')
F0_l0_post = self.fwd_l0_post(0, stream = 'comp')
F0_l1_attn = self.fwd_l1_attn(0, stream = 'comp')
F0_l1_mlp = self.fwd_l1_mlp(0, stream = 'comp')
F0_model_head = self.fwd_model_head(0, stream = 'comp')
B0_model_head = self.bwd_model_head(0, stream = 'comp')
F1_model_embed = self.fwd_model_embed(1, stream = 'comp')
F1_l0_attn = self.fwd_l0_attn(1, stream = 'comp')
record_event_5 = fxoverlap_program_record_event('ev_F1_l0_attn', 'comp')
B0_l1_mlp = self.bwd_l1_mlp(0, stream = 'comp')
wait_event_5 = fxoverlap_program_wait_event('ev_F1_l0_attn', 'comm')
F1_l0_dispatch = self.fwd_l0_dispatch(1, stream = 'comm')
record_event_6 = fxoverlap_program_record_event('ev_F1_l0_dispatch', 'comm')
wait_event_6 = fxoverlap_program_wait_event('ev_F1_l0_dispatch', 'comp')
F1_l0_experts = self.fwd_l0_experts(1, stream = 'comp')
record_event_7 = fxoverlap_program_record_event('ev_F1_l0_experts', 'comp')
B0_l1_attn = self.bwd_l1_attn(0, stream = 'comp')
wait_event_7 = fxoverlap_program_wait_event('ev_F1_l0_experts', 'comm')
F1_l0_combine = self.fwd_l0_combine(1, stream = 'comm')
record_event_8 = fxoverlap_program_record_event('ev_F1_l0_combine', 'comm')
B0_l0_post = self.bwd_l0_post(0, stream = 'comp')
record_event_9 = fxoverlap_program_record_event('ev_B0_l0_post', 'comp')
wait_event_8 = fxoverlap_program_wait_event('ev_F1_l0_combine', 'comp')
F1_l0_post = self.fwd_l0_post(1, stream = 'comp')
F1_l1_attn = self.fwd_l1_attn(1, stream = 'comp')
wait_event_9 = fxoverlap_program_wait_event('ev_B0_l0_post', 'comm')
B0_l0_combine = self.bwd_l0_combine(0, stream = 'comm')
record_event_10 = fxoverlap_program_record_event('ev_B0_l0_combine', 'comm')
wait_event_10 = fxoverlap_program_wait_event('ev_B0_l0_combine', 'comp')
B0_l0_experts = self.bwd_l0_experts(0, stream = 'comp')
record_event_11 = fxoverlap_program_record_event('ev_B0_l0_experts', 'comp')
F1_l1_mlp = self.fwd_l1_mlp(1, stream = 'comp')
wait_event_11 = fxoverlap_program_wait_event('ev_B0_l0_experts', 'comm')
B0_l0_dispatch = self.bwd_l0_dispatch(0, stream = 'comm')
record_event_12 = fxoverlap_program_record_event('ev_B0_l0_dispatch', 'comm')
wait_event_12 = fxoverlap_program_wait_event('ev_B0_l0_dispatch', 'comp')
B0_l0_attn = self.bwd_l0_attn(0, stream = 'comp')
F1_model_head = self.fwd_model_head(1, stream = 'comp')
B0_model_embed = self.bwd_model_embed(0, stream = 'comp')
B1_model_head = self.bwd_model_head(1, stream = 'comp')
B1_l1_mlp = self.bwd_l1_mlp(1, stream = 'comp')
B1_l1_attn = self.bwd_l1_attn(1, stream = 'comp')
B1_l0_post = self.bwd_l0_post(1, stream = 'comp')
record_event_13 = fxoverlap_program_record_event('ev_B1_l0_post', 'comp')
wait_event_13 = fxoverlap_program_wait_event('ev_B1_l0_post', 'comm')
B1_l0_combine = self.bwd_l0_combine(1, stream = 'comm')
record_event_14 = fxoverlap_program_record_event('ev_B1_l0_combine', 'comm')
wait_event_14 = fxoverlap_program_wait_event('ev_B1_l0_combine', 'comp')
B1_l0_experts = self.bwd_l0_experts(1, stream = 'comp')
record_event_15 = fxoverlap_program_record_event('ev_B1_l0_experts', 'comp')
wait_event_15 = fxoverlap_program_wait_event('ev_B1_l0_experts', 'comm')
B1_l0_dispatch = self.bwd_l0_dispatch(1, stream = 'comm')
record_event_16 = fxoverlap_program_record_event('ev_B1_l0_dispatch', 'comm')
wait_event_16 = fxoverlap_program_wait_event('ev_B1_l0_dispatch', 'comp')
B1_l0_attn = self.bwd_l0_attn(1, stream = 'comp')
B1_model_embed = self.bwd_model_embed(1, stream = 'comp')
record_event_17 = fxoverlap_program_record_event('end', 'comm')
wait_event_17 = fxoverlap_program_wait_event('end', 'comp')""")


def test_drain_runs_each_wgrad_after_the_next_comm_stage():
    """In the drain B(N-1), each wgrad part comes after the first comm stage issued
    after its parent (the all-to-all it overlaps), not right after the parent."""
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(n_layers=2, dim=32, n_heads=2, n_experts=4, expert_dim=16,
                         vocab_size=32, layer_pattern=("moe", "moe"))
    engine = fxoverlap.optimize(MoETransformer(cfg), None, fxoverlap.OverlapConfig(delay_wgrad=True))
    engine.forward_backward([_batch(), _batch()])
    stages = {s.name: s for s in engine.stages}
    calls = [n for n in engine.program.graph.nodes if n.op == "call_module"]
    drain = [n for n in calls if n.meta["microbatch"] == 1 and n.name.startswith("B")]
    assert all(n.meta["slot"] is None for n in drain)
    assert [n.name.removeprefix("B1_") for n in drain] == [
        "model_head", "l1_post", "l1_combine",
        "l1_experts", "l1_dispatch", "l1_experts_wgrad",
        "l1_attn", "l0_post", "l0_combine", "l1_attn_wgrad",
        "l0_experts", "l0_dispatch", "l0_experts_wgrad",
        "l0_attn", "l0_attn_wgrad",  # no comm stage left: right after its parent
        "model_embed",
    ]
    pos = {n.meta["stage"]: i for i, n in enumerate(drain)}
    comm = [i for i, n in enumerate(drain) if stages[n.meta["stage"]].stream is StreamKind.COMM]
    for name, s in stages.items():
        if s.wgrad_of is not None:
            after = [i for i in comm if i > pos[s.wgrad_of]]
            assert not after or after[0] < pos[name], f"{name} runs before the comm stage after {s.wgrad_of}"
