"""GPU check of fxoverlap.expert_parallel on transformers MoE families (one GPU, a 1-rank NCCL group).

    python -m fxoverlap.bench hf

Per family and dtype: the unsharded model (transformers' default experts path) vs
expert_parallel in eager and through fxoverlap.optimize; prints one JSON line each.

    python -m fxoverlap.bench hf --real [--out DIR] [--models qwen3_moe,...] [--modes ...] [--chunks 1,2,..] [--nolink]

At released layer shapes (``REAL``: Qwen3-30B-A3B, Moonlight (DeepSeek-V3 MLA), Mixtral-8x7B,
GPT-OSS-20B, OLMoE-1B-7B layers; 4 layers, vocabulary cut to 32768, 4 microbatches of 1 x 2048
tokens, bf16), one rank of emulated EP (``ep``: its local experts are the model's experts, every
dispatch/combine holds the stream for the bytes an EP-N rank would move over a 100 GB/s link,
``fxoverlap/kernels/emulated_link.py``). One process per (model, mode) (``--one``), so each
mode's peak memory is its own; each process first runs the eager step of the same
``expert_parallel`` model on the same weights and data (its losses and gradients kept on the
host), then the mode:

- ``compile``: ``torch.compile(model)`` (Inductor), the baseline step time;
- ``optimize``: ``fxoverlap.optimize`` (the CUDA default: Inductor stages);
- ``backend``: ``torch.compile(model, backend="fxoverlap")``, one microbatch per call;
- ``forward_only``: ``engine.forward_only`` (no gradients) against eager's forward losses;
- ``compile_forward`` / ``backend_forward``: ``torch.compile(model)`` / ``torch.compile(model,
  backend="fxoverlap")`` called on each microbatch under ``torch.no_grad()``, the loss computed
  outside the compiled model as the ``compile`` / ``backend`` rows do; against eager's forward
  losses. Not in the default ``--modes``.

``--chunks 1,2,3,4``: one process per (model, mode, chunks) for the fxoverlap modes
(``OverlapConfig(chunks=K)``, the backend's ``options={"chunks": K}``); the ``torch.compile``
rows run once. ``--nolink``: the emulated group holds nothing (``EmulatedGroup(None)``, the
EP-N rank's compute only). With 4 microbatches ``forward_only`` runs them in pairs, whole
exchanges (``OverlapConfig.chunks``' docstring), and ``optimize`` chunks only F(0)/B(0)/F(N-1)/B(N-1):
the backend's rows are where chunks count. Per (model, mode[, chunks]) one JSON line: loss and
gradient difference from eager, step time (median of the timed steps) and its ratio to
``compile``'s (``compile_forward``'s for the forward rows; torch.compile's rows run first), the
first step's time (compiles), peak memory. bf16 tolerance (``ok``): each loss within 1e-2
relative; per parameter max|Δgrad| <= 8 · 2^-8 = 3.1e-2 · max|eager grad| (a few bf16 roundings
of reordered sums; a wrong slice or a lost routing weight is O(1)). Each process's log and
the JSON lines (``hf_gpu_real.jsonl``) go to ``--out`` (default ``$OUT``). Budget: about 8
minutes on one H200 with a warm Inductor cache dir shared by the processes.
"""
import argparse, collections, copy, dataclasses, json, os, statistics, subprocess, sys, time, traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.bench.commands import BenchCommandError, SupportModule, self_command, subprocess_env
from fxoverlap.passes.inductor import stage_route
from fxoverlap.testing import take_grads

hf_cases = SupportModule("hf_cases")  # tests/support/hf_cases.py, imported at first use

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


# ---------------------------------------------------------------- released layer shapes

