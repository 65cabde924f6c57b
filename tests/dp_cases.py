"""Workers for the data-parallel tests: 4 gloo ranks, EP 2 x DP 2 (spawned ranks import this module).

Rank layout (``init_device_mesh("cpu", (2, 2), ("edp", "ep"))``): EP groups {0, 1} and
{2, 3}; expert-DP groups {0, 2} and {1, 3}; dp_group is the world. The reference is eager
backward over the microbatches, then the reduction by hand, parameter by parameter:
``all_reduce(p.grad, group)`` and ``/ |dp_group|``, where ``group`` is the expert-DP group
for expert weights (known here by name, not from fxoverlap's graph analysis) and the
world for the rest.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fxoverlap
from fxoverlap.grad_reduce import reduce_scatter_single
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.ir.program import finish_reduce, reduce_grads
from fxoverlap.testing import eager_steps, share_plans, take_grads
from fxoverlap.ir.program import program_of
from numerics_cases import make_batches

EXPERT_NAMES = ("moe.experts.", "moe.w_in", "moe.w_out")  # MoETransformer's and TitanTransformer's


def groups():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    return mesh["ep"].get_group(), mesh["edp"].get_group()


def make_model(name: str, ep_group):
    torch.manual_seed(0)
    if name == "titan":
        from titan_models import TitanTransformer

        return TitanTransformer(ep_group), 64
    cfg = MoEConfig.tiny(shared_expert_dim=32)
    return MoETransformer(cfg, ep_group), cfg.vocab_size


def is_expert(name: str) -> bool:
    return any(k in name for k in EXPERT_NAMES)


def reduce_by_hand(local: dict[str, torch.Tensor], edp) -> dict[str, torch.Tensor]:
    """The reference reduction, parameter by parameter."""
    out = {}
    for name, g in local.items():
        g = g.clone()
        dist.all_reduce(g, group=edp if is_expert(name) else dist.group.WORLD)
        out[name] = g.div_(dist.get_world_size())
    return out


def reduce_flat_by_hand(local: dict[str, torch.Tensor], buckets, edp, mode: str) -> dict[str, torch.Tensor]:
    """The same reduction on flat buffers laid out as the engine's buckets (so gloo sums
    each element in the same order): bitwise equal to the engine's where the rest is."""
    out = {}
    for b in buckets:
        group = edp if b.role == "expert" else dist.group.WORLD
        n = dist.get_world_size(group)
        flat = torch.zeros(b.padded_numel(n))
        for s in b.slots:
            flat[s.offset:s.offset + s.numel] = local[s.param].reshape(-1)
        if mode == "all_reduce":
            dist.all_reduce(flat, group=group)
        else:  # the rank's shard, placed back into the bucket (the rest stays unreduced)
            start, stop = b.shard(dist.get_rank(group), n)
            shard = flat.new_empty(stop - start)
            reduce_scatter_single(shard, flat, group=group)
            flat[start:stop] = shard
        flat.div_(dist.get_world_size())
        for s in b.slots:
            out[s.param] = flat[s.offset:s.offset + s.numel].view(s.shape)
    return out


def _compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """Max abs diff, max |ref|, and whether the expert and the dense gradients are bitwise equal."""
    worst, scale, missing = 0.0, 0.0, sorted(ref.keys() ^ got.keys())
    bitwise = {"expert": True, "dense": True}
    for k in ref.keys() & got.keys():
        worst = max(worst, (got[k].double() - ref[k].double()).abs().max().item())
        scale = max(scale, ref[k].abs().max().item())
        bitwise["expert" if is_expert(k) else "dense"] &= torch.equal(got[k], ref[k])
    return dict(diff=worst, scale=scale, bitwise=bitwise, missing=missing)


