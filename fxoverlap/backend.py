"""``torch.compile(model, backend="fxoverlap")``: fxoverlap's stages, streams and compiled
kernels for one microbatch per call, under torch.compile.

What is Dynamo-specific lives here; everything else is the engine's pipeline
(``fxoverlap/pipeline.py``) and runtime (``ProgramRunner``): one set of passes, one
runtime, one free plan, one way to compile stages. Dynamo hands the backend its
forward GraphModule, parameters lifted to graph inputs. The backend

1. **annotates layers** (:func:`annotate_layers`): the entry of every candidate
   layer list a Dynamo node runs in comes from its ``nn_module_stack``
   (``L['self'].layers.0.moe...``), written into ``node.meta["custom"]`` under the key
   the capture pass's hooks write for ``optimize``; the capture pass then picks the
   decoder-layer list with the same finder as for ``optimize`` (``passes/layers.py``). Dynamo turns an activation checkpoint into a
   ``tag_activation_checkpoint`` call of a body graph: its body's nodes are annotated
   too, and marked as checkpointed, so the recompute pass replays them as it does
   under ``optimize``;
2. **captures the joint graph** of the Dynamo graph with the ordinary capture pass
   (``scalar_loss=False``: the graph may return logits or several tensors): a thin
   module (:class:`_GraphStep`) holds the differentiable graph inputs as parameters
   and runs the Dynamo graph through an ``fx.Interpreter`` under
   ``preserve_node_meta``, so every aten node inherits the annotation of the
   Dynamo node it came from, and backward nodes carry ``seq_nr``;
3. builds the stages and a one-microbatch program with the engine's pipeline:
   tag, side (the attn work a dispatch does not need runs under it), split,
   Inductor-compiled compute stages (the default on CUDA), schedule, streams, free;
4. returns a :class:`CompiledStep` whose call runs the program's forward part inside
   one ``torch.autograd.Function``; its backward seeds each output's incoming
   gradient as that output's tangent and runs the backward part, in *segments*: the
   backward is cut where gradients are handed out (at least
   :data:`SEGMENT_MIN_GRAD_BYTES` of them per segment), each later segment is a node
   of its own in a chain autograd runs in order, and each returns its gradients, so
   autograd's ``AccumulateGrad`` fills ``p.grad`` (hooks included) as the backward
   goes, as in eager, rather than once a whole new set of gradients is held at its
   end (AOTAutograd's way, which costs a model's worth of gradients under gradient
   accumulation).
   Buffers (and inputs) the forward updates in place are updated right after the
   stage that computes their new value. Outputs that are views of a graph input or of
   another output (no tangent from AOTAutograd) are rebuilt from their base after the
   Function, as AOTAutograd's runtime does (``fxoverlap/backend_outputs.py``).

One joint graph instead of AOT's forward and backward compilers: the tag pass
maps backward nodes to forward nodes by ``seq_nr`` within one graph; what
crosses from forward to backward is exactly what the backward formulas read
(what eager saves), so with ``compiler="eager"`` gradients are bitwise equal to
eager's; and every decision, including the fallback, is taken at compile time (AOT
compiles the backward lazily, at the first ``backward()``, where falling back is
no longer possible).

Fallback: anything the backend cannot handle (dynamic-shape graph inputs, a
graph output that is not a tensor, no output needing grad, a differentiable output
that has no tangent and cannot be rebuilt from its base, a capture/tag/split error) makes it return the plain Dynamo GraphModule, which runs like eager, with a
:class:`FallbackWarning` (also logged) that names the reason. Under
``torch.no_grad()`` (inference) the backend compiles the forward-only program
(:class:`CompiledForward`: the same passes, chunks and compiled stages, no autograd),
and falls back the same way. When Dynamo broke
the graph at a host read (split sizes from ``.tolist()``, :func:`host_read_breaks`), a
graph without a whole decoder layer falls back with a warning that names the break and
the fixes (:func:`graph_break_hint`): the static dispatchers, ``capture_scalar_outputs``,
or ``fxoverlap.optimize``.

Dropless routing gives ``fxoverlap::dispatch`` a data-dependent output size,
which Dynamo graph-breaks on unless
``torch._dynamo.config.capture_dynamic_output_shape_ops`` is on; importing this
module turns it on when it is still at its default (a backend cannot scope a
Dynamo config through ``torch.compile(backend=...)``).

Introspection: :func:`last_compiled` / :func:`last_stages` return the most
recent :class:`CompiledStep` (``.stages``, ``.program``, ``.capture``,
``.stage_table()``) and its stages; :func:`reset` forgets it.

Limits: one microbatch per call, so only intra-microbatch overlap (the
interleaved 1F1B program is ``fxoverlap.optimize``'s); static shapes only (a
recompile that Dynamo makes dynamic falls back: use ``dynamic=False``); no double
backward or ``retain_graph=True`` (a second backward raises).

Options: ``torch.compile(model, backend="fxoverlap", options={...})`` with
``OverlapConfig`` fields and Inductor options (:func:`backend_config`), or
``backend=functools.partial(fxoverlap_backend, layer_container="layers")``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from fxoverlap.backend_outputs import plan_outputs
from fxoverlap.config import ConfigError, OverlapConfig, UnknownConfigField, unknown_names
from fxoverlap.cudagraphs import GraphCache
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.meta import CHECKPOINT_KEY
from fxoverlap.passes.capture import WRAPPED_MODULE_ATTRS, Capture, capture
from fxoverlap.ir.meta import LIST_KEY
from fxoverlap.pipeline import build_program, build_stages, check_disable_passes, make_runner
from fxoverlap.ir.stage import Stage, StreamKind

__all__ = [
    "FALLBACK_ERRORS",
    "SEGMENT_MIN_GRAD_BYTES",
    "UNSUPPORTED_FIELDS",
    "CompiledStep",
    "FallbackWarning",
    "annotate_layers",
    "backend_config",
    "fxoverlap_backend",
    "graph_break_hint",
    "host_read_breaks",
    "last_compiled",
    "last_stages",
    "merge_segments",
    "reset",
]

log = logging.getLogger("fxoverlap.backend")


class FallbackWarning(UserWarning):
    """The backend runs a graph as plain eager-equivalent code; the message says why."""


class _Unsupported(FxOverlapError):
    """What the backend does not handle (a dynamic shape, a non-tensor output, ...): it falls back."""


class BackendError(FxOverlapError, RuntimeError):
    """A compiled step was used in a way it does not support (a second backward through one call)."""


_last: CompiledStep | None = None
# A merged step (pipeline parallelism): the generator of another program's backward
# (CompiledStep.backward_in_turns) that the next compiled forward runs in turns with its
# own chunks; set by run_in_turns, taken by the forward that runs.
_in_turns = None
# what of that generator the forward left after its last chunk (run_in_turns runs it)
_turns_left = None


def run_in_turns(other, forward, after_forward: Callable[[], None] | None = None):
    """Call ``forward()`` (which runs a compiled step's forward) with the generator ``other``
    run in turns with that forward's chunks; what of ``other`` is left after the forward's
    last chunk (or all of it, when ``forward`` compiled anew or ran no compiled step) runs
    once ``forward`` has returned and ``after_forward()`` has run: a pipeline stage hands
    the forward's outputs on there (its send) before the rest of ``other``. Returns
    ``forward()``'s result."""
    global _in_turns, _turns_left
    _in_turns, _turns_left = other, None
    try:
        out = forward()
    finally:
        left = _in_turns if _in_turns is not None else _turns_left
        _in_turns = _turns_left = None
    if after_forward is not None:
        after_forward()
    if left is not None:
        for _ in left:
            pass
    return out
_graphed_steps: weakref.WeakSet = weakref.WeakSet()  # compiled steps holding CUDA graphs


def last_compiled() -> CompiledStep | None:
    """The most recent :class:`CompiledStep` the backend built in this process."""
    return _last


def reset() -> None:
    """Forget :func:`last_compiled` and release every compiled step's CUDA graphs
    (``torch._dynamo.reset()`` calls this too, where it reaches the backend); call it
    before ``dist.destroy_process_group()`` when graphs ran."""
    global _last
    _last = None
    for step in list(_graphed_steps):
        step.close()


def last_stages() -> list[Stage]:
    """The stages of :func:`last_compiled`, in program order ([] when none)."""
    return [] if _last is None else list(_last.stages)


# ------------------------------------------------------------------ layers from nn_module_stack

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


@dataclasses.dataclass
class LayerInfo:
    container: tuple[str, ...]
    layer_names: list[str]  # child names of the container, in execution order
    param_children: dict[int, set[str]]  # per layer: its children that read a parameter
    ffn_child: dict[int, str]  # per layer: the last of them to run
    in_order: bool = True  # each layer's nodes run before the next layer's

    @property
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
                raise _Unsupported(f"node {n.name} ({n.target}) runs a subgraph another call runs too; "
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
) -> dict[str, LayerInfo]:
    """Write ``{LIST_KEY: {list: (i, child)}}`` (``passes/layers.py``) into
    ``node.meta["custom"]`` of every Dynamo node that runs inside entry ``i`` (child
    ``name``) of a candidate layer list, the nodes of checkpoint bodies included (these
    also get ``fxoverlap_checkpoint``); return each candidate's :class:`LayerInfo`.

    The candidates are ``layer_container`` (an attribute path such as ``"layers"``) or,
    by default, every module list seen in the nodes' ``nn_module_stack``; entries are
    numbered in execution order. The capture pass chooses among them, as it does for
    ``fxoverlap.optimize``. ``differentiable`` names the placeholders that are
    parameters: a dense layer's FFN is its last child that reads one (as the capture
    pass's hooks decide).
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
        raise _Unsupported(f"layer_container={layer_container!r} names no module that runs in the graph")
    infos = {}
    for c in containers:
        if not order[c]:
            continue
        ffn_child, owners = {}, {}
        for i, name in enumerate(order[c]):
            kids = [k for k in child_order[c].get(name, []) if k in param_children[c].get(name, set())]
            if kids:
                ffn_child[i], owners[i] = kids[-1], set(kids)
        infos[".".join(c)] = LayerInfo(c, order[c], owners, ffn_child, in_order[c])
    return infos


# ------------------------------------------------------------------ capture of a Dynamo graph


class _GraphStep(nn.Module):
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


# ------------------------------------------------------------------ the compiled artefact


class _Run:
    """One call of a :class:`CompiledStep`: its runner and state, and which backward
    segment runs next (autograd runs them in order, each from its own node). ``args``:
    the call's graph inputs, for a backward run outside autograd
    (:meth:`CompiledStep.backward_in_turns`). ``defer_weights``: its backward leaves the
    weight-gradient part for :meth:`CompiledStep.weight_grads` (a ZeroBubble schedule's W)."""

    __slots__ = ("step", "runner", "state", "next_segment", "args", "grads", "defer_weights", "__weakref__")

    def __init__(self, step: CompiledStep):
        self.step, self.runner, self.state, self.next_segment, self.args = step, None, None, 0, ()
        self.grads: dict[int, torch.Tensor] = {}
        self.defer_weights = False

    def backward_segment(self, k: int, grad_outputs) -> dict[int, torch.Tensor]:
        """Run backward segment ``k``; the gradients it hands out, by graph input index."""
        if self.state is None or self.next_segment != k:
            raise BackendError(
                "fxoverlap backend: backward through a compiled step ran twice (retain_graph=True); "
                "the step's saved values are freed by its first backward"
            )
        self.next_segment = k + 1
        grads = self.step._run_backward(self, k, grad_outputs)
        if self.next_segment == len(self.step._segments) and not self.defer_weights:
            self.state.stores.clear()
            self.state = None
            self.args = ()
        return grads


def _token(device: torch.device, requires_grad: bool = False) -> torch.Tensor:
    return torch.empty(0, device=device, requires_grad=requires_grad)  # no storage: it only orders nodes


class _StepFunction(torch.autograd.Function):
    """The program's forward; its backward runs the backward's first segment."""

    @staticmethod
    def forward(ctx, run: _Run, token: torch.Tensor | None, *args):
        if run.step.keep_args:
            run.args = args
        outs = run.step._run_forward(run, args)
        ctx.run, ctx.token_device = run, None if token is None else token.device
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, run.step._differentiable) if not d))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        got = ctx.run.backward_segment(0, grad_outputs)
        grads = [got.get(i) if need else None for i, need in enumerate(ctx.needs_input_grad[2:])]
        return (None, None if ctx.token_device is None else _token(ctx.token_device), *grads)


