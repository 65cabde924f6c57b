"""Models with a submodule registered twice, and the workers for their 2-rank tests
(spawned ranks import this module by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import fxoverlap
from fxoverlap import ops
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import eager_steps, grad_diff, take_grads
from numerics_cases import make_batches

# How a reference MoE model gets a submodule under two paths:
# "shared_norm": layer 1's ffn_norm is layer 0's (one norm, run by both layers);
# "first": layer 0 also kept as ``model.first`` (an alias, not called);
# "head_norm": the final norm is layer 0's attention_norm (run inside layer 0 and in the head);
# "shared_moe": layer 1's MoE block is layer 0's (its dispatch and combine run in both layers).
SHARING = ("shared_norm", "first", "head_norm", "shared_moe")


def share(model: MoETransformer, how: str) -> MoETransformer:
    """``model`` with a submodule registered twice, as ``how`` (one of :data:`SHARING`) says."""
    if how == "shared_norm":
        model.layers[1].ffn_norm = model.layers[0].ffn_norm
    elif how == "first":
        model.first = model.layers[0]
    elif how == "head_norm":
        model.norm = model.layers[0].attention_norm
    elif how == "shared_moe":
        model.layers[1].moe = model.layers[0].moe
    else:
        raise AssertionError(how)
    return model


def shared_model(how: str | tuple[str, ...], group=None, seed: int = 0, **cfg) -> MoETransformer:
    torch.manual_seed(seed)
    model = MoETransformer(MoEConfig.tiny(**cfg), group)
    for h in (how,) if isinstance(how, str) else how:
        share(model, h)
    return model


class Branchy(nn.Module):
    """``inner`` then a Python branch on a tensor's value: fine in eager, a data-dependent
    guard that cannot be traced under fake tensors."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if out.sum() > 0:
            out = out * 1.0
        return out


class OutsideA2A(nn.Module):
    """An all-to-all on the head's hidden state: outside every decoder layer (a TagError)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows = h.flatten(0, -2)
        out, _ = ops.dispatch(rows, torch.tensor([rows.shape[0]]), None)
        return out.view_as(h)


class LazyBuffer(nn.Module):
    """Registers a buffer the first time it runs (a cache built on first use)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "scale"):
            self.register_buffer("scale", torch.ones(x.shape[-1]))
        return x * self.scale


def ep_against_eager(rank: int, world: int, variants: list[str]) -> dict:
    """Each sharing variant on EP 2 (compiler="eager", 2 microbatches): bitwise eager's losses
    and gradients? Per variant: (losses equal, grads bitwise, missing grads, the error if any)."""
    out = {}
    mbs = make_batches(rank, 256, 2)
    for how in variants:
        ref = shared_model(how, dist.group.WORLD)
        ref_losses = eager_steps(ref, mbs)
        ref_grads = take_grads(ref)
        model = shared_model(how, dist.group.WORLD)
        engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(compiler="eager"))
        try:
            losses = engine.forward_backward(mbs)
        except Exception as e:  # noqa: BLE001 - the test reports it
            out[how] = (False, False, [], f"{type(e).__name__}: {e}")
            continue
        diff = grad_diff(model, ref_grads)
        missing = sorted(n for n, p in model.named_parameters() if (p.grad is None) != (n not in ref_grads))
        out[how] = (all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), diff[2], missing, None)
    return out
