"""What ``fxoverlap.optimize``'s engine is given, checked before anything is captured or run.

* the process groups (:func:`check_group`) and the experts' split over the EP group;
* the microbatches (:func:`normalise`): each one a tensor, a tuple or list of tensors (the
  model's positional inputs, in ``forward``'s order), or a ``Mapping`` of tensors (keyword
  inputs: ``model(**batch)``, ``loss_fn(output, **batch)``, as Hugging Face trainers call
  them), as a :class:`~fxoverlap.ir.capture.Microbatch`; every other type is refused by name
  with a hint; all microbatches of one call share their structure;
* the call contract (:func:`check_call`): ``model(*args, **kwargs)`` and ``loss_fn(output,
  *args, **kwargs)`` bind, checked for every new model ``forward`` / ``loss_fn`` code;
* the EP ranks' agreement on the microbatches (:func:`agree`), so that a mismatch is an
  error on every rank, never a collective mismatch that aborts one;
* the EP group the captured comm ops use (:meth:`InputChecks.adopt_group`): with
  ``ep_group=None`` a group of more than one rank in the graph is adopted (or, with data
  parallelism, refused by name).

:class:`InputChecks` holds what these checks remember for one engine.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from fxoverlap.expert_parallel import ExpertParallelError
from fxoverlap.ir.capture import Capture, Microbatch
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.passes.capture import input_signature

__all__ = ["EPGroupError", "InputChecks", "InputError", "Microbatch", "MicrobatchError", "MicrobatchMismatch",
           "agree", "as_microbatch", "check_call", "check_expert_split", "check_group", "comm_groups", "describe",
           "normalise"]


class InputError(FxOverlapError, TypeError):
    """``microbatches`` or a group passed to fxoverlap has the wrong type or shape of call;
    the message says what was passed and what is expected."""


class MicrobatchError(FxOverlapError, ValueError):
    """The microbatches passed to ``forward_backward`` do not make one step (none, or two with
    different input structures); the message says which."""


class MicrobatchMismatch(FxOverlapError, ValueError):
    """The ranks of the EP group called ``forward_backward`` with different microbatch counts
    or input structures; raised on every rank, naming each rank's call."""


class EPGroupError(FxOverlapError, ValueError):
    """The captured comm ops exchange over a process group of more than one rank that the
    engine was not given as ``ep_group`` and cannot adopt; the message names the group."""


# ---------------------------------------------------------------- groups
def check_group(group: object, name: str) -> None:
    """``group`` must be a ``torch.distributed.ProcessGroup`` or None."""
    if group is None or isinstance(group, dist.ProcessGroup) or group is dist.GroupMember.NON_GROUP_MEMBER:
        return  # (what dist.new_group returns on a rank outside the group: torch's own value)
    hint = ""
    if type(group).__name__ == "DeviceMesh":
        hint = " (a DeviceMesh: pass mesh['<dim>'].get_group())"
    elif isinstance(group, int):
        hint = " (a rank or group size? pass the group itself, e.g. dist.group.WORLD or dist.new_group(ranks))"
    raise InputError(f"fxoverlap.optimize: {name} is {group!r}, of type {type(group).__name__}{hint}; it must be "
                     f"a torch.distributed.ProcessGroup or None")


def check_expert_split(model: nn.Module, ep_group: dist.ProcessGroup | None) -> None:
    """Every experts module's count divides evenly over the EP group."""
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    for name, mod in model.named_modules():
        for holder in (mod, getattr(mod, "cfg", None), getattr(mod, "config", None)):
            n = getattr(holder, "n_experts", None) or getattr(holder, "num_experts", None)
            if isinstance(n, int) and n % ep:
                raise ExpertParallelError(
                    f"fxoverlap.optimize: {name or 'model'} has {n} experts, which an expert-parallel "
                    f"group of {ep} ranks cannot split evenly; use a group size that divides {n}"
                )


