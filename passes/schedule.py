"""schedule: emit the interleaved 1F1B program as an FX graph whose nodes call stages.

Contract
--------
Assumes: ``stages`` from ``split`` (plain order), the ``capture`` they came from.

Guarantees: a program (``torch.fx.GraphModule``, code readable as a listing) that
calls every stage once per microbatch, each after the stages whose outputs it
reads, and records on every node it emits a :class:`~fxoverlap.ir.program.Step`
(microbatch, stream, values read and written, slot). Right after a stage call
that produces them, ``output`` hands the step's outputs (the loss) to the caller,
``accumulate`` adds parameter gradients into ``.grad`` and ``mutate`` copies the
new values of buffers the forward updates in place into them (so in microbatch
order). No events and no frees: ``streams`` and ``free`` add them.

The order: F(0); for i = 1..N-1 the merged step F(i) ⊗ B(i-1); then B(N-1). In
the merged step, forward layer j pairs with backward layer L-1-j (Megatron's
order), four slots per pair, the compute stage of each slot issued before its
comm stage:

    slot | comm stream   | compute stream
    1    | B combine     | F attn          (B post right before B combine,
    2    | F dispatch    | B experts        F post(j-1) right before F attn(j))
    3    | B dispatch    | F experts (+ B experts wgrad)
    4    | F combine     | B attn

Parts (``side``): a forward attn ``side`` part is issued right after its layer's
dispatch (slot 2), a backward attn ``early`` part right after its layer's backward
combine (slot 1); both run under that all-to-all, in the merged step as in F(0)
and B(N-1). With delayed weight-grad, B experts' wgrad joins slot 3 and B attn's
wgrad joins the next pair's slot 1 (the last pair's runs before B embed);
``expert_wgrad_slot=2`` issues B experts' wgrad in slot 2 instead, right after B
experts and before the F dispatch, so it runs while F experts waits for that dispatch
rather than between F experts and B attn.

B head opens the merged step; F post of the last layer, F head and B embed close
it. A dense layer's ``mlp`` takes the experts slot and has no comm slots. A
recompute stage runs right before the first stage that reads its outputs, in
program order (a replayed all-to-all of a checkpointed region, with
``ac_replay_comm``, is a recompute stage on the comm stream, and its own inputs'
recompute stages run before it).

The drain B(N-1) (with N = 1, the whole backward) has no forward to pair with,
so it overlaps its comm stages with its own weight-grads: stages run in plain
backward order, and each wgrad part waits until the microbatch's next comm stage
has been issued, so the compute stream runs it while the comm stream runs that
all-to-all. Per MoE layer l:

    B experts(l) -> B dispatch(l) -> wgrad experts(l) -> B attn(l)
    -> B post(l-1) -> B combine(l-1) -> wgrad attn(l) -> B experts(l-1) -> ...

A wgrad part with no comm stage after it (layer 0's attn, dense layers under the
lowest MoE layer) runs right after its parent: waiting would only hold memory.

``weight_last`` (a one-microbatch program: a pipeline stage's backward under a ZeroBubble
schedule) puts every wgrad part after all of B's other stages instead, so the program's
backward is two spans: input gradients (``BACKWARD_INPUT``), then weight gradients
(``BACKWARD_WEIGHT``, run later by the pipeline schedule).

Chunks (``chunk``: a layer's exchange -> experts -> exchange cut into K chunks): in the plain
orders the chain is issued ``first(0), experts(0), first(1), last(0), experts(1), ...,
last(K-1)``, so each exchange but the first and the last runs under a chunk's experts; in the
merged steps each slot runs a kind's chunks back to back. Where a layer has both its chunks and
its whole chain (``chunk.with_whole_chains``; ``OverlapConfig.chunks_in_merged_steps=False``),
the microbatches that run with no other beside them, 0 and N-1 (F(0) and B(N-1), and the
other half of each: B(0), F(N-1)), run the chunks, the others the whole chain.

A forward-only program (inference: ``engine.forward_only(microbatches)``) runs its
microbatches in pairs F(2k) ⊗ F(2k+1), layer by layer, each one's exchanges under the other's
attn and experts (two-batch overlap, ``_Emitter.forward_pair``), with their whole chains; a
last odd microbatch runs alone, with the chunks. Where a forward stage draws random numbers
(dropout in training mode under ``no_grad``), pairing would interleave two microbatches'
draws, so every microbatch runs alone, in order, with the chunks.

Random ops draw in eager's order: every draw of microbatch ``i`` comes after the
draws eager makes before it (its own earlier ones, and all of microbatch ``i - 1``'s),
checked on the emitted program (``rng`` numbered them and made the stages keep
that order within a microbatch); a program that would break it is refused with
:class:`~fxoverlap.passes.rng.RngOrderError`.

Steps
-----
1. Index the stages by (direction, layer, kind) and their parts by parent.
2. Emit F(0), the merged steps, then B(N-1) (forward-only: the pairs, then an odd one); each
   stage call with its sinks. Forward pairs that would touch a buffer the forward updates in
   place out of eager's order (a buffer two layers share) are emitted again one by one.
3. Check that every stage ran once per microbatch, and the order of random draws.

Entry point: ``schedule(stages, capture, num_microbatches, expert_wgrad_slot=3) -> GraphModule``;
``schedule(stages, capture, 1, forward_only=True)`` emits the forward alone,
``schedule(stages, capture, 1, weight_last=True)`` the weight gradients last.
"""

