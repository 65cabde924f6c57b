"""Workers for the 2-rank dispatcher tests, and a counter of host reads of tensors."""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

import fxoverlap
from fxoverlap import ops
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import eager_steps, grad_diff, take_grads
from numerics_cases import make_batches

aten = torch.ops.aten
# Python-level reads of a tensor's value (each one waits for the device on CUDA).
PY_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")
# aten ops that synchronise with the host on CUDA (their output size or value is data).
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.bincount.default,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.equal.default, aten.is_nonzero.default,
}
REPEAT_OPS = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}  # sync without output_size
BOOL_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}  # a nonzero inside


class _SyncOps(TorchDispatchMode):
    """Counts syncing aten ops, also inside fxoverlap's custom ops (whose Python bodies it
    re-runs under itself: a mode does not see the ops a kernel calls)."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in SYNC_OPS or (func in REPEAT_OPS and kwargs.get("output_size") is None)
                or (func in BOOL_INDEX_OPS and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()))):
            self.counts[str(func)] += 1
        opdef = OPDEFS.get(func._schema.name) if func.namespace == "fxoverlap" else None
        if opdef is not None:
            with self:
                return opdef._init_fn(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_reads():
    """``{"python": Counter, "aten": Counter}`` of host reads made inside the block."""
    counts = {"python": collections.Counter(), "aten": collections.Counter()}
    own = {name: torch.Tensor.__dict__.get(name) for name in PY_READS}

    def counted(name, fn):
        def read(self, *args, **kwargs):
            counts["python"][name] += 1
            return fn(self, *args, **kwargs)
        return read

    for name in PY_READS:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    try:
        with _SyncOps(counts["aten"]):
            yield counts
    finally:
        for name, fn in own.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)


ROUTINGS = {"dropless": {}, "dedup": dict(token_dedup=True, top_k=3), "capacity": dict(routing="capacity")}


def backends_match_eager(rank: int, world: int, routings: list[str], backends: list[str]) -> list[dict]:
    """Per routing and backend: a step after the capture against eager on the same weights
    and data (losses and grads bitwise), its host reads, and which expert stages are capturable."""
    out = []
    for routing in routings:
        for backend in backends:
            torch.manual_seed(0)
            cfg = MoEConfig.tiny(shared_expert_dim=32, **ROUTINGS[routing])
            model = MoETransformer(cfg, dist.group.WORLD)
            mbs = make_batches(rank, cfg.vocab_size, 2)
            ref_losses, ref = eager_steps(model, mbs), take_grads(model)
            engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(dispatcher=backend))
            engine.forward_backward(mbs)  # capture + a first step
            model.zero_grad(set_to_none=True)
            with count_host_reads() as reads:
                losses = engine.forward_backward(mbs)
            diff, scale, bitwise = grad_diff(model, ref)
            out.append(dict(
                routing=routing, backend=backend, bitwise=bitwise, diff=diff, scale=scale,
                losses_equal=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
                python_reads=dict(reads["python"]), aten_syncs=dict(reads["aten"]),
                experts=[(s.name, s.capturable) for s in engine.stages if s.kind.value == "experts"],
            ))
    return out


def overflow_and_edges(rank: int, world: int) -> dict:
    """A capacity factor that fits (one read, bitwise; with delayed weight gradients), one that
    overflows (DispatchOverflow, grads untouched), forward-only, and the static ops on skewed
    routing against the generic ones."""
    out = {}
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32)
    model = MoETransformer(cfg, dist.group.WORLD)
    mbs = make_batches(rank, cfg.vocab_size, 2)
    ref_losses, ref = eager_steps(model, mbs), take_grads(model)
    roomy = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(
        dispatcher="padded", dispatch_capacity_factor=1.5, delay_wgrad=True))
    roomy.forward_backward(mbs)
    model.zero_grad(set_to_none=True)
    with count_host_reads() as reads:
        losses = roomy.forward_backward(mbs)
    out["roomy"] = dict(bitwise=grad_diff(model, ref)[2], python_reads=dict(reads["python"]),
                        wgrad_stages=sum(1 for s in roomy.stages if s.wgrad_of),
                        aten_syncs=dict(reads["aten"]),
                        losses_equal=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)))

    tight = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(
        dispatcher="padded", dispatch_capacity_factor=0.25))
    before = {k: v.clone() for k, v in take_grads(model).items()}  # grads of the roomy step...
    for name, p in model.named_parameters():
        p.grad = before[name].clone()  # ...put back, so the overflowing step has grads to spoil
    try:
        tight.forward_backward(mbs)
        out["tight"] = dict(raised=None)
    except fxoverlap.DispatchOverflow as e:
        out["tight"] = dict(raised=str(e), grads_kept=all(
            torch.equal(p.grad, before[n]) for n, p in model.named_parameters()))

    tokens = mbs[0][0]
    with torch.no_grad():
        out["forward_only"] = torch.equal(
            fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(dispatcher="padded"))(tokens),
            model(tokens))
    out["ops"] = _skewed_ops(rank, world)
    return out


def _skewed_ops(rank: int, world: int) -> dict:
    """dispatch/combine (forward and backward-style calls) on routing where one rank sends
    nothing to a peer and some experts get nothing, static vs generic."""
    n_experts, el, d = 8, 8 // world, 4
    g = torch.Generator().manual_seed(rank)
    counts = torch.randint(0, 4, (n_experts,), generator=g)
    if rank == 0:
        counts[el:] = 0  # rank 0 sends nothing to rank 1
    counts[1] = 0
    x = torch.randn(int(counts.sum()), d, generator=g)
    group, name = dist.group.WORLD, dist.group.WORLD.group_name
    y, recv = ops.dispatch(x, counts, group)
    caps = torch.tensor([max(x.shape[0], 1)])
    dist.all_reduce(caps, op=dist.ReduceOp.MAX)  # one capacity on every rank (the SPMD contract), the worst case
    cap = int(caps)
    ys, recv_s = torch.ops.fxoverlap.dispatch_static(x, counts, name, None, cap, "padded", None, 0)
    real = y.shape[0]
    back = ops.combine(y * 3, recv, counts, group, x.shape[0])
    back_s = torch.ops.fxoverlap.combine_static(ys * 3, recv_s, counts, name, x.shape[0], cap, "padded")
    grad_y, _ = torch.ops.fxoverlap.dispatch(back, counts, name, recv, real)
    grad_ys, _ = torch.ops.fxoverlap.dispatch_static(back_s, counts, name, recv_s, cap, "padded", None, 0)
    return dict(
        dispatch=torch.equal(ys[:real], y), padding_zero=bool((ys[real:] == 0).all()), counts=torch.equal(recv_s, recv),
        combine=torch.equal(back_s, back), backward_dispatch=torch.equal(grad_ys[:real], grad_y), rows=ys.shape[0],
    )