def comm_groups(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """The process groups the graph's comm ops name: ``group_name`` -> the nodes that use it.
    Read from each op's schema argument ``group_name`` (fxoverlap's ops and torch's
    functional collectives alike); an empty name is no group (one rank)."""
    found: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.name != "group_name":
                continue
            name = node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
            if isinstance(name, str) and name:
                found.setdefault(name, []).append(node.name)
    return found


def _resolve(group_name: str) -> dist.ProcessGroup | None:
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name)
    except (KeyError, RuntimeError, ValueError):  # not a group of this process (a test's fake name)
        return None


# ---------------------------------------------------------------- microbatches
_ENTRY = ("each microbatch is one tensor, a tuple of tensors in forward's order ([(tokens, labels), ...] for "
          "forward(self, tokens, labels)), or a dict of tensors passed as keyword arguments "
          "([{'input_ids': ids, 'labels': labels}, ...] for model(**batch))")


def _hint(x: object) -> str:
    """What to pass instead of ``x``, a value that is not a tensor."""
    if type(x).__module__ == "numpy" or type(x).__name__ == "ndarray":
        return "convert it with torch.from_numpy(array) (or torch.as_tensor)"
    if isinstance(x, (str, bytes)):
        return ("fxoverlap takes token ids, not text: tokenize it first "
                "(e.g. tokenizer(text, return_tensors='pt')['input_ids'])")
    if x is None:
        return ("leave an optional input out (a shorter tuple, or a dict without that key), or bind it into the "
                "model or loss_fn")
    if isinstance(x, (bool, int, float, complex)):
        return ("a Python number is not an input fxoverlap captures: bind it into the model or loss_fn "
                "(functools.partial), or pass torch.tensor(value)")
    if isinstance(x, Mapping):
        return ("a dict is a whole microbatch, passed as keyword arguments: [{'input_ids': ids, 'labels': "
                "labels}, ...], not an entry of a tuple or list")
    if isinstance(x, (list, tuple)):
        return "nested tuples or lists are not flattened: " + _ENTRY
    if isinstance(x, (types.GeneratorType, Iterator)):
        return "a generator is consumed once and names no order: pass a tuple of the tensors in forward's order"
    if isinstance(x, (set, frozenset)):
        return "a set has no order: pass a tuple of the tensors in forward's order"
    return "bind non-tensor arguments into the model or loss_fn (functools.partial); " + _ENTRY


def _what(x: object) -> str:
    t = type(x)
    name = t.__name__ if t.__module__ in ("builtins", None) else f"{t.__module__}.{t.__qualname__}"
    return f"{name} {x!r}" if isinstance(x, (str, bytes, bool, int, float, complex)) and len(repr(x)) <= 40 else name


def as_microbatch(mb: object, i: int, what: str) -> Microbatch:
    """Microbatch ``i`` as a :class:`Microbatch`: a tensor, a tuple or list of tensors, or a
    ``Mapping`` of str to tensors (its keys sorted: keyword arguments have no order)."""
    if isinstance(mb, Microbatch):
        return mb
    if isinstance(mb, torch.Tensor):
        return Microbatch((mb,))
    if isinstance(mb, Mapping):
        if bad := [k for k in mb if not isinstance(k, str)]:
            raise InputError(f"{what}: microbatch {i} is a {type(mb).__name__} with key {bad[0]!r} of type "
                             f"{type(bad[0]).__name__}; its keys are the model's keyword arguments: str")
        keys = tuple(sorted(mb))
        for k in keys:
            if not isinstance(mb[k], torch.Tensor):
                raise InputError(f"{what}: microbatch {i}[{k!r}] is a {_what(mb[k])}, not a tensor; {_hint(mb[k])}")
        return Microbatch(tuple(mb[k] for k in keys), keys)
    if isinstance(mb, (tuple, list)):
        for j, t in enumerate(mb):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{what}: microbatch {i} is a {type(mb).__name__} whose entry {j} is a "
                                 f"{_what(t)}, not a tensor; {_hint(t)}")
        return Microbatch(mb)
    raise InputError(f"{what}: microbatch {i} is a {_what(mb)}; {_hint(mb)}")


