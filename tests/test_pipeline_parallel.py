"""fxoverlap.pipeline_schedule: torch.distributed.pipelining schedules whose F/B steps run as
fxoverlap programs, against the unpipelined model run eagerly (tests/support/pp_cases.py).

PP 2 x EP 1 on 2 gloo ranks, PP 2 x EP 2 on 4; Schedule1F1B, ScheduleInterleaved1F1B and
ScheduleDualPipeV (which emits OVERLAP_F_B and the BACKWARD_INPUT/BACKWARD_WEIGHT split); 4
microbatches; the reference MoE model, an mHC model and torchtitan's Qwen3-MoE (at EP 1, and
at EP 2 with torchtitan's own EP: DTensor expert weights); PP 2 x DP 2 with DDP stage modules
and with pipeline_schedule(..., dp_group=...), and PP 2 x EP 2 with the EP group as dp_group. With
``compiler="eager"`` the stage programs run eager's kernels in eager's order, and
pipelining accumulates each stage's microbatch gradients in the reference's order, so
losses and gradients are bitwise equal.
"""

from __future__ import annotations

import expecttest
import pytest

import fxoverlap
from fxoverlap.pipeline_parallel import PipelineInputError, UnsupportedSchedule
from fxoverlap.testing import RankError, run_distributed, run_distributed_once

import pp_cases


def _handlers() -> list[str]:
    from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD, OVERLAP_F_B,
                                                        REDUCE_GRAD)

    return sorted(str(k) for k in (FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, REDUCE_GRAD, OVERLAP_F_B))


_HANDLERS = _handlers()


def _check(results: list[dict], schedule: str, n_stages_per_rank: int, overlap: bool, merged: bool | None = True,
           bitwise: bool = True, layerless: tuple[int, ...] = ()) -> None:
    """``layerless``: pipeline stages that hold no decoder layer (torchtitan's split can leave
    the last one with the norm and the head only)."""
    assert any("losses" in r for r in results)
    for r in results:
        where = f"rank {r['rank']} stages {r['stages']}"
        assert r["schedule_type"] == schedule and r["is_subclass"], where
        # fxoverlap's state is in its own objects: nothing _fxoverlap* on pipelining's, the user's
        # stages left as built (the schedule runs fxoverlap's stages built from them)
        assert r["parked"] == [] and r["user_stages_untouched"], (where, r["parked"])
        # the runtime schedules run every backward action and REDUCE_GRAD through fxoverlap's custom
        # functions (FORWARD stays the runtime's); the single-stage ones take none
        assert r["handlers"] == ([] if schedule in ("Schedule1F1B", "ScheduleGPipe") else _HANDLERS), \
            (where, r["handlers"])
        assert not r["missing"], (where, r["missing"])
        assert r["n_grads"] > 0, where
        if bitwise:
            assert r["grad_bitwise"], (where, r["grad_max_abs_diff"], r["grad_max_abs_ref"])
        else:  # fp32: each parameter's gradient within 1e-6 relative (L2)
            assert r["grad_rel_l2"] <= 1e-6, (where, r["grad_rel_l2"])
        if "losses" in r:
            assert r["loss_bitwise"] or (not bitwise and all(
                abs(a - b) <= 1e-6 * abs(b) for a, b in zip(r["losses"], r["ref_losses"]))), \
                (where, r["losses"], r["ref_losses"])
            assert len(r["losses"]) == 4
        # every local stage ran its F steps through fxoverlap, with fxoverlap stages per layer
        assert set(r["fxoverlap_stages"]) == set(r["stages"]) and len(r["stages"]) == n_stages_per_rank, where
        assert all(n == 4 for n in r["forward_calls"].values()), (where, r["forward_calls"])
        for idx, stages in r["fxoverlap_stages"].items():
            assert {d for _, d, _ in stages} == {"fwd", "bwd"}, (where, idx)
            assert idx in layerless or any(layer >= 0 and kind not in ("embed", "head") for kind, _, layer in stages), \
                (where, idx)
        if overlap and merged is None:  # some merged, some not
            assert r["overlap_steps"] > 0, where
        elif overlap and not merged:  # merge=False: F then B, through autograd
            assert r["overlap_steps"] > 0 and r["merged_steps"] == 0 and not r["merged_calls"], where
        elif overlap:  # the OVERLAP_F_B custom function ran the merged steps, F and B in turns
            assert r["overlap_steps"] > 0 and r["merged_steps"] == r["overlap_steps"], where
            assert len(r["merged_calls"]) == r["merged_steps"], where
            for calls in r["merged_calls"]:
                dirs = [d for d, _ in calls]
                if layerless and ("fwd", "dispatch") not in calls:
                    # F of a layerless stage (the head only): no all-to-all to put B's compute
                    # under; F runs, then B
                    assert dirs[0] == "fwd" and "bwd" in dirs and all(k == "head" for d, k in calls if d == "fwd"), \
                        (where, calls)
                    continue
                # interleaved: a backward stage runs before the forward's last stage, and right
                # after the forward's first dispatch (its compute under that all-to-all)
                assert "bwd" in dirs and dirs.index("bwd") < len(dirs) - 1 - dirs[::-1].index("fwd"), (where, calls)
                first_dispatch = calls.index(("fwd", "dispatch"))
                assert calls[first_dispatch + 1][0] == "bwd", (where, calls)


