"""cudagraph: choose the stages the runtime runs as CUDA graphs.

Contract
--------
Assumes: ``split`` decided each stage's capturability (``stage.not_capturable_reason``:
communication, host syncs, data-dependent shapes, in-place ops, nothing to launch),
and its graphs carry ``meta["val"]`` on their placeholders (split keeps the joint
graph's). ``inductor`` runs after it and may lower the chosen stages too (a graphed
compiled stage is captured as its compiled kernels).

Guarantees: with ``mode=True``, ``stage.graphed`` is True exactly for the capturable
stages. With ``mode=None`` (``OverlapConfig(cuda_graphs=None)``, the default) the
same, unless a graph would have to copy in a value larger than
``AUTO_MAX_COPY_BYTES`` from an eager stage: then no stage is graphed (logged once,
with the value). It adds, removes and rewrites no node of any graph. Each stage left
out is logged once, with the node that stops it (a compute stage left eager costs
launch overhead, so at WARNING; a comm stage at INFO). ``free`` treats graphed
stages' outputs like any other value (``fxoverlap.cudagraphs`` owns their memory).

Why the rule: a graph reads its inputs from fixed addresses, so each value an eager
stage (an all-to-all) hands to a graphed one is copied in at every replay. Measured
on one H200 (docs/benchmarks.md, 2026-12-01, run 2 of the second lease): with 4 and 16
MiB copies graphs made the step 2.3–5.2× faster; at the peer's shape, 256 MiB copies,
5–8 % slower. 64 MiB is the geometric middle of those two points.

Passes never touch CUDA: this pass runs the same on CPU, where the runtime ignores
the choice (with a warning only where ``cuda_graphs=True`` asked for graphs).
Running it twice gives the same result.

Steps
-----
1. Per stage: ``graphed`` = ``capturable``; log each stage left out and why.
2. ``mode=None``: the largest value a graphed stage reads from an ungraphed stage's
   outputs, views of the parameters and buffers (``static``) left out (a graph reads
   those in place: ``fxoverlap.cudagraphs``); above the bound, un-mark every stage.

Entry point: ``cudagraph(stages, mode=True, static=()) -> None``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fxoverlap.ir.stage import Stage, StreamKind

log = logging.getLogger("fxoverlap")

AUTO_MAX_COPY_BYTES = 64 * 2**20


def cudagraph(stages: list[Stage], mode: bool | None = True, static: Collection[str] = ()) -> None:
    for s in stages:
        s.graphed = bool(mode is not False and s.capturable)
        if mode is not False and not s.graphed:
            level = logging.INFO if s.stream is StreamKind.COMM else logging.WARNING
            log.log(level, "fxoverlap cudagraph: not captured: %s", s.not_capturable_reason)
    if mode is None:
        largest = largest_copy_in(stages, static)
        if largest is not None and largest[0] > AUTO_MAX_COPY_BYTES:
            for s in stages:
                s.graphed = False
            log.info("fxoverlap cudagraph: cuda_graphs=None: no stage graphed: stage %s would copy in %s "
                     "(%.0f MiB, above %d MiB) at every replay; cuda_graphs=True graphs anyway",
                     largest[1], largest[2], largest[0] / 2**20, AUTO_MAX_COPY_BYTES // 2**20)
    log.info("fxoverlap cudagraph: %d of %d stages graphed", sum(s.graphed for s in stages), len(stages))


def largest_copy_in(stages: list[Stage], static: Collection[str] = ()) -> tuple[int, str, str] | None:
    """``(bytes, stage, value)`` of the largest value a graphed stage reads from an
    ungraphed stage's outputs (what the runtime copies into the graph per replay); views
    of the ``static`` placeholders (parameters, buffers) are read in place, not copied."""
    eager_out = {v for s in stages if not s.graphed for v in s.outputs} - static_views(stages, static)
    best = None
    for s in stages:
        if not s.graphed:
            continue
        for node in s.graph_module.graph.find_nodes(op="placeholder"):
            val = node.meta.get("val")
            if node.target in eager_out and isinstance(val, torch.Tensor):
                size = _nbytes(val)
                if size is not None and (best is None or size > best[0]):
                    best = (size, s.name, node.target)
    return best


def static_views(stages: list[Stage], static: Collection[str]) -> set[str]:
    """Stage outputs that are views of the ``static`` placeholders (``w.t()`` saved for the
    backward), through any number of stages; ``stages`` in program order."""
    over = set(static)
    for s in stages:
        g = s.graph_module.graph
        viewing = set(n for n in g.find_nodes(op="placeholder") if n.target in over)
        for n in g.nodes:
            if (isinstance(n.target, torch._ops.OpOverload) and n.target.is_view and n.args
                    and n.args[0] in viewing):
                viewing.add(n)
        (out,) = g.find_nodes(op="output")
        over.update(name for name, v in zip(s.outputs, out.args[0]) if v in viewing)
    return over - set(static)


def _nbytes(t: torch.Tensor) -> int | None:
    numel = t.numel()
    if free_unbacked_symbols(numel):  # a data-dependent size: not known before the step
        return None
    return int(numel) * t.element_size()
