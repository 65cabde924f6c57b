"""CUDA graphs for stage calls: the runtime side of ``passes/cudagraph.py``.

The pass marks the stages to graph (``stage.graphed``); on a CUDA device (with
``OverlapConfig(cuda_graphs=None)``, the default, or ``True``), :class:`ProgramRunner` hands
each such call to a :class:`StageGraphs` (one per program, kept by the engine across
steps), which captures the stage once per *copy* and afterwards only replays it.
Communication stages are never captured: they stay eager on the comm stream, so no
NCCL kernel lives in a graph (capturing one made ``destroy_process_group()`` hang on
the GPU machine, docs/design.md). ``Engine.close()`` releases every graph and pool; call
it before ``dist.destroy_process_group()``.

Copies: why two graphs per stage
--------------------------------
A graph writes its outputs to fixed (static) addresses at every replay. Two
microbatches are in flight: the saved activations of microbatch i, written by
F(i)'s graphs, are read by B(i), which runs interleaved with F(i+1). If F(i+1)
replayed the same graph it would overwrite them before B(i) used them. So each
stage has one graph per microbatch parity (``copy = microbatch % copies``), and
microbatch i+2 is the next one to overwrite microbatch i's outputs. That is safe
because of the schedule (``passes/schedule.py``): F(0); merged step i runs
F(i) ⊗ B(i-1) for i = 1..N-1 and ends by placing whatever of B(i-1) the slots did
not (``_Emitter.backward``); then B(N-1). So F(i) is issued in merged step i
(F(0) before the first one) and all of B(i), its recompute and weight-grad stages
included, in merged step i+1 (B(N-1) after the last one); the first call of
microbatch i+2, in merged step i+2, comes after B(i) finished issuing in merged
step i+1. :func:`in_flight_depth` checks exactly this on the program (the
smallest k such that every call of microbatch m precedes every call of m+k) rather
than trusting it: 2 for this schedule with N >= 2, 1 for N = 1, and a future
schedule with more microbatches in flight gets more copies.

Issue order is not GPU order. Readers on the graph's own stream are ordered by the
stream. A reader on another stream (an eager all-to-all on the comm stream reading
the experts stage's static output) records an event after its call
(:meth:`StageGraphs.note_reads`), and every replay of a graph of that copy first
makes its stream wait on those events. In the current schedule these waits are
already implied by data dependencies (the next graph of the copy consumes the
comm stage's output), so they cost nothing; they make the rule independent of that.

Static inputs
-------------
Parameters and buffers, and any value over their memory (a weight's transpose that the
forward saves for the backward), are read by the graph where they were at capture. At each
run's start (:meth:`StageGraphs.use_statics`) their addresses are compared with those: where
one moved (``p.data = ...``, ``model.cpu()`` and back, a checkpoint loaded with
``assign=True``) the graphs are dropped and captured anew in that run; a value that moved
between a run's start and a replay raises :class:`GraphReplayError` (never a stale read).
A value that is the output of another graph of the same copy (the attn stage's output read
by the backward attn stage of the same microbatch) is read in place: no buffer, no copy; at replay the
incoming tensor must be that memory. Everything else (outputs of eager comm stages,
the microbatch inputs, the loss tangent) is copied into a static input buffer before
each replay, on the stage's stream. The buffers are allocated inside the capture
(an allocation launches no kernel), so they come from the copy's pool like the
graph's outputs.

Memory pools
------------
Each copy gets its own pool, so graphs of different parities never share memory:
microbatch i's saved activations (copy i%2) are live while copy (i+1)%2's graphs
replay. Within a copy one pool serves all graphs, and it follows the program's
liveness: a graph keeps only *aliases* of its outputs and input buffers (tensors over
their memory that own nothing, as Inductor's CUDA-graph trees hand out outputs). The
capturing call returns the tensors the capture made; the program frees them at their
last use (``passes/free.py``), which returns their blocks to the pool, and the copy's
later captures reuse those blocks for their own outputs, buffers and temporaries. So
the pool holds what one microbatch of the copy has live at once, not every output
of every graph.

Why this is safe: a later graph k of the copy may write where a value u died before
k's capture. At every replay u is dead there too, when (a) every microbatch of the
copy does the same with graph memory in the same order as the one that captured the
graphs (the same graphed calls, the same reads of graphed outputs, so each value dies
at the same point relative to them), (b) the copy's next microbatch starts only after
the previous one's last call (:func:`in_flight_depth`), and (c) all graphs replay on
one stream, with eager readers on another stream fenced by the events above. The
pool plan checks (a) and (c) on the program per copy; where they fail (e.g. delayed
weight-grad stages placed differently in the last microbatch's backward) that copy
falls back to one private pool per graph, and the reason is logged. Before each
capture the runtime waits for the device, so blocks whose cross-stream readers were
pending are free for the capture to reuse.

Costs: programs for different microbatch counts get separate graphs. The copy into
a static input buffer is a device copy per replay, which at large shapes costs more
than the launches a graph saves: ``passes/cudagraph.py`` turns graphs off by default
there. Capture happens in the first step: per graph, a few warm-up runs on a side
stream (as PyTorch's CUDA-graph docs recommend: lazy initialisation such as cuBLAS
handles or the grouped-GEMM probe must not happen during capture), then the capture,
then one replay (the warm-ups run with the random generators' states put back
afterwards, so a stage that draws random numbers draws them once, at the replay,
as eager does). A capture that fails (e.g. a host sync hidden inside a custom op)
leaves that stage eager, with a logged reason.

Outputs and gradients that leave the program
--------------------------------------------
Losses and other outputs are cloned off graph memory before they reach the caller. Where
``optimize`` adds a gradient into an existing ``p.grad`` (no tensor hook sees it), the add
reads graph memory directly, in stream order before any replay (``runtime.accumulate_into``);
elsewhere it clones. Gradients handed to a caller (the backend hands them to autograd, whose
``AccumulateGrad`` adds them into ``p.grad`` or copies them) are *lent*
(:meth:`StageGraphs.lend`): the caller gets a tensor over the graph memory with a storage
of its own, and the loan keeps the memory allocated. Before the runner runs anything again
(:meth:`StageGraphs.reclaim`, at the start of each run or backward segment), each loan
nobody else holds ends; one that something still holds (a tensor hook, the result of
``torch.autograd.grad``, a list) is moved onto a copy first (``Tensor.set_``), so the
holder keeps its values and the next replay may write the memory. A *view* of a loan
cannot be moved that way: the runtime then raises :class:`GraphReplayError` naming the
gradient before anything overwrites it. So the copy is made only where a gradient is kept
past its use, which ``AccumulateGrad`` never does (it reads the gradient once, in stream
order; with ``p.grad`` unset it copies it, as the loan is held by us: it is never stolen).

Capture runs on a side capture stream (``torch.cuda.graph``'s own), not on the
stage's stream: the compute stream is normally the legacy default stream, which
cannot be captured. Where a graph was captured does not matter for its replay,
which the runtime issues on the stage's stream. All graphs replay on that one
stream (only compute stages are graphed); a graph that would replay on a second
stream is left eager instead.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Sequence

import torch
import torch.fx
from torch.utils.weak import WeakIdKeyDictionary

from fxoverlap.ir.meta import STEP_KEY
from fxoverlap.ir.program import stage_calls, steps
from fxoverlap.runtime import static_storage_keys, storage_key
from fxoverlap.ir.stage import Stage
from fxoverlap.ir.errors import FxOverlapError, InternalError
from fxoverlap.kernels.copy_labels import GRAPH_GRADIENT, STATIC_INPUT, copy_label


class GraphReplayError(FxOverlapError, RuntimeError):
    """A CUDA graph cannot replay: a value it reads changed shape, dtype or memory since capture;
    the message names the value and the fix."""

log = logging.getLogger("fxoverlap")

WARMUP_ITERS = 3

_CONST, _STATIC, _SHARED, _COPY = "const", "static", "shared", "copy"


class _Loan:
    """Graph memory lent to a caller: ``tensor`` (what the caller got: its own storage over
    the memory), ``keep`` (the stored value, which keeps the memory allocated in the run
    that captures the graph), ``name`` (what it is, for the error)."""

    __slots__ = ("tensor", "keep", "name")

    def __init__(self, tensor: torch.Tensor, keep: torch.Tensor | None, name: str):
        self.tensor, self.keep, self.name = tensor, keep, name


def _holders(loan: _Loan) -> tuple[int, int, int]:
    """Who holds a loan's tensor: Python references to it, C++ references to its TensorImpl,
    references to its storage (views). Compared with :data:`_UNHELD`, measured the same way."""
    t = loan.tensor
    return sys.getrefcount(t), t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# a loan nobody but the loan holds, measured as reclaim measures one (the interpreter's
# reference counting decides the first figure: calibrated, not assumed)
_UNHELD = _holders(_Loan(torch.empty(1), None, ""))


def in_flight_depth(program: torch.fx.GraphModule) -> int:
    """Smallest k such that every stage call of microbatch m precedes every call of m + k."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, (_, step) in enumerate(stage_calls(program)):
        mb = step.microbatch
        first.setdefault(mb, i)
        last[mb] = i
    depth = 1
    for a in first:
        for b in first:
            if b > a and first[b] < last[a]:
                depth = max(depth, b - a + 1)
    return depth


