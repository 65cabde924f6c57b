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
    if "ep" in (mesh.mesh_dim_names or ()):  # experts: ("ep", "edp"), or ("ep",) where no other rank holds them
        rows = full.shape[0] // mesh.size(0)
        e = mesh.get_local_rank("ep")
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


def train(rank: int, world: int, delay: bool = False, chunks: int = 1, ac: bool = False, keep: float = 0.0,
          steps: int = 2, n: int = 3) -> dict:
    """``steps`` optimizer steps, the engine (ZeRO-3) against eager + manual reduction."""
    ep, edp = groups()
    ref_model, vocab = _model(ep, ac)
    model, _ = _model(ep, ac)
    cfg = fxoverlap.OverlapConfig(shard_params=True, delay_wgrad=delay, chunks=chunks, reduce_bucket_mb=0,
                                  record_memory=True, keep_gathered_mb=keep)
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
    unit_bytes = sorted((u.nbytes for u in units), reverse=True)
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


# (delay_wgrad, chunks, user AC)
# (delay_wgrad, chunks, user AC, keep_gathered_mb): the last keeps every unit gathered through the step
TRAIN = ((False, 1, False, 0.0), (True, 1, False, 0.0), (False, 2, False, 0.0), (True, 1, True, 0.0),
         (True, 1, False, float("inf")))


def case_name(delay: bool, chunks: int, ac: bool, keep: float) -> str:
    return f"delay={delay},chunks={chunks},ac={ac}" + (f",keep={keep}" if keep else "")


def everything(rank: int, world: int) -> dict:
    """One 4-rank spawn for the ZeRO-3 tests (CI's slow step): the training cases, memory,
    checkpoint and resume, forward-only, accumulation over calls and hooks, errors."""
    return dict(train={case_name(*c): train(rank, world, *c) for c in TRAIN},
                memory=memory(rank, world), checkpoint=checkpoint(rank, world), errors=errors(rank, world),
                accumulation=accumulation(rank, world))


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


# ---------------------------------------------------------------- edge cases (one slow spawn)


def _tied(ep, ac: bool = False):
    """The tiny model with its output weight the embedding weight (tied by assignment)."""
    model, vocab = _model(ep, ac)
    model.output.weight = model.tok_embeddings.weight
    return model, vocab


def _diff(got: dict, ref: dict) -> dict:
    keys = ref.keys() & got.keys()
    return dict(expert=max([(got[k] - ref[k]).abs().max().item() for k in keys if is_expert(k)], default=0.0),
                dense=max([(got[k] - ref[k]).abs().max().item() for k in keys if not is_expert(k)], default=0.0),
                missing=sorted(ref.keys() - got.keys()), extra=sorted(got.keys() - ref.keys()))


def compare_steps(rank: int, make, ep, edp, dp=None, steps: int = 2, n: int = 2, before=None, ctx=None,
                  ref_dtype=None, shard: bool = True, **cfg_kw) -> dict:
    """``steps`` SGD steps of a ZeRO-3 engine against eager + manual reduction on a copy made by
    ``make(ep)``; ``before(step, model, ref_model)`` runs ahead of each step on both models;
    ``ctx()``: a context both run under (autocast); ``ref_dtype``: the reference reduction's dtype."""
    import contextlib

    dp = dist.group.WORLD if dp is None else dp
    ref_model, vocab = make(ep)
    model, _ = make(ep)
    engine = fxoverlap.optimize(model, ep, fxoverlap.OverlapConfig(shard_params=shard, **cfg_kw), dp_group=dp,
                                expert_dp_group=edp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ctx = ctx or contextlib.nullcontext
    out = dict(grad_diff=[], param_diff=[], scale=max(p.abs().max().item() for p in ref_model.parameters()),
               grad_scale=[])
    for step in range(steps):
        if before is not None:
            before(step, model, ref_model)
        mbs = make_batches(rank, vocab, n, seed=50 + step)
        with ctx():
            eager_steps(ref_model, mbs)
        local = take_grads(ref_model, ref_dtype)
        ref = {k: g.to(p.dtype) for (k, g), p in zip(reduce_by_hand(local, edp).items(),
                                                     (dict(ref_model.named_parameters())[k] for k in local))}
        with ctx():
            engine.forward_backward(mbs)
        got = _full_grads(model)
        out["grad_diff"].append(_diff({k: v.float() for k, v in got.items()}, {k: v.float() for k, v in ref.items()}))
        out["grad_scale"].append(max(g.float().abs().max().item() for g in ref.values()))
        params = dict(ref_model.named_parameters())
        for k, g in ref.items():
            params[k].grad = g
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["param_diff"].append(_worst(model, ref_model))
    out["units"] = [(u.name, u.role, [p.fqn for p in u.params]) for u in program_of(engine.program).units]
    out["types"] = {k: type(p).__name__ for k, p in model.named_parameters()}
    out["engine"], out["model"], out["ref_model"] = engine, model, ref_model
    return out


def _strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("engine", "model", "ref_model")}


