"""Compact renderings of graphs for expecttest snapshots."""

from __future__ import annotations

import pytest
import torch

import re

from fxoverlap.ir.meta import TAG_KEY, op_name

requires_pinned_torch = pytest.mark.skipif(
    not torch.__version__.startswith("2.13"),
    reason="graph snapshots are pinned to torch 2.13 (aten op names change across releases)",
)


def render_tagged(gm: torch.fx.GraphModule, direction: str = "fwd") -> str:
    """One line per node of ``direction``: tag, name, op, input names."""
    lines = []
    for n in gm.graph.nodes:
        t = n.meta.get(TAG_KEY)
        if t is None or t.direction.value != direction:
            continue
        args = ", ".join(a.name for a in n.all_input_nodes)
        lines.append(f"{t.layer:>2} {t.kind.value:<8} {n.name} = {op_name(n) if n.op == 'call_function' else n.op}({args})")
    return "\n".join(lines)


def render_program(program: torch.fx.GraphModule) -> str:
    """The program's code without FX's trailing `x = None` bookkeeping; a free, output,
    accumulate, mutate or reduce_grads node of more than three values shows how many."""
    out = []
    for line in program.code.strip().splitlines():
        line = line.split(";  ")[0].strip()
        m = re.match(r"(.*fxoverlap_program_(?:free|output|accumulate|mutate|reduce_grads)\((\d+), (?:\d+, )?)(.*)\)$", line)
        if m and m.group(3).count(",") >= 3:
            line = f"{m.group(1)}<{m.group(3).count(',') + 1} values>)"
        if line and not line.startswith("return"):
            out.append(line)
    return "\n".join(out)
