"""The vocabulary every pass and the runtime share: metadata keys and op names, each defined once.

Joint-graph nodes (the captured train step) carry, in ``node.meta``:

* ``"custom"``: the annotations made while tracing (``torch.fx.traceback.annotate``):
  :data:`LAYER_KEY` (decoder layer index), :data:`CHILD_KEY` (the layer child
  that ran the op), :data:`REGION_KEY` (an ``fxoverlap.region`` marker),
  :data:`CHECKPOINT_KEY` (the ``torch.utils.checkpoint`` call the op ran inside);
* ``"recompute"``: torch's own :class:`torch.utils.checkpoint.CheckpointPolicy` of an op
  that ran under a selective checkpoint policy (``context_fn``); read only on nodes that
  carry :data:`CHECKPOINT_KEY` (outside them torch leaves stale values behind);
* :data:`TAG_KEY`: the node's :class:`~fxoverlap.ir.stage.Tag` (set by ``tag``, refined by
  ``side`` and ``recompute``);
* :data:`RECOMPUTE_LAYERS_KEY`: on recompute clones, the layers of their group;
* :data:`REPLAYS_KEY`: on recompute clones, the :class:`~fxoverlap.ir.stage.Tag` of the forward
  node each replays (an experts op replayed in a recompute stage still reads expert weights);
* :data:`RNG_ORDER_KEY`: on random ops, their index in eager's order of draws (``rng``);
  stage graphs keep it, and ``schedule`` checks the program's draws against it.

Program nodes (the emitted schedule) carry :data:`STEP_KEY`: a
:class:`fxoverlap.ir.program.Step`, what the node reads and writes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

# ---- annotations made while tracing (inside node.meta["custom"])
LAYER_KEY = "fxoverlap_layer"
CHILD_KEY = "fxoverlap_child"
REGION_KEY = "fxoverlap_region"
CHECKPOINT_KEY = "fxoverlap_checkpoint"

# node.meta["custom"][LIST_KEY]: {candidate layer list path: (entry index, child name or None)},
# written while tracing for every candidate list; ``layers`` keeps the chosen one as LAYER_KEY/CHILD_KEY
LIST_KEY = "fxoverlap_lists"

# ---- joint-graph node metadata written by the passes
TAG_KEY = "fxoverlap_tag"
RECOMPUTE_LAYERS_KEY = "fxoverlap_recompute_layers"
REPLAYS_KEY = "fxoverlap_replays"  # recompute: on a clone, the Tag of the forward node it replays
RNG_ORDER_KEY = "fxoverlap_rng_order"  # rng: a random op's index in eager's order of draws

# ---- joint-graph metadata (GraphModule.meta) written by the passes
SAVED_COMM_KEY = "fxoverlap_saved_comm_layers"  # recompute: layers whose checkpointed all-to-alls stay saved

# ---- program node metadata
STEP_KEY = "fxoverlap_step"
# ---- program metadata (the program's GraphModule.meta): its fxoverlap.ir.program.Program record
PROGRAM_KEY = "fxoverlap_program"


def nodes_by_tag(graph: torch.fx.Graph) -> dict[tuple, list[torch.fx.Node]]:
    """The tagged nodes of ``graph`` by ``(direction, layer, kind)`` of their tag, in graph order."""
    out: dict[tuple, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if (t := n.meta.get(TAG_KEY)) is not None:
            out.setdefault((t.direction, t.layer, t.kind), []).append(n)
    return out


def custom(node: torch.fx.Node) -> dict:
    """The tracing-time annotations of ``node`` (empty when it has none)."""
    return node.meta.get("custom") or {}


def op_name(target_or_node) -> str:
    """``"aten.mm"``, ``"fxoverlap.dispatch"``: a short, release-stable name of an op."""
    t = target_or_node.target if isinstance(target_or_node, torch.fx.Node) else target_or_node
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.replace("::", ".")
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.replace("::", ".")
    return getattr(t, "__name__", str(t))


# ops whose result the host reads: a sync on CUDA, and a value no CUDA graph can replay
HOST_SYNC_OPS = frozenset({"aten._local_scalar_dense"})


def is_host_sync(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and op_name(node) in HOST_SYNC_OPS


def draws_random_numbers(node: torch.fx.Node) -> bool:
    """A seeded op (it draws from a generator), unless its dropout probability is 0
    (attention kernels without dropout carry the tag too)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
            or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name in ("dropout_p", "p"):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            return value != 0
    return True


def computes(node: torch.fx.Node) -> bool:
    """Whether ``node`` launches work: not a view (``aten.view``, ``aten.t``, ``_unsafe_view``...),
    a getitem or a size query. The one rule for "a part of only views is not worth a stage"."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return not t.is_view and "view" not in t._schema.name and "sym_" not in t._schema.name
    return True  # a Python function or a custom callable: assume it computes
