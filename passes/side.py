"""side: split each MoE layer's attn work into what its all-to-alls wait for and what can run under them.

Contract
--------
Assumes: ``tag`` ran (every node has a :class:`~fxoverlap.ir.stage.Tag`).

Guarantees: only tags change, and only of ``attn`` nodes of layers that have a
dispatch:

* forward: attn nodes the layer's dispatch does not depend on (a shared expert,
  the routing weights) get part ``SIDE``; the schedule issues them right after the
  dispatch, so they run under it. Everything the dispatch needs stays ``MAIN``.
* backward: attn nodes that depend on nothing of the layer's backward dispatch,
  experts or combine (shared-expert and router backward, fed by the layer's
  ``post`` backward) get part ``EARLY``; the schedule issues them right after the
  backward combine, so they run under it.

A layer where either part would be empty keeps one attn stage. Plain order
(sort by ``Tag.sort_key``) stays valid: a side part reads only main attn work of
its layer and earlier stages; an early part reads only stages before the
backward combine, and nothing of the main backward attn part depends on it the
other way round.

Steps
-----
1. Group tagged nodes by (direction, layer, kind).
2. Forward: ancestors (within attn) of what the dispatch reads stay MAIN; the rest is SIDE.
3. Backward: descendants (within attn) of the layer's backward comm/experts work stay MAIN;
   the rest is EARLY.

Entry point: ``side(gm) -> GraphModule`` (tags rewritten in place).
"""

from __future__ import annotations

import torch.fx

from fxoverlap.ir.meta import TAG_KEY, computes, nodes_by_tag
from fxoverlap.ir.stage import MOE_CHAIN_KINDS, Direction, Part, StageKind, Tag


def _forward_side(attn: list[torch.fx.Node], dispatch: list[torch.fx.Node]) -> list[torch.fx.Node]:
    members = set(dispatch)
    wanted = {p for n in dispatch for p in n.all_input_nodes if p not in members}
    keep: set[torch.fx.Node] = set()
    for n in reversed(attn):  # ancestors (within the stage) of what the dispatch reads
        if n in wanted or any(u in keep for u in n.users):
            keep.add(n)
    return [n for n in attn if n not in keep]


def _backward_early(attn: list[torch.fx.Node], layer: int) -> list[torch.fx.Node]:
    late: set[torch.fx.Node] = set()
    for n in attn:  # descendants (within the stage) of the layer's backward comm/experts work
        for p in n.all_input_nodes:
            t = p.meta.get(TAG_KEY)
            if p in late or (t is not None and t.direction is Direction.BWD and t.layer == layer
                             and t.kind in MOE_CHAIN_KINDS):
                late.add(n)
                break
    return [n for n in attn if n not in late]


def side(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    groups = nodes_by_tag(gm.graph)
    for (direction, layer, kind), nodes in groups.items():
        if kind is not StageKind.ATTN or (direction, layer, StageKind.DISPATCH) not in groups:
            continue
        if direction is Direction.FWD:
            moved, part = _forward_side(nodes, groups[(direction, layer, StageKind.DISPATCH)]), Part.SIDE
        else:
            moved, part = _backward_early(nodes, layer), Part.EARLY
        # a part of only views and getitems is not worth a stage of its own
        if not moved or len(moved) == len(nodes) or not any(computes(n) for n in moved):
            continue
        for n in moved:
            n.meta[TAG_KEY] = Tag(direction, layer, kind, part)
    return gm
