"""Workers for the data-parallel tests: 4 gloo ranks, EP 2 x DP 2 (spawned ranks import this module).

Rank layout (``init_device_mesh("cpu", (2, 2), ("edp", "ep"))``): EP groups {0, 1} and
{2, 3}; expert-DP groups {0, 2} and {1, 3}; dp_group is the world. The reference is eager
backward over the microbatches, then the reduction by hand, parameter by parameter:
``all_reduce(p.grad, group)`` and ``/ |dp_group|``, where ``group`` is the expert-DP group
for expert weights (known here by name, not from fxoverlap's graph analysis) and the
world for the rest.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.program_ops import finish_reduce, reduce_grads
from fxoverlap.testing import eager_steps, take_grads
from numerics_cases import make_batches

EXPERT_NAMES = ("moe.experts.", "moe.w_in", "moe.w_out")  # MoETransformer's and TitanTransformer's


def groups():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    return mesh["ep"].get_group(), mesh["edp"].get_group()


def make_model(name: str, ep_group):
    torch.manual_seed(0)
    if name == "titan":
        from titan_models import TitanTransformer

        return TitanTransformer(ep_group), 64
    cfg = MoEConfig.tiny(shared_expert_dim=32)
    return MoETransformer(cfg, ep_group), cfg.vocab_size


def is_expert(name: str) -> bool:
    return any(k in name for k in EXPERT_NAMES)


def reduce_by_hand(local: dict[str, torch.Tensor], edp) -> dict[str, torch.Tensor]:
    """The reference reduction, parameter by parameter."""
    out = {}
    for name, g in local.items():
        g = g.clone()
        dist.all_reduce(g, group=edp if is_expert(name) else dist.group.WORLD)
        out[name] = g.div_(dist.get_world_size())
    return out


def reduce_flat_by_hand(local: dict[str, torch.Tensor], buckets, edp, mode: str) -> dict[str, torch.Tensor]:
    """The same reduction on flat buffers laid out as the engine's buckets (so gloo sums
    each element in the same order): bitwise equal to the engine's where the rest is."""
    out = {}
    for b in buckets:
        group = edp if b.role == "expert" else dist.group.WORLD
        n = dist.get_world_size(group)
        flat = torch.zeros(b.padded_numel(n))
        for s in b.slots:
            flat[s.offset:s.offset + s.numel] = local[s.param].reshape(-1)
        if mode == "all_reduce":
            dist.all_reduce(flat, group=group)
        else:  # the rank's shard, placed back into the bucket (the rest stays unreduced)
            start, stop = b.shard(dist.get_rank(group), n)
            shard = flat.new_empty(stop - start)
            dist.reduce_scatter_tensor(shard, flat, group=group)
            flat[start:stop] = shard
        flat.div_(dist.get_world_size())
        for s in b.slots:
            out[s.param] = flat[s.offset:s.offset + s.numel].view(s.shape)
    return out


def _compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """Max abs diff, max |ref|, and whether the expert and the dense gradients are bitwise equal."""
    worst, scale, missing = 0.0, 0.0, sorted(ref.keys() ^ got.keys())
    bitwise = {"expert": True, "dense": True}
    for k in ref.keys() & got.keys():
        worst = max(worst, (got[k].double() - ref[k].double()).abs().max().item())
        scale = max(scale, ref[k].abs().max().item())
        bitwise["expert" if is_expert(k) else "dense"] &= torch.equal(got[k], ref[k])
    return dict(diff=worst, scale=scale, bitwise=bitwise, missing=missing)


def _shard_grads(engine, ref: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """reduce_scatter: the rank's shard pieces and the same slices of the reference."""
    got, want = {}, {}
    for i, piece in enumerate(engine.grad_reduction.shard_pieces()):
        key = f"{piece.param}[{piece.start}:{piece.start + piece.view.numel()}]#{i}"
        got[key] = piece.view.grad.clone()
        want[key] = ref[piece.param].reshape(-1)[piece.start:piece.start + piece.view.numel()]
    return got, want


def numerics(rank: int, world: int, models: list[str], ns: list[int]) -> list[dict]:
    """forward_backward with in-program reduction vs eager + manual reduction, per case."""
    ep, edp = groups()
    out = []
    for name in models:
        for delay in (False, True):
            for mode in ("all_reduce", "reduce_scatter"):
                model, vocab = make_model(name, ep)
                cfg = fxoverlap.OverlapConfig(delay_wgrad=delay, grad_reduce=mode, reduce_bucket_mb=0)
                engine = fxoverlap.optimize(model, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp)
                for n in ns:
                    mbs = make_batches(rank, vocab, n, seed=n)
                    eager_steps(model, mbs)
                    local = take_grads(model)
                    ref = reduce_by_hand(local, edp)
                    t0 = time.perf_counter()
                    engine.forward_backward(mbs)
                    row = dict(model=name, delay_wgrad=delay, mode=mode, n=n, seconds=time.perf_counter() - t0)
                    prog = engine.program
                    flat_ref = reduce_flat_by_hand(local, prog.meta["buckets"], edp, mode)
                    if mode == "all_reduce":
                        got = take_grads(model)
                        row.update(_compare(got, ref))
                        row["flat_bitwise"] = _compare(got, flat_ref)["bitwise"]
                    else:
                        row["p_grad_left"] = [k for k, p in model.named_parameters() if p.grad is not None]
                        got, want = _shard_grads(engine, ref)
                        row.update(_compare(got, want))
                        row["flat_bitwise"] = _compare(*_shard_grads(engine, flat_ref))["bitwise"]
                        row["shard_elements"] = sum(t.numel() for t in got.values())
                        for v in engine.shard_parameters():
                            v.grad = None
                    row["reduce_nodes"] = sum(1 for x in prog.graph.nodes if x.target is reduce_grads)
                    row["finish_nodes"] = sum(1 for x in prog.graph.nodes if x.target is finish_reduce)
                    out.append(row)
                if name == "moe" and not delay:
                    out.append(dict(model=name, mode=mode, grad_table=engine.grad_table()))
    return out
