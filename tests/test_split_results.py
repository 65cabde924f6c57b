"""split keeps the results of a multi-output op in the op's stage (a hand-built tagged graph).

On CUDA the backward of SDPA returns a tuple whose pieces a delayed weight-grad split
can send to different stages; a stage must hand out tensors, never the op's tuple
(Inductor's and CUDA graphs' outputs are flat)."""

from __future__ import annotations

import operator

import torch
import torch.fx

from fxoverlap.meta import TAG_KEY
from fxoverlap.passes.split import split
from fxoverlap.stage import Direction, Part, StageKind, Tag


def test_getitem_follows_its_op():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    top = g.call_function(torch.ops.aten.topk.default, (x, 2))
    values = g.call_function(operator.getitem, (top, 0))
    indices = g.call_function(operator.getitem, (top, 1))
    double = g.call_function(torch.ops.aten.mul.Tensor, (values, 2))
    as_float = g.call_function(torch.ops.aten._to_copy.default, (indices,), {"dtype": torch.float32})
    g.output((double, as_float))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    main = Tag(Direction.BWD, 0, StageKind.ATTN)
    wgrad = main.with_part(Part.WGRAD)
    for n, t in ((top, main), (values, main), (double, main), (indices, wgrad), (as_float, wgrad)):
        n.meta[TAG_KEY] = t
    stages = {s.name: s for s in split(gm, 1)}
    assert set(stages) == {"bwd_l0_attn", "bwd_l0_attn_wgrad"}
    main_nodes = {n.name for n in stages["bwd_l0_attn"].graph_module.graph.nodes}
    assert {top.name, values.name, indices.name} <= main_nodes  # both results stay with topk
    assert top.name not in stages["bwd_l0_attn"].outputs  # the tuple is never handed out
    assert stages["bwd_l0_attn_wgrad"].inputs == [indices.name]
    x_val = torch.randn(4, 8)
    outs = {}
    for s in stages.values():
        args = [x_val if i == "x" else outs[i] for i in s.inputs]
        outs.update(zip(s.outputs, s.graph_module(*args)))
    assert torch.equal(outs[double.name], x_val.topk(2).values * 2)
    assert torch.equal(outs[as_float.name], x_val.topk(2).indices.float())
