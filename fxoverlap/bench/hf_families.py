"""Sweep: Hugging Face transformers MoE families through ``fxoverlap.expert_parallel`` on 2 gloo ranks.

For each family: a tiny random-weight config built from its config class (no download), the
unsharded model in eager as the reference (each rank computes it for every rank's data), then
``expert_parallel`` + eager, ``expert_parallel`` + ``fxoverlap.optimize`` with eager stages
(``optimize``), unless ``--no-backend`` ``expert_parallel`` + ``torch.compile(backend="fxoverlap")``
(``backend``, eager stages), and ``fxoverlap.optimize`` with Inductor-compiled stages
(``inductor``: ``OverlapConfig(compiler="inductor")``). ``--modes`` picks some of these. Each family
runs in its own process with a timeout. Prints one JSON line per family and, at the end, the
Markdown table of docs/models.md.

    python -m fxoverlap.bench families                       # every family below
    python -m fxoverlap.bench families jamba dots1           # some
    python -m fxoverlap.bench families --modes inductor      # only the Inductor-stage run
    python -m fxoverlap.bench families --json out.jsonl ...  # also append the JSON lines to a file
    python -m fxoverlap.bench families --table a.jsonl b.jsonl  # the table from saved lines (a family's
                                                        # modes merged over the files, later ones win)

Tolerances: eager stages, loss within 1e-6 relative and every gradient within 1e-5 of its
parameter's max |gradient|; Inductor stages (other kernels, other summation orders), |Δloss| <= 1e-5
and the same 1e-5 per parameter (docs/design.md).

Not part of the test suite (minutes per family on 2 CPU cores); tests/test_hf_models.py keeps
one test per capability.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import time
import traceback

from fxoverlap.bench.commands import self_command, subprocess_env, use_support

# Common tiny sizes; only the fields a family's config has are set.
TINY = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="sdpa",
    moe_intermediate_size=16, expert_ffn_hidden_size=16, ffn_hidden_size=64, shared_expert_intermediate_size=16,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_topk=2, moe_k=2,
    n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, router_jitter_noise=0.0, input_jitter_noise=0.0, attention_dropout=0.0, hidden_dropout=0.0, dropout_rate=0.0,
)

# family (model_type) -> (display name, extra config fields). CI = already in tests/test_hf_models.py.
FAMILIES = {
    "qwen3_moe": ("Qwen3-MoE (CI)", {}),
    "mixtral": ("Mixtral (CI)", {}),
    "deepseek_v3": ("DeepSeek-V3 (CI)", dict(num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2)),
    "gpt_oss": ("GPT-OSS (CI)", dict(attn_implementation="eager", layer_types=["full_attention"] * 2)),
    "jamba": ("Jamba", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                            mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False)),
    "dots1": ("Dots1", {}),
    "flex_olmo": ("FlexOlmo", {}),
    "minimax_m2": ("MiniMax-M2", {}),
    "glm4_moe_lite": ("GLM-4-MoE-Lite", dict(num_key_value_heads=4)),
    "lfm2_moe": ("LFM2-MoE", dict(num_dense_layers=1, layer_types=["conv", "full_attention"])),
    "qwen3_next": ("Qwen3-Next", dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)),
    "qwen3_5_moe": ("Qwen3.5-MoE", dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)),
    "longcat_flash": ("LongCat-Flash", dict(num_layers=1, num_key_value_heads=4, zero_expert_num=2)),
    "olmoe": ("OLMoE", {}),
    "qwen2_moe": ("Qwen2-MoE", {}),
    "granitemoe": ("GraniteMoE", {}),
    "granitemoeshared": ("GraniteMoE-Shared", {}),
    "granitemoehybrid": ("GraniteMoE-Hybrid", dict(layer_types=["mamba", "attention"], mamba_n_heads=4,
                                                   mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                                                   mamba_chunk_size=8)),
    "glm4_moe": ("GLM-4-MoE", {}),
    "deepseek_v2": ("DeepSeek-V2", dict(num_key_value_heads=4)),
    "ernie4_5_moe": ("Ernie-4.5-MoE", {}),
    "minimax": ("MiniMax", dict(layer_types=["full_attention"] * 2)),
    "hunyuan_v1_moe": ("HunYuan-MoE-V1", {}),
    "phimoe": ("PhiMoE", {}),
    "exaone_moe": ("EXAONE-MoE", {}),
    "afmoe": ("AFMoE", {}),
    "cohere2_moe": ("Cohere2-MoE", {}),
    "solar_open": ("Solar-Open", {}),
    "hy_v3": ("HY-V3", {}),
    "laguna": ("Laguna", {}),
    "kimi_linear": ("Kimi-Linear", dict(num_experts_per_token=2, num_key_value_heads=4, qk_head_dim=16,
                                        mlp_layer_types=["dense", "sparse"], linear_head_dim=8, linear_num_heads=4,
                                        layer_types=["linear_attention", "full_attention"])),
    "mimo_v2_flash": ("MiMo-V2-Flash", dict(attn_implementation="eager")),
    "deepseek_v32": ("DeepSeek-V3.2", dict(num_key_value_heads=4)),
    "glm_moe_dsa": ("GLM-MoE-DSA", dict(num_key_value_heads=4)),
    "nemotron_h": ("Nemotron-H", dict(layers_block_type=["linear_attention", "full_attention", "moe"],
                                      mamba_num_heads=4, mamba_head_dim=8, n_groups=1, ssm_state_size=8, chunk_size=8,
                                      moe_shared_expert_intermediate_size=16, use_mamba_kernels=False)),
    "deepseek_v4": ("DeepSeek-V4", dict(num_key_value_heads=4, attn_implementation="eager")),
    "hy_v4": ("HY-V4", dict(attn_implementation="eager")),
    "axk1": ("AXK1", dict(num_key_value_heads=4)),
    "axk2": ("AXK2", dict(num_key_value_heads=4)),
    "mellum": ("Mellum", {}),
    "zaya": ("Zaya", dict(num_experts_per_tok=1)),
    "qwen4_exp": ("Qwen4-Exp", {}),
    "granitemoe_swa": ("GraniteMoE-SWA", dict(attn_implementation="eager")),
    "dbrx": ("DBRX", dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                          attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                          ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2))),
    "llama4": ("Llama-4", {}),
    "jetmoe": ("JetMoE", {}),
}


# Why a family is refused or fails, where the error's first line does not say it (the table's cause).
WHY = {
    "longcat_flash": "not a list of MLPs: `LongcatFlashExperts` stacks `gate_up_proj` over the routed *and* the "
                     "zero-compute (identity) experts ([6, 2I, D] for 4 + 2) but `down_proj` over the routed ones "
                     "([4, D, I]), and declares no layout (no `@use_experts_implementation`): `expert_parallel` "
                     "finds no experts module (`ExpertParallelError: no MoE experts module found`). Identity "
                     "experts are not supported",
    "llama4": "`Llama4TextExperts` is called as `experts(hidden[E·C, D])` with the tokens already gathered per "
              "expert, not with indices and weights: `ExpertParallelError: no MoE experts module found`",
    "jetmoe": "each stacked weight sits in its own `JetMoeParallelExperts` called as `(inputs, expert_size)`: "
              "`ExpertParallelError: no MoE experts module found`",
    "dbrx": "expert weights flattened to 2-D `[E·I, D]` (`w1`, `v1`, `w2`): `ExpertParallelError: no MoE "
            "experts module found`",
}


def _tiny_lists(cfg: dict, n_layers: int) -> dict:
    """Per-layer lists of the default config cut to ``n_layers`` entries, one of each kind first."""
    out = {}
    for key, value in cfg.items():
        if isinstance(value, list) and len(value) > n_layers and len(value) >= 4 and key not in TINY:
            if all(isinstance(v, (str, int, bool)) for v in value):
                kinds = list(dict.fromkeys(value))
                out[key] = (kinds + value)[:n_layers] if len(kinds) <= n_layers else value[:n_layers]
    return out


def build(family: str):
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # Multimodal families: the language model's own config (Qwen3.5-MoE's text_config).
    config_cls = transformers.CONFIG_MAPPING[family]
    config_cls = (getattr(config_cls, "sub_configs", None) or {}).get("text_config", config_cls)
    default = config_cls().to_dict()
    fields = {k: v for k, v in TINY.items() if k in default or k == "attn_implementation"}
    fields.update(_tiny_lists(default, TINY["num_hidden_layers"]))
    fields.update(FAMILIES[family][1])
    torch.manual_seed(0)
    config = config_cls(**fields)
    model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])(config)
    with torch.no_grad():  # some families init biases or gates to zero; random ones make the paths count
        for name, p in model.named_parameters():
            if name.endswith("_bias") and ".experts." in name:
                p.normal_(0.0, 0.1)
    return model.float()


def _cause(exc: BaseException) -> str:
    """The innermost error's type and first line (the cause, not the wrappers)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}"