class _GradSegment(torch.autograd.Function):
    """Backward segment ``k`` > 0 of a call, returning the gradients of ``inputs``.
    Autograd runs it after segment ``k - 1`` (whose input is its token) and after the
    ``AccumulateGrad`` nodes of what segment ``k - 1`` returned (autograd runs those
    first), so each gradient is accumulated into ``p.grad``, and freed, once final."""

    @staticmethod
    def forward(ctx, run: _Run, k: int, token: torch.Tensor, *inputs):
        ctx.run, ctx.k, ctx.device = run, k, token.device
        return _token(token.device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _token_grad):
        got = ctx.run.backward_segment(ctx.k, None)
        order = ctx.run.step._segments[ctx.k][1]  # the inputs, as __call__ passed them
        grads = [got.get(i) if need else None for i, need in zip(order, ctx.needs_input_grad[3:])]
        return (None, None, _token(ctx.device), *grads)


SEGMENT_MIN_GRAD_BYTES = 64 * 2**20
"""A backward segment of the backend hands out at least this many gradient bytes
(the last one excepted). Each segment costs a host-side autograd node (about 0.1 ms
measured on an H200 host); 64 MiB keeps that under 1 % where gradients are large (the
peer's shape: 4 GiB of them, a segment per stage) and merges a small model's segments,
while the gradients held beyond eager's stay below 64 MiB plus one stage's."""


