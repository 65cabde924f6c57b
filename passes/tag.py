"""tag: give every node of the joint graph a ``(direction, layer, kind)`` tag.

Forward nodes: the layer comes from the capture annotation; the kind from data
dependencies on the layer's communication nodes, not graph order (a shared expert
written after the dispatch call still lands in ``attn``, so it can overlap the
dispatch):

* ``dispatch`` / ``combine``: the all-to-all nodes, with what runs between two
  all-to-alls of the same group (e.g. the ``.tolist()`` of exchanged counts);
* ``experts``: depends on the dispatch, feeds the combine;
* ``post``: depends on the combine;
* ``attn``: the rest of the layer. A layer without communication is dense:
  its last parameterized child to run outside region "mhc" (the FFN) and
  what depends on it are ``mlp``.

Nodes outside every layer are ``embed`` (before the first layer) or ``head``.
Backward nodes take the tag of the forward op they differentiate (``seq_nr``);
the rest take a neighbour's by data dependency. Finally every node is moved, if
needed, to no earlier a stage than its producers, so stages form a DAG in plain
execution order.

Communication is recognised by op: fxoverlap's ``dispatch``/``combine`` and
``token_dispatch``/``token_combine`` (and their ``_static`` lowerings, ``FXOVERLAP_COMM_OPS``),
functional collectives (``all_to_all_single``, as torchtitan writes EP), DeepEP
ops, or code marked with ``fxoverlap.region("dispatch" | "combine")``. Among
unmarked all-to-alls, one whose data input depends (other than through a
host-side scalar) on another all-to-all's output is a combine; the rest are
dispatches.

Entry point: ``tag(capture) -> GraphModule`` (the capture's graph, with
``node.meta["fxoverlap_tag"]`` set on every node but placeholders and the output).
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.fx

from fxoverlap.kernels.deepep import DEEPEP_COMBINE_OPS, DEEPEP_DISPATCH_OPS
from fxoverlap.passes.capture import CHILD_KEY, Capture
from fxoverlap.region import LAYER_KEY, REGION_KEY
from fxoverlap.stage import Direction, StageKind, Tag

TAG_KEY = "fxoverlap_tag"

# fxoverlap's forward comm ops by kind: the generic ones models write and the static ones
# the dispatcher pass lowers them to (backward ops take their forward op's tag by seq_nr).
FXOVERLAP_COMM_OPS = {
    "fxoverlap.dispatch": "dispatch", "fxoverlap.token_dispatch": "dispatch",
    "fxoverlap.dispatch_static": "dispatch", "fxoverlap.token_dispatch_static": "dispatch",
    "fxoverlap.combine": "combine", "fxoverlap.token_combine": "combine",
    "fxoverlap.combine_static": "combine", "fxoverlap.token_combine_static": "combine",
}
_A2A_TARGETS = {"_c10d_functional.all_to_all_single", "_c10d_functional_autograd.all_to_all_single"}
_WAIT_TARGETS = {"_c10d_functional.wait_tensor"}
_SCALAR_TARGETS = {"aten._local_scalar_dense"}


class TagError(RuntimeError):
    """The graph's layers or communication cannot be told apart; the message says how to fix it."""


def op_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.replace("::", ".")
    return getattr(t, "__name__", str(t))


