"""Workers for the ZeRO-3 tests (``OverlapConfig(shard_params=True)``): 4 gloo ranks, EP 2 x DP 2
(spawned ranks import this module); the layout and references of ``dp_cases``.

The reference trains an unsharded copy of the model in eager: backward over the microbatches,
the gradients reduced by hand parameter by parameter (``dp_cases.reduce_by_hand``), the same
optimizer on every full parameter. The engine's model holds DTensor shards; its parameters are
compared by ``full_tensor()``.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

import fxoverlap
from dp_cases import groups, is_expert, make_model, reduce_by_hand
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.param_shard import gathered_bytes
from fxoverlap.ir.program import program_of, reshard, unshard, wait_unshard
from fxoverlap.testing import eager_steps, take_grads
from numerics_cases import make_batches


def _full(p: torch.Tensor) -> torch.Tensor:
    """The tensor as this rank's model reads it: a DTensor's full tensor, of an expert parameter
    (over the ("ep", "edp") mesh: every EP rank's experts) this EP rank's rows."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p
    full = p.full_tensor()
    mesh = p.device_mesh
    if mesh.ndim == 2:
        rows = full.shape[0] // mesh.size(0)
        e = mesh.get_local_rank(0)
        return full[e * rows:(e + 1) * rows]
    return full


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {k: _full(p.grad).clone() for k, p in model.named_parameters() if p.grad is not None}


def _worst(model, ref_model) -> float:
    ref = dict(ref_model.named_parameters())
    return max((_full(p.detach()) - ref[k].detach()).abs().max().item() for k, p in model.named_parameters())


def placement(program) -> dict:
    """Where the program gathers and drops each unit, from its node order."""
    nodes = [n for n in program.graph.nodes if n.op in ("call_module", "call_function")]
    ahead, per_unit, open_, bad = [], {}, {}, []
    stage_pos = [i for i, n in enumerate(nodes) if n.op == "call_module"]
    for i, n in enumerate(nodes):
        if n.target is unshard:
            open_[n.args[0]] = i
            per_unit.setdefault(n.args[0], [0, 0])[0] += 1
        elif n.target is wait_unshard:
            start = open_.get(n.args[0])
            if start is None:
                bad.append(f"wait before unshard of unit {n.args[0]}")
                continue
            # stages issued between the gather and its wait: what it hides under
            ahead.append(sum(1 for j in stage_pos if start < j < i))
        elif n.target is reshard:
            open_.pop(n.args[0], None)
            per_unit.setdefault(n.args[0], [0, 0])[1] += 1
    return dict(ahead=ahead, per_unit=per_unit, bad=bad, peak=program_of(program).gathered_peak,
                units=[(u.name, u.role, [p.fqn for p in u.params]) for u in program_of(program).units])


def _model(ep, ac: bool = False):
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32, activation_checkpoint=ac)
    return MoETransformer(cfg, ep), cfg.vocab_size


