"""free: drop each per-microbatch value from the value store right after its last use.

Rewrites the program (after ``schedule`` and ``streams``) by inserting
``program_ops.free(mb, *names)`` call_function nodes, one per stage call that is
the last use of something, named ``free_<stage call>``. Every per-microbatch value
is freed exactly once (once per definition, where a later stage produces the same
name again, as a recompute stage replaying a forward value would):

- stage outputs (activations, saved activations, incoming gradients, parameter
  gradients, the loss), the microbatch's inputs (``capture.input_placeholders``)
  and the loss tangent (``capture.tangent_placeholder``);
- at its last read by a stage call of the same microbatch, in program order; a
  value no stage reads (parameter gradients, the loss) right after the stage call
  that produces it;
- an input no stage reads, right before the microbatch's first stage call.

So the saved activations of microbatch i are gone once B(i) has used them, and
once the program has run, every store holds only parameters and buffers.

Assumes, of the runtime (``fxoverlap.runtime.ProgramRunner``):

- a stage call reads only its own microbatch's store; parameters and buffers
  (``capture.param_placeholders`` / ``buffer_placeholders``) are shared by all
  microbatches and are never freed;
- right after the stage call that produces them, still inside that program node,
  the runtime accumulates parameter gradients (``capture.output_names[1:]``) into
  ``p.grad``, copies out the loss and seeds the tangent from it; so a free placed
  after that node never loses a gradient or a loss;
- a free only drops the store's reference. On GPU, a tensor that a stage on the
  other stream reads had ``Tensor.record_stream`` called for that stream before the
  read was issued, so the caching allocator does not hand its block out again
  until the consumer's work is done. The free of a value whose last reader runs on
  another stream than its producer comes after that reader's stage call and after
  the event record that follows the call on the reader's stream, never earlier.

Memory a CUDA graph owns (its static outputs, overwritten at replay) is never freed
by hand: a stage may carry ``cudagraph_owned_outputs`` (a set of output names);
those values are left to the graph's owner and stay in the store until the
runtime drops the stores at the end of the run.

Entry point: ``free(program, stages, capture) -> GraphModule``; assumes ``streams``
ran (it works without it too). Running it twice is a no-op the second time.
"""

from __future__ import annotations

import torch.fx

from fxoverlap.passes.capture import Capture
from fxoverlap.program_ops import free as free_op
from fxoverlap.program_ops import record_event
from fxoverlap.stage import Stage


def free(program: torch.fx.GraphModule, stages: list[Stage], capture: Capture) -> torch.fx.GraphModule:
    graph = program.graph
    if any(n.op == "call_function" and n.target is free_op for n in graph.nodes):
        return program  # already rewritten
    calls = [n for n in graph.nodes if n.op == "call_module" and "stage" in n.meta]
    if not calls:
        return program
    by_name = {s.name: s for s in stages}
    static = set(capture.param_placeholders) | set(capture.buffer_placeholders)
    loss, tangent = capture.loss_name, capture.tangent_placeholder

    # Walk the calls; per (microbatch, value) keep the anchor of its current
    # definition: its last reader so far, else its producer (None: in the store
    # from the start). A value produced again (a recompute stage replaying a forward
    # value) first gets the free of its previous definition.
    anchor: dict[tuple[int, str], torch.fx.Node | None] = {}
    owned: set[tuple[int, str]] = set()
    first_call: dict[int, torch.fx.Node] = {}
    to_free: dict[tuple[int, torch.fx.Node | None], list[str]] = {}

    def close(mb: int, v: str) -> None:
        at = anchor.pop((mb, v))
        if (mb, v) in owned:
            owned.discard((mb, v))  # a CUDA graph's memory: its owner releases it
        else:
            to_free.setdefault((mb, at), []).append(v)

    def define(mb: int, v: str, at: torch.fx.Node | None, graph_owned: bool = False) -> None:
        if (mb, v) in anchor:
            close(mb, v)
        anchor[(mb, v)] = at
        if graph_owned:
            owned.add((mb, v))

    for n in calls:
        stage, mb = by_name[n.meta["stage"]], n.meta["microbatch"]
        if mb not in first_call:
            first_call[mb] = n
            for v in capture.input_placeholders:
                define(mb, v, None)
        for v in stage.inputs:
            if v in static:
                continue
            if (mb, v) not in anchor:
                raise AssertionError(
                    f"free: stage call {n.name} reads {v} of microbatch {mb}, which is neither a "
                    f"parameter, buffer, input, tangent nor the output of an earlier stage call"
                )
            anchor[(mb, v)] = n
        graph_owned = getattr(stage, "cudagraph_owned_outputs", None) or ()
        for v in stage.outputs:
            define(mb, v, n, v in graph_owned)
            if v == loss and tangent is not None:
                define(mb, tangent, n)  # seeded by the runtime right after this call
    for mb, v in list(anchor):
        close(mb, v)

    stream_of = lambda n: n.kwargs.get("stream")  # noqa: E731
    for (mb, after), names in to_free.items():
        if after is None:
            with graph.inserting_before(first_call[mb]):
                graph.create_node("call_function", free_op, (mb, *names), name=f"free_inputs{mb}")
            continue
        # After the call and the event recorded on its stream right after it.
        at = after
        while (
            at.next.op == "call_function"
            and at.next.target is record_event
            and at.next.args[1] == stream_of(after)
        ):
            at = at.next
        with graph.inserting_after(at):
            graph.create_node("call_function", free_op, (mb, *names), name=f"free_{after.name}")
    program.recompile()
    return program