def merge_segments(segments: list[tuple[tuple[int, int], tuple[int, ...]]], nbytes: dict[int, int],
                   min_bytes: int = SEGMENT_MIN_GRAD_BYTES) -> list[tuple[tuple[int, int], tuple[int, ...]]]:
    """Join consecutive backward segments until each hands out ``min_bytes`` of gradients."""
    out: list[tuple[tuple[int, int], tuple[int, ...]]] = []
    held = 0
    for (lo, hi), inputs in segments:
        if out and held < min_bytes:
            (start, _), before = out.pop()
            lo, inputs = start, before + inputs
        else:
            held = 0
        held += sum(nbytes.get(i, 0) for i in inputs)
        out.append(((lo, hi), inputs))
    return out


class _CompiledProgram:
    """What :class:`CompiledStep` and :class:`CompiledForward` share: the program, its CUDA
    graphs, where each placeholder comes from (a graph input index, a buffer), introspection."""

    def __init__(self, gm: torch.fx.GraphModule, capture_: Capture, stages: list[Stage],
                 program: torch.fx.GraphModule, wrapper: _GraphStep, config: OverlapConfig, device: torch.device):
        self.gm, self.capture, self.stages, self.program = gm, capture_, stages, program
        self._graphs = GraphCache(config.cuda_graphs)
        self._index_of = {f"in{i}": i for i in wrapper.diff_index}
        self._static_src = [(ph, self._index_of[fqn]) for ph, fqn in capture_.param_placeholders.items()]
        self._buffers = {ph: wrapper.get_buffer(fqn) for ph, fqn in capture_.buffer_placeholders.items()}
        self._input_src = list(wrapper.plain_index)

    def _static(self, args) -> dict:
        """The static placeholders' values for one call (its parameters and the buffers)."""
        static = dict(self._buffers)
        static.update((ph, args[i]) for ph, i in self._static_src)
        return static

    def stage_table(self) -> str:
        from fxoverlap.engine import format_stage_table

        return format_stage_table(self.stages)

    def close(self) -> None:
        """Release this program's CUDA graphs; later calls run without them."""
        self._graphs.close()
        self._graphs.enabled = False
        self.runner.cuda_graphs = None