def train(rank: int, world: int, delay: bool = False, chunks: int = 1, ac: bool = False, steps: int = 2,
          n: int = 3) -> dict:
    """``steps`` optimizer steps, the engine (ZeRO-3) against eager + manual reduction."""
    ep, edp = groups()
    ref_model, vocab = _model(ep, ac)
    model, _ = _model(ep, ac)
    cfg = fxoverlap.OverlapConfig(shard_params=True, delay_wgrad=delay, chunks=chunks, reduce_bucket_mb=0,
                                  record_memory=True)
    engine = fxoverlap.optimize(model, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built before the shards: retargeted
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    out = dict(grad_diff=[], param_diff=[], scale=max(p.abs().max().item() for p in ref_model.parameters()))
    for step in range(steps):
        mbs = make_batches(rank, vocab, n, seed=20 + step)
        eager_steps(ref_model, mbs)
        ref = reduce_by_hand(take_grads(ref_model), edp)
        engine.forward_backward(mbs)
        got = _full_grads(model)
        out["grad_diff"].append({
            "expert": max((got[k] - ref[k]).abs().max().item() for k in ref if is_expert(k)),
            "dense": max((got[k] - ref[k]).abs().max().item() for k in ref if not is_expert(k)),
            "missing": sorted(ref.keys() - got.keys())})
        for k, p in ref_model.named_parameters():
            p.grad = ref[k]
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["param_diff"].append(_worst(model, ref_model))
    out["placement"] = placement(engine.program)
    out["types"] = sorted({type(p).__name__ for p in model.parameters()})
    out["stages"] = [n.target for n in engine.program.graph.nodes if n.op == "call_module"]
    return out


def memory(rank: int, world: int, n: int = 3) -> dict:
    """Parameter bytes per rank: the shards held between steps, the gathered units at the peak
    of a step, and whether each drop freed its unit (nothing else kept its tensors)."""
    ep, edp = groups()
    model, vocab = _model(ep)
    full = {k: p.numel() * p.element_size() for k, p in model.named_parameters()}
    engine = fxoverlap.optimize(model, ep, fxoverlap.OverlapConfig(shard_params=True), dp_group=dist.group.WORLD,
                                expert_dp_group=edp)
    mbs = make_batches(rank, vocab, n)
    engine.plan(mbs)
    sharding = engine.sharding
    sharding.trace = []
    engine.forward_backward(mbs)
    units = program_of(engine.program).units
    unit_bytes = sorted((gathered_bytes(u) for u in units), reverse=True)
    return dict(
        held=sharding.local_bytes(model),
        expected=sum(b // (2 if is_expert(k) else 4) for k, b in full.items()),
        full=sum(full.values()),
        peak_gathered=sharding.peak_bytes,
        bound=sum(unit_bytes[:program_of(engine.program).gathered_peak]),
        largest_unit=unit_bytes[0],
        kept_alive=[(units[u].name, alive) for ev, u, _, alive in sharding.trace if ev == "drop" and alive],
        drops=sum(1 for ev, *_ in sharding.trace if ev == "drop"),
        gathers=sum(1 for ev, *_ in sharding.trace if ev == "gather"),
        live_after=sharding.live_bytes)


def _shared_dir() -> str:
    path = [tempfile.mkdtemp(prefix="fxoverlap_zero3_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def checkpoint(rank: int, world: int, n: int = 2) -> dict:
    """DCP save after one step and load into a fresh engine: the resumed second step equals the
    uninterrupted one (parameters bitwise); ``model.state_dict()`` holds DTensors whose full
    tensors equal the reference model's; ``forward_only`` (a second capture, of the sharded model)
    equals eager's forward."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ep, edp = groups()

    def fresh():
        model, vocab = _model(ep)
        engine = fxoverlap.optimize(model, ep, fxoverlap.OverlapConfig(shard_params=True), dp_group=dist.group.WORLD,
                                    expert_dp_group=edp)
        return model, vocab, engine

    model, vocab, engine = fresh()
    batches = [make_batches(rank, vocab, n, seed=40 + s) for s in range(2)]
    engine.plan(batches[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_model, _ = _model(ep)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    out = {}
    path = _shared_dir()
    for step, mbs in enumerate(batches):
        engine.forward_backward(mbs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        eager_steps(ref_model, mbs)
        for k, g in reduce_by_hand(take_grads(ref_model), edp).items():
            dict(ref_model.named_parameters())[k].grad = g
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        if step == 0:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    sd = model.state_dict()
    out["state_dict_types"] = sorted({type(v).__name__ for v in sd.values()})
    ref_sd = ref_model.state_dict()
    out["state_dict_vs_eager"] = max((_full(v) - ref_sd[k]).abs().max().item() for k, v in sd.items())
    # resume: a fresh model and engine, sharded by plan, loaded from the step-0 checkpoint
    model2, _, engine2 = fresh()
    engine2.plan(batches[0])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model2, opt2)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    engine2.forward_backward(batches[1])
    opt2.step()
    mine = dict(model.named_parameters())
    out["resumed_bitwise"] = all(torch.equal(_full(p.detach()), _full(mine[k].detach()))
                                 for k, p in model2.named_parameters())
    out["resumed_vs_eager"] = _worst(model2, ref_model)
    out["uninterrupted_vs_eager"] = _worst(model, ref_model)
    out["expert_global_shape"] = tuple(dict(model.named_parameters())["layers.0.moe.experts.w1"].shape)
    # forward only on the sharded model (captured anew, the shards traced as full parameters)
    with torch.no_grad():
        want = [ref_model(*mb) for mb in batches[0]]
    got = engine.forward_only(batches[0])
    out["forward_only"] = max((g - w).abs().max().item() for g, w in zip(got, want))
    out["eval_scale"] = max(w.abs().max().item() for w in want)
    return out


def errors(rank: int, world: int) -> dict:
    """Inputs ZeRO-3 cannot take: named errors, before any step runs."""
    ep, edp = groups()
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as e:  # noqa: BLE001 (the test reads the type and message)
            out[name] = f"{type(e).__name__}: {e}"

    cfg = fxoverlap.OverlapConfig(shard_params=True)
    model, vocab = _model(ep)
    attempt("no_dp_group", lambda: fxoverlap.optimize(model, ep, cfg))

    def fsdp():
        from torch.distributed.fsdp import fully_shard

        m, _ = _model(ep)
        fully_shard(m.layers[0])
        fxoverlap.optimize(m, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp)

    attempt("fully_shard", fsdp)

    def odd():
        m, vocab = _model(ep)
        m.odd = torch.nn.Parameter(torch.ones(3))  # 3 rows over 4 ranks
        fxoverlap.optimize(m, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp).plan(
            make_batches(rank, vocab, 1))

    attempt("not_divisible", odd)

    def stepped():
        m, vocab = _model(ep)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        fxoverlap.optimize(m, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp).plan(make_batches(rank, vocab, 1))

    attempt("optimizer_stepped_before", stepped)
    return out


def accumulation(rank: int, world: int) -> dict:
    """Two calls with no zero_grad between: the DTensor gradients hold the sum of each call's
    reduced gradients (eager + manual reduction per call, added); a tensor hook on a sharded
    parameter is refused (its local gradient never passes through it)."""
    ep, edp = groups()
    ref_model, vocab = _model(ep)
    model, _ = _model(ep)
    engine = fxoverlap.optimize(model, ep, fxoverlap.OverlapConfig(shard_params=True), dp_group=dist.group.WORLD,
                                expert_dp_group=edp)
    total = None
    for c in range(2):
        mbs = make_batches(rank, vocab, 2, seed=70 + c)
        eager_steps(ref_model, mbs)
        ref = reduce_by_hand(take_grads(ref_model), edp)
        total = ref if total is None else {k: total[k] + ref[k] for k in ref}
        engine.forward_backward(mbs)
    got = _full_grads(model)
    out = dict(diff=max((got[k] - total[k]).abs().max().item() for k in total),
               scale=max(g.abs().max().item() for g in total.values()))
    next(model.parameters()).register_hook(lambda g: g)
    try:
        engine.forward_backward(make_batches(rank, vocab, 1))
        out["hook"] = None
    except Exception as e:  # noqa: BLE001 (the test reads the type and message)
        out["hook"] = f"{type(e).__name__}: {e}"
    return out


# (delay_wgrad, chunks, user AC): the default suite runs two, CI's slow step the other two
DEFAULT_TRAIN = ((False, 1, False), (True, 1, True))
SLOW_TRAIN = ((True, 1, False), (False, 2, False))


def everything(rank: int, world: int, cases=DEFAULT_TRAIN, rest: bool = True) -> dict:
    """One 4-rank spawn for the ZeRO-3 tests: the training ``cases`` and, with ``rest``, the others."""
    out = dict(train={f"delay={d},chunks={c},ac={a}": train(rank, world, d, c, a) for d, c, a in cases})
    if rest:
        out.update(memory=memory(rank, world), checkpoint=checkpoint(rank, world), errors=errors(rank, world),
                   accumulation=accumulation(rank, world))
    return out


def program_lines(rank: int, world: int, n: int = 3, delay: bool = False) -> list[str]:
    """The program's stage calls and unit nodes (rank 0's), for reading and snapshots."""
    ep, edp = groups()
    model, vocab = make_model("moe", ep)
    cfg = fxoverlap.OverlapConfig(shard_params=True, reduce_bucket_mb=0, delay_wgrad=delay)
    engine = fxoverlap.optimize(model, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp)
    program = engine.plan(make_batches(rank, vocab, n)).program
    names = {u.index: u.name for u in program_of(program).units}
    out = []
    for node in program.graph.nodes:
        if node.op == "call_module":
            out.append(f"  {node.target}")
        elif node.target in (unshard, wait_unshard, reshard):
            out.append(f"{node.target.__name__}({names[node.args[0]]})")
    return out


def hugging_face(rank: int, world: int, family: str = "qwen3_moe") -> dict:
    """A transformers model through expert_parallel: ZeRO-3's gradients against the unsharded
    in-program reduction's (``grad_reduce="all_reduce"``, itself tested against eager), and the
    units its parameters fall into."""
    import copy

    import hf_cases

    ep, edp = groups()
    full = hf_cases.build(family)
    mbs = hf_cases.batches(rank, n=2)
    out = {}
    grads = {}
    for name, cfg in (("all_reduce", fxoverlap.OverlapConfig()), ("zero3", fxoverlap.OverlapConfig(shard_params=True))):
        model = fxoverlap.expert_parallel(copy.deepcopy(full), ep)
        engine = fxoverlap.optimize(model, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp)
        out[f"{name}_losses"] = [x.item() for x in engine.forward_backward(mbs, loss_fn=hf_cases.next_token_loss)]
        grads[name] = _full_grads(model)
        if name == "zero3":
            out["units"] = [(u.name, u.role, len(u.params)) for u in program_of(engine.program).units]
    ref, got = grads["all_reduce"], grads["zero3"]
    out["missing"] = sorted(ref.keys() ^ got.keys())
    out["diff"] = max((got[k] - ref[k]).abs().max().item() for k in ref.keys() & got.keys())
    out["scale"] = max(g.abs().max().item() for g in ref.values())
    return out