def _check_weight_steps(results: list[dict], schedule: str) -> None:
    """ZeroBubble splits: the weight-gradient parts (expert, attention and MLP weight
    gradients) run inside BACKWARD_WEIGHT actions, where the schedule has them: all of them
    for the ZeroBubble schedules (every backward is I then W), some for DualPipeV (whose
    OVERLAP_F_B steps run full backwards); other schedules compute no such parts."""
    for r in results:
        where = (f"rank {r['rank']} stages {r['stages']}", r["wgrad_calls"])
        w, other = r["wgrad_calls"]["in_W"], r["wgrad_calls"]["elsewhere"]
        if schedule in ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble"):
            assert w > 0 and other == 0, where
        elif schedule == "ScheduleDualPipeV":
            assert w > 0 and other > 0, where
        else:
            assert w == 0 and other == 0, where


def _check_p2p_order(results: list[dict]) -> None:
    """The P2P of each merged OVERLAP_F_B step (DualPipeV): F's output activation is sent as
    soon as F has returned, before B's last stage runs; B's input gradients right after B's
    last stage; F's received input waited before F's first stage, B's received gradients only
    after F's first stage (not both up front); and every send of the step issued once
    (pipelining's later SEND_F / SEND_B find nothing left), in the schedule's count."""
    for r in results:
        where = f"rank {r['rank']} stages {r['stages']}"
        sr, last = r["stage_rank"], r["num_stages"] - 1
        assert r["sends"]["total"] == r["sends"]["actions"] and r["sends"]["early"] > 0, (where, r["sends"])
        merged = [st for st in r["overlap_events"] if st["merged"]]
        assert merged, where
        for st in merged:
            f, b, ev = st["f"], st["b"], st["events"]
            calls = [i for i, e in enumerate(ev) if e[0] in ("fwd", "bwd")]
            fwd = [i for i in calls if ev[i][0] == "fwd"]
            bwd = [i for i in calls if ev[i][0] == "bwd"]
            f_sends = f != last and sr[f + 1] != sr[f]
            b_sends = b != 0 and sr[b - 1] != sr[b]
            f_recvs = f != 0 and sr[f - 1] != sr[f]
            b_recvs = b != last and sr[b + 1] != sr[b]
            what = (where, f, b, ev)
            assert ev.count(("send", "fxoverlap_fwd_send")) == f_sends, what
            assert ev.count(("send", "fxoverlap_bwd_send")) == b_sends, what
            assert not any(e == ("send", "pipelining") for e in ev), what  # nothing sent twice
            if f_sends:  # F's activation goes out while B still has stages to run
                assert fwd[-1] < ev.index(("send", "fxoverlap_fwd_send")) < bwd[-1], what
            if b_sends:
                assert bwd[-1] < ev.index(("send", "fxoverlap_bwd_send")), what
            if f_recvs:
                assert ev.index(("wait", "fwd_recv")) < fwd[0], what
            if b_recvs:  # B's gradients waited after F's first stage, right before B's first
                assert fwd[0] < ev.index(("wait", "bwd_recv")) < bwd[0], what


