"""``split``'s weight-gradient cut over a layer's backward stages (``delay_wgrad``): a main part
never reads a wgrad part, since a ZeroBubble pipeline schedule runs every wgrad part after every
main one. A hand-made tagged graph stands for what torchtitan's pipeline stage graphs traced
(DualPipeV, EP 2): the experts' weight-gradient GEMM reaches its gradient output only through a
view in the attn stage, whose share of the cut is views alone (not worth a stage)."""

from __future__ import annotations

import torch
import torch.fx

from fxoverlap.ir.meta import TAG_KEY
from fxoverlap.ir.stage import Direction, StageKind, Tag
from fxoverlap.passes.split import split

aten = torch.ops.aten


def _layer(through_view: bool) -> torch.fx.GraphModule:
    """Layer 0's backward: experts (input gradient, weight-gradient GEMM), attn (its input
    gradient; the GEMM's result through a view, or a cast that computes), then the embedding."""
    g = torch.fx.Graph()
    x, dy = g.placeholder("x"), g.placeholder("dy")
    experts, attn = Tag(Direction.BWD, 0, StageKind.EXPERTS), Tag(Direction.BWD, 0, StageKind.ATTN)
    embed = Tag(Direction.BWD, -1, StageKind.EMBED)

    def node(tag, op, *args):
        n = g.call_function(op, args)
        n.meta[TAG_KEY] = tag
        return n

    dx = node(experts, aten.mul.Tensor, dy, 2.0)
    dw = node(experts, aten.mm.default, x, dy)
    back = node(attn, aten.t.default, dw) if through_view else node(attn, aten.mul.Tensor, dw, 1.0)
    dxa = node(attn, aten.mul.Tensor, dx, 3.0)
    out = node(embed, aten.mul.Tensor, dxa, 1.0)
    g.output((back, out))
    return torch.fx.GraphModule({}, g)


def _reads_of_wgrad(stages) -> list:
    made = {o: s.name for s in stages for o in s.outputs}
    return [(s.name, i) for s in stages if not s.name.endswith("_wgrad") for i in s.inputs
            if made.get(i, "").endswith("_wgrad")]


def test_a_views_only_share_keeps_what_feeds_it_in_main():
    stages = split(_layer(through_view=True), 1, delay_wgrad=True)
    assert _reads_of_wgrad(stages) == []
    assert not any(s.name.endswith("_wgrad") for s in stages), [s.name for s in stages]


def test_a_share_that_computes_is_cut_in_both_stages():
    stages = split(_layer(through_view=False), 1, delay_wgrad=True)
    assert _reads_of_wgrad(stages) == []
    ops = {s.name: [n.target for n in s.graph_module.graph.nodes if n.op == "call_function"] for s in stages}
    assert ops["bwd_l0_experts_wgrad"] == [aten.mm.default] and ops["bwd_l0_attn_wgrad"] == [aten.mul.Tensor]
    assert aten.mm.default not in ops["bwd_l0_experts"]