def _shard_grads(engine, ref: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """reduce_scatter: the rank's shard pieces and the same slices of the reference."""
    got, want = {}, {}
    for i, piece in enumerate(engine.grad_reduction.shard_pieces()):
        key = f"{piece.param}[{piece.start}:{piece.start + piece.view.numel()}]#{i}"
        got[key] = piece.view.grad.clone()
        want[key] = ref[piece.param].reshape(-1)[piece.start:piece.start + piece.view.numel()]
    return got, want


def bucket_layer(bucket) -> int | None:
    """The highest decoder layer whose parameters are in ``bucket`` (None: embed/head only)."""
    layers = {int(s.param.split(".")[1]) for s in bucket.slots if s.param.startswith("layers.")}
    return max(layers) if layers else None


def order_facts(program) -> dict:
    """Where the program places the reductions, from its node order."""
    nodes = [x for x in program.graph.nodes if x.op in ("call_module", "call_function")]
    pos = {x.name: i for i, x in enumerate(nodes)}
    last = f"B{program_of(program).num_microbatches - 1}_"
    l0 = [pos[x.name] for x in nodes if x.op == "call_module" and x.name.startswith(last + "l0_")]
    produced_at = {}
    for x in nodes:
        if x.op == "call_module" and x.name.startswith(last):
            for v in x.meta["fxoverlap_step"].writes:
                produced_at[v] = pos[x.name]
    reduces = {x.args[1]: x for x in nodes if x.target is reduce_grads}
    finishes = [pos[x.name] for x in nodes if x.target is finish_reduce]
    upper = [b for b in program_of(program).buckets if (bucket_layer(b) or 0) >= 1]
    return dict(
        # no reduction before its last contribution: after every stage call writing its values
        after_contributions=all(pos[reduces[b.index].name] > max(produced_at[s.value] for s in b.slots)
                                for b in program_of(program).buckets),
        upper_before_l0_starts=all(pos[reduces[b.index].name] < min(l0) for b in upper),
        upper_before_l0_ends=all(pos[reduces[b.index].name] < max(l0) for b in upper),
        finishes_last=min(finishes) > max(pos[x.name] for x in reduces.values()) and
        all(x.op != "call_module" for x in nodes[min(finishes):]),
        upper_buckets=len(upper),
    )


def numerics(rank: int, world: int, models: list[str], ns: list[int], plans: dict | None = None) -> list[dict]:
    """forward_backward with in-program reduction vs eager + manual reduction, per case;
    ``plans`` (if given) receives, per model, the engine holding its plans without delayed wgrad."""
    ep, edp = groups()
    out = []
    for name in models:
        for delay in (False, True):
            first = None
            for mode in ("all_reduce", "reduce_scatter"):
                model, vocab = make_model(name, ep)
                cfg = fxoverlap.OverlapConfig(delay_wgrad=delay, grad_reduce=mode, reduce_bucket_mb=0,
                                              record_memory=True)
                engine = fxoverlap.optimize(model, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp)
                if first is None:
                    first = engine
                    if plans is not None and not delay:
                        plans[name] = engine
                else:
                    share_plans(first, engine)
                for n in ns:
                    mbs = make_batches(rank, vocab, n, seed=n)
                    eager_steps(model, mbs)
                    local = take_grads(model)
                    ref = reduce_by_hand(local, edp)
                    t0 = time.perf_counter()
                    engine.forward_backward(mbs)
                    row = dict(model=name, delay_wgrad=delay, mode=mode, n=n, seconds=time.perf_counter() - t0)
                    prog = engine.program
                    flat_ref = reduce_flat_by_hand(local, program_of(prog).buckets, edp, mode)
                    if mode == "all_reduce":
                        got = take_grads(model)
                        row.update(_compare(got, ref))
                        row["flat_bitwise"] = _compare(got, flat_ref)["bitwise"]
                    else:
                        row["p_grad_left"] = [k for k, p in model.named_parameters() if p.grad is not None]
                        got, want = _shard_grads(engine, ref)
                        row.update(_compare(got, want))
                        row["flat_bitwise"] = _compare(*_shard_grads(engine, flat_ref))["bitwise"]
                        row["shard_elements"] = sum(t.numel() for t in got.values())
                        for v in engine.shard_parameters():
                            v.grad = None
                    row["leftover"] = engine.leftover  # values the stores still hold at the end
                    row["buckets"] = len(program_of(prog).buckets)
                    row["reduce_nodes"] = sum(1 for x in prog.graph.nodes if x.target is reduce_grads)
                    row["finish_nodes"] = sum(1 for x in prog.graph.nodes if x.target is finish_reduce)
                    row.update(order_facts(prog))
                    out.append(row)
                if name == "moe" and not delay:
                    out.append(dict(model=name, mode=mode, grad_table=engine.grad_table()))
    return out


def ep1_dp4(rank: int, world: int) -> dict:
    """EP 1 x DP 4 (every expert on every rank): expert_dp_group defaults to dp_group, and the
    default bucket size (25 MiB: one bucket per role for this model)."""
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32)
    model = MoETransformer(cfg, None)
    engine = fxoverlap.optimize(model, None, dp_group=dist.group.WORLD)
    mbs = make_batches(rank, cfg.vocab_size, 2)
    eager_steps(model, mbs)
    local = take_grads(model)
    ref = {}
    for name, g in local.items():
        g = g.clone()
        dist.all_reduce(g)
        ref[name] = g.div_(world)
    engine.forward_backward(mbs)
    row = _compare(take_grads(model), ref)
    row["roles"] = [b.role for b in program_of(engine.program).buckets]
    row["table"] = engine.grad_table()
    return row


