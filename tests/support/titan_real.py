"""torchtitan 0.3.0's own Qwen3-MoE and DeepSeek-V3, tiny, and the workers of ``test_torchtitan.py``.

The models are torchtitan's classes built by torchtitan's own layer builders, with
small sizes. What differs from torchtitan's shipped configs, and why:

- attention is ``ScaledDotProductAttention`` (FlexAttention, the shipped default,
  has no CPU backward);
- sharding configs are set with the model's ``set_*_sharding_config`` (what its
  ``Config.update_from_config`` calls; that method imports torchtitan's trainer,
  which needs torchdata, datasets and more that the models themselves do not);
- torchtitan's ``ParallelDims`` builds its mesh for a CUDA device type when no
  accelerator is found; the 2-rank worker points it at ``"cpu"``
  (``torchtitan.distributed.parallel_dims.device_type``), as a test-side patch.

Expert parallelism is torchtitan's: ``model.parallelize(ParallelDims(ep=2,
spmd_backend="partial_dtensor"))`` makes the expert weights ``DTensor``s
(``Shard(0)``) and routes tokens with its ``AllToAllTokenDispatcher``. Spawned ranks
import this module by name.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxoverlap
from fxoverlap.passes.capture import CaptureError
from fxoverlap.testing import token_batches

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()

VOCAB = 64
_INIT = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
_EXPERTS_INIT = {k: partial(nn.init.normal_, std=0.02) for k in ("w1_EFD", "w2_EDF", "w3_EFD")}
_NORM_INIT = {"weight": nn.init.ones_}


def _sdpa(layers: list) -> list:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def qwen3_moe_config(n_layers: int = 2, dim: int = 32, experts: int = 4, top_k: int = 2):
    """Qwen3-MoE (GQA with QK norm, softmax top-k router with route norm, no shared expert)."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    layers = qwen3._build_qwen3_moe_layers(
        n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=8, moe_hidden_dim=16,
        num_experts=experts, top_k=top_k, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=8, max_seq_len=64, theta=1e6))
    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_INIT),
        layers=_sdpa(layers))


def deepseek_v3_config(n_layers: int = 3, dim: int = 32, experts: int = 4, top_k: int = 2):
    """DeepSeek-V3 (MLA, a dense first layer, then MoE layers with a shared expert)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers

    layers = build_mla_moe_layers(
        n_layers=n_layers, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mscale=0.70, dense_hidden_dim=64,
        moe_hidden_dim=16, num_experts=experts, num_shared_experts=1, router_top_k=top_k,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, linear_init=_INIT, norm_init=_NORM_INIT,
        depth_init=lambda layer_id: _INIT, depth_experts_init=lambda layer_id: _EXPERTS_INIT,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=32))
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_INIT),
        layers=_sdpa(layers))


CONFIGS = {"qwen3_moe": qwen3_moe_config, "deepseek_v3": deepseek_v3_config}


def build(family: str, ep: int = 1, seed: int = 0, experts: int = 4) -> nn.Module:
    """A torchtitan model in training mode, initialised from ``seed``; with ``ep > 1`` (every
    rank of the default group in one EP group) parallelized by torchtitan itself."""
    cfg = CONFIGS[family](experts=experts)
    if ep > 1:
        import torchtitan.distributed.parallel_dims as parallel_dims
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as titan_dist

        if family == "qwen3_moe":
            from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config as set_sharding
        else:
            from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config as set_sharding
        set_sharding(cfg, enable_sp=False, enable_ep=True)
        titan_dist.set_spmd_backend("partial_dtensor")  # what torchtitan's Trainer does from its config
        parallel_dims.device_type = "cpu"  # torchtitan falls back to "cuda" without an accelerator
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    if ep > 1:
        world = dist.get_world_size()
        model.parallelize(ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=ep, world_size=world,
                                       spmd_backend="partial_dtensor"))
    return model.train()


def next_token_loss(logits, tokens: torch.Tensor) -> torch.Tensor:
    if isinstance(logits, list):  # DeepSeek-V3's MTPDecoder returns [main logits, *mtp logits]
        logits = logits[0]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def batches(rank: int, n: int, shape=(2, 16)) -> list[tuple[torch.Tensor]]:
    """This rank's microbatches: tokens only (the loss predicts each next token)."""
    return [(tokens,) for tokens, _ in token_batches(VOCAB, n, shape, seed=100 + rank)]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def compare(model: nn.Module, eager: nn.Module) -> dict:
    """Every gradient and buffer of ``model`` against ``eager``'s: bitwise, and of the same kind
    (for a DTensor: the same mesh and placements)."""
    ref = dict(eager.named_parameters())
    grads = {}
    for name, p in model.named_parameters():
        g, r = p.grad, ref[name].grad
        if g is None or r is None:
            grads[name] = f"missing: fxoverlap {g is None}, eager {r is None}"
            continue
        kind = (type(g).__name__, str(getattr(g, "placements", "")), getattr(g, "device_mesh", None) is
                getattr(r, "device_mesh", None))
        kind_ref = (type(r).__name__, str(getattr(r, "placements", "")), True)
        same = kind == kind_ref and g.shape == r.shape and torch.equal(_local(g), _local(r))
        grads[name] = True if same else f"{kind} vs eager {kind_ref}"
    ref_buf = dict(eager.named_buffers())
    buffers = {name: torch.equal(_local(b), _local(ref_buf[name])) for name, b in model.named_buffers()}
    counted = {name: float(_local(b).sum()) for name, b in model.named_buffers() if "tokens_per_expert" in name}
    dtensor_grads = sorted(n for n, p in model.named_parameters() if type(p.grad).__name__ == "DTensor")
    return dict(grads=grads, buffers=buffers, counted=counted, dtensor_grads=dtensor_grads)


