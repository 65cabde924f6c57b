"""CUDA graphs on CPU, on the reference model: the cudagraph pass and the runtime's logic.
(The pass on hand-built stages, capturability reasons and the copies the schedule
needs: tests/test_passes.py.)

- the pass marks exactly the capturable compute stages: in capacity routing every
  compute stage, in dropless routing all but the experts stages (skipped with a
  reason naming the node); comm stages are never marked; each skipped stage's
  reason is logged once; graph outputs are freed at their last use like any value
  (that is what lets a copy's pool follow the program's liveness);
- on CPU, ``cuda_graphs=True`` is a no-op for the runtime with a one-time warning,
  numerics unchanged (bitwise);
- the runtime's capture/replay logic (``fxoverlap.cudagraphs.StageGraphs``) run on
  a CPU stand-in for the CUDA API whose "graphs" rewrite their static outputs in
  place at every replay, as a real graph does: the program's results stay bitwise
  equal with 1-5 microbatches (two copies per stage, static inputs shared between
  graphs, no gradient or loss aliasing graph memory), and a single copy per stage
  visibly corrupts them (the test has teeth); cross-stream reads of graph memory
  make the next replay of that copy wait; the graphs keep no reference to the tensors
  their capture made (outputs, input buffers), so those die where the program frees
  them, and a copy shares one pool only where its microbatches use graph memory in the
  same order.

What needs a GPU (real capture, memory pools, streams, NCCL teardown) is in
``python -m fxoverlap.bench cudagraph``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import logging
import types
import weakref

import pytest
import torch
import torch.fx

import fxoverlap
import fxoverlap.cudagraphs as cg
from fxoverlap.ir import program as program_ops
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.runtime import ProgramRunner
from fxoverlap.ir.stage import StageKind, StreamKind
from fxoverlap.testing import eager_steps, token_batches

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()


def _model(routing: str, **kw):
    torch.manual_seed(0)
    return MoETransformer(MoEConfig.tiny(routing=routing, **kw))


def _batches(n: int, vocab: int, distinct: bool = True, seed: int = 0):
    return token_batches(vocab, n, seed=seed) if distinct else token_batches(vocab, 1, seed=seed) * n


def _grads(model):
    out = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _steps_bitwise(engine, model, mbs, ref_losses, ref_grads, steps: int = 2) -> None:
    """``steps`` forward_backward calls, each equal to the reference bitwise."""
    for step in range(steps):
        losses = engine.forward_backward(mbs)
        grads = _grads(model)
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), step
        assert grads.keys() == ref_grads.keys()
        bad = [k for k in grads if not torch.equal(grads[k], ref_grads[k])]
        assert not bad, (step, bad)


def _graphed(engine) -> set[str]:
    return {s.name for s in engine.stages if s.graphed}


def _run(model, config, mbs):
    engine = fxoverlap.optimize(model, None, config)
    losses = engine.forward_backward(mbs)
    return engine, losses, _grads(model)


# One reference engine (no graphs) per model: the tests only read its program and its results,
# and a capture costs seconds, so they share it (its model keeps _model's seed-0 weights: no
# optimizer step runs on it, and _grads clears its gradients after each call).
_REFERENCES: dict[tuple, fxoverlap.Engine] = {}


def _reference(routing: str, mbs, **kw):
    """``_run(_model(routing, **kw), OverlapConfig(), mbs)`` on a shared engine."""
    key = (routing, tuple(sorted(kw.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = fxoverlap.optimize(_model(routing, **kw), None, fxoverlap.OverlapConfig())
    engine = _REFERENCES[key]
    losses = engine.forward_backward(mbs)
    return engine, losses, _grads(engine.model)


# ---------------------------------------------------------------- the pass


def test_capacity_every_compute_stage_graphed():
    model = _model("capacity")
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else 256
    with pytest.warns(UserWarning, match="cuda_graphs"):
        engine, _, _ = _run(model, fxoverlap.OverlapConfig(cuda_graphs=True), _batches(2, vocab, distinct=False))
    by_name = {s.name: s for s in engine.stages}
    comp = {s.name for s in engine.stages if s.stream is StreamKind.COMP}
    comm = {s.name for s in engine.stages if s.stream is StreamKind.COMM}
    assert comp and comm
    assert all(by_name[n].capturable for n in comp), engine.stage_table()
    assert _graphed(engine) == comp
    for name in comm:
        reason = by_name[name].not_capturable_reason
        assert "communication stage" in reason and name in reason
    assert {s.name for s in engine.stages if s.runs_as == "graphed"} == comp


def test_dropless_experts_skipped_with_reason(caplog):
    model = _model("dropless")
    with caplog.at_level(logging.INFO, logger="fxoverlap"), pytest.warns(UserWarning, match="cuda_graphs"):
        engine, _, _ = _run(model, fxoverlap.OverlapConfig(cuda_graphs=True), _batches(3, 256))
    comp = [s for s in engine.stages if s.stream is StreamKind.COMP]
    experts = {s.name for s in comp if s.kind is StageKind.EXPERTS}
    assert len(experts) == 2 * model.cfg.n_layers  # fwd and bwd of every MoE layer
    marked = _graphed(engine)
    assert marked == {s.name for s in comp} - experts
    for s in engine.stages:
        if s.name in experts:
            reason = s.not_capturable_reason
            assert reason.startswith(f"stage {s.name}: data-dependent shape at node ")
            node = reason.split("at node ")[1].split(" ")[0]
            assert node in {n.name for n in s.graph_module.graph.nodes}, reason
    # Each skipped stage's reason is logged once, though it is called for 3 microbatches.
    logged = [r.getMessage() for r in caplog.records if "not captured" in r.getMessage()]
    skipped = {s.name for s in engine.stages} - marked
    for name in skipped:
        assert sum(f"stage {name}:" in m for m in logged) == 1, (name, logged)
    assert all(r.levelno == logging.WARNING for r in caplog.records
               if "not captured" in r.getMessage() and "data-dependent" in r.getMessage())


def test_free_frees_graph_outputs_as_without_graphs():
    model = _model("capacity")
    with pytest.warns(UserWarning):
        engine, _, _ = _run(model, fxoverlap.OverlapConfig(cuda_graphs=True), _batches(3, 256))
    plain, _, _ = _reference("capacity", _batches(3, 256))

    def frees(e):
        return [(n.args, n.prev.name) for n in e.program.graph.nodes
                if n.op == "call_function" and n.target is program_ops.free]

    owned = set().union(*(s.outputs for s in engine.stages if s.graphed))
    assert owned and owned <= {v for args, _ in frees(engine) for v in args[1:]}
    assert frees(engine) == frees(plain)  # same frees, at the same places


# ---------------------------------------------------------------- CPU: a no-op


def test_cpu_noop_one_warning_bitwise():
    mbs = _batches(3, 256)
    _, ref_losses, ref_grads = _reference("capacity", mbs)
    model = _model("capacity")
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True))
    with pytest.warns(UserWarning, match="no effect on cpu"):
        losses = engine.forward_backward(mbs)
    grads = _grads(model)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is one-time
        losses2 = engine.forward_backward(mbs)
        out = engine(*mbs[0])
    grads2 = _grads(model)
    for ls in (losses, losses2):
        assert all(torch.equal(a, b) for a, b in zip(ls, ref_losses))
    for gs in (grads, grads2):
        assert gs.keys() == ref_grads.keys()
        assert all(torch.equal(gs[k], ref_grads[k]) for k in gs)
    assert torch.equal(out, ref_losses[0])
    engine.close()  # no graphs on CPU: a no-op
    engine.close()


# ---------------------------------------------------------------- runtime logic on a CPU stand-in


class _Stream:
    def __init__(self, backend, name):
        self.backend, self.name = backend, name

    def wait_stream(self, other):
        pass

    def wait_event(self, ev):
        self.backend.log.append(("wait", ev.id, self.name))

    def __repr__(self):
        return f"<stream {self.name}>"


class _Event:
    def __init__(self, backend):
        self.backend = backend
        self.id = len(backend.events)
        backend.events.append(self)

    def record(self, stream):
        self.backend.log.append(("record", self.id, stream.name))


class _Graph:
    """Replays by recomputing and writing into the static outputs in place."""

    def __init__(self, backend, fn, outs, pool):
        self.backend, self.fn, self.outs, self.pool = backend, fn, outs, pool

    def replay(self):
        self.backend.log.append(("replay", id(self)))
        new = self.fn()
        for s, n in zip(self.outs, new):
            if not isinstance(s, torch.Tensor):
                continue
            # Write the whole underlying storage, as the graph's kernels would (an output
            # may be an expanded view, which copy_ cannot write). Views of parameters or
            # of static inputs share the storage already.
            ss, ns = s.untyped_storage(), n.untyped_storage()
            if ss.data_ptr() != ns.data_ptr():
                assert ss.nbytes() == ns.nbytes()
                ss.copy_(ns)

    def reset(self):
        self.backend.resets += 1
        self.fn = None


class FakeCuda(cg.CudaBackend):
    def __init__(self):
        self.streams = {"comp": _Stream(self, "comp"), "comm": _Stream(self, "comm")}
        self.cur = self.streams["comp"]
        self.events, self.log, self.graphs, self.resets = [], [], [], 0
        self.kept = []

    def current_stream(self, device):
        return self.cur

    def new_stream(self, device):
        return _Stream(self, "side")

    def stream(self, s):
        return contextlib.nullcontext()

    def new_event(self):
        return _Event(self)

    def synchronize(self, device):
        pass

    def pool_handle(self):
        return object()

    def settle(self, device):
        pass

    def capture(self, alloc, fn, pool):
        bufs = [b.zero_() for b in alloc()]  # a real capture runs nothing; this runs, on valid values
        with torch.random.fork_rng(devices=[]):  # ... and draws nothing
            outs = fn(bufs)
        held = [self.alias(b) for b in bufs]  # the graph reads the buffers' memory, as a real one does
        g = _Graph(self, lambda: fn(held), outs, pool)
        self.graphs.append(g)
        return g, bufs, outs

    def alias(self, t):
        # Another tensor over the same memory with a storage of its own, as on CUDA (there it
        # does not keep the memory allocated; on CPU nothing may be freed under it, so the
        # fake keeps the memory's own storage).
        s = t.untyped_storage()
        self.kept.append(s)
        own = torch._C._construct_storage_from_data_pointer(s.data_ptr(), t.device, s.nbytes())
        return torch.empty(0, dtype=t.dtype).set_(own, t.storage_offset(), t.shape, t.stride())

    def empty_cache(self):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """Engines built inside get StageGraphs on a FakeCuda on CPU; the runner's stream
    context switches the fake's current stream."""
    backend = FakeCuda()
    made: list[cg.StageGraphs] = []

    def get(self, program, stages, capture, device):
        if not self.enabled or not any(s.graphed for s in stages):
            return None
        sg = self._by_program.get(id(program))
        if sg is None:
            names = set(capture.param_placeholders) | set(capture.buffer_placeholders)
            sg = self._by_program[id(program)] = cg.StageGraphs(program, stages, names, device, backend=backend)
            made.append(sg)
        return sg

    @contextlib.contextmanager
    def stream_ctx(self, stream):
        prev, backend.cur = backend.cur, backend.streams[str(stream)]
        try:
            yield
        finally:
            backend.cur = prev

    monkeypatch.setattr(cg.GraphCache, "get", get)
    monkeypatch.setattr(ProgramRunner, "_ctx", stream_ctx)
    # as on a GPU during execute: comm launches switch streams, compute launches stay (call_plain)
    monkeypatch.setattr(ProgramRunner, "_switches", lambda self, stream: stream is not StreamKind.COMP)
    backend.made = made
    return backend