def _check_list(microbatches: object, what: str) -> None:
    """``microbatches`` is a list (or another ordered iterable) of microbatches."""
    if isinstance(microbatches, torch.Tensor):
        raise InputError(
            f"{what}: microbatches is a tensor of shape {list(microbatches.shape)}, not a list of "
            f"microbatches (fxoverlap would iterate over its rows); pass a list, each entry a tuple of the "
            f"model's inputs: [(tokens0, labels0), (tokens1, labels1)], or [tokens0, tokens1] for one input"
        )
    if isinstance(microbatches, tuple) and microbatches and all(isinstance(t, torch.Tensor) for t in microbatches):
        raise InputError(
            f"{what}: microbatches is a tuple of {len(microbatches)} tensors {describe(microbatches)}: one "
            f"microbatch without its list? Pass a list of microbatches: [(tokens, labels)] for one "
            f"microbatch of two inputs, or a list [t0, t1] for microbatches of one tensor each"
        )
    if isinstance(microbatches, Mapping):
        raise InputError(f"{what}: microbatches is a {type(microbatches).__name__} (keys {list(microbatches)}): one "
                         f"microbatch without its list? Pass a list of them: [batch] (each passed as "
                         f"model(**batch))")
    if isinstance(microbatches, (set, frozenset)):
        raise InputError(f"{what}: microbatches is a {type(microbatches).__name__}, which has no order; pass a "
                         f"list of microbatches (the losses come back in its order): {_ENTRY}")
    special = microbatches is None or isinstance(microbatches, (str, bytes)) or \
        type(microbatches).__module__ == "numpy"
    if special or not isinstance(microbatches, Iterable):
        hint = f" ({_hint(microbatches)})" if special else ""
        raise InputError(f"{what}: microbatches is a {_what(microbatches)}{hint}; pass a list of microbatches: "
                         f"{_ENTRY}")


def normalise(microbatches: object, what: str) -> list[Microbatch]:
    """The microbatches of one call, each a :class:`Microbatch`, all of one structure (the same
    keyword names, and the same input signature: shapes and dtypes)."""
    _check_list(microbatches, what)
    mbs = [as_microbatch(mb, i, what) for i, mb in enumerate(microbatches)]
    if not mbs:
        raise MicrobatchError(f"{what}: got an empty list of microbatches; pass at least one")
    first = mbs[0]
    for i, mb in enumerate(mbs[1:], 1):
        if mb.keywords != first.keywords:
            only_i = sorted(set(mb.keywords) - set(first.keywords))
            only_0 = sorted(set(first.keywords) - set(mb.keywords))
            raise MicrobatchError(
                f"{what}: microbatch {i} has keys {list(mb.keywords)} but microbatch 0 has {list(first.keywords)} "
                f"(only in {i}: {only_i}; only in 0: {only_0}); all microbatches of one call pass the same "
                f"keyword arguments (a later call may use others: it is captured anew)"
            )
        if input_signature(mb) != input_signature(first):
            raise MicrobatchError(
                f"{what}: microbatch {i} has inputs {describe(mb)} but microbatch 0 has "
                f"{describe(first)}; all microbatches of one call must share shapes and dtypes "
                f"(a later call may use new shapes: it is captured anew)"
            )
    return mbs


def describe(mb: Sequence) -> str:
    """``(float32[4, 8], input_ids=int64[2, 8])``: each input's dtype and shape."""
    def one(t) -> str:
        return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" if isinstance(t, torch.Tensor) \
            else type(t).__name__

    keywords = getattr(mb, "keywords", ())
    n = len(mb) - len(keywords)
    return "(" + ", ".join([one(t) for t in mb[:n]] + [f"{k}={one(t)}" for k, t in zip(keywords, mb[n:])]) + ")"


