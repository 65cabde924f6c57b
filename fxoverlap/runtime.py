"""Runtime: executes stages against a per-microbatch value store. It never rewrites graphs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn

from fxoverlap.passes.capture import Capture
from fxoverlap.stage import Stage


def static_values(capture: Capture, model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of ``model`` under their placeholder names."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    out = {ph: params[fqn] for ph, fqn in capture.param_placeholders.items()}
    out.update({ph: buffers[fqn] for ph, fqn in capture.buffer_placeholders.items()})
    return out


def microbatch_values(capture: Capture, inputs: Sequence[torch.Tensor], loss_dtype: torch.dtype) -> dict:
    store = dict(zip(capture.input_placeholders, inputs))
    return store


def run_stage(stage: Stage, store: dict) -> None:
    outs = stage.graph_module(*[store[i] for i in stage.inputs])
    store.update(zip(stage.outputs, outs))


def seed_tangent(capture: Capture, store: dict) -> None:
    """The loss gradient eager's ``loss.backward()`` starts from: ones."""
    store[capture.tangent_placeholder] = torch.ones_like(store[capture.loss_name])


def accumulate_grads(capture: Capture, store: dict, model: nn.Module) -> None:
    """Add this microbatch's gradients into ``p.grad`` as eager's AccumulateGrad does."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, fqn in zip(capture.output_names[1:], capture.grad_targets):
        if name is None or fqn is None:
            continue
        p, g = params[fqn], store[name]
        if p.grad is None:
            p.grad = g.detach().clone() if g.data_ptr() == p.data_ptr() else g.detach()
        else:
            p.grad.add_(g)


def run_plain(stages: Iterable[Stage], capture: Capture, model: nn.Module, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """One microbatch, stages in plain order (all forward, then all backward)."""
    store = static_values(capture, model)
    store.update(zip(capture.input_placeholders, inputs))
    stages = list(stages)
    with torch.no_grad():
        for s in stages:
            if s.direction.value == "bwd" and capture.tangent_placeholder not in store:
                seed_tangent(capture, store)
            run_stage(s, store)
        accumulate_grads(capture, store, model)
    return store[capture.loss_name].detach()