# 3 microbatches already replay each parity's graphs for a second microbatch; 5 (tried) add CI time, not cases.
# 2 (both copies, each replayed once a step) is a subset of 3's path: `slow`.
@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("routing", ["capacity", "dropless"])
def test_replay_logic_bitwise(fake_cuda, routing, n):
    mbs = _batches(n, 256, seed=n)
    model = _model(routing)
    _, ref_losses, ref_grads = _reference(routing, mbs)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True))
    for step in range(3):  # step 0 captures, later steps replay
        losses = engine.forward_backward(mbs)
        graph_storages = {o.untyped_storage().data_ptr() for g in fake_cuda.graphs for o in g.outs
                          if isinstance(o, torch.Tensor)}
        for p in model.parameters():
            if p.grad is not None:
                assert p.grad.untyped_storage().data_ptr() not in graph_storages, "p.grad aliases graph memory"
        for loss in losses:
            assert loss.untyped_storage().data_ptr() not in graph_storages, "a loss aliases graph memory"
        grads = _grads(model)
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (step, losses, ref_losses)
        assert grads.keys() == ref_grads.keys()
        bad = [k for k in grads if not torch.equal(grads[k], ref_grads[k])]
        assert not bad, (step, bad)
    (sg,) = fake_cuda.made
    graphed = _graphed(engine)
    assert sg.copies == (1 if n == 1 else 2)
    assert sg.summary()["graphs"] == len(graphed) * min(n, 2) == len(fake_cuda.graphs)
    assert sg.summary()["eager_fallbacks"] == {}
    assert all(sg.shared_pool.values())
    # Graphs of one copy share a pool; the two copies do not.
    pools = {}
    for (name, copy), g in sg._graphs.items():
        pools.setdefault(copy, set()).add(id(g.graph.pool))
    assert all(len(p) == 1 for p in pools.values())
    assert len({next(iter(p)) for p in pools.values()}) == len(pools)
    # Values passed from graph to graph of the same microbatch are read in place.
    kinds = [k for g in sg._graphs.values() for k in g.kinds]
    assert kinds.count("shared") > 0 and kinds.count("copy") > 0
    replays = sum(1 for e in fake_cuda.log if e[0] == "replay")
    assert replays == 3 * n * len(graphed)
    engine.close()
    assert fake_cuda.resets == len(fake_cuda.graphs)
    assert sg.summary()["graphs"] == 0