# ---------------------------------------------------------------- the call contract
def _code_key(fn: Callable | None) -> object:
    """What decides ``fn``'s signature: its code, defaults and bound ``self``'s presence for a
    Python function or method (a fresh lambda of the same code shares it), else ``fn``."""
    bound = isinstance(fn, types.MethodType)
    func = fn.__func__ if bound else fn
    if isinstance(func, types.FunctionType):
        return func.__code__, func.__defaults__, _hashable(func.__kwdefaults__), bound
    return fn


def _hashable(d: dict | None) -> object:
    return None if d is None else tuple(sorted((k, id(v)) for k, v in d.items()))


def check_call(model: nn.Module, fn: Callable | None, mb: Microbatch, what: str, fn_name: str = "loss_fn") -> None:
    """``model(*mb.args, **mb.kwargs)`` and ``fn(output, *mb.args, **mb.kwargs)`` must bind: say
    what was passed and what they take."""
    args, kwargs = mb.args, mb.kwargs
    star = "**microbatch" if mb.keywords and not args else ("*args, **kwargs" if mb.keywords else "*microbatch")
    for f, f_args, call, shown in ((model.forward, args, f"{type(model).__name__}.forward", f"model({star})"),
                                   (fn, (None, *args), fn_name, f"{fn_name}(output, {star})")):
        if f is None:
            continue
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):  # a builtin or C function: nothing to check
            continue
        try:
            sig.bind(*f_args, **kwargs)
        except TypeError as e:
            raise InputError(
                f"{what}: microbatch 0 has {len(mb)} tensor(s) {describe(mb)}, and fxoverlap calls {shown}, but "
                f"{call}{sig} does not take them ({e}). Each microbatch is a tuple of the model's positional "
                f"inputs, or a dict of its keyword inputs; {fn_name} gets the output and the same inputs: e.g. "
                f"microbatches [(tokens, labels), ...] for forward(self, tokens, labels), or [(tokens,), ...] with "
                f"{fn_name}=lambda out, tokens: ..., or [{{'input_ids': ids}}, ...] with "
                f"{fn_name}=lambda out, input_ids: ..."
            ) from None


