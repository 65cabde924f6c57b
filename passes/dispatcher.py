"""dispatcher: lower fxoverlap's generic EP ops to the backend ``OverlapConfig.dispatcher`` names.

Models write one interface (``ops.dispatch``/``ops.combine``, or the token-once
``ops.token_dispatch``/``ops.token_combine``); this pass picks how it runs, before
``tag``, so every backend looks the same to tag/split/schedule:

* ``"all_to_all"``: the generic ops, graph untouched (one host read per dispatch).
* ``"padded"``: static shapes, a fixed row capacity per rank-to-rank link, one
  equal-split all-to-all (gloo and NCCL), zero host reads; moves the padding too.
* ``"symm_mem"``: the same layout, but the real rows are written straight into the
  peers' symmetric memory (CUDA, one host); zero host reads, only real rows move.
* ``"auto"``: ``symm_mem`` where it can run and the EP group has more than one rank, else
  ``all_to_all``.
* ``"deepep"`` / ``"hybridep"``: recognised, not built. The model calls torchtitan's
  ``deepep::`` / ``hybridep::`` ops itself (``tag`` knows them under every setting); the
  graph is left alone, and fxoverlap's generic ops are refused (they are not lowered to
  DeepEP yet). ``OverlapConfig`` checks that ``deep_ep`` is there.

Contract
  Assumes: the captured graph (joint or forward-only) before ``tag``; every rank of the
  EP group captured the same shapes (links have one capacity everywhere); the code
  between a dispatch and its combine treats rows independently, apart from
  ``ops.grouped_mm``'s weight gradient (which stops at the real rows): the static
  backends pad the expert input, and the values computed on padding rows are
  unspecified.
  Guarantees: each MoE layer's comm nodes (forward dispatch and combine, and their
  backward counterparts) become ``fxoverlap.dispatch_ops`` static ops with one per-link
  capacity, keeping their node meta (layer annotation, ``seq_nr``, direction), so
  ``tag`` sees the same layers; every ``meta["val"]`` is re-propagated with the
  capture's fake mode, so no unbacked size is left and ``split`` marks the expert
  stages capturable; the default capacity is the worst case (dropless stays dropless,
  nothing is flagged or read); below it, the returned ``Lowering.overflow`` (kept as ``Capture.overflow``) names the device
  buffer the dispatches write their busiest link into. Raises ``DispatcherError`` for
  a backend that cannot run here, and for a reduction over the padded rows.

Steps
  1. ``_resolve``: ``"auto"`` -> a backend; reject what cannot run.
  2. ``find_sites``: each forward dispatch, the nodes that reuse its layout (linked
     through its counts / slot output) and the link capacity.
  3. ``rewrite_sites``: swap each node for its static op (plus the overflow buffer).
  4. ``_propagate``: fake-tensor propagation with the capture's fake mode.
  5. ``check_row_wise``: a second fake run with every capacity one larger finds the
     values sized by the padded rows; refuse nodes that reduce them away.
  6. ``_fold_sizes``: sizes that became constants become literals.

Entry point: ``dispatcher(gm, backend="auto", capacity_factor=None) -> GraphModule``.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap import ops  # noqa: F401  (registers the generic ops)
from fxoverlap.config import DEEPEP_DISPATCHERS, DISPATCHERS
from fxoverlap.dispatch_ops import STATIC_OPS
from fxoverlap.ir.capture import OverflowFlags, OverflowSite
from fxoverlap.kernels import a2a
from fxoverlap.ir.meta import LAYER_KEY

BACKENDS = DISPATCHERS  # one list, fxoverlap/config.py's
_OVERFLOW_BUFFER = "_fxoverlap_dispatch_overflow"

_fx = torch.ops.fxoverlap
_GENERIC = {
    _fx.dispatch.default: "dispatch",
    _fx.combine.default: "combine",
    _fx.token_dispatch.default: "token_dispatch",
    _fx.token_dispatch_backward.default: "token_dispatch_backward",
    _fx.token_combine.default: "token_combine",
    _fx.token_combine_backward.default: "token_combine_backward",
}
# Where each op takes the layout its forward dispatch made: per expert the received
# counts (dispatch output 1), token-once the slot map (token_dispatch output 4).
_LAYOUT_ARG = {"dispatch": 3, "combine": 1, "token_dispatch_backward": 4, "token_combine": 2,
               "token_combine_backward": 2}
_LAYOUT_OUTPUT = {"dispatch": 1, "token_dispatch": 4}
_STATIC_TARGETS = set(STATIC_OPS.values())
# Ops that may read values sized by the padded rows without being so sized themselves:
# the comm ops, grouped_mm's weight gradient and its FP8 version (they stop at the real rows), unpacking.
_GROUP_AWARE = {_fx.grouped_mm_wgrad.default, _fx.grouped_mm_fp8_wgrad.default, *_STATIC_TARGETS, operator.getitem}


class DispatcherError(FxOverlapError, RuntimeError):
    """The configured dispatcher cannot lower this graph; the message says why and what to change."""


@dataclasses.dataclass(frozen=True)
class Site:
    """One MoE layer's exchange: its forward dispatch and the nodes that reuse its layout."""

    layer: int | None
    dispatch: torch.fx.Node
    reusers: tuple[torch.fx.Node, ...]
    group_name: str
    capacity: int  # rows per rank-to-rank link
    worst_case: int  # a link never carries more
    share: float  # rows per link if routing were balanced (what a capacity factor multiplies)


