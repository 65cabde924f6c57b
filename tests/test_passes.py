"""Per-pass unit tests on hand-built stage lists, programs and small FX graphs.

No model is traced and nothing is spawned: the stages of ``pass_cases.model_stages``
carry the names, tags and dataflow ``split`` would give them, so these tests hold on
any torch release (the snapshot tests, pinned to one, cover the real models).

- schedule: F(0), then F(i) ⊗ B(i-1) in the slot order of the table in
  ``passes/schedule.py``, then B(N-1); side / early / wgrad parts and recompute stages
  where the schedule puts them; the forward-only program; every stage once per
  microbatch after its producers;
- streams: events only on cross-stream edges, redundant waits left out, start/end;
- free: each value freed once, right after its last use, after the reader's event
  when read across streams; inputs nothing reads freed first; CUDA-graph outputs
  never freed;
- side: on a small hand-built tagged FX graph (and ``split`` of it);
- cudagraph: exactly the capturable stages graphed, each one left out logged;
  ``split``'s capturability reasons on small graphs; the copies the runtime needs.
"""

from __future__ import annotations

import logging
import operator

import pytest
import torch
import torch.fx

import fxoverlap.cudagraphs as cg
from fxoverlap.ir import program as program_ops
from fxoverlap.ir.meta import STEP_KEY, TAG_KEY
from fxoverlap.passes.cudagraph import cudagraph
from fxoverlap.passes.free import free
from fxoverlap.passes.schedule import schedule
from fxoverlap.passes.side import side
from fxoverlap.passes.split import not_capturable_reason, split
from fxoverlap.passes.streams import streams
from fxoverlap.ir.program import stage_calls
from fxoverlap.ir.stage import Direction, Part, StageKind, Tag, stream_of
from pass_cases import (
    COMM,
    COMP,
    check_cross_stream_order,
    check_dataflow,
    check_program_frees,
    listing,
    model_stages,
    program_of,
)

F, B, K = Direction.FWD, Direction.BWD, StageKind

# (pattern, parts) of the hand-built models the property tests run over
CASES = [
    ("mm", {}),
    ("mm", dict(side=True, early=True)),
    ("mdm", dict(wgrad=True)),
    ("mmm", dict(side=True, early=True, wgrad=True, recompute_group=2)),
    ("dmd", dict(recompute_group=1)),
]
CASE_IDS = [f"{p}-{'-'.join(k for k, v in kw.items() if v) or 'plain'}" for p, kw in CASES]


def _calls(program) -> list[tuple[str, tuple | None]]:
    return [(n.name, st.slot) for n, st in stage_calls(program)]


def _names(program) -> list[str]:
    return [n.name for n, _ in stage_calls(program)]


# ================================================================ schedule


def test_schedule_forward_first_then_merged_slots_then_drain():
    stages, cap = model_stages("mm")
    calls = _calls(schedule(stages, cap, 2))
    fwd = [s.name.split("_", 1)[1] for s in stages if s.direction is F]
    bwd = [s.name.split("_", 1)[1] for s in stages if s.direction is B]
    n_f, n_b = len(fwd), len(bwd)
    # F(0): the whole forward of microbatch 0, in plain order, outside the slots
    assert calls[:n_f] == [(f"F0_{s}", None) for s in fwd]
    # F(1) ⊗ B(0): B head opens; pair j = forward layer j with backward layer 1 - j; per
    # slot the compute stage is issued before the comm stage; post, head and embed close.
    assert calls[n_f:n_f + n_f + n_b] == [
        ("B0_model_head", None),
        ("B0_l1_post", (1, 0, 1)), ("F1_model_embed", (1, 0, 1)), ("F1_l0_attn", (1, 0, 1)),
        ("B0_l1_combine", (1, 0, 1)),
        ("B0_l1_experts", (1, 0, 2)), ("F1_l0_dispatch", (1, 0, 2)),
        ("F1_l0_experts", (1, 0, 3)), ("B0_l1_dispatch", (1, 0, 3)),
        ("B0_l1_attn", (1, 0, 4)), ("F1_l0_combine", (1, 0, 4)),
        ("B0_l0_post", (1, 1, 1)), ("F1_l0_post", (1, 1, 1)), ("F1_l1_attn", (1, 1, 1)),
        ("B0_l0_combine", (1, 1, 1)),
        ("B0_l0_experts", (1, 1, 2)), ("F1_l1_dispatch", (1, 1, 2)),
        ("F1_l1_experts", (1, 1, 3)), ("B0_l0_dispatch", (1, 1, 3)),
        ("B0_l0_attn", (1, 1, 4)), ("F1_l1_combine", (1, 1, 4)),
        ("F1_l1_post", None), ("F1_model_head", None), ("B0_model_embed", None),
    ]
    # B(1): the drain, in plain backward order, outside the slots
    assert calls[2 * n_f + n_b:] == [(f"B1_{s}", None) for s in bwd]


