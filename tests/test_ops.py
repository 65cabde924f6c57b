"""fxoverlap's EP dispatch/combine and grouped GEMM ops."""

from __future__ import annotations

import torch

import ops_cases
from fxoverlap import ops
from fxoverlap.testing import run_distributed


def test_dispatch_combine_roundtrip_two_ranks():
    for r in run_distributed(ops_cases.roundtrip, 4):
        assert r["roundtrip"] and r["grad"] and r["layout"], r
        assert r["recv_rows"] == r["y_rows"]
        # one host sync per dispatch (its split sizes); combine and both backward
        # all-to-alls reuse them
        assert r["host_syncs"] == 1, r


def test_single_rank_ops_need_no_process_group():
    x = torch.randn(6, 8, requires_grad=True)
    counts = torch.tensor([2, 0, 4])
    y, recv = ops.dispatch(x, counts, None)
    assert torch.equal(y, x) and recv.tolist() == [[2, 0, 4]]
    back = ops.combine(y, recv, counts, None, 6)
    back.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_grouped_mm_matches_per_expert_matmul_and_grads():
    torch.manual_seed(0)
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # expert 1 gets no rows
    out = ops.grouped_mm(x, w, offs)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([xr[:4] @ wr[0], xr[4:4] @ wr[1], xr[4:] @ wr[2]])
    torch.testing.assert_close(out, ref)
    (out * torch.arange(80.0).view(10, 8)).sum().backward()
    (ref * torch.arange(80.0).view(10, 8)).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    assert torch.equal(w.grad[1], torch.zeros(16, 8))


def test_token_dispatch_combine_two_ranks():
    for r in run_distributed(ops_cases.token_roundtrip, 8, 3):
        assert r["combine"] and r["grad_x"] and r["grad_w"], r
        assert r["layout"] and r["pairs"] and r["once_per_rank"], r
        # the dispatch syncs once for its split sizes and caches them; the combine
        # and both backward all-to-alls find them cached (no further host sync)
        assert r["host_syncs"] == 0, r


def test_token_dispatch_single_rank():
    torch.manual_seed(0)
    x, w = torch.randn(5, 3, requires_grad=True), torch.rand(5, 2)
    idx = torch.tensor([[0, 2], [1, 0], [3, 2], [2, 1], [0, 3]])
    sent = ops.token_dispatch(x, idx, w, 4, None)
    assert sent.tokens_per_expert.tolist() == [3, 2, 3, 2]
    # pairs grouped by expert: expert 0 gets tokens 0, 1, 4; expert 1 tokens 1, 3; ...
    assert (sent.pair_index // 2).tolist() == [0, 1, 4, 1, 3, 0, 2, 3, 2, 4]
    assert torch.equal(sent.x, x.detach()[sent.pair_index // 2])
    assert torch.equal(sent.weights, w.flatten()[sent.pair_index])
    back = ops.token_combine(sent.x * 3, sent, None)
    back.sum().backward()
    assert torch.allclose(back, x.detach() * 6) and torch.equal(x.grad, torch.full_like(x, 6.0))


def test_row_sum_matches_a_loop_and_skips_foreign_slots():
    from fxoverlap.kernels.row_sum import pair_positions, sum_per_row

    torch.manual_seed(0)
    rows, k, d = 5, 3, 4
    pair_index = torch.tensor([0, 4, 5, 7, 9, 12, 14])  # slots row * k + j that hold a local expert
    src = torch.randn(len(pair_index), d)
    pos = pair_positions(pair_index, rows, k)
    assert pos[1].tolist() == [7, 1, 2] and pos[4].tolist() == [5, 7, 6]  # 7 = P: no pair there
    expected = torch.zeros(rows, d)
    for p, slot in enumerate(pair_index.tolist()):
        expected[slot // k] += src[p]
    torch.testing.assert_close(sum_per_row(src, pair_index, rows, k), expected)
    half = sum_per_row(src.bfloat16(), pair_index, rows, k)
    assert half.dtype is torch.bfloat16
    torch.testing.assert_close(half.float(), expected, atol=2e-2, rtol=1e-2)
