"""Train the tiny reference MoE model for a few steps with fxoverlap on 2 gloo ranks (CPU).

    torchrun --nproc-per-node 2 examples/train_tiny.py
"""

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32, layer_pattern=("moe", "dense"))
    model = MoETransformer(cfg, dist.group.WORLD)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(delay_wgrad=True))
    g = torch.Generator().manual_seed(rank)
    for step in range(5):
        mbs = [(torch.randint(0, cfg.vocab_size, (2, 32), generator=g),) * 2 for _ in range(4)]
        losses = engine.forward_backward(mbs)
        # Non-expert parameters are replicated: average their gradients over ranks.
        for name, p in model.named_parameters():
            if ".experts." not in name and p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {torch.stack(losses).mean():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