def _needs_torchtitan() -> None:
    """Skip unless torchtitan 0.3.0 imports: it is not installed, or this torch is older than it
    needs (on torch 2.11 it fails importing torch.distributed.fsdp.DataParallelMeshDims)."""
    pytest.importorskip("torchtitan.models.qwen3", reason="torchtitan 0.3.0 does not import here (not installed, "
                        "or this torch is older than it needs)", exc_type=ImportError)


@pytest.mark.parametrize("schedule,kind", [
    ("Schedule1F1B", "ref"),
    ("ScheduleDualPipeV", "ref"),
    pytest.param("ScheduleInterleaved1F1B", "ref", marks=pytest.mark.slow),
    pytest.param("ScheduleDualPipeV", "mhc", marks=pytest.mark.slow),
    pytest.param("Schedule1F1B", "titan", marks=pytest.mark.slow),
    # with scale_grads=False (the reference's grads not divided)
    pytest.param("ScheduleZBVZeroBubble", "ref", marks=pytest.mark.slow),
    pytest.param("ScheduleInterleavedZeroBubble", "ref", marks=pytest.mark.slow),
])
def test_pp2_ep1(schedule, kind):
    if kind == "titan":
        _needs_torchtitan()
    # the mHC case passes loss_kwargs to step (a loss weight of 0.5, also in the reference)
    opts = {"loss_weight": 0.5} if kind == "mhc" else {"scale_grads": False} if schedule == "ScheduleZBVZeroBubble" else {}
    results = run_distributed_once(pp_cases.run_case, schedule, kind, 1, opts, world_size=2)
    _check(results, schedule, 1 if schedule == "Schedule1F1B" else 2, overlap=schedule == "ScheduleDualPipeV")
    _check_weight_steps(results, schedule)
    if kind == "ref":  # MoE layers: the all-to-alls are stages of their own
        kinds = {k for r in results for st in r["fxoverlap_stages"].values() for k, _, _ in st}
        assert {"dispatch", "experts", "combine"} <= kinds


# both `slow` (4 ranks): by default DualPipeV runs at PP 2 x EP 2 in test_pp2_ep2_dp_group_reduction
# (numerics, merged steps), its p2p order and weight steps at EP 1 (test_pp2_ep1*)
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["Schedule1F1B", "ScheduleDualPipeV"])
def test_pp2_ep2(schedule):
    results = run_distributed(pp_cases.run_case, schedule, "ref", 2, world_size=4)
    _check(results, schedule, 1 if schedule == "Schedule1F1B" else 2, overlap=schedule == "ScheduleDualPipeV")
    _check_weight_steps(results, schedule)
    if schedule == "ScheduleDualPipeV":
        _check_p2p_order(results)


def test_pp2_ep1_dualpipe_p2p_order():
    """DualPipeV, PP 2 x EP 1 (the same spawn as test_pp2_ep1's): in each merged OVERLAP_F_B
    step F's activation send is issued before B's last stage runs, B's gradient send when B
    ends, each receive waited right before its data is used (_check_p2p_order)."""
    results = run_distributed_once(pp_cases.run_case, "ScheduleDualPipeV", "ref", 1, {}, world_size=2)
    _check(results, "ScheduleDualPipeV", 2, overlap=True)
    _check_p2p_order(results)