def test_schedule_steps_and_sinks():
    stages, cap = model_stages("mm")
    program = schedule(stages, cap, 3)
    by_name = {s.name: s for s in stages}
    for node, step in stage_calls(program):
        assert step.stream is stream_of(by_name[step.stage].kind)
        assert node.name.startswith(("F", "B")) and node.name[1] == str(step.microbatch)
    sinks = {}
    for n in program.graph.nodes:
        if n.op == "call_function":
            sinks.setdefault(n.target.__name__, []).append((n.prev.name, n.args))
    # right after the stage that makes them: the loss, each gradient, the buffer update
    assert sinks["output"] == [(f"F{mb}_model_head", (mb, "loss")) for mb in range(3)]
    assert sinks["mutate"] == [(f"F{mb}_l0_experts", (mb, "new_counter")) for mb in range(3)]
    accumulated = {(mb, v) for _, (mb, *vs) in sinks["accumulate"] for v in vs}
    assert accumulated == {(mb, g) for mb in range(3) for g in cap.grads}
    mutate = next(n for n in program.graph.nodes if n.target is program_ops.mutate)
    assert mutate.meta[STEP_KEY].reads == ("new_counter", "b_counter")  # writes into the buffer


def test_schedule_side_and_early_parts_run_under_their_all_to_all():
    stages, cap = model_stages("mm", side=True, early=True)
    program = schedule(stages, cap, 3)
    calls = _calls(program)
    names = [c[0] for c in calls]
    for mb in range(3):
        for layer in range(2):
            i = names.index(f"F{mb}_l{layer}_dispatch")
            assert calls[i + 1] == (f"F{mb}_l{layer}_attn_side", calls[i][1])
            i = names.index(f"B{mb}_l{layer}_combine")
            assert calls[i + 1] == (f"B{mb}_l{layer}_attn_early", calls[i][1])
    # in the merged steps: the side part in slot 2, the early part in slot 1
    assert dict(calls)["F1_l0_attn_side"] == (1, 0, 2) and dict(calls)["B0_l1_attn_early"] == (1, 0, 1)


def test_schedule_wgrad_parts():
    stages, cap = model_stages("mm", wgrad=True)
    program = schedule(stages, cap, 2)
    calls = _calls(program)
    names = [c[0] for c in calls]
    slot = dict(calls)
    # B experts' weight-grad fills slot 3, right before the B dispatch it no longer delays
    assert names[names.index("B0_l1_dispatch") - 1] == "B0_l1_experts_wgrad" and slot["B0_l1_experts_wgrad"] == (1, 0, 3)
    # B attn's weight-grad fills the next pair's slot 1, right before its B combine ...
    assert names[names.index("B0_l0_combine") - 1] == "B0_l1_attn_wgrad" and slot["B0_l1_attn_wgrad"] == (1, 1, 1)
    # ... and the last pair's runs before B embed
    assert names[names.index("B0_model_embed") - 1] == "B0_l0_attn_wgrad"
    # the drain: each wgrad part waits until the next comm stage is issued; the last
    # one (no comm stage after it) right after its parent
    assert names[names.index("B1_model_head"):] == [
        "B1_model_head", "B1_l1_post", "B1_l1_combine", "B1_l1_experts", "B1_l1_dispatch",
        "B1_l1_experts_wgrad", "B1_l1_attn", "B1_l0_post", "B1_l0_combine", "B1_l1_attn_wgrad",
        "B1_l0_experts", "B1_l0_dispatch", "B1_l0_experts_wgrad", "B1_l0_attn", "B1_l0_attn_wgrad",
        "B1_model_embed",
    ]


