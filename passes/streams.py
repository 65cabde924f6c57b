"""streams: put each stage call on its stream and add events on cross-stream edges.

Comm stages (dispatch, combine) run on the comm stream, everything else on the
compute stream. For every edge from a stage call on one stream to a stage call
of the same microbatch on the other, the producer records an event right after
it and the consumer waits on it right before it; nothing else is added. A wait
is left out when the consumer's stream already waited on a later event of the
same producer stream (stream order makes it redundant). The program starts with
the comm stream waiting for the compute stream (inputs and parameters were
written there) and ends with the compute stream waiting for the comm stream.

Entry point: ``streams(program, stages) -> GraphModule``; assumes ``schedule`` ran.
"""

from __future__ import annotations

import torch
import torch.fx

from fxoverlap.program_ops import record_event, wait_event
from fxoverlap.stage import Stage, StreamKind

COMP, COMM = StreamKind.COMP.value, StreamKind.COMM.value


def streams(program: torch.fx.GraphModule, stages: list[Stage]) -> torch.fx.GraphModule:
    by_name = {s.name: s for s in stages}
    graph = program.graph
    calls = [n for n in graph.nodes if n.op == "call_module"]
    if not calls:
        return program
    position = {n: i for i, n in enumerate(calls)}
    stream_of = {n: by_name[n.meta["stage"]].stream.value for n in calls}
    for n in calls:
        n.kwargs = {**n.kwargs, "stream": stream_of[n]}

    with graph.inserting_before(calls[0]):
        graph.call_function(record_event, ("start", COMP))
    start_waited = False

    producer: dict[tuple[int, str], torch.fx.Node] = {}
    recorded: dict[torch.fx.Node, str] = {}
    # latest producer position each stream has waited on, per other stream
    waited: dict[str, int] = {COMP: -1, COMM: -1}
    for n in calls:
        stage, mb, stream = by_name[n.meta["stage"]], n.meta["microbatch"], stream_of[n]
        if stream == COMM and not start_waited:
            with graph.inserting_before(n):
                graph.call_function(wait_event, ("start", COMM))
            start_waited = True
        deps = {producer[(mb, v)] for v in stage.inputs if (mb, v) in producer}
        cross = sorted((p for p in deps if stream_of[p] != stream), key=position.get)
        if cross:
            latest = cross[-1]  # waiting on the latest implies the earlier ones (same stream)
            if position[latest] > waited[stream]:
                if latest not in recorded:
                    recorded[latest] = f"ev_{latest.name}"
                    with graph.inserting_after(latest):
                        graph.call_function(record_event, (recorded[latest], stream_of[latest]))
                with graph.inserting_before(n):
                    graph.call_function(wait_event, (recorded[latest], stream))
                waited[stream] = position[latest]
        for v in stage.outputs:
            producer[(mb, v)] = n
    if start_waited:
        out = next(iter(graph.find_nodes(op="output")))
        with graph.inserting_before(out):
            graph.call_function(record_event, ("end", COMM))
            graph.call_function(wait_event, ("end", COMP))
    program.recompile()
    return program
