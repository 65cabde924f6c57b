"""The key a compiled program is reused under, and the bounded cache of programs.

A program is the captured joint graph of one train step (or forward), split, scheduled and
compiled. It bakes in everything that the trace saw: the inputs' metadata, which parameters
need gradients, each module's ``training`` flag, autocast, the hooks traced into the forward,
the loss function's code and the values it closes over, the config, the groups the comm ops
name. :class:`ProgramKey` holds each of those, so a program is reused only when none has
changed (``../shared/FRONTEND.md``, "The cache key"). What the key leaves out is read on every
call instead: the parameters and buffers themselves (by name, so ``load_state_dict(assign=True)``,
``copy.deepcopy`` and ``model.to()`` keep training the model's own tensors) and the
parameters' gradient hooks (run by the engine as eager runs them).

Building a key is one walk over the modules (:func:`model_state`), which also gives the call
its parameters and buffers by name, shared by everything that reads them in that call.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.runtime import NamedTensors

log = logging.getLogger("fxoverlap.cache")

# Autocast is keyed for the device types a program can run on.
_AUTOCAST_DEVICES = ("cpu", "cuda")


class UnsupportedModelState(FxOverlapError, RuntimeError):
    """The model is in a state fxoverlap refuses to compile (a DistributedDataParallel wrapper,
    a module backward hook); the message names the module, what was found and the fix."""


class RepeatedRecompileWarning(UserWarning):
    """The same ``loss_fn`` / ``output_fn`` code keeps arriving with other closure values,
    and each one compiles the model anew."""


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    """Everything that changes what a compiled program computes. Two calls with equal keys
    get the same program; a field that differs compiles anew (or is refused by name).

    ========================  ===========================================================
    field                     what would go wrong without it
    ========================  ===========================================================
    ``role``                  ``"train"`` (forward + loss + backward) or ``"forward"``
    ``inputs``                each input's shape, stride, dtype, device (with index),
                              ``requires_grad``, tensor type, and its keyword if any: the
                              graph is traced for them
    ``params``                each parameter by name: shape, stride, dtype, device,
                              ``requires_grad``, tensor type (``model.to()``, freezing,
                              FSDP/DTensor parameters appearing after the first step)
    ``buffers``               each buffer by name: the same metadata
    ``eval_modules``          the submodules not in ``training`` mode (``model.eval()``
                              turns dropout off, a running statistic stops updating)
    ``grad_mode``             ``torch.is_grad_enabled()``
    ``autocast``              per device type: enabled and its dtype (the casts are traced)
    ``deterministic``         ``torch.are_deterministic_algorithms_enabled()``
    ``hooks``                 the module forward and forward-pre hooks (global ones too),
                              by handle: they are traced into the graph, so adding or
                              removing one compiles anew
    ``fn``                    the ``loss_fn`` / ``output_fn``: its ``cache_hash`` attribute
                              if it has one, else its code, closure values, defaults and
                              bound ``self`` (a fresh ``lambda`` with the same code and
                              values reuses the program)
    ``config``                the :class:`~fxoverlap.OverlapConfig`
    ``groups``                each process group's name and size (baked into the comm ops)
    ========================  ===========================================================
    """

    role: str
    inputs: tuple
    params: tuple
    buffers: tuple
    eval_modules: tuple[str, ...]
    grad_mode: bool
    autocast: tuple
    deterministic: bool
    hooks: tuple
    fn: Hashable
    config: str
    groups: tuple

    def differences(self, other: ProgramKey) -> list[str]:
        """Why ``self`` is not ``other``: one phrase per field that differs, naming what changed."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(other, f.name), getattr(self, f.name)
            if a == b:
                continue
            if f.name in ("params", "buffers", "inputs"):
                out.append(_named_diff(f.name, a, b))
            elif f.name == "eval_modules":
                went_eval, went_train = sorted(set(b) - set(a)), sorted(set(a) - set(b))
                out.append("training flags: " + "; ".join(
                    ([f"{_few(went_eval)} now in eval mode"] if went_eval else [])
                    + ([f"{_few(went_train)} now in training mode"] if went_train else [])))
            elif f.name == "fn":
                out.append("the loss/output function (its code, closure values or defaults)")
            else:
                out.append(f"{f.name}: {a} -> {b}")
        return out


