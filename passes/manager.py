"""The pass manager: the list of passes, in one place for both entry points (not a pass itself).

    dispatcher ─ tag ─ side ─ rng ─ chunk ─ recompute ─ split ─ cudagraph ─ inductor   (phase "stages": once per plan)
    schedule ─ reduce ─ shard ─ streams ─ free                              (phase "program": once per microbatch count)

:data:`PASSES` is that list: named passes of one signature, ``Pass.run(state: PassState) -> None``,
each a thin adapter around its module's public entry point (``fxoverlap.passes.<name>``).
``build_stages`` and ``build_program`` run the entries of one phase in order. Capture
(``passes/capture.py``, or dynamo's graph in the backend) runs before, in the entry points.

``cudagraph`` only chooses stages (``stage.graphed``), so it runs before
``inductor``, which compiles each compute stage whether it is graphed or not,
and before ``free``, which reads the choice. ``reduce`` (data parallelism) places
the gradient reductions and ``shard`` (ZeRO-3) the parameter gathers before ``streams`` and
``free`` add their events and frees.

Switching off (``OverlapConfig(disable_passes=("side", ...))``), for debugging: only passes
whose absence leaves a correct program are switchable (``Pass.can_disable``; ``Pass.why``
says why each is or is not). A pass also skips itself where the config says so
(``side_stages=False``, ``cuda_graphs``, ``compiler="eager"``, ``free_early=False``,
no ``dp_group``).

Observability: each pass logs one line (name, wall time, size in -> out) at INFO to
``logging.getLogger("fxoverlap.passes.<name>")``: ``TORCH_LOGS="fxoverlap"`` shows them.
Under ``TORCH_TRACE=<dir>`` each pass also emits structured artifacts (``fxoverlap_<pass>_graph``,
``_stage_table``, ``_program``, ``_plan``; :func:`emit_artifacts`) that ``tlparse`` renders.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.fx

from fxoverlap.config import ConfigError, OverlapConfig
from fxoverlap.ir.capture import Capture
from fxoverlap.ir.meta import PROGRAM_KEY, SAVED_COMM_KEY, STEP_KEY
from fxoverlap.ir.program import free as free_op
from fxoverlap.ir.program import record_event, wait_event
from fxoverlap.ir.stage import Stage, format_stage_table
from fxoverlap.passes.chunk import chunk, with_whole_chains
from fxoverlap.passes.cudagraph import cudagraph
from fxoverlap.passes.dispatcher import dispatcher
from fxoverlap.passes.free import free
from fxoverlap.passes.inductor import inductor
from fxoverlap.passes.recompute import recompute
from fxoverlap.passes.reduce import reduce
from fxoverlap.passes.rng import rng
from fxoverlap.passes.schedule import schedule
from fxoverlap.passes.shard import shard
from fxoverlap.passes.side import side
from fxoverlap.passes.split import split
from fxoverlap.passes.streams import streams
from fxoverlap.passes.tag import tag

log = logging.getLogger(__name__)
Phase = Literal["stages", "program"]


def _progress(msg: str, show: bool = True) -> None:
    """A compile progress line: logged at INFO on ``fxoverlap.pipeline`` (``TORCH_LOGS="fxoverlap"``
    shows it, on every rank); with ``show`` (``OverlapConfig.progress``) and that log off, printed
    to stderr on rank 0."""
    import torch.distributed as dist

    log.info("%s", msg)
    if show and not log.isEnabledFor(logging.INFO) and (not dist.is_initialized() or dist.get_rank() == 0):
        print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class PassState:
    """What every pass reads and writes. Phase "stages" fills ``graph`` (the joint graph, from
    ``tag`` on; ``dispatcher`` rewrites ``capture.graph_module``) and ``stages``; phase
    "program" reads ``stages`` and fills ``program``."""

    capture: Capture
    config: OverlapConfig
    device_type: str = "cpu"
    train: bool = True
    # the programs built from these stages run one microbatch (the backend's): no merged steps
    # or forward pairs, so no whole chains are kept beside the chunks
    one_microbatch: bool = False
    graph: torch.fx.GraphModule | None = None
    # the graph before ``chunk`` cut it, whose whole exchanges the microbatches of the merged
    # steps run (None: the cut graph is the only one)
    whole_graph: torch.fx.GraphModule | None = None
    stages: list[Stage] | None = None
    num_microbatches: int = 1
    forward_only: bool = False
    reduce_grads: bool = False
    weight_last: bool = False  # schedule: the backward's weight-gradient parts after all else
    units: tuple = ()  # shard: the parameter units of ZeRO-3 (fxoverlap.ir.unit.ParamUnit), () without it
    program: torch.fx.GraphModule | None = None


@dataclasses.dataclass(frozen=True)
class Pass:
    """One entry of :data:`PASSES`. ``skip(state)``: why the config leaves the pass out
    (None: it runs). ``can_disable``: whether ``OverlapConfig.disable_passes`` may name it;
    ``why``: the reason either way."""

    name: str
    phase: Phase
    run: Callable[[PassState], None]
    can_disable: bool
    why: str
    skip: Callable[[PassState], str | None] = lambda state: None


# --- adapters: one signature around each pass module's public entry point ---------------------

def _dispatcher(st: PassState) -> None:
    lowering = dispatcher(st.capture.graph_module, st.config.dispatcher, st.config.dispatch_capacity_factor)
    st.capture.dispatcher, st.capture.overflow, st.capture.ep_size = lowering.backend, lowering.overflow, lowering.ep_size
    st.capture.ep_groups = lowering.groups


def _tag(st: PassState) -> None:
    st.graph = tag(st.capture)


def _side(st: PassState) -> None:
    st.graph = side(st.graph)


def _rng(st: PassState) -> None:
    st.graph = rng(st.graph, st.capture.num_layers)


def _chunk(st: PassState) -> None:
    cut = chunk(st.graph, st.config.resolved_chunks(st.device_type), st.capture.static_placeholders,
                st.config.resolved_min_chunk_exchange_bytes(st.device_type, st.one_microbatch))
    if cut.layers and not st.one_microbatch and not st.config.chunks_in_merged_steps:
        st.whole_graph = st.graph  # chunk cut a copy
    st.graph = cut.graph
    if cut.skipped:
        whys = "; ".join(f"layer {layer}: {why}" for layer, why in cut.skipped.items())
        # printed when the user asked for chunks; with the per-device default, only logged
        _progress(f"fxoverlap: chunks={cut.chunks} cut layers {cut.layers or 'none'}; left whole: {whys}",
                  show=st.config.progress and st.config.chunks is not None)


def _recompute(st: PassState) -> None:
    cfg = st.config
    st.graph = recompute(st.graph, st.capture.num_layers, cfg.mhc_recompute_group, replay_comm=cfg.ac_replay_comm)
    if st.whole_graph is not None:
        st.whole_graph = recompute(st.whole_graph, st.capture.num_layers, cfg.mhc_recompute_group,
                                   replay_comm=cfg.ac_replay_comm)
    if layers := st.graph.meta.get(SAVED_COMM_KEY):
        _progress(f"fxoverlap: activation checkpointing keeps the all-to-all outputs of layers "
                  f"{', '.join(map(str, layers))} for the backward, where eager's checkpoint exchanges "
                  f"them again; OverlapConfig(ac_replay_comm=True) replays them (less memory, more comm)",
                  show=cfg.progress)


def _split(st: PassState) -> None:
    delay = st.config.resolved_delay_wgrad(st.device_type) and st.train
    # ZeRO-3: a stage reads the (gathered) parameters themselves, no value made of them crosses stages
    static = frozenset(st.capture.static_placeholders) if st.config.shard_params else None
    st.stages = split(st.graph, st.capture.num_layers, delay_wgrad=delay, static=static)
    if st.whole_graph is not None:
        whole = split(st.whole_graph, st.capture.num_layers, delay_wgrad=delay, static=static)
        st.stages, why = with_whole_chains(st.stages, whole)
        if why is not None:
            _progress(f"fxoverlap: the chunks run in every microbatch, the merged steps' too: {why}",
                      show=st.config.progress and st.config.chunks is not None)


def _cudagraph(st: PassState) -> None:
    cudagraph(st.stages, st.config.cuda_graphs, st.capture.static_placeholders)


def _inductor(st: PassState) -> None:
    show = st.config.progress
    report = inductor(st.stages, st.capture, dict(st.config.compile_options or {}),
                      progress=lambda msg: _progress(msg, show=show))
    _artifact("fxoverlap_inductor_report", lambda: repr(report))


def _schedule(st: PassState) -> None:
    st.program = schedule(st.stages, st.capture, st.num_microbatches, forward_only=st.forward_only,
                          weight_last=st.weight_last, expert_wgrad_slot=st.config.expert_wgrad_slot)


def _reduce(st: PassState) -> None:
    st.program = reduce(st.program, st.capture, bucket_bytes=int(st.config.reduce_bucket_mb * 2**20))


def _shard(st: PassState) -> None:
    st.program = shard(st.program, st.stages, st.capture, st.units,
                       keep_gathered_bytes=st.config.keep_gathered_mb * 2**20, unshard_ahead=st.config.unshard_ahead)


def _streams(st: PassState) -> None:
    st.program = streams(st.program)


def _free(st: PassState) -> None:
    st.program = free(st.program, st.capture)


def _no_graphs(st: PassState) -> str | None:
    if st.config.shard_params:
        return "OverlapConfig.shard_params (gathered parameters live in new memory every step)"
    on = st.config.cuda_graphs or (st.config.cuda_graphs is None and st.device_type == "cuda")
    return None if on else f"OverlapConfig.cuda_graphs={st.config.cuda_graphs} on {st.device_type}"


PASSES: tuple[Pass, ...] = (
    Pass("dispatcher", "stages", _dispatcher, False,
         "lowers fxoverlap's dispatch/combine ops to the chosen transport; without it they cannot run"),
    Pass("tag", "stages", _tag, False, "assigns every node its layer, kind and direction; split needs them"),
    Pass("side", "stages", _side, True,
         "only moves attn work that the dispatch does not need under it; off = OverlapConfig(side_stages=False)",
         skip=lambda st: None if st.config.side_stages else "OverlapConfig.side_stages=False"),
    Pass("rng", "stages", _rng, False,
         "orders the random draws as eager does; without it dropout/sampling differ from eager"),
    Pass("chunk", "stages", _chunk, True,
         "only cuts each MoE layer's exchange into chunks along its experts; off = OverlapConfig(chunks=1)",
         skip=lambda st: None if st.config.resolved_chunks(st.device_type) > 1
         else f"chunks={st.config.resolved_chunks(st.device_type)}"),
    Pass("recompute", "stages", _recompute, False,
         "places activation-checkpoint and mHC recompute; with either, the graph is wrong without it",
         skip=lambda st: None if st.train else "forward only"),
    Pass("split", "stages", _split, False, "makes the stages every later pass works on"),
    Pass("cudagraph", "stages", _cudagraph, True,
         "only chooses stages to run as CUDA graphs; off = every stage runs eagerly or compiled",
         skip=_no_graphs),
    Pass("inductor", "stages", _inductor, True,
         "only compiles compute stages; off = they run op by op, as OverlapConfig(compiler='eager')",
         skip=lambda st: None if st.config.resolved_compiler(st.device_type) == "inductor"
         else f"compiler {st.config.resolved_compiler(st.device_type)!r}"),
    Pass("schedule", "program", _schedule, False, "makes the program"),
    Pass("reduce", "program", _reduce, False,
         "reduces the gradients over the data-parallel groups; without it they would not be reduced",
         skip=lambda st: None if st.reduce_grads and not st.forward_only else "no data-parallel group"),
    Pass("shard", "program", _shard, False,
         "gathers the sharded parameters before their readers; without it they would read no parameters",
         skip=lambda st: None if st.units else "no sharded parameters (OverlapConfig.shard_params)"),
    Pass("streams", "program", _streams, False,
         "adds the events that order the comm and compute streams; without them stages race"),
    Pass("free", "program", _free, True,
         "only drops values at their last use; off = they live until the step ends (more memory), "
         "as OverlapConfig(free_early=False)",
         skip=lambda st: None if st.config.free_early else "OverlapConfig.free_early=False"),
)
SWITCHABLE: tuple[str, ...] = tuple(p.name for p in PASSES if p.can_disable)


def check_disable_passes(names: Sequence[str]) -> None:
    """Raise ``ConfigError`` (a ValueError) unless every name in ``names`` is a pass that can be switched off."""
    known = {p.name: p for p in PASSES}
    for name in names:
        if name not in known or not known[name].can_disable:
            why = (f"{name!r} cannot be switched off: it {known[name].why}" if name in known
                   else f"there is no pass {name!r}")
            raise ConfigError(f"OverlapConfig.disable_passes: {why}. Passes that can be switched off: "
                             f"{', '.join(SWITCHABLE)} (all passes: {', '.join(known)})")


# --- the pass manager ----------------------------------------------------------------------

def _size(st: PassState, phase: Phase) -> str:
    if phase == "program" and st.program is not None:
        return f"{len(st.program.graph.nodes)} program nodes"
    if st.stages is not None:
        return f"{len(st.stages)} stages ({sum(len(s.graph_module.graph.nodes) for s in st.stages)} nodes)"
    gm = st.graph if st.graph is not None else st.capture.graph_module
    return f"{len(gm.graph.nodes)} nodes"


def run_passes(phase: Phase, state: PassState) -> PassState:
    """Run the entries of :data:`PASSES` of ``phase`` in order on ``state``, one log line and
    the trace artifacts per pass."""
    check_disable_passes(state.config.disable_passes)
    disabled = set(state.config.disable_passes)
    for p in PASSES:
        if p.phase != phase:
            continue
        plog = logging.getLogger(f"fxoverlap.passes.{p.name}")
        why = "OverlapConfig.disable_passes" if p.name in disabled else p.skip(state)
        if why is not None:
            plog.info("fxoverlap pass %-10s skipped (%s)", p.name, why)
            continue
        logging_on = plog.isEnabledFor(logging.INFO)  # sizes are counted only for the log line
        before = _size(state, phase) if logging_on else ""
        t0 = time.perf_counter()
        p.run(state)
        if logging_on:
            ms = (time.perf_counter() - t0) * 1e3
            plog.info("fxoverlap pass %-10s %8.1f ms  %s -> %s", p.name, ms, before, _size(state, phase))
        emit_artifacts(p.name, state, phase)
    return state


def build_stages(capture: Capture, config: OverlapConfig, device_type: str, train: bool = True,
                 one_microbatch: bool = False) -> list[Stage]:
    """The stages of a capture, chosen for CUDA graphs and compiled as ``config`` says
    (``one_microbatch``: every program built from them runs one microbatch, as the backend's)."""
    return run_passes("stages", PassState(capture, config, device_type, train, one_microbatch)).stages


def build_program(stages: list[Stage], capture: Capture, num_microbatches: int, config: OverlapConfig,
                  forward_only: bool = False, reduce_grads: bool = False,
                  weight_last: bool = False, units: tuple = ()) -> torch.fx.GraphModule:
    """The program that runs ``stages`` over ``num_microbatches`` microbatches; with
    ``reduce_grads``, it also reduces the gradients over the data-parallel groups; with
    ``units`` (ZeRO-3), it gathers and drops those parameter units around their readers; with
    ``weight_last`` (one microbatch), its backward computes the weight gradients of the
    ``delay_wgrad`` parts after everything else (a ZeroBubble schedule's B then W)."""
    state = PassState(capture, config, stages=stages, num_microbatches=num_microbatches,
                      forward_only=forward_only, reduce_grads=reduce_grads, weight_last=weight_last,
                      units=tuple(units))
    return run_passes("program", state).program


# --- structured trace artifacts (TORCH_TRACE) ------------------------------------------------

def _tracing() -> bool:
    from torch._logging._internal import trace_log

    return bool(trace_log.handlers)


def _artifact(name: str, payload_fn: Callable[[], str]) -> None:
    """One ``trace_structured`` artifact (a no-op unless ``TORCH_TRACE`` is set); inside a
    torch.compile it carries the compile id, outside (``optimize``) none."""
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=payload_fn,
        expect_trace_id=False,
    )