def test_schedule_expert_wgrad_slot_2():
    """``expert_wgrad_slot=2``: B experts' weight-grad right after B experts, before the F dispatch,
    in slot 2; everything else where the default puts it."""
    stages, cap = model_stages("mm", side=True, early=True, wgrad=True)
    default, program = schedule(stages, cap, 3), schedule(stages, cap, 3, expert_wgrad_slot=2)
    calls = _calls(program)
    names, slot = [c[0] for c in calls], dict(calls)
    for i, (bl, j) in ((i, lj) for i in (1, 2) for lj in ((1, 0), (0, 1))):
        b, f = i - 1, i
        at = names.index(f"B{b}_l{bl}_experts")
        assert names[at:at + 3] == [f"B{b}_l{bl}_experts", f"B{b}_l{bl}_experts_wgrad", f"F{f}_l{j}_dispatch"]
        assert slot[f"B{b}_l{bl}_experts_wgrad"] == (i, j, 2)
    # the rest of the order is the default's: the same list with the moved parts taken out
    moved = {n for n in names if "_experts_wgrad" in n and slot[n] is not None}
    assert [n for n in names if n not in moved] == [n for n in _names(default) if n not in moved]
    assert sorted(names) == sorted(_names(default))
    check_dataflow(program, stages, 3)
    with pytest.raises(ValueError, match="expert_wgrad_slot"):
        schedule(stages, cap, 3, expert_wgrad_slot=4)


def test_schedule_dense_layer_takes_the_experts_slot():
    stages, cap = model_stages("dm")
    slot = dict(_calls(schedule(stages, cap, 2)))
    assert slot["F1_l0_mlp"] == (1, 0, 3)  # F experts' slot, pair 0
    assert slot["B0_l0_mlp"] == (1, 1, 2)  # B experts' slot, pair 1 (backward layer 0)
    assert not any(name.startswith(("F1_l0_d", "F1_l0_c", "B0_l0_d", "B0_l0_c")) for name in slot)


def test_schedule_recompute_right_before_its_first_reader():
    stages, cap = model_stages("mmm", recompute_group=2)
    assert [s.recompute_layers for s in stages if s.kind is K.RECOMPUTE] == [(2,), (0, 1)]
    names = _names(schedule(stages, cap, 3))
    for mb in range(3):
        for top in (2, 1):  # read by each layer's backward attn: the group's top layer's comes first
            i = names.index(f"B{mb}_l{top}_recompute")
            assert names[i + 1] == f"B{mb}_l{top}_attn"
            assert all(not n.startswith(f"B{mb}_l{top}_attn") for n in names[:i])


def test_schedule_forward_only():
    """Forward-only: microbatches in pairs, each one's exchanges issued between the other's
    compute (F0 attn, F0 dispatch, F1 attn, F1 dispatch, F0 experts, F0 combine, F1 experts, ...),
    a last odd one alone in plain order."""
    stages, cap = model_stages("mm", side=True)
    fwd = [s.name.split("_", 1)[1] for s in stages if s.direction is F]
    plain = [s for s in fwd if not s.endswith("_side")]
    for layer in (0, 1):  # the side part right after its dispatch, as in F(0)
        plain.insert(plain.index(f"l{layer}_dispatch") + 1, f"l{layer}_attn_side")
    pair = ["F0_model_embed", "F1_model_embed"]
    for layer in (0, 1):
        for mb in (0, 1):
            pair += [f"F{mb}_l{layer - 1}_post"] * (layer > 0)
            pair += [f"F{mb}_l{layer}_{k}" for k in ("attn", "dispatch", "attn_side")]
        pair += [f"F{mb}_l{layer}_{k}" for mb in (0, 1) for k in ("experts", "combine")]
    pair += [f"F{mb}_{k}" for mb in (0, 1) for k in ("l1_post", "model_head")]
    for n, want in ((1, [f"F0_{s}" for s in plain]), (2, pair), (3, pair + [f"F2_{s}" for s in plain])):
        program = schedule(stages, cap, n, forward_only=True)
        assert _calls(program) == [(c, None) for c in want], n
        check_dataflow(program, stages, n, forward_only=True)
    targets = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert targets == {program_ops.output, program_ops.mutate}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("pattern,parts", CASES, ids=CASE_IDS)