from __future__ import annotations

import logging

import torch
import torch.fx
import torch.nn as nn

from fxoverlap.ir import program as program_ops
from fxoverlap.ir.capture import Capture
from fxoverlap.ir.meta import PROGRAM_KEY, STEP_KEY
from fxoverlap.ir.program import Program, StageCall, Step, add_marker
from fxoverlap.ir.stage import RECOMPUTE_KINDS, Direction, Part, Stage, StageKind, StreamKind, stage_name
from fxoverlap.passes.rng import RngOrderError
from fxoverlap.ir.errors import FxOverlapError, InternalError


log = logging.getLogger("fxoverlap")


class ScheduleError(FxOverlapError, ValueError):
    """The schedule was asked for something it cannot build (no microbatch)."""

F, B, K = Direction.FWD, Direction.BWD, StageKind


class _Emitter:
    def __init__(self, stages: list[Stage], capture: Capture, alone: set[int], expert_wgrad_slot: int = 3):
        # (direction, layer, kind) -> its main stages; where a layer has its chunks and its whole
        # chain (chunk.with_whole_chains), ``main`` holds the whole one and ``chunked`` the chunks,
        # which the microbatches in ``alone`` run
        self.main: dict[tuple, list[Stage]] = {}
        self.chunked: dict[tuple, list[Stage]] = {}
        self.alone = alone
        self.parts: dict[tuple[str, Part], Stage] = {}  # (parent stage name, part) -> that part
        for s in stages:
            if s.part is Part.MAIN:
                self.main.setdefault((s.direction, s.layer, s.kind), []).append(s)
        for key, group in list(self.main.items()):
            cut = [s for s in group if s.chunk is not None]
            if cut and len(cut) < len(group):
                self.main[key] = [s for s in group if s.chunk is None]
                self.chunked[key] = cut
        for s in stages:
            if s.part is not Part.MAIN:  # its parent: the main stage of its chunk
                self.parts[(stage_name(s.tag.with_part(Part.MAIN)), s.part)] = s
        self.sinks = (
            (program_ops.output, set(capture.outputs)),
            (program_ops.accumulate, set(capture.grads)),
            (program_ops.mutate, set(capture.mutations)),
        )
        self.mutations = capture.mutations
        self.root = nn.Module()
        self.graph = torch.fx.Graph()
        self.emitted: set[tuple[str, int]] = set()
        # stage name -> the recompute stages whose outputs it reads
        self.recompute_for: dict[str, list[Stage]] = {}
        # (merged step, layer pair, slot) of the stages emitted now; None outside slots
        self.slot: tuple[int, int, int] | None = None
        self.expert_wgrad_slot = expert_wgrad_slot  # the merged-step slot of B experts' wgrad part (2 or 3)

    def get(self, direction: Direction, layer: int, kind: StageKind, mb: int) -> list[Stage]:
        key = (direction, layer, kind)
        if mb in self.alone and key in self.chunked:
            return self.chunked[key]
        return self.main.get(key, [])

    def runs(self, s: Stage, mb: int) -> bool:
        """Whether microbatch ``mb`` runs stage ``s`` (a layer's chunks or its whole chain)."""
        if (s.direction, s.layer, s.kind) not in self.chunked:
            return True
        return (s.chunk is not None) == (mb in self.alone)

    def part(self, stages: list[Stage], part: Part) -> list[Stage]:
        return [self.parts[(s.name, part)] for s in stages if (s.name, part) in self.parts]

    def emit(self, stages: list[Stage], mb: int) -> None:
        for s in stages:
            # a no-op once r ran for mb; recursive: a replayed all-to-all's inputs are recomputed too
            self.emit(self.recompute_for.get(s.name, []), mb)
            self._emit_one(s, mb)

    def _emit_one(self, s: Stage, mb: int) -> None:
        if (s.name, mb) in self.emitted:
            return
        self.emitted.add((s.name, mb))
        if not hasattr(self.root, s.name):
            self.root.add_module(s.name, StageCall(s.name))
        node = self.graph.call_module(s.name, (mb,))
        node.name = f"{'F' if s.direction is Direction.FWD else 'B'}{mb}_{s.name.split('_', 1)[1]}"
        node.meta[STEP_KEY] = Step(mb, s.stream, tuple(s.inputs), tuple(s.outputs), s.name, self.slot)
        for marker, names in self.sinks:
            values = tuple(v for v in s.outputs if v in names)
            if values:
                # a mutation also reads (writes into) the buffer or input it updates
                targets = tuple(self.mutations[v] for v in values) if marker is program_ops.mutate else ()
                add_marker(self.graph, marker, Step(mb, s.stream, reads=values + targets, slot=self.slot),
                           name=f"{marker.__name__}_{node.name}")

    # ---- plain orders (F(0), the forward-only program, the drain B(N-1))
    def chain(self, direction: Direction, layer: int, mb: int) -> list[Stage]:
        """A layer's exchange -> experts -> exchange in issue order, with the attn part that runs
        under the first exchange. Cut into chunks (``chunk``), chunk c+1's first exchange is
        issued right after chunk c's experts and chunk c's second exchange right after it, so
        the comm stream runs first(c+1) under experts(c) and second(c) under experts(c+1)."""
        first_kind, last_kind = (K.DISPATCH, K.COMBINE) if direction is F else (K.COMBINE, K.DISPATCH)
        first, mid, last = (self.get(direction, layer, k, mb) for k in (first_kind, K.EXPERTS, last_kind))
        under = self.part(self.get(direction, layer, K.ATTN, mb), Part.SIDE if direction is F else Part.EARLY)
        if len(first) != len(mid) or len(mid) != len(last) or len(mid) <= 1:
            return first + under + mid + last
        order = first[:1] + under
        for c, experts in enumerate(mid):
            order += [experts] + first[c + 1:c + 2] + [last[c]]
        return order

    def layer_order(self, direction: Direction, layer: int, mb: int) -> list[Stage]:
        """One layer's stages in plain order (the backward's reversed), the exchanges as :meth:`chain` issues them."""
        kinds = (K.ATTN, None, K.MLP, K.POST)  # None: the chain
        if direction is B:
            kinds = kinds[::-1]
        return [s for k in kinds
                for s in (self.chain(direction, layer, mb) if k is None else self.get(direction, layer, k, mb))]

    def forward(self, mb: int, num_layers: int) -> None:
        self.emit(self.get(F, -1, K.EMBED, mb), mb)
        for layer in range(num_layers):
            self.emit(self.layer_order(F, layer, mb), mb)
        self.emit(self.get(F, num_layers, K.HEAD, mb), mb)

    def forward_pair(self, a: int, b: int, num_layers: int) -> None:
        """F(a) and F(b) of a forward-only program in turns, layer by layer, so each one's
        exchanges run under the other's compute (two-batch overlap):

            compute | post_a(j-1) attn_a(j) | post_b(j-1) attn_b(j) | experts_a(j) | experts_b(j)
            comm    | combine_b(j-1)        | dispatch_a(j)         | dispatch_b(j) | combine_a(j)

        (combine_b(j) runs under the next layer's post_a and attn_a.)"""
        for mb in (a, b):
            self.emit(self.get(F, -1, K.EMBED, mb), mb)
        for layer in range(num_layers):
            for mb in (a, b):
                if layer:
                    self.emit(self.get(F, layer - 1, K.POST, mb), mb)
                self.emit(self.get(F, layer, K.ATTN, mb), mb)
                self.emit(self.get(F, layer, K.DISPATCH, mb), mb)
                self.emit(self.part(self.get(F, layer, K.ATTN, mb), Part.SIDE), mb)
            for mb in (a, b):
                self.emit(self.get(F, layer, K.EXPERTS, mb) + self.get(F, layer, K.MLP, mb), mb)
                self.emit(self.get(F, layer, K.COMBINE, mb), mb)
        for mb in (a, b):
            self.emit(self.get(F, num_layers - 1, K.POST, mb), mb)
            self.emit(self.get(F, num_layers, K.HEAD, mb), mb)

    def backward(self, mb: int, num_layers: int, weight_last: bool = False) -> None:
        """What is left of B(mb), in plain order, each wgrad part after the next comm stage
        (``weight_last``: every wgrad part after all of B's input-gradient work)."""
        order = list(self.get(B, num_layers, K.HEAD, mb))
        for layer in reversed(range(num_layers)):
            order += self.layer_order(B, layer, mb)
        order += self.get(B, -1, K.EMBED, mb)
        if weight_last:
            self.emit(order, mb)
            self.emit(self.part(order, Part.WGRAD), mb)
            return
        comm_left = sum(s.stream is StreamKind.COMM for s in order)
        pending: list[Stage] = []  # wgrad parts waiting for the next comm stage
        for s in order:
            self.emit([s], mb)
            if s.stream is StreamKind.COMM:
                comm_left -= 1
                # issued on the comm stream: these wgrads now run alongside it
                self.emit(pending, mb)
                pending = []
            if comm_left:
                pending += self.part([s], Part.WGRAD)
            else:  # no comm stage left to overlap with
                self.emit(self.part([s], Part.WGRAD), mb)

    # ---- F(f) ⊗ B(b)
    def merged(self, i: int, f: int, b: int, num_layers: int) -> None:
        self.emit(self.get(B, num_layers, K.HEAD, b), b)
        for j in range(num_layers):
            fl, bl = j, num_layers - 1 - j
            # slot 1: B combine || F attn (+ B attn early)
            self.slot = (i, j, 1)
            self.emit(self.get(B, bl, K.POST, b), b)
            self.emit(self.get(F, -1, K.EMBED, f) if fl == 0 else self.get(F, fl - 1, K.POST, f), f)
            self.emit(self.get(F, fl, K.ATTN, f), f)
            if j > 0:  # the previous pair's B attn weight-grad fills this B combine
                self.emit(self.part(self.get(B, bl + 1, K.ATTN, b), Part.WGRAD), b)
            self.emit(self.get(B, bl, K.COMBINE, b), b)
            self.emit(self.part(self.get(B, bl, K.ATTN, b), Part.EARLY), b)
            # slot 2: F dispatch || B experts (+ F attn side)
            self.slot = (i, j, 2)
            self.emit(self.get(B, bl, K.EXPERTS, b) + self.get(B, bl, K.MLP, b), b)
            if self.expert_wgrad_slot == 2:  # B experts' weight-grad fills F experts' wait for the F dispatch
                self.emit(self.part(self.get(B, bl, K.EXPERTS, b) + self.get(B, bl, K.MLP, b), Part.WGRAD), b)
            self.emit(self.get(F, fl, K.DISPATCH, f), f)
            self.emit(self.part(self.get(F, fl, K.ATTN, f), Part.SIDE), f)
            # slot 3: B dispatch || F experts
            self.slot = (i, j, 3)
            self.emit(self.get(F, fl, K.EXPERTS, f) + self.get(F, fl, K.MLP, f), f)
            # B experts' weight-grad fills the B dispatch it no longer delays (a no-op if slot 2 ran it)
            self.emit(self.part(self.get(B, bl, K.EXPERTS, b) + self.get(B, bl, K.MLP, b), Part.WGRAD), b)
            self.emit(self.get(B, bl, K.DISPATCH, b), b)
            # slot 4: F combine || B attn
            self.slot = (i, j, 4)
            self.emit(self.get(B, bl, K.ATTN, b), b)
            self.emit(self.get(F, fl, K.COMBINE, f), f)
            self.slot = None
        self.emit(self.get(F, num_layers - 1, K.POST, f), f)
        self.emit(self.get(F, num_layers, K.HEAD, f), f)
        self.emit(self.part(self.get(B, 0, K.ATTN, b), Part.WGRAD), b)
        self.emit(self.get(B, -1, K.EMBED, b), b)
        self.backward(b, num_layers)  # anything of B(b) the slots did not place (e.g. fallback stages)