MODES = ("eager", "optimize", "backend", "inductor")


def _summary(model, losses, ref_losses, want) -> dict:
    import hf_cases

    rel = hf_cases.rel({n: p.grad for n, p in model.named_parameters()}, want)
    worst = max(rel, key=rel.get)
    loss_rel = max(abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(losses, ref_losses))
    loss_abs = max(abs(a.item() - b.item()) for a, b in zip(losses, ref_losses))
    return dict(loss_rel=loss_rel, loss_abs=loss_abs, grad_rel=rel[worst], worst=worst)


def rank_worker(rank: int, world: int, family: str, modes: list[str]) -> dict:
    import torch
    import torch.distributed as dist

    import fxoverlap

    fxoverlap.enable_dynamic_output_shapes()  # the backend's documented setup
    import hf_cases

    group = dist.group.WORLD
    out: dict = {}
    full = build(family)
    out["params"] = sum(p.numel() for p in full.parameters())
    ref_losses, own, total = hf_cases.reference(full, rank, world)
    try:
        sharded = fxoverlap.expert_parallel(copy.deepcopy(full), group)
    except Exception as e:  # noqa: BLE001
        out["expert_parallel"] = _cause(e)
        return out
    want = hf_cases.rank_view_of(sharded, own, total, rank)
    for mode in modes:
        model = copy.deepcopy(sharded)
        t0 = time.perf_counter()
        try:
            if mode == "eager":
                losses = hf_cases.eager_losses(model, hf_cases.batches(rank))
            elif mode in ("optimize", "inductor"):
                cfg = fxoverlap.OverlapConfig(compiler="inductor" if mode == "inductor" else "eager", progress=False)
                engine = fxoverlap.optimize(model, group, cfg)
                losses = engine.forward_backward(hf_cases.batches(rank), loss_fn=hf_cases.next_token_loss)
                engine.close()
            else:
                import warnings

                import fxoverlap.backend as fxb

                torch._dynamo.reset()
                fxb.reset()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", fxb.FallbackWarning)
                    losses = hf_cases.eager_losses(torch.compile(model, backend="fxoverlap"), hf_cases.batches(rank))
                fallbacks = [str(w.message)[:200] for w in caught if issubclass(w.category, fxb.FallbackWarning)]
                fxb.reset()
                torch._dynamo.reset()
            out[mode] = _summary(model, losses, ref_losses, want)
            if mode == "backend":
                out[mode]["fallbacks"] = fallbacks
        except Exception as e:  # noqa: BLE001
            out[mode] = dict(error=_cause(e), where=traceback.format_exc()[-1500:])
        out[mode]["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def run_one(family: str, modes: list[str]) -> dict:
    from fxoverlap.testing import run_distributed

    t0 = time.perf_counter()
    try:
        ranks = run_distributed(rank_worker, family, modes)
    except Exception as e:  # noqa: BLE001 -- a build error or a rank that raised outside a mode
        msg = str(e)
        last = [ln for ln in msg.splitlines() if ln.strip()]
        return dict(family=family, modes=modes, error=(last[-1] if last else msg)[:400],
                    seconds=round(time.perf_counter() - t0, 1))
    return dict(family=family, modes=modes, ranks=ranks, seconds=round(time.perf_counter() - t0, 1))


def _mode(ranks: list[dict], mode: str) -> tuple[str, object] | None:
    """("ok", (loss, grad, fallbacks)) within tolerance, ("off", ...) outside it, ("error", cause),
    or None (not run). Loss: relative for eager stages, absolute for Inductor stages."""
    rows = [r.get(mode) for r in ranks]
    if any(r is None for r in rows):
        return None
    errors = [r["error"] for r in rows if "error" in r]
    if errors:
        return "error", errors[0]
    if mode == "inductor":
        loss = max(r.get("loss_abs", r["loss_rel"]) for r in rows)
        loss_ok = loss <= 1e-5
    else:
        loss = max(r["loss_rel"] for r in rows)
        loss_ok = loss <= 1e-6
    grad = max(r["grad_rel"] for r in rows)
    fallbacks = sum(len(r.get("fallbacks", [])) for r in rows)
    ok = loss_ok and grad <= 1e-5 and not fallbacks
    return ("ok" if ok else "off"), (loss, grad, fallbacks)


def merge(lines: list[dict]) -> list[dict]:
    """One line per family, in first-seen order: a later line's modes (per rank) override an
    earlier one's, so a run of some modes adds a column to a run of the others. A later line that
    failed as a whole (timed out) marks the modes it ran (``modes``) as failed with its error."""
    out: dict[str, dict] = {}
    for line in lines:
        prev = out.get(line["family"])
        if prev is None or "ranks" not in prev:
            out[line["family"]] = copy.deepcopy(line)
        elif "ranks" in line:
            for old, new in zip(prev["ranks"], line["ranks"]):
                old.update(copy.deepcopy(new))
        elif line.get("modes"):
            for old in prev["ranks"]:
                old.update({m: {"error": line["error"]} for m in line["modes"]})
    return list(out.values())


def _cell(ranks: list[dict], modes: tuple[str, ...], notes: list[str]) -> tuple[list[str], list[float]]:
    """The modes within tolerance and their worst (loss, grad); failures go to ``notes``."""
    good, worst = [], [0.0, 0.0]
    for mode in modes:
        res = _mode(ranks, mode)
        if res is None:
            continue
        kind, val = res
        if kind == "error":
            notes.append(f"{mode} fails: {val}")
            continue
        loss, grad, fallbacks = val
        if kind == "ok":
            good.append(mode)
            worst = [max(worst[0], loss), max(worst[1], grad)] if mode != "inductor" else worst
        else:
            notes.append(f"{mode}: loss {loss:.1e}, grad {grad:.1e}" + (f", {fallbacks} fallbacks" if fallbacks else ""))
    return good, worst


def table(lines: list[dict]) -> str:
    """One row per family: the entry points that match the unsharded model with eager stages and
    with Inductor stages, the worst difference over them and over both ranks, and the cause of
    each failure."""
    out = ["| family | ranks | eager stages: within tolerance | Inductor stages: within tolerance | "
           "result: max rel. loss diff; max per-parameter grad diff / max|grad| (eager stages; Inductor stages: "
           "max abs. loss diff; grad); or the failure |", "|---|---|---|---|---|"]
    for line in merge(lines):
        name = FAMILIES.get(line["family"], (line["family"],))[0]
        if "error" in line and line["error"].startswith("timed out"):
            out.append(f"| {name} | 2 | none | none | not run to the end: {line['error']} (untested) |")
            continue
        if "error" in line:
            out.append(f"| {name} | 2 | none | none | fails before sharding: `{line['error']}` |")
            continue
        ranks = line["ranks"]
        if ranks[0].get("expert_parallel"):
            why = WHY.get(line["family"]) or f"`{ranks[0]['expert_parallel']}`"
            out.append(f"| {name} | 2 | none | none | `expert_parallel` refuses it: {why} |")
            continue
        notes: list[str] = []
        good, worst = _cell(ranks, ("eager", "optimize", "backend"), notes)
        ind_good, _ = _cell(ranks, ("inductor",), notes)
        ind = _mode(ranks, "inductor")
        merged: dict[str, list[str]] = {}  # one failure cause, the modes it stops
        for note in notes:
            mode, _, rest = note.partition(" fails: ") if " fails: " in note else (note, "", "")
            merged.setdefault(rest or note, []).append(mode if rest else "")
        notes = [f"{' and '.join(modes)} fail{'s' if len(modes) == 1 else ''}: `{cause}`" if modes[0] else cause
                 for cause, modes in merged.items()]
        result = [f"loss {worst[0]:.1e}, grad {worst[1]:.1e}"] if good else []
        if ind_good:
            result.append(f"Inductor: loss {ind[1][0]:.1e}, grad {ind[1][1]:.1e}")
        ind_cell = "optimize" if ind_good else ("not run" if ind is None else "none")
        out.append(f"| {name} | 2 | {', '.join(good) or 'none'} | {ind_cell} | {'; '.join(result + notes)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--no-backend", action="store_true")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    ap.add_argument("--json", help="append each family's JSON line to this file")
    ap.add_argument("--table", nargs="+", help="print the table of the JSON lines in these files and exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    use_support()  # tests/support (hf_cases) on sys.path, here and in the spawned ranks
    modes = [m for m in args.modes.split(",") if m and not (args.no_backend and m == "backend")]
    if any(m not in MODES for m in modes):
        ap.error(f"--modes: each of {MODES}, got {args.modes}")
    if args.table:
        lines = []
        for path in args.table:
            with open(path) as f:
                lines += [json.loads(line) for line in f if line.strip()]
        print(table(lines))
        return
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, modes)), flush=True)
        return
    lines = []
    for family in args.families or list(FAMILIES):
        cmd = self_command("families", "--one", family, "--modes", ",".join(modes))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=subprocess_env())
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            line = json.loads(found[-1][7:]) if found else dict(
                family=family, modes=modes, error=f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:300]}")
        except subprocess.TimeoutExpired:
            line = dict(family=family, modes=modes, error=f"timed out after {args.timeout} s")
        line.setdefault("seconds", round(time.perf_counter() - t0, 1))
        print(json.dumps(line), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")
        lines.append(line)
    print(table(lines))


if __name__ == "__main__":
    main()