def train_steps(rank: int, world: int, steps: int = 2, plans: dict | None = None) -> dict:
    """Optimizer steps: the engine (both modes; reduce_scatter through shard_parameters() and
    gather_parameters()) against eager + manual reduction + the optimizer on all parameters.
    SGD with momentum: the update is linear in the gradient, so parameters differ by no
    more than lr times the gradients' (reduction-order) difference. ``plans``: ``plans["moe"]``,
    an engine of the same model (no delayed wgrad) whose captures and stages to reuse (a
    capture per microbatch count is most of a case's time on CPU)."""
    ep, edp = groups()
    ref_model, vocab = make_model("moe", ep)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    runs = {}
    first = make_batches(rank, vocab, 2, seed=10)
    for mode in ("all_reduce", "reduce_scatter"):
        model, _ = make_model("moe", ep)
        cfg = fxoverlap.OverlapConfig(grad_reduce=mode, reduce_bucket_mb=0)
        engine = fxoverlap.optimize(model, ep, cfg, dp_group=dist.group.WORLD, expert_dp_group=edp)
        donor = runs["all_reduce"][1] if runs else (plans or {}).get("moe")
        if donor is not None:
            share_plans(donor, engine)
        engine.plan(first)  # capture and bucket before the first step: the shards are known
        params = model.parameters() if mode == "all_reduce" else engine.shard_parameters()
        runs[mode] = (model, engine, torch.optim.SGD(params, lr=0.1, momentum=0.9))
    worst = {mode: 0.0 for mode in runs}
    for step in range(steps):
        mbs = make_batches(rank, vocab, 2, seed=10 + step)
        eager_steps(ref_model, mbs)
        for name, g in reduce_by_hand(take_grads(ref_model), edp).items():
            dict(ref_model.named_parameters())[name].grad = g
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        for mode, (model, engine, opt) in runs.items():
            engine.forward_backward(mbs)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mode == "reduce_scatter":
                engine.gather_parameters()
            ref = dict(ref_model.named_parameters())
            for name, p in model.named_parameters():
                worst[mode] = max(worst[mode], (p.detach() - ref[name].detach()).abs().max().item())
    # the replicas agree: dense parameters on all ranks, experts within the expert-DP group
    agree = {}
    for mode, (model, _, _) in runs.items():
        ok = True
        for name, p in model.named_parameters():
            group = edp if is_expert(name) else dist.group.WORLD
            copies = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
            dist.all_gather(copies, p.detach().contiguous(), group=group)
            ok &= all(torch.equal(c, copies[0]) for c in copies)
        agree[mode] = ok
    shard = sum(v.numel() for v in runs["reduce_scatter"][1].shard_parameters())
    full = sum(p.numel() for p in ref_model.parameters())
    return dict(worst=worst, agree=agree, shard_elements=shard, full_elements=full,
                scale=max(p.abs().max().item() for p in ref_model.parameters()))