def _val(node) -> torch.Tensor:
    return node.meta["val"]


def _getitem(node: torch.fx.Node, i: int) -> torch.fx.Node | None:
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == i), None)


def _capacity(node: torch.fx.Node, kind: str, ep: int, factor: float | None) -> tuple[int, int, float]:
    """(capacity, worst case, balanced share) in rows per link for a forward dispatch node."""
    if kind == "token_dispatch":
        t, k = _val(node.args[1]).shape
        worst, share = t, t * min(k, ep) / ep  # a token goes to a rank at most once
    else:
        n, out_rows = _val(node.args[0]).shape[0], node.args[4]
        if out_rows >= 0:  # static_rows: every rank sends the same rows to every expert
            return n // ep, n // ep, n / ep
        worst, share = n, n / ep
    if factor is None:
        return worst, worst, share
    return min(worst, max(1, math.ceil(factor * share))), worst, share


def find_sites(gm: torch.fx.GraphModule, factor: float | None) -> list[Site]:
    """Each forward dispatch with its reusers; every generic comm node belongs to one site."""
    sites, claimed = [], set()
    for node in gm.graph.nodes:
        kind = _GENERIC.get(node.target)
        if kind not in _LAYOUT_OUTPUT or (kind == "dispatch" and node.args[3] is not None):
            continue
        layout = _getitem(node, _LAYOUT_OUTPUT[kind])
        reusers = tuple(
            u for u in (layout.users if layout is not None else ())
            if (k := _GENERIC.get(u.target)) in _LAYOUT_ARG and u.args[_LAYOUT_ARG[k]] is layout
        )
        group_name = node.args[4 if kind == "token_dispatch" else 2]
        ep = a2a.world_size(a2a.resolve_group(group_name))
        layer = (node.meta.get("custom") or {}).get(LAYER_KEY)
        sites.append(Site(layer, node, reusers, group_name, *_capacity(node, kind, ep, factor)))
        claimed.update((node, *reusers))
    for node in gm.graph.nodes:
        if node.target in _GENERIC and node not in claimed:
            raise DispatcherError(
                f"node {node.name} ({node.target}) does not reuse the layout of a forward dispatch in this graph "
                f"(its counts or slot map come from elsewhere), so it cannot be lowered to a static dispatcher; "
                f"use OverlapConfig(dispatcher='all_to_all')"
            )
    return sites


def rewrite_sites(gm: torch.fx.GraphModule, sites: list[Site], transport: str) -> OverflowFlags | None:
    """Swap every site's nodes for static ops; give flagged dispatches the overflow buffer (returned
    with the sites it flags; None when no capacity is below the worst case)."""
    graph = gm.graph
    flagged = [s for s in sites if s.capacity < s.worst_case]
    flags = None
    if flagged:
        device = _val(sites[0].dispatch.args[0]).device
        gm.register_buffer(_OVERFLOW_BUFFER, torch.zeros(len(flagged), dtype=torch.long, device=device))
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            flags = graph.get_attr(_OVERFLOW_BUFFER)
    overflow_sites = []
    for site in sites:
        for node in (site.dispatch, *site.reusers):
            kind = _GENERIC[node.target]
            args = (*(node.args[:4] if kind == "dispatch" else node.args), site.capacity, transport)
            if kind in ("dispatch", "token_dispatch"):  # the overflow buffer (or None) and its site
                args = (*args, flags, flagged.index(site)) if node is site.dispatch and site in flagged else (
                    *args, None, 0)
            with graph.inserting_before(node):
                new = graph.call_function(STATIC_OPS[kind], args, dict(node.kwargs))
            new.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta", "unbacked_bindings")}
            node.replace_all_uses_with(new)
            name = node.name
            graph.erase_node(node)
            new.name = name  # free again: stage inputs/outputs keep their all_to_all names
            if node is site.dispatch and site in flagged:
                overflow_sites.append(OverflowSite(site.layer, new.name, site.capacity, site.worst_case, site.share))
    return OverflowFlags(_OVERFLOW_BUFFER, tuple(overflow_sites), sites[0].group_name) if flagged else None