def comm_placement(engine) -> dict:
    """Where the all-to-alls are: per stage kind, and any stage outside dispatch/combine that has one."""
    per_stage = {s.name: sum(o.endswith("all_to_all_single") for o in s.op_list()) for s in engine.stages}
    kinds = {s.name: str(s.kind) for s in engine.stages}
    return dict(misplaced={n: c for n, c in per_stage.items() if c and kinds[n] not in ("dispatch", "combine")},
                comm_stages={n: c for n, c in per_stage.items() if c},
                stages=[(s.name, str(s.kind), str(s.stream)) for s in engine.stages])


def full_activation_checkpointing(model: nn.Module) -> nn.Module:
    """torchtitan's own full activation checkpointing (every decoder layer wrapped)."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    FullAC.Config().build(dump_folder="").apply(model)
    return model


def _eager_math(model: nn.Module, expert_dtype: str | None):
    """What eager runs under to use the experts' math of ``OverlapConfig(expert_dtype=...)``."""
    if expert_dtype is None:
        return contextlib.nullcontext()
    from fxoverlap import fp8_ops, torchtitan_experts

    stack = contextlib.ExitStack()
    stack.enter_context(fp8_ops.expert_math(expert_dtype))
    stack.enter_context(torchtitan_experts.fxoverlap_gemms(model))
    return stack


def train_vs_eager(family: str, ep: int, n: int, rank: int = 0, delay_wgrad: bool = False,
                   wrap=lambda model: model, config: dict | None = None, experts: int = 4) -> dict:
    """``engine.forward_backward`` over ``n`` microbatches vs eager ``loss.backward()`` per
    microbatch, on two copies of the same model built from the same seed (then ``wrap``ped);
    with ``config["expert_dtype"]`` eager runs the same expert math."""
    eager, model = wrap(build(family, ep, experts=experts)), wrap(build(family, ep, experts=experts))
    mbs = batches(rank, n)
    ref_losses = []
    with _eager_math(eager, (config or {}).get("expert_dtype")):
        for mb in mbs:
            loss = next_token_loss(eager(*mb), *mb)
            loss.backward()
            ref_losses.append(loss.detach())
    group = dist.group.WORLD if ep > 1 else None
    engine = fxoverlap.optimize(model, group, fxoverlap.OverlapConfig(delay_wgrad=delay_wgrad, **(config or {})))
    losses = engine.forward_backward(mbs, loss_fn=next_token_loss)
    return dict(stage_names=[s.name for s in engine.stages], stage_ops={s.name: s.op_list() for s in engine.stages},
                fp8_loss0=float(losses[0]), losses_equal=[torch.equal(a, b) for a, b in zip(losses, ref_losses)], **compare(model, eager),
                **comm_placement(engine), wgrad_stages=sum(1 for s in engine.stages if s.wgrad_of),
                eager_counted={k: float(_local(b).sum()) for k, b in eager.named_buffers() if "tokens_per_expert" in k})


def forward_only_vs_eager(family: str, ep: int, n: int, rank: int = 0, config: dict | None = None) -> dict:
    """``engine.forward_only`` over ``n`` microbatches (in pairs) vs the model's own forward under
    ``no_grad``, same weights: whether the logits are bitwise, and the program's stage calls."""
    model = build(family, ep)
    mbs = batches(rank, n)
    with torch.no_grad():
        want = [model(*mb) for mb in mbs]
    engine = fxoverlap.optimize(model, dist.group.WORLD if ep > 1 else None, fxoverlap.OverlapConfig(**(config or {})))
    got = engine.forward_only(mbs)
    calls = [n.name for n in engine.program.graph.nodes if n.op == "call_module"]
    return dict(bitwise=all(torch.equal(a, b) for a, b in zip(got, want)), calls=calls)


