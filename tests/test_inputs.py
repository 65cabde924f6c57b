"""What fxoverlap is given: the decoder-layer list both entry points find, the call
contract (``model(*mb)``, ``loss_fn(output, *mb)``), and the checks of microbatches
and process groups (with the EP ranks' agreement on the microbatches)."""

from __future__ import annotations

import warnings

import pytest
import torch

import error_cases
import fxoverlap
from fxoverlap import backend
from fxoverlap.passes import TagError, capture, tag
from fxoverlap.testing import run_distributed
from layer_cases import ListExpertModel
from test_errors import Stack, TopLevelA2A


def _loss(out, x):
    return out.pow(2).mean()


def _eager(model, mbs):
    losses = []
    for mb in mbs:
        loss = _loss(model(*mb), *mb)
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return losses, grads


def test_layers_are_the_outer_list_not_the_longer_experts_list_in_both_entry_points():
    torch.manual_seed(0)
    model = ListExpertModel(n_layers=2, n_experts=4)
    mbs = [(torch.randn(8, 8),) for _ in range(3)]
    ref_losses, ref_grads = _eager(model, mbs)
    _, ref_grads0 = _eager(model, mbs[:1])

    engine = fxoverlap.optimize(model)
    losses = engine.forward_backward(mbs, _loss)
    choice = engine.plan(mbs, _loss).capture.layer_choice
    assert choice.container == "blocks"
    assert ("blocks.0.ffn.experts", 4) in choice.considered
    assert {s.layer for s in engine.stages if s.kind.name == "DISPATCH"} == {0, 1}
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(p.grad, ref_grads[n]) for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxoverlap")
    with warnings.catch_warnings():
        warnings.simplefilter("error", backend.FallbackWarning)
        loss = _loss(compiled(*mbs[0]), *mbs[0])
        loss.backward()
    step = backend.last_compiled()
    assert step is not None and step.capture.layer_choice.container == "blocks"
    assert step.capture.layer_names == ["blocks.0", "blocks.1"]
    assert {s.layer for s in step.stages if s.kind.name == "DISPATCH"} == {0, 1}
    assert torch.equal(loss.detach(), ref_losses[0])
    assert all(torch.equal(p.grad, ref_grads0[n]) for n, p in model.named_parameters())


def test_all_to_all_outside_every_list_names_layer_container_and_the_lists_considered():
    with pytest.raises(TagError, match=r"outside every decoder layer of 'layers'.*Layer lists considered: "
                                       r"'layers' \(2 entries\).*OverlapConfig\(layer_container="):
        tag(capture(TopLevelA2A(), (torch.randn(4, 8),)))


def test_layer_container_that_is_not_a_list():
    engine = fxoverlap.optimize(ListExpertModel(), config=fxoverlap.OverlapConfig(layer_container="head"))
    with pytest.raises(RuntimeError, match=r"layer_container='head'\) names a Linear"):
        engine.forward_backward([(torch.randn(8, 8),)], _loss)


def test_microbatches_given_as_a_tensor():
    engine = fxoverlap.optimize(Stack())
    with pytest.raises(TypeError, match=r"microbatches is a tensor of shape \[3, 4, 8\], not a list"):
        engine.forward_backward(torch.randn(3, 4, 8))
    assert isinstance(pytest.raises(fxoverlap.InputError, engine.forward_backward, torch.randn(3, 4, 8)).value,
                      TypeError)


def test_one_microbatch_without_its_list():
    engine = fxoverlap.optimize(Stack())
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"tuple of 2 tensors \(float32\[4, 8\], float32\[4, 8\]\): one "
                                        r"microbatch without its list\? .*\[\(tokens, labels\)\]"):
        engine.forward_backward((x, y), loss_fn=lambda out, x, y: (out - y).pow(2).sum())


def test_microbatch_longer_than_forward_takes():
    engine = fxoverlap.optimize(Stack(reduce=False))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"microbatch 0 has 2 tensor\(s\) \(float32\[4, 8\], float32\[4, 8\]\), "
                                        r"and fxoverlap calls model\(\*microbatch\), but Stack.forward\(x\) does "
                                        r"not take them"):
        engine.forward_backward([(x, y)], loss_fn=lambda out, x, y: (out - y).pow(2).sum())
    # the same data, as the contract says: the model gets x, the loss function (output, x, y)
    # (here through a forward that takes both)
    engine.model.forward = lambda x, y: Stack.forward(engine.model, x)
    loss = engine.forward_backward([(x, y)], loss_fn=lambda out, x, y: (out - y).pow(2).sum())[0]
    assert loss.dim() == 0


def test_forward_only_call_checks_the_contract():
    engine = fxoverlap.optimize(Stack(reduce=False))
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"engine\(\*inputs\): microbatch 0 has 2 tensor\(s\).*Stack.forward\(x\)"):
        engine(x, x)
    assert engine(x).shape == (4, 8)


def test_loss_fn_that_does_not_take_the_microbatch():
    engine = fxoverlap.optimize(Stack(reduce=False))
    with pytest.raises(TypeError, match=r"fxoverlap calls loss_fn\(output, \*microbatch\), but loss_fn\(out\) "
                                        r"does not take them"):
        engine.forward_backward([torch.randn(4, 8)], loss_fn=lambda out: out.sum())


@pytest.mark.parametrize("name", ["ep_group", "dp_group", "expert_dp_group"])
def test_groups_must_be_process_groups(name):
    kwargs = {"ep_group": None, "dp_group": None, "expert_dp_group": None, name: 2}
    with pytest.raises(TypeError, match=rf"{name} is 2, of type int .*must be a torch.distributed.ProcessGroup "
                                        r"or None"):
        fxoverlap.optimize(Stack(), kwargs.pop("ep_group"), **kwargs)


def test_ranks_that_disagree_on_the_microbatch_count_both_raise():
    for rank, (kind, msg, is_value_error, seconds) in enumerate(run_distributed(error_cases.microbatch_count_mismatch)):
        assert kind == "MicrobatchMismatch" and is_value_error, (rank, kind, msg)
        assert "rank 0: 3 microbatch(es) of (int64[2, 16], int64[2, 16])" in msg
        assert "rank 1: 2 microbatch(es)" in msg
        assert seconds < 30, f"rank {rank} took {seconds:.1f}s"


def test_backend_graph_break_at_tolist_is_named_with_the_fixes():
    """Dropless EP with host split sizes (``.tolist()``) through the backend: Dynamo breaks
    every layer's graph; the fallback warning names the break and the fixes, not an
    all-to-all outside the layers."""
    import layer_cases

    (res,) = run_distributed(layer_cases.host_split_backend_warnings, world_size=1)
    assert res["equal"]
    named = [w for w in res["warnings"] if "a graph break split the decoder layers" in w]
    assert named, res["warnings"]
    for w in named:
        assert "_local_scalar_dense" in w and ".tolist()" in w
        assert "dispatcher='padded' | 'symm_mem'" in w
        assert "capture_scalar_outputs = True" in w and "fxoverlap.optimize(model, ep_group)" in w
    assert not any("outside every decoder layer" in w and "graph break" not in w for w in res["warnings"])
