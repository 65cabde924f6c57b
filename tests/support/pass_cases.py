"""Hand-built stages and programs for the per-pass unit tests, and checks of a program's
properties that the pass tests and the memory tests share.

Nothing here traces a model: a stage is its name, tag and the values it reads and
writes, as ``split`` hands them to ``schedule``, ``streams`` and ``free`` (which
never run a stage), so the tests built on it hold on any torch release.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
import torch.nn as nn

from fxoverlap.ir import program as program_ops
from fxoverlap.ir.meta import STEP_KEY
from fxoverlap.ir.capture import Capture
from fxoverlap.ir.program import StageCall, Step
from fxoverlap.ir.stage import Direction, Part, Stage, StageKind, StreamKind, Tag, stage_name

F, B, K = Direction.FWD, Direction.BWD, StageKind
COMP, COMM = StreamKind.COMP, StreamKind.COMM


def _no_graph() -> torch.fx.GraphModule:
    return torch.fx.GraphModule(nn.Module(), torch.fx.Graph())


def model_stages(pattern: str = "mm", *, side: bool = False, early: bool = False, wgrad: bool = False,
                 recompute_group: int | None = None) -> tuple[list[Stage], Capture]:
    """The stages (plain order) and capture of a model with one decoder layer per letter
    of ``pattern`` (``m``: MoE, ``d``: dense), with the dataflow of a real one.

    Each stage writes a value named after itself; forward stages read the previous
    hidden state and their parameter, ``post`` also the residual (the hidden state
    entering the layer); backward stages read the incoming gradient and the forward
    values they need (the dispatch output for experts, the attn output for attn).
    Backward compute stages write their parameter's gradient (``g_<owner>``), or their
    ``wgrad`` part does. The first MoE layer's experts update buffer ``b_counter``
    (``Capture.mutations``). Parts: ``side`` (forward attn work the dispatch does not
    read, which ``post`` reads), ``early`` (backward attn work fed by ``post`` alone),
    ``wgrad`` (weight gradients of backward attn/experts/mlp), ``recompute_group``
    (a recompute stage per group of layers writing ``rc_l<i>``, which each layer's
    backward attn reads).
    """
    n = len(pattern)
    stages: list[Stage] = []
    params: dict[str, str] = {}
    grads: dict[str, str] = {}

    def add(direction, layer, kind, reads, extra=(), part=Part.MAIN, recompute_layers=()) -> str:
        tag = Tag(direction, layer, kind, part)
        name = stage_name(tag)
        writes = [name, *extra] if kind is not K.HEAD or direction is B else ["loss"]
        stages.append(Stage(name, tag, _no_graph(), list(reads), writes, recompute_layers=tuple(recompute_layers)))
        return writes[0]

    def param(owner: str) -> str:
        params[f"p_{owner}"] = f"{owner}.weight"
        grads[f"g_{owner}"] = f"{owner}.weight"
        return f"p_{owner}"

    def grad_writes(direction_layer_kind: tuple, owner: str, reads: Sequence[str]) -> list[str]:
        """The gradient of ``owner``: written by the stage itself, or by its wgrad part."""
        if not wgrad:
            return [f"g_{owner}"]
        d, layer, kind = direction_layer_kind
        tag = Tag(d, layer, kind, Part.WGRAD)
        stages.append(Stage(stage_name(tag), tag, _no_graph(), list(reads), [f"g_{owner}"]))
        return []

    # ---- forward
    hidden_in: list[str] = []  # the hidden state entering each layer
    h = add(F, -1, K.EMBED, ["tokens", param("embed")])
    fwd: dict[tuple[int, StageKind], str] = {}
    counter = {}
    for layer, c in enumerate(pattern):
        hidden_in.append(h)
        attn = fwd[(layer, K.ATTN)] = add(F, layer, K.ATTN, [h, param(f"l{layer}_attn")])
        if c == "d":
            h = add(F, layer, K.MLP, [attn, param(f"l{layer}_mlp")])
            continue
        side_out = [add(F, layer, K.ATTN, [attn], part=Part.SIDE)] if side else []
        d = fwd[(layer, K.DISPATCH)] = add(F, layer, K.DISPATCH, [attn])
        buf = [] if counter else ["b_counter"]
        e = add(F, layer, K.EXPERTS, [d, param(f"l{layer}_experts"), *buf], extra=["new_counter"] if buf else ())
        counter = counter or {"new_counter": "b_counter"}
        h = add(F, layer, K.POST, [add(F, layer, K.COMBINE, [e]), hidden_in[layer], *side_out])
    add(F, n, K.HEAD, [h, "labels", param("head")])

    # ---- backward
    g = add(B, n, K.HEAD, ["tangent", h, "labels"], extra=["g_head"])
    recompute_of: dict[int, str] = {}
    if recompute_group:
        for lo in range(0, n, recompute_group):
            layers = range(lo, min(lo + recompute_group, n))
            writes = [f"rc_l{layer}" for layer in layers]
            tag = Tag(B, layers[-1], K.RECOMPUTE)
            stages.append(Stage(stage_name(tag), tag, _no_graph(), [hidden_in[lo]], writes,
                                recompute_layers=tuple(layers)))
            recompute_of.update((layer, f"rc_l{layer}") for layer in layers)
    for layer in reversed(range(n)):
        rc = [recompute_of[layer]] if layer in recompute_of else []
        attn = fwd[(layer, K.ATTN)]
        if pattern[layer] == "d":
            gm = add(B, layer, K.MLP, [g, attn],
                     extra=grad_writes((B, layer, K.MLP), f"l{layer}_mlp", [g, attn]))
            g = add(B, layer, K.ATTN, [gm, g, *rc],
                    extra=grad_writes((B, layer, K.ATTN), f"l{layer}_attn", [gm, *rc]))
            continue
        gp = add(B, layer, K.POST, [g])
        gc = add(B, layer, K.COMBINE, [gp])
        early_out = [add(B, layer, K.ATTN, [gp], part=Part.EARLY)] if early else []
        d = fwd[(layer, K.DISPATCH)]
        ge = add(B, layer, K.EXPERTS, [gc, d],
                 extra=grad_writes((B, layer, K.EXPERTS), f"l{layer}_experts", [gc, d]))
        gd = add(B, layer, K.DISPATCH, [ge])
        g = add(B, layer, K.ATTN, [gd, gp, attn, *early_out, *rc],
                extra=grad_writes((B, layer, K.ATTN), f"l{layer}_attn", [gd, attn, *rc]))
    add(B, -1, K.EMBED, [g, "tokens"], extra=["g_embed"])
    stages.sort(key=lambda s: s.tag.sort_key(n))
    capture = Capture(
        graph_module=_no_graph(), fake_mode=None, param_placeholders=params,
        buffer_placeholders={"b_counter": "layers.0.counter"} if counter else {},
        input_placeholders=["tokens", "labels"], tangents={"tangent": "loss"}, outputs=["loss"],
        grads=grads, mutations=counter, num_layers=n, layer_names=[f"layers.{i}" for i in range(n)],
        param_children={}, signature=(),
    )
    return stages, capture


def program_of(calls: Sequence[tuple]) -> torch.fx.GraphModule:
    """A program of ``(name, microbatch, stream, reads, writes)`` nodes in this order: a
    stage call ``name``, or the sink ``output`` / ``accumulate`` / ``mutate`` of ``reads``."""
    sinks = {"output": program_ops.output, "accumulate": program_ops.accumulate, "mutate": program_ops.mutate}
    root, graph = nn.Module(), torch.fx.Graph()
    for name, mb, stream, reads, writes in calls:
        if name in sinks:
            node = graph.call_function(sinks[name], (mb, *reads))
            node.meta[STEP_KEY] = Step(mb, stream, tuple(reads))
            continue
        if not hasattr(root, name):
            root.add_module(name, StageCall(name))
        node = graph.call_module(name, (mb,))
        node.meta[STEP_KEY] = Step(mb, stream, tuple(reads), tuple(writes), name)
    graph.output(None)
    return torch.fx.GraphModule(root, graph)


def listing(program: torch.fx.GraphModule) -> list[str]:
    """One line per program node: a stage call's node name, or a marker and its arguments."""
    out = []
    for n in program.graph.nodes:
        if n.op == "call_module":
            out.append(n.name)
        elif n.op == "call_function":
            out.append(" ".join([n.target.__name__, *map(str, n.args)]))
    return out


