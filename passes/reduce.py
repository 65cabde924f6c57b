"""reduce: bucket the parameter gradients and place their data-parallel reductions in the program.

Contract
--------
Assumes: ``schedule`` ran on a training program of N microbatches (every stage call and
sink carries a ``Step``); ``streams`` and ``free`` have not run yet: they add the events
and frees of the nodes placed here like those of any other node. The capture's joint
graph carries the tags ``tag`` gave it (which stage kind reads each parameter).

Guarantees:

- every parameter gradient the capture names is in exactly one :class:`Bucket`. A
  bucket holds one *role* and one dtype: ``"expert"`` parameters (read by experts
  stages only, directly or through ops of the parameter alone: the runtime reduces them
  over ``expert_dp_group``) or ``"dense"`` ones (everything else, over ``dp_group``);
- for each bucket, the accumulate of the last microbatch (N-1) is taken out of the
  ``accumulate`` nodes and done by one ``reduce_grads(N-1, b, *values)`` node, on the
  comm stream, placed right after the node at which the bucket's last gradient became
  final (so never before its last contribution): it adds the values to what ``p.grad``
  holds, into the bucket's flat buffer, and starts the reduction; its Step reads the
  values and writes ``bucket_value(b)``, so ``streams`` puts an event on the edge from
  the stage that computed them (compute stream) and ``free`` drops them after it;
- ``finish_reduce(N-1, b)`` nodes, in bucket order, at the end of the program on the
  compute stream, read ``bucket_value(b)``: every reduction has finished when the
  program does (no reduction is left running after ``forward_backward`` returns);
- the accumulates of microbatches 0..N-2 are untouched: they all run before B(N-1);
- ``program_of(program).buckets``: the buckets, in the order they are issued.

Buckets are filled in the order gradients become final in B(N-1) (which is the plain
backward order for every N), like DDP's reverse-parameter-order buckets: a bucket of a
role and dtype closes after the first stage at which it holds ``bucket_bytes`` or more.
``bucket_bytes=0`` gives one bucket per backward stage, role and dtype.

Flat-buffer layout (one per bucket, dtype of its parameters)
------------------------------------------------------------
Gradients in bucket order, each flattened row-major and starting at a multiple of
:data:`ALIGN` elements (the gaps are zeros); the buffer is padded with zeros to
``bucket.padded_numel(n)``, a multiple of the group size ``n``. In
``grad_reduce="reduce_scatter"`` rank ``r`` of the group owns elements
``bucket.shard(r, n)`` = ``[r·s, (r+1)·s)``, ``s = padded_numel(n) / n``: a shard may
start or end inside a gradient, and a gradient may span shards.

Steps
-----
1. Role of each parameter: the stage kinds of the nodes that read it (:func:`parameter_roles`).
2. The last microbatch's ``accumulate`` nodes, in program order.
3. Buckets: append each node's gradients to the open bucket of their role and dtype;
   close the buckets that reached ``bucket_bytes`` there (the rest after the last node).
4. Placement: one ``reduce_grads`` node per bucket after its closing node, the bucket's
   values taken out of the accumulate nodes (a node left with none is removed), and the
   ``finish_reduce`` nodes before the program's output.

Entry point: ``reduce(program, capture, bucket_bytes) -> GraphModule``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx

from fxoverlap.ir import program as program_ops
from fxoverlap.ir.meta import REPLAYS_KEY, STEP_KEY, TAG_KEY
from fxoverlap.ir.bucket import Bucket, GradSlot, slots_end
from fxoverlap.ir.capture import Capture
from fxoverlap.ir.program import Step, add_marker, bucket_value, marker_args, program_of, steps
from fxoverlap.ir.stage import StageKind, StreamKind, Tag
from fxoverlap.ir.errors import FxOverlapError


class ReduceError(FxOverlapError, NotImplementedError):
    """The reduce pass cannot bucket these gradients (tensor-subclass parameters); the message says what to do."""

ALIGN = 64  # elements: each gradient's offset in a flat buffer is a multiple of this


def parameter_readers(capture: Capture) -> dict[str, set[Tag | None]]:
    """The tags of the nodes that read each parameter (FQN); None for an untagged reader. A
    recompute clone counts with the tag of the forward node it replays (``REPLAYS_KEY``).

    Read on the tagged joint graph (``tag`` ran). The readers of a parameter are the
    first nodes that combine it with per-microbatch data, following the ops that compute
    from parameters and buffers alone (a transpose, a cast, a stack of two weights),
    which ``tag`` may place in an attn stage because they do not depend on the dispatch.
    """
    graph = capture.graph_module.graph
    static = capture.static_placeholders
    weights_only: set[torch.fx.Node] = set()  # nodes computed from parameters and buffers alone
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name in static) or n.op == "get_attr" or (
                n.op == "call_function" and all(i in weights_only for i in n.all_input_nodes)):
            weights_only.add(n)
    readers = {}
    for ph in graph.find_nodes(op="placeholder"):
        fqn = capture.param_placeholders.get(ph.name)
        if fqn is None:
            continue
        seen, tags, todo = {ph}, set(), [ph]
        while todo:
            for user in todo.pop().users:
                if user in seen or user.op == "output":
                    continue
                seen.add(user)
                if user in weights_only:
                    todo.append(user)
                else:  # a recompute clone reads as the forward node it replays
                    tags.add(user.meta.get(REPLAYS_KEY, user.meta.get(TAG_KEY)))
        readers[fqn] = tags
    return readers


def parameter_roles(capture: Capture, readers: dict[str, set[Tag | None]] | None = None) -> dict[str, str]:
    """``"expert"`` for each parameter (FQN) that only experts stages read
    (:func:`parameter_readers`, or ``readers`` where the caller has them), else ``"dense"``."""
    if readers is None:
        readers = parameter_readers(capture)
    return {fqn: "expert" if {None if t is None else t.kind for t in tags} == {StageKind.EXPERTS} else "dense"
            for fqn, tags in readers.items()}


def param_meta(capture: Capture) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each parameter's (FQN) traced shape and dtype."""
    out = {}
    for ph in capture.graph_module.graph.find_nodes(op="placeholder"):
        fqn = capture.param_placeholders.get(ph.name)
        if fqn is not None:
            val = ph.meta["val"]
            out[fqn] = (tuple(int(d) for d in val.shape), val.dtype)
    return out