@pytest.mark.slow
def test_pp2_ep1_dualpipe_defer_pp_recv_keeps_p2p_order():
    """DualPipeV with defer_pp_recv=True: on the lower PP rank pipelining flushes the deferred
    receives from the peer right before each send to it (its deadlock-free order), so a RECV
    sits between an OVERLAP_F_B step and its SEND actions; that rank's steps send nothing early
    (pipelining's SEND actions send), the higher rank's still do. Bitwise, nothing sent twice."""
    import inspect

    from torch.distributed.pipelining import ScheduleDualPipeV

    if "defer_pp_recv" not in inspect.signature(ScheduleDualPipeV.__init__).parameters:
        pytest.skip("this torch's ScheduleDualPipeV has no defer_pp_recv (torch 2.11's has none)")
    results = run_distributed(pp_cases.run_case, "ScheduleDualPipeV", "ref", 1,
                              {"schedule_kwargs": {"defer_pp_recv": True}}, world_size=2)
    _check(results, "ScheduleDualPipeV", 2, overlap=True)
    by_rank = {r["rank"]: r for r in results}
    for r in results:
        assert r["sends"]["total"] == r["sends"]["actions"], r["sends"]
    assert by_rank[0]["sends"]["early"] == 0, by_rank[0]["sends"]
    assert by_rank[1]["sends"]["early"] > 0, by_rank[1]["sends"]


# DualPipeV: its merged OVERLAP_F_B steps and its plain F/B both run; Schedule1F1B with torchtitan's
# model is tested at EP 1 (test_pp2_ep1), and at EP 2 it passed too (kept out of CI for its time)
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ScheduleDualPipeV"])
def test_pp2_ep2_torchtitan_expert_parallel(schedule):
    """torchtitan 0.3.0's Qwen3-MoE with torchtitan's own EP: split by torchtitan's _split_module,
    each stage module then parallelized by torchtitan (ParallelDims(pp=2, ep=2): DTensor expert
    weights, its AllToAllTokenDispatcher with split sizes read on the host), as its pipeline_llm
    does; the reference is the whole model parallelized the same way, run eagerly. The stage
    graphs take the experts' local shards (the experts read only w.to_local()), the split sizes
    stay in the graph as unbacked sizes. Losses and gradients bitwise; every expert gradient a
    DTensor with the reference's mesh and placements; the all-to-alls in dispatch/combine
    stages; every OVERLAP_F_B merged (DualPipeV; its 4-stage split leaves stage 3 the norm and
    the head only)."""
    _needs_torchtitan()
    results = run_distributed(pp_cases.run_case, schedule, "titan", 2, world_size=4)
    dualpipe = schedule == "ScheduleDualPipeV"
    _check(results, schedule, 2 if dualpipe else 1, overlap=dualpipe, layerless=(3,) if dualpipe else ())
    # decoder layers per stage as torchtitan splits 4 layers (embedding and head weighing a layer each)
    layers = {0: 1, 1: 2, 2: 1, 3: 0} if dualpipe else {0: 2, 1: 2}
    for r in results:
        # a DTensor gradient for each expert weight (w1, w2, w3) of each MoE layer of this rank's stages
        assert r["dtensor_grads"] == 3 * sum(layers[s] for s in r["stages"]), (r["stages"], r["dtensor_grads"])
        assert not r["grad_kinds_differ"], r["grad_kinds_differ"]
        kinds = {k for st in r["fxoverlap_stages"].values() for k, _, _ in st}
        assert {"dispatch", "experts", "combine"} <= kinds, kinds


@pytest.mark.slow  # 4 ranks; AC and the padded dispatcher run without PP in the default suite
@pytest.mark.parametrize("kind,config", [
    ("ac", {}),  # activation checkpointing: the layers' recompute stages inside each stage program
    ("ref", {"dispatcher": "padded"}),  # a static dispatcher
])
def test_pp2_ep2_composes(kind, config):
    results = run_distributed(pp_cases.run_case, "ScheduleDualPipeV", kind, 2, {"config": config}, world_size=4)
    _check(results, "ScheduleDualPipeV", 2, overlap=True)
    kinds = {k for r in results for st in r["fxoverlap_stages"].values() for k, _, _ in st}
    if kind == "ac":
        assert "recompute" in kinds, kinds


