"""Early-free pass and memory accounting on the reference model, on CPU (the pass on
hand-built programs: tests/test_passes.py).

- numerics with freeing on (and off) equal eager's, on 2 gloo ranks;
- every per-microbatch value is freed exactly once, after its last use, and the
  value stores hold nothing but parameters and buffers after each forward_backward;
- the live-bytes trace stays under one microbatch's saved activations plus the
  largest stage working set, both measured from the stages' actual values; with
  ``free_early=False`` the peak is higher;
- a snapshot of the program with its free nodes.
"""

from __future__ import annotations

import unittest

import expecttest
import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.ir import program as program_ops
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.passes.schedule import schedule
from fxoverlap.passes.streams import streams
from fxoverlap.runtime import ProgramRunner, accumulate_into, live_bytes, static_storage_keys, static_values
from fxoverlap.ir.stage import Direction
from fxoverlap.testing import grad_diff, run_distributed, token_batches
from numerics_cases import eager_grads
from pass_cases import check_program_frees
from snapshot_utils import render_program, requires_pinned_torch

CFG = MoEConfig.tiny(n_layers=2, dim=32, n_heads=2, n_experts=4, expert_dim=16)


def _model_and_batches(rank: int, ep_group, n_mb: int):
    torch.manual_seed(0)
    model = MoETransformer(CFG, ep_group)
    return model, token_batches(CFG.vocab_size, n_mb, seed=100 + rank)


def _capture_of(engine, mbs):
    return engine.plan(mbs).capture


def stage_bytes(stages, capture, model, mbs, only: set[str] | None = None) -> tuple[int, int, str]:
    """Run each microbatch's stages in plain order; return (max over microbatches of
    the bytes of its saved activations — forward-stage outputs a backward stage reads,
    those in ``only`` if given —, max over stages and microbatches of inputs + outputs
    bytes, that stage's name)."""
    static = static_values(capture, model)
    keys = static_storage_keys(static)
    fwd_out = {v for s in stages if s.direction is Direction.FWD for v in s.outputs}
    bwd_in = {v for s in stages if s.direction is Direction.BWD for v in s.inputs}
    saved_names = fwd_out & bwd_in & (only if only is not None else fwd_out)
    saved_max, work_max, work_stage = 0, 0, ""
    with torch.no_grad():
        for mb in mbs:
            store = dict(static, **dict(zip(capture.input_placeholders, mb)))
            store.update({ph: torch.ones(()) for ph in capture.tangents})
            for s in stages:
                outs = s.graph_module(*[store[v] for v in s.inputs])
                store.update(zip(s.outputs, outs))
                touched = {v: store[v] for v in (*s.inputs, *s.outputs)}
                work = live_bytes([touched], keys)
                if work > work_max:
                    work_max, work_stage = work, s.name
            saved_max = max(saved_max, live_bytes([{v: store[v] for v in saved_names}], keys))
    return saved_max, work_max, work_stage


def _distributed_checks(rank: int, world_size: int, n_mb: int) -> dict:
    group = dist.group.WORLD
    model, mbs = _model_and_batches(rank, group, n_mb)
    ref_losses, ref_grads = eager_grads(model, mbs)
    engine = fxoverlap.optimize(model, group, fxoverlap.OverlapConfig(record_memory=True))
    out = {}

    def record(key, losses, trace):
        worst, scale, bitwise = grad_diff(model, ref_grads)
        model.zero_grad(set_to_none=True)
        out[f"{key}_grad_ok"] = worst <= 1e-6 * scale
        out[f"{key}_bitwise"] = bitwise and all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
        out[f"{key}_peak"] = max(b for _, _, b in trace)
        out[f"{key}_end"] = trace[-1]

    for call in range(2):  # the stores must be empty after each call, not just the first
        record(f"on{call}", engine.forward_backward(mbs), engine.memory_trace)
    cap = _capture_of(engine, mbs)
    out["free_nodes"] = check_program_frees(engine.program, cap)

    def run(program):
        runner = ProgramRunner(program, engine.stages, cap, torch.device("cpu"), grads=accumulate_into(model, cap),
                               record_memory=True)
        state = runner.run(static_values(cap, model), mbs)
        return state, [o[cap.loss_name] for o in state.outputs]

    state, losses = run(engine.program)
    record("runner", losses, state.memory_trace)
    out["leftover"] = {mb: names for mb, st in enumerate(state.stores)
                       if (names := [v for v in st if v not in cap.static_placeholders])}
    # The same stages without the free pass (what free_early=False builds; no second capture).
    state, losses = run(streams(schedule(engine.stages, cap, n_mb)))
    record("off", losses, state.memory_trace)
    out["saved"], out["work"], out["work_stage"] = stage_bytes(engine.stages, cap, model, mbs)
    return out


