"""``torch.compile(model, backend="fxoverlap")``: the stage split, streams and
intra-microbatch overlap for one microbatch per call, under torch.compile.

Design (and why not ``aot_autograd(fw_compiler=..., bw_compiler=...)``)
----------------------------------------------------------------------
Dynamo hands the backend its forward GraphModule, parameters lifted to graph
inputs. The backend

1. **annotates layers** (:func:`annotate_layers`): the decoder layer of every
   Dynamo node comes from its ``nn_module_stack`` (``L['self'].layers.0.moe...``),
   written into ``node.meta["custom"]`` under the same keys the capture pass's
   hooks write (``fxoverlap_layer``, ``fxoverlap_child``);
2. **captures the joint graph** of the Dynamo graph with the ordinary capture pass
   (``aot_export_joint_with_descriptors``, no decompositions): a thin module
   (:class:`_GraphStep`) holds the differentiable graph inputs as parameters and
   runs the Dynamo graph through an ``fx.Interpreter`` under
   ``preserve_node_meta``, so every aten node inherits the annotation of the
   Dynamo node it came from, and backward nodes carry ``seq_nr``;
3. reuses **tag → split** unchanged, then splits each MoE layer's ``attn``
   stages once more for intra-microbatch overlap (:func:`split_for_overlap`):
   forward attn work the dispatch does not need (the shared expert, routing
   weights) runs after the dispatch is issued; backward attn work that does not
   need the backward dispatch's output (shared-expert and router backward) runs
   right after the backward combine is issued;
4. emits a one-microbatch program and runs the **streams** pass on it (comm stages
   on the comm stream, events on cross-stream edges; no-ops on CPU);
5. returns a :class:`CompiledStep` whose call runs the forward stages inside one
   ``torch.autograd.Function``; its backward seeds the incoming loss gradient,
   runs the backward stages and returns the input gradients, so autograd's
   ``AccumulateGrad`` fills ``p.grad`` exactly as in eager.

One joint graph instead of AOT's forward and backward compilers: the tag pass
maps backward nodes to forward nodes by ``seq_nr`` within one graph and can be
reused as it is; what crosses from forward to backward is exactly what the
backward formulas read (no partitioner choices, no recompute), which is what
eager saves, so gradients stay bitwise equal to eager's; and every decision,
including the fallback, is taken at compile time (AOT compiles the backward
lazily, at the first ``backward()``, where falling back is no longer possible).

Fallback: anything the backend cannot handle (graph breaks leave pieces whose
output is not a scalar loss, dynamic-shape graph inputs, no gradient needed,
a capture/tag/split error) makes it return the plain Dynamo GraphModule, which
runs like eager, with a :class:`FallbackWarning` (also logged) that names the
reason. Under ``torch.no_grad()`` the plain graph runs too, without a warning.

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
recompile that Dynamo makes dynamic falls back: use ``dynamic=False``); the
compiled graph must return one scalar loss (pieces left by a graph break fall
back); no buffer or input mutation in the forward (falls back); no double
backward or ``retain_graph=True`` (a second backward raises).

Options: ``torch.compile(model, backend=functools.partial(fxoverlap_backend,
layer_container="layers", overlap=False))``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import warnings
from collections.abc import Sequence

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from fxoverlap import program_ops
from fxoverlap.passes.capture import CHILD_KEY, Capture, capture
from fxoverlap.passes.schedule import StageCall
from fxoverlap.passes.split import build_stage_module, split, stage_boundary
from fxoverlap.passes.streams import streams
from fxoverlap.passes.tag import TAG_KEY, tag
from fxoverlap.region import LAYER_KEY
from fxoverlap.stage import Direction, Stage, StageKind

__all__ = [
    "CompiledStep",
    "FallbackWarning",
    "annotate_layers",
    "fxoverlap_backend",
    "last_compiled",
    "last_stages",
    "reset",
    "split_for_overlap",
]

log = logging.getLogger("fxoverlap.backend")


class FallbackWarning(UserWarning):
    """The backend runs a graph as plain eager-equivalent code; the message says why."""


class _Unsupported(Exception):
    pass


_last: CompiledStep | None = None


def last_compiled() -> CompiledStep | None:
    """The most recent :class:`CompiledStep` the backend built in this process."""
    return _last


def reset() -> None:
    """Forget :func:`last_compiled` (``torch._dynamo.reset()`` calls this too, where it
    reaches the backend)."""
    global _last
    _last = None


def last_stages() -> list[Stage]:
    """The stages of :func:`last_compiled`, in program order ([] when none)."""
    return [] if _last is None else list(_last.stages)


# ------------------------------------------------------------------ layers from nn_module_stack

_ROOT = re.compile(r"^[A-Za-z_]\w*\[(['\"])[^'\"]*\1\]")  # L['self'], L["model"], ...


def module_path(path: str) -> tuple[str, ...]:
    """``"L['self'].layers[0].attention"`` -> ``("layers", "0", "attention")``."""
    path = _ROOT.sub("", path, count=1)
    path = re.sub(r"\._modules\[(['\"])(.*?)\1\]", r".\2", path)
    path = re.sub(r"\[(['\"])(.*?)\1\]", r".\2", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return tuple(p for p in path.split(".") if p)


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

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)


def _find_container(paths: list[tuple[str, ...]]) -> tuple[str, ...] | None:
    """The outermost module list among ``paths`` (integer children), the largest if several."""
    kids: dict[tuple[str, ...], list[str]] = {}
    for p in paths:
        for i in range(1, len(p)):
            if p[i].isdigit():
                lst = kids.setdefault(p[:i], [])
                if p[i] not in lst:
                    lst.append(p[i])
    outer = [c for c in kids if not any(len(c) > len(o) and c[: len(o)] == o for o in kids)]
    if not outer:
        return None
    return max(outer, key=lambda c: len(kids[c]))


def annotate_layers(
    gm: torch.fx.GraphModule, differentiable: set[str] | None = None, layer_container: str | None = None
) -> LayerInfo:
    """Write ``{fxoverlap_layer: i, fxoverlap_child: name}`` into ``node.meta["custom"]``
    of every Dynamo node that runs inside decoder layer ``i`` (child ``name``).

    The layers are the children of ``layer_container`` (an attribute path such as
    ``"layers"``) or, by default, of the outermost module list seen in the nodes'
    ``nn_module_stack``; they are numbered in execution order. ``differentiable``
    names the placeholders that are parameters: a dense layer's FFN is its last
    child that reads one (as the capture pass's hooks decide).
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    node_paths = {n: _stack_paths(n) for n in nodes}
    if layer_container is not None:
        container = tuple(p for p in layer_container.split(".") if p)
    else:
        container = _find_container([p for ps in node_paths.values() for p in ps])
    if container is None:
        return LayerInfo((), [], {}, {})
    k = len(container)
    order: list[str] = []
    child_order: dict[str, list[str]] = {}
    param_children: dict[str, set[str]] = {}
    seq: list[int] = []
    differentiable = differentiable or set()
    for n in nodes:
        best = max((p for p in node_paths[n] if len(p) > k and p[:k] == container), key=len, default=None)
        if best is None:
            continue
        layer_name = best[k]
        if layer_name not in order:
            order.append(layer_name)
        i = order.index(layer_name)
        seq.append(i)
        meta = dict(n.meta.get("custom") or {})
        meta[LAYER_KEY] = i
        if len(best) > k + 1:
            child = best[k + 1]
            meta[CHILD_KEY] = child
            kids = child_order.setdefault(layer_name, [])
            if child not in kids:
                kids.append(child)
            if any(p.op == "placeholder" and p.name in differentiable for p in n.all_input_nodes) or any(
                p.op == "get_attr" for p in n.all_input_nodes
            ):
                param_children.setdefault(layer_name, set()).add(child)
        n.meta["custom"] = meta
    if layer_container is not None and not order:
        raise _Unsupported(f"layer_container={layer_container!r} names no module that runs in the graph")
    if any(b < a for a, b in zip(seq, seq[1:])):
        raise _Unsupported(
            f"the layers of {'.'.join(container)} do not run one after another (a layer is called "
            f"twice or interleaved with another); fxoverlap schedules each layer once per step"
        )
    ffn_child, owners = {}, {}
    for i, name in enumerate(order):
        kids = [c for c in child_order.get(name, []) if c in param_children.get(name, set())]
        if kids:
            ffn_child[i], owners[i] = kids[-1], set(kids)
    return LayerInfo(container, order, owners, ffn_child)


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

    def forward(self, *plain: torch.Tensor) -> torch.Tensor:
        args: list = [None] * self.num_inputs
        for i in self.diff_index:
            args[i] = getattr(self, f"in{i}")
        for i, t in zip(self.plain_index, plain):
            args[i] = t
        with fx_traceback.preserve_node_meta():
            out = torch.fx.Interpreter(self.g).run(*args)
        return out[0] if isinstance(out, (tuple, list)) else out


# ------------------------------------------------------------------ intra-microbatch overlap


def _sub_stage(gm: torch.fx.GraphModule, parent: Stage, nodes: list[torch.fx.Node], name: str) -> Stage:
    inputs, outputs = stage_boundary(nodes)
    return Stage(
        name=name, layer=parent.layer, kind=parent.kind, direction=parent.direction, stream=parent.stream,
        graph_module=build_stage_module(gm, nodes, inputs, outputs, name), inputs=inputs, outputs=outputs,
        capturable=parent.capturable, not_capturable_reason=parent.not_capturable_reason,
    )


def split_for_overlap(gm: torch.fx.GraphModule, stages: list[Stage]) -> tuple[list[Stage], dict[str, str]]:
    """Split each MoE layer's attn stages so part of them can overlap that layer's all-to-all.

    Forward: ``attn`` keeps what the dispatch needs; ``attn_side`` (e.g. the shared
    expert) gets the rest. Backward: ``attn_early`` is what does not depend on the
    backward dispatch's output (shared-expert and router backward); ``attn`` the rest.
    Returns the stages (plain order still valid) and ``{moved stage: stage it should
    follow}`` for the emitter.
    """
    by_tag: dict = {}
    for n in gm.graph.nodes:
        t = n.meta.get(TAG_KEY)
        if t is not None:
            by_tag.setdefault(t, []).append(n)
    index = {(s.direction, s.layer, s.kind): s for s in stages}
    out: list[Stage] = []
    after: dict[str, str] = {}
    for s in stages:
        if s.kind is not StageKind.ATTN:
            out.append(s)
            continue
        nodes = by_tag.get(s.tag, [])
        if s.direction is Direction.FWD:
            comm = index.get((Direction.FWD, s.layer, StageKind.DISPATCH))
            if comm is None:
                out.append(s)
                continue
            wanted = set(comm.inputs)
            keep: set[torch.fx.Node] = set()
            for n in reversed(nodes):  # ancestors (within the stage) of the dispatch's inputs
                if n.name in wanted or any(u in keep for u in n.users):
                    keep.add(n)
            first = [n for n in nodes if n in keep]
            second = [n for n in nodes if n not in keep]
            if not first or not second:
                out.append(s)
                continue
            a, b = _sub_stage(gm, s, first, s.name), _sub_stage(gm, s, second, s.name + "_side")
            after[b.name] = comm.name
            out += [a, b]
        else:
            comm = index.get((Direction.BWD, s.layer, StageKind.DISPATCH))
            anchor = index.get((Direction.BWD, s.layer, StageKind.COMBINE))
            if comm is None or anchor is None:
                out.append(s)
                continue
            late_in = set(comm.outputs)
            late: set[torch.fx.Node] = set()
            for n in nodes:  # descendants (within the stage) of the backward dispatch's outputs
                if any(p.name in late_in or p in late for p in n.all_input_nodes):
                    late.add(n)
            first = [n for n in nodes if n not in late]
            second = [n for n in nodes if n in late]
            if not first or not second:
                out.append(s)
                continue
            a, b = _sub_stage(gm, s, first, s.name + "_early"), _sub_stage(gm, s, second, s.name)
            after[a.name] = anchor.name
            out += [a, b]
    return out, after


def _order(stages: list[Stage], after: dict[str, str]) -> list[Stage]:
    """Plain order, with each stage of ``after`` moved right behind its anchor where its
    inputs allow it (a move that would read a value not yet produced is not made)."""
    order = list(stages)
    producer = {o: s.name for s in stages for o in s.outputs}
    for name, anchor in after.items():
        trial = [s for s in order if s.name != name]
        moved = next(s for s in order if s.name == name)
        pos = next(i for i, s in enumerate(trial) if s.name == anchor) + 1
        trial.insert(pos, moved)
        if _valid(trial, producer):
            order = trial
        else:
            log.info("fxoverlap backend: %s stays in place (it reads a value produced after %s)", name, anchor)
    return order


def _valid(order: list[Stage], producer: dict[str, str]) -> bool:
    done: set[str] = set()
    for s in order:
        if any(i in producer and producer[i] not in done for i in s.inputs):
            return False
        done.add(s.name)
    return True


def emit_program(order: list[Stage]) -> torch.fx.GraphModule:
    """A one-microbatch program in the schedule pass's format (stage calls in ``order``)."""
    root, graph = nn.Module(), torch.fx.Graph()
    for s in order:
        root.add_module(s.name, StageCall(s))
        node = graph.call_module(s.name, (0,))
        node.name = f"{'F' if s.direction is Direction.FWD else 'B'}0_{s.name.split('_', 1)[1]}"
        node.meta["stage"] = s.name
        node.meta["microbatch"] = 0
    graph.output(None)
    gm = torch.fx.GraphModule(root, graph, class_name="Program")
    gm.meta = {"num_microbatches": 1}
    return gm


# ------------------------------------------------------------------ the compiled artefact


class _StepFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: CompiledStep, *args):
        loss, state = step._run_forward(args)
        ctx.step, ctx.state = step, state
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        state, ctx.state = ctx.state, None
        if state is None:
            raise RuntimeError(
                "fxoverlap backend: backward through a compiled step ran twice (retain_graph=True); "
                "the step's saved values are freed by its first backward"
            )
        grads = ctx.step._run_backward(state, grad_loss, ctx.needs_input_grad[1:])
        return (None, *grads)


