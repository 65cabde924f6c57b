"""Emulated data parallelism on one process (``EmulatedDPGroup`` as ``dp_group``): ZeRO-3's
shards are 1/M of each parameter, and every DP collective holds its stream for its bytes
(``bench dp --emulate-dp M``, fxoverlap/bench/gpu_dp_emulated.py, on CPU with a counting
stand-in for the holds)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from fxoverlap.passes.reduce import ALIGN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# runs in a child: a world of one rank of its own (gloo on a HashStore), the holds counted
CHILD = r"""
import json, sys, torch
from fxoverlap.bench import gpu_dp, gpu_dp_emulated
from fxoverlap.ir.program import program_of, unshard
from fxoverlap.kernels import emulated_link as el
from fxoverlap.param_shard import shard_bytes

args = gpu_dp.parse_args(sys.argv[2:])
out = {}

def inspect(engine, model, dp_group, link):
    prog = engine.program
    ir = program_of(prog)
    info = {"link_s": {}, "params": {}}
    if engine.sharding is not None:
        units = engine.sharding.units
        # the gathered buffer: M shards, each padded to ALIGN elements (passes/shard.py)
        info["unshard_bytes"] = [shard_bytes(units[n.args[0]]) * units[n.args[0]].ranks
                                 for n in prog.graph.nodes if n.target is unshard]
        info["unshard_param_bytes"] = [units[n.args[0]].nbytes for n in prog.graph.nodes if n.target is unshard]
        info["unit_bytes"] = sorted({u.nbytes for u in units})
        named = dict(model.named_parameters(remove_duplicate=False))
        info["params"] = {fqn: [list(named[fqn].shape), list(shape), type(named[fqn]).__name__]
                          for fqn, shape in engine.sharding.program_shapes.items()}
    info["buckets"] = [[b.role, b.numel, b.padded_numel(args.emulate_dp), b.dtype.itemsize] for b in ir.buckets]
    info["link"] = [link.latency_us, link.gbps, link.ep]
    out["inspect"] = info

counter = el.Counter()
with el.standin(counter):
    row = gpu_dp_emulated.measure(args, sys.argv[1], torch.device("cpu"), inspect)
out["row"] = row
out["calls"] = counter.calls
print("RESULT " + json.dumps(out, default=str))
"""

M, N = 4, 2
FLAGS = ["--emulate-dp", str(M), "--emulate-ep", str(N), "--dp-link", "10", "--device", "cpu", "--shape", "tiny",
         "--warmup", "0", "--iters", "1", "--microbatches", "2", "--one-process", "--out", "unused"]


@functools.lru_cache(maxsize=None)
def _run(mode: str, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, *FLAGS, *extra], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _seconds(link: list, nbytes: int) -> float:
    latency_us, gbps, m = link
    return latency_us * 1e-6 + nbytes * (m - 1) / m / (gbps * 1e9)


@pytest.mark.slow  # a benchmark run on CPU (the slow step runs it)
def test_zero3_emulated_shards_are_one_mth_and_every_unshard_holds_for_its_bytes():
    out = _run("zero3")
    row, info = out["row"], out["inspect"]
    # each sharded parameter a plain tensor of 1/M of its first dimension; the experts whole (M_e = M / N... = 1)
    assert info["params"], info
    for fqn, (shape, full, kind) in info["params"].items():
        assert kind == "Parameter" and shape[0] * M == full[0] and shape[1:] == full[1:], (fqn, shape, full, kind)
        assert ".moe.experts." not in fqn
    assert row["shard_rows_ok"] and row["M_e"] == 1
    assert row["held_bytes"] == row["held_expected"] == row["P_d"] // M + row["P_e"]
    # the holds of one step with the link on (the "on" and "no EP link" settings: one step each)
    dp = [c for c in out["calls"] if c[0] in ("all_gather", "reduce_scatter")]
    gathers = [c for c in dp if c[0] == "all_gather"]
    per_step = info["unshard_bytes"]
    assert row["unshards_per_step"] == len(per_step) > 0
    assert sorted(c[1] for c in gathers) == sorted(per_step * 2)  # each unshard: its unit's full buffer
    for buffer, params in zip(per_step, info["unshard_param_bytes"]):  # = its parameters' bytes, but the padding
        assert params <= buffer < params + M * len(info["params"]) * ALIGN * 4, (buffer, params)
    for op, nbytes, seconds in dp:
        # the hold: latency + (M - 1) / M of the full bytes over the bandwidth
        assert seconds == pytest.approx(_seconds(info["link"], nbytes)), (op, nbytes, seconds)
    dense = [b for b in info["buckets"] if b[0] == "dense"]
    rs = sorted(c[1] for c in dp if c[0] == "reduce_scatter")
    assert rs == sorted([numel * size for _, numel, _, size in dense] * 2)  # the full buckets, unpadded
    assert row["dp_by_op"]["all_gather"]["calls"] == len(per_step)
    assert row["dp_by_op"]["all_gather"]["bytes"] == sum(per_step)
    assert row["dp_hold_ms"] == pytest.approx(1e3 * sum(_seconds(info["link"], b) for b in per_step + rs[:len(rs) // 2]))
    assert row["ep_hold_ms"] > 0 and row["gathered_peak_bytes"] >= max(info["unit_bytes"])
    # the floor: the timed step's first all-gather (the program's first unshard) and last reduce-scatter
    rs_calls = [c for c in dp if c[0] == "reduce_scatter"]
    assert gathers[0][1] == per_step[0]
    assert row["dp_floor_ms"] == pytest.approx(1e3 * (gathers[0][2] + rs_calls[len(rs_calls) // 2 - 1][2]))
    assert row["dp_hidden_bound"] == pytest.approx(1 - row["dp_floor_ms"] / row["dp_hold_ms"])


@pytest.mark.slow  # a benchmark run on CPU (the slow step runs it)
def test_more_layers_raise_the_bound_on_dp_hidden():
    """``--layers`` overrides the shape's layer count: more units between the step's first gather and
    last reduce-scatter, so more of the DP link can hide (the floor is the embedding's gather and the
    last gradient bucket's reduce-scatter, which takes up to 25 MiB of gradients whatever the depth)."""
    base, more = _run("zero3")["row"], _run("zero3", "--layers", "4")["row"]
    assert (base["layers"], more["layers"]) == (2, 4)
    assert more["dp_hold_ms"] > base["dp_hold_ms"] and more["dp_hidden_bound"] > base["dp_hidden_bound"]


@pytest.mark.slow  # a benchmark run on CPU (the slow step runs it)
def test_zero2_emulated_reduce_scatters_hold_for_the_padded_buckets():
    out = _run("zero2")
    row, info = out["row"], out["inspect"]
    assert row["held_bytes"] == row["P_d"] + row["P_e"]  # ZeRO-2 holds every parameter
    dense = [b for b in info["buckets"] if b[0] == "dense"]
    rs = [c for c in out["calls"] if c[0] == "reduce_scatter"]
    # two steps with the link on (the "on" and "no EP link" settings), then gather_parameters
    assert sorted(c[1] for c in rs) == sorted([padded * size for _, _, padded, size in dense] * 2)
    assert [c[0] for c in out["calls"] if c[0] == "all_gather"] == ["all_gather"] * len(dense)
    assert "all_reduce" not in {c[0] for c in out["calls"]}
    assert row["gather_parameters_ms"] >= 0