class CompiledStep(_CompiledProgram):
    """What the backend returns for a graph: the forward part of its program in an
    autograd.Function whose backward runs the backward part, both on the engine's
    runtime. ``.stages``, ``.program`` and ``.stage_table()`` for introspection."""

    def __init__(self, gm: torch.fx.GraphModule, capture_: Capture, stages: list[Stage],
                 program: torch.fx.GraphModule, wrapper: _GraphStep, config: OverlapConfig, device: torch.device):
        super().__init__(gm, capture_, stages, program, wrapper, config, device)
        # keep each call's graph inputs until its backward (backward_in_turns needs them; pipeline
        # parallelism sets it, where the stage's inputs are held until its backward anyway)
        self.keep_args = False
        graphs = self._graphs.get(program, stages, capture_, device)
        make = functools.partial(make_runner, program, stages, capture_, device, config, grads=None)
        self.runner = make(cuda_graphs=graphs)
        # The program has one microbatch, so one copy of each graph: a forward that
        # starts while a graphed forward still awaits its backward (two losses summed
        # before one backward) runs on a runner without graphs, made the first time,
        # rather than overwrite it.
        self._make_plain, self._plain = make, None
        self._awaiting_backward: weakref.ref | None = None
        if graphs is not None:
            _graphed_steps.add(self)
        index_of = self._index_of
        self._grad_of = {index_of[fqn]: v for v, fqn in capture_.grads.items() if fqn in index_of}
        # the backward in segments, each ending where gradients are handed out: autograd
        # then accumulates each gradient as soon as it is final (as eager's backward does),
        # rather than every gradient of the step at once at its end (as AOTAutograd's)
        input_of = {v: i for i, v in self._grad_of.items()}
        nbytes = {i: getattr(wrapper, f"in{i}").nbytes for i in wrapper.diff_index}
        self._segments = merge_segments([(span, tuple(input_of[v] for v in values if v in input_of))
                                         for span, values in self.runner.grad_segments()], nbytes,
                                        SEGMENT_MIN_GRAD_BYTES)
        seeded = set(capture_.tangents.values())
        self._differentiable = [o in seeded for o in capture_.outputs]
        self._tangent_pos = [capture_.outputs.index(o) for o in capture_.tangents.values()]
        # outputs AOTAutograd gives no tangent (views of inputs or of other outputs): rebuilt from their base
        arg_of = {ph: index_of[fqn] for ph, fqn in capture_.param_placeholders.items() if fqn in index_of}
        arg_of.update(zip(capture_.input_placeholders, wrapper.plain_index))
        self._outputs = plan_outputs(capture_, gm, arg_of, set(wrapper.diff_index))

    def __call__(self, *args):
        if not torch.is_grad_enabled():
            return self.gm(*args)
        run, token = _Run(self), None
        if len(self._segments) > 1:
            # a leaf that requires grad starts the chain, so every segment runs in the
            # backward, whether or not its own inputs need gradients
            token = _token(self._token_device(args), requires_grad=True)
            for k in range(len(self._segments) - 1, 0, -1):
                token = _GradSegment.apply(run, k, token, *(args[i] for i in self._segments[k][1]))
        outs = _StepFunction.apply(run, token, *args)
        return self._outputs.rebuild(outs if isinstance(outs, tuple) else (outs,), args)

    def _token_device(self, args) -> torch.device:
        # the parameters' device: autograd then runs the chain on the thread that runs
        # their AccumulateGrad nodes, in priority order
        return next((args[i].device for i in self._grad_of), torch.device("cpu"))

    def _run_forward(self, run: _Run, args) -> tuple:
        static = self._static(args)
        runner = self.runner
        pending = self._awaiting_backward() if self._awaiting_backward is not None else None
        if runner.cuda_graphs is not None and pending is not None:
            if self._plain is None:
                self._plain = self._make_plain()
            runner = self._plain
        state = runner.start(static, [[args[i] for i in self._input_src]], tangents=[()])
        global _in_turns, _turns_left
        other, _in_turns = _in_turns, None
        if other is None:
            runner.execute(state, "forward")
        else:  # a merged step: this forward and another program's backward, in turns
            spans = runner.turns("forward")
            for k, span in enumerate(spans):
                runner.execute(state, span)
                if k + 1 < len(spans):
                    next(other, None)
            # the rest of the other program runs after this forward has returned
            # (run_in_turns), so the caller can send this forward's outputs on first; the
            # chunks run in the same order as if they ran here
            _turns_left = other
            if runner.streams:
                runner.streams[StreamKind.COMP].wait_stream(runner.streams[StreamKind.COMM])
        if runner.cuda_graphs is not None:
            self._awaiting_backward = weakref.ref(state)
        run.runner, run.state = runner, state
        outs = state.outputs[0]
        return tuple(outs.pop(o) for o in self.capture.outputs)

    def backward_in_turns(self, run: _Run, grad_outputs):
        """The backward of call ``run`` outside autograd, as a generator that stops after each
        of its comm-stream stages (:meth:`ProgramRunner.turns`), so another program's
        forward can run in between (:func:`run_in_turns`). ``grad_outputs``: one per
        output of the call (as autograd would pass them). When exhausted, ``run.grads``
        holds the gradients by graph input index, and the call's autograd node is spent
        (a later backward through it raises)."""
        if run.state is None or run.next_segment != 0:
            raise BackendError("fxoverlap backend: backward through a compiled step ran twice")
        runner, state = run.runner, run.state
        # a graphed call's memory is in use until its last part has run
        if not run.defer_weights:
            self._backward_started(state)
        run.next_segment = len(self._segments)
        runner.set_tangents(state, 0, [grad_outputs[i] for i in self._tangent_pos])
        for span in runner.turns("input_grads" if run.defer_weights else "backward"):
            runner.execute(state, span)
            yield
        handed = state.outputs[0]
        run.grads = {i: handed.pop(v) for i, v in self._grad_of.items() if v in handed}
        if not run.defer_weights:
            state.stores.clear()
            run.state, run.args = None, ()

    def weight_grads(self, run: _Run) -> dict[int, torch.Tensor]:
        """The weight-gradient part of call ``run``'s backward, left by a backward with
        ``run.defer_weights`` (a ZeroBubble schedule's ``BACKWARD_WEIGHT``): runs it and
        returns the gradients it hands out, by graph input index (the caller accumulates
        them, as autograd's AccumulateGrad would). Frees the call's saved values."""
        if run.state is None or not run.defer_weights or run.next_segment != len(self._segments):
            raise BackendError("fxoverlap backend: weight gradients of a call whose input-gradient backward has not "
                               "run with defer_weights, or that already ran")
        runner, state = run.runner, run.state
        self._backward_started(state)
        runner.execute(state, "weight_grads")
        handed = state.outputs[0]
        grads = {i: handed.pop(v) for i, v in self._grad_of.items() if v in handed}
        state.stores.clear()
        run.state, run.args = None, ()
        return grads

    @property
    def splits_weight_grads(self) -> bool:
        """Whether the program's backward has a weight-gradient part to defer (``weight_last``)."""
        return self.runner.has_weight_part()

    def _backward_started(self, state) -> None:
        """The last part of call ``state``'s backward runs: its graph memory may be reused
        after it, so the next forward may use the graphed runner again."""
        if self._awaiting_backward is not None and self._awaiting_backward() is state:
            self._awaiting_backward = None

    def draws_random_numbers(self) -> bool:
        return any(s.draws for s in self.stages)

    def _run_backward(self, run: _Run, k: int, grad_outputs) -> dict[int, torch.Tensor]:
        runner, state = run.runner, run.state
        if k == 0:
            if not run.defer_weights:
                self._backward_started(state)
            runner.set_tangents(state, 0, [grad_outputs[i] for i in self._tangent_pos])
        (lo, hi), inputs = self._segments[k]
        if run.defer_weights:  # the weight-gradient part runs later (weight_grads)
            hi = min(hi, runner.weight_start)
        if lo < hi:
            runner.execute(state, (lo, hi))
        handed = state.outputs[0]
        return {i: handed.pop(self._grad_of[i], None) for i in inputs}