@dataclasses.dataclass
class _State:
    store: dict
    stream_of: dict
    events: dict
    streams: dict


class CompiledStep:
    """What the backend returns for a graph: forward stages in an autograd.Function whose
    backward runs the backward stages. ``.stages`` and ``.program`` for introspection."""

    def __init__(self, gm, capture_: Capture, stages: list[Stage], program: torch.fx.GraphModule,
                 wrapper: _GraphStep, comm_stream_priority: int = -1):
        self.gm, self.capture, self.stages, self.program = gm, capture_, stages, program
        self._by_name = {s.name: s for s in stages}
        self._comm_priority = comm_stream_priority
        # where each placeholder of the joint graph comes from
        fqn_index = {f"in{i}": i for i in wrapper.diff_index}
        self._param_src = [(ph, fqn_index[fqn]) for ph, fqn in capture_.param_placeholders.items()]
        self._input_src = list(zip(capture_.input_placeholders, wrapper.plain_index))
        self._buffers = {ph: wrapper.get_buffer(fqn) for ph, fqn in capture_.buffer_placeholders.items()}
        self._grad_of = {}  # input index -> value name of its gradient
        for name, fqn in zip(capture_.output_names[1:], capture_.grad_targets):
            if name is not None and fqn in fqn_index:
                self._grad_of[fqn_index[fqn]] = name
        keep = {n for n in capture_.output_names if n is not None}
        nodes = list(program.graph.nodes)
        calls = [n for n in nodes if n.op == "call_module"]
        last_fwd = max((i for i, n in enumerate(nodes) if n.op == "call_module"
                        and self._by_name[n.meta["stage"]].direction is Direction.FWD), default=-1)
        cut = last_fwd + 1
        while cut < len(nodes) and nodes[cut].op == "call_function" and nodes[cut].target is program_ops.record_event:
            cut += 1
        self._fwd_nodes, self._bwd_nodes = nodes[:cut], nodes[cut:]
        # free each value after the stage call that reads it last
        last_read: dict[str, torch.fx.Node] = {}
        for n in calls:
            for v in self._by_name[n.meta["stage"]].inputs:
                last_read[v] = n
        self._free_after: dict[torch.fx.Node, list[str]] = {}
        for v, n in last_read.items():
            if v not in keep:
                self._free_after.setdefault(n, []).append(v)
        self._loss_needed_later = capture_.loss_name in last_read

    # ---- introspection
    def stage_table(self) -> str:
        from fxoverlap.engine import format_stage_table

        return format_stage_table(self.stages)

    # ---- running
    def __call__(self, *args):
        if not torch.is_grad_enabled():
            return self.gm(*args)
        return (_StepFunction.apply(self, *args),)

    def _streams(self, args) -> dict:
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        if dev.type != "cuda":
            return {}
        comm = getattr(self, "_comm_stream", None)
        if comm is None or comm.device != dev:
            comm = self._comm_stream = torch.cuda.Stream(dev, priority=self._comm_priority)
        return {"comp": torch.cuda.current_stream(dev), "comm": comm}

    def _run_forward(self, args):
        store = dict(self._buffers)
        for ph, i in self._param_src:
            store[ph] = args[i]
        for ph, i in self._input_src:
            store[ph] = args[i]
        state = _State(store, {}, {}, self._streams(args))
        self._walk(self._fwd_nodes, state)
        if state.streams:
            state.streams["comp"].wait_stream(state.streams["comm"])
        loss = store[self.capture.loss_name]
        # keep no reference to the Function's output in its ctx (a reference cycle)
        if self._loss_needed_later:
            store[self.capture.loss_name] = loss.detach()
        else:
            del store[self.capture.loss_name]
        return loss, state

    def _run_backward(self, state: _State, grad_loss, needs_grad) -> list:
        if state.streams:
            state.streams["comp"] = torch.cuda.current_stream(state.streams["comm"].device)
            state.streams["comm"].wait_stream(state.streams["comp"])
        state.store[self.capture.tangent_placeholder] = grad_loss
        with torch.no_grad():
            self._walk(self._bwd_nodes, state)
        grads = [None] * len(needs_grad)
        for i, name in self._grad_of.items():
            if needs_grad[i]:
                grads[i] = state.store.get(name)
        state.store.clear()
        return grads

    def _walk(self, nodes: list[torch.fx.Node], state: _State) -> None:
        from fxoverlap.runtime import StageFailed

        store, streams_ = state.store, state.streams
        for node in nodes:
            if node.op == "call_module":
                stage = self._by_name[node.meta["stage"]]
                stream = node.kwargs.get("stream")
                ctx = torch.cuda.stream(streams_[stream]) if streams_ and stream else contextlib.nullcontext()
                with ctx:
                    args = [store[i] for i in stage.inputs]
                    if streams_:
                        for v, a in zip(stage.inputs, args):
                            if state.stream_of.get(v, "comp") != stream and isinstance(a, torch.Tensor):
                                a.record_stream(streams_[stream])
                    try:
                        outs = stage.graph_module(*args)
                    except Exception as e:
                        raise StageFailed(
                            f"stage {stage.name} (layer {stage.layer}, {stage.kind}, {stage.direction}) "
                            f"failed: {type(e).__name__}: {e}"
                        ) from e
                del args
                for v, o in zip(stage.outputs, outs):
                    store[v] = o
                    state.stream_of[v] = stream or "comp"
                for v in self._free_after.get(node, ()):
                    store.pop(v, None)
            elif node.op == "call_function" and streams_:
                name, stream = node.args
                if node.target is program_ops.record_event:
                    ev = torch.cuda.Event()
                    ev.record(streams_[stream])
                    state.events[name] = ev
                elif node.target is program_ops.wait_event:
                    streams_[stream].wait_event(state.events[name])