VOCAB_REAL, SEQ, N_MB, LAYERS, GBPS = 32768, 2048, 4, 4, 100.0
BF16_LOSS_TOL, BF16_GRAD_TOL = 1e-2, 8 * 2.0**-8
# model -> (hf_cases family, emulated EP size, global experts, config fields: the released layer,
# with the local experts E/EP as the model's experts)
REAL = {
    "qwen3_moe": ("qwen3_moe", 8, 128, dict(  # Qwen3-30B-A3B
        hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        moe_intermediate_size=768, num_experts=16, num_experts_per_tok=8, norm_topk_prob=True)),
    "deepseek_v3": ("deepseek_v3", 8, 64, dict(  # Moonlight-16B-A3B (DeepSeek-V3 architecture, MLA)
        hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=8, num_experts_per_tok=6, n_shared_experts=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, routed_scaling_factor=2.446,
        norm_topk_prob=True)),
    "mixtral": ("mixtral", 4, 8, dict(  # Mixtral-8x7B (EP 4: 2 local experts for its top-2)
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        num_local_experts=2, num_experts_per_tok=2)),
    "gpt_oss": ("gpt_oss", 8, 32, dict(  # GPT-OSS-20B (eager attention: sinks; sliding 128 / full)
        hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=4, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2))),
    "olmoe": ("olmoe", 8, 64, dict(  # OLMoE-1B-7B
        hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
        num_experts=8, num_experts_per_tok=8)),
}
MODES_REAL = ("compile", "optimize", "backend", "forward_only", "compile_forward", "backend_forward")
DEFAULT_MODES_REAL = MODES_REAL[:4]  # ``bench hf --real`` with no --modes
FORWARD_MODES_REAL = ("forward_only", "compile_forward", "backend_forward")  # no gradients, eager's forward losses
COMPILE_MODES_REAL = ("compile", "compile_forward")  # torch.compile's own: OverlapConfig(chunks=) does not apply


def _real_model(name: str):
    family, _, _, fields = REAL[name]
    with torch.device("cuda"):  # initialised on the GPU: seconds, not a minute of CPU init per process
        return hf_cases.build(family, torch.bfloat16, vocab_size=VOCAB_REAL, num_hidden_layers=LAYERS,
                              max_position_embeddings=max(4096, SEQ), **fields)


