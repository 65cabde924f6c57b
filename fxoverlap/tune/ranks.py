"""How the ranks agree: the candidate lists first, by digest (:func:`agree_on_candidates`:
``CandidateMismatch`` on every rank when they differ, before any timing); every timing is reduced
with MAX over the ranks (the slowest rank decides); each "go on?" decision against the budget is
taken on the slowest rank's clock (:func:`fxoverlap.tune.search.search`); so every rank times the
same programs in the same order and ends with the same choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxoverlap.tune.cache import digest
from fxoverlap.tune.candidates import Candidate
from fxoverlap.tune.errors import CandidateMismatch


class Ranks:
    """The collectives tuning agrees through (no-ops on one rank)."""

    def __init__(self, group):
        self.group = group if (group is not None and dist.is_initialized()
                               and dist.get_world_size(group) > 1) else None
        self.device = torch.device("cpu")
        if self.group is not None and str(dist.get_backend(self.group)) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def min(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MIN)

    def _reduce(self, values: Sequence[float], op) -> list[float]:
        if self.group is None or not values:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def first(self, obj: Any) -> Any:
        """The group's first rank's ``obj``, on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]


def agree_on_candidates(ranks: Ranks, candidates: Sequence[Candidate]) -> None:
    """Raise :class:`CandidateMismatch` on every rank unless all enumerated the same list."""
    mine = digest([c.fields() for c in candidates])
    seen = ranks.gather((mine, len(candidates)))
    if len({d for d, _ in seen}) > 1:
        raise CandidateMismatch(
            "fxoverlap.tune: the ranks enumerated different candidate lists (digest, count per rank: "
            f"{[(d[:10], n) for d, n in seen]}). Every rank must pass the same config, space, microbatch "
            "count and EP/DP groups and run on the same kind of device; pass candidates=... to fix the list")
