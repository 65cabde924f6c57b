"""split: cut the tagged joint graph into stage subgraphs with explicit inputs and outputs.

Contract
--------
Assumes: ``tag`` ran (and ``side``, ``recompute`` where configured): every node but
placeholders and the output carries a :class:`~fxoverlap.ir.stage.Tag`, and sorting the
tags by ``Tag.sort_key`` orders every node after its producers.

Guarantees: one :class:`~fxoverlap.ir.stage.Stage` per tag, in plain execution order
(every forward stage, then every backward stage), each holding the nodes of its tag,
in graph order, as its own GraphModule. Its inputs are the values it reads from
placeholders or other stages (saved activations are simply forward-stage outputs
that a backward stage reads); its outputs are the values another stage or the graph
output reads; a stage whose inputs' shapes use an unbacked size only inside an
expression (``u + 120``) takes that size as an input too, so a compiler can bind it.
Every stage records whether a CUDA graph can hold it (``not_capturable_reason``:
communication, a host sync, a data-dependent shape, an in-place op, or nothing to
launch), with the node that makes it so: the one place that is decided. The joint graph is not changed.

With ``delay_wgrad``, each backward ``attn``/``experts``/``mlp`` stage is cut in
two: the weight-gradient part (nodes whose results reach only parameter-gradient
outputs) becomes a stage of its own, part ``WGRAD`` (``<name>_wgrad``), so the
schedule can run it where it fills a comm slot. A layer's stages are cut together
(its chunks, its attn and experts), so a weight gradient that reaches its output through
another of the layer's stages (the chunks' sum; the cast back of a weight cast in the
forward's attn stage) is still in its part; a main part never reads a wgrad part.

Steps
-----
1. Group the tagged nodes by tag; with ``delay_wgrad``, cut the weight-gradient part
   off each backward attn/experts/mlp group (``_wgrad_part``); a multi-output op's
   getitems and a view that only passes a value on go with the node they read.
2. Per group in plain order: inputs and outputs (``stage_boundary``), the stage
   graph (``build_stage_module``), capturability (``not_capturable_reason``).
3. Check that no stage reads a value a later stage produces (``_check_order``).

Entry point: ``split(gm, num_layers, delay_wgrad=False) -> list[Stage]`` (plain data).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn as nn

from fxoverlap.ir.meta import RECOMPUTE_LAYERS_KEY, TAG_KEY, computes, draws_random_numbers, is_host_sync, op_name
from fxoverlap.ir.stage import COMM_KINDS, MOE_CHAIN_KINDS, Direction, Part, Stage, StageKind, Tag, stage_name
from fxoverlap.ir.errors import InternalError


def _has_unbacked_shape(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    for v in vals:
        if isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape):
            return True
        if isinstance(v, torch.SymInt):
            return True
    return False


def _copy_attr(src: nn.Module, dst: nn.Module, target: str) -> None:
    *path, leaf = target.split(".")
    for p in path:
        src = getattr(src, p)
        if not hasattr(dst, p):
            dst.add_module(p, nn.Module())
        dst = getattr(dst, p)
    val = getattr(src, leaf)
    if isinstance(val, torch.Tensor) and not isinstance(val, nn.Parameter):
        dst.register_buffer(leaf, val)
    else:
        setattr(dst, leaf, val)


def stage_boundary(nodes: list[torch.fx.Node], copied: dict[torch.fx.Node, set] | None = None,
                   group_of: dict[torch.fx.Node, object] | None = None, tag: object = None,
                   symbols: dict[object, list[torch.fx.Node]] | None = None) -> tuple[list[str], list[str]]:
    """Names of the values ``nodes`` read from outside, and of those they hand out. ``copied``
    (node -> the groups that compute a copy of it), ``group_of`` (node -> its own group) and
    ``tag`` (this group): a value whose outside readers all compute their own copy is not handed
    out, nor is a copy (its own group hands it out where anything must). ``symbols`` (group ->
    the size values it takes besides, see :func:`_symbols_to_pass`): read and handed out too."""
    members = set(nodes)
    inputs: list[str] = []
    outputs: list[str] = []
    passed = {n for group, ns in (symbols or {}).items() if group != tag for n in ns}
    for n in nodes:
        for p in n.all_input_nodes:
            if p not in members and p.name not in inputs:
                inputs.append(p.name)
        if copied and n in copied and group_of.get(n) != tag:
            continue
        if n in passed or any(u not in members and not (copied and group_of.get(u) in copied.get(n, ()))
                              for u in n.users):
            outputs.append(n.name)
    for p in (symbols or {}).get(tag, ()):
        if p not in members and p.name not in inputs:
            inputs.append(p.name)
    return inputs, outputs


def _symbols_to_pass(gm: torch.fx.GraphModule, groups: dict[Tag, list[torch.fx.Node]]
                     ) -> dict[Tag, list[torch.fx.Node]]:
    """Per group, the size values (SymInt nodes) it must take as inputs although none of its
    nodes reads them: an unbacked symbol ``u`` that its inputs' shapes use only inside an
    expression (``u + 120``: FP8's groups padded to 16 rows) and never bare. A compiler binds a
    stage's symbols from its inputs (a bare size, or a SymInt input); without ``u`` itself,
    Inductor cannot generate the code for ``u + 120``. Only within one layer's MoE chain
    (dispatch, experts, combine and their parts), where ``u`` is made: the stages outside
    the chains stay the same whether ``chunk`` cut the layer or not, which its whole chains
    need (``chunk.with_whole_chains``)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    defined: dict[object, torch.fx.Node] = {}  # a bare symbol -> the first node whose value it is
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol:
            defined.setdefault(v.node.expr, n)
    out: dict[Tag, list[torch.fx.Node]] = {}
    for tag, nodes in groups.items():
        members = set(nodes)
        bare, used = set(), set()
        for p in {p for n in nodes for p in n.all_input_nodes if p not in members}:
            v = p.meta.get("val")
            for x in v if isinstance(v, (tuple, list)) else (v,):
                sizes = (x,) if isinstance(x, torch.SymInt) else (
                    (*x.shape, *x.stride()) if isinstance(x, torch.Tensor) else ())
                for size in sizes:
                    if not isinstance(size, torch.SymInt):
                        continue
                    if size.node.expr.is_Symbol:
                        bare.add(size.node.expr)
                    else:
                        used.update(free_unbacked_symbols(size.node.expr))
        missing = sorted(used - bare, key=str)
        if take := [defined[u] for u in missing if u in defined and defined[u] not in members
                    and _same_chain(tag, defined[u].meta.get(TAG_KEY))]:
            out[tag] = take
    return out


def _same_chain(a: Tag | None, b: Tag | None) -> bool:
    """Whether two tags are of one layer's MoE chain (dispatch, experts, combine)."""
    return (a is not None and b is not None and a.layer == b.layer and a.kind in MOE_CHAIN_KINDS
            and b.kind in MOE_CHAIN_KINDS)


def build_stage_module(
    gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], inputs: list[str], outputs: list[str], name: str
) -> torch.fx.GraphModule:
    """A GraphModule computing ``outputs`` from ``inputs`` with copies of ``nodes``."""
    by_name = {n.name: n for n in gm.graph.nodes}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i in inputs:
        ph = graph.placeholder(i)
        ph.meta = dict(by_name[i].meta)
        env[by_name[i]] = ph
    root = nn.Module()
    for n in nodes:
        if n.op == "get_attr":
            _copy_attr(gm, root, n.target)
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[by_name[o]] for o in outputs))
    return torch.fx.GraphModule(root, graph, class_name=name)