def _few(names: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(repr(x or "<model>") for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _named_diff(field: str, old: tuple, new: tuple) -> str:
    a, b = {e[0]: e[1:] for e in old}, {e[0]: e[1:] for e in new}
    changed = [n for n in b if n in a and a[n] != b[n]]
    parts = []
    if changed:
        n = changed[0]
        parts.append(f"{field} {n!r} changed {a[n]} -> {b[n]}"
                     + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""))
    if added := [n for n in b if n not in a]:
        parts.append(f"{field} added: {_few(added)}")
    if removed := [n for n in a if n not in b]:
        parts.append(f"{field} removed: {_few(removed)}")
    return "; ".join(parts) or f"{field} reordered"


def _tensor_meta(t: torch.Tensor) -> tuple:
    kind = type(t)
    plain = kind is nn.Parameter or kind is torch.Tensor or kind is nn.Buffer or not _is_subclass(t)
    device = t.device
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return (tuple(t.shape), t.stride() if plain and t.layout == torch.strided else None,
            t.dtype, name, t.requires_grad, kind.__name__)


_DEVICE_NAMES: dict[torch.device, str] = {}  # str(device), which costs more than the rest of _tensor_meta


def _is_subclass(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, nn.Parameter, nn.Buffer) and hasattr(t, "__tensor_flatten__")


class _Same:
    """A value compared by identity (a tensor or module a loss function closes over): the key
    keeps it alive, so its ``id`` cannot be reused by another object while the key exists."""

    __slots__ = ("obj",)

    def __init__(self, obj: object):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<{type(self.obj).__name__} at {id(self.obj):#x}>"


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum,
          type)


def value_key(v: Any) -> Hashable:
    """A hashable stand-in for a value a function closes over or takes as a default: plain
    immutable values by value, containers element-wise, functions by :func:`fn_key`, a
    parameterless ``nn.Module`` (a loss module) by its type, mode and plain attributes, and
    anything else by identity."""
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (tuple, list, frozenset, set)):
        items = sorted(map(value_key, v), key=repr) if isinstance(v, (set, frozenset)) else map(value_key, v)
        return (type(v).__name__, tuple(items))
    if isinstance(v, dict) and len(v) < 64:
        return ("dict", tuple((value_key(k), value_key(x)) for k, x in v.items()))
    if callable(v) and not isinstance(v, nn.Module) and (inspect.isfunction(v) or inspect.ismethod(v)
                                                         or isinstance(v, functools.partial)):
        return fn_key(v)
    if isinstance(v, nn.Module) and not any(True for _ in v.parameters()) and not any(True for _ in v.buffers()):
        attrs = tuple((k, value_key(x)) for k, x in sorted(vars(v).items())
                      if not k.startswith("_") and isinstance(x, _PLAIN))
        return ("module", type(v), v.training, attrs)
    return _Same(v)


def fn_key(fn: Callable | None) -> Hashable:
    """The loss / output function as the key sees it: ``fn.cache_hash`` if set (the user's own
    promise that equal hashes compute the same), else code + closure values + defaults + bound
    ``self``, so a new ``lambda`` with the same code and values reuses the program."""
    if fn is None:
        return None
    if (h := getattr(fn, "cache_hash", None)) is not None:
        return ("cache_hash", h)
    if isinstance(fn, functools.partial):
        return ("partial", fn_key(fn.func), value_key(fn.args), value_key(fn.keywords))
    if inspect.ismethod(fn):
        return ("method", fn_key(fn.__func__), value_key(fn.__self__))
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object (an nn.Module loss, a class instance)
        return ("callable", value_key(fn))
    cells = []
    for c in fn.__closure__ or ():
        try:
            cells.append(value_key(c.cell_contents))
        except ValueError:  # an empty cell (a name assigned later in the enclosing scope)
            cells.append(_Same(c))
    return ("function", code, tuple(cells), value_key(fn.__defaults__), value_key(fn.__kwdefaults__))