def test_gradients_from_graph_memory_are_cloned_only_into_an_empty_grad(fake_cuda):
    """A graphed stage's parameter gradient lives in graph memory, which the next replay
    overwrites: the first microbatch's is cloned into ``p.grad``, later microbatches add
    from graph memory in place (no clone per microbatch); a parameter with a tensor hook
    (which may keep what it sees) still gets a clone every microbatch. Bitwise eager's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n = 3
    mbs = _batches(n, 256, seed=n)
    model = _model("capacity")
    _, ref_losses, ref_grads = _reference("capacity", mbs)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True))
    engine.forward_backward(mbs)  # captures
    model.zero_grad(set_to_none=True)
    graph_storages = {o.untyped_storage().data_ptr() for g in fake_cuda.graphs for o in g.outs
                      if isinstance(o, torch.Tensor)}

    class CountClones(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.clone.default and args[0].untyped_storage().data_ptr() in graph_storages:
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    def step():
        with CountClones() as counter:
            losses = engine.forward_backward(mbs)
        grads = _grads(model)
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
        assert not [k for k in grads if not torch.equal(grads[k], ref_grads[k])]
        return counter.shapes

    clones = step()
    graph_grads = [p for p in model.parameters()
                   if any(tuple(p.shape) == sh for sh in clones)]
    assert graph_grads, "no parameter gradient came from graph memory: the test checks nothing"
    for sh, k in {sh: clones.count(sh) for sh in set(clones)}.items():
        if sh != ():  # the losses are outputs: cloned per microbatch, as before
            owners = sum(1 for p in model.parameters() if tuple(p.shape) == sh)
            assert k <= owners, (sh, k, owners)  # once per parameter, not once per microbatch
    hooked = graph_grads[0]
    seen = []
    hooked.register_hook(lambda g: seen.append(g) or None)
    clones = step()
    assert len(seen) == n
    assert all(g.untyped_storage().data_ptr() not in graph_storages for g in seen)
    assert clones.count(tuple(hooked.shape)) >= n
    engine.close()


def test_profiler_charges_each_copy_fxoverlap_makes_to_its_reason(fake_cuda):
    """Under a profiler, each copy the runtime makes around its CUDA graphs sits in a
    ``copy_labels`` range naming why (what ``bench hf-timeline --deep`` charges copies to): the
    loads into static inputs, the graph-memory gradients copied into an empty ``p.grad``, the
    graph-owned outputs (the losses), and the one-rank exchange's copies; real kineto events,
    read as the timeline reads them; the loads and outputs also name the value they copy. Without a
    profiler the label is no range at all."""
    from torch.profiler import ProfilerActivity, profile

    from fxoverlap.bench.hf_timeline import enclosing, key_of
    from fxoverlap.kernels import copy_labels

    mbs = _batches(2, 256, seed=2)
    model = _model("capacity")
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True))
    engine.forward_backward(mbs)  # captures
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.forward_backward(mbs)
    evs = prof.profiler.kineto_results.events()
    by_thread: dict = {}
    for e in evs:
        by_thread.setdefault(e.start_thread_id(), []).append((e.start_ns(), e.end_ns(), e.name()))
    copies = [e for e in evs if e.name() == "aten::copy_"]
    keys = {}
    for th, iv in by_thread.items():
        qs = [(e.start_ns() + 1, i) for i, e in enumerate(copies) if e.start_thread_id() == th]
        keys.update(enclosing(iv, qs))
    reasons = {key_of(labels).split(" | ")[0] for labels in keys.values()}
    for kind in (copy_labels.STATIC_INPUT, copy_labels.GRAPH_GRADIENT, copy_labels.GRAPH_OUTPUT,
                 copy_labels.ONE_RANK_EXCHANGE):
        assert f"aten::copy_ [{kind}]" in reasons, (kind, sorted(reasons))
    assert {r for r in reasons if "[" in r} <= {f"aten::copy_ [{k}]" for k in copy_labels.KINDS}
    # the graphs' loads name the stage input they fill, the outputs the value they hand out
    named = {p for labels in keys.values() for l in labels if (p := copy_labels.parse(l)) is not None and p[1]}
    stage_inputs = {f"{s.name}.{v}" for s in engine.stages for v in s.inputs}
    loads = {v for k, v in named if k == copy_labels.STATIC_INPUT}
    assert loads and loads <= stage_inputs, sorted(loads - stage_inputs)
    outs = {v for k, v in named if k == copy_labels.GRAPH_OUTPUT}
    assert outs and outs <= {v for s in engine.stages for v in s.outputs}
    assert isinstance(copy_labels.copy_label(copy_labels.STATIC_INPUT), contextlib.nullcontext)
    engine.close()


def test_one_copy_would_corrupt(fake_cuda, monkeypatch):
    """With a single copy per stage, F(i+1) overwrites what B(i) still needs."""
    mbs = _batches(3, 256, seed=7)
    model = _model("capacity")
    _, ref_losses, ref_grads = _reference("capacity", mbs)
    monkeypatch.setattr(cg, "in_flight_depth", lambda program: 1)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True))
    engine.forward_backward(mbs)
    grads = _grads(model)
    assert any(not torch.equal(grads[k], ref_grads[k]) for k in grads)


def test_cross_stream_readers_delay_next_replay(fake_cuda):
    """An eager comm stage that reads a graph's static output records an event after
    it; the next replay of a graph of that copy waits on it on its own stream."""
    mbs = _batches(4, 256, seed=3)
    model = _model("capacity")
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True))
    engine.forward_backward(mbs)
    engine.forward_backward(mbs)
    log = fake_cuda.log
    recorded = [(i, e[1]) for i, e in enumerate(log) if e[0] == "record"]
    assert recorded and all(log[i][2] == "comm" for i, _ in recorded)
    waited = {e[1]: i for i, e in enumerate(log) if e[0] == "wait"}
    assert all(log[i][2] == "comp" for i in waited.values())
    # Every reader event but the very last ones (no later replay of their copy) is
    # waited on, after it was recorded, before a later replay.
    assert len(waited) >= len(recorded) - 2 * 2
    for i, ev in recorded:
        if ev in waited:
            j = waited[ev]
            assert j > i and any(e[0] == "replay" for e in log[j:])


@pytest.mark.slow
def test_delay_wgrad_and_mhc_replay_bitwise(fake_cuda):
    mbs = _batches(4, 256, seed=11)
    model = _model("capacity", mhc_rate=4, mtp=True)
    cfg = dict(delay_wgrad=True, mhc_recompute_group=1)
    _, ref_losses, ref_grads = _run(model, fxoverlap.OverlapConfig(**cfg), mbs)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True, **cfg))
    _steps_bitwise(engine, model, mbs, ref_losses, ref_grads)
    (sg,) = fake_cuda.made
    assert sg.copies == 2 and not sg.eager


def test_pool_per_graph_where_replay_order_differs(fake_cuda, caplog):
    """Delayed weight-grad stages run in another order in the last microbatch's
    backward than in the merged steps (here: the dense layer's wgrads wait for the
    next combine in the drain): that copy gets one pool per graph (logged)."""
    mbs = _batches(3, 256, seed=5)
    model = _model("capacity", n_layers=3, layer_pattern=("moe", "dense", "moe"))
    _, ref_losses, ref_grads = _run(model, fxoverlap.OverlapConfig(delay_wgrad=True), mbs)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True, delay_wgrad=True))
    with caplog.at_level(logging.INFO, logger="fxoverlap"):
        _steps_bitwise(engine, model, mbs, ref_losses, ref_grads)
    (sg,) = fake_cuda.made
    assert sg.shared_pool == {0: False, 1: True}
    assert any("copy 0 uses one memory pool per graph" in r.getMessage() and "microbatch 2" in r.getMessage()
               for r in caplog.records)
    pools0 = [g.graph.pool for (name, c), g in sg._graphs.items() if c == 0]
    assert pools0 and all(p is None for p in pools0)  # None: a private pool of its own


def test_graphs_keep_no_capture_tensor_alive(fake_cuda, monkeypatch):
    """On CUDA the capture's tensors live in the copy's pool; once the program frees
    them, later captures of the copy reuse their blocks. That needs the graphs to hold
    only aliases: here every tensor a capture made is garbage after the step, while
    the replays stay bitwise."""
    made = []
    capture = FakeCuda.capture

    def tracked(self, alloc, fn, pool):
        g, bufs, outs = capture(self, alloc, fn, pool)
        made.extend(weakref.ref(t) for t in (*bufs, *outs) if isinstance(t, torch.Tensor))
        return g, bufs, outs

    monkeypatch.setattr(FakeCuda, "capture", tracked)
    monkeypatch.setattr(_Graph, "__init__", _graph_init_without_outs)
    mbs = _batches(4, 256, seed=13)
    model = _model("capacity")
    _, ref_losses, ref_grads = _reference("capacity", mbs)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True))
    _steps_bitwise(engine, model, mbs, ref_losses, ref_grads, steps=1)
    gc.collect()
    # what stays: views of parameters and buffers, which the graphs read in place
    static = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    alive = [r() for r in made if r() is not None]
    assert len(made) > 100 and all(t.untyped_storage().data_ptr() in static for t in alive)
    assert len(alive) < len(made) / 4
    del alive
    _steps_bitwise(engine, model, mbs, ref_losses, ref_grads, steps=2)
    (sg,) = fake_cuda.made
    assert all(sg.shared_pool.values())
    engine.close()


def _graph_init_without_outs(self, backend, fn, outs, pool):
    # The stand-in graph rewrites its outputs' memory at replay: it needs that memory,
    # not the capture's tensor objects (a real graph holds neither).
    self.backend, self.fn, self.pool = backend, fn, pool
    self.outs = [backend.alias(o) if isinstance(o, torch.Tensor) else o for o in outs]


def test_pool_shared_only_where_graph_memory_is_used_alike():
    """The pool check compares, per microbatch, the graphed calls and every read of a
    graphed stage's output (where those values die), not only the graphed calls."""
    stages = [_stage("g", ["x"], ["y"], graphed=True), _stage("e", ["y"], ["z"], graphed=False),
              _stage("h", ["z"], ["w"], graphed=True), _stage("r", ["y"], ["q"], graphed=False)]
    # two microbatches in flight: copies 0 (microbatches 0, 2) and 1
    same = [(0, "g"), (0, "e"), (1, "g"), (0, "r"), (0, "h"), (1, "e"), (2, "g"), (1, "r"), (1, "h"),
            (2, "e"), (2, "r"), (2, "h")]
    moved = same[:-2] + [(2, "h"), (2, "r")]  # microbatch 2 reads y after h: y lives longer
    assert cg.StageGraphs(_program(stages, same), stages, (), torch.device("cpu"), FakeCuda()).shared_pool == {
        0: True, 1: True}
    assert cg.StageGraphs(_program(stages, moved), stages, (), torch.device("cpu"), FakeCuda()).shared_pool == {
        0: False, 1: True}


