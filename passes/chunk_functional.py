"""chunk_functional: the ``chunk`` pass's cut for a layer whose exchange is torch's functional
``all_to_all_single`` (torchtitan's ``AllToAllTokenDispatcher``, and models written like it).

Such a layer's all-to-alls are ``_c10d_functional.all_to_all_single`` + ``wait_tensor`` with
split sizes read to the host from the exchanged counts (``.tolist()``: one
``_local_scalar_dense`` per rank). The chunks are cut as in ``chunk`` (along local experts,
``a2a.chunk_bounds``) but stay functional all-to-alls, with their split sizes read to the host
once per layer: no fxoverlap op enters the layer, and the experts keep the model's own code.

Contract
--------
Assumes: the tagged joint graph (or the forward alone). The layer's forward dispatch stage runs
two functional all-to-alls over one group: the *counts exchange* of an integer ``[ep, El]``
tensor in equal splits (``counts[r, j]``: the rows this rank sends to local expert ``j`` of rank
``r``) and the *token exchange* of ``x`` (sorted by global expert: to each rank, by its local
expert), whose input / output split sizes are the per-rank sums of the sent / received counts;
rows arrive source-rank-major, each source's rows by local expert. Its forward combine stage holds
one all-to-all, of the experts' output with the split sizes swapped; in the backward, the combine's
gradient goes out with the dispatch's split sizes and the experts' input gradient comes back with
the combine's. The experts read the received rows and counts (after ``wait_tensor``, or views of
them in the dispatch stage), parameters, and (backward) saved experts values: the conditions of
``chunk``, which also checks row-wise experts afterwards. The split sizes being the counts' sums
is checked at run time (``aten._assert_scalar`` on the host values: a model whose counts do not
match its split sizes fails there, with the layer's name, instead of mixing rows).

Guarantees: chunk ``c``'s stages (``Tag.chunk = c``): dispatch (chunk 0 also runs the counts
exchange and the model's own host reads, then one host read of every chunk's split sizes and the
rows sorted by chunk; then each chunk's token all-to-all), experts (a clone of the layer's experts
that sees the received counts with the other local experts' columns zeroed, so its grouped GEMM
gives them zero rows), combine (its rows back); the last chunk's combine puts the chunks' rows back
in the sender's order (same value name: the stages that read it are unchanged). The backward
likewise, each gradient the experts hand out the sum of the chunks'. Every row is computed by the
same ops on the same values as in the whole layer (forward: bitwise); each expert's rows are in
one chunk. One host read per layer exchange beyond the model's own.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from fxoverlap.ir.meta import TAG_KEY, op_name
from fxoverlap.ir.stage import Tag
from fxoverlap.kernels import a2a
from fxoverlap.passes.chunk import (B, F, K, _become, _CannotCut, _Chain, _check_boundaries, _copy, _FAKE_KEYS,
                                    _position)

A2A = torch.ops._c10d_functional.all_to_all_single.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
aten = torch.ops.aten


@dataclasses.dataclass
class _Exchange:
    """One functional all-to-all and its chain of ``wait_tensor`` (the last one is its value)."""

    a2a: torch.fx.Node
    waits: list[torch.fx.Node]

    @property
    def out(self) -> torch.fx.Node:
        return self.waits[-1]

    @property
    def nodes(self) -> list[torch.fx.Node]:
        return [self.a2a, *self.waits]


@dataclasses.dataclass
class FunctionalChain(_Chain):
    """A layer's chain (``chunk._Chain``'s fields: ``dispatch`` is the token exchange, ``received``
    its value, ``recv_counts`` the received counts, ``combine`` the combine's all-to-all) plus
    the functional exchanges and the dispatch-stage nodes the experts read (cloned per chunk)."""

    counts: _Exchange | None = None
    tokens: _Exchange | None = None
    back: _Exchange | None = None  # the forward combine
    bwd_in: _Exchange | None = None  # backward: the combine's gradient out
    bwd_out: _Exchange | None = None  # backward: the experts' input gradient back
    per_chunk: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    ep_size: int = 1

    @property
    def ep(self) -> int:
        return self.ep_size

    @property
    def splits(self) -> set[torch.fx.Node]:
        """The token exchange's split sizes that are host values (each chunk has its own)."""
        return {v for v in (*self.dispatch.args[1], *self.dispatch.args[2]) if isinstance(v, torch.fx.Node)}

    def sources(self) -> set[torch.fx.Node]:
        out = {*self.tokens.nodes, self.recv_counts, *self.per_chunk, *self.splits}
        return out | (set(self.bwd_in.nodes) if self.bwd_in is not None else set())


