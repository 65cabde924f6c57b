"""``fxoverlap.tune``: the overlap knobs chosen by timing a few real steps of the user's own model.

``tune(model, ep_group, microbatches, loss_fn=..., budget_s=60, config=None) -> OverlapConfig``
times candidate settings of ``chunks`` (and ``chunks_in_merged_steps``), ``delay_wgrad`` with
``expert_wgrad_slot``, ``dispatcher``, ``sm_carveout`` and ``comm_stream_priority``, on these
microbatches, and returns ``config`` with the fastest (docs/tune.md). :func:`tune_with_report`
returns the same choice with the table of what was tried (:class:`TuneResult`).

How (each piece a function of its own, unit-tested on CPU in ``tests/test_tune.py``):

1. :func:`enumerate_candidates`: the candidate settings (a pure function of the config, the
   search :class:`Space`, the EP size and device); forward-only calls get their own set. A
   candidate's fields are grouped by the phase ``OverlapConfig`` declares for them
   (``config.field_phase``): candidates that differ only in ``"runtime"`` fields (SM carve-out,
   comm-stream priority) share one compiled program (:func:`program_groups`), and the runner's
   knobs are set between timings (:func:`_set_runtime_knobs`).
2. The step model (:class:`StageProfile`, :func:`predict_ms`): each stage's time is measured once,
   on the defaults' program (a synchronised run through the runner's stage hook, combined over
   ranks as one lockstep step: compute with its slowest rank, comm with its fastest); a
   candidate's program is built without compiling (eager stages: its structure only) and
   replayed on two in-order streams (:func:`replay`), its stages' times derived from the
   measured ones (:meth:`StageProfile.estimate`). The program groups are timed in the order
   the model ranks them until ``budget_s`` is spent.
3. The timer (:class:`Timer`): :class:`CudaEventTimer` times whole ``forward_backward`` steps with
   CUDA events (the default, and the only one on CUDA); :class:`WallTimer` uses the host clock
   (CPU smoke runs); a test passes its own. Without CUDA and without a timer, tuning is
   skipped: one :class:`TuneSkipped` warning, the config kept as given.
4. The cache (:func:`cache_key`, :class:`TuneCache`): one JSON file per key under
   ``$FXOVERLAP_TUNE_CACHE`` (default ``~/.cache/fxoverlap/tune``), written atomically; the key
   holds the model's signature, the microbatches' shapes and dtypes, the device name, the
   world/EP/DP sizes, the link (real, or the emulated link's numbers), the torch version, the
   config's other fields and the candidate list. A hit is used without timing, logged on
   ``fxoverlap.tune`` (``TORCH_LOGS="fxoverlap"``) and as the trace artifact ``fxoverlap_tune_cache``.
5. Ranks agree (:func:`_agree`): the candidate lists first, by digest (:class:`CandidateMismatch`
   on every rank when they differ, before any timing); every timing is reduced with MAX over
   the ranks (the slowest rank decides); each "go on?" decision against the budget is taken
   on the slowest rank's clock; so every rank times the same programs in the same order and
   ends with the same choice.

Tuning runs real steps: ``p.grad`` and the model's buffers (load-balance counters) are saved
before and restored after, as are the RNG states. Note ``fxoverlap.tune`` is the function
(``fxoverlap/__init__.py`` exports it over this module's name): import this module's names with
``from fxoverlap.tune import ...``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import itertools
import json
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn

from fxoverlap.config import DEEPEP_DISPATCHERS, OverlapConfig, field_phase
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.program import stage_calls
from fxoverlap.ir.stage import Direction, Part, Stage, StageKind, StreamKind

log = logging.getLogger("fxoverlap.tune")

#: Environment variable naming the cache folder (default ``~/.cache/fxoverlap/tune``).
CACHE_ENV = "FXOVERLAP_TUNE_CACHE"
#: Bumped when the cache's key or entry layout changes: older entries are then misses.
CACHE_VERSION = 1
#: The fields tuning chooses (everything else of the config is kept, and is part of the key).
TUNED_FIELDS = ("chunks", "chunks_in_merged_steps", "delay_wgrad", "expert_wgrad_slot", "dispatcher",
                "sm_carveout", "comm_stream_priority")
#: Step-model constants (documented in docs/tune.md, "The step model"). A chunk of K costs
#: 1/K of its whole stage plus this share (smaller GEMMs, the rows' copies; the 12-02
#: measurements put chunks 4 at ~15 % more compute on the experts: ~5 % a chunk).
CHUNK_COST = 0.05
#: The weight-gradient share of a backward attn/experts/mlp stage when only the unsplit stage
#: was measured (dX and dW of a linear layer are GEMMs of equal FLOPs).
WGRAD_SHARE = 0.5
#: Peak memory above this share of the device's memory: the headroom warning.
HEADROOM_SHARE = 0.9
#: Microbatch counts the report predicts the chosen setting's step for.
REPORT_MICROBATCHES = (4, 8, 16)


class TuneError(FxOverlapError, RuntimeError):
    """Tuning could not run as asked (the message names what and the fix)."""


class CandidateMismatch(TuneError):
    """The ranks enumerated different candidate lists (another config, EP size or device on some
    rank): raised on every rank, before any timing, so none waits in a collective."""


class TuneWarning(UserWarning):
    """What the measurement revealed: ``CUDA_DEVICE_MAX_CONNECTIONS=1``, a link slower than the
    compute can hide, a candidate too close to the device's memory (or out of it)."""


