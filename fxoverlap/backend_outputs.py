"""The backend's graph outputs that alias a graph input or another output: rebuilt from their base.

Contract
--------
AOTAutograd gives a graph output that *is* a graph input, or is a view of one (``w.t()`` of a
parameter, ``h.reshape(...)`` of an activation passed in after a graph break), or is one of
two views of an intermediate, no tangent: its gradient is to reach its base through the view,
which AOTAutograd's runtime regenerates outside its ``autograd.Function`` from the base
(``gen_alias_from_base``, replaying the view ops functionalization recorded). A compiled step
does the same after its Function (:meth:`OutputPlan.rebuild`):

- a graph input returned as it is, is returned as that input;
- a view of a graph input, or of an output of the Function (a step output, or the
  intermediate AOTAutograd returns as the base of two views, ``Capture.outputs`` past the
  step's own), is the recorded view ops replayed on that base (torch's
  ``gen_alias_from_base``), so autograd carries its gradient into the base as eager's view
  would;
- the extra intermediate bases are not returned.

Assumes: the capture named the aliases (``Capture.output_aliases``) and the call's
arguments are the Dynamo graph's inputs. Guarantees (:func:`plan_outputs`, at compile time):
every output whose Dynamo example value requires grad either has a tangent (the Function
seeds its gradient) or is rebuilt from a base that carries its gradient; any other raises
:class:`OutputGradError` naming the output, so the backend falls back (its
``FallbackWarning`` quotes the message) rather than drop the gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
import torch.fx

from fxoverlap.ir.capture import Capture
from fxoverlap.ir.errors import FxOverlapError

__all__ = ["OutputGradError", "OutputPlan", "graph_outputs", "plan_outputs"]


class OutputGradError(FxOverlapError):
    """A differentiable graph output has no tangent and cannot be rebuilt from its base."""


@dataclasses.dataclass(frozen=True)
class _Rebuild:
    index: int  # the graph output's position
    arg: int | None  # its base: a graph input (index into the call's arguments) ...
    out: int | None  # ... or an output of the Function (index into Capture.outputs)
    views: object  # the view ops to replay on the base (None: the base itself)
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    """How the Function's outputs (``Capture.outputs``) become the graph's ``num_outputs`` outputs."""

    num_outputs: int
    rebuilds: tuple[_Rebuild, ...] = ()

    def rebuild(self, outs: Sequence[torch.Tensor], args: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The graph's outputs from the Function's ``outs`` and the call's ``args``."""
        if not self.rebuilds:
            return tuple(outs[: self.num_outputs])
        from torch._functorch._aot_autograd.functional_utils import gen_alias_from_base

        res = list(outs[: self.num_outputs])
        # views of inputs first: a view of an output may have that (rebuilt) output as its base
        for r in sorted(self.rebuilds, key=lambda r: r.arg is None):
            if r.arg is not None:
                base = args[r.arg]
            else:
                base = res[r.out] if r.out < self.num_outputs else outs[r.out]
            res[r.index] = base if r.views is None else gen_alias_from_base(
                base, outs[r.index], r.requires_grad, r.views, replay_views=True)
        return tuple(res)


def _replayable(views) -> bool:
    return views is not None and not any(vm.has_symbolic_inputs for vm in views.sequence)


def graph_outputs(gm: torch.fx.GraphModule) -> tuple[list[bool], list[str]]:
    """Whether each output of Dynamo graph ``gm`` requires grad (its example value), and its name."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    vals = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    evs = [v.meta.get("example_value") if isinstance(v, torch.fx.Node) else v for v in vals]
    return ([isinstance(ev, torch.Tensor) and ev.requires_grad for ev in evs],
            [v.name if isinstance(v, torch.fx.Node) else repr(v) for v in vals])


def plan_outputs(capture: Capture, gm: torch.fx.GraphModule, arg_of: Mapping[str, int],
                 differentiable_args: set[int]) -> OutputPlan:
    """The :class:`OutputPlan` of Dynamo graph ``gm`` captured as ``capture``.

    ``arg_of``: input placeholder of the capture -> index of the call's argument (the Dynamo
    graph input); ``differentiable_args``: the indices of those that require grad. Raises
    :class:`OutputGradError` for a differentiable output it cannot give a gradient.
    """
    needs_grad, names = graph_outputs(gm)
    seeded = set(capture.tangents.values())
    rebuilds = []
    for i, need in enumerate(needs_grad):
        alias = capture.output_aliases.get(i)
        rebuilt = False
        if alias is not None and alias.base is not None and (alias.kind == "input" or _replayable(alias.views)):
            views = None if alias.kind == "input" else alias.views
            if alias.kind != "view_of_output" and alias.base in arg_of:
                arg = arg_of[alias.base]
                rebuilds.append(_Rebuild(i, arg, None, views, alias.requires_grad))
                rebuilt = arg in differentiable_args
            elif alias.kind == "view_of_output" and alias.base in capture.outputs:
                out = capture.outputs.index(alias.base)
                rebuilds.append(_Rebuild(i, None, out, views, alias.requires_grad))
                rebuilt = alias.base in seeded or (out < len(needs_grad) and needs_grad[out])
        if need and not rebuilt and capture.outputs[i] not in seeded:
            what = (f"AOTAutograd names it a {alias.kind} of {alias.base}" if alias is not None
                    else "AOTAutograd named no base for it")
            raise OutputGradError(
                f"graph output {i} ({names[i]!r}) requires grad but has no tangent, and fxoverlap cannot "
                f"rebuild it from its base ({what}; no view ops to replay on a base that requires grad): its "
                f"gradient would be dropped. Return a tensor the graph computes (e.g. .clone() the view)")
    return OutputPlan(len(needs_grad), tuple(rebuilds))