_WGRAD_KINDS = (StageKind.ATTN, StageKind.EXPERTS, StageKind.MLP)


def _wgrad_part(nodes: list[torch.fx.Node], output: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes of a backward stage whose results reach only the graph's gradient outputs
    (a backward node that feeds the graph output feeds a gradient)."""
    wgrad: set[torch.fx.Node] = set()
    for n in reversed(nodes):
        users = list(n.users)
        if users and all(u in wgrad or u is output for u in users):
            wgrad.add(n)
    # A wgrad part made only of views of saved tensors is not worth a stage.
    return [n for n in nodes if n in wgrad] if any(computes(n) for n in wgrad) else []


def _wgrad_cut(tags: list[Tag], groups: dict[Tag, list[torch.fx.Node]], together: list[torch.fx.Node],
               output: torch.fx.Node) -> dict[Tag, list[torch.fx.Node]]:
    """Per tag of one layer's backward stages, the nodes its ``_wgrad`` part takes. A tag whose
    share is only views keeps it (not worth a stage), so a node of another tag's part that feeds
    it must stay too (a main part never reads a wgrad part: a ZeroBubble pipeline schedule runs
    every wgrad part after every main one): repeated until nothing more stays."""
    wset = set(_wgrad_part(together, output))
    while True:
        cut = {}
        for t in tags:
            w = [n for n in groups[t] if n in wset]
            if w and len(w) < len(groups[t]) and any(computes(n) for n in w):
                cut[t] = w
        taken = {n for w in cut.values() for n in w}
        kept: set[torch.fx.Node] = set()
        for n in reversed(together):  # users before the nodes they read
            if n in taken and all(u in kept or u is output for u in n.users):
                kept.add(n)
        if kept == wset:
            return cut
        wset = kept


def launches_kernel(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph computes anything (not only views and metadata ops)."""
    return any(computes(n) for n in gm.graph.nodes)


def not_capturable_reason(name: str, kind: StageKind, gm: torch.fx.GraphModule) -> str | None:
    """Why a CUDA graph cannot hold this stage, or None: the one place capturability is decided.

    Communication stays eager (NCCL kernels in a graph hung process-group teardown
    on the GPU machine); a host sync or a data-dependent shape cannot be replayed; an
    in-place op would be repeated on the graph's static copy of its input; a stage
    of only views and metadata ops has nothing to capture (its outputs would alias
    the graph's static inputs).
    """
    if kind in COMM_KINDS:
        return f"stage {name}: communication stage (stays eager on the comm stream)"
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if is_host_sync(n):
            return f"stage {name}: host sync at node {n.name} ({op_name(n)})"
        if _has_unbacked_shape(n):
            return f"stage {name}: data-dependent shape at node {n.name} ({op_name(n)})"
        if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            return f"stage {name}: in-place op at node {n.name} ({op_name(n)}) mutates an input"
    for n in gm.graph.find_nodes(op="placeholder"):
        if _has_unbacked_shape(n):  # a graph's static copy of it has one row count; the next call's differs
            return f"stage {name}: data-dependent shape of input {n.target}"
    if not launches_kernel(gm):
        return f"stage {name}: only views and metadata ops, nothing to capture"
    return None


def split(gm: torch.fx.GraphModule, num_layers: int, delay_wgrad: bool = False,
          static: frozenset[str] | None = None) -> list[Stage]:
    groups: dict[Tag, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        t = n.meta.get(TAG_KEY)
        if t is not None:
            groups.setdefault(t, []).append(n)
    if delay_wgrad:
        output = next(iter(gm.graph.find_nodes(op="output")))
        # a layer's backward attn/experts/mlp stages together: an earlier chunk's weight gradient
        # feeds the chunks' sum in the last chunk's stage (``chunk``), and a weight cast in the
        # forward's attn stage (torchtitan's ``w.bfloat16()``, independent of the dispatch) puts
        # the gradient's cast back in the backward's attn stage, so the experts' weight-gradient
        # GEMM reaches only gradient outputs through the attn stage
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        kin: dict[int | None, list[Tag]] = {}
        for t in groups:
            if t.direction is Direction.BWD and t.kind in _WGRAD_KINDS and t.part is Part.MAIN:
                kin.setdefault(t.layer, []).append(t)
        for tags in kin.values():
            together = sorted((n for t in tags for n in groups[t]), key=order.get)
            for t, w in _wgrad_cut(tags, groups, together, output).items():
                groups[t] = [n for n in groups[t] if n not in w]
                groups[t.with_part(Part.WGRAD)] = w
    _keep_results_with_their_op(groups)
    _keep_passing_views_with_their_input(groups)
    group_of = {n: t for t, nodes in groups.items() for n in nodes}
    copied = None if static is None else _derive_weight_values_where_read(groups, static)
    symbols = _symbols_to_pass(gm, groups)
    stages = []
    for t in sorted(groups, key=lambda k: k.sort_key(num_layers)):
        nodes = groups[t]
        inputs, outputs = stage_boundary(nodes, copied, group_of, t, symbols)
        name = stage_name(t)
        stage_gm = build_stage_module(gm, nodes, inputs, outputs, name)
        stages.append(Stage(
            name=name,
            tag=t,
            graph_module=stage_gm,
            inputs=inputs,
            outputs=outputs,
            not_capturable_reason=not_capturable_reason(name, t.kind, stage_gm),
            recompute_layers=tuple(nodes[0].meta.get(RECOMPUTE_LAYERS_KEY, ())),
        ))
    _check_order(stages)
    return stages


def _keep_results_with_their_op(groups: dict[Tag, list[torch.fx.Node]]) -> None:
    """Move each ``getitem`` of a multi-output op into the op's stage: a stage hands out
    tensors, never the tuple of an op (Inductor and CUDA graphs take flat outputs). A
    getitem computes nothing, and its new stage runs no later than its old one."""
    group_of = {n: t for t, nodes in groups.items() for n in nodes}
    moved: dict[Tag, set[torch.fx.Node]] = {}
    for t, nodes in groups.items():
        for n in nodes:
            if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
                src = group_of.get(n.args[0])
                if src is not None and src != t:
                    moved.setdefault(t, set()).add(n)
                    group_of[n] = src
    if not moved:
        return
    for t, nodes in moved.items():
        groups[t] = [n for n in groups[t] if n not in nodes]
    order = {n: i for i, n in enumerate(next(iter(groups.values()))[0].graph.nodes)}
    for n in set().union(*moved.values()):
        groups[group_of[n]].append(n)
    for t in list(groups):
        groups[t].sort(key=order.get)
        if not groups[t]:
            del groups[t]


def _keep_passing_views_with_their_input(groups: dict[Tag, list[torch.fx.Node]]) -> None:
    """Move each view that only passes a value on (its one input made by another stage, no
    user in its own stage) into its input's stage: the value then crosses one boundary as
    the view, instead of into a stage that only re-views it (a Hugging Face model's expert
    weight gradients, transposed back to the parameter's layout, were read by the backward
    attn stage, whose CUDA graph then had to copy them in). A view launches nothing; its
    new stage runs before its old one and before every stage that reads it."""
    group_of = {n: t for t, nodes in groups.items() for n in nodes}
    moved = False
    for n, t in list(group_of.items()):
        ins = n.all_input_nodes
        if (not (isinstance(n.target, torch._ops.OpOverload) and n.target.is_view)
                or not isinstance(n.meta.get("val"), torch.Tensor) or len(ins) != 1
                or group_of.get(ins[0]) in (None, t) or any(group_of.get(u) == t for u in n.users)):
            continue
        group_of[n] = group_of[ins[0]]
        moved = True
    if not moved:
        return
    order = {n: i for i, n in enumerate(next(iter(groups.values()))[0].graph.nodes)}
    groups.clear()
    for n in sorted(group_of, key=order.get):
        groups.setdefault(group_of[n], []).append(n)


def _derive_weight_values_where_read(groups: dict[Tag, list[torch.fx.Node]],
                                     static: frozenset[str]) -> dict[torch.fx.Node, set[Tag]]:
    """Each stage computes the values it reads that come from parameters and buffers alone (a
    transposed weight, its cast) itself, from the placeholders, instead of reading them from the
    stage that made them: so no value made of a parameter crosses a stage boundary, and a stage
    that reads a parameter reads the placeholder (fully sharded parameters are gathered around
    their readers and freed after: a forward stage's ``w.t()`` kept for the backward would keep
    the gathered weight alive). Returns node -> the groups that compute a copy of it."""
    weights: set[torch.fx.Node] = set()
    graph_nodes = next(iter(groups.values()))[0].graph.nodes
    for n in graph_nodes:
        ins = n.all_input_nodes
        # (a random draw or an in-place op is never computed twice: eager runs it once)
        if n.op == "call_function" and ins and not draws_random_numbers(n) and not (
                isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable) and all(
                (i.op == "placeholder" and i.name in static) or i in weights for i in ins):
            weights.add(n)
    group_of = {n: t for t, nodes in groups.items() for n in nodes}
    order = {n: i for i, n in enumerate(graph_nodes)}
    copied: dict[torch.fx.Node, set[Tag]] = {}
    for t, nodes in groups.items():
        members = set(nodes)
        todo = [i for n in nodes for i in n.all_input_nodes if i in weights and i not in members]
        while todo:
            w = todo.pop()
            if w in members:
                continue
            members.add(w)
            copied.setdefault(w, set()).add(t)
            todo.extend(i for i in w.all_input_nodes if i in weights and i not in members)
        if len(members) != len(nodes):
            groups[t] = sorted(members, key=order.get)
    # a weight value that only copies read is dropped from its own group
    for w in copied:
        own = group_of.get(w)
        if own is not None and all(u.op != "output" and group_of.get(u) != own and group_of.get(u) in copied[w]
                                   for u in w.users):
            groups[own] = [n for n in groups[own] if n is not w]
    for t in [t for t, nodes in groups.items() if not nodes]:
        del groups[t]
    return copied


def _check_order(stages: list[Stage]) -> None:
    producer = {o: st for st in stages for o in st.outputs}
    produced: set[str] = set()
    for s in stages:
        for i in s.inputs:
            node_stage = producer.get(i)
            if node_stage is not None and i not in produced:
                raise InternalError(
                    f"split: stage {s.name} reads {i} from {node_stage.name}, which runs later; "
                    f"the tag pass left a cycle"
                )
        produced.update(s.outputs)
