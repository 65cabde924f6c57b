"""One (model, mode) of ``bench hf --real`` with its last timed step under torch.profiler: where a
step's time goes on the GPU (per stream busy time, the emulated link's holds, launches, host syncs,
the top kernels) as one JSON line in ``OUT/profiles.jsonl`` and the row in ``OUT/rows.jsonl``.

    python -m fxoverlap.bench hf-timeline --model qwen3_moe --mode backend --out $OUT [--nolink] [--chunks K] [--deep]

``--nolink``: the emulated group holds nothing (``EmulatedGroup(None)``): the EP-8 rank's compute
only. ``--chunks K``: ``OverlapConfig(chunks=K)`` / the backend's ``options={"chunks": K}``.
``--deep``: also cProfile of one step (the main thread's Python; a CUDA backward runs on autograd's
device thread, which it does not see) in ``OUT/cprofile_<tag>.txt``, and the GPU's idle gaps and
host syncs charged to the CPU op that launched the next kernel, and each device copy's GPU time
charged to the op that issued it and, for the copies fxoverlap makes, to their reason
(``copies``: ``aten::copy_ [static-input]``, ``[graph-output]``, ...: ``fxoverlap.kernels.copy_labels``,
profiler ranges: on the GPU the Python frames did not attach to the copies), and again by the value
copied where the label names it (``copies_by_value``: ``static-input fwd_l0_post.combine``, a stage's
input; ``graph-output <value>``; ``graph-gradient <parameter>``). Issue 37's breakdown
(docs/benchmarks.md, 2026-12-04 tenth session) was measured with it.
"""
import argparse
import json
import os
import time

import torch

import fxoverlap.bench.hf_gpu as h
from fxoverlap.kernels import copy_labels

def analyse(prof) -> dict:
    evs = prof.profiler.kineto_results.events()
    kern = [(e.device_resource_id(), e.start_ns() / 1e3, e.end_ns() / 1e3, e.name()) for e in evs
            if e.device_type() == torch.autograd.DeviceType.CUDA]
    cpu = [e for e in evs if e.device_type() == torch.autograd.DeviceType.CPU]
    if not kern:
        return {}
    t0 = min(k[1] for k in kern)
    t1 = max(k[2] for k in kern)

    def union(iv):
        tot, cur_a, cur_b = 0.0, None, None
        for a, b in sorted(iv):
            if cur_b is None or a > cur_b:
                if cur_b is not None:
                    tot += cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        if cur_b is not None:
            tot += cur_b - cur_a
        return tot

    is_hold = lambda n: "spin" in n.lower() or "hold" in n.lower()
    by_stream: dict = {}
    for s, a, b, n in kern:
        by_stream.setdefault(s, []).append((a, b, n))
    streams = {}
    for s, lst in by_stream.items():
        holds = [x for x in lst if is_hold(x[2])]
        streams[str(s)] = dict(kernels=len(lst), busy_ms=round(union([(a, b) for a, b, _ in lst]) / 1e3, 3),
                               hold_ms=round(sum(b - a for a, b, _ in holds) / 1e3, 3), holds=len(holds))
    comp = [(a, b) for _, a, b, n in kern if not is_hold(n)]
    holds = [(a, b) for _, a, b, n in kern if is_hold(n)]
    sync_names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
                  "aten::item", "aten::_local_scalar_dense", "aten::tolist", "cudaStreamWaitEvent")
    syncs = {}
    for e in cpu:
        if e.name() in sync_names:
            r = syncs.setdefault(e.name(), [0, 0.0])
            r[0] += 1
            r[1] += e.duration_ns() / 1e6
    launches = sum(1 for e in cpu if e.name() in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                   "cuLaunchKernelEx", "cudaGraphLaunch"))
    top = {}
    for s, a, b, n in kern:
        r = top.setdefault(n[:90], [0, 0.0])
        r[0] += 1
        r[1] += (b - a) / 1e3
    top = sorted(top.items(), key=lambda kv: -kv[1][1])[:30]
    return dict(gpu_span_ms=round((t1 - t0) / 1e3, 3), gpu_busy_ms=round(union([(a, b) for _, a, b, _ in kern]) / 1e3, 3),
                compute_busy_ms=round(union(comp) / 1e3, 3), hold_union_ms=round(union(holds) / 1e3, 3),
                compute_kernel_sum_ms=round(sum(b - a for a, b in comp) / 1e3, 3), streams=streams,
                host_syncs={k: [c, round(t, 2)] for k, (c, t) in syncs.items()}, launches=launches,
                top_kernels=[[k, c, round(t, 3)] for k, (c, t) in top])



