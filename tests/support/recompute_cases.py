"""Workers for the 2-rank mHC recompute tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import grad_diff
from numerics_cases import eager_grads, make_batches


def _check(model, engine, vocab: int, ns) -> list[dict]:
    rows = []
    for n in ns:
        mbs = make_batches(dist.get_rank(), vocab, n, seed=n)
        ref_losses, ref = eager_grads(model, mbs)
        losses = engine.forward_backward(mbs)
        diff, scale, bitwise = grad_diff(model, ref)
        model.zero_grad(set_to_none=True)
        rows.append(dict(
            n=n, losses_equal=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), diff=diff,
            scale=scale, bitwise=bitwise, peak=max(b for _, _, b in engine.memory_trace),
            recompute=[s.name for s in engine.stages if s.kind.value == "recompute"],
        ))
    return rows


def reference(rank: int, world: int, cases: list[tuple[dict, int | None]], ns: list[int]) -> list[list[dict]]:
    """mHC reference model: (model config, recompute group) per case, each over ns microbatch counts."""
    out = []
    for kw, group in cases:
        torch.manual_seed(0)
        cfg = MoEConfig.tiny(**kw)
        model = MoETransformer(cfg, dist.group.WORLD)
        cfg_o = fxoverlap.OverlapConfig(mhc_recompute_group=group, record_memory=True)
        out.append(_check(model, fxoverlap.optimize(model, dist.group.WORLD, cfg_o), cfg.vocab_size, ns))
    return out


def standalone(rank: int, world: int, groups: list[int | None]) -> list[list[dict]]:
    """The hyper-connection model in tests/hc_models.py (marked only with the region)."""
    from hc_models import HCMoETransformer

    out = []
    for group in groups:
        torch.manual_seed(0)
        model = HCMoETransformer(dist.group.WORLD, pattern=("moe", "moe", "dense"))
        cfg_o = fxoverlap.OverlapConfig(mhc_recompute_group=group, record_memory=True)
        out.append(_check(model, fxoverlap.optimize(model, dist.group.WORLD, cfg_o), 128, [2]))
    return out
