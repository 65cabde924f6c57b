"""Workers for the 2-rank EP op tests."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from fxoverlap import ops
from fxoverlap.kernels import a2a


@contextlib.contextmanager
def count_host_syncs():
    """Count the split-list cache misses of the all-to-all ops (each miss is a host sync)."""
    misses = {"n": 0}
    recall = a2a._recall

    def counting(c):
        hit = recall(c)
        misses["n"] += hit is None
        return hit

    a2a._recall = counting
    try:
        yield misses
    finally:
        a2a._recall = recall


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
    with count_host_syncs() as misses:
        y, recv = ops.dispatch(x, counts, dist.group.WORLD)
        local = n_experts // world
        expected_experts = torch.arange(rank * local, (rank + 1) * local)
        ok_layout = bool((y[:, 1].unsqueeze(1) == expected_experts).any(1).all()) and bool(
            (y[:, 1].diff() >= 0).all())
        back = ops.combine(y * 2, recv, counts, dist.group.WORLD, rows)
        back.sum().backward()
    return dict(
        roundtrip=torch.equal(back, x.detach() * 2), grad=torch.equal(x.grad, torch.full_like(x, 2.0)),
        layout=ok_layout, recv_rows=int(recv.sum()), y_rows=y.shape[0], host_syncs=misses["n"],
    )


def token_roundtrip(rank: int, world: int, n_experts: int, k: int) -> dict:
    """token_dispatch -> identity experts -> token_combine against the per-expert formula.

    Checks the layout (pairs grouped by this rank's experts in ascending order, each
    pair carrying its token and weight), that a token crosses to a rank at most once,
    that the combine returns sum_j w[t, j] * x[t], the gradients of x and w, and that
    only the dispatch syncs with the host.
    """
    g = torch.Generator().manual_seed(rank)
    t, el = 7, n_experts // world
    idx = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(t)])
    # columns: source rank, token, then free values
    x = torch.cat([torch.full((t, 1), float(rank)), torch.arange(t).float().unsqueeze(1),
                   torch.randn(t, 2, generator=g)], 1).requires_grad_()
    w = torch.rand(t, k, generator=g).requires_grad_()
    with count_host_syncs() as misses:
        sent = ops.token_dispatch(x, idx, w, n_experts, dist.group.WORLD)
        out = ops.token_combine(sent.x * sent.weights.unsqueeze(-1), sent, dist.group.WORLD)
        probe = torch.randn(t, 4, generator=g)
        (out * probe).sum().backward()
    # every pair's (source, token, weight) against the sender's routing, gathered from all ranks
    routing = [torch.zeros(t, k, dtype=torch.long) for _ in range(world)]
    weights = [torch.zeros(t, k) for _ in range(world)]
    dist.all_gather(routing, idx)
    dist.all_gather(weights, w.detach())
    src, tok = sent.x[:, 0].long(), sent.x[:, 1].long()
    j = sent.pair_index % k
    experts = torch.stack(routing)[src, tok, j]
    layout = bool((experts.diff() >= 0).all()) and bool(((experts // el) == rank).all()) and torch.equal(
        sent.weights, torch.stack(weights)[src, tok, j]) and int(sent.tokens_per_expert.sum()) == len(experts)
    expected_pairs = sum(int(((r // el) == rank).sum()) for r in routing)
    ranks_per_token = torch.zeros(t, world, dtype=torch.bool).scatter_(1, idx // el, True).sum()
    sent_rows, recv_rows = ranks_per_token.clone(), sent.recv_rows.sum()
    dist.all_reduce(sent_rows)
    dist.all_reduce(recv_rows)
    scale = w.detach().sum(1, keepdim=True)
    return dict(
        combine=torch.allclose(out, x.detach() * scale, atol=1e-6),
        grad_x=torch.allclose(x.grad, probe * scale, atol=1e-6),
        grad_w=torch.allclose(w.grad, (probe * x.detach()).sum(1, keepdim=True).expand(t, k), atol=1e-6),
        layout=layout, pairs=len(experts) == expected_pairs, once_per_rank=int(sent_rows) == int(recv_rows),
        host_syncs=misses["n"],
    )
