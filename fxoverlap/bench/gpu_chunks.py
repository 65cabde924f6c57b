"""Chunks on one GPU: ``OverlapConfig(chunks=K)`` against ``chunks=1`` and eager, one rank.

    python -m fxoverlap.bench chunks --out $OUT/chunk_check.jsonl

1. ``torch._grouped_mm``'s weight gradient gives exact zeros to groups with no rows (a chunk's
   experts stage runs every local expert, the others with no rows, and the chunks' gradients
   are summed).
2. A small reference model (fp32 and bf16, dropless): losses, gradients and forward-only logits
   of chunks=2 and 4 against chunks=1 (compiler eager: bitwise expected; Inductor: the same
   compiled stages, bitwise expected) and against eager.
Prints one ``CHUNKCHECK {json}`` line per check.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import eager_steps, take_grads, token_batches


def _emit(out, rec: dict) -> None:
    line = json.dumps(rec)
    print("CHUNKCHECK", line, flush=True)
    if out:
        out.write(line + "\n")
        out.flush()


def empty_groups() -> dict:
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([0, 32, 32, 64], device="cuda", dtype=torch.int32)  # groups 0 and 2 empty
    dw = torch._grouped_mm(x.t(), dy, offs=offs)
    return {"check": "grouped_mm_wgrad_empty_groups", "zeros": bool((dw[0] == 0).all() and (dw[2] == 0).all())}


def model_check(dtype: torch.dtype, compiler: str, chunks: int) -> dict:
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(n_layers=2, dim=256, n_heads=4, n_experts=8, top_k=2, expert_dim=512, vocab_size=512)
    base = MoETransformer(cfg).to("cuda", dtype)
    mbs = [tuple(t.cuda() for t in mb) for mb in token_batches(cfg.vocab_size, 3, (2, 128))]
    runs = {}
    for name, k in (("whole", 1), ("chunked", chunks)):
        m = copy.deepcopy(base)
        engine = fxoverlap.optimize(m, None, fxoverlap.OverlapConfig(compiler=compiler, chunks=k, progress=False))
        losses = engine.forward_backward(mbs)
        with torch.no_grad():
            logits = engine(mbs[0][0])
        runs[name] = (losses, take_grads(m), logits, [s.name for s in engine.stages])
        engine.close()
    ref = copy.deepcopy(base)
    ref_losses = eager_steps(ref, mbs)
    ref_grads = take_grads(ref)
    (lw, gw, xw, _), (lc, gc, xc, names) = runs["whole"], runs["chunked"]
    rel = max(((gc[n].float() - gw[n].float()).abs().max() / gw[n].float().abs().max().clamp_min(1e-30)).item()
              for n in gw)
    rel_eager = max(((gc[n].float() - ref_grads[n].float()).abs().max()
                     / ref_grads[n].float().abs().max().clamp_min(1e-30)).item() for n in ref_grads)
    return {"check": "model", "dtype": str(dtype), "compiler": compiler, "chunks": chunks,
            "chunk_stages": sum("_c" in n for n in names),
            "losses_equal_whole": all(torch.equal(a, b) for a, b in zip(lc, lw)),
            "grads_bitwise_whole": all(torch.equal(gc[n], gw[n]) for n in gw), "grad_rel_whole": rel,
            "logits_equal_whole": torch.equal(xc, xw),
            "loss_rel_eager": max(((a - b).abs() / b.abs()).item() for a, b in zip(lc, ref_losses)),
            "grad_rel_eager": rel_eager}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    a = p.parse_args()
    out = open(a.out, "a") if a.out else None
    _emit(out, empty_groups())
    for dtype in (torch.float32, torch.bfloat16):
        for compiler in ("eager", "inductor"):
            for chunks in (2, 4):
                try:
                    _emit(out, model_check(dtype, compiler, chunks))
                except Exception as e:  # noqa: BLE001  (report and go on)
                    _emit(out, {"check": "model", "dtype": str(dtype), "compiler": compiler, "chunks": chunks,
                                "error": f"{type(e).__name__}: {str(e)[:500]}"})


if __name__ == "__main__":
    main()
