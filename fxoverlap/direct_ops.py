"""Eager stage graphs with fxoverlap's custom ops called past torch's dispatcher.

Each ``fxoverlap::*`` op is a ``torch.library.custom_op`` whose kernel is a plain Python
function. Called from an eager stage graph, ``torch.ops.fxoverlap.X.default`` goes into the
C++ dispatcher, back into Python at torch.library's ``backend_impl`` (which checks that no
output aliases an input), through a ``torch._dynamo.disable`` wrapper (four
``set_eval_frame`` calls) and only then into the kernel: ~6 µs of host work per call on a
CPU (torch 2.13), against ~1 µs for the kernel's own frame. The runtime runs the stage
graphs under no_grad and past autograd, where the dispatcher would run exactly that kernel;
:func:`direct_module` gives a copy of an eager stage's graph that calls it directly.

The copy is the runtime's only (:class:`fxoverlap.runtime.ProgramRunner`, which uses it
only while no dispatch or function mode, profiler or Dynamo frame callback is active):
``stage.graph_module`` keeps the ops, for the passes, tests and tools that look for them by
target. An op is called directly only where that is what the dispatcher would run
(:func:`direct_kernel`); a stage only where every input is a plain tensor as traced (no
tensor subclass that would take the op to its ``__torch_dispatch__``).
What is given up: torch.library's output-aliasing check (our kernels return new tensors;
the check only ever raised) and the op's profiler range (a profiled run takes the op path).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.fx

NAMESPACE = "fxoverlap"

# graph module -> (its generated code object when the copy was made, the copy or None)
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def direct_kernel(target) -> Callable | None:
    """The Python kernel the dispatcher runs for ``target`` (an ``fxoverlap::*`` custom op's
    overload) on every device, or None where calling it directly would skip something: the
    op is not a ``torch.library.custom_op`` of ours, mutates or views an input (its
    ``ADInplaceOrView`` kernel bumps versions / records the view), has a device-specific or a
    disabled kernel, or torch's layout of the wrappers is not the one this was written
    against (torch 2.13: ``_backend_fns[None]`` = ``_disable_dynamo(wrapped_fn)``, whose
    closure holds the kernel, ``_init_fn`` for the decorator form)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != NAMESPACE:
        return None
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return None
    qualname = target._schema.name
    opdef = OPDEFS.get(qualname)
    if opdef is None or getattr(opdef, "_opoverload", None) is not target:
        return None
    schema = target._schema
    if schema.is_mutable or schema._is_view_op():
        return None
    fns = getattr(opdef, "_backend_fns", None)
    kernel = getattr(opdef, "_init_fn", None)
    if fns is None or set(fns) != {None} or getattr(opdef, "_disabled_kernel", True) or kernel is None:
        return None
    # no kernel registered past the custom op's own (torch.library.impl on a device key)
    for key in ("CPU", "CUDA"):
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key):
            return None
    wrapped = getattr(fns[None], "__wrapped__", None)  # _disable_dynamo keeps functools.wraps' link
    code = getattr(wrapped, "__code__", None)
    if code is None or "fn" not in code.co_freevars or wrapped.__closure__ is None:
        return None
    try:
        registered = wrapped.__closure__[code.co_freevars.index("fn")].cell_contents
    except ValueError:  # an empty cell
        return None
    return kernel if registered is kernel else None


def _plain(val) -> bool:
    """Whether a placeholder's traced value is a plain tensor (or no tensor at all)."""
    if not isinstance(val, torch.Tensor):
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return type(val) in (FakeTensor, torch.Tensor, torch.nn.Parameter)


def direct_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A copy of stage graph ``gm`` whose ``fxoverlap::*`` op nodes call their kernels
    directly (:func:`direct_kernel`), or None where it has no such node or an input is not
    known to be a plain tensor (a placeholder without a traced value, or a subclass). Built
    once per graph module and code (a recompiled ``gm`` gets a new copy); the copy shares
    ``gm``'s attributes. A wrapper of a stage's code (a benchmark's clock) wraps the copy's
    ``forward`` too: the runtime reads it at each call."""
    code = getattr(gm, "_code", None)
    hit = _CACHE.get(gm)
    if hit is not None and hit[0] is code:
        return hit[1]
    out = _build(gm)
    _CACHE[gm] = (code, out)
    return out


def _build(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    kernels = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and ("val" not in n.meta or not _plain(n.meta["val"])):
            return None
        if n.op == "call_function" and n.target not in kernels:
            kernels[n.target] = direct_kernel(n.target)
    if not any(kernels.values()):
        return None
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in graph.nodes:
        if n.op == "call_function" and kernels.get(n.target) is not None:
            n.target = kernels[n.target]
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__ + "Direct")