def _readable(gm: torch.fx.GraphModule) -> str:
    try:
        return gm.print_readable(print_output=False, include_stride=True, include_device=True)
    except Exception:  # noqa: BLE001  (a graph print_readable cannot render: its code will do)
        return gm.code


def emit_artifacts(name: str, st: PassState, phase: Phase) -> None:
    """Pass ``name``'s artifacts: ``fxoverlap_<name>_graph`` (its output graph: the joint graph,
    the stages' graphs, or the program), ``_stage_table`` (once there are stages, phase
    "stages"), ``_program`` (the program's code) and ``_plan`` (its memory and stream plan)."""
    if not _tracing():
        return
    if phase == "program":
        prog = st.program
        _artifact(f"fxoverlap_{name}_program", lambda: prog.code)
        _artifact(f"fxoverlap_{name}_plan", lambda: format_plan(prog))
        return
    if st.stages is None:
        gm = st.graph if st.graph is not None else st.capture.graph_module
        _artifact(f"fxoverlap_{name}_graph", lambda: _readable(gm))
        return
    stages = list(st.stages)
    _artifact(f"fxoverlap_{name}_graph", lambda: "\n\n".join(
        f"# stage {s.name} ({s.runs_as}, {s.stream})\n{_readable(s.graph_module)}" for s in stages))
    _artifact(f"fxoverlap_{name}_stage_table", lambda: format_stage_table(stages))