class CompiledForward(_CompiledProgram):
    """What the backend returns for a graph Dynamo traced under ``torch.no_grad()`` (inference,
    ``model.eval()`` or not): the forward-only program (chunks, compiled stages, the comm
    stream), no autograd. ``.stages``, ``.program`` and ``.stage_table()`` as for
    :class:`CompiledStep`."""

    def __init__(self, gm: torch.fx.GraphModule, capture_: Capture, stages: list[Stage],
                 program: torch.fx.GraphModule, wrapper: _GraphStep, config: OverlapConfig, device: torch.device):
        super().__init__(gm, capture_, stages, program, wrapper, config, device)
        self.runner = make_runner(program, stages, capture_, device, config, grads=None,
                                  cuda_graphs=self._graphs.get(program, stages, capture_, device))
        if self.runner.cuda_graphs is not None:
            _graphed_steps.add(self)

    def __call__(self, *args):
        state = self.runner.run(self._static(args), [[args[i] for i in self._input_src]])
        outs = state.outputs[0]
        return tuple(outs.pop(o) for o in self.capture.outputs)


# ------------------------------------------------------------------ the backend


def _fallback(gm: torch.fx.GraphModule, reason: str):
    msg = f"fxoverlap backend: running this graph as plain eager-equivalent code: {reason}"
    log.warning(msg)
    warnings.warn(msg, FallbackWarning, stacklevel=2)
    return gm.forward


