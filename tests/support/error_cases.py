"""Workers for the 2-rank error tests."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from numerics_cases import make_batches


def rank_failure(rank: int, world: int) -> tuple:
    """Rank 1's stage raises mid-program; rank 0 must fail too, quickly, not hang."""
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(), dist.group.WORLD)
    engine = fxoverlap.optimize(model, dist.group.WORLD)
    mbs = make_batches(rank, 256, 2)
    engine.forward_backward(mbs)  # builds the plan
    if rank == 1:
        stage = next(s for s in engine.stages if s.name == "fwd_l1_attn")

        def boom(*args):
            raise RuntimeError("injected failure")

        stage.compiled = boom  # the runtime reads it at each launch
    start = time.monotonic()
    try:
        engine.forward_backward(mbs)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def bad_expert_split(rank: int, world: int) -> tuple[str, str]:
    model = MoETransformer(MoEConfig.tiny(n_experts=3, top_k=2))  # built for one rank
    msgs = ["no error", "no error"]
    try:
        fxoverlap.optimize(model, dist.group.WORLD)
    except ValueError as e:
        msgs[0] = str(e)
    try:
        fxoverlap.ops.token_dispatch(torch.ones(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), 3,
                                     dist.group.WORLD)
    except ValueError as e:
        msgs[1] = str(e)
    return tuple(msgs)


def microbatch_count_mismatch(rank: int, world: int) -> tuple[str, str, bool, float]:
    """Rank 0 passes 3 microbatches, rank 1 passes 2: both must raise the agreement error.
    The EP group's 60 s timeout bounds the test if the check were missing (gloo would then
    fail, or kill a rank, in the program's first all-to-all instead)."""
    from datetime import timedelta

    group = dist.new_group(timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    engine = fxoverlap.optimize(MoETransformer(MoEConfig.tiny(), group), group)
    start = time.monotonic()
    try:
        engine.forward_backward(make_batches(rank, 256, 3 if rank == 0 else 2))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e), isinstance(e, ValueError), time.monotonic() - start
    return "no error", "", False, time.monotonic() - start