@pytest.mark.slow
def test_stage_without_layer_list_raises():
    (res,) = run_distributed(pp_cases.error_case, "nolist", world_size=1)
    assert res["raised"]
    names = [n for n, _ in res["chain"]]
    assert "StageLayersNotFound" in names, res["chain"]
    msg = dict(res["chain"])["StageLayersNotFound"]
    assert "pipeline stage 0" in msg and "ModuleDict" in msg and "layer_container" in msg


def test_stage_with_dtensor_used_beyond_to_local_raises():
    """A DTensor parameter the stage module reads other than through to_local() (here
    full_tensor()): the stage compile names the stage, the graph input and the fix."""
    (res,) = run_distributed(pp_cases.error_case, "dtensor", world_size=1)
    assert res["raised"]
    names = [n for n, _ in res["chain"]]
    assert "PipelineError" in names, res["chain"]
    msg = dict(res["chain"])["PipelineError"]
    assert "pipeline stage 0 (DTensorHeadStage)" in msg and "is a DTensor" in msg and "full_tensor" in msg, msg
    assert "to_local()" in msg and "fxoverlap.optimize" in msg, msg


def test_unsupported_schedule_raises():
    from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleLoopedBFS

    class MySchedule(ScheduleDualPipeV):  # a subclass may change what the actions mean
        pass

    for cls in (ScheduleLoopedBFS, MySchedule, object, "Schedule1F1B"):
        with pytest.raises(UnsupportedSchedule, match="Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, "
                                                      "ScheduleDualPipeV, ScheduleInterleavedZeroBubble"):
            fxoverlap.pipeline_schedule(cls, [], 4)
    assert issubclass(UnsupportedSchedule, fxoverlap.FxOverlapError) and issubclass(UnsupportedSchedule, TypeError)
    from torch.distributed.pipelining import Schedule1F1B

    with pytest.raises(PipelineInputError, match="Schedule1F1B takes one PipelineStage, got a list"):
        fxoverlap.pipeline_schedule(Schedule1F1B, [], 4)
    with pytest.raises(PipelineInputError, match="ep_group must be a torch.distributed ProcessGroup or None, got str"):
        fxoverlap.pipeline_schedule(Schedule1F1B, None, 4, ep_group="ep")


@pytest.mark.slow
def test_pp2_ep2_overlap_f_b_unmerged():
    """merge=False: each OVERLAP_F_B runs F then B through autograd; the same gradients."""
    results = run_distributed(pp_cases.run_case, "ScheduleDualPipeV", "ref", 2, {"merge": False}, world_size=4)
    _check(results, "ScheduleDualPipeV", 2, overlap=True, merged=False)


def test_pp2_ep1_gradient_hook_keeps_autograd():
    """A post-accumulate-grad hook on a parameter of the last stage: that stage's backward
    stays in autograd (the hook runs once per microbatch), the other stages' merge; the
    gradients are the same."""
    results = run_distributed(pp_cases.run_case, "ScheduleDualPipeV", "ref", 1, {"hook": True}, world_size=2)
    _check(results, "ScheduleDualPipeV", 2, overlap=True, merged=None)
    by_rank = {r["rank"]: r for r in results}
    assert by_rank[0]["hook_calls"] == 4  # rank 0 holds the last stage (3): one call per microbatch
    assert 0 < by_rank[0]["merged_steps"] < by_rank[0]["overlap_steps"]  # B of stage 3 stayed in autograd
    assert by_rank[1]["merged_steps"] == by_rank[1]["overlap_steps"]


