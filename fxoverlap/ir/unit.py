"""Parameter units of fully sharded data parallelism (``OverlapConfig(shard_params=True)``).

A unit is the set of parameters gathered together: one all-gather brings every rank's shard
of each of its parameters, and they are dropped together. ``passes/shard.py`` decides the
units and places the program nodes that gather and drop them; ``fxoverlap.param_shard``
runs those nodes.

Layout: every parameter of a unit is sharded along its first dimension into ``ranks`` equal
row blocks (rank ``r`` holds rows ``[r·d0/ranks, (r+1)·d0/ranks)``, a
``torch.distributed.tensor.Shard(0)`` DTensor); a rank's shards are packed in unit order
into one flat buffer of :attr:`ParamUnit.shard_numel` elements (each at its
:attr:`UnitParam.offset`), which is what the all-gather sends.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class UnitParam:
    """One parameter of a unit: its name, full shape, and where its shard starts in the
    rank's flat shard buffer (elements). ``aliases``: the other names the program reads the
    same tensor by (tied weights: the capture lifts one placeholder per module slot), each
    given the gathered tensor and each with a gradient of its own, summed by the reduction."""

    fqn: str
    shape: tuple[int, ...]
    offset: int
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every name of the parameter: its own, then its aliases."""
        return (self.fqn, *self.aliases)


@dataclasses.dataclass(frozen=True)
class ParamUnit:
    """Parameters gathered and dropped together, over one group (``role``: ``"dense"`` over
    ``dp_group``, ``"expert"`` over ``expert_dp_group``), of one dtype."""

    index: int
    name: str  # e.g. "l3_dense", "l3_expert", "embed", "head", "embed+head" (tied)
    role: str
    dtype: torch.dtype
    ranks: int  # the group's size: each parameter's first dimension is split this many ways
    params: tuple[UnitParam, ...]

    def rows(self, p: UnitParam) -> int:
        """Rows of ``p`` each rank holds."""
        return p.shape[0] // self.ranks

    def shard_elems(self, p: UnitParam) -> int:
        """Elements of ``p`` each rank holds."""
        return math.prod(p.shape) // self.ranks

    @property
    def shard_numel(self) -> int:
        """Length of a rank's flat shard buffer (what the all-gather sends)."""
        last = self.params[-1]
        return last.offset + self.shard_elems(last)

    @property
    def numel(self) -> int:
        """Elements of the gathered parameters."""
        return sum(math.prod(p.shape) for p in self.params)

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered parameters (what holding the unit gathered costs)."""
        return self.numel * self.dtype.itemsize