class TestFreeDistributed(unittest.TestCase):
    def test_free_numerics_empty_stores_and_bound(self):
        n_mb = 3
        for rank, r in enumerate(run_distributed(_distributed_checks, n_mb)):
            with self.subTest(rank=rank):
                for key in ("on0", "on1", "runner", "off"):
                    # (a) eager's grads and losses, bitwise as the unfreed program is:
                    # freeing only drops references
                    self.assertTrue(r[f"{key}_grad_ok"], f"{key}: grads differ from eager")
                    self.assertTrue(r[f"{key}_bitwise"], f"{key}: not bitwise equal to eager")
                # (b) every tensor is dropped by the end of each forward_backward
                self.assertEqual(r["on0_end"], ("end", -1, 0))
                self.assertEqual(r["on1_end"], ("end", -1, 0))
                self.assertEqual(r["leftover"], {})
                self.assertGreater(r["off_end"][2], 0)
                self.assertGreater(r["free_nodes"], 0)
                # (c) the bound: one microbatch's saved activations + one stage's working set
                bound = r["saved"] + r["work"]
                self.assertEqual(r["on0_peak"], r["on1_peak"])
                self.assertLessEqual(r["on0_peak"], bound, f"peak over bound; {r}")
                self.assertGreater(r["off_peak"], r["on0_peak"])
                print(
                    f"\nrank {rank}: peak live bytes free on {r['on0_peak']}, off {r['off_peak']}; "
                    f"bound {bound} = saved {r['saved']} + working set {r['work']} ({r['work_stage']})"
                )


