"""What fxoverlap is given: the decoder-layer list both entry points find, the call
contract (``model(*mb)``, ``loss_fn(output, *mb)``), and the checks of microbatches
and process groups (with the EP ranks' agreement on the microbatches)."""

from __future__ import annotations

import warnings

import pytest
import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for torch
    np = None

import error_cases
import fxoverlap
import input_cases
from fxoverlap import backend
from fxoverlap.passes import TagError, capture, tag
from fxoverlap.testing import run_distributed
from layer_cases import ListExpertModel
from test_errors import Stack, TopLevelA2A

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()


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


# ---------------------------------------------------------------- microbatch types, keywords, the call check
_X = torch.randn(4, 8)


def _generator():
    yield _X


_UNSUPPORTED = {
    # name: (microbatches, type named, hint)
    "dict in a list of lists": ([[{"x": _X}]], "dict", "a dict is a whole microbatch, passed as keyword arguments"),
    "nested lists": ([[[_X], [_X]]], "list whose entry 0 is a list", "nested tuples or lists are not flattened"),
    "numpy microbatch": ([np.ones((4, 8), np.float32)] if np else None, "numpy.ndarray", "torch.from_numpy"),
    "numpy in a tuple": ([(_X, np.ones(3))] if np else None, "entry 1 is a numpy.ndarray", "torch.from_numpy"),
    "numpy microbatches": (np.ones((2, 4, 8), np.float32) if np else None, "microbatches is a numpy.ndarray",
                           "torch.from_numpy"),
    "string": (["the quick fox"], "str 'the quick fox'", "tokenize it first"),
    "strings": ("the quick fox", "microbatches is a str", "tokenize it first"),
    "None": ([None], "microbatch 0 is a NoneType", "leave an optional input out"),
    "None in a tuple": ([(_X, None)], "entry 1 is a NoneType", "leave an optional input out"),
    "int": ([3], "microbatch 0 is a int 3", "torch.tensor(value)"),
    "float in a tuple": ([(_X, 0.5)], "entry 1 is a float 0.5", "torch.tensor(value)"),
    "generator": ([_generator()], "microbatch 0 is a generator", "a tuple of the tensors in forward's order"),
    "set": ([{_X}], "microbatch 0 is a set", "a set has no order"),
    "set of microbatches": ({_X}, "microbatches is a set, which has no order", "pass a list of microbatches"),
    "dict of microbatches": ({"x": _X}, "microbatches is a dict (keys ['x'])", "Pass a list of them: [batch]"),
    "dict with a list value": ([{"x": [1, 2]}], "microbatch 0['x'] is a list", "nested tuples or lists are not"),
    "dict with an int key": ([{0: _X}], "with key 0 of type int", "keyword arguments: str"),
}


@pytest.mark.parametrize("case", list(_UNSUPPORTED))
def test_unsupported_microbatch_types_are_named_with_a_hint(case):
    microbatches, named, hint = _UNSUPPORTED[case]
    if microbatches is None:
        pytest.skip("numpy is not installed")
    engine = fxoverlap.optimize(Stack())
    with pytest.raises(fxoverlap.InputError) as info:
        engine.forward_backward(microbatches, loss_fn=lambda out, x: out.sum())
    msg = str(info.value)
    assert msg.startswith("forward_backward: ") and named in msg and hint in msg, msg
    assert isinstance(info.value, TypeError)
    assert engine.stages == []  # refused before anything was captured


class _Labelled(torch.nn.Module):
    """``forward(tokens, labels)``: the reference model's call, on a model of one rank."""

    def __init__(self):
        super().__init__()
        self.inner = Stack(reduce=False)

    def forward(self, x, labels):
        return (self.inner(x) - labels).pow(2).mean()


def test_mapping_microbatch_is_passed_as_keyword_arguments():
    """``{"x": x, "labels": y}`` is ``model(**batch)``, equal to eager; the keyword names are
    part of the signature (two key sets, two captures); the microbatches of one call share keys."""
    torch.manual_seed(0)
    model = _Labelled()
    mbs = [{"labels": torch.randn(4, 8), "x": torch.randn(4, 8)} for _ in range(2)]
    ref = []
    for mb in mbs:
        loss = model(**mb)
        loss.backward()
        ref.append(loss.detach())
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    engine = fxoverlap.optimize(model)
    losses = engine.forward_backward(mbs)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref))
    assert all(torch.equal(p.grad, ref_grads[n]) for n, p in model.named_parameters())
    by_keywords = engine.plan(mbs).capture
    assert by_keywords.signature[-1] == ("**", ("labels", "x"))
    # positional and mixed: other signatures, other captures, the same numbers
    model.zero_grad(set_to_none=True)
    positional = [(mb["x"], mb["labels"]) for mb in mbs]
    assert all(torch.equal(a, b) for a, b in zip(engine.forward_backward(positional), ref))
    assert engine.plan(positional).capture is not by_keywords
    with pytest.raises(fxoverlap.engine.MicrobatchError, match=r"microbatch 1 has keys \['x'\] but microbatch 0 has "
                                                               r"\['labels', 'x'\] \(only in 1: \[\]; only in 0: "
                                                               r"\['labels'\]\)"):
        engine.forward_backward([mbs[0], {"x": mbs[1]["x"]}])
    with pytest.raises(fxoverlap.InputError, match=r"fxoverlap calls model\(\*\*microbatch\), but "
                                                   r"_Labelled.forward\(x, labels\) does not take them"):
        engine.forward_backward([{"x": mbs[0]["x"], "label": mbs[0]["labels"]}])


