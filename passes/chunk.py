"""chunk: cut each MoE layer's dispatch -> experts -> combine into K chunks along its local experts.

Why: with one microbatch in flight (the ``torch.compile`` backend, F(0) and B(N-1) of the
1F1B program, forward-only calls) nothing else can run under a layer's all-to-alls. Cut
into chunks, chunk c+1's dispatch runs under chunk c's experts, and chunk c's combine under
chunk c+1's experts (``schedule`` issues them so).

Why local experts and not tokens (docs/design.md, "Chunks"): everything that reduces over
the microbatch's tokens (the router, its statistics and auxiliary losses, load-balance
buffers, the loss) lies before the dispatch or after the combine and still runs once on all
tokens; each expert's rows travel in exactly one chunk, so its weight gradient is one sum
over its rows, as in eager (computed by its chunk alone); no random op is split.

Contract
--------
Assumes: the tagged joint graph (``tag``, ``side``, ``rng``), or the forward alone. A layer
is cut when its exchange is fxoverlap's generic pair (``fxoverlap::dispatch`` /
``fxoverlap::combine``, lowered by the ``all_to_all`` dispatcher), or torch's functional
``all_to_all_single`` as torchtitan's token dispatcher traces it (``chunk_functional``, which
states its own contract and builds on this module's checks): its dispatch and combine
stages hold only those ops, its experts read only the dispatch's outputs, parameters and
(backward) the saved forward experts values and the gradient the backward combine brings,
its experts are read only by the combine, the backward and (backward) the parameter
gradients, it has at least K local experts, its experts draw no random numbers, and no
experts op reduces over the received rows except into parameter gradients.

Guarantees: for every layer it cuts, chunk c's stages (``Tag.chunk = c``): dispatch
(``fxoverlap::dispatch_chunk``: the rows of the chunk's experts, the other experts' counts
zeroed), experts (a clone of the layer's experts subgraph: the grouped GEMM gives the other
local experts zero rows), combine (``fxoverlap::combine_chunk``); in the backward the same
ops on the gradients and a clone of the backward experts. The combine's output and the
gradient of the dispatch's input are the same rows in the same order as before
(``fxoverlap::merge_chunks``, a copy by slices, in the last chunk's comm stage), and each gradient
the experts hand out is the sum of the chunks' (same value names, so the capture's roles
hold), except a stacked weight's ``fxoverlap::grouped_mm_wgrad``: chunk c computes the groups of
its own experts only (``offs[lo:hi]``) and the gradient is the parts joined in order (``cat``),
the same values without a full-size gradient of zeros per chunk and their sum. Nodes outside
the chains are not touched. A layer it cannot cut stays as it was; :attr:`Chunking.skipped`
says why, per layer. Every new node gets its fake value.

Steps
-----
1. Find each layer's chain and check that it can be cut (:func:`_find_chain`).
2. Per chunk, write the forward chain, then the backward chain (:func:`_cut`).
3. Merge: ``merge_chunks`` for the rows, a sum for each gradient (a ``cat`` of the chunks'
   experts for a grouped GEMM's weight gradient); erase the old chain.
4. Fake values for the whole graph (the capture's fake mode); check that the cloned
   experts are row-wise (:func:`_row_wise`); a layer that is not is put back
   (the pass reruns on the original graph without it).

``min_exchange_bytes`` (the per-device default where a program runs one microbatch per call,
``OverlapConfig.resolved_min_chunk_exchange_bytes``) also leaves whole a layer whose forward
dispatch sends fewer bytes: there the chunks cost more than they hide (measured, config.py).

Entry point: ``chunk(gm, chunks, static, min_exchange_bytes) -> Chunking``. After ``split``, :func:`with_whole_chains` joins
the stages of the cut graph and of the graph before the cut (whose whole chains the microbatches
of the merged steps run: ``OverlapConfig.chunks_in_merged_steps``).
"""

from __future__ import annotations