def test_schedule_runs_every_stage_once_after_its_producers(pattern, parts, n):
    stages, cap = model_stages(pattern, **parts)
    check_dataflow(schedule(stages, cap, n), stages, n)


def test_schedule_errors():
    stages, cap = model_stages("m")
    with pytest.raises(ValueError, match="at least one microbatch"):
        schedule(stages, cap, 0)


def test_in_flight_depth_of_schedule():
    """Two microbatches in flight (one for N = 1): what the CUDA-graph runtime's copies rely on."""
    stages, cap = model_stages("mdm", wgrad=True, recompute_group=2)
    for n in (1, 2, 3, 4, 6):
        assert cg.in_flight_depth(schedule(stages, cap, n)) == (1 if n == 1 else 2), n


# ================================================================ streams


def test_streams_events_only_on_cross_stream_edges():
    program = streams(program_of([
        ("a", 0, COMP, ["x"], ["y"]),
        ("b", 0, COMM, ["y"], ["z"]),  # reads a's y across streams: waits on a's event
        ("c", 0, COMM, ["y"], ["w"]),  # the comm stream already waited on a: no second wait
        ("d", 1, COMP, ["z"], ["u"]),  # microbatch 1's z: no stage wrote it, no edge
        ("e", 0, COMP, ["z", "w"], ["v"]),  # reads b's and c's: one wait, on the later one
        ("f", 0, COMP, ["v"], ["t"]),  # same stream: nothing
        ("output", 0, COMP, ["t"], []),
    ]))
    assert listing(program) == [
        "record_event start comp",
        "a", "record_event ev_a comp",
        "wait_event start comm", "wait_event ev_a comm", "b",
        "c", "record_event ev_c comm",
        "d",
        "wait_event ev_c comp", "e",
        "f",
        "output 0 t",
        "record_event end comm", "wait_event end comp",
    ]
    check_cross_stream_order(program)


def test_streams_wait_implied_by_a_later_event_is_left_out():
    program = streams(program_of([
        ("a", 0, COMP, [], ["x"]),
        ("a2", 0, COMP, [], ["x2"]),
        ("b", 0, COMM, ["x2"], ["y"]),  # waits on a2's event, which comes after a's
        ("c", 0, COMM, ["x"], ["z"]),  # so a's x is ready too: no event for a at all
        ("d", 0, COMP, ["y", "z"], []),
    ]))
    assert listing(program) == [
        "record_event start comp", "a", "a2", "record_event ev_a2 comp",
        "wait_event start comm", "wait_event ev_a2 comm", "b", "c", "record_event ev_c comm",
        "wait_event ev_c comp", "d",
        "record_event end comm", "wait_event end comp",
    ]
    check_cross_stream_order(program)


def test_streams_no_comm_no_events():
    program = streams(program_of([("a", 0, COMP, [], ["x"]), ("b", 0, COMP, ["x"], [])]))
    assert listing(program) == ["a", "b"]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("pattern,parts", CASES, ids=CASE_IDS)
def test_streams_order_every_cross_stream_read(pattern, parts, n):
    stages, cap = model_stages(pattern, **parts)
    program = streams(schedule(stages, cap, n))
    check_cross_stream_order(program)
    check_cross_stream_order(free(program, cap))  # frees move no event


def test_cross_stream_check_has_teeth():
    stages, cap = model_stages("mm")
    program = streams(schedule(stages, cap, 2))
    wait = next(n for n in program.graph.nodes if n.target is program_ops.wait_event and n.args[0] != "start")
    with program.graph.inserting_after(wait):  # a second, redundant wait
        program.graph.call_function(program_ops.wait_event, wait.args)
    with pytest.raises(AssertionError, match="implied by an earlier wait"):
        check_cross_stream_order(program)
    program = streams(schedule(stages, cap, 2))
    wait = next(n for n in program.graph.nodes if n.target is program_ops.wait_event and n.args[0] != "start")
    program.graph.erase_node(wait)
    with pytest.raises(AssertionError, match="without waiting on it"):
        check_cross_stream_order(program)


