"""recompute: replay each layer group's hyper-connection (mHC) forward in the backward
instead of saving its activations.

mHC widens the residual stream to n copies, and its per-token maps (RMSNorm of
the flattened stream, sigmoids, 20 Sinkhorn iterations) leave many n-times-wide
activations for the backward.

Contract
--------
Assumes: ``tag`` ran; the model marks its hyper-connection code
``fxoverlap.region("mhc")`` (``REGION_KEY`` in ``node.meta["custom"]``) inside its
decoder layers. Runs between ``tag`` and ``split``, on the tagged joint graph
(cloning before ``split`` lets it give the recompute stage explicit inputs and
outputs like any other stage).

Guarantees: for every backward node of a layer in group ``g`` (``group_size``
consecutive layers) that reads an mHC value of its own group, that value's mHC
computation is cloned into the backward, tagged ``Tag(bwd, top layer of g,
recompute)`` (with ``RECOMPUTE_LAYERS_KEY``: the group's layers), and the reader
reads the clone. Clone inputs are what the group does not recompute: non-mHC
forward values, parameters, and mHC values of other groups (the stream entering
the group, which stays saved). Backward readers outside the group's layers keep
reading the saved original, so the recompute stage always runs before its readers:
the schedule places it right before the group's first backward stage, on the
compute stream. The originals then die in the forward and the free pass drops them
there. Recomputed values are bitwise the saved ones: the same ops on the same
inputs. No mHC node, or nothing to recompute, raises :class:`RecomputeError`.

Steps
-----
1. Find the forward mHC nodes of decoder layers (``_is_mhc``).
2. For each backward node reading an mHC value of its own group, clone that value
   (inputs first, once per group) before the first backward node and rewire the read.

Entry point: ``recompute(gm, num_layers, group_size) -> GraphModule``.
"""

from __future__ import annotations

import torch
import torch.fx

from fxoverlap.meta import RECOMPUTE_LAYERS_KEY, REGION_KEY, TAG_KEY, custom, op_name
from fxoverlap.stage import Direction, StageKind, Tag


class RecomputeError(RuntimeError):
    """Recompute was asked for but cannot be applied; the message says why."""


def _is_mhc(node: torch.fx.Node, num_layers: int) -> bool:
    t = node.meta.get(TAG_KEY)
    return (
        t is not None and t.direction is Direction.FWD and 0 <= t.layer < num_layers
        and custom(node).get(REGION_KEY) == "mhc"
    )


def recompute(gm: torch.fx.GraphModule, num_layers: int, group_size: int) -> torch.fx.GraphModule:
    if group_size < 1:
        raise RecomputeError(f"recompute: group size must be >= 1, got {group_size}")
    graph = gm.graph
    mhc = {n for n in graph.nodes if _is_mhc(n, num_layers)}
    if not mhc:
        raise RecomputeError(
            f"recompute: OverlapConfig.mhc_recompute_group={group_size} but no decoder-layer node is "
            f"marked fxoverlap.region('mhc'); mark the model's hyper-connection code with it, or leave "
            f"mhc_recompute_group unset"
        )
    group_of = lambda layer: layer // group_size  # noqa: E731
    layers_of = lambda g: tuple(range(g * group_size, min((g + 1) * group_size, num_layers)))  # noqa: E731
    bwd = [n for n in graph.nodes if (t := n.meta.get(TAG_KEY)) is not None and t.direction is Direction.BWD]
    if not bwd:
        return gm
    clones: dict[tuple[int, torch.fx.Node], torch.fx.Node] = {}

    def clone(g: int, node: torch.fx.Node) -> torch.fx.Node:
        key = (g, node)
        if key in clones:
            return clones[key]
        for p in node.all_input_nodes:  # inputs first: keeps the graph topological
            if p in mhc and group_of(p.meta[TAG_KEY].layer) == g:
                clone(g, p)

        def arg(p: torch.fx.Node) -> torch.fx.Node:
            return clones.get((g, p), p)

        with graph.inserting_before(bwd[0]):
            c = graph.node_copy(node, arg)
        c.meta = dict(node.meta)
        c.meta["partitioner_tag"] = "is_backward"
        c.meta[TAG_KEY] = Tag(Direction.BWD, layers_of(g)[-1], StageKind.RECOMPUTE)
        c.meta[RECOMPUTE_LAYERS_KEY] = layers_of(g)
        clones[key] = c
        return c

    for b in bwd:
        layer = b.meta[TAG_KEY].layer
        if not 0 <= layer < num_layers:
            continue
        g = group_of(layer)
        for p in list(b.all_input_nodes):
            if p in mhc and group_of(p.meta[TAG_KEY].layer) == g:
                b.replace_input_with(p, clone(g, p))
    if not clones:
        raise RecomputeError(
            "recompute: no backward node reads an mHC activation of its own layer group; nothing to "
            f"recompute (first mHC node: {next(iter(mhc)).name} ({op_name(next(iter(mhc)))}))"
        )
    graph.lint()
    gm.recompile()
    return gm
