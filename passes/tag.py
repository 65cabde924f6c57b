"""tag: give every node of the joint graph a ``(direction, layer, kind)`` tag.

Contract
--------
Assumes: a :class:`~fxoverlap.ir.capture.Capture` whose forward nodes inside
decoder layer ``i`` carry the annotation ``{LAYER_KEY: i, CHILD_KEY: child}``
(``node.meta["custom"]``), and whose backward nodes carry the ``seq_nr`` of the
forward op they differentiate.

Guarantees: every node but placeholders and the output gets ``meta[TAG_KEY]``, a
:class:`~fxoverlap.ir.stage.Tag`; sorting the tags by ``Tag.sort_key`` gives an order
in which every node comes no earlier than its producers (so the stages ``split``
cuts form a DAG in plain execution order). Nothing else in the graph changes.
A layer with a dispatch but no combine (or the reverse), an all-to-all outside
every layer, or a comm op that depends on its layer's experts work raises
:class:`TagError` naming the node and op and how to fix it.

Kinds come from data dependencies on the layer's communication nodes, not graph
order (a shared expert written after the dispatch call still lands in ``attn``,
so it can overlap the dispatch):

* ``dispatch`` / ``combine``: the all-to-all nodes, with what runs between two
  all-to-alls of the same group (e.g. the ``.tolist()`` of exchanged counts);
* ``experts``: depends on the dispatch, feeds the combine;
* ``post``: depends on the combine;
* ``attn``: the rest of the layer. A layer without communication is dense:
  its FFN (code marked ``fxoverlap.region("experts")``, else its last child with
  parameters to run outside region ``"mhc"``) and what depends on it are ``mlp``.

Communication is recognised by op (:data:`COMM_OPS`: fxoverlap's own ops,
functional collectives as torchtitan writes EP, the ``deepep::`` and ``hybridep::``
ops torchtitan registers for DeepEP and HybridEP) or by a
``fxoverlap.region("dispatch" | "combine")`` marker. Among unmarked all-to-alls,
one whose data input depends (other than through a host-side scalar) on another
all-to-all's output is a combine; the rest are dispatches.

Steps
-----
1. ``_LayerComm``: per forward layer, its comm nodes and their kinds.
2. Forward layers: kinds from dependencies on the comm nodes (``_tag_layer``).
3. Forward nodes outside layers: ``embed`` (feeds the first layer) or ``head``.
4. Backward nodes: the tag of the forward op with their ``seq_nr``.
5. Finish: untagged nodes take a neighbour's tag; every node moves to no earlier a
   stage than its producers.

Entry point: ``tag(capture) -> GraphModule`` (the capture's graph, tagged in place).
"""

from __future__ import annotations

import dataclasses
import operator
import warnings

import torch
import torch.fx

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.kernels.deepep import DEEPEP_COMBINE_OPS, DEEPEP_DISPATCH_OPS
from fxoverlap.ir.meta import CHILD_KEY, LAYER_KEY, REGION_KEY, TAG_KEY, custom, is_host_sync, op_name
from fxoverlap.ir.capture import Capture
from fxoverlap.ir.stage import COMM_KINDS, Direction, StageKind, Tag

# Communication ops by op name: what they are when no region marker says otherwise.
# None: an all-to-all whose role is decided by data dependencies.
# fxoverlap's own: the generic ops models write and the static ones the dispatcher pass
# lowers them to (backward comm ops take their forward op's tag by seq_nr); torchtitan's
# DeepEP/HybridEP ops (kernels/deepep.py).
COMM_OPS: dict[str, StageKind | None] = {
    **{f"fxoverlap.{op}{static}": StageKind.DISPATCH
       for op in ("dispatch", "token_dispatch") for static in ("", "_static")},
    **{f"fxoverlap.{op}{static}": StageKind.COMBINE
       for op in ("combine", "token_combine") for static in ("", "_static")},
    **{n.replace("::", "."): StageKind.DISPATCH for n in DEEPEP_DISPATCH_OPS},
    **{n.replace("::", "."): StageKind.COMBINE for n in DEEPEP_COMBINE_OPS},
    "_c10d_functional.all_to_all_single": None,
    "_c10d_functional_autograd.all_to_all_single": None,
}
_WAIT_OPS = frozenset({"_c10d_functional.wait_tensor"})
_REGION_KINDS = {"dispatch": StageKind.DISPATCH, "combine": StageKind.COMBINE}


