"""An emulated EP interconnect: a process group stand-in whose exchanges hold their stream
as a real link would.

On one device an expert-parallel all-to-all moves nothing, so there is nothing for fxoverlap
to hide. :class:`EmulatedGroup` is a group of one rank (``a2a.GroupStandIn``) that stands in
for EP N: build the model on it and pass it where the EP group goes, as a real group would be
(``MoETransformer(cfg, group)``, ``fxoverlap.optimize(model, group)``). The comm ops reach it
through their own ``group_name`` argument; each transport runs its one-rank copy and then
tells the group what an EP-N rank would have moved (``a2a.exchanged``, one chokepoint per
transport), and the group holds the op's current stream for
``seconds = latency + bytes * (N - 1) / N * skew / bandwidth`` of its :class:`Link`
(nothing while its link is None). The comm ops (``fxoverlap/ops.py``,
``fxoverlap/dispatch_ops.py``) never import this module (an import-linter contract).

On CUDA the hold is a spinning kernel of 16 blocks x 512 threads on the op's current stream
(the comm stream under fxoverlap, the default stream in eager and under
``torch.compile``): each block reads ``%globaltimer`` and spins until the time has passed,
so it holds SM slots as an NCCL/NVSHMEM kernel does (``torch.cuda._sleep`` does not: it was
seen to let everything else run as if the link were free). On CPU it sleeps. A stand-in for
the hold itself (:func:`standin`, e.g. :class:`Counter`) replaces both: the CPU tests count
the calls and bytes with it.

Nothing here is read while tracing: the op bodies are opaque to Dynamo, AOT and Inductor
(only their fake kernels are traced), so the hold runs in every mode, eager,
``torch.compile(model)``, the ``fxoverlap`` backend and ``fxoverlap.optimize``, and the
group's link can be changed between steps (:attr:`EmulatedGroup.link`,
:meth:`EmulatedGroup.using`) without a recompile. A CUDA graph that captured a comm op bakes
the hold's duration in: fxoverlap never graphs comm stages, but
``torch.compile(model, mode="reduce-overhead")`` could (docs/design.md, "The emulated
interconnect").
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator

import torch

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.kernels.a2a import GroupStandIn


class LinkError(FxOverlapError, ValueError):
    """An emulated link's numbers are not usable (bandwidth <= 0, EP size < 1, ...)."""


# The spinning kernel's shape: what a comm kernel occupies (the earlier probe's 16 x 512).
HOLD_BLOCKS = 16
HOLD_WARPS = 16  # x 32 = 512 threads per block
MAX_HOLD_S = 10.0  # a hold longer than this is a units mistake: refuse it rather than hang the GPU


@dataclasses.dataclass(frozen=True)
class Link:
    """One EP-N rank's link: ``gbps`` GB/s (1e9 bytes/s, one direction, per rank) and
    ``latency_us`` per all-to-all; ``ep`` = N, the emulated group size; ``skew`` >= 1:
    the busiest link carries ``skew`` times the balanced bytes and sets the time;
    ``experts``: the emulated model's global expert count E (for the token-once ops'
    expected destination ranks per token; None: sampling with replacement)."""

    gbps: float
    latency_us: float = 20.0
    ep: int = 2
    skew: float = 1.0
    experts: int | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        if not (self.gbps > 0 and math.isfinite(self.gbps)):
            raise LinkError(f"emulated link: bandwidth must be a positive number of GB/s, got {self.gbps}")
        if self.latency_us < 0:
            raise LinkError(f"emulated link: latency must be >= 0 us, got {self.latency_us}")
        if self.ep < 1:
            raise LinkError(f"emulated link: the EP size must be >= 1, got {self.ep}")
        if self.skew < 1:
            raise LinkError(f"emulated link: skew is the busiest link's share over the balanced one, >= 1; "
                            f"got {self.skew}")

    @property
    def remote_share(self) -> float:
        """The share of a rank's rows that leave it, (N - 1) / N with balanced routing."""
        return (self.ep - 1) / self.ep

    def seconds(self, nbytes: int) -> float:
        """How long an all-to-all of ``nbytes`` (all rows one rank moves) holds the stream."""
        return self.latency_us * 1e-6 + nbytes * self.remote_share * self.skew / (self.gbps * 1e9)

    def token_ranks(self, top_k: int) -> float:
        """Expected destination ranks of a token that picks ``top_k`` distinct experts of
        ``experts`` (uniformly; with replacement when ``experts`` is None): the rows per
        token of the token-once dispatch (``MoEConfig.token_dedup``)."""
        n = self.ep
        if self.experts is None or self.experts % n:
            return n * (1.0 - (1.0 - 1.0 / n) ** top_k)
        e, el = self.experts, self.experts // n
        miss = math.comb(e - el, top_k) / math.comb(e, top_k) if top_k <= e else 0.0
        return n * (1.0 - miss)

    def replace(self, **changes) -> "Link":
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict:
        return {**dataclasses.asdict(self), "remote_share": self.remote_share, "emulated": True}