def schedule(
    stages: list[Stage], capture: Capture, num_microbatches: int, forward_only: bool = False,
    weight_last: bool = False, expert_wgrad_slot: int = 3,
) -> torch.fx.GraphModule:
    if num_microbatches < 1:
        raise ScheduleError("schedule: need at least one microbatch")
    if weight_last and num_microbatches != 1:
        raise ScheduleError("schedule: weight_last is for a one-microbatch program (a pipeline stage's B), "
                            f"not {num_microbatches} microbatches")
    if expert_wgrad_slot not in (2, 3):
        raise ScheduleError(f"schedule: expert_wgrad_slot is 2 or 3, not {expert_wgrad_slot!r}")
    # a forward-only program runs its microbatches in pairs, unless that would reorder random draws
    # or the reads and writes of a buffer the forward updates in place
    pairs = forward_only and num_microbatches > 1 and not any(s.draws for s in stages if s.direction is F)
    by_name = {s.name: s for s in stages}
    e = _emit(stages, capture, num_microbatches, forward_only, weight_last, expert_wgrad_slot, pairs)
    if pairs and (why := _buffer_order(e.graph, by_name, capture)) is not None:
        log.info("fxoverlap: forward-only microbatches run one after the other, not in pairs: %s", why)
        e = _emit(stages, capture, num_microbatches, forward_only, weight_last, expert_wgrad_slot, False)
    _check_draws(e.graph, by_name)
    e.graph.output(None)
    gm = torch.fx.GraphModule(e.root, e.graph, class_name="Program")
    gm.meta = {PROGRAM_KEY: Program(gm, num_microbatches, capture.num_layers, forward_only)}
    return gm