class TuneSkipped(TuneWarning):
    """Tuning needs CUDA events (or a timer passed in): the config is kept as given."""


# ---------------------------------------------------------------- candidates


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
    (:func:`enumerate_candidates`)."""

    chunks: tuple[int, ...] = (1, 2, 3, 4)
    chunks_in_merged_steps: tuple[bool, ...] = (False, True)
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


def digest(obj: Any) -> str:
    """A stable hex digest of a JSON-able value."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------- the step model


@dataclasses.dataclass(frozen=True)
class Call:
    """One stage call of a program: node name, stage, stream, and the earlier calls it reads."""

    name: str
    stage: str
    stream: str
    deps: tuple[str, ...] = ()


def calls_of(program: torch.fx.GraphModule) -> list[Call]:
    """The stage calls of ``program`` in the runtime's order, with what each reads."""
    producer: dict[tuple[int, str], str] = {}
    out = []
    for n, st in stage_calls(program):
        deps = tuple(dict.fromkeys(producer[(st.microbatch, v)] for v in st.reads if (st.microbatch, v) in producer))
        out.append(Call(n.name, st.stage, st.stream.value, deps))
        for v in st.writes:
            producer[(st.microbatch, v)] = n.name
    return out


def replay(calls: Sequence[Call], stage_ms: Mapping[str, float]) -> float:
    """The step time of ``calls`` run on two in-order streams (compute, comm), each call starting
    when its stream is free and the calls it reads have ended, each taking its stage's time
    (``stage_ms`` by stage name): what the schedule's events allow, without the host or
    contention."""
    end: dict[str, float] = {}
    free = {StreamKind.COMP.value: 0.0, StreamKind.COMM.value: 0.0}
    for c in calls:
        s = StreamKind.COMM.value if c.stream == StreamKind.COMM.value else StreamKind.COMP.value
        t0 = max([free[s], *(end[d] for d in c.deps if d in end)])
        end[c.name] = free[s] = t0 + stage_ms[c.stage]
    return max(free.values())


_SPLIT_KINDS = (StageKind.ATTN, StageKind.EXPERTS, StageKind.MLP)


def _role(stage: Stage) -> tuple:
    return (stage.direction.value, stage.layer, stage.kind.value)


