"""``fxoverlap.expert_parallel``: expert parallelism for Hugging Face ``transformers`` MoE models.

Contract
    Consumes a model whose MoE blocks call an *experts module* as
    ``experts(hidden[T, D], indices[T, k], weights[T, k]) -> [T, D]`` and whose
    experts module holds its experts as stacked parameters (dim 0 = E experts).
    It is recognised by that call and those shapes, not by class or argument
    names, so every family that shares the interface works without a list.
    The per-expert math comes from the module itself: its declared layout
    (``has_gate``, ``is_transposed``, ``has_bias``, as transformers'
    ``@use_experts_implementation`` sets them) and its own gate/activation
    (``_apply_gate`` / ``act_fn``), so transposed, interleaved, biased and
    non-gated variants keep their math.

    Changes, in place: every parameter of such a module whose dim 0 is E becomes
    this rank's shard ``[r·E/ep, (r+1)·E/ep)`` (same name, a plain tensor), and the
    module's ``forward`` becomes: sort the (token, k) assignments by global
    expert, ``ops.dispatch``, the local experts as grouped GEMMs on rows grouped
    by local expert (``ops.grouped_mm``: traces with the dispatch's unbacked row
    count, in any dtype), ``ops.combine``, unsort, weight, sum over k.

    Experts kept as a list (an ``nn.ModuleList`` / ``nn.ModuleDict`` of E modules of one
    structure whose parameters sit in ``nn.Linear`` layers, the experts module itself or its
    child, called the same way): rank r keeps entries ``[r·E/ep, (r+1)·E/ep)`` under their
    global names and drops the others; the same forward runs the first entry's own forward
    once on all received rows, its Linear layers replaced by grouped GEMMs over the local
    entries' weights (stacked per call).

    Keeps: the routers, attention, shared experts and every other parameter
    (replicated, untouched); the model's outputs, and its losses per rank. Expert
    gradients become those of the sum of all ranks' losses (each expert sees the
    tokens of every rank), as in any EP training.

Pseudo-code::

    for name, experts in find_experts(model):
        E = experts' stacked dim 0; check E % ep == 0
        for p in experts' parameters with dim 0 == E: p <- p[r*E/ep : (r+1)*E/ep]
        experts.forward <- dispatch -> local grouped experts -> combine
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import re
import traceback
import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fxoverlap import ops
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.kernels.a2a import GroupStandIn

__all__ = ["expert_parallel", "explain_capture_error", "find_experts", "ExpertShard", "ExpertParallelError"]

_SHARD_ATTR = "_fxoverlap_expert_shard"
_INTERFACE = (
    "a submodule called as experts(hidden[T, D], indices[T, k], weights[T, k]) -> [T, D] with stacked "
    "parameters of dim 0 = num_experts (at least two 3-D ones, e.g. gate_up_proj[E, 2I, D] and down_proj[E, D, I])"
)


class ExpertParallelError(FxOverlapError, ValueError):
    """The model cannot be made expert-parallel as it is; the message names the module and the fix."""


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """What :func:`expert_parallel` recorded on one experts module."""

    group: dist.ProcessGroup | None
    num_experts: int  # E, in the whole model
    first: int  # this rank's first global expert
    num_local: int  # E / ep

    @property
    def ep(self) -> int:
        return self.num_experts // self.num_local

    def __deepcopy__(self, memo: dict) -> "ExpertShard":
        # Immutable, and a process group cannot be copied: a deep copy of the model
        # (an EMA copy, say) shares the group, as its copies of the shard would.
        return self


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How an experts module computes one expert, from its own declarations."""

    up: str  # "gate_up_proj" (gated) or "up_proj"
    gated: bool
    transposed: bool  # weights stored [E, in, out] instead of [E, out, in]
    bias: bool

    def run(self, mod: nn.Module, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return _local_experts(mod, self, x, tokens_per_expert)


class _GroupedLinear(nn.Module):
    """Stands in for one ``nn.Linear`` of a list expert inside the template: the same Linear of
    every local expert, stacked, as one grouped GEMM over rows grouped by local expert."""

    def __init__(self, path: str, ctx: dict):
        super().__init__()
        self.path = path
        self.ctx = ctx  # shared with the layout: "experts" (the local modules), "offs", "row_expert"

    @property
    def weight(self) -> torch.Tensor:
        """The first local expert's weight: for the MLP code that reads its dtype or device."""
        return self.ctx["experts"][0].get_submodule(self.path).weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.ctx["experts"][0].get_submodule(self.path).bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linears = [e.get_submodule(self.path) for e in self.ctx["experts"]]
        # Stacked per call: each expert's Linear stays its own parameter (same name, same
        # gradient), at the cost of one copy of the local weights per call.
        w = torch.stack([lin.weight for lin in linears])  # [E_local, out, in]
        b = torch.stack([lin.bias for lin in linears]) if linears[0].bias is not None else None
        return _grouped_linear(x, w, b, self.ctx["offs"], self.ctx["row_expert"], transposed=False)


@dataclasses.dataclass(frozen=True)
class _ListLayout:
    """Experts kept as a list of modules of one structure: this rank's entries, and a template
    (a copy of the first, its Linear layers replaced by :class:`_GroupedLinear`) whose own forward
    runs every local expert at once on rows grouped by local expert."""

    container: str  # "" (the experts module is the list) or the name of its list child
    template: nn.Module
    ctx: dict
    bias: bool

    def run(self, mod: nn.Module, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        self.ctx["offs"] = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        self.ctx["row_expert"] = None
        if self.bias:
            self.ctx["row_expert"] = ops.group_of_rows(tokens_per_expert, x.shape[0])
        try:
            return self.template(x)
        finally:
            self.ctx["offs"] = self.ctx["row_expert"] = None


# ---------------------------------------------------------------- recognition


def _called_with_three_tensors(module: nn.Module) -> bool:
    """``forward`` takes three positional arguments (hidden, indices, weights); more only with defaults."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3:
        return False
    return all(p.default is not p.empty for p in positional[3:])


def _stacked_dim(module: nn.Module) -> int | None:
    """E when the module's own 3-D parameters (at least two) share dim 0, else None."""
    dims = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3}
    n3 = sum(1 for p in module.parameters(recurse=False) if p.dim() == 3)
    return dims.pop() if n3 >= 2 and len(dims) == 1 else None


def _three_required_arguments(module: nn.Module) -> bool:
    """``forward(hidden, indices, weights)``: exactly three positional arguments without defaults
    (stricter than for stacked experts: a decoder layer holding a list of modules takes one)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return len(required) == 3 and not any(p.kind == p.VAR_POSITIONAL for p in params)


def _entries(container: nn.Module) -> list[tuple[str, nn.Module]]:
    return list(container._modules.items()) if isinstance(container, (nn.ModuleList, nn.ModuleDict)) else []


def _expert_list(module: nn.Module) -> tuple[str, nn.Module] | None:
    """``(name, container)`` when ``module`` keeps its experts as a list of modules: it is itself an
    ``nn.ModuleList`` / ``nn.ModuleDict`` of at least two modules with parameters, or it has one
    such child (``""`` names the module itself). Structure is checked later (:func:`_list_layout`)."""
    if not _three_required_arguments(module):
        return None
    candidates = [("", module)] if _entries(module) else []
    candidates += [(n, c) for n, c in module.named_children() if _entries(c)]
    candidates = [(n, c) for n, c in candidates
                  if len(_entries(c)) >= 2 and all(any(True for _ in m.parameters()) for _, m in _entries(c))]
    return candidates[0] if len(candidates) == 1 else None


def _num_experts(mod: nn.Module) -> int | None:
    e = _stacked_dim(mod)
    if e is None and (found := _expert_list(mod)) is not None:
        e = len(_entries(found[1]))
    return e


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model`` (by call signature and parameter shapes), outermost first:
    stacked experts (3-D parameters of dim 0 = E) or experts kept as a list of modules."""
    found: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if hasattr(mod, _SHARD_ATTR) or (_stacked_dim(mod) is not None and _called_with_three_tensors(mod)) \
                or _expert_list(mod) is not None:
            found.append((name, mod))
    return found


def _mlp_lists(model: nn.Module) -> list[tuple[str, int, str]]:
    """Lists of at least two modules of one structure whose parameters all sit in nn.Linear layers."""
    out = []
    for name, mod in model.named_modules():
        entries = [m for _, m in _entries(mod)]
        if len(entries) < 2 or not any(True for _ in entries[0].parameters()):
            continue
        if all(_signature(m) == _signature(entries[0]) for m in entries[1:]) and all(
                type(sub) is nn.Linear for sub in entries[0].modules() if any(True for _ in sub.parameters(recurse=False))):
            out.append((name, len(entries), type(entries[0]).__name__))
    return out


def _signature(m: nn.Module) -> list[tuple]:
    return [(n, type(c).__name__) for n, c in m.named_modules()] + \
        [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()]


def _list_layout(name: str, mod: nn.Module) -> _ListLayout:
    """Check that the list's entries share one structure of plain ``nn.Linear`` layers; build the template."""
    cname, container = _expert_list(mod)
    entries = _entries(container)
    where = f"{name}{'.' + cname if cname else ''}"
    first_key, first = entries[0]
    want = _signature(first)
    for key, entry in entries[1:]:
        got = _signature(entry)
        if got != want:
            diff = next(((a, b) for a, b in zip(want, got) if a != b), None)
            if diff is None:  # one is the other plus more
                diff = (want[len(got)], "nothing") if len(want) > len(got) else ("nothing", got[len(want)])
            raise ExpertParallelError(
                f"fxoverlap.expert_parallel: {where} ({type(mod).__name__}) keeps its experts as a list, but entry "
                f"{key} ({type(entry).__name__}) differs in structure from entry {first_key} "
                f"({type(first).__name__}): {diff[1]} where entry {first_key} has {diff[0]} (submodule name and "
                f"class, or parameter name, shape, dtype, requires_grad); expert parallelism runs every local expert "
                f"with one structure, so the entries must be modules of one class with equal parameter shapes"
            )
    linear_paths = []
    for sub_name, sub in first.named_modules():
        own = list(sub.parameters(recurse=False))
        if not own:
            continue
        if type(sub) is not nn.Linear:
            raise ExpertParallelError(
                f"fxoverlap.expert_parallel: {where} ({type(mod).__name__}) keeps its experts as a list of "
                f"{type(first).__name__}, whose submodule {sub_name or '(itself)'} ({type(sub).__name__}) holds "
                f"parameters; list experts run as grouped GEMMs of their nn.Linear layers, so only nn.Linear "
                f"submodules may hold an expert's parameters"
            )
        linear_paths.append(sub_name)
    if any(True for _ in first.buffers()):
        raise ExpertParallelError(
            f"fxoverlap.expert_parallel: {where} ({type(mod).__name__}) keeps its experts as a list of "
            f"{type(first).__name__}, which hold buffers ({[n for n, _ in first.named_buffers()]}); list experts "
            f"may hold only nn.Linear parameters"
        )
    ctx: dict = {"experts": [], "offs": None, "row_expert": None}
    template = copy.deepcopy(first)
    for path in linear_paths:
        parent, _, leaf = path.rpartition(".")
        setattr(template.get_submodule(parent), leaf, _GroupedLinear(path, ctx))
    bias = any(first.get_submodule(p).bias is not None for p in linear_paths)
    return _ListLayout(cname, template, ctx, bias)


def _layout(name: str, mod: nn.Module) -> _Layout:
    flags = {k: getattr(mod, k, None) for k in ("has_gate", "is_transposed", "has_bias")}
    if not all(isinstance(v, bool) for v in flags.values()):
        raise ExpertParallelError(
            f"fxoverlap.expert_parallel: {name} ({type(mod).__name__}) is called like an experts module and "
            f"has stacked expert parameters, but does not declare its weight layout (has_gate, is_transposed, "
            f"has_bias: {flags}); decorate the class with transformers' @use_experts_implementation, or set "
            f"those three bool attributes"
        )
    up = "gate_up_proj" if flags["has_gate"] else "up_proj"
    names = [up, "down_proj"] + ([f"{up}_bias", "down_proj_bias"] if flags["has_bias"] else [])
    missing = [n for n in names if not isinstance(getattr(mod, n, None), torch.Tensor)]
    if missing:
        raise ExpertParallelError(
            f"fxoverlap.expert_parallel: {name} ({type(mod).__name__}) declares has_gate={flags['has_gate']}, "
            f"has_bias={flags['has_bias']} but has no parameter {missing}; its stacked weights must be named "
            f"as transformers' experts interface names them ({names})"
        )
    return _Layout(up, flags["has_gate"], flags["is_transposed"], flags["has_bias"])


# ---------------------------------------------------------------- the expert-parallel forward


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, offs: torch.Tensor,
                    row_expert: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Rows of local expert g times its weight ``w[g]`` (``[in, out]`` if transposed, else ``[out, in]``)."""
    y = ops.grouped_mm(x.to(w.dtype), w if transposed else w.transpose(-1, -2), offs)
    if b is None:
        return y
    # Bias rows gathered in fp32: the same forward (one rounding of the exact sum), and the
    # backward sums each expert's rows (an index_add) in fp32 instead of in bf16.
    return (y + ops.bias_rows(b, row_expert)).to(y.dtype)


def _local_experts(mod: nn.Module, layout: _Layout, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """This rank's experts on ``x`` (rows grouped by local expert); no host sync, any dtype."""
    offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
    row_expert = None
    if layout.bias:
        # Local expert of each row, with the dispatch's (unbacked) row count.
        row_expert = ops.group_of_rows(tokens_per_expert, x.shape[0])
    up_b = getattr(mod, f"{layout.up}_bias") if layout.bias else None
    h = _grouped_linear(x, getattr(mod, layout.up), up_b, offs, row_expert, layout.transposed)
    # The module's own gate / activation: families differ here (interleaved gate/up, clamped GLU, ...).
    h = mod._apply_gate(h) if layout.gated else mod.act_fn(h)
    down_b = mod.down_proj_bias if layout.bias else None
    return _grouped_linear(h, mod.down_proj, down_b, offs, row_expert, layout.transposed)


def _check_call(mod: nn.Module, hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> None:
    ok = (
        isinstance(hidden, torch.Tensor) and isinstance(indices, torch.Tensor) and isinstance(weights, torch.Tensor)
        and hidden.dim() == 2 and indices.dim() == 2 and tuple(weights.shape) == tuple(indices.shape)
        and indices.shape[0] == hidden.shape[0] and not indices.is_floating_point() and weights.is_floating_point()
    )
    if not ok:
        shape = lambda t: f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__  # noqa: E731
        raise ExpertParallelError(
            f"fxoverlap.expert_parallel: {type(mod).__name__} was called with ({shape(hidden)}, {shape(indices)}, "
            f"{shape(weights)}); expected (hidden[T, D], integer indices[T, k], float weights[T, k])"
        )


def _expert_parallel_forward(self: nn.Module, hidden: torch.Tensor, indices: torch.Tensor,
                             weights: torch.Tensor) -> torch.Tensor:
    """``experts(hidden[T, D], indices[T, k], weights[T, k])`` with this rank's shard of the experts."""
    shard: ExpertShard = getattr(self, _SHARD_ATTR)
    if (isinstance(indices, torch.Tensor) and isinstance(weights, torch.Tensor) and indices.dim() == 3
            and not indices.is_floating_point() and indices.shape[-1] == shard.num_experts
            and weights.dim() == 2 and tuple(weights.shape) == tuple(indices.shape[:2])):
        # One-hot expert masks [T, k, E] (Switch Transformers): a row with no expert (dropped
        # over capacity) gets weight 0, as the masked loop gives it nothing.
        weights = weights * indices.sum(-1).to(weights.dtype)
        indices = indices.argmax(-1)
    _check_call(self, hidden, indices, weights)
    n_tok, k = indices.shape
    flat = indices.reshape(-1)
    # (token, k) assignments sorted by global expert: the layout ops.dispatch expects.
    order = torch.argsort(flat, stable=True)
    counts = F.one_hot(flat, shard.num_experts).sum(0)
    routed = hidden.index_select(0, order // k)
    received, recv_counts = ops.dispatch(routed, counts, shard.group)
    # Each local expert's rows padded where the expert math asks (FP8: to 16 rows), dropped after.
    expert_out = ops.expert_rows(functools.partial(self._fxoverlap_layout.run, self), received, recv_counts.sum(0))
    back = ops.combine(expert_out, recv_counts, counts, shard.group, n_tok * k)
    unsorted = torch.zeros_like(back).index_copy(0, order, back)
    # Weight in the routing weights' dtype (fp32 for some routers) and sum over k, as
    # transformers' grouped/batched paths do, then back to the hidden dtype.
    return (unsorted.view(n_tok, k, -1) * weights.unsqueeze(-1)).sum(1).to(hidden.dtype)


# ---------------------------------------------------------------- public entry point


def _ep_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    if isinstance(group, GroupStandIn):  # one rank of its own (the emulated link): not in torch's registry
        return group.size(), 0
    return dist.get_world_size(group), dist.get_rank(group)


def expert_parallel(model: nn.Module, ep_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard ``model``'s MoE experts over ``ep_group`` in place and route tokens through fxoverlap's ops.

    Load the full checkpoint on every rank first (``from_pretrained``), then call
    this: rank ``r`` keeps experts ``[r·E/ep, (r+1)·E/ep)`` of every experts
    module, under the same parameter names. ``ep_group=None`` (or one rank)
    keeps every expert and still runs the dispatch/combine path, so the same
    graphs are captured. Returns ``model``.
    """
    found = find_experts(model)
    if not found:
        lists = _mlp_lists(model)
        lists = [entry for entry in lists if entry[1] >= 4]  # fewer are rarely experts (LongCat's 2 dense mlps)
        hint = (f" {lists[0][0]} is a list of {lists[0][1]} {lists[0][2]} modules, but no module is called with them "
                f"as experts(hidden, indices, weights): if they are the experts, their MoE block loops over them "
                f"itself; expert_parallel replaces a module with that call, so move the block's loop over experts "
                f"into one" if lists else "")
        raise ExpertParallelError(
            f"fxoverlap.expert_parallel: no MoE experts module found in {type(model).__name__}; expected {_INTERFACE}, "
            f"or such a module (an nn.ModuleList / nn.ModuleDict itself, or with one as its child) that keeps its "
            f"experts as a list of modules of one structure.{hint} Dense models need no expert parallelism"
        )
    ep, rank = _ep_size_and_rank(ep_group)
    plans = []
    for name, mod in found:  # check everything before changing anything
        done = getattr(mod, _SHARD_ATTR, None)
        if done is not None:
            if done.group is not ep_group:
                raise ExpertParallelError(
                    f"fxoverlap.expert_parallel: {name} is already sharded over another group "
                    f"({done.ep} ranks); call expert_parallel once per model"
                )
            continue
        e = _num_experts(mod)
        if e % ep:
            raise ExpertParallelError(
                f"fxoverlap.expert_parallel: {name} ({type(mod).__name__}) has {e} experts, which an expert-parallel "
                f"group of {ep} ranks cannot split evenly; use a group size that divides {e}"
            )
        plans.append((name, mod, e, _layout(name, mod) if _stacked_dim(mod) is not None else _list_layout(name, mod)))
    for name, mod, e, layout in plans:
        n_local = e // ep
        lo = rank * n_local
        if isinstance(layout, _ListLayout):
            # Keep entries [lo, lo + n_local) under their global keys (names as in the full model).
            container = mod.get_submodule(layout.container) if layout.container else mod
            for i, key in enumerate(list(container._modules)):
                if not lo <= i < lo + n_local:
                    del container._modules[key]
            layout.ctx["experts"] = list(container._modules.values())
        with torch.no_grad():
            for pname, p in list(mod.named_parameters(recurse=False)):
                if isinstance(layout, _Layout) and p.dim() >= 1 and p.shape[0] == e:
                    shard = nn.Parameter(p[lo: lo + n_local].clone(), requires_grad=p.requires_grad)
                    setattr(mod, pname, shard)
        setattr(mod, _SHARD_ATTR, ExpertShard(ep_group, e, lo, n_local))
        mod._fxoverlap_layout = layout
        # An instance attribute wins over the class's forward (and over transformers'
        # experts-implementation dispatch), so nothing global is patched.
        mod.forward = types.MethodType(_expert_parallel_forward, mod)
    return model


# ---------------------------------------------------------------- capture errors of raw models


def _module_frames(model: nn.Module, exc: BaseException) -> list[tuple[str, nn.Module, traceback.FrameSummary]]:
    """(name, module, frame) of each traceback frame whose ``self`` is a submodule of ``model``, innermost first."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            summary = traceback.FrameSummary(frame.f_code.co_filename, tb.tb_lineno, frame.f_code.co_name)
            out.append((names[id(owner)] or type(model).__name__, owner, summary))
        tb = tb.tb_next
    return out[::-1]


def _where(frame: traceback.FrameSummary) -> str:
    line = (frame.line or "").strip()
    return f"{frame.name}() at {frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno}" + (f": `{line}`" if line else "")


def explain_capture_error(model: nn.Module, exc: BaseException) -> str | None:
    """A message for the capture failures of raw transformers MoE models, or None if ``exc`` is not one.

    Recognises (1) ``experts_implementation="grouped_mm"`` outside bf16 (``torch._grouped_mm``'s
    meta kernel accepts only bf16) and (2) ``experts_implementation="eager"`` (a Python loop
    over the experts that were hit: a guard on data), each raised inside an experts module;
    and (3) transformers' packed-sequence check of the attention mask, which reads data when
    no cache is built. ``exc`` may also wrap one of them (``__cause__`` / ``__context__``).
    Meant for ``passes/capture.py`` to append to its ``CaptureError``.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        msg = _explain_one(model, exc)
        if msg is not None:
            return msg
        exc = exc.__cause__ or exc.__context__
    return None


def _explain_one(model: nn.Module, exc: BaseException) -> str | None:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    msg = str(exc)
    experts = [(n, m, f) for n, m, f in _module_frames(model, exc)
               if _stacked_dim(m) is not None and _called_with_three_tensors(m)]
    fix = ("call fxoverlap.expert_parallel(model, ep_group) before fxoverlap.optimize (it runs the experts as "
           "fxoverlap grouped GEMMs between dispatch and combine, in any dtype)")
    if experts and "Expected inputs of BF16 type" in msg:
        name, mod, frame = experts[0]
        dtype = next(mod.parameters()).dtype
        return (f"fxoverlap capture: {name} ({type(mod).__name__}) runs experts_implementation=\"grouped_mm\", whose "
                f"torch._grouped_mm accepts only bfloat16 while tracing, and its weights are {dtype} "
                f"(in {_where(frame)}); {fix}, or, on one rank without expert parallelism, load the model in bfloat16")
    if not isinstance(exc, GuardOnDataDependentSymNode):
        return None
    if experts:
        name, mod, frame = experts[0]
        found = re.search(r"data-dependent expression (.+?) \(unhinted", msg)
        expr = found.group(1) if found else "a data-dependent value"
        return (f"fxoverlap capture: {name} ({type(mod).__name__}) runs experts_implementation=\"eager\", a Python "
                f"loop over the experts that were hit, which needs the routing on the host while tracing (guard on "
                f"{expr} in {_where(frame)}); {fix}, or, on one rank without expert "
                f"parallelism, use experts_implementation=\"grouped_mm\" in bfloat16")
    mask = [f for f in traceback.extract_tb(exc.__traceback__) if f.name == "find_packed_sequence_indices"]
    if mask:
        return (f"fxoverlap capture: transformers' attention-mask helper {_where(mask[-1])} checks on data whether "
                f"the batch packs several sequences (its tracing check does not see AOTAutograd); it runs only "
                f"when the model builds no cache: keep use_cache=True in the model's config (the default)")
    return None


# `fxoverlap.expert_parallel` is this function once fxoverlap/__init__ imports it; the
# attribute keeps `fxoverlap.expert_parallel.explain_capture_error(...)` working too.
expert_parallel.explain_capture_error = explain_capture_error  # type: ignore[attr-defined]
