"""Random ops draw what eager draws, whatever the passes move (``passes/rng.py``).

A model that draws everywhere (tests/support/rng_models.py): dropout on the embeddings,
after attention and in the routed experts; a shared expert with dropout before the
router, which ``side`` moves under the dispatch (after the router's draw), or after
the experts, which ``tag`` puts into attn (before the experts' draw); a router that
adds noise or samples its experts. Eager and fxoverlap start from the same seed; each
test asserts bitwise losses, gradients and the generator's state after the step (the
next step draws on from where eager's would), over two calls:

- ``optimize`` on 2 gloo ranks, 1-4 microbatches, with user activation checkpointing,
  mHC recompute and delayed weight-grads;
- the ``torch.compile`` backend on 2 ranks, no fallback;
- CUDA graphs' capture logic (the CPU stand-in of tests/test_cudagraph.py): warm-ups
  draw nothing;
- a Hugging Face family whose router samples in training (PhiMoE), one rank;
- Inductor stages: the program draws what the same compiled stages draw in plain order;
- the rng pass on its own: which stages draw, and the order check that refuses a
  program whose backward draws while the next microbatch's forward does.
"""

from __future__ import annotations

import pytest
import torch

import fxoverlap
from fxoverlap.models import MoEConfig
from fxoverlap.passes.rng import RngOrderError
from fxoverlap.pipeline import run_plain
from fxoverlap.testing import eager_steps, run_distributed_once, take_grads, token_batches
from rng_cases import CFG, SEED, backend_vs_eager, optimize_vs_eager
from rng_models import RandomTransformer

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()

OPTIMIZE = [
    dict(ns=[1, 2, 4]),
    dict(model=dict(router="sample"), ns=[3]),
    dict(model=dict(shared_first=False), config=dict(delay_wgrad=True), ns=[3]),
    dict(model=dict(ac=True), ns=[3]),
    dict(cfg=dict(mhc_rate=2), config=dict(mhc_recompute_group=1), ns=[2]),
]


def _bitwise(r: dict) -> None:
    assert r["losses_equal"], r
    assert r["grads_bitwise"], r
    assert r["generator_equal"], r


@pytest.mark.parametrize("i", range(len(OPTIMIZE)))
def test_optimize_draws_what_eager_draws(i):
    ranks = run_distributed_once(optimize_vs_eager, OPTIMIZE)
    for rank in ranks:
        for r in rank:
            if r["variant"] is OPTIMIZE[i] or r["variant"] == OPTIMIZE[i]:
                _bitwise(r)


BACKEND = [dict(), dict(model=dict(router="sample", shared_first=False))]


@pytest.mark.parametrize("i", range(len(BACKEND)))
def test_backend_draws_what_eager_draws(i):
    ranks = run_distributed_once(backend_vs_eager, BACKEND)
    for rank in ranks:
        r = rank[i]
        assert not r["fallbacks"], r["fallbacks"]
        assert any(s.endswith("_dispatch") for s in r["stages"]), r["stages"]
        _bitwise(r)


def _one_rank_model(**model):
    torch.manual_seed(0)
    return RandomTransformer(MoEConfig.tiny(**CFG), None, **model)


def test_draws_stay_in_eager_order_in_the_stages():
    """Which stages draw: the shared expert's dropout, drawn before the router's noise, is
    back in the main attn part; written after the experts, it draws in the experts stage. Stage
    order never goes back in eager's order, and a side part draws nothing (here the side part is
    the index-range checks torch 2.13 traces, ``_assert_async``; 2.11 traces none and keeps one
    attn stage)."""
    for shared_first, expect in ((True, "fwd_l0_attn"), (False, "fwd_l0_experts")):
        model = _one_rank_model(shared_first=shared_first)
        plan = fxoverlap.optimize(model, None).plan(token_batches(CFG["vocab_size"], 2))
        drawn = [(d, s.name) for s in plan.stages for d in s.draws]
        assert [d for d, _ in sorted(drawn, key=lambda x: x[0])] == list(range(len(drawn)))
        fwd = [name for _, name in sorted(drawn) if name.startswith("fwd")]
        assert fwd == sorted(fwd, key=[s.name for s in plan.stages].index), fwd
        # 1 embedding dropout + per layer: attention dropout, shared dropout, router noise, experts dropout
        assert len(fwd) == 1 + 4 * CFG["n_layers"]
        assert sum(name == expect for name in fwd) >= 2, fwd
        if torch.__version__ >= "2.13":
            assert any(s.name == "fwd_l0_attn_side" for s in plan.stages)
        assert not any(s.draws for s in plan.stages if s.name.endswith("_side"))


