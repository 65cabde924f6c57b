"""Workers for the 2-rank tests of ``test_inputs.py``: keyword microbatches with expert
parallelism, and ``optimize(model)`` without ``ep_group`` on a model built on a 2-rank group."""

from __future__ import annotations

import copy
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import fxoverlap
import hf_cases
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import grad_compare, take_grads
from numerics_cases import make_batches


def _as_dicts(mbs) -> list[dict]:
    return [{"tokens": t, "labels": y} for t, y in mbs]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def keyword_microbatches(rank: int, world: int) -> dict:
    """Dict microbatches passed as keyword arguments, against eager on the same weights and
    data, with EP over both ranks: the reference model (``forward(tokens, labels)``) through
    ``forward_backward``, ``forward_only`` and ``engine(**kwargs)``; a tiny Qwen3-MoE with
    ``{"input_ids": ids}`` and a loss on ``out.logits``."""
    group = dist.group.WORLD
    out: dict = {}

    torch.manual_seed(0)
    cfg = MoEConfig.tiny()
    model = MoETransformer(cfg, group)
    mbs = _as_dicts(make_batches(rank, cfg.vocab_size, 3))
    ref_losses = []
    for mb in mbs:
        loss = model(**mb)
        loss.backward()
        ref_losses.append(loss.detach())
    ref = take_grads(model)
    engine = fxoverlap.optimize(model, group)
    losses = engine.forward_backward(mbs)
    out["ref_fb"] = dict(losses_equal=_equal(losses, ref_losses), grads=grad_compare(model, ref),
                         keywords=engine.plan(mbs).capture.signature[-1])
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        want = [model(tokens=mb["tokens"]) for mb in mbs[:2]]
    got = engine.forward_only([{"tokens": mb["tokens"]} for mb in mbs[:2]])
    out["ref_forward_only"] = _equal(got, want)
    out["ref_call"] = torch.equal(engine(tokens=mbs[0]["tokens"]), want[0])
    out["ref_call_positional"] = torch.equal(engine(mbs[0]["tokens"]), want[0])
    # positional and keyword: forward(tokens, labels=...) from (tokens,) and {labels}
    mixed = engine(mbs[0]["tokens"], labels=mbs[0]["labels"])
    with torch.no_grad():
        out["ref_call_mixed"] = torch.equal(mixed, model(mbs[0]["tokens"], labels=mbs[0]["labels"]))

    full = hf_cases.build("qwen3_moe")
    eager = fxoverlap.expert_parallel(copy.deepcopy(full), group)
    optimized = copy.deepcopy(eager)
    ids = hf_cases.batches(rank)
    ref_losses = []
    for x in ids:
        loss = hf_cases.next_token_loss(eager(input_ids=x), x)
        loss.backward()
        ref_losses.append(loss.detach())
    ref = take_grads(eager)
    engine = fxoverlap.optimize(optimized, group)
    losses = engine.forward_backward([{"input_ids": x} for x in ids],
                                     loss_fn=lambda out, input_ids: hf_cases.next_token_loss(out, input_ids))
    out["hf_fb"] = dict(losses_equal=_equal(losses, ref_losses), grads=grad_compare(optimized, ref))
    with torch.no_grad():
        want = [eager(input_ids=x).logits for x in ids]
    got = engine.forward_only([{"input_ids": x} for x in ids], output_fn=lambda out, input_ids: out.logits)
    out["hf_forward_only"] = _equal(got, want)
    return out


def ep_group_from_the_graph(rank: int, world: int) -> dict:
    """``optimize(model)`` with ``ep_group=None`` on a model built on a 2-rank group: the engine
    adopts the group (equal to eager; the ranks' agreement on the microbatch counts holds: both
    raise when they differ, none aborts); with ``dp_group`` it refuses by name."""
    group = dist.new_group(timeout=timedelta(seconds=60))
    out: dict = {}
    torch.manual_seed(0)
    cfg = MoEConfig.tiny()
    model = MoETransformer(cfg, group)
    mbs = make_batches(rank, cfg.vocab_size, 2)
    ref_losses = []
    for mb in mbs:
        loss = model(*mb)
        loss.backward()
        ref_losses.append(loss.detach())
    ref = take_grads(model)
    engine = fxoverlap.optimize(model)
    losses = engine.forward_backward(mbs)
    out["adopted"] = dict(losses_equal=_equal(losses, ref_losses), grads=grad_compare(model, ref),
                          is_group=engine.ep_group is group)
    model.zero_grad(set_to_none=True)

    start = time.monotonic()
    try:
        fxoverlap.optimize(model).forward_backward(make_batches(rank, cfg.vocab_size, 3 if rank == 0 else 2))
        out["counts_differ"] = ("no error", "", time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        out["counts_differ"] = (type(e).__name__, str(e), time.monotonic() - start)
    model.zero_grad(set_to_none=True)

    try:
        fxoverlap.optimize(model, dp_group=group).forward_backward(mbs)
        out["with_dp"] = ("no error", "")
    except Exception as e:  # noqa: BLE001 - the test inspects it
        out["with_dp"] = (type(e).__name__, str(e))
    return out