@pytest.mark.parametrize("schedule", ["Schedule1F1B", pytest.param("ScheduleDualPipeV", marks=pytest.mark.slow)])
def test_pp2_dp2_ddp_stage_modules(schedule):
    """PP 2 x DP 2: each stage module in DistributedDataParallel over its DP group. DDP
    reduces at the stage's last backward: with DualPipeV that is the last microbatch's
    BACKWARD_INPUT (the whole backward runs there), which pipelining does not flag as the
    last. Against the eager model's gradients averaged over DP: fp32, 1e-6 relative (the
    reduction adds in another order)."""
    results = run_distributed(pp_cases.run_dp_case, schedule, world_size=4)
    for r in results:
        assert not r["missing"] and r["n_grads"] > 0, r
        assert r["max_abs_diff"] <= 1e-6 * r["max_abs_ref"], r
        assert all(n > 0 for n in r["stages"].values()), r


@pytest.mark.slow  # 4 ranks; test_pp2_ep2_dp_group_reduction[ScheduleDualPipeV] reduces over dp_group
@pytest.mark.parametrize("schedule", ["Schedule1F1B", "ScheduleDualPipeV"])
def test_pp2_dp2_dp_group_reduction(schedule):
    """PP 2 x DP 2 with fxoverlap's own reduction: plain stage modules, pipeline_schedule(...,
    dp_group=...). Each stage's gradients are all-reduced over its DP group once per step, the
    reduction issued right after the stage's last backward (its 4th) and finished at the end of
    the step, before pipelining's scaling; two steps (zeroed in between) to see it again. Against
    the eager model's gradients averaged over DP: fp32, 1e-6 relative per parameter (the
    reduction sums and divides in another order; measured bitwise here: with 2 DP ranks a sum
    of two is order-free and the divisions by 2 and 4 are exact). DualPipeV's OVERLAP_F_B
    steps all merge (no DDP hooks to keep them in autograd). reduce_bucket_mb=0.001 (1 KiB):
    several buckets per stage."""
    results = run_distributed(pp_cases.run_dp_case, schedule, "dp_group",
                              {"steps": 2, "config": {"reduce_bucket_mb": 0.001}}, world_size=4)
    for r in results:
        assert not r["missing"] and r["n_grads"] > 0, r
        assert r["grad_rel_l2"] <= 1e-6 and r["max_abs_diff"] <= 1e-6 * r["max_abs_ref"], r
        stages = sorted(r["stages"])
        assert all(n > 0 for n in r["stages"].values()), r
        # once per stage per step, after its last backward
        assert sorted(r["reduce_starts"]) == sorted([(s, 4) for s in stages] * 2), r["reduce_starts"]
        assert all(n > 1 for n in r["buckets"].values()), r["buckets"]
        # EP 1: the expert parameters (found from the stage graphs) reduce over dp_group as the
        # dense ones do, so each stage has one reducer, over 2 ranks, dividing by 2
        assert r["expert_params"] == r["want_expert_params"] and r["expert_params"], r["expert_params"]
        assert all(len(red) == 1 and red[0][:2] == (2, 2) for red in r["reducers"].values()), r["reducers"]
        if schedule == "ScheduleDualPipeV":
            assert r["overlap_steps"] > 0 and r["merged_steps"] == r["overlap_steps"], r


