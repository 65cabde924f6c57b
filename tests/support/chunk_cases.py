"""Workers for tests/test_chunks.py (spawned ranks import this module by name)."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.ir.meta import STEP_KEY
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import eager_steps, grad_diff, take_grads
from numerics_cases import make_batches

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()

# 8 experts: 4 local experts per rank on 2 ranks, so 2, 3 and 4 chunks can be cut
CFG = dict(n_layers=2, dim=32, n_heads=2, n_experts=8, expert_dim=16, vocab_size=64)


def _model(group, cfg: dict) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoEConfig.tiny(**{**CFG, **cfg}), group)


def _compare(losses, ref_losses, model, ref) -> dict:
    diff, scale, bitwise = grad_diff(model, ref)
    model.zero_grad(set_to_none=True)
    return dict(losses_equal=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
                loss_rel=max(((a - b).abs() / b.abs()).item() for a, b in zip(losses, ref_losses)),
                grad_rel=diff / scale, grads_bitwise=bitwise)


@contextlib.contextmanager
def chunk_log_lines() -> Iterator[list[str]]:
    """The ``fxoverlap`` log lines about chunks (which layers were cut, which left whole and why)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    log = logging.getLogger("fxoverlap")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    lines: list[str] = []
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        lines.extend(m for m in records if "chunks=" in m)


def _stages(stages) -> list[tuple]:
    return [(s.name, str(s.kind), str(s.direction), s.layer, s.chunk) for s in stages]


def _calls(program) -> list[str]:
    """The program's stage calls, in issue order."""
    return [n.name for n in program.graph.nodes if n.op == "call_module" and STEP_KEY in n.meta]


def optimize_vs_eager(rank: int, world: int, variants: list[dict]) -> list[dict]:
    """``optimize`` with chunks against eager on the same model and data, per variant and microbatch count."""
    out = []
    for v in variants:
        model = _model(dist.group.WORLD, v.get("cfg", {}))
        config = fxoverlap.OverlapConfig(**{"compiler": "eager", **v.get("config", {})})
        engine = fxoverlap.optimize(model, dist.group.WORLD, config)
        for n in v["ns"]:
            mbs = make_batches(rank, CFG["vocab_size"], n, seed=n)
            ref_losses = eager_steps(model, mbs)
            ref = take_grads(model)
            losses = engine.forward_backward(mbs)
            out.append(dict(variant=v, n=n, stages=_stages(engine.stages), calls=_calls(engine.program),
                            ep_size=engine.plan(mbs).capture.ep_size,
                            table=engine.stage_table(), **_compare(losses, ref_losses, model, ref)))
    return out


def backend_vs_eager(rank: int, world: int, options: dict) -> dict:
    """``torch.compile(model, backend="fxoverlap", options=...)``, one microbatch per call."""
    torch._dynamo.reset()
    model = _model(dist.group.WORLD, {})
    mbs = make_batches(rank, CFG["vocab_size"], 3)
    ref_losses = eager_steps(model, mbs)
    ref = take_grads(model)
    compiled = torch.compile(model, backend="fxoverlap", options=options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = eager_steps(compiled, mbs)
    fallbacks = [str(w.message) for w in caught if w.category.__name__ == "FallbackWarning"]
    return dict(fallbacks=fallbacks, stages=_stages(fxoverlap.backend.last_stages()),
                **_compare(losses, ref_losses, model, ref))


def forward_only(rank: int, world: int, chunks: int) -> dict:
    """Inference: ``engine(x)`` and the backend under ``no_grad`` / ``eval`` against eager logits."""
    torch._dynamo.reset()
    model = _model(dist.group.WORLD, {})
    xs = [tokens for tokens, _ in make_batches(rank, CFG["vocab_size"], 3)]
    with torch.no_grad():
        want = [model(x) for x in xs]
        engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(compiler="eager", chunks=chunks))
        got = [engine(x) for x in xs]
        engine_stages = _stages(engine.stages)
        # 3 microbatches: 0 and 1 in a pair (whole exchanges), 2 alone (chunks)
        paired = engine.forward_only([(x,) for x in xs])
        paired_calls = _calls(engine.program)
        model.eval()
        compiled = torch.compile(model, backend="fxoverlap", options={"chunks": chunks})
        backend = [compiled(x) for x in xs]
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    return dict(engine_rel=max(rel(a, b) for a, b in zip(got, want)),
                engine_bitwise=all(torch.equal(a, b) for a, b in zip(got, want)),
                paired_bitwise=all(torch.equal(a, b) for a, b in zip(paired, want)), paired_calls=paired_calls,
                backend_rel=max(rel(a, b) for a, b in zip(backend, want)),
                engine_stages=engine_stages, backend_stages=_stages(fxoverlap.backend.last_stages()))