def edge_tied(rank: int, world: int) -> dict:
    ep, edp = groups()
    row = compare_steps(rank, _tied, ep, edp)
    model, ref_model = row["model"], row["ref_model"]
    sd, ref_sd = model.state_dict(), ref_model.state_dict()
    row["state_dict_keys"] = sorted(sd.keys() ^ ref_sd.keys())
    row["state_dict_vs_eager"] = max((_full(v) - ref_sd[k]).abs().max().item() for k, v in sd.items())
    row["still_tied"] = model.output.weight is model.tok_embeddings.weight
    return _strip(row)


def edge_tied_all_reduce(rank: int, world: int) -> dict:
    """Tied weights under the unsharded in-program reduction (the two slots' gradients of one tensor)."""
    ep, edp = groups()
    return _strip(compare_steps(rank, _tied, ep, edp, shard=False))


def edge_frozen(rank: int, world: int) -> dict:
    """A parameter frozen from the start (dense) and others frozen after the first step (an
    expert one and the final norm: the program key changes, the sharded model is captured anew)."""
    ep, edp = groups()

    def before(step, *models):
        for m in models:
            named = dict(m.named_parameters())
            if step == 0:
                named["layers.0.attention.wq.weight"].requires_grad_(False)
            if step == 1:
                named["layers.1.moe.experts.w1"].requires_grad_(False)
                named["norm.weight"].requires_grad_(False)

    return _strip(compare_steps(rank, _model, ep, edp, steps=3, before=before))


def edge_eval_train(rank: int, world: int) -> dict:
    """train step, eval forward, train step in one loop."""
    ep, edp = groups()
    evals = []

    def before(step, model, ref_model):
        if step == 1:
            engine = state["engine"]
            mbs = make_batches(rank, 256, 2, seed=99)
            model.eval(), ref_model.eval()
            with torch.no_grad():
                want = [ref_model(*mb) for mb in mbs]
            got = engine.forward_only(mbs)
            evals.append(max((g - w).abs().max().item() for g, w in zip(got, want)))
            model.train(), ref_model.train()

    state = {}
    import functools

    # the engine is made inside compare_steps: reach it through optimize
    orig = fxoverlap.optimize

    def grab(*a, **k):
        state["engine"] = orig(*a, **k)
        return state["engine"]

    fxoverlap.optimize = grab
    try:
        row = compare_steps(rank, _model, ep, edp, steps=3, before=before)
    finally:
        fxoverlap.optimize = orig
    row["eval_diff"] = evals
    return _strip(row)


def edge_autocast(rank: int, world: int) -> dict:
    ep, edp = groups()
    return _strip(compare_steps(rank, _model, ep, edp, ctx=lambda: torch.autocast("cpu", dtype=torch.bfloat16)))


def edge_bf16(rank: int, world: int) -> dict:
    ep, edp = groups()

    def make(ep):
        m, v = _model(ep)
        return m.to(torch.bfloat16), v

    row = compare_steps(rank, make, ep, edp, ref_dtype=torch.float32)
    row["unit_dtypes"] = sorted({str(u.dtype) for u in program_of(row["engine"].program).units})
    return _strip(row)


def edge_ep1_dp4(rank: int, world: int) -> dict:
    def make(ep):
        return _model(None)

    row = compare_steps(rank, make, None, None)
    return _strip(row)


def edge_ep4(rank: int, world: int) -> dict:
    """EP 4 x DP 4 for the dense parameters, experts over a group of one (not gathered: DTensors
    over the EP mesh, read in place)."""
    alone, _ = dist.new_subgroups(group_size=1)
    row = compare_steps(rank, _model, dist.group.WORLD, alone)
    return _strip(row)


