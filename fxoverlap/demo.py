"""``python -m fxoverlap.demo``: the reference MoE model through fxoverlap on 2 gloo ranks, CPU only.

Captures one train step, tags and splits it into stages, prints the stage table
and the interleaved program's first steps, then checks ``forward_backward`` over
3 microbatches against eager PyTorch on the same weights and data.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.engine import format_stage_table
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import eager_steps, grad_diff, run_distributed, take_grads, token_batches


def _rank_main(rank: int, world: int, microbatches: int, routing: str) -> dict:
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(routing=routing, shared_expert_dim=32, layer_pattern=("moe", "moe", "dense"), n_layers=3)
    model = MoETransformer(cfg, dist.group.WORLD)
    mbs = token_batches(cfg.vocab_size, microbatches, (2, 32), seed=rank)
    t0 = time.perf_counter()
    ref_losses = eager_steps(model, mbs)
    eager_s = time.perf_counter() - t0
    ref = take_grads(model)

    engine = fxoverlap.optimize(model, dist.group.WORLD)
    t0 = time.perf_counter()
    losses = engine.forward_backward(mbs)
    first_s = time.perf_counter() - t0
    diff, scale, bitwise = grad_diff(model, ref)
    program_head = "\n".join(
        line.split(";")[0] for line in engine.program.code.strip().splitlines()[1:40] if "free" not in line
    )
    return dict(
        table=format_stage_table(engine.stages), program=program_head, eager_s=eager_s, first_s=first_s,
        losses=[float(x) for x in losses], ref_losses=[float(x) for x in ref_losses],
        losses_equal=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
        diff=diff, scale=scale, bitwise=bitwise,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=3)
    p.add_argument("--routing", choices=("dropless", "capacity"), default="dropless")
    args = p.parse_args(argv)
    print(f"fxoverlap demo: reference MoE model ({args.routing} routing), 2 gloo ranks on CPU, "
          f"{args.microbatches} microbatches")
    print("spawning 2 ranks; capturing, tagging and splitting the train step ...", flush=True)
    results = run_distributed(_rank_main, args.microbatches, args.routing)
    r0 = results[0]
    print("\nstage table (rank 0):")
    print(r0["table"])
    print("\ninterleaved program, first lines (rank 0):")
    print(r0["program"])
    print("\ncheck against eager (same weights and data):")
    ok = True
    for rank, r in enumerate(results):
        good = r["losses_equal"] and r["diff"] <= 1e-6 * r["scale"]
        ok &= good
        print(f"  rank {rank}: losses {['%.4f' % x for x in r['losses']]} "
              f"{'==' if r['losses_equal'] else '!='} eager; max |grad - eager grad| = {r['diff']:.3g} "
              f"(max |eager grad| {r['scale']:.3g}){' bitwise' if r['bitwise'] else ''} -> {'OK' if good else 'MISMATCH'}")
    print(f"\n{'PASS' if ok else 'FAIL'}: fxoverlap matches eager on both ranks "
          f"(first call incl. capture {r0['first_s']:.2f}s, eager {r0['eager_s']:.2f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
