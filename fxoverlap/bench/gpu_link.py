"""GPU check of the emulated link's hold kernel (fxoverlap/kernels/emulated_link.py).

    python -m fxoverlap.bench link [--out FILE.jsonl]

1. ``spin(t)`` alone on a stream lasts t (CUDA events), for t from 20 us to 20 ms.
2. A GEMM loop on one stream, alone and with holds running on a second stream: the holds'
   own time, and what they cost the GEMMs (a comm kernel's resident blocks take SM slots).
3. ``fxoverlap::dispatch`` over an ``EmulatedGroup`` holds its stream for ``Link.seconds(bytes)``.
Prints one ``EMUCHECK {json}`` line per check.
"""

from __future__ import annotations

import argparse
import json

import torch

from fxoverlap import ops
from fxoverlap.kernels import emulated_link as el


def timed(fn, stream=None) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rows = []

    def emit(rec):
        rows.append(rec)
        print("EMUCHECK " + json.dumps(rec), flush=True)

    el.spin(1e-4, dev)  # compile
    torch.cuda.synchronize()
    for t in (20e-6, 100e-6, 1e-3, 5e-3, 20e-3):
        ms = sorted(timed(lambda: el.spin(t, dev)) for _ in range(5))[2]
        emit({"check": "spin_alone", "want_ms": t * 1e3, "got_ms": ms, "ok": abs(ms - t * 1e3) <= 0.05 + 0.02 * t * 1e3})

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    comp, comm = torch.cuda.Stream(), torch.cuda.Stream()

    def gemms():
        for _ in range(20):
            a @ b

    gemms()
    alone = sorted(timed(gemms, comp) for _ in range(3))[1]
    for kind in ("spin", "cuda_sleep"):
        torch.cuda.synchronize()
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(comm):
            c0.record()
            for _ in range(10):
                if kind == "spin":
                    el.spin(alone / 1e3 / 10, dev)
                else:
                    torch.cuda._sleep(int(alone * 1e6 / 10))  # cycles ~ ns at ~1-2 GHz: rough
            c1.record()
        with torch.cuda.stream(comp):
            s0.record()
            gemms()
            s1.record()
        torch.cuda.synchronize()
        emit({"check": "gemm_with_holds", "kind": kind, "gemm_alone_ms": alone, "gemm_with_ms": s0.elapsed_time(s1),
              "hold_ms": c0.elapsed_time(c1), "gemm_slowdown": s0.elapsed_time(s1) / alone})

    x = torch.randn(32768, 4096, device=dev, dtype=torch.bfloat16)
    counts = torch.full((4,), 32768 // 4, device=dev, dtype=torch.long)
    link = el.preset("nvlink", ep=8)
    group = el.EmulatedGroup(link)  # the dispatch reaches it through its group argument
    with group.using(None):
        ops.dispatch(x, counts, group)
        plain = sorted(timed(lambda: ops.dispatch(x, counts, group)) for _ in range(5))[2]
    held = sorted(timed(lambda: ops.dispatch(x, counts, group)) for _ in range(5))[2]
    want = link.seconds(x.numel() * x.element_size()) * 1e3
    emit({"check": "dispatch_hold", "plain_ms": plain, "held_ms": held, "link_ms": want,
          "ok": abs(held - plain - want) <= 0.05 + 0.05 * want})
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