def code_of(fn: Callable | None):
    """The code object behind ``fn`` (through partials and bound methods), or None."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
_BACKWARD_HOOKS = ("_backward_hooks", "_backward_pre_hooks")


def _global_hooks(kind: str) -> dict:
    return getattr(torch.nn.modules.module, f"_global{kind}", {})


def _hook_name(hook: Callable) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def refuse_unsupported(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModelState` for what no compiled program can honour:

    - a ``DistributedDataParallel`` wrapper (the model or a submodule): fxoverlap runs the
      backward itself, so DDP's gradient hooks never fire and replicas drift apart;
    - module backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``,
      or the global ones): the backward is traced once, so such a hook would run at capture
      only and never again.
    """
    _refuse_global_backward_hooks()
    for name, mod in model.named_modules():
        _refuse_module(name, mod)


def _refuse_module(name: str, mod: nn.Module) -> None:
    if isinstance(mod, torch.nn.parallel.DistributedDataParallel):
        raise UnsupportedModelState(
            f"fxoverlap: {name or 'the model'} is wrapped in DistributedDataParallel. fxoverlap runs the "
            f"backward itself, so DDP's gradient reduction would never run and the replicas would drift "
            f"apart. Pass the unwrapped module (ddp.module) and let fxoverlap reduce the gradients: "
            f"fxoverlap.optimize(model, ep_group, dp_group=<the data-parallel group>)")
    for kind in _BACKWARD_HOOKS:
        if hooks := getattr(mod, kind, None):
            raise UnsupportedModelState(
                f"fxoverlap: module {name or '<model>'} ({type(mod).__name__}) has a module backward hook "
                f"({_hook_name(next(iter(hooks.values())))}, in {kind}). The backward is traced once, so "
                f"the hook would run at capture only, not at each step. Remove it, or hook the gradients "
                f"fxoverlap honours at each step: p.register_hook(fn) on a parameter, or "
                f"p.register_post_accumulate_grad_hook(fn)")


def _refuse_global_backward_hooks() -> None:
    for kind in _BACKWARD_HOOKS:
        if hooks := _global_hooks(kind):
            raise UnsupportedModelState(
                f"fxoverlap: a global module backward hook is registered ({_hook_name(next(iter(hooks.values())))},"
                f" torch.nn.modules.module._global{kind}); the backward is traced once, so it would run at capture "
                f"only. Remove it while fxoverlap runs the model")


@dataclasses.dataclass(frozen=True)
class ModelState:
    """What one call reads of the model, from one walk over its modules: the submodules not in
    training mode and the forward hooks (the key's ``eval_modules`` and ``hooks``, each module
    once, first name), and every parameter and buffer by name (``remove_duplicate=False``, a
    shared module under each of its names: what ``named_parameters`` / ``named_buffers`` give).
    The engine takes one per call and shares it: the key, the static values, the gradient sink
    and the reduction's ``begin`` read the same parameter objects, looked up once."""

    eval_modules: tuple[str, ...]
    hooks: tuple
    params: tuple[tuple[str, torch.Tensor], ...]
    buffers: tuple[tuple[str, torch.Tensor], ...]

    @functools.cached_property
    def tensors(self) -> NamedTensors:
        """The parameters and buffers by name (the runtime's lookups)."""
        return NamedTensors(dict(self.params), dict(self.buffers))


_NAMED_MODULES = nn.Module.named_modules
_NAMED_MEMBERS = (nn.Module.named_parameters, nn.Module.named_buffers, nn.Module._named_members)