# ---------------------------------------------------------------- the EP ranks agree
def agree(mbs: list[Microbatch], group: dist.ProcessGroup | None, what: str) -> None:
    """Every rank of the EP group plans the same microbatch count and input structure
    (keyword names, number of tensors, dtypes, dims; shapes may differ): one small all-gather,
    so that a mismatch is this clear error on every rank instead of a collective mismatch that
    kills one rank and leaves the other with a reset connection."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    structure = (mbs[0].keywords, tuple((str(t.dtype), t.dim()) for t in mbs[0]))
    mine = (len(mbs), structure, describe(mbs[0]))
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if len({(n, s) for n, s, _ in every}) > 1:
        ranks = dist.get_process_group_ranks(group)
        calls = "; ".join(f"rank {r}: {n} microbatch(es) of {d}" for r, (n, _, d) in zip(ranks, every))
        raise MicrobatchMismatch(
            f"{what}: the ranks of the expert-parallel group disagree on the microbatches ({calls}). "
            f"Every EP rank runs the same program, with the same all-to-alls: give each rank the same number "
            f"of microbatches with the same inputs (dtypes and dims; shapes may differ)"
        )


class InputChecks:
    """The input checks of one engine, and what they remember: the calls already checked
    (per model ``forward`` and ``loss_fn`` code and input signature) and the (signature,
    microbatch count) pairs the EP ranks agreed on."""

    def __init__(self, model: nn.Module, ep_group: dist.ProcessGroup | None,
                 dp_group: dist.ProcessGroup | None = None, expert_dp_group: dist.ProcessGroup | None = None):
        for group, name in ((ep_group, "ep_group"), (dp_group, "dp_group"), (expert_dp_group, "expert_dp_group")):
            check_group(group, name)
        check_expert_split(model, ep_group)
        self.model, self.ep_group = model, ep_group
        self.data_parallel = dp_group is not None or expert_dp_group is not None
        self._agreed: set[tuple] = set()  # (signature, microbatch count) the EP ranks agreed on
        self._called: set[tuple] = set()  # (forward's code, fn's code, signature) whose call binds
        self._pending: tuple[list[Microbatch], str] | None = None  # a call to agree on once the group is known

    def check(self, microbatches: object, fn: Callable | None = None, what: str = "forward_backward",
              fn_name: str = "loss_fn") -> list[Microbatch]:
        """The microbatches as :class:`Microbatch` es, checked against each other, the call
        contract and, the first time for their signature and count, the other EP ranks."""
        self._pending = None
        mbs = normalise(microbatches, what)
        self.check_call(mbs[0], fn, what, fn_name)
        key = (input_signature(mbs[0]), len(mbs))
        if key not in self._agreed:  # a call fxoverlap plans for: check once, before it runs
            if self.ep_group is None and dist.is_initialized() and dist.get_world_size() > 1:
                self._pending = (mbs, what)  # the group may be in the graph: adopt_group agrees then
            else:
                agree(mbs, self.ep_group, what)
                self._agreed.add(key)
        return mbs

    def call(self, args: tuple, kwargs: dict, what: str = "engine(*inputs)") -> Microbatch:
        """``engine(*args, **kwargs)``'s one microbatch, checked like :meth:`check`'s."""
        pos = as_microbatch(tuple(args), 0, what)
        kw = as_microbatch(dict(kwargs), 0, what) if kwargs else Microbatch(())
        return self.check([Microbatch((*pos, *kw), kw.keywords)], None, what)[0]

    def check_call(self, mb: Microbatch, fn: Callable | None, what: str, fn_name: str = "loss_fn") -> None:
        """:func:`check_call`, once per model ``forward`` code, ``fn`` code and input signature."""
        key = (_code_key(self.model.forward), _code_key(fn), input_signature(mb))
        try:
            if key in self._called:
                return
        except TypeError:  # an unhashable callable: check every call
            key = None
        check_call(self.model, fn, mb, what, fn_name)
        if key is not None:
            self._called.add(key)

    def adopt_group(self, cap: Capture) -> dist.ProcessGroup | None:
        """The EP group after capturing ``cap``: ``ep_group`` as given, or, where that is None and
        the graph's comm ops exchange over a group of more than one rank, that group (then the
        EP ranks agree on the call that captured it). Refused (:class:`EPGroupError`) with data
        parallelism (its groups were checked for EP 1) or when the ops use two such groups."""
        if self.ep_group is not None or not dist.is_initialized():
            return self.ep_group
        groups = {name: (g, nodes) for name, nodes in comm_groups(cap.graph_module).items()
                  if (g := _resolve(name)) is not None and dist.get_world_size(g) > 1}
        if not groups:
            return None
        named = "; ".join(f"group {name!r} of ranks {dist.get_process_group_ranks(g)} (nodes {', '.join(n[:3])})"
                          for name, (g, n) in groups.items())
        if len(groups) > 1 or self.data_parallel:
            why = ("they use more than one" if len(groups) > 1 else
                   "with dp_group / expert_dp_group the gradient reductions were set up for EP 1")
            raise EPGroupError(
                f"fxoverlap.optimize: ep_group is None, but the model's comm ops exchange over {named}, and "
                f"{why}; pass that group: fxoverlap.optimize(model, ep_group=<the group the model was built on>, ...)"
            )
        (group, _), = groups.values()
        check_expert_split(self.model, group)
        self.ep_group = group
        if self._pending is not None:  # the call that captured it: agree before it runs
            mbs, what = self._pending
            self._pending = None
            agree(mbs, group, what)
            self._agreed.add((input_signature(mbs[0]), len(mbs)))
        return group
