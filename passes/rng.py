"""rng: random ops draw from the generator in eager's order, whatever the other passes moved.

Why: the program runs a microbatch's stages in an order of its own (a shared
expert's dropout under the dispatch, after the router's noise), and a random op
draws whatever the generator holds when it runs. Run in another order, two random
ops swap their numbers: silently wrong losses and gradients. CPU generators cannot
skip ahead, so saving "the state eager would have" needs the draws before it to
have run; the one mechanism that holds on CPU and CUDA, with Inductor stages and
with CUDA graphs (whose replays draw at replay time, in issue order) is to keep the
draws in eager's order. This pass makes the stages keep it; ``schedule`` checks the
program it emits (every draw of microbatch ``i`` after those eager draws before it).

Contract
--------
Assumes: the tagged joint graph (``tag``, optionally ``side``). Forward nodes are in
eager's execution order (AOTAutograd traces the forward as it runs), so the graph
order of random ops is the order eager draws in.

Guarantees: every random op (:func:`~fxoverlap.ir.meta.draws_random_numbers`) gets
``meta[RNG_ORDER_KEY]``, its index in eager's order of draws. Walking the forward's
random ops in that order, the plain order of their stages (``Tag.sort_key``: the
order in which the program issues a microbatch's forward compute stages) never goes
back. Only tags change, and only where it did go back:

* *pull*: a random op drawn earlier that sits in a later part of the same layer's
  attn (a ``side`` part) returns to the main part, with its ancestors in that part;
* *push*: otherwise the op drawn later moves forward to the stage of the latest
  earlier draw, with every descendant that sat in an earlier stage (e.g. a shared
  expert written after the routed experts, which ``tag`` puts into ``attn``, draws
  in the experts stage). A push that would move communication is refused.

Plain order stays valid (every node no earlier than its producers). Random ops of the
backward (none unless a custom ``autograd.Function`` draws) are numbered after the
forward's; ``schedule`` refuses a program that would interleave them with the next
microbatch's forward draws. :class:`RngOrderError` names both ops, their stages and
the fix when neither move works.

Steps
-----
1. Number the random ops in graph order.
2. For each forward random op, find the earlier draws whose stage comes later.
3. Pull those into this op's stage, or push this op (and what depends on it) to theirs.

Entry point: ``rng(gm, num_layers) -> GraphModule`` (tags rewritten in place).
"""

from __future__ import annotations

import torch.fx

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.meta import RNG_ORDER_KEY, TAG_KEY, draws_random_numbers, op_name
from fxoverlap.ir.stage import COMM_KINDS, Direction, Part, StageKind, Tag, stage_name


class RngOrderError(FxOverlapError, RuntimeError):
    """Random ops cannot keep eager's order of draws in the stages; the message says which and why."""


def _describe(n: torch.fx.Node) -> str:
    return f"{n.name} ({op_name(n)}) in stage {stage_name(n.meta[TAG_KEY])}"


def _pull(q: torch.fx.Node, to: Tag) -> list[torch.fx.Node] | None:
    """``q`` and its ancestors in ``q``'s part, if moving them to part ``to`` of the same attn is valid."""
    t = q.meta[TAG_KEY]
    if (t.direction, t.layer, t.kind, t.part) != (to.direction, to.layer, StageKind.ATTN, Part.SIDE) \
            or to.kind is not StageKind.ATTN or to.part is not Part.MAIN:
        return None
    moved, todo = [], [q]
    while todo:
        n = todo.pop()
        if n in moved or n.meta.get(TAG_KEY) != t:
            continue
        moved.append(n)
        todo.extend(n.all_input_nodes)
    return moved


def _push(r: torch.fx.Node, to: Tag, num_layers: int) -> list[torch.fx.Node] | None:
    """``r`` and its descendants in stages before ``to``, if moving them there moves no communication."""
    target = to.sort_key(num_layers)
    moved, todo = [], [r]
    while todo:
        n = todo.pop()
        t = n.meta.get(TAG_KEY)
        if n in moved or t is None or t.direction is not Direction.FWD or t.sort_key(num_layers) >= target:
            continue
        if t.kind in COMM_KINDS:
            return None
        moved.append(n)
        todo.extend(n.users)
    return moved


def rng(gm: torch.fx.GraphModule, num_layers: int) -> torch.fx.GraphModule:
    draws = [n for n in gm.graph.nodes if n.op == "call_function" and TAG_KEY in n.meta and draws_random_numbers(n)]
    for i, n in enumerate(draws):  # step 1
        n.meta[RNG_ORDER_KEY] = i
    forward = [n for n in draws if n.meta[TAG_KEY].direction is Direction.FWD]
    for k, r in enumerate(forward):
        key = r.meta[TAG_KEY].sort_key(num_layers)
        later = [q for q in forward[:k] if q.meta[TAG_KEY].sort_key(num_layers) > key]  # step 2
        if not later:
            continue
        pulls = [_pull(q, r.meta[TAG_KEY]) for q in later]  # step 3
        if all(p is not None for p in pulls):
            for n in {n for p in pulls for n in p}:
                n.meta[TAG_KEY] = r.meta[TAG_KEY]
            continue
        last = max(later, key=lambda q: q.meta[TAG_KEY].sort_key(num_layers))
        pushed = _push(r, last.meta[TAG_KEY], num_layers)
        if pushed is None:
            raise RngOrderError(
                f"rng: eager draws random op {_describe(last)} before {_describe(r)}, but the stages run them "
                f"the other way round, and moving {r.name} after it would move communication. Random numbers "
                f"would be swapped between them. Fix: OverlapConfig(side_stages=False), or draw the random "
                f"numbers of {r.name} before the code of {last.name} in the model")
        for n in pushed:
            n.meta[TAG_KEY] = last.meta[TAG_KEY]
    return gm
