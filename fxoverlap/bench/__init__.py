"""Benchmark: fxoverlap's interleaved program against eager sequential, on one model.

Run one process per rank; the expert-parallel group is the whole world::

    torchrun --nproc-per-node 2 -m fxoverlap.bench                      # GPU, the peer's shape
    torchrun --nproc-per-node 2 -m fxoverlap.bench --tiny --device cpu  # CPU, gloo, tiny shape

Builds ``MoETransformer(MoEConfig.benchmark())`` (the shape of the Megatron-Core
peer measurement, docs/benchmarks.md; other shapes by flags), then in one run, on
the same weights and microbatches, the modes ``--modes`` names (default all):

* **eager**: ``for mb in microbatches: model(*mb).backward()``
* **compile**: the same loop through ``torch.compile(model)`` (Inductor, no overlap): the
  strongest no-overlap alternative a user has, and the baseline to beat
* **backend**: the same loop through ``torch.compile(model, backend="fxoverlap")``
* **fxoverlap**: ``fxoverlap.optimize(model, group).forward_backward(microbatches)``

Forward-only modes (``--modes fwd_eager,fwd_compile,fwd_backend,fwd_fxoverlap``, under
``torch.no_grad()``; ``fwd_fxoverlap`` is ``engine.forward_only(microbatches)``, microbatches in
pairs; ``fwd_fxoverlap_each`` is ``engine(*mb)`` per microbatch, each cut into chunks) are not in
the default.

**Emulated EP** (``--emulate-ep N --link {nvlink,p2p_off,ib400,none}`` or ``--link-gbps X
--link-latency-us Y``, ``--skew S``; one process, no torchrun needed): the model is one
EP-N rank's (E/N experts, same top-k, or routing over E folded onto them,
``MoEConfig.expert_fold``), built and optimized on an ``EmulatedGroup`` (a one-rank process
group stand-in, injected as the EP group would be), over which every fxoverlap dispatch/combine
holds its stream as the link would (:mod:`fxoverlap.kernels.emulated_link`), in every mode
(eager and ``torch.compile`` included). Each mode is then timed without the
link (``T_compute_ms``) and with it (``T_step_ms``, and ``T_comm_ms``: the holds asked for
per step); ``hidden_share`` = (T_compute + T_comm - T_step) / min(T_compute, T_comm). Every
such figure is marked emulated in the JSON and the printed table.

Each mode: warm-up, then the median of ``--iters`` steps timed with CUDA events
(wall clock on CPU); the step time is the slowest rank's median. Gradients are
zeroed (set to None) before every step; peak memory
(``torch.cuda.max_memory_allocated``) is reset after the warm-up of each mode.

``T_serial`` and ``T_bound`` (docs/benchmarks.md, "What is measured") come from the
same program (``engine.plan(microbatches)``) run by a
:class:`~fxoverlap.runtime.ProgramRunner` whose hook runs each stage alone
(synchronised): ``T_serial`` = sum of all stage times; ``T_bound`` = for each
merged-step slot (``Step.slot``) max(sum of compute-stream stage times, sum of
comm-stream stage times), plus every stage time outside the slots. Stage times are combined
over ranks: a compute stage counts with its slowest rank (the others wait for it
at the next all-to-all), a comm stage with its fastest rank (the all-to-all's
time on the other ranks includes waiting for the last rank to arrive), so the
sums describe one lockstep serial step of the whole group. Per-rank sums are in
the JSON as well. A first stage-timed run is not counted (warm-up); each stage's
time is its median over ``--stage-reps`` runs. Overlap efficiency =
(T_serial - T_fx) / (T_serial - T_bound). ``--no-stage-timing`` skips this, the
timeline and the trace.

Numerics: the per-microbatch losses of both modes, and fxoverlap's gradients
against eager's (max abs difference, bitwise or not) beside eager's own
run-to-run difference (a second eager step on the same data).

One more fxoverlap step is run with CUDA events around every stage call (the
timeline): ``timeline_stats`` in the JSON gives, per rank, how busy each stream
was and how much of the comm stream's time ran under compute, and per
(direction, kind) the stages' time inside the interleaved step against their
time alone, i.e. what running side by side costs each of them.

Writes under ``--out`` (default ``bench_out/``): ``<name>.json`` with every
number, ``<name>_trace.json.gz`` (a ``torch.profiler`` Chrome trace of one
fxoverlap step on rank 0, stages labelled by ``record_function``) and
``<name>_timeline.png`` (which stage ran when on the compute and comm stream of
every rank during one fxoverlap step, from CUDA events around each stage;
needs matplotlib, skipped with a message without it).

The package, one concern per module:

* :mod:`~fxoverlap.bench.metrics`: the arithmetic (``program_calls``,
  ``serial_and_bound``, ``combine_rank_times``, ``overlap_efficiency``,
  ``timeline_stats``, interval maths): pure functions, unit-tested;
* :mod:`~fxoverlap.bench.probe`: the runner hooks (``StageTimer``, ``TimelineProbe``);
* :mod:`~fxoverlap.bench.plot`: the timeline PNG; :mod:`~fxoverlap.bench.report`: the text summary;
* :mod:`~fxoverlap.bench.cli`: the flags (``parse_args``, ``parse_overlap_config``,
  ``routing_fields``, ``model_config``);
* :mod:`~fxoverlap.bench.run`: :class:`Bench` (one run), process-group setup and ``main``;
* :mod:`~fxoverlap.bench.commands`: ``python -m fxoverlap.bench [SUBCOMMAND]``, every other GPU
  measurement and check as a subcommand (``run``, the above, is the default);
  :mod:`~fxoverlap.bench.rows` runs one process per row within a time budget (``rows``,
  ``emulated``, ``slots``, ``one``, ``peer``).

Nothing in the library imports this package.
"""

from fxoverlap.bench.cli import (
    ALL_MODES,
    FORWARD_MODES,
    MODES,
    emulated_config,
    model_config,
    parse_args,
    parse_link,
    parse_overlap_config,
    routing_fields,
)
from fxoverlap.bench.metrics import (
    ProgramCall,
    combine_rank_times,
    overlap_efficiency,
    program_calls,
    serial_and_bound,
    timeline_stats,
)
from fxoverlap.bench.run import Bench, main

__all__ = [
    "ALL_MODES", "FORWARD_MODES", "MODES", "Bench", "emulated_config", "parse_link", "ProgramCall", "combine_rank_times", "main", "model_config", "overlap_efficiency",
    "parse_args", "parse_overlap_config", "program_calls", "routing_fields", "serial_and_bound", "timeline_stats",
]