def _stage(name, inputs, outputs, graphed):
    # what the pool planning reads of a stage
    return types.SimpleNamespace(name=name, inputs=inputs, outputs=outputs, graphed=graphed)


def _program(stages, calls):
    from fxoverlap.ir.meta import STEP_KEY
    by = {s.name: s for s in stages}
    g = torch.fx.Graph()
    for mb, name in calls:
        n = g.call_function(program_ops.output, (mb,))
        n.meta[STEP_KEY] = program_ops.Step(mb, StreamKind.COMP, tuple(by[name].inputs), tuple(by[name].outputs),
                                            stage=name)
    g.output(None)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_auto_graphs_unless_a_graph_copies_in_a_large_value(monkeypatch, caplog):
    """cuda_graphs=None (the default): on CPU nothing is graphed and nothing warns; the
    pass graphs the capturable stages unless one would copy in, at every replay, a value
    from an eager stage larger than the bound, and then none."""
    import warnings

    from fxoverlap.passes import cudagraph as pass_

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine, _, _ = _run(_model("capacity"), fxoverlap.OverlapConfig(), _batches(2, 256))
    stages = engine.stages
    assert not any(s.graphed for s in stages) and engine.cuda_graph_summary() == []
    pass_.cudagraph(stages, None)
    size, name, value = pass_.largest_copy_in(stages)
    consumer = next(s for s in stages if s.name == name)
    producer = next(s for s in stages if value in s.outputs)
    assert consumer.graphed and not producer.graphed and producer.stream is StreamKind.COMM
    val = next(ph for ph in consumer.graph_module.graph.find_nodes(op="placeholder") if ph.target == value).meta["val"]
    assert size == val.numel() * val.element_size() > 0
    graphable = {s.name for s in stages if s.capturable}
    assert {s.name for s in stages if s.graphed} == graphable
    monkeypatch.setattr(pass_, "AUTO_MAX_COPY_BYTES", size - 1)
    with caplog.at_level(logging.INFO, logger="fxoverlap"):
        pass_.cudagraph(stages, None)
    assert not any(s.graphed for s in stages)
    assert any(f"stage {name} would copy in {value}" in r.getMessage() for r in caplog.records)
    pass_.cudagraph(stages, True)  # an explicit True graphs anyway
    assert {s.name for s in stages if s.graphed} == graphable
    pass_.cudagraph(stages, False)
    assert not any(s.graphed for s in stages)


