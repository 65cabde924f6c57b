"""Workers for the 2-rank numerics tests (spawned ranks import this module by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.passes import capture, split, tag
from fxoverlap.pipeline import run_plain
from fxoverlap.testing import eager_steps, grad_diff, take_grads, token_batches


def make_batches(rank: int, vocab: int, n: int, seed: int = 0, batch=(2, 16)):
    """This rank's ``n`` microbatches: different data on every rank, and for every ``seed``."""
    return token_batches(vocab, n, batch, seed=1000 * seed + rank)


def eager_grads(model, mbs, rounds: int = 1):
    return eager_steps(model, mbs, rounds), take_grads(model)


def stagewise(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """One microbatch through capture -> tag -> split, stages in plain order."""
    out = []
    for kw in configs:
        torch.manual_seed(0)
        cfg = MoEConfig.tiny(**kw)
        model = MoETransformer(cfg, dist.group.WORLD)
        mbs = make_batches(rank, cfg.vocab_size, 1)
        losses, ref = eager_grads(model, mbs)
        cap = capture(model, mbs[0])
        stages = split(tag(cap), cap.num_layers)
        loss = run_plain(stages, cap, model, mbs[0])
        diff, scale, bitwise = grad_diff(model, ref)
        out.append(dict(config=kw, loss_equal=torch.equal(loss, losses[0]), diff=diff, scale=scale,
                        bitwise=bitwise, stages=[s.name for s in stages]))
    return out


def _optimize_vs_eager(rank: int, configs: list[dict], ns: list[int], overlap: dict):
    """For each model config and microbatch count N: ``(engine, record)`` after ``forward_backward``
    over N microbatches against eager on the same weights and data (``record``: config, n, losses
    equal, largest gradient difference, its scale, bitwise); each engine closed after its counts."""
    for kw in configs:
        torch.manual_seed(0)
        cfg = MoEConfig.tiny(**kw)
        model = MoETransformer(cfg, dist.group.WORLD)
        engine = fxoverlap.optimize(model, dist.group.WORLD, fxoverlap.OverlapConfig(**overlap))
        for n in ns:
            mbs = make_batches(rank, cfg.vocab_size, n, seed=n)
            ref_losses, ref = eager_grads(model, mbs)
            losses = engine.forward_backward(mbs)
            diff, scale, bitwise = grad_diff(model, ref)
            model.zero_grad(set_to_none=True)
            yield engine, dict(config=kw, n=n, losses_equal=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
                               diff=diff, scale=scale, bitwise=bitwise)
        engine.close()


def interleaved(rank: int, world: int, configs: list[dict], ns: list[int], delay_wgrad: bool) -> list[dict]:
    """forward_backward over N microbatches equals eager, for each N."""
    return [dict(rec, wgrad_stages=sum(1 for s in engine.stages if s.wgrad_of))
            for engine, rec in _optimize_vs_eager(rank, configs, ns, dict(delay_wgrad=delay_wgrad))]


def expert_wgrad_slot(rank: int, world: int, configs: list[dict], ns: list[int]) -> list[dict]:
    """delay_wgrad with ``expert_wgrad_slot=2``: forward_backward equals eager, and in every merged
    step B experts' weight-grad is the call right after B experts, in slot 2."""
    from fxoverlap.ir.program import stage_calls

    out = []
    for engine, rec in _optimize_vs_eager(rank, configs, ns, dict(delay_wgrad=True, expert_wgrad_slot=2)):
        calls = [(node.name, st.stage, st.slot) for node, st in stage_calls(engine.program)]
        placed = [(calls[i - 1][1], c[2][2]) for i, c in enumerate(calls)
                  if c[2] is not None and c[1].endswith("_experts_wgrad")]
        out.append(dict(rec, placed=placed))
    return out


def two_calls(rank: int, world: int) -> dict:
    """Two consecutive forward_backward calls accumulate like two eager rounds."""
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32)
    model = MoETransformer(cfg, dist.group.WORLD)
    mbs = make_batches(rank, cfg.vocab_size, 2)
    _, ref = eager_grads(model, mbs, rounds=2)
    engine = fxoverlap.optimize(model, dist.group.WORLD)
    engine.forward_backward(mbs)
    engine.forward_backward(mbs)
    diff, scale, bitwise = grad_diff(model, ref)
    return dict(diff=diff, scale=scale, bitwise=bitwise)


