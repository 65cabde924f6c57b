"""The backend's Dynamo graph -> :class:`Capture` adapter.

Dynamo hands the backend its forward GraphModule, parameters lifted to graph inputs. This module

1. **writes layer candidates** (:func:`annotate_layers`): the entry of every candidate layer
   list a Dynamo node runs in comes from its ``nn_module_stack`` (``L['self'].layers.0.moe...``),
   written into ``node.meta["custom"]`` under the key the capture pass's hooks write for
   ``optimize``, with a :class:`~fxoverlap.passes.layers.LayerCandidate` per list (entry names,
   the children that read a parameter, whether the entries ran in order). Which list holds the
   decoder layers, and the capture's layer facts, are the capture pass's (``passes/layers.py``,
   the one finder of both front ends). Dynamo turns an activation checkpoint into a
   ``tag_activation_checkpoint`` call of a body graph: its body's nodes are annotated too, and
   marked as checkpointed, so the recompute pass replays them as it does under ``optimize``;
2. **captures the joint graph** (:func:`capture_graph`) with the ordinary capture pass
   (``scalar_loss=False``: the graph may return logits or several tensors): a thin module
   (:class:`GraphStep`) holds the differentiable graph inputs as parameters and runs the Dynamo
   graph through an ``fx.Interpreter`` under ``preserve_node_meta``, so every aten node inherits
   the annotation of the Dynamo node it came from, and backward nodes carry ``seq_nr``.

What the backend does not handle raises :class:`~fxoverlap.backend_fallback.BackendUnsupported`
(it falls back).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from fxoverlap.backend_fallback import BackendUnsupported
from fxoverlap.ir.capture import Capture
from fxoverlap.ir.meta import CHECKPOINT_KEY, LIST_KEY
from fxoverlap.passes.capture import WRAPPED_MODULE_ATTRS, capture
from fxoverlap.passes.layers import LayerCandidate

__all__ = ["GraphStep", "annotate_layers", "capture_graph", "check_supported", "module_path"]

_ROOT = re.compile(r"^[A-Za-z_]\w*\[(['\"])[^'\"]*\1\]")  # L['self'], L["model"], ...


def module_path(path: str) -> tuple[str, ...]:
    """``"L['self'].layers[0].attention"`` -> ``("layers", "0", "attention")``; the module a
    wrapper holds (``checkpoint_wrapper``'s ``_checkpoint_wrapped_module``) takes the
    wrapper's place: ``layers.0.__dict__['_modules']['_checkpoint_wrapped_module'].moe`` ->
    ``("layers", "0", "moe")``."""
    path = _ROOT.sub("", path, count=1)
    path = re.sub(r"\.__dict__\[(['\"])_modules\1\]", "", path)
    path = re.sub(r"\._modules\[(['\"])(.*?)\1\]", r".\2", path)
    path = re.sub(r"\[(['\"])(.*?)\1\]", r".\2", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return tuple(p for p in path.split(".") if p and p not in WRAPPED_MODULE_ATTRS)


def _stack_paths(node: torch.fx.Node) -> list[tuple[str, ...]]:
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for val in stack.values():
        p = val[0] if isinstance(val, tuple) else val
        if isinstance(p, str):
            out.append(module_path(p))
    return out



    def num_layers(self) -> int:
        return len(self.layer_names)


def _candidates(paths: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Every module list among ``paths`` (a module with integer children), outer ones first.
    Which one holds the decoder layers is decided after capture, from where the
    all-to-alls ran (``passes/layers.py``, shared with ``fxoverlap.optimize``)."""
    kids: dict[tuple[str, ...], list[str]] = {}
    for p in paths:
        for i in range(1, len(p)):
            if p[i].isdigit():
                lst = kids.setdefault(p[:i], [])
                if p[i] not in lst:
                    lst.append(p[i])
    return sorted(kids, key=len)


def _layer_and_child(paths: list[tuple[str, ...]], container: tuple[str, ...]) -> tuple[str, str | None] | None:
    """The decoder layer a node runs in and the layer's child that runs it, from the node's
    module stack (outermost first). A child reached through a bound method (a layer whose
    ``forward`` was replaced by ``partial(checkpoint, layer.forward)``: path
    ``layers.0.forward.args[0].__self__.attention``) is the module after ``__self__``."""
    k = len(container)
    for j, p in enumerate(paths):
        if len(p) <= k or p[:k] != container:
            continue
        for q in paths[j:]:
            if "__self__" in q:
                at = len(q) - 1 - q[::-1].index("__self__")
                if at + 1 < len(q):
                    return p[k], q[at + 1]
            elif len(q) > k + 1 and q[: k + 1] == p[: k + 1]:
                return p[k], q[k + 1]
        return p[k], None
    return None


def _bodies(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """The subgraphs a higher-order op node runs (``tag_activation_checkpoint``'s body)."""
    out = []
    for a in node.args:
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            sub = getattr(gm, a.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                out.append(sub)
    return out


def _execution_order(gm: torch.fx.GraphModule, params: set[torch.fx.Node], checkpoint: str | None = None,
                     seen: set[int] | None = None) -> list[tuple[torch.fx.Node, str | None]]:
    """The nodes a Dynamo graph runs, each with the checkpoint call it runs in: a
    higher-order op's body nodes come right before the op node (a
    ``tag_activation_checkpoint`` body is checkpoint ``<op node name>``). ``params``
    gains each body placeholder that receives a parameter."""
    from torch._higher_order_ops.wrap import tag_activation_checkpoint

    seen = set() if seen is None else seen
    out = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        for body in _bodies(gm, n):
            if id(body) in seen:  # its nodes' annotations would have to name two layers
                raise BackendUnsupported(f"node {n.name} ({n.target}) runs a subgraph another call runs too; "
                                   f"fxoverlap annotates each subgraph with one decoder layer")
            seen.add(id(body))
            inner = checkpoint if n.target is not tag_activation_checkpoint else n.name
            outer_args = [a for a in n.args if not (isinstance(a, torch.fx.Node) and a.op == "get_attr"
                                                     and isinstance(getattr(gm, a.target, None), torch.fx.GraphModule))]
            for ph, a in zip(body.graph.find_nodes(op="placeholder"), outer_args):
                if a in params:
                    params.add(ph)
            out += _execution_order(body, params, inner, seen)
        out.append((n, checkpoint))
    return out


def annotate_layers(
    gm: torch.fx.GraphModule, differentiable: set[str] | None = None, layer_container: str | None = None
) -> dict[str, LayerCandidate]:
    """Write ``{LIST_KEY: {list: (i, child)}}`` (``passes/layers.py``) into
    ``node.meta["custom"]`` of every Dynamo node that runs inside entry ``i`` (child
    ``name``) of a candidate layer list, the nodes of checkpoint bodies included (these
    also get ``fxoverlap_checkpoint``); return each candidate's
    :class:`~fxoverlap.passes.layers.LayerCandidate` (what the capture pass chooses among).

    The candidates are ``layer_container`` (an attribute path such as ``"layers"``) or,
    by default, every module list seen in the nodes' ``nn_module_stack``; entries are
    numbered in execution order. The capture pass chooses among them, as it does for
    ``fxoverlap.optimize``. ``differentiable`` names the placeholders that are
    parameters: the children that read one are the candidate's ``param_children``.
    """
    differentiable = differentiable or set()
    params = {n for n in gm.graph.find_nodes(op="placeholder") if n.name in differentiable}
    params |= {n for n in gm.graph.nodes if n.op == "get_attr" and not isinstance(getattr(gm, n.target, None), torch.fx.GraphModule)}
    flat = _execution_order(gm, params)
    node_paths = {n: _stack_paths(n) for n, _ in flat}
    if layer_container is not None:
        containers = [tuple(p for p in layer_container.split(".") if p)]
    else:
        containers = _candidates([p for ps in node_paths.values() for p in ps])
    order: dict[tuple[str, ...], list[str]] = {c: [] for c in containers}
    child_order: dict[tuple[str, ...], dict[str, list[str]]] = {c: {} for c in containers}
    param_children: dict[tuple[str, ...], dict[str, set[str]]] = {c: {} for c in containers}
    last: dict[tuple[str, ...], int] = {}
    in_order = {c: True for c in containers}
    for n, checkpoint in flat:
        if checkpoint is not None:  # a body node: the recompute pass may replay it
            n.meta["custom"] = {**(n.meta.get("custom") or {}), CHECKPOINT_KEY: checkpoint}
        lists = {}
        for c in containers:
            found = _layer_and_child(node_paths[n], c)
            if found is None:
                continue
            layer_name, child = found
            if layer_name not in order[c]:
                order[c].append(layer_name)
            i = order[c].index(layer_name)
            in_order[c] &= i >= last.get(c, 0)
            last[c] = i
            if child is not None:
                kids = child_order[c].setdefault(layer_name, [])
                if child not in kids:
                    kids.append(child)
                if any(p in params for p in n.all_input_nodes):
                    param_children[c].setdefault(layer_name, set()).add(child)
            lists[".".join(c)] = (i, child)
        if lists:
            n.meta["custom"] = {**(n.meta.get("custom") or {}), LIST_KEY: lists}
    if layer_container is not None and not order[containers[0]]:
        raise BackendUnsupported(f"layer_container={layer_container!r} names no module that runs in the graph")
    found = {}
    for c in containers:
        if not order[c]:
            continue
        # a dense layer's FFN is its last child that reads a parameter (as the capture pass's hooks decide)
        owners = {i: frozenset(kids) for i, name in enumerate(order[c])
                  if (kids := [k for k in child_order[c].get(name, []) if k in param_children[c].get(name, set())])}
        found[".".join(c)] = LayerCandidate(tuple(order[c]), owners, in_order[c])
    return found


# ------------------------------------------------------------------ capture of a Dynamo graph


class GraphStep(nn.Module):
    """The Dynamo graph as a model: differentiable graph inputs become parameters
    ``in{i}``, the others stay inputs; the graph runs through an interpreter so
    node metadata reaches the traced aten nodes."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]):
        super().__init__()
        self.g = gm
        self.num_inputs = len(example_inputs)
        self.diff_index = [i for i, t in enumerate(example_inputs) if t.requires_grad]
        self.plain_index = [i for i, t in enumerate(example_inputs) if not t.requires_grad]
        for i in self.diff_index:
            self.register_parameter(f"in{i}", nn.Parameter(example_inputs[i].detach(), requires_grad=True))

    def forward(self, *plain: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args: list = [None] * self.num_inputs
        for i in self.diff_index:
            args[i] = getattr(self, f"in{i}")
        for i, t in zip(self.plain_index, plain):
            args[i] = t
        with fx_traceback.preserve_node_meta():
            out = torch.fx.Interpreter(self.g).run(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)



def check_supported(gm: torch.fx.GraphModule, example_inputs, train: bool = True) -> None:
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor):
            raise BackendUnsupported(
                f"graph input {i} is a {type(t).__name__} (dynamic shapes); fxoverlap captures static "
                f"shapes: compile with dynamic=False (each new shape is then compiled anew)"
            )
    for ph in gm.graph.find_nodes(op="placeholder"):
        ev = ph.meta.get("example_value")
        if isinstance(ev, torch.Tensor) and not all(isinstance(d, int) for d in ev.shape):
            raise BackendUnsupported(
                f"graph input {ph.name} has a dynamic shape {list(ev.shape)}; fxoverlap captures "
                f"static shapes: compile with dynamic=False (each new shape is then compiled anew)"
            )
    own = [name for name, p in gm.named_parameters() if p.requires_grad]
    if own:
        raise BackendUnsupported(
            f"parameters {own[:3]} are attributes of the graph, not graph inputs "
            f"(torch._dynamo.config.inline_inbuilt_nn_modules is off?)"
        )
    out = next(iter(gm.graph.find_nodes(op="output")))
    vals = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    evs = [v.meta.get("example_value") if isinstance(v, torch.fx.Node) else v for v in vals]
    if bad := [i for i, ev in enumerate(evs) if not isinstance(ev, torch.Tensor)]:
        raise BackendUnsupported(
            f"graph output {bad[0]} is {'None' if evs[bad[0]] is None else type(evs[bad[0]]).__name__}, not a "
            f"tensor; fxoverlap compiles graphs whose outputs are tensors"
        )
    if train and not any(ev.requires_grad for ev in evs):
        raise BackendUnsupported("no output of the graph requires grad (nothing to train)")


def capture_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], layer_container: str | None,
                  train: bool = True) -> tuple[Capture, GraphStep]:
    """The joint graph of Dynamo graph ``gm`` (``train=False``: its forward alone) and the
    :class:`GraphStep` it was traced from. The layer candidates come from the Dynamo nodes'
    module stacks; the capture pass chooses among them (``passes/layers.py``)."""
    check_supported(gm, example_inputs, train)
    diff = {n.name for n, t in zip(gm.graph.find_nodes(op="placeholder"), example_inputs) if t.requires_grad}
    candidates = annotate_layers(gm, diff, layer_container)
    wrapper = GraphStep(gm, example_inputs)
    plain = [example_inputs[i] for i in wrapper.plain_index]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tag's "no layers found" is reported by the backend
        cap = capture(wrapper, plain, scalar_loss=False, train=train, lists=candidates)
    if cap.subclass_placeholders or any(path for _, path in cap.input_parts.values()):
        raise BackendUnsupported("a graph input is a tensor subclass (a DTensor?); the backend runs plain "
                                 "tensors: use fxoverlap.optimize(model, ep_group), which takes DTensor "
                                 "parameters and inputs")
    return cap, wrapper