def _exchange(n: torch.fx.Node) -> _Exchange:
    waits, cur = [], n
    while True:
        nxt = [u for u in cur.users if u.target is WAIT]
        if len(nxt) != 1:
            break
        waits.append(cur := nxt[0])
    if not waits:
        raise _CannotCut(f"its all-to-all {n.name} is not waited on (wait_tensor)")
    return _Exchange(n, waits)


def _only(nodes: list[torch.fx.Node], what: str) -> _Exchange:
    calls = [n for n in nodes if n.target is A2A]
    if len(calls) != 1:
        raise _CannotCut(f"its {what} stage runs {len(calls)} functional all-to-alls, not one")
    ex = _exchange(calls[0])
    rest = [n for n in nodes if n not in ex.nodes]
    if rest:
        raise _CannotCut(f"its {what} stage runs {rest[0].name} ({op_name(rest[0])}) beside its all-to-all")
    return ex


def _same(a, b) -> bool:
    return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and all(
        x is y or (isinstance(x, int) and x == y) for x, y in zip(a, b))


def find_chain(by_tag: dict[tuple, list[torch.fx.Node]], layer: int, chunks: int, static: set[str]
               ) -> FunctionalChain:
    """Step 1 of ``chunk`` for a functional exchange: the layer's chain, or ``_CannotCut``."""
    def nodes(direction, kind):
        return by_tag.get((direction, layer, kind), [])

    disp = nodes(F, K.DISPATCH)
    calls = [n for n in disp if n.target is A2A]
    ints = [n for n in calls if not n.args[0].meta["val"].dtype.is_floating_point]
    if len(calls) != 2 or len(ints) != 1:
        raise _CannotCut(f"its forward dispatch stage runs {len(calls)} functional all-to-all(s), not a counts "
                         f"exchange (integers) and a token exchange")
    counts, tokens = _exchange(ints[0]), _exchange(next(n for n in calls if n is not ints[0]))
    group = tokens.a2a.args[3]
    ep = a2a.world_size(a2a.resolve_group(group))
    sent, got = counts.a2a.args[0].meta["val"], counts.out.meta["val"]
    if counts.a2a.args[3] != group or sent.dim() != 2 or sent.shape[0] != ep or tuple(got.shape) != tuple(sent.shape) \
            or any(s is not None and not _same(s, [1] * ep) for s in counts.a2a.args[1:3]):
        raise _CannotCut(f"its counts exchange {counts.a2a.name} is not an [ep, local experts] tensor in equal splits "
                         f"over the token exchange's group")
    el = sent.shape[1]
    if not isinstance(el, int) or el < chunks:
        raise _CannotCut(f"it has {el} local expert(s), fewer than chunks={chunks} (chunks are cut along local experts)")
    out_splits, in_splits = tokens.a2a.args[1], tokens.a2a.args[2]
    if not (isinstance(out_splits, (list, tuple)) and len(out_splits) == ep and len(in_splits or ()) == ep):
        raise _CannotCut(f"its token exchange {tokens.a2a.name} has no split sizes per rank")
    back = _only(nodes(F, K.COMBINE), "forward combine")
    if back.a2a.args[3] != group or not (_same(back.a2a.args[1], in_splits) and _same(back.a2a.args[2], out_splits)):
        raise _CannotCut(f"its combine {back.a2a.name} does not take the token exchange's split sizes, swapped")
    chain = FunctionalChain(layer, tokens.a2a, tokens.out, counts.out, back.a2a, nodes(F, K.EXPERTS), counts=counts,
                            tokens=tokens, back=back, ep_size=ep)
    if nodes(B, K.COMBINE) or nodes(B, K.DISPATCH):
        chain.bwd_in = _only(nodes(B, K.COMBINE), "backward combine")
        chain.bwd_out = _only(nodes(B, K.DISPATCH), "backward dispatch")
        if not (_same(chain.bwd_in.a2a.args[1], out_splits) and _same(chain.bwd_in.a2a.args[2], in_splits)
                and _same(chain.bwd_out.a2a.args[1], in_splits) and _same(chain.bwd_out.a2a.args[2], out_splits)):
            raise _CannotCut("its backward all-to-alls do not take the forward's split sizes")
        chain.bwd_dispatch, chain.bwd_grad, chain.bwd_combine = chain.bwd_in.a2a, chain.bwd_in.out, chain.bwd_out.a2a
        chain.bwd_experts = nodes(B, K.EXPERTS)
    for ex in (back, chain.bwd_out) if chain.bwd_out is not None else (back,):
        for n in ex.nodes[:-1]:
            if len(n.users) != 1:
                raise _CannotCut(f"{n.name} of its exchange {ex.a2a.name} is read before its last wait_tensor")
    chain.per_chunk = _per_chunk(chain, disp)
    _check_boundaries(chain, static)
    return chain


