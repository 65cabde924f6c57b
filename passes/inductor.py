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

Layout contract at stage boundaries
-----------------------------------
Every value that crosses a stage boundary has, at run time, the layout (sizes and
strides) of its ``meta["val"]`` in the joint graph, whatever stage produced it; and
every stage is compiled against exactly those layouts (its placeholders' vals). This
holds by construction for each kind of producer:

* an eager stage runs the joint graph's aten ops, whose fake (meta) kernels gave the
  traced strides;
* an Inductor stage is made to return its outputs in their traced strides (below);
* a CUDA-graph replay returns the static outputs of the callable it captured (one of
  the two above), a chunk or a recompute region is a stage like any other, and
  the step's inputs are bound from the microbatches the capture traced.

Inductor does not keep the traced strides by itself: it keeps the strides its
outputs have *after* its own decompositions, which can differ. Found on Qwen3-MoE,
Mixtral and OLMoE (transformers' KV cache update ``cat([empty, k], -2)``): the joint
graph's ``cat`` is contiguous, Inductor's ``cat`` decomposition drops the empty input
and returns ``k.clone()`` in ``k``'s transposed layout, and the backward attn stage,
compiled for the contiguous layout, failed its input stride assert. So each stage is
compiled with a post-grad graph pass (:class:`KeepTracedStrides`) that sets the
output strides Inductor must honour (``original_output_strides``, the record Inductor
keeps the user-visible output strides of a ``torch.compile``'d graph in) to the traced
ones. Inductor then writes each output in that layout in the kernel that produces it:
no copy where the layouts already agree, and where they differ usually none either
(the producing kernel stores in the required order); a copy only where an output is
a view Inductor cannot restride. Why not the other way round (compile each consumer
against what its producers deliver, as AOTAutograd does from its forward to its
backward): a value here has producers of several kinds (eager, Inductor, graph
replays, and the step's own inputs), one stage graph is shared by every layer, and
the traced layout is the one thing they all know at plan time.

The same retrace can change the layout of a value *inside* a stage, where the joint graph
recorded a ``view`` for the traced layout (``q @ k.transpose(-2, -1)`` on such a ``k``: "Cannot
view a tensor with shape ..."). Inductor therefore gets the stage graph with every shape
``view`` as a ``reshape`` (:func:`reshaping_views`): the same view where the layout allows
it, a copy only where it does not; the eager stage keeps its views.

Debug check: ``FXOVERLAP_CHECK_LAYOUTS=1`` (or ``ProgramRunner(check_layouts=True)``)
makes the runtime compare each input of a compiled stage with the layout the stage
was compiled for before calling it, and raise :class:`fxoverlap.runtime.LayoutMismatch`
naming the value, its producer and the consumer (``fxoverlap.runtime.check_layouts``).

Steps
-----
1. Key every compute stage by its canonical structure.
2. Compile one stage per key (progress line per compile), its views as reshapes and its
   outputs' traced strides pinned; share the result.

Calling a compiled stage
------------------------
``standalone_compile``'s artifact calls Inductor's compiled graph (a ``CompiledFxGraph``)
through AOTAutograd's runtime: Dynamo's ``disable`` wrapper, ``aot_module_simplified``'s
``forward`` (prepends lifted parameters: none here), and the inference ``RuntimeWrapper``
(grad mode off around the call, then its epilogue: input mutations written back, outputs
that alias an input or an intermediate rebuilt as views of their base with
``gen_alias_from_base``, dynamic dims stamped on outputs). Measured on CPU: 3 µs per call
for a stage with no aliased output, ~50 µs for an attn stage with 34 outputs (the alias
replay). The runtime calls every stage under ``no_grad`` and ``_DisableAutocast``, and
nothing in the program relies on a stage output *being* a view (the graphs are functional:
values and layouts are what matter, and Inductor returns each output in its traced layout),
so each stage is called as :class:`DirectStage`, the ``CompiledFxGraph`` itself, where
the wrapper does nothing else: no mutated input, no effect tokens, no functionalised RNG,
no subclass, no deduplicated or synthetic-base input, no autocast disabling of its own,
no lifted parameter (:func:`direct_stage` checks the wrapper chain and the code the runtime
wrapper generated, and keeps the artifact for any stage that does more). Output aliasing
is the one behaviour given up: an output the wrapper would have made a view of an input
is what Inductor returns (``reinterpret_tensor`` of that input: a view too, or a copy with
the same values). ``_dynamo_propagated_dynamic_indices`` stamps are dropped (the runtime's
``output`` detaches every program output, which drops them anyway).
``FXOVERLAP_AOT_WRAPPER=1`` keeps the artifact for every stage (to compare).

Entry point: ``inductor(stages, capture, options=None, progress=None) -> InductorReport``.
"""

from __future__ import annotations

import dataclasses
import dis
import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.autograd.profiler as _profiler
import torch.fx
from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
from torch._inductor.custom_graph_pass import CustomGraphPass

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


def traced_output_strides(gm: torch.fx.GraphModule) -> list[tuple | None]:
    """Per output of a stage graph: the strides of its traced value (None: not a tensor)."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in out.args[0]]
    return [tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in vals]


class KeepTracedStrides(CustomGraphPass):
    """Inductor post-grad pass: the stage's outputs keep the strides of the traced graph.

    Inductor lays out each user-visible output as ``output.meta["original_output_strides"]``
    says; it records those after its decompositions, which may change an output's layout
    (``cat`` with an empty input becomes a ``clone`` of the other). This pass, run after
    that record and before lowering, puts back the joint graph's strides, so the stage's
    consumers (compiled for those) get them. Outputs are matched by position (after any
    mutated-input outputs AOTAutograd puts first); one whose shape differs from the traced
    one is left as Inductor chose (the debug check would name it). ``then``: a post-grad
    pass the caller's options set, run first.
    """

    def __init__(self, strides: list[tuple | None], shapes: list[tuple | None], then=None):
        self.strides, self.shapes, self.then = strides, shapes, then
        self.applied = 0  # outputs pinned by the last run (for tests)

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.then is not None:
            self.then(graph)
        out = next(iter(graph.find_nodes(op="output")))
        args = list(out.args[0]) if not isinstance(out.args[0], torch.fx.Node) else [out.args[0]]
        ctx = torch._guards.TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None)
        start = getattr(meta, "num_mutated_inp_runtime_indices", 0) or 0
        recorded = list(out.meta.get("original_output_strides") or [None] * len(args))
        recorded += [None] * (len(args) - len(recorded))
        visible = set(out.meta.get("user_visible_output_idxs") or ())
        applied = 0
        for i, (want, shape) in enumerate(zip(self.strides, self.shapes)):
            j = start + i
            if want is None or j >= len(args) or not isinstance(args[j], torch.fx.Node):
                continue
            val = args[j].meta.get("val")
            if not isinstance(val, torch.Tensor) or _size_key(val.shape) != shape:
                continue
            recorded[j] = want
            visible.add(j)
            applied += 1
        out.meta["original_output_strides"] = recorded
        out.meta["user_visible_output_idxs"] = sorted(visible)
        self.applied = applied

    def uuid(self) -> str:
        # Inductor's FX graph cache keys on this: the pinned strides are part of the compile
        then = self.then.uuid() if self.then is not None and hasattr(self.then, "uuid") else None
        text = repr((_size_key(self.strides), then))
        return "fxoverlap-keep-traced-strides-" + hashlib.sha256(text.encode()).hexdigest()


def _size_key(sizes) -> tuple | None:
    """Sizes or strides as comparable text (symbols by name)."""
    if sizes is None:
        return None
    return tuple(_size_key(s) if isinstance(s, (tuple, list)) else str(s) for s in sizes)


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def reshaping_views(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with each shape ``view`` as a ``reshape`` (a new module; ``gm`` itself when it has none).

    Inductor retraces the stage graph through its own decompositions, which may give an
    intermediate value another layout than the joint graph traced (``cat`` with an empty input
    becomes a ``clone`` of the other), and a ``view`` the joint graph recorded for the traced
    layout cannot view the new one ("Cannot view a tensor with shape ..."). A ``reshape`` is
    that view where the layout allows it (the usual case: no copy) and a copy where it does not.
    The graph is functional, so nothing depends on the view aliasing its input."""
    if not any(n.op == "call_function" and n.target in _VIEWS for n in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _VIEWS:
            n.target = torch.ops.aten.reshape.default
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)


class DirectStage:
    """A compiled stage called as Inductor's ``CompiledFxGraph`` itself, without AOTAutograd's
    runtime wrapper around it (module docstring, "Calling a compiled stage"). ``artifact``:
    the ``standalone_compile`` artifact it was taken from (calls through the wrapper)."""

    __slots__ = ("graph", "artifact", "n_outputs", "first")

    def __init__(self, graph, artifact, n_outputs: int):
        self.graph, self.artifact, self.n_outputs = graph, artifact, n_outputs
        self.first = True

    def __call__(self, *args):
        # Dynamo must not trace the compiled code (the wrapper's ``disable`` did this)
        prior = _set_eval_frame(None)
        # Inductor's extern kernels (``mm(..., out=)``) refuse inputs that need grad under
        # grad mode; the runtime calls under no_grad already, so this is one check there
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            graph = self.graph
            if self.first or _profiler._is_profiler_enabled:
                # the first call ends Inductor's autotune-cache bundling; a profiled call keeps
                # the "## Call CompiledFxGraph ##" range
                self.first = False
                outs = graph([*args])
            else:
                outs = graph.current_callable([*args])
        finally:
            if grad:
                torch._C._set_grad_enabled(True)
            _set_eval_frame(prior)
        # past the stage's outputs: the bases of aliased intermediates AOTAutograd returns too
        # (the wrapper drops them)
        return outs if len(outs) == self.n_outputs else outs[:self.n_outputs]

# The names the inference RuntimeWrapper's generated code may use when all it adds around
# the compiled graph is grad mode off, output aliases rebuilt and dynamic dims stamped.
_WRAPPER_GLOBALS_OK = {"torch", "_replay_aliases_", "_mark_dynamic_"}
_WRAPPER_NAMES_OK = {"torch", "is_grad_enabled", "_C", "_set_grad_enabled", "isinstance", "tuple", "list", "len",
                     "AssertionError", "_replay_aliases_", "_mark_dynamic_"}


def _cell(fn, name: str):
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars or fn.__closure__ is None:
        return None
    try:
        return fn.__closure__[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def _unserializable(fn):
    """``fn`` without AOTAutograd's ``SerializableCompiledFunction`` (a pass-through holding its cache entry)."""
    from torch._functorch._aot_autograd.runtime_wrappers import SerializableCompiledFunction

    return fn.compiled_fn if isinstance(fn, SerializableCompiledFunction) else fn


def direct_stage(art, n_outputs: int) -> DirectStage | None:
    """The :class:`DirectStage` of a ``standalone_compile`` artifact, or None (call the artifact)
    when AOTAutograd's runtime wrapper does more than :class:`DirectStage` may skip, or its
    layout is not one this was written against: artifact -> Dynamo's ``disable`` ->
    ``aot_module_simplified``'s ``forward`` -> the inference ``runtime_wrapper`` ->
    ``CompiledFxGraph``, with AOTAutograd's cache entry around one of the last two. torch 2.13's
    runtime wrapper runs generated code (checked by the names it uses); torch 2.11's is a plain
    closure over the graph's metadata, with two pass-through wrappers below it
    (:func:`_graph_under_closure_wrapper`)."""
    from torch._inductor.output_code import CompiledFxGraph

    fn = getattr(art, "_compiled_fn", None)
    fwd = _cell(fn, "fn") if fn is not None else None  # Dynamo's disable wrapper
    if fwd is None or not fwd.__qualname__.startswith("aot_module_simplified."):
        return None
    params = _cell(fwd, "params_buffers_flat")
    if params is None or len(params) != 0:
        return None
    # AOTAutograd's cache entry (a pass-through) wraps the compiled graph on a cache miss and
    # the runtime wrapper on a hit
    rw = _unserializable(_cell(fwd, "compiled_fn"))
    if getattr(rw, "__qualname__", "") != "_create_runtime_wrapper.<locals>.runtime_wrapper":
        return None  # another wrapper (dedupe, synthetic base, subclasses) or none
    generated = _cell(rw, "_codegen_runtime_wrapper")
    if generated is None:  # torch 2.11
        graph = _graph_under_closure_wrapper(rw)
        return None if graph is None else DirectStage(graph, art, n_outputs)
    graph = _unserializable(_cell(rw, "_inner_compiled_fn"))
    if type(graph) is not CompiledFxGraph:
        return None  # effect tokens, functionalised RNG, a subclass: a wrapper in between
    names = {k for k in generated.__globals__ if not k.startswith("__") and not k.startswith("_dyn_dims_")}
    used = {k for k in generated.__code__.co_names if not k.startswith("_dyn_dims_")}
    if not names <= _WRAPPER_GLOBALS_OK or not used <= _WRAPPER_NAMES_OK:
        return None  # input mutations, version counters, its own autocast disabling
    # grad mode set once off and restored on both exits: a fourth call is a grad-mode mutation
    sets = sum(1 for i in dis.get_instructions(generated) if i.argval == "_set_grad_enabled")
    if sets != 3:
        return None
    return DirectStage(graph, art, n_outputs)


def _code_name(fn) -> str:
    # the code object's name: functools.wraps rewrites a wrapper's __qualname__ to the wrapped one's
    code = getattr(fn, "__code__", None)
    return getattr(code, "co_qualname", "") if code is not None else ""


# torch 2.11's wrappers between the runtime wrapper and the compiled graph, and the closure value
# under which each one only calls on
_PASS_THROUGH = {
    "FunctionalizedRngRuntimeWrapper.post_compile.<locals>.wrapper":
        lambda fn: not _cell(fn, "runtime_metadata").is_rng_op_functionalized,
    "EffectTokensWrapper.post_compile.<locals>.inner_fn": lambda fn: _cell(fn, "num_tokens") == 0,
}


def _graph_under_closure_wrapper(rw):
    """The ``CompiledFxGraph`` under torch 2.11's inference ``runtime_wrapper`` (a closure over the
    graph's ``ViewAndMutationMeta``), or None where that wrapper does more than grad mode off,
    output aliases rebuilt and dynamic dims stamped: a mutated input (data, metadata or version
    counter), a grad-mode mutation, its own autocast disabling, functionalised RNG, effect tokens,
    a joint graph, or a wrapper in between that is not a pass-through."""
    from torch._inductor.output_code import CompiledFxGraph

    meta = _cell(rw, "runtime_metadata")
    if meta is None or _cell(rw, "trace_joint") is not False or _cell(rw, "disable_amp") is not False:
        return None
    if (meta.num_mutated_inp_runtime_indices or meta.grad_enabled_mutation is not None
            or meta.is_rng_op_functionalized or len(meta.tokens)
            or any(i.mutates_data or i.mutates_metadata for i in meta.input_info)):
        return None
    fn = _cell(rw, "compiled_fn")
    for _ in range(4):
        fn = _unserializable(fn)
        if type(fn) is CompiledFxGraph:
            return fn
        passes_on = _PASS_THROUGH.get(_code_name(fn))
        if passes_on is None or not passes_on(fn):
            return None
        fn = _cell(fn, "compiled_fn")
    return None


def _compile(stage: Stage, capture: Capture, options: dict) -> Callable:
    from torch._inductor import standalone_compile

    gm = stage.graph_module
    example = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    out = next(iter(gm.graph.find_nodes(op="output")))
    shapes = [_size_key(a.meta["val"].shape) if isinstance(a, torch.fx.Node)
              and isinstance(a.meta.get("val"), torch.Tensor) else None for a in out.args[0]]
    options = dict(options)
    options["post_grad_custom_post_pass"] = KeepTracedStrides(
        traced_output_strides(gm), shapes, options.get("post_grad_custom_post_pass"))
    # Symbols the capture created are bound in its graph already; left "pending", the
    # retrace inside compile_fx would try to bind them to this stage's inputs.
    capture.fake_mode.shape_env.pending_fresh_unbacked_symbols.clear()
    with (
        torch.no_grad(),
        torch._guards.tracing(torch._guards.TracingContext(capture.fake_mode)),
        torch._inductor.config.patch(options),
    ):
        art = standalone_compile(reshaping_views(gm), example, dynamic_shapes="from_tracing_context")
    if os.environ.get("FXOVERLAP_AOT_WRAPPER") == "1":
        return art
    direct = direct_stage(art, len(out.args[0]))
    if direct is None:
        log.debug("fxoverlap: stage %s keeps AOTAutograd's runtime wrapper", stage.name)
        return art
    return direct


def stage_route(stage: Stage) -> str:
    """How ``stage`` is called: ``Stage.runs_as``, with an Inductor stage's route told apart:
    ``inductor`` (its compiled graph called directly, :class:`DirectStage`) or ``inductor+wrapper``
    (through AOTAutograd's runtime wrapper: the stage needs it, ``FXOVERLAP_AOT_WRAPPER=1``, or
    this torch's wrapper layout is not one :func:`direct_stage` knows). The bench rows report it,
    so a GPU run shows which route its stages took."""
    kind = stage.runs_as
    if kind == "inductor" and not isinstance(stage.compiled, DirectStage):
        return "inductor+wrapper"
    return kind


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
    wrapped = sum(1 for s in todo if not isinstance(s.compiled, DirectStage))
    say(f"fxoverlap: compiled {report.stages} stages ({report.compiled} distinct graphs) in {report.seconds:.1f} s"
        + (f"; {wrapped} called through AOTAutograd's runtime wrapper" if wrapped else ""))
    return report