class _NoisyGrad(torch.autograd.Function):
    """A backward that draws (gradient noise): eager draws it between two microbatches' forwards."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g + 1e-3 * torch.randn_like(g)


def test_backward_draws_refused_when_they_would_interleave(monkeypatch):
    import rng_models

    real = rng_models.RandomBlock._forward
    monkeypatch.setattr(rng_models.RandomBlock, "_forward", lambda self, x: _NoisyGrad.apply(real(self, x)))
    model = _one_rank_model()
    mbs = token_batches(CFG["vocab_size"], 2)
    torch.manual_seed(SEED)
    ref_losses = eager_steps(model, mbs[:1])
    ref = take_grads(model)
    engine = fxoverlap.optimize(model, None)
    torch.manual_seed(SEED)
    losses = engine.forward_backward(mbs[:1])  # one microbatch: nothing interleaves
    assert torch.equal(losses[0], ref_losses[0])
    assert all(torch.equal(p.grad, ref[k]) for k, p in model.named_parameters())
    with pytest.raises(RngOrderError, match="backward"):
        engine.forward_backward(mbs)


@pytest.mark.slow  # Inductor compiles; the eager-stage draws run in the default suite
@pytest.mark.parametrize("router", ["noisy"])
def test_inductor_program_draws_what_plain_order_draws(router):
    """With Inductor stages (its own random kernels) the interleaved program draws what the same
    compiled stages draw run one microbatch at a time in plain order, from the same seed.
    One thread: Inductor's CPU embedding backward adds atomically, in thread order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _inductor_program_vs_plain(router)
    finally:
        torch.set_num_threads(threads)


def _inductor_program_vs_plain(router: str) -> None:
    model = _one_rank_model(router=router)
    mbs = token_batches(CFG["vocab_size"], 3)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="inductor", progress=False))
    plan = engine.plan(mbs)
    torch.manual_seed(SEED)
    plain = [run_plain(plan.stages, plan.capture, model, mb) for mb in mbs]
    plain_grads, state = take_grads(model), torch.get_rng_state()
    torch.manual_seed(SEED)
    losses = engine.forward_backward(mbs)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain))
    assert all(torch.equal(p.grad, plain_grads[k]) for k, p in model.named_parameters())
    assert torch.equal(state, torch.get_rng_state())
    assert any(s.runs_as == "inductor" and s.draws for s in plan.stages)


@pytest.mark.slow
def test_hf_family_whose_router_samples():
    """PhiMoE's sparsemixer draws Gumbel noise in training, with jitter and attention dropout:
    without the rng pass its losses differ from eager's (found on main at 8031e30)."""
    from hf_cases import batches, build, next_token_loss

    model = fxoverlap.expert_parallel(build("phimoe", router_jitter_noise=0.1, input_jitter_noise=0.1,
                                            attention_dropout=0.1), None)
    model.train()
    mbs = batches(0, 3)
    torch.manual_seed(SEED)
    ref_losses = []
    for mb in mbs:
        loss = next_token_loss(model(mb), mb)
        loss.backward()
        ref_losses.append(loss.detach())
    ref, state = take_grads(model), torch.get_rng_state()
    engine = fxoverlap.optimize(model, None)
    torch.manual_seed(SEED)
    losses = engine.forward_backward([(mb,) for mb in mbs], loss_fn=next_token_loss)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(p.grad, ref[k]) for k, p in model.named_parameters() if k in ref)
    assert torch.equal(state, torch.get_rng_state())