# ================================================================ free


def _free_program(calls, static=("w",), inputs=("inp",), tangents=None, stages=()):
    from types import SimpleNamespace

    cap = SimpleNamespace(static_placeholders=set(static), input_placeholders=list(inputs),
                          tangents=dict(tangents or {}))
    return free(streams(program_of(calls)), cap), cap


def test_free_right_after_last_use_and_after_the_readers_event():
    program, cap = _free_program([
        ("a", 0, COMP, ["inp", "w"], ["x"]),
        ("b", 0, COMM, ["x"], ["y"]),  # x's last reader runs on the comm stream
        ("c", 0, COMP, ["y"], ["z", "unread"]),
        ("output", 0, COMP, ["z"], []),
    ], inputs=("inp", "unused"))
    assert listing(program) == [
        "record_event start comp",
        "free 0 unused",  # an input nothing reads: before the microbatch's first node
        "a", "record_event ev_a comp", "free 0 inp",  # after the event b waits on
        "wait_event start comm", "wait_event ev_a comm", "b", "record_event ev_b comm", "free 0 x",
        "wait_event ev_b comp", "c", "free 0 y unread",  # a value nothing reads: right after its producer
        "output 0 z", "free 0 z",
        "record_event end comm", "wait_event end comp",
    ]
    check_program_frees(program, cap)


def test_value_produced_again_is_freed_per_definition():
    # A recompute stage replays x: the forward x is freed after its last forward
    # reader, not kept alive until the backward.
    program, cap = _free_program([
        ("fwd_a", 0, COMP, ["inp", "w"], ["x", "loss"]),
        ("fwd_b", 0, COMP, ["x"], ["y"]),
        ("rec", 0, COMP, ["inp"], ["x"]),
        ("bwd_a", 0, COMP, ["x", "y", "tan", "w"], ["gw"]),
    ], tangents={"tan": "loss"})
    frees = [(n.prev.name, n.args[1:]) for n in program.graph.nodes if n.target is program_ops.free]
    assert frees == [
        ("fwd_a", ("loss",)),
        ("fwd_b", ("x",)),
        ("rec", ("inp",)),
        ("bwd_a", ("tan", "y", "x", "gw")),
    ]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("pattern,parts", CASES, ids=CASE_IDS)
def test_free_each_value_once_after_its_last_use(pattern, parts, n):
    stages, cap = model_stages(pattern, **parts)
    program = free(streams(schedule(stages, cap, n)), cap)
    assert check_program_frees(program, cap) > 0
    freed = [(n.args[0], v) for n in program.graph.nodes if n.target is program_ops.free for v in n.args[1:]]
    assert not set(freed) & {(mb, v) for mb in range(n) for v in cap.static_placeholders}
    before = program.code
    assert free(program, cap).code == before  # a second run adds nothing


def test_free_treats_cuda_graph_outputs_like_others():
    # Graphed stages' outputs die at their last use too (a copy's graph pool reuses
    # their memory from there, fxoverlap.cudagraphs): marking stages graphed changes no free.
    stages, cap = model_stages("mm", side=True)
    plain = free(streams(schedule(stages, cap, 3)), cap).code
    stages, cap = model_stages("mm", side=True)
    for s in stages:
        s.graphed = s.kind in (K.EXPERTS, K.POST)
    program = free(streams(schedule(stages, cap, 3)), cap)
    assert program.code == plain
    live: dict[int, set[str]] = {mb: {"tokens", "labels", "tangent"} for mb in range(3)}
    for node, step in program_ops.steps(program):
        live[step.microbatch].update(step.writes)
    for node in program.graph.nodes:
        if node.target is program_ops.free:
            live[node.args[0]] -= set(node.args[1:])
    assert all(not v for v in live.values())


# ================================================================ side