import copy
import dataclasses
import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.meta import RNG_ORDER_KEY, TAG_KEY, nodes_by_tag, op_name
from fxoverlap.ir.stage import MOE_CHAIN_KINDS, Direction, Stage, StageKind, Tag
from fxoverlap.kernels import a2a
from fxoverlap.ops import (COMBINE_CHUNK_OP, COMBINE_OP, DISPATCH_CHUNK_OP, DISPATCH_OP, GROUPED_MM_WGRAD_OP,
                           MERGE_CHUNKS_OP)
from fxoverlap.passes.dispatcher import propagate_fake_values

F, B, K = Direction.FWD, Direction.BWD, StageKind
_FAKE_KEYS = ("val", "tensor_meta", "unbacked_bindings")


@dataclasses.dataclass
class Chunking:
    """What :func:`chunk` did: the graph, the layers it cut, and why it left the others."""

    graph: torch.fx.GraphModule
    chunks: int
    layers: list[int]
    skipped: dict[int, str]


@dataclasses.dataclass
class _Chain:
    layer: int
    dispatch: torch.fx.Node  # forward fxoverlap::dispatch
    received: torch.fx.Node  # its getitem 0
    recv_counts: torch.fx.Node  # its getitem 1
    combine: torch.fx.Node  # forward fxoverlap::combine
    fwd_experts: list[torch.fx.Node]
    # the backward (None in a forward-only graph): fxoverlap::dispatch of the combine's gradient,
    # its getitem 0, the backward experts, fxoverlap::combine of the received rows' gradient
    bwd_dispatch: torch.fx.Node | None = None
    bwd_grad: torch.fx.Node | None = None
    bwd_experts: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    bwd_combine: torch.fx.Node | None = None
    # set by _check_boundaries: the experts nodes cloned per chunk, and the summed gradients
    fwd_rows: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    bwd_rows: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    summed: list[torch.fx.Node] = dataclasses.field(default_factory=list)

    @property
    def ep(self) -> int:
        return a2a.world_size(a2a.resolve_group(self.dispatch.args[2]))

    @property
    def local_experts(self) -> int:
        return self.dispatch.args[1].meta["val"].shape[0] // self.ep

    def sources(self) -> set[torch.fx.Node]:
        """What the exchanges bring the experts (each chunk has its own)."""
        return {self.received, self.recv_counts} | ({self.bwd_grad} if self.bwd_grad is not None else set())


def _tag(n: torch.fx.Node) -> Tag | None:
    return n.meta.get(TAG_KEY)


def _getitems(n: torch.fx.Node) -> dict[int, torch.fx.Node]:
    return {u.args[1]: u for u in n.users if u.target is operator.getitem}


def _one(nodes: list[torch.fx.Node], op, what: str) -> torch.fx.Node:
    calls = [n for n in nodes if n.target is op]
    rest = [n for n in nodes if n.target is not op and not (n.target is operator.getitem and n.args[0] in calls)]
    if len(calls) != 1 or rest:
        ops = sorted({op_name(n) for n in nodes if n.target is not operator.getitem})
        found = ", ".join(ops[:4]) + (f" and {len(ops) - 4} more ops" if len(ops) > 4 else "") or "nothing"
        raise _CannotCut(f"its {what} stage is not one fxoverlap.{op._schema.name.split('::')[1]} "
                         f"(it runs {found}): only fxoverlap's generic dispatch/combine (dispatcher='all_to_all') "
                         f"is cut into chunks")
    return calls[0]


class _CannotCut(FxOverlapError):
    """Why a layer stays whole (internal: the pass reports it in ``Chunking.skipped``, never raises it)."""


