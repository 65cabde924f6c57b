"""``fxoverlap.region``: mark code the passes cannot recognise by op."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.fx.traceback as fx_traceback

from fxoverlap.ir.meta import REGION_KEY
from fxoverlap.ir.errors import FxOverlapError


class RegionError(FxOverlapError, ValueError):
    """``fxoverlap.region`` was given a name that is not a region."""

REGIONS = frozenset({"mhc", "dispatch", "combine", "experts"})


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """Mark the ops run inside this block as belonging to region ``name``.

    ``"dispatch"`` / ``"combine"``: communication the passes should treat as the
    layer's dispatch or combine all-to-all (e.g. a custom kernel they cannot
    recognise). ``"experts"``: a layer's expert (or feed-forward) computation:
    between a dispatch and a combine it is checked to be the experts stage; in a
    layer without communication it is the layer's ``mlp`` stage (instead of its last
    child with parameters). ``"mhc"``: hyper-connection code, which the recompute
    pass may replay instead of saving.

    Outside of tracing this is a no-op apart from a dict update, so models can
    keep the marker in their eager code.
    """
    if name not in REGIONS:
        raise RegionError(f"fxoverlap.region: unknown region {name!r}; expected one of {sorted(REGIONS)}")
    with fx_traceback.annotate({REGION_KEY: name}):
        yield