def _tagged_graph() -> torch.fx.GraphModule:
    """Layer 0 (MoE): a router the dispatch reads, a shared expert it does not, a
    two-output op; layer 1 (MoE): only a view off the dispatch path; layer 2: dense;
    and layer 0's backward: the attn gradient through the dispatch, and the shared
    expert's, fed by the post backward alone."""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x, w, grad = g.placeholder("x"), g.placeholder("w"), g.placeholder("grad")

    def op(name, target, args, direction, layer, kind):
        n = g.call_function(target, args)
        n.name = name
        n.meta[TAG_KEY] = Tag(direction, layer, kind)
        return n

    norm = op("norm", aten.mul.Tensor, (x, w), F, 0, K.ATTN)
    stats = op("stats", aten.var_mean.correction, (norm,), F, 0, K.ATTN)
    mean = op("mean", operator.getitem, (stats, 0), F, 0, K.ATTN)
    var = op("var", operator.getitem, (stats, 1), F, 0, K.ATTN)
    route = op("route", aten.add.Tensor, (norm, mean), F, 0, K.ATTN)
    shared = op("shared", aten.mul.Tensor, (norm, w), F, 0, K.ATTN)
    shared2 = op("shared2", aten.mul.Tensor, (shared, var), F, 0, K.ATTN)
    d = op("dispatch", aten.add.Tensor, (route, 1), F, 0, K.DISPATCH)
    e = op("experts", aten.mul.Tensor, (d, w), F, 0, K.EXPERTS)
    c = op("combine", aten.add.Tensor, (e, 1), F, 0, K.COMBINE)
    p = op("post", aten.add.Tensor, (c, shared2), F, 0, K.POST)
    a1 = op("attn1", aten.mul.Tensor, (p, w), F, 1, K.ATTN)
    v1 = op("view1", aten.view.default, (a1, [-1]), F, 1, K.ATTN)
    d1 = op("dispatch1", aten.add.Tensor, (a1, 1), F, 1, K.DISPATCH)
    p1 = op("post1", aten.add.Tensor, (d1, v1), F, 1, K.POST)
    a2 = op("attn2", aten.mul.Tensor, (p1, w), F, 2, K.ATTN)
    m2 = op("mlp2", aten.mul.Tensor, (a2, w), F, 2, K.MLP)
    gp = op("g_post", aten.mul.Tensor, (grad, 1), B, 0, K.POST)
    gc = op("g_combine", aten.add.Tensor, (gp, 1), B, 0, K.COMBINE)
    ge = op("g_experts", aten.mul.Tensor, (gc, w), B, 0, K.EXPERTS)
    gd = op("g_dispatch", aten.add.Tensor, (ge, 1), B, 0, K.DISPATCH)
    ga = op("g_attn", aten.mul.Tensor, (gd, norm), B, 0, K.ATTN)
    gs = op("g_shared", aten.mul.Tensor, (gp, norm), B, 0, K.ATTN)
    gsum = op("g_sum", aten.add.Tensor, (ga, gs), B, 0, K.ATTN)
    g.output((m2, gsum))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_side_parts_on_a_hand_built_graph():
    gm = side(_tagged_graph())
    moved = {n.name: n.meta[TAG_KEY].part for n in gm.graph.nodes
             if TAG_KEY in n.meta and n.meta[TAG_KEY].part is not Part.MAIN and n.target is not operator.getitem}
    # forward: what the dispatch does not read runs under it. Layer 1's side part would
    # be only a view, and layer 2 has no dispatch: both keep one attn stage. Backward:
    # what depends on nothing of the layer's backward comm/experts work runs under the
    # combine.
    assert moved == {"shared": Part.SIDE, "shared2": Part.SIDE, "g_shared": Part.EARLY}
    # split of it: the parts are stages of their own (the two-output op's results stay
    # with it: a stage hands out tensors, not tuples), and plain order still holds
    stages = split(gm, 3)
    nodes = {s.name: [n.name for n in s.graph_module.graph.nodes if n.op == "call_function"] for s in stages}
    assert [s.name for s in stages if s.kind is K.ATTN] == [
        "fwd_l0_attn", "fwd_l0_attn_side", "fwd_l1_attn", "fwd_l2_attn", "bwd_l0_attn_early", "bwd_l0_attn"]
    assert nodes["fwd_l0_attn"] == ["norm", "stats", "mean", "var", "route"]
    assert nodes["fwd_l0_attn_side"] == ["shared", "shared2"]
    assert nodes["fwd_l1_attn"] == ["attn1", "view1"]
    assert nodes["bwd_l0_attn_early"] == ["g_shared"] and nodes["bwd_l0_attn"] == ["g_attn", "g_sum"]
    side_stage = next(s for s in stages if s.name == "fwd_l0_attn_side")
    assert side_stage.inputs == ["norm", "w", "var"] and side_stage.outputs == ["shared2"]


