"""FP8 rowwise expert GEMMs: rowwise quantization and ``torch._scaled_grouped_mm``.

Three products, each quantized along its contraction dim (the recipe of torchao's FP8 rowwise
grouped GEMM: float8_e4m3fn, scales rounded down to powers of two, saturated cast):

* :func:`grouped_mm` ``x[M, K] @ w[g][K, N]`` per row group (forward, and the input gradient
  ``dy @ w[g]^T`` with ``w`` given transposed): ``x`` scaled per row, ``w[g]`` per column.
* :func:`grouped_mm_wgrad` ``x[group g]^T @ dy[group g]`` -> ``[G, K, N]``: both scaled per
  column *within each group* (the contraction runs over the group's rows).

On CUDA the quantization runs torchao's Triton kernels (``torchao.prototype.moe_training.kernels``,
imported on first use) and the product ``torch._scaled_grouped_mm`` (SM89+; ``fxoverlap.fp8_ops``
refuses other devices before anything here runs). Elsewhere (CPU, the meta device) the same
quantization runs as torch ops, and on CPU the product is the exact fp32 product of the dequantized
operands (a power-of-two scale dequantizes exactly): the reference the GPU checks and the CPU tests
compare against. The offsets are group ends (int32); every group must start at a multiple of 16
rows for the CUDA kernels (``fxoverlap.ops.pad_groups``). Outputs are bfloat16, as
``torch._scaled_grouped_mm`` writes them.
"""

from __future__ import annotations

import functools

import torch

from fxoverlap.kernels import grouped_gemm

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
EPS = 1e-12  # torchao's: an all-zero row gets a finite scale
ALIGN = 16  # rows per group start, and K and N: torch._scaled_grouped_mm's alignment (16 bytes of FP8)


@functools.lru_cache(maxsize=None)
def _torchao():
    # Imported on first CUDA use only: its import loads CUDA extensions and registers ops.
    from torchao.prototype.moe_training import kernels

    return kernels


def _scales(amax: torch.Tensor) -> torch.Tensor:
    """torchao's scales: FP8_MAX / amax (in fp64, then fp32), rounded down to a power of two."""
    s = (FP8_MAX / amax.double().clamp_min(EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s)))


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last two dims column-major (what ``_scaled_grouped_mm`` takes as mat_b)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[M, K]`` -> (FP8 row-major ``[M, K]``, scales ``[M]``): one scale per row."""
    if x.is_cuda:
        q, s = _torchao().triton_fp8_rowwise_2d_scale_and_cast(x, FP8, True)
        return q, s.reshape(-1)
    s = _scales(x.abs().amax(dim=-1, keepdim=True))
    return _cast(x, s).contiguous(), s.reshape(-1)


def quantize_rhs(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w[G, K, N]`` (any strides) -> (FP8 column-major ``[G, K, N]``, scales ``[G, N]``): one scale
    per output column of each group, over K."""
    if w.is_cuda:
        q, s = _torchao().triton_fp8_colwise_3d_scale_and_cast(w, FP8, True)
        return q, s.reshape(w.shape[0], w.shape[2])
    s = _scales(w.abs().amax(dim=-2, keepdim=True))
    return _col_major(_cast(w, s)), s.reshape(w.shape[0], w.shape[2])


def row_groups(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows]``: each row's group (``G`` for rows past the last group end); no host read."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)


def quantize_groups(a: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a[M, C]`` -> (FP8 column-major ``[M, C]``, scales ``[G * C]``): one scale per column of
    each row group (group major), over the group's rows."""
    g, (m, c) = offs.shape[0], a.shape
    group = row_groups(offs, m)
    amax = a.new_zeros(g + 1, c, dtype=torch.float32).scatter_reduce(
        0, group[:, None].expand(m, c), a.abs().float(), "amax")
    s = _scales(amax)
    return _col_major(_cast(a, s.index_select(0, group))), s[:g].reshape(-1)


def _quantize_group_pair(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor):
    if x.is_cuda:
        xq, xs, dq, ds = _torchao().triton_fp8_per_group_colwise_scales_dual(x.contiguous(), dy.contiguous(), offs,
                                                                             FP8, True)
        return xq, xs, dq, ds
    return (*quantize_groups(x, offs), *quantize_groups(dy, offs))


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` with *quantization* scales (``q = x * scale``), bf16 out; on CPU
    the exact product of the dequantized operands (2-D x 3-D, or 2-D x 2-D grouped along K)."""
    if a.device.type != "cpu":  # CUDA; the meta device checks the call against torch's meta kernel
        return torch._scaled_grouped_mm(a, b, scale_a.reciprocal(), scale_b.reciprocal(), offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)
    if b.dim() == 3:
        xa = a.float() / scale_a[:, None]
        wb = b.float() / scale_b[:, None, :]
        return grouped_gemm.grouped_mm(xa, wb, offs).to(torch.bfloat16)
    # 2-D x 2-D: a = x^T [K, M], b = dy [M, N], scales per (group, K) and (group, N)
    g, k, n = offs.shape[0], a.shape[0], b.shape[1]
    group = row_groups(offs, a.shape[1]).clamp(max=g - 1)  # rows past the groups: no group reads them
    xa = a.t().float() / scale_a.view(g, k).index_select(0, group)
    yb = b.float() / scale_b.view(g, n).index_select(0, group)
    return grouped_gemm.grouped_mm_wgrad(xa, yb, offs).to(torch.bfloat16)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ w[g]`` in FP8 rowwise, bf16 ``[M, N]``."""
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rhs(w)
    return scaled_grouped_mm(xq, wq, xs, ws, offs)


def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[group g]^T @ dy[group g]`` in FP8 (per-group column scales), bf16 ``[G, K, N]``; an
    empty group's gradient is exact zeros (chunks add the chunks' gradients up)."""
    rows = x.shape[0]
    if rows % ALIGN:
        # the product reads the quantized rows transposed (column-major [rows, C]), and
        # torch._scaled_grouped_mm wants that row stride a multiple of 16 bytes: zero rows past
        # the last group, which no group reads. Done here, where the row count is a number (the
        # experts stage's graph knows it only as an unbacked symbol).
        pad = ALIGN - rows % ALIGN
        x, dy = torch.nn.functional.pad(x, (0, 0, 0, pad)), torch.nn.functional.pad(dy, (0, 0, 0, pad))
    xq, xs, dq, ds = _quantize_group_pair(x, dy, offs)
    out = scaled_grouped_mm(xq.t(), dq, xs, ds, offs)
    if out.is_cuda:  # torch._scaled_grouped_mm leaves an empty group's block unwritten (seen on an H200)
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        out = torch.where((sizes > 0)[:, None, None], out, 0)
    return out