def titan(rank: int, world: int, n: int) -> dict:
    """A torchtitan-style model (functional collectives, no fxoverlap import)."""
    from titan_models import TitanTransformer

    torch.manual_seed(0)
    model = TitanTransformer(dist.group.WORLD)
    mbs = make_batches(rank, 64, n)
    ref_losses, ref = eager_grads(model, mbs)
    cap = capture(model, mbs[0])
    stages = split(tag(cap), cap.num_layers)
    loss0 = run_plain(stages, cap, model, mbs[0])
    model.zero_grad(set_to_none=True)
    engine = fxoverlap.optimize(model, dist.group.WORLD)
    losses = engine.forward_backward(mbs)
    diff, scale, bitwise = grad_diff(model, ref)
    comm_ops = {s.name: [o for o in s.op_list() if o.endswith("all_to_all_single")] for s in stages}
    return dict(misplaced={k: v for k, v in comm_ops.items() if v and not k.endswith(("dispatch", "combine"))},
                stagewise_loss_equal=torch.equal(loss0, ref_losses[0]),
                losses_equal=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
                diff=diff, scale=scale, bitwise=bitwise,
                stages=[(s.name, s.stream.value) for s in engine.stages])


def titan_dtensor(rank: int, world: int, n: int) -> dict:
    """The torchtitan-style model with DTensor weights (experts ``Shard(0)``, routers replicated
    with ``Partial`` gradients) and DTensor token inputs (``Shard(0)`` on the batch)."""
    from titan_models import TitanTransformer, shard_with_dtensors
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from fxoverlap.passes.capture import CaptureError

    mesh = init_device_mesh("cpu", (world,))

    def build():
        torch.manual_seed(0)
        return shard_with_dtensors(TitanTransformer(dist.group.WORLD), mesh)

    eager, model = build(), build()
    mbs = [(DTensor.from_local(t, mesh, [Shard(0)], run_check=False), y) for t, y in make_batches(rank, 64, n)]
    ref_losses = eager_steps(eager, mbs)
    engine = fxoverlap.optimize(model, dist.group.WORLD)
    losses = engine.forward_backward(mbs)
    cap = engine.plan(mbs).capture
    ref = dict(eager.named_parameters())
    grads = {}
    for name, p in model.named_parameters():
        g, r = p.grad, ref[name].grad
        same_kind = type(g) is type(r) and getattr(g, "placements", None) == getattr(r, "placements", None)
        grads[name] = (type(g).__name__, str(getattr(g, "placements", "")),
                       same_kind and torch.equal(getattr(g, "_local_tensor", g), getattr(r, "_local_tensor", r)))
    try:  # a DTensor loss: the step must hand out plain tensors
        fxoverlap.optimize(model, dist.group.WORLD).forward_backward(
            mbs[:1], loss_fn=lambda loss, *_: DTensor.from_local(loss, mesh, [Partial()]))
        subclass_loss_error = "no error"
    except CaptureError as e:
        subclass_loss_error = str(e)
    try:  # data-parallel reduction in the program takes plain gradients only
        fxoverlap.optimize(model, dist.group.WORLD, dp_group=dist.group.WORLD).forward_backward(mbs[:1])
        dp_error = "no error"
    except NotImplementedError as e:
        dp_error = str(e)
    return dict(losses_equal=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), grads=grads,
                subclass_loss_error=subclass_loss_error, dp_error=dp_error, subclass_parts=sorted({(fqn, ".".join(path)) for fqn, path in cap.subclass_placeholders.values()}),
                input_parts=sorted({".".join(path) for _, path in cap.input_parts.values()}))


def forward_only(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32)
    model = MoETransformer(cfg, dist.group.WORLD)
    tokens, labels = make_batches(rank, cfg.vocab_size, 1)[0]
    engine = fxoverlap.optimize(model, dist.group.WORLD)
    with torch.no_grad():
        logits_ref, loss_ref = model(tokens), model(tokens, labels)
    return dict(logits_equal=torch.equal(engine(tokens), logits_ref), loss_equal=torch.equal(engine(tokens, labels), loss_ref))


