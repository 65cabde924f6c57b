"""layers: the one decoder-layer finder both entry points use.

Contract
--------
Assumes: a joint graph whose forward nodes carry, under ``node.meta["custom"][LIST_KEY]``,
``{container: (entry, child)}`` for every candidate layer list they ran inside: the
capture pass's hooks write it for ``fxoverlap.optimize`` (every ``nn.ModuleList`` /
``nn.ModuleDict`` whose entries have parameters), the torch.compile backend from the
Dynamo nodes' ``nn_module_stack`` (every list with integer children).

Guarantees: :func:`choose_container` picks the decoder-layer list as a user means it:
the *outermost* candidate whose entries together hold every all-to-all (entries without
one, dense layers, are allowed); among several such (no all-to-all at all, sibling
lists), the one with the most entries. Not the longest list: a layer's experts in an
``nn.ModuleList`` are longer than the layer list in many models. When no candidate holds
every all-to-all it returns the one that holds the most, with ``complete=False``, and the
tag pass raises a ``TagError`` naming ``layer_container=`` and every candidate considered.
:func:`resolve` then rewrites the annotations of the chosen list into ``{LAYER_KEY: i,
CHILD_KEY: child}`` and drops the rest, so later passes see exactly one layer list.

A front end that traced the layers itself (the torch.compile backend, from Dynamo's
``nn_module_stack``) hands the capture pass a :class:`LayerCandidate` per list: its entries'
names in execution order, the children of each that read a parameter, and whether the entries
ran one after another. The capture pass takes the chosen list's facts from it
(:func:`layer_facts`), so the layer facts of a capture come from here alone, for both front ends.

Entry points: ``choose_container(gm, sizes) -> Choice``, ``resolve(gm, container)``,
``layer_facts(container, candidate) -> (layer names, param_children)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.fx

from fxoverlap.ir.capture import Choice
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.meta import CHILD_KEY, LAYER_KEY, LIST_KEY


class LayersOutOfOrder(FxOverlapError):
    """The entries of the chosen layer list do not run one after another."""


@dataclasses.dataclass(frozen=True)
class LayerCandidate:
    """A candidate layer list as a front end traced it: ``names``, its entries (child names of
    the list) in execution order; ``param_children[i]``, the children of entry ``i`` that read a
    parameter; ``in_order``, whether each entry's nodes ran before the next entry's."""

    names: tuple[str, ...]
    param_children: Mapping[int, frozenset[str]] = dataclasses.field(default_factory=dict)
    in_order: bool = True

    def __len__(self) -> int:
        return len(self.names)


def layer_facts(container: str | None, candidate: int | LayerCandidate | None,
                param_children: Mapping[int, set[str]] | None = None) -> tuple[int, list[str], dict[int, set[str]]]:
    """``(num_layers, layer_names, param_children)`` of the chosen list ``container``: from the
    front end's :class:`LayerCandidate`, or, for an entry count (``fxoverlap.optimize``: the capture
    pass's hooks), entries ``container.0 ...`` with the hooks' ``param_children``. Raises
    :class:`LayersOutOfOrder` when the candidate's entries did not run one after another."""
    if container is None or candidate is None:
        return 0, [], {}
    if isinstance(candidate, LayerCandidate):
        if not candidate.in_order:
            raise LayersOutOfOrder(
                f"the layers of {container} do not run one after another (a layer is called twice or "
                f"interleaved with another); fxoverlap schedules each layer once per step")
        return (len(candidate.names), [f"{container}.{n}" for n in candidate.names],
                {i: set(kids) for i, kids in candidate.param_children.items()})
    return candidate, [f"{container}.{i}" for i in range(candidate)], dict(param_children or {})


def lists_of(node: torch.fx.Node) -> Mapping[str, tuple[int, str | None]]:
    """The candidate lists ``node`` ran inside, each with its entry and child."""
    return (node.meta.get("custom") or {}).get(LIST_KEY) or {}


def _inside(inner: str, outer: str) -> bool:
    return inner != outer and (outer == "" or inner.startswith(outer + "."))


def choose_container(gm: torch.fx.GraphModule, sizes: Mapping[str, int]) -> Choice:
    """The decoder-layer list among the candidates ``sizes`` (path -> entry count)."""
    sizes = {c: len(v) if isinstance(v, LayerCandidate) else v for c, v in sizes.items()}
    from fxoverlap.passes.tag import _direction, _is_comm  # tag imports capture, which imports this
    from fxoverlap.ir.stage import Direction

    considered = tuple(sorted(sizes.items()))
    if not sizes:
        return Choice(None, considered)
    comm = [n for n in gm.graph.nodes if n.op == "call_function" and _direction(n) is Direction.FWD and _is_comm(n)]
    held = {c: sum(1 for n in comm if c in lists_of(n)) for c in sizes}
    holders = [c for c in sizes if held[c] == len(comm)]
    complete = bool(holders)
    if not holders:  # best effort for the error the tag pass raises: the list holding the most
        top = max(held.values())
        holders = [c for c in sizes if held[c] == top]
    outer = [c for c in holders if not any(_inside(c, o) for o in holders)]
    best = max(outer, key=lambda c: (sizes[c], -len(c)))
    outside = None
    if not complete:
        from fxoverlap.ir.meta import op_name

        n = next(n for n in comm if best not in lists_of(n))
        outside = f"{n.name} ({op_name(n)})"
    return Choice(best, considered, complete, outside)


def resolve(gm: torch.fx.GraphModule, container: str | None) -> None:
    """Keep ``container``'s annotations as ``{LAYER_KEY, CHILD_KEY}``; drop every candidate's."""
    for n in gm.graph.nodes:
        meta = n.meta.get("custom")
        if not meta or LIST_KEY not in meta:
            continue
        lists = meta.pop(LIST_KEY)
        if container is not None and container in lists:
            entry, child = lists[container]
            mine = {LAYER_KEY: entry} if child is None else {LAYER_KEY: entry, CHILD_KEY: child}
            meta = {**mine, **meta}
        if meta:
            n.meta["custom"] = meta
        else:
            del n.meta["custom"]
