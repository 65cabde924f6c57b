"""cudagraph: mark the stage calls that the runtime runs as CUDA graphs.

Rewrites nothing but node metadata and stage attributes; it adds and removes no
program nodes, so the program's code is unchanged:

- every stage call (``call_module`` node with ``meta["stage"]``) of a graphed stage
  gets ``node.meta["cudagraph"] = True``;
- every other stage call gets ``node.meta["cudagraph_skip"] = reason`` (the reason
  names the stage and, where one node is to blame, the node and its op); each
  skipped stage's reason is logged once per run of the pass on the ``"fxoverlap"``
  logger;
- each graphed stage gets ``stage.cudagraph_owned_outputs = set(stage.outputs)``.
  The ``free`` pass reads it and never frees those values by hand: they are the
  static outputs of the stage's graphs, which the runtime (``fxoverlap.cudagraphs``)
  owns and overwrites at the next replay of the same graph. Our frees only ever drop
  a reference from the value store; they never resize or release a storage
  (``untyped_storage().resize_(0)``), so even a stray free of graph memory could not
  pull memory out from under a graph. Megatron-LM had to revert a change that
  resized storage owned by a CUDA graph; this pass and ``free`` keep that from
  happening here by construction.

A stage is graphed when it is a compute stage the split pass found capturable
(``stage.capturable``: static shapes, no host sync) and, in addition:

- it is not a communication stage. Comm stages (dispatch, combine) stay eager on
  the comm stream. Capturing NCCL kernels is possible, but a probe on the GPU
  machine then hung in ``dist.destroy_process_group()`` (DESIGN.md); keeping
  communication out of the graphs sidesteps that teardown hang entirely, and eager
  all-to-alls are what overlaps with the graphed compute anyway;
- no op mutates anything in place (a replay would repeat the mutation on the
  graph's static copy of an input instead of the value in the store, and the
  runtime's warm-up runs would apply it more than once);
- it launches at least one kernel (a stage of only views and metadata ops has
  nothing to capture, and its outputs would alias the graph's static inputs).

Assumes ``schedule`` (and usually ``streams``) ran and ``free`` has not: run this
pass before ``free`` so that ``free`` sees ``cudagraph_owned_outputs``. Passes never
touch CUDA: this pass runs the same on CPU, where the runtime ignores the marks.
Running it twice gives the same result.

Entry point: ``cudagraph(program, stages) -> GraphModule``.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from fxoverlap.stage import Stage, StreamKind

log = logging.getLogger("fxoverlap")

GRAPHED_KEY = "cudagraph"
SKIP_KEY = "cudagraph_skip"


def skip_reason(stage: Stage) -> str | None:
    """Why ``stage`` is not run as a CUDA graph, or None when it is."""
    if stage.stream is StreamKind.COMM:
        return (
            f"stage {stage.name}: communication stage (stays eager on the comm stream; "
            f"NCCL kernels are never captured)"
        )
    if not stage.capturable:
        return f"stage {stage.name}: {stage.not_capturable_reason or 'not capturable'}"
    launches_kernel = False
    for n in stage.graph_module.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        if isinstance(t, torch._ops.OpOverload):
            if t._schema.is_mutable:
                return f"stage {stage.name}: in-place op at node {n.name} ({_op(t)}) mutates an input"
            if not t.is_view and "sym_" not in t._schema.name:
                launches_kernel = True
        elif t is not operator.getitem:
            launches_kernel = True  # a Python function or a custom callable: assume it computes
    if not launches_kernel:
        return f"stage {stage.name}: only views and metadata ops, nothing to capture"
    return None


def cudagraph(program: torch.fx.GraphModule, stages: list[Stage]) -> torch.fx.GraphModule:
    by_name = {s.name: s for s in stages}
    reasons: dict[str, str | None] = {}
    for s in stages:
        reasons[s.name] = r = skip_reason(s)
        if r is None:
            s.cudagraph_owned_outputs = set(s.outputs)
    logged: set[str] = set()
    for n in program.graph.nodes:
        if n.op != "call_module" or "stage" not in n.meta:
            continue
        name = n.meta["stage"]
        if name not in by_name:
            raise AssertionError(f"cudagraph: program node {n.name} calls unknown stage {name}")
        r = reasons[name]
        if r is None:
            n.meta[GRAPHED_KEY] = True
            n.meta.pop(SKIP_KEY, None)
        else:
            n.meta.pop(GRAPHED_KEY, None)
            n.meta[SKIP_KEY] = r
            if name not in logged:
                logged.add(name)
                # A compute stage left eager costs launch overhead: say so louder.
                level = logging.INFO if by_name[name].stream is StreamKind.COMM else logging.WARNING
                log.log(level, "fxoverlap cudagraph: not captured: %s", r)
    graphed = sorted({n.meta["stage"] for n in program.graph.nodes if n.meta.get(GRAPHED_KEY)})
    log.info("fxoverlap cudagraph: %d of %d stages graphed", len(graphed), len(stages))
    return program


def _op(t: torch._ops.OpOverload) -> str:
    return f"{t.namespace}.{t._schema.name.split('::')[-1]}"
