"""recompute: replay recompute regions in the backward instead of saving their activations.

A *recompute region* is forward code of the decoder layers whose values the backward
should recompute rather than keep. Two sources, one mechanism:

* **activation checkpointing** (always on): the ops a non-reentrant
  ``torch.utils.checkpoint`` call ran (``checkpoint(block, x, use_reentrant=False)``,
  ``checkpoint_wrapper``, torchtitan's ``apply_ac``), marked by the capture
  (:data:`~fxoverlap.ir.meta.CHECKPOINT_KEY`). Under a selective policy
  (``context_fn=create_selective_checkpoint_contexts(...)``) an op whose
  ``CheckpointPolicy`` is ``MUST_SAVE`` / ``PREFER_SAVE`` stays saved;
* **hyper-connections** (``OverlapConfig.mhc_recompute_group``): code marked
  ``fxoverlap.region("mhc")``. mHC widens the residual stream to n copies, and its
  per-token maps leave many n-times-wide activations for the backward.

Never replayed, whatever the region says, so saved: host syncs (a replay would stall
the host again), random ops (a replay draws new numbers; a dropout probability of 0
is not random) and in-place ops; and, by default, communication (nodes of a layer's
dispatch / combine stages: a replayed all-to-all is a second collective every peer
must join, costing the exchange again). The compute around them is replayed from
their saved outputs. With ``replay_comm`` (``OverlapConfig(ac_replay_comm=True)``)
the all-to-alls of checkpointed regions are replayed too, as eager's checkpoint does:
their outputs are then not kept between forward and backward. They go to recompute
stages of kind ``RECOMPUTE_COMM`` (the comm stream, so every rank issues them in
program order), and the group's compute is split into phases around them.

Contract
--------
Assumes: the tagged joint graph (``tag``, optionally ``side``); forward nodes carry
the capture's annotations.

Guarantees: layers are partitioned into *groups* of consecutive layers (one per layer;
``mhc_group`` consecutive layers with mHC recompute; a checkpoint call that spans
several layers joins them). For every backward node of a layer in group ``g`` that
reads a replayable region value of group ``g``, that value's computation is cloned
into a recompute stage ``Tag(bwd, top layer of g, recompute)`` (``meta[RECOMPUTE_LAYERS_KEY]``
= the group's layers) and the reader reads the clone. With replayed all-to-alls the
clones get a phase (``Tag.phase``): an all-to-all has the largest phase of its inputs,
a compute node one more than an all-to-all it reads, so the stages ``recompute``,
``recompute_comm``, ``recompute1``, ... are acyclic. Clone inputs are what the group
does not replay: values outside the regions, parameters, saved nodes, and values of
other groups (a group's input, e.g. the layer input a checkpoint keeps, stays saved).
Backward readers outside the group (the next layer's, the head's) keep reading the
saved original. ``gm.meta[SAVED_COMM_KEY]`` lists the layers whose checkpointed
all-to-all outputs the backward reads saved (empty with ``replay_comm``), so the caller
can say what the default keeps that eager's checkpoint would exchange again. The
schedule places each recompute stage right before the first stage that reads it (a
``recompute_comm`` stage on the comm stream, the others on the compute stream). The
originals then die in the forward and the free pass drops them there. Recomputed values are bitwise the saved ones: the
same ops on the same inputs. A graph with no region comes back unchanged.

Steps
-----
1. Replayable region nodes (``_replayable``), each with its layer.
2. Groups: union of the mHC blocks and of the layers each checkpoint call spans.
3. Clone, per group, what the group's backward reads, inputs first.

Runs after ``rng`` and before ``split`` (cloning before it lets ``split`` give the
recompute stage explicit inputs and outputs like any other stage).

Entry point: ``recompute(gm, num_layers, mhc_group=None, replay_comm=False) -> GraphModule``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.meta import (CHECKPOINT_KEY, RECOMPUTE_LAYERS_KEY, REGION_KEY, REPLAYS_KEY, SAVED_COMM_KEY, TAG_KEY, custom,
                            draws_random_numbers, is_host_sync, op_name)
from fxoverlap.ir.stage import COMM_KINDS, Direction, StageKind, Tag


class RecomputeError(FxOverlapError, RuntimeError):
    """Recompute was asked for but cannot be applied; the message says why."""


def _saved_by_policy(node: torch.fx.Node) -> bool:
    """A selective checkpoint policy said MUST_SAVE / PREFER_SAVE for this op."""
    from torch.utils.checkpoint import CheckpointPolicy

    return node.meta.get("recompute") in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def _never_replayed(node: torch.fx.Node, replay_comm: bool = False) -> bool:
    """Host syncs, random and in-place ops (and communication, unless ``replay_comm``):
    saved, whatever the region."""
    if node.op != "call_function" or is_host_sync(node):
        return True
    if node.meta[TAG_KEY].kind in COMM_KINDS and not replay_comm:
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable or draws_random_numbers(node)
    return False


def _replayable(gm: torch.fx.GraphModule, num_layers: int, mhc: bool,
                replay_comm: bool = False) -> dict[torch.fx.Node, int]:
    """Step 1: forward nodes of the decoder layers to replay, each with its layer."""
    out = {}
    for n in gm.graph.nodes:
        t = n.meta.get(TAG_KEY)
        if t is None or t.direction is not Direction.FWD or not 0 <= t.layer < num_layers:
            continue
        marks = custom(n)
        checkpointed = CHECKPOINT_KEY in marks and not _saved_by_policy(n)
        if (checkpointed or (mhc and marks.get(REGION_KEY) == "mhc")) and not _never_replayed(
                n, replay_comm and checkpointed):
            # an element of a saved multi-output op is saved with it (no tuple crosses stages)
            if n.target is not operator.getitem or n.args[0] in out:
                out[n] = t.layer
    return out


def _groups(region: dict[torch.fx.Node, int], num_layers: int, mhc_group: int | None) -> list[int]:
    """Step 2: the group of each layer (groups are runs of consecutive layers, numbered in order)."""
    joined = [False] * num_layers  # joined[l]: layer l is in the group of layer l - 1
    if mhc_group is not None:
        for layer in range(num_layers):
            joined[layer] = layer % mhc_group != 0
    spans: dict[object, list[int]] = {}
    for n, layer in region.items():
        if (call := custom(n).get(CHECKPOINT_KEY)) is not None:
            lo_hi = spans.setdefault(call, [layer, layer])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], layer), max(lo_hi[1], layer)
    for lo, hi in spans.values():
        for layer in range(lo + 1, hi + 1):
            joined[layer] = True
    group, out = -1, []
    for layer in range(num_layers):
        group += 0 if joined[layer] else 1
        out.append(group)
    return out


def recompute(gm: torch.fx.GraphModule, num_layers: int, mhc_group: int | None = None,
              replay_comm: bool = False) -> torch.fx.GraphModule:
    if mhc_group is not None and mhc_group < 1:
        raise RecomputeError(f"recompute: group size must be >= 1, got {mhc_group}")
    graph = gm.graph
    region = _replayable(gm, num_layers, mhc=mhc_group is not None, replay_comm=replay_comm)
    if mhc_group is not None and not any(custom(n).get(REGION_KEY) == "mhc" for n in region):
        raise RecomputeError(
            f"recompute: OverlapConfig.mhc_recompute_group={mhc_group} but no decoder-layer node is "
            f"marked fxoverlap.region('mhc'); mark the model's hyper-connection code with it, or leave "
            f"mhc_recompute_group unset"
        )
    bwd = [n for n in graph.nodes if (t := n.meta.get(TAG_KEY)) is not None and t.direction is Direction.BWD]
    if not region or not bwd:
        gm.meta[SAVED_COMM_KEY] = []
        return gm
    group_of = _groups(region, num_layers, mhc_group)
    layers_of: dict[int, tuple[int, ...]] = {}
    for layer, g in enumerate(group_of):
        layers_of[g] = layers_of.get(g, ()) + (layer,)

    clones: dict[tuple[int, torch.fx.Node], torch.fx.Node] = {}

    def replayed_in(g: int, p: torch.fx.Node) -> bool:
        return p in region and group_of[region[p]] == g

    def clone(g: int, node: torch.fx.Node) -> torch.fx.Node:
        key = (g, node)
        if key in clones:
            return clones[key]
        for p in node.all_input_nodes:  # inputs first: keeps the graph topological
            if replayed_in(g, p):
                clone(g, p)
        with graph.inserting_before(bwd[0]):
            c = graph.node_copy(node, lambda p: clones.get((g, p), p))
        comm = node.meta[TAG_KEY].kind in COMM_KINDS
        phase = 0
        for p in node.all_input_nodes:
            if (pc := clones.get((g, p))) is not None:
                t = pc.meta[TAG_KEY]
                phase = max(phase, t.phase + (not comm and t.kind is StageKind.RECOMPUTE_COMM))
        c.meta = dict(node.meta)
        c.meta[REPLAYS_KEY] = node.meta.get(REPLAYS_KEY, node.meta[TAG_KEY])
        c.meta["partitioner_tag"] = "is_backward"
        kind = StageKind.RECOMPUTE_COMM if comm else StageKind.RECOMPUTE
        c.meta[TAG_KEY] = Tag(Direction.BWD, layers_of[g][-1], kind, phase=phase)
        c.meta[RECOMPUTE_LAYERS_KEY] = layers_of[g]
        clones[key] = c
        return c

    for b in bwd:
        layer = b.meta[TAG_KEY].layer
        if not 0 <= layer < num_layers:
            continue  # embed / head backward: reads the saved originals
        g = group_of[layer]
        for p in list(b.all_input_nodes):
            if replayed_in(g, p):
                b.replace_input_with(p, clone(g, p))
    if mhc_group is not None and not any(custom(n).get(REGION_KEY) == "mhc" for _, n in clones):
        first = next(n for n in region if custom(n).get(REGION_KEY) == "mhc")
        raise RecomputeError(
            "recompute: no backward node reads an mHC activation of its own layer group; nothing to "
            f"recompute (first mHC node: {first.name} ({op_name(first)}))"
        )
    gm.meta[SAVED_COMM_KEY] = sorted({
        t.layer for n in graph.nodes
        if (t := n.meta.get(TAG_KEY)) is not None and t.direction is Direction.FWD and t.kind in COMM_KINDS
        and CHECKPOINT_KEY in custom(n) and any(u.meta[TAG_KEY].direction is Direction.BWD for u in n.users
                                               if TAG_KEY in u.meta)
    })
    graph.lint()
    gm.recompile()
    return gm