def _emit(stages: list[Stage], capture: Capture, num_microbatches: int, forward_only: bool, weight_last: bool,
          expert_wgrad_slot: int, pairs: bool) -> _Emitter:
    """Step 2: every stage call in program order (``pairs``: a forward-only program's microbatches
    two by two)."""
    num_layers = capture.num_layers
    # the microbatches with no other beside them run the chunks (where a layer has both)
    if not forward_only:
        alone = {0, num_microbatches - 1}
    elif pairs:
        alone = {num_microbatches - 1} if num_microbatches % 2 else set()
    else:
        alone = set(range(num_microbatches))
    e = _Emitter(stages, capture, alone, expert_wgrad_slot)
    for r in stages:
        if r.kind in RECOMPUTE_KINDS:
            readers = [s for s in stages if set(r.outputs) & set(s.inputs)]
            if not readers:
                raise InternalError(f"schedule: no stage reads the outputs of recompute stage {r.name}")
            for s in readers:
                e.recompute_for.setdefault(s.name, []).append(r)
    if not forward_only:
        e.forward(0, num_layers)
        for i in range(1, num_microbatches):
            e.merged(i, i, i - 1, num_layers)
        e.backward(num_microbatches - 1, num_layers, weight_last)
    else:
        paired = num_microbatches - num_microbatches % 2 if pairs else 0
        for mb in range(0, paired, 2):
            e.forward_pair(mb, mb + 1, num_layers)
        for mb in range(paired, num_microbatches):
            e.forward(mb, num_layers)
    expected = [s for s in stages if not forward_only or s.direction is F]
    missing = [(s.name, mb) for mb in range(num_microbatches) for s in expected
               if e.runs(s, mb) and (s.name, mb) not in e.emitted]
    if missing:
        raise InternalError(f"schedule: stages never placed: {missing[:5]}")
    return e


