"""Gradient buckets: what ``reduce`` plans and the runtime's gradient reduction runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class GradSlot:
    """One parameter's gradient in a bucket's flat buffer."""

    param: str  # parameter FQN
    value: str  # the gradient's value name in the store (a joint-graph output)
    shape: tuple[int, ...]
    offset: int  # its first element in the flat buffer

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Gradients reduced together: one flat buffer, one collective."""

    index: int
    role: str  # "dense" (over dp_group) or "expert" (over expert_dp_group)
    dtype: torch.dtype
    slots: tuple[GradSlot, ...]
    after: str  # the stage call whose gradients completed it (its reduction is issued after it)

    @property
    def numel(self) -> int:
        """Elements up to the end of the last gradient."""
        return slots_end(self.slots)

    def padded_numel(self, ranks: int) -> int:
        """The flat buffer's length for a group of ``ranks``: a multiple of ``ranks``."""
        return -(-self.numel // ranks) * ranks

    def shard(self, rank: int, ranks: int) -> tuple[int, int]:
        """The elements ``[start, stop)`` rank ``rank`` of ``ranks`` owns (reduce-scatter)."""
        size = self.padded_numel(ranks) // ranks
        return rank * size, (rank + 1) * size


def slots_end(slots: Sequence[GradSlot]) -> int:
    return slots[-1].offset + slots[-1].numel