# Measured numbers (docs/design.md, "The emulated interconnect"): remote bandwidth per rank.
PRESETS: dict[str, Link] = {
    "nvlink": Link(294.0, name="nvlink"),  # 2 x H200, NVLink, NCCL all-to-all
    "p2p_off": Link(23.5, name="p2p_off"),  # 2 x H200, NCCL_P2P_DISABLE=1 (through host memory)
    "ib400": Link(45.0, name="ib400"),  # 400 Gb/s InfiniBand, DeepEP's measured internode rate
}


def preset(name: str, **changes) -> Link:
    """A preset by name (``nvlink``, ``p2p_off``, ``ib400``), with ``changes`` applied."""
    if name not in PRESETS:
        raise LinkError(f"unknown emulated link {name!r}; presets: {sorted(PRESETS)}")
    return PRESETS[name].replace(**changes)


# ---------------------------------------------------------------- the group


@dataclasses.dataclass
class Stats:
    """What a group's holds were asked for since the last :meth:`reset`: per op, calls, bytes,
    seconds, and the first and the last call's seconds (a step's first all-gather and last
    reduce-scatter are the part of the DP link no placement can hide: nothing runs before the
    one, nor after the other)."""

    calls: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    by_op: dict[str, list] = dataclasses.field(default_factory=dict)  # op -> [calls, bytes, seconds, first, last]

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.calls += 1
        self.nbytes += nbytes
        self.seconds += seconds
        row = self.by_op.setdefault(op, [0, 0, 0.0, seconds, 0.0])
        row[0] += 1
        row[1] += nbytes
        row[2] += seconds
        row[4] = seconds

    def reset(self) -> None:
        self.calls, self.nbytes, self.seconds, self.by_op = 0, 0, 0.0, {}

    def as_dict(self) -> dict:
        return {"calls": self.calls, "bytes": self.nbytes, "ms": self.seconds * 1e3,
                "by_op": {k: {"calls": c, "bytes": b, "ms": s * 1e3, "first_ms": f * 1e3, "last_ms": la * 1e3}
                          for k, (c, b, s, f, la) in sorted(self.by_op.items())}}


def per_step(row: dict, steps: int) -> dict:
    """One op's :meth:`Stats.as_dict` row over ``steps`` steps, per step (the first and last call's
    times stay as they are)."""
    return {k: v if k in ("first_ms", "last_ms") else v / steps for k, v in row.items()}


_names = itertools.count()