def _find_chain(by_tag: dict[tuple, list[torch.fx.Node]], layer: int, chunks: int, static: set[str]) -> _Chain:
    """Step 1: the layer's chain, or ``_CannotCut`` with the reason."""
    def nodes(direction, kind):
        return by_tag.get((direction, layer, kind), [])

    d = _one(nodes(F, K.DISPATCH), DISPATCH_OP, "forward dispatch")
    c = _one(nodes(F, K.COMBINE), COMBINE_OP, "forward combine")
    items = _getitems(d)
    if d.args[3] is not None or set(items) != {0, 1}:
        raise _CannotCut(f"its dispatch {d.name} is not a forward dispatch with both outputs read")
    chain = _Chain(layer, d, items[0], items[1], c, nodes(F, K.EXPERTS))
    el = chain.local_experts
    if el < chunks:
        raise _CannotCut(f"it has {el} local expert(s), fewer than chunks={chunks} (chunks are cut along local experts)")
    if c.args[1] is not chain.recv_counts or c.args[2] is not d.args[1]:
        raise _CannotCut(f"its combine {c.name} does not take the dispatch's counts")
    if nodes(B, K.COMBINE) or nodes(B, K.DISPATCH):
        chain.bwd_dispatch = _one(nodes(B, K.COMBINE), DISPATCH_OP, "backward combine")
        chain.bwd_combine = _one(nodes(B, K.DISPATCH), COMBINE_OP, "backward dispatch")
        grads = _getitems(chain.bwd_dispatch)
        if set(grads) - {0, 1} or 0 not in grads:
            raise _CannotCut(f"its backward exchange {chain.bwd_dispatch.name} hands out more than rows")
        chain.bwd_grad = grads[0]
        chain.bwd_experts = nodes(B, K.EXPERTS)
        bd, bc = chain.bwd_dispatch, chain.bwd_combine
        if bd.args[1] is not d.args[1] or bd.args[3] is not chain.recv_counts \
                or bc.args[1] is not chain.recv_counts or bc.args[2] is not d.args[1]:
            raise _CannotCut("its backward exchanges do not take the forward dispatch's counts")
    _check_boundaries(chain, static)
    return chain


def _of_weights_only(n: torch.fx.Node, static: set[str]) -> bool:
    """Whether ``n`` is computed from parameters and buffers alone (a transposed weight): the
    same value for every chunk."""
    todo, seen = [n], set()
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        if a.op == "placeholder" and a.name not in static:
            return False
        todo.extend(a.all_input_nodes)
    return True


def _check_boundaries(chain: _Chain, static: set[str]) -> None:
    """Which experts nodes work on the chunk's rows (``chain.fwd_rows`` / ``bwd_rows``, cloned per
    chunk; the rest, e.g. a transposed weight, is shared), and that rows leave the chain only
    through its exchanges, and (backward) as gradients summed over the chunks (``chain.summed``)."""
    fwd, bwd = set(chain.fwd_experts), set(chain.bwd_experts)
    for n in chain.fwd_experts + chain.bwd_experts:
        if RNG_ORDER_KEY in n.meta:
            raise _CannotCut(f"its experts draw random numbers ({n.name}, {op_name(n)}): chunks would change "
                             f"what they draw")
    sources = chain.sources()
    rows, todo = set(), [u for s_ in sources for u in s_.users]
    while todo:  # everything in the experts that depends on what the exchanges bring
        n = todo.pop()
        if n in (fwd | bwd) and n not in rows:
            rows.add(n)
            todo.extend(n.users)
    chain.fwd_rows = [n for n in chain.fwd_experts if n in rows]
    chain.bwd_rows = [n for n in chain.bwd_experts if n in rows]
    for n in chain.fwd_rows + chain.bwd_rows:
        for a in n.all_input_nodes:
            if a not in rows and a not in sources and a not in fwd and a not in bwd and not _of_weights_only(a, static):
                raise _CannotCut(f"its experts read {a.name} ({op_name(a)}), which is neither what the exchanges "
                                 f"bring nor computed from parameters alone")
    for n in chain.fwd_rows:
        for u in n.users:
            if u not in fwd and u not in bwd and u is not chain.combine and u is not chain.bwd_dispatch:
                raise _CannotCut(f"{n.name} ({op_name(n)}) of its experts is read by {u.name} ({op_name(u)}) "
                                 f"outside the dispatch -> experts -> combine chain")
    if chain.combine.args[0] not in rows:
        raise _CannotCut("its combine does not take the experts' output")
    # a backward value that leaves the chain other than through the exchange is a gradient
    # contribution (the backward is linear in the incoming gradient): its chunks are summed
    chain.summed = [n for n in chain.bwd_rows if any(u not in bwd and u is not chain.bwd_combine for u in n.users)]
    for n in chain.summed:
        if free_unbacked_symbols(n.meta.get("val")):
            raise _CannotCut(f"{n.name} ({op_name(n)}) of its backward experts hands rows to {next(iter(n.users)).name} "
                             f"outside the chain")
    if chain.bwd_combine is not None and chain.bwd_combine.args[0] not in rows:
        raise _CannotCut("its backward dispatch does not take the backward experts' output")