def _timed(fn, iters: int) -> tuple[float, list[float], object]:
    """(first call's seconds, the next ``iters`` calls' seconds, the last call's result)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    last = fn()
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        last = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return t_first, times, last


def run_real_one(name: str, mode: str, iters: int, stage_options: dict | None = None, chunks: int | None = None,
                 link: bool = True, timed: Callable | None = None, gbps: float = GBPS,
                 overlap_options: dict | None = None) -> dict:
    """One (model, mode) in this process: eager reference, then the mode; see the module docstring.
    ``stage_options``: Inductor options for fxoverlap's compiled stages (``OverlapConfig.compile_options``,
    the backend's ``options``), e.g. ``{"cpp_wrapper": True}``; ``torch.compile``'s row keeps its defaults.
    ``chunks``: ``OverlapConfig(chunks=K)`` (``optimize``, ``forward_only``) or the backend's
    ``options={"chunks": K}`` (``backend``, ``backend_forward``); None: the default (CUDA: 2).
    ``link``: False, the emulated group holds nothing (the EP-N rank's compute only); ``gbps``: the
    emulated link's speed otherwise. ``overlap_options``: ``OverlapConfig`` fields for the fxoverlap
    modes (``optimize``'s config and the backend's ``options``), e.g. ``{"cuda_graphs": False}``.
    ``timed``: how the mode's steps are timed (default :func:`_timed`; ``hf-timeline`` profiles in it)."""
    from fxoverlap.kernels import emulated_link

    if mode not in MODES_REAL:
        raise BenchCommandError(f"bench hf --real: unknown mode {mode!r}; choose from {', '.join(MODES_REAL)}")
    if chunks is not None and mode in COMPILE_MODES_REAL:
        raise BenchCommandError(f"bench hf --real: chunks={chunks} is an fxoverlap setting; the {mode!r} row is "
                                "torch.compile's own (leave chunks out for it)")
    overlap_options = overlap_options or {}
    if overlap_options and mode in COMPILE_MODES_REAL:
        raise BenchCommandError(f"bench hf --real: {overlap_options} are fxoverlap settings; the {mode!r} row is "
                                "torch.compile's own")
    timed = timed or _timed
    forward = mode in FORWARD_MODES_REAL
    fxoverlap.enable_dynamic_output_shapes()  # dropless dispatch stays in torch.compile's graph
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29556")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    _, ep, experts, _ = REAL[name]
    emulated = emulated_link.Link(gbps, ep=ep, experts=experts, name=f"{gbps:g}GB/s") if link else None
    group = emulated_link.EmulatedGroup(emulated)  # the EP group: one rank here, every exchange holds as EP-N's
    row = dict(model=name, mode=mode, chunks=chunks, layers=LAYERS, stage_options=stage_options or {},
               overlap_options=overlap_options,
               tokens=f"{N_MB} x 1 x {SEQ}", dtype="bfloat16",
               link=f"emulated EP {ep}, {gbps:g} GB/s" if link else f"emulated EP {ep}, none (holds nothing)",
               torch=torch.__version__)
    config = fxoverlap.OverlapConfig(compile_options=stage_options, chunks=chunks, **overlap_options)
    if mode not in COMPILE_MODES_REAL:
        row["chunks_resolved"] = config.resolved_chunks("cuda")
    backend_options = {**(stage_options or {}), **({} if chunks is None else {"chunks": chunks}), **overlap_options}
    g = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, VOCAB_REAL, (1, SEQ), generator=g).cuda() for _ in range(N_MB)]
    model = fxoverlap.expert_parallel(_real_model(name), group)
    row["params"] = sum(p.numel() for p in model.parameters())
    row["local_experts"] = REAL[name][3].get("num_experts") or REAL[name][3].get("num_local_experts") \
        or REAL[name][3].get("n_routed_experts")
    # the eager reference on the same weights and data: losses, gradients (on the host)
    if forward:
        with torch.no_grad():
            ref_losses = [hf_cases.next_token_loss(model(ids), ids).float() for ids in mbs]
        ref = {}
    else:
        ref_losses = [l.float() for l in steps(model, mbs)]
        ref = {n: p.grad.detach().to("cpu", non_blocking=True) for n, p in model.named_parameters()
               if p.grad is not None}
        model.zero_grad(set_to_none=True)
    t_eager = None
    if mode == "compile":  # eager's step time too, for scale (plain timing: not the mode's step)
        t_eager = _timed(lambda: steps(model, mbs), 1)[1][0]
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()

    def fwd_bwd(m):
        def step():
            m.zero_grad(set_to_none=True)
            return steps(m, mbs)
        return step

    def fwd(m):  # the forward rows of torch.compile and the backend: the loss outside the compiled model
        def step():
            with torch.no_grad():
                return [hf_cases.next_token_loss(m(ids), ids) for ids in mbs]
        return step

    engine = None
    if mode in ("compile", "compile_forward"):
        torch._dynamo.config.cache_size_limit = 64
        step = (fwd_bwd if mode == "compile" else fwd)(torch.compile(model))
    elif mode in ("backend", "backend_forward"):
        import fxoverlap.backend as fxb

        fxb.reset()
        compiled = torch.compile(model, backend="fxoverlap", options=backend_options)
        step = (fwd_bwd if mode == "backend" else fwd)(compiled)
    elif mode == "optimize":
        engine = fxoverlap.optimize(model, group, config)

        def step():
            model.zero_grad(set_to_none=True)
            return engine.forward_backward(mbs, loss_fn=hf_cases.next_token_loss)
    else:  # forward_only
        engine = fxoverlap.optimize(model, group, config)

        def step():
            with torch.no_grad():
                outs = engine.forward_only(mbs, output_fn=lambda out, ids: hf_cases.next_token_loss(out, ids))
            return outs
    t_first, times, losses = timed(step, iters)  # the last step's losses; its gradients (zeroed before each)
    losses = list(losses)
    row["first_step_s"] = round(t_first, 2)
    row["step_ms"] = round(1e3 * statistics.median(times), 2)
    row["step_ms_all"] = [round(1e3 * t, 2) for t in times]
    if t_eager is not None:
        row["eager_step_ms"] = round(1e3 * t_eager, 2)
    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    row["peak_above_model_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
    row["loss_rel"] = max(abs(a.float().item() - b.item()) / abs(b.item()) for a, b in zip(losses, ref_losses))
    if ref:
        rel = hf_cases.rel({n: p.grad for n, p in model.named_parameters()}, {n: r.cuda() for n, r in ref.items()})
        worst = max(rel, key=rel.get)
        row["grad_rel"], row["worst"] = rel[worst], worst
    row["ok"] = row["loss_rel"] <= BF16_LOSS_TOL and row.get("grad_rel", 0.0) <= BF16_GRAD_TOL
    stages = engine.stages if engine is not None else None
    if mode in ("backend", "backend_forward"):
        import fxoverlap.backend as fxb

        stages = fxb.last_stages()
        runner = getattr(fxb.last_compiled(), "runner", None)
        if runner is not None and runner.cuda_graphs is not None:  # loans_copied: gradients kept past their use
            row["cuda_graphs"] = runner.cuda_graphs.summary()
    elif engine is not None:
        row["cuda_graphs"] = engine.cuda_graph_summary()
    if stages is not None:
        # chunks_resolved is the count; which layers it cut (the one-microbatch default leaves small exchanges whole)
        row["chunked_layers"] = sorted({s.layer for s in stages if s.chunk is not None})
        row["runs_as"] = sorted({s.runs_as for s in stages})
        row["stage_routes"] = dict(collections.Counter(stage_route(s) for s in stages))
    dist.destroy_process_group()
    return row


def _chunk_list(text: str | None) -> list[int | None]:
    """``--chunks 1,2,3,4`` -> [1, 2, 3, 4]; not given -> [None] (the default)."""
    if not text:
        return [None]
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise SystemExit(f"bench hf: --chunks takes comma-separated ints >= 1, got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise SystemExit(f"bench hf: --chunks takes comma-separated ints >= 1, got {text!r}")
    return ks


def parse_options(items: list[str], bool_keys: Callable[[str], bool] = lambda key: True) -> dict:
    """``KEY=VALUE`` strings as a dict: ``true/false`` as bools, ``1/0`` too where ``bool_keys(KEY)``
    (every key by default: Inductor's flags), other numbers as numbers, the rest as strings."""
    out = {}
    for kv in items:
        key, _, value = kv.partition("=")
        low = value.lower()
        if low in ("true", "false") or (low in ("1", "0") and bool_keys(key)):
            out[key] = low in ("1", "true")
        else:
            try:
                out[key] = int(value)
            except ValueError:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
    return out


def parse_overlap_options(items: list[str]) -> dict:
    """``KEY=VALUE`` strings naming ``OverlapConfig`` fields: ``1/0`` is a bool for a bool field
    (``cuda_graphs=0``) and a number for a number field (``chunks=1``)."""
    types = {f.name: str(f.type) for f in dataclasses.fields(fxoverlap.OverlapConfig)}
    return parse_options(items, lambda key: types.get(key, "").startswith("bool"))


def row_command(name: str, mode: str, iters: int, chunks: int | None = None, link: bool = True,
                gbps: float = GBPS, overlap_options: list[str] = ()) -> list[str]:
    """The command of one (model, mode[, chunks]) process of ``bench hf --real``."""
    return self_command("hf", "--one", name, mode, "--iters", str(iters),
                        *(() if gbps == GBPS else ("--gbps", f"{gbps:g}")),
                        *(a for kv in overlap_options for a in ("--overlap-option", kv)),
                        *(() if chunks is None else ("--chunks", str(chunks))), *(() if link else ("--nolink",)))


def main_real(args) -> None:
    """``bench hf --real``: one process per (model, mode[, chunks]) (:func:`row_command`), within
    ``args.budget``; the JSON lines to ``OUT/hf_gpu_real.jsonl``."""
    out_dir = args.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    models = args.models.split(",") if args.models else list(REAL)
    modes = args.modes.split(",") if args.modes else list(DEFAULT_MODES_REAL)
    for what, names, known in (("model", models, REAL), ("mode", modes, MODES_REAL)):
        bad = [n for n in names if n not in known]
        if bad:
            raise SystemExit(f"bench hf --real: unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(known)}")
    # torch.compile's rows first (stable), so every other row has its baseline for speedup_vs_compile
    modes.sort(key=lambda m: m not in COMPILE_MODES_REAL)
    chunk_list = _chunk_list(args.chunks)
    link = not args.nolink
    t_start = time.perf_counter()
    base_ms: dict[tuple[str, str], float] = {}  # (model, compile mode) -> its step ms
    base_grad: dict[tuple[str, str], float | None] = {}  # (model, compile mode) -> its grad_rel against eager
    with open(os.path.join(out_dir, "hf_gpu_real.jsonl"), "a") as jl:
        for name in models:
            for mode in modes:
                for chunks in ([None] if mode in COMPILE_MODES_REAL else chunk_list):
                    ident = dict(model=name, mode=mode, chunks=chunks)
                    left = args.budget - (time.perf_counter() - t_start)
                    if left < 20:
                        row = dict(ident, skipped=f"total budget of {args.budget} s spent")
                    else:
                        tag = (f"{name}_{mode}" + ("" if chunks is None else f"_c{chunks}")
                               + ("_nolink" if not link else "" if args.gbps == GBPS else f"_{args.gbps:g}GBps"))
                        opts = [] if mode in COMPILE_MODES_REAL else args.overlap_option
                        tag += "".join(f"_{kv.replace('=', '')}" for kv in opts)
                        log = os.path.join(out_dir, f"{tag}.log")
                        cmd = row_command(name, mode, args.iters, chunks, link, args.gbps, opts)
                        try:
                            with open(log, "w") as f:
                                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True,
                                                      env=subprocess_env(), timeout=min(args.timeout, left))
                            f_out = proc.stdout
                            found = [ln for ln in f_out.splitlines() if ln.startswith("RESULT ")]
                            row = json.loads(found[-1][7:]) if found else dict(
                                ident, error=f"exit {proc.returncode}; see {log}")
                            with open(log, "a") as f:
                                f.write(f_out)
                        except subprocess.TimeoutExpired:
                            row = dict(ident, error=f"timed out; see {log}")
                    if mode in COMPILE_MODES_REAL and "step_ms" in row:
                        base_ms[name, mode] = row["step_ms"]
                        base_grad[name, mode] = row.get("grad_rel")
                    base = "compile_forward" if mode in FORWARD_MODES_REAL else "compile"
                    if mode not in COMPILE_MODES_REAL and "step_ms" in row and (name, base) in base_ms:
                        row["speedup_vs_compile"] = round(base_ms[name, base] / row["step_ms"], 3)
                        if base_grad[name, base] is not None and "grad_rel" in row:
                            # bf16 against eager: torch.compile's own difference is the scale (at the
                            # released shapes it exceeds BF16_GRAD_TOL on norm weights, 0.04-0.14)
                            row["grad_rel_compile"] = base_grad[name, base]
                            row["ok_vs_compile"] = row["grad_rel"] <= max(BF16_GRAD_TOL, 1.25 * base_grad[name, base])
                    row["elapsed_s"] = round(time.perf_counter() - t_start, 1)
                    print(json.dumps(row), flush=True)
                    jl.write(json.dumps(row) + "\n")
                    jl.flush()


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="released layer shapes (see the module docstring)")
    ap.add_argument("--out", help="log and JSON-lines folder (default $OUT)")
    ap.add_argument("--models", help=f"comma-separated, of {tuple(REAL)}")
    ap.add_argument("--modes", help=f"comma-separated, of {MODES_REAL} (default: {','.join(DEFAULT_MODES_REAL)})")
    ap.add_argument("--chunks", help="comma-separated chunk counts: one row per count for each fxoverlap mode "
                    "(OverlapConfig(chunks=K), the backend's options={'chunks': K}); torch.compile's rows run once. "
                    "Default: the config's default (CUDA: 2)")
    ap.add_argument("--nolink", action="store_true", help="the emulated group holds nothing (the EP-N rank's compute only)")
    ap.add_argument("--gbps", type=float, default=GBPS, help="the emulated link's speed, GB/s (default %(default)g)")
    ap.add_argument("--overlap-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an OverlapConfig field for the fxoverlap rows (optimize's config, the backend's options), "
                         "e.g. cuda_graphs=0; repeatable")
    ap.add_argument("--iters", type=int, default=3, help="timed steps after the first")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per (model, mode) process")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run; later rows are skipped")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        chunks = _chunk_list(args.chunks)
        if len(chunks) != 1:
            ap.error(f"--one runs one row: one --chunks value, got {args.chunks!r}")
        try:
            row = run_real_one(*args.one, args.iters, chunks=chunks[0], link=not args.nolink, gbps=args.gbps,
                               overlap_options=parse_overlap_options(args.overlap_option))
        except Exception as e:  # noqa: BLE001 -- reported as the row
            row = dict(model=args.one[0], mode=args.one[1], chunks=chunks[0], error=f"{type(e).__name__}: {e}"[:600],
                       trace=traceback.format_exc()[-1500:])
        print("RESULT " + json.dumps(row), flush=True)
        sys.stdout.flush()
        os._exit(0)  # no teardown hang of NCCL/compile workers after the result is out
    if args.real:
        main_real(args)
    else:
        main()


if __name__ == "__main__":
    cli()