class EmulatedGroup(GroupStandIn):
    """One rank of EP-``link.ep`` on this device: a process group of one rank for compute,
    whose every exchange holds the op's stream as ``link`` would (None: holds nothing).

    Pass it where the EP group goes (the model's layers, ``fxoverlap.optimize``); the comm
    ops find it by its ``group_name`` (``fxoverlap_emulated_<n>`` unless ``name`` is given).
    ``stats`` sums what its holds were asked for (the bench's T_comm)."""

    def __init__(self, link: Link | None = None, name: str | None = None):
        super().__init__(name or f"fxoverlap_emulated_{next(_names)}")
        self._lock = threading.Lock()
        self.stats = Stats()
        self.link = link

    @property
    def link(self) -> Link | None:
        """The emulated link (None: the exchanges hold nothing); may change between steps."""
        return self._link

    @link.setter
    def link(self, link: Link | None) -> None:
        if link is not None and not isinstance(link, Link):
            raise LinkError(f"{self!r}: the link is an emulated_link.Link or None, got {type(link).__name__}")
        if link is not None:
            self._check_link(link)
        self._link = link

    def _check_link(self, link: Link) -> None:
        """A subclass's further condition on its link (raises :class:`LinkError`)."""

    @contextlib.contextmanager
    def using(self, link: Link | None) -> Iterator[Link | None]:
        """This group's link is ``link`` for the ``with`` block, then the previous one again."""
        before = self._link
        self.link = link
        try:
            yield link
        finally:
            self._link = before

    def takes_sms(self) -> bool:
        return self._link is not None  # the hold kernel runs beside the compute

    def token_rows(self, tokens: int, top_k: int) -> float:
        """Each token once per destination rank of an EP-N rank (:meth:`Link.token_ranks`)."""
        link = self._link
        return 0.0 if link is None else tokens * link.token_ranks(top_k)

    def exchanged(self, op: str, nbytes: int, device: torch.device) -> None:
        """Hold the current stream of ``device`` as the link would for an all-to-all of ``nbytes``."""
        link = self._link
        if link is None:
            return
        seconds = link.seconds(int(nbytes))
        if seconds > MAX_HOLD_S:
            raise LinkError(f"emulated link: {op} would hold its stream {seconds:.1f} s for {nbytes} bytes on "
                            f"{link}; check the units (GB/s, us)")
        with self._lock:
            self.stats.add(op, int(nbytes), seconds)
        hold = _standin
        if hold is not None:
            hold(op, int(nbytes), seconds, device)
        elif device.type == "cuda":
            spin(seconds, device)
        else:
            time.sleep(seconds)


class EmulatedDPGroup(EmulatedGroup):
    """One rank of data parallelism over ``size`` = M ranks on this device (rank 0 of M; the
    others are virtual): pass it as ``dp_group`` (and, for expert parameters sharded over
    M_e > 1 ranks under an emulated EP group, another of size M_e as ``expert_dp_group``) on a
    world of one rank. ``fxoverlap.grad_reduce.check_groups`` then sizes the shards and the
    gradient buckets for M ranks, and every DP collective (``grad_reduce.dp_collective``, the
    one chokepoint: ZeRO-3's unshard all-gather, its reduce-scatter, ZeRO-2's reduce-scatter
    and all-reduce) calls :meth:`collective` instead of ``torch.distributed``.

    :meth:`collective` runs a local stand-in of the data (every virtual rank holds what this one
    does: an all-gather tiles the local shard M times, a reduce-scatter / all-reduce sums M
    equal copies), so the buffers are real (the gathered parameters' memory is the full size)
    while the values are not the model's, and then holds a stream of the group's own for
    ``link.seconds(nbytes)`` = ``latency + nbytes * (M - 1) / M / bandwidth`` (the link's
    ``ep`` is M): as NCCL runs an async collective on its communicator's internal stream, so the
    hold never queues the EP all-to-all or the program's comm stream behind it. One stream per
    ``op`` name (the gathers have a communicator of their own in the real path too)."""

    def __init__(self, size: int, link: Link | None = None, name: str | None = None):
        if size < 1:
            raise LinkError(f"emulated DP group: the size M must be >= 1, got {size}")
        super().__init__(None, name or f"fxoverlap_emulated_dp_{next(_names)}")
        self.emulated_size = size
        self._streams: dict[tuple, torch.cuda.Stream] = {}
        self.link = link

    def _check_link(self, link: Link) -> None:
        """The DP link's group size is M (``Link(gbps, ep=M)``)."""
        if link.ep != self.emulated_size:
            raise LinkError(f"{self!r}: the link's group size (Link.ep={link.ep}) must be the emulated DP size "
                            f"{self.emulated_size}: Link(gbps, ep={self.emulated_size})")

    def __repr__(self) -> str:
        return f"EmulatedDPGroup({self.group_name!r}, size={getattr(self, 'emulated_size', '?')})"

    def collective(self, op: str, nbytes: int, device: torch.device, local: Callable[[], None],
                   tensors: tuple[torch.Tensor, ...] = ()) -> "LocalWork":
        """One asynchronous collective ``op`` of ``nbytes`` (the full exchange's bytes: the gathered
        buffer, the reduce-scatter's input; twice the buffer for an all-reduce): ``local()`` makes
        its data, then the hold; both on the group's stream for ``op``, which first waits for the
        current stream (where the buffers were written); ``tensors`` (its buffers) are recorded on
        that stream, so their blocks are not reused before it is done with them (as c10d records
        a collective's tensors on NCCL's stream). The returned work's ``wait()`` makes the current
        stream wait for it, as a c10d Work's does."""
        if device.type != "cuda":
            local()
            self.exchanged(op, nbytes, device)
            return LocalWork(None, device)
        key = (op, device.index)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        for t in tensors:
            t.record_stream(stream)
        with torch.cuda.stream(stream):
            local()
            self.exchanged(op, nbytes, device)
            done = torch.cuda.Event()
            done.record(stream)
        return LocalWork(done, device)