class TestFreePass(expecttest.TestCase):
    _engines: dict = {}  # free_early -> (engine, model): one capture per setting for the class

    def _engine(self, n_mb=2, free_early=True):
        if free_early not in self._engines:
            model, _ = _model_and_batches(0, None, 0)
            cfg = fxoverlap.OverlapConfig(record_memory=True, free_early=free_early)
            self._engines[free_early] = (fxoverlap.optimize(model, None, cfg), model)
        engine, model = self._engines[free_early]
        _, mbs = _model_and_batches(0, None, n_mb)
        engine.forward_backward(mbs)
        model.zero_grad(set_to_none=True)
        return engine, model, mbs

    def test_single_rank_frees_everything(self):
        engine, model, mbs = self._engine(n_mb=3)
        check_program_frees(engine.program, _capture_of(engine, mbs))
        self.assertEqual(engine.memory_trace[-1], ("end", -1, 0))
        # the trace has one entry per stage call and free node, plus the end
        n = sum(1 for node in engine.program.graph.nodes if node.op == "call_module" or node.target is program_ops.free)
        self.assertEqual(len(engine.memory_trace), n + 1)

    def test_live_bytes_dedupes_views_and_skips_params(self):
        p = torch.nn.Parameter(torch.zeros(4, 4))
        x = torch.zeros(8, 8)
        static = {"p": p}
        stores = [
            dict(static, a=x, b=x.view(64), c=x[:2], t=p.t(), n=3),
            dict(static, a=x, d=torch.zeros(2, dtype=torch.float64)),
        ]
        self.assertEqual(live_bytes(stores, static), 8 * 8 * 4 + 2 * 8)
        self.assertEqual(live_bytes(stores, static_storage_keys(static)), 8 * 8 * 4 + 2 * 8)

    def test_free_off_inserts_nothing_and_peaks_higher(self):
        off, _, _ = self._engine(free_early=False)
        self.assertFalse(any(n.target is program_ops.free for n in off.program.graph.nodes))
        on, _, _ = self._engine()
        peak = lambda e: max(b for _, _, b in e.memory_trace)  # noqa: E731
        self.assertGreater(peak(off), peak(on))
        self.assertGreater(off.memory_trace[-1][2], 0)

    @requires_pinned_torch
    def test_program_snapshot(self):
        engine, _, _ = self._engine()
        self.assertExpectedInline(render_program(engine.program), """\
def forward(self):
record_event = fxoverlap_program_record_event('start', 'comp')
F0_model_embed = self.fwd_model_embed(0)
F0_l0_attn = self.fwd_l0_attn(0)
record_event_1 = fxoverlap_program_record_event('ev_F0_l0_attn', 'comp')
wait_event = fxoverlap_program_wait_event('start', 'comm')
wait_event_1 = fxoverlap_program_wait_event('ev_F0_l0_attn', 'comm')
F0_l0_dispatch = self.fwd_l0_dispatch(0)
record_event_2 = fxoverlap_program_record_event('ev_F0_l0_dispatch', 'comm')
free_F0_l0_dispatch = fxoverlap_program_free(0, 'index_select')
F0_l0_attn_side = self.fwd_l0_attn_side(0)
free_F0_l0_attn_side = fxoverlap_program_free(0, 'view_8')
wait_event_2 = fxoverlap_program_wait_event('ev_F0_l0_dispatch', 'comp')
F0_l0_experts = self.fwd_l0_experts(0)
record_event_3 = fxoverlap_program_record_event('ev_F0_l0_experts', 'comp')
wait_event_3 = fxoverlap_program_wait_event('ev_F0_l0_experts', 'comm')
F0_l0_combine = self.fwd_l0_combine(0)
record_event_4 = fxoverlap_program_record_event('ev_F0_l0_combine', 'comm')
free_F0_l0_combine = fxoverlap_program_free(0, 'grouped_mm_2')
wait_event_4 = fxoverlap_program_wait_event('ev_F0_l0_combine', 'comp')
F0_l0_post = self.fwd_l0_post(0)
free_F0_l0_post = fxoverlap_program_free(0, 'combine')
F0_l1_attn = self.fwd_l1_attn(0)
record_event_5 = fxoverlap_program_record_event('ev_F0_l1_attn', 'comp')
wait_event_5 = fxoverlap_program_wait_event('ev_F0_l1_attn', 'comm')
F0_l1_dispatch = self.fwd_l1_dispatch(0)
record_event_6 = fxoverlap_program_record_event('ev_F0_l1_dispatch', 'comm')
free_F0_l1_dispatch = fxoverlap_program_free(0, 'index_select_1')
F0_l1_attn_side = self.fwd_l1_attn_side(0)
free_F0_l1_attn_side = fxoverlap_program_free(0, 'view_19')
wait_event_6 = fxoverlap_program_wait_event('ev_F0_l1_dispatch', 'comp')
F0_l1_experts = self.fwd_l1_experts(0)
record_event_7 = fxoverlap_program_record_event('ev_F0_l1_experts', 'comp')
wait_event_7 = fxoverlap_program_wait_event('ev_F0_l1_experts', 'comm')
F0_l1_combine = self.fwd_l1_combine(0)
record_event_8 = fxoverlap_program_record_event('ev_F0_l1_combine', 'comm')
free_F0_l1_combine = fxoverlap_program_free(0, 'grouped_mm_5')
wait_event_8 = fxoverlap_program_wait_event('ev_F0_l1_combine', 'comp')
F0_l1_post = self.fwd_l1_post(0)
free_F0_l1_post = fxoverlap_program_free(0, 'combine_1')
F0_model_head = self.fwd_model_head(0)
free_F0_model_head = fxoverlap_program_free(0, 'primals_29')
output_F0_model_head = fxoverlap_program_output(0, 'getitem_24')
free_output_F0_model_head = fxoverlap_program_free(0, 'getitem_24')
B0_model_head = self.bwd_model_head(0)
free_B0_model_head = fxoverlap_program_free(0, <11 values>)
accumulate_B0_model_head = fxoverlap_program_accumulate(0, 't_14', 'view_28')
free_accumulate_B0_model_head = fxoverlap_program_free(0, 't_14', 'view_28')
B0_l1_post = self.bwd_l1_post(0)
record_event_9 = fxoverlap_program_record_event('ev_B0_l1_post', 'comp')
free_B0_l1_post = fxoverlap_program_free(0, 'getitem_21', 'unsqueeze_3', 'view_20')
F1_model_embed = self.fwd_model_embed(1)
F1_l0_attn = self.fwd_l0_attn(1)
record_event_11 = fxoverlap_program_record_event('ev_F1_l0_attn', 'comp')
wait_event_9 = fxoverlap_program_wait_event('ev_B0_l1_post', 'comm')
B0_l1_combine = self.bwd_l1_combine(0)
record_event_10 = fxoverlap_program_record_event('ev_B0_l1_combine', 'comm')
free_B0_l1_combine = fxoverlap_program_free(0, 'sym_size_int_1', 'expand_2')
B0_l1_attn_early = self.bwd_l1_attn_early(0)
free_B0_l1_attn_early = fxoverlap_program_free(0, <7 values>)
accumulate_B0_l1_attn_early = fxoverlap_program_accumulate(0, 't_18')
free_accumulate_B0_l1_attn_early = fxoverlap_program_free(0, 't_18')
wait_event_10 = fxoverlap_program_wait_event('ev_B0_l1_combine', 'comp')
B0_l1_experts = self.bwd_l1_experts(0)
record_event_13 = fxoverlap_program_record_event('ev_B0_l1_experts', 'comp')
free_B0_l1_experts = fxoverlap_program_free(0, <7 values>)
accumulate_B0_l1_experts = fxoverlap_program_accumulate(0, 'grouped_mm_wgrad', 'grouped_mm_wgrad_1', 'grouped_mm_wgrad_2')
free_accumulate_B0_l1_experts = fxoverlap_program_free(0, 'grouped_mm_wgrad', 'grouped_mm_wgrad_1', 'grouped_mm_wgrad_2')
wait_event_11 = fxoverlap_program_wait_event('ev_F1_l0_attn', 'comm')
F1_l0_dispatch = self.fwd_l0_dispatch(1)
record_event_12 = fxoverlap_program_record_event('ev_F1_l0_dispatch', 'comm')
free_F1_l0_dispatch = fxoverlap_program_free(1, 'index_select')
F1_l0_attn_side = self.fwd_l0_attn_side(1)
free_F1_l0_attn_side = fxoverlap_program_free(1, 'view_8')
wait_event_12 = fxoverlap_program_wait_event('ev_F1_l0_dispatch', 'comp')
F1_l0_experts = self.fwd_l0_experts(1)
record_event_15 = fxoverlap_program_record_event('ev_F1_l0_experts', 'comp')
wait_event_13 = fxoverlap_program_wait_event('ev_B0_l1_experts', 'comm')
B0_l1_dispatch = self.bwd_l1_dispatch(0)
record_event_14 = fxoverlap_program_record_event('ev_B0_l1_dispatch', 'comm')
free_B0_l1_dispatch = fxoverlap_program_free(0, 'sum_4', 'getitem_23', 'add_50')
wait_event_14 = fxoverlap_program_wait_event('ev_B0_l1_dispatch', 'comp')
B0_l1_attn = self.bwd_l1_attn(0)
free_B0_l1_attn = fxoverlap_program_free(0, <31 values>)
accumulate_B0_l1_attn = fxoverlap_program_accumulate(0, <6 values>)
free_accumulate_B0_l1_attn = fxoverlap_program_free(0, <6 values>)
wait_event_15 = fxoverlap_program_wait_event('ev_F1_l0_experts', 'comm')
F1_l0_combine = self.fwd_l0_combine(1)
record_event_16 = fxoverlap_program_record_event('ev_F1_l0_combine', 'comm')
free_F1_l0_combine = fxoverlap_program_free(1, 'grouped_mm_2')
B0_l0_post = self.bwd_l0_post(0)
record_event_17 = fxoverlap_program_record_event('ev_B0_l0_post', 'comp')
free_B0_l0_post = fxoverlap_program_free(0, 'getitem_9', 'unsqueeze_1', 'view_9')
wait_event_16 = fxoverlap_program_wait_event('ev_F1_l0_combine', 'comp')
F1_l0_post = self.fwd_l0_post(1)
free_F1_l0_post = fxoverlap_program_free(1, 'combine')
F1_l1_attn = self.fwd_l1_attn(1)
record_event_19 = fxoverlap_program_record_event('ev_F1_l1_attn', 'comp')
wait_event_17 = fxoverlap_program_wait_event('ev_B0_l0_post', 'comm')
B0_l0_combine = self.bwd_l0_combine(0)
record_event_18 = fxoverlap_program_record_event('ev_B0_l0_combine', 'comm')
free_B0_l0_combine = fxoverlap_program_free(0, 'sym_size_int', 'expand_6')
B0_l0_attn_early = self.bwd_l0_attn_early(0)
free_B0_l0_attn_early = fxoverlap_program_free(0, <7 values>)
accumulate_B0_l0_attn_early = fxoverlap_program_accumulate(0, 't_38')
free_accumulate_B0_l0_attn_early = fxoverlap_program_free(0, 't_38')
wait_event_18 = fxoverlap_program_wait_event('ev_B0_l0_combine', 'comp')
B0_l0_experts = self.bwd_l0_experts(0)
record_event_21 = fxoverlap_program_record_event('ev_B0_l0_experts', 'comp')
free_B0_l0_experts = fxoverlap_program_free(0, <7 values>)
accumulate_B0_l0_experts = fxoverlap_program_accumulate(0, 'grouped_mm_wgrad_3', 'grouped_mm_wgrad_4', 'grouped_mm_wgrad_5')
free_accumulate_B0_l0_experts = fxoverlap_program_free(0, 'grouped_mm_wgrad_3', 'grouped_mm_wgrad_4', 'grouped_mm_wgrad_5')
wait_event_19 = fxoverlap_program_wait_event('ev_F1_l1_attn', 'comm')
F1_l1_dispatch = self.fwd_l1_dispatch(1)
record_event_20 = fxoverlap_program_record_event('ev_F1_l1_dispatch', 'comm')
free_F1_l1_dispatch = fxoverlap_program_free(1, 'index_select_1')
F1_l1_attn_side = self.fwd_l1_attn_side(1)
free_F1_l1_attn_side = fxoverlap_program_free(1, 'view_19')
wait_event_20 = fxoverlap_program_wait_event('ev_F1_l1_dispatch', 'comp')
F1_l1_experts = self.fwd_l1_experts(1)
record_event_23 = fxoverlap_program_record_event('ev_F1_l1_experts', 'comp')
wait_event_21 = fxoverlap_program_wait_event('ev_B0_l0_experts', 'comm')
B0_l0_dispatch = self.bwd_l0_dispatch(0)
record_event_22 = fxoverlap_program_record_event('ev_B0_l0_dispatch', 'comm')
free_B0_l0_dispatch = fxoverlap_program_free(0, 'sum_1', 'getitem_11', 'add_62')
wait_event_22 = fxoverlap_program_wait_event('ev_B0_l0_dispatch', 'comp')
B0_l0_attn = self.bwd_l0_attn(0)
free_B0_l0_attn = fxoverlap_program_free(0, <31 values>)
accumulate_B0_l0_attn = fxoverlap_program_accumulate(0, <6 values>)
free_accumulate_B0_l0_attn = fxoverlap_program_free(0, <6 values>)
wait_event_23 = fxoverlap_program_wait_event('ev_F1_l1_experts', 'comm')
F1_l1_combine = self.fwd_l1_combine(1)
record_event_24 = fxoverlap_program_record_event('ev_F1_l1_combine', 'comm')
free_F1_l1_combine = fxoverlap_program_free(1, 'grouped_mm_5')
wait_event_24 = fxoverlap_program_wait_event('ev_F1_l1_combine', 'comp')
F1_l1_post = self.fwd_l1_post(1)
free_F1_l1_post = fxoverlap_program_free(1, 'combine_1')
F1_model_head = self.fwd_model_head(1)
free_F1_model_head = fxoverlap_program_free(1, 'primals_29')
output_F1_model_head = fxoverlap_program_output(1, 'getitem_24')
free_output_F1_model_head = fxoverlap_program_free(1, 'getitem_24')
B0_model_embed = self.bwd_model_embed(0)
free_B0_model_embed = fxoverlap_program_free(0, 'primals_28', 'add_73')
accumulate_B0_model_embed = fxoverlap_program_accumulate(0, 'embedding_dense_backward')
free_accumulate_B0_model_embed = fxoverlap_program_free(0, 'embedding_dense_backward')
B1_model_head = self.bwd_model_head(1)
free_B1_model_head = fxoverlap_program_free(1, <11 values>)
accumulate_B1_model_head = fxoverlap_program_accumulate(1, 't_14', 'view_28')
free_accumulate_B1_model_head = fxoverlap_program_free(1, 't_14', 'view_28')
B1_l1_post = self.bwd_l1_post(1)
record_event_25 = fxoverlap_program_record_event('ev_B1_l1_post', 'comp')
free_B1_l1_post = fxoverlap_program_free(1, 'getitem_21', 'unsqueeze_3', 'view_20')
wait_event_25 = fxoverlap_program_wait_event('ev_B1_l1_post', 'comm')
B1_l1_combine = self.bwd_l1_combine(1)
record_event_26 = fxoverlap_program_record_event('ev_B1_l1_combine', 'comm')
free_B1_l1_combine = fxoverlap_program_free(1, 'sym_size_int_1', 'expand_2')
B1_l1_attn_early = self.bwd_l1_attn_early(1)
free_B1_l1_attn_early = fxoverlap_program_free(1, <7 values>)
accumulate_B1_l1_attn_early = fxoverlap_program_accumulate(1, 't_18')
free_accumulate_B1_l1_attn_early = fxoverlap_program_free(1, 't_18')
wait_event_26 = fxoverlap_program_wait_event('ev_B1_l1_combine', 'comp')
B1_l1_experts = self.bwd_l1_experts(1)
record_event_27 = fxoverlap_program_record_event('ev_B1_l1_experts', 'comp')
free_B1_l1_experts = fxoverlap_program_free(1, <7 values>)
accumulate_B1_l1_experts = fxoverlap_program_accumulate(1, 'grouped_mm_wgrad', 'grouped_mm_wgrad_1', 'grouped_mm_wgrad_2')
free_accumulate_B1_l1_experts = fxoverlap_program_free(1, 'grouped_mm_wgrad', 'grouped_mm_wgrad_1', 'grouped_mm_wgrad_2')
wait_event_27 = fxoverlap_program_wait_event('ev_B1_l1_experts', 'comm')
B1_l1_dispatch = self.bwd_l1_dispatch(1)
record_event_28 = fxoverlap_program_record_event('ev_B1_l1_dispatch', 'comm')
free_B1_l1_dispatch = fxoverlap_program_free(1, 'sum_4', 'getitem_23', 'add_50')
wait_event_28 = fxoverlap_program_wait_event('ev_B1_l1_dispatch', 'comp')
B1_l1_attn = self.bwd_l1_attn(1)
free_B1_l1_attn = fxoverlap_program_free(1, <31 values>)
accumulate_B1_l1_attn = fxoverlap_program_accumulate(1, <6 values>)
free_accumulate_B1_l1_attn = fxoverlap_program_free(1, <6 values>)
B1_l0_post = self.bwd_l0_post(1)
record_event_29 = fxoverlap_program_record_event('ev_B1_l0_post', 'comp')
free_B1_l0_post = fxoverlap_program_free(1, 'getitem_9', 'unsqueeze_1', 'view_9')
wait_event_29 = fxoverlap_program_wait_event('ev_B1_l0_post', 'comm')
B1_l0_combine = self.bwd_l0_combine(1)
record_event_30 = fxoverlap_program_record_event('ev_B1_l0_combine', 'comm')
free_B1_l0_combine = fxoverlap_program_free(1, 'sym_size_int', 'expand_6')
B1_l0_attn_early = self.bwd_l0_attn_early(1)
free_B1_l0_attn_early = fxoverlap_program_free(1, <7 values>)
accumulate_B1_l0_attn_early = fxoverlap_program_accumulate(1, 't_38')
free_accumulate_B1_l0_attn_early = fxoverlap_program_free(1, 't_38')
wait_event_30 = fxoverlap_program_wait_event('ev_B1_l0_combine', 'comp')
B1_l0_experts = self.bwd_l0_experts(1)
record_event_31 = fxoverlap_program_record_event('ev_B1_l0_experts', 'comp')
free_B1_l0_experts = fxoverlap_program_free(1, <7 values>)
accumulate_B1_l0_experts = fxoverlap_program_accumulate(1, 'grouped_mm_wgrad_3', 'grouped_mm_wgrad_4', 'grouped_mm_wgrad_5')
free_accumulate_B1_l0_experts = fxoverlap_program_free(1, 'grouped_mm_wgrad_3', 'grouped_mm_wgrad_4', 'grouped_mm_wgrad_5')
wait_event_31 = fxoverlap_program_wait_event('ev_B1_l0_experts', 'comm')
B1_l0_dispatch = self.bwd_l0_dispatch(1)
record_event_32 = fxoverlap_program_record_event('ev_B1_l0_dispatch', 'comm')
free_B1_l0_dispatch = fxoverlap_program_free(1, 'sum_1', 'getitem_11', 'add_62')
wait_event_32 = fxoverlap_program_wait_event('ev_B1_l0_dispatch', 'comp')
B1_l0_attn = self.bwd_l0_attn(1)
free_B1_l0_attn = fxoverlap_program_free(1, <31 values>)
accumulate_B1_l0_attn = fxoverlap_program_accumulate(1, <6 values>)
free_accumulate_B1_l0_attn = fxoverlap_program_free(1, <6 values>)
B1_model_embed = self.bwd_model_embed(1)
free_B1_model_embed = fxoverlap_program_free(1, 'primals_28', 'add_73')
accumulate_B1_model_embed = fxoverlap_program_accumulate(1, 'embedding_dense_backward')
free_accumulate_B1_model_embed = fxoverlap_program_free(1, 'embedding_dense_backward')
record_event_33 = fxoverlap_program_record_event('end', 'comm')
wait_event_33 = fxoverlap_program_wait_event('end', 'comp')""")


if __name__ == "__main__":
    unittest.main()
