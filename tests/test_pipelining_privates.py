"""The internals of torch.distributed.pipelining that fxoverlap reaches exist on the pinned torch
(fxoverlap/pipelining_privates.py lists them), and pipeline_parallel.py reaches none other."""

from __future__ import annotations

import ast
import pathlib

import pp_cases

from fxoverlap import pipelining_privates
from fxoverlap.testing import run_distributed

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_needed_private_exists():
    (res,) = run_distributed(pp_cases.privates_case, world_size=1)
    assert res["runtime"] and res["checked"] == len(pipelining_privates.NEEDED) > 0
    assert res["missing"] == [], f"torch.distributed.pipelining lacks {res['missing']}: update pipelining_privates"


def test_pipeline_parallel_reaches_no_pipelining_private():
    """pipeline_parallel.py names no private (``_x``) attribute of a pipelining module, schedule or
    stage, and imports none: those go through pipelining_privates. (Its own ``self._x`` and
    torch's tensor / Dynamo privates are not pipelining's.)"""
    tree = ast.parse((ROOT / "fxoverlap" / "pipeline_parallel.py").read_text())
    allowed_bases = {"self", "torch", "t", "fn"}  # our objects, tensors, autograd nodes
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and "pipelining" in node.module:
            bad += [f"import {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if not (isinstance(base, ast.Name) and base.id in allowed_bases):
                bad.append(f"line {node.lineno}: .{node.attr}")
    assert bad == [], bad


# the classes whose ``self`` is a pipelining object (our PipelineStage / schedule subclasses)
_PIPELINING_SUBCLASSES = {"_OverlapStage", "_SingleScheduleStage", "_OverlapSchedule"}
# the names pipeline_parallel.py binds to pipelining stages and schedules
_PIPELINING_NAMES = {"stage", "st", "schedule", "sched", "s", "stages", "local", "ours"}


def test_pipeline_parallel_assigns_no_pipelining_attribute():
    """No attribute of a torch.distributed.pipelining object is assigned in pipeline_parallel.py
    outside our subclasses' ``__init__``: no ``stage.x = ...`` / ``schedule.x = ...`` (nor
    ``setattr``), and ``self.x = ...`` in _OverlapStage / _OverlapSchedule only in ``__init__``."""
    tree = ast.parse((ROOT / "fxoverlap" / "pipeline_parallel.py").read_text())
    bad = []

    def targets(node):
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        if isinstance(node, ast.Delete):
            return node.targets
        return []

    def base_name(t):
        while isinstance(t, (ast.Attribute, ast.Subscript)):
            t = t.value
        return t.id if isinstance(t, ast.Name) else None

    def scan(node, cls: str | None, fn: str | None):
        for child in ast.iter_child_nodes(node):
            c, f = cls, fn
            if isinstance(child, ast.ClassDef):
                c, f = child.name, None
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                f = child.name if f is None else f
            for t in targets(child):
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if not isinstance(el, ast.Attribute):
                        continue
                    name = base_name(el)
                    own_self = name == "self" and isinstance(el.value, ast.Name)
                    if own_self and c in _PIPELINING_SUBCLASSES and f != "__init__":
                        bad.append(f"line {el.lineno}: self.{el.attr} in {c}.{f}")
                    elif name in _PIPELINING_NAMES and isinstance(el.value, ast.Name):
                        bad.append(f"line {el.lineno}: {name}.{el.attr}")
                    # nothing of ours parked on any object, tensors included (a local shard's DTensor
                    # is looked up in the stage's own table: _StageCompiler.shards)
                    if el.attr.startswith("_fxoverlap"):
                        bad.append(f"line {el.lineno}: .{el.attr}")
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "setattr":
                bad.append(f"line {child.lineno}: setattr")
            scan(child, c, f)

    scan(tree, None, None)
    assert bad == [], bad
    # the subclasses the scan trusts are the ones pipeline_parallel.py defines
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    assert _PIPELINING_SUBCLASSES <= names


def test_pipeline_parallel_names_no_fxoverlap_attribute():
    """No ``_fxoverlap*`` name anywhere in pipeline_parallel.py: not assigned (the AST scan above),
    nor read or set by name (``getattr(t, "_fxoverlap_...")``, ``hasattr``, ``setattr``,
    ``vars(x)[...]``), so no mark rides on a tensor or a pipelining object."""
    src = (ROOT / "fxoverlap" / "pipeline_parallel.py").read_text()
    tree = ast.parse(src)
    named = [n.lineno for n in ast.walk(tree)
             if (isinstance(n, ast.Attribute) and n.attr.startswith("_fxoverlap"))
             or (isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("_fxoverlap"))]
    assert named == [], f"pipeline_parallel.py names _fxoverlap* at lines {named}"
    assert "_fxoverlap" not in src


def test_stage_subclass_overrides_only_what_takes_no_custom_function():
    """Our PipelineStage subclass changes, of pipelining's stage methods, only the one call of the
    stage module and the sends (SEND_F / SEND_B take no custom function); for the single-stage
    schedules, which take none, also the backward and the gradient scaling. No dw_builder: the
    runtime schedules' BACKWARD_INPUT / BACKWARD_WEIGHT run through fxoverlap's custom functions."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from fxoverlap import pipeline_parallel as pp

    theirs = {n for c in PipelineStage.__mro__ if issubclass(c, _PipelineStageBase) for n in vars(c)}

    def changed(cls):
        return sorted(n for c in cls.__mro__[:cls.__mro__.index(PipelineStage)] for n in vars(c)
                      if n in theirs and callable(vars(c)[n]) and n != "__init__")

    runtime, single = pp._stage_class(PipelineStage, False), pp._stage_class(PipelineStage, True)
    assert changed(runtime) == ["forward_maybe_with_nosync", "get_bwd_send_ops", "get_fwd_send_ops"]
    assert changed(single) == ["backward_one_chunk", "forward_maybe_with_nosync", "get_bwd_send_ops",
                               "get_fwd_send_ops", "perform_reduce_grad"]
    assert issubclass(runtime, PipelineStage) and issubclass(single, PipelineStage)