@dataclasses.dataclass(frozen=True)
class Lowering:
    """What :func:`dispatcher` chose: the backend the EP ops run on, the overflow flags of a
    capacity below the worst case (None: nothing can overflow), the EP group size of the
    exchanges and the names of their groups (None: the graph has none of fxoverlap's, so their
    group is not known here)."""

    backend: str
    overflow: OverflowFlags | None = None
    ep_size: int | None = None
    groups: tuple[str, ...] | None = None


class _Prop(FakeTensorProp):
    """FakeTensorProp; with ``rerun`` given, only those nodes, nodes with no value yet and nodes
    reading a node that ran get a new value: the others read what they read before, so they keep
    theirs (and the unbacked sizes they made: running a data-dependent op again makes new ones,
    and on torch 2.11 some decompositions guard on them, e.g. ``native_dropout``'s ``uniform_``
    on an experts-sized tensor)."""

    def __init__(self, gm: torch.fx.GraphModule, mode, rerun: set[torch.fx.Node] | None = None):
        super().__init__(gm, mode)
        self._rerun, self._ran = rerun, set()

    def run_node(self, n: torch.fx.Node):
        if self._keeps(n):
            return n.meta.get("val")
        if n.op == "call_function":  # placeholders and constants hand on what they did before
            self._ran.add(n)
        return super().run_node(n)

    def _keeps(self, n: torch.fx.Node) -> bool:
        if (self._rerun is None or n.op != "call_function" or n in self._rerun
                or any(a in self._ran for a in n.all_input_nodes)):
            return False
        if "val" in n.meta:
            return True
        schema = getattr(n.target, "_schema", None)  # an op that returns nothing (an assert) has no value
        return schema is not None and not schema.returns

    def get_attr(self, target, args, kwargs):  # constants (the overflow buffer) enter as fakes
        val = super().get_attr(target, args, kwargs)
        return self._mode.from_tensor(val) if isinstance(val, torch.Tensor) else val


def _fakes(gm: torch.fx.GraphModule) -> tuple[object, list]:
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return _val(placeholders[0]).fake_mode, [_val(p) for p in placeholders]


def _sizes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.sym_size.int))


def propagate_fake_values(gm: torch.fx.GraphModule, rerun: set[torch.fx.Node] | None = None) -> None:
    """Recompute ``meta["val"]`` with the capture's fake mode: of every node, or with ``rerun``
    (the nodes a rewrite changed in place; new nodes have no value yet) of those and of what
    reads them, directly or not."""
    for node in _sizes(gm):  # e.g. the backward dispatch's old row count, now unused
        if not node.users:
            gm.graph.erase_node(node)
    mode, args = _fakes(gm)
    _Prop(gm, mode, rerun).propagate_dont_convert_inputs(*args)
    for node in _sizes(gm):  # torch 2.11's FakeTensorProp keeps a size's old value when it becomes an int
        node.meta["val"] = _val(node.args[0]).shape[node.args[1]]


def _fold_sizes(gm: torch.fx.GraphModule) -> None:
    """Sizes that are now constants become literals (and the size nodes go)."""
    for node in _sizes(gm):
        size = node.meta["val"]
        if isinstance(size, int):
            for user in list(node.users):
                user.args = map_arg(user.args, lambda a: size if a is node else a)
                user.kwargs = map_arg(user.kwargs, lambda a: size if a is node else a)
            gm.graph.erase_node(node)
    gm.recompile()


def _shapes(val) -> tuple:
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else _known_bool(v) for v in vals)


def _known_bool(v):
    """A SymBool the shape env decides (a pipeline stage's ``u >= 0`` size check: True) as
    that bool, else ``v``: torch 2.11 cannot compare such a SymBool with the probe's bool
    (sympy: "BooleanAtom not allowed in this context"); torch 2.13 decides it the same way."""
    if isinstance(v, torch.SymBool):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        if statically_known_true(v):
            return True
        if statically_known_true(torch.sym_not(v)):
            return False
    return v


class _Probe(torch.fx.Interpreter):
    """Runs ``gm`` on fakes with every link capacity one row larger, recording shapes: the
    values whose shapes change are the ones sized by the padded rows."""

    def __init__(self, gm: torch.fx.GraphModule, mode):
        super().__init__(gm)
        self.mode, self.shapes = mode, {}

    def get_attr(self, target, args, kwargs):
        return self.mode.from_tensor(super().get_attr(target, args, kwargs))

    def call_function(self, target, args, kwargs):
        if target in _STATIC_TARGETS:
            i = next(j for j, a in enumerate(target._schema.arguments) if a.name == "capacity")
            args = (*args[:i], args[i] + 1, *args[i + 1:])
        return super().call_function(target, args, kwargs)

    def run_node(self, n):
        out = super().run_node(n)
        self.shapes[n] = _shapes(out)
        return out


