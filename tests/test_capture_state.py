"""A capture leaves the model as it was, and a submodule registered twice is captured right.

* After every kind of capture failure (a tracing error inside the model, an error in
  ``loss_fn``, a non-scalar loss, a decoder layer run twice, a tag error) the model's
  parameters and buffers are the very objects they were, and plain eager forward+backward
  equals a fresh copy's, bitwise. The models carry an alias (``model.first = model.layers[0]``),
  which used to leave FunctionalTensors in the model even when the capture succeeded.
* A submodule shared by two layers (a norm, a whole MoE block), by a layer and the head, or
  kept under a second name gets each call's layer and matches eager bitwise (CPU,
  ``compiler="eager"``, one rank and EP 2); a decoder layer that runs twice per forward is
  refused with a CaptureError naming both its paths.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxoverlap
import shared_module_cases as cases
from fxoverlap.ir.meta import CHILD_KEY, LAYER_KEY, TAG_KEY
from fxoverlap.passes import CaptureError, TagError, capture, tag
from fxoverlap.testing import eager_steps, run_distributed_once, take_grads, token_batches

EAGER = fxoverlap.OverlapConfig(compiler="eager")


def _batches(n: int = 2):
    return token_batches(256, n)


def _tensors(model: nn.Module) -> list[tuple[str, str, int, type]]:
    """Every parameter and buffer slot of every module: (kind, path, object id, type)."""
    out = []
    for path, m in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(m, kind).items():
                out.append((kind, f"{path}.{name}", id(t), type(t)))
    return out


def _eager_equal(model: nn.Module, fresh: nn.Module, mbs) -> None:
    """Plain eager forward+backward of ``model`` equals ``fresh``'s, bitwise."""
    model.zero_grad(set_to_none=True)
    got_losses, got = eager_steps(model, mbs), take_grads(model)
    want_losses, want = eager_steps(fresh, mbs), take_grads(fresh)
    assert all(torch.equal(a, b) for a, b in zip(got_losses, want_losses))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------------ A. failures leave the model as it was

def _tracing_error(model):
    model.layers[1].attention = cases.Branchy(model.layers[1].attention)
    return model, None


def _loss_fn_error(model):
    def loss_fn(out, tokens, labels):
        raise KeyError("no 'logits' in the output")
    return model, loss_fn


def _non_scalar_loss(model):
    return model, lambda out, tokens, labels: out.expand(3)


def _layer_run_twice(model):
    # layer 0 also runs on the embeddings, through a second path
    model.tok_embeddings = nn.Sequential(model.tok_embeddings, model.first)
    return model, None


def _tag_error(model):
    model.norm = nn.Sequential(model.norm, cases.OutsideA2A())
    return model, None


