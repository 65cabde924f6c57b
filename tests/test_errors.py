"""Bad input gets a clear error naming the node, the op and the reason (or a documented fallback)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import error_cases
import fxoverlap
from fxoverlap import ops
from fxoverlap.models import MoEConfig
from fxoverlap.passes import CaptureError, TagError, capture, split, tag
from fxoverlap.testing import run_distributed


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.ffn = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.ffn(x)


class Stack(nn.Module):
    def __init__(self, n=2, reduce=True):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.reduce = reduce

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).sum() if self.reduce else x


def test_no_layers_falls_back_with_warning_and_stays_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    engine = fxoverlap.optimize(model)
    with pytest.warns(UserWarning, match="no decoder layers found"):
        engine.forward_backward([(x,)], loss_fn=lambda out, x: out.sum())
    assert [s.name for s in engine.stages] == ["fwd_model_head", "bwd_model_head"]
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))


class TopLevelA2A(Stack):
    def forward(self, x):
        counts = torch.tensor([x.shape[0]])
        x, _ = ops.dispatch(x, counts, None)  # an all-to-all outside every layer
        return super().forward(x)


def test_all_to_all_outside_layers_names_node_and_op():
    with pytest.raises(TagError, match=r"node dispatch \(fxoverlap\.dispatch\) is an all-to-all outside every decoder layer"):
        tag(capture(TopLevelA2A(), (torch.randn(4, 8),)))


def test_non_scalar_output_without_loss_fn():
    engine = fxoverlap.optimize(Stack(reduce=False))
    with pytest.raises(CaptureError, match=r"returned a tensor of shape \[4, 8\].*pass loss_fn="):
        engine.forward_backward([torch.randn(4, 8)])
    # ... and the same model works once a loss function is given
    losses = engine.forward_backward([torch.randn(4, 8)], loss_fn=lambda out, x: out.mean())
    assert losses[0].dim() == 0


class SyncBlock(Block):
    def forward(self, x):
        scale = x.detach().abs().max().item()  # host sync
        return x + self.ffn(x) * scale


def test_host_sync_marks_stage_not_capturable():
    model = Stack()
    model.layers[1] = SyncBlock()
    cap = capture(model, (torch.randn(4, 8),))
    stages = {s.name: s for s in split(tag(cap), cap.num_layers)}
    assert not stages["fwd_l1_attn"].capturable
    assert "host sync at node _local_scalar_dense" in stages["fwd_l1_attn"].not_capturable_reason
    assert stages["fwd_l0_mlp"].capturable


def test_empty_microbatch_list():
    with pytest.raises(ValueError, match="empty list of microbatches"):
        fxoverlap.optimize(Stack()).forward_backward([])


def test_microbatch_shapes_differ():
    engine = fxoverlap.optimize(Stack())
    with pytest.raises(ValueError, match=r"microbatch 1 has inputs \(float32\[2, 8\]\) but microbatch 0 has \(float32\[4, 8\]\)"):
        engine.forward_backward([torch.randn(4, 8), torch.randn(2, 8)])


def test_new_shapes_in_a_later_call_are_captured_anew():
    torch.manual_seed(0)
    model = Stack()
    engine = fxoverlap.optimize(model)
    for rows in (4, 6):
        x = torch.randn(rows, 8)
        model.zero_grad(set_to_none=True)
        model(x).backward()
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        engine.forward_backward([x])
        assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))
    # one plan per input signature, kept: the last call ran the 6-row plan's program, and
    # the 4-row plan is still there, with a capture of its own
    six, four = engine.plan([torch.randn(6, 8)]), engine.plan([torch.randn(4, 8)])
    assert engine.program is six.program
    assert four.capture is not six.capture and four.capture.signature != six.capture.signature
    assert engine.plan([torch.randn(4, 8)]).program is four.program


def test_config_errors():
    with pytest.raises(ValueError, match="mhc_recompute_group"):
        fxoverlap.OverlapConfig(mhc_recompute_group=0)
    with pytest.raises(ValueError, match="layer_pattern entries"):
        MoEConfig.tiny(layer_pattern=("moe", "mlp"))
    with pytest.raises(ValueError, match="token_dedup needs routing='dropless'"):
        MoEConfig.tiny(routing="capacity", token_dedup=True)


def test_expert_count_not_divisible_by_group():
    for msg, token_msg in run_distributed(error_cases.bad_expert_split):
        assert "has 3 experts" in msg and "group of 2 ranks" in msg
        assert "token_dispatch: 3 experts cannot be split" in token_msg and "group of 2 ranks" in token_msg


def test_rank_failure_does_not_hang_peers():
    """Documented behaviour: the failing rank aborts the EP group, so a peer blocked
    in a collective gets a connection error instead of waiting for a timeout."""
    (kind0, msg0, t0), (kind1, msg1, t1) = run_distributed(error_cases.rank_failure)
    assert kind1 == "StageFailed" and "stage fwd_l1_attn" in msg1 and "injected failure" in msg1
    assert kind0 == "StageFailed" and "fwd_l1_dispatch" in msg0
    assert t0 < 60, f"peer took {t0:.1f}s to notice"
