"""capture: trace forward + loss + backward of a model into one joint FX graph.

Contract
--------
Assumes: the model's decoder layers are the entries of one ``nn.ModuleList`` or
``nn.ModuleDict`` (the outermost list whose entries hold every all-to-all, chosen by
``passes/layers.py``, or named by ``OverlapConfig.layer_container``),
called once each per forward; the inputs are tensors (a ``Microbatch``, ``fxoverlap.ir.capture``,
names its last ones as keyword arguments: ``model(*args, **kwargs)``, ``loss_fn(out, *args,
**kwargs)``); the loss is a scalar tensor
(``scalar_loss=False``, for the torch.compile backend: any tensor outputs). Buffers
and inputs the forward updates in place (a load-balance counter, a running
statistic) are allowed; parameters updated in place are not. Tensor-subclass
parameters, buffers and inputs (DTensor) are allowed: the graph takes their
flattened parts (``__tensor_flatten__`` attributes: a DTensor's ``_local_tensor``,
and its ``device_mesh`` where torch passes it as an opaque value).

Guarantees: a :class:`Capture`: the joint graph from AOTAutograd's
``aot_export_joint_with_descriptors`` with no decompositions, so every node is the
aten op eager runs and executing the graph reproduces eager's loss and gradients
bitwise on CPU; every placeholder and graph output named by role (parameters,
buffers, inputs, tangents; outputs, parameter gradients, in-place updates in
``Capture.mutations``); subclass parts named in ``Capture.subclass_placeholders`` /
``input_parts`` / ``grad_parts``, and each subclass gradient's layout (for a DTensor
its mesh and placements, as the traced backward, so eager, produced them) in
``grad_layouts``, so the runtime can rebuild it. Every tensor the step hands out
(output, gradient, new buffer value) is a node of its own that the graph computes:
where AOTAutograd returns one node for two entries, or a placeholder as it is (a
gradient that is the tangent), a clone stands in. Forward nodes of decoder layer
``i`` carry the annotation ``{LAYER_KEY: i, CHILD_KEY: child}``
(``node.meta["custom"]``; the children of a wrapped layer, ``checkpoint_wrapper`` or
a ``torch.compile``'d module, are those of the module it wraps); ops run inside a
non-reentrant ``torch.utils.checkpoint`` call also carry ``{CHECKPOINT_KEY: id}``
(:func:`_mark_checkpoints`), so the recompute pass can replay them; backward nodes
carry the ``seq_nr`` of the forward op they differentiate. Inputs are faked with static
shapes under a ``ShapeEnv``, so a data-dependent dispatch (dropless routing) gets an
unbacked row count and one capture serves every routing outcome. Nothing runs on
real data and nothing is communicated. A model that cannot be traced raises
:class:`CaptureError` saying why and what to change. Whether the capture succeeds or fails,
every module's parameters and buffers are afterwards the objects they were before it
(:func:`_restore_state`), so eager keeps working. A submodule registered under two paths
(shared by two layers, or also kept as ``model.first``) is one set of placeholders, named by
its first path (:class:`_Step`), and its ops carry the layer that ran each call; a decoder
layer that runs twice per forward raises :class:`CaptureError` naming its paths.

Steps
-----
1. Refuse FSDP2-wrapped modules; find the candidate layer lists (``find_layers``).
2. Trace the train step (``_TrainStep``: model + loss) under forward hooks that
   annotate each layer's and child's ops (``_annotate_layers``) and with checkpoint
   calls marked (``_mark_checkpoints``).
3. Choose the layer list from where the all-to-alls ran (``layers.choose_container``),
   check each of its entries ran once (``_check_layers_run_once``),
   and keep only its annotations (``layers.resolve``). Give each handed-out value a node of its own (``_distinct_sink_values``).
4. Name placeholders and outputs by role from AOTAutograd's descriptors and the
   subclass layouts of the gradients (``_roles``, ``_grad_layouts``).

Entry point: ``capture(model, inputs, loss_fn=None, layer_container=None, train=True,
scalar_loss=True) -> Capture`` (with ``train=False``, ``loss_fn`` picks the one output tensor from
the model's output: ``engine.forward_only(..., output_fn=...)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.capture import Capture, Choice, OutputAlias, SubclassLayout, inner_value, split_inputs
from fxoverlap.ir.meta import CHECKPOINT_KEY, LIST_KEY
from fxoverlap.passes.layers import LayerCandidate, choose_container, layer_facts, resolve


class CaptureError(FxOverlapError, RuntimeError):
    """The model cannot be captured as it is; the message says why and what to change."""


def find_layers(model: nn.Module, container: str | None) -> dict[str, list[nn.Module]]:
    """The candidate decoder-layer lists of ``model``, path -> entries: ``container`` alone if
    given, else every ``nn.ModuleList`` / ``nn.ModuleDict`` with entries that have parameters
    (the pass ``layers.choose_container`` picks among them from where the all-to-alls ran)."""
    if container is not None:
        try:
            mod = model.get_submodule(container)
        except AttributeError as e:
            raise CaptureError(f"OverlapConfig(layer_container={container!r}): {e}; name the attribute path of "
                               f"the model's list of decoder layers (e.g. 'layers' or 'model.layers')") from e
        if not isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            raise CaptureError(
                f"OverlapConfig(layer_container={container!r}) names a {type(mod).__name__}, "
                f"not an nn.ModuleList or nn.ModuleDict of layers"
            )
        return {container: list(mod.values() if isinstance(mod, nn.ModuleDict) else mod)}
    found: dict[str, list[nn.Module]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            kids = list(mod.values() if isinstance(mod, nn.ModuleDict) else mod)
            kids = [k for k in kids if any(True for _ in k.parameters())]
            if kids:
                found[name] = kids
    return found


def input_signature(inputs: Sequence[torch.Tensor]) -> tuple:
    """Each input's shape, dtype, device type and ``requires_grad``; for a :class:`Microbatch`
    with keyword inputs, their names too (two key sets are two captures)."""
    sig = tuple((tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for t in inputs)
    keywords = getattr(inputs, "keywords", ())
    return (*sig, ("**", keywords)) if keywords else sig


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


class _Step(nn.Module):
    """Base of the traced step modules: each parameter and buffer *slot* is listed once.

    AOTAutograd lists the step's tensors with ``remove_duplicate=False`` and swaps each name for
    its traced stand-in (``torch.nn.utils.stateless._reparametrize_module``). A submodule
    registered under two paths (a norm shared by two layers, a block also kept as
    ``model.first``) would be swapped twice through its one slot, so the restore after the trace
    left the first stand-in there (the model's parameters left as FunctionalTensors), and the
    trace read only the second name's placeholder. Here each module is visited once, under its
    first path (as ``model.named_parameters()`` names it), while one tensor held in two modules'
    slots (tied embedding and output weights) keeps a name per slot, as before, and gets a
    gradient per slot that the runtime sums."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        if remove_duplicate:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        return _slots(self, "_parameters", prefix, recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        if remove_duplicate:
            return super().named_buffers(prefix, recurse, remove_duplicate)
        return _slots(self, "_buffers", prefix, recurse)


def _slots(module: nn.Module, kind: str, prefix: str, recurse: bool):
    """(name, tensor) of every non-None entry of each module's ``kind`` dict, each module once."""
    mods = module.named_modules(prefix=prefix) if recurse else [(prefix, module)]
    for path, mod in mods:
        for name, t in getattr(mod, kind).items():
            if t is not None:
                yield (f"{path}.{name}" if path else name), t


@contextlib.contextmanager
def _restore_state(model: nn.Module):
    """Put every module's parameters and buffers back as they were when the block ends, however
    it ends: a trace swaps them for stand-ins, and a failure, or a model that registers a tensor
    while it runs (under fake tensors), must not leave one behind for eager to trip on."""
    saved = [(m, kind, dict(getattr(m, kind))) for m in model.modules() for kind in ("_parameters", "_buffers")]
    try:
        yield
    finally:
        for m, kind, before in saved:
            now = getattr(m, kind)
            for name in [n for n in now if n not in before]:
                del now[name]
            for name, t in before.items():
                if now.get(name, _ABSENT) is not t:
                    now[name] = t


_ABSENT = object()


@contextlib.contextmanager
def _plain_stand_ins(model: nn.Module, shapes: Mapping[str, torch.Size] | None, fake_mode):
    """Put a plain fake tensor of the given shape (in ``fake_mode``: no memory) in each named
    parameter's place, under every name it is held by; ``_restore_state`` puts them back."""
    if shapes:
        named = dict(model.named_parameters(remove_duplicate=False))  # a tied one: by any of its names
        stand_in = {}
        for name, shape in shapes.items():
            p = named[name]
            with fake_mode:
                fake = torch.empty(shape, dtype=p.dtype, device=p.device)
            stand_in[id(p)] = nn.Parameter(fake, requires_grad=p.requires_grad)
        for mod in model.modules():
            for k, p in list(mod._parameters.items()):
                if p is not None and id(p) in stand_in:
                    mod._parameters[k] = stand_in[id(p)]
    yield


class _TrainStep(_Step):
    """model + loss as one module, so the joint graph ends at the loss.

    ``scalar_loss=False`` (the torch.compile backend): the model's outputs are returned
    as they are, one tensor or a tuple of tensors, and the caller seeds each one's
    gradient."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, scalar_loss: bool = True,
                 keywords: Sequence[str] = ()):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.scalar_loss = scalar_loss
        self.keywords = tuple(keywords)  # the names of the last inputs: passed as keyword arguments

    def forward(self, *inputs: torch.Tensor):
        args, kwargs = split_inputs(inputs, self.keywords)
        out = self.model(*args, **kwargs)
        loss = out if self.loss_fn is None else self.loss_fn(out, *args, **kwargs)
        if not self.scalar_loss:
            outs = loss if isinstance(loss, (tuple, list)) else (loss,)
            if bad := [i for i, o in enumerate(outs) if not isinstance(o, torch.Tensor)]:
                raise CaptureError(f"output {bad[0]} of the step is {_describe(outs[bad[0]])}; "
                                   f"fxoverlap handles tensor outputs")
            return tuple(outs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            if self.loss_fn is None:
                hint = " (a Hugging Face output with its loss: loss_fn=lambda out, **batch: out.loss)" if (
                    isinstance(getattr(loss, "loss", None), torch.Tensor)) else ""
                raise CaptureError(
                    f"the model returned {_describe(loss)}, not a scalar loss, and no loss_fn was given: "
                    f"pass loss_fn=lambda output, *inputs: <scalar> to forward_backward{hint}"
                )
            raise CaptureError(f"loss_fn returned {_describe(loss)}; it must return a scalar tensor")
        return loss


class _Forward(_Step):
    """The forward alone: one output tensor (``optimize``'s ``engine(*inputs)``; ``output_fn(out,
    *inputs)`` picks it from a structured output, ``engine.forward_only``'s), or with
    ``single=False`` a tuple of them (the backend's Dynamo graphs)."""

    def __init__(self, model: nn.Module, single: bool = True, output_fn: Callable | None = None,
                 keywords: Sequence[str] = ()):
        super().__init__()
        self.model, self.single, self.output_fn = model, single, output_fn
        self.keywords = tuple(keywords)  # the names of the last inputs: passed as keyword arguments

    def forward(self, *inputs: torch.Tensor):
        args, kwargs = split_inputs(inputs, self.keywords)
        out = self.model(*args, **kwargs)
        if self.output_fn is not None:
            out = self.output_fn(out, *args, **kwargs)
        if not self.single and isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
            return tuple(out)
        if not isinstance(out, torch.Tensor):
            what = "output_fn" if self.output_fn is not None else "the model"
            raise CaptureError(f"{what} returned {_describe(out)}; fxoverlap's forward-only call handles one "
                               f"output tensor: pick it with engine.forward_only(microbatches, output_fn=lambda out, "
                               f"*inputs: out.logits)")
        return out


# Attributes through which a module wrapper holds the module it wraps: activation
# checkpointing's checkpoint_wrapper, torch.compile's OptimizedModule, FSDP1.
WRAPPED_MODULE_ATTRS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def unwrap(module: nn.Module) -> nn.Module:
    """The module a wrapper (``checkpoint_wrapper``, ``torch.compile``) holds, else ``module``."""
    while True:
        inner = next((m for a in WRAPPED_MODULE_ATTRS if isinstance(m := getattr(module, a, None), nn.Module)), None)
        if inner is None:
            return module
        module = inner


# Keys torch's selective checkpointing writes into the tracing context (and leaves there).
_TORCH_CHECKPOINT_KEYS = frozenset({"recompute", "ac_graph_id"})


@contextlib.contextmanager
def _mark_checkpoints():
    """Annotate the ops of every non-reentrant ``torch.utils.checkpoint`` call with
    ``{CHECKPOINT_KEY: "checkpoint<n>"}`` while the capture traces.

    Why: under AOTAutograd's joint tracing a checkpoint leaves no mark of its own. Its
    saved-tensor hooks are never called, so the joint graph is node for node the
    un-checkpointed one. A selective policy (``context_fn``) writes each op's
    ``CheckpointPolicy`` into ``node.meta["recompute"]``, but it also leaves that key in
    the tracing context, so every later op, the backward's included, carries it, and
    ``ac_graph_id`` is None. So the capture wraps the checkpoint's generator
    (``_checkpoint_without_reentrant_generator``): ``checkpoint`` looks it up at each
    call, and so do ``checkpoint_wrapper`` and torch.compile's
    ``tag_activation_checkpoint``. The forward then runs under the annotation, and the
    keys torch left in the context are dropped when the checkpoint ends. A torch without
    that function leaves checkpointed regions unmarked: they are saved as without AC.
    """
    import torch.utils.checkpoint as torch_checkpoint

    original = getattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", None)
    if original is None:
        yield
        return
    ids = itertools.count()

    def marked(*args, **kwargs):
        inner = original(*args, **kwargs)
        next(inner)  # the checkpoint's hooks and forward context are entered
        had = _TORCH_CHECKPOINT_KEYS & fx_traceback.get_current_meta().keys()
        try:
            with fx_traceback.annotate({CHECKPOINT_KEY: f"checkpoint{next(ids)}"}):
                try:
                    yield  # the checkpointed function runs
                except BaseException as e:
                    inner.throw(e)  # the checkpoint's own clean-up; it re-raises
                    raise
        finally:
            meta = fx_traceback.get_current_meta()
            for k in _TORCH_CHECKPOINT_KEYS - had:
                meta.pop(k, None)
        next(inner, None)  # the checkpoint's post-forward step

    torch_checkpoint._checkpoint_without_reentrant_generator = marked
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = original


@contextlib.contextmanager
def _annotate_layers(lists: dict[str, list[nn.Module]], param_children: dict[str, dict[int, set[str]]],
                     runs: dict[str, dict[int, int]] | None = None, shared: frozenset[int] = frozenset()):
    """Annotate the ops of each candidate list's entry ``i`` (and of its children) with
    ``{LIST_KEY: {list: (i, child)}}``; ``param_children[list][i]``: the children with
    parameters that ran; ``runs[list][i]``: how many times entry ``i`` was called. A module in
    two lists (or nested lists) gets both entries.

    A child in ``shared`` (the ids of modules registered under more than one path) is annotated
    by the layer running when it is called, not by the module object: a norm shared by two
    layers gets each call's layer, and one also called outside the list (kept as ``model.norm``
    too) none of that list's; its hooks for the other layers push a no-op, so every post-hook
    pops its own. A child registered once keeps its layer even where the layer's own hooks did
    not run (a model calling ``layer.forward(x)`` directly)."""
    handles, open_ctx = [], []

    def current() -> dict:
        return dict((fx_traceback.get_current_meta().get("custom") or {}).get(LIST_KEY) or {})

    def enter(name: str, value: tuple[int, str | None]):
        lists_now = current()
        lists_now[name] = value
        cm = fx_traceback.annotate({LIST_KEY: lists_now})
        cm.__enter__()
        open_ctx.append(cm)

    def leave(*_):
        cm = open_ctx.pop()
        if cm is not None:
            cm.__exit__(None, None, None)

    def layer_pre(m, a, lname: str, i: int):
        if runs is not None:
            runs.setdefault(lname, {})[i] = runs.get(lname, {}).get(i, 0) + 1
        enter(lname, (i, None))

    def child_pre(m, a, lname: str, i: int, name: str, has_params: bool):
        running = current().get(lname)
        if (running is None and id(m) in shared) or (running is not None and running[0] != i):
            open_ctx.append(None)  # a shared module's call by another layer, or outside the list
            return
        if has_params:
            param_children.setdefault(lname, {}).setdefault(i, set()).add(name)
        enter(lname, (i, name))

    for lname, layers in lists.items():
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(functools.partial(layer_pre, lname=lname, i=i)))
            handles.append(layer.register_forward_hook(leave))
            for name, child in unwrap(layer).named_children():
                pre = functools.partial(child_pre, lname=lname, i=i, name=name,
                                        has_params=any(True for _ in child.parameters()))
                handles.append(child.register_forward_pre_hook(pre))
                handles.append(child.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while open_ctx:  # an exception inside a layer left its annotation open
            leave()


def _shared_modules(model: nn.Module) -> frozenset[int]:
    """The ids of the modules registered under more than one path in ``model``."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, m in model.named_modules(remove_duplicate=False):
        (shared if id(m) in seen else seen).add(id(m))
    return frozenset(shared)


def _paths(model: nn.Module, module: nn.Module) -> list[str]:
    """Every attribute path under which ``module`` is registered in ``model``."""
    return [name for name, m in model.named_modules(remove_duplicate=False) if m is module]


def _check_layers_run_once(model: nn.Module, container: str, layers: list[nn.Module],
                           runs: Mapping[int, int]) -> None:
    """Each entry of the decoder-layer list must run once per forward: the stages are per entry,
    and the hooks cannot tell two calls of one module object apart."""
    for i, n in sorted(runs.items()):
        if n > 1:
            paths = _paths(model, layers[i])
            also = [p for p in paths if p != f"{container}.{i}"]
            where = (f"it is one module registered as {' and '.join(map(repr, paths))}" if also
                     else "the forward calls it more than once")
            raise CaptureError(
                f"capture: decoder layer {container}.{i} ran {n} times in one forward ({where}); fxoverlap "
                f"gives each entry of {container!r} its own stages, so each must run once. Give each layer "
                f"its own module (copy.deepcopy of a shared block), or call a block kept under a second "
                f"name through the list only"
            )


def _reject_fsdp(model: nn.Module) -> None:
    """FSDP2's hooks gather and free real storage; under the fake tensors of tracing they fail
    deep inside FSDP (``invalid python storage``). Say so up front."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    wrapped = [name or "the model" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if wrapped:
        raise CaptureError(
            f"capture: {wrapped[0]} is wrapped by FSDP2 (fully_shard); fxoverlap traces the train step with "
            f"fake tensors, which FSDP's parameter gathering cannot run on. Leave data parallelism out of the "
            f"model (no fully_shard) and reduce the dense gradients over the data-parallel group after "
            f"forward_backward"
        )


def capture(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    loss_fn: Callable | None = None,
    layer_container: str | None = None,
    train: bool = True,
    scalar_loss: bool = True,
    lists: Mapping[str, LayerCandidate] | None = None,
    explain: Callable[[nn.Module, BaseException], str | None] | None = None,
    plain_params: Mapping[str, torch.Size] | None = None,
) -> Capture:
    """Trace one train step of ``model`` on inputs shaped like ``inputs``; no data is used.

    ``train=False`` traces the forward alone (no loss, no backward): the graph
    returns the model's output and the capture has no tangents or gradients.
    ``scalar_loss=False`` accepts any tensor outputs (each differentiable one gets a
    tangent placeholder) instead of requiring one scalar loss. ``lists`` (path ->
    :class:`~fxoverlap.passes.layers.LayerCandidate`): the candidate layer lists the caller
    has already annotated on the nodes it traces (``layers.LIST_KEY``), instead of this
    pass's hooks on the model's lists; the chosen one's entries and children come from it.
    ``explain(model, exc)``: a message for a tracing failure the caller knows how to explain
    (``optimize`` passes ``expert_parallel.explain_capture_error``), raised as ``CaptureError``.
    ``plain_params``: parameters (by name) traced as plain contiguous tensors of the given shape,
    whatever they are now (ZeRO-3's DTensor shards: the program reads gathered full ones).
    """
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise CaptureError(
                f"microbatch input {i} is a {type(t).__name__}; fxoverlap captures tensor inputs only "
                f"(bind other arguments into the model or loss_fn)"
            )
    _reject_fsdp(model)
    if lists is None:
        candidates = find_layers(model, layer_container)
        sizes = {name: len(layers) for name, layers in candidates.items()}
    else:  # annotated by the caller (the torch.compile backend, from nn_module_stack)
        candidates, sizes = {}, dict(lists)
    param_children: dict[str, dict[int, set[str]]] = {}
    runs: dict[str, dict[int, int]] = {}
    keywords = getattr(inputs, "keywords", ())  # a Microbatch's keyword inputs
    step = (_TrainStep(model, loss_fn, scalar_loss, keywords) if train
            else _Forward(model, single=scalar_loss, output_fn=loss_fn, keywords=keywords))
    # AOTAutograd runs the step more than once (metadata, then the joint trace): count each run's calls
    step.register_forward_pre_hook(lambda m, a: runs.clear())
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fake_inputs = tuple(fake_mode.from_tensor(t, static_shapes=True) for t in inputs)
    grad_mode = contextlib.nullcontext() if train else torch.no_grad()
    try:
        with (_restore_state(model), _plain_stand_ins(model, plain_params, fake_mode), fx_traceback.preserve_node_meta(),
              _annotate_layers(candidates, param_children, runs, _shared_modules(model)), _mark_checkpoints(),
              contextlib.ExitStack() as stack, grad_mode):
            joint = aot_export_joint_with_descriptors(stack, step, fake_inputs)
    except CaptureError:
        raise
    except Exception as e:
        if "use_reentrant=True" in str(e):
            raise CaptureError(
                "capture: the model calls torch.utils.checkpoint with use_reentrant=True, which cannot be "
                "traced into one joint graph; pass use_reentrant=False (checkpoint_wrapper's default), "
                "which fxoverlap replays in the backward"
            ) from e
        hint = None if explain is None else explain(model, e)
        if hint is None:
            raise
        raise CaptureError(hint) from e
    gm = joint.graph_module
    gm.graph._codegen = torch.fx.graph.CodeGen()  # plain positional in, flat tuple out
    # the decoder layers: where the all-to-alls ran decides among the candidate lists
    choice = choose_container(gm, sizes)
    if choice.container in candidates:
        _check_layers_run_once(model, choice.container, candidates[choice.container], runs.get(choice.container, {}))
    resolve(gm, choice.container)
    num_layers, layer_names, chosen_children = layer_facts(
        choice.container, None if choice.container is None else sizes[choice.container],
        param_children.get(choice.container))
    _distinct_sink_values(gm)
    gm.recompile()
    roles = _roles(gm, train, _grad_layouts(joint))
    roles["output_aliases"] = _output_aliases(gm, joint, roles["outputs"])
    # The mode that traced the graph holds its symbols: ours, or the ambient one under
    # torch.compile (AOTAutograd prefers the tracing context's fake mode to its inputs').
    traced = next((v.fake_mode for ph in gm.graph.find_nodes(op="placeholder")
                   if isinstance(v := ph.meta.get("val"), FakeTensor)), fake_mode)
    return Capture(
        graph_module=gm,
        fake_mode=traced,
        **roles,
        num_layers=num_layers,
        layer_names=layer_names,
        param_children=chosen_children,
        signature=input_signature(inputs),
        layer_choice=choice,
    )


def _output_aliases(gm: torch.fx.GraphModule, joint, outputs: list[str]) -> dict[int, OutputAlias]:
    """The step outputs that alias an input or another output, from AOTAutograd's metadata
    (private: checked on torch 2.13; where it is missing, none are named, and the backend
    falls back for a differentiable output without a tangent)."""
    from torch._functorch._aot_autograd.schemas import OutputType

    state = getattr(joint, "_aot_state", None)
    infos = getattr(getattr(state, "fw_metadata", None), "output_info", None) or []
    arg_descs = getattr(state, "flat_args_descs", None) or []
    placeholder_of = {n.meta.get("desc"): n.name for n in gm.graph.find_nodes(op="placeholder")}
    n_user = len(infos)
    kinds = {OutputType.is_input: "input", OutputType.alias_of_input: "view_of_input",
             OutputType.alias_of_intermediate: "view_of_output",
             OutputType.alias_of_intermediate_save_as_output: "view_of_output",
             OutputType.alias_of_intermediate_base_is_user_output: "view_of_output"}
    out: dict[int, OutputAlias] = {}
    for i, info in enumerate(infos):
        kind, k = kinds.get(info.output_type), info.base_idx
        if kind is None or k is None:
            continue  # not an alias AOTAutograd regenerates: the graph's own output, with its tangent
        if kind != "view_of_output":  # an index into the step's flat inputs
            base = placeholder_of.get(arg_descs[k]) if k < len(arg_descs) else None
        elif info.output_type is OutputType.alias_of_intermediate_base_is_user_output:
            base = outputs[k] if k < n_user else None
        else:  # an index into the intermediate bases, returned after the step's outputs
            base = outputs[n_user + k] if n_user + k < len(outputs) else None
        out[i] = OutputAlias(kind, base, info.requires_grad, info.view_meta_sequence)
    return out


def _strip(fqn: str) -> str:
    return fqn[len("model.") :] if fqn.startswith("model.") else fqn


def _distinct_sink_values(gm: torch.fx.GraphModule) -> None:
    """Give every tensor the step hands out a node of its own that the graph computes.

    AOTAutograd may return one node for two entries (the gradients of ``a`` and ``b`` in
    ``loss = f(x) + a + b`` are both the tangent) or return a placeholder as it is (that
    tangent, or an input returned unchanged). Values are named by node, and only stage
    outputs reach a sink, so each such entry gets a clone, as eager's AccumulateGrad
    gives each parameter a gradient tensor of its own.
    """
    from torch._functorch._aot_autograd.descriptors import GradAOTOutput

    out = next(iter(gm.graph.find_nodes(op="output")))
    vals, descs = list(out.args[0]), out.meta.get("desc") or []
    seen: set[torch.fx.Node] = set()
    for i, v in enumerate(vals):
        if not isinstance(v, torch.fx.Node) or not isinstance(v.meta.get("val"), torch.Tensor):
            continue  # None, or an opaque part (a DTensor's mesh) passed through
        if v.op == "placeholder" or v in seen:
            with gm.graph.inserting_before(out):
                c = gm.graph.call_function(torch.ops.aten.clone.default, (v,))
            c.meta["val"] = v.meta["val"]
            root = _unwrap(descs[i])[0] if i < len(descs) else None
            c.meta["partitioner_tag"] = "is_backward" if isinstance(root, GradAOTOutput) else "is_forward"
            for key in ("custom", "seq_nr"):
                if key in v.meta:
                    c.meta[key] = v.meta[key]
            vals[i] = c
        seen.add(v)
    out.args = (tuple(vals),)


def _unwrap(desc) -> tuple[object, tuple[str, ...]]:
    """The descriptor a chain of subclass-attribute descriptors starts from, and the path."""
    path = []
    while hasattr(desc, "attr") and hasattr(desc, "base"):  # SubclassGetAttrAOT{Input,Output}
        path.append(desc.attr)
        desc = desc.base
    return desc, tuple(reversed(path))


def _layout(meta) -> SubclassLayout:
    """Our layout from AOTAutograd's SubclassCreationMeta of a traced gradient."""
    attrs = tuple((attr, _layout(m) if hasattr(m, "attrs") else None) for attr, m in meta.attrs.items())
    cls = meta.original_subclass_type or type(meta.original_subclass)
    size, stride = tuple(meta.outer_size), tuple(meta.outer_stride)
    if not all(isinstance(d, int) for d in (*size, *stride)):
        raise CaptureError(f"capture: a {cls.__name__} gradient has a symbolic outer shape {list(size)}; "
                           f"fxoverlap captures tensor-subclass parameters of static shape")
    return SubclassLayout(cls, attrs, meta.meta, size, stride)


def _grad_layouts(joint) -> dict:
    """Input descriptor -> layout of its gradient, for inputs whose gradient is a tensor subclass."""
    # AOTAutograd's own records (private: checked on torch 2.13)
    sub = getattr(getattr(joint, "_aot_graph_capture", None), "maybe_subclass_meta", None)
    metas = getattr(sub, "grad_input_metas", None)
    if not metas:
        return {}
    descs = getattr(getattr(joint, "_aot_state", None), "flat_args_descs", None)
    if descs is None or len(descs) != len(metas):
        raise CaptureError(f"capture: AOTAutograd (torch {torch.__version__}) does not name the step input "
                           f"of each of its {len(metas)} gradients; fxoverlap cannot tell which tensor-subclass "
                           f"gradient is whose")
    return {d: _layout(m) for d, m in zip(descs, metas) if hasattr(m, "attrs")}


def _roles(gm: torch.fx.GraphModule, train: bool, grad_layouts: dict) -> dict:
    """Name every placeholder and graph output by role, from AOTAutograd's descriptors."""
    from torch._functorch._aot_autograd.descriptors import (
        BufferAOTInput,
        GradAOTOutput,
        InputMutationAOTOutput,
        IntermediateBaseAOTOutput,
        ParamAOTInput,
        PlainAOTInput,
        PlainAOTOutput,
        SubclassGetAttrAOTInput,
        SubclassGetAttrAOTOutput,
        TangentAOTInput,
    )

    params, buffers, user_inputs, input_parts = {}, {}, [], {}
    subclass_phs: dict[str, tuple[str, tuple[str, ...]]] = {}
    by_part: dict[tuple[object, tuple[str, ...]], str] = {}  # (root descriptor, attribute path) -> placeholder
    tangent_of: dict[str, object] = {}  # tangent placeholder -> descriptor of its output
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        root, path = _unwrap(desc) if isinstance(desc, SubclassGetAttrAOTInput) else (desc, ())
        if isinstance(desc, TangentAOTInput):
            tangent_of[node.name] = desc.output
            continue
        if isinstance(root, TangentAOTInput):
            raise CaptureError(f"capture: a differentiable output of the step is a tensor subclass (its "
                               f"gradient's part {'.'.join(path)} is graph input {node.name}); fxoverlap hands "
                               f"out plain tensors: return a plain tensor (e.g. DTensor.to_local() or full_tensor())")
        if isinstance(root, (ParamAOTInput, BufferAOTInput)):
            if path:
                subclass_phs[node.name] = (_strip(root.target), path)
            else:
                (params if isinstance(root, ParamAOTInput) else buffers)[node.name] = _strip(root.target)
        elif isinstance(root, PlainAOTInput):
            user_inputs.append(node.name)
            input_parts[node.name] = (root.idx, path)
        else:
            what = (f"the part {'.'.join(path)} of a tensor-subclass input with descriptor {root!r}" if path
                    else f"descriptor {desc!r}")
            raise CaptureError(
                f"capture: graph input {node.name} has {what}, which fxoverlap does not handle (a tangent "
                f"that is a tensor subclass, or a symbolic subclass size?); please report it with the model"
            )
        by_part[(root, path)] = node.name
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outputs, grads, mutations, output_of = [], {}, {}, {}
    bases = []  # intermediates AOTAutograd returns as the base of two output views: after the outputs
    grad_parts, layouts, grad_opaque = {}, {}, {}
    for i, (val, desc) in enumerate(zip(out_node.args[0], out_node.meta.get("desc") or [])):
        name = val.name if isinstance(val, torch.fx.Node) else None
        root, path = _unwrap(desc) if isinstance(desc, SubclassGetAttrAOTOutput) else (desc, ())
        if name is None and not isinstance(root, PlainAOTOutput):
            continue  # no gradient for an input that needs none
        if isinstance(root, PlainAOTOutput):
            if path:
                raise CaptureError(f"capture: step output {root.idx} is a tensor subclass (its part "
                                   f"{'.'.join(path)}); fxoverlap hands out plain tensors: return "
                                   f"a plain tensor (e.g. DTensor.to_local() or full_tensor())")
            if name is None:
                raise CaptureError(f"capture: step output {desc.idx} is not a tensor the graph computes")
            outputs.append(name)
            output_of[desc] = name
        elif isinstance(root, IntermediateBaseAOTOutput) and name is not None and not path:
            bases.append(name)
            output_of[desc] = name
        elif isinstance(root, InputMutationAOTOutput):
            target = by_part.get((root.mutated_input, path))
            if target is None or target in params or isinstance(root.mutated_input, ParamAOTInput):
                raise CaptureError(
                    f"capture: the forward mutates {root.mutated_input!r} in place; fxoverlap applies "
                    f"in-place updates of buffers and inputs only (not of parameters)"
                )
            mutations[name] = target
        elif isinstance(root, GradAOTOutput):
            if not isinstance(root.grad_of, ParamAOTInput):
                continue
            fqn = _strip(root.grad_of.target)
            if not path:
                grads[name] = fqn
                continue
            layout = grad_layouts.get(root.grad_of)
            if layout is None:
                raise CaptureError(f"capture: the gradient of {fqn} leaves the graph flattened, but AOTAutograd "
                                   f"recorded no subclass layout for it (torch {torch.__version__})")
            layouts[fqn] = layout
            if isinstance(val.meta.get("val"), torch.Tensor):
                grads[name] = fqn
                grad_parts[name] = path
            elif name in subclass_phs:  # an opaque leaf (a DTensor's mesh) passed through from the input
                grad_opaque[(fqn, path)] = name
            else:
                raise CaptureError(f"capture: the gradient of {fqn} has a non-tensor part {'.'.join(path)} that "
                                   f"the graph computes; fxoverlap takes such parts from the parameter's own")
        else:
            raise CaptureError(
                f"capture: graph output {i} has descriptor {desc!r}; fxoverlap handles the step's "
                f"outputs, parameter gradients and in-place updates of buffers"
            )
    for fqn, layout in layouts.items():
        missing = [p for p in layout.leaves() if (fqn, p) not in grad_opaque and p not in
                   {grad_parts[v] for v, f in grads.items() if f == fqn and v in grad_parts}]
        if missing:
            raise CaptureError(f"capture: the gradient of {fqn} lacks its part(s) {missing} among the graph's outputs")
    outputs += bases
    tangents = {ph: output_of[d] for ph, d in tangent_of.items() if d in output_of}
    if len(tangents) != len(tangent_of):
        raise CaptureError("capture: a tangent seeds a graph output that is not one of the step's outputs "
                           "(an output that aliases an input or another output?)")
    if train and not tangents:
        raise CaptureError("capture: the loss does not require grad; no parameter of the model is trainable")
    return dict(param_placeholders=params, buffer_placeholders=buffers, input_placeholders=user_inputs,
                tangents=tangents, outputs=outputs, grads=grads, mutations=mutations,
                subclass_placeholders=subclass_phs, input_parts=input_parts,
                grad_parts=grad_parts, grad_layouts=layouts, grad_opaque=grad_opaque)
