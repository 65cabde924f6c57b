"""cudagraph: choose the stages the runtime runs as CUDA graphs.

Contract
--------
Assumes: ``split`` decided each stage's capturability (``stage.not_capturable_reason``:
communication, host syncs, data-dependent shapes, in-place ops, nothing to launch).
``inductor`` runs after it and may lower the chosen stages too (a graphed compiled
stage is captured as its compiled kernels).

Guarantees: ``stage.graphed`` is True exactly for the capturable stages; it adds,
removes and rewrites no node of any graph. Each stage left out is logged once,
with the node that stops it (a compute stage left eager costs launch overhead, so
at WARNING; a comm stage at INFO). ``free`` reads ``stage.graphed`` and never frees
a graphed stage's outputs: they are the static outputs of the stage's graphs,
which the runtime (``fxoverlap.cudagraphs``) owns and overwrites at the next replay.

Passes never touch CUDA: this pass runs the same on CPU, where the runtime ignores
the choice (with a warning). Running it twice gives the same result.

Steps
-----
1. Per stage: ``graphed`` = ``capturable``; log each stage left out and why.

Entry point: ``cudagraph(stages) -> None``.
"""

from __future__ import annotations

import logging

from fxoverlap.stage import Stage, StreamKind

log = logging.getLogger("fxoverlap")


def cudagraph(stages: list[Stage]) -> None:
    for s in stages:
        s.graphed = s.capturable
        if not s.graphed:
            level = logging.INFO if s.stream is StreamKind.COMM else logging.WARNING
            log.log(level, "fxoverlap cudagraph: not captured: %s", s.not_capturable_reason)
    log.info("fxoverlap cudagraph: %d of %d stages graphed", sum(s.graphed for s in stages), len(stages))
