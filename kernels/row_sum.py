"""Sum the (row, expert) pairs of each received row: ``out[r] = sum_j src[pos[r, j]]``.

``pos[r, j]`` is the pair of row ``r``'s top-k slot ``j``, or ``P`` (= ``len(src)``)
where that slot's expert lives on another rank. The sum runs over ``j`` in order with
an fp32 accumulator, so it is deterministic and as precise as the per-expert path's
``.sum(1)``; ``index_add_`` would be neither on CUDA (bf16 atomics). On CUDA a Triton
kernel reads each pair once and writes each row once; elsewhere (or without Triton)
a gather + ``sum`` does the same arithmetic.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:

    @triton.jit
    def _row_sum_kernel(src, pos, out, n_pairs, dim, K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < dim
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            p = tl.load(pos + row * K + j)
            v = tl.load(src + p * dim + cols, mask=mask & (p < n_pairs), other=0.0)
            acc += v.to(tl.float32)
        tl.store(out + row * dim + cols, acc.to(out.dtype.element_ty), mask=mask)


def pair_positions(pair_index: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """``pos[rows, k]``: the pair of each top-k slot, ``P`` where the slot has none."""
    n = pair_index.numel()
    pos = torch.full((rows * k,), n, dtype=torch.long, device=pair_index.device)
    return pos.scatter_(0, pair_index, torch.arange(n, device=pair_index.device)).view(rows, k)


def sum_per_row(src: torch.Tensor, pair_index: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """``[rows, D]``: each row's pairs of ``src [P, D]`` summed, slots in order, fp32 accumulation."""
    return sum_at(src, pair_positions(pair_index, rows, k))


def sum_at(src: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``out[r] = sum_j src[pos[r, j]]`` (``pos [rows, k]``; ``P`` = ``len(src)``: nothing), fp32 accumulation."""
    rows, k = pos.shape
    if triton is not None and src.is_cuda and src.dim() == 2 and rows > 0:
        src = src.contiguous()
        out = src.new_empty(rows, src.shape[1])
        block = min(1024, triton.next_power_of_2(max(src.shape[1], 16)))
        _row_sum_kernel[(rows, triton.cdiv(src.shape[1], block))](
            src, pos.contiguous(), out, src.shape[0], src.shape[1], K=k, BLOCK=block)
        return out
    padded = torch.cat([src, src.new_zeros(1, *src.shape[1:])])
    return padded[pos].sum(1, dtype=torch.float32).to(src.dtype)