def local_experts(model: nn.Module) -> nn.Module:
    """Each DTensor parameter (torchtitan's ``Shard(0)`` expert weights under EP) replaced by a plain
    parameter of this rank's shard: the backend takes plain tensors only (it falls back on a
    DTensor graph input; ``optimize`` takes them). torchtitan's experts run either kind, and the
    token dispatcher and its all-to-alls are unchanged."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if hasattr(p, "to_local"):
                setattr(module, name, nn.Parameter(p.to_local().detach().clone()))
    return model


def backend_vs_eager(family: str, n: int, ep: int = 1, rank: int = 0, options: dict | None = None) -> dict:
    """``torch.compile(model, backend="fxoverlap", options=options)`` with ``loss.backward()`` per
    microbatch vs eager on a twin (with ``ep > 1``: both parallelized by torchtitan, then
    :func:`local_experts`), the backward cut into a segment per gradient hand-out."""
    import warnings

    import fxoverlap.backend as fxb

    eager, model = local_experts(build(family, ep)), local_experts(build(family, ep))
    torch._dynamo.reset()
    fxb.reset()
    compiled = torch.compile(model, backend="fxoverlap", options=options or {})
    losses_equal = []
    with warnings.catch_warnings(), _scalar_outputs():
        warnings.simplefilter("error", fxb.FallbackWarning)
        for mb in batches(rank, n):
            ref = next_token_loss(eager(*mb), *mb)
            ref.backward()
            loss = next_token_loss(compiled(*mb), *mb)
            loss.backward()
            losses_equal.append(torch.equal(loss, ref))
    step = fxb.last_compiled()
    return dict(losses_equal=losses_equal, **compare(model, eager), segments=len(step._segments),
                stages=[(s.name, str(s.kind), str(s.stream)) for s in step.stages])


def backend_forward_only(family: str, ep: int, rank: int = 0, options: dict | None = None) -> dict:
    """The backend under ``torch.no_grad()`` (the prefill case) vs the model's own forward under
    ``no_grad``, same weights: whether the logits are bitwise, and the compiled stages."""
    import warnings

    import fxoverlap.backend as fxb

    model = local_experts(build(family, ep))
    mbs = batches(rank, 2)
    torch._dynamo.reset()
    fxb.reset()
    compiled = torch.compile(model, backend="fxoverlap", options=options or {})
    with torch.no_grad(), warnings.catch_warnings(), _scalar_outputs():
        warnings.simplefilter("error", fxb.FallbackWarning)
        want = [_first(model(*mb)) for mb in mbs]
        got = [_first(compiled(*mb)) for mb in mbs]
    return dict(bitwise=all(torch.equal(a, b) for a, b in zip(got, want)),
                stages=[(s.name, str(s.kind), str(s.stream)) for s in fxb.last_stages()])


def _scalar_outputs():
    """Dynamo traces ``.tolist()`` of the split sizes into the graph, as torchtitan's own compile
    sets it (``torchtitan.distributed.compile``); without it EP breaks the graph at each MoE layer."""
    return torch._dynamo.config.patch(capture_scalar_outputs=True)


def _first(logits):
    return logits[0] if isinstance(logits, list) else logits


def fsdp_error(world: int) -> str:
    """What optimize says about a model with FSDP2-wrapped modules."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build("qwen3_moe", world)
    fully_shard(model.layers["0"].attention, mesh=init_device_mesh("cpu", (world,)))
    try:
        fxoverlap.optimize(model, dist.group.WORLD).forward_backward(batches(0, 1), loss_fn=next_token_loss)
    except CaptureError as e:
        return str(e)
    return "no error"


def fp8_chunks(rank: int, world: int, n: int) -> dict:
    """Qwen3 with torchtitan's EP, FP8 experts (their reference math: the CPU has no FP8 GEMM, so
    the device check is waived here, as the tests' ``fp8_here`` fixture does), 2 chunks and the
    delayed weight gradient."""
    from fxoverlap import fp8_ops

    saved, fp8_ops.fp8_unavailable = fp8_ops.fp8_unavailable, lambda device: []
    try:
        return train_vs_eager("qwen3_moe", world, n, rank, delay_wgrad=True,
                              config=dict(expert_dtype="fp8_rowwise", chunks=2))
    finally:
        fp8_ops.fp8_unavailable = saved


def two_ranks(rank: int, world: int, n: int) -> dict:
    """Both families with torchtitan's EP on every rank; Qwen3 also with wgrad stages, and with
    FP8 experts in chunks."""
    return {"qwen3_moe": train_vs_eager("qwen3_moe", world, n, rank),
            "qwen3_moe/fp8_chunks": fp8_chunks(rank, world, n),
            "qwen3_moe/delay_wgrad": train_vs_eager("qwen3_moe", world, n, rank, delay_wgrad=True),
            "deepseek_v3": train_vs_eager("deepseek_v3", world, n, rank),
            "fsdp_error": fsdp_error(world)}