def test_side_is_a_no_op_the_second_time():
    gm = side(_tagged_graph())
    tags = {n.name: n.meta.get(TAG_KEY) for n in gm.graph.nodes}
    assert {n.name: n.meta.get(TAG_KEY) for n in side(gm).graph.nodes} == tags


# ================================================================ cudagraph (and split's capturability)


def _with_split_reasons(stages, left_eager: str):
    for s in stages:
        s.not_capturable_reason = (not_capturable_reason(s.name, s.kind, s.graph_module) if s.stream is COMM
                                   else f"stage {s.name}: host sync at node x (aten.item)" if s.name == left_eager
                                   else None)
    return stages


def test_cudagraph_marks_exactly_the_capturable_stages(caplog):
    stages = _with_split_reasons(model_stages("mm")[0], left_eager="fwd_l0_experts")
    code = [s.graph_module.code for s in stages]
    with caplog.at_level(logging.INFO, logger="fxoverlap"):
        cudagraph(stages)
    assert {s.name for s in stages if s.graphed} == {s.name for s in stages if s.stream is COMP} - {"fwd_l0_experts"}
    assert all(s.runs_as == ("graphed" if s.graphed else "eager") for s in stages)
    left = [r for r in caplog.records if "not captured" in r.getMessage()]
    assert len(left) == sum(not s.graphed for s in stages)  # each once
    levels = {r.getMessage().split("not captured: stage ")[1].split(":")[0]: r.levelno for r in left}
    assert levels.pop("fwd_l0_experts") == logging.WARNING  # a compute stage left eager costs launches
    assert levels == {s.name: logging.INFO for s in stages if s.stream is COMM}  # comm stays eager by design
    marks = {s.name for s in stages if s.graphed}
    cudagraph(stages)  # twice: the same
    assert {s.name for s in stages if s.graphed} == marks
    assert [s.graph_module.code for s in stages] == code


def _reason(fn, name="fwd_l0_attn", kind=StageKind.ATTN) -> str | None:
    return not_capturable_reason(name, kind, torch.fx.symbolic_trace(fn))


def test_capturability_reasons():
    def mutates(x, y):
        return torch.ops.aten.add_.Tensor(x, y)

    def views(x):
        return torch.ops.aten.t.default(torch.ops.aten.view.default(x, [4, 4]))

    def computes(x):
        return torch.ops.aten.mul.Tensor(x, 2)

    def syncs(x):
        return torch.ops.aten._local_scalar_dense.default(x)

    r = _reason(mutates)
    assert r is not None and "in-place op at node add_" in r and "aten.add_" in r
    assert "only views" in _reason(views)
    assert _reason(computes) is None
    assert _reason(syncs) == "stage fwd_l0_attn: host sync at node _local_scalar_dense_default (aten._local_scalar_dense)"
    assert "communication stage" in _reason(computes, "fwd_l0_dispatch", StageKind.DISPATCH)


# ---------------------------------------------------------------- split: results of a multi-output op

# On CUDA the backward of SDPA returns a tuple whose pieces a delayed weight-grad split can
# send to different stages; a stage must hand out tensors, never the op's tuple (Inductor's
# and CUDA graphs' outputs are flat).


