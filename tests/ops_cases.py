"""Workers for the 2-rank EP op tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxoverlap import ops
from fxoverlap.kernels import a2a


def roundtrip(rank: int, world: int, n_experts: int) -> dict:
    """dispatch -> (identity experts) -> combine returns each row home; gradients flow back.

    Also checks the layout contract: rank r receives, grouped by its local expert,
    exactly the rows other ranks sent to that expert, in source-rank order.
    """
    g = torch.Generator().manual_seed(rank)
    counts = torch.randint(0, 4, (n_experts,), generator=g)
    counts[rank] = 0  # an expert that gets nothing from this rank
    rows = int(counts.sum())
    # Row i carries (source rank, global expert, index) so the receiver can check it.
    expert_of_row = torch.repeat_interleave(torch.arange(n_experts), counts)
    x = torch.stack([torch.full((rows,), float(rank)), expert_of_row.float(), torch.arange(rows).float()], 1)
    x = torch.cat([x, torch.zeros(rows, 1)], 1).requires_grad_()
    misses = {"n": 0}
    recall = a2a._recall

    def counting(c):
        hit = recall(c)
        misses["n"] += hit is None
        return hit

    a2a._recall = counting
    try:
        y, recv = ops.dispatch(x, counts, dist.group.WORLD)
        local = n_experts // world
        expected_experts = torch.arange(rank * local, (rank + 1) * local)
        ok_layout = bool((y[:, 1].unsqueeze(1) == expected_experts).any(1).all()) and bool(
            (y[:, 1].diff() >= 0).all())
        back = ops.combine(y * 2, recv, counts, dist.group.WORLD, rows)
        back.sum().backward()
    finally:
        a2a._recall = recall
    return dict(
        roundtrip=torch.equal(back, x.detach() * 2), grad=torch.equal(x.grad, torch.full_like(x, 2.0)),
        layout=ok_layout, recv_rows=int(recv.sum()), y_rows=y.shape[0], host_syncs=misses["n"],
    )
