"""torchtitan's experts on fxoverlap's grouped GEMM, for ``OverlapConfig(expert_dtype=...)``.

torchtitan's ``GroupedExperts`` (and its subclasses, e.g. GPT-OSS's) run every expert GEMM
through one method, ``self._grouped_mm(A=..., B_t=..., offs=...)``, which torchtitan documents
as the seam for low-precision variants (its Float8 / MXFP8 converters subclass it). fxoverlap's
FP8 experts use that seam, so the model's own expert math (gate/up/down, biases, activation,
the bf16 casts) stays torchtitan's:

* while :func:`fxoverlap_gemms` is active, each such module's ``_grouped_mm`` is
  ``fxoverlap.ops.grouped_mm`` (the FP8 rowwise op under ``fp8_ops.expert_math("fp8_rowwise")``,
  whose weight gradient stays a node of its own for ``delay_wgrad``), and its ``forward`` runs
  with each expert's row group padded to the active alignment (``ops.expert_rows``: 16 rows
  under FP8, sync-free), so torchtitan's default token dispatcher needs no change (a capacity
  dispatcher's rows past the groups, DeepEP's or HybridEP's, are carried along: untested, CUDA only);
* on exit both are the class's again. Only instance attributes are set, only for the
  duration of a trace or of an eager reference step; the model and its classes are unchanged.

``fxoverlap.optimize`` traces under it when ``expert_dtype`` is set; eager PyTorch with the same
FP8 ops (the reference the tests compare against) is::

    with fp8_ops.expert_math("fp8_rowwise"), torchtitan_experts.fxoverlap_gemms(model):
        loss = loss_fn(model(tokens), tokens)

torchtitan is imported only where the model already imported it (``sys.modules``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.nn as nn

from fxoverlap import ops
from fxoverlap.fp8_ops import Fp8ExpertError

_SEAM = "_grouped_mm"


def _grouped_experts_class() -> type | None:
    if "torchtitan.models.common.moe" not in sys.modules:  # a model of torchtitan's imported it
        return None
    return sys.modules["torchtitan.models.common.moe"].GroupedExperts


def seam_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every torchtitan ``GroupedExperts`` in ``model`` (subclasses too).
    Raises :class:`Fp8ExpertError` for one whose seam is already replaced, by its class
    (torchtitan's own Float8/MXFP8 converters) or on the instance: its GEMMs are someone else's."""
    base = _grouped_experts_class()
    if base is None:
        return []
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, base)]
    for name, m in found:
        if getattr(type(m), _SEAM) is not getattr(base, _SEAM):
            raise Fp8ExpertError(
                f"OverlapConfig(expert_dtype='fp8_rowwise'): {name} ({type(m).__qualname__}) already runs its own "
                f"{_SEAM} (torchtitan's Float8/MXFP8 grouped-experts converter?), so fxoverlap cannot put its FP8 "
                f"GEMMs there. Build the model without torchtitan's MoE quantization converter and let fxoverlap "
                f"quantize, or keep torchtitan's and leave expert_dtype=None")
        if _SEAM in vars(m):
            raise Fp8ExpertError(
                f"OverlapConfig(expert_dtype='fp8_rowwise'): a {type(m).__qualname__} instance has its own {_SEAM} "
                f"attribute; fxoverlap runs torchtitan's experts through their class's {_SEAM} seam. Remove the "
                f"instance attribute or leave expert_dtype=None")
    return found


def _groups_fill_rows(model: nn.Module, name: str) -> bool:
    """Whether the experts at ``name`` get exactly their groups' rows: their sibling dispatcher
    (torchtitan's ``RoutedExperts``) is the local or the all-to-all one, exactly (a subclass such
    as ``TorchAOTokenDispatcher`` pads the groups itself, within a row bound). Any other
    dispatcher (DeepEP, HybridEP, ...) or caller may hand rows past the groups, which the padding
    then carries along (``ops.pad_groups(tail=True)``; such layers are not cut into chunks)."""
    dispatchers = sys.modules["torchtitan.models.common.token_dispatcher"]
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    d = getattr(parent, "token_dispatcher", None)
    return type(d) in (dispatchers.LocalTokenDispatcher, dispatchers.AllToAllTokenDispatcher)


def _grouped_mm(*, A, B_t, offs):  # torchtitan's seam signature: A[R, D] @ B_t[e] per expert group
    return ops.grouped_mm(A, B_t, offs)


@contextlib.contextmanager
def fxoverlap_gemms(model: nn.Module) -> Iterator[list[str]]:
    """Run ``model``'s torchtitan experts through ``ops.grouped_mm`` with padded row groups while
    active (yields their names; empty for a model without them)."""
    found = seam_modules(model)
    # torchtitan's parallelize() sets an instance forward (its input/output redistribution): it is
    # wrapped as found and put back as found
    saved = [vars(m).get("forward") for _, m in found]
    try:
        for name, m in found:
            forward, tail = m.forward, not _groups_fill_rows(model, name)
            m.forward = lambda x, counts, _forward=forward, _tail=tail: ops.expert_rows(_forward, x, counts, tail=_tail)
            setattr(m, _SEAM, _grouped_mm)
        yield [name for name, _ in found]
    finally:
        for (_, m), forward in zip(found, saved):
            vars(m).pop(_SEAM, None)
            if forward is None:
                vars(m).pop("forward", None)
            else:
                m.forward = forward
