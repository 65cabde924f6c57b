"""The layout contract at stage boundaries (``passes/inductor.py``), on CPU with Inductor stages.

A value saved for a backward stage reaches it in the layout (strides) of its traced value,
whatever produced it. The model here saves transposed and strided values across stages,
among them the one that broke Hugging Face Qwen3-MoE, Mixtral and OLMoE (issue 35):
transformers' KV-cache update ``cat([empty, k.transpose(1, 2)], -2)``, which the joint graph
traces contiguous and Inductor's ``cat`` decomposition turns into a clone in ``k``'s transposed
layout. With Inductor stages it must match eager: per parameter max|Δgrad| <= 1e-5 ·
max|eager grad|, |Δloss| <= 1e-5. The debug check (``FXOVERLAP_CHECK_LAYOUTS=1``) must name
the value, its producer and its consumer when a producer hands out another layout.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.models.moe import Attention, apply_rope
from fxoverlap.runtime import CHECK_LAYOUTS_ENV, LayoutMismatch, StageFailed
from fxoverlap.testing import take_grads, token_batches

CFG = MoEConfig.tiny(n_layers=2, dim=32, n_heads=2, n_experts=4, expert_dim=16, vocab_size=64)
TOL = 1e-5


class StridedAttention(Attention):
    """Attention that saves, for its backward, transposed and strided values: K/V after an
    empty-cache ``cat`` (transformers' ``DynamicCache.update``), K transposed for a matmul,
    and a strided slice of V."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        empty = x.new_zeros(b, self.n_heads, 0, self.head_dim)
        k, v = torch.cat([empty, k], dim=-2), torch.cat([empty, v], dim=-2)
        q, k = apply_rope(q, self.rope_cos, self.rope_sin), apply_rope(k, self.rope_cos, self.rope_sin)
        att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        o = att @ v + 0.5 * F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o + v[..., ::2].repeat_interleave(2, dim=-1).sigmoid() * v  # a strided slice of a transposed value
        return self.wo(o.transpose(1, 2).reshape(b, s, d))


def _model() -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(CFG)
    for layer in model.layers:
        layer.attention.__class__ = StridedAttention
    return model


def _batches():
    return token_batches(CFG.vocab_size, 2, (2, 16), seed=3)


_ENGINE: dict = {}


def _optimized() -> tuple[MoETransformer, object, list]:
    """The model and its engine with Inductor stages after one step (one compile for the file)."""
    if not _ENGINE:
        model = _model()
        engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="inductor", progress=False))
        losses = engine.forward_backward(_batches())
        _ENGINE.update(model=model, engine=engine, losses=losses, grads=take_grads(model))
    return _ENGINE["model"], _ENGINE["engine"], _ENGINE["losses"]


def test_strided_saved_values_inductor_matches_eager():
    eager = _model()
    ref_losses = []
    for mb in _batches():
        loss = eager(*mb)
        loss.backward()
        ref_losses.append(loss.detach())
    ref = take_grads(eager)
    _, engine, losses = _optimized()
    got = _ENGINE["grads"]
    assert {s.runs_as for s in engine.stages if s.kind.name == "ATTN"} == {"inductor"}
    assert max(abs(a.item() - b.item()) for a, b in zip(losses, ref_losses)) <= TOL
    assert set(got) == set(ref)
    for name, r in ref.items():
        assert (got[name] - r).abs().max().item() <= TOL * r.abs().max().item(), name


def _misstride(t: torch.Tensor) -> torch.Tensor:
    """The same values in column-major strides (another layout for any tensor of 2+ dims > 1)."""
    dims = list(range(t.dim()))[::-1]
    return t.permute(dims).contiguous().permute(dims)


@pytest.mark.parametrize("check", [True, False])
def test_layout_check_names_producer_consumer_value(monkeypatch, check):
    """A forward attn stage deliberately hands a saved 4-D value out column-major: with the check
    on, LayoutMismatch names the value, the producer and the consumer before the consumer runs;
    off, Inductor's own input assert fails in the consumer (what users saw)."""
    model, engine, _ = _optimized()
    fwd = next(s for s in engine.stages if s.name == "fwd_l1_attn")
    consumers = {s.name: s for s in engine.stages if s.compiled is not None and s.name.startswith("bwd_")}
    # a 4-D output of fwd_l1_attn read by a compiled backward stage
    out_node = next(iter(fwd.graph_module.graph.find_nodes(op="output")))
    vals = [a.meta["val"] for a in out_node.args[0]]
    index, value, consumer = next(
        (i, o, c) for i, o in enumerate(fwd.outputs) for c in consumers.values()
        if o in c.inputs and vals[i].dim() == 4 and all(n > 1 for n in vals[i].shape))
    real = fwd.compiled

    def bad(*args):
        outs = list(real(*args))
        outs[index] = _misstride(outs[index])
        return outs

    if check:
        monkeypatch.setenv(CHECK_LAYOUTS_ENV, "1")
    else:
        monkeypatch.delenv(CHECK_LAYOUTS_ENV, raising=False)
    engine2 = fxoverlap.optimize(copy.deepcopy(model), None,
                                 fxoverlap.OverlapConfig(compiler="inductor", progress=False))
    plan = engine2.plan(_batches())
    fwd2 = next(s for s in plan.stages if s.name == fwd.name)
    real = fwd2.compiled
    fwd2.compiled = bad
    if check:
        with pytest.raises(LayoutMismatch) as info:
            engine2.forward_backward(_batches())
        msg = str(info.value)
        assert f"value {value} from stage {fwd.name} (inductor)" in msg, msg
        assert "reaches stage bwd_" in msg and f"strides {tuple(vals[index].stride())}" in msg, msg
        assert any(f"reaches stage {c} " in msg for c in consumers if value in consumers[c].inputs), msg
    else:
        with pytest.raises(StageFailed, match="stride"):
            engine2.forward_backward(_batches())
