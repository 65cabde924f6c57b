"""Runtime: executes a program against per-microbatch value stores. It never rewrites graphs.

:class:`ProgramRunner` is shaped like ``torch.fx.Interpreter``: one method per
program node kind (:meth:`~ProgramRunner.call_stage`, :meth:`~ProgramRunner.record_event`,
:meth:`~ProgramRunner.wait_event`, :meth:`~ProgramRunner.free`,
:meth:`~ProgramRunner.output`, :meth:`~ProgramRunner.accumulate`,
:meth:`~ProgramRunner.mutate`, :meth:`~ProgramRunner.reduce_grads`,
:meth:`~ProgramRunner.finish_reduce`, :meth:`~ProgramRunner.unshard`,
:meth:`~ProgramRunner.wait_unshard`, :meth:`~ProgramRunner.reshard`). The node list is bound to those methods once, when
the runner is built, so a step costs one Python call per node. It owns the
streams (compute: the current stream; comm: its own), the events and the value
stores; everything else (which stream, what a node reads) comes from the
program's ``Step`` records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
import torch.fx
import torch.nn as nn

from fxoverlap import direct_ops
from fxoverlap.ir import program as program_ops
from fxoverlap.ir.meta import STEP_KEY
from fxoverlap.ir.capture import Capture, inner_value
from fxoverlap.ir.errors import FxOverlapError, InternalError
from fxoverlap.ir.program import Step, bucket_value
from fxoverlap.ir.stage import Direction, Part, Stage, StageKind, StreamKind
from fxoverlap.kernels.copy_labels import GRAPH_GRADIENT, GRAPH_OUTPUT, copy_label

# A hook wraps every stage call: hook(node, stage, run) must call run() (which
# runs the stage on its inputs, on its stream) and return its outputs.
StageHook = Callable[[torch.fx.Node, Stage, Callable[[], Sequence]], Sequence]
# Where gradients go: sink(value name, gradient, is_graph_memory).
GradSink = Callable[[str, torch.Tensor, bool], None]


class LayoutMismatch(FxOverlapError, RuntimeError):
    """A value reached an Inductor-compiled stage in another layout than the one the stage was
    compiled for (the boundary layout contract of ``passes/inductor.py``); names the value,
    its producer and the consumer. Raised by the debug check (``FXOVERLAP_CHECK_LAYOUTS=1``)."""


# FXOVERLAP_CHECK_LAYOUTS=1: check every input of an Inductor-compiled stage against the layout
# it was compiled for, before the call (passes/inductor.py, "Layout contract at stage boundaries").
CHECK_LAYOUTS_ENV = "FXOVERLAP_CHECK_LAYOUTS"


_NO_STREAM = contextlib.nullcontext()  # reusable: no state between uses

# A stage runs under no_grad, so autograd's kernels only pass each op on (a custom op's
# Python autograd kernel checks the inputs and redispatches past autograd itself: several
# Python frames per call). A stage's ops dispatch past autograd directly, as a custom op's
# own no-grad path does; views and version counters (ADInplaceOrView) are kept.
_BelowAutograd = torch._C._AutoDispatchBelowAutograd
_NOTHING = _NO_STREAM  # a run that enters no guard around its nodes


def direct_calls_allowed() -> bool:
    """Whether a stage may run its direct copy now (:mod:`fxoverlap.direct_ops`): no torch
    dispatch or function mode (the op must reach it), no profiler (the op's range) and no
    Dynamo frame callback (the op's ``disable`` wrapper keeps Dynamo off its kernel)."""
    cb = torch._C._dynamo.eval_frame.get_eval_frame_callback()
    return ((cb is None or cb is False) and not torch._C._len_torch_dispatch_stack()
            and not torch._C._is_torch_function_mode_enabled() and not torch._C._autograd._profiler_enabled())


def check_layouts_requested() -> bool:
    """Whether ``FXOVERLAP_CHECK_LAYOUTS`` asks for the layout debug check (any value but ``""``/``0``)."""
    return os.environ.get(CHECK_LAYOUTS_ENV, "") not in ("", "0")


class LayoutCheck:
    """The debug check of the boundary layout contract: before an Inductor-compiled stage runs,
    each tensor input must have the sizes and strides of the placeholder value the stage was
    compiled for, symbols bound from the call's own input sizes (a stride of a dimension of
    size 1 or less is not compared, as Inductor's own input assert does not)."""

    def __init__(self, stages: Sequence[Stage], capture: Capture):
        self.producer: dict[str, str] = {}
        for ph, fqn in capture.param_placeholders.items():
            self.producer[ph] = f"parameter {fqn}"
        for ph, fqn in capture.buffer_placeholders.items():
            self.producer[ph] = f"buffer {fqn}"
        for ph in capture.input_placeholders:
            self.producer[ph] = "the step's input"
        for ph in capture.tangents:
            self.producer[ph] = "the loss's tangent"
        for st in stages:
            for o in st.outputs:
                self.producer[o] = f"stage {st.name} ({st.runs_as})"
        self.vals: dict[str, list] = {
            st.name: [n.meta.get("val") for n in st.graph_module.graph.find_nodes(op="placeholder")]
            for st in stages}

    def check(self, stage: Stage, args: Sequence, mb: int) -> None:
        if stage.compiled is None:  # eager stages take any layout; a graph replay copies its inputs
            return
        vals = self.vals[stage.name]
        bind: dict = {}
        for v, a in zip(vals, args):
            if isinstance(v, torch.Tensor) and isinstance(a, torch.Tensor) and v.dim() == a.dim():
                for d, n in zip(v.shape, a.shape):
                    if isinstance(d, torch.SymInt) and getattr(d.node.expr, "is_Symbol", False):
                        bind[d.node.expr] = n
            elif isinstance(v, torch.SymInt) and isinstance(a, int) and getattr(v.node.expr, "is_Symbol", False):
                bind[v.node.expr] = a
        for name, v, a in zip(stage.inputs, vals, args):
            if not (isinstance(v, torch.Tensor) and isinstance(a, torch.Tensor)):
                continue
            want_size = [_value(d, bind) for d in v.shape]
            want_stride = [_value(d, bind) for d in v.stride()]
            bad = a.dim() != v.dim() or any(w is not None and w != g for w, g in zip(want_size, a.shape))
            bad = bad or any(w is not None and n > 1 and w != g for w, g, n in zip(want_stride, a.stride(), a.shape))
            if bad:
                raise LayoutMismatch(
                    f"layout check: value {name} from {self.producer.get(name, 'an unknown producer')} reaches "
                    f"stage {stage.name} (layer {stage.layer}, {stage.kind}, {stage.direction}; Inductor) on "
                    f"microbatch {mb} with sizes {tuple(a.shape)} strides {a.stride()}, but the stage was compiled "
                    f"for sizes {tuple(v.shape)} strides {tuple(v.stride())} (the traced layout). The producer broke "
                    f"the boundary layout contract (passes/inductor.py): an Inductor stage should keep its traced "
                    f"output strides, an eager stage's op its meta strides; run with OverlapConfig(compiler='eager') "
                    f"to avoid it, and report it")


def _value(d, bind: dict) -> int | None:
    """A traced size or stride at run time: an int, a symbol expression evaluated with ``bind``,
    or None where a symbol in it is not bound by the inputs."""
    if isinstance(d, int):
        return d
    expr = d.node.expr
    expr = expr.xreplace(bind) if hasattr(expr, "xreplace") else expr
    return int(expr) if isinstance(expr, int) or getattr(expr, "is_number", False) else None


class StageFailed(FxOverlapError, RuntimeError):
    """A stage raised while the program ran; names the stage and microbatch."""

    @classmethod
    def of(cls, stage: Stage, microbatch: int, exc: BaseException) -> StageFailed:
        return cls(f"stage {stage.name} (layer {stage.layer}, {stage.kind}, {stage.direction}) failed on "
                   f"microbatch {microbatch}: {type(exc).__name__}: {exc}")


class NamedTensors(NamedTuple):
    """A model's parameters and buffers by name (``named_parameters`` / ``named_buffers`` with
    ``remove_duplicate=False``), as one call found them: looked up once per call (the engine's
    ``program_key.model_state``) and read by everything in that call."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]

    @classmethod
    def of(cls, model: nn.Module | NamedTensors) -> NamedTensors:
        """``model``'s parameters and buffers now (``model`` itself when it is one already)."""
        if isinstance(model, NamedTensors):
            return model
        return cls(dict(model.named_parameters(remove_duplicate=False)),
                   dict(model.named_buffers(remove_duplicate=False)))


def static_values(capture: Capture, model: nn.Module | NamedTensors) -> dict[str, torch.Tensor]:
    """Parameters and buffers of ``model`` (or of the call's :class:`NamedTensors`) under their
    placeholder names (a tensor subclass's flattened parts under theirs)."""
    params, buffers = NamedTensors.of(model)
    out = {ph: params[fqn] for ph, fqn in capture.param_placeholders.items()}
    out.update({ph: buffers[fqn] for ph, fqn in capture.buffer_placeholders.items()})
    for ph, (fqn, path) in capture.subclass_placeholders.items():
        out[ph] = inner_value(params[fqn] if fqn in params else buffers[fqn], path)
    return out


def accumulate_into(model: nn.Module | NamedTensors, capture: Capture, post_hooks: bool = True,
                    held: dict[str, torch.Tensor] | None = None, sharded: frozenset[str] = frozenset()) -> GradSink:
    """A :data:`GradSink` that adds into ``p.grad`` as eager's AccumulateGrad does, with the
    parameters ``model`` has now (looked up by name: make one per run; or the call's
    :class:`NamedTensors`).

    As in eager, each microbatch's gradient first goes through the parameter's tensor hooks
    (``p.register_hook``; a hook's return value replaces it), and after it is added the
    post-accumulate-grad hooks run (``p.register_post_accumulate_grad_hook``; ``post_hooks=False``
    leaves them to the caller: with data parallelism they run once the reduced gradient is final).

    ``held`` (ZeRO-3's :attr:`~fxoverlap.param_shard.ParamSharding.held`): the local gradients of
    the ``sharded`` parameters (their ``p.grad`` is a DTensor shard the reduction fills) are
    summed there instead, by parameter name, with no hooks.

    A tensor-subclass parameter's gradient arrives as parts; once a microbatch's
    parts are all in, they are wrapped into the subclass the traced backward
    produced (for a DTensor: its mesh and placements, which may differ from the
    parameter's) and accumulated as that."""
    params, buffers = NamedTensors.of(model)
    by_value = {v: (params[fqn], capture.grad_parts.get(v)) for v, fqn in capture.grads.items()}
    n_parts = {fqn: sum(1 for v, f in capture.grads.items() if f == fqn and v in capture.grad_parts)
               for fqn in capture.grad_layouts}
    pending: dict[str, dict[tuple[str, ...], torch.Tensor]] = {}

    def add(p: nn.Parameter, g: torch.Tensor) -> None:
        if hooks := p._backward_hooks:
            for hook in hooks.values():
                if (new := hook(g)) is not None:
                    g = new
        grad = p.grad
        if grad is None:
            p.grad = g
        else:
            grad.add_(g)
        if post_hooks and (hooks := getattr(p, "_post_accumulate_grad_hooks", None)):
            for hook in hooks.values():
                hook(p)

    def sink(name: str, g: torch.Tensor, graph_memory: bool) -> None:
        if sharded and (fqn := capture.grads[name]) in sharded:
            held[fqn] = g.detach() if fqn not in held else held[fqn].add_(g)
            return
        p, path = by_value[name]
        # graph memory is overwritten at the next replay: p.grad must not alias it (nor p). Where
        # p.grad exists and no hook sees g, add() reads g once, in stream order before any replay:
        # no copy needed (the clone would only be added and dropped)
        in_place = path is None and p.grad is not None and not p._backward_hooks
        if (graph_memory and not in_place) or g.data_ptr() == (p if path is None else inner_value(p, path)).data_ptr():
            with copy_label(GRAPH_GRADIENT):
                g = g.detach().clone()
        if path is None:
            add(p, g.detach())
            return
        fqn = capture.grads[name]
        parts = pending.setdefault(fqn, {})
        parts[path] = g.detach()
        if len(parts) == n_parts[fqn]:
            del pending[fqn]
            add(p, capture.grad_layouts[fqn].rebuild(lambda leaf: parts[leaf] if leaf in parts else opaque(fqn, leaf)))

    def opaque(fqn: str, leaf: tuple[str, ...]):
        """An opaque part of a gradient (a DTensor's mesh): the input part the graph passes through."""
        owner, path = capture.subclass_placeholders[capture.grad_opaque[(fqn, leaf)]]
        return inner_value(params[owner] if owner in params else buffers[owner], path)

    return sink


def run_post_accumulate_hooks(model: nn.Module | NamedTensors, capture: Capture) -> None:
    """Run each parameter's post-accumulate-grad hooks once, for the parameters the capture
    computes gradients of (after a step's reduction has made their ``.grad`` final)."""
    params = NamedTensors.of(model).params
    for fqn in dict.fromkeys(capture.grads.values()):
        p = params[fqn]
        for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(p)


@dataclasses.dataclass
class RunState:
    """One run of a program: the value stores and what the run handed out."""

    stores: list[dict]
    outputs: list[dict[str, torch.Tensor]]
    events: dict = dataclasses.field(default_factory=dict)
    graph_owned: set = dataclasses.field(default_factory=set)  # (mb, value): CUDA-graph memory
    memory_trace: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    static_keys: frozenset = frozenset()
    grads: GradSink | None = None  # where this run's gradients go (None: the runner's own sink)


class _Run(NamedTuple):
    """A span's nodes as one launch mode runs them (:meth:`ProgramRunner._nodes`), and whether
    the run may enter the below-autograd guard once around them: where the gradients are
    handed out as outputs (no sink), and where a sink takes them."""

    nodes: list[tuple[Callable, tuple]]
    below: bool
    below_with_sink: bool


class ProgramRunner:
    """Walks a program: stage calls, events, frees, outputs, gradients, buffer updates.

    On CPU streams and events are no-ops and the program runs in its order.
    ``hook`` wraps every stage call (timing, profiling); ``cuda_graphs`` (a
    :class:`fxoverlap.cudagraphs.StageGraphs`) runs the stages the ``cudagraph``
    pass chose; ``record_memory`` keeps a trace of the live bytes of the stores;
    ``reducer`` (a :class:`fxoverlap.grad_reduce.BucketReducer`) runs the gradient
    reductions that ``passes/reduce.py`` placed; ``check_layouts`` (default: the
    ``FXOVERLAP_CHECK_LAYOUTS`` environment variable) checks each input of an Inductor stage
    against the layout it was compiled for (:class:`LayoutCheck`); ``sm_carveout`` SMs are left free by the
    experts stages' grouped GEMMs (``OverlapConfig.sm_carveout``) in a run whose exchanges run
    comm kernels (``comm_kernels_run()``, asked at each run); ``sharding`` (a
    :class:`fxoverlap.param_shard.ParamSharding`) gathers and drops the parameter units that
    ``passes/shard.py`` placed (their placeholders are then never in the stores outside a use).
    """

    def __init__(
        self,
        program: torch.fx.GraphModule,
        stages: Sequence[Stage],
        capture: Capture,
        device: torch.device,
        *,
        grads: GradSink | None = None,  # None: gradients are handed out with the outputs
        comm_stream_priority: int = -1,
        sm_carveout: int | None = None,
        comm_kernels_run: Callable[[], bool] = lambda: True,
        cuda_graphs=None,
        record_memory: bool = False,
        hook: StageHook | None = None,
        reducer=None,
        sharding=None,
        check_layouts: bool | None = None,  # None: FXOVERLAP_CHECK_LAYOUTS decides
    ):
        self.program, self.capture, self.device = program, capture, device
        self.stages = {s.name: s for s in stages}
        self.grads = grads
        self.cuda_graphs = cuda_graphs
        # what messages call a value (the backend names its parameters' gradients by its graph's inputs)
        self.value_names: dict[str, str] = {}
        self.record_memory = record_memory
        self.hook = hook
        self.reducer = reducer
        self.sharding = sharding
        if check_layouts is None:
            check_layouts = check_layouts_requested()
        self.layouts = LayoutCheck(stages, capture) if check_layouts else None
        self.sm_carveout = sm_carveout  # torch's setting only reaches CUDA kernels; harmless elsewhere
        self.comm_kernels_run = comm_kernels_run  # asked at each run: does its exchange run comm kernels?
        self._carveout: int | None = None  # this run's (execute)
        self._comp_current = False  # execute: the compute stream is the current one (on our device)
        self._direct = False  # execute: eager stages may run their direct copies (direct_calls_allowed)
        self._below = False  # execute: the run's nodes run past autograd's dispatch already
        self._state: RunState | None = None
        self._on_error: Callable | None = None
        self.streams: dict[StreamKind, object] = {}
        if device.type == "cuda":
            self.streams = {
                StreamKind.COMP: torch.cuda.current_stream(device),
                StreamKind.COMM: torch.cuda.Stream(device, priority=comm_stream_priority),
            }
        self._bind()

    # ---------------------------------------------------------------- binding
    def _bind(self) -> None:
        """Bind each node to the method that runs it, with what it needs precomputed."""
        methods = {
            program_ops.record_event: self.record_event, program_ops.wait_event: self.wait_event,
            program_ops.free: self.free, program_ops.output: self.output,
            program_ops.accumulate: self.accumulate, program_ops.mutate: self.mutate,
            program_ops.reduce_grads: self.reduce_grads, program_ops.finish_reduce: self.finish_reduce,
            program_ops.unshard: self.unshard, program_ops.wait_unshard: self.wait_unshard,
            program_ops.reshard: self.reshard,
        }
        self._bound: list[tuple[Callable, tuple]] = []
        self._traced: list[tuple[str, int] | None] = []  # (node, microbatch) whose live bytes record_memory traces
        self.backward_start: int | None = None  # index of the first node of the backward part
        for node in self.program.graph.nodes:
            step: Step | None = node.meta.get(STEP_KEY)
            if node.op == "call_module":
                stage = self.stages[step.stage]
                mb = step.microbatch
                cross = step.cross  # decided by the streams pass
                if stage.direction is Direction.BWD and self.backward_start is None:
                    self.backward_start = len(self._bound)
                    while self.backward_start and self._bound[self.backward_start - 1][0] == self.wait_event:
                        self.backward_start -= 1  # waits that precede the first backward stage go with it
                # what the launch reads, fixed once: the value names, the stream, the carveout's kind
                self._bound.append((self.call_stage, (node, stage, mb, cross, tuple(stage.inputs),
                                                      tuple(stage.outputs), stage.stream,
                                                      stage.kind is StageKind.EXPERTS)))
                self._traced.append((node.name, mb))
            elif node.op == "call_function":
                if node.target not in methods:
                    raise InternalError(f"runtime: program node {node.name} calls {node.target}, which is "
                                         f"not a program op")
                if node.target is program_ops.reduce_grads and self.reducer is None:
                    raise InternalError(f"runtime: program node {node.name} reduces gradients, but the "
                                         f"runner has no reducer (ProgramRunner(reducer=...))")
                if node.target is program_ops.unshard and self.sharding is None:
                    raise InternalError(f"runtime: program node {node.name} gathers parameters, but the "
                                         f"runner has no sharding (ProgramRunner(sharding=...))")
                # a marker with a Step runs what its Step says (its args are derived from it)
                step_args = program_ops.marker_args(node.target, step) if step is not None else node.args
                self._bound.append((methods[node.target], step_args))
                self._traced.append((node.name, node.args[0]) if node.target is program_ops.free else None)
        # ZeRO-3: each unit's parameters by placeholder name (the stores hold them during its uses only)
        placeholder = {fqn: ph for ph, fqn in self.capture.param_placeholders.items()}
        units = program_ops.program_of(self.program).units
        # (a tied parameter: each of its names' placeholders gets the one gathered tensor)
        self._unit_names = [[(p.fqn, placeholder[name]) for p in u.params for name in p.names] for u in units]
        self._sharded = frozenset(ph for names in self._unit_names for _, ph in names)
        # ZeRO-3's DTensors read in place (experts no other rank holds): the program takes their local tensor
        local = () if self.sharding is None else self.sharding.local_only
        self._in_place = frozenset(ph for ph, fqn in self.capture.param_placeholders.items() if fqn in local)
        self.weight_start = self._weight_start()
        # the named parts of the program, for execute and turns (fixed once the nodes are bound)
        end = len(self._bound)
        split = end if self.backward_start is None else self.backward_start
        weight = max(split, self.weight_start)
        self._spans: dict[str, tuple[int, int]] = {
            "all": (0, end), "forward": (0, split), "backward": (split, end),
            "input_grads": (split, weight), "weight_grads": (weight, end)}
        # per span and launch mode, the nodes as a run executes them (_nodes)
        self._runs: dict[tuple, _Run] = {}
        # the tangents' seeds (default: ones, as loss.backward() seeds), by shape and dtype
        self._seeds = [(ph, node.meta["val"]) for ph in self.capture.tangents
                       for node in self.capture.graph_module.graph.find_nodes(op="placeholder", target=ph)[:1]]

    def _weight_start(self) -> int:
        """Where the backward's trailing weight-gradient part begins (a program scheduled with
        ``weight_last``): its first ``WGRAD`` stage after the last other stage, with the waits
        before it; the end of the program where there is none."""
        calls = [(i, args[1]) for i, (fn, args) in enumerate(self._bound) if fn == self.call_stage]
        start = len(self._bound)
        for i, stage in reversed(calls):
            if stage.part is not Part.WGRAD or stage.direction is not Direction.BWD:
                break
            start = i
        while start < len(self._bound) and start and self._bound[start - 1][0] == self.wait_event:
            start -= 1
        return start

    def _ctx(self, stream: StreamKind):
        """The context that makes ``stream`` current: none where it is current already (the
        compute stream is the caller's current one, on this runner's device, during
        :meth:`execute`), so only comm-stream work switches streams."""
        if not self._switches(stream):
            return _NO_STREAM
        return torch.cuda.stream(self.streams[stream])

    def _switches(self, stream: StreamKind) -> bool:
        """Whether a launch on ``stream`` makes another stream current (:meth:`_ctx`)."""
        return bool(self.streams) and not (stream is StreamKind.COMP and self._comp_current)

    def _nodes(self, lo: int, hi: int) -> _Run:
        """The nodes of span ``(lo, hi)`` as this run executes them, built once per span and
        launch mode: without streams the event nodes are no-ops, left out (the spans keep
        their indices); a stage launch that needs none of :meth:`call_stage`'s extras in this
        run (no hook, layout check, carveout, stream switch or cross-stream record, and no CUDA
        graph of its own) is bound to :meth:`call_plain`, which does the same with less host
        work per launch; the frees of a microbatch that follow a launch or a free of it are
        done by that call; and each eager stage's launch carries its direct copy
        (:mod:`fxoverlap.direct_ops`, None where it has none), which :meth:`execute` allows or
        not per run."""
        plain = self.hook is None and self.layouts is None
        mode = (lo, hi, plain, self.cuda_graphs is None, self._carveout is None, self._comp_current)
        run = self._runs.get(mode)
        if run is None:
            run = self._runs[mode] = self._build_run(lo, hi, plain)
        return run

    def _build_run(self, lo: int, hi: int, plain: bool) -> _Run:
        noop = () if self.streams else (self.record_event, self.wait_event)
        nodes: list[tuple[Callable, tuple]] = []
        for fn, args in self._bound[lo:hi]:
            if fn in noop:
                continue
            if fn == self.free and nodes and nodes[-1][0] in (self._free_run, self.call_plain) and nodes[-1][1][1] == args[0]:
                # the same pops, in the same order, right after the launch (or free) before them
                last, last_args = nodes[-1]
                nodes[-1] = (last, (*last_args[:-1], last_args[-1] + args[1:]))
                continue
            if fn == self.call_stage:
                node, stage, mb, cross, inputs, outputs, stream, experts = args
                direct = direct_ops.direct_module(stage.graph_module) if stage.compiled is None else None
                switch = self._switches(stream)
                graphed = stage.graphed and self.cuda_graphs is not None
                if (plain and not switch and not graphed and not (cross and self.streams)
                        and not (experts and self._carveout is not None)):
                    nodes.append((self.call_plain, (stage, mb, inputs, outputs, direct, ())))
                    continue
                nodes.append((fn, (*args, direct)))
                continue
            if fn == self.free:  # (None, mb, values): the shape call_plain's arguments end in
                nodes.append((self._free_run, (None, args[0], args[1:])))
                continue
            nodes.append((fn, args))
        # Which runs may enter the below-autograd guard once, around all their nodes, rather
        # than once per launch: those of launches that would enter it themselves (no hook,
        # layout check, CUDA graphs or carveout), frees, events and outputs (a detach or a
        # clone of a value that needs no gradient: the same tensor below autograd), and
        # gradient hand-outs where they are outputs (no sink: a sink's code is not ours).
        bare = plain and self.cuda_graphs is None and self._carveout is None
        ok = {self.call_plain, self._free_run, self.output, self.record_event, self.wait_event}
        if bare:
            ok.add(self.call_stage)
        fns = {fn for fn, _ in nodes}
        below = fns <= ok | {self.accumulate}
        return _Run(nodes, below, below and self.accumulate not in fns)

    # ---------------------------------------------------------------- running
    def start(self, static: dict[str, torch.Tensor], microbatches: Sequence[Sequence[torch.Tensor]],
              tangents: Sequence[Sequence[torch.Tensor]] | None = None, grads: GradSink | None = None,
              params: dict[str, torch.Tensor] | None = None) -> RunState:
        """Value stores for a run: shared parameters and buffers, each microbatch's inputs,
        and its tangents (default: ones for a scalar loss, as ``loss.backward()`` seeds).
        ``grads``: where this run's gradients go, in place of the runner's sink (the engine
        makes one per call from the model's current parameters); ``params``: the call's
        parameters by name (:class:`NamedTensors`), for the reduction's ``begin`` (None: it
        looks them up itself)."""
        cap = self.capture
        if self._sharded or self._in_place:  # the gathers put them in (DTensor shards are no stage's input)
            static = {k: (v._local_tensor if k in self._in_place else v) for k, v in static.items()
                      if k not in self._sharded}
        stores = []
        for i, mb in enumerate(microbatches):
            store = dict(static)
            store.update(cap.bind_inputs(mb))
            if tangents is not None:
                store.update(zip(cap.tangents, tangents[i]))
            else:
                for ph, val in self._seeds:
                    store[ph] = torch.ones(val.shape, dtype=val.dtype, device=self.device)
            stores.append(store)
        state = RunState(stores, [{} for _ in microbatches], grads=grads if grads is not None else self.grads)
        if self.cuda_graphs is not None:
            self.cuda_graphs.use_statics(static)  # read in place by the graphs (which follow them if they moved)
        if self.sharding is not None:
            self.sharding.begin(params)
        if self.reducer is not None:
            # what p.grad holds now is already reduced: set it aside, so only this run's gradients
            # are reduced (the averages are added into it at the finish nodes)
            self.reducer.begin(params)
        if self.record_memory:
            state.static_keys = static_storage_keys(static)
        return state

    def set_tangents(self, state: RunState, microbatch: int, tangents: Sequence[torch.Tensor]) -> None:
        state.stores[microbatch].update(zip(self.capture.tangents, tangents))

    def has_weight_part(self) -> bool:
        """Whether the backward ends in a weight-gradient part (``"weight_grads"`` is not empty)."""
        return self.backward_start is not None and self.weight_start < len(self._bound)

    def execute(self, state: RunState, part: str | tuple[int, int] = "all", on_error: Callable | None = None) -> None:
        """Run ``"all"`` of the program, its ``"forward"`` / ``"backward"`` part (one
        microbatch, as the torch.compile backend runs it from an autograd.Function), the
        backward's ``"input_grads"`` then ``"weight_grads"`` part (a program scheduled with
        ``weight_last``: a ZeroBubble schedule's B and W), or the span ``(lo, hi)`` of it
        that one of :meth:`grad_segments` names."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.reclaim()  # before any replay: the gradients lent by the last run
        split = self._spans["backward"][0]
        lo, hi = self._spans[part] if isinstance(part, str) else part
        self._on_error = on_error
        if self.streams:
            # the compute stream is the caller's current one (autograd may run a backward
            # on another stream than the forward's)
            self.streams[StreamKind.COMP] = torch.cuda.current_stream(self.device)
            # (another current device: each launch makes the stream, and with it the device, current)
            self._comp_current = self.device.index is None or torch.cuda.current_device() == self.device.index
            if part in ("backward", "input_grads") or (not isinstance(part, str) and lo == split):
                # the backward starts: its comm work follows what came before it
                self.streams[StreamKind.COMM].wait_stream(self.streams[StreamKind.COMP])
        self._state = state
        # no comm kernel runs beside the experts (one rank, no emulated link): nothing to leave SMs to.
        # (A CUDA-graphed experts stage keeps the carveout of the run that captured it.)
        # (asked only where there is a carveout to set: the question resolves the EP groups)
        self._carveout = self.sm_carveout if self.sm_carveout is not None and self.comm_kernels_run() else None
        # eager stages call fxoverlap's custom ops' kernels directly unless something must see the ops
        # (asked once per run: nothing a stage runs enters a mode, a profiler or a Dynamo callback)
        self._direct = self.layouts is None and direct_calls_allowed()
        grad = torch.is_grad_enabled()
        try:
            # the stages run exactly as traced: autocast's casts are in their graphs already, and
            # an ambient autocast would cast their ops again (AOTAutograd's runtime does the same)
            # (grad mode set directly: torch.no_grad() is two Python objects per call)
            torch._C._set_grad_enabled(False)
            with torch._C._DisableAutocast():
                if not self.record_memory:
                    run = self._nodes(lo, hi)
                    self._below = run.below if state.grads is None else run.below_with_sink
                    # one below-autograd guard for the run where its launches would each enter it
                    with _BelowAutograd() if self._below else _NOTHING:
                        for fn, args in run.nodes:
                            fn(*args)
                else:
                    for (fn, args), traced in zip(self._bound[lo:hi], self._traced[lo:hi]):
                        fn(*args)
                        if traced is not None:
                            state.memory_trace.append((*traced, live_bytes(state.stores, state.static_keys)))
        finally:
            torch._C._set_grad_enabled(grad)
            self._state = None
            self._comp_current = False
            self._direct = self._below = False
        if self.streams and part == "forward":
            self.streams[StreamKind.COMP].wait_stream(self.streams[StreamKind.COMM])
        if part != "forward" and hi == len(self._bound) and self.record_memory:
            state.memory_trace.append(("end", -1, live_bytes(state.stores, state.static_keys)))

    def turns(self, part: str) -> list[tuple[int, int]]:
        """The ``"forward"``, ``"backward"`` or ``"input_grads"`` part cut right after each call
        of a stage on the comm stream: spans for :meth:`execute`. Running two programs' chunks
        in turns (a merged F(i) ⊗ B(j) step of pipeline parallelism) puts each one's compute
        under the other's communication."""
        lo, hi = self._spans[part]
        out, start = [], lo
        for i in range(lo, hi):
            fn, args = self._bound[i]
            if fn == self.call_stage and args[1].stream is StreamKind.COMM:
                out.append((start, i + 1))
                start = i + 1
        if start < hi or not out:
            out.append((start, hi))
        return out

    def grad_segments(self) -> list[tuple[tuple[int, int], tuple[str, ...]]]:
        """The backward part cut right after each node that hands out gradients: per
        segment, its span for :meth:`execute` and the gradient values it hands out. A
        caller that returns gradients to autograd segment by segment lets autograd
        accumulate (and free) them as the backward goes, not all at its end."""
        split = self._spans["backward"][0]
        out, lo = [], split
        for i in range(split, len(self._bound)):
            fn, args = self._bound[i]
            if fn == self.accumulate:
                out.append(((lo, i + 1), tuple(args[1:])))
                lo = i + 1
        if not out:
            return [((split, len(self._bound)), ())]
        (start, _), values = out[-1]  # what follows the last hand-out (frees, events) closes it
        out[-1] = ((start, len(self._bound)), values)
        return out

    def run(self, static: dict[str, torch.Tensor], microbatches: Sequence[Sequence[torch.Tensor]],
            on_error: Callable | None = None, grads: GradSink | None = None,
            params: dict[str, torch.Tensor] | None = None) -> RunState:
        """The whole program over ``microbatches``; the state holds each one's outputs
        (``grads``, ``params``: as :meth:`start` takes them)."""
        state = self.start(static, microbatches, grads=grads, params=params)
        try:
            self.execute(state, "all", on_error)
        except BaseException:
            if self.reducer is not None:
                self.reducer.abandon()  # p.grad as the call found it, not half a call's local gradients
            raise
        return state

    # ---------------------------------------------------------------- node kinds
    def call_stage(self, node: torch.fx.Node, stage: Stage, mb: int, cross: tuple[int, ...],
                   inputs: tuple[str, ...], outputs: tuple[str, ...], stream: StreamKind, experts: bool,
                   direct: torch.fx.GraphModule | None = None) -> None:
        """Launch ``stage`` on microbatch ``mb`` (``inputs`` / ``outputs``: its value names;
        ``stream``: its stream; ``experts``: its grouped GEMMs take the SM carveout; ``direct``:
        its graph's direct copy, :meth:`_code`), all fixed when the node was bound. The common
        launch (no hook, no CUDA graphs, no carveout, no layout check) calls the stage's code
        itself, with no wrapper around it."""
        state = self._state
        store = state.stores[mb]
        graphed = False
        with self._ctx(stream):
            args = [store[v] for v in inputs]
            if cross and self.streams:
                on = self.streams[stream]
                for i in cross:
                    # allocated on the other stream: keep its block from being reused there
                    # until this stream is done with it
                    if isinstance(args[i], torch.Tensor):
                        args[i].record_stream(on)
            # the experts' grouped GEMMs (persistent kernels, one block per SM) leave the comm
            # kernels their SMs; the others use every SM (docs/design.md, "SM carveout")
            carve = self._carveout if experts else None
            try:
                if self.layouts is not None:
                    self.layouts.check(stage, args, mb)
                if carve is None and self.hook is None and self.cuda_graphs is None:
                    if self._below:  # the run entered the guard
                        outs = self._code(stage, direct)(*args)
                    else:
                        with _BelowAutograd():
                            outs = self._code(stage, direct)(*args)
                else:
                    outs, graphed = self._launch(node, stage, args, carve, direct)
            except Exception as e:
                if self._on_error is not None:
                    self._on_error(e)
                if isinstance(e, LayoutMismatch):  # names the stage already
                    raise
                raise StageFailed.of(stage, mb, e) from e
        store.update(zip(outputs, outs))
        if graphed:
            state.graph_owned.update((mb, v) for v in outputs)

    def call_plain(self, stage: Stage, mb: int, inputs: tuple[str, ...], outputs: tuple[str, ...],
                   direct: torch.fx.GraphModule | None, drop: tuple[str, ...]) -> None:
        """:meth:`call_stage` where its launch needs nothing around the stage (chosen per run by
        :meth:`_nodes`): the stage's code (:meth:`_code`, inlined) called directly, its failure
        reported as :meth:`call_stage` does; then the :meth:`free` of ``drop``, the values the
        program frees right after it. A run with CUDA graphs notes the reads of graph memory,
        as :meth:`_launch` does."""
        store = self._state.stores[mb]
        args = [store[v] for v in inputs]
        try:
            code = stage.compiled  # read at each call: a test may swap it
            if code is None:
                code = direct.forward if direct is not None and self._direct else stage.graph_module.forward
            if self._below:  # the run entered the guard
                outs = code(*args)
            else:
                with _BelowAutograd():
                    outs = code(*args)
            if self.cuda_graphs is not None:
                self.cuda_graphs.note_reads(args)
        except Exception as e:
            if self._on_error is not None:
                self._on_error(e)
            raise StageFailed.of(stage, mb, e) from e
        store.update(zip(outputs, outs))
        for v in drop:
            store.pop(v, None)

    def _free_run(self, _stage: None, mb: int, values: tuple[str, ...]) -> None:
        """:meth:`free` as :meth:`_nodes` binds it (its arguments shaped as :meth:`call_plain`'s end)."""
        store = self._state.stores[mb]
        for v in values:
            store.pop(v, None)

    def _code(self, stage: Stage, direct: torch.fx.GraphModule | None) -> Callable:
        """What runs ``stage`` (as :meth:`Stage.__call__` picks, ``compiled`` read at each call: a
        test may swap it): its compiled callable, else its graph's direct copy (``direct``:
        fxoverlap's custom ops called past the dispatcher, :mod:`fxoverlap.direct_ops`) where
        this run allows it, else its graph's ``forward`` (directly: a stage module is ours and
        has no hooks, so ``nn.Module.__call__`` is host work only)."""
        compiled = stage.compiled
        if compiled is not None:
            return compiled
        return direct.forward if direct is not None and self._direct else stage.graph_module.forward

    def _launch(self, node: torch.fx.Node, stage: Stage, args: list, carve: int | None,
                direct: torch.fx.GraphModule | None = None) -> tuple[Sequence, bool]:
        """A launch through the hook, the CUDA graphs or the carveout: its outputs, and whether
        they are graph memory."""
        graphed = [False]

        def run() -> Sequence:  # the stage as this runner runs it: graphed or not
            if stage.graphed and self.cuda_graphs is not None:
                outs, graphed[0] = self.cuda_graphs.call(node, stage, args)
                return outs
            if self._below:
                return self._code(stage, direct)(*args)
            with _BelowAutograd():  # as call_stage's own launch: the stage's ops past autograd
                return self._code(stage, direct)(*args)

        # a hook (the benchmark's) wraps the call the step makes, graphs included
        with sm_carveout(carve):
            outs = run() if self.hook is None else self.hook(node, stage, run)
        if self.cuda_graphs is not None:
            self.cuda_graphs.note_reads(args)
        return outs, graphed[0]

    def record_event(self, name: str, stream: str) -> None:
        if self.streams:
            ev = torch.cuda.Event()
            ev.record(self.streams[StreamKind(stream)])
            self._state.events[name] = ev

    def wait_event(self, name: str, stream: str) -> None:
        if self.streams:
            self.streams[StreamKind(stream)].wait_event(self._state.events[name])

    def free(self, mb: int, *values: str) -> None:
        store = self._state.stores[mb]
        for v in values:
            store.pop(v, None)

    def output(self, mb: int, *values: str) -> None:
        state = self._state
        for v in values:
            t = state.stores[mb][v].detach()
            if (mb, v) in state.graph_owned:
                with copy_label(GRAPH_OUTPUT, v):
                    t = t.clone()
            state.outputs[mb][v] = t

    def accumulate(self, mb: int, *values: str) -> None:
        state = self._state
        if state.grads is None:  # no sink: gradients go to the caller, as outputs do
            graphs, store, out = self.cuda_graphs, state.stores[mb], state.outputs[mb]
            for v in values:
                if (mb, v) in state.graph_owned:  # copied only if the caller keeps it (cudagraphs.py)
                    out[v] = graphs.lend(store[v], self.value_names.get(v)
                                         or f"the gradient {v} of {self.capture.grads.get(v, v)}")
                else:
                    out[v] = store[v].detach()
            return
        for v in values:
            state.grads(v, state.stores[mb][v], (mb, v) in state.graph_owned)

    def mutate(self, mb: int, *values: str) -> None:
        store = self._state.stores[mb]
        for v in values:
            store[self.capture.mutations[v]].copy_(store[v])

    def reduce_grads(self, mb: int, bucket: int, *values: str) -> None:
        store = self._state.stores[mb]
        grads = [store[v] for v in values]
        with self._ctx(StreamKind.COMM):
            if self.streams:
                comm = self.streams[StreamKind.COMM]
                for g in grads:  # written on the compute stream: keep its block until read here
                    g.record_stream(comm)
            store[bucket_value(bucket)] = self.reducer.start(bucket, grads)

    def finish_reduce(self, mb: int, bucket: int) -> None:
        with self._ctx(StreamKind.COMP):
            self.reducer.finish(self._state.stores[mb][bucket_value(bucket)], self.streams.get(StreamKind.COMP))

    def unshard(self, unit: int) -> None:
        with self._ctx(StreamKind.COMP):  # packs the shards where the stages wrote them
            self.sharding.start_gather(unit)

    def wait_unshard(self, unit: int) -> None:
        with self._ctx(StreamKind.COMP):
            full = self.sharding.finish_gather(unit)
        values = [(ph, full[fqn]) for fqn, ph in self._unit_names[unit]]
        for store in self._state.stores:
            store.update(values)

    def reshard(self, unit: int) -> None:
        for store in self._state.stores:
            for _, ph in self._unit_names[unit]:
                store.pop(ph, None)
        self.sharding.dropped(unit)


@contextlib.contextmanager
def sm_carveout(sms: int | None) -> Iterator[None]:
    """Leave ``sms`` SMs free of the GEMMs inside (torch's process-wide SM carveout), and
    restore the setting after; ``None``, or a torch without the (experimental) setting: leave
    it as it is. torch warns once per process that the setting is experimental."""
    if sms is None or not hasattr(torch._C, "_set_sm_carveout_experimental"):
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


def storage_key(t: torch.Tensor) -> tuple:
    """What identifies ``t``'s memory: views of one storage share it."""
    return (t.device, t.untyped_storage().data_ptr())


def static_storage_keys(static: dict) -> frozenset:
    """Storages of the parameters and buffers (views of them, like ``w.t()``, share these)."""
    return frozenset(storage_key(v) for v in static.values() if isinstance(v, torch.Tensor))


def live_bytes(stores: Sequence[dict], static_keys: frozenset | dict) -> int:
    """Bytes of the tensors held by the microbatch value stores.

    Each underlying storage counts once (views and values shared between stores
    are deduplicated by device and storage pointer); storages of parameters and
    buffers (``static_keys``, or the dict of static values) are left out; values
    that are not tensors (SymInt sizes) count nothing.
    """
    if isinstance(static_keys, dict):
        static_keys = static_storage_keys(static_keys)
    seen_ids: set[int] = set()
    seen: set[tuple] = set(static_keys)
    total = 0
    for store in stores:
        for v in store.values():
            if not isinstance(v, torch.Tensor) or id(v) in seen_ids:
                continue
            seen_ids.add(id(v))
            key = storage_key(v)
            if key not in seen:
                seen.add(key)
                total += v.untyped_storage().nbytes()
    return total
