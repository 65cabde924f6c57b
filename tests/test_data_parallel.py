"""Expert parallelism inside data parallelism: gradient reductions inside the program.

One 4-rank gloo spawn (EP 2 x DP 2, ``dp_cases.everything``) serves the distributed tests (two
`slow` ones the torchtitan-style model's numerics, and the reference model's at 1 microbatch
with the CPU timeline);
the snapshot of the program with its reduction nodes is single-rank (the reduce pass
needs no process group).

Tolerance (DESIGN.md): max abs grad diff <= 1e-6 * max |reference grad|. Expert gradients
sum over 2 ranks (a + b: no order to differ) and are bitwise equal to the reference; dense
ones sum over 4 ranks, and gloo's ring sums an element in an order that depends on where it
sits in the buffer, so per-parameter reductions (the reference) and flat buckets differ in
the last bits. Reducing the reference on flat buffers of the engine's layout is bitwise
equal, which shows that the order is the only difference.
"""

from __future__ import annotations

import functools

import expecttest
import pytest
import torch

import dp_cases
import fxoverlap
from fxoverlap.passes.free import free
from fxoverlap.passes.reduce import ALIGN, parameter_roles, reduce
from fxoverlap.passes.schedule import schedule
from fxoverlap.passes.streams import streams
from fxoverlap.testing import run_distributed
from fxoverlap.ir.program import program_of
from snapshot_utils import render_program, requires_pinned_torch
from test_snapshots import _stages as _build_stages

# The default suite runs the reference model's numerics with every other case in one spawn;
# the torchtitan-style model's numerics are `slow` (CI's second step), in a spawn of their own.
_RESULTS: dict[str, list] = {}


def _everything(model: str = "moe") -> list[dict]:
    """The default spawn (the reference model at 3 microbatches, and every other case), or a slow
    one: the torchtitan-style model ("titan"), the reference model at 1 microbatch with the CPU
    timeline ("moe-1")."""
    if model not in _RESULTS:
        args = {"moe": (["moe"], True, (3,), False), "moe-1": (["moe"], False, (1,), True),
                "titan": (["titan"], False, (1, 3), False)}[model]
        _RESULTS[model] = run_distributed(dp_cases.everything, *args, world_size=4)
    return _RESULTS[model]


CASES = [(m, d, mode, n) if (m, n) == ("moe", 3) else pytest.param(m, d, mode, n, marks=pytest.mark.slow)
         for m in ("moe", "titan") for d in (False, True) for mode in ("all_reduce", "reduce_scatter") for n in (1, 3)]


@pytest.mark.parametrize("model,delay_wgrad,mode,n", CASES)
def test_gradients_match_eager_plus_manual_reduction(model, delay_wgrad, mode, n):
    for rank, res in enumerate(_everything("moe-1" if (model, n) == ("moe", 1) else model)):
        rows = [r for r in res["numerics"] if r.get("n") == n and r["model"] == model
                and r["delay_wgrad"] == delay_wgrad and r["mode"] == mode]
        assert len(rows) == 1, rows
        r = rows[0]
        assert r["missing"] == [], r
        assert r["diff"] <= 1e-6 * r["scale"], r
        assert r["bitwise"]["expert"], r  # 2-rank sums
        assert r["flat_bitwise"] == {"expert": True, "dense": True}, r
        assert r["buckets"] == r["reduce_nodes"] == r["finish_nodes"] > 0, r
        assert r["leftover"] == {}, r  # the free pass dropped every gradient and pending reduction
        if mode == "reduce_scatter":
            assert r["p_grad_left"] == [], r  # ZeRO-2: no full gradient is kept
            assert r["shard_elements"] > 0, r
        # the program order: no bucket before its last contribution, the reductions of
        # layers L-1..1 before the backward of layer 0 ends (before it starts without
        # delayed wgrad), every reduction waited for at the end
        assert r["after_contributions"] and r["finishes_last"] and r["upper_before_l0_ends"], r
        assert r["upper_buckets"] >= 3, r  # layer 1: attn early, experts, attn
        if not delay_wgrad:
            assert r["upper_before_l0_starts"], r


