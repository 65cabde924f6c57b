"""Stage: one subgraph of the captured joint graph, the unit the schedule moves."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

import torch.fx

from fxoverlap.ir.meta import RNG_ORDER_KEY, op_name


class StageKind(str, enum.Enum):
    """What part of a layer (or of the model) a stage computes."""

    EMBED = "embed"
    ATTN = "attn"  # norms, attention, router, shared expert, permute
    DISPATCH = "dispatch"  # all-to-all: tokens to the ranks owning their experts
    EXPERTS = "experts"
    MLP = "mlp"  # a dense layer's feed-forward
    COMBINE = "combine"  # all-to-all: expert outputs back
    POST = "post"  # unpermute, weighting, residual
    HEAD = "head"  # final norm, output projection, loss, MTP
    RECOMPUTE = "recompute"  # replay of a group's recompute region before its backward
    # an all-to-all of a checkpointed region, replayed in the backward (OverlapConfig.ac_replay_comm)
    RECOMPUTE_COMM = "recompute_comm"

    def __str__(self) -> str:
        return self.value


class Direction(str, enum.Enum):
    FWD = "fwd"
    BWD = "bwd"

    def __str__(self) -> str:
        return self.value


class StreamKind(str, enum.Enum):
    COMP = "comp"
    COMM = "comm"

    def __str__(self) -> str:
        return self.value


class Part(str, enum.Enum):
    """Which part of its (direction, layer, kind) a stage holds."""

    MAIN = ""
    SIDE = "side"  # forward attn work the dispatch does not need: runs under the dispatch
    EARLY = "early"  # backward attn work the backward dispatch does not feed: runs under the combine
    WGRAD = "wgrad"  # weight gradients split off a backward stage (delayed wgrad)

    def __str__(self) -> str:
        return self.value


COMM_KINDS = frozenset({StageKind.DISPATCH, StageKind.COMBINE, StageKind.RECOMPUTE_COMM})
RECOMPUTE_KINDS = frozenset({StageKind.RECOMPUTE, StageKind.RECOMPUTE_COMM})
# One MoE layer's chain: what ``chunk`` cuts, what side work runs beside.
MOE_CHAIN_KINDS = frozenset({StageKind.DISPATCH, StageKind.EXPERTS, StageKind.COMBINE})

# The order of kinds inside one layer's forward; the backward walks it in reverse.
# A dense layer has only ATTN and MLP; a MoE layer has no MLP.
LAYER_KIND_ORDER = (
    StageKind.ATTN,
    StageKind.DISPATCH,
    StageKind.EXPERTS,
    StageKind.MLP,
    StageKind.COMBINE,
    StageKind.POST,
)
_KIND_RANK = {k: i + 1 for i, k in enumerate(LAYER_KIND_ORDER)}
_KIND_RANK[StageKind.EMBED] = 0
_KIND_RANK[StageKind.HEAD] = len(LAYER_KIND_ORDER) + 1
_KIND_RANK[StageKind.RECOMPUTE] = 99  # backward: before every stage of its group's top layer
_KIND_RANK[StageKind.RECOMPUTE_COMM] = 99  # with the recompute stages, ordered by phase
# forward: main then side; backward: early, main, then the weight gradients
_PART_RANK = {Part.MAIN: 1, Part.SIDE: 2, Part.EARLY: 0, Part.WGRAD: 2}


def stream_of(kind: StageKind) -> StreamKind:
    """The stream a stage of ``kind`` runs on: the one place this is decided."""
    return StreamKind.COMM if kind in COMM_KINDS else StreamKind.COMP


@dataclasses.dataclass(frozen=True, order=True)
class Tag:
    """Where a node belongs: (direction, layer, kind, part). ``layer`` is -1 for embed
    and ``num_layers`` for head, so the plain execution order is the sort order.
    ``phase`` orders a group's recompute stages when its replay includes all-to-alls
    (``recompute``): compute of phase p, then the all-to-alls of phase p, then p + 1.
    ``chunk``: which chunk of a layer's dispatch/experts/combine (``chunk``), None when the
    layer is not cut into chunks."""

    direction: Direction
    layer: int
    kind: StageKind
    part: Part = Part.MAIN
    phase: int = 0
    chunk: int | None = None

    def sort_key(self, num_layers: int) -> tuple[int, int, int, int, int, int]:
        kind_rank, part_rank = _KIND_RANK[self.kind], _PART_RANK[self.part]
        step = 2 * self.phase + (self.kind is StageKind.RECOMPUTE_COMM)
        chunk = self.chunk or 0
        if self.direction is Direction.FWD:
            return (0, self.layer, kind_rank, chunk, step, part_rank)
        # backward: head first, layers descending, kinds reversed, embed last
        return (1, num_layers - self.layer, -kind_rank, chunk, step, part_rank)

    def with_part(self, part: Part) -> Tag:
        return dataclasses.replace(self, part=part)

    def __str__(self) -> str:
        return (f"{self.direction}:{self.layer}:{self.kind}" + (f"{self.phase}" if self.phase else "")
                + (f":c{self.chunk}" if self.chunk is not None else "")
                + (f":{self.part}" if self.part is not Part.MAIN else ""))


def stage_name(tag: Tag) -> str:
    layer = "model" if tag.kind in (StageKind.EMBED, StageKind.HEAD) or tag.layer < 0 else f"l{tag.layer}"
    suffix = f"_{tag.part}" if tag.part is not Part.MAIN else ""
    phase = str(tag.phase) if tag.phase else ""
    chunk = f"_c{tag.chunk}" if tag.chunk is not None else ""
    return f"{tag.direction}_{layer}_{tag.kind}{phase}{chunk}{suffix}"


@dataclasses.dataclass(eq=False)
class Stage:
    """A stage subgraph with explicit inputs and outputs.

    ``inputs``/``outputs`` are names of values in the joint graph: a stage reads
    its inputs from the per-microbatch value store and writes its outputs there.
    Fields below the graph are decided by one pass each and only read elsewhere.
    """

    name: str
    tag: Tag
    graph_module: torch.fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    # split: why no CUDA graph can hold this stage (None: capturable)
    not_capturable_reason: str | None = None
    # recompute: the layers whose recompute region this stage replays
    recompute_layers: tuple[int, ...] = ()
    # compile: the Inductor-compiled callable (None: the graph runs op by op)
    compiled: Callable | None = None
    # cudagraph: the runtime runs this stage as a CUDA graph; its outputs are graph memory
    graphed: bool = False

    @property
    def layer(self) -> int:
        return self.tag.layer

    @property
    def kind(self) -> StageKind:
        return self.tag.kind

    @property
    def direction(self) -> Direction:
        return self.tag.direction

    @property
    def part(self) -> Part:
        return self.tag.part

    @property
    def chunk(self) -> int | None:
        return self.tag.chunk

    @property
    def stream(self) -> StreamKind:
        return stream_of(self.tag.kind)

    @property
    def capturable(self) -> bool:
        return self.not_capturable_reason is None

    @property
    def wgrad_of(self) -> str | None:
        """The stage this weight-gradient part was split off, or None."""
        return stage_name(self.tag.with_part(Part.MAIN)) if self.part is Part.WGRAD else None

    @property
    def runs_as(self) -> str:
        """``graphed`` (a CUDA graph), ``inductor`` (compiled kernels) or ``eager`` (op by op)."""
        return "graphed" if self.graphed else "inductor" if self.compiled is not None else "eager"

    def __call__(self, *args):
        """Run the stage: its compiled callable, else its graph's ``forward`` (directly: a
        stage module is ours and has no hooks, so ``nn.Module.__call__`` is host work only)."""
        compiled = self.compiled  # read at each call: a test may swap it
        return compiled(*args) if compiled is not None else self.graph_module.forward(*args)

    @property
    def draws(self) -> tuple[int, ...]:
        """Eager's indices (``rng``) of the random ops this stage runs, in the order it runs them."""
        return tuple(n.meta[RNG_ORDER_KEY] for n in self.graph_module.graph.nodes
                     if n.op == "call_function" and RNG_ORDER_KEY in n.meta)

    def op_list(self) -> list[str]:
        """Compact rendering of the stage's ops, for snapshots and logs."""
        return [op_name(n) for n in self.graph_module.graph.nodes if n.op == "call_function"]

    def __repr__(self) -> str:
        return f"Stage({self.name}, {self.tag}, stream={self.stream}, in={len(self.inputs)}, out={len(self.outputs)})"


def format_stage_table(stages: Sequence[Stage]) -> str:
    """One line per stage: name, layer, kind, direction, stream, #ops, inputs, outputs, how it
    runs (``inductor`` / ``eager`` / ``graphed``), and whether a CUDA graph can hold it."""
    rows = [("stage", "layer", "kind", "dir", "stream", "ops", "in", "out", "runs", "capturable")]
    for s in stages:
        kind = str(s.kind) if s.chunk is None else f"{s.kind} c{s.chunk}"
        rows.append((s.name, str(s.layer), kind, str(s.direction), str(s.stream),
                     str(len(s.op_list())), str(len(s.inputs)), str(len(s.outputs)), s.runs_as,
                     "yes" if s.capturable else f"no: {s.not_capturable_reason.split(': ', 1)[-1]}"))
    return render_rows(rows)


def render_rows(rows: list[tuple[str, ...]]) -> str:
    """Rows as aligned columns (the last one left ragged)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows
    )