# Dynamo's reasons for a graph break at a read of a tensor's value on the host
# (``.tolist()``, ``.item()``, ``int(t)``: ``aten._local_scalar_dense``)
_HOST_READ = re.compile(r"_local_scalar_dense|tolist|\.item\(|data.dependent", re.IGNORECASE)


def host_read_breaks() -> list[str]:
    """The first lines of the graph-break reasons Dynamo recorded in this process that are
    host reads of tensor values (split sizes from ``.tolist()``, a scalar from ``.item()``)."""
    from torch._dynamo.utils import counters

    out = []
    for reason in counters.get("graph_break", {}):
        if _HOST_READ.search(reason):
            ctx = re.search(r"Developer debug context:\s*(\S+)", reason)
            out.append(reason.strip().splitlines()[0] + (f" at {ctx.group(1)}" if ctx else ""))
    return out


def _has_all_to_all(gm: torch.fx.GraphModule) -> bool:
    """Whether the Dynamo graph runs an all-to-all (a functional collective or fxoverlap's ops)."""
    return any(n.op == "call_function" and ("all_to_all" in str(n.target) or "fxoverlap" in str(n.target))
               for n in gm.graph.nodes)


def graph_break_hint() -> str | None:
    """Why a graph holds no whole decoder layer when Dynamo broke graphs at host reads, and the fix."""
    breaks = host_read_breaks()
    if not breaks:
        return None
    return (
        f"a graph break split the decoder layers: Dynamo broke the graph at a host read of a tensor value "
        f"({breaks[0]!r}: e.g. all-to-all split sizes from .tolist()), so each graph holds a piece of a layer, "
        f"and no graph a whole layer with its all-to-alls to overlap. Fixes: fxoverlap's dispatch/combine ops "
        f"(fxoverlap.ops) with a static, sync-free dispatcher (OverlapConfig(dispatcher='padded' | 'symm_mem'), "
        f"torch.compile(..., options={{'dispatcher': 'padded'}})), which read no split sizes on the host; "
        f"torch._dynamo.config.capture_scalar_outputs = True, which keeps the host read inside the graph; "
        f"or fxoverlap.optimize(model, ep_group), which traces the whole step without graph breaks"
    )


def _check_supported(gm: torch.fx.GraphModule, example_inputs, train: bool = True) -> None:
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor):
            raise _Unsupported(
                f"graph input {i} is a {type(t).__name__} (dynamic shapes); fxoverlap captures static "
                f"shapes: compile with dynamic=False (each new shape is then compiled anew)"
            )
    for ph in gm.graph.find_nodes(op="placeholder"):
        ev = ph.meta.get("example_value")
        if isinstance(ev, torch.Tensor) and not all(isinstance(d, int) for d in ev.shape):
            raise _Unsupported(
                f"graph input {ph.name} has a dynamic shape {list(ev.shape)}; fxoverlap captures "
                f"static shapes: compile with dynamic=False (each new shape is then compiled anew)"
            )
    own = [name for name, p in gm.named_parameters() if p.requires_grad]
    if own:
        raise _Unsupported(
            f"parameters {own[:3]} are attributes of the graph, not graph inputs "
            f"(torch._dynamo.config.inline_inbuilt_nn_modules is off?)"
        )
    out = next(iter(gm.graph.find_nodes(op="output")))
    vals = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    evs = [v.meta.get("example_value") if isinstance(v, torch.fx.Node) else v for v in vals]
    if bad := [i for i, ev in enumerate(evs) if not isinstance(ev, torch.Tensor)]:
        raise _Unsupported(
            f"graph output {bad[0]} is {'None' if evs[bad[0]] is None else type(evs[bad[0]]).__name__}, not a "
            f"tensor; fxoverlap compiles graphs whose outputs are tensors"
        )
    if train and not any(ev.requires_grad for ev in evs):
        raise _Unsupported("no output of the graph requires grad (nothing to train)")


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

