"""What ``capture`` hands to the passes and the runtime: the joint graph and what its values mean."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.fx

from fxoverlap.ir.errors import FxOverlapError, InternalError


@dataclasses.dataclass(frozen=True)
class Choice:
    """The layer list chosen and why: ``considered`` lists every candidate (its path and
    entry count), ``complete`` whether the chosen one holds every all-to-all, ``outside``
    the name and op of an all-to-all it does not hold (when not complete)."""

    container: str | None
    considered: tuple[tuple[str, int], ...]
    complete: bool = True
    outside: str | None = None

    def describe(self) -> str:
        """The candidates as ``'blocks' (2 entries), 'blocks.0.ffn.experts' (4 entries)``."""
        return ", ".join(f"{c!r} ({n} entries)" for c, n in self.considered) or "none"


@dataclasses.dataclass(frozen=True)
class SubclassLayout:
    """How to rebuild a tensor subclass from its flattened parts with ``__tensor_unflatten__``.

    ``attrs`` lists the subclass's ``__tensor_flatten__`` attributes in order, each
    with the layout of an inner subclass, or None for a leaf (a plain tensor or an
    opaque value such as a DTensor's mesh). ``meta``, ``outer_size`` and
    ``outer_stride`` are what ``__tensor_unflatten__`` takes besides the parts.
    """

    cls: type
    attrs: tuple[tuple[str, SubclassLayout | None], ...]
    meta: object
    outer_size: tuple[int, ...]
    outer_stride: tuple[int, ...]

    def leaves(self, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        """Attribute paths of the leaves, outermost attribute first."""
        out = []
        for attr, sub in self.attrs:
            out.extend(sub.leaves(prefix + (attr,)) if sub is not None else [prefix + (attr,)])
        return out

    def rebuild(self, leaf: Callable[[tuple[str, ...]], object], prefix: tuple[str, ...] = ()) -> torch.Tensor:
        """The subclass whose leaf at each attribute path is ``leaf(path)``."""
        inner = {attr: sub.rebuild(leaf, prefix + (attr,)) if sub is not None else leaf(prefix + (attr,))
                 for attr, sub in self.attrs}
        return self.cls.__tensor_unflatten__(inner, self.meta, self.outer_size, self.outer_stride)


class FrozenError(FxOverlapError, AttributeError):
    """An attribute of an immutable fxoverlap value (a :class:`Microbatch`) was set."""


class Microbatch(tuple):
    """One microbatch as fxoverlap captures and runs it: a flat tuple of its tensors, the
    positional inputs first, then the keyword inputs, whose names are ``keywords`` (in that
    order). The flat tuple is what the graph's input placeholders take; the step calls
    ``model(*mb.args, **mb.kwargs)``. A plain tuple of tensors is a microbatch without keywords.
    Immutable, like the tuple it is."""

    keywords: tuple[str, ...]

    def __new__(cls, tensors, keywords: Sequence[str] = ()) -> Microbatch:
        self = super().__new__(cls, tensors)
        keywords = tuple(keywords)
        if len(keywords) > len(self):
            raise InternalError(f"Microbatch: {len(keywords)} keyword names for {len(self)} tensors")
        object.__setattr__(self, "keywords", keywords)
        return self

    def __setattr__(self, name, value):
        raise FrozenError(f"Microbatch is immutable (setting {name!r}): build a new one")

    def __reduce__(self):
        return Microbatch, (tuple(self), self.keywords)

    @property
    def args(self) -> tuple:
        """The positional inputs."""
        return tuple(self[: len(self) - len(self.keywords)])

    @property
    def kwargs(self) -> dict:
        """The keyword inputs, by name."""
        return dict(zip(self.keywords, self[len(self) - len(self.keywords):]))

    def __repr__(self) -> str:
        return f"Microbatch({tuple(self)!r}, keywords={self.keywords!r})"


def split_inputs(inputs: Sequence, keywords: Sequence[str]) -> tuple[tuple, dict]:
    """``inputs`` (a flat tuple whose last ``len(keywords)`` entries are named by ``keywords``)
    as positional arguments and keyword arguments."""
    n = len(inputs) - len(keywords)
    return tuple(inputs[:n]), dict(zip(keywords, inputs[n:]))


def inner_value(t, path: tuple[str, ...]):
    """The flattened part of tensor subclass ``t`` at attribute ``path`` (``t`` for ``()``)."""
    for attr in path:
        t = getattr(t, attr)
    return t


@dataclasses.dataclass(frozen=True)
class OutputAlias:
    """A step output that aliases a graph input or another output, which AOTAutograd gives no
    tangent: its gradient reaches its base through the view (``fxoverlap/backend_outputs.py``
    rebuilds it from the base). ``kind``: ``"input"`` (the input itself), ``"view_of_input"``
    or ``"view_of_output"``; ``base``: the input placeholder, or the output value (an entry of
    ``Capture.outputs``) it is a view of (None: not a plain one, e.g. a tensor-subclass part);
    ``views``: the view ops functionalization recorded from the base (AOTAutograd's
    ``ViewMetaSequence``; None when it recorded none)."""

    kind: str
    base: str | None
    requires_grad: bool
    views: object = None


@dataclasses.dataclass(frozen=True)
class OverflowSite:
    """One forward dispatch whose capacity is below the worst case."""

    layer: int | None
    node: str
    capacity: int  # rows per link
    worst_case: int  # rows per link that can never overflow
    share: float  # the balanced share of rows per link, which dispatch_capacity_factor multiplies


@dataclasses.dataclass(frozen=True)
class OverflowFlags:
    """The overflow flags of a static dispatcher below the worst case (``Capture.overflow``)."""

    buffer: str  # attribute of the graph module: int64 [len(sites)], max rows on one link per site
    sites: tuple[OverflowSite, ...]
    group_name: str


@dataclasses.dataclass
class Capture:
    """The joint graph of one train step and what its placeholders and outputs mean.

    ``graph_module`` takes ``(*params, *buffers, *inputs, *tangents)`` as plain
    positional arguments (names in the ``*_placeholders`` fields) and returns a flat
    tuple. Its values that leave the step are named here by role: ``outputs``
    (what the step returns: the loss first for a train step), ``grads`` (value ->
    parameter FQN), ``mutations`` (value -> placeholder it must be copied into: a
    buffer or input the forward mutates in place). ``tangents`` maps each tangent
    placeholder to the output it is the gradient of.

    Tensor-subclass parameters and buffers appear as their flattened parts
    (``subclass_placeholders``), inputs as theirs (``input_parts``); a subclass
    parameter's gradient leaves the graph as parts too: each part's value is in
    ``grads`` (-> FQN) and ``grad_parts`` (-> attribute path), and
    ``grad_layouts[fqn]`` rebuilds the gradient from them (opaque leaves, such as a
    mesh, come from the placeholder named in ``grad_opaque``).

    ``output_aliases`` (step output index -> :class:`OutputAlias`): the outputs that alias an
    input or another output. Where two of them are views of one intermediate, AOTAutograd
    returns that intermediate too: ``outputs`` then ends with it (after the step's own
    outputs), with a tangent of its own.
    """

    graph_module: torch.fx.GraphModule
    fake_mode: object  # the FakeTensorMode whose ShapeEnv holds the graph's symbols
    param_placeholders: dict[str, str]  # placeholder name -> parameter FQN
    buffer_placeholders: dict[str, str]  # placeholder name -> buffer FQN
    input_placeholders: list[str]  # the microbatch's tensors (or their parts), in order
    tangents: dict[str, str]  # tangent placeholder -> output value it seeds
    outputs: list[str]  # values the step returns, in order
    grads: dict[str, str]  # gradient value -> parameter FQN
    mutations: dict[str, str]  # new value -> placeholder (buffer or input) it is copied into
    num_layers: int
    layer_names: list[str]
    param_children: dict[int, set[str]]  # per layer: children with parameters that ran
    signature: tuple
    # tensor subclasses (empty for a model of plain tensors)
    subclass_placeholders: dict[str, tuple[str, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    # placeholder -> (FQN of the subclass parameter or buffer, attribute path of the part)
    input_parts: dict[str, tuple[int, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    # input placeholder -> (index of the microbatch tensor, attribute path; () for a plain tensor)
    grad_parts: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    grad_layouts: dict[str, SubclassLayout] = dataclasses.field(default_factory=dict)
    grad_opaque: dict[tuple[str, tuple[str, ...]], str] = dataclasses.field(default_factory=dict)
    # (FQN, attribute path) of an opaque gradient leaf -> the placeholder that holds it
    layer_choice: Choice | None = None  # the layer list chosen, and the candidates considered
    # the dispatcher pass: the backend it lowered the EP ops to (None: not run, or the graph has none to
    # lower), and the overflow flags of a capacity below the worst case (None: nothing can overflow)
    dispatcher: str | None = None
    overflow: OverflowFlags | None = None
    # the EP group size of fxoverlap's exchanges and the names of their groups (the dispatcher pass);
    # None: unknown (none of them)
    ep_size: int | None = None
    ep_groups: tuple[str, ...] | None = None
    output_aliases: dict[int, OutputAlias] = dataclasses.field(default_factory=dict)

    @property
    def loss_name(self) -> str:
        return self.outputs[0]

    @property
    def static_placeholders(self) -> set[str]:
        """Placeholders shared by every microbatch: parameters and buffers (or their parts)."""
        return set(self.param_placeholders) | set(self.buffer_placeholders) | set(self.subclass_placeholders)

    def bind_inputs(self, microbatch: Sequence[torch.Tensor]) -> dict[str, object]:
        """The input placeholders' values for one microbatch (subclass inputs flattened)."""
        if not self.input_parts:
            return dict(zip(self.input_placeholders, microbatch))
        return {ph: inner_value(microbatch[i], path) for ph, (i, path) in self.input_parts.items()}