def _new(graph: torch.fx.Graph, target, args: tuple, tag: Tag, like: torch.fx.Node) -> torch.fx.Node:
    n = graph.call_function(target, args)
    n.meta = {k: v for k, v in like.meta.items() if k not in _FAKE_KEYS}
    n.meta[TAG_KEY] = tag
    return n


def _copy(graph: torch.fx.Graph, n: torch.fx.Node, env: dict, chunk: int) -> torch.fx.Node:
    new = graph.node_copy(n, lambda a: env.get(a, a))
    for k in _FAKE_KEYS:
        new.meta.pop(k, None)
    new.meta[TAG_KEY] = dataclasses.replace(n.meta[TAG_KEY], chunk=chunk)
    env[n] = new
    return new


def _cut(gm: torch.fx.GraphModule, chain: _Chain, chunks: int) -> None:
    """Steps 2 and 3 for one layer."""
    g, d, L, last = gm.graph, chain.dispatch, chain.layer, chunks - 1
    x, counts, group = d.args[0], d.args[1], d.args[2]
    envs: list[dict] = []
    with g.inserting_before(chain.combine):
        parts = []
        for c in range(chunks):
            first = envs[0][chain.recv_counts] if envs else None  # its host counts serve every chunk
            dc = _new(g, DISPATCH_CHUNK_OP, (x, counts, group, None, -1, c, chunks, first),
                      Tag(F, L, K.DISPATCH, chunk=c), d)
            env = {chain.received: _new(g, operator.getitem, (dc, 0), Tag(F, L, K.DISPATCH, chunk=c), chain.received),
                   chain.recv_counts: _new(g, operator.getitem, (dc, 1), Tag(F, L, K.DISPATCH, chunk=c),
                                           chain.recv_counts)}
            for n in chain.fwd_rows:
                _copy(g, n, env, c)
            # the chunk's received rows, which its backward exchange promises to return
            env["rows"] = _new(g, torch.ops.aten.sym_size.int, (env[chain.received], 0),
                               Tag(F, L, K.EXPERTS, chunk=c), chain.received)
            parts.append(_new(g, COMBINE_CHUNK_OP, (env[chain.combine.args[0]], env[chain.recv_counts], counts, group,
                                                    c, chunks), Tag(F, L, K.COMBINE, chunk=c), chain.combine))
            envs.append(env)
        first = envs[0][chain.recv_counts]
    # the old exchange becomes the merge, so the value keeps its name: the stages that read it
    # are those of the uncut graph (chunk.with_whole_chains)
    _become(chain.combine, MERGE_CHUNKS_OP, (parts, counts, chain.ep, chain.combine.args[4], first),
            Tag(F, L, K.COMBINE, chunk=last))
    old = [d, chain.received, chain.recv_counts, *chain.fwd_rows]
    for n in chain.fwd_experts + chain.bwd_experts:  # shared by the chunks: in chunk 0's stage
        if n not in chain.fwd_rows and n not in chain.bwd_rows:
            n.meta[TAG_KEY] = dataclasses.replace(n.meta[TAG_KEY], chunk=0)
    if chain.bwd_dispatch is not None:
        bd, bc = chain.bwd_dispatch, chain.bwd_combine
        grad_rows = bd.args[0]
        grads = chain.summed
        with g.inserting_before(bc):
            parts = []
            for c, env in enumerate(envs):
                dc = _new(g, DISPATCH_CHUNK_OP, (grad_rows, counts, group, env[chain.recv_counts], env["rows"], c,
                                                 chunks, None), Tag(B, L, K.COMBINE, chunk=c), bd)
                env[chain.bwd_grad] = _new(g, operator.getitem, (dc, 0), Tag(B, L, K.COMBINE, chunk=c), chain.bwd_grad)
                for n in chain.bwd_rows:
                    _copy(g, n, env, c)
                parts.append(_new(g, COMBINE_CHUNK_OP, (env[bc.args[0]], env[chain.recv_counts], counts, group, c,
                                                        chunks), Tag(B, L, K.DISPATCH, chunk=c), bc))
            _become(bc, MERGE_CHUNKS_OP, (parts, counts, chain.ep, bc.args[4], first), Tag(B, L, K.DISPATCH, chunk=last))
            for n in grads:  # the old node becomes the sum, so the capture's name for the gradient holds
                if _wgrad_of_local_experts(n, chain.recv_counts, chain.local_experts):
                    # each chunk's weight gradient of its own experts only, joined: no zeros
                    # written for the other experts and no sum of full-size gradients
                    for c, env in enumerate(envs):
                        w = env[n]
                        lo, hi = a2a.chunk_bounds(chain.local_experts, c, chunks)
                        offs = _new(g, torch.ops.aten.slice.Tensor, (w.args[2], 0, lo, hi), w.meta[TAG_KEY], w)
                        w.args = (w.args[0], w.args[1], offs)
                    _become(n, torch.ops.aten.cat.default, ([env[n] for env in envs], 0),
                            dataclasses.replace(n.meta[TAG_KEY], chunk=last))
                    continue
                total = envs[0][n]
                for env in envs[1:-1]:
                    total = _new(g, torch.ops.aten.add.Tensor, (total, env[n]), Tag(B, L, K.EXPERTS, chunk=last), n)
                _become(n, torch.ops.aten.add.Tensor, (total, envs[-1][n]),
                        dataclasses.replace(n.meta[TAG_KEY], chunk=last))
        old += [bd, *_getitems(bd).values(), *(n for n in chain.bwd_rows if n not in grads)]
    for n in sorted(old, key=_position(gm), reverse=True):
        g.erase_node(n)