@dataclasses.dataclass
class StageProfile:
    """Stage times measured once (ms per call, by stage name) on one program's stages, and the
    rules that derive the time of a stage of another candidate's program from them.

    Per role (direction, layer, kind) and part, the *whole* time: the unchunked stage's, or the sum
    of its chunks' less :data:`CHUNK_COST` each. A candidate's stage then takes: its measured time
    if the same stage was measured; else its part's whole time (a backward attn/experts/mlp stage
    not split into weight gradients: main + wgrad; split where only the whole was measured:
    :data:`WGRAD_SHARE` of it to the wgrad part), divided by its layer's chunk count K and
    times (1 + CHUNK_COST) for a chunk. A role never measured takes 0."""

    stage_ms: dict[str, float]
    stages: list[Stage]
    chunk_cost: float = CHUNK_COST
    wgrad_share: float = WGRAD_SHARE

    def __post_init__(self) -> None:
        whole: dict[tuple, dict[str, float]] = {}
        chunked: dict[tuple, dict[str, list[float]]] = {}
        for s in self.stages:
            t = self.stage_ms.get(s.name)
            if t is None:
                continue
            part = s.part.value
            if s.chunk is None:
                whole.setdefault(_role(s), {})[part] = t
            else:
                chunked.setdefault(_role(s), {}).setdefault(part, []).append(t)
        self._chunks = {(role, part): len(ts) for role, parts in chunked.items() for part, ts in parts.items()}
        for role, parts in chunked.items():
            for part, ts in parts.items():
                cost = 1 + (self.chunk_cost if len(ts) > 1 else 0.0)
                whole.setdefault(role, {}).setdefault(part, sum(ts) / cost)
        self._whole = whole

    def estimate(self, stage: Stage, stages: Sequence[Stage]) -> float:
        """The time of ``stage``, one of ``stages`` (a candidate's), by the rules above."""
        role, part = _role(stage), stage.part
        parts = self._whole.get(role, {})
        main, wgrad = parts.get(Part.MAIN.value), parts.get(Part.WGRAD.value)
        splits = part in (Part.MAIN, Part.WGRAD) and stage.direction is Direction.BWD and stage.kind in _SPLIT_KINDS
        split_here = splits and any(_role(s) == role and s.part is Part.WGRAD for s in stages)
        k = sum(1 for s in stages if _role(s) == role and s.part is part and s.chunk is not None)
        if (stage.name in self.stage_ms and split_here == (splits and wgrad is not None)
                and (stage.chunk is None or self._chunks.get((role, part.value)) == k)):
            return self.stage_ms[stage.name]  # the same stage was measured (same split, same chunks)
        if splits:
            combined = (main or 0.0) + (wgrad or 0.0)
            if part is Part.WGRAD:
                t = wgrad if wgrad is not None else combined * self.wgrad_share
            elif split_here:
                t = main if wgrad is not None else combined * (1 - self.wgrad_share)
            else:
                t = combined
        else:
            t = parts.get(part.value, 0.0)
        if stage.chunk is not None:
            t = t / max(k, 1) * (1 + (self.chunk_cost if k > 1 else 0.0))
        return t

    def sums(self) -> dict[str, float]:
        """Per stream, the measured stage times of the profiled program, per call (``comp``, ``comm``)."""
        out = {StreamKind.COMP.value: 0.0, StreamKind.COMM.value: 0.0}
        for s in self.stages:
            out[s.stream.value] += self.stage_ms.get(s.name, 0.0)
        return out


def predict_ms(program: torch.fx.GraphModule, stages: Sequence[Stage], profile: StageProfile) -> float:
    """The step model's time for ``program`` over ``stages``: :func:`replay` with
    :meth:`StageProfile.estimate` per stage."""
    times = {s.name: profile.estimate(s, stages) for s in stages}
    return replay(calls_of(program), times)