def is_host_sync(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and op_name(node) in _SCALAR_TARGETS


def _custom(node: torch.fx.Node) -> dict:
    return node.meta.get("custom") or {}


def _direction(node: torch.fx.Node) -> Direction:
    return Direction.BWD if node.meta.get("partitioner_tag") == "is_backward" else Direction.FWD


def _comm_kind(node: torch.fx.Node) -> str | None:
    """'dispatch' / 'combine' when known from the op or a region marker, 'a2a' when unknown."""
    region = _custom(node).get(REGION_KEY)
    if region in ("dispatch", "combine"):
        return region
    name = op_name(node)
    if name in FXOVERLAP_COMM_OPS:
        return FXOVERLAP_COMM_OPS[name]
    if name.replace(".", "::", 1) in DEEPEP_DISPATCH_OPS:
        return "dispatch"
    if name.replace(".", "::", 1) in DEEPEP_COMBINE_OPS:
        return "combine"
    if name in _A2A_TARGETS:
        return "a2a"
    return None


def _reach(start: set[torch.fx.Node], graph: torch.fx.Graph) -> dict[torch.fx.Node, set]:
    """For each node, the ``start`` nodes that reach it through data; a host-side
    scalar (``.item()``/``.tolist()``) passes nothing on."""
    reach: dict[torch.fx.Node, set] = {}
    for n in graph.nodes:
        acc = {n} if n in start else set()
        if not is_host_sync(n):
            for p in n.all_input_nodes:
                acc |= reach.get(p, set())
        if acc:
            reach[n] = acc
    return reach


def _closure(seeds: set[torch.fx.Node], nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """``seeds`` plus what lies between two of them, plus waits/getitems of them."""
    if not seeds:
        return set()
    node_set = set(nodes)
    down: set[torch.fx.Node] = set()
    for n in nodes:  # graph order: descendants of seeds within the layer
        if n in seeds or any(p in down for p in n.all_input_nodes):
            down.add(n)
    up: set[torch.fx.Node] = set()
    for n in reversed(nodes):  # ancestors of seeds within the layer
        if n in seeds or any(u in up for u in n.users if u in node_set):
            up.add(n)
    out = set(seeds) | (down & up)
    changed = True
    while changed:  # results of a comm op that only unpack or wait on it
        changed = False
        for n in nodes:
            if n in out:
                continue
            if n.all_input_nodes and all(p in out for p in n.all_input_nodes) and (
                op_name(n) in _WAIT_TARGETS or n.target is operator.getitem
            ):
                out.add(n)
                changed = True
    return out


def _tag_layer_forward(layer: int, nodes: list[torch.fx.Node], capture: Capture) -> dict[torch.fx.Node, Tag]:
    comm = {n: k for n in nodes if (k := _comm_kind(n))}
    def tag(kind):
        return Tag(Direction.FWD, layer, kind)

    if not comm:
        # The FFN: the last child with parameters to run, ignoring hyper-connection
        # code (region "mhc"), which may wrap the FFN from both sides.
        owners = capture.param_children.get(layer, set())
        ffn = None
        for n in nodes:
            child = _custom(n).get(CHILD_KEY)
            if child in owners and _custom(n).get(REGION_KEY) != "mhc":
                ffn = child
        mlp: set[torch.fx.Node] = set()
        for n in nodes:
            if (ffn is not None and _custom(n).get(CHILD_KEY) == ffn) or any(p in mlp for p in n.all_input_nodes):
                mlp.add(n)
        return {n: tag(StageKind.MLP if n in mlp else StageKind.ATTN) for n in nodes}

    unknown = [n for n, k in comm.items() if k == "a2a"]
    if unknown:
        known_comm = set(comm)
        reach = _reach(known_comm, nodes[0].graph)
        for n in unknown:
            data_in = set()
            for p in n.all_input_nodes:
                if not is_host_sync(p):
                    data_in |= reach.get(p, set())
            comm[n] = "combine" if data_in - {n} else "dispatch"
    dispatch = _closure({n for n, k in comm.items() if k == "dispatch"}, nodes)
    combine = _closure({n for n, k in comm.items() if k == "combine"}, nodes) - dispatch
    first = next(iter(comm))
    if not dispatch or not combine:
        have, miss = ("dispatch", "combine") if dispatch else ("combine", "dispatch")
        raise TagError(
            f"layer {layer}: node {first.name} ({op_name(first)}) is a {have} all-to-all but the layer "
            f"has no {miss}; fxoverlap overlaps layers with one dispatch and one combine. Mark the "
            f"missing one with fxoverlap.region({miss!r}), or move the collective out of the layer"
        )
    out: dict[torch.fx.Node, Tag] = {}
    after_dispatch: set[torch.fx.Node] = set()
    after_combine: set[torch.fx.Node] = set()
    for n in nodes:
        ins = n.all_input_nodes
        if n in dispatch:
            out[n] = tag(StageKind.DISPATCH)
            after_dispatch.add(n)
        elif n in combine:
            out[n] = tag(StageKind.COMBINE)
            after_combine.add(n)
        elif any(p in after_combine for p in ins):
            out[n] = tag(StageKind.POST)
            after_combine.add(n)
        elif any(p in after_dispatch for p in ins):
            out[n] = tag(StageKind.EXPERTS)
            after_dispatch.add(n)
        else:
            out[n] = tag(StageKind.ATTN)
    return out


def tag(capture: Capture) -> torch.fx.GraphModule:
    gm = capture.graph_module
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op in ("call_function", "get_attr")]
    num_layers = capture.num_layers
    tags: dict[torch.fx.Node, Tag | None] = {}

    if num_layers == 0:
        warnings.warn(
            "fxoverlap: no decoder layers found (no nn.ModuleList/ModuleDict of modules with "
            "parameters); falling back to one stage per direction, with no overlap. Set "
            "OverlapConfig.layer_container to the attribute that holds the layers.",
            stacklevel=3,
        )
        for n in nodes:
            tags[n] = Tag(_direction(n), 0, StageKind.HEAD)
        return _finish(gm, tags, 0)

    fwd = [n for n in nodes if _direction(n) is Direction.FWD]
    by_layer: dict[int, list[torch.fx.Node]] = {}
    for n in fwd:
        layer = _custom(n).get(LAYER_KEY)
        if layer is not None:
            by_layer.setdefault(layer, []).append(n)
    for n in fwd:
        if _custom(n).get(LAYER_KEY) is None and _comm_kind(n):
            raise TagError(
                f"node {n.name} ({op_name(n)}) is an all-to-all outside every decoder layer; fxoverlap "
                f"schedules communication per layer. Move it into a layer of "
                f"{capture.layer_names[0].rsplit('.', 1)[0] or 'the layer list'}, or compute it outside "
                f"the captured step"
            )
    for layer, layer_nodes in by_layer.items():
        tags.update(_tag_layer_forward(layer, layer_nodes, capture))

    # Forward nodes outside layers: embed before the first layer, head after the last.
    layer_nodes_all = {n for ns in by_layer.values() for n in ns}
    feeds_layer: set[torch.fx.Node] = set()
    for n in reversed(fwd):
        if n in layer_nodes_all or any(u in feeds_layer for u in n.users):
            feeds_layer.add(n)
    after_layer: set[torch.fx.Node] = set()
    for n in fwd:
        if n in layer_nodes_all or any(p in after_layer for p in n.all_input_nodes):
            after_layer.add(n)
    for n in fwd:
        if n in tags:
            continue
        if n.op == "get_attr":
            tags[n] = None  # a constant: lives with its first consumer
        elif n not in feeds_layer:
            tags[n] = Tag(Direction.FWD, num_layers, StageKind.HEAD)
        elif n not in after_layer:
            tags[n] = Tag(Direction.FWD, -1, StageKind.EMBED)
        else:
            tags[n] = None  # between two layers: joins its producer's stage below

    # Backward nodes: the tag of the forward op that created their autograd node:
    # the first forward node with that seq_nr, unless a differentiable all-to-all
    # shares it (an autograd.Function whose forward copies its input before the
    # collective, as some releases trace functional collectives): then the backward
    # belongs with the communication, not with the copy.
    owner: dict[int, torch.fx.Node] = {}
    for n in fwd:
        seq = n.meta.get("seq_nr")
        if seq is None or n.op != "call_function":
            continue
        if seq not in owner:
            owner[seq] = n
        elif (
            _is_differentiable_comm(n, tags)
            and not _is_differentiable_comm(owner[seq], tags)
        ):
            owner[seq] = n
    for n in nodes:
        if _direction(n) is not Direction.BWD:
            continue
        f = owner.get(n.meta.get("seq_nr"))
        ft = tags.get(f) if f is not None else None
        tags[n] = Tag(Direction.BWD, ft.layer, ft.kind) if ft is not None else None
    return _finish(gm, tags, num_layers)


def _is_differentiable_comm(node: torch.fx.Node, tags: dict) -> bool:
    t = tags.get(node)
    val = node.meta.get("val")
    return (
        t is not None and t.kind in (StageKind.DISPATCH, StageKind.COMBINE) and _comm_kind(node) is not None
        and isinstance(val, torch.Tensor) and val.is_floating_point()
    )


def _finish(gm: torch.fx.GraphModule, tags: dict, num_layers: int) -> torch.fx.GraphModule:
    """Fill untagged nodes from neighbours; make every node no earlier than its producers."""
    key = lambda t: t.sort_key(num_layers)  # noqa: E731
    graph_nodes = [n for n in gm.graph.nodes if n in tags]
    for n in graph_nodes:  # producers first
        prod = [tags[p] for p in n.all_input_nodes if tags.get(p) is not None and tags[p].direction is _direction(n)]
        cur = tags[n]
        if prod:
            latest = max(prod, key=key)
            if cur is None or key(latest) > key(cur):
                if cur is not None and cur.kind in (StageKind.DISPATCH, StageKind.COMBINE) and latest.kind != cur.kind and cur.direction is Direction.FWD:
                    raise TagError(
                        f"node {n.name} ({op_name(n)}) is the {cur.kind} of layer {cur.layer} but depends "
                        f"on {latest} work; the layer's stages would form a cycle"
                    )
                tags[n] = latest
    for n in reversed(graph_nodes):  # still untagged (constants, fresh tensors): first consumer
        if tags[n] is None:
            cons = [tags[u] for u in n.users if tags.get(u) is not None]
            if cons:
                tags[n] = min(cons, key=key)
            else:
                tags[n] = Tag(_direction(n), num_layers, StageKind.HEAD)
    for n in graph_nodes:
        n.meta[TAG_KEY] = tags[n]
    return gm