@pytest.mark.parametrize("schedule", [pytest.param("Schedule1F1B", marks=pytest.mark.slow), "ScheduleDualPipeV"])
def test_pp2_ep2_dp_group_reduction(schedule):
    """PP 2 x EP 2 with pipeline_schedule(..., dp_group=...), the DP group being the EP group
    (each pipeline rank's 2 ranks, each with its own data and 2 of the 4 experts;
    expert_dp_group=None: no other rank holds a rank's experts). As fxoverlap.optimize reduces:
    dense gradients averaged over dp_group, expert gradients (which already sum over the EP
    group's tokens) only divided by |dp_group|. Which parameters are expert is read from each
    stage's compiled graphs (only experts stages read them): here the experts' w1/w2/w3, two
    reducers per stage (dense over 2 ranks, expert alone, both dividing by 2). Against the
    eager model reduced so: every gradient within 1e-6 relative (measured: bitwise), losses
    bitwise; reductions issued once per stage per step after its 4th backward (DualPipeV's: after
    its BACKWARD_WEIGHT), two steps for DualPipeV. Reducing the expert gradients over dp_group
    like the dense ones is off by ~1 here. A wrong expert_dp_group (dp_group itself, or a group
    of the EP peer alone) is refused with check_groups' message."""
    steps = 2 if schedule == "ScheduleDualPipeV" else 1
    results = run_distributed(pp_cases.run_dp_case, schedule, "dp_group",
                              {"ep": 2, "steps": steps, "config": {"reduce_bucket_mb": 0.001}}, world_size=4)
    for r in results:
        assert not r["missing"] and r["n_grads"] > 0, r
        assert r["grad_rel_l2"] <= 1e-6 and r["max_abs_diff"] <= 1e-6 * r["max_abs_ref"], r
        if r["loss_bitwise"] is not None:
            assert r["loss_bitwise"] and r["n_losses"] == 4, r
        stages = sorted(r["stages"])
        assert sorted(r["reduce_starts"]) == sorted([(s, 4) for s in stages] * steps), r["reduce_starts"]
        assert r["expert_params"] == r["want_expert_params"] and r["expert_params"], r["expert_params"]
        for s, red in r["reducers"].items():
            assert [(size, div) for size, div, _ in red] == [(2, 2), (1, 2)], (s, red)
        if schedule == "ScheduleDualPipeV":
            assert r["overlap_steps"] > 0 and r["merged_steps"] == r["overlap_steps"], r
        me, peer = r["rank"], r["rank"] ^ 1
        dp = sorted((me, peer))
        assert r["errors"]["expert_dp_is_dp"] == (
            f"GradReduceConfigError: fxoverlap.pipeline_schedule: expert_dp_group has 2 ranks {dp}, but "
            f"|dp_group| / |ep_group| = 2 / 2 = 1: each rank's experts are replicated on one rank of every EP "
            f"group"), r["errors"]
        assert r["errors"]["expert_dp_of_peer"].startswith(
            f"GradReduceConfigError: fxoverlap.pipeline_schedule: rank {me} is not a member of expert_dp_group"), \
            r["errors"]


@pytest.mark.slow
def test_pp1_dp4_ep2_expert_dp_group():
    """An expert_dp_group of more than one rank: PP 1 x DP 4 with EP 2 inside on 4 ranks (each
    rank a one-stage pipeline, Schedule1F1B, 4 microbatches; dp_group the world, EP groups
    {0, 1} / {2, 3}, expert_dp_group {0, 2} / {1, 3}). Two reducers: dense over the 4 ranks,
    expert over the 2 that hold the same experts, both dividing by 4. Against the eager model
    reduced so: every gradient within 1e-6 relative (a sum of 4 in another order; measured
    7e-8), losses bitwise."""
    results = run_distributed(pp_cases.run_edp_case, world_size=4)
    for r in results:
        assert not r["missing"] and r["n_grads"] > 0, r
        assert r["grad_rel_l2"] <= 1e-6 and r["max_abs_diff"] <= 1e-6 * r["max_abs_ref"], r
        assert r["loss_bitwise"], r
        assert r["expert_params"] == r["want_expert_params"] and r["expert_params"], r["expert_params"]
        assert [(size, div) for size, div, _ in r["reducers"]] == [(4, 4), (2, 4)], r["reducers"]