class TagError(FxOverlapError, RuntimeError):
    """The graph's layers or communication cannot be told apart; the message says how to fix it."""


def _direction(node: torch.fx.Node) -> Direction:
    return Direction.BWD if node.meta.get("partitioner_tag") == "is_backward" else Direction.FWD


def comm_kind(node: torch.fx.Node) -> StageKind | None:
    """DISPATCH / COMBINE when known from a region marker or the op; None for other nodes.

    An all-to-all whose role only data dependencies can tell is reported as
    DISPATCH here; :class:`_LayerComm` decides it.
    """
    region = _REGION_KINDS.get(custom(node).get(REGION_KEY))
    if region is not None:
        return region
    name = op_name(node)
    if name not in COMM_OPS:
        return None
    return COMM_OPS[name] or StageKind.DISPATCH


def _is_comm(node: torch.fx.Node) -> bool:
    return comm_kind(node) is not None


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
                op_name(n) in _WAIT_OPS or n.target is operator.getitem
            ):
                out.add(n)
                changed = True
    return out


@dataclasses.dataclass(frozen=True)
class _LayerComm:
    """One forward layer's communication: the dispatch and combine nodes, each with
    what lies between its all-to-alls and the waits/unpacking of their results."""

    layer: int
    dispatch: frozenset[torch.fx.Node]
    combine: frozenset[torch.fx.Node]

    @staticmethod
    def find(layer: int, nodes: list[torch.fx.Node]) -> _LayerComm | None:
        comm = {n: comm_kind(n) for n in nodes if _is_comm(n)}
        if not comm:
            return None
        undecided = [n for n in comm if custom(n).get(REGION_KEY) not in _REGION_KINDS
                     and COMM_OPS.get(op_name(n), StageKind.DISPATCH) is None]
        if undecided:
            reach = _reach(set(comm), nodes[0].graph)
            for n in undecided:
                data_in: set = set()
                for p in n.all_input_nodes:
                    if not is_host_sync(p):
                        data_in |= reach.get(p, set())
                comm[n] = StageKind.COMBINE if data_in - {n} else StageKind.DISPATCH
        dispatch = _closure({n for n, k in comm.items() if k is StageKind.DISPATCH}, nodes)
        combine = _closure({n for n, k in comm.items() if k is StageKind.COMBINE}, nodes) - dispatch
        if not dispatch or not combine:
            first = next(iter(comm))
            have, miss = ("dispatch", "combine") if dispatch else ("combine", "dispatch")
            raise TagError(
                f"layer {layer}: node {first.name} ({op_name(first)}) is a {have} all-to-all but the layer "
                f"has no {miss}; fxoverlap overlaps layers with one dispatch and one combine. Mark the "
                f"missing one with fxoverlap.region({miss!r}), or move the collective out of the layer"
            )
        return _LayerComm(layer, frozenset(dispatch), frozenset(combine))