def stream_busy_ms(program: torch.fx.GraphModule, stage_ms: Mapping[str, float]) -> dict[str, float]:
    """Per stream, the sum of the times of the program's stage calls (``stage_ms`` by stage)."""
    out = {StreamKind.COMP.value: 0.0, StreamKind.COMM.value: 0.0}
    for c in calls_of(program):
        out[StreamKind.COMM.value if c.stream == StreamKind.COMM.value else StreamKind.COMP.value] += stage_ms[c.stage]
    return out


# ---------------------------------------------------------------- timers


class Timer(Protocol):
    """How tuning times. ``step_ms(candidate, step, iters)``: the median ms of ``iters`` calls of
    ``step`` (a whole ``forward_backward``) run with ``candidate``; ``stage_hook()``: a
    ``ProgramRunner`` hook that records each stage call's time alone in its ``times`` (ms by
    program node name), or None when this timer measures no stages (no step model then)."""

    def step_ms(self, candidate: Candidate, step: Callable[[], Any], iters: int) -> float: ...

    def stage_hook(self) -> Any: ...


class _StageHook:
    """Runs each stage alone (synchronised before and after on CUDA) and records its time."""

    def __init__(self, cuda: bool, device: torch.device | None):
        self.cuda, self.device = cuda, device
        self.times: dict[str, float] = {}

    def __call__(self, node, stage, run):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outs = run()
            end.record()
            torch.cuda.synchronize(self.device)
            self.times[node.name] = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            outs = run()
            self.times[node.name] = (time.perf_counter() - t0) * 1e3
        return outs


class CudaEventTimer:
    """Whole steps between two CUDA events on the current stream, synchronised around each
    (the bench's timing); stages alone through a synchronising hook."""

    def __init__(self, device: torch.device):
        self.device = device

    def step_ms(self, candidate: Candidate, step: Callable[[], Any], iters: int) -> float:
        times = []
        for _ in range(iters):
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(self.device)
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def stage_hook(self) -> _StageHook:
        return _StageHook(True, self.device)


class WallTimer:
    """Host wall-clock timing (``time.perf_counter``): for CPU smoke runs of the whole flow;
    on a GPU, :class:`CudaEventTimer` is the one that measures the device."""

    def step_ms(self, candidate: Candidate, step: Callable[[], Any], iters: int) -> float:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def stage_hook(self) -> _StageHook:
        return _StageHook(False, None)


# ---------------------------------------------------------------- the cache


