"""Tiny transformers MoE models and the 2-rank workers of ``test_hf_models.py``.

Spawned ranks import this module by name. Every model is built from its config
class with random weights (no download); each rank builds the same full model
from one seed, and regenerates every rank's data from that rank's seed, so it
can compute the unsharded reference for all ranks' data by itself.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxoverlap
from fxoverlap.testing import take_grads

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
               attn_implementation="sdpa")


# family -> (config class, model class, config fields beyond _COMMON)
_FAMILIES = {
    # 8 experts, top-2
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2, head_dim=8, num_experts=8,
        num_experts_per_tok=2)),
    # 4 experts, top-2: 2 local experts per rank
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=16, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2)),
    # dense first layer, MLA, group-limited sigmoid routing, one shared expert
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
    # transposed stacked weights, per-expert biases, interleaved gate/up, clamped GLU
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        attn_implementation="eager", intermediate_size=16, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["full_attention"] * 2)),
    # dense: no experts module
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=64, num_key_value_heads=2)),
}
# More families that share the interface, checked on one rank in eager (recognition and
# per-expert math; the all-to-all path is the same code as for the families above).
_MOE = dict(intermediate_size=32, moe_intermediate_size=16, num_key_value_heads=2, head_dim=8)
_FAMILIES.update({
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(_MOE, num_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        _MOE, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=16)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(_MOE, num_local_experts=4, num_experts_per_tok=2)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        _MOE, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _MOE, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(_MOE, moe_num_experts=4, moe_k=2)),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        _MOE, num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(_MOE, num_experts=4, moe_topk=2)),
    # its router samples in training (sparsemixer: Gumbel noise from exponential_)
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(_MOE, num_local_experts=4, num_experts_per_tok=2)),
})
MORE_FAMILIES = ["olmoe", "qwen2_moe", "granitemoe", "glm4_moe", "deepseek_v2", "ernie4_5_moe", "minimax",
                 "hunyuan_v1_moe"]


def build(family: str, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A 2-layer random-weight model of ``family`` (seed 0): the same weights on every rank."""
    import transformers

    config_cls, model_cls, fields = _FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**_COMMON, **fields, **overrides})
    model = getattr(transformers, model_cls)(config)
    if family == "gpt_oss":
        with torch.no_grad():  # its init zeroes the biases; random ones make the bias path count
            for name, p in model.named_parameters():
                if name.endswith("_bias"):
                    p.normal_(0.0, 0.1)
    return model.to(dtype)


def next_token_loss(out, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token i+1 from position i (the loss_fn of every test)."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def batches(rank: int, n: int = 2, shape=(2, 8)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, shape, generator=g) for _ in range(n)]


def eager_losses(model, mbs) -> list[torch.Tensor]:
    losses = []
    for ids in mbs:
        loss = next_token_loss(model(ids), ids)
        loss.backward()
        losses.append(loss.detach())
    return losses


def reference(full: torch.nn.Module, rank: int, world: int) -> tuple[list[torch.Tensor], dict, dict]:
    """The unsharded model on this rank's data: its losses and gradients; and the
    gradients of the summed losses of every rank's data (what EP expert grads must be)."""
    model = copy.deepcopy(full)
    losses = eager_losses(model, batches(rank))
    own = take_grads(model)
    for r in range(world):
        eager_losses(model, batches(r))
    return losses, own, take_grads(model)


def rank_view(own: dict, total: dict, shapes: dict, rank: int) -> dict:
    """The reference as an EP rank must see it: for a sharded parameter (dim 0 smaller than the
    full model's) this rank's slice of the all-ranks gradient, for the rest the own-data one."""
    view = {}
    for name, shape in shapes.items():
        n = shape[0] if len(shape) else 0
        sharded = len(shape) and n != total[name].shape[0]
        view[name] = total[name][rank * n: (rank + 1) * n] if sharded else own[name]
    return view


def rank_view_of(model: torch.nn.Module, own: dict, total: dict, rank: int) -> dict:
    """:func:`rank_view` for a model after ``expert_parallel``: a parameter under an experts
    module gets the all-ranks gradient (this rank's slice of it when stacked experts were
    sliced), every other one the own-data gradient. Also right for experts kept as a list of
    modules, whose kept entries keep their full shapes and their global names."""
    from fxoverlap.expert_parallel import find_experts

    prefixes = tuple(f"{name}." for name, _ in find_experts(model))
    view = {}
    for name, p in model.named_parameters():
        if name not in total:  # no gradient in the reference (requires_grad=False: Ernie's moe_statics)
            continue
        if not name.startswith(prefixes):
            view[name] = own[name]
            continue
        n = p.shape[0] if p.dim() else 0
        view[name] = total[name][rank * n: (rank + 1) * n] if p.dim() and n != total[name].shape[0] else total[name]
    return view


def rel(got: dict, want: dict) -> dict:
    """Per parameter: max|got - want| / max|want| (inf for a missing gradient)."""
    out = {}
    for name, w in want.items():
        g = got.get(name)
        diff = float("inf") if g is None else (g.double() - w.double()).abs().max().item()
        out[name] = diff / max(w.double().abs().max().item(), 1e-30)
    return out


def _loss_rel(got, want) -> float:
    return max(abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(got, want))


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters()}