# What may lie between the received counts and a grouped GEMM's offsets for the groups to be the
# local experts in order, each group before a chunk's first expert empty: elementwise maps that keep
# every expert in its place and send 0 to 0 (so not adding a constant). The arithmetic ops count
# only with a number as their other operand (one node among the args).
_ORDER_KEEPING = {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default, torch.ops.prims.convert_element_type.default,
                  torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, torch.ops.aten.floor_divide.default,
                  torch.ops.aten.floor_divide.Scalar, torch.ops.aten.remainder.Scalar}


def _wgrad_of_local_experts(n: torch.fx.Node, recv_counts: torch.fx.Node, local_experts: int) -> bool:
    """Whether the summed gradient ``n`` is ``fxoverlap::grouped_mm_wgrad(x, dy, offs)`` with one
    group per local expert, in order: ``offs`` is the running sum of the received counts summed
    over the source ranks, through order-keeping arithmetic only. Then chunk ``c``'s part is the
    groups of its experts alone, ``offs[lo:hi]`` (every group before ``lo`` has no rows in the
    chunk, so its rows start at 0), and the whole gradient is the chunks' parts joined in order.
    Anything else between the counts and the offsets keeps the sum of full-size gradients."""
    if n.target is not GROUPED_MM_WGRAD_OP or not isinstance(n.args[2], torch.fx.Node):
        return False
    val, got = n.meta.get("val"), recv_counts.meta.get("val")
    if val is None or got is None or got.dim() != 2 or val.shape[0] != local_experts:
        return False
    node, seen_cumsum, seen_sum = n.args[2], False, False
    while node is not recv_counts:
        args = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if node.op != "call_function" or len(args) != 1:
            return False
        if node.target is torch.ops.aten.cumsum.default and node.args[1] in (0, -1) and not seen_cumsum:
            seen_cumsum = True
        elif (node.target is torch.ops.aten.sum.dim_IntList and list(node.args[1]) in ([0], [-2])
              and seen_cumsum and not seen_sum and len(node.args) == 2 and not node.kwargs.get("keepdim")):
            seen_sum = True
        elif node.target not in _ORDER_KEEPING:
            return False
        node = args[0]
    return seen_cumsum and seen_sum