class LocalWork:
    """What :meth:`EmulatedDPGroup.collective` returns: the part of a c10d ``Work`` the
    reductions and gathers use (``wait``, ``is_completed``, ``get_future``)."""

    def __init__(self, done: torch.cuda.Event | None, device: torch.device):
        self._done, self._device = done, device

    def wait(self) -> bool:
        """The current stream waits for the collective (on CPU it is done already)."""
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        return self._done is None or self._done.query()

    def get_future(self) -> torch.futures.Future:
        """A completed future (the trace's "done" is the issue time: the hold's end is on the GPU)."""
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


# ---------------------------------------------------------------- the hold's stand-in (tests)

_standin: Callable[[str, int, float, torch.device], None] | None = None


@contextlib.contextmanager
def standin(fn: Callable[[str, int, float, torch.device], None] | None) -> Iterator[None]:
    """Replace the hold itself (kernel or sleep) by ``fn(op, nbytes, seconds, device)`` in every
    :class:`EmulatedGroup` for the ``with`` block (the tests' hook: the holds still happen where
    they would, with their numbers, but nothing spins or sleeps)."""
    global _standin
    before = _standin
    _standin = fn
    try:
        yield
    finally:
        _standin = before


class Counter:
    """A stand-in that only records ``(op, nbytes, seconds)`` per call (the CPU tests')."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []

    def __call__(self, op: str, nbytes: int, seconds: float, device: torch.device) -> None:
        self.calls.append((op, nbytes, seconds))

    @property
    def nbytes(self) -> int:
        return sum(c[1] for c in self.calls)

    def by_op(self) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = {}
        for op, b, _ in self.calls:
            row = out.setdefault(op, [0, 0])
            row[0] += 1
            row[1] += b
        return {k: tuple(v) for k, v in sorted(out.items())}


# ---------------------------------------------------------------- the CUDA kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the hold sleeps or calls the stand-in
    triton = None

if triton is not None:

    # ns is not specialised (no recompile per value; only an int32/int64 variant).
    @triton.jit(do_not_specialize=["ns"])
    def _spin_kernel(ns):
        # Each block spins on the global timer (ns) from its own start; 512 threads per
        # block keep the SM slots busy as a comm kernel's resident blocks do.
        start = tl.extra.cuda.globaltimer()
        now = start
        while now - start < ns:
            now = tl.extra.cuda.globaltimer()


def spin(seconds: float, device: torch.device) -> None:
    """Enqueue the spinning kernel (16 x 512 threads, ``seconds``) on ``device``'s current stream."""
    if triton is None:
        raise LinkError("the emulated link's CUDA hold needs Triton (a spinning kernel on %globaltimer)")
    ns = max(int(seconds * 1e9), 1)
    with torch.cuda.device(device):
        _spin_kernel[(HOLD_BLOCKS,)](ns, num_warps=HOLD_WARPS)
