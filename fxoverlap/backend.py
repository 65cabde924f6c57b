"""``torch.compile(model, backend="fxoverlap")``: fxoverlap's stages, streams and compiled
kernels for one microbatch per call, under torch.compile.

The backend is a callable instance, :class:`Backend` (as ``torch._dynamo.backends.common.AotAutograd``
is), over the one compile entry, ``compile_program``. Dynamo finds it through the
``torch_dynamo_backends`` entry point in ``setup.cfg`` (``fxoverlap = fxoverlap.backend:fxoverlap_backend``),
loaded when a ``torch.compile`` first names ``"fxoverlap"``; importing fxoverlap registers nothing
and changes no Dynamo setting. Its parts, each a module of its own:

- ``fxoverlap/backend_capture.py``: the Dynamo graph -> ``Capture`` adapter (layer candidates from
  the nodes' ``nn_module_stack``; the capture pass's one layer finder chooses among them);
- ``fxoverlap/backend_autograd.py``: the autograd bridge (:class:`CompiledStep`: the program's
  forward in one ``autograd.Function``, its backward in segments; :class:`CompiledForward` under
  ``torch.no_grad()``) and :func:`compile_step`;
- ``fxoverlap/backend_outputs.py``: graph outputs that are views, rebuilt from their base;
- ``fxoverlap/backend_options.py``: ``options`` / ``mode`` -> ``OverlapConfig`` (:func:`backend_config`);
- ``fxoverlap/backend_fallback.py``: what falls back to the plain graph, with a :class:`FallbackWarning`.

One joint graph instead of AOT's forward and backward compilers: the tag pass maps backward
nodes to forward nodes by ``seq_nr`` within one graph; what crosses from forward to backward is
exactly what the backward formulas read (what eager saves), so with ``compiler="eager"`` gradients
are bitwise equal to eager's; and every decision, including the fallback, is taken at compile
time (AOT compiles the backward lazily, at the first ``backward()``, where falling back is no
longer possible).

Dropless routing gives ``fxoverlap::dispatch`` a data-dependent output size, which Dynamo
graph-breaks on unless ``torch._dynamo.config.capture_dynamic_output_shape_ops`` is on while it
traces: a backend is called after tracing and cannot set it. Call
:func:`enable_dynamic_output_shapes` once before ``torch.compile`` (or patch the setting around
the first call yourself); ``fxoverlap.pipeline_schedule`` sets it around its own stage calls.

Introspection: each :class:`Backend` instance keeps the :class:`CompiledStep` it built last
(``.last``, ``.last_stages()``) and releases the CUDA graphs of its steps at :meth:`Backend.reset`
(``torch._dynamo.reset()`` calls it). ``backend=Backend(layer_container="layers")`` compiles
with options of its own; :func:`last_compiled`, :func:`last_stages` and :func:`reset` answer for
the entry point's instance, :data:`fxoverlap_backend`.

Limits: one microbatch per call, so only intra-microbatch overlap (the interleaved 1F1B program
is ``fxoverlap.optimize``'s); static shapes only (a recompile that Dynamo makes dynamic falls back:
use ``dynamic=False``); no double backward or ``retain_graph=True`` (a second backward raises).
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.fx

from fxoverlap.backend_autograd import (SEGMENT_MIN_GRAD_BYTES, BackendError, CompiledForward, CompiledStep,
                                        StepRun, Turns, compile_step, merge_segments)
from fxoverlap.backend_capture import annotate_layers, module_path
from fxoverlap.backend_fallback import (FALLBACK_ERRORS, BackendUnsupported, FallbackWarning, fallback,
                                        graph_break_hint, has_all_to_all, host_read_breaks)
from fxoverlap.backend_options import backend_config
from fxoverlap.ir.stage import Stage

__all__ = (
    "FALLBACK_ERRORS",
    "SEGMENT_MIN_GRAD_BYTES",
    "Backend",
    "BackendError",
    "BackendUnsupported",
    "CompiledForward",
    "CompiledStep",
    "FallbackWarning",
    "StepRun",
    "Turns",
    "annotate_layers",
    "backend_config",
    "compile_step",
    "enable_dynamic_output_shapes",
    "fxoverlap_backend",
    "graph_break_hint",
    "has_all_to_all",
    "host_read_breaks",
    "last_compiled",
    "last_stages",
    "merge_segments",
    "module_path",
    "reset",
)

log = logging.getLogger("fxoverlap.backend")


def enable_dynamic_output_shapes() -> None:
    """Let Dynamo trace ops with data-dependent output sizes (dropless routing's
    ``fxoverlap::dispatch``) into the graph rather than break it there: turns on
    ``torch._dynamo.config.capture_dynamic_output_shape_ops`` for this process, where it is
    still at its default (a value you set stays). Dynamo reads it while tracing, before any
    backend runs, so the backend cannot set it itself; call this once before ``torch.compile``."""
    import torch._dynamo.config as dynamo_config

    if dynamo_config._is_default("capture_dynamic_output_shape_ops"):
        dynamo_config.capture_dynamic_output_shape_ops = True


class Backend:
    """The ``"fxoverlap"`` torch.compile backend: ``torch.compile(model, backend=Backend(**options))``
    or ``backend="fxoverlap"`` (the entry point's instance, :data:`fxoverlap_backend`).

    ``options`` and keyword options are ``OverlapConfig`` fields and Inductor options
    (:func:`backend_config`), checked here; ``torch.compile(..., options=..., mode=...)`` adds to
    them per call. ``segment_min_grad_bytes``: the gradient bytes each backward segment hands out
    at least (:data:`SEGMENT_MIN_GRAD_BYTES`; 0: a segment per hand-out)."""

    def __init__(self, options: dict | None = None, mode: str | None = None, *,
                 segment_min_grad_bytes: int = SEGMENT_MIN_GRAD_BYTES, **kwargs):
        self.options = {**(options or {}), **kwargs}
        self.mode = mode
        self.segment_min_grad_bytes = segment_min_grad_bytes
        backend_config(self.options, mode)  # a bad option is the user's error now, not at the first compile
        self.last: CompiledStep | CompiledForward | None = None
        self._graphed: weakref.WeakSet = weakref.WeakSet()  # this instance's steps holding CUDA graphs

    def __repr__(self) -> str:
        return f"fxoverlap.backend.Backend({self.options or ''}{', mode=' + repr(self.mode) if self.mode else ''})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                 mode: str | None = None, **kwargs):
        """Compile one Dynamo graph: a :class:`CompiledStep` (a :class:`CompiledForward` under
        ``no_grad``), or the plain graph with a :class:`FallbackWarning`."""
        config = backend_config({**self.options, **(options or {}), **kwargs}, mode or self.mode)
        try:
            # Dynamo guards on grad mode: a graph traced under no_grad only ever runs under it
            step = compile_step(gm, example_inputs, config, train=torch.is_grad_enabled(),
                                segment_min_grad_bytes=self.segment_min_grad_bytes)
        except BackendUnsupported as e:
            return fallback(gm, str(e))
        except FALLBACK_ERRORS as e:  # a pass could not handle the graph: never a wrong answer
            log.debug("fxoverlap backend: compile failed", exc_info=True)
            hint = graph_break_hint() if "outside every decoder layer" in str(e) else None
            if hint is not None:  # the layer is a fragment: the graph break is the cause, not the model
                return fallback(gm, f"{hint} (the pass said: {type(e).__name__}: {e})")
            return fallback(gm, f"{type(e).__name__}: {e}")
        self.last = step
        if step.holds_graphs:
            self._graphed.add(step)
        log.info("fxoverlap backend: %d stages\n%s", len(step.stages), step.stage_table())
        return step

    def last_stages(self) -> list[Stage]:
        """The stages of :attr:`last`, in program order ([] when none)."""
        return [] if self.last is None else list(self.last.stages)

    def reset(self) -> None:
        """Forget :attr:`last` and release the CUDA graphs of every step this instance built
        (``torch._dynamo.reset()`` calls this); call it before ``dist.destroy_process_group()``
        when graphs ran."""
        self.last = None
        for step in list(self._graphed):
            step.close()


fxoverlap_backend = Backend()
"""The entry point's instance: what ``torch.compile(model, backend="fxoverlap")`` runs."""


def last_compiled() -> CompiledStep | CompiledForward | None:
    """The most recent step :data:`fxoverlap_backend` (``backend="fxoverlap"``) built."""
    return fxoverlap_backend.last


def last_stages() -> list[Stage]:
    """The stages of :func:`last_compiled`, in program order ([] when none)."""
    return fxoverlap_backend.last_stages()


def reset() -> None:
    """:meth:`Backend.reset` of :data:`fxoverlap_backend`."""
    fxoverlap_backend.reset()