FAILURES = {
    "tracing error": (_tracing_error, Exception, None),
    "error in loss_fn": (_loss_fn_error, KeyError, "no 'logits'"),
    "non-scalar loss": (_non_scalar_loss, CaptureError, r"loss_fn returned a tensor of shape \[3\]"),
    "layer run twice": (_layer_run_twice, CaptureError, r"decoder layer layers\.0 ran 2 times"),
    "tag error": (_tag_error, TagError, "outside every decoder layer"),
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_failed_capture_leaves_the_model_as_it_was(kind):
    make, exc, match = FAILURES[kind]
    model, loss_fn = make(cases.shared_model(("first", "shared_norm")))
    fresh, _ = make(cases.shared_model(("first", "shared_norm")))
    before = _tensors(model)
    hooks = [(m._forward_pre_hooks.copy(), m._forward_hooks.copy()) for m in model.modules()]
    mbs = _batches()
    engine = fxoverlap.optimize(model, config=EAGER)
    with pytest.raises(exc, match=match):
        engine.forward_backward(mbs, loss_fn=loss_fn)
    assert _tensors(model) == before  # the same objects, all nn.Parameter / plain buffers again
    assert all(t in (nn.Parameter if kind == "_parameters" else torch.Tensor, type(None)) for kind, _, _, t in before)
    assert [(m._forward_pre_hooks, m._forward_hooks) for m in model.modules()] == hooks
    assert all(p.grad is None for p in model.parameters())
    _eager_equal(model, fresh, mbs)


def test_tensor_registered_while_tracing_is_dropped():
    """A module that registers a buffer on first use: the fake one the trace made is not left
    in the model (eager registers its own real one on its first call)."""
    torch.manual_seed(0)
    model = cases.shared_model("first")
    model.layers[0].attention_norm = nn.Sequential(cases.LazyBuffer(), model.layers[0].attention_norm)
    lazy = model.layers[0].attention_norm[0]
    tokens, labels = _batches(1)[0]
    try:
        capture(model, (tokens, labels))
    except Exception:  # noqa: BLE001 - whether torch traces it is not what this test is about
        pass
    assert "scale" not in lazy._buffers
    model(tokens, labels).backward()
    assert type(lazy.scale) is torch.Tensor and all(type(p) is nn.Parameter for p in model.parameters())


def test_successful_capture_of_an_alias_keeps_the_parameters():
    """The case that used to break eager: a block kept as ``model.first`` (its parameters
    listed twice by AOTAutograd) was left with FunctionalTensors after a capture that succeeded."""
    model = cases.shared_model("first")
    before = _tensors(model)
    cap = capture(model, _batches(1)[0])
    assert _tensors(model) == before
    # one placeholder per parameter slot, named by its first path
    assert "layers.0.attention.wq.weight" in cap.param_placeholders.values()
    assert not any(f.startswith("first.") for f in cap.param_placeholders.values())


# ------------------------------------------------------------------ B. shared submodules

def test_shared_norm_is_annotated_by_the_layer_running_it():
    """One norm in two layers (and another in layer 0 and the head): each call's ops carry the
    layer that ran it, and the head's call none."""
    model = cases.shared_model(("shared_norm", "head_norm"))
    cap = capture(model, _batches(1)[0])
    by_fqn = {f: p for p, f in cap.param_placeholders.items()}
    gm = cap.graph_module
    tag(cap)

    def fwd_users(fqn):
        ph = next(n for n in gm.graph.nodes if n.name == by_fqn[fqn])
        users = [u for u in ph.users if str(u.meta[TAG_KEY]).startswith("fwd")]
        return [((u.meta.get("custom") or {}).get(LAYER_KEY), (u.meta.get("custom") or {}).get(CHILD_KEY),
                 str(u.meta[TAG_KEY])) for u in users]

    assert "layers.1.ffn_norm.weight" not in by_fqn  # one slot, one placeholder
    assert sorted(fwd_users("layers.0.ffn_norm.weight")) == [(0, "ffn_norm", "fwd:0:attn"),
                                                             (1, "ffn_norm", "fwd:1:attn")]
    assert sorted(fwd_users("layers.0.attention_norm.weight"), key=str) == [
        (0, "attention_norm", "fwd:0:attn"), (None, None, "fwd:2:head")]


@pytest.mark.parametrize("how", cases.SHARING)
def test_shared_submodule_matches_eager(how):
    """One rank, 2 microbatches (the 1F1B program's merged step included): bitwise eager."""
    mbs = _batches()
    ref = cases.shared_model(how)
    ref_losses, ref_grads = eager_steps(ref, mbs), take_grads(ref)
    model = cases.shared_model(how)
    losses = fxoverlap.optimize(model, config=EAGER).forward_backward(mbs)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == ref_grads.keys() and all(torch.equal(got[k], ref_grads[k]) for k in ref_grads)


@pytest.mark.slow
def test_shared_submodule_matches_eager_on_ep2():
    """EP 2 (2 gloo ranks, real all-to-alls), each sharing: bitwise eager's losses and grads."""
    for rank, result in enumerate(run_distributed_once(cases.ep_against_eager, list(cases.SHARING))):
        for how, (losses_equal, bitwise, missing, error) in result.items():
            assert error is None, f"rank {rank}, {how}: {error}"
            assert losses_equal and bitwise and not missing, (rank, how, missing)


def test_layer_in_the_list_twice_is_refused_naming_both_paths():
    model = cases.shared_model(())
    model.layers[1] = model.layers[0]
    with pytest.raises(CaptureError, match=r"decoder layer layers\.0 ran 2 times.*'layers\.0' and "
                                           r"'layers\.1'.*copy\.deepcopy"):
        capture(model, _batches(1)[0])


def test_layer_called_under_a_second_name_is_refused_naming_both_paths():
    model, _ = _layer_run_twice(cases.shared_model("first"))
    with pytest.raises(CaptureError, match=r"registered as 'tok_embeddings\.1' and 'layers\.0' and 'first'"):
        capture(model, _batches(1)[0])


def test_layer_called_without_its_hooks_keeps_its_children_annotated():
    """A model calling ``layer.forward(x)`` (no module hooks on the layer): children registered
    once still carry their layer, so the layers are found as before."""
    from fxoverlap.passes import split

    class Direct(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = x + layer.forward(x)
            return x.pow(2).sum()

    cap = capture(Direct(), (torch.randn(4, 8),))
    names = [s.name for s in split(tag(cap), cap.num_layers)]
    assert cap.num_layers == 2 and "fwd_l0_mlp" in names and "fwd_l1_mlp" in names