def check_dataflow(program: torch.fx.GraphModule, stages: Sequence[Stage], num_microbatches: int,
                   forward_only: bool = False) -> None:
    """Every stage runs once per microbatch, after the stages whose outputs it reads, on
    its stream; every sink reads values its microbatch has."""
    by_name = {s.name: s for s in stages}
    producers = {v for s in stages for v in s.outputs}
    done: dict[int, set[str]] = {}
    made: dict[int, set[str]] = {}
    for node, step in program_ops.steps(program):
        mb = step.microbatch
        have = made.setdefault(mb, set())
        missing = [v for v in step.reads if v in producers and v not in have]
        assert not missing, f"{node.name} reads {missing} of microbatch {mb} before any stage wrote them"
        if step.stage is not None:
            stage = by_name[step.stage]
            assert step.stream is stage.stream, f"{node.name} runs on {step.stream}, its stage on {stage.stream}"
            assert (step.reads, step.writes) == (tuple(stage.inputs), tuple(stage.outputs)), node.name
            assert step.stage not in done.setdefault(mb, set()), f"{step.stage} runs twice for microbatch {mb}"
            done[mb].add(step.stage)
            have.update(step.writes)
    want = {s.name for s in stages if not forward_only or s.direction is F}
    assert sorted(done) == list(range(num_microbatches))
    for mb, names in done.items():
        assert names == want, f"microbatch {mb}: missing {sorted(want - names)}"