@pytest.mark.parametrize("model", ["moe", pytest.param("titan", marks=pytest.mark.slow)])
def test_shards_partition_the_buckets(model):
    """reduce_scatter: the two ranks of a group own disjoint halves; together, everything."""
    res = _everything(model)
    sizes = [next(r["shard_elements"] for r in rk["numerics"] if r.get("mode") == "reduce_scatter"
                  and r["model"] == model and r.get("n") == 3 and not r["delay_wgrad"]) for rk in res]
    assert len(set(sizes)) <= 2 and all(s > 0 for s in sizes), sizes


def test_grad_table_names_the_group_of_every_parameter():
    res = _everything()
    for rank, rk in enumerate(res):
        table = next(r["grad_table"] for r in rk["numerics"] if "grad_table" in r and r["mode"] == "all_reduce")
        lines = table.splitlines()
        assert lines[0].split()[:4] == ["param", "role", "reduces", "over"], table
        rows = {ln.split()[0]: ln for ln in lines[1:]}
        edp = "[0, 2]" if rank % 2 == 0 else "[1, 3]"
        for name, line in rows.items():
            if dp_cases.is_expert(name):
                assert f"expert  expert_dp_group  {edp}" in line, line
            else:
                assert "dense   dp_group         [0, 1, 2, 3]" in line, line
        assert "layers.1.moe.experts.w1" in rows and "tok_embeddings.weight" in rows


def test_ep1_every_parameter_over_dp_group():
    for r in _everything():
        e = r["ep1"]
        assert e["missing"] == [] and e["diff"] <= 1e-6 * e["scale"], e
        assert e["roles"] == ["dense", "expert"], e  # 25 MiB buckets: one per role here
        assert "expert_dp_group" in e["table"] and "[0, 1, 2, 3]" in e["table"], e["table"]
        assert all("[0, 1, 2, 3]" in ln for ln in e["table"].splitlines()[1:]), e["table"]


def test_optimizer_step_on_shards_matches_full_step():
    for r in _everything():
        t = r["train"]
        for mode in ("all_reduce", "reduce_scatter"):
            assert t["worst"][mode] <= 1e-6 * t["scale"], t
            assert t["agree"][mode], t  # replicas stay equal after the steps
        # a rank holds about half of the parameters (dense over 4 ranks: a quarter)
        assert 0 < t["shard_elements"] < t["full_elements"] / 2, t


@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("calls", [[2, 2], [2, 1, 3]])
def test_accumulation_over_calls_matches_eager_plus_manual_reduction(mode, calls):
    """forward_backward called 2 and 3 times with no zero_grad between (microbatches per call:
    ``calls``): p.grad (ZeRO-2: the shards' .grad) is the average over the DP ranks of the
    sum of every call's gradients (issue 34, item 7: the experts were 36 % off). Each call
    reduces its own gradients and adds the average: against the reference summed over calls
    first, the sums differ in association only (<= 1e-6 * scale); against the same per-call
    reduction the experts are bitwise, and with gloo's order (flat buffers) everything is."""
    for rank, res in enumerate(_everything()):
        rows = [r for r in res["accumulation"] if r["mode"] == mode and r["calls"] == calls]
        assert len(rows) == 1, rows
        r = rows[0]
        for key in ("sum", "per_call", "flat"):
            assert r[key]["missing"] == [] and r[key]["diff"] <= 1e-6 * r[key]["scale"], (rank, key, r)
        assert r["per_call"]["bitwise"]["expert"], r
        assert r["flat"]["bitwise"] == {"expert": True, "dense": True}, r
        if mode == "all_reduce":
            assert r["same_grad_storage"], r  # accumulated in place: no second gradient kept
        else:
            assert r["p_grad_left"] == [], r


@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_clip_grad_norm_after_accumulation_matches_eager(mode):
    """clip_grad_norm_ after 2 and 3 accumulating calls: the engine's norm and clipped
    gradients equal eager's (bitwise against the flat-order reference); ZeRO-2: the global
    norm from the shards (docs/data_parallel.md's recipe) equals the reference's."""
    for res in _everything():
        for r in (x for x in res["accumulation"] if x["mode"] == mode):
            c = r["clip"]
            if mode == "all_reduce":
                assert c["norm"] > c["max_norm"], c  # the clip scales the gradients
                assert c["norm_vs_sum"] <= 1e-6 * c["norm"] and c["norm_bitwise_flat"], c
                assert c["sum"]["diff"] <= 1e-6 * c["sum"]["scale"], c
                assert c["flat"]["bitwise"] == {"expert": True, "dense": True} and c["flat"]["missing"] == [], c
            else:
                assert abs(c["norm"] - c["ref"]) <= 1e-6 * c["ref"], c


