"""capture: trace forward + loss + backward of a model into one joint FX graph.

Uses AOTAutograd's ``aot_export_joint_with_descriptors`` with no decompositions,
so every node is the aten op eager runs and executing the graph reproduces
eager's loss and gradients bitwise on CPU. Inputs are faked with static shapes
under a ``ShapeEnv``, so a data-dependent dispatch (dropless routing) gets an
unbacked row count and one capture serves every routing outcome. Nothing is
communicated while tracing.

While tracing, forward hooks annotate the ops of each decoder layer with
``{"fxoverlap_layer": i, "fxoverlap_child": name}`` (``torch.fx.traceback.annotate``);
backward nodes carry the annotation of the forward op they differentiate.

Assumes: the model's decoder layers are the entries of one ``nn.ModuleList`` or
``nn.ModuleDict`` (found by size, or named by ``OverlapConfig.layer_container``),
called once each per forward; no buffer is mutated in the forward; the loss is a
scalar tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from fxoverlap.region import LAYER_KEY

CHILD_KEY = "fxoverlap_child"


class CaptureError(RuntimeError):
    """The model cannot be captured as it is; the message says why and what to change."""


@dataclasses.dataclass
class Capture:
    """The joint graph of one train step and what its placeholders and outputs mean.

    ``graph_module`` takes ``(*params, *buffers, *inputs, loss_tangent)`` as
    plain positional arguments (names in ``placeholders``) and returns
    ``(loss, *grads)`` (``grad_targets[i]`` names the parameter of ``grads[i]``,
    ``None`` where a parameter gets no gradient).
    """

    graph_module: torch.fx.GraphModule
    param_placeholders: dict[str, str]  # placeholder name -> parameter FQN
    buffer_placeholders: dict[str, str]  # placeholder name -> buffer FQN
    input_placeholders: list[str]  # the microbatch's tensors, in order
    tangent_placeholder: str | None
    output_names: list[str | None]  # value names feeding the graph output
    grad_targets: list[str | None]  # parameter FQN per grad output
    num_layers: int
    layer_names: list[str]
    param_children: dict[int, set[str]]  # per layer: children with parameters that ran
    signature: tuple

    @property
    def loss_name(self) -> str:
        return self.output_names[0]


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


class _TrainStep(nn.Module):
    """model + loss as one module, so the joint graph ends at a scalar."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = self.model(*inputs)
        loss = out if self.loss_fn is None else self.loss_fn(out, *inputs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {list(loss.shape)}"
            if self.loss_fn is None:
                raise CaptureError(
                    f"the model returned {what}, not a scalar loss, and no loss_fn was given: "
                    f"pass loss_fn=lambda output, *inputs: <scalar> to forward_backward"
                )
            raise CaptureError(f"loss_fn returned {what}; it must return a scalar tensor")
        return loss


class _Forward(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor):
        out = self.model(*inputs)
        if not isinstance(out, torch.Tensor):
            raise CaptureError(f"the model returned a {type(out).__name__}; fxoverlap handles one output tensor")
        return out


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
        for name, child in layer.named_children():
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
) -> Capture:
    """Trace one train step of ``model`` on inputs shaped like ``inputs``; no data is used.

    ``train=False`` traces the forward alone (no loss, no backward): the graph
    returns the model's output and the capture has no tangent or gradients.
    """
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._functorch._aot_autograd.descriptors import (
        BufferAOTInput,
        GradAOTOutput,
        ParamAOTInput,
        PlainAOTInput,
        PlainAOTOutput,
        TangentAOTInput,
    )
    from torch._subclasses.fake_tensor import FakeTensorMode
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
    step = _TrainStep(model, loss_fn) if train else _Forward(model)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fake_inputs = tuple(fake_mode.from_tensor(t, static_shapes=True) for t in inputs)
    grad_mode = contextlib.nullcontext() if train else torch.no_grad()
    with fx_traceback.preserve_node_meta(), _annotate_layers(layers, param_children), contextlib.ExitStack() as stack, grad_mode:
        joint = aot_export_joint_with_descriptors(stack, step, fake_inputs)
    gm = joint.graph_module
    gm.graph._codegen = torch.fx.graph.CodeGen()  # plain positional in, flat tuple out
    gm.recompile()

    params, buffers, user_inputs, tangent = {}, {}, [], None
    strip = lambda fqn: fqn[len("model.") :] if fqn.startswith("model.") else fqn  # noqa: E731
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if isinstance(desc, ParamAOTInput):
            params[node.name] = strip(desc.target)
        elif isinstance(desc, BufferAOTInput):
            buffers[node.name] = strip(desc.target)
        elif isinstance(desc, PlainAOTInput):
            user_inputs.append(node.name)
        elif isinstance(desc, TangentAOTInput) and tangent is None:
            tangent = node.name
        else:
            raise CaptureError(
                f"capture: graph input {node.name} has descriptor {desc!r}, which fxoverlap does not "
                f"handle (input mutation, tensor subclass or extra tangent); make the model's forward "
                f"functional"
            )
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    out_args = out_node.args[0]
    descs = out_node.meta.get("desc") or []
    output_names, grad_targets = [], []
    for i, (val, desc) in enumerate(zip(out_args, descs)):
        if i == 0 or not train:
            if not isinstance(desc, PlainAOTOutput):
                raise CaptureError(f"capture: first graph output is {desc!r}, expected the loss")
        elif val is None:
            pass  # no gradient for a non-differentiable input
        elif not isinstance(desc, GradAOTOutput):
            raise CaptureError(
                f"capture: graph output {i} has descriptor {desc!r}; fxoverlap handles only the loss "
                f"and parameter gradients (a forward that mutates a buffer is not supported)"
            )
        output_names.append(val.name if isinstance(val, torch.fx.Node) else None)
        if i:
            target = desc.grad_of if isinstance(desc, GradAOTOutput) else None
            grad_targets.append(strip(target.target) if isinstance(target, ParamAOTInput) else None)
    if tangent is None and train:
        raise CaptureError("capture: the loss does not require grad; no parameter of the model is trainable")
    return Capture(
        graph_module=gm,
        param_placeholders=params,
        buffer_placeholders=buffers,
        input_placeholders=user_inputs,
        tangent_placeholder=tangent,
        output_names=output_names,
        grad_targets=grad_targets,
        num_layers=len(layers),
        layer_names=[f"{layer_names}.{i}" for i in range(len(layers))],
        param_children=param_children,
        signature=input_signature(inputs),
    )
