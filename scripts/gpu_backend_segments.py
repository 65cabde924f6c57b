"""A/B of the backend's backward segments, in one process: every segment (a cut at each
gradient hand-out), the default (``SEGMENT_MIN_GRAD_BYTES``) and one piece, alternated over
4 rounds of 10 steps, at the bench's small shape (2 layers, dim 1024, 8 experts top-2, 4
microbatches of 1024 tokens), dropless and capacity, bf16, one GPU:
``torchrun --standalone --nproc-per-node 1 scripts/gpu_backend_segments.py``. Prints one
``AB`` line per routing: segments per variant and ms per step per round."""
import datetime, time
import torch, torch.distributed as dist
import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import token_batches
fxoverlap.enable_dynamic_output_shapes()  # the backend's documented setup: dropless dispatch in the graph

torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=120))
for routing in ("dropless", "capacity"):
    cfg = MoEConfig.benchmark(n_layers=2, dim=1024, n_heads=8, n_experts=8, top_k=2, expert_dim=512, vocab_size=8192,
                              max_seq_len=1024, routing=routing)
    torch.manual_seed(0)
    model = MoETransformer(cfg, dist.group.WORLD).to(device=dev, dtype=torch.bfloat16)
    batches = token_batches(cfg.vocab_size, 4, (1, 1024), seed=1, device=dev)
    c = torch.compile(model, backend="fxoverlap")

    def step():
        for b in batches:
            c(*b).backward()

    for _ in range(3):
        step()
    st = fxoverlap.backend.last_compiled()
    input_of = {v: i for i, v in st._grad_of.items()}
    raw = [(span, tuple(input_of[v] for v in values if v in input_of)) for span, values in st.runner.grad_segments()]
    default = list(st._segments)
    merged = [((raw[0][0][0], raw[-1][0][1]), tuple(i for _, ins in raw for i in ins))]
    variants = (("all", raw), ("default", default), ("one", merged))
    res = {k: [] for k, _ in variants}
    for rnd in range(4):
        for name, s in variants:
            st._segments = s
            step(); torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                step()
            torch.cuda.synchronize()
            res[name].append(1e3 * (time.perf_counter() - t) / 10)
    print("AB", routing, "n_segments", {k: len(v) for k, v in variants}, {k: [round(x, 2) for x in v] for k, v in res.items()}, flush=True)
    fxoverlap.backend.reset(); torch._dynamo.reset()
    del c, model
dist.destroy_process_group()
