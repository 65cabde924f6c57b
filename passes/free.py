"""free: drop each per-microbatch value from the value store right after its last use.

Contract
--------
Assumes: ``schedule`` ran (every stage call and sink carries a ``Step``); usually
``streams`` too. Of the runtime (``fxoverlap.runtime.ProgramRunner``):

- a node reads only its own microbatch's store; parameters and buffers
  (``capture.static_placeholders``) are shared by all microbatches and never freed;
- a free only drops the store's reference. On GPU, a tensor that a stage on the
  other stream reads had ``Tensor.record_stream`` called for that stream before the
  read was issued, so the caching allocator does not hand its block out again
  until the consumer's work is done.

Guarantees: ``program_ops.free(mb, *names)`` nodes, one per node that is the last
use of something, named ``free_<node>``. Every per-microbatch value (stage
outputs, the microbatch's inputs and tangents) is freed exactly once per
definition (a recompute stage may produce a forward value's name again):

- at its last read by a node of the same microbatch (a stage call, or an
  ``output`` / ``accumulate`` / ``mutate`` sink), in program order; a value nothing
  reads right after the node that produces it;
- an input nothing reads, right before the microbatch's first node;
- after the reader's node and the event recorded on its stream right after it,
  never earlier, so a value read across streams is freed after that reader.

So the saved activations of microbatch i are gone once B(i) has used them, and
once the program has run, every store holds only parameters and buffers.

Values a CUDA graph wrote (the outputs of a stage with ``stage.graphed``) are freed
like any other. In the step that captures the graphs they are the tensors the capture
made, in the graph's memory pool: freeing them returns their blocks to that pool, and
the copy's later captures reuse them, so the pool follows the program's liveness
(``fxoverlap.cudagraphs``, "Memory pools"). At replay they are aliases that own
nothing, and freeing them releases nothing. Our frees never resize or release a
storage (``untyped_storage().resize_(0)``), so a free cannot pull memory out from
under a graph. Megatron-LM had to revert a change that resized storage owned by a
CUDA graph; this pass keeps that from happening here by construction.

Steps
-----
1. Walk the nodes in order; per (microbatch, value) keep the anchor of its current
   definition: its last reader so far, else its producer, else "before the
   microbatch's first node" (inputs, tangents). A value defined again first closes
   its previous definition.
2. Insert one free per anchor: after the anchor node and the event recorded on its
   stream right after it, or before the microbatch's first node.

Entry point: ``free(program, capture) -> GraphModule``; assumes ``streams``
ran (it works without it too). Running it twice is a no-op the second time.
"""

from __future__ import annotations

import torch.fx

from fxoverlap.ir.capture import Capture
from fxoverlap.ir.program import free as free_op
from fxoverlap.ir.program import record_event, steps
from fxoverlap.ir.errors import InternalError


def free(program: torch.fx.GraphModule, capture: Capture) -> torch.fx.GraphModule:
    graph = program.graph
    if any(n.op == "call_function" and n.target is free_op for n in graph.nodes):
        return program  # already rewritten
    nodes = steps(program)
    if not nodes:
        return program
    static = capture.static_placeholders
    per_mb_inputs = [*capture.input_placeholders, *capture.tangents]

    # Walk the nodes; per (microbatch, value) keep the anchor of its current
    # definition: its last reader so far, else its producer (None: in the store
    # from the start). A value produced again (a recompute stage replaying a forward
    # value) first gets the free of its previous definition.
    anchor: dict[tuple[int, str], torch.fx.Node | None] = {}
    first_node: dict[int, torch.fx.Node] = {}
    to_free: dict[tuple[int, torch.fx.Node | None], list[str]] = {}

    def close(mb: int, v: str) -> None:
        to_free.setdefault((mb, anchor.pop((mb, v))), []).append(v)

    def define(mb: int, v: str, at: torch.fx.Node | None) -> None:
        if (mb, v) in anchor:
            close(mb, v)
        anchor[(mb, v)] = at

    for n, step in nodes:
        mb = step.microbatch
        if mb not in first_node:
            first_node[mb] = n
            for v in per_mb_inputs:
                define(mb, v, None)
        for v in step.reads:
            if v in static:
                continue
            if (mb, v) not in anchor:
                raise InternalError(
                    f"free: program node {n.name} reads {v} of microbatch {mb}, which is neither a "
                    f"parameter, buffer, input, tangent nor the output of an earlier stage call"
                )
            anchor[(mb, v)] = n
        for v in step.writes:
            define(mb, v, n)
    for mb, v in list(anchor):
        close(mb, v)

    stream_of = {n: s.stream.value for n, s in nodes}
    for (mb, after), names in to_free.items():
        if after is None:
            with graph.inserting_before(first_node[mb]):
                graph.create_node("call_function", free_op, (mb, *names), name=f"free_inputs{mb}")
            continue
        # After the node and the event recorded on its stream right after it.
        at = after
        while (
            at.next.op == "call_function"
            and at.next.target is record_event
            and at.next.args[1] == stream_of[after]
        ):
            at = at.next
        with graph.inserting_after(at):
            graph.create_node("call_function", free_op, (mb, *names), name=f"free_{after.name}")
    program.recompile()
    return program