# ------------------------------------------------------------------ the backend


def _fallback(gm: torch.fx.GraphModule, reason: str):
    msg = f"fxoverlap backend: running this graph as plain eager-equivalent code: {reason}"
    log.warning(msg)
    warnings.warn(msg, FallbackWarning, stacklevel=2)
    return gm.forward


def _check_supported(gm: torch.fx.GraphModule, example_inputs) -> None:
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
    if len(vals) != 1 or not isinstance(vals[0], torch.fx.Node):
        raise _Unsupported(
            f"the graph returns {len(vals)} values; fxoverlap compiles a train step that returns one "
            f"scalar loss (a graph break leaves such pieces; see TORCH_LOGS=graph_breaks)"
        )
    ev = vals[0].meta.get("example_value")
    if not isinstance(ev, torch.Tensor) or ev.dim() != 0 or not ev.is_floating_point():
        what = f"a tensor of shape {list(ev.shape)}" if isinstance(ev, torch.Tensor) else type(ev).__name__
        raise _Unsupported(
            f"the graph returns {what}, not a scalar floating-point loss (a graph break leaves such "
            f"pieces; see TORCH_LOGS=graph_breaks)"
        )
    if not ev.requires_grad:
        raise _Unsupported("the loss does not require grad (nothing to train)")