def _tag_layer(layer: int, nodes: list[torch.fx.Node], capture: Capture) -> dict[torch.fx.Node, Tag]:
    """Step 2: the forward nodes of one layer."""
    comm = _LayerComm.find(layer, nodes)
    kinds: dict[torch.fx.Node, StageKind] = {}
    if comm is None:
        ffn = _ffn_nodes(layer, nodes, capture)
        for n in nodes:
            kinds[n] = StageKind.MLP if n in ffn else StageKind.ATTN
        return {n: Tag(Direction.FWD, layer, k) for n, k in kinds.items()}
    after_dispatch: set[torch.fx.Node] = set()
    after_combine: set[torch.fx.Node] = set()
    for n in nodes:
        ins = n.all_input_nodes
        if n in comm.dispatch:
            kinds[n] = StageKind.DISPATCH
            after_dispatch.add(n)
        elif n in comm.combine:
            kinds[n] = StageKind.COMBINE
            after_combine.add(n)
        elif any(p in after_combine for p in ins):
            kinds[n] = StageKind.POST
            after_combine.add(n)
        elif any(p in after_dispatch for p in ins):
            kinds[n] = StageKind.EXPERTS
            after_dispatch.add(n)
        else:
            kinds[n] = StageKind.ATTN
        if custom(n).get(REGION_KEY) == "experts" and kinds[n] is not StageKind.EXPERTS and n.op == "call_function":
            raise TagError(
                f"layer {layer}: node {n.name} ({op_name(n)}) is marked fxoverlap.region('experts') but does "
                f"not lie between the layer's dispatch and combine (it is {kinds[n]} by its data "
                f"dependencies); move the marker to the code that computes on the dispatched tokens"
            )
    return {n: Tag(Direction.FWD, layer, k) for n, k in kinds.items()}


def _ffn_nodes(layer: int, nodes: list[torch.fx.Node], capture: Capture) -> set[torch.fx.Node]:
    """A dense layer's FFN and what depends on it: code marked region "experts", else
    its last child with parameters to run, ignoring hyper-connection code (region
    "mhc"), which may wrap the FFN from both sides."""
    marked = {n for n in nodes if custom(n).get(REGION_KEY) == "experts"}
    if not marked:
        owners = capture.param_children.get(layer, set())
        ffn = None
        for n in nodes:
            child = custom(n).get(CHILD_KEY)
            if child in owners and custom(n).get(REGION_KEY) != "mhc":
                ffn = child
        marked = {n for n in nodes if ffn is not None and custom(n).get(CHILD_KEY) == ffn}
    out: set[torch.fx.Node] = set()
    for n in nodes:
        if n in marked or any(p in out for p in n.all_input_nodes):
            out.add(n)
    return out


def _tag_outside(fwd: list[torch.fx.Node], in_layer: set[torch.fx.Node], num_layers: int) -> dict:
    """Step 3: forward nodes outside every layer: embed before the first layer, head after."""
    feeds_layer: set[torch.fx.Node] = set()
    for n in reversed(fwd):
        if n in in_layer or any(u in feeds_layer for u in n.users):
            feeds_layer.add(n)
    after_layer: set[torch.fx.Node] = set()
    for n in fwd:
        if n in in_layer or any(p in after_layer for p in n.all_input_nodes):
            after_layer.add(n)
    tags: dict[torch.fx.Node, Tag | None] = {}
    for n in fwd:
        if n in in_layer:
            continue
        if n.op == "get_attr":
            tags[n] = None  # a constant: lives with its first consumer
        elif n not in feeds_layer:
            tags[n] = Tag(Direction.FWD, num_layers, StageKind.HEAD)
        elif n not in after_layer:
            tags[n] = Tag(Direction.FWD, -1, StageKind.EMBED)
        else:
            tags[n] = None  # between two layers: joins its producer's stage in step 5
    return tags


def _tag_backward(nodes: list[torch.fx.Node], fwd: list[torch.fx.Node], tags: dict) -> dict:
    """Step 4: a backward node takes the tag of the forward op that created its autograd
    node: the first forward node with that seq_nr, unless a differentiable all-to-all
    shares it (an autograd.Function whose forward copies its input before the
    collective, as some releases trace functional collectives): then the backward
    belongs with the communication, not with the copy."""
    def differentiable_comm(n: torch.fx.Node) -> bool:
        t, val = tags.get(n), n.meta.get("val")
        return (t is not None and t.kind in COMM_KINDS and _is_comm(n)
                and isinstance(val, torch.Tensor) and val.is_floating_point())

    owner: dict[int, torch.fx.Node] = {}
    for n in fwd:
        seq = n.meta.get("seq_nr")
        if seq is None or n.op != "call_function":
            continue
        if seq not in owner or (differentiable_comm(n) and not differentiable_comm(owner[seq])):
            owner[seq] = n
    out: dict[torch.fx.Node, Tag | None] = {}
    for n in nodes:
        if _direction(n) is Direction.BWD:
            f = owner.get(n.meta.get("seq_nr"))
            ft = tags.get(f) if f is not None else None
            out[n] = Tag(Direction.BWD, ft.layer, ft.kind) if ft is not None else None
    return out


