"""Eager stages call fxoverlap's custom ops' kernels directly (``fxoverlap.direct_ops``), and a
run enters the below-autograd guard once where its launches would each enter it.

* which ops qualify (our custom ops with one Python kernel; not a mutating one, not one with a
  device kernel of its own, not aten's), and the copy leaves the stage graph as it was;
* a step's eager stages reach no op through the dispatcher, yet with a dispatch mode or a
  profiler active the ops are seen again; gradients are bitwise those of the op path and of
  eager PyTorch on the same weights and data;
* which runs take the guard once (the forward of plain launches; not a run whose gradients go
  to a sink, nor one with a hook).
"""

from __future__ import annotations

import torch
import torch._library.custom_ops as custom_ops
from torch.utils._python_dispatch import TorchDispatchMode

import fxoverlap
from fxoverlap import direct_ops
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import token_batches

GROUPED_MM = torch.ops.fxoverlap.grouped_mm.default
DISPATCH = torch.ops.fxoverlap.dispatch.default


def test_direct_kernel_only_for_plain_custom_ops():
    assert direct_ops.direct_kernel(GROUPED_MM) is custom_ops.OPDEFS["fxoverlap::grouped_mm"]._init_fn
    assert direct_ops.direct_kernel(DISPATCH) is custom_ops.OPDEFS["fxoverlap::dispatch"]._init_fn
    # mutates its `overflow` input (ADInplaceOrView bumps its version): the op path
    assert direct_ops.direct_kernel(torch.ops.fxoverlap.dispatch_static.default) is None
    assert direct_ops.direct_kernel(torch.ops.aten.mm.default) is None
    assert direct_ops.direct_kernel(torch.ops.fxoverlap.grouped_mm) is None  # the packet, not an overload


def test_direct_kernel_refuses_a_device_kernel(monkeypatch):
    monkeypatch.setattr(direct_ops, "NAMESPACE", "fxoverlap_direct_test")

    @torch.library.custom_op("fxoverlap_direct_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @torch.library.custom_op("fxoverlap_direct_test::thrice", mutates_args=())
    def thrice(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    @thrice.register_kernel("cpu")
    def _(x):  # on a CPU the dispatcher runs this one, not the default
        return x * 3 + 0

    assert direct_ops.direct_kernel(torch.ops.fxoverlap_direct_test.twice.default) is twice._init_fn
    assert direct_ops.direct_kernel(torch.ops.fxoverlap_direct_test.thrice.default) is None


def _grouped_mm_module(val: bool = True) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x, w, offs = (graph.placeholder(n) for n in ("x", "w", "offs"))
    y = graph.call_function(GROUPED_MM, (x, w, offs))
    graph.output((graph.call_function(torch.ops.aten.relu.default, (y,)),))
    if val:
        for ph, t in zip((x, w, offs), _grouped_mm_inputs()):
            ph.meta["val"] = t
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _grouped_mm_inputs():
    torch.manual_seed(0)
    return torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([2, 6], dtype=torch.int32)


def test_direct_module_calls_the_kernel_and_leaves_the_graph():
    gm = _grouped_mm_module()
    direct = direct_ops.direct_module(gm)
    assert direct is not None and direct_ops.direct_module(gm) is direct  # built once
    targets = [n.target for n in direct.graph.nodes if n.op == "call_function"]
    assert targets == [custom_ops.OPDEFS["fxoverlap::grouped_mm"]._init_fn, torch.ops.aten.relu.default]
    # the stage's own graph still names the op (the passes, tests and tools look for it)
    assert GROUPED_MM in [n.target for n in gm.graph.nodes]
    args = _grouped_mm_inputs()
    with torch.no_grad():
        assert torch.equal(direct(*args)[0], gm(*args)[0])
    gm.recompile()  # a new code: a new copy
    assert direct_ops.direct_module(gm) is not direct
    # an input of unknown kind (no traced value) could be a subclass: no copy
    assert direct_ops.direct_module(_grouped_mm_module(val=False)) is None


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


def _engine_and_batches():
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig.tiny(n_layers=2), None)
    mbs = [(t,) for t, _ in token_batches(256, 2, shape=(2, 16), seed=0)]
    return model, fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="eager")), mbs


def _loss(out, tokens):
    return out.float().pow(2).mean()


def _step(model, engine, mbs):
    model.zero_grad(set_to_none=True)
    losses = engine.forward_backward(mbs, _loss)
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_eager_stages_skip_the_dispatcher_and_match_the_op_path(monkeypatch):
    model, engine, mbs = _engine_and_batches()
    # eager PyTorch on the same weights and data
    model.zero_grad(set_to_none=True)
    for (t,) in mbs:
        _loss(model(t), t).backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _step(model, engine, mbs)  # builds the runs and the direct copies
    eager_stages = [s for s in engine.stages if s.compiled is None]
    assert any(direct_ops.direct_module(s.graph_module) is not None for s in eager_stages)

    # count the calls that reach a kernel through the op (torch.library's backend_impl looks the
    # kernel up at each call)
    calls = {"n": 0}
    for name in ("fxoverlap::grouped_mm", "fxoverlap::dispatch", "fxoverlap::combine"):
        fns = custom_ops.OPDEFS[name]._backend_fns
        real = fns[None]

        def counted(*args, real=real, **kwargs):
            calls["n"] += 1
            return real(*args, **kwargs)

        monkeypatch.setitem(fns, None, counted)

    losses, direct = _step(model, engine, mbs)
    assert calls["n"] == 0, "a step's eager stages reached a custom op through the dispatcher"
    mode = _Ops()
    with mode:  # a mode must see the ops: the runner takes the op path
        op_losses, op_path = _step(model, engine, mbs)
    assert calls["n"] > 0 and {"fxoverlap.grouped_mm.default", "fxoverlap.dispatch.default"} <= mode.seen
    assert all(torch.equal(a, b) for a, b in zip(losses, op_losses))
    assert direct.keys() == op_path.keys() == eager.keys()
    for n in direct:
        assert torch.equal(direct[n], op_path[n]), n
        assert torch.equal(direct[n], eager[n]), n
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, engine, mbs)
    assert "fxoverlap::grouped_mm" in {e.name for e in prof.events()}


def test_runs_enter_the_guard_once_only_where_every_node_may():
    model, engine, mbs = _engine_and_batches()
    _step(model, engine, mbs)
    runner = engine.runner(mbs, _loss)
    forward = runner._nodes(*runner._spans["forward"])
    assert forward.below and forward.below_with_sink  # plain launches, frees, outputs
    assert any(fn == runner.call_plain for fn, _ in forward.nodes)
    whole = runner._nodes(*runner._spans["all"])
    assert whole.below and not whole.below_with_sink  # its gradients: a sink's code is not ours
    hooked = engine.runner(mbs, _loss, hook=lambda node, stage, run: run())
    run = hooked._nodes(*hooked._spans["forward"])
    assert not run.below and not any(fn == hooked.call_plain for fn, _ in run.nodes)
