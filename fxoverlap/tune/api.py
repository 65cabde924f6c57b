"""The entry points: :func:`tune` and :func:`tune_with_report` (the timer chosen, the warnings
before timing, the candidates agreed over the ranks, the cache read and written around
:func:`fxoverlap.tune.search.search`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxoverlap.config import OverlapConfig
from fxoverlap.tune.cache import TuneCache, cache_key, group_size, log_cache_use
from fxoverlap.tune.candidates import Candidate, Space, enumerate_candidates, local_expert_count
from fxoverlap.tune.errors import TuneSkipped, TuneWarning
from fxoverlap.tune.ranks import Ranks, agree_on_candidates
from fxoverlap.tune.search import TuneResult, search
from fxoverlap.tune.session import Session, preserved
from fxoverlap.tune.timers import CudaEventTimer, Timer

log = logging.getLogger("fxoverlap.tune")


def tune(model: nn.Module, ep_group: dist.ProcessGroup | None, microbatches: Sequence,
         loss_fn: Callable | None = None, budget_s: float = 60.0, config: OverlapConfig | None = None,
         **kwargs: Any) -> OverlapConfig:
    """``config`` (default ``OverlapConfig()``) with the overlap knobs that ran fastest on these
    microbatches; see :func:`tune_with_report` for the keyword arguments and the table."""
    return tune_with_report(model, ep_group, microbatches, loss_fn, budget_s, config, **kwargs).config


def tune_with_report(model: nn.Module, ep_group: dist.ProcessGroup | None, microbatches: Sequence,
                     loss_fn: Callable | None = None, budget_s: float = 60.0, config: OverlapConfig | None = None,
                     *, forward_only: bool = False, dp_group: dist.ProcessGroup | None = None,
                     expert_dp_group: dist.ProcessGroup | None = None, group: Any = "world",
                     timer: Timer | None = None, space: Space = Space(),
                     candidates: Sequence[Candidate] | None = None, cache: bool | str | TuneCache = True,
                     iters: int = 3, warmup: int = 1, exhaustive: bool = False) -> TuneResult:
    """Time candidate settings of the overlap knobs on ``model`` and these ``microbatches``
    (``loss_fn`` as ``forward_backward`` takes it; with ``forward_only``, the ``output_fn`` of
    ``engine.forward_only``) and return the fastest, with the table of what was tried.

    ``budget_s``: wall seconds for the timing (compiles included); the defaults' program is
    always timed, then the other programs in the step model's order while the budget lasts
    (``exhaustive``: every one, no budget). ``group``: the ranks that agree on the choice
    (default the world). ``timer``: default :class:`CudaEventTimer`; without CUDA and without a
    timer, a :class:`TuneSkipped` warning and ``config`` as given. ``space`` / ``candidates``:
    what to search (default :func:`enumerate_candidates`). ``cache``: True (the folder of
    :func:`cache_dir`), a folder, a :class:`TuneCache`, or False (neither read nor written).
    ``iters`` timed steps per candidate after ``warmup`` (per program)."""
    t_start = time.perf_counter()
    base = dataclasses.replace(config or OverlapConfig(), autotune=False)
    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    if timer is None:
        if device.type != "cuda":
            warnings.warn(TuneSkipped(
                f"fxoverlap.tune: tuning needs CUDA events (the model's parameters are on {device}); the config "
                f"is kept as given. Move the model to a GPU, or time on the host: "
                f"from fxoverlap.tune import WallTimer; fxoverlap.tune(..., timer=WallTimer())"), stacklevel=2)
            return TuneResult(base, None, "defaults", seconds=time.perf_counter() - t_start)
        timer = CudaEventTimer(device)
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        warnings.warn(TuneWarning(
            "fxoverlap.tune: CUDA_DEVICE_MAX_CONNECTIONS=1 is set: every stream's kernels share one hardware "
            "queue, which was measured to halve what the overlap gains (Megatron sets it for its own "
            "ordering; fxoverlap orders with events). Unset it for the steps tuned and run"), stacklevel=2)
    ranks = Ranks(dist.group.WORLD if group == "world" and dist.is_initialized() else
                  (None if group == "world" else group))
    mbs = list(microbatches)
    ep_size = group_size(ep_group)
    emulated = getattr(ep_group, "link", None) is not None
    if candidates is None:
        candidates = enumerate_candidates(base, space=space, forward_only=forward_only, microbatches=len(mbs),
                                          ep_size=ep_size, device_type=device.type,
                                          comm_kernels=ep_size > 1 or emulated, local_experts=local_expert_count(model))
    candidates = list(candidates)
    agree_on_candidates(ranks, candidates)
    store = None if cache is False else cache if isinstance(cache, TuneCache) else TuneCache(
        None if cache is True else cache)
    key = cache_key(model, mbs, device=device, ep_group=ep_group, dp_group=dp_group, base=base,
                    forward_only=forward_only, candidates=candidates)
    if store is not None:
        entry = store.load(key)
        hits = ranks.min([1.0 if entry is not None else 0.0])[0]
        if hits:  # every rank has an entry: take the first rank's choice
            choice = Candidate(**ranks.first(entry["choice"]))
            path = store.path(key)
            log_cache_use(path, key, choice)
            return TuneResult(choice.config(base), choice, "cache", entry.get("table", []),
                              seconds=time.perf_counter() - t_start, cache_path=path)
        log.info("fxoverlap.tune: no cached entry for this key (%s); timing %d candidates",
                 store.path(key), len(candidates))
    with preserved(model):
        result = search(Session(model, ep_group, mbs, loss_fn, forward_only, base, timer, ranks, dp_group,
                                expert_dp_group), candidates, budget_s, iters, warmup, exhaustive, t_start)
    if store is not None and result.choice is not None:
        result.cache_path = store.store(key, result.choice, result.table)
    result.seconds = time.perf_counter() - t_start
    log.info("fxoverlap.tune: chose %s in %.1f s\n%s", result.choice.label() if result.choice else None,
             result.seconds, result.format_table())
    return result
