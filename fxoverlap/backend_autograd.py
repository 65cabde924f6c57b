"""The backend's autograd bridge: a Dynamo graph's compiled program as a callable whose forward
runs inside one ``torch.autograd.Function`` and whose backward runs in segments.

A :class:`CompiledStep`'s call runs the program's forward part inside :class:`_StepFunction`;
its backward seeds each output's incoming gradient as that output's tangent and runs the
backward part, in *segments*: the backward is cut where gradients are handed out (at least
``segment_min_grad_bytes`` of them per segment, :data:`SEGMENT_MIN_GRAD_BYTES` by default),
each later segment is a node of its own (:class:`_GradSegment`) in a chain autograd runs in
order, and each returns its gradients, so autograd's ``AccumulateGrad`` fills ``p.grad`` (hooks
included) as the backward goes, as in eager, rather than once a whole new set of gradients is
held at its end (AOTAutograd's way, which costs a model's worth of gradients under gradient
accumulation). Buffers (and inputs) the forward updates in place are updated right after the
stage that computes their new value. Outputs that are views of a graph input or of another
output (no tangent from AOTAutograd) are rebuilt from their base after the Function, as
AOTAutograd's runtime does (``fxoverlap/backend_outputs.py``).

Under ``torch.no_grad()`` a graph compiles to a :class:`CompiledForward` (the forward-only
program, no autograd). Pipeline parallelism drives a call's backward outside autograd
(:meth:`CompiledStep.backward_in_turns`, :meth:`CompiledStep.weight_grads`) and runs a forward
in turns with another call's backward through the step's :class:`Turns` (no module state).

Entry point: :func:`compile_step` (Dynamo graph -> capture -> stages -> ``compile_program``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.fx

from fxoverlap.backend_capture import GraphStep, capture_graph
from fxoverlap.backend_fallback import BackendUnsupported, graph_break_hint, has_all_to_all
from fxoverlap.backend_outputs import plan_outputs
from fxoverlap.compiled_program import CompiledProgram, ProgramSpec, compile_program
from fxoverlap.config import OverlapConfig
from fxoverlap.cudagraphs import GraphCache
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.stage import StreamKind, format_stage_table
from fxoverlap.pipeline import build_stages, make_runner

__all__ = ["SEGMENT_MIN_GRAD_BYTES", "BackendError", "CompiledForward", "CompiledStep", "StepRun", "Turns",
           "compile_step", "merge_segments"]

log = logging.getLogger("fxoverlap.backend")


class BackendError(FxOverlapError, RuntimeError):
    """A compiled step was used in a way it does not support (a second backward through one call)."""


class Turns:
    """A merged step's channel (pipeline parallelism), held by the compiled steps of one
    pipeline stage: :meth:`run` hands the next compiled forward another call's backward (a
    generator, :meth:`CompiledStep.backward_in_turns`) to run in turns with its own chunks."""

    def __init__(self) -> None:
        self.other: Iterator | None = None  # taken by the forward that runs
        self.left: Iterator | None = None  # what of it that forward left after its last chunk

    def take(self) -> Iterator | None:
        other, self.other = self.other, None
        return other

    def run(self, other: Iterator, forward: Callable, after_forward: Callable[[], None] | None = None):
        """Call ``forward()`` (which runs a compiled step's forward) with the generator ``other``
        run in turns with that forward's chunks; what of ``other`` is left after the forward's
        last chunk (or all of it, when ``forward`` compiled anew or ran no compiled step) runs
        once ``forward`` has returned and ``after_forward()`` has run: a pipeline stage hands
        the forward's outputs on there (its send) before the rest of ``other``. Returns
        ``forward()``'s result."""
        self.other, self.left = other, None
        try:
            out = forward()
        finally:
            left = self.other if self.other is not None else self.left
            self.other = self.left = None
        if after_forward is not None:
            after_forward()
        if left is not None:
            for _ in left:
                pass
        return out


class StepRun:
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
    def forward(ctx, run: StepRun, token: torch.Tensor | None, *args):
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
    def forward(ctx, run: StepRun, k: int, token: torch.Tensor, *inputs):
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
    """What :class:`CompiledStep` and :class:`CompiledForward` share: the one-microbatch
    :class:`~fxoverlap.compiled_program.CompiledProgram`, its CUDA graphs, where each placeholder
    comes from (a graph input index, a buffer), introspection."""

    def __init__(self, gm: torch.fx.GraphModule, compiled: CompiledProgram, wrapper: GraphStep, graphs: GraphCache):
        self.gm, self.compiled, self._graphs = gm, compiled, graphs
        self.capture, self.stages, self.program, self.runner = (compiled.capture, compiled.stages,
                                                                compiled.program, compiled.runner)
        capture_ = compiled.capture
        self.index_of = {f"in{i}": i for i in wrapper.diff_index}  # parameter fqn -> graph input index
        self._static_src = [(ph, self.index_of[fqn]) for ph, fqn in capture_.param_placeholders.items()]
        self._buffers = {ph: wrapper.get_buffer(fqn) for ph, fqn in capture_.buffer_placeholders.items()}
        self._input_src = list(wrapper.plain_index)
        names = [n.name for n in gm.graph.find_nodes(op="placeholder")]  # Dynamo's, from the sources
        self.runner.value_names.update(
            (v, f"the gradient of graph input {self.index_of[fqn]} ({names[self.index_of[fqn]]})")
            for v, fqn in capture_.grads.items() if fqn in self.index_of)

    @property
    def holds_graphs(self) -> bool:
        return self.runner.cuda_graphs is not None

    def _static(self, args) -> dict:
        """The static placeholders' values for one call (its parameters and the buffers)."""
        static = dict(self._buffers)
        static.update((ph, args[i]) for ph, i in self._static_src)
        return static

    def stage_table(self) -> str:
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

    def __init__(self, gm: torch.fx.GraphModule, compiled: CompiledProgram, wrapper: GraphStep, graphs: GraphCache,
                 config: OverlapConfig, device: torch.device, *, turns: Turns | None = None,
                 segment_min_grad_bytes: int = SEGMENT_MIN_GRAD_BYTES):
        super().__init__(gm, compiled, wrapper, graphs)
        capture_ = self.capture
        # keep each call's graph inputs until its backward (backward_in_turns needs them; pipeline
        # parallelism sets it, where the stage's inputs are held until its backward anyway)
        self.keep_args = False
        self.turns = turns  # pipeline parallelism's merged steps (None: every forward runs alone)
        # The program has one microbatch, so one copy of each graph: a forward that
        # starts while a graphed forward still awaits its backward (two losses summed
        # before one backward) runs on a runner without graphs, made the first time,
        # rather than overwrite it.
        self._make_plain = functools.partial(make_runner, self.program, self.stages, capture_, device, config,
                                             grads=None, cuda_graphs=None)
        self._plain = None
        self._awaiting_backward: weakref.ref | None = None
        index_of = self.index_of
        self._grad_of = {index_of[fqn]: v for v, fqn in capture_.grads.items() if fqn in index_of}
        # the backward in segments, each ending where gradients are handed out: autograd
        # then accumulates each gradient as soon as it is final (as eager's backward does),
        # rather than every gradient of the step at once at its end (as AOTAutograd's)
        input_of = {v: i for i, v in self._grad_of.items()}
        nbytes = {i: getattr(wrapper, f"in{i}").nbytes for i in wrapper.diff_index}
        self._segments = merge_segments([(span, tuple(input_of[v] for v in values if v in input_of))
                                         for span, values in self.runner.grad_segments()], nbytes,
                                        segment_min_grad_bytes)
        seeded = set(capture_.tangents.values())
        self._differentiable = [o in seeded for o in capture_.outputs]
        # the output position of each tangent (the incoming gradient that seeds it)
        self.tangent_pos = [capture_.outputs.index(o) for o in capture_.tangents.values()]
        # outputs AOTAutograd gives no tangent (views of inputs or of other outputs): rebuilt from their base
        arg_of = {ph: index_of[fqn] for ph, fqn in capture_.param_placeholders.items() if fqn in index_of}
        arg_of.update(zip(capture_.input_placeholders, wrapper.plain_index))
        self._outputs = plan_outputs(capture_, gm, arg_of, set(wrapper.diff_index))

    def __call__(self, *args):
        if not torch.is_grad_enabled():
            return self.gm(*args)
        run, token = StepRun(self), None
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

    def _run_forward(self, run: StepRun, args) -> tuple:
        static = self._static(args)
        runner = self.runner
        pending = self._awaiting_backward() if self._awaiting_backward is not None else None
        if runner.cuda_graphs is not None and pending is not None:
            if self._plain is None:
                self._plain = self._make_plain()
            runner = self._plain
        state = runner.start(static, [[args[i] for i in self._input_src]], tangents=[()])
        other = None if self.turns is None else self.turns.take()
        if other is None:
            runner.execute(state, "forward")
        else:  # a merged step: this forward and another program's backward, in turns
            spans = runner.turns("forward")
            for k, span in enumerate(spans):
                runner.execute(state, span)
                if k + 1 < len(spans):
                    next(other, None)
            # the rest of the other program runs after this forward has returned
            # (Turns.run), so the caller can send this forward's outputs on first; the
            # chunks run in the same order as if they ran here
            self.turns.left = other
            if runner.streams:
                runner.streams[StreamKind.COMP].wait_stream(runner.streams[StreamKind.COMM])
        if runner.cuda_graphs is not None:
            self._awaiting_backward = weakref.ref(state)
        run.runner, run.state = runner, state
        outs = state.outputs[0]
        return tuple(outs.pop(o) for o in self.capture.outputs)

    def backward_in_turns(self, run: StepRun, grad_outputs):
        """The backward of call ``run`` outside autograd, as a generator that stops after each
        of its comm-stream stages (:meth:`ProgramRunner.turns`), so another program's
        forward can run in between (:meth:`Turns.run`). ``grad_outputs``: one per
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
        runner.set_tangents(state, 0, [grad_outputs[i] for i in self.tangent_pos])
        for span in runner.turns("input_grads" if run.defer_weights else "backward"):
            runner.execute(state, span)
            yield
        handed = state.outputs[0]
        run.grads = {i: handed.pop(v) for i, v in self._grad_of.items() if v in handed}
        if not run.defer_weights:
            state.stores.clear()
            run.state, run.args = None, ()

    def weight_grads(self, run: StepRun) -> dict[int, torch.Tensor]:
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

    def _run_backward(self, run: StepRun, k: int, grad_outputs) -> dict[int, torch.Tensor]:
        runner, state = run.runner, run.state
        if k == 0:
            if not run.defer_weights:
                self._backward_started(state)
            runner.set_tangents(state, 0, [grad_outputs[i] for i in self.tangent_pos])
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

    def __call__(self, *args):
        state = self.runner.run(self._static(args), [[args[i] for i in self._input_src]])
        outs = state.outputs[0]
        return tuple(outs.pop(o) for o in self.capture.outputs)



def compile_step(gm: torch.fx.GraphModule, example_inputs, config: OverlapConfig | None = None,
                 train: bool = True, weight_last: bool = False, *, turns: Turns | None = None,
                 segment_min_grad_bytes: int = SEGMENT_MIN_GRAD_BYTES) -> CompiledStep | CompiledForward:
    """Build the :class:`CompiledStep` for a Dynamo graph (``train=False``: the
    :class:`CompiledForward` of a graph Dynamo traced under ``no_grad``); raises when it cannot.
    The capture comes from the adapter (``backend_capture.capture_graph``), the program from
    ``compile_program`` (one microbatch). ``weight_last``: the backward computes the weight
    gradients of the ``delay_wgrad`` parts after all else, so a call's backward can leave them
    for later (``StepRun.defer_weights``, :meth:`CompiledStep.weight_grads`: a ZeroBubble
    schedule's W). ``turns``: the channel through which pipeline parallelism runs this step's
    forwards in turns with another call's backward."""
    config = config or OverlapConfig()
    if weight_last:
        config = dataclasses.replace(config, delay_wgrad=True)
    if config.dispatch_capacity_factor is not None:
        raise BackendUnsupported(
            "dispatch_capacity_factor needs a check of the overflow flags after each step, which "
            "fxoverlap.optimize makes and the torch.compile backend does not; use the worst-case "
            "capacity (the default) under torch.compile, or fxoverlap.optimize")
    cap, wrapper = capture_graph(gm, example_inputs, config.layer_container, train)
    # before the passes: a piece of a layer fails them with a reason that hides the graph break
    if cap.num_layers == 0 and has_all_to_all(gm) and (hint := graph_break_hint()) is not None:
        raise BackendUnsupported(f"no decoder layer in this graph; {hint}")
    device = next((t.device for t in example_inputs if t.requires_grad), example_inputs[0].device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tag's "no layers found" is reported below
        stages = build_stages(cap, config, device.type, train, one_microbatch=True)
    graphs = GraphCache(config.cuda_graphs)
    compiled = compile_program(cap, stages, config, ProgramSpec(1, forward_only=not train,
                                                                weight_last=weight_last and train),
                               device, graphs=graphs)
    if cap.num_layers == 0:
        log.warning("fxoverlap backend: no decoder layers found in the graph; one stage per direction, no overlap")
    if not train:
        return CompiledForward(gm, compiled, wrapper, graphs)
    return CompiledStep(gm, compiled, wrapper, graphs, config, device, turns=turns,
                        segment_min_grad_bytes=segment_min_grad_bytes)
