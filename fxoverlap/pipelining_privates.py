"""Every internal of ``torch.distributed.pipelining`` that fxoverlap's pipelining front end
(``fxoverlap/pipeline_parallel.py``) reaches, one named function each.

pipelining has no public API for what its custom functions (``OVERLAP_F_B``, the backward
actions) must do the way ``_PipelineScheduleRuntime._perform_action`` does it (wait a receive,
compute the loss, fill the stage's caches), so the front end reaches these internals here and nowhere else: a torch
release that renames one breaks this module, and ``tests/test_pipelining_privates.py`` names
which (:data:`NEEDED` lists each internal and where it lives). Module-level functions of
``schedules`` are looked up at call time, so a test that wraps ``schedules._batch_p2p``
sees our calls too.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NEEDED", "batch_p2p", "bwd_cache", "bwd_recv_ops", "compute_loss", "fwd_cache", "fwd_recv_ops",
           "get_loss", "has_internal", "pipeline_order_with_comms", "retrieve_recv_grads", "stage_input_count",
           "wait_batch_p2p"]

# (where, name) of each internal reached below: "schedules" (a function of the module),
# "schedule" (an attribute of a _PipelineScheduleRuntime instance), "stage" (of a PipelineStage
# instance); a dotted name is looked up attribute by attribute, and "a | b" is met by either (the
# layouts of torch 2.13 and of 2.11, the oldest torch fxoverlap supports)
NEEDED: tuple[tuple[str, str], ...] = (
    ("schedules", "_batch_p2p"),
    ("schedules", "_wait_batch_p2p"),
    ("schedule", "_maybe_compute_loss"),
    ("schedule", "_maybe_get_loss"),
    ("schedule", "fwd_recv_ops"),
    ("schedule", "bwd_recv_ops"),
    ("schedule", "pipeline_order_with_comms"),
    ("stage", "_retrieve_recv_grads"),
    ("stage", "_stage_meta.inputs | inputs_meta"),
    ("stage", "fwd_cache"),
    ("stage", "bwd_cache"),
)


def has_internal(owner: Any, name: str) -> bool:
    """Whether ``owner`` has the internal ``name`` of :data:`NEEDED` (dotted, ``a | b``)."""
    for path in name.split("|"):
        obj = owner
        try:
            for part in path.strip().split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return True
    return False


def _schedules():
    from torch.distributed.pipelining import schedules

    return schedules


def batch_p2p(ops: list, desc: str | None = None) -> list:
    """Issue P2P ops as the runtime does (``schedules._batch_p2p``); the works to wait on."""
    return _schedules()._batch_p2p(ops, desc=desc)


def wait_batch_p2p(works: list) -> None:
    """Wait for the works of :func:`batch_p2p` (``schedules._wait_batch_p2p``)."""
    _schedules()._wait_batch_p2p(works)


def compute_loss(schedule, stage, output: Any, target_mbs: list | None, mb: int) -> None:
    """The schedule's loss of microbatch ``mb`` where ``stage`` is the last (kept by the schedule).
    No ``loss_kwargs`` (torch 2.11's takes none): the schedule's ``loss_fn`` applies the step's."""
    schedule._maybe_compute_loss(stage, output, target_mbs, mb)


def get_loss(schedule, stage, mb: int) -> torch.Tensor | None:
    """The loss :func:`compute_loss` kept for microbatch ``mb`` (``None`` unless ``stage`` is the last)."""
    return schedule._maybe_get_loss(stage, mb)


def fwd_recv_ops(schedule) -> dict:
    """The runtime's issued activation receives, ``(stage index, microbatch) -> works``."""
    return schedule.fwd_recv_ops


def bwd_recv_ops(schedule) -> dict:
    """The runtime's issued gradient receives, ``(stage index, microbatch) -> works``."""
    return schedule.bwd_recv_ops


def pipeline_order_with_comms(schedule) -> dict | None:
    """The runtime's actions per rank, with its P2P actions (``None`` before it made them)."""
    return getattr(schedule, "pipeline_order_with_comms", None)


def retrieve_recv_grads(stage, mb: int) -> tuple:
    """The output gradients ``stage`` received for microbatch ``mb``."""
    return stage._retrieve_recv_grads(mb)


def stage_input_count(stage) -> int:
    """How many inputs the stage's forward takes (what its input gradients are cut to)."""
    meta = getattr(stage, "_stage_meta", None)
    return len(meta.inputs) if meta is not None else len(stage.inputs_meta)  # torch 2.13 / 2.11


def fwd_cache(stage) -> dict:
    """``microbatch -> (outputs, inputs)`` of the stage's forwards whose backward has not run."""
    return stage.fwd_cache


def bwd_cache(stage) -> dict:
    """``microbatch -> input gradients`` the stage sends (or hands to its local neighbour)."""
    return stage.bwd_cache