def random_experts(rank: int, world: int, experts_draw: bool = True) -> dict:
    """A model that draws in the embedding, attention, the shared expert and the router, and
    (``experts_draw``) in its experts: then the layers stay whole; otherwise they are cut.
    Either way the draws stay eager's."""
    from rng_cases import CFG as RCFG, SEED
    from rng_models import RandomTransformer

    torch.manual_seed(0)
    model = RandomTransformer(MoEConfig.tiny(**RCFG), dist.group.WORLD)
    if not experts_draw:
        for layer in model.layers:
            layer.moe.experts.p = 0.0  # a dropout with p = 0 draws nothing
    with chunk_log_lines() as lines:
        engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(compiler="eager", chunks=2))
        # 3 microbatches: 0 and 2 run the chunks, 1 the whole exchange (both versions draw)
        mbs = make_batches(rank, RCFG["vocab_size"], 3)
        torch.manual_seed(SEED)
        ref_losses = eager_steps(model, mbs)
        ref, state = take_grads(model), torch.get_rng_state()
        torch.manual_seed(SEED)
        losses = engine.forward_backward(mbs)
        generator_equal = torch.equal(state, torch.get_rng_state())
        # forward-only with draws (train mode under no_grad): no pairs, the draws stay eager's
        with torch.no_grad():
            torch.manual_seed(SEED)
            want = [model(*mb) for mb in mbs[:2]]
            state = torch.get_rng_state()
            torch.manual_seed(SEED)
            got = engine.forward_only(mbs[:2])
        forward_only = dict(bitwise=all(torch.equal(a, b) for a, b in zip(got, want)),
                            generator_equal=torch.equal(state, torch.get_rng_state()), calls=_calls(engine.program))
    return dict(stages=_stages(engine.stages), log=lines, forward_only=forward_only,
                generator_equal=generator_equal, **_compare(losses, ref_losses, model, ref))


def one_microbatch_modes(rank: int, world: int, chunks: int) -> dict:
    """One spawn for the backend, forward-only calls and the model whose experts draw."""
    return dict(backend=backend_vs_eager(rank, world, {"chunks": chunks}), forward_only=forward_only(rank, world, chunks),
                random_experts=random_experts(rank, world),
                random_elsewhere=random_experts(rank, world, experts_draw=False))


def hf_family(rank: int, world: int, family: str, chunks: int) -> dict:
    """A Hugging Face family after ``expert_parallel``: optimize and the backend with chunks
    against the same sharded model run eagerly."""
    import fxoverlap.backend as fxb
    from hf_cases import batches, build, eager_losses, next_token_loss

    group = dist.group.WORLD
    eager = fxoverlap.expert_parallel(build(family), group)
    mbs = batches(rank, 3)
    ref_losses = eager_losses(eager, mbs)
    ref = take_grads(eager)
    optimized = copy.deepcopy(eager)
    engine = fxoverlap.optimize(optimized, group, fxoverlap.OverlapConfig(compiler="eager", chunks=chunks))
    losses = engine.forward_backward(mbs, loss_fn=next_token_loss)
    row = dict(optimize=dict(stages=_stages(engine.stages), **_compare(losses, ref_losses, optimized, ref)))
    with torch.no_grad():  # forward-only: 3 microbatches, a pair and one alone
        want = [eager(ids).logits for ids in mbs]
        got = engine.forward_only(mbs, output_fn=lambda out, ids: out.logits)
    row["forward_only_bitwise"] = all(torch.equal(a, b) for a, b in zip(got, want))
    torch._dynamo.reset()
    fxb.reset()
    backend = copy.deepcopy(eager)
    compiled = torch.compile(backend, backend="fxoverlap", options={"chunks": chunks})
    losses = eager_losses(compiled, mbs)
    row["backend"] = dict(stages=_stages(fxb.last_stages()), **_compare(losses, ref_losses, backend, ref))
    return row


def titan_two_ranks(rank: int, world: int) -> dict:
    """torchtitan's Qwen3-MoE and DeepSeek-V3 with its own EP (functional all-to-alls) on 2 ranks,
    cut into chunks (``passes/chunk_functional.py``): ``optimize`` (3 microbatches: 0 and 2 run
    the chunks, 1 the whole exchange), 3 and 4 chunks (8 experts: 4 local), the backend forward and
    backward, the backend under ``no_grad``, and ``engine.forward_only``'s pairs; each against eager."""
    import titan_real

    out: dict = {}
    for family in ("qwen3_moe", "deepseek_v3"):
        with chunk_log_lines() as lines:
            out[f"{family}/optimize"] = titan_real.train_vs_eager(family, 2, 3, rank, config={"chunks": 2})
        out[f"{family}/optimize"]["log"] = lines
        out[f"{family}/backend"] = titan_real.backend_vs_eager(family, 2, ep=2, rank=rank, options={"chunks": 2})
        out[f"{family}/no_grad"] = titan_real.backend_forward_only(family, 2, rank, options={"chunks": 2})
    for k in (3, 4):
        out[f"qwen3_moe/chunks={k}"] = titan_real.train_vs_eager("qwen3_moe", 2, 2, rank, config={"chunks": k},
                                                                 experts=8)
    # forward-only: a pair (whole exchanges, each under the other's compute), then the odd one in chunks
    out["forward_only"] = titan_real.forward_only_vs_eager("qwen3_moe", 2, 3, rank, config={"chunks": 2})
    return out
