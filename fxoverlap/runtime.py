"""Runtime: executes stages against a per-microbatch value store. It never rewrites graphs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
import torch.fx
import torch.nn as nn

from fxoverlap.passes.capture import Capture
from fxoverlap.stage import Stage


def static_values(capture: Capture, model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of ``model`` under their placeholder names."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    out = {ph: params[fqn] for ph, fqn in capture.param_placeholders.items()}
    out.update({ph: buffers[fqn] for ph, fqn in capture.buffer_placeholders.items()})
    return out


def run_stage(stage: Stage, store: dict) -> None:
    outs = stage.graph_module(*[store[i] for i in stage.inputs])
    store.update(zip(stage.outputs, outs))


def seed_tangent(capture: Capture, store: dict) -> None:
    """The loss gradient eager's ``loss.backward()`` starts from: ones."""
    store[capture.tangent_placeholder] = torch.ones_like(store[capture.loss_name])


def accumulate_grads(capture: Capture, store: dict, model: nn.Module) -> None:
    """Add this microbatch's gradients into ``p.grad`` as eager's AccumulateGrad does."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, fqn in zip(capture.output_names[1:], capture.grad_targets):
        if name is None or fqn is None:
            continue
        _accumulate(params[fqn], store[name])


def run_plain(stages: Iterable[Stage], capture: Capture, model: nn.Module, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """One microbatch, stages in plain order (all forward, then all backward)."""
    store = static_values(capture, model)
    store.update(zip(capture.input_placeholders, inputs))
    stages = list(stages)
    with torch.no_grad():
        for s in stages:
            if s.direction.value == "bwd" and capture.tangent_placeholder not in store:
                seed_tangent(capture, store)
            run_stage(s, store)
        accumulate_grads(capture, store, model)
    return store[capture.loss_name].detach()


class StageFailed(RuntimeError):
    """A stage raised while the program ran; names the stage and microbatch."""


class ProgramRunner:
    """Walks a program: stage calls, events, frees. Owns streams, events and value stores.

    On CPU streams and events are no-ops and the program runs in its order.
    """

    def __init__(
        self,
        program: torch.fx.GraphModule,
        stages: Sequence[Stage],
        capture: Capture,
        model: nn.Module,
        device: torch.device,
        comm_stream_priority: int = -1,
        record_memory: bool = False,
        time_stages: bool = False,
        cuda_graphs=None,
    ):
        from fxoverlap import program_ops

        self.program, self.capture, self.model = program, capture, model
        self.stages = {s.name: s for s in stages}
        self.device = device
        self.record_memory = record_memory
        self.memory_trace: list[tuple[str, int, int]] = []
        self.leftover: dict[int, list[str]] = {}  # record_memory: values left in the stores at the end
        # time_stages: run each stage alone (synchronised) and record its time in
        # ms under its program node name; for the benchmark's T_serial / T_bound.
        self.time_stages = time_stages
        self.stage_times: dict[str, float] = {}
        # cuda_graphs: a fxoverlap.cudagraphs.StageGraphs that runs the calls the
        # cudagraph pass marked (node.meta["cudagraph"]), or None: all eager.
        self.cuda_graphs = cuda_graphs
        self._ops = program_ops
        self._grad_of = {
            name: fqn for name, fqn in zip(capture.output_names[1:], capture.grad_targets) if name and fqn
        }
        self.streams: dict[str, object] = {}
        if device.type == "cuda":
            self.streams = {
                "comp": torch.cuda.current_stream(device),
                "comm": torch.cuda.Stream(device, priority=comm_stream_priority),
            }
        self._nodes = list(program.graph.nodes)

    # ---- helpers
    def _stream_ctx(self, stream: str | None):
        if not self.streams or stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.streams[stream])

    def run(self, microbatches: Sequence[Sequence[torch.Tensor]], on_error=None) -> list[torch.Tensor]:
        cap = self.capture
        static = static_values(cap, self.model)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        stores = [dict(static, **dict(zip(cap.input_placeholders, mb))) for mb in microbatches]
        stage_stream: dict[tuple[int, str], str] = {}  # (mb, value) -> stream that produced it
        losses: list[torch.Tensor | None] = [None] * len(microbatches)
        events: dict[str, object] = {}
        ops = self._ops
        static_keys = static_storage_keys(static) if self.record_memory else frozenset()
        with torch.no_grad():
            for node in self._nodes:
                if node.op == "call_module":
                    stage = self.stages[node.meta["stage"]]
                    mb = node.meta["microbatch"]
                    stream = node.kwargs.get("stream")
                    store = stores[mb]
                    with self._stream_ctx(stream):
                        args = [store[i] for i in stage.inputs]
                        if self.streams:
                            for v, a in zip(stage.inputs, args):
                                # A tensor allocated on the other stream: keep its block
                                # from being reused there until this stream is done with it.
                                if stage_stream.get((mb, v), "comp") != stream and isinstance(a, torch.Tensor):
                                    a.record_stream(self.streams[stream])
                        graphed = False  # outs are a CUDA graph's static outputs, overwritten at replay
                        try:
                            if self.time_stages:
                                outs = self._timed(node.name, stage, args)
                            elif self.cuda_graphs is not None and node.meta.get("cudagraph"):
                                outs, graphed = self.cuda_graphs.call(node, stage, args)
                            else:
                                outs = stage.graph_module(*args)
                            if self.cuda_graphs is not None:
                                self.cuda_graphs.note_reads(args)
                        except Exception as e:
                            if on_error is not None:
                                on_error(e)
                            raise StageFailed(
                                f"stage {stage.name} (layer {stage.layer}, {stage.kind}, {stage.direction}) "
                                f"failed on microbatch {mb}: {type(e).__name__}: {e}"
                            ) from e
                        for v, o in zip(stage.outputs, outs):
                            store[v] = o
                            stage_stream[(mb, v)] = stream or "comp"
                            fqn = self._grad_of.get(v)
                            if fqn is not None:
                                _accumulate(params[fqn], o, copy=graphed)
                    if cap.loss_name in stage.outputs:
                        losses[mb] = store[cap.loss_name].detach()
                        if graphed:
                            losses[mb] = losses[mb].clone()
                        seed_tangent(cap, store)
                    if self.record_memory:
                        self.memory_trace.append((node.name, mb, live_bytes(stores, static_keys)))
                elif node.op == "call_function":
                    if node.target is ops.record_event:
                        name, stream = node.args
                        if self.streams:
                            ev = torch.cuda.Event()
                            ev.record(self.streams[stream])
                            events[name] = ev
                    elif node.target is ops.wait_event:
                        name, stream = node.args
                        if self.streams:
                            self.streams[stream].wait_event(events[name])
                    elif node.target is ops.free:
                        mb, *names = node.args
                        for v in names:
                            stores[mb].pop(v, None)
                        if self.record_memory:
                            self.memory_trace.append((node.name, mb, live_bytes(stores, static_keys)))
        if self.record_memory:
            # What the program left behind: ("end", -1, bytes), and the names per microbatch.
            self.memory_trace.append(("end", -1, live_bytes(stores, static_keys)))
            left = {mb: [v for v in st if v not in static] for mb, st in enumerate(stores)}
            self.leftover = {mb: names for mb, names in left.items() if names}
        stores.clear()
        return losses

    def _timed(self, name: str, stage: Stage, args: list) -> tuple:
        import time

        if self.streams:
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outs = stage.graph_module(*args)
            end.record()
            torch.cuda.synchronize(self.device)
            self.stage_times[name] = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            outs = stage.graph_module(*args)
            self.stage_times[name] = (time.perf_counter() - t0) * 1e3
        return outs


def _accumulate(p: torch.Tensor, g: torch.Tensor, copy: bool = False) -> None:
    # copy: g is graph memory (overwritten at the next replay); p.grad must not alias it.
    if p.grad is None:
        p.grad = g.detach().clone() if copy or g.data_ptr() == p.data_ptr() else g.detach()
    else:
        p.grad.add_(g)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


def static_storage_keys(static: dict) -> frozenset:
    """Storages of the parameters and buffers (views of them, like ``w.t()``, share these)."""
    return frozenset(_storage_key(v) for v in static.values() if isinstance(v, torch.Tensor))


def live_bytes(stores: Sequence[dict], static_keys: frozenset | dict) -> int:
    """Bytes of the tensors held by the microbatch value stores.

    Each underlying storage counts once (views and values shared between stores
    are deduplicated by device and storage pointer); storages of parameters and
    buffers (``static_keys``, or the dict of static values) are left out; values
    that are not tensors (SymInt sizes) count nothing.
    """
    if isinstance(static_keys, dict):
        static_keys = static_storage_keys(static_keys)
    seen_ids: set[int] = set()
    seen: set[tuple] = set(static_keys)
    total = 0
    for store in stores:
        for v in store.values():
            if not isinstance(v, torch.Tensor) or id(v) in seen_ids:
                continue
            seen_ids.add(id(v))
            key = _storage_key(v)
            if key not in seen:
                seen.add(key)
                total += v.untyped_storage().nbytes()
    return total