KEEP_OUT = ("torch/nn/modules/module.py", "torch/_ops.py", "torch/utils/_contextlib.py", "<built-in",
            "torch/_dynamo/eval_frame.py", "torch/autograd/function.py", "torch/_compile.py")


def enclosing(intervals, queries):
    """intervals: nested (start, end, label) of one thread; queries: (t, qid) -> {qid: [labels outer->inner]}."""
    intervals.sort(key=lambda x: (x[0], -x[1]))
    res, stack, i = {}, [], 0
    for t, qid in sorted(queries):
        while i < len(intervals) and intervals[i][0] <= t:
            iv = intervals[i]
            while stack and stack[-1][1] < iv[0]:
                stack.pop()
            stack.append(iv)
            i += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        res[qid] = [x[2] for x in stack]
    return res


def key_of(labels):
    """``op [reason] | frames``: the innermost op, the innermost :mod:`copy_labels` reason (a
    copy fxoverlap makes says why) and up to four Python frames, innermost first."""
    ops = [l for l in labels if "::" in l and "): " not in l]
    reasons = [p[0] for l in labels if (p := copy_labels.parse(l)) is not None]
    py = [l for l in labels if "(" in l and "): " in l and not any(k in l for k in KEEP_OUT)]
    op = (ops[-1] if ops else "-") + (f" [{reasons[-1]}]" if reasons else "")
    return op + " | " + " < ".join(reversed(py[-4:]))


def attribute(prof) -> dict:
    """The GPU's idle gaps, the host syncs and the device copies of a profiled step, each charged
    to the CPU op (and Python frames, with ``with_stack``) that launched it."""
    return attribute_events(prof.profiler.kineto_results.events())