_ALIASES = {"overlap": "side_stages"}

# OverlapConfig fields the backend cannot honour (a set value would be silently ignored), and why
UNSUPPORTED_FIELDS = {
    "record_memory": "the memory trace is engine.memory_trace, which only fxoverlap.optimize keeps",
    "grad_reduce": "the backend reduces no gradients over data parallelism (optimize(..., dp_group=...) does)",
    "reduce_bucket_mb": "the backend reduces no gradients over data parallelism (optimize(..., dp_group=...) does)",
    "dispatch_capacity_factor": "it needs a check of the overflow flags after each step, which "
                                "fxoverlap.optimize makes and the backend does not",
    "chunks_in_merged_steps": "the backend runs one microbatch per call, so its program has no merged steps "
                              "(its layers run the chunks anyway)",
    "expert_wgrad_slot": "the backend runs one microbatch per call, so its program has no merged steps",
}


def _inductor_options() -> set[str]:
    """The names ``torch.compile(options=...)`` takes for Inductor: the keys of
    ``torch._inductor.config`` (dotted for its sub-configs: ``"triton.cudagraphs"``)."""
    import torch._inductor.config as inductor_config

    return set(inductor_config.get_config_copy())


def backend_config(options: dict | None = None, mode: str | None = None, **kwargs) -> OverlapConfig:
    """The :class:`OverlapConfig` for ``torch.compile(model, backend="fxoverlap", mode=..., options=...)``.

    Keys of ``options`` (and keyword options of ``functools.partial(fxoverlap_backend, ...)``)
    that name an ``OverlapConfig`` field set it (``overlap`` is ``side_stages``); keys of
    ``torch._inductor.config`` are Inductor options for the compiled stages
    (``compile_options``), as ``torch.compile(options=...)`` passes them to Inductor. Any other
    key raises :class:`~fxoverlap.config.ConfigError` naming it and its close matches, as does a
    field the backend cannot honour (:data:`UNSUPPORTED_FIELDS`: ``record_memory``,
    ``grad_reduce``, ``reduce_bucket_mb``, ``dispatch_capacity_factor``, and the merged steps'
    ``chunks_in_merged_steps`` and ``expert_wgrad_slot``; use ``fxoverlap.optimize`` for them). ``mode="reduce-overhead"``
    turns on CUDA graphs; ``mode="max-autotune"`` Inductor's autotuning.
    """
    fields = {f.name: f for f in dataclasses.fields(OverlapConfig)}
    inductor_names = _inductor_options()
    cfg: dict = {}
    inductor_opts: dict = {}
    unknown: list[str] = []
    for k, v in {**(options or {}), **kwargs}.items():
        k = _ALIASES.get(k, k)
        if k in fields:
            cfg[k] = v
        elif k in inductor_names:
            inductor_opts[k] = v
        else:
            unknown.append(k)
    if unknown:
        raise UnknownConfigField(
            f"fxoverlap backend: unknown option {unknown_names(unknown, {*fields, *_ALIASES, *inductor_names})}: "
            f"an option is an OverlapConfig field "
            f"({', '.join(sorted(fields))}; 'overlap' is side_stages) or an Inductor option (a key of "
            f"torch._inductor.config.get_config_copy(), dotted for its sub-configs: 'triton.cudagraphs')")
    refused = [k for k in UNSUPPORTED_FIELDS if k in cfg and cfg[k] != fields[k].default]
    if refused:
        raise ConfigError(
            f"fxoverlap backend: cannot honour {', '.join(f'{k}={cfg[k]!r}' for k in refused)}: "
            + "; ".join(f"{k}: {UNSUPPORTED_FIELDS[k]}" for k in refused)
            + ". Use fxoverlap.optimize(model, ep_group, OverlapConfig(...)) for them")
    if mode == "reduce-overhead":
        cfg.setdefault("cuda_graphs", True)
    elif mode in ("max-autotune", "max-autotune-no-cudagraphs"):
        inductor_opts.setdefault("max_autotune", True)
    elif mode not in (None, "default"):
        raise ConfigError(f"fxoverlap backend: unknown mode {mode!r}")
    if inductor_opts:
        cfg["compile_options"] = {**(cfg.get("compile_options") or {}), **inductor_opts}
    config = OverlapConfig(**cfg)
    check_disable_passes(config.disable_passes)  # an error for the user, not a fallback
    return config


