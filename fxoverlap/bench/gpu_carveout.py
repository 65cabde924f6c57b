"""How much the compute kernels of the peer's shape slow down beside the emulated link's hold
kernel, and whether torch's SM carveout (``OverlapConfig.sm_carveout``) changes it.

For each kernel (the attention projections' GEMMs, the experts' grouped GEMMs, causal SDPA),
each BLAS backend (cuBLAS, cuBLASLt) and each carveout: the kernel's time alone, and beside a
train of 2 ms holds on a high-priority stream (the comm stream's), with how long the holds took
(a hold whose blocks wait for SMs ends late: the link's time grows). One H200, bf16. Prints one
JSON line per row.

    python -m fxoverlap.bench carveout [--carveouts none,8,16,24] > probe.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from fxoverlap.kernels import emulated_link
from fxoverlap.runtime import sm_carveout

DEV = torch.device("cuda")
REPS = 20
HOLD_S = 2e-3


def kernels() -> dict:
    bf = dict(device=DEV, dtype=torch.bfloat16)
    x = torch.randn(4096, 4096, **bf)
    w = torch.randn(4096, 4096, **bf)
    w3 = torch.randn(4096, 3 * 4096, **bf)
    rows = torch.randn(32768, 4096, **bf)  # T*k rows of one EP-8 rank, 4 local experts
    w1 = torch.randn(4, 4096, 1024, **bf)
    h = torch.randn(32768, 1024, **bf)
    w2 = torch.randn(4, 1024, 4096, **bf)
    offs = torch.arange(1, 5, device=DEV, dtype=torch.int32) * 8192
    q, k, v = (torch.randn(1, 32, 4096, 128, **bf) for _ in range(3))
    return {
        "mm_4096": lambda: x @ w,
        "mm_qkv": lambda: x @ w3,
        "grouped_w1": lambda: torch._grouped_mm(rows, w1, offs=offs),
        "grouped_w2": lambda: torch._grouped_mm(h, w2, offs=offs),
        "grouped_wgrad": lambda: torch._grouped_mm(rows.t(), h, offs=offs),
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }


def timed(fn, side: torch.cuda.Stream | None = None, alone_ms: float = 0.0) -> tuple[float, float, int]:
    """(ms of REPS calls on the current stream, ms of the hold train on ``side``, holds in it);
    the train outlasts the calls' time alone, ``alone_ms``."""
    main = torch.cuda.current_stream()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1, h0, h1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    holds = 0
    if side is not None:
        holds = max(1, int(alone_ms / 1e3 / HOLD_S) + 2)
        side.wait_stream(main)
        h0.record(side)
    e0.record(main)
    if side is not None:
        with torch.cuda.stream(side):
            for _ in range(holds):
                emulated_link.spin(HOLD_S, DEV)
        h1.record(side)
    for _ in range(REPS):
        fn()
    e1.record(main)
    torch.cuda.synchronize()
    hold_ms = h0.elapsed_time(h1) if side is not None else 0.0
    return e0.elapsed_time(e1), hold_ms, holds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--carveouts", default="none,8,16,24")
    args = ap.parse_args()
    carveouts = [None if c == "none" else int(c) for c in args.carveouts.split(",")]
    side = torch.cuda.Stream(DEV, priority=-1)
    emulated_link.spin(1e-4, DEV)  # compile the hold kernel before any row times it
    torch.cuda.synchronize()
    for blas in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(blas)
        for name, fn in kernels().items():
            for c in carveouts:
                with sm_carveout(c):
                    alone, _, _ = timed(fn)
                    beside, hold_ms, holds = timed(fn, side, alone)
                print(json.dumps({"kernel": name, "blas": blas, "carveout": c, "alone_ms": round(alone / REPS, 4),
                                  "beside_ms": round(beside / REPS, 4), "slowdown": round(beside / alone, 4),
                                  "holds": holds, "hold_train_ms": round(hold_ms, 3),
                                  "hold_asked_ms": round(holds * HOLD_S * 1e3, 3)}), flush=True)


if __name__ == "__main__":
    main()