class CudaBackend:
    """The few CUDA calls :class:`StageGraphs` makes, in one place (tests substitute a
    CPU stand-in to check the copy and static-buffer logic without a GPU)."""

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def new_stream(self, device):
        return torch.cuda.Stream(device)

    def stream(self, s):
        return torch.cuda.stream(s)

    def new_event(self):
        return torch.cuda.Event()

    def synchronize(self, device) -> None:
        torch.cuda.synchronize(device)

    def settle(self, device) -> None:
        """Wait for the device; then an allocation outside any capture makes the caching
        allocator release the blocks whose cross-stream uses are now done (it does that
        only when no capture is under way), so the next capture may reuse them."""
        torch.cuda.synchronize(device)
        torch.empty(1, device=device)

    def pool_handle(self):
        return torch.cuda.graph_pool_handle()

    def capture(self, alloc, fn, pool):
        """Capture ``fn(alloc())`` into a new graph; returns ``(graph, alloc's buffers, fn's outputs)``.

        ``alloc`` runs inside the capture but launches no kernel: its buffers (the
        graph's static inputs) come from the graph's pool, like its outputs."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog thread may query events of collectives
        # issued before this capture; that must not invalidate it.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            bufs = alloc()
            outs = fn(bufs)
        return graph, bufs, outs

    def alias(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor over ``t``'s memory that does not keep that memory allocated (as
        Inductor's CUDA-graph trees hand out their outputs)."""
        s = t.untyped_storage()
        storage = torch._C._construct_storage_from_data_pointer(s.data_ptr(), t.device, s.nbytes())
        meta = {"size": t.shape, "stride": t.stride(), "storage_offset": t.storage_offset(), "dtype": t.dtype,
                "device": t.device, "data_ptr": s.data_ptr(), "nbytes": s.nbytes()}
        return torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(meta, storage)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def _address(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride()


def _same_memory(a, s) -> bool:
    return (isinstance(a, torch.Tensor) and a.data_ptr() == s.data_ptr() and a.shape == s.shape
            and a.stride() == s.stride() and a.dtype == s.dtype)


class _Graph:
    """One stage captured for one copy."""

    def __init__(self, stage: Stage, copy: int, graph, static_args: list, kinds: list[str], outs: tuple, stream):
        self.stage, self.copy, self.graph = stage, copy, graph
        self.static_args, self.kinds, self.outs, self.stream = static_args, kinds, outs, stream
        # where the graph reads each parameter, buffer or view of one
        self.addresses = {i: _address(a) for i, (kind, a) in enumerate(zip(kinds, static_args)) if kind == _STATIC}

    def load(self, args: Sequence) -> None:
        """Bring the incoming values into the graph's static inputs (on the current stream)."""
        for i, (kind, s, a) in enumerate(zip(self.kinds, self.static_args, args)):
            if kind == _COPY:
                if a is s:
                    continue
                if a.shape != s.shape or a.dtype != s.dtype:
                    raise GraphReplayError(self._bad(i, a, s, "has a different shape or dtype than at capture"))
                if a.data_ptr() == s.data_ptr() and a.stride() == s.stride():
                    continue  # the static buffer itself, as another view
                with copy_label(STATIC_INPUT, self.stage.name, self.stage.inputs[i]):
                    s.copy_(a)
            elif kind == _SHARED:
                if a is not s and not _same_memory(a, s):
                    raise InternalError(self._bad(
                        i, a, s, "was the static output of another graph at capture but is not that memory now"))
            elif kind == _STATIC:
                # against the address the graph was captured with (``s`` may be the very tensor,
                # whose storage ``p.data = ...`` replaced since)
                if _address(a) != self.addresses[i]:
                    raise GraphReplayError(self._bad(
                        i, a, s, "(a parameter or buffer, or a view of one) moved or changed shape since capture; "
                                 "drop the captured graphs so they are captured anew: engine.close() (optimize) or "
                                 "fxoverlap.backend.reset() (the torch.compile backend)"))
            elif a != s:
                raise GraphReplayError(self._bad(i, a, s, "is a non-tensor value that changed since capture"))

    def _bad(self, i: int, a, s, what: str) -> str:
        desc = lambda t: f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)  # noqa: E731
        return (f"cudagraph: input {self.stage.inputs[i]} of stage {self.stage.name} (copy {self.copy}) {what}: "
                f"now {desc(a)}, at capture {desc(s)}")