def _become(n: torch.fx.Node, target, args: tuple, tag: Tag) -> None:
    """Make ``n`` compute ``target(*args)`` under ``tag``, keeping its name and its users."""
    n.target, n.args, n.kwargs = target, args, {}
    for k in _FAKE_KEYS:
        n.meta.pop(k, None)
    n.meta[TAG_KEY] = tag


def _sort(graph: torch.fx.Graph) -> None:
    """Put every node after its inputs, otherwise keeping the graph's order (a gradient turned
    into the chunks' sum now reads nodes inserted after it)."""
    import heapq

    index = {n: i for i, n in enumerate(graph.nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in graph.nodes}
    ready = [(index[n], n.name) for n, k in waiting.items() if k == 0]
    by_name = {n.name: n for n in graph.nodes}
    heapq.heapify(ready)
    last = None
    while ready:
        n = by_name[heapq.heappop(ready)[1]]
        if last is not None and last.next is not n:
            last.append(n)
        last = n
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (index[u], u.name))


def _position(gm: torch.fx.GraphModule):
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return order.__getitem__


def _row_wise(gm: torch.fx.GraphModule, layer: int) -> str | None:
    """Step 4: why the cut layer's experts are not row-wise, or None. A clone that turns the
    chunk's rows into a value without them reduces over rows: allowed only where what it
    computes reaches nothing but rows-free values (the parameter gradients)."""
    def rows(n):
        return bool(free_unbacked_symbols(n.meta.get("val")))

    for n in gm.graph.nodes:
        t = _tag(n)
        if t is None or t.layer != layer or t.chunk is None or t.kind is not K.EXPERTS or n.op != "call_function":
            continue
        if not isinstance(n.meta.get("val"), torch.Tensor) or rows(n) or not any(rows(a) for a in n.all_input_nodes):
            continue  # sizes and runtime asserts on them hand out no values; row-shaped values are per row
        if t.direction is F or any(rows(u) for u in _descendants(n)):
            return (f"{n.name} ({op_name(n)}) of its experts reduces over the received rows, which a chunk holds "
                    f"only some of")
    return None


def _descendants(n: torch.fx.Node) -> set[torch.fx.Node]:
    seen, todo = set(), list(n.users)
    while todo:
        u = todo.pop()
        if u not in seen and u.op == "call_function":
            seen.add(u)
            todo.extend(u.users)
    return seen


def _sent_bytes(dispatches: list[torch.fx.Node]) -> int | None:
    """What a layer's forward dispatch sends, in bytes: its largest exchange's input (a
    functional dispatch exchanges its counts first); None where not known at compile time."""
    from fxoverlap.passes import chunk_functional

    sizes = []
    for n in dispatches:
        if n.target in (DISPATCH_OP, chunk_functional.A2A) and isinstance(n.args[0], torch.fx.Node):
            val = n.args[0].meta.get("val")
            if not isinstance(val, torch.Tensor):
                return None
            try:
                sizes.append(int(val.numel()) * val.element_size())
            except (TypeError, RuntimeError):  # a data-dependent row count
                return None
    return max(sizes, default=None)