@pytest.mark.parametrize("front, how", [("optimize", "data"), ("optimize", "assign"), ("backend", "data")])
def test_parameters_moved_between_steps_are_followed(fake_cuda, front, how):
    """A graph reads a parameter at the address it was captured with. Where the parameter's memory
    is replaced between steps (``p.data = ...``, as ``model.cpu()`` and back does; or new parameter
    objects from ``load_state_dict(assign=True)``), the next run drops the graphs and captures them
    anew, so it trains the new values (the stand-in, like a real graph, reads the memory it
    captured: without the recapture it reads the old values)."""
    import fxoverlap.backend as fxb

    mbs = _batches(2, 256, seed=5)
    model = _model("capacity")
    ref = copy.deepcopy(model)
    if front == "optimize":
        engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True))
        step = functools.partial(engine.forward_backward, mbs)
    else:
        torch._dynamo.reset()
        step = functools.partial(eager_steps, torch.compile(model, backend="fxoverlap", mode="reduce-overhead"), mbs)
    step()
    eager_steps(ref, mbs)
    _grads(model), _grads(ref)
    with torch.no_grad():
        if how == "data":
            for m in (model, ref):
                p = m.layers[0].attention.wq.weight
                p.data = p.data * 1.5
        else:
            state = {k: v * 1.5 for k, v in ref.state_dict().items()}
            model.load_state_dict(state, assign=True), ref.load_state_dict(state, assign=True)
    losses = step()
    want = eager_steps(ref, mbs)
    assert all(torch.equal(a, b) for a, b in zip(losses, want))
    got, ref_grads = _grads(model), _grads(ref)
    assert all(torch.equal(got[k], ref_grads[k]) for k in ref_grads)
    (sg,) = fake_cuda.made
    assert sg.summary()["recaptures"] == 1
    step()  # nothing moved since: replays
    assert sg.summary()["recaptures"] == 1
    if front == "optimize":
        engine.close()
    else:
        fxb.reset()
        torch._dynamo.reset()