def test_engine_call_takes_keyword_inputs():
    torch.manual_seed(0)
    model = Stack(reduce=False)
    x = torch.randn(4, 8)
    engine = fxoverlap.optimize(model)
    with torch.no_grad():
        want = model(x)
    assert torch.equal(engine(x=x), want) and torch.equal(engine(x), want)
    assert torch.equal(engine.forward_only([{"x": x}])[0], want)
    with pytest.raises(fxoverlap.InputError, match=r"engine\(\*inputs\): microbatch 0\['y'\] is a float"):
        engine(x, y=1.0)


def test_call_check_runs_for_every_new_loss_fn():
    """A second, wrong loss_fn on a signature already checked is an InputError, not a raw TypeError."""
    engine = fxoverlap.optimize(Stack(reduce=False))
    mbs = [torch.randn(4, 8)]
    assert engine.forward_backward(mbs, loss_fn=lambda out, x: out.sum())[0].dim() == 0
    with pytest.raises(fxoverlap.InputError, match=r"fxoverlap calls loss_fn\(output, \*microbatch\), but "
                                                   r"loss_fn\(out\) does not take them"):
        engine.forward_backward(mbs, loss_fn=lambda out: out.sum())
    with pytest.raises(fxoverlap.InputError, match=r"fxoverlap calls output_fn\(output, \*microbatch\), but "
                                                   r"output_fn\(out, x, y\) does not take them"):
        engine.forward_only(mbs, output_fn=lambda out, x, y: out)
    # a fresh lambda of the checked code is not checked again (keyed by code), and still runs
    for _ in range(2):
        assert engine.forward_backward(mbs, loss_fn=lambda out, x: out.sum())[0].dim() == 0


@pytest.mark.slow
def test_keyword_microbatches_with_expert_parallelism_equal_eager():
    """2 gloo ranks, EP over both: the reference model with {"tokens", "labels"} (forward_backward,
    forward_only, engine(**kwargs)) and a tiny Qwen3-MoE with {"input_ids"} and a loss on
    out.logits, each against eager on the same weights and data (eager stages: bitwise)."""
    pytest.importorskip("transformers")
    for rank, res in enumerate(run_distributed(input_cases.keyword_microbatches)):
        for key in ("ref_fb", "hf_fb"):
            r = res[key]
            assert r["losses_equal"] and r["grads"]["bitwise"] and not r["grads"]["missing"], (rank, key, r)
        assert res["ref_fb"]["keywords"] == ("**", ("labels", "tokens"))
        for key in ("ref_forward_only", "ref_call", "ref_call_positional", "ref_call_mixed", "hf_forward_only"):
            assert res[key], (rank, key)


def test_ep_group_none_adopts_the_group_of_the_captured_comm_ops():
    """optimize(model) without ep_group, the model built on a 2-rank group: the engine adopts the
    group the all-to-alls use (equal to eager), so ranks with different microbatch counts both get
    MicrobatchMismatch (before: accepted, and one rank died by SIGABRT); with dp_group, a named error."""
    for rank, res in enumerate(run_distributed(input_cases.ep_group_from_the_graph)):
        r = res["adopted"]
        assert r["is_group"] and r["losses_equal"] and r["grads"]["bitwise"], (rank, r)
        kind, msg, seconds = res["counts_differ"]
        assert kind == "MicrobatchMismatch" and "rank 0: 3 microbatch(es)" in msg and "rank 1: 2 microbatch(es)" in msg
        assert seconds < 30, (rank, seconds)
        kind, msg = res["with_dp"]
        assert kind == "EPGroupError", (rank, kind, msg)
        assert "ep_group is None, but the model's comm ops exchange over group" in msg and "of ranks [0, 1]" in msg
        assert "pass that group: fxoverlap.optimize(model, ep_group=" in msg


def test_microbatch_value_and_the_new_errors():
    """A Microbatch is its flat tensor tuple (what the graph's placeholders take) plus the keyword
    names; immutable, picklable; the new errors keep their builtin bases."""
    import pickle

    from fxoverlap.inputs import EPGroupError, Microbatch, as_microbatch, describe
    from fxoverlap.ir.capture import FrozenError

    a, b, c = torch.zeros(2), torch.ones(3, dtype=torch.int64), torch.ones(1)
    mb = as_microbatch({"labels": b, "input_ids": c}, 0, "test")
    assert tuple(mb) == (c, b) and mb.keywords == ("input_ids", "labels") and mb.args == ()
    mixed = Microbatch((a, c, b), ("input_ids", "labels"))
    assert mixed.args == (a,) and list(mixed.kwargs) == ["input_ids", "labels"] and mixed.kwargs["labels"] is b
    assert describe(mixed) == "(float32[2], input_ids=float32[1], labels=int64[3])"
    with pytest.raises(FrozenError):
        mixed.keywords = ()
    back = pickle.loads(pickle.dumps(mixed))
    assert back.keywords == mixed.keywords and torch.equal(back[2], b)
    from fxoverlap.passes.capture import input_signature
    assert input_signature(mb) != input_signature((c, b))  # the names are part of the signature
    for cls, base in ((EPGroupError, ValueError), (FrozenError, AttributeError)):
        assert issubclass(cls, fxoverlap.FxOverlapError) and issubclass(cls, base)
    assert fxoverlap.EPGroupError is EPGroupError and fxoverlap.engine.InputError is fxoverlap.InputError
