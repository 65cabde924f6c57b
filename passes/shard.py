"""shard: the parameter units of ZeRO-3 (``OverlapConfig(shard_params=True)``), and their
gather and drop nodes in the program.

Contract
--------
Assumes: ``schedule`` ran (every stage call carries a ``Step``), ``reduce`` too where the
program reduces gradients; ``streams`` and ``free`` have not run yet (they leave the nodes
placed here alone: these carry no ``Step`` and no per-microbatch value). The capture's joint
graph carries the tags ``tag`` gave it.

Guarantees, for every unit ``u`` of ``units`` and every parameter of it (by FQN):

- its *uses* are the spans ``[first, last]`` of the stage calls that read any of ``u``'s
  parameters, one span per microbatch and direction (a delayed weight-gradient stage and a
  recompute stage belong to their microbatch's backward), overlapping spans merged, and a
  span merged into the unit's previous one where its gather would start before that one
  ends (the unit then stays gathered through the gap instead of being gathered again at once);
- each use is bracketed by ``wait_unshard(u)`` right before its first reader and
  ``reshard(u)`` right after its last: no stage reads a parameter of ``u`` outside one;
- ``unshard(u)`` (the gather's start) comes ``unshard_ahead`` uses ahead (1 by default):
  right before the ``wait_unshard`` of the uses that start ``unshard_ahead`` first readers
  earlier (any unit's), so a gather is in flight under the previous units' compute; never
  before ``u``'s previous ``reshard``; the uses that start at the program's first
  ``unshard_ahead`` readers gather at the start of the program;
- with ``keep_gathered_bytes`` > 0, a unit stays gathered between two of its uses where the
  gathered bytes stay within that budget (or the placement's own peak), shortest gaps first;
- ``program_of(program).units`` is ``units`` and ``.gathered_peak`` the most units gathered or
  being gathered at any point of the program (``unshard`` .. ``reshard``). Bound: the uses
  open at one point (1F1B's merged step F(i+1) ⊗ B(i): a forward and a backward layer, each
  a dense and an expert unit; with ``delay_wgrad`` the expert units whose weight-gradient
  part waits for its slot) plus the gathers ahead (``unshard_ahead`` uses' units), plus the
  units a ``keep_gathered_bytes`` budget keeps; ``.gathered_peak_bytes`` their most bytes
  (within ``max(keep_gathered_bytes, the peak without a budget)``).

Units (:func:`param_units`): one per group of parameters read by the same layers (the tags'
``layer``: ``-1`` embed, ``num_layers`` head, so tied embed/head weights share one), of one
role (``"expert"``: read by experts stages only, over ``expert_dp_group``; ``"dense"``, over
``dp_group``) and dtype, in forward order. A role whose group has one rank is not sharded.
Every sharded parameter's first dimension must divide by its group's size (:class:`ShardError`).

Steps
-----
1. The readers of each unit: the stage calls reading its parameters' placeholders.
2. Its uses: per (microbatch, direction) the span of its readers; overlapping spans merged, and
   a use merged into the unit's previous one where its gather (``unshard_ahead`` uses ahead)
   would start before that one ends; then, with ``keep_gathered_bytes``, the shortest gaps
   between a unit's uses merged while the gathered bytes (modelled from the placement of
   step 3) stay within the budget.
3. Placement: ``reshard`` after each use's last reader, ``wait_unshard`` before its first,
   ``unshard`` before the waits of the uses that start ``unshard_ahead`` readers earlier (or
   after the unit's previous ``reshard``, whichever is later).
4. ``gathered_peak`` and ``gathered_peak_bytes`` by walking the placed nodes.

Entry points: ``param_units(capture, ranks) -> tuple[ParamUnit, ...]`` (decided once per
model: the engine keeps them for every program) and ``shard(program, stages, capture, units,
keep_gathered_bytes=0, unshard_ahead=1) -> GraphModule`` (``OverlapConfig.keep_gathered_mb``
and ``unshard_ahead``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.fx

from fxoverlap.ir import program as program_ops
from fxoverlap.ir.capture import Capture
from fxoverlap.ir.errors import FxOverlapError, InternalError
from fxoverlap.ir.program import program_of, stage_calls
from fxoverlap.ir.stage import Direction, Stage, StreamKind
from fxoverlap.ir.unit import ParamUnit, UnitParam
from fxoverlap.passes.reduce import ALIGN, param_meta, parameter_readers, parameter_roles


class ShardError(FxOverlapError, ValueError):
    """The parameters cannot be sharded as ``OverlapConfig(shard_params=True)`` lays them out;
    the message names the parameters, their shapes, the group size and the fix."""


def _unit_name(layers: tuple[int, ...], role: str, num_layers: int) -> str:
    def one(layer: int) -> str:
        return "embed" if layer < 0 else "head" if layer >= num_layers else f"l{layer}"
    return "+".join(one(x) for x in layers) + ("_expert" if role == "expert" else
                                                "" if all(x < 0 or x >= num_layers for x in layers) else "_dense")


def param_units(capture: Capture, ranks: Mapping[str, int],
                tied: Mapping[str, str] | None = None) -> tuple[ParamUnit, ...]:
    """The units of the capture's parameters; ``ranks``: the group size per sharded role
    (``"dense"``, ``"expert"``; a role left out is not sharded); ``tied``: name -> first name of the same tensor, for a
    parameter the model holds under several names (tied embed/head weights): the capture
    lifts each name as a placeholder of its own, but the tensor is one parameter of one unit,
    read by the readers of every name. Raises :class:`ShardError` for a parameter whose first
    dimension the group size does not divide (or a 0-dim parameter)."""
    readers = parameter_readers(capture)
    roles = parameter_roles(capture, readers)  # (before the tied names' readers are merged below)
    aliases: dict[str, list[str]] = {}
    for name, first in (tied or {}).items():
        if name in readers and first in readers and name != first:
            readers[first] = readers[first] | readers.pop(name)
            # the role of the tensor: expert only where every name is read by experts stages alone
            if roles[name] != roles[first]:
                roles[first] = "dense"
            aliases.setdefault(first, []).append(name)
    meta = param_meta(capture)
    groups: dict[tuple, list[str]] = {}
    bad = []
    for fqn, tags in readers.items():
        role = roles[fqn]
        n = ranks.get(role)
        if n is None:
            continue
        shape, dtype = meta[fqn]
        if not shape or shape[0] % n:
            bad.append(f"{fqn} {list(shape)} over {n} ranks ({role})")
            continue
        layers = tuple(sorted({t.layer for t in tags if t is not None})) or (-1,)
        groups.setdefault((layers, role, dtype), []).append(fqn)
    if bad:
        raise ShardError(
            f"OverlapConfig(shard_params=True) splits each parameter's first dimension evenly over its group, "
            f"which these cannot be: {'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. Pad that dimension "
            f"to a multiple of the group size (e.g. the vocabulary), or train with grad_reduce='reduce_scatter' "
            f"(ZeRO-2) instead")
    units = []
    order = sorted(groups, key=lambda k: (min(k[0]), k[0], k[1] == "expert", str(k[2])))
    for key in order:
        layers, role, dtype = key
        n = ranks[role]
        params, offset = [], 0
        for fqn in groups[key]:
            shape = meta[fqn][0]
            params.append(UnitParam(fqn, shape, offset, tuple(aliases.get(fqn, ()))))
            offset = -(-(offset + math.prod(shape) // n) // ALIGN) * ALIGN
        units.append(ParamUnit(len(units), _unit_name(layers, role, capture.num_layers), role, dtype, n,
                               tuple(params)))
    return tuple(units)


def shard(program: torch.fx.GraphModule, stages: Sequence[Stage], capture: Capture,
          units: Sequence[ParamUnit], keep_gathered_bytes: float = 0, unshard_ahead: int = 1) -> torch.fx.GraphModule:
    graph = program.graph
    by_name = {s.name: s for s in stages}
    placeholder = {fqn: ph for ph, fqn in capture.param_placeholders.items()}
    unit_of: dict[str, int] = {}  # placeholder -> unit
    for u in units:
        for p in u.params:
            for name in p.names:
                if name not in placeholder:
                    raise InternalError(f"shard: unit {u.name}'s parameter {name} is not one of this capture's")
                unit_of[placeholder[name]] = u.index
    order = {n: i for i, n in enumerate(graph.nodes)}

    # 1.-2. the uses of each unit: spans of readers per (microbatch, direction), merged
    spans: dict[tuple[int, int, Direction], list[torch.fx.Node]] = {}
    for node, step in stage_calls(program):
        stage = by_name[step.stage]
        units_read = {unit_of[v] for v in step.reads if v in unit_of}
        if units_read and stage.stream is not StreamKind.COMP:
            # the gathered tensors are dropped in the compute stream's order (reshard): a reader on
            # another stream could see its memory reused under it
            raise InternalError(f"shard: stage {stage.name} on the {stage.stream} stream reads sharded parameters")
        for u in units_read:
            span = spans.setdefault((u, step.microbatch, stage.direction), [node, node])
            span[1] = node
    per_unit: dict[int, list[list[torch.fx.Node]]] = {}
    for (u, _, _), (first, last) in sorted(spans.items(), key=lambda kv: order[kv[1][0]]):
        uses = per_unit.setdefault(u, [])
        if uses and order[first] <= order[uses[-1][1]]:
            if order[last] > order[uses[-1][1]]:
                uses[-1][1] = last
        else:
            uses.append([first, last])
    if unshard_ahead < 1:
        raise InternalError(f"shard: unshard_ahead must be >= 1, got {unshard_ahead}")
    _keep_through_short_gaps(per_unit, order, unshard_ahead)
    if keep_gathered_bytes > 0:
        _keep_within(per_unit, order, {u.index: u.nbytes for u in units}, keep_gathered_bytes, unshard_ahead)

    # 3. placement
    uses = sorted(((first, last, u, i) for u, us in per_unit.items() for i, (first, last) in enumerate(us)),
                  key=lambda x: order[x[0]])
    waits, reshards = {}, {}
    for first, last, u, i in uses:
        with graph.inserting_after(last):
            reshards[(u, i)] = graph.call_function(program_ops.reshard, (u,))
        with graph.inserting_before(first):
            waits[(u, i)] = graph.call_function(program_ops.wait_unshard, (u,))
    start = next(n for n in graph.nodes if n.op != "placeholder")
    first_wait: dict[torch.fx.Node, torch.fx.Node] = {}  # a reader -> the earliest wait placed before it
    for first, _, u, i in uses:
        first_wait.setdefault(first, waits[(u, i)])
    readers = list(first_wait)
    # the uses that start at a reader gather under those that start ``unshard_ahead`` readers earlier
    ahead_of = {r: first_wait[readers[j - unshard_ahead]] if j >= unshard_ahead else start
                for j, r in enumerate(readers)}
    for first, last, u, i in uses:
        at = ahead_of[first]
        if i > 0:  # not before this unit's previous use has dropped it
            prev = reshards[(u, i - 1)]
            if _before(graph, at, prev):
                at = prev.next
        with graph.inserting_before(at):
            graph.call_function(program_ops.unshard, (u,))

    # 4. the most units (and bytes) gathered at once
    live = peak = live_bytes = peak_bytes = 0
    for n in graph.nodes:
        if n.target is program_ops.unshard:
            live, live_bytes = live + 1, live_bytes + units[n.args[0]].nbytes
            peak, peak_bytes = max(peak, live), max(peak_bytes, live_bytes)
        elif n.target is program_ops.reshard:
            live, live_bytes = live - 1, live_bytes - units[n.args[0]].nbytes
    record = program_of(program)
    record.units, record.gathered_peak, record.gathered_peak_bytes = tuple(units), peak, peak_bytes
    program.recompile()
    return program


def _gather_starts(per_unit: dict[int, list[list[torch.fx.Node]]], order: dict, ahead: int) -> dict[int, float]:
    """Position (in ``order``) where the gathers of the uses that start at each first reader
    are issued, as step 3 places them: before the first reader ``ahead`` readers earlier
    (-1: the program's start), not yet held back by the unit's previous drop."""
    readers = sorted({order[first] for us in per_unit.values() for first, _ in us})
    return {r: readers[j - ahead] - 0.5 if j >= ahead else -1.0 for j, r in enumerate(readers)}


def _keep_through_short_gaps(per_unit: dict[int, list[list[torch.fx.Node]]], order: dict, ahead: int) -> None:
    """Merge a use into the unit's previous one where its gather (``ahead`` uses ahead) would
    start before that previous use ends (dropping the unit only to gather it again at once:
    F(0)'s head and B(0)'s, say)."""
    while True:
        starts = _gather_starts(per_unit, order, ahead)
        merge = [(order[us[i][0]], u, i) for u, us in per_unit.items() for i in range(1, len(us))
                 if starts[order[us[i][0]]] <= order[us[i - 1][1]]]
        if not merge:
            return
        _, u, i = min(merge)
        per_unit[u][i - 1][1] = per_unit[u][i][1]
        del per_unit[u][i]


def _intervals(per_unit: dict[int, list[list[torch.fx.Node]]], order: dict, ahead: int
               ) -> list[tuple[float, float, int]]:
    """``(start, end, unit)`` of every use as step 3 places its nodes, in positions of ``order``:
    gathered from :func:`_gather_starts`' position (or right after the unit's previous drop,
    whichever is later) to right after its last reader."""
    starts = _gather_starts(per_unit, order, ahead)
    return [(starts[order[f]] if i == 0 else max(starts[order[f]], order[us[i - 1][1]] + 0.5), order[l] + 0.5, u)
            for u, us in per_unit.items() for i, (f, l) in enumerate(us)]


def _peak_bytes(per_unit: dict[int, list[list[torch.fx.Node]]], order: dict, nbytes: Mapping[int, int],
                ahead: int) -> int:
    events = sorted((x, kind, u) for s, e, u in _intervals(per_unit, order, ahead) for x, kind in ((s, 1), (e, 0)))
    live = peak = 0
    for _, kind, u in events:  # at a tie a drop comes first: the nodes run drop, then gather
        live += nbytes[u] if kind else -nbytes[u]
        peak = max(peak, live)
    return peak


def _keep_within(per_unit: dict[int, list[list[torch.fx.Node]]], order: dict, nbytes: Mapping[int, int],
                 budget: float, ahead: int) -> None:
    """Keep units gathered between uses while the gathered bytes stay within ``budget`` (or
    the placement's own peak, if that is higher): each merge saves one gather of the unit.
    Greedy, the shortest gaps first (the least memory held per gather saved)."""
    cap = max(budget, _peak_bytes(per_unit, order, nbytes, ahead))
    gaps = sorted(((order[us[i][0]] - order[us[i - 1][1]], u, us[i][0]) for u, us in per_unit.items()
                   for i in range(1, len(us))), key=lambda g: (g[0], order[g[2]]))
    for _, u, first in gaps:
        uses = per_unit[u]
        i = next(k for k, use in enumerate(uses) if use[0] is first)
        merged = [*uses[:i - 1], [uses[i - 1][0], uses[i][1]], *uses[i + 1:]]
        if _peak_bytes({**per_unit, u: merged}, order, nbytes, ahead) <= cap:
            per_unit[u] = merged


def _before(graph: torch.fx.Graph, a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether node ``a`` comes before (or is) node ``b`` in the graph."""
    for n in graph.nodes:
        if n is a:
            return True
        if n is b:
            return False
    raise InternalError("shard: node not in the graph")