def world_generic(rank: int, world: int) -> dict:
    """Any EP size that divides the expert count: dropless + capacity, 3 microbatches."""
    out = {}
    for routing in ("dropless", "capacity", "dedup"):
        torch.manual_seed(0)
        kw = dict(token_dedup=True, top_k=3) if routing == "dedup" else dict(routing=routing)
        cfg = MoEConfig.tiny(shared_expert_dim=32, **kw)
        model = MoETransformer(cfg, dist.group.WORLD)
        mbs = make_batches(rank, cfg.vocab_size, 3)
        ref_losses, ref = eager_grads(model, mbs)
        losses = fxoverlap.optimize(model, dist.group.WORLD).forward_backward(mbs)
        diff, scale, bitwise = grad_diff(model, ref)
        out[routing] = dict(losses_equal=all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
                            diff=diff, scale=scale, bitwise=bitwise,
                            local_experts=model.layers[0].moe.experts.w1.shape[0])
    return out


def titan_shared_seq_nr(rank: int, world: int) -> dict:
    """Tagging when a forward all-to-all shares its seq_nr with the copy before it (as an
    autograd.Function that copies, then communicates, is traced): the backward
    all-to-alls must still land in comm stages, and numerics stay exact."""
    from titan_models import TitanTransformer

    from fxoverlap.ir.meta import op_name

    torch.manual_seed(0)
    model = TitanTransformer(dist.group.WORLD)
    mbs = make_batches(rank, 64, 1)
    ref_losses, ref = eager_grads(model, mbs)
    cap = capture(model, mbs[0])
    nodes = list(cap.graph_module.graph.nodes)
    moved = 0
    for i, n in enumerate(nodes):
        if n.meta.get("partitioner_tag") == "is_forward" and op_name(n).endswith("all_to_all_single"):
            prev = nodes[i - 1]
            if prev.op == "call_function" and prev.meta.get("seq_nr") is not None:
                prev.meta["seq_nr"] = n.meta["seq_nr"]  # the copy now "creates" the a2a's autograd node
                moved += 1
    stages = split(tag(cap), cap.num_layers)
    loss = run_plain(stages, cap, model, mbs[0])
    diff, scale, bitwise = grad_diff(model, ref)
    comm_ops = {s.name: [o for o in s.op_list() if o.endswith("all_to_all_single")] for s in stages}
    return dict(moved=moved, loss_equal=torch.equal(loss, ref_losses[0]), diff=diff, scale=scale, bitwise=bitwise,
                misplaced={k: v for k, v in comm_ops.items() if v and not k.endswith(("dispatch", "combine"))})


def dedup_vs_per_expert(rank: int, world: int) -> dict:
    """The same weights and data through token_dedup=True and False (eager, 3 microbatches)."""
    torch.manual_seed(0)
    per_expert = MoETransformer(MoEConfig.tiny(top_k=3, shared_expert_dim=32), dist.group.WORLD)
    dedup = MoETransformer(MoEConfig.tiny(top_k=3, shared_expert_dim=32, token_dedup=True), dist.group.WORLD)
    dedup.load_state_dict(per_expert.state_dict())
    mbs = make_batches(rank, 256, 3)
    ref_losses, ref = eager_grads(per_expert, mbs)
    losses = eager_steps(dedup, mbs)
    diff, scale, _ = grad_diff(dedup, ref)
    moe = dedup.layers[0].moe
    tokens = torch.randn(32, moe.cfg.dim)
    _, idx = moe.router(tokens)
    sent = fxoverlap.ops.token_dispatch(tokens, idx, torch.ones(idx.shape), moe.cfg.n_experts, dist.group.WORLD)
    return dict(loss_diff=max((a - b).abs().item() for a, b in zip(losses, ref_losses)),
                loss_scale=max(a.abs().item() for a in ref_losses), diff=diff, scale=scale,
                routed=idx.numel(), sent=int((sent.slot >= 0).sum()), pairs=int(sent.tokens_per_expert.sum()))
