"""Workers and helpers for the activation-checkpointing tests (2 gloo ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import fxoverlap
from fxoverlap.testing import grad_diff
from numerics_cases import eager_grads, make_batches

# "save matmuls, recompute the rest"
MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                     torch.ops.fxoverlap.grouped_mm.default})


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_layers(model: nn.Module, policy=None) -> nn.Module:
    """Wrap every decoder layer in ``checkpoint_wrapper``, as torchtitan's apply_ac does;
    with ``policy``, selective AC (``create_selective_checkpoint_contexts(policy)``)."""
    layers = model.layers
    kw = {} if policy is None else dict(context_fn=lambda: create_selective_checkpoint_contexts(policy))
    for name, layer in list(layers.named_children()):
        layers.register_module(name, checkpoint_wrapper(layer, **kw))
    return model


def eager_saved_bytes(model: nn.Module, batch) -> int:
    """Bytes of the activations eager autograd keeps for the backward of one step (distinct
    storages packed by saved-tensor hooks, parameters and buffers left out). Inside a
    checkpoint, the checkpoint's own hooks take over, so what it keeps is its inputs."""
    static = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in static:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(kept.values())
