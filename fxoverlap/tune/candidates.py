"""The candidate settings tuning considers: a pure function of the config, the search
:class:`Space`, the EP size and the device; forward-only calls get their own set.

A candidate's fields are grouped by the phase ``OverlapConfig`` declares for them
(``config.field_phase``): candidates that differ only in ``"runtime"`` fields (SM carve-out,
comm-stream priority) share one compiled program (:func:`program_groups`), and the runner's knobs
are set between timings (:func:`fxoverlap.tune.session.set_runtime_knobs`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from fxoverlap.config import DEEPEP_DISPATCHERS, OverlapConfig, field_phase

#: The fields tuning chooses (everything else of the config is kept, and is part of the key).
TUNED_FIELDS = ("chunks", "chunks_in_merged_steps", "delay_wgrad", "expert_wgrad_slot", "dispatcher",
                "sm_carveout", "comm_stream_priority")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setting of the tuned fields (:data:`TUNED_FIELDS`)."""

    chunks: int = 1
    chunks_in_merged_steps: bool = False
    delay_wgrad: bool = False
    expert_wgrad_slot: int = 2
    dispatcher: str = "auto"
    sm_carveout: int = 0
    comm_stream_priority: int = -1

    def config(self, base: OverlapConfig) -> OverlapConfig:
        """``base`` with this candidate's fields (and ``autotune`` off: this is the tuned config)."""
        return dataclasses.replace(base, **dataclasses.asdict(self), autotune=False)

    def fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def program_part(self) -> tuple:
        """The fields that change the compiled program (phases other than ``"runtime"``)."""
        return tuple((k, v) for k, v in self.fields().items() if field_phase(k) != "runtime")

    def stages_part(self) -> tuple:
        """The fields that change the capture or the stages (a new compile of every stage)."""
        return tuple((k, v) for k, v in self.fields().items() if field_phase(k) in ("capture", "stages"))

    def runtime_part(self) -> tuple:
        return tuple((k, v) for k, v in self.fields().items() if field_phase(k) == "runtime")

    def label(self) -> str:
        f = self.fields()
        return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in f.items())


@dataclasses.dataclass(frozen=True)
class Space:
    """The values searched per field. ``dispatchers=None``: the ones that apply
    (:func:`enumerate_candidates`). ``chunks_in_merged_steps=True`` is left out unless asked for:
    it never won where measured (its best setting 1.4-8.8 % slower than the best without it in
    all six exhaustive sweeps of docs/benchmarks.md, seventeenth and eighteenth sessions, and
    497.3 vs 495.5 ms in the seventh), and it made a third of the candidates."""

    chunks: tuple[int, ...] = (1, 2, 3, 4)
    chunks_in_merged_steps: tuple[bool, ...] = (False,)
    delay_wgrad: tuple[bool, ...] = (False, True)
    expert_wgrad_slot: tuple[int, ...] = (2, 3)
    sm_carveout: tuple[int, ...] = (0, 8, 16, 24, 32)
    comm_stream_priority: tuple[int, ...] = (-1, 0)
    dispatchers: tuple[str, ...] | None = None


def default_candidate(base: OverlapConfig, device_type: str) -> Candidate:
    """What ``base`` runs as on ``device_type`` (its ``None`` fields resolved): the defaults'
    candidate, always timed, so the choice is never slower than the defaults as measured."""
    return Candidate(chunks=base.resolved_chunks(device_type), chunks_in_merged_steps=base.chunks_in_merged_steps,
                     delay_wgrad=base.resolved_delay_wgrad(device_type), expert_wgrad_slot=base.expert_wgrad_slot,
                     dispatcher=base.dispatcher, sm_carveout=base.resolved_sm_carveout(device_type) or 0,
                     comm_stream_priority=base.comm_stream_priority)


def applicable_dispatchers(base: OverlapConfig, ep_size: int, device_type: str) -> tuple[str, ...]:
    """The dispatchers worth timing: DeepEP's as set (the model calls its ops itself); with one
    EP rank (or an emulated one) ``auto`` only (it is ``all_to_all`` there); with more, ``auto``
    (``symm_mem`` where it can run), and on CUDA ``all_to_all`` beside it, and ``padded``."""
    if base.dispatcher in DEEPEP_DISPATCHERS:
        return (base.dispatcher,)
    if ep_size <= 1:
        return ("auto",)
    return ("auto", "all_to_all", "padded") if device_type == "cuda" else ("auto", "padded")


def enumerate_candidates(base: OverlapConfig, *, space: Space = Space(), forward_only: bool = False,
                         microbatches: int = 2, ep_size: int = 1, device_type: str = "cuda",
                         comm_kernels: bool = True, local_experts: int | None = None) -> list[Candidate]:
    """Every candidate to consider, in a fixed order (the defaults' candidate first).

    - ``chunks`` above ``local_experts`` are left out (each expert's rows stay in one chunk);
      the static dispatchers (``padded``, ``symm_mem``) run unchunked, so only ``chunks=1``;
    - ``chunks_in_merged_steps`` only with chunks and more than one microbatch;
    - ``expert_wgrad_slot`` only with ``delay_wgrad``; forward-only calls have neither;
    - ``sm_carveout`` only where comm kernels run beside the experts (``comm_kernels``: more than
      one EP rank or an emulated link) and ``comm_stream_priority`` only on CUDA: elsewhere the
      runtime reads neither, so each collapses to one value.
    """
    dispatchers = space.dispatchers or applicable_dispatchers(base, ep_size, device_type)
    chunks = [k for k in space.chunks if local_experts is None or k <= local_experts] or [1]
    carveouts = space.sm_carveout if comm_kernels and device_type == "cuda" else (0,)
    priorities = space.comm_stream_priority if device_type == "cuda" else (-1,)
    wgrads = [(False, 2)] if forward_only else [
        (d, s) for d in space.delay_wgrad for s in (space.expert_wgrad_slot if d else (2,))]
    out: list[Candidate] = []
    for disp, k in itertools.product(dispatchers, chunks):
        if k > 1 and disp in ("padded", "symm_mem"):
            continue
        cims = space.chunks_in_merged_steps if k > 1 and microbatches > 1 else (False,)
        for cim, (dw, slot), carve, prio in itertools.product(dict.fromkeys(cims), wgrads, carveouts, priorities):
            out.append(Candidate(k, cim, dw, slot, disp, carve, prio))
    default = default_candidate(base, device_type)
    if forward_only:
        default = dataclasses.replace(default, delay_wgrad=False, expert_wgrad_slot=2)
    if device_type != "cuda" or not comm_kernels:
        default = dataclasses.replace(default, sm_carveout=0)
    if device_type != "cuda":
        default = dataclasses.replace(default, comm_stream_priority=-1)
    return [default, *[c for c in out if c != default]]


def program_groups(candidates: Sequence[Candidate]) -> list[list[Candidate]]:
    """The candidates by their program (:meth:`Candidate.program_part`), in first-seen order:
    one compile per group, its runtime variants timed on it."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault(c.program_part(), []).append(c)
    return list(groups.values())


def local_expert_count(model: nn.Module) -> int | None:
    """The local expert count, where the model says it (fxoverlap's reference models, the
    HF models through ``expert_parallel``): the largest ``num_experts``/``n_local_experts``-like
    attribute of a module; None when none is found (no filter on chunks)."""
    found = [v for m in model.modules() for a in ("n_local_experts", "num_local_experts", "local_experts")
             if isinstance(v := getattr(m, a, None), int) and v > 0]
    return max(found) if found else None