def test_getitem_follows_its_op():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    top = g.call_function(torch.ops.aten.topk.default, (x, 2))
    values = g.call_function(operator.getitem, (top, 0))
    indices = g.call_function(operator.getitem, (top, 1))
    double = g.call_function(torch.ops.aten.mul.Tensor, (values, 2))
    as_float = g.call_function(torch.ops.aten._to_copy.default, (indices,), {"dtype": torch.float32})
    g.output((double, as_float))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    main = Tag(Direction.BWD, 0, StageKind.ATTN)
    wgrad = main.with_part(Part.WGRAD)
    for n, t in ((top, main), (values, main), (double, main), (indices, wgrad), (as_float, wgrad)):
        n.meta[TAG_KEY] = t
    stages = {s.name: s for s in split(gm, 1)}
    assert set(stages) == {"bwd_l0_attn", "bwd_l0_attn_wgrad"}
    main_nodes = {n.name for n in stages["bwd_l0_attn"].graph_module.graph.nodes}
    assert {top.name, values.name, indices.name} <= main_nodes  # both results stay with topk
    assert top.name not in stages["bwd_l0_attn"].outputs  # the tuple is never handed out
    assert stages["bwd_l0_attn_wgrad"].inputs == [indices.name]
    x_val = torch.randn(4, 8)
    outs = {}
    for s in stages.values():
        args = [x_val if i == "x" else outs[i] for i in s.inputs]
        outs.update(zip(s.outputs, s.graph_module(*args)))
    assert torch.equal(outs[double.name], x_val.topk(2).values * 2)
    assert torch.equal(outs[as_float.name], x_val.topk(2).indices.float())


def test_with_whole_chains_joins_only_matching_versions():
    """chunk.with_whole_chains: the whole chains join the cut stages when everything outside the
    chains is the same and each layer's chunks and whole chain read and hand on the same values;
    otherwise the cut stages alone, with the reason (then every microbatch runs the chunks)."""
    from types import SimpleNamespace

    from fxoverlap.ir.stage import StageKind as K
    from fxoverlap.passes.chunk import with_whole_chains

    def st(name, kind, chunk, inputs, outputs, code="c"):
        return SimpleNamespace(name=name, kind=kind, layer=0, chunk=chunk, inputs=tuple(inputs),
                               outputs=tuple(outputs), graph_module=SimpleNamespace(code=code))

    attn = st("fwd_l0_attn", K.ATTN, None, ["x"], ["h"])
    post = st("fwd_l0_post", K.POST, None, ["combine"], ["y"])
    whole = [attn, st("fwd_l0_dispatch", K.DISPATCH, None, ["h"], ["rows"]),
             st("fwd_l0_experts", K.EXPERTS, None, ["rows"], ["out"]),
             st("fwd_l0_combine", K.COMBINE, None, ["out"], ["combine"]), post]
    cut = [attn, *(st(f"fwd_l0_{k}_c{c}", kind, c, i, o) for c in (0, 1) for k, kind, i, o in (
        ("dispatch", K.DISPATCH, ["h"], [f"rows{c}"]), ("experts", K.EXPERTS, [f"rows{c}"], [f"out{c}"]),
        ("combine", K.COMBINE, [f"out{c}"] + (["part0"] if c else []), [f"part{c}"] if not c else ["combine"]))),
           post]
    joined, why = with_whole_chains(cut, whole)
    assert why is None and [s.name for s in joined[len(cut):]] == ["fwd_l0_dispatch", "fwd_l0_experts", "fwd_l0_combine"]
    # the merge under another name: post would read a value the whole chain does not make
    renamed = cut[:-2] + [st("fwd_l0_combine_c1", K.COMBINE, 1, ["out1", "part0"], ["merged"]),
                          st("fwd_l0_post", K.POST, None, ["merged"], ["y"])]
    joined, why = with_whole_chains(renamed, whole)
    assert joined is renamed and "differs" in why
    # the chunks read a value the whole chain does not
    extra = [cut[0], st("fwd_l0_dispatch_c0", K.DISPATCH, 0, ["h", "x"], ["rows0"]), *cut[2:]]
    joined, why = with_whole_chains(extra, whole)
    assert joined is extra and "read or hand on different values" in why
    # a stage outside the chains compiled differently
    joined, why = with_whole_chains(cut, whole[:-1] + [st("fwd_l0_post", K.POST, None, ["combine"], ["y"], "d")])
    assert joined is cut and "fwd_l0_post" in why
