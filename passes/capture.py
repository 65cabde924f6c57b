"""capture: trace forward + loss + backward of a model into one joint FX graph.

Contract
--------
Assumes: the model's decoder layers are the entries of one ``nn.ModuleList`` or
``nn.ModuleDict`` (found by size, or named by ``OverlapConfig.layer_container``),
called once each per forward; the inputs are tensors; the loss is a scalar tensor
(``scalar_loss=False``, for the torch.compile backend: any tensor outputs). Buffers
and inputs the forward updates in place (a load-balance counter, a running
statistic) are allowed; parameters updated in place are not.

Guarantees: a :class:`Capture`: the joint graph from AOTAutograd's
``aot_export_joint_with_descriptors`` with no decompositions, so every node is the
aten op eager runs and executing the graph reproduces eager's loss and gradients
bitwise on CPU; every placeholder and graph output named by role (parameters,
buffers, inputs, tangents; outputs, parameter gradients, in-place updates in
``Capture.mutations``). Forward nodes of decoder layer ``i`` carry the annotation
``{LAYER_KEY: i, CHILD_KEY: child}`` (``node.meta["custom"]``; the children of a
wrapped layer, ``checkpoint_wrapper`` or a ``torch.compile``'d module, are those of the
module it wraps); ops run inside a non-reentrant ``torch.utils.checkpoint`` call also
carry ``{CHECKPOINT_KEY: id}`` (:func:`_mark_checkpoints`), so the recompute pass can
replay them; backward nodes carry the ``seq_nr`` of the forward op they differentiate. Inputs are faked with static
shapes under a ``ShapeEnv``, so a data-dependent dispatch (dropless routing) gets an
unbacked row count and one capture serves every routing outcome. Nothing runs on
real data and nothing is communicated. A model that cannot be traced raises
:class:`CaptureError` saying why and what to change.

Steps
-----
1. Find the decoder layers (``find_layers``).
2. Trace the train step (``_TrainStep``: model + loss) under forward hooks that
   annotate each layer's and child's ops (``_annotate_layers``) and with checkpoint
   calls marked (``_mark_checkpoints``).
3. Name placeholders and outputs by role from AOTAutograd's descriptors (``_roles``).

Entry point: ``capture(model, inputs, loss_fn=None, layer_container=None, train=True,
scalar_loss=True) -> Capture``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from fxoverlap.meta import CHECKPOINT_KEY, CHILD_KEY, LAYER_KEY


class CaptureError(RuntimeError):
    """The model cannot be captured as it is; the message says why and what to change."""


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
    """

    graph_module: torch.fx.GraphModule
    fake_mode: object  # the FakeTensorMode whose ShapeEnv holds the graph's symbols
    param_placeholders: dict[str, str]  # placeholder name -> parameter FQN
    buffer_placeholders: dict[str, str]  # placeholder name -> buffer FQN
    input_placeholders: list[str]  # the microbatch's tensors, in order
    tangents: dict[str, str]  # tangent placeholder -> output value it seeds
    outputs: list[str]  # values the step returns, in order
    grads: dict[str, str]  # gradient value -> parameter FQN
    mutations: dict[str, str]  # new value -> placeholder (buffer or input) it is copied into
    num_layers: int
    layer_names: list[str]
    param_children: dict[int, set[str]]  # per layer: children with parameters that ran
    signature: tuple

    @property
    def loss_name(self) -> str:
        return self.outputs[0]

    @property
    def static_placeholders(self) -> set[str]:
        """Placeholders shared by every microbatch: parameters and buffers."""
        return set(self.param_placeholders) | set(self.buffer_placeholders)


def find_layers(model: nn.Module, container: str | None) -> tuple[str, list[nn.Module]] | None:
    """The model's decoder layers: ``container`` if given, else the largest module list."""
    if container is not None:
        mod = model.get_submodule(container)
        if not isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            raise CaptureError(
                f"OverlapConfig.layer_container={container!r} names a {type(mod).__name__}, "
                f"not an nn.ModuleList or nn.ModuleDict of layers"
            )
        return container, list(mod.values() if isinstance(mod, nn.ModuleDict) else mod)
    best: tuple[str, list[nn.Module]] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            kids = list(mod.values() if isinstance(mod, nn.ModuleDict) else mod)
            kids = [k for k in kids if any(True for _ in k.parameters())]
            if kids and (best is None or len(kids) > len(best[1])):
                best = (name, kids)
    return best