def _result(model, losses, ref_losses, want: dict, full) -> dict:
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return dict(rel=rel(_grads(model), want), loss_rel=_loss_rel(losses, ref_losses),
                sharded={n: (tuple(full.get_parameter(n).shape), s) for n, s in shapes.items()
                         if s != tuple(full.get_parameter(n).shape)})


def families_on_two_ranks(rank: int, world: int, families: list[str], dtypes: list[str]) -> dict:
    """For each family and dtype: expert_parallel in eager and through fxoverlap.optimize vs the unsharded model."""
    group = dist.group.WORLD
    out = {}
    for family in families:
        for dtype_name in dtypes:
            t0 = time.perf_counter()
            full = build(family, getattr(torch, dtype_name))
            ref_losses, own, total = reference(full, rank, world)
            eager = fxoverlap.expert_parallel(copy.deepcopy(full), group)
            optimized = copy.deepcopy(eager)  # a deep copy of a sharded model shares its group
            losses = eager_losses(eager, batches(rank))
            shapes = {n: tuple(p.shape) for n, p in eager.named_parameters()}
            want = rank_view(own, total, shapes, rank)
            row = {"expert_params": sorted(n for n, _ in full.named_parameters() if ".experts." in n),
                   "names_equal": sorted(shapes) == sorted(n for n, _ in full.named_parameters()),
                   "eager": _result(eager, losses, ref_losses, want, full)}
            engine = fxoverlap.optimize(optimized, group)
            losses = engine.forward_backward(batches(rank), loss_fn=next_token_loss)
            row["optimize"] = dict(_result(optimized, losses, ref_losses, want, full),
                                   stages=[s.name for s in engine.stages])
            if dtype_name == "float32":
                row["backend"] = _through_backend(fxoverlap.expert_parallel(copy.deepcopy(full), group),
                                                  rank, ref_losses, want, full)
            if dtype_name != "float32":
                # fp32 math on the same (bf16-valued) weights: the unsharded bf16 model's own
                # distance from it is the scale of bf16 rounding noise the EP result is judged by.
                ref32_losses, own32, total32 = reference(copy.deepcopy(full).float(), rank, world)
                want32 = rank_view(own32, total32, shapes, rank)
                row["bf16_noise"] = dict(rel=rel(want, want32), loss_rel=_loss_rel(ref_losses, ref32_losses))
                for kind, model in (("eager", eager), ("optimize", optimized)):
                    row[kind]["vs_fp32"] = rel(_grads(model), want32)
            row["seconds"] = time.perf_counter() - t0
            out[f"{family}/{dtype_name}"] = row
    out["indivisible"] = _indivisible_error(group)
    return out


def families_inductor_on_two_ranks(rank: int, world: int, families: list[str]) -> dict:
    """For each family, fp32: ``expert_parallel`` + ``fxoverlap.optimize`` with Inductor-compiled
    stages vs the unsharded eager model; the loss difference is absolute (Inductor's kernels sum in
    other orders). With the layout debug check on (``FXOVERLAP_CHECK_LAYOUTS``)."""
    import os

    from fxoverlap.runtime import CHECK_LAYOUTS_ENV

    os.environ[CHECK_LAYOUTS_ENV] = "1"
    group = dist.group.WORLD
    out = {}
    for family in families:
        full = build(family)
        ref_losses, own, total = reference(full, rank, world)
        model = fxoverlap.expert_parallel(copy.deepcopy(full), group)
        want = rank_view_of(model, own, total, rank)
        engine = fxoverlap.optimize(model, group, fxoverlap.OverlapConfig(compiler="inductor", progress=False))
        losses = engine.forward_backward(batches(rank), loss_fn=next_token_loss)
        out[family] = dict(rel=rel(_grads(model), want),
                           loss_abs=max(abs(a.item() - b.item()) for a, b in zip(losses, ref_losses)),
                           runs_as={s.name: s.runs_as for s in engine.stages})
        engine.close()
    return out


def _through_backend(model, rank: int, ref_losses, want: dict, full) -> dict:
    """``torch.compile(model, backend="fxoverlap")``, ``loss.backward()`` per microbatch."""
    import warnings

    import fxoverlap.backend as fxb

    torch._dynamo.reset()
    fxb.reset()
    compiled = torch.compile(model, backend="fxoverlap")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fxb.FallbackWarning)
        losses = eager_losses(compiled, batches(rank))
    stages = [s.name for s in fxb.last_stages()]
    fxb.reset()
    torch._dynamo.reset()
    return dict(_result(model, losses, ref_losses, want, full), stages=stages,
                fallbacks=[str(w.message) for w in caught if issubclass(w.category, fxb.FallbackWarning)])


def _indivisible_error(group) -> str:
    model = build("qwen3_moe", num_experts=3)
    try:
        fxoverlap.expert_parallel(model, group)
    except ValueError as e:
        return str(e)
    return "no error"
