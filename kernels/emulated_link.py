"""An emulated EP interconnect: every fxoverlap all-to-all holds its stream as a real link would.

On one device an expert-parallel all-to-all moves nothing, so there is nothing for
fxoverlap to hide. With a :class:`Link` set (:func:`set_link` or :func:`using`), every
fxoverlap comm op (``dispatch``, ``combine``, ``token_dispatch``, ``token_combine``, their
backward ops and every static variant, ``fxoverlap/ops.py`` and ``fxoverlap/dispatch_ops.py``)
calls :func:`hold` at the end of its implementation, after its local copy, with the bytes
an EP-N rank would move: ``seconds = latency + bytes * (N - 1) / N * skew / bandwidth``.

On CUDA the hold is a spinning kernel of 16 blocks x 512 threads on the op's current
stream (the comm stream under fxoverlap, the default stream in eager and under
``torch.compile``): each block reads ``%globaltimer`` and spins until the time has
passed, so it holds SM slots as an NCCL/NVSHMEM kernel does (``torch.cuda._sleep`` does
not: it was seen to let everything else run as if the link were free). On CPU it
sleeps. A stand-in (:func:`standin`, e.g. :class:`Counter`) replaces both: the CPU
tests count the calls and bytes with it.

Nothing here is read while tracing: the op bodies are opaque to Dynamo, AOT and
Inductor (only their fake kernels are traced), so the hold runs in every mode, eager,
``torch.compile(model)``, the ``fxoverlap`` backend and ``fxoverlap.optimize``, and the
link can be changed between steps without a recompile. A CUDA graph that captured a
comm op bakes the hold's duration in: fxoverlap never graphs comm stages, but
``torch.compile(model, mode="reduce-overhead")`` could (docs/design.md, "The emulated
interconnect").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator

import torch

from fxoverlap.ir.errors import FxOverlapError


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


# ---------------------------------------------------------------- the process-wide setting


@dataclasses.dataclass
class Stats:
    """What :func:`hold` was asked for since the last :meth:`reset`: per op, calls, bytes, seconds."""

    calls: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    by_op: dict[str, list] = dataclasses.field(default_factory=dict)  # op -> [calls, bytes, seconds]

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.calls += 1
        self.nbytes += nbytes
        self.seconds += seconds
        row = self.by_op.setdefault(op, [0, 0, 0.0])
        row[0] += 1
        row[1] += nbytes
        row[2] += seconds

    def reset(self) -> None:
        self.calls, self.nbytes, self.seconds, self.by_op = 0, 0, 0.0, {}

    def as_dict(self) -> dict:
        return {"calls": self.calls, "bytes": self.nbytes, "ms": self.seconds * 1e3,
                "by_op": {k: {"calls": c, "bytes": b, "ms": s * 1e3} for k, (c, b, s) in sorted(self.by_op.items())}}


_lock = threading.Lock()
_link: Link | None = None
_standin: Callable[[str, int, float, torch.device], None] | None = None
stats = Stats()


def set_link(link: Link | None) -> None:
    """Emulate ``link`` in every fxoverlap comm op of this process from now on (None: off)."""
    global _link
    if link is not None and not isinstance(link, Link):
        raise LinkError(f"set_link takes an emulated_link.Link or None, got {type(link).__name__}")
    _link = link


def get_link() -> Link | None:
    return _link


@contextlib.contextmanager
def using(link: Link | None) -> Iterator[Link | None]:
    """``set_link(link)`` for the ``with`` block, then the previous setting again."""
    before = _link
    set_link(link)
    try:
        yield link
    finally:
        set_link(before)


@contextlib.contextmanager
def standin(fn: Callable[[str, int, float, torch.device], None] | None) -> Iterator[None]:
    """Replace the hold itself (kernel or sleep) by ``fn(op, nbytes, seconds, device)``."""
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


# ---------------------------------------------------------------- the hold


def hold(op: str, nbytes: int, device: torch.device) -> None:
    """Hold the current stream of ``device`` as the set link would for an all-to-all of
    ``nbytes``; nothing without a link. Called by the comm ops' implementations only."""
    link = _link
    if link is None:
        return
    seconds = link.seconds(int(nbytes))
    if seconds > MAX_HOLD_S:
        raise LinkError(f"emulated link: {op} would hold its stream {seconds:.1f} s for {nbytes} bytes on "
                        f"{link}; check the units (GB/s, us)")
    with _lock:
        stats.add(op, int(nbytes), seconds)
    if _standin is not None:
        _standin(op, int(nbytes), seconds, device)
    elif device.type == "cuda":
        spin(seconds, device)
    else:
        time.sleep(seconds)


def exchange_takes_sms(ep_size: int | None) -> bool:
    """Whether an exchange over ``ep_size`` ranks runs a comm kernel beside the compute here: a
    real one (more than one rank, or a group not known), or the emulated link's hold."""
    return ep_size is None or ep_size > 1 or _link is not None


def row_bytes(x: torch.Tensor) -> int:
    """Bytes of one row (dim 0) of ``x``."""
    return (x.numel() // max(x.shape[0], 1) if x.dim() else 1) * x.element_size()


def hold_rows(op: str, rows: float, x: torch.Tensor, extra_row_bytes: int = 0) -> None:
    """:func:`hold` for ``rows`` rows shaped like ``x``'s (plus ``extra_row_bytes`` each)."""
    if _link is None:
        return
    hold(op, int(round(rows * (row_bytes(x) + extra_row_bytes))), x.device)


def token_rows(tokens: int, top_k: int) -> float:
    """Rows a token-once all-to-all of ``tokens`` tokens moves on an EP-N rank: each
    token once per destination rank (:meth:`Link.token_ranks`)."""
    link = _link
    return 0.0 if link is None else tokens * link.token_ranks(top_k)


# ---------------------------------------------------------------- the CUDA kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: hold() sleeps or calls the stand-in
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