def _finish(gm: torch.fx.GraphModule, tags: dict, num_layers: int) -> torch.fx.GraphModule:
    """Step 5: fill untagged nodes from neighbours; make every node no earlier than its producers."""
    key = lambda t: t.sort_key(num_layers)  # noqa: E731
    graph_nodes = [n for n in gm.graph.nodes if n in tags]
    for n in graph_nodes:  # producers first
        prod = [tags[p] for p in n.all_input_nodes if tags.get(p) is not None and tags[p].direction is _direction(n)]
        cur = tags[n]
        if prod:
            latest = max(prod, key=key)
            if cur is None or key(latest) > key(cur):
                if (cur is not None and cur.kind in COMM_KINDS and latest.kind != cur.kind
                        and cur.direction is Direction.FWD):
                    raise TagError(
                        f"node {n.name} ({op_name(n)}) is the {cur.kind} of layer {cur.layer} but depends "
                        f"on {latest} work; the layer's stages would form a cycle"
                    )
                tags[n] = latest
    for n in reversed(graph_nodes):  # still untagged (constants, fresh tensors): first consumer
        if tags[n] is None:
            cons = [tags[u] for u in n.users if tags.get(u) is not None]
            tags[n] = min(cons, key=key) if cons else Tag(_direction(n), num_layers, StageKind.HEAD)
    for n in graph_nodes:
        n.meta[TAG_KEY] = tags[n]
    return gm


def _outside_error(n: torch.fx.Node, capture: Capture) -> str:
    """Why an all-to-all is in no layer, with the lists considered and ``layer_container=``."""
    container = capture.layer_names[0].rsplit(".", 1)[0] if capture.layer_names else None
    choice = capture.layer_choice
    considered = f" Layer lists considered: {choice.describe()}." if choice is not None else ""
    return (
        f"node {n.name} ({op_name(n)}) is an all-to-all outside every decoder layer of {container!r}: no "
        f"nn.ModuleList/ModuleDict of the model holds every all-to-all in its entries.{considered} "
        f"fxoverlap schedules communication per layer: move the all-to-all into a decoder layer, compute it "
        f"outside the captured step, or name the decoder-layer list with "
        f"OverlapConfig(layer_container='<path>') (torch.compile: options={{'layer_container': '<path>'}})"
    )


def tag(capture: Capture) -> torch.fx.GraphModule:
    gm = capture.graph_module
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "get_attr")]
    num_layers = capture.num_layers
    if num_layers == 0:
        warnings.warn(
            "fxoverlap: no decoder layers found (no nn.ModuleList/ModuleDict of modules with "
            "parameters); falling back to one stage per direction, with no overlap. Set "
            "OverlapConfig(layer_container='<path>') to the attribute that holds the layers.",
            stacklevel=3,
        )
        return _finish(gm, {n: Tag(_direction(n), 0, StageKind.HEAD) for n in nodes}, 0)

    fwd = [n for n in nodes if _direction(n) is Direction.FWD]
    by_layer: dict[int, list[torch.fx.Node]] = {}
    for n in fwd:
        layer = custom(n).get(LAYER_KEY)
        if layer is not None:
            by_layer.setdefault(layer, []).append(n)
        elif _is_comm(n):
            raise TagError(_outside_error(n, capture))
    tags: dict[torch.fx.Node, Tag | None] = {}
    for layer, layer_nodes in by_layer.items():
        tags.update(_tag_layer(layer, layer_nodes, capture))
    tags.update(_tag_outside(fwd, {n for ns in by_layer.values() for n in ns}, num_layers))
    tags.update(_tag_backward(nodes, fwd, tags))
    return _finish(gm, tags, num_layers)