def model_state(model: nn.Module) -> ModelState:
    """The :class:`ModelState` of ``model`` now, raising :class:`UnsupportedModelState` for what
    :func:`refuse_unsupported` refuses.

    One explicit walk over ``_modules`` in ``named_modules``' order (preorder, children in
    registration order), rather than ``named_modules`` + ``named_parameters`` +
    ``named_buffers`` (three walks of nested generators, and the largest part of a cached
    call's host time). It gives exactly what they give: a module reached twice is walked under
    each name for its parameters and buffers, as ``remove_duplicate=False`` does, and counted
    once (its first name) for the training flags and hooks, as ``named_modules()`` does. A model
    whose modules override ``named_modules`` (or whose root overrides ``named_parameters`` /
    ``named_buffers``) is read through those methods instead."""
    _refuse_global_backward_hooks()
    if any(getattr(type(model), f.__name__) is not f for f in _NAMED_MEMBERS):
        return _model_state_by_methods(model)
    evals: list[str] = []
    hooks = [("<global>", kind, tuple(g)) for kind in _MODULE_HOOKS if (g := _global_hooks(kind))]
    params: list[tuple[str, torch.Tensor]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    ddp = torch.nn.parallel.DistributedDataParallel
    # (the module's own attributes read from its __dict__: the walk is the cached call's largest cost)
    while stack:
        name, mod = stack.pop()
        if type(mod).named_modules is not _NAMED_MODULES:
            return _model_state_by_methods(model)
        attrs = mod.__dict__
        dot = name + "." if name else ""
        if id(mod) not in seen:
            seen.add(id(mod))
            if attrs.get("_backward_hooks") or attrs.get("_backward_pre_hooks") or isinstance(mod, ddp):
                _refuse_module(name, mod)
            if not mod.training:
                evals.append(name)
            if d := attrs.get("_forward_hooks"):
                hooks.append((name, "_forward_hooks", tuple(d)))
            if d := attrs.get("_forward_pre_hooks"):
                hooks.append((name, "_forward_pre_hooks", tuple(d)))
        for k, p in attrs["_parameters"].items():
            if p is not None:
                params.append((dot + k, p))
        for k, b in attrs["_buffers"].items():
            if b is not None:
                buffers.append((dot + k, b))
        children = attrs["_modules"]
        if children:
            stack.extend([(dot + k, m) for k, m in reversed(children.items()) if m is not None])
    return ModelState(tuple(evals), tuple(hooks), tuple(params), tuple(buffers))


def _model_state_by_methods(model: nn.Module) -> ModelState:
    """:func:`model_state` through ``named_modules`` / ``named_parameters`` / ``named_buffers``."""
    _refuse_global_backward_hooks()
    evals: list[str] = []
    hooks = [("<global>", kind, tuple(g)) for kind in _MODULE_HOOKS if (g := _global_hooks(kind))]
    for name, mod in model.named_modules():
        _refuse_module(name, mod)
        if not mod.training:
            evals.append(name)
        hooks.extend((name, kind, tuple(d)) for kind in _MODULE_HOOKS if (d := getattr(mod, kind, None)))
    return ModelState(tuple(evals), tuple(hooks), tuple(model.named_parameters(remove_duplicate=False)),
                      tuple(model.named_buffers(remove_duplicate=False)))


def wrapped_by_ddp(model: nn.Module) -> UnsupportedModelState | None:
    """The error to raise when a ``DistributedDataParallel`` was built around ``model`` after
    ``optimize`` (it leaves no mark on the module: found through the objects that refer to it;
    asked when a program is compiled, not at every call), else None."""
    import gc

    # DDP holds the model in its _modules dict, and that dict in its instance dict, next to its
    # C++ Reducer: two levels of referrers (about 0.1 s each with torch imported)
    for holder in gc.get_referrers(model):
        if isinstance(holder, dict) and holder.get("module") is model:
            if any(isinstance(d, dict) and d.get("_modules") is holder and type(d.get("reducer")).__name__ == "Reducer"
                   for d in gc.get_referrers(holder)):
                return UnsupportedModelState(
                    f"fxoverlap: a DistributedDataParallel wraps the model ({type(model).__name__}) that "
                    f"fxoverlap.optimize was given. fxoverlap runs the backward itself, so DDP's gradient "
                    f"reduction never runs and the replicas would drift apart. Drop the DDP wrapper and pass "
                    f"dp_group=<the data-parallel group> to fxoverlap.optimize, which reduces the gradients "
                    f"inside the program")
    return None


def group_keys(groups: dict[str, dist.ProcessGroup | None]) -> tuple:
    """Each group by role: its name and size (the comm ops name the group they run on)."""
    return tuple((role, None, 1) if g is None or not dist.is_initialized()
                 else (role, getattr(g, "group_name", None), dist.get_world_size(g)) for role, g in groups.items())


def program_key(model: nn.Module, inputs: Sequence[torch.Tensor], keywords: tuple[str, ...], fn: Callable | None,
                role: str, config: object, groups: dict[str, dist.ProcessGroup | None],
                state: ModelState | None = None) -> ProgramKey:
    """The :class:`ProgramKey` of calling ``model`` on ``inputs`` (the last ``len(keywords)`` of
    them passed by those keywords) with ``fn`` as the loss (``role="train"``) or output
    (``"forward"``) function; ``state``: ``model_state(model)`` taken for this call (taken here
    when None). Raises :class:`UnsupportedModelState` for a model no program can honour
    (:func:`refuse_unsupported`)."""
    if state is None:
        state = model_state(model)
    names = (None,) * (len(inputs) - len(keywords)) + tuple(keywords)
    return ProgramKey(
        role=role,
        inputs=tuple((i if k is None else k, *_tensor_meta(t)) for i, (k, t) in enumerate(zip(names, inputs))),
        params=tuple((n, *_tensor_meta(p)) for n, p in state.params),
        buffers=tuple((n, *_tensor_meta(b)) for n, b in state.buffers),
        eval_modules=state.eval_modules,
        grad_mode=torch.is_grad_enabled(),
        autocast=tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        hooks=state.hooks,
        fn=fn_key(fn),
        config=repr(config),
        groups=group_keys(groups),
    )


V = TypeVar("V")


class ProgramCache(Generic[V]):
    """At most ``max_programs`` programs by :class:`ProgramKey`, least recently used evicted
    (``close(value)`` releases an evicted one: its CUDA graphs and pools). Every compile is
    logged with why (``TORCH_LOGS="+fxoverlap"``), as Dynamo logs its recompile reasons; when
    keys keep differing only in the loss/output function while its code stays the same, it
    warns once with the fix."""

    def __init__(self, max_programs: int, close: Callable[[V], None] = lambda v: None):
        self.max_programs = max_programs
        self._close = close
        self._entries: collections.OrderedDict[ProgramKey, V] = collections.OrderedDict()
        self._fn_only_misses: collections.Counter = collections.Counter()  # code object -> misses
        self._warned = False
        self.compiles = 0

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[ProgramKey, V]]:
        return list(self._entries.items())

    def get(self, key: ProgramKey) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def why_new(self, key: ProgramKey, fn: Callable | None) -> str:
        """Why ``key`` misses: the differences from the most recent key of the same role (and
        the one-time warning when only the function's closure values differ)."""
        last = next((k for k in reversed(self._entries) if k.role == key.role), None)
        if last is None:
            return "first call" if not self._entries else f"first {key.role} call"
        where = code_of(fn)
        if where is not None and dataclasses.replace(key, fn=last.fn) == last:  # only the function differs
            self._fn_only_misses[where] += 1
            if self._fn_only_misses[where] >= 2 and not self._warned:
                self._warned = True
                warnings.warn(RepeatedRecompileWarning(
                    f"fxoverlap: the function {where.co_name} ({where.co_filename}:{where.co_firstlineno}) keeps "
                    f"arriving with other values in its closure or defaults, and each new one traces and compiles "
                    f"the whole model again. Whatever changes between calls (a tensor, a module) is baked into "
                    f"the program: pass tensors as part of the microbatch instead, define the function once "
                    f"outside the loop, or set fn.cache_hash to a value that is equal exactly when two functions "
                    f"compute the same"), stacklevel=4)
        return "; ".join(key.differences(last))

    def put(self, key: ProgramKey, value: V) -> None:
        self.compiles += 1
        self._entries[key] = value
        while len(self._entries) > self.max_programs:
            old_key, old = self._entries.popitem(last=False)
            log.info("fxoverlap: evicting the %s program of %d inputs (cache holds %d)", old_key.role,
                     len(old_key.inputs), self.max_programs)
            self._close(old)

    def clear(self) -> None:
        while self._entries:
            self._close(self._entries.popitem()[1])
