"""Stage: one subgraph of the captured joint graph, the unit the schedule moves."""

from __future__ import annotations

import dataclasses
import enum

import torch.fx


class StageKind(str, enum.Enum):
    """What part of a layer (or of the model) a stage computes."""

    EMBED = "embed"
    ATTN = "attn"  # norms, attention, router, shared expert, permute
    DISPATCH = "dispatch"  # all-to-all: tokens to the ranks owning their experts
    EXPERTS = "experts"
    COMBINE = "combine"  # all-to-all: expert outputs back
    POST = "post"  # unpermute, weighting, residual
    MLP = "mlp"  # a dense layer's feed-forward
    HEAD = "head"  # final norm, output projection, loss, MTP
    RECOMPUTE = "recompute"  # replay of a group's mHC forward before its backward

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


COMM_KINDS = frozenset({StageKind.DISPATCH, StageKind.COMBINE})

# Order of kinds inside one layer's forward; the backward walks it in reverse.
LAYER_KIND_ORDER = (
    StageKind.ATTN,
    StageKind.DISPATCH,
    StageKind.EXPERTS,
    StageKind.COMBINE,
    StageKind.POST,
    StageKind.MLP,
)


@dataclasses.dataclass(frozen=True, order=True)
class Tag:
    """Where a node belongs: (direction, layer, kind). ``layer`` is -1 for embed and
    ``num_layers`` for head, so the plain execution order is the sort order."""

    direction: Direction
    layer: int
    kind: StageKind

    def sort_key(self, num_layers: int) -> tuple[int, int, int]:
        kind_rank = _KIND_RANK[self.kind]
        if self.direction is Direction.FWD:
            return (0, self.layer, kind_rank)
        # backward: head first, layers descending, kinds reversed, embed last
        return (1, num_layers - self.layer, -kind_rank)

    def __str__(self) -> str:
        return f"{self.direction}:{self.layer}:{self.kind}"


_KIND_RANK = {
    StageKind.EMBED: 0,
    StageKind.RECOMPUTE: 99,  # backward: before every stage of its group's top layer
    StageKind.ATTN: 1,
    StageKind.DISPATCH: 2,
    StageKind.EXPERTS: 3,
    StageKind.COMBINE: 4,
    StageKind.POST: 5,
    StageKind.MLP: 3,
    StageKind.HEAD: 6,
}


@dataclasses.dataclass
class Stage:
    """A stage subgraph with explicit inputs and outputs.

    ``inputs``/``outputs`` are names of values in the joint graph: a stage reads
    its inputs from the per-microbatch value store and writes its outputs there.
    """

    name: str
    layer: int
    kind: StageKind
    direction: Direction
    stream: StreamKind
    graph_module: torch.fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    capturable: bool = True
    not_capturable_reason: str | None = None
    # Weight-gradient part split off a backward stage (delayed wgrad), or None.
    wgrad_of: str | None = None
    # Recompute stages: the layers whose mHC forward this stage replays.
    recompute_layers: tuple[int, ...] = ()

    @property
    def tag(self) -> Tag:
        return Tag(self.direction, self.layer, self.kind)

    def __call__(self, *args):
        return self.graph_module(*args)

    def op_list(self) -> list[str]:
        """Compact rendering of the stage's ops, for snapshots and logs."""
        out = []
        for n in self.graph_module.graph.nodes:
            if n.op == "call_function":
                out.append(_op_name(n.target))
        return out

    def __repr__(self) -> str:
        return (
            f"Stage({self.name}, layer={self.layer}, kind={self.kind}, "
            f"direction={self.direction}, stream={self.stream}, "
            f"in={len(self.inputs)}, out={len(self.outputs)})"
        )


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        name = target._schema.name.split("::")[-1]
        return f"{ns}.{name}"
    return getattr(target, "__name__", str(target))


def stage_name(tag: Tag, suffix: str = "") -> str:
    layer = {-1: "model"}.get(tag.layer, f"l{tag.layer}")
    if tag.kind in (StageKind.EMBED, StageKind.HEAD):
        layer = "model"
    return f"{tag.direction}_{layer}_{tag.kind}{suffix}"
