"""Profiler labels for the device copies fxoverlap itself makes, so a trace charges each copy to
its reason (``python -m fxoverlap.bench hf-timeline --deep``'s ``copies`` table).

A label is a ``record_function`` range named ``PREFIX + kind``, or ``PREFIX + kind + " " + value``
where the copy names what it copies (a stage's input, a program output), opened only while a
profiler runs (otherwise :func:`copy_label` is a ``nullcontext``: one C call per copy, and the
value's name is not even joined). The kinds are the reasons a copy is made; this module is the
one place they are named.
"""

from __future__ import annotations

import contextlib

import torch

PREFIX = "fxoverlap.copy "

#: A CUDA graph's output handed to autograd or the caller: graph memory is overwritten at the
#: next replay, so the value leaves as a copy.
GRAPH_OUTPUT = "graph-output"
#: A gradient in graph memory (or aliasing its parameter) copied before it becomes ``p.grad``.
GRAPH_GRADIENT = "graph-gradient"
#: An incoming value copied into a CUDA graph's static input buffer before the replay.
STATIC_INPUT = "static-input"
#: An exchange on one rank: what would travel is copied (an op's output may not alias its input).
ONE_RANK_EXCHANGE = "one-rank-exchange"
#: A chunk's rows taken out of, or put back into, the layer's rows.
CHUNK_ROWS = "chunk-rows"

KINDS = (GRAPH_OUTPUT, GRAPH_GRADIENT, STATIC_INPUT, ONE_RANK_EXCHANGE, CHUNK_ROWS)

_NO_RANGE = contextlib.nullcontext()  # stateless: one for every copy made without a profiler


def copy_label(kind: str, *value: str) -> contextlib.AbstractContextManager:
    """A profiler range around a copy while a profiler runs, else nothing: ``PREFIX + kind``,
    followed by the copied value's name where given (its parts joined by dots, e.g. a stage and
    its input: ``copy_label(STATIC_INPUT, "fwd_l0_post", "combine")``)."""
    if not torch._C._autograd._profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(PREFIX + kind + (" " + ".".join(value) if value else ""))


def parse(label: str) -> tuple[str, str] | None:
    """``(kind, value)`` of a :func:`copy_label` range's name (value ``""`` where none was given);
    None for any other name."""
    if not label.startswith(PREFIX):
        return None
    kind, _, value = label[len(PREFIX):].partition(" ")
    return kind, value