class StageGraphs:
    """The CUDA graphs of one program's graphed stage calls, one per (stage, copy)."""

    def __init__(self, program: torch.fx.GraphModule, stages: Sequence[Stage], static_names,
                 device: torch.device, backend: CudaBackend | None = None):
        self.device = device
        self.cuda = backend or CudaBackend()
        self.static_names = frozenset(static_names)
        # the current run's parameters and buffers by placeholder (:meth:`use_statics`): a capture
        # reads them, and any view of them (``w.t()`` saved for the backward), in place
        self.statics: dict = {}
        self._captured_at: dict[str, int] | None = None  # their addresses when the graphs were captured
        self.recaptures = 0  # times the parameters moved and the graphs were captured anew
        self.copies = in_flight_depth(program)
        self._graphs: dict[tuple[str, int], _Graph] = {}
        self.eager: dict[str, str] = {}  # stage name -> why it runs eagerly after all (capture-time)
        # a graph's output (the tensor its capture made, while it lives, and the alias
        # every replay hands out) -> (its copy, the alias)
        self._outs = WeakIdKeyDictionary()
        self._owned: dict[tuple, tuple[int, object]] = {}  # storage -> (copy, stream of its graph)
        self._pending: dict[int, list] = {}  # copy -> events of cross-stream readers not yet waited on
        self._pools: dict[int, object] = {}
        self._side = None  # side stream for warm-up runs
        self._warmed: set[str] = set()
        self._graph_streams: list = []  # the streams graphs were captured from (replay there)
        self._loans: list[_Loan] = []
        self.loans_copied = 0  # loans something still held at their reclaim (each cost a copy)
        self.shared_pool = self._plan_pools(program, stages)

    # ---------------------------------------------------------------- planning
    def _plan_pools(self, program: torch.fx.GraphModule, stages: Sequence[Stage]) -> dict[int, bool]:
        """Per copy: may its graphs share one pool? Yes when every microbatch of the copy
        does, in the same order, what the one that captures them did with graph memory:
        the same graphed calls and the same reads of graphed stages' outputs (the last
        read is where a value dies, so its memory is reused from the same point on), and
        all graphed calls are on one stream."""
        graphed = {s.name for s in stages if s.graphed}
        graph_values = {v for s in stages if s.graphed for v in s.outputs}
        seqs: dict[int, list[tuple]] = {}
        streams = set()
        for node, step in steps(program):
            if step.stage in graphed:
                streams.add(step.stream)
                seqs.setdefault(step.microbatch, []).append(("call", step.stage))
            elif reads := tuple(v for v in step.reads if v in graph_values):
                what = step.stage or getattr(node.target, "__name__", str(node.target))
                seqs.setdefault(step.microbatch, []).append((what, reads))
        one_stream = len(streams) <= 1
        shared = {}
        for c in range(self.copies):
            mbs = sorted(mb for mb in seqs if mb % self.copies == c)
            same = all(seqs[mb] == seqs[mbs[0]] for mb in mbs)
            shared[c] = one_stream and same
            if mbs and not shared[c]:
                why = "graphed stages run on more than one stream" if not one_stream else (
                    f"microbatch {next(mb for mb in mbs if seqs[mb] != seqs[mbs[0]])} uses graph memory "
                    f"in another order than microbatch {mbs[0]}, which captures the graphs")
                log.info("fxoverlap cudagraph: copy %d uses one memory pool per graph: %s", c, why)
        return shared

    def _pool(self, copy: int):
        if not self.shared_pool.get(copy):
            return None  # a private pool of its own
        if copy not in self._pools:
            self._pools[copy] = self.cuda.pool_handle()
        return self._pools[copy]

    # ---------------------------------------------------------------- running
    def call(self, node: torch.fx.Node, stage: Stage, args: Sequence) -> tuple[tuple, bool]:
        """Run one stage call; returns ``(outputs, graphed)``. Outputs of a graph are its
        static outputs (not copies): valid until the same graph replays for microbatch
        + copies. Runs on the current stream, which the runtime set to the stage's."""
        copy = node.meta[STEP_KEY].microbatch % self.copies
        g = self._graphs.get((stage.name, copy))
        if g is None:
            captured = self._capture(stage, copy, args) if stage.name not in self.eager else None
            if captured is None:
                return stage(*args), False
            return captured[1], True  # the capture replayed it once already
        self._wait_readers(copy)
        g.load(args)
        g.graph.replay()
        return g.outs, True

    def note_reads(self, args: Sequence) -> None:
        """After a stage call was issued on the current stream: if it read graph memory
        that a graph on another stream owns, that graph's copy must not replay until
        this stream is past the read."""
        if not self._owned:
            return
        cur = self.cuda.current_stream(self.device)
        if self._graph_streams[0] == cur:
            return  # the usual case: every graph and this call on the compute stream
        ev = None
        for a in args:
            if not isinstance(a, torch.Tensor) or a.device != self.device:
                continue
            hit = self._owned.get(storage_key(a))
            if hit is None or hit[1] == cur:
                continue
            if ev is None:
                ev = self.cuda.new_event()
                ev.record(cur)
            pending = self._pending.setdefault(hit[0], [])
            if not pending or pending[-1] is not ev:
                pending.append(ev)

    def use_statics(self, static: dict) -> None:
        """The run's parameters and buffers, by placeholder; the runner calls this at each run's
        start, when no graph memory of this program is in use but lent gradients (which
        :meth:`close` moves). Where one has another address than when the graphs were captured
        (``p.data = ...``, ``model.cpu()`` and back, a checkpoint loaded with ``assign=True``), the
        graphs would read the old memory: they are dropped, and this run captures them anew."""
        self.statics = static
        now = {k: v.data_ptr() for k, v in static.items() if isinstance(v, torch.Tensor)}
        if not self._graphs or self._captured_at is None:
            self._captured_at = now
            return
        if now == self._captured_at:
            return
        moved = sorted(k for k in now if now[k] != self._captured_at.get(k))
        log.info("fxoverlap cudagraph: %s moved since the graphs were captured; capturing them anew",
                 ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else ""))
        self.reclaim()  # as the run would: a held view of a lent gradient raises before its memory goes
        self.close()
        self.recaptures += 1
        self._captured_at = now

    def lend(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """``t`` (graph memory: a gradient the runner hands to its caller) without a copy: a
        tensor over its memory with a storage of its own, valid until :meth:`reclaim`."""
        loan = _Loan(self.cuda.alias(t), t, name)
        self._loans.append(loan)
        return loan.tensor

    def reclaim(self) -> None:
        """End the loans; the runner calls this before it runs graphs again. A loan that
        something still holds is moved onto a copy of its memory, on the current stream,
        before any replay can write the memory; a view of one cannot be moved: raises
        :class:`GraphReplayError`."""
        if not self._loans:
            return
        loans, self._loans = self._loans, []
        viewed = []
        for loan in loans:
            held = _holders(loan)
            if held == _UNHELD:
                continue
            self.loans_copied += 1
            if held[2] > _UNHELD[2]:
                viewed.append(loan.name)
            t = loan.tensor
            with torch.no_grad(), copy_label(GRAPH_GRADIENT, loan.name):
                t.set_(t.clone())  # (a view keeps the old storage: only the tensor itself moves)
            log.debug("fxoverlap cudagraph: %s was held past its use; moved off graph memory", loan.name)
        if viewed:
            raise GraphReplayError(
                f"cudagraph: a view of {', '.join(viewed[:3])}{f' and {len(viewed) - 3} more' if len(viewed) > 3 else ''} "
                f"(graph memory lent to the caller as a gradient) is still "
                f"held as its CUDA graphs are about to run again, which would overwrite it; clone it where it is kept "
                f"(e.g. `g.clone()` in a tensor hook) or run with cuda_graphs=False")

    def _wait_readers(self, copy: int) -> None:
        events = self._pending.pop(copy, None)
        if events:
            cur = self.cuda.current_stream(self.device)
            for ev in events:
                cur.wait_event(ev)

    def _capture(self, stage: Stage, copy: int, args: Sequence) -> tuple[_Graph, tuple] | None:
        for name, a in zip(stage.inputs, args):
            if isinstance(a, torch.Tensor) and a.device != self.device:
                return self._fallback(stage, f"input {name} is on {a.device}, not {self.device}")
        cur = self.cuda.current_stream(self.device)
        if self._graph_streams and not self._graph_streams[0] == cur:
            # The reader-event bookkeeping (note_reads / _wait_readers) assumes one
            # replay stream; graphed stages are compute stages, all on one stream.
            return self._fallback(stage, "graphs replaying on more than one stream are not supported")
        self._wait_readers(copy)
        # Captures happen in the first step only: settling there costs one wait each.
        self.cuda.settle(self.device)
        static_args, kinds, static_storage, copied = [], [], set(), []
        static_keys = static_storage_keys(self.statics)
        for i, (name, a) in enumerate(zip(stage.inputs, args)):
            if not isinstance(a, torch.Tensor):
                kind = _CONST
            elif name in self.static_names or storage_key(a) in static_keys:
                kind = _STATIC
                static_storage.add(storage_key(a))
            elif (hit := self._outs.get(a)) is not None and hit[0] == copy:
                kind = _SHARED  # read in place
            else:
                kind = _COPY
                copied.append(i)
            kinds.append(kind)
            static_args.append(a)

        def alloc() -> list[torch.Tensor]:
            return [torch.empty_like(args[i]) for i in copied]  # same strides where dense

        def run(bufs: list[torch.Tensor]) -> tuple:
            # The capture reads the tensors as they are (an output that views one keeps
            # it alive as long as in eager); the graph keeps aliases (below).
            full = list(static_args)
            for i, b in zip(copied, bufs):
                full[i] = b
            return tuple(stage(*full))

        try:
            if self._side is None:
                self._side = self.cuda.new_stream(self.device)
            self._side.wait_stream(cur)
            # Warm-ups must not draw: the capture's replay below draws this call's random
            # numbers where eager would, once (a capture itself draws nothing).
            with self.cuda.stream(self._side), torch.random.fork_rng(
                    devices=[self.device] if self.device.type == "cuda" else []):
                # The stage's other copy was warmed up already: lazy initialisation is done.
                for _ in range(0 if stage.name in self._warmed else WARMUP_ITERS):
                    stage(*args)
            cur.wait_stream(self._side)
            self._warmed.add(stage.name)
            graph, bufs, outs = self.cuda.capture(alloc, run, self._pool(copy))
        except Exception as e:  # noqa: BLE001 - any capture failure leaves the stage eager
            self.cuda.synchronize(self.device)
            return self._fallback(stage, f"capture failed: {type(e).__name__}: {e}")
        for i, b in zip(copied, bufs):
            with copy_label(STATIC_INPUT, stage.name, stage.inputs[i]):
                b.copy_(args[i])
            static_args[i] = self.cuda.alias(b)
        for i, kind in enumerate(kinds):
            if kind == _SHARED:
                static_args[i] = self._outs[static_args[i]][1]
            elif kind == _STATIC:  # the memory the graph reads, not the tensor (whose storage may be replaced)
                static_args[i] = self.cuda.alias(static_args[i])
        graph.replay()  # on the stage's stream: this call's outputs
        # The graph keeps only aliases; this call returns the tensors the capture made,
        # so their memory (and the input buffers', dropped here) goes back to the copy's
        # pool where the program drops them, for the copy's later captures to reuse.
        aliases = tuple(self.cuda.alias(o) if isinstance(o, torch.Tensor) and storage_key(o) not in static_storage
                        else o for o in outs)
        g = _Graph(stage, copy, graph, static_args, kinds, aliases, cur)
        self._graphs[(stage.name, copy)] = g
        if not self._graph_streams:
            self._graph_streams.append(cur)
        for o, al in zip(outs, aliases):
            if isinstance(o, torch.Tensor) and al is not o:
                self._outs[o] = self._outs[al] = (copy, al)
                self._owned.setdefault(storage_key(o), (copy, cur))
        return g, outs

    def _fallback(self, stage: Stage, reason: str) -> None:
        self.eager[stage.name] = reason
        log.warning("fxoverlap cudagraph: stage %s runs eagerly: %s", stage.name, reason)
        return None

    # ---------------------------------------------------------------- teardown
    def summary(self) -> dict:
        return {
            "graphs": len(self._graphs),
            "loans_copied": self.loans_copied,
            "recaptures": self.recaptures,
            "stages_graphed": len({k[0] for k in self._graphs}),
            "copies": self.copies,
            "shared_pool": {str(c): v for c, v in self.shared_pool.items()},
            "eager_fallbacks": dict(self.eager),
        }

    def close(self) -> None:
        """Wait for the device, then drop every graph, static buffer and pool (a gradient
        still lent is moved off their memory first)."""
        try:
            self.reclaim()
        except GraphReplayError as e:  # the memory goes back to the allocator: say so, as reclaim would
            warnings.warn(str(e), stacklevel=2)
        if self._graphs:
            self.cuda.synchronize(self.device)
        graphs = list(self._graphs.values())
        self._graphs.clear()
        self._outs = WeakIdKeyDictionary()
        self._owned.clear()
        self._pending.clear()
        self._pools.clear()
        self._graph_streams.clear()
        self._warmed.clear()
        for g in graphs:
            g.graph.reset()
            g.static_args = g.outs = None
        self._side = None


class GraphCache:
    """The engine's :class:`StageGraphs`, one per program; see ``Engine.close()``."""

    def __init__(self, enabled: bool | None):
        self.enabled = enabled is not False  # None: wherever the cudagraph pass graphed stages
        self.asked = enabled is True  # only an explicit True warns where graphs cannot run
        self._by_program: dict[int, StageGraphs] = {}
        self._warned = False

    def get(self, program: torch.fx.GraphModule, stages: Sequence[Stage], capture,
            device: torch.device) -> StageGraphs | None:
        """The graphs for ``program``, or None where CUDA graphs are off or cannot run."""
        if not self.enabled or not any(s.graphed for s in stages):
            return None
        if device.type != "cuda":
            if self.asked and not self._warned:
                self._warned = True
                msg = (f"fxoverlap: OverlapConfig(cuda_graphs=True) has no effect on {device.type}: "
                       f"CUDA graphs need a CUDA device; every stage runs eagerly")
                log.warning(msg)
                warnings.warn(msg, stacklevel=3)
            return None
        sg = self._by_program.get(id(program))
        if sg is None:
            sg = self._by_program[id(program)] = StageGraphs(program, stages, capture.static_placeholders, device)
        return sg

    def summaries(self) -> list[dict]:
        return [sg.summary() for sg in self._by_program.values()]

    def release(self, program: torch.fx.GraphModule) -> None:
        """Close ``program``'s graphs (the engine's cache evicted it); a no-op where it has none."""
        sg = self._by_program.pop(id(program), None)
        if sg is not None:
            sg.close()

    def close(self) -> None:
        graphs = list(self._by_program.values())
        self._by_program.clear()
        for sg in graphs:
            sg.close()
        if graphs:
            graphs[0].cuda.empty_cache()