def check_cross_stream_order(program: torch.fx.GraphModule) -> None:
    """Streams' guarantees, by walking the program as two streams run it:

    * every value read across streams was written before an event its reader's stream
      waited on (so the read is ordered after the write);
    * every event but ``start``/``end`` is recorded right after a stage call and waited
      on right before a node of the other stream that reads what that call wrote, and no
      wait is implied by an earlier one (the waiting stream had not yet waited on that
      producer or a later one of its stream);
    * ``start`` is recorded before the first node and waited on by the comm stream
      before its first node; ``end`` is recorded on the comm stream and waited on by the
      compute stream at the end of the program.
    """
    nodes = [n for n in program.graph.nodes if n.op in ("call_module", "call_function")]
    position = {n: i for i, n in enumerate(nodes)}
    recorded: dict[str, tuple[str, torch.fx.Node | None]] = {}  # event -> (stream, producer node)
    waited_upto = {COMP.value: -1, COMM.value: -1}  # per stream: the latest producer position it waited on
    writer: dict[tuple[int, str], torch.fx.Node] = {}
    stream_of: dict[torch.fx.Node, str] = {}
    seen_comm = False
    waited: set[str] = set()
    for i, n in enumerate(nodes):
        step = n.meta.get(STEP_KEY)
        if n.target is program_ops.record_event:
            name, stream = n.args
            prev = next((p for p in reversed(nodes[:i]) if STEP_KEY in p.meta), None)
            if name == "start":
                assert i == 0 and stream == COMP.value, "start is recorded on the compute stream, first"
            elif name == "end":
                assert stream == COMM.value
            else:
                prev = nodes[i - 1]
                assert prev.op == "call_module" and stream_of[prev] == stream, f"{name} does not follow its producer"
            recorded[name] = (stream, prev)
        elif n.target is program_ops.wait_event:
            name, stream = n.args
            assert name in recorded, f"wait on {name} before it is recorded"
            ev_stream, producer = recorded[name]
            assert ev_stream != stream, f"{stream} waits on its own event {name}"
            if name == "end":
                assert stream == COMP.value and all(m.target is program_ops.free for m in nodes[i + 1:]), \
                    "the end wait closes the program"
                continue
            if name == "start":
                assert stream == COMM.value and not seen_comm
                continue
            assert position[producer] > waited_upto[stream], f"wait on {name} is implied by an earlier wait"
            waited_upto[stream] = position[producer]
            waited.add(name)
            consumer = next(m for m in nodes[i + 1:] if STEP_KEY in m.meta)  # frees may sit in between
            cstep = consumer.meta[STEP_KEY]
            assert cstep.stream.value == stream, f"{name} is waited on {stream}, but {consumer.name} runs on the other"
            assert any(writer.get((cstep.microbatch, v)) is producer for v in cstep.reads), \
                f"{consumer.name} waits on {name} but reads nothing {producer.name} wrote"
        elif step is not None:
            stream = step.stream.value
            if stream == COMM.value and not seen_comm:
                seen_comm = True
                assert "start" in recorded and any(
                    m.target is program_ops.wait_event and m.args == ("start", COMM.value) for m in nodes[:i]), \
                    "the first comm node waits on start"
            stream_of[n] = stream
            for v in step.reads:
                p = writer.get((step.microbatch, v))
                if p is not None and stream_of[p] != stream:
                    assert position[p] <= waited_upto[stream], \
                        f"{n.name} reads {v} from {p.name} on the other stream without waiting on it"
            for v in step.writes:
                writer[(step.microbatch, v)] = n
    unused = set(recorded) - waited - {"start", "end"}
    assert not unused, f"events recorded but never waited on: {sorted(unused)}"
    if seen_comm:
        assert "end" in recorded and any(m.target is program_ops.wait_event and m.args == ("end", COMP.value)
                                         for m in nodes), "a program with comm nodes ends waiting on end"


