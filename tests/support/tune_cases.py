"""Stand-in timers and the 2-rank case of tests/test_tune.py (importable by spawned ranks)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import token_batches
from fxoverlap.tune import Candidate, CandidateMismatch, tune_with_report


class TableTimer:
    """A stand-in timer: each candidate's time from ``ms(candidate)``, without timing (it does
    not call the step); counts its calls; measures no stages (no step model)."""

    def __init__(self, ms: Callable[[Candidate], float]):
        self.ms, self.calls = ms, 0

    def step_ms(self, candidate: Candidate, step, iters: int) -> float:
        self.calls += 1
        return self.ms(candidate)

    def stage_hook(self):
        return None


def tiny(group=None, n: int = 2):
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(n_layers=1)
    model = MoETransformer(cfg, group)
    return model, token_batches(cfg.vocab_size, n, (2, 8), seed=0)


#: two candidates on one program (only the runtime knob differs): one compile
CANDS = [Candidate(dispatcher="auto", sm_carveout=0), Candidate(dispatcher="auto", sm_carveout=8)]


def ranks_agree(rank: int, world: int) -> dict:
    """Rank 0 alone would choose carveout 0 (1 ms against 5); rank 1 measures 10 against 6: the
    slowest rank's times decide (10 against 6), so both choose carveout 8. Before that, a list
    that differs on one rank raises CandidateMismatch on both, with no timing."""
    model, mbs = tiny(dist.group.WORLD)
    cfg = fxoverlap.OverlapConfig(progress=False)
    out: dict = {}
    timer = TableTimer(lambda c: 0.0)
    try:
        tune_with_report(model, dist.group.WORLD, mbs, config=cfg, timer=timer, cache=False,
                         candidates=CANDS if rank == 0 else CANDS[:1])
    except CandidateMismatch as e:
        out["mismatch"] = str(e)
    out["mismatch_timed"] = timer.calls
    mine = {0: {0: 1.0, 8: 5.0}, 1: {0: 10.0, 8: 6.0}}[rank]
    res = tune_with_report(model, dist.group.WORLD, mbs, config=cfg, timer=TableTimer(lambda c: mine[c.sm_carveout]),
                           cache=False, candidates=CANDS, iters=1)
    out["choice"] = res.choice.sm_carveout
    out["measured"] = [r["measured_ms"] for r in res.table]
    out["grads_none"] = all(p.grad is None for p in model.parameters())
    return out