def chunk(gm: torch.fx.GraphModule, chunks: int, static: set[str] = frozenset(),
          min_exchange_bytes: int = 0) -> Chunking:
    """Cut every layer that can be cut into ``chunks`` chunks along its local experts.
    ``static``: the placeholders of parameters and buffers (values read by the experts that
    come from them alone, e.g. a transposed weight, are shared by every chunk).
    ``min_exchange_bytes``: leave whole a layer whose forward dispatch sends fewer bytes."""
    from fxoverlap.passes import chunk_functional  # it builds on this module's helpers

    if chunks <= 1:
        return Chunking(gm, 1, [], {})
    skipped: dict[int, str] = {}
    if min_exchange_bytes > 0:
        for (direction, layer, kind), nodes in nodes_by_tag(gm.graph).items():
            if direction is not F or kind is not K.DISPATCH:
                continue
            sent = _sent_bytes(nodes)
            if sent is not None and sent < min_exchange_bytes:
                skipped[layer] = (f"its dispatch sends {sent / 2**20:.0f} MiB a microbatch, under the "
                                  f"{min_exchange_bytes / 2**20:.0f} MiB from which chunks paid with one microbatch "
                                  f"per call (a set OverlapConfig.chunks cuts it anyway)")
    while True:
        out = copy.deepcopy(gm)
        by_tag = nodes_by_tag(out.graph)
        layers = sorted({t.layer for n in out.graph.nodes if (t := _tag(n)) is not None and t.kind is K.DISPATCH})
        cut = []
        for layer in layers:
            if layer in skipped:
                continue
            functional = any(n.target is chunk_functional.A2A for n in by_tag.get((F, layer, K.DISPATCH), []))
            try:
                chain = (chunk_functional.find_chain if functional else _find_chain)(by_tag, layer, chunks, static)
            except _CannotCut as why:
                skipped[layer] = str(why)
                continue
            (chunk_functional.cut if functional else _cut)(out, chain, chunks)
            cut.append(layer)
        _sort(out.graph)
        out.graph.lint()
        out.recompile()
        try:  # the layers left whole read what they read before: their values stand
            propagate_fake_values(out, {n for n in out.graph.nodes if (t := _tag(n)) is not None and t.layer in cut})
        except Exception as e:  # noqa: BLE001  (a cut the checks missed: leave every layer whole, say why)
            if not cut:
                raise
            skipped.update({layer: f"the cut graph does not propagate ({type(e).__name__}: {str(e)[:200]})"
                            for layer in cut})
            continue
        bad = {layer: why for layer in cut if (why := _row_wise(out, layer)) is not None}
        if not bad:
            return Chunking(out, chunks, cut, dict(sorted(skipped.items())))
        skipped.update(bad)


def with_whole_chains(cut: list[Stage], whole: list[Stage]) -> tuple[list[Stage], str | None]:
    """The stages of the graph ``chunk`` cut, plus the whole chains (dispatch, experts, combine,
    their parts) of the graph before the cut: ``schedule`` runs, per microbatch, a layer's
    chunks or its whole chain. Both must read and hand on the same values: every stage outside
    the chains is the same in both (same name, inputs, outputs and code), and each layer's
    whole chain reads and produces what its chunks read and produce from and for the rest.
    Where that does not hold, the cut stages alone, and why (then every microbatch runs the
    chunks)."""
    cut_layers = {s.layer for s in cut if s.chunk is not None}

    def in_chain(s: Stage) -> bool:  # forward and backward: the backward reads what the forward saved
        return s.kind in MOE_CHAIN_KINDS and s.layer in cut_layers

    rest = {s.name: s for s in cut if not in_chain(s)}
    other = {s.name: s for s in whole if not in_chain(s)}
    if rest.keys() != other.keys():
        return cut, f"the stages outside the chains differ ({sorted(rest.keys() ^ other.keys())[:4]})"
    for name, s in rest.items():
        o = other[name]
        if (s.inputs, s.outputs) != (o.inputs, o.outputs) or s.graph_module.code != o.graph_module.code:
            return cut, f"stage {name} differs between the cut graph and the whole one"
    rest_reads = {v for s in rest.values() for v in s.inputs}
    for layer in cut_layers:
        mine = [s for s in cut if in_chain(s) and s.layer == layer]
        theirs = [s for s in whole if in_chain(s) and s.layer == layer]
        if _boundary(mine, rest_reads) != _boundary(theirs, rest_reads):
            return cut, f"layer {layer}'s chunks and its whole chain read or hand on different values"
    return cut + [s for s in whole if in_chain(s)], None


def _boundary(chain: list[Stage], rest_reads: set[str]) -> tuple[frozenset[str], frozenset[str]]:
    """What a chain reads from outside it, and what it hands on: to the other stages
    (``rest_reads``: what they read) and to the graph's outputs (what no stage reads)."""
    made = {v for s in chain for v in s.outputs}
    read = {v for s in chain for v in s.inputs}
    return frozenset(read - made), frozenset((made & rest_reads) | (made - read - rest_reads))