def model_signature(model: nn.Module) -> str:
    """A digest of the parameters' and buffers' names, shapes and dtypes and the modules' types."""
    parts = [("p", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    parts += [("b", n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    parts += [("m", n, f"{type(m).__module__}.{type(m).__qualname__}") for n, m in model.named_modules()]
    return digest(parts)


def _group_size(group) -> int:
    if group is None:
        return 1
    if hasattr(group, "size") and not isinstance(group, dist.ProcessGroup):
        return int(group.size())
    return dist.get_world_size(group) if dist.is_initialized() else 1


def link_key(ep_group) -> dict:
    """The link the exchanges run over: an emulated one's numbers (``EmulatedGroup.link``), or
    the real group's backend and size."""
    link = getattr(ep_group, "link", None)
    if link is not None and hasattr(link, "describe"):
        return {"kind": "emulated", **link.describe()}
    if ep_group is None:
        return {"kind": "none"}
    if isinstance(ep_group, dist.ProcessGroup):
        return {"kind": "real", "backend": str(dist.get_backend(ep_group)), "size": _group_size(ep_group)}
    return {"kind": type(ep_group).__name__, "link": None}


def _tensors(mb) -> list[torch.Tensor]:
    if isinstance(mb, torch.Tensor):
        return [mb]
    if isinstance(mb, Mapping):
        return [v for _, v in sorted(mb.items()) if isinstance(v, torch.Tensor)]
    return [t for t in mb if isinstance(t, torch.Tensor)]


def cache_key(model: nn.Module, microbatches: Sequence, *, device: torch.device, ep_group=None, dp_group=None,
              base: OverlapConfig, forward_only: bool, candidates: Sequence[Candidate]) -> dict:
    """What a tuned result depends on (docs/tune.md, "The cache"), as a JSON-able dict."""
    others = {f.name: repr(getattr(base, f.name)) for f in dataclasses.fields(base)
              if f.name not in TUNED_FIELDS and f.name not in ("autotune", "progress")}
    return {
        "version": CACHE_VERSION,
        "model": model_signature(model),
        "microbatches": [[(tuple(t.shape), str(t.dtype)) for t in _tensors(mb)] for mb in microbatches],
        "forward_only": forward_only,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "ep": _group_size(ep_group),
        "dp": _group_size(dp_group),
        "link": link_key(ep_group),
        "torch": torch.__version__,
        "config": others,
        "candidates": digest([c.fields() for c in candidates]),
    }


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fxoverlap", "tune")


class TuneCache:
    """One JSON file per key digest under ``folder`` (default :func:`cache_dir`)."""

    def __init__(self, folder: str | None = None):
        self.folder = folder or cache_dir()

    def path(self, key: Mapping) -> str:
        return os.path.join(self.folder, f"{digest(key)[:32]}.json")

    def load(self, key: Mapping) -> dict | None:
        """The entry stored under ``key`` (its own key checked equal), or None."""
        path = self.path(key)
        try:
            with open(path) as f:
                entry = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.info("fxoverlap.tune: ignoring unreadable cache entry %s (%s)", path, e)
            return None
        if entry.get("key") != json.loads(json.dumps(key, default=str)):
            log.info("fxoverlap.tune: cache entry %s holds another key; ignored", path)
            return None
        return entry

    def store(self, key: Mapping, choice: Candidate, table: list[dict]) -> str:
        """Write the entry atomically (a temporary file in the folder, then ``os.replace``)."""
        os.makedirs(self.folder, exist_ok=True)
        path = self.path(key)
        entry = {"key": key, "choice": choice.fields(), "table": table,
                 "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f, indent=1, default=str)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


def _log_cache_use(path: str, key: Mapping, choice: Candidate) -> None:
    log.info("fxoverlap.tune: using cached entry %s (model %s, device %s, link %s): %s", path, key["model"][:12],
             key["device"], key["link"].get("kind"), choice.label())
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": "fxoverlap_tune_cache", "encoding": "json"},
        payload_fn=lambda: json.dumps({"path": path, "key": key, "choice": choice.fields()}, default=str),
        expect_trace_id=False)


# ---------------------------------------------------------------- ranks


class _Ranks:
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


def _agree(ranks: _Ranks, candidates: Sequence[Candidate]) -> None:
    """Raise :class:`CandidateMismatch` on every rank unless all enumerated the same list."""
    mine = digest([c.fields() for c in candidates])
    seen = ranks.gather((mine, len(candidates)))
    if len({d for d, _ in seen}) > 1:
        raise CandidateMismatch(
            "fxoverlap.tune: the ranks enumerated different candidate lists (digest, count per rank: "
            f"{[(d[:10], n) for d, n in seen]}). Every rank must pass the same config, space, microbatch "
            "count and EP/DP groups and run on the same kind of device; pass candidates=... to fix the list")


# ---------------------------------------------------------------- tuning


@dataclasses.dataclass
class TuneResult:
    """:func:`tune_with_report`'s answer: the config, the candidate it is, where it came from
    (``"timed"``, ``"cache"``, ``"defaults"``: skipped), the table of what was tried (one row per
    candidate: its fields, ``predicted_ms``, ``measured_ms`` (slowest rank's median), ``status``),
    the predicted step of the choice at other microbatch counts, and the seconds spent."""

    config: OverlapConfig
    choice: Candidate | None
    source: str
    table: list[dict] = dataclasses.field(default_factory=list)
    microbatch_prediction: dict[int, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    cache_path: str | None = None

    def format_table(self) -> str:
        rows = [("candidate", "predicted ms", "measured ms", "status")]
        for r in self.table:
            p, m = r.get("predicted_ms"), r.get("measured_ms")
            rows.append((r["label"], "-" if p is None else f"{p:.2f}", "-" if m is None else f"{m:.2f}",
                         r["status"]))
        widths = [max(len(x[i]) for x in rows) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


@contextlib.contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Run real steps on ``model`` and leave its ``p.grad``, buffers and the RNG states as found."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _set_runtime_knobs(runner, candidate: Candidate, device: torch.device) -> None:
    """Apply the candidate's ``"runtime"`` fields to a compiled program's runner (no recompile).
    A CUDA-graphed experts stage keeps the carve-out of the run that captured it."""
    runner.sm_carveout = candidate.sm_carveout
    if device.type == "cuda" and runner.streams:
        runner.streams[StreamKind.COMM] = torch.cuda.Stream(device, priority=candidate.comm_stream_priority)


def _local_experts(model: nn.Module) -> int | None:
    """The local expert count, where the model says it (fxoverlap's reference models, the
    HF models through ``expert_parallel``): the largest ``num_experts``/``n_local_experts``-like
    attribute of a module; None when none is found (no filter on chunks)."""
    found = [v for m in model.modules() for a in ("n_local_experts", "num_local_experts", "local_experts")
             if isinstance(v := getattr(m, a, None), int) and v > 0]
    return max(found) if found else None


class _Session:
    """One tuning run: the engines, the structures and the timings of one model and call."""

    def __init__(self, model, ep_group, mbs, fn, forward_only, base, timer, ranks, dp_group, expert_dp_group):
        self.model, self.ep_group, self.mbs, self.fn = model, ep_group, list(mbs), fn
        self.forward_only, self.base, self.timer, self.ranks = forward_only, base, timer, ranks
        self.dp_group, self.expert_dp_group = dp_group, expert_dp_group
        p = next(model.parameters(), None)
        self.device = p.device if p is not None else torch.device("cpu")
        self._structures: dict[tuple, tuple] = {}

    def engine(self, cfg: OverlapConfig):
        from fxoverlap.engine import optimize

        return optimize(self.model, self.ep_group, cfg, dp_group=self.dp_group, expert_dp_group=self.expert_dp_group)

    def step(self, engine) -> Callable[[], Any]:
        if self.forward_only:
            def fwd():
                with torch.no_grad():
                    return engine.forward_only(self.mbs, self.fn)
            return fwd

        def train():
            self.model.zero_grad(set_to_none=True)
            return engine.forward_backward(self.mbs, self.fn)
        return train

    def runner(self, engine, hook=None):
        """The runner the engine's step runs with (compiled by now), or one like it through ``hook``."""
        checked = engine._check(self.mbs, self.fn, "tune", "output_fn" if self.forward_only else "loss_fn")
        entry, tensors = engine._entry(checked[0], self.fn, train=not self.forward_only)
        prog = engine._program(entry, len(checked), train=not self.forward_only, hook=hook)
        return prog, entry, tensors, checked

    def seed_structure(self, cand: Candidate, engine) -> None:
        """Take ``cand``'s capture and stages from its compiled engine (no second capture)."""
        _, entry, _, _ = self.runner(engine)
        self._structures[cand.stages_part()] = (entry.capture, entry.stages)

    def profile(self, engine, timer) -> dict[str, float] | None:
        """Each stage's time alone (ms per call, median over its calls), one synchronised run."""
        from fxoverlap.runtime import accumulate_into, static_values

        hook = timer.stage_hook()
        if hook is None:
            return None
        prog, entry, tensors, checked = self.runner(engine, hook)
        self.model.zero_grad(set_to_none=True)
        grads = None if self.forward_only else accumulate_into(tensors, entry.capture)
        with torch.no_grad() if self.forward_only else contextlib.nullcontext():
            prog.run(static_values(entry.capture, tensors), checked, grads=grads)
        by_stage: dict[str, list[float]] = {}
        names = {n.name: st.stage for n, st in stage_calls(prog.program)}
        for node, ms in hook.times.items():
            by_stage.setdefault(names[node], []).append(ms)
        stages = sorted(by_stage)
        mine = [statistics.median(by_stage[s]) for s in stages]
        # one lockstep step: compute with its slowest rank, comm with its fastest
        comm = {s.name for s in entry.stages if s.stream is StreamKind.COMM}
        hi, lo = self.ranks.max(mine), self.ranks.min(mine)
        return {s: (lo[i] if s in comm else hi[i]) for i, s in enumerate(stages)}

    def structure(self, cand: Candidate, n: int | None = None):
        """The stages and the program of ``cand`` for ``n`` microbatches (default: this call's),
        built with eager stages (no compile: the structure only)."""
        from fxoverlap.pipeline import build_program

        key = cand.stages_part()
        if key not in self._structures:
            cfg = dataclasses.replace(cand.config(self.base), compiler="eager", cuda_graphs=False, progress=False)
            eng = self.engine(cfg)
            checked = eng._check(self.mbs, self.fn, "tune", "output_fn" if self.forward_only else "loss_fn")
            entry = eng._compiled(checked[0], self.fn, train=not self.forward_only)
            self._structures[key] = (entry.capture, entry.stages)
        cap, stages = self._structures[key]
        cfg = cand.config(self.base)
        program = build_program(stages, cap, n or len(self.mbs), cfg, forward_only=self.forward_only)
        return stages, program


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
    ranks = _Ranks(dist.group.WORLD if group == "world" and dist.is_initialized() else
                   (None if group == "world" else group))
    mbs = list(microbatches)
    ep_size = _group_size(ep_group)
    emulated = getattr(ep_group, "link", None) is not None
    if candidates is None:
        candidates = enumerate_candidates(base, space=space, forward_only=forward_only, microbatches=len(mbs),
                                          ep_size=ep_size, device_type=device.type,
                                          comm_kernels=ep_size > 1 or emulated, local_experts=_local_experts(model))
    candidates = list(candidates)
    _agree(ranks, candidates)
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
            _log_cache_use(path, key, choice)
            return TuneResult(choice.config(base), choice, "cache", entry.get("table", []),
                              seconds=time.perf_counter() - t_start, cache_path=path)
        log.info("fxoverlap.tune: no cached entry for this key (%s); timing %d candidates",
                 store.path(key), len(candidates))
    with _preserved(model):
        result = _search(_Session(model, ep_group, mbs, loss_fn, forward_only, base, timer, ranks, dp_group,
                                  expert_dp_group), candidates, budget_s, iters, warmup, exhaustive, t_start)
    if store is not None and result.choice is not None:
        result.cache_path = store.store(key, result.choice, result.table)
    result.seconds = time.perf_counter() - t_start
    log.info("fxoverlap.tune: chose %s in %.1f s\n%s", result.choice.label() if result.choice else None,
             result.seconds, result.format_table())
    return result


def _search(s: _Session, candidates: list[Candidate], budget_s: float, iters: int, warmup: int,
            exhaustive: bool, t_start: float) -> TuneResult:
    groups = program_groups(candidates)
    rows = {c: {"label": c.label(), **c.fields(), "predicted_ms": None, "measured_ms": None, "status": "not timed"}
            for c in candidates}
    # 1. the defaults' program (the first group): timed always, and its stages profiled once
    measured: dict[Candidate, float] = {}
    t0 = time.perf_counter()
    engine = s.engine(groups[0][0].config(s.base))
    _time_group(s, engine, groups[0], warmup, iters, measured, rows)
    group_cost = s.ranks.max([time.perf_counter() - t0])[0]  # compile + steps of one program
    profile = s.profile(engine, s.timer)
    # 2. the step model ranks the other programs (the first rank's order, so every rank agrees)
    order = list(range(1, len(groups)))
    if profile is not None:
        s.seed_structure(groups[0][0], engine)
        base_stages, base_program = s.structure(groups[0][0])
        prof = StageProfile(profile, list(base_stages))
        _warn_link(prof, base_program)
        predicted = {}
        for i, g in enumerate(groups):
            stages, program = s.structure(g[0])
            predicted[i] = predict_ms(program, stages, prof)
            for c in g:
                rows[c]["predicted_ms"] = predicted[i]
        order.sort(key=lambda i: (predicted[i], i))
        order = s.ranks.first(order)
    # 3. time the programs in that order while the budget lasts (the slowest rank's clock)
    for i in order:
        spent = s.ranks.max([time.perf_counter() - t_start])[0]
        if not exhaustive and spent + group_cost > budget_s:
            for c in (c for j in order[order.index(i):] for c in groups[j]):
                rows[c]["status"] = "skipped (budget)"
            break
        t0 = time.perf_counter()
        try:
            engine = s.engine(groups[i][0].config(s.base))
            _time_group(s, engine, groups[i], warmup, iters, measured, rows)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            warnings.warn(TuneWarning(f"fxoverlap.tune: {groups[i][0].label()} ran out of device memory; left out"))
            for c in groups[i]:
                rows[c]["status"] = "out of memory"
        group_cost = max(group_cost, time.perf_counter() - t0)
    best = min(measured, key=lambda c: (measured[c], candidates.index(c)))
    rows[best]["status"] += ", chosen"
    result = TuneResult(best.config(s.base), best, "timed", [rows[c] for c in candidates])
    if profile is not None and not s.forward_only:
        for n in REPORT_MICROBATCHES:
            stages, program = s.structure(best, n)
            result.microbatch_prediction[n] = predict_ms(program, stages, prof)
    return result


def _time_group(s: _Session, engine, group: list[Candidate], warmup: int, iters: int,
                measured: dict[Candidate, float], rows: dict) -> None:
    """Compile ``group``'s program (the warm-up steps) and time each of its runtime variants
    on it; every rank's times reduced with MAX."""
    step = s.step(engine)
    runner = _compiled_runner(s, engine)  # compiles the program the step runs
    _set_runtime_knobs(runner, group[0], s.device)
    cuda = s.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(s.device)
    for _ in range(max(warmup, 1)):
        step()
    mine = []
    for c in group:
        _set_runtime_knobs(runner, c, s.device)
        mine.append(s.timer.step_ms(c, step, iters))
    times = s.ranks.max(mine)
    for c, t in zip(group, times):
        measured[c] = t
        rows[c]["measured_ms"] = t
        rows[c]["status"] = "timed"
    if cuda:
        peak = torch.cuda.max_memory_allocated(s.device)
        total = torch.cuda.get_device_properties(s.device).total_memory
        if peak > HEADROOM_SHARE * total:
            warnings.warn(TuneWarning(
                f"fxoverlap.tune: {group[0].label()} peaked at {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
                f"(over {HEADROOM_SHARE:.0%}): little headroom for the optimizer or a longer sequence"))


def _compiled_runner(s: _Session, engine):
    """The runner the engine's step uses (its program compiled on first use)."""
    return s.runner(engine)[0].runner


def _warn_link(profile: StageProfile, program: torch.fx.GraphModule) -> None:
    busy = stream_busy_ms(program, {st.name: profile.estimate(st, profile.stages) for st in profile.stages})
    comp, comm = busy[StreamKind.COMP.value], busy[StreamKind.COMM.value]
    if comm > comp > 0:
        warnings.warn(TuneWarning(
            f"fxoverlap.tune: the link is slower than the compute can hide: the exchanges take {comm:.1f} ms a "
            f"step and the compute {comp:.1f} ms, so at least {comm - comp:.1f} ms of exchange stay exposed "
            f"whatever the settings (more microbatches or a faster link hide more)"))