def compile_step(
    gm: torch.fx.GraphModule, example_inputs, *, layer_container: str | None = None, overlap: bool = True,
    comm_stream_priority: int = -1,
) -> CompiledStep:
    """Build the :class:`CompiledStep` for a Dynamo graph; raises when it cannot."""
    _check_supported(gm, example_inputs)
    diff = {n.name for n, t in zip(gm.graph.find_nodes(op="placeholder"), example_inputs) if t.requires_grad}
    info = annotate_layers(gm, diff, layer_container)
    wrapper = _GraphStep(gm, example_inputs)
    plain = [example_inputs[i] for i in wrapper.plain_index]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tag's "no layers found" is reported below
        cap = capture(wrapper, plain)
        fields = {f.name for f in dataclasses.fields(cap)}
        layer_fields = {k: v for k, v in (("param_children", info.param_children), ("ffn_child", info.ffn_child))
                        if k in fields}
        cap = dataclasses.replace(
            cap, num_layers=info.num_layers,
            layer_names=[".".join(info.container + (n,)) for n in info.layer_names], **layer_fields,
        )
        tagged = tag(cap)
    stages = split(tagged, cap.num_layers)
    after: dict[str, str] = {}
    if overlap:
        stages, after = split_for_overlap(tagged, stages)
    order = _order(stages, after)
    program = streams(emit_program(order), order)
    if info.num_layers == 0:
        log.warning("fxoverlap backend: no decoder layers found in the graph; one stage per direction, no overlap")
    return CompiledStep(gm, cap, order, program, wrapper, comm_stream_priority)


def fxoverlap_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The ``"fxoverlap"`` torch.compile backend (see the module docstring).

    ``options``: ``layer_container`` (attribute path of the decoder layers),
    ``overlap`` (intra-microbatch overlap split, default True),
    ``comm_stream_priority`` (CUDA priority of the comm stream, default -1).
    """
    global _last
    if not torch.is_grad_enabled():
        log.info("fxoverlap backend: grad mode is off; running the graph as it is")
        return gm.forward
    try:
        step = compile_step(gm, example_inputs, **options)
    except _Unsupported as e:
        return _fallback(gm, str(e))
    except Exception as e:  # a pass could not handle the graph: never a wrong answer
        log.debug("fxoverlap backend: compile failed", exc_info=True)
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
