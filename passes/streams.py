"""streams: add events on the program's cross-stream edges.

Contract
--------
Assumes: ``schedule`` ran (every stage call and sink carries a ``Step`` with its
stream, reads and writes).

Guarantees: every node's ``Step.cross`` names the reads written on the other stream
(inputs, parameters and buffers count as the compute stream's), which the runtime
keeps alive for that stream. For every edge from a node on one stream to a node of the same
microbatch on the other that reads what it wrote, the producer records an event
right after it and the consumer waits on it right before it; nothing else is
added. A wait is left out when the consumer's stream already waited on a later
event of the same producer stream (stream order makes it redundant). The program
starts with the comm stream waiting for the compute stream (inputs and
parameters were written there) and ends with the compute stream waiting for the
comm stream; a program with nothing on the comm stream gets no event at all. Which
stream a node runs on is the Step's, decided by ``split``.

Steps
-----
1. Record ``start`` on the compute stream before the first node; the first comm
   node waits on it (without comm nodes, ``start`` is dropped at the end).
2. Walk the nodes in order, keeping the producer of each (microbatch, value); for a
   node with producers on the other stream, take the latest: unless its stream
   already waited on that producer or a later one of that stream, record an event
   after the producer (once per producer) and wait on it before the node.
3. With any comm node, record ``end`` on the comm stream and wait on it on the
   compute stream before the output.

Entry point: ``streams(program) -> GraphModule``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from fxoverlap.ir.meta import STEP_KEY
from fxoverlap.ir.program import record_event, steps, wait_event
from fxoverlap.ir.stage import StreamKind

COMP, COMM = StreamKind.COMP.value, StreamKind.COMM.value


def streams(program: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = program.graph
    nodes = steps(program)
    if not nodes:
        return program
    position = {n: i for i, (n, _) in enumerate(nodes)}
    stream_of = {n: s.stream.value for n, s in nodes}
    with graph.inserting_before(nodes[0][0]):
        start = graph.call_function(record_event, ("start", COMP))
    start_waited = False
    producer: dict[tuple[int, str], torch.fx.Node] = {}
    recorded: dict[torch.fx.Node, str] = {}
    # latest producer position each stream has waited on
    waited: dict[str, int] = {COMP: -1, COMM: -1}
    for n, step in nodes:
        stream = stream_of[n]
        if stream == COMM and not start_waited:
            with graph.inserting_before(n):
                graph.call_function(wait_event, ("start", COMM))
            start_waited = True
        # reads written on the other stream (inputs and parameters: the compute stream's), for the runtime
        cross_reads = tuple(i for i, v in enumerate(step.reads)
                            if (stream_of[producer[(step.microbatch, v)]] if (step.microbatch, v) in producer
                                else COMP) != stream)
        if cross_reads:
            n.meta[STEP_KEY] = dataclasses.replace(step, cross=cross_reads)
        deps = {producer[(step.microbatch, v)] for v in step.reads if (step.microbatch, v) in producer}
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
        for v in step.writes:
            producer[(step.microbatch, v)] = n
    if start_waited:
        out = next(iter(graph.find_nodes(op="output")))
        with graph.inserting_before(out):
            graph.call_function(record_event, ("end", COMM))
            graph.call_function(wait_event, ("end", COMP))
    else:  # nothing runs on the comm stream: no stream waits on start
        graph.erase_node(start)
    program.recompile()
    return program
