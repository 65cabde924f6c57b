"""Workers and helpers for the activation-checkpointing tests (spawned ranks import this by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.ir.stage import COMM_KINDS, Direction
from fxoverlap.testing import grad_diff
from numerics_cases import eager_grads, make_batches
from test_memory import stage_bytes

# 4 layers (one dense): one layer's replay is a fraction of the step's activations, as in
# real depths; dim above vocab, so the head does not dominate the activations
MOE = dict(n_layers=4, dim=64, n_heads=2, n_experts=4, expert_dim=32, vocab_size=64,
           layer_pattern=("moe", "dense", "moe", "moe"))
MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                     torch.ops.fxoverlap.grouped_mm.default})
_sac_kept: dict[int, int] | None = None  # while eager_saved_bytes runs: what the policy saves


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective AC: save the outputs of matmuls, recompute the rest."""
    if op not in MATMULS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if _sac_kept is not None and not ctx.is_recompute:
        key, nbytes = _policy_output_bytes(ctx, op, args, kwargs)
        _sac_kept[key] = nbytes
    return CheckpointPolicy.MUST_SAVE


def _policy_output_bytes(ctx, op, args: tuple, kwargs: dict) -> tuple[object, int]:
    """(a key, the bytes) of the storage of the output of ``op``, which the policy saves.
    torch 2.13 calls the policy after the op, with its output (``ctx.op_output``): its storage,
    keyed by address as eager_saved_bytes keys what autograd packs. torch 2.11 calls it before
    the op runs (no ``op_output``): the output's size from the op run on meta copies of its
    inputs; a matmul's output is a fresh contiguous tensor, so its storage is exactly that
    size, and it is no storage autograd packs (checkpoint's own hooks take those over), so a
    key of its own counts it once."""
    if hasattr(ctx, "op_output"):  # torch 2.13
        s = ctx.op_output.untyped_storage()
        return s.data_ptr(), s.nbytes()
    from torch.utils._pytree import tree_map_only

    out = op(*tree_map_only(torch.Tensor, lambda t: t.to("meta"), args),
             **tree_map_only(torch.Tensor, lambda t: t.to("meta"), kwargs))
    return ("policy output", len(_sac_kept)), out.untyped_storage().nbytes()


def checkpoint_layers(model: nn.Module, policy=None) -> nn.Module:
    """Wrap every decoder layer in ``checkpoint_wrapper`` (non-reentrant), as torchtitan's
    apply_ac does; with ``policy``, selective AC (``create_selective_checkpoint_contexts``)."""
    kw = {} if policy is None else dict(context_fn=lambda: create_selective_checkpoint_contexts(policy))
    for name, layer in list(model.layers.named_children()):
        model.layers.register_module(name, checkpoint_wrapper(layer, **kw))
    return model


def eager_saved_bytes(model: nn.Module, batch) -> int:
    """Bytes of the activations eager autograd keeps for the backward of one microbatch:
    distinct storages packed by saved-tensor hooks (parameters and buffers left out), plus
    what a selective policy caches. Inside a checkpoint its own hooks take over: what it
    keeps is its inputs (and the policy's saved outputs)."""
    global _sac_kept
    static = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in static:
            kept[s.data_ptr()] = s.nbytes()
        return t

    _sac_kept = kept
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(*batch)
    finally:
        _sac_kept = None
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(kept.values())


def comm_saved_bytes(engine, model, mbs) -> int:
    """Bytes of the all-to-all outputs (forward comm stages) the backward reads: what the
    program keeps under AC that eager replays by communicating again."""
    cap = engine.plan(mbs).capture
    comm_out = {v for s in engine.stages if s.direction is Direction.FWD and s.kind in COMM_KINDS for v in s.outputs}
    bwd_in = {v for s in engine.stages if s.direction is Direction.BWD for v in s.inputs}
    return stage_bytes(engine.stages, cap, model, mbs[:1], only=comm_out & bwd_in)[0]


def run_case(model: nn.Module, rank: int, vocab: int, ns: list[int], **config) -> list[dict]:
    """optimize vs eager (the same model, so the same AC) per microbatch count, with memory."""
    engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(record_memory=True, **config))
    rows = []
    for n in ns:
        mbs = make_batches(rank, vocab, n, seed=n)
        ref_losses, ref = eager_grads(model, mbs)
        losses = engine.forward_backward(mbs)
        diff, scale, bitwise = grad_diff(model, ref)
        model.zero_grad(set_to_none=True)
        cap = engine.plan(mbs).capture
        rows.append(dict(
            n=n, exact=bitwise and all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), diff=diff, scale=scale,
            peak=max(b for _, _, b in engine.memory_trace),
            saved=stage_bytes(engine.stages, cap, model, mbs[:1])[0],
            eager_saved=eager_saved_bytes(model, mbs[0]),
            comm_saved=comm_saved_bytes(engine, model, mbs),
            stages=[(s.name, s.kind.value) for s in engine.stages],
        ))
    return rows


def two_ranks(rank: int, world: int, models: tuple[str, ...] = ("moe", "titan")) -> dict[str, list[dict]]:
    """The 2-rank cases of ``models`` in one spawn: the reference MoE model (``moe``) without AC,
    with full AC (MoEConfig.activation_checkpoint) and with selective AC (checkpoint_wrapper,
    matmuls saved); the torchtitan-style model (``titan``) with full and selective AC."""
    from titan_models import TitanTransformer

    out = {}
    full = dict(activation_checkpoint=True)
    replay = dict(ac_replay_comm=True)
    for name, kw, policy, config in (("moe/none", {}, None, {}), ("moe/full", full, None, {}),
                                     ("moe/full/replay", full, None, replay), ("moe/matmuls", {}, save_matmuls, {})):
        if "moe" not in models:
            break
        torch.manual_seed(0)
        model = MoETransformer(MoEConfig.tiny(**MOE, **kw), dist.group.WORLD)
        if policy is not None:
            checkpoint_layers(model, policy)
        out[name] = run_case(model, rank, MOE["vocab_size"], [1, 3] if name.startswith("moe/full") else [3], **config)
    for name, policy, config in (("titan/none", None, {}), ("titan/full", None, {}),
                                 ("titan/full/replay", None, replay), ("titan/matmuls", save_matmuls, {})):
        if "titan" not in models:
            break
        torch.manual_seed(0)
        model = TitanTransformer(dist.group.WORLD)
        if name != "titan/none":
            checkpoint_layers(model, policy)
        out[name] = run_case(model, rank, 64, [2], **config)
    return out


def crossing_bytes(stages) -> int:
    """Bytes of the values forward stages hand backward stages (each value once, from its
    traced shape): what a step keeps for its backward, as the stage graphs say."""
    produced = {v for s in stages if s.direction is Direction.FWD for v in s.outputs}
    sizes: dict[str, int] = {}
    for s in stages:
        if s.direction is Direction.BWD:
            for ph in s.graph_module.graph.find_nodes(op="placeholder"):
                val = ph.meta.get("val")
                if ph.target in produced and isinstance(val, torch.Tensor):
                    sizes[ph.target] = val.numel() * val.element_size()
    return sum(sizes.values())
