"""GPU check of DTensor parameters and inputs through fxoverlap.optimize (any number of GPUs).

    torchrun --nproc-per-node 2 -m fxoverlap.bench dtensor     # or 1

The torchtitan-style model of tests/support/titan_models.py (functional-collective EP over
NCCL) with DTensor weights, as torchtitan's EP leaves them: experts Shard(0) on a CUDA
mesh, routers replicated with Partial gradients, DTensor token inputs. fxoverlap vs
eager on twin models, fp32, 3 microbatches, the default stage compiler (Inductor on
CUDA) and "eager" stages. Prints one JSON line per rank and compiler: losses and
gradients bitwise / max abs diff, and whether every gradient has eager's placements.
torchtitan itself needs torch >= 2.12 (it does not import on torch 2.11).
"""
import argparse, json, os

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.bench.commands import SupportModule
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

titan_models = SupportModule("titan_models")  # tests/support/titan_models.py, imported at first use


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no flags; --help
    TitanTransformer, shard_with_dtensors = titan_models.TitanTransformer, titan_models.shard_with_dtensors
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    mesh = init_device_mesh("cuda", (world,))
    g = torch.Generator().manual_seed(100 + rank)
    mbs = [(DTensor.from_local(torch.randint(0, 64, (2, 16), generator=g).cuda(), mesh, [Shard(0)], run_check=False),
            torch.randint(0, 64, (2, 16), generator=g).cuda()) for _ in range(3)]

    def build():
        torch.manual_seed(0)
        return shard_with_dtensors(TitanTransformer(dist.group.WORLD).cuda(), mesh)

    for compiler in (None, "eager"):
        eager, model = build(), build()
        ref = []
        for mb in mbs:
            loss = eager(*mb)
            loss.backward()
            ref.append(loss.detach())
        engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(compiler=compiler))
        losses = engine.forward_backward(mbs)
        refs = dict(eager.named_parameters())
        worst, scale, bitwise, kinds = 0.0, 0.0, True, True
        for name, p in model.named_parameters():
            a, b = p.grad, refs[name].grad
            kinds &= type(a) is type(b) and getattr(a, "placements", None) == getattr(b, "placements", None)
            worst = max(worst, (local(a).double() - local(b).double()).abs().max().item())
            scale = max(scale, local(b).abs().max().item())
            bitwise &= torch.equal(local(a), local(b))
        print(json.dumps(dict(rank=rank, world=world, torch=torch.__version__, compiler=compiler or "default",
                              losses_bitwise=all(torch.equal(x, y) for x, y in zip(losses, ref)),
                              max_loss_diff=max(abs(x.item() - y.item()) for x, y in zip(losses, ref)),
                              grads_bitwise=bitwise, max_grad_diff=worst, grad_scale=scale,
                              grads_same_kind_as_eager=kinds)), flush=True)
        engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