def test_dp_group_errors():
    """pipeline_schedule(dp_group=...) refuses what it cannot reduce (2 ranks, one pipeline)."""
    res = run_distributed(pp_cases.dp_error_case, world_size=2)[0]
    assert res["not_group"].startswith("PipelineInputError: dp_group must be a torch.distributed ProcessGroup"), res
    assert res["ddp"].startswith("PipelineInputError: pipeline stage 0 (DistributedDataParallel) is wrapped in "
                                 "DistributedDataParallel and dp_group is given"), res
    assert res["reduce_scatter"].startswith("PipelineError: pipeline_schedule(dp_group=...) reduces with "
                                            "all_reduce"), res
    assert res["bucket_without_dp"].startswith("PipelineError: pipeline_schedule cannot honour OverlapConfig "
                                               "fields ['reduce_bucket_mb']"), res
    assert "dp_group=...) reduces them" in res["bucket_without_dp"], res
    assert res["shares_pipeline"].startswith("PipelineInputError: pipeline stage 0 (MoEStage): dp_group [0, 1] and "
                                             "the pipeline group [0, 1] share ranks [0, 1]"), res
    # the groups are checked as fxoverlap.optimize checks them (grad_reduce.check_groups)
    assert res["expert_dp_without_dp"].startswith("GradReduceConfigError: fxoverlap.pipeline_schedule: "
                                                  "expert_dp_group needs dp_group"), res
    assert res["ep_outside_dp"] == ("GradReduceConfigError: fxoverlap.pipeline_schedule: ep_group [0, 1] is not "
                                    "inside dp_group [0]; expert parallelism runs inside data parallelism"), res
    assert res["expert_dp_not_group"].startswith("PipelineInputError: expert_dp_group must be a torch.distributed "
                                                 "ProcessGroup or None, got list"), res


@pytest.mark.slow
def test_pp2_ep2_hf_qwen3_moe():
    """Hugging Face Qwen3-MoE after fxoverlap.expert_parallel, split into 4 stage modules that
    compute positions, mask and rotary embeddings as the model's forward does (pp_cases.HFStage),
    under DualPipeV on PP 2 x EP 2. Not bitwise: the backend's HF graphs differ from HF eager
    by a few fp32 roundings without PP too (test_hf_models.py: <= 4e-7); measured here
    <= 5.5e-7 per parameter (relative L2), losses bitwise."""
    results = run_distributed(pp_cases.run_case, "ScheduleDualPipeV", "hf", 2, world_size=4)
    _check(results, "ScheduleDualPipeV", 2, overlap=True, bitwise=False)


@pytest.mark.slow  # test_pp2_ep1_gradient_hook_keeps_autograd keeps a stage's backward in autograd by default
def test_pp2_ep1_graph_break_keeps_autograd():
    """A graph break before the head: the last stage runs as two fxoverlap graphs, so its
    backward stays in autograd (the second graph's input is no leaf); the others merge."""
    results = run_distributed(pp_cases.run_case, "ScheduleDualPipeV", "ref", 1, {"stage_cls": "BreakStage"},
                              world_size=2)
    _check(results, "ScheduleDualPipeV", 2, overlap=True, merged=None)
    by_rank = {r["rank"]: r for r in results}
    assert by_rank[0]["graphs"] == {0: 1, 3: 2}, by_rank[0]["graphs"]
    assert 0 < by_rank[0]["merged_steps"] < by_rank[0]["overlap_steps"]
    assert by_rank[1]["merged_steps"] == by_rank[1]["overlap_steps"]


class MergedStepSnapshot(expecttest.TestCase):
    """One rank's merged OVERLAP_F_B step under DualPipeV (PP 2 x EP 1, the reference model): the
    stage calls of F(i) and B(j) in the order they ran (the same spawn as test_pp2_ep1's case)."""

    def test_first_merged_step_of_rank0(self):
        results = run_distributed_once(pp_cases.run_case, "ScheduleDualPipeV", "ref", 1, {}, world_size=2)
        calls = next(r for r in results if r["rank"] == 0)["merged_calls"][0]
        self.assertExpectedInline(" ".join(f"{d}:{k}" for d, k in calls), """fwd:embed fwd:attn fwd:dispatch bwd:head bwd:post bwd:combine fwd:attn.side fwd:experts fwd:combine bwd:attn.early bwd:experts bwd:dispatch fwd:post bwd:attn bwd:experts.wgrad""")