def attribute_events(evs) -> dict:
    """:func:`attribute` on kineto events (``device_type``, ``name``, ``start_ns``, ``end_ns``,
    ``duration_ns``, ``correlation_id``, ``start_thread_id``)."""
    cpu = [e for e in evs if e.device_type() == torch.autograd.DeviceType.CPU]
    kern = sorted([e for e in evs if e.device_type() == torch.autograd.DeviceType.CUDA], key=lambda e: e.start_ns())
    launch = {}
    for e in cpu:
        if e.name().startswith("cu") and e.correlation_id():
            launch[e.correlation_id()] = e
    by_thread = {}
    for e in cpu:
        if e.name().startswith("cuda") or e.name().startswith("cu") and "Launch" in e.name():
            continue
        by_thread.setdefault(e.start_thread_id(), []).append((e.start_ns(), e.end_ns(), e.name()))
    queries = {}  # thread -> [(t, qid)]
    gaps, syncs = {}, {}
    busy_end = None
    for k in kern:
        if busy_end is not None and k.start_ns() - busy_end > 10_000:
            le = launch.get(k.correlation_id())
            if le is not None:
                qid = ("gap", len(gaps))
                gaps[qid] = (k.start_ns() - busy_end) / 1e6
                queries.setdefault(le.start_thread_id(), []).append((le.start_ns(), qid))
        busy_end = k.end_ns() if busy_end is None else max(busy_end, k.end_ns())
    copies = {}  # a device copy's GPU time, charged to what issued it (a clone off graph memory, a copy_ in)
    for k in kern:
        if k.name().startswith("Memcpy") and (le := launch.get(k.correlation_id())) is not None:
            qid = ("copy", len(copies))
            copies[qid] = (k.end_ns() - k.start_ns()) / 1e6
            queries.setdefault(le.start_thread_id(), []).append((le.start_ns(), qid))
    for e in cpu:
        if e.name() in ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaMemcpy", "cudaEventSynchronize",
                        "cudaDeviceSynchronize") and e.duration_ns() > 30_000:
            qid = ("sync", len(syncs))
            syncs[qid] = e.duration_ns() / 1e6
            queries.setdefault(e.start_thread_id(), []).append((e.start_ns(), qid))
    where = {}
    for th, qs in queries.items():
        where.update(enclosing(by_thread.get(th, []), qs))
    out = {}
    # the copies again, by what they copied where the label names it (``static-input fwd_l0_post.combine``)
    by_value: dict[str, list] = {}
    for qid, ms in copies.items():
        named = [p for l in where.get(qid, []) if (p := copy_labels.parse(l)) is not None and p[1]]
        if named:
            r = by_value.setdefault(" ".join(named[-1]), [0, 0.0])
            r[0] += 1
            r[1] += ms
    out["copies_by_value"] = [[k, c, round(t, 3)]
                              for k, (c, t) in sorted(by_value.items(), key=lambda kv: -kv[1][1])[:40]]
    for name, table in (("gaps", gaps), ("syncs", syncs), ("copies", copies)):
        agg = {}
        for qid, ms in table.items():
            r = agg.setdefault(key_of(where.get(qid, [])), [0, 0.0])
            r[0] += 1
            r[1] += ms
        out[name + "_total_ms"] = round(sum(table.values()), 3)
        out[name] = [[k, c, round(t, 3)] for k, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:30]]
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m fxoverlap.bench hf-timeline``: see the module docstring."""
    ap = argparse.ArgumentParser(prog="python -m fxoverlap.bench hf-timeline")
    ap.add_argument("--model", required=True, choices=sorted(h.REAL))
    ap.add_argument("--mode", required=True, choices=h.MODES_REAL)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--nolink", action="store_true", help="the emulated group holds nothing")
    ap.add_argument("--overlap-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an OverlapConfig field for an fxoverlap mode, e.g. cuda_graphs=0; repeatable")
    ap.add_argument("--gbps", type=float, default=h.GBPS, help="the emulated link's speed, GB/s (default %(default)g)")
    ap.add_argument("--chunks", type=int, help="OverlapConfig(chunks=K) / the backend's options={'chunks': K} "
                    "(not for torch.compile's modes); default: the config's (CUDA: 2)")
    ap.add_argument("--deep", action="store_true", help="cProfile of one step; idle gaps charged to ops")
    ap.add_argument("--stage-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an Inductor option for fxoverlap's stages (torch.compile's row keeps its defaults), "
                         "e.g. cpp_wrapper=1 (Inductor's C++ wrapper launches the kernels); repeatable")
    args = ap.parse_args(argv)
    if args.chunks is not None and (args.chunks < 1 or args.mode in h.COMPILE_MODES_REAL):
        ap.error(f"--chunks {args.chunks}: an int >= 1, for an fxoverlap mode (not {', '.join(h.COMPILE_MODES_REAL)})")
    os.makedirs(args.out, exist_ok=True)
    stage_options = h.parse_options(args.stage_option)
    overlap_options = h.parse_overlap_options(args.overlap_option)
    tag = (f"{args.model}_{args.mode}{'' if args.chunks is None else f'_c{args.chunks}'}"
           f"{'_nolink' if args.nolink else '' if args.gbps == h.GBPS else f'_{args.gbps:g}GBps'}"
           + "".join(f"_{k}" for k, v in stage_options.items() if v)
           + "".join(f"_{kv.replace('=', '')}" for kv in args.overlap_option))
    timed = h._timed

    def timed_with_profile(fn, iters):
        first, times, last = timed(fn, iters)
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile
        if args.deep:
            import cProfile
            import io
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            fn()
            torch.cuda.synchronize()
            pr.disable()
            buf = io.StringIO()
            st = pstats.Stats(pr, stream=buf)
            st.sort_stats("tottime").print_stats(40)
            st.sort_stats("cumulative").print_stats(60)
            with open(os.path.join(args.out, f"cprofile_{tag}.txt"), "w") as f:
                f.write(buf.getvalue())
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.deep) as prof:
            t0 = time.perf_counter()
            last = fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        res = analyse(prof)
        if args.deep:
            res.update(attribute(prof))
        res["profiled_wall_ms"], res["tag"] = wall, tag
        with open(os.path.join(args.out, "profiles.jsonl"), "a") as f:
            f.write(json.dumps(res) + "\n")
        print("PROFILE " + json.dumps({k: v for k, v in res.items() if k != "top_kernels"}), flush=True)
        return first, times, last

    row = h.run_real_one(args.model, args.mode, args.iters, stage_options, chunks=args.chunks,
                         link=not args.nolink, timed=timed_with_profile, gbps=args.gbps,
                         overlap_options=overlap_options)
    row["tag"] = tag
    print("RESULT " + json.dumps(row), flush=True)
    with open(os.path.join(args.out, "rows.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    os._exit(0)  # no teardown hang of NCCL/compile workers after the result is out