def compile_step(gm: torch.fx.GraphModule, example_inputs, config: OverlapConfig | None = None,
                 train: bool = True, weight_last: bool = False) -> CompiledStep | CompiledForward:
    """Build the :class:`CompiledStep` for a Dynamo graph (``train=False``: the
    :class:`CompiledForward` of a graph Dynamo traced under ``no_grad``); raises when it cannot.
    ``weight_last``: the backward computes the weight gradients of the ``delay_wgrad`` parts
    after all else, so a call's backward can leave them for later
    (``_Run.defer_weights``, :meth:`CompiledStep.weight_grads`: a ZeroBubble schedule's W)."""
    config = config or OverlapConfig()
    if weight_last:
        config = dataclasses.replace(config, delay_wgrad=True)
    if config.dispatch_capacity_factor is not None:
        raise _Unsupported(
            "dispatch_capacity_factor needs a check of the overflow flags after each step, which "
            "fxoverlap.optimize makes and the torch.compile backend does not; use the worst-case "
            "capacity (the default) under torch.compile, or fxoverlap.optimize")
    _check_supported(gm, example_inputs, train)
    diff = {n.name for n, t in zip(gm.graph.find_nodes(op="placeholder"), example_inputs) if t.requires_grad}
    infos = annotate_layers(gm, diff, config.layer_container)
    wrapper = _GraphStep(gm, example_inputs)
    plain = [example_inputs[i] for i in wrapper.plain_index]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tag's "no layers found" is reported below
        # the capture pass chooses the layer list among the candidates, as for fxoverlap.optimize
        cap = capture(wrapper, plain, scalar_loss=False, train=train,
                      lists={name: info.num_layers for name, info in infos.items()})
        chosen = cap.layer_choice.container if cap.layer_choice is not None else None
        info = infos[chosen] if chosen is not None else LayerInfo((), [], {}, {})
        if not info.in_order:
            raise _Unsupported(
                f"the layers of {chosen} do not run one after another (a layer is called "
                f"twice or interleaved with another); fxoverlap schedules each layer once per step"
            )
        if cap.subclass_placeholders or any(path for _, path in cap.input_parts.values()):
            raise _Unsupported("a graph input is a tensor subclass (a DTensor?); the backend runs plain "
                               "tensors: use fxoverlap.optimize(model, ep_group), which takes DTensor "
                               "parameters and inputs")
        cap = dataclasses.replace(
            cap, num_layers=info.num_layers, param_children=info.param_children,
            layer_names=[".".join(info.container + (n,)) for n in info.layer_names],
        )
        device = next((t.device for t in example_inputs if t.requires_grad), example_inputs[0].device)
        stages = build_stages(cap, config, device.type, train, one_microbatch=True)
    if info.num_layers == 0 and _has_all_to_all(gm) and (hint := graph_break_hint()) is not None:
        raise _Unsupported(f"no decoder layer in this graph; {hint}")
    program = build_program(stages, cap, 1, config, forward_only=not train, weight_last=weight_last and train)
    if info.num_layers == 0:
        log.warning("fxoverlap backend: no decoder layers found in the graph; one stage per direction, no overlap")
    return (CompiledStep if train else CompiledForward)(gm, cap, stages, program, wrapper, config, device)


def fxoverlap_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
                      mode: str | None = None, **kwargs):
    """The ``"fxoverlap"`` torch.compile backend (see the module docstring and :func:`backend_config`)."""
    global _last
    config = backend_config(options, mode, **kwargs)
    try:
        # Dynamo guards on grad mode: a graph traced under no_grad only ever runs under it
        step = compile_step(gm, example_inputs, config, train=torch.is_grad_enabled())
    except _Unsupported as e:
        return _fallback(gm, str(e))
    except FALLBACK_ERRORS as e:  # a pass could not handle the graph: never a wrong answer
        log.debug("fxoverlap backend: compile failed", exc_info=True)
        hint = graph_break_hint() if "outside every decoder layer" in str(e) else None
        if hint is not None:  # the layer is a fragment: the graph break is the cause, not the model
            return _fallback(gm, f"{hint} (the pass said: {type(e).__name__}: {e})")
        return _fallback(gm, f"{type(e).__name__}: {e}")
    _last = step
    log.info("fxoverlap backend: %d stages\n%s", len(step.stages), step.stage_table())
    return step


fxoverlap_backend.reset = reset  # type: ignore[attr-defined]


def _enable_dynamic_dispatch() -> None:
    import torch._dynamo.config as dcfg

    if dcfg._is_default("capture_dynamic_output_shape_ops"):
        dcfg.capture_dynamic_output_shape_ops = True


def _register() -> None:
    # When Dynamo found the entry point first, it registers what the entry point
    # loads (this function) itself: registering here too would be a duplicate.
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if "fxoverlap" not in _COMPILER_FNS and _BACKENDS.get("fxoverlap") is None:
        register_backend(fxoverlap_backend, "fxoverlap")


_enable_dynamic_dispatch()
_register()
