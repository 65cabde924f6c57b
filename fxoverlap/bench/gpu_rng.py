"""GPU check that random ops draw what eager draws (one GPU, one rank).

    python -m fxoverlap.bench rng

The model of tests/support/rng_models.py (dropout in the embedding, attention, a shared
expert before the router, the experts; a noisy or sampling router) on CUDA, fp32,
3 microbatches, two calls, each against eager from the same seed: losses, gradients and the
CUDA generator's state after the step. Modes: eager-kernel stages without and with CUDA
graphs (the graphed stages draw at replay), the backend with eager-kernel stages, and
Inductor stages against the same compiled stages run in plain order (Inductor draws with
its own kernels). First a control: eager run twice from one seed, bitwise with itself?
Prints one JSON line per mode.
"""
import argparse
import json

import torch

import fxoverlap
from fxoverlap.bench.commands import SupportModule
from fxoverlap.models import MoEConfig
from fxoverlap.pipeline import run_plain
from fxoverlap.testing import take_grads, token_batches

rng_models = SupportModule("rng_models")  # tests/support/rng_models.py, imported at first use

CFG = MoEConfig.tiny(n_layers=2, dim=64, n_heads=4, n_experts=8, expert_dim=32, vocab_size=128)


def build(router: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return rng_models.RandomTransformer(CFG, None, router=router).cuda()


def eager(model, mbs, rounds=2, call=None):
    """``rounds`` eager passes over ``mbs`` from seed 1 (``call``: what runs the model, e.g. a compiled one)."""
    torch.manual_seed(1)
    losses = []
    for _ in range(rounds):
        for mb in mbs:
            loss = (model if call is None else call)(*mb)
            loss.backward()
            losses.append(loss.detach())
    return losses, take_grads(model), torch.cuda.get_rng_state()


def compare(name, losses, grads, state, ref) -> None:
    ref_losses, ref_grads, ref_state = ref
    row = dict(mode=name,
               losses_bitwise=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
               grads_bitwise=grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads),
               max_grad_diff=max((grads[k] - ref_grads[k]).abs().max().item() for k in grads),
               generator_equal=torch.equal(state, ref_state))
    print(json.dumps(row), flush=True)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no flags; --help
    fxoverlap.enable_dynamic_output_shapes()  # the backend's documented setup: dropless dispatch in the graph
    mbs = token_batches(CFG.vocab_size, 3, device="cuda")
    for router in ("noisy", "sample"):
        model = build(router)
        ref = eager(model, mbs)
        compare(f"{router}: eager again (control)", *eager(model, mbs), ref)
        for graphs in (False, True):
            engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="eager", cuda_graphs=graphs))
            torch.manual_seed(1)
            losses = engine.forward_backward(mbs) + engine.forward_backward(mbs)
            graphed = sum(1 for s in engine.stages if s.graphed and s.draws)
            compare(f"{router}: optimize eager stages, cuda_graphs={graphs} ({graphed} graphed stages draw)",
                    losses, take_grads(model), torch.cuda.get_rng_state(), ref)
            engine.close()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fxoverlap", options={"compiler": "eager"})
        compare(f"{router}: backend eager stages", *eager(model, mbs, call=compiled), ref)
        fxoverlap.backend.reset()
        engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="inductor", progress=False))
        plan = engine.plan(mbs)
        plain = []
        torch.manual_seed(1)
        for _ in range(2):
            plain += [run_plain(plan.stages, plan.capture, model, mb) for mb in mbs]
        plain_ref = (plain, take_grads(model), torch.cuda.get_rng_state())
        torch.manual_seed(1)
        losses = engine.forward_backward(mbs) + engine.forward_backward(mbs)
        compare(f"{router}: optimize inductor stages vs the same stages in plain order", losses, take_grads(model),
                torch.cuda.get_rng_state(), plain_ref)
        engine.close()


if __name__ == "__main__":
    main()