def reduce(program: torch.fx.GraphModule, capture: Capture, bucket_bytes: int) -> torch.fx.GraphModule:
    if capture.grad_layouts:  # their gradients leave the graph as parts; buckets hold whole ones
        raise ReduceError(
            f"reduce: parameters {sorted(capture.grad_layouts)[:3]} are tensor subclasses (DTensors); "
            f"fxoverlap reduces plain gradients over dp_group only: leave dp_group/expert_dp_group unset "
            f"and reduce those gradients after forward_backward")
    graph = program.graph
    last = program_of(program).num_microbatches - 1
    roles = parameter_roles(capture)  # 1.
    meta = param_meta(capture)

    # 2. when each gradient is final: the last microbatch's accumulate nodes, in order
    accumulates = [n for n, s in steps(program)
                   if n.target is program_ops.accumulate and s.microbatch == last]

    # 3. buckets
    buckets: list[Bucket] = []
    open_: dict[tuple[str, torch.dtype], list[GradSlot]] = {}

    def close(key: tuple[str, torch.dtype], after: torch.fx.Node) -> None:
        slots = open_.pop(key)
        call = after.prev
        while call.op != "call_module":  # the sinks follow their stage call
            call = call.prev
        buckets.append(Bucket(len(buckets), key[0], key[1], tuple(slots), call.name))

    closing: dict[torch.fx.Node, list[int]] = {}  # node -> buckets closed right after it
    for node in accumulates:
        for v in node.args[1:]:
            fqn = capture.grads[v]
            shape, dtype = meta[fqn]
            key = (roles[fqn], dtype)
            slots = open_.setdefault(key, [])
            offset = 0 if not slots else -(-slots_end(slots) // ALIGN) * ALIGN
            slots.append(GradSlot(fqn, v, shape, offset))
        for key in [k for k, slots in open_.items() if slots_end(slots) * k[1].itemsize >= bucket_bytes]:
            close(key, node)
            closing.setdefault(node, []).append(buckets[-1].index)
    for key in list(open_):  # what is left closes after the last gradient's node
        close(key, accumulates[-1])
        closing.setdefault(accumulates[-1], []).append(buckets[-1].index)

    # 4. placement
    bucketed = {slot.value for b in buckets for slot in b.slots}
    for node in accumulates:
        at = node
        for b in closing.get(node, []):
            bucket = buckets[b]
            values = tuple(slot.value for slot in bucket.slots)
            with graph.inserting_after(at):
                at = add_marker(graph, program_ops.reduce_grads,
                                Step(last, StreamKind.COMM, reads=values, writes=(bucket_value(b),), bucket=b),
                                name=f"reduce_bucket{b}")
        keep = tuple(v for v in node.meta[STEP_KEY].reads if v not in bucketed)
        if keep:
            node.meta[STEP_KEY] = dataclasses.replace(node.meta[STEP_KEY], reads=keep)
            node.args = marker_args(node.target, node.meta[STEP_KEY])
        else:
            graph.erase_node(node)
    out = next(iter(graph.find_nodes(op="output")))
    for bucket in buckets:
        with graph.inserting_before(out):
            add_marker(graph, program_ops.finish_reduce,
                       Step(last, StreamKind.COMP, reads=(bucket_value(bucket.index),), bucket=bucket.index),
                       name=f"finish_bucket{bucket.index}")
    program_of(program).buckets = tuple(buckets)
    program.recompile()
    return program
