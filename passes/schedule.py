"""schedule: emit the interleaved 1F1B program as an FX graph whose nodes call stages.

F(0); for i = 1..N-1 the merged step F(i) ⊗ B(i-1); then B(N-1). In the merged
step, forward layer j pairs with backward layer L-1-j (Megatron's order), four
slots per pair, the compute stage of each slot issued before its comm stage:

    slot | comm stream   | compute stream
    1    | B combine     | F attn          (B post right before B combine,
    2    | F dispatch    | B experts        F post(j-1) right before F attn(j))
    3    | B dispatch    | F experts (+ B experts wgrad)
    4    | F combine     | B attn

With delayed weight-grad, B experts' wgrad joins slot 3 and B attn's wgrad joins
the next pair's slot 1 (the last pair's runs before B embed).

B head opens the merged step; F post of the last layer, F head and B embed close
it. A dense layer's ``mlp`` takes the experts slot and has no comm slots. A
recompute stage runs right before the first backward stage of its group.

The drain B(N-1) (with N = 1, the whole backward) has no forward to pair with,
so it overlaps its comm stages with its own weight-grads: stages run in plain
backward order, and each wgrad part waits until the microbatch's next comm stage
has been issued, so the compute stream runs it while the comm stream runs that
all-to-all. Per MoE layer l:

    B experts(l) -> B dispatch(l) -> wgrad experts(l) -> B attn(l)
    -> B post(l-1) -> B combine(l-1) -> wgrad attn(l) -> B experts(l-1) -> ...

A wgrad part with no comm stage after it (layer 0's attn, dense layers under the
lowest MoE layer) runs right after its parent: waiting would only hold memory.
Drain stages are outside the slots (``meta["slot"]`` None).

Each program node is ``call_module`` on a stage wrapper with ``args=(microbatch,)``
and ``meta["stage"]``, ``meta["microbatch"]`` and ``meta["slot"]`` (``(merged step,
layer pair, slot)``, or None outside the slots); the runtime walks them in order.

Entry point: ``schedule(stages, num_microbatches, num_layers) -> GraphModule``.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn as nn

from fxoverlap.stage import Direction, Stage, StageKind, StreamKind


class StageCall(nn.Module):
    """Placeholder module that names a stage in the program; the runtime executes it."""

    def __init__(self, stage: Stage):
        super().__init__()
        self.stage_name = stage.name

    def forward(self, microbatch: int, **_):  # pragma: no cover - the runtime interprets the program
        raise RuntimeError("a program is walked by fxoverlap's runtime, not called")


class _Emitter:
    def __init__(self, stages: list[Stage]):
        self.by_tag = {}
        self.wgrad: dict[str, Stage] = {}  # parent stage name -> its delayed weight-grad part
        for s in stages:
            if s.wgrad_of is None:
                self.by_tag.setdefault((s.direction, s.layer, s.kind), []).append(s)
            else:
                self.wgrad[s.wgrad_of] = s
        self.root = nn.Module()
        self.graph = torch.fx.Graph()
        self.emitted: set[tuple[str, int]] = set()
        self.recompute_before: dict[tuple[str, int], list[Stage]] = {}
        # (merged step, layer pair, slot) of the stages emitted now; None outside slots
        self.slot: tuple[int, int, int] | None = None

    def get(self, direction: Direction, layer: int, kind: StageKind) -> list[Stage]:
        return self.by_tag.get((direction, layer, kind), [])

    def wgrad_of(self, stages: list[Stage]) -> list[Stage]:
        return [self.wgrad[s.name] for s in stages if s.name in self.wgrad]

    def emit(self, stages: list[Stage], mb: int) -> None:
        for s in stages:
            for r in self.recompute_before.pop((s.name, mb), []):
                self._emit_one(r, mb)
            self._emit_one(s, mb)

    def _emit_one(self, s: Stage, mb: int) -> None:
        if (s.name, mb) in self.emitted:
            return
        self.emitted.add((s.name, mb))
        if not hasattr(self.root, s.name):
            self.root.add_module(s.name, StageCall(s))
        node = self.graph.call_module(s.name, (mb,))
        node.name = f"{'F' if s.direction is Direction.FWD else 'B'}{mb}_{s.name.split('_', 1)[1]}"
        node.meta["stage"] = s.name
        node.meta["microbatch"] = mb
        node.meta["slot"] = self.slot


def _layer_kinds(direction: Direction) -> tuple[StageKind, ...]:
    kinds = (StageKind.ATTN, StageKind.DISPATCH, StageKind.EXPERTS, StageKind.MLP, StageKind.COMBINE, StageKind.POST)
    return kinds if direction is Direction.FWD else tuple(reversed(kinds))


def schedule(stages: list[Stage], num_microbatches: int, num_layers: int) -> torch.fx.GraphModule:
    if num_microbatches < 1:
        raise ValueError("schedule: need at least one microbatch")
    e = _Emitter(stages)
    F, B = Direction.FWD, Direction.BWD
    K = StageKind
    # A recompute stage (layer = first layer of its group, kind RECOMPUTE) runs
    # right before the group's first backward stage.
    for s in stages:
        if s.kind is K.RECOMPUTE:
            first = _first_backward_of_group(stages, s)
            for mb in range(num_microbatches):
                e.recompute_before.setdefault((first.name, mb), []).append(s)

    def fwd_all(mb: int) -> None:
        e.emit(e.get(F, -1, K.EMBED), mb)
        for layer in range(num_layers):
            for kind in _layer_kinds(F):
                e.emit(e.get(F, layer, kind), mb)
        e.emit(e.get(F, num_layers, K.HEAD), mb)

    def bwd_all(mb: int) -> None:
        """What is left of B(mb), in plain order, each wgrad part after the next comm stage."""
        order = list(e.get(B, num_layers, K.HEAD))
        for layer in reversed(range(num_layers)):
            for kind in _layer_kinds(B):
                order += e.get(B, layer, kind)
        order += e.get(B, -1, K.EMBED)
        comm_left = sum(s.stream is StreamKind.COMM for s in order)
        pending: list[Stage] = []  # wgrad parts waiting for the next comm stage
        for s in order:
            e.emit([s], mb)
            if s.stream is StreamKind.COMM:
                comm_left -= 1
                # issued on the comm stream: these wgrads now run alongside it
                e.emit(pending, mb)
                pending = []
            if comm_left:
                pending += e.wgrad_of([s])
            else:  # no comm stage left to overlap with
                e.emit(e.wgrad_of([s]), mb)

    fwd_all(0)
    for i in range(1, num_microbatches):
        f, b = i, i - 1
        e.emit(e.get(B, num_layers, K.HEAD), b)
        for j in range(num_layers):
            fl, bl = j, num_layers - 1 - j
            # slot 1: B combine || F attn
            e.slot = (i, j, 1)
            e.emit(e.get(B, bl, K.POST), b)
            if fl == 0:
                e.emit(e.get(F, -1, K.EMBED), f)
            else:
                e.emit(e.get(F, fl - 1, K.POST), f)
            e.emit(e.get(F, fl, K.ATTN), f)
            if j > 0:  # the previous pair's B attn weight-grad fills this B combine
                e.emit(e.wgrad_of(e.get(B, bl + 1, K.ATTN)), b)
            e.emit(e.get(B, bl, K.COMBINE), b)
            # slot 2: F dispatch || B experts
            e.slot = (i, j, 2)
            e.emit(e.get(B, bl, K.EXPERTS) + e.get(B, bl, K.MLP), b)
            e.emit(e.get(F, fl, K.DISPATCH), f)
            # slot 3: B dispatch || F experts
            e.slot = (i, j, 3)
            e.emit(e.get(F, fl, K.EXPERTS) + e.get(F, fl, K.MLP), f)
            # B experts' weight-grad fills the B dispatch it no longer delays
            e.emit(e.wgrad_of(e.get(B, bl, K.EXPERTS) + e.get(B, bl, K.MLP)), b)
            e.emit(e.get(B, bl, K.DISPATCH), b)
            # slot 4: F combine || B attn
            e.slot = (i, j, 4)
            e.emit(e.get(B, bl, K.ATTN), b)
            e.emit(e.get(F, fl, K.COMBINE), f)
            e.slot = None
        e.emit(e.get(F, num_layers - 1, K.POST), f)
        e.emit(e.get(F, num_layers, K.HEAD), f)
        e.emit(e.wgrad_of(e.get(B, 0, K.ATTN)), b)
        e.emit(e.get(B, -1, K.EMBED), b)
        bwd_all(b)  # anything of B(i-1) the slots did not place (e.g. fallback stages)
    bwd_all(num_microbatches - 1)
    missing = [(s.name, mb) for mb in range(num_microbatches) for s in stages if (s.name, mb) not in e.emitted]
    if missing:
        raise AssertionError(f"schedule: stages never placed: {missing[:5]}")
    e.graph.output(None)
    gm = torch.fx.GraphModule(e.root, e.graph, class_name="Program")
    gm.meta = {"num_microbatches": num_microbatches, "num_layers": num_layers}
    return gm


def _first_backward_of_group(stages: list[Stage], rec: Stage) -> Stage:
    bwd = [
        s for s in stages
        if s.direction is Direction.BWD and s.layer in rec.recompute_layers and s.kind is not StageKind.RECOMPUTE
    ]
    if not bwd:
        raise AssertionError(f"schedule: recompute stage {rec.name} has no backward stage to precede")
    return bwd[0]  # stages are in plain order, so the first backward stage of the group