@pytest.mark.slow
def test_cpu_timeline_reductions_overlap_the_backward():
    """Measured on CPU (gloo runs each reduction on its own thread while the rank computes).

    A dense reduction can only finish once every rank of the world has issued it, and the two
    EP pairs drift apart on 2 shared cores; so the measure is against the world's last rank
    to finish B(N-1)'s layer 0: how many reductions of layers L-1..1 had completed by then."""
    res = _everything("moe-1")
    l0_end = max(r["timeline"]["l0_end"] for r in res)
    upper, done_early = 0, 0
    exposed = []
    for r in res:
        t = r["timeline"]
        assert t["order"]["upper_before_l0_starts"] and t["order"]["after_contributions"], t["order"]
        done = {b: tt for ev, b, tt, _ in t["trace"] if ev == "done"}
        issue = {b: tt for ev, b, tt, _ in t["trace"] if ev == "issue"}
        for b, layer in t["bucket_layer"].items():
            if layer is not None and layer >= 1:
                upper += 1
                done_early += done[b] <= l0_end
                assert issue[b] <= t["l0_start"], (b, issue[b], t["l0_start"])  # issued before layer 0's backward
        exposed.append(sum(1 for ev, _, _, was_done in t["trace"] if ev == "wait" and not was_done))
    share = done_early / upper
    print(f"\nCPU timeline: {done_early}/{upper} reductions of layers >= 1 done before the backward of layer 0 "
          f"ended; reductions still running at their wait, per rank: {exposed}")
    assert share >= 0.5, (share, exposed)


def test_bad_groups_fail_at_optimize():
    for rank, r in enumerate(_everything()):
        e = r["errors"]
        assert all(msg is not None for msg in e.values()), e
        if rank == 3:
            assert "rank 3 is not a member of dp_group" in e["dp_not_dividing_world_or_not_member"], e
        else:
            assert "dp_group has 3 ranks [0, 1, 2], which does not divide the world of 4" in \
                e["dp_not_dividing_world_or_not_member"], e
        assert "expert_dp_group has 4 ranks" in e["expert_dp_wrong_size"], e
        assert "meet ep_group" in e["expert_dp_is_ep"], e
        assert "pass expert_dp_group" in e["expert_dp_missing"], e
        assert "expert_dp_group needs dp_group" in e["expert_dp_without_dp"], e
        assert "needs dp_group" in e["reduce_scatter_without_dp"], e
        assert "is not inside dp_group" in e["ep_not_in_dp"], e


# ---------------------------------------------------------------- single rank


@functools.cache
def _stages():
    return _build_stages()



def test_roles_and_layout():
    cap, _, stages = _stages()
    roles = parameter_roles(cap)
    assert {k for k, v in roles.items() if v == "expert"} == {f"layers.0.moe.experts.w{i}" for i in (1, 2, 3)}
    program = reduce(schedule(stages, cap, 2), cap, bucket_bytes=25 * 2**20)
    buckets = program_of(program).buckets
    assert [b.role for b in buckets] == ["dense", "expert"]  # a small model: one bucket per role
    for b in buckets:
        ends = [s.offset + s.numel for s in b.slots]
        assert all(s.offset % ALIGN == 0 for s in b.slots)
        assert all(nxt.offset >= end for nxt, end in zip(b.slots[1:], ends))
        assert b.padded_numel(4) % 4 == 0 and b.padded_numel(4) >= b.numel
        assert b.shard(3, 4)[1] == b.padded_numel(4)
    assert {s.param for b in buckets for s in b.slots} == set(cap.grads.values())