def accumulation(rank: int, world: int, calls: tuple[tuple[int, ...], ...] = ((2, 2), (2, 1, 3)),
                 plans: dict | None = None) -> list[dict]:
    """Gradient accumulation: several forward_backward calls (microbatch counts ``calls[i]``)
    with no zero_grad between, both modes, then clip_grad_norm_.

    References (eager backward of the same microbatches on the same weights):
    ``sum``, the docs' statement: every call's local gradients summed, reduced parameter by
    parameter and divided by |dp_group|; ``per_call``: each call's local gradients reduced and
    divided, the results added in call order (what the engine computes: the sums differ from
    ``sum``'s in association only); ``flat``: ``per_call`` with each call reduced on flat
    buffers of the engine's layout (gloo's order), for bitwise checks. ``plans``: as in
    :func:`train_steps`; ``plans["moe"]`` is then this function's engine (its plans added)."""
    ep, edp = groups()
    out, first = [], (plans or {}).get("moe")
    for mode in ("all_reduce", "reduce_scatter"):
        model, vocab = make_model("moe", ep)
        engine = fxoverlap.optimize(model, ep, fxoverlap.OverlapConfig(grad_reduce=mode, reduce_bucket_mb=0),
                                    dp_group=dist.group.WORLD, expert_dp_group=edp)
        if first is not None:
            share_plans(first, engine)
        first = engine
        for ns in calls:
            batches = [make_batches(rank, vocab, n, seed=50 + 10 * len(ns) + c) for c, n in enumerate(ns)]
            eager_steps(model, [mb for mbs in batches for mb in mbs])  # one eager accumulation over every call
            total = take_grads(model)
            locals_ = []
            for mbs in batches:
                eager_steps(model, mbs)
                locals_.append(take_grads(model))
            for c, mbs in enumerate(batches):  # the engine: no zero_grad between the calls
                engine.forward_backward(mbs)
                if c == 0:  # where p.grad lives after the first call (a view into its bucket's buffer)
                    held = {k: p.grad.data_ptr() for k, p in model.named_parameters() if p.grad is not None}
            buckets = program_of(engine.program).buckets
            refs = {"sum": reduce_by_hand(total, edp), "per_call": None, "flat": None}
            for local in locals_:
                for key, r in (("per_call", reduce_by_hand(local, edp)),
                               ("flat", reduce_flat_by_hand(local, buckets, edp, mode))):
                    refs[key] = r if refs[key] is None else {k: refs[key][k] + r[k] for k in r}
            row = dict(mode=mode, calls=list(ns))
            if mode == "all_reduce":
                got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
                # the later calls added into those tensors: no second full gradient kept across calls
                row["same_grad_storage"] = held == {k: p.grad.data_ptr() for k, p in model.named_parameters()
                                                    if p.grad is not None} and len(held) > 0
                for key, ref in refs.items():
                    row[key] = _compare(got, ref)
                # clip_grad_norm_ after the accumulation, on the engine's gradients and on each reference
                params = dict(model.named_parameters())
                max_norm = 0.5 * torch.stack([g.norm() for g in refs["sum"].values()]).norm().item()
                clipped = {}
                for key in ("engine", "sum", "flat"):
                    if key != "engine":
                        for k, p in params.items():
                            p.grad = refs[key][k].clone()
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                    clipped[key] = (norm, take_grads(model))
                row["clip"] = dict(norm=clipped["engine"][0].item(), max_norm=max_norm,
                                   norm_vs_sum=abs(clipped["engine"][0].item() - clipped["sum"][0].item()),
                                   norm_bitwise_flat=torch.equal(clipped["engine"][0], clipped["flat"][0]),
                                   sum=_compare(clipped["engine"][1], clipped["sum"][1]),
                                   flat=_compare(clipped["engine"][1], clipped["flat"][1]))
            else:
                row["p_grad_left"] = [k for k, p in model.named_parameters() if p.grad is not None]
                for key, ref in refs.items():
                    row[key] = _compare(*_shard_grads(engine, ref))
                # ZeRO-2 clipping (docs/data_parallel.md): the global norm from the shards, against
                # the reference's: dense once, experts once per EP index
                sq = sum(v.grad.double().square().sum() for v in engine.shard_parameters())
                dist.all_reduce(sq)
                dense = sum(g.double().square().sum() for k, g in refs["sum"].items() if not is_expert(k))
                expert = sum(g.double().square().sum() for k, g in refs["sum"].items() if is_expert(k))
                dist.all_reduce(expert, group=ep)
                row["clip"] = dict(norm=sq.sqrt().item(), ref=(dense + expert).sqrt().item())
                for v in engine.shard_parameters():
                    v.grad = None
            out.append(row)
    if plans is not None:
        plans["moe"] = first
    return out


