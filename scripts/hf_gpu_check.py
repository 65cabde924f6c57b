"""GPU check of fxoverlap.expert_parallel on transformers MoE families (one GPU, a 1-rank NCCL group).

    python scripts/hf_gpu_check.py

Per family and dtype: the unsharded model (transformers' default experts path) vs
expert_parallel in eager and through fxoverlap.optimize; prints one JSON line each.
"""
import copy, json, os, sys, time, traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
import hf_cases  # noqa: E402
import fxoverlap  # noqa: E402
from fxoverlap.testing import take_grads  # noqa: E402

SHAPE = dict(hidden_size=256)


def steps(model, mbs, engine=None):
    if engine is not None:
        return engine.forward_backward(mbs, loss_fn=hf_cases.next_token_loss)
    out = []
    for ids in mbs:
        loss = hf_cases.next_token_loss(model(ids), ids)
        loss.backward()
        out.append(loss.detach())
    return out


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    print(json.dumps(dict(torch=torch.__version__, device=torch.cuda.get_device_name())), flush=True)
    import transformers
    print(json.dumps(dict(transformers=transformers.__version__)), flush=True)
    g = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, hf_cases.VOCAB, (4, 64), generator=g).cuda() for _ in range(3)]
    for family in ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"):
        for dtype in (torch.bfloat16, torch.float32):
            row = dict(family=family, dtype=str(dtype))
            try:
                t0 = time.perf_counter()
                full = hf_cases.build(family, dtype, **SHAPE).cuda()
                ref = copy.deepcopy(full)
                try:
                    ref_losses = steps(ref, mbs)
                    row["reference"] = ref.config._experts_implementation
                except Exception as e:  # transformers' grouped_mm may refuse this dtype on CUDA
                    row["reference_error"] = f"{type(e).__name__}: {str(e)[:160]}"
                    ref.zero_grad(set_to_none=True)
                    ref.set_experts_implementation("batched_mm")
                    ref_losses = steps(ref, mbs)
                    row["reference"] = "batched_mm"
                want = take_grads(ref)
                # transformers' own run-to-run spread (atomics in its backward), for scale
                steps(ref, mbs)
                again = hf_cases.rel(take_grads(ref), want)
                row["reference_rerun_grad_rel"] = max(again.values())
                truth = None
                if dtype != torch.float32:  # fp32 math on the same weights: who is closer to it
                    ref32 = copy.deepcopy(full).float()
                    steps(ref32, mbs)
                    truth = take_grads(ref32)
                    row["reference_vs_fp32"] = max(hf_cases.rel(want, truth).values())
                for mode in ("eager", "optimize"):
                    model = fxoverlap.expert_parallel(copy.deepcopy(full), dist.group.WORLD)
                    engine = fxoverlap.optimize(model, dist.group.WORLD) if mode == "optimize" else None
                    losses = steps(model, mbs, engine)
                    rel = hf_cases.rel({n: p.grad for n, p in model.named_parameters()}, want)
                    worst = max(rel, key=rel.get)
                    row[mode] = dict(loss_rel=max(abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(losses, ref_losses)),
                                     grad_rel=rel[worst], worst=worst,
                                     bitwise_losses=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)))
                    if truth is not None:
                        row[mode]["vs_fp32"] = max(hf_cases.rel({n: p.grad for n, p in model.named_parameters()}, truth).values())
                    if engine is not None:
                        row[mode]["comm_stages"] = sorted({s.name.split("_", 2)[-1] for s in engine.stages if s.stream is fxoverlap.StreamKind.COMM})
                row["seconds"] = round(time.perf_counter() - t0, 2)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:600]
                row["trace"] = traceback.format_exc()[-1500:]
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
