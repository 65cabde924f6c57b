"""inductor: lower every compute stage with TorchInductor, once per distinct stage graph.

Contract
--------
Assumes: ``split`` (and ``recompute``) built the stages from a capture whose
``fake_mode`` holds the graph's symbols: every stage placeholder carries a fake
``meta["val"]``, and a dropless experts stage's row count is an *unbacked* symbol.

Guarantees: each compute stage (attn, experts, post, mlp, embed, head, recompute,
every part) that launches a kernel gets ``stage.compiled``: a callable taking the
stage's inputs and returning its outputs, as ``stage.graph_module`` does. Comm
stages and stages of only views are left alone. Graphs are not changed.

Lowering route: ``torch._inductor.standalone_compile(stage_graph, fake_inputs,
dynamic_shapes="from_tracing_context")`` inside a ``TracingContext`` of the
capture's fake mode, under ``no_grad``. It runs AOTAutograd's inference path
(functionalisation, Inductor's decompositions) and Inductor, as ``torch.compile``
does for a graph, but on our stage graph and its fake inputs, with no Dynamo and
no guards. Because the row count stays an unbacked symbol, the compiled kernels
take any row count, 0 and 1 included, with no recompile and no guard that could
fail at run time (a backed dynamic dimension would specialise on 0/1 and carry
guards that nothing here would check). Inductor options pass through as config
patches, as ``torch.compile(options=...)`` does.

Stages whose graphs are equal up to names (the same layer kind in every layer)
are compiled once and share the compiled callable: the key is the graph's ops,
constants and edges, and its inputs' dtypes, shapes and strides, with symbols
numbered by first appearance. Inductor's on-disk caches (FX graph and AOTAutograd
caches) then make a second process fast.

Steps
-----
1. Key every compute stage by its canonical structure.
2. Compile one stage per key (progress line per compile), share the result.

Entry point: ``inductor(stages, capture, options=None, progress=None) -> InductorReport``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.fx

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.capture import Capture
from fxoverlap.passes.split import launches_kernel
from fxoverlap.ir.stage import Stage, StreamKind

log = logging.getLogger("fxoverlap")


class InductorError(FxOverlapError, RuntimeError):
    """Inductor could not compile a stage; the message names the stage and how to fall back."""


@dataclasses.dataclass(frozen=True)
class InductorReport:
    stages: int  # compute stages that run compiled
    compiled: int  # distinct graphs compiled
    seconds: float


def _symbols(val, names: dict) -> object:
    """``val`` with every symbolic size replaced by its first-appearance number."""
    if isinstance(val, torch.SymInt):
        return ("sym", names.setdefault(str(val.node.expr), len(names)))
    if isinstance(val, (list, tuple)):
        return tuple(_symbols(v, names) for v in val)
    return val


def _key(stage: Stage) -> tuple:
    gm = stage.graph_module
    index: dict[torch.fx.Node, int] = {}
    names: dict[str, int] = {}
    parts: list = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        if n.op == "placeholder":
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                parts.append(("in", v.dtype, _symbols(tuple(v.shape), names), _symbols(tuple(v.stride()), names),
                              v.device.type))
            else:
                parts.append(("in", type(v).__name__, _symbols(v, names)))
            continue
        if n.op == "get_attr":  # a constant: shared only with the same tensor
            parts.append(("attr", id(getattr(gm, n.target))))
            continue
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", index[a]))
        parts.append((n.op, str(n.target), repr(args)))
    return tuple(parts)


def _compile(stage: Stage, capture: Capture, options: dict) -> Callable:
    from torch._inductor import standalone_compile

    gm = stage.graph_module
    example = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    # Symbols the capture created are bound in its graph already; left "pending", the
    # retrace inside compile_fx would try to bind them to this stage's inputs.
    capture.fake_mode.shape_env.pending_fresh_unbacked_symbols.clear()
    with (
        torch.no_grad(),
        torch._guards.tracing(torch._guards.TracingContext(capture.fake_mode)),
        torch._inductor.config.patch(options),
    ):
        art = standalone_compile(gm, example, dynamic_shapes="from_tracing_context")
    return art


def inductor(
    stages: Sequence[Stage],
    capture: Capture,
    options: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> InductorReport:
    todo = [s for s in stages if s.stream is StreamKind.COMP and launches_kernel(s.graph_module)]
    by_key: dict[tuple, list[Stage]] = {}
    for s in todo:
        by_key.setdefault(_key(s), []).append(s)
    say = progress if progress is not None else (lambda msg: log.info("%s", msg))
    t0 = time.perf_counter()
    for i, group in enumerate(by_key.values(), 1):
        first = group[0]
        t1 = time.perf_counter()
        say(f"fxoverlap: compiling stage {i}/{len(by_key)} {first.name}"
            + (f" (+{len(group) - 1} equal)" if len(group) > 1 else "") + " ...")
        try:
            fn = _compile(first, capture, dict(options or {}))
        except Exception as e:
            raise InductorError(
                f"inductor: compiling stage {first.name} ({first.kind}, {first.direction}, layer {first.layer}) "
                f"failed: {type(e).__name__}: {e}. Run with OverlapConfig(compiler='eager') to run the "
                f"stages op by op"
            ) from e
        for s in group:
            s.compiled = fn
        log.debug("fxoverlap: compiled %s in %.1f s", first.name, time.perf_counter() - t1)
    report = InductorReport(len(todo), len(by_key), time.perf_counter() - t0)
    say(f"fxoverlap: compiled {report.stages} stages ({report.compiled} distinct graphs) in {report.seconds:.1f} s")
    return report
