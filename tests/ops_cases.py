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


def _global_ids_of_pairs(sent, k, x, idx, n_experts, world):
    """Send every token's global ids along (as a float payload) to read them back per pair."""
    ids_sent = ops.token_dispatch(idx.float(), idx, torch.ones(idx.shape), n_experts, dist.group.WORLD)
    picked = ids_sent.x.index_select(0, sent.pair_index // k)  # [P, k] the token's k global ids
    el = n_experts // world
    mine = picked.long() // el == dist.get_rank()
    # the pair's expert is the one of slot pair_index % k
    return picked.gather(1, (sent.pair_index % k).unsqueeze(1)).squeeze(1).long() * mine.any(1)


def token_roundtrip(rank: int, world: int, n_experts: int, k: int) -> dict:
    """token_dispatch -> identity experts -> token_combine against the per-expert formula.

    Checks the layout (each received row's ids name this rank's experts, weights are
    the sender's), that every token crosses to a rank at most once, that the combine
    returns sum_j w[t, j] * x[t], the gradients of x and w, and one host sync.
    """
    g = torch.Generator().manual_seed(rank)
    t, d, el = 7, 4, n_experts // world
    idx = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(t)])
    x = torch.randn(t, d, generator=g, requires_grad=True)
    w = torch.rand(t, k, generator=g, requires_grad=True)
    misses = {"n": 0}
    recall = a2a._recall

    def counting(c):
        hit = recall(c)
        misses["n"] += hit is None
        return hit

    a2a._recall = counting
    try:
        sent = ops.token_dispatch(x, idx, w, n_experts, dist.group.WORLD)
        ids_ok = bool((sent.weights >= 0).all())
        # pairs come grouped by local expert: the global ids behind them, in order,
        # are this rank's experts in ascending order
        owner_ids = _global_ids_of_pairs(sent, k, x, idx, n_experts, world)
        expert_major = bool((owner_ids.diff() >= 0).all()) and bool(
            ((owner_ids >= rank * el) & (owner_ids < (rank + 1) * el)).all())
        rows = sent.pair_index // k
        expanded = sent.x.index_select(0, rows)
        weighted = expanded * sent.weights.flatten().index_select(0, sent.pair_index).unsqueeze(-1)
        per_slot = weighted.new_zeros(sent.x.shape[0] * k, d).index_copy(0, sent.pair_index, weighted)
        out = ops.token_combine(per_slot.view(-1, k, d).sum(1), sent, dist.group.WORLD)
        probe = torch.randn(t, d, generator=g)
        (out * probe).sum().backward()
    finally:
        a2a._recall = recall
    expected = x.detach() * w.detach().sum(1, keepdim=True)
    ranks_per_token = (idx // el).unsqueeze(-1).eq(torch.arange(world)).any(1).sum()
    all_rows = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(all_rows, torch.tensor([sent.x.shape[0]]))
    sent_rows = torch.zeros(1, dtype=torch.long)
    dist.all_reduce(sent_rows.copy_(ranks_per_token))
    return dict(
        combine=torch.allclose(out, expected, atol=1e-6),
        grad_x=torch.allclose(x.grad, probe * w.detach().sum(1, keepdim=True), atol=1e-6),
        grad_w=torch.allclose(w.grad, (probe * x.detach()).sum(1, keepdim=True).expand(t, k), atol=1e-6),
        pairs=int(sent.pair_index.numel()) == int(sent.recv_pairs.sum()),
        expert_major=expert_major,
        once_per_rank=int(sum(int(r) for r in all_rows)) == int(sent_rows),
        weights_positive=ids_ok, host_syncs=misses["n"],
    )
