"""The backend's fallbacks: what makes ``torch.compile(model, backend="fxoverlap")`` run a graph as
the plain Dynamo GraphModule (eager-equivalent), and the warning that names why.

Anything the backend cannot handle (dynamic-shape graph inputs, a graph output that is not a
tensor, no output needing grad, a differentiable output without a tangent that cannot be rebuilt
from its base, a capture/tag/split error: :data:`FALLBACK_ERRORS`) falls back with a
:class:`FallbackWarning` (also logged). When Dynamo broke the graph at a host read (split sizes
from ``.tolist()``, :func:`host_read_breaks`) or at an op with a data-dependent output size
(dropless routing's dispatch without ``capture_dynamic_output_shape_ops``, :func:`dynamic_output_breaks`),
a graph without a whole decoder layer falls back with a warning that names the break and the fixes
(:func:`graph_break_hint`).
"""

from __future__ import annotations

import logging
import re
import warnings

import torch
import torch._subclasses.fake_tensor
import torch.fx
import torch.fx.experimental.symbolic_shapes

from fxoverlap.ir.errors import FxOverlapError

__all__ = ["FALLBACK_ERRORS", "BackendUnsupported", "FallbackWarning", "dynamic_output_breaks", "fallback",
           "graph_break_hint", "has_all_to_all", "host_read_breaks"]

log = logging.getLogger("fxoverlap.backend")


class FallbackWarning(UserWarning):
    """The backend runs a graph as plain eager-equivalent code; the message says why."""


class BackendUnsupported(FxOverlapError):
    """What the backend does not handle (a dynamic shape, a non-tensor output, ...): it falls back."""


def fallback(gm: torch.fx.GraphModule, reason: str):
    """``gm.forward`` (Dynamo runs it as eager would), after a :class:`FallbackWarning` naming ``reason``."""
    msg = f"fxoverlap backend: running this graph as plain eager-equivalent code: {reason}"
    log.warning(msg)
    warnings.warn(msg, FallbackWarning, stacklevel=3)
    return gm.forward


# Dynamo's reasons for a graph break at a read of a tensor's value on the host
# (``.tolist()``, ``.item()``, ``int(t)``: ``aten._local_scalar_dense``)
_HOST_READ = re.compile(r"_local_scalar_dense|tolist|\.item\(|data.dependent", re.IGNORECASE)


# ... and at an op whose output size depends on tensor data (dropless routing's ``fxoverlap::dispatch``),
# which Dynamo traces only with ``capture_dynamic_output_shape_ops`` on
_DYNAMIC_OUTPUT = re.compile(r"output shape depends on input Tensor data|capture_dynamic_output_shape_ops")


def _break_kind(reason: str) -> str | None:
    """``"dynamic_output"``, ``"host_read"`` or None: which of the breaks the hint names a Dynamo
    graph-break reason is."""
    if _DYNAMIC_OUTPUT.search(reason):
        return "dynamic_output"
    return "host_read" if _HOST_READ.search(reason) else None


def _breaks(kind: str) -> list[str]:
    """The first lines of the graph-break reasons of ``kind`` Dynamo recorded in this process, each
    with the op Dynamo names (``at <op>``) where it names one."""
    from torch._dynamo.utils import counters

    out = []
    for reason in counters.get("graph_break", {}):
        if _break_kind(reason) == kind:
            ctx = re.search(r"Developer debug context:\s*(\S+)", reason)
            out.append(reason.strip().splitlines()[0] + (f" at {ctx.group(1)}" if ctx else ""))
    return out


def host_read_breaks() -> list[str]:
    """The graph breaks Dynamo recorded in this process at host reads of tensor values (split
    sizes from ``.tolist()``, a scalar from ``.item()``)."""
    return _breaks("host_read")


def dynamic_output_breaks() -> list[str]:
    """The graph breaks Dynamo recorded in this process at ops with data-dependent output sizes."""
    return _breaks("dynamic_output")


def has_all_to_all(gm: torch.fx.GraphModule) -> bool:
    """Whether the Dynamo graph runs an all-to-all (a functional collective or fxoverlap's ops)."""
    return any(n.op == "call_function" and ("all_to_all" in str(n.target) or "fxoverlap" in str(n.target))
               for n in gm.graph.nodes)


def graph_break_hint() -> str | None:
    """Why a graph holds no whole decoder layer when Dynamo broke graphs at ops with
    data-dependent output sizes or at host reads, and the fixes (each kind found)."""
    parts = []
    if dynamic := dynamic_output_breaks():
        parts.append(
            f"Dynamo broke the graph at an op whose output size depends on tensor data ({dynamic[0]!r}: e.g. "
            f"dropless routing's fxoverlap::dispatch), which it traces only with "
            f"torch._dynamo.config.capture_dynamic_output_shape_ops on: call fxoverlap.enable_dynamic_output_shapes() "
            f"once before torch.compile (or patch that flag around the first call)")
    if breaks := host_read_breaks():
        parts.append(
            f"Dynamo broke the graph at a host read of a tensor value ({breaks[0]!r}: e.g. all-to-all split sizes "
            f"from .tolist()): torch._dynamo.config.capture_scalar_outputs = True keeps the host read inside the "
            f"graph, or fxoverlap's dispatch/combine ops (fxoverlap.ops) with a static, sync-free dispatcher "
            f"read no split sizes on the host")
    if not parts:
        return None
    return (
        f"a graph break split the decoder layers, so each graph holds a piece of a layer, and no graph a whole "
        f"layer with its all-to-alls to overlap: {'; and '.join(parts)}. Other fixes: a static, sync-free "
        f"dispatcher (OverlapConfig(dispatcher='padded' | 'symm_mem'), torch.compile(..., options={{'dispatcher': "
        f"'padded'}})); or fxoverlap.optimize(model, ep_group), which traces the whole step without graph breaks"
    )


# What makes the backend fall back to the plain graph (anything else propagates: a bug in
# fxoverlap must not pass for a graph the backend does not handle):
FALLBACK_ERRORS: tuple[type[BaseException], ...] = (
    # ours: a pass refused the graph (CaptureError, TagError, RecomputeError, DispatcherError,
    # InductorError, RngOrderError, ...), each naming the node and the reason
    FxOverlapError,
    # autograd's "the derivative for '<op>' is not implemented", raised while the capture pass
    # traces the backward of a graph holding an op without one (seen: torch.unique's _unique2);
    # torch raises it as a plain NotImplementedError
    NotImplementedError,
    # the capture pass traces the Dynamo graph again on fake tensors with a ShapeEnv of its
    # own: an op without a fake kernel or with a data-dependent output (Dynamo ran the same
    # ops on its fake tensors first, so these are not seen in the tests)
    torch._subclasses.fake_tensor.UnsupportedOperatorException,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
    torch._subclasses.fake_tensor.DataDependentOutputException,
    # a pass or that trace branching on an unbacked size (an .item() Dynamo kept in the graph)
    torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode,
)