def input_signature(inputs: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for t in inputs)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


class _TrainStep(nn.Module):
    """model + loss as one module, so the joint graph ends at the loss.

    ``scalar_loss=False`` (the torch.compile backend): the model's outputs are returned
    as they are, one tensor or a tuple of tensors, and the caller seeds each one's
    gradient."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, scalar_loss: bool = True):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.scalar_loss = scalar_loss

    def forward(self, *inputs: torch.Tensor):
        out = self.model(*inputs)
        loss = out if self.loss_fn is None else self.loss_fn(out, *inputs)
        if not self.scalar_loss:
            outs = loss if isinstance(loss, (tuple, list)) else (loss,)
            if bad := [i for i, o in enumerate(outs) if not isinstance(o, torch.Tensor)]:
                raise CaptureError(f"output {bad[0]} of the step is {_describe(outs[bad[0]])}; "
                                   f"fxoverlap handles tensor outputs")
            return tuple(outs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            if self.loss_fn is None:
                raise CaptureError(
                    f"the model returned {_describe(loss)}, not a scalar loss, and no loss_fn was given: "
                    f"pass loss_fn=lambda output, *inputs: <scalar> to forward_backward"
                )
            raise CaptureError(f"loss_fn returned {_describe(loss)}; it must return a scalar tensor")
        return loss


class _Forward(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor):
        out = self.model(*inputs)
        if not isinstance(out, torch.Tensor):
            raise CaptureError(f"the model returned {_describe(out)}; fxoverlap's forward-only call "
                               f"handles one output tensor")
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
def _annotate_layers(layers: list[nn.Module], param_children: dict[int, set[str]]):
    """Annotate each layer's ops with its index, and each child's ops with its name."""
    handles, open_ctx = [], []

    def enter(meta: dict):
        cm = fx_traceback.annotate(meta)
        cm.__enter__()
        open_ctx.append(cm)

    def leave(*_):
        open_ctx.pop().__exit__(None, None, None)

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: enter({LAYER_KEY: i})))
        handles.append(layer.register_forward_hook(leave))
        for name, child in unwrap(layer).named_children():
            def pre(m, a, i=i, name=name, has_params=any(True for _ in child.parameters())):
                if has_params:
                    param_children.setdefault(i, set()).add(name)
                enter({CHILD_KEY: name})

            handles.append(child.register_forward_pre_hook(pre))
            handles.append(child.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while open_ctx:  # an exception inside a layer left its annotation open
            leave()


def capture(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    loss_fn: Callable | None = None,
    layer_container: str | None = None,
    train: bool = True,
    scalar_loss: bool = True,
) -> Capture:
    """Trace one train step of ``model`` on inputs shaped like ``inputs``; no data is used.

    ``train=False`` traces the forward alone (no loss, no backward): the graph
    returns the model's output and the capture has no tangents or gradients.
    ``scalar_loss=False`` accepts any tensor outputs (each differentiable one gets a
    tangent placeholder) instead of requiring one scalar loss.
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
    found = find_layers(model, layer_container)
    layer_names, layers = (found[0], found[1]) if found else ("", [])
    param_children: dict[int, set[str]] = {}
    step = _TrainStep(model, loss_fn, scalar_loss) if train else _Forward(model)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fake_inputs = tuple(fake_mode.from_tensor(t, static_shapes=True) for t in inputs)
    grad_mode = contextlib.nullcontext() if train else torch.no_grad()
    try:
        with (fx_traceback.preserve_node_meta(), _annotate_layers(layers, param_children), _mark_checkpoints(),
              contextlib.ExitStack() as stack, grad_mode):
            joint = aot_export_joint_with_descriptors(stack, step, fake_inputs)
    except CaptureError:
        raise
    except Exception as e:
        from fxoverlap.expert_parallel import explain_capture_error

        if "use_reentrant=True" in str(e):
            raise CaptureError(
                "capture: the model calls torch.utils.checkpoint with use_reentrant=True, which cannot be "
                "traced into one joint graph; pass use_reentrant=False (checkpoint_wrapper's default), "
                "which fxoverlap replays in the backward"
            ) from e
        hint = explain_capture_error(model, e)
        if hint is None:
            raise
        raise CaptureError(hint) from e
    gm = joint.graph_module
    gm.graph._codegen = torch.fx.graph.CodeGen()  # plain positional in, flat tuple out
    gm.recompile()
    roles = _roles(gm, train)
    # The mode that traced the graph holds its symbols: ours, or the ambient one under
    # torch.compile (AOTAutograd prefers the tracing context's fake mode to its inputs').
    traced = next((v.fake_mode for ph in gm.graph.find_nodes(op="placeholder")
                   if isinstance(v := ph.meta.get("val"), FakeTensor)), fake_mode)
    return Capture(
        graph_module=gm,
        fake_mode=traced,
        **roles,
        num_layers=len(layers),
        layer_names=[f"{layer_names}.{i}" for i in range(len(layers))],
        param_children=param_children,
        signature=input_signature(inputs),
    )


