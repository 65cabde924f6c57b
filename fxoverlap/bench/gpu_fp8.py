"""FP8 rowwise experts on one GPU (SM89+, torchao 0.18.0): ``OverlapConfig(expert_dtype="fp8_rowwise")``.

    python -m fxoverlap.bench fp8 --out $OUT/fp8.json [--parts kernels,numerics,speed,curve,profile]

The GPU machine reaches no registry: carry torchao's wheel (``pip download --no-deps torchao==0.18.0``)
and ``pip install --no-deps`` it there first. Parts (each adds its key to the JSON at ``--out``):

1. ``kernels``: the CUDA path (torchao's quantization kernels, ``torch._scaled_grouped_mm``) against
   the reference math of ``kernels/fp8_gemm.py`` run on the CPU on the same data (forward, input
   gradient, weight gradient; the quantized bytes), against torchao's own fused
   ``_to_fp8_rowwise_then_scaled_grouped_mm``, and the weight gradient of empty groups (exact zeros:
   chunks rely on it).
2. ``numerics``: a small model, bf16: fxoverlap-FP8 (eager stages, the CUDA defaults: delay_wgrad,
   chunks) against eager with the same FP8 ops (losses and every gradient <= 1e-3 relative); the same
   with Inductor stages, beside bf16's Inductor-against-eager difference for scale; and per
   experts stage (each MoE layer's experts on the inputs the model gave them, and at the
   Qwen3-30B-A3B layer shape) FP8 against bf16: SQNR of the output >= 23 dB, input gradient >= 29,
   weight gradients >= 21; and torchao's own MoE-layer check in its test's geometry
   (:func:`moe_layer_sqnr`: output and ``x.grad`` >= 29 dB, parameter gradients >= 23, with the
   bf16 shared expert its test has, and without one).
3. ``speed``: the Qwen3-30B-A3B layer shape (dim 2048, 128 experts top-8, expert dim 768), emulated
   EP 8, without a link and over 100 GB/s: ``python -m fxoverlap.bench run`` rows (one process
   each) for bf16, FP8 and torchao's FP8 under torch.compile (the baseline): the experts stages'
   time, the step with (fxoverlap) and without (torch.compile) overlap, FP8 against bf16.
4. ``curve``: 200 AdamW steps of a small model through fxoverlap, bf16 and FP8, on data it can
   learn (:func:`learnable_batches`): the last losses within 1 % (a PNG beside the JSON when
   matplotlib is there).
5. ``profile`` (not in the default parts; about a minute): where FP8's experts time goes. One experts
   layer at the Qwen3-30B-A3B shape of one EP-8 rank (32768 rows, 16 experts), eager, phase by phase
   (forward, input gradient, weight gradients) with bf16's and FP8's ops: CUDA-event times, the
   ``torch.profiler`` kernels by name and category per phase, and each FP8 building block
   (quantizations, ``_scaled_grouped_mm``, paddings, the wgrad ``torch.where``) timed alone with its
   calls per layer (``fxoverlap/bench/fp8_profile.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import json
import os
import time
from collections.abc import Iterator

import torch

import fxoverlap
from fxoverlap import fp8_ops, ops
from fxoverlap.kernels import fp8_gemm, grouped_gemm
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import eager_steps, take_grads, token_batches

# Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts top-8, moe_intermediate_size 768); 16 heads of
# 128 (the reference model ties the attention width to dim); vocab cut to 32768.
QWEN3_30B = ["--dim", "2048", "--heads", "16", "--experts", "128", "--top-k", "8", "--expert-dim", "768",
             "--vocab", "32768", "--layers", "2", "--seq", "4096", "--microbatches", "8"]
THRESHOLDS = {"out": 23.0, "dx": 29.0, "dw": 21.0}  # dB, torchao's


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float(20 * torch.log10(ref.norm() / (ref - got).norm().clamp_min(1e-30)))


def rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.float(), got.float()
    return float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-30))


@contextlib.contextmanager
def torchao_experts() -> Iterator[None]:
    """The baseline: every ``ops.grouped_mm`` as torchao's fused FP8 rowwise grouped GEMM (its own
    autograd Function), each group padded to 16 rows by ``ops.expert_rows`` as for ours. It takes
    the weights [E, K, N] column-major: the reference model stores them row-major, so each call
    copies them (torchtitan stores them transposed and pays no copy)."""
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm as fused

    def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        w_t = w if w.stride(-2) == 1 else w.transpose(-1, -2).contiguous().transpose(-1, -2)
        return fused(x, w_t, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)

    saved = ops.grouped_mm
    ops.grouped_mm = grouped_mm
    try:
        with fp8_ops.expert_math(None, row_align=fp8_ops.ROW_ALIGN):
            yield
    finally:
        ops.grouped_mm = saved


def _counts(rows: int, groups: int, seed: int = 0) -> torch.Tensor:
    """Uneven group sizes (some empty), each a multiple of 16, summing to ``rows``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(groups, generator=g) ** 2
    w[torch.randperm(groups, generator=g)[: max(1, groups // 8)]] = 0
    c = (w / w.sum() * rows / 16).floor().long() * 16
    c[int(c.argmax())] += rows - int(c.sum())
    return c


# ---------------------------------------------------------------- 1. kernels


def kernels(m: int = 4096, k: int = 2048, n: int = 1536, groups: int = 16) -> dict:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    counts = _counts(m, groups)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(groups, k, n, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    out: dict = {"shape": {"m": m, "k": k, "n": n, "groups": groups}}
    for name, fn, exact, args in (("fwd", fp8_gemm.grouped_mm, grouped_gemm.grouped_mm, (x, w, offs)),
                                  ("dgrad", fp8_gemm.grouped_mm, grouped_gemm.grouped_mm, (dy, w.transpose(-1, -2), offs)),
                                  ("wgrad", fp8_gemm.grouped_mm_wgrad, grouped_gemm.grouped_mm_wgrad, (x, dy, offs))):
        cpu = fn(*args)
        gpu = fn(*(a.to(dev) for a in args)).cpu()
        out[name] = {"rel_vs_reference": rel(cpu, gpu), "sqnr_vs_reference": sqnr(cpu, gpu),
                     # against the product in bf16 (torchao's one-GEMM thresholds: 27 / 25 / 24 dB)
                     "sqnr_vs_bf16": sqnr(exact(args[0].float(), args[1].float(), offs), gpu)}
    qc, sc = fp8_gemm.quantize_rows(x)
    qg, sg = fp8_gemm.quantize_rows(x.to(dev))
    out["quantize_rows_equal"] = bool(torch.equal(qc.view(torch.uint8), qg.cpu().view(torch.uint8))
                                      and torch.equal(sc, sg.cpu()))
    qc, sc = fp8_gemm.quantize_rhs(w)
    qg, sg = fp8_gemm.quantize_rhs(w.to(dev))
    out["quantize_rhs_equal"] = bool(torch.equal(qc.contiguous().view(torch.uint8),
                                                 qg.cpu().contiguous().view(torch.uint8)) and torch.equal(sc, sg.cpu()))
    xg, wg, og = x.to(dev), w.to(dev), offs.to(dev)
    ours = fp8_ops.grouped_mm_fp8(xg, wg, og)
    try:
        with torchao_experts():
            theirs = ops.grouped_mm(xg, wg, og)
        out["vs_torchao_fused"] = {"equal": bool(torch.equal(ours, theirs)), "rel": rel(theirs, ours)}
    except Exception as e:  # noqa: BLE001  (report and go on)
        out["vs_torchao_fused"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    empty = torch.tensor([0, 1024, 1024, m - 2048], dtype=torch.int32, device=dev).cumsum(0).to(torch.int32)
    dw = fp8_gemm.grouped_mm_wgrad(xg, dy.to(dev), empty)
    out["wgrad_empty_groups_zero"] = bool((dw[0] == 0).all() and (dw[2] == 0).all())
    return out


# ---------------------------------------------------------------- 2. numerics


def _experts_sqnr(experts: torch.nn.Module, x: torch.Tensor, counts: torch.Tensor, dy: torch.Tensor) -> dict:
    """One experts stage's work, bf16 against FP8 on the same inputs: output, input and weight gradients."""
    runs = []
    for dtype in (None, "fp8_rowwise"):
        e = copy.deepcopy(experts)
        xi = x.detach().clone().requires_grad_()
        with fp8_ops.expert_math(dtype):
            y = ops.expert_rows(e, xi, counts)
        y.backward(dy)
        runs.append((y.detach(), xi.grad, {n: p.grad for n, p in e.named_parameters()}))
    (y0, dx0, dw0), (y1, dx1, dw1) = runs
    res = {"out": sqnr(y0, y1), "dx": sqnr(dx0, dx1), "dw": min(sqnr(dw0[n], dw1[n]) for n in dw0)}
    res["ok"] = all(res[k] >= t for k, t in THRESHOLDS.items())
    return res


#: torchao 0.18's own FP8-rowwise MoE test (test/prototype/moe_training, test_moe_training_fsdp):
#: SQNR of the MoE layer's output and ``x.grad`` >= 29 dB, of every parameter's gradient >= 23,
#: on torchtitan's ``MoE(MoEArgs(num_experts=8), dim, 4 * dim)``: top-1 of 8 routed experts beside
#: one bf16 shared expert of width 4·dim, router and shared expert left in bf16.
TORCHAO_MOE_THRESHOLDS = {"out": 29.0, "dx": 29.0, "param": 23.0}


def moe_layer_sqnr(device: str | torch.device, dim: int = 512, tokens: int = 2048, shared: bool = True,
                   seed: int = 42) -> dict:
    """torchao's MoE-layer check with fxoverlap's FP8 experts: the reference model's ``MoE`` in
    torchao's test geometry (8 experts top-1, expert width 4·dim, a shared expert of 4·dim unless
    ``shared=False``), weights N(0, 0.02) in bf16, MSE loss against ones; FP8 experts
    (``expert_math("fp8_rowwise")``) against bf16: SQNR of the output, of ``x.grad`` and the lowest
    of the parameters' gradients (dB). Runs on CPU with the reference FP8 math (the quantized
    bytes equal the CUDA kernels', ``kernels`` part) or on CUDA."""
    import torch.nn.functional as F

    from fxoverlap.models.moe import MoE

    torch.manual_seed(seed)
    cfg = MoEConfig.tiny(dim=dim, n_experts=8, top_k=1, expert_dim=4 * dim, shared_expert_dim=4 * dim if shared else 0)
    ref = MoE(cfg, None).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.02)
    x0 = torch.randn(tokens // 256, 256, dim, device=device, dtype=torch.bfloat16)
    runs = []
    for dtype in (None, "fp8_rowwise"):
        m = copy.deepcopy(ref)
        x = x0.clone().requires_grad_(True)
        with fp8_ops.expert_math(dtype):
            out = m(x)
        out = out[0] if isinstance(out, tuple) else out
        F.mse_loss(out, torch.ones_like(out)).backward()
        runs.append((out.detach(), x.grad, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (y0, dx0, g0), (y1, dx1, g1) = runs
    params = {n: sqnr(g0[n], g1[n]) for n in g0}
    res = {"shared_expert": shared, "dim": dim, "tokens": tokens, "out": sqnr(y0, y1), "dx": sqnr(dx0, dx1),
           "param": min(params.values()), "worst_param": min(params, key=params.get)}
    res["ok"] = all(res[k] >= t for k, t in TORCHAO_MOE_THRESHOLDS.items())
    return res


def numerics() -> dict:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = MoEConfig.tiny(n_layers=2, dim=512, n_heads=8, n_experts=8, top_k=2, expert_dim=256, vocab_size=1024)
    base = MoETransformer(cfg, None).to(dev, torch.bfloat16)
    mbs = [tuple(t.to(dev) for t in mb) for mb in token_batches(cfg.vocab_size, 4, (2, 256))]
    out: dict = {"config": {"dim": cfg.dim, "experts": cfg.n_experts, "top_k": cfg.top_k, "expert_dim": cfg.expert_dim}}
    # eager bf16, capturing each experts stage's inputs
    seen: dict[int, tuple] = {}
    ref16 = copy.deepcopy(base)
    def keep_inputs(i):
        def hook(mod, args, res) -> None:  # returns None: a hook's return value would replace the output
            seen.setdefault(i, (args[0].detach(), args[1].detach(), res.shape))
        return hook

    def keep_input_grads(store: dict, i: int):
        def hook(mod, grad_in, grad_out) -> None:  # the layer's input gradient, first microbatch's
            store.setdefault(i, grad_in[0].detach().clone())
        return hook

    dx16: dict[int, torch.Tensor] = {}
    dx8: dict[int, torch.Tensor] = {}
    hooks = [layer.moe.experts.register_forward_hook(keep_inputs(i))
             for i, layer in enumerate(ref16.layers) if hasattr(layer, "moe")]
    hooks += [layer.register_full_backward_hook(keep_input_grads(dx16, i)) for i, layer in enumerate(ref16.layers)]
    l16 = eager_steps(ref16, mbs)
    g16 = take_grads(ref16)
    for h in hooks:
        h.remove()
    ref8 = copy.deepcopy(base)
    hooks = [layer.register_full_backward_hook(keep_input_grads(dx8, i)) for i, layer in enumerate(ref8.layers)]
    with fp8_ops.expert_math("fp8_rowwise"):
        l8 = eager_steps(ref8, mbs)
    g8 = take_grads(ref8)
    for h in hooks:
        h.remove()
    # torchao's 29 dB input-gradient threshold is its MoE layer's (residual included), not one experts stage's
    out["layer_input_grad_sqnr_db"] = {f"layer{i}": sqnr(dx16[i], dx8[i]) for i in dx16}
    def run(expert_dtype, compiler):
        fx = copy.deepcopy(base)
        engine = fxoverlap.optimize(fx, None, fxoverlap.OverlapConfig(expert_dtype=expert_dtype, compiler=compiler,
                                                                   progress=False))
        losses = engine.forward_backward(mbs)
        out.setdefault("stages", [s.name for s in engine.stages if "experts" in s.name])
        engine.close()
        return losses, take_grads(fx)

    def against(ref_losses, ref_grads, losses, grads, tol=None) -> dict:
        loss_rel = max(abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(losses, ref_losses))
        grad_rel = {n: rel(ref_grads[n], grads[n]) for n in ref_grads}
        row = {"loss_rel": loss_rel, "grad_rel_max": max(grad_rel.values()), "worst": max(grad_rel, key=grad_rel.get)}
        return row | ({"ok": loss_rel <= tol and row["grad_rel_max"] <= tol} if tol else {})

    # the criterion (<= 1e-3: the same ops, reduction order only) with eager stages; Inductor's
    # stages round bf16 differently from eager (fused in fp32), shown beside bf16's own Inductor-vs-eager
    lfx, gfx = run("fp8_rowwise", "eager")
    out["fxoverlap_vs_eager_fp8"] = against(l8, g8, lfx, gfx, tol=1e-3)
    lfx, gfx = run("fp8_rowwise", None)
    out["fxoverlap_inductor_vs_eager_fp8"] = against(l8, g8, lfx, gfx)
    l16i, g16i = run(None, None)
    out["bf16_inductor_vs_eager_bf16"] = against(l16, g16, l16i, g16i)
    out["fp8_vs_bf16_model"] = {
        "loss_rel": max(abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(l8, l16)),
        "expert_weight_grad_sqnr": {n: sqnr(g16[n], gfx[n]) for n in g16 if ".experts." in n}}
    # per experts stage: the layer's experts on the inputs the model gave them
    per_stage = {}
    for i, (x, counts, shape) in seen.items():
        dy = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        per_stage[f"layer{i}"] = _experts_sqnr(base.layers[i].moe.experts, x, counts, dy)
    # and at the Qwen3-30B-A3B layer shape, one EP-8 rank (16 local experts, 4096 rows)
    from fxoverlap.models.moe import GroupedExperts

    torch.manual_seed(1)
    big = GroupedExperts(16, 2048, 768).to(dev, torch.bfloat16)
    counts = _counts(4096, 16)
    counts[int(counts.argmax())] -= 5
    counts[int(counts.argmin())] += 5  # groups that are no multiple of 16: the padding runs
    counts = counts.to(dev)
    per_stage["qwen3_30b_layer"] = _experts_sqnr(big, torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16),
                                                 counts, torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16))
    out["per_experts_stage_sqnr_db"] = per_stage
    out["thresholds_db"] = THRESHOLDS
    # torchao's own threshold check, in its test's geometry (with its bf16 shared expert, and without)
    out["torchao_moe_layer_sqnr_db"] = [moe_layer_sqnr(dev, dim=1024, tokens=8192, shared=s) for s in (True, False)]
    return out


# ---------------------------------------------------------------- 3. speed


def speed(out_dir: str, budget_s: float, link_gbps: float, layers: int, microbatches: int = 8,
          row_timeout_s: float = 900.0, only: str = "") -> dict:
    from fxoverlap.bench.commands import self_command
    from fxoverlap.bench.rows import Runner, Step

    runner = Runner(out_dir, "fp8_speed", budget_s=budget_s, est_s=240.0, timeout_s=row_timeout_s)
    shape = [*QWEN3_30B]
    shape[shape.index("--layers") + 1] = str(layers)
    shape[shape.index("--microbatches") + 1] = str(microbatches)
    common = [*shape, "--emulate-ep", "8", "--link-gbps", str(link_gbps), "--out", out_dir, "--no-trace",
              "--no-timeline", "--no-grad-check"]
    rows = {"bf16": ("model", "compile,fxoverlap", []), "fp8": ("fp8_rowwise", "compile,fxoverlap", []),
            "torchao_fp8": ("torchao_fp8", "compile", ["--no-stage-timing"])}
    for name, (math, modes, extra) in rows.items():
        if only and name not in only.split(","):
            continue
        runner.run(Step(f"fp8_speed_{name}", self_command("run", *common, "--expert-math", math, "--modes", modes,
                                                          "--name", f"fp8_speed_{name}", *extra)))
    return summarize(out_dir, link_gbps) | {"failed": runner.failed}


def _experts_ms(stage_ms: dict) -> dict:
    """The experts stages' ms per step, by direction; the bench's stage keys are ``<F|B><mb>_<stage>``
    (``F0_l0_experts_c0``, ``B3_l1_experts_c1_wgrad``)."""
    fwd = sum(v for k, v in stage_ms.items() if "_experts" in k and k.startswith("F"))
    bwd = sum(v for k, v in stage_ms.items() if "_experts" in k and k.startswith("B"))
    return {"fwd": fwd, "bwd": bwd, "total": fwd + bwd}


def summarize(out_dir: str, link_gbps: float) -> dict:
    """Step and experts-stage times of the speed rows' JSON, FP8 against bf16."""
    rows: dict = {}
    for path in glob.glob(os.path.join(out_dir, "fp8_speed_*.json")):
        name = os.path.basename(path)[len("fp8_speed_"):-len(".json")]
        with open(path) as f:
            r = json.load(f)
        row = {}
        for mode, m in r.get("modes", {}).items():
            row[mode] = {"step_ms_no_link": m.get("T_compute_ms", m.get("step_ms")),
                         f"step_ms_{link_gbps:g}GBps": m.get("step_ms"), "hidden_share": m.get("hidden_share")}
        if "stage_timing" in r:
            row["experts_stage_ms"] = _experts_ms(r["stage_timing"]["stage_ms"])
        rows[name] = row
    ratios = {}
    for mode in ("compile", "fxoverlap"):
        for key in ("step_ms_no_link", f"step_ms_{link_gbps:g}GBps"):
            a, b = (rows.get(n, {}).get(mode, {}).get(key) for n in ("fp8", "bf16"))
            if a and b:
                ratios[f"{mode}_{key}_fp8_over_bf16"] = a / b
    a, b = (rows.get(n, {}).get("experts_stage_ms", {}).get("total") for n in ("fp8", "bf16"))
    if a and b:
        ratios["experts_stage_fp8_over_bf16"] = a / b
    for key in ("step_ms_no_link", f"step_ms_{link_gbps:g}GBps"):
        ours, theirs = rows.get("fp8", {}).get("fxoverlap", {}).get(key), rows.get("torchao_fp8", {}).get(
            "compile", {}).get(key)
        if ours and theirs:
            ratios[f"torchao_compile_over_fxoverlap_fp8_{key}"] = theirs / ours
    return {"rows": rows, "ratios": ratios}


# ---------------------------------------------------------------- 4. loss curve


def learnable_batches(vocab: int, n: int, shape: tuple[int, int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` microbatches ``(tokens, labels)`` a model can learn (random labels cannot be: the
    loss would stay at ln(vocab) and say nothing of FP8): each label is a fixed permutation of
    its token, 10 % of them replaced by random ids, so the loss falls from ~ln(vocab) to ~1."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, shape, generator=g)
        noise = torch.rand(shape, generator=g) < 0.1
        out.append((tokens, torch.where(noise, torch.randint(0, vocab, shape, generator=g), perm[tokens])))
    return out


def curve(out_dir: str, steps: int, device: str = "cuda", compiler: str = "eager", cfg: MoEConfig | None = None,
          batch: tuple[int, int] = (4, 128)) -> dict:
    """``steps`` AdamW steps through fxoverlap, bf16 and FP8 experts on the same weights and data.
    Eager stages by default: the curve is about FP8's numerics over training, and eager stages
    are the ops eager runs (Inductor's compile would take most of a GPU call's budget); the
    partial curves are written to ``fp8_curve_partial.json`` every 25 steps."""
    dev = torch.device(device)
    cfg = cfg or MoEConfig.tiny(n_layers=4, dim=512, n_heads=8, n_experts=8, top_k=2, expert_dim=512, vocab_size=2048)
    torch.manual_seed(0)
    base = MoETransformer(cfg, None).to(dev, torch.bfloat16)
    losses: dict[str, list[float]] = {}
    t0 = time.time()
    for name, dtype in (("bf16", None), ("fp8", "fp8_rowwise")):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        engine = fxoverlap.optimize(m, None, fxoverlap.OverlapConfig(expert_dtype=dtype, compiler=compiler,
                                                                   progress=False))
        curve_ = losses.setdefault(name, [])
        for step in range(steps):
            mbs = [tuple(t.to(dev) for t in mb) for mb in learnable_batches(cfg.vocab_size, 4, batch, seed=step)]
            curve_.append(float(torch.stack(engine.forward_backward(mbs)).float().mean()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if (step + 1) % 25 == 0:
                print(f"FP8 curve {name} step {step + 1}/{steps} loss {curve_[-1]:.4f} ({time.time() - t0:.0f} s)",
                      flush=True)
                with open(os.path.join(out_dir, "fp8_curve_partial.json"), "w") as f:
                    json.dump({"steps": steps, "compiler": compiler, "losses": losses}, f)
        engine.close()
    tail = max(1, steps // 20)
    end = {k: sum(v[-tail:]) / tail for k, v in losses.items()}
    res = {"steps": steps, "compiler": compiler, "device": device, "model": {
               "layers": cfg.n_layers, "dim": cfg.dim, "experts": cfg.n_experts, "top_k": cfg.top_k,
               "expert_dim": cfg.expert_dim, "vocab": cfg.vocab_size, "tokens_per_step": 4 * batch[0] * batch[1]},
           "losses": losses, "final_mean_last": end,
           "final_rel": abs(end["fp8"] - end["bf16"]) / end["bf16"]}
    res["ok"] = res["final_rel"] <= 0.01
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for k, v in losses.items():
            ax.plot(v, label=k)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (mean over microbatches)")
        ax.set_title("fxoverlap: bf16 vs FP8 rowwise experts")
        ax.legend()
        png = os.path.join(out_dir, "fp8_loss_curve.png")
        fig.savefig(png, dpi=120, bbox_inches="tight")
        res["png"] = png
    except ImportError:
        pass
    return res


# ---------------------------------------------------------------- 5. profile


def _profile() -> dict:
    from fxoverlap.bench.fp8_profile import profile

    return profile("cuda")


# ---------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m fxoverlap.bench fp8", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out/fp8.json", help="the JSON written (its folder gets the rows' files)")
    p.add_argument("--parts", default="kernels,numerics,speed,curve",
                   help="any of kernels,numerics,speed,curve,profile (profile: the FP8 experts' per-kernel time)")
    p.add_argument("--link-gbps", type=float, default=100.0)
    p.add_argument("--layers", type=int, default=2, help="layers of the speed rows' model")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches of the speed rows")
    p.add_argument("--row-timeout", type=float, default=900.0, help="seconds per speed row (one process each)")
    p.add_argument("--budget", type=float, default=0.0, help="seconds for the speed rows (0: no budget)")
    p.add_argument("--rows", default="", help="the speed rows run (bf16,fp8,torchao_fp8; default all): "
                   "the others' JSON already in the folder is still summarized")
    p.add_argument("--steps", type=int, default=200, help="steps of the loss curve")
    p.add_argument("--curve-compiler", default="eager", choices=("eager", "inductor"),
                   help="the loss curve's stages (eager: no compile time; the ops eager runs)")
    a = p.parse_args()
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    fp8_ops.check_expert_dtype("fp8_rowwise", device)  # Fp8Unavailable names what is missing
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import torchao

        result["torchao"] = torchao.__version__
    except ImportError:
        pass
    parts = {"kernels": kernels, "numerics": numerics,
             "speed": lambda: speed(out_dir, a.budget, a.link_gbps, a.layers, a.microbatches, a.row_timeout, a.rows),
             "curve": lambda: curve(out_dir, a.steps, compiler=a.curve_compiler),
             "profile": _profile}
    for name in filter(None, (s.strip() for s in a.parts.split(","))):
        t0 = time.time()
        try:
            result[name] = parts[name]()
        except Exception as e:  # noqa: BLE001  (report and go on to the next part)
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
        result.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        print("FP8", name, json.dumps(result[name], default=str)[:2000], flush=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