def timeline(rank: int, world: int, n_layers: int = 3, n: int = 3) -> dict:
    """A CPU timeline of one step (the second): stage calls from a ProgramRunner hook,
    reductions from the reducer's trace; and where the program places them."""
    ep, edp = groups()
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32, n_layers=n_layers, dim=128, expert_dim=128)
    model = MoETransformer(cfg, ep)
    engine = fxoverlap.optimize(model, ep, fxoverlap.OverlapConfig(reduce_bucket_mb=0),
                                dp_group=dist.group.WORLD, expert_dp_group=edp)
    mbs = make_batches(rank, cfg.vocab_size, n)
    engine.forward_backward(mbs)
    model.zero_grad(set_to_none=True)
    runner = engine._last[1].runner
    stage_times: list[tuple[str, float, float]] = []

    def hook(node, stage, run):
        t0 = time.perf_counter()
        outs = run()
        stage_times.append((node.name, t0, time.perf_counter()))
        return outs

    runner.hook, runner.reducer.trace = hook, []
    dist.barrier()
    engine.forward_backward(mbs)
    trace = list(runner.reducer.trace)
    runner.hook, runner.reducer.trace = None, None
    buckets = program_of(engine.program).buckets
    l0 = [(a, b) for name, a, b in stage_times if name.startswith(f"B{n - 1}_l0_")]
    return dict(order=order_facts(engine.program), l0_start=min(a for a, _ in l0), l0_end=max(b for _, b in l0),
                trace=trace, bucket_layer={b.index: bucket_layer(b) for b in buckets})


def bad_groups(rank: int, world: int) -> dict:
    """Groups that cannot work: optimize must refuse them (ValueError), before any collective."""
    ep, edp = groups()
    three = dist.new_group([0, 1, 2])
    model, _ = make_model("moe", ep)
    cases = {
        "dp_not_dividing_world_or_not_member": dict(dp_group=three),
        "expert_dp_wrong_size": dict(dp_group=dist.group.WORLD, expert_dp_group=dist.group.WORLD),
        "expert_dp_is_ep": dict(dp_group=dist.group.WORLD, expert_dp_group=ep),
        "expert_dp_missing": dict(dp_group=dist.group.WORLD),
        "expert_dp_without_dp": dict(expert_dp_group=edp),
        "reduce_scatter_without_dp": dict(config=fxoverlap.OverlapConfig(grad_reduce="reduce_scatter")),
        "ep_not_in_dp": dict(dp_group=edp),
    }
    out = {}
    for name, kw in cases.items():
        try:
            fxoverlap.optimize(model, ep, **kw)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def everything(rank: int, world: int, models: list[str] | None = None, rest: bool = True,
               ns: tuple[int, ...] = (1, 3), with_timeline: bool = False) -> dict:
    """One 4-rank spawn for the data-parallel tests: the numerics of ``models`` (default: both) at
    ``ns`` microbatches; with ``rest``, the optimizer steps, EP 1, accumulation and the errors;
    with ``with_timeline``, the CPU timeline."""
    plans: dict = {}
    out = dict(numerics=numerics(rank, world, models or ["moe", "titan"], list(ns), plans))
    if rest:
        # the reference model's plans are captured once for the numerics, the accumulation and the
        # optimizer steps: they differ in the reduction only
        out.update(accumulation=accumulation(rank, world, plans=plans))
        out.update(train=train_steps(rank, world, plans=plans), ep1=ep1_dp4(rank, world),
                   errors=bad_groups(rank, world))
    if with_timeline:
        out["timeline"] = timeline(rank, world)
    return out