def _buffer_order(graph: torch.fx.Graph, stages: dict[str, Stage], capture: Capture) -> str | None:
    """Why the program would read or update a buffer the forward updates in place out of eager's
    order (every access of microbatch ``i`` before any of ``i + 1``), or None. A buffer that two
    layers share, or that a later stage of a layer reads after its update, breaks it in pairs."""
    shared = set(capture.mutations.values()) & capture.static_placeholders
    last: dict[str, tuple[int, str]] = {}
    for node in graph.nodes:
        step = node.meta.get(STEP_KEY)
        if step is None:
            continue
        if step.stage is not None:
            touched = shared.intersection(stages[step.stage].inputs)
        elif node.target is program_ops.mutate:
            touched = shared.intersection(step.reads)
        else:
            continue
        for p in touched:
            if p in last and step.microbatch < last[p][0]:
                return (f"buffer {p} would be used by {node.name} (microbatch {step.microbatch}) after "
                        f"{last[p][1]} (microbatch {last[p][0]})")
            last[p] = (step.microbatch, node.name)
    return None


def _check_draws(graph: torch.fx.Graph, stages: dict[str, Stage]) -> None:
    """Step 3: the program's random draws, (microbatch, eager index), only ever increase."""
    last = None
    for node in graph.nodes:
        step = node.meta.get(STEP_KEY)
        if step is None or step.stage is None:
            continue
        for d in stages[step.stage].draws:
            if last is not None and (step.microbatch, d) <= last[0]:
                raise RngOrderError(
                    f"schedule: {node.name} (stage {step.stage}) would draw random numbers before {last[1]} "
                    f"(microbatch {last[0][0]}), which eager draws first: random ops would get each other's "
                    f"numbers. A random op in the backward (a custom autograd.Function that draws) cannot "
                    f"overlap the next microbatch's forward; run such a model with one microbatch per call")
            last = ((step.microbatch, d), node.name)
