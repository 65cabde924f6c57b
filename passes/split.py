"""split: cut the tagged joint graph into stage subgraphs with explicit inputs and outputs.

Each stage holds the nodes of one tag, in graph order, as its own GraphModule.
Its inputs are the values it reads from placeholders or other stages (saved
activations are simply forward-stage outputs that a backward stage reads); its
outputs are the values another stage or the graph output reads. Stages come
back in plain execution order: every forward stage, then every backward stage.

A stage with a host sync (``.item()``, ``.tolist()``) or a data-dependent shape
is recorded as not capturable (for CUDA graphs), with the node that makes it so.

Entry point: ``split(gm, num_layers) -> list[Stage]`` (plain data); assumes
``tag`` ran.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn as nn

from fxoverlap.passes.tag import TAG_KEY, is_host_sync, op_name
from fxoverlap.stage import COMM_KINDS, Stage, StreamKind, Tag, stage_name


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


def split(gm: torch.fx.GraphModule, num_layers: int) -> list[Stage]:
    groups: dict[Tag, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        t = n.meta.get(TAG_KEY)
        if t is not None:
            groups.setdefault(t, []).append(n)
    owner = {n: t for t, ns in groups.items() for n in ns}
    stages = []
    for t in sorted(groups, key=lambda t: t.sort_key(num_layers)):
        nodes = groups[t]
        members = set(nodes)
        inputs: list[str] = []
        outputs: list[str] = []
        for n in nodes:
            for p in n.all_input_nodes:
                if p not in members and p.name not in inputs:
                    inputs.append(p.name)
            if any(u not in members for u in n.users):
                outputs.append(n.name)
        name = stage_name(t)
        stage = Stage(
            name=name,
            layer=t.layer,
            kind=t.kind,
            direction=t.direction,
            stream=StreamKind.COMM if t.kind in COMM_KINDS else StreamKind.COMP,
            graph_module=build_stage_module(gm, nodes, inputs, outputs, name),
            inputs=inputs,
            outputs=outputs,
        )
        for n in nodes:
            if is_host_sync(n):
                stage.capturable, stage.not_capturable_reason = False, f"host sync at node {n.name} ({op_name(n)})"
                break
            if _has_unbacked_shape(n):
                stage.capturable = False
                stage.not_capturable_reason = f"data-dependent shape at node {n.name} ({op_name(n)})"
                break
        if stage.stream is StreamKind.COMM:
            stage.capturable, stage.not_capturable_reason = False, "communication stage"
        stages.append(stage)
    _check_order(stages, owner)
    return stages


def _check_order(stages: list[Stage], owner: dict) -> None:
    produced: set[str] = set()
    for s in stages:
        for i in s.inputs:
            node_stage = next((st for st in stages if i in st.outputs), None)
            if node_stage is not None and i not in produced:
                raise AssertionError(
                    f"split: stage {s.name} reads {i} from {node_stage.name}, which runs later; "
                    f"the tag pass left a cycle"
                )
        produced.update(s.outputs)
