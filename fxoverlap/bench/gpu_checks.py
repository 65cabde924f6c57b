"""GPU checks on 2 ranks with NCCL: ``torchrun --nproc-per-node 2 -m fxoverlap.bench checks``.

* numerics: bf16 losses and gradients of ``forward_backward`` against eager on the same
  weights and data (dropless, capacity, and dropless with token dedup). Tolerance: gradients are compared by
  relative L2 per parameter against eager; eager is run twice to measure its own
  run-to-run noise (atomics in index/scatter backward kernels make bf16 sums
  order-dependent). We require rel-L2 <= max(4 x eager noise, 2^-7): the stage graphs
  run eager's kernels, so the only legitimate source of difference is that same
  summation-order noise; 2^-7 is two bf16 unit roundoffs (2^-8 each).
* memory: peak ``max_memory_allocated`` of the interleaved program vs eager sequential at
  two microbatch sizes (target <= 1.10).
* recompute: peak memory of an mHC model (>= 4 layers) with recompute off vs on.
* row_sum: token dedup's Triton per-row pair sum against an fp32 reference, and its speed.
* csan: the program (free pass on, delayed wgrad off/on, each routing) under CSAN,
  enabled after the capture (``--checks csan``).
* symm_mem: a whole step of the ``symm_mem`` and ``padded`` dispatchers (each routing, and
  with CUDA graphs on) under ``torch.cuda.set_sync_debug_mode("error")``: any host sync
  raises. Gradients against the other backend (same layout: bitwise expected) and eager
  (the numerics tolerance). Any number of ranks on one host, one included
  (``--checks symm_mem``).
* ac: full activation checkpointing (``MoEConfig.activation_checkpoint``) at the peer's
  shape in bf16, 4 microbatches, with the all-to-all outputs saved (the default) and
  replayed (``OverlapConfig(ac_replay_comm=True)``): fxoverlap's peak
  ``max_memory_allocated`` against eager with the same AC (target <= 1.10), both against no AC, what the program keeps that
  eager does not (the all-to-all outputs, per microbatch), and each side's step time with
  and without AC (the cost of the replay); the same for ``torch.compile(backend="fxoverlap")``
  in a per-microbatch loop. One row per AC setting as it finishes, then the summary.
  Any number of ranks; one GPU is enough:
  ``torchrun --nproc-per-node 1 -m fxoverlap.bench checks --checks ac``.
* symm_mem_smoke: the symm_mem transport op by op against ``padded`` (dispatch, combine,
  their backward calls, token-once, more calls than there are buffers); one rank is
  enough: ``torchrun --nproc-per-node 1 -m fxoverlap.bench checks --checks symm_mem_smoke``.
Prints one ``CHECK {...}`` JSON line per result on rank 0; ``--out`` writes them to a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import time

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.bench import routing_fields
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import eager_steps, rel_l2, take_grads, token_batches


def _batches(cfg, n, mbs, seq, device, seed=0):
    return token_batches(cfg.vocab_size, n, (mbs, seq), seed=seed + 1000 * dist.get_rank(), device=device)


def _eager(model, batches):
    return [x.float() for x in eager_steps(model, batches)], take_grads(model, torch.float32)


ROUTINGS = ("dropless", "capacity", "dedup")


def _model(cfg, device, dtype):
    torch.manual_seed(0)
    return MoETransformer(cfg, dist.group.WORLD).to(device=device, dtype=dtype)


def _small_config(routing):
    """Four layers (one dense), 16 experts top-4, dim 256: seconds per step on one GPU."""
    return MoEConfig.tiny(dim=256, n_heads=8, n_layers=4, n_experts=16, top_k=4, expert_dim=128,
                          shared_expert_dim=128, vocab_size=4096, max_seq_len=256, **routing_fields(routing),
                          layer_pattern=("moe", "moe", "dense", "moe"))


def check_csan(device, emit):
    """The interleaved program under CSAN (torch.cuda._sanitizer). The sanitizer is
    enabled after the capture: it inspects real tensors and cannot run under the
    fake tensors of tracing. Any unsynchronised cross-stream access raises."""
    import torch.cuda._sanitizer as csan

    results = {}
    for routing in ROUTINGS:
        cfg = _small_config(routing)
        model = _model(cfg, device, torch.bfloat16)
        batches = _batches(cfg, 3, 2, 256, device)
        for wgrad in (False, True):
            engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(delay_wgrad=wgrad))
            engine.forward_backward(batches)  # capture outside the sanitizer
            model.zero_grad(set_to_none=True)
            results[(routing, wgrad)] = engine
    csan.enable_cuda_sanitizer()
    for (routing, wgrad), engine in results.items():
        error = None
        try:
            batches = _batches(engine.model.cfg, 3, 2, 256, device, seed=1)
            engine.forward_backward(batches)
            torch.cuda.synchronize()
        except Exception as e:  # CSAN raises CUDASanitizerErrors on a race
            error = f"{type(e).__name__}: {str(e)[:2000]}"
        engine.model.zero_grad(set_to_none=True)
        emit(dict(check="csan", routing=routing, delay_wgrad=wgrad, free_early=True, error=error, ok=error is None))


def _compiled_grads(model, batches):
    """torch.compile(model) run sequentially: the numerics a user of plain Inductor gets."""
    compiled = torch.compile(model)
    return [x.float() for x in eager_steps(compiled, batches)], take_grads(model, torch.float32)


def _step_under_sync_check(engine, batches):
    """One step with sync debug mode "error": (losses, None), or (None, the error)."""
    engine.forward_backward(batches)  # capture, buffers, CUDA graphs: outside the check
    engine.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return [x.float() for x in engine.forward_backward(batches)], None
    except RuntimeError as e:
        return None, f"{type(e).__name__}: {str(e)[:1000]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def check_symm_mem(device, emit):
    """A step with zero host syncs: sync debug mode "error" turns any into an exception.
    Capture, symmetric-memory rendezvous and CUDA-graph capture happen in a first step,
    outside the check. The control, all_to_all, reads split sizes on the host (token-once
    always, per-expert with more than one rank), so it must raise there; it runs on a
    group of its own, which the engine aborts when the step fails."""
    for routing in ROUTINGS:
        cfg = _small_config(routing)
        model = _model(cfg, device, torch.bfloat16)
        batches = _batches(cfg, 3, 2, 256, device)
        l1, g1 = _eager(model, batches)
        _, g2 = _eager(model, batches)
        noise, _ = rel_l2(g1, g2)
        control_group = dist.new_group()
        control = MoETransformer(cfg, control_group).to(device=device, dtype=torch.bfloat16)
        control.load_state_dict(model.state_dict())
        _, error = _step_under_sync_check(fxoverlap.optimize(control, control_group, fxoverlap.OverlapConfig(
            dispatcher="all_to_all", compiler="eager")), batches)
        expect = routing == "dedup" or dist.get_world_size() > 1
        emit(dict(check="symm_mem_sync_free", routing=routing, backend="all_to_all", sync_error=error,
                  expected_sync_error=expect, ok=(error is not None) == expect))
        grads = {}
        for backend, graphs in (("padded", False), ("symm_mem", False), ("symm_mem", True)):
            # compiler="eager": this checks the dispatchers (bitwise against each other);
            # what Inductor's kernels change is the numerics check's business
            engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(
                dispatcher=backend, cuda_graphs=graphs, compiler="eager"))
            losses, error = _step_under_sync_check(engine, batches)
            grads[(backend, graphs)] = gf = take_grads(model, torch.float32)
            err, worst = rel_l2(g1, gf) if error is None else (float("inf"), "")
            tol = max(4 * noise, 2.0 ** -7)
            graphed = sum(s.graphed for s in engine.stages) if graphs else 0
            engine.close()
            emit(dict(check="symm_mem_sync_free", routing=routing, backend=backend, cuda_graphs=graphs,
                      graphed_stage_calls=graphed, sync_error=error, fx_rel_l2=err, worst_param=worst,
                      eager_noise_rel_l2=noise, tolerance=tol,
                      bitwise_vs_padded=error is None and all(
                          torch.equal(grads[("padded", False)][k], gf[k]) for k in gf),
                      loss_rel_err=max(abs(a - b).item() / abs(a).item() for a, b in zip(l1, losses)) if error is None
                      else None, ok=error is None and err <= tol))


def check_symm_mem_smoke(device, emit):
    """The symm_mem transport against padded, op by op, on random routing (bitwise: both
    only move rows). Six dispatches in a row cycle the two landing buffers three times."""
    name = dist.group.WORLD.group_name
    ep, el, d = dist.get_world_size(), 4, 256
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    f = torch.ops.fxoverlap
    same = []
    for i in range(6):
        # 64 rows over the experts, some with none; every row could go to one rank: capacity 64
        counts = torch.randint(0, ep * el, (64,), generator=g, device=device).bincount(minlength=ep * el)
        x = torch.randn(64, d, generator=g, device=device, dtype=torch.bfloat16)
        cap = 64
        out = {}
        for t in ("padded", "symm_mem"):
            y, recv = f.dispatch_static(x, counts, name, None, cap, t, None, 0)
            back = f.combine_static(y * 2, recv, counts, name, x.shape[0], cap, t)
            grad_y, _ = f.dispatch_static(back, counts, name, recv, cap, t, None, 0)
            out[t] = (y[: int(recv.sum())], recv, back, grad_y[: int(recv.sum())])
        same.append(all(torch.equal(a, b) for a, b in zip(out["padded"], out["symm_mem"]))
                    and torch.equal(out["padded"][2], x * 2))
    idx = torch.stack([torch.randperm(ep * el, generator=g, device=device)[:3] for _ in range(32)])
    xt = torch.randn(32, d, generator=g, device=device, dtype=torch.bfloat16)
    w = torch.rand(32, 3, generator=g, device=device, dtype=torch.bfloat16)
    tok = {}
    for t in ("padded", "symm_mem"):
        sent = f.token_dispatch_static(xt, idx, w, ep * el, name, 32, t, None, 0)
        comb = f.token_combine_static(sent[0] * sent[1].unsqueeze(-1), sent[3], sent[4], sent[5], 3, name, 32, t)
        gy = f.token_combine_backward_static(comb, sent[3], sent[4], sent[5], 3, name, 32, t)
        gx, gw = f.token_dispatch_backward_static(gy, sent[1], idx, sent[3], sent[4], sent[5], ep * el, name, 32, t)
        tok[t] = (*sent, comb, gy, gx, gw)
    token_same = all(torch.equal(a, b) for a, b in zip(tok["padded"], tok["symm_mem"]))
    combine_ok = torch.allclose(tok["padded"][6].float(), (xt.float() * w.float().sum(1, keepdim=True)), rtol=2e-2,
                                atol=2e-2)
    emit(dict(check="symm_mem_smoke", ranks=ep, per_expert_equal=same, token_once_equal=token_same,
              token_combine_vs_formula=combine_ok, ok=all(same) and token_same and combine_ok))


def check_numerics(device, emit, small=False, routings=ROUTINGS):
    """bf16 losses and gradients of forward_backward against eager, for both stage
    compilers. compiler="eager" runs eager's kernels: the tolerance is eager's own
    run-to-run noise (x4) or two bf16 roundoffs. compiler="inductor" fuses kernels as
    torch.compile does: its tolerance is twice the difference between torch.compile(model)
    and eager measured here (or the eager one, if larger). With Inductor, the interleaved
    program must equal the same compiled stages run one microbatch at a time: bitwise on CPU
    (tests/test_inductor.py); on CUDA within eager's own run-to-run noise, because atomics
    (embedding and index backward, Inductor's scatter reductions) make some kernels
    non-deterministic (measured on one H200: not bitwise)."""
    from fxoverlap.pipeline import run_plain

    for routing in routings:
        dim, seq = (256, 256) if small else (1024, 1024)
        cfg = MoEConfig.tiny(dim=dim, n_heads=8, n_layers=4, n_experts=16, top_k=4, expert_dim=dim // 2,
                             shared_expert_dim=dim // 2, vocab_size=8192, max_seq_len=seq, **routing_fields(routing),
                             layer_pattern=("moe", "moe", "dense", "moe"))
        model = _model(cfg, device, torch.bfloat16)
        batches = _batches(cfg, 3, 2, seq, device)
        l1, g1 = _eager(model, batches)
        l2, g2 = _eager(model, batches)
        lc, gc = _compiled_grads(model, batches)
        noise, _ = rel_l2(g1, g2)
        compile_err, _ = rel_l2(g1, gc)
        for compiler in ("eager", "inductor"):
            engine = fxoverlap.optimize(model, dist.group.WORLD,
                                        fxoverlap.OverlapConfig(delay_wgrad=True, compiler=compiler))
            losses = [x.float() for x in engine.forward_backward(batches)]
            gf = take_grads(model, torch.float32)
            err, worst = rel_l2(g1, gf)
            vs_compile, _ = rel_l2(gc, gf)
            tol = max(4 * noise, 2.0 ** -7) if compiler == "eager" else max(2 * compile_err, 4 * noise, 2.0 ** -7)
            loss_err = max(abs(a - b).item() / abs(a).item() for a, b in zip(l1, losses))
            r = dict(check="numerics_bf16", routing=routing, compiler=compiler, eager_noise_rel_l2=noise,
                     compile_vs_eager_rel_l2=compile_err, fx_rel_l2=err, fx_vs_compile_rel_l2=vs_compile,
                     worst_param=worst, tolerance=tol, loss_rel_err=loss_err,
                     bitwise=all(torch.equal(g1[k], gf[k]) for k in g1), ok=err <= tol and loss_err <= tol)
            if compiler == "inductor":
                plan = engine.plan(batches)
                plain = [run_plain(plan.stages, plan.capture, model, b).float() for b in batches]
                gp = take_grads(model, torch.float32)
                r["plain_order_bitwise"] = all(torch.equal(a, b) for a, b in zip(plain, losses)) and all(
                    torch.equal(gp[k], gf[k]) for k in gf)
                # Same kernels, same inputs: bitwise but for the kernels that are not deterministic
                # on CUDA (atomics: eager differs from itself by eager_noise), so within that noise.
                r["plain_order_rel_l2"], _ = rel_l2(gf, gp)
                r["ok"] = r["ok"] and r["plain_order_rel_l2"] <= max(2 * noise, 2.0 ** -7)
            emit(r)


def check_row_sum(device, emit):
    """The Triton per-row pair sum of token dedup against an fp32 reference: the result
    is rounded to bf16 once (up to 1 unit of |ref| * 2^-8, which is 0.5-1 ulp) plus
    fp32 summation-order differences, which matter only where terms cancel, hence
    2 units; bitwise repeatable; time against index_add_."""
    from fxoverlap.kernels import row_sum

    g = torch.Generator(device=device).manual_seed(0)
    rows, k, dim = 8192, 8, 4096
    keep = torch.rand(rows * k, generator=g, device=device) < 0.5
    pair_index = keep.nonzero().flatten()
    src = torch.randn(pair_index.numel(), dim, generator=g, device=device).bfloat16()
    got = row_sum.sum_per_row(src, pair_index, rows, k)
    again = row_sum.sum_per_row(src, pair_index, rows, k)
    ref = torch.cat([src, src.new_zeros(1, dim)])[row_sum.pair_positions(pair_index, rows, k)].float().sum(1)
    ulp = (ref.abs() * 2.0 ** -8).clamp_min(2.0 ** -133)
    err = ((got.float() - ref).abs() / ulp).max().item()

    def timed(fn, reps=20):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    rows_of = pair_index // k
    emit(dict(check="row_sum", pairs=pair_index.numel(), rows=rows, k=k, dim=dim, max_err_bf16_ulps=err,
              repeatable=torch.equal(got, again),
              ms_triton=timed(lambda: row_sum.sum_per_row(src, pair_index, rows, k)),
              ms_index_add=timed(lambda: src.new_zeros(rows, dim).index_add_(0, rows_of, src)),
              ok=err <= 2.0 and torch.equal(got, again)))


def _peak(fn):
    gc.collect()  # a model of an earlier check that waits in a reference cycle would count in the base
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), base


def check_memory(device, emit):
    cfg = MoEConfig.tiny(dim=2048, n_heads=16, n_layers=4, n_experts=16, top_k=4, expert_dim=1024,
                         vocab_size=16384, max_seq_len=4096)
    model = _model(cfg, device, torch.bfloat16)
    engine = fxoverlap.optimize(model, dist.group.WORLD)
    for mbs in (1, 2):
        batches = _batches(cfg, 4, mbs, 4096, device)
        _eager(model, batches)  # warm-up: allocator, capture
        engine.forward_backward(batches)
        model.zero_grad(set_to_none=True)
        peak_e, base = _peak(lambda: [model(*b).backward() for b in batches])
        model.zero_grad(set_to_none=True)
        peak_f, _ = _peak(lambda: engine.forward_backward(batches))
        emit(dict(check="peak_memory", micro_batch_size=mbs, seq=4096, microbatches=4,
                  eager_GiB=peak_e / 2**30, fx_GiB=peak_f / 2**30, ratio=peak_f / peak_e,
                  eager_above_base_GiB=(peak_e - base) / 2**30, fx_above_base_GiB=(peak_f - base) / 2**30,
                  ok=peak_f <= 1.10 * peak_e))
        model.zero_grad(set_to_none=True)


def check_recompute(device, emit):
    n, layers = 4, 4
    cfg = MoEConfig.tiny(dim=1024, n_heads=8, n_layers=layers, n_experts=16, top_k=4, expert_dim=512,
                         vocab_size=8192, max_seq_len=2048, mhc_rate=n)
    model = _model(cfg, device, torch.bfloat16)
    batches = _batches(cfg, 3, 2, 2048, device)
    peaks = {}
    for group in (None, 1, 2):
        engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(mhc_recompute_group=group))
        engine.forward_backward(batches)
        model.zero_grad(set_to_none=True)
        peaks[group], base = _peak(lambda: engine.forward_backward(batches))
        model.zero_grad(set_to_none=True)
    for group in (1, 2):
        # The mHC paper's block-recompute estimate of resident mHC memory, in units of one
        # layer's C = tokens x dim: n*C*ceil(L/Lr) + (n+2)*C*Lr, against (n+2)*C*L saved.
        predicted = 1 - (n * math.ceil(layers / group) + (n + 2) * group) / ((n + 2) * layers)
        measured = 1 - (peaks[group] - base) / (peaks[None] - base)
        emit(dict(check="mhc_recompute_memory", layers=layers, mhc_rate=n, group=group,
                  off_GiB=peaks[None] / 2**30, on_GiB=peaks[group] / 2**30,
                  measured_reduction_above_base=measured, paper_formula_reduction_of_mhc_memory=predicted,
                  ok=peaks[group] < peaks[None]))


def _step_time(fn, iters: int = 3) -> float:
    """Seconds per call of ``fn`` after one warm-up call (captures, allocator, Inductor)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def check_ac(device, emit):
    base_cfg = MoEConfig.benchmark()
    n, mbs, seq = 4, 1, 4096
    rows = {}
    for ac in (False, True, "replay"):
        cfg = dataclasses.replace(base_cfg, activation_checkpoint=bool(ac))
        model = _model(cfg, device, torch.bfloat16)
        batches = _batches(cfg, n, mbs, seq, device)
        engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(ac_replay_comm=ac == "replay"))
        # the torch.compile backend with the same AC (one microbatch per call, as a user's loop)
        compiled = torch.compile(model, backend="fxoverlap", options={"ac_replay_comm": True} if ac == "replay" else None)
        inductor = torch.compile(model)  # the baseline: plain torch.compile with the same AC (once per AC)

        def loop(fn):
            losses = []
            for b in batches:
                loss = fn(*b)
                loss.backward()
                losses.append(loss.detach().float())
            return losses

        steps = {"eager": lambda: loop(model), "fx": lambda: [x.float() for x in engine.forward_backward(batches)],
                 "backend": lambda: loop(compiled), "compile": lambda: loop(inductor)}
        if ac == "replay":  # the replay is fxoverlap's option: the model, hence compile's run, is the "on" one
            del steps["compile"]
        row: dict = {}
        for name, step in steps.items():
            row[f"{name}_ms"] = 1e3 * _step_time(step)
            model.zero_grad(set_to_none=True)
            peak, base = _peak(step)
            row[f"{name}_GiB"], row[f"{name}_base_GiB"] = peak / 2**30, base / 2**30
            model.zero_grad(set_to_none=True)
        ref = loop(model)
        model.zero_grad(set_to_none=True)
        for name in set(steps) - {"eager"}:
            row[f"{name}_loss_rel_diff"] = max(float((a - b).abs() / b.abs()) for a, b in zip(steps[name](), ref))
            model.zero_grad(set_to_none=True)
        # what fxoverlap keeps and eager (which communicates again in its replay) does not:
        # each MoE layer's dispatch and combine outputs, tokens x top_k rows of dim each
        rows_routed = mbs * seq * cfg.top_k * dist.get_world_size()  # dropless: on average per rank
        alltoall = sum(p == "moe" for p in cfg.pattern) * 2 * rows_routed * cfg.dim * 2 // dist.get_world_size()
        row.update(recompute_stages=sum(s.kind.value.startswith("recompute") for s in engine.stages),
                   alltoall_outputs_GiB_per_microbatch=alltoall / 2**30)
        rows[ac] = row
        emit(dict(check="activation_checkpointing_row", ac=str(ac), **row))
        engine.close()
        fxoverlap.backend.reset()
        torch._dynamo.reset()
        del engine, model, compiled, inductor, steps
        gc.collect()
        torch.cuda.empty_cache()
    off, on, replay = rows[False], rows[True], rows["replay"]
    emit(dict(check="activation_checkpointing", shape="peer", microbatches=n, micro_batch_size=mbs, seq=seq,
              ranks=dist.get_world_size(), off=off, on=on, replay=replay,
              ratio_fx_vs_eager_with_ac=on["fx_GiB"] / on["eager_GiB"],
              ratio_fx_replay_vs_eager_with_ac=replay["fx_GiB"] / replay["eager_GiB"],
              ratio_backend_vs_eager_with_ac=on["backend_GiB"] / on["eager_GiB"],
              ratio_backend_replay_vs_eager_with_ac=replay["backend_GiB"] / replay["eager_GiB"],
              ratio_compile_vs_eager_with_ac=on["compile_GiB"] / on["eager_GiB"],
              fx_replay_comm_cost=replay["fx_ms"] / off["fx_ms"],
              eager_ac_saving_GiB=off["eager_GiB"] - on["eager_GiB"], fx_ac_saving_GiB=off["fx_GiB"] - on["fx_GiB"],
              eager_replay_cost=on["eager_ms"] / off["eager_ms"], fx_replay_cost=on["fx_ms"] / off["fx_ms"],
              ok=min(on["fx_GiB"], replay["fx_GiB"]) <= 1.10 * on["eager_GiB"] and on["recompute_stages"] > 0
              and max(on["fx_loss_rel_diff"], replay["fx_loss_rel_diff"]) < 2**-6))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checks", default="numerics,memory,recompute")
    p.add_argument("--out", default=None)
    p.add_argument("--small", action="store_true", help="a small model for the numerics check (e.g. under CSAN)")
    p.add_argument("--routings", default=",".join(ROUTINGS), help="routings of the numerics check")
    args = p.parse_args()
    fxoverlap.enable_dynamic_output_shapes()  # the backend's documented setup: dropless dispatch in the graph
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=120))
    results = []

    def emit(r):
        results.append(r)
        if dist.get_rank() == 0:
            print("CHECK " + json.dumps(r), flush=True)

    for name in args.checks.split(","):
        if name == "numerics":
            check_numerics(device, emit, small=args.small, routings=args.routings.split(","))
        else:
            checks = {"memory": check_memory, "recompute": check_recompute, "csan": check_csan, "row_sum": check_row_sum,
                      "symm_mem": check_symm_mem, "symm_mem_smoke": check_symm_mem_smoke, "ac": check_ac}
            checks[name](device, emit)
    if args.out and dist.get_rank() == 0:
        with open(args.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