def edge_clip(rank: int, world: int) -> dict:
    """Clipping by the global norm: torch's clip_grad_norm_ refuses ZeRO-3's gradients (DTensors
    on two meshes); ``engine.clip_grad_norm_`` equals eager's global norm (every EP rank's experts
    counted once), with the expert role sharded (EP 2 x DP 2) and not (EP 4: expert DTensors over
    the EP mesh alone); an optimizer with foreach over every mesh steps."""
    from torch.distributed.tensor import DTensor

    ep2, edp2 = groups()
    alone, _ = dist.new_subgroups(group_size=1)
    out = {}
    for name, (ep, edp) in (("ep2", (ep2, edp2)), ("ep4", (dist.group.WORLD, alone))):
        ref_model, vocab = _model(ep)
        model, _ = _model(ep)
        engine = fxoverlap.optimize(model, ep, fxoverlap.OverlapConfig(shard_params=True),
                                    dp_group=dist.group.WORLD, expert_dp_group=edp)
        mbs = make_batches(rank, vocab, 2, seed=5)
        eager_steps(ref_model, mbs)
        ref = reduce_by_hand(take_grads(ref_model), edp)
        dense = sum(g.double().pow(2).sum() for k, g in ref.items() if not is_expert(k))
        expert = sum(g.double().pow(2).sum() for k, g in ref.items() if is_expert(k))
        dist.all_reduce(expert, group=ep)
        want = (dense + expert).sqrt().item()
        engine.forward_backward(mbs)
        row = dict(want=want)
        if name == "ep2":
            try:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=want / 2)
                row["torch"] = None
            except Exception as e:  # noqa: BLE001 (the test reads it)
                row["torch"] = f"{type(e).__name__}: {str(e)[:200]}"
        total = engine.clip_grad_norm_(want / 2)
        row["got"] = total.item()
        got = _full_grads(model)
        coef = (want / 2) / (total.item() + 1e-6)
        row["clipped_diff"] = max((got[k] - ref[k] * coef).abs().max().item() for k in ref)
        row["grad_scale"] = max(g.abs().max().item() for g in ref.values())
        row["types"] = sorted({type(p.grad).__name__ for p in model.parameters()})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        try:  # a foreach optimizer over every parameter (DTensors on the dp, (ep, edp) or ep mesh)
            opt.step()
            row["foreach"] = None
        except RuntimeError as e:
            row["foreach"] = str(e)[:200]
        out[name] = row
    return out


def edge_hf(rank: int, world: int, family: str) -> dict:
    return hugging_face(rank, world, family)


EDGE = ("tied", "tied_all_reduce", "frozen", "eval_train", "autocast", "bf16", "ep1_dp4", "ep4", "clip",
        "hf_deepseek_v3", "hf_mixtral", "hf_gpt_oss")


def edge(rank: int, world: int, names=EDGE) -> dict:
    """One 4-rank spawn for the edge cases; each case's error (type, message) instead of its row."""
    import traceback

    out = {}
    for name in names:
        fn, args = (edge_hf, (name[3:],)) if name.startswith("hf_") else (globals()[f"edge_{name}"], ())
        try:
            out[name] = fn(rank, world, *args)
        except Exception as e:  # noqa: BLE001 (the test reads it)
            out[name] = dict(error=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-1500:])
        dist.barrier()
    return out


def one_rank(rank: int, world: int) -> dict:
    """A world of one rank: the shards are the whole parameters over one-rank meshes, the gathers
    one-rank collectives (how one GPU runs the parameter stream's code); two SGD steps against
    eager; then ``load_state_dict(full, assign=True)`` puts plain tensors where the shards were."""
    out = compare_steps(rank, lambda ep: _model(ep), None, None)
    engine, model, ref_model = out.pop("engine"), out.pop("model"), out.pop("ref_model")
    out.pop("units")
    out["gathers"] = sum(1 for n in engine.program.graph.nodes if n.op == "call_function" and n.target is unshard)
    full = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
    model.load_state_dict(full, assign=True)
    try:
        engine.forward_backward(make_batches(rank, 64, 2, seed=9))
        out["assign_error"] = None
    except Exception as e:  # noqa: BLE001 (the test reads the type and message)
        out["assign_error"] = f"{type(e).__name__}: {e}"
    engine.close()
    return out
