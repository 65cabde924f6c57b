"""Host (Python) time per training step of both front ends, on CPU at tiny shapes.

    python -m fxoverlap.bench host-time [--front optimize,backend,compile] [--steps 200]
        [--profile 20] [--layers 2] [--microbatches 2] [--compiler eager] [--chunks 1]

The reference MoE model (``MoEConfig.tiny``: dim 64, 4 heads, 8 experts top-2, dropless) on one
rank without a process group, tokens ``(2, 16)``: the kernels are tiny, so the step's time is
mostly host work. ``optimize``: ``engine.forward_backward(mbs, loss_fn)``; ``backend``:
``compiled(tokens, labels).backward()`` per microbatch; ``compile``: the same loop through plain
``torch.compile(model)`` (``--compiler inductor``: Inductor; ``eager``: AOTAutograd's graphs run op
by op, as ``backend="aot_eager"``), the target the backend's host time is compared with (its
compiled forward and backward graphs are timed and replayed as the stages are). After ``--warmup`` steps (compiles and
first calls) it reports the median and mean ms per step over ``--steps`` steps, the stage
launches per step, and, with ``--profile N``, cProfile's top entries (own time) over N steps.
Gradients are zeroed between steps (set_to_none) outside the timed region.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import fxoverlap
import fxoverlap.backend as fxb
from fxoverlap import direct_ops
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import token_batches


def _loss(out, tokens):
    return out.float().pow(2).mean()


def build(front: str, args):
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(n_layers=args.layers), None).to(args.device)
    batches = [tuple(t.to(args.device) for t in b)
               for b in token_batches(256, args.microbatches, shape=(2, 16), seed=0)]
    config = fxoverlap.OverlapConfig(compiler=args.compiler, chunks=args.chunks)
    if front == "optimize":
        engine = fxoverlap.optimize(model, None, config)
        mbs = [(t,) for t, _ in batches]

        def step():
            engine.forward_backward(mbs, _loss)

        def stages():
            return engine.stages
    elif front == "compile":
        fxoverlap.enable_dynamic_output_shapes()  # as the backend row: dropless routing in one graph
        torch._dynamo.reset()
        parts: list[CompiledPart] = []
        compiled = torch.compile(model, backend=plain_backend(args.compiler, parts))

        def step():
            for tokens, labels in batches:
                compiled(tokens, labels).backward()

        def stages():
            return parts
    else:
        fxoverlap.enable_dynamic_output_shapes()
        torch._dynamo.reset()
        backend = fxb.Backend(compiler=args.compiler, chunks=args.chunks)
        compiled = torch.compile(model, backend=backend)

        def step():
            for tokens, labels in batches:
                compiled(tokens, labels).backward()

        def stages():
            return backend.last.stages
    return model, step, stages


class CompiledPart:
    """One of plain torch.compile's compiled graphs (a forward or a backward), shaped as the clock
    and :func:`replay` see a stage: ``compiled`` is the callable its runtime calls (``holder.attr``)."""

    graph_module = None

    def __init__(self, holder, attr: str) -> None:
        self._holder, self._attr = holder, attr

    @property
    def compiled(self):
        return getattr(self._holder, self._attr)

    @compiled.setter
    def compiled(self, fn) -> None:
        setattr(self._holder, self._attr, fn)


def plain_backend(compiler: str, parts: list[CompiledPart]):
    """torch.compile's own path, recording each compiled graph in ``parts``: ``inductor``,
    Inductor (its ``CompiledFxGraph.current_callable``, the generated code, is what is timed);
    ``eager``, AOTAutograd with the graphs run op by op (``aot_eager``)."""
    import types

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    if compiler == "inductor":
        def inner(gm, example_inputs, **kwargs):
            out = compile_fx_inner(gm, example_inputs, **kwargs)
            if hasattr(out, "current_callable"):
                parts.append(CompiledPart(out, "current_callable"))
            return out

        def backend(gm, example_inputs):
            # AOTAutograd's cache would load the graphs without calling ``inner``
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return compile_fx(gm, example_inputs, inner_compile=inner)
        return backend

    def graph(gm, example_inputs):
        holder = types.SimpleNamespace(fn=gm.forward)
        parts.append(CompiledPart(holder, "fn"))
        return make_boxed_func(lambda *args: holder.fn(*args))

    return aot_autograd(fw_compiler=graph, bw_compiler=graph)


class StageClock:
    """Wall time spent inside the stages' own code (an eager stage's ``GraphModule.forward``, an
    Inductor stage's callable), timed by wrapping each stage's: step time minus this is the
    front end's host work (plus, for the backend, Dynamo's guards and autograd's engine)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.calls = 0

    def wrap(self, stages) -> None:
        for stage in stages:
            if stage.compiled is not None:
                stage.compiled = self._timed(stage.compiled)
            else:  # an instance attribute: found by GraphModule.__call__ and by a direct .forward alike
                for gm in _eager_modules(stage):
                    gm.forward = self._timed(gm.forward)

    def _timed(self, fn):
        clock = self

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                clock.total += time.perf_counter() - t0
                clock.calls += 1

        return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--front", default="optimize,backend")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--compiler", default="eager")
    ap.add_argument("--chunks", type=int, default=1, help="OverlapConfig.chunks of optimize and the backend")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for front in args.front.split(","):
        model, step, stages = build(front, args)
        for _ in range(args.warmup):
            step()
            model.zero_grad(set_to_none=True)
        clock = StageClock()
        clock.wrap(stages())
        step()
        model.zero_grad(set_to_none=True)
        launches = clock.calls
        times, outside = [], []
        for _ in range(args.steps):
            clock.total = 0.0
            t0 = time.perf_counter()
            step()
            if args.device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            outside.append(times[-1] - clock.total)
            model.zero_grad(set_to_none=True)
        print(f"{front}: {args.layers} layers, {args.microbatches} microbatches, compiler={args.compiler}, "
              f"chunks={args.chunks if front != 'compile' else '-'}, "
              f"{launches} stage launches per step; real stages: median {_ms(times)} ms/step (min {_ms(times, min)}), "
              f"outside the stages median {_ms(outside)} (min {_ms(outside, min)})", flush=True)
        # host work alone: every stage replays the outputs it gave once (no kernel runs); the
        # thread's CPU time is what a busy machine disturbs least
        replay(stages())
        cpu, wall = [], []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.thread_time()
            step()
            if args.device != "cpu":
                torch.cuda.synchronize()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        print(f"{front}: host only (stages replayed): CPU median {_ms(cpu)} ms/step (min {_ms(cpu, min)}), "
              f"wall median {_ms(wall)} (min {_ms(wall, min)})", flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile):
                step()
                model.zero_grad(set_to_none=True)
            prof.disable()
            st = pstats.Stats(prof)
            st.sort_stats("tottime").print_stats(args.top)
            st.sort_stats("cumulative").print_stats(args.top)


def _ms(xs, how=statistics.median) -> str:
    return f"{1e3 * how(xs):.3f}"


def replay(stages) -> None:
    """Make each stage return the outputs of its next call, at once, ever after (the same
    tensors: the step's values are garbage, its host work the same): the step then runs the
    front end's host work and no kernel."""
    for stage in stages:
        holders = [stage] if stage.compiled is not None else _eager_modules(stage)
        attr = "compiled" if stage.compiled is not None else "forward"
        for holder in holders:
            real = getattr(holder, attr)
            seen: list = []

            def fn(*args, real=real, seen=seen):
                if not seen:
                    seen.append(real(*args))
                return seen[0]

            setattr(holder, attr, fn)


def _eager_modules(stage) -> list:
    """The modules whose ``forward`` runs an eager stage: its graph's, and the runtime's direct
    copy of it (``fxoverlap.direct_ops``: the custom ops called past the dispatcher) where it has one."""
    direct = direct_ops.direct_module(stage.graph_module)
    return [stage.graph_module] if direct is None else [stage.graph_module, direct]


if __name__ == "__main__":
    main()
