"""Workers for tests/test_rng.py (spawned ranks import this module by name)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.models import MoEConfig
from fxoverlap.testing import eager_steps, grad_diff, take_grads
from numerics_cases import make_batches
from rng_models import RandomTransformer

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()

CFG = dict(n_layers=2, dim=32, n_heads=2, n_experts=4, expert_dim=16, vocab_size=64)
SEED = 1  # the generator's seed before each run: eager and fxoverlap start from the same state


def _model(group, cfg: dict, model: dict) -> RandomTransformer:
    torch.manual_seed(0)
    return RandomTransformer(MoEConfig.tiny(**{**CFG, **cfg}), group, **model)


def _compare(losses, ref_losses, model, ref, state) -> dict:
    diff, scale, bitwise = grad_diff(model, ref)
    model.zero_grad(set_to_none=True)
    return dict(losses_equal=len(losses) == len(ref_losses) and all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
                loss_diff=max((a - b).abs().item() for a, b in zip(losses, ref_losses)),
                grads_bitwise=bitwise, grad_diff=diff, grad_scale=scale,
                generator_equal=torch.equal(state, torch.get_rng_state()))


def optimize_vs_eager(rank: int, world: int, variants: list[dict]) -> list[dict]:
    """Per variant and microbatch count: two forward_backward calls against two eager rounds
    from the same seed; losses, gradients and the generator's final state."""
    out = []
    for v in variants:
        model = _model(dist.group.WORLD, v.get("cfg", {}), v.get("model", {}))
        engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(**v.get("config", {})))
        for n in v["ns"]:
            mbs = make_batches(rank, CFG["vocab_size"], n, seed=n)
            torch.manual_seed(SEED)
            ref_losses = eager_steps(model, mbs, rounds=2)
            ref, state = take_grads(model), torch.get_rng_state()
            torch.manual_seed(SEED)
            losses = engine.forward_backward(mbs) + engine.forward_backward(mbs)
            out.append(dict(variant=v, n=n, **_compare(losses, ref_losses, model, ref, state)))
    return out


def backend_vs_eager(rank: int, world: int, variants: list[dict]) -> list[dict]:
    """``torch.compile(model, backend="fxoverlap")``, one microbatch per call, two rounds."""
    out = []
    for v in variants:
        torch._dynamo.reset()
        model = _model(dist.group.WORLD, v.get("cfg", {}), v.get("model", {}))
        mbs = make_batches(rank, CFG["vocab_size"], 3)
        torch.manual_seed(SEED)
        ref_losses = eager_steps(model, mbs, rounds=2)
        ref, state = take_grads(model), torch.get_rng_state()
        compiled = torch.compile(model, backend="fxoverlap")
        torch.manual_seed(SEED)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = eager_steps(compiled, mbs, rounds=2)  # the same loop, through the backend
        fallbacks = [str(w.message) for w in caught if w.category.__name__ == "FallbackWarning"]
        stages = [s.name for s in fxoverlap.backend.last_stages()]
        out.append(dict(variant=v, fallbacks=fallbacks, stages=stages,
                        **_compare(losses, ref_losses, model, ref, state)))
    return out