def _per_chunk(chain: FunctionalChain, disp: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The dispatch-stage nodes computed from the received counts or rows that the experts read
    (e.g. a flattening view): each chunk computes its own from its counts."""
    stage = set(disp) - set(chain.counts.nodes) - set(chain.tokens.nodes)
    derived, todo = set(), [chain.recv_counts, *chain.tokens.nodes]
    while todo:
        for u in todo.pop().users:
            if u in stage and u not in derived:
                derived.add(u)
                todo.append(u)
    experts = set(chain.fwd_experts) | set(chain.bwd_experts)
    splits = chain.splits  # the chunk's own (Dynamo's graphs read them, e.g. for the received rows)
    need, todo = set(), [a for n in experts for a in n.all_input_nodes if a in derived and a not in splits]
    while todo:
        n = todo.pop()
        if n not in need:
            need.add(n)
            todo.extend(a for a in n.all_input_nodes if a in derived and a not in splits)
    for n in need:
        if not isinstance(n.meta.get("val"), torch.Tensor):
            raise _CannotCut(f"its experts read {n.name} ({op_name(n)}), a host value of the exchanged counts: "
                             f"each chunk would read its own to the host")
    return [n for n in disp if n in need]


def _call(g: torch.fx.Graph, target, args: tuple, tag: Tag, like: torch.fx.Node, kwargs: dict | None = None
          ) -> torch.fx.Node:
    n = g.call_function(target, args, kwargs or {})
    n.meta = {k: v for k, v in like.meta.items() if k not in _FAKE_KEYS}
    n.meta[TAG_KEY] = tag
    return n


def _sum(g: torch.fx.Graph, values: list, tag: Tag, like: torch.fx.Node):
    total = values[0]
    for v in values[1:]:
        total = _call(g, operator.add, (total, v), tag, like)
    return total


def cut(gm: torch.fx.GraphModule, chain: FunctionalChain, chunks: int) -> None:
    """Steps 2 and 3 of ``chunk`` for a functional exchange (see the module docstring)."""
    g, L, last, ep = gm.graph, chain.layer, chunks - 1, chain.ep
    tx, cx = chain.tokens, chain.counts
    x, out_splits, in_splits, group = tx.a2a.args
    sent, got = cx.a2a.args[0], chain.recv_counts
    el = sent.meta["val"].shape[1]
    bounds = [a2a.chunk_bounds(el, c, chunks) for c in range(chunks)]
    device = sent.meta["val"].device
    rows = x.meta["val"].shape[0]
    t0 = Tag(F, L, K.DISPATCH, chunk=0)
    envs: list[dict] = []
    with g.inserting_before(chain.combine):
        def call(target, *args, tag=t0, like=tx.a2a, **kwargs):
            return _call(g, target, args, tag, like, kwargs)

        # every chunk's split sizes: the sent and received counts summed per rank over the chunk's
        # experts, read to the host at once (the counts exchange is chunk 0's)
        pieces = [call(aten.sum.dim_IntList, call(aten.slice.Tensor, src, 1, lo, hi), [1])
                  for src in (sent, got) for lo, hi in bounds]
        host = call(aten.cat.default, pieces)
        if device.type != "cpu":
            host = call(aten._to_copy.default, host, device=torch.device("cpu"))
        items = call(aten.unbind.int, host)
        vals = [call(aten._local_scalar_dense.default, call(operator.getitem, items, i)) for i in range(2 * chunks * ep)]
        send = [vals[c * ep:(c + 1) * ep] for c in range(chunks)]
        recv = [vals[(chunks + c) * ep:(chunks + c + 1) * ep] for c in range(chunks)]
        # the model's split sizes are the chunks' sums (else the counts do not describe the rows)
        for whole, mine, what in ((in_splits, send, "sends"), (out_splits, recv, "receives")):
            for r in range(ep):
                ok = call(operator.eq, _sum(g, [m[r] for m in mine], t0, tx.a2a), whole[r])
                call(aten._assert_scalar.default, ok,
                     f"fxoverlap chunks: layer {L}: the rows its all-to-all {tx.a2a.name} {what} from/to rank {r} "
                     f"are not the sum of its exchanged counts ({cx.a2a.name}); the layer cannot be cut into "
                     f"chunks: set OverlapConfig(chunks=1)")
        rows_of = [_sum(g, s, t0, tx.a2a) for s in send]
        # the rows sorted by chunk (stable: each chunk's rows keep the sender's order), and back
        lid = call(aten.remainder.Scalar, call(aten.arange.default, ep * el, dtype=torch.long, device=device), el)
        cid = None
        for lo, _ in bounds[1:]:
            ge = call(aten._to_copy.default, call(aten.ge.Scalar, lid, lo), dtype=torch.long)
            cid = ge if cid is None else call(aten.add.Tensor, cid, ge)
        if not isinstance(rows, int):  # a dynamic batch: its size as the graph has it
            rows = call(aten.sym_size.int, x, 0)
        expert = call(aten.repeat_interleave.Tensor, call(aten.reshape.default, sent, [-1]), output_size=rows)
        perm = call(operator.getitem, call(aten.sort.stable, call(aten.index.Tensor, cid, [expert]), stable=True), 1)
        inv = call(operator.getitem, call(aten.sort.stable, perm, stable=True), 1)

        def parts(rows_in, tag, like):
            ordered = _call(g, aten.index.Tensor, (rows_in, [perm]), tag, like)
            split = _call(g, aten.split_with_sizes.default, (ordered, rows_of), tag, like)
            return [_call(g, operator.getitem, (split, c), tag, like) for c in range(chunks)]

        def exchange(rows_in, out_s, in_s, tag, like):
            sent_ = _call(g, A2A, (rows_in, out_s, in_s, group), tag, like)
            return sent_, _call(g, WAIT, (sent_,), tag, like)

        def merge(ex: _Exchange, waited: list[torch.fx.Node], tag: Tag) -> None:
            together = _call(g, aten.cat.default, (waited,), tag, ex.a2a)
            _become(ex.out, aten.index.Tensor, (together, [inv]), tag)

        fwd_parts = parts(x, t0, tx.a2a)
        backs = []
        for c, (lo, hi) in enumerate(bounds):
            td = Tag(F, L, K.DISPATCH, chunk=c)
            sent_c, waited = exchange(fwd_parts[c], recv[c], send[c], td, tx.a2a)
            mine = call(aten.slice.Tensor, got, 1, lo, hi, tag=td, like=got)
            counts_c = call(aten.slice_scatter.default, call(aten.zeros_like.default, got, tag=td, like=got), mine,
                            1, lo, hi, tag=td, like=got)
            env = {tx.a2a: sent_c, **dict.fromkeys(tx.waits, waited), got: counts_c}
            for whole, mine in ((out_splits, recv[c]), (in_splits, send[c])):
                env.update((w, m) for w, m in zip(whole, mine) if isinstance(w, torch.fx.Node))
            for n in chain.per_chunk + chain.fwd_rows:
                _copy(g, n, env, c)
            backs.append(exchange(env[chain.combine.args[0]], send[c], recv[c], Tag(F, L, K.COMBINE, chunk=c),
                                  chain.combine)[1])
            envs.append(env)
        merge(chain.back, backs, Tag(F, L, K.COMBINE, chunk=last))
    old = [*tx.nodes, *chain.back.nodes[:-1], *chain.fwd_rows]
    for n in chain.fwd_experts + chain.bwd_experts:  # shared by the chunks: in chunk 0's stage
        if n not in chain.fwd_rows and n not in chain.bwd_rows:
            n.meta[TAG_KEY] = dataclasses.replace(n.meta[TAG_KEY], chunk=0)
    if chain.bwd_in is not None:
        bi, bo = chain.bwd_in, chain.bwd_out
        # the chunks go where the backward experts began, so that no node outside the chain moves
        # (``chunk.with_whole_chains`` compares those stages): a gradient the experts hand out then
        # already comes after the chunks it sums; the experts' shared nodes (of weights) move up
        order = _position(gm)
        first = min(chain.bwd_rows, key=order)
        for n in sorted(chain.bwd_experts, key=order):
            if n not in chain.bwd_rows and order(n) > order(first):
                first.prepend(n)
        with g.inserting_before(first):
            t0b = Tag(B, L, K.COMBINE, chunk=0)
            grad_parts = parts(bi.a2a.args[0], t0b, bi.a2a)
            outs = []
            for c, env in enumerate(envs):
                sent_c, waited = exchange(grad_parts[c], recv[c], send[c], Tag(B, L, K.COMBINE, chunk=c), bi.a2a)
                env.update({bi.a2a: sent_c, **dict.fromkeys(bi.waits, waited)})
                for n in chain.bwd_rows:
                    _copy(g, n, env, c)
                outs.append(exchange(env[bo.a2a.args[0]], send[c], recv[c], Tag(B, L, K.DISPATCH, chunk=c), bo.a2a)[1])
            merge(bo, outs, Tag(B, L, K.DISPATCH, chunk=last))
            for n in chain.summed:  # the old node becomes the sum: the capture's name for the gradient holds
                total = envs[0][n]
                for env in envs[1:-1]:
                    total = _call(g, aten.add.Tensor, (total, env[n]), Tag(B, L, K.EXPERTS, chunk=last), n)
                _become(n, aten.add.Tensor, (total, envs[-1][n]), dataclasses.replace(n.meta[TAG_KEY], chunk=last))
        old += [*bi.nodes, *bo.nodes[:-1], *(n for n in chain.bwd_rows if n not in chain.summed)]
    # the per-chunk nodes' originals go where nothing else reads them (the model's host reads may)
    for n in sorted({*old, *chain.per_chunk}, key=_position(gm), reverse=True):
        if not n.users:
            g.erase_node(n)
    # what is left of the forward dispatch stage (the counts exchange, the model's host reads) is chunk 0's
    for n in g.nodes:
        t = n.meta.get(TAG_KEY)
        if t is not None and (t.direction, t.layer, t.kind) == (F, L, K.DISPATCH) and t.chunk is None:
            n.meta[TAG_KEY] = dataclasses.replace(t, chunk=0)