def _strip(fqn: str) -> str:
    return fqn[len("model.") :] if fqn.startswith("model.") else fqn


def _roles(gm: torch.fx.GraphModule, train: bool) -> dict:
    """Name every placeholder and graph output by role, from AOTAutograd's descriptors."""
    from torch._functorch._aot_autograd.descriptors import (
        BufferAOTInput,
        GradAOTOutput,
        InputMutationAOTOutput,
        ParamAOTInput,
        PlainAOTInput,
        PlainAOTOutput,
        SubclassGetAttrAOTInput,
        TangentAOTInput,
    )

    params, buffers, user_inputs, by_input = {}, {}, [], {}
    tangent_of: dict[str, object] = {}  # tangent placeholder -> descriptor of its output
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if isinstance(desc, ParamAOTInput):
            params[node.name] = _strip(desc.target)
        elif isinstance(desc, BufferAOTInput):
            buffers[node.name] = _strip(desc.target)
        elif isinstance(desc, PlainAOTInput):
            user_inputs.append(node.name)
        elif isinstance(desc, TangentAOTInput):
            tangent_of[node.name] = desc.output
        elif isinstance(desc, SubclassGetAttrAOTInput):
            base = desc.base
            while isinstance(base, SubclassGetAttrAOTInput):
                base = base.base
            what = f"parameter {_strip(base.target)}" if isinstance(base, (ParamAOTInput, BufferAOTInput)) else "an input"
            raise CaptureError(
                f"capture: {what} is a tensor subclass (e.g. a DTensor; graph input {node.name} is its "
                f"{desc.attr}); fxoverlap's stage graphs run on plain tensors: pass plain tensors, or "
                f"shard expert weights with fxoverlap.expert_parallel"
            )
        else:
            raise CaptureError(
                f"capture: graph input {node.name} has descriptor {desc!r}, which fxoverlap does not "
                f"handle; please report it with the model that produced it"
            )
        if desc is not None and not isinstance(desc, TangentAOTInput):
            by_input[desc] = node.name
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outputs, grads, mutations, output_of = [], {}, {}, {}
    for i, (val, desc) in enumerate(zip(out_node.args[0], out_node.meta.get("desc") or [])):
        name = val.name if isinstance(val, torch.fx.Node) else None
        if name is None and not isinstance(desc, PlainAOTOutput):
            continue  # no gradient for an input that needs none
        if isinstance(desc, PlainAOTOutput):
            if name is None:
                raise CaptureError(f"capture: step output {desc.idx} is not a tensor the graph computes")
            outputs.append(name)
            output_of[desc] = name
        elif isinstance(desc, InputMutationAOTOutput):
            target = by_input.get(desc.mutated_input)
            if target is None or target in params:
                raise CaptureError(
                    f"capture: the forward mutates {desc.mutated_input!r} in place; fxoverlap applies "
                    f"in-place updates of buffers and inputs only (not of parameters)"
                )
            mutations[name] = target
        elif isinstance(desc, GradAOTOutput):
            if isinstance(desc.grad_of, ParamAOTInput):
                grads[name] = _strip(desc.grad_of.target)
        else:
            raise CaptureError(
                f"capture: graph output {i} has descriptor {desc!r}; fxoverlap handles the step's "
                f"outputs, parameter gradients and in-place updates of buffers"
            )
    tangents = {ph: output_of[d] for ph, d in tangent_of.items() if d in output_of}
    if len(tangents) != len(tangent_of):
        raise CaptureError("capture: a tangent seeds a graph output that is not one of the step's outputs "
                           "(an output that aliases an input or another output?)")
    if train and not tangents:
        raise CaptureError("capture: the loss does not require grad; no parameter of the model is trainable")
    return dict(param_placeholders=params, buffer_placeholders=buffers, input_placeholders=user_inputs,
                tangents=tangents, outputs=outputs, grads=grads, mutations=mutations)