def format_plan(program: torch.fx.GraphModule) -> str:
    """The program's memory and stream plan, one line per node: index, stream, what it does
    (run a stage, record / wait an event, free values, ...), and how many values of the
    microbatch stores are live after it (written and not yet freed)."""
    rows = [("#", "stream", "mb", "live", "does")]
    live: set[tuple[int, str]] = set()
    peak = 0
    for i, n in enumerate(program.graph.nodes):
        if n.op in ("placeholder", "output"):
            continue
        step = n.meta.get(STEP_KEY)
        stream, mb = (str(step.stream), str(step.microbatch)) if step is not None else ("", "")
        if step is not None:
            live.update((step.microbatch, w) for w in step.writes)
        if n.op == "call_module":
            does = f"run {step.stage if step is not None else n.target}"
            if step is not None and step.reads:
                does += f"  reads {', '.join(step.reads)}"
            if step is not None and step.writes:
                does += f"  writes {', '.join(step.writes)}"
        elif n.target is record_event:
            stream, does = str(n.args[1]), f"record event {n.args[0]}"
        elif n.target is wait_event:
            stream, does = str(n.args[1]), f"wait event {n.args[0]}"
        elif n.target is free_op:
            mb = str(n.args[0])
            live.difference_update((n.args[0], v) for v in n.args[1:])
            does = f"free {', '.join(map(str, n.args[1:]))}"
        else:
            does = f"{getattr(n.target, '__name__', n.target)} {', '.join(map(str, n.args[1:]))}"
        peak = max(peak, len(live))
        rows.append((str(i), stream, mb, str(len(live)), does))
    events = sum(1 for n in program.graph.nodes if n.target is record_event)
    frees = sum(1 for n in program.graph.nodes if n.target is free_op)
    from fxoverlap.ir.stage import render_rows

    record = program.meta.get(PROGRAM_KEY)
    units = (f", at most {record.gathered_peak} of {len(record.units)} parameter units gathered"
             if record is not None and record.units else "")
    return (render_rows(rows) + f"\n\n{events} events recorded, {frees} frees, "
            f"peak {peak} live values, {len(live)} live at the end{units}")
