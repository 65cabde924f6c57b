"""mHC hyper-connections and the MTP head of the reference model.

Eager checks, then the capture -> tag -> split pipeline run stage by stage on 2 gloo
ranks against eager (the reference model, and a hyper-connection MoE model written
without ``fxoverlap.models`` in ``hc_models.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.models.mhc import HyperConnection, sinkhorn
from fxoverlap.passes import capture, split, tag
from fxoverlap.region import REGION_KEY
from fxoverlap.pipeline import run_plain
from fxoverlap.testing import eager_steps, grad_diff, run_distributed, take_grads, token_batches

# mHC on x final layer MoE / dense x MTP on / off.
MHC_CONFIGS = [
    dict(mhc_rate=4, layer_pattern=pattern, mtp=mtp)
    for pattern in (("moe", "moe"), ("moe", "dense"))
    for mtp in (False, True)
]


def _batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batches(vocab, 1, seed=seed)[0]


# ------------------------------------------------------------------ eager


def test_sinkhorn_doubly_stochastic():
    torch.manual_seed(0)
    h = sinkhorn(torch.eye(4) + 0.5 * torch.randn(2, 16, 4, 4))
    ones = torch.ones(2, 16, 4)
    torch.testing.assert_close(h.sum(-1), ones, atol=1e-5, rtol=0)
    torch.testing.assert_close(h.sum(-2), ones, atol=1e-5, rtol=0)
    assert (h > 0).all()


def test_hyper_connection_res_is_doubly_stochastic():
    torch.manual_seed(0)
    hc = HyperConnection(4, 32, 1e-6)
    h, h_post, h_res = hc.pre(torch.randn(2, 16, 4, 32))
    assert h.shape == (2, 16, 32) and h_post.shape == (2, 16, 4) and h_res.shape == (2, 16, 4, 4)
    ones = torch.ones(2, 16, 4)
    torch.testing.assert_close(h_res.sum(-1), ones, atol=1e-5, rtol=0)
    torch.testing.assert_close(h_res.sum(-2), ones, atol=1e-5, rtol=0)
    assert ((h_post > 0) & (h_post < 2)).all()


@pytest.mark.parametrize("cfg_kw", MHC_CONFIGS, ids=lambda kw: f"last_{kw['layer_pattern'][-1]}-mtp{int(kw['mtp'])}")
def test_mhc_model_grads_eager(cfg_kw):
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(**cfg_kw)
    m = MoETransformer(cfg)
    loss = m(*_batch(cfg.vocab_size, 0))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
    hc_params = [n for n, _ in m.named_parameters() if "_hc." in n or "hc_contract" in n]
    assert len(hc_params) == 2 * cfg.n_layers * 7 + 1 + cfg.mtp  # 7 tensors per sublayer, contractions


def test_mtp_loss_is_weighted_sum():
    """The MTP module is built last, so the main model's parameters do not depend on ``mtp``."""
    tokens, labels = _batch(256, 0)
    losses = []
    for kw in (dict(mtp=False), dict(mtp=True, mtp_loss_weight=0.0), dict(mtp=True, mtp_loss_weight=1.0),
               dict(mtp=True, mtp_loss_weight=2.0)):
        torch.manual_seed(0)
        with torch.no_grad():
            losses.append(MoETransformer(MoEConfig.tiny(mhc_rate=2, **kw))(tokens, labels))
    main, l0, l1, l2 = losses
    assert torch.equal(main, l0)
    assert l1 > main  # a cross-entropy is positive
    torch.testing.assert_close(l2 - l1, l1 - l0)


def test_mhc_rate_validation():
    with pytest.raises(ValueError, match="mhc_rate"):
        MoEConfig.tiny(mhc_rate=0)
    with pytest.raises(ValueError, match="mhc_rate"):
        MoEConfig.tiny(mhc_rate=-2)
    MoEConfig.tiny(mhc_rate=1)


def test_mhc_off_adds_nothing():
    torch.manual_seed(0)
    names = [n for n, _ in MoETransformer(MoEConfig.tiny()).named_parameters()]
    assert not any("hc" in n or "mtp" in n for n in names)


