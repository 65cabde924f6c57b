"""Static-shape, sync-free variants of fxoverlap's EP ops, and the overflow check.

``passes/dispatcher.py`` swaps the generic ops of a captured joint graph for these
(``OverlapConfig(dispatcher="padded" | "symm_mem")``). Each takes the generic op's
arguments plus ``capacity`` (rows per rank-to-rank link) and ``transport`` (how rows
travel: ``"padded"`` or ``"symm_mem"``); shapes follow from them alone, so the fake
kernels need no unbacked sizes. They have no autograd: they enter graphs that are
already differentiated (a forward op and its backward are separate nodes). The
dispatches' ``overflow``/``site`` have no defaults: torch 2.11 drops trailing default
arguments before it bumps a mutated argument's version, and then fails.

A forward dispatch whose capacity is below the worst case also writes the busiest
link's row count into ``overflow[site]`` (on the device); :func:`check_overflow` reads
all sites once at the end of a step and raises :class:`DispatchOverflow`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from fxoverlap.kernels import a2a, padded, static_ep
from fxoverlap.config import ConfigError
from fxoverlap.ir.capture import Capture, OverflowFlags, OverflowSite
from fxoverlap.ir.errors import FxOverlapError



def _transport(name: str) -> static_ep.Transport:
    if name == "padded":
        return padded.transport
    if name == "symm_mem":
        from fxoverlap.kernels import symm_mem  # needs CUDA (and Triton); imported only when used

        return symm_mem.transport
    raise ConfigError(f"unknown fxoverlap transport {name!r}; expected 'padded' or 'symm_mem'")


def _ep(group_name: str) -> int:
    return a2a.world_size(a2a.resolve_group(group_name))


# ---------------------------------------------------------------- per expert


@torch.library.custom_op("fxoverlap::dispatch_static", mutates_args=("overflow",))
def _dispatch_static(
    x: torch.Tensor, send_counts: torch.Tensor, group_name: str, recv_counts: torch.Tensor | None, capacity: int,
    transport: str, overflow: torch.Tensor | None, site: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return static_ep.dispatch(x, send_counts, a2a.resolve_group(group_name), recv_counts, capacity,
                              _transport(transport), overflow, site)


@_dispatch_static.register_fake
def _(x, send_counts, group_name, recv_counts, capacity, transport, overflow, site):
    ep = _ep(group_name)
    return x.new_empty(ep * capacity, x.shape[1]), send_counts.new_empty(ep, send_counts.shape[0] // ep)


@torch.library.custom_op("fxoverlap::combine_static", mutates_args=())
def _combine_static(
    y: torch.Tensor, recv_counts: torch.Tensor, send_counts: torch.Tensor, group_name: str, out_rows: int,
    capacity: int, transport: str,
) -> torch.Tensor:
    return static_ep.combine(y, recv_counts, send_counts, a2a.resolve_group(group_name), out_rows, capacity,
                             _transport(transport))


@_combine_static.register_fake
def _(y, recv_counts, send_counts, group_name, out_rows, capacity, transport):
    return y.new_empty(out_rows, y.shape[1])


# ---------------------------------------------------------------- token once


@torch.library.custom_op("fxoverlap::token_dispatch_static", mutates_args=("overflow",))
def _token_dispatch_static(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, n_experts: int, group_name: str, capacity: int,
    transport: str, overflow: torch.Tensor | None, site: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return static_ep.token_dispatch(x, idx, w, n_experts, a2a.resolve_group(group_name), capacity,
                                    _transport(transport), overflow, site)


@_token_dispatch_static.register_fake
def _(x, idx, w, n_experts, group_name, capacity, transport, overflow, site):
    ep = _ep(group_name)
    el, (t, k) = n_experts // ep, idx.shape
    pairs = ep * capacity * min(k, el)
    return (x.new_empty(pairs, x.shape[1]), w.new_empty(pairs), idx.new_empty(ep, el), idx.new_empty(pairs),
            idx.new_empty(t, ep), idx.new_empty(ep))


@torch.library.custom_op("fxoverlap::token_dispatch_backward_static", mutates_args=())
def _token_dispatch_backward_static(
    grad_x: torch.Tensor, grad_w: torch.Tensor, idx: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor,
    recv_rows: torch.Tensor, n_experts: int, group_name: str, capacity: int, transport: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return static_ep.token_dispatch_backward(grad_x, grad_w, idx, pair_index, slot, recv_rows, n_experts,
                                             a2a.resolve_group(group_name), capacity, _transport(transport))


@_token_dispatch_backward_static.register_fake
def _(grad_x, grad_w, idx, pair_index, slot, recv_rows, n_experts, group_name, capacity, transport):
    return grad_x.new_empty(idx.shape[0], grad_x.shape[1]), grad_w.new_empty(idx.shape)


@torch.library.custom_op("fxoverlap::token_combine_static", mutates_args=())
def _token_combine_static(
    y: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor, recv_rows: torch.Tensor, top_k: int,
    group_name: str, capacity: int, transport: str,
) -> torch.Tensor:
    return static_ep.token_combine(y, pair_index, slot, recv_rows, top_k, a2a.resolve_group(group_name), capacity,
                                   _transport(transport))


@_token_combine_static.register_fake
def _(y, pair_index, slot, recv_rows, top_k, group_name, capacity, transport):
    return y.new_empty(slot.shape[0], y.shape[1])


@torch.library.custom_op("fxoverlap::token_combine_backward_static", mutates_args=())
def _token_combine_backward_static(
    grad_out: torch.Tensor, pair_index: torch.Tensor, slot: torch.Tensor, recv_rows: torch.Tensor, top_k: int,
    group_name: str, capacity: int, transport: str,
) -> torch.Tensor:
    return static_ep.token_combine_backward(grad_out, pair_index, slot, recv_rows, top_k,
                                            a2a.resolve_group(group_name), capacity, _transport(transport))


@_token_combine_backward_static.register_fake
def _(grad_out, pair_index, slot, recv_rows, top_k, group_name, capacity, transport):
    return grad_out.new_empty(pair_index.shape[0], grad_out.shape[1])


# ---------------------------------------------------------------- overflow


class DispatchOverflow(FxOverlapError, RuntimeError):
    """A dispatch needed more rows on one rank-to-rank link than its capacity; the step's
    gradients were discarded (``p.grad`` is as it was before the step)."""


def check_overflow(flags: torch.Tensor, sites: Sequence[OverflowSite], group: dist.ProcessGroup | None) -> None:
    """Raise :class:`DispatchOverflow` if any site needed more rows than its capacity.

    One host read of ``flags`` (and, with a group, one all-reduce of them first, so that
    every rank of the group raises together instead of some entering the next step).
    """
    if flags.is_cuda:
        torch.cuda.synchronize(flags.device)  # the comm stream wrote the flags
    needed = flags.clone()
    if not a2a.one_rank(group):  # (a stand-in group runs no collective: one rank)
        dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
    over = [(s, n) for s, n in zip(sites, needed.tolist()) if n > s.capacity]
    if over:
        lines = [
            f"layer {s.layer} ({s.node}): {n} rows on one rank-to-rank link, capacity {s.capacity} "
            f"(worst case {s.worst_case})" for s, n in over
        ]
        factor = math.ceil(100 * max(n / s.share for s, n in over)) / 100
        raise DispatchOverflow(
            "fxoverlap dispatch overflow: " + "; ".join(lines) + f". The step's gradients were discarded. Raise "
            f"OverlapConfig.dispatch_capacity_factor to at least {factor:g}, or leave it None for the worst-case "
            f"capacity (never overflows)"
        )


@contextlib.contextmanager
def overflow_guard(capture: Capture, model: torch.nn.Module) -> Iterator[None]:
    """Around one step of ``gm``'s stages: reset its overflow flags, and on overflow put
    every ``p.grad`` back as it was before the step and raise. A no-op without flags
    (worst-case capacity: nothing is read)."""
    info: OverflowFlags | None = capture.overflow
    if info is None:
        yield
        return
    flags = getattr(capture.graph_module, info.buffer)
    flags.zero_()
    before = {p: None if p.grad is None else p.grad.clone() for p in model.parameters()}
    yield
    try:
        check_overflow(flags, info.sites, a2a.resolve_group(info.group_name))
    except DispatchOverflow:
        for p, g in before.items():
            p.grad = g
        raise


STATIC_OPS = {
    "dispatch": torch.ops.fxoverlap.dispatch_static.default,
    "combine": torch.ops.fxoverlap.combine_static.default,
    "token_dispatch": torch.ops.fxoverlap.token_dispatch_static.default,
    "token_dispatch_backward": torch.ops.fxoverlap.token_dispatch_backward_static.default,
    "token_combine": torch.ops.fxoverlap.token_combine_static.default,
    "token_combine_backward": torch.ops.fxoverlap.token_combine_backward_static.default,
}