def test_auto_rule_leaves_views_of_parameters_out_of_the_copies():
    """The default's bound counts what a graph copies in at every replay: a view of a
    parameter (transformers' saved ``w.t()``) from an eager stage is read in place, so it
    does not count, however large."""
    import hf_cases
    import fxoverlap.backend as fxb
    from fxoverlap.kernels.emulated_link import EmulatedGroup
    from fxoverlap.passes import cudagraph as pass_

    model = fxoverlap.expert_parallel(hf_cases.build("qwen3_moe"), EmulatedGroup(None))
    ids = torch.randint(0, hf_cases.VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    hf_cases.next_token_loss(torch.compile(model, backend="fxoverlap")(ids), ids).backward()
    stages, static = fxb.last_stages(), fxb.last_compiled().runner.capture.static_placeholders
    views = pass_.static_views(stages, static)
    read = {v for s in stages for v in s.inputs}
    sizes = {p.numel() for p in model.parameters()}
    assert views and all(v in read for v in views)
    counted = 0
    for producer in [s for s in stages if views & set(s.outputs)]:
        for s in stages:  # only the producer eager: its outputs are what graphs copy in
            s.graphed = s is not producer
        counted += pass_.largest_copy_in(stages)[2] in views
        left = pass_.largest_copy_in(stages, static)
        assert left is None or left[2] not in views
    assert counted  # without the parameters' names, a view was the largest copy somewhere
    assert all(ph.meta["val"].numel() in sizes  # each a whole parameter, re-viewed
               for s in stages for ph in s.graph_module.graph.find_nodes(op="placeholder") if ph.target in views)
    fxb.reset()
    torch._dynamo.reset()


@pytest.mark.parametrize("segment_bytes", [None, 0], ids=["default", "segment_per_hand_out"])
def test_backend_replays_graphs_and_never_overwrites_a_pending_backward(fake_cuda, monkeypatch, segment_bytes):
    """``torch.compile(model, backend="fxoverlap", mode="reduce-overhead")``: the backend's
    one-microbatch program runs as graphs (one copy each), bitwise equal to eager over
    steps. Two forwards before one backward (summed losses) must not let the second
    overwrite the first's saved activations: the second runs without graphs. Also with the
    backward cut at every gradient hand-out (two calls' segment chains in one backward)."""
    import fxoverlap.backend as fxb

    if segment_bytes is not None:
        monkeypatch.setattr(fxb.fxoverlap_backend, "segment_min_grad_bytes", segment_bytes)

    mbs = _batches(3, 256, seed=21)
    model = _model("capacity")
    ref = []
    for tokens, labels in mbs:
        model(tokens, labels).backward()
        ref.append(_grads(model))
    both = {k: ref[0][k] + ref[1][k] for k in ref[0]}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxoverlap", mode="reduce-overhead")
    for (tokens, labels), want in zip(mbs, ref):
        compiled(tokens, labels).backward()
        got = _grads(model)
        assert all(torch.equal(got[k], want[k]) for k in want)
    (sg,) = fake_cuda.made
    assert sg.copies == 1 and sg.summary()["graphs"] == len(fake_cuda.graphs) > 0
    assert (len(fxb.last_compiled()._segments) > 2) is (segment_bytes == 0)
    replays = sum(e[0] == "replay" for e in fake_cuda.log)
    # summed losses of two forwards, one backward: gradients equal eager's sum
    (t0, l0), (t1, l1) = mbs[0], mbs[1]
    (compiled(t0, l0) + compiled(t1, l1)).backward()
    got = _grads(model)
    assert all(torch.allclose(got[k], both[k], rtol=1e-6, atol=1e-7) for k in both)
    assert sum(e[0] == "replay" for e in fake_cuda.log) > replays  # the first forward still replayed
    fxb.reset()  # releases the graphs
    assert fake_cuda.resets == len(fake_cuda.graphs) and sg.summary()["graphs"] == 0
    torch._dynamo.reset()


def test_views_of_parameters_are_read_in_place_not_copied(fake_cuda, monkeypatch):
    """transformers' attention saves its weights' transposes for the backward (views of the
    parameters): the backward's graphs read them in the parameters' memory, as they read the
    parameters, instead of copying them into static input buffers at every replay (at the
    Qwen3-30B-A3B layer's shape, 36 MiB a layer and 128 MiB for the head per microbatch).
    Gradients stay eager's over captured and replayed steps."""
    import hf_cases
    import fxoverlap.backend as fxb
    from fxoverlap.kernels.emulated_link import EmulatedGroup

    copied = []
    load = cg._Graph.load

    def spy(self, args):
        copied.extend(a.untyped_storage().data_ptr() for k, a in zip(self.kinds, args) if k == cg._COPY)
        return load(self, args)

    monkeypatch.setattr(cg._Graph, "load", spy)
    model = fxoverlap.expert_parallel(hf_cases.build("qwen3_moe"), EmulatedGroup(None))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, hf_cases.VOCAB, (1, 16), generator=g) for _ in range(2)]
    for ids in mbs:
        hf_cases.next_token_loss(ref(ids), ids).backward()
    want = _grads(ref)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxoverlap", options={"cuda_graphs": True})
    for _ in range(2):  # the first step captures, the second replays
        for ids in mbs:
            hf_cases.next_token_loss(compiled(ids), ids).backward()
        got = _grads(model)
        assert got.keys() == want.keys()
        assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6) for k in want)
    (sg,) = fake_cuda.made
    views = [k for g in sg._graphs.values() for k, n in zip(g.kinds, g.stage.inputs)
             if k == cg._STATIC and n not in sg.static_names]
    assert views, "no graph read a view of a parameter: the case is not exercised"
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert copied and not weights & set(copied)
    fxb.reset()
    torch._dynamo.reset()