def check_program_frees(program: torch.fx.GraphModule, capture: Capture) -> int:
    """Walk the program: no node reads a freed value, nothing is freed twice, every
    per-microbatch value is freed, and each free follows the node it belongs to with
    at most event records in between. Returns the number of free nodes."""
    static = capture.static_placeholders
    produced: set[tuple[int, str]] = set()
    freed: set[tuple[int, str]] = set()
    started: set[int] = set()
    count = 0
    for n in program.graph.nodes:
        step = n.meta.get(STEP_KEY)
        if step is not None:
            mb = step.microbatch
            if mb not in started:
                started.add(mb)
                produced.update((mb, v) for v in (*capture.input_placeholders, *capture.tangents))
            for v in step.reads:
                assert (mb, v) not in freed, f"{n.name} reads {v} of microbatch {mb} after it was freed"
            born = {(mb, v) for v in step.writes}
            produced |= born
            freed -= born  # produced again (a recompute stage): a new definition to free
        elif n.op == "call_function" and n.target is program_ops.free:
            count += 1
            mb, *names = n.args
            for v in names:
                assert v not in static, f"{n.name} frees parameter/buffer {v}"
                assert (mb, v) not in freed, f"{n.name} frees {v} of microbatch {mb} twice"
                freed.add((mb, v))
            if not n.name.startswith("free_inputs"):
                prev, events = n.prev, []
                while prev.op == "call_function" and prev.target is program_ops.record_event:
                    events.append(prev)
                    prev = prev.prev
                prev_step = prev.meta.get(STEP_KEY)
                assert prev_step is not None and prev_step.microbatch == mb, f"{n.name} does not follow a node of mb {mb}"
                # only the event recorded on the node's own stream right after it sits in between
                assert all(e.args[1] == prev_step.stream.value for e in events), f"{n.name}: {events}"
                touched = set(prev_step.reads) | set(prev_step.writes) | set(capture.tangents)
                assert set(names) <= touched, f"{n.name} frees {set(names) - touched}, which {prev.name} does not touch"
    leaked = {(mb, v) for mb, v in produced if v not in static} - freed
    assert not leaked, f"never freed: {sorted(leaked)[:10]}"
    return count