def test_mhc_region_marks_only_hyper_connection_code():
    """Every mHC parameter is read only by marked nodes; the sublayers are unmarked."""
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(mhc_rate=2, layer_pattern=("moe", "dense"), mtp=True)
    m = MoETransformer(cfg)
    c = capture(m, _batch(cfg.vocab_size, 0))
    graph = c.graph_module.graph
    fwd = [n for n in graph.nodes if n.op == "call_function" and n.meta.get("partitioner_tag") != "is_backward"]
    region_of = {n: (n.meta.get("custom") or {}).get(REGION_KEY) for n in fwd}
    by_name = {n.name: n for n in graph.nodes}
    for ph, fqn in c.param_placeholders.items():
        users = [u for u in by_name[ph].users if u in region_of]
        hc = "_hc." in fqn or "hc_contract" in fqn
        assert users and all((region_of[u] == "mhc") == hc for u in users), (fqn, [u.name for u in users])
    assert sum(r == "mhc" for r in region_of.values()) > 100
    comm = [n for n in fwd if "fxoverlap" in str(n.target)]
    assert comm and all(region_of[n] is None for n in comm)


# ------------------------------------------------------------------ 2 gloo ranks, capture -> tag -> split


def _check_pipeline(make_model, rank: int, vocab: int) -> tuple[bool, tuple, list[str]]:
    torch.manual_seed(0)
    m = make_model()
    tok, lbl = _batch(vocab, rank)
    (loss,), ref = eager_steps(m, [(tok, lbl)]), take_grads(m)
    c = capture(m, (tok, lbl))
    stages = split(tag(c), c.num_layers)
    l2 = run_plain(stages, c, m, (tok, lbl))
    return torch.equal(l2, loss), grad_diff(m, ref), [s.name for s in stages]


def _reference_model_worker(rank, world, configs):
    out = []
    for kw in configs:
        cfg = MoEConfig.tiny(**kw)
        out.append(_check_pipeline(lambda: MoETransformer(cfg, dist.group.WORLD), rank, cfg.vocab_size))
    return out


def _hc_model_worker(rank, world, patterns):
    from hc_models import HCMoETransformer

    return [_check_pipeline(lambda: HCMoETransformer(dist.group.WORLD, p), rank, 128) for p in patterns]


def _expected_stages(pattern: tuple[str, ...]) -> list[str]:
    fwd = ["fwd_model_embed"]
    for i, kind in enumerate(pattern):
        kinds = ("attn", "dispatch", "experts", "combine", "post") if kind == "moe" else ("attn", "mlp")
        fwd += [f"fwd_l{i}_{k}" for k in kinds]
    fwd.append("fwd_model_head")
    bwd = ["bwd" + s[3:] for s in reversed(fwd)]
    return fwd + bwd


def _assert_close(results, labels):
    for rank, per_rank in enumerate(results):
        for label, (loss_equal, (diff, scale, bitwise), _) in zip(labels, per_rank):
            assert loss_equal, f"rank {rank} {label}: loss differs from eager"
            assert diff <= 1e-6 * scale, f"rank {rank} {label}: max grad diff {diff} vs max|grad| {scale}"
            assert not math.isnan(diff)


@pytest.mark.slow
def test_mhc_reference_model_pipeline_matches_eager():
    results = run_distributed(_reference_model_worker, MHC_CONFIGS)
    _assert_close(results, [str(kw) for kw in MHC_CONFIGS])
    for per_rank in results:
        for kw, (_, _, names) in zip(MHC_CONFIGS, per_rank):
            assert names == _expected_stages(kw["layer_pattern"]), (kw, names)


def test_hc_model_without_fxoverlap_models_pipeline_matches_eager():
    patterns = [("moe", "moe"), ("moe", "dense")]
    results = run_distributed(_hc_model_worker, patterns)
    _assert_close(results, [str(p) for p in patterns])
    for per_rank in results:
        for p, (_, _, names) in zip(patterns, per_rank):
            assert names == _expected_stages(p), (p, names)