def test_backend_lends_gradients_and_moves_the_kept_ones_off_graph_memory(fake_cuda):
    """The backend hands its graphed gradients to autograd without a copy (a loan, ended
    before the graphs run again): accumulated over microbatches they equal eager's bitwise
    and no loan is copied. A gradient something keeps past its use (a tensor hook's list,
    ``torch.autograd.grad``'s result) is moved onto a copy before the next replay would
    overwrite it; a kept view of one raises, naming the parameter."""
    import fxoverlap.backend as fxb

    mbs = _batches(3, 256, seed=21)
    model = _model("capacity")
    params = [p for p in model.parameters() if p.requires_grad]
    ref = []
    for tokens, labels in mbs:
        model(tokens, labels).backward()
        ref.append(_grads(model))
    for tokens, labels in mbs:
        model(tokens, labels).backward()
    ref_sum = _grads(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxoverlap", mode="reduce-overhead")
    for _ in range(2):  # the first call captures, the second replays
        for tokens, labels in mbs:
            compiled(tokens, labels).backward()
        got = _grads(model)
        assert all(torch.equal(got[k], ref_sum[k]) for k in ref_sum)
    (sg,) = fake_cuda.made
    assert sg.loans_copied == 0
    names = {id(p): k for k, p in model.named_parameters()}

    kept: list[dict] = [{} for _ in mbs]
    current = [0]
    handles = [p.register_hook(lambda g, k=names[id(p)]: kept[current[0]].__setitem__(k, g)) for p in params]
    for i, (tokens, labels) in enumerate(mbs):
        current[0] = i
        compiled(tokens, labels).backward()
        _grads(model)
    for h in handles:
        h.remove()
    compiled(*mbs[0]).backward()  # the graphs run again: the last microbatch's kept gradients too
    _grads(model)
    for i, want in enumerate(ref):
        assert kept[i].keys() == want.keys()
        assert all(torch.equal(kept[i][k], want[k]) for k in want), i
    assert sg.loans_copied >= len(mbs)  # (without the move, the fake's replays overwrite what the hook kept)

    grads = torch.autograd.grad(compiled(*mbs[1]), params)
    compiled(*mbs[2]).backward()
    _grads(model)
    assert all(torch.equal(g, ref[1][names[id(p)]]) for g, p in zip(grads, params))

    views = []
    handles = [p.register_hook(lambda g: views.append(g.view(-1))) for p in params]
    compiled(*mbs[0]).backward()
    for h in handles:
        h.remove()
    with pytest.raises(cg.GraphReplayError, match=r"a view of the gradient of graph input \d+ \(\w*param\w*\).* is still held"):
        compiled(*mbs[1]).backward()
    fxb.reset()
    torch._dynamo.reset()


def test_graphed_stages_that_draw_give_eager_numbers(fake_cuda):
    """A graphed stage with dropout or router noise draws once per call, at its replay, as
    eager does: the warm-ups before a capture run with the generator put back afterwards
    (and a capture draws nothing). Two steps (capture, then replays), 3 microbatches."""
    from rng_models import RandomTransformer

    torch.manual_seed(0)
    model = RandomTransformer(MoEConfig.tiny(n_layers=2, routing="dropless"), None)
    mbs = _batches(3, 256, seed=5)
    torch.manual_seed(1)
    ref_losses = eager_steps(model, mbs, rounds=2)
    ref_grads, state = _grads(model), torch.get_rng_state()
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(cuda_graphs=True))
    torch.manual_seed(1)
    losses = engine.forward_backward(mbs) + engine.forward_backward(mbs)
    assert any(s.graphed and s.draws for s in engine.stages)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    grads = _grads(model)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    assert torch.equal(state, torch.get_rng_state())
    engine.close()