def check_row_wise(gm: torch.fx.GraphModule) -> None:
    """Raise if a node turns a value sized by the padded rows into one that is not (a
    reduction over rows), unless it is a comm op or ``grouped_mm``'s weight gradient."""
    mode, args = _fakes(gm)
    probe = _Probe(gm, mode)
    with mode:
        probe.run(*args)
    sized = {n for n, shapes in probe.shapes.items() if shapes != _shapes(n.meta.get("val"))}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in sized or node.target in _GROUP_AWARE:
            continue
        src = next((p for p in node.all_input_nodes if p in sized and isinstance(_val(p), torch.Tensor)), None)
        if src is not None:
            layer = (node.meta.get("custom") or {}).get(LAYER_KEY)
            raise DispatcherError(
                f"layer {layer}: node {node.name} ({node.target}) reduces over the padded rows of an expert input "
                f"({src.name}, shape {list(_val(src).shape)}); the static dispatchers pad that input past its real rows "
                f"with unspecified values, so a reduction over rows (a bias gradient, a dense Linear's weight "
                f"gradient) would read them. Give experts their weights through fxoverlap.ops.grouped_mm (its "
                f"gradient stops at the real rows), or use OverlapConfig(dispatcher='all_to_all')"
            )


def _resolve(backend: str, gm: torch.fx.GraphModule, sites: list[Site]) -> str:
    if backend not in BACKENDS:
        raise DispatcherError(f"OverlapConfig.dispatcher must be one of {BACKENDS}, got {backend!r}")
    if backend in DEEPEP_DISPATCHERS:  # the model calls torchtitan's ops; nothing to lower
        if sites:
            raise DispatcherError(
                f"OverlapConfig(dispatcher={backend!r}): node {sites[0].dispatch.name} ({sites[0].dispatch.target}) is "
                f"fxoverlap's own dispatch, which fxoverlap does not yet lower to DeepEP; with this dispatcher the "
                f"model must call torchtitan's {backend}:: ops itself (its "
                f"{'DeepEP' if backend == 'deepep' else 'HybridEP'}TokenDispatcher). Or keep fxoverlap's ops "
                f"and use dispatcher='auto', 'all_to_all', 'padded' or 'symm_mem'"
            )
        return "all_to_all"  # leave the graph as it is
    if backend in ("all_to_all", "padded") or not sites:
        return backend if backend != "auto" else "all_to_all"
    from fxoverlap.kernels import symm_mem

    device = _val(sites[0].dispatch.args[0]).device
    group = a2a.resolve_group(sites[0].group_name)
    ok, why = symm_mem.usable(group, device)
    if backend == "auto":
        # One rank has nothing to send: the static layout would only cost (measured on one
        # H200, docs/benchmarks.md 2026-12-01: 2.6-3.3x slower steps than all_to_all).
        return "symm_mem" if ok and a2a.world_size(group) > 1 else "all_to_all"
    if not ok:
        raise DispatcherError(
            f"OverlapConfig(dispatcher='symm_mem') cannot run here: {why}. Use dispatcher='padded' (any device, "
            f"gloo or NCCL, also across hosts) or 'auto'"
        )
    return backend


def dispatcher(gm: torch.fx.GraphModule, backend: str = "auto", capacity_factor: float | None = None
               ) -> Lowering:
    """Lower ``gm``'s generic EP ops to ``backend`` in place (see the module docstring); returns what
    was chosen (the caller records it on the :class:`~fxoverlap.ir.capture.Capture`)."""
    if capacity_factor is not None and capacity_factor <= 0:
        raise DispatcherError(
            f"OverlapConfig.dispatch_capacity_factor must be > 0 (or None for the worst case), got {capacity_factor}")
    sites = find_sites(gm, capacity_factor)
    ep_size = max((a2a.world_size(a2a.resolve_group(s.group_name)) for s in sites), default=None)
    groups = tuple(dict.fromkeys(s.group_name for s in sites)) or None
    chosen = _resolve(backend, gm, sites)
    if chosen == "all_to_all":
        if capacity_factor is not None and sites:
            raise DispatcherError(
                f"OverlapConfig.dispatch_capacity_factor={capacity_factor} needs a static dispatcher, but "
                f"dispatcher={backend!r} runs all_to_all here (variable split sizes, nothing to bound); set "
                f"dispatcher='padded' (or 'symm_mem' on one CUDA host), or drop the factor"
            )
        return Lowering(chosen, ep_size=ep_size, groups=groups)
    overflow = rewrite_sites(gm, sites, chosen)
    propagate_fake_values(gm)
    check_row_wise(gm)
    _fold_sizes(gm)
    return Lowering(chosen, overflow, ep_size, groups)
