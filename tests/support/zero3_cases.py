"""Workers for the ZeRO-3 tests (``OverlapConfig(shard_params=True)``): 4 gloo ranks, EP 2 x DP 2
(spawned ranks import this module); the layout and references of ``dp_cases``.

The reference trains an unsharded copy of the model in eager: backward over the microbatches,
the gradients reduced by hand parameter by parameter (``dp_cases.reduce_by_hand``), the same
optimizer on every full parameter. The engine's model holds DTensor shards; its parameters are
compared by ``full_tensor()``.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

import fxoverlap
from dp_cases import groups, is_expert, make_model, reduce_by_hand
from fxoverlap.ir.program import program_of, reshard, unshard, wait_unshard
from fxoverlap.testing import eager_steps, take_grads
from numerics_cases import make_batches


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {k: _full(p.grad).clone() for k, p in model.named_parameters() if p.grad is not None}


def _worst(model, ref_model) -> float:
    ref = dict(ref_model.named_parameters())
    return max((_full(p.detach()) - ref[k].detach()).abs().max().item() for k, p in model.named_parameters())


def placement(program) -> dict:
    """Where the program gathers and drops each unit, from its node order."""
    nodes = [n for n in program.graph.nodes if n.op in ("call_module", "call_function")]
    ahead, per_unit, open_, bad = [], {}, {}, []
    stage_pos = [i for i, n in enumerate(nodes) if n.op == "call_module"]
    for i, n in enumerate(nodes):
        if n.target is unshard:
            open_[n.args[0]] = i
            per_unit.setdefault(n.args[0], [0, 0])[0] += 1
        elif n.target is wait_unshard:
            start = open_.get(n.args[0])
            if start is None:
                bad.append(f"wait before unshard of unit {n.args[0]}")
                continue
            # stages issued between the gather and its wait: what it hides under
            ahead.append(sum(1 for j in stage_pos if start < j < i))
        elif n.target is reshard:
            open_.pop(n.args[0], None)
            per_unit.setdefault(n.args[0], [0, 0])[1] += 1
    return dict(ahead=ahead, per_unit=per_unit, bad=bad, peak=program_of(program).gathered_peak,
                units=[(u.name, u.role, len(u.params)) for u in program_of(program).units])


def train(rank: int, world: int, delay: bool = False, chunks: int = 1, steps: int = 2, n: int = 3) -> dict:
    """``steps`` optimizer steps, the engine (ZeRO-3) against eager + manual reduction."""
    ep, edp = groups()
    ref_model, vocab = make_model("moe", ep)
    model, _ = make_model("moe", ep)
    cfg = fxoverlap.OverlapConfig(shard_params=True, delay_wgrad=delay, chunks=chunks, reduce_bucket_mb=0,
                                  record_memory=True)
    engine = fxoverlap.optimize(model, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built before the shards: retargeted
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    out = dict(grad_diff=[], param_diff=[], scale=max(p.abs().max().item() for p in ref_model.parameters()))
    for step in range(steps):
        mbs = make_batches(rank, vocab, n, seed=20 + step)
        eager_steps(ref_model, mbs)
        ref = reduce_by_hand(take_grads(ref_model), edp)
        engine.forward_backward(mbs)
        got = _full_grads(model)
        out["grad_diff"].append({
            "expert": max((got[k] - ref[k]).abs().max().item() for k in ref if is_expert(k)),
            "dense": max((got[k] - ref[k]).abs().max().item() for k in ref if not is_expert(k)),
            "missing": sorted(ref.keys() - got.keys())})
        for k, p in ref_model.named_parameters():
            p.grad = ref[k]
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["param_diff"].append(_worst(model, ref_model))
    out["placement"] = placement(engine.program)
    out["types"] = sorted({type(p).__name__ for p in model.parameters()})
    return out


def smoke(rank: int, world: int) -> dict:
    return train(rank, world)


def program_lines(rank: int, world: int, n: int = 3, delay: bool = False) -> list[str]:
    """The program's stage calls and unit nodes (rank 0's), for reading and snapshots."""
    ep, edp = groups()
    model, vocab = make_model("moe", ep)
    cfg = fxoverlap.OverlapConfig(shard_params=True, reduce_bucket_mb=0, delay_wgrad=delay)
    engine = fxoverlap.optimize(model, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp)
    program = engine.plan(make_batches(rank, vocab, n)).program
    names = {u.index: u.name for u in program_of(program).units}
    out = []
    for node in program.graph.nodes:
        if node.op == "call_module":
            out.append(f"  {node.target}")
        elif node.target in (unshard, wait_unshard, reshard):
            out.append(f"{node.target.__name__}({names[node.args[0]]})")
    return out