def test_a_view_that_only_passes_a_value_on_stays_with_its_producer():
    """transformers' experts hold their weights transposed, so the experts' weight gradients
    leave the backward as transposes of fxoverlap's grouped-GEMM gradients. Such a view is cut
    into the stage that makes its input (``split``): no stage reads a value only to re-view it
    for another stage or the step's output, which a CUDA graph would copy in at every replay
    (at Qwen3-30B-A3B's shape, 96 MiB per layer, which kept every stage ungraphed)."""
    import hf_cases
    from fxoverlap.kernels.emulated_link import EmulatedGroup

    model = fxoverlap.expert_parallel(hf_cases.build("qwen3_moe"), EmulatedGroup(None))
    ids = torch.randint(0, hf_cases.VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    hf_cases.next_token_loss(torch.compile(model, backend="fxoverlap")(ids), ids).backward()
    stages = fxoverlap.backend.last_stages()
    produced = {v for s in stages for v in s.outputs}
    passing = []
    for s in stages:
        g = s.graph_module.graph
        outs = set(next(iter(g.find_nodes(op="output"))).args[0])
        for n in g.nodes:
            ins = n.all_input_nodes
            if (isinstance(n.target, torch._ops.OpOverload) and n.target.is_view and len(ins) == 1
                    and ins[0].op == "placeholder" and ins[0].target in produced and n.users and set(n.users) <= {next(iter(g.find_nodes(op="output")))}
                    and n in outs):
                passing.append((s.name, n.name, ins[0].target))
    assert passing == []
    experts_bwd = [s for s in stages if s.kind is StageKind.EXPERTS and s.direction.name == "BWD"]
    assert experts_bwd and all(any(n.target is torch.ops.aten.transpose.int for n in s.graph_module.graph.nodes)
                               for s in experts_bwd)
    torch._dynamo.reset()


@pytest.mark.slow  # ~20 s: the FP8 reference math on CPU
def test_fp8_experts_replay_logic_bitwise(fake_cuda, fp8_here):
    """FP8 experts (``expert_dtype="fp8_rowwise"``, the reference math on CPU) with CUDA graphs: the
    experts stages stay out of the graphs (their row counts are data-dependent), the stages around
    them are graphed, and captured then replayed steps equal eager with the same FP8 ops bitwise."""
    from fxoverlap import fp8_ops

    torch.manual_seed(0)
    cfg = MoEConfig.tiny(routing="dropless")
    base = MoETransformer(cfg).to(torch.bfloat16)
    mbs = _batches(2, cfg.vocab_size, seed=5)
    ref = copy.deepcopy(base)
    with fp8_ops.expert_math("fp8_rowwise"):
        ref_losses = eager_steps(ref, mbs)
    ref_grads = _grads(ref)
    model = copy.deepcopy(base)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(expert_dtype="fp8_rowwise", cuda_graphs=True,
                                                                     progress=False))
    _steps_bitwise(engine, model, mbs, ref_losses, ref_grads, steps=2)  # step 0 captures, step 1 replays
    graphed = _graphed(engine)
    experts = {s.name for s in engine.stages if s.kind is StageKind.EXPERTS}
    assert graphed and experts and not graphed & experts, (graphed, experts)
    assert any(fp8_ops.GROUPED_MM_FP8_OP in {n.target for n in s.graph_module.graph.nodes}
               for s in engine.stages if s.name in experts)
    assert sum(1 for e in fake_cuda.log if e[0] == "replay") > 0
    engine.close()
