"""What a step hands out besides the loss, through ``fxoverlap.optimize`` (one rank, CPU fp32).

Gradients AOTAutograd returns as one node for two parameters, or as the tangent
itself (``loss = f(x) + a + b``: both gradients are the tangent): each parameter
gets its own, as eager's AccumulateGrad gives.

Buffers the forward updates in place.

The model keeps two kinds of statistics in every training forward: per-expert token
counts added under ``no_grad`` (as torchtitan's MoE updates ``tokens_per_expert_E``)
and an ``nn.BatchNorm1d``'s running mean, variance and batch count. The running
statistic reads the value the previous microbatch left, so the program must apply
each microbatch's updates in microbatch order. After ``forward_backward`` every buffer,
loss and gradient equals eager's after the same microbatches, bitwise.
(The torch.compile side: ``test_backend.py::test_logits_and_buffer_mutations``.)
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxoverlap
from fxoverlap.ir import program as program_ops
from fxoverlap.ir.meta import STEP_KEY
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import grad_diff, token_batches


def _count(moe: nn.Module, router: nn.Module, args, out) -> None:
    """Tokens routed to each expert, added to a buffer under no_grad (torchtitan's MoE does this)."""
    with torch.no_grad():
        moe.tokens_per_expert.add_(F.one_hot(out[1].flatten(), moe.tokens_per_expert.numel()).sum(0))


class _WithStatistics(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.model = MoETransformer(cfg, None)
        self.bn = nn.BatchNorm1d(cfg.dim)
        for layer in self.model.layers:
            if hasattr(layer, "moe"):
                layer.moe.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts))
                layer.moe.router.register_forward_hook(functools.partial(_count, layer.moe))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.tok_embeddings(tokens)
        for layer in m.layers:
            h = layer(h)
        # (tokens, channels): on a transposed (batch, channels, seq) input torch 2.13's fake kernel of
        # _native_batch_norm_legit_functional predicts other strides than the CPU kernel returns,
        # and AOTAutograd's own joint graph then fails on a view
        h = self.bn(m.norm(h).flatten(0, 1)).view_as(h)
        return F.cross_entropy(m.output(h).flatten(0, 1), labels.flatten())


def _build(cfg: MoEConfig) -> _WithStatistics:
    torch.manual_seed(0)
    return _WithStatistics(cfg)


def _batches(n: int, vocab: int):
    return token_batches(vocab, n, seed=5)


def _mutate_order(program) -> list[tuple[int, tuple[str, ...]]]:
    return [(n.args[0], n.args[1:]) for n in program.graph.nodes
            if n.op == "call_function" and n.target is program_ops.mutate]


def test_buffers_end_as_eager_leaves_them():
    cfg = MoEConfig.tiny(n_layers=2, layer_pattern=("moe", "dense"), shared_expert_dim=32)
    eager, model = _build(cfg), _build(cfg)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(delay_wgrad=True))
    for call, n in enumerate((3, 1)):  # two calls: the second starts from what the first left
        mbs = _batches(n, cfg.vocab_size)
        ref = []
        for mb in mbs:
            loss = eager(*mb)
            loss.backward()
            ref.append(loss.detach())
        losses = engine.forward_backward(mbs)
        assert all(torch.equal(a, b) for a, b in zip(losses, ref)), call
        assert grad_diff(model, {k: p.grad for k, p in eager.named_parameters()})[2], call
        ref_buffers = dict(eager.named_buffers())
        for name, b in model.named_buffers():
            assert torch.equal(b, ref_buffers[name]), (call, name, b, ref_buffers[name])
    counts = model.model.layers[0].moe.tokens_per_expert
    assert counts.sum() == 4 * 32 * cfg.top_k  # 4 microbatches of 32 tokens, top-k each
    assert int(model.bn.num_batches_tracked) == 4
    assert not torch.equal(model.bn.running_mean, torch.zeros(cfg.dim))

    # each microbatch's updates are applied in microbatch order, once per microbatch
    order = _mutate_order(engine.plan(_batches(3, cfg.vocab_size)).program)
    assert [mb for mb, _ in order] == sorted(mb for mb, _ in order), order
    targets = engine.plan(_batches(3, cfg.vocab_size)).capture.mutations
    per_mb = [sorted(targets[v] for mb_, vals in order if mb_ == mb for v in vals) for mb in range(3)]
    assert per_mb[0] == per_mb[1] == per_mb[2] and len(per_mb[0]) == 4, per_mb  # counts + 3 BatchNorm buffers


def test_mutate_follows_the_stage_that_computes_it():
    cfg = MoEConfig.tiny(n_layers=2, shared_expert_dim=32)
    model = _build(cfg)
    plan = fxoverlap.optimize(model, None).plan(_batches(2, cfg.vocab_size))
    produced_at: dict[tuple[int, str], int] = {}
    for i, node in enumerate(plan.program.graph.nodes):
        step = node.meta.get(STEP_KEY)
        if node.op == "call_module":
            stage = next(s for s in plan.stages if s.name == step.stage)
            produced_at.update(((step.microbatch, v), i) for v in stage.outputs)
        elif node.op == "call_function" and node.target is program_ops.mutate:
            mb = node.args[0]
            # right after the stage call that computes the values (only sink nodes in between)
            last = max(produced_at[(mb, v)] for v in node.args[1:])
            between = list(plan.program.graph.nodes)[last + 1:i]
            assert all(n.op == "call_function" and n.target in program_ops.MARKERS for n in between), between


class _Offsets(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.model = MoETransformer(cfg, None)
        self.a = nn.Parameter(torch.zeros(()))
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, labels) + self.a + self.b


def test_gradient_that_is_the_tangent_for_two_parameters():
    cfg = MoEConfig.tiny(n_layers=1)
    torch.manual_seed(0)
    eager = _Offsets(cfg)
    torch.manual_seed(0)
    model = _Offsets(cfg)
    mbs = _batches(3, cfg.vocab_size)
    for mb in mbs:
        eager(*mb).backward()
    engine = fxoverlap.optimize(model, None)
    engine.forward_backward(mbs)
    assert eager.a.grad == 3 and eager.b.grad == 3
    assert grad_diff(model, {k: p.grad for k, p in eager.named_parameters()})[2]
    assert model.a.grad is not model.b.grad  # each its own tensor, as eager's