def test_roles_of_hugging_face_experts():
    """Hugging Face experts transpose their stacked weights before the dispatch, so the
    transpose lands in an attn stage: the roles follow such ops to the experts stage."""
    pytest.importorskip("transformers")
    import hf_cases
    from fxoverlap.passes import capture, tag

    model = fxoverlap.expert_parallel(hf_cases.build("qwen3_moe"), None)
    cap = capture(model, (hf_cases.batches(0, n=1)[0],), hf_cases.next_token_loss)
    tag(cap)
    roles = parameter_roles(cap)
    experts = {k for k, v in roles.items() if v == "expert"}
    assert experts == {k for k in roles if ".mlp.experts." in k} and experts, roles


@requires_pinned_torch
class TestReduceSnapshots(expecttest.TestCase):
    def test_program_with_reductions(self):
        """2 microbatches, one bucket per backward stage and role: B0 accumulates into p.grad
        as before; B1's gradients go to reduce_grads right after their stage."""
        cap, _, stages = _stages()
        program = reduce(schedule(stages, cap, 2), cap, bucket_bytes=0)
        text = render_program(program)
        self.assertExpectedInline(text[text.index("B0_model_embed ="):], """\
B0_model_embed = self.bwd_model_embed(0)
accumulate_B0_model_embed = fxoverlap_program_accumulate(0, 'embedding_dense_backward')
B1_model_head = self.bwd_model_head(1)
reduce_bucket0 = fxoverlap_program_reduce_grads(1, 0, 't_19', 'view_27')
B1_l1_mlp = self.bwd_l1_mlp(1)
reduce_bucket1 = fxoverlap_program_reduce_grads(1, 1, 't_23', 't_27', 't_31')
B1_l1_attn = self.bwd_l1_attn(1)
reduce_bucket2 = fxoverlap_program_reduce_grads(1, 2, <6 values>)
B1_l0_post = self.bwd_l0_post(1)
B1_l0_combine = self.bwd_l0_combine(1)
B1_l0_experts = self.bwd_l0_experts(1)
reduce_bucket3 = fxoverlap_program_reduce_grads(1, 3, 'grouped_mm_wgrad', 'grouped_mm_wgrad_1', 'grouped_mm_wgrad_2')
B1_l0_dispatch = self.bwd_l0_dispatch(1)
B1_l0_attn = self.bwd_l0_attn(1)
reduce_bucket4 = fxoverlap_program_reduce_grads(1, 4, <10 values>)
B1_model_embed = self.bwd_model_embed(1)
reduce_bucket5 = fxoverlap_program_reduce_grads(1, 5, 'embedding_dense_backward')
finish_bucket0 = fxoverlap_program_finish_reduce(1, 0)
finish_bucket1 = fxoverlap_program_finish_reduce(1, 1)
finish_bucket2 = fxoverlap_program_finish_reduce(1, 2)
finish_bucket3 = fxoverlap_program_finish_reduce(1, 3)
finish_bucket4 = fxoverlap_program_finish_reduce(1, 4)
finish_bucket5 = fxoverlap_program_finish_reduce(1, 5)""")

    def test_streams_and_free_around_reductions(self):
        """One microbatch: the comm stream waits for the stage that computed a bucket's
        gradients; the compute stream waits for the comm stream before the finish nodes."""
        cap, _, stages = _stages()
        program = free(streams(reduce(schedule(stages, cap, 1), cap, bucket_bytes=0)), cap)
        text = render_program(program)
        self.assertExpectedInline(text[text.index("B0_l1_attn ="):], """\
B0_l1_attn = self.bwd_l1_attn(0)
record_event_7 = fxoverlap_program_record_event('ev_B0_l1_attn', 'comp')
free_B0_l1_attn = fxoverlap_program_free(0, <27 values>)
wait_event_7 = fxoverlap_program_wait_event('ev_B0_l1_attn', 'comm')
reduce_bucket2 = fxoverlap_program_reduce_grads(0, 2, <6 values>)
free_reduce_bucket2 = fxoverlap_program_free(0, <6 values>)
B0_l0_post = self.bwd_l0_post(0)
record_event_8 = fxoverlap_program_record_event('ev_B0_l0_post', 'comp')
free_B0_l0_post = fxoverlap_program_free(0, 'getitem_9', 'unsqueeze_1', 'view_9')
wait_event_8 = fxoverlap_program_wait_event('ev_B0_l0_post', 'comm')
B0_l0_combine = self.bwd_l0_combine(0)
record_event_9 = fxoverlap_program_record_event('ev_B0_l0_combine', 'comm')
free_B0_l0_combine = fxoverlap_program_free(0, 'sym_size_int', 'expand_4')
wait_event_9 = fxoverlap_program_wait_event('ev_B0_l0_combine', 'comp')
B0_l0_experts = self.bwd_l0_experts(0)
record_event_10 = fxoverlap_program_record_event('ev_B0_l0_experts', 'comp')
free_B0_l0_experts = fxoverlap_program_free(0, <7 values>)
wait_event_10 = fxoverlap_program_wait_event('ev_B0_l0_experts', 'comm')
reduce_bucket3 = fxoverlap_program_reduce_grads(0, 3, 'grouped_mm_wgrad', 'grouped_mm_wgrad_1', 'grouped_mm_wgrad_2')
free_reduce_bucket3 = fxoverlap_program_free(0, 'grouped_mm_wgrad', 'grouped_mm_wgrad_1', 'grouped_mm_wgrad_2')
B0_l0_dispatch = self.bwd_l0_dispatch(0)
record_event_11 = fxoverlap_program_record_event('ev_B0_l0_dispatch', 'comm')
free_B0_l0_dispatch = fxoverlap_program_free(0, 'sum_1', 'getitem_11', 'add_45')
wait_event_11 = fxoverlap_program_wait_event('ev_B0_l0_dispatch', 'comp')
B0_l0_attn = self.bwd_l0_attn(0)
record_event_12 = fxoverlap_program_record_event('ev_B0_l0_attn', 'comp')
free_B0_l0_attn = fxoverlap_program_free(0, <41 values>)
wait_event_12 = fxoverlap_program_wait_event('ev_B0_l0_attn', 'comm')
reduce_bucket4 = fxoverlap_program_reduce_grads(0, 4, <10 values>)
record_event_14 = fxoverlap_program_record_event('ev_reduce_bucket4', 'comm')
free_reduce_bucket4 = fxoverlap_program_free(0, <10 values>)
B0_model_embed = self.bwd_model_embed(0)
record_event_13 = fxoverlap_program_record_event('ev_B0_model_embed', 'comp')
free_B0_model_embed = fxoverlap_program_free(0, 'primals_30', 'add_57')
wait_event_13 = fxoverlap_program_wait_event('ev_B0_model_embed', 'comm')
reduce_bucket5 = fxoverlap_program_reduce_grads(0, 5, 'embedding_dense_backward')
record_event_15 = fxoverlap_program_record_event('ev_reduce_bucket5', 'comm')
free_reduce_bucket5 = fxoverlap_program_free(0, 'embedding_dense_backward')
finish_bucket0 = fxoverlap_program_finish_reduce(0, 0)
free_finish_bucket0 = fxoverlap_program_free(0, 'bucket#0')
finish_bucket1 = fxoverlap_program_finish_reduce(0, 1)
free_finish_bucket1 = fxoverlap_program_free(0, 'bucket#1')
finish_bucket2 = fxoverlap_program_finish_reduce(0, 2)
free_finish_bucket2 = fxoverlap_program_free(0, 'bucket#2')
finish_bucket3 = fxoverlap_program_finish_reduce(0, 3)
free_finish_bucket3 = fxoverlap_program_free(0, 'bucket#3')
wait_event_14 = fxoverlap_program_wait_event('ev_reduce_bucket4', 'comp')
finish_bucket4 = fxoverlap_program_finish_reduce(0, 4)
free_finish_bucket4 = fxoverlap_program_free(0, 'bucket#4')
wait_event_15 = fxoverlap_program_wait_event('ev_reduce_bucket5', 'comp')
finish_bucket5 = fxoverlap_program_finish_reduce(0, 5)
free_finish_bucket5 = fxoverlap_program_free(0, 'bucket#5')
record_event_16 = fxoverlap_program_record_event('end', 'comm')
wait_event_16 = fxoverlap_program_wait_event('end', 'comp')""")
