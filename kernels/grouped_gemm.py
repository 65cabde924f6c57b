"""Expert GEMMs: ``torch._grouped_mm`` where it runs, a loop over groups otherwise."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.zeros(8, 16, device=device_type, dtype=dtype)
        w = torch.zeros(2, 16, 16, device=device_type, dtype=dtype)
        offs = torch.tensor([4, 8], device=device_type, dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs)
        torch._grouped_mm(x.t(), x, offs=offs)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _aligned(*ts: torch.Tensor) -> bool:
    # _grouped_mm needs 16-byte aligned strides.
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in ts)


def use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    return _grouped_mm_runs(x.device.type, x.dtype) and _aligned(x, w)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[rows of group g] = x[rows of group g] @ w[g]``; ``offs`` are cumulative row ends."""
    if use_grouped_mm(x, w):
        return torch._grouped_mm(x.contiguous(), w, offs=offs)
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        torch.mm(x[start:end], w[g], out=out[start:end])
        start = end
    return out


def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``dw[g] = x[group g].T @ dy[group g]``, shape ``[G, K, N]``."""
    if use_grouped_mm(x, dy):
        if offs.data_ptr() % 16:  # a chunk's slice of the offsets (passes/chunk.py) may start off 16 bytes
            offs = offs.clone()
        return torch._grouped_mm(x.t(), dy.contiguous(), offs=offs)
    dw = x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        torch.mm(x[start:end].t(), dy[start:end], out=dw[g])
        start = end
    return dw


def register_split_backward(forward_op, wgrad_op) -> None:
    """The autograd of a grouped GEMM custom op ``forward_op(x, w, offs)`` as two ops, so that
    ``delay_wgrad`` can move the weight gradient: the input gradient is ``forward_op`` itself on
    ``(dy, wᵀ)``, the weight gradient ``wgrad_op(x, dy, offs)`` (bf16 and FP8 alike)."""

    def setup(ctx, inputs, output):
        x, w, offs = inputs
        ctx.save_for_backward(x, w, offs)

    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = forward_op(dy, w.transpose(-1, -2), offs) if ctx.needs_input_grad[0] else None
        dw = wgrad_op(x, dy, offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None

    forward_op.register_autograd(backward, setup_context=setup)
