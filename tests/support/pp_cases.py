"""Pipeline parallelism (``fxoverlap.pipeline_schedule``) against the unpipelined model run eagerly.

Every rank builds the full model from one seed (EP ranks hold their expert shard), runs it
eagerly over all microbatches as pipelining scales it (``loss_fn(model(x_i), y_i)``, one
backward per microbatch, grads divided by the microbatch count at the end), then builds the
same model again, splits it into stage modules that hold references to the full model's
submodules (decoder layers in a ``ModuleDict`` under their original names, as torchtitan's PP
split leaves them), and runs the schedule. Each rank returns its losses and gradients against
the reference's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxoverlap
from fxoverlap.models import MoEConfig, MoEStage, MoETransformer
from fxoverlap.pipeline_parallel import pp_ep_groups, stage_layout

N_LAYERS = 4
BATCH_PER_MB = 2
SEQ = 8


def loss_fn(logits: torch.Tensor, target: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
    return loss if weight == 1.0 else loss * weight


RefStage = MoEStage  # the reference model's stage module (fxoverlap.models.moe)


class BreakStage(RefStage):
    """RefStage with a Dynamo graph break before the head: the last stage runs as two graphs."""

    def head(self, h: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return super().head(h)


class DTensorHeadStage(RefStage):
    """RefStage whose head weight is a DTensor (replicated over the default group) that the
    forward reads with ``full_tensor()``, not ``to_local()``: the stage compile refuses it."""

    def __init__(self, model: MoETransformer, layer_ids: list[int], first: bool, last: bool):
        super().__init__(model, layer_ids, first, last)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.head_w = nn.Parameter(distribute_tensor(self.output.weight.detach().clone(), mesh, [Replicate()]))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(h), self.head_w.full_tensor())


class NoListStage(nn.Module):
    """A stage module whose MoE layers are plain attributes: no layer list to find."""

    def __init__(self, model: MoETransformer, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.inner = RefStage(model, layer_ids, first, last)
        self.first, self.last = first, last
        for i in layer_ids:
            setattr(self, f"block{i}", model.layers[i])
        self.ids = layer_ids
        del self.inner.layers
        self.inner.layers = nn.ModuleDict()

    def forward(self, h):
        if self.first:
            h = self.inner.tok_embeddings(h)
        for i in self.ids:
            h = getattr(self, f"block{i}")(h)
        if self.last:
            h = self.inner.output(self.inner.norm(h))
        return h


def _build(kind: str, ep_group):
    torch.manual_seed(0)
    if kind == "ref":
        cfg = MoEConfig.tiny(n_layers=N_LAYERS, dim=32, n_heads=4, expert_dim=32, n_experts=4, shared_expert_dim=32,
                             vocab_size=64)
    elif kind == "ac":  # every decoder layer under torch.utils.checkpoint (non-reentrant)
        cfg = MoEConfig.tiny(n_layers=N_LAYERS, dim=32, n_heads=4, expert_dim=32, n_experts=4, shared_expert_dim=32,
                             vocab_size=64, activation_checkpoint=True)
    elif kind == "mhc":
        cfg = MoEConfig.tiny(n_layers=N_LAYERS, dim=32, n_heads=4, expert_dim=32, n_experts=4, vocab_size=64,
                             mhc_rate=2)
    else:
        raise ValueError(kind)
    return MoETransformer(cfg, ep_group), cfg.vocab_size


def titan_next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _titan_dims(pp: int, ep: int):
    """torchtitan's ``ParallelDims`` for PP ``pp`` x EP ``ep`` over the default group (its
    mesh lays ranks out as ``pp_ep_groups`` does: the EP groups are the rows), with the
    test-side settings of titan_real.build (the partial-DTensor backend, a CPU mesh)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as titan_dist

    titan_dist.set_spmd_backend("partial_dtensor")
    parallel_dims.device_type = "cpu"
    world = dist.get_world_size()
    return ParallelDims(dp_replicate=1, dp_shard=world // pp, cp=1, tp=1, pp=pp, ep=ep, world_size=world,
                        spmd_backend="partial_dtensor")


def _build_titan(ep: int = 1):
    """torchtitan 0.3.0's Qwen3-MoE, tiny, N_LAYERS layers (titan_real.py), not yet parallelized;
    with ``ep > 1`` its sharding configs are set for torchtitan's EP (``model.parallelize``)."""
    import titan_real

    cfg = titan_real.qwen3_moe_config(n_layers=N_LAYERS)
    if ep > 1:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=True)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return model.train(), titan_real.VOCAB


def _titan_stage(model, n_stages: int, s: int) -> nn.Module:
    """Stage ``s`` as torchtitan's PP splits the model (``pipeline_parallel._split_module``: a
    deep copy with the other stages' layers deleted from ``layers``, a ModuleDict keeping the
    original names, and the other top-level modules set to None)."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _split_module

    names = _generate_llm_fqn_per_model_part(n_stages, N_LAYERS, input_weight=1, output_weight=1)
    return _split_module(model, names[s])


class HFStage(nn.Module):
    """A pipeline stage of a Hugging Face causal LM (Qwen3-MoE's layout): embedding (first),
    its decoder layers in a ModuleDict under their original indices, norm + lm_head (last);
    each stage computes the positions, mask and rotary embeddings as the model's forward does."""

    def __init__(self, lm, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        inner = lm.model
        self.config, self.first, self.last = inner.config, first, last
        if first:
            self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layer_ids})
        if last:
            self.norm, self.lm_head = inner.norm, lm.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        if self.first:
            h = self.embed_tokens(h)
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                                  position_ids=position_ids)
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        return self.lm_head(self.norm(h)) if self.last else h


def hf_next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _build_hf(ep_group):
    """Hugging Face Qwen3-MoE, tiny (hf_cases.py), N_LAYERS layers, after fxoverlap.expert_parallel."""
    import hf_cases

    model = hf_cases.build("qwen3_moe", num_hidden_layers=N_LAYERS).train()
    return fxoverlap.expert_parallel(model, ep_group), hf_cases.VOCAB


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _layout(t: torch.Tensor) -> tuple:
    """What kind of tensor ``t`` is: its type, and for a DTensor its mesh's ranks and placements."""
    mesh = getattr(t, "device_mesh", None)
    return (type(t).__name__, None if mesh is None else mesh.mesh.tolist(), str(getattr(t, "placements", "")))


def _gloo_v_warmup() -> None:
    """Let torch 2.11's pipelining warm up a V-schedule's P2P under gloo (this rank process only).

    torch 2.11 warms up each stage's P2P with a dummy send to and receive from each neighbour
    stage through the process group (``_get_init_p2p_neighbors_ops``), the neighbour on this
    rank included (DualPipeV / ZBV: stages pp-1 and pp share a rank). gloo, these CPU tests'
    transport, cannot send to its own rank ("Pair is not connected"), so on 2.11 every
    V-schedule fails under gloo before any stage runs, with or without fxoverlap (plain
    pipelining too; NCCL on the GPU machine can). The ops to this rank carry a dummy tensor
    nothing reads: they are dropped. torch 2.13 warms up with its vote protocol instead and
    does not call this for a PipelineStage: nothing is changed there."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.stage import _PipelineStageBase

    if hasattr(PipelineStage, "_warmup_forward_vote"):  # torch 2.13's warm-up
        return
    orig = _PipelineStageBase._get_init_p2p_neighbors_ops
    if getattr(orig, "drops_self_ops", False):
        return

    def ops(self) -> list:
        me = dist.get_rank()
        return [op for op in orig(self) if op.peer != me]

    ops.drops_self_ops = True
    _PipelineStageBase._get_init_p2p_neighbors_ops = ops


def run_case(rank: int, world: int, schedule: str, kind: str, ep: int, opts: dict | None = None) -> dict:
    """``opts``: ``n_mb`` (4), ``stage_cls`` ("RefStage"), ``loss_weight`` (1.0: passed to
    ``step`` as ``loss_kwargs``), ``config`` (OverlapConfig fields; ``compiler="eager"``),
    ``schedule_kwargs`` (to the schedule class)."""
    import torch.distributed.pipelining as pipelining

    opts = opts or {}
    n_mb, stage_cls, loss_weight = opts.get("n_mb", 4), opts.get("stage_cls", "RefStage"), opts.get("loss_weight", 1.0)
    scale_grads = opts.get("scale_grads", True)
    config = {"compiler": "eager", **opts.get("config", {})}

    _gloo_v_warmup()
    torch.manual_seed(0)
    pp, pp_rank, ep_rank, ep_group, pp_group = pp_ep_groups(ep)
    ep_group = ep_group if ep > 1 else None
    g = torch.Generator().manual_seed(100 + ep_rank)  # EP peers: different data
    titan = kind == "titan"
    # torchtitan's own EP: its ParallelDims over the same PP x EP layout; the reference model
    # and each stage module are parallelized by torchtitan (DTensor expert weights), the
    # stage modules after the PP split, as torchtitan's pipeline_llm does
    dims = _titan_dims(pp, ep) if titan and ep > 1 else None
    if dims is not None:
        ep_group = dims.get_mesh("ep").get_group()
    hf = kind == "hf"
    model, vocab = _build_titan(ep) if titan else _build_hf(ep_group) if hf else _build(kind, ep_group)
    if dims is not None:
        model.parallelize(dims)
    lossf = titan_next_token_loss if titan else hf_next_token_loss if hf else loss_fn
    lkw = {"weight": loss_weight} if loss_weight != 1.0 else {}  # step(loss_kwargs=...)
    x = torch.randint(0, vocab, (n_mb * BATCH_PER_MB, SEQ), generator=g)
    y = x.clone() if titan or hf else torch.randint(0, vocab, (n_mb * BATCH_PER_MB, SEQ), generator=g)

    # the reference: the unpipelined model, eager, as pipelining scales the gradients
    ref_losses = []
    for xi, yi in zip(x.chunk(n_mb), y.chunk(n_mb)):
        out = model(xi)
        loss = lossf(out.logits if hf else out, yi, **lkw)
        loss.backward()
        ref_losses.append(loss.detach())
    for p in model.parameters():
        if p.grad is not None and scale_grads:
            p.grad.div_(n_mb)
    ref = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    del model

    model, _ = _build_titan(ep) if titan else _build_hf(ep_group) if hf else _build(kind, ep_group)
    n_stages, mine = stage_layout(schedule, pp, pp_rank)
    per = N_LAYERS // n_stages
    make = HFStage if hf else {"RefStage": RefStage, "NoListStage": NoListStage, "BreakStage": BreakStage}[stage_cls]
    stages, names = [], {}
    for s in mine:
        if titan:  # a deep copy: its parameters keep the whole model's names
            mod = _titan_stage(model, n_stages, s)
            if dims is not None:
                mod.parallelize(dims)
            names.update({id(p): k for k, p in mod.named_parameters()})
        else:  # references to the whole model's modules
            mod = make(model, list(range(s * per, (s + 1) * per)), s == 0, s == n_stages - 1)
            names.update({id(p): k for k, p in model.named_parameters()})
        stages.append(pipelining.PipelineStage(mod, s, n_stages, torch.device("cpu"), group=pp_group))
    hook_calls = []
    if opts.get("hook"):
        for st in stages:
            if st.is_last:
                st.submod.output.weight.register_post_accumulate_grad_hook(lambda p: hook_calls.append(1))
    cls = getattr(pipelining, schedule)
    arg = stages[0] if schedule in ("Schedule1F1B", "ScheduleGPipe") else stages
    sched = fxoverlap.pipeline_schedule(cls, arg, n_mb, loss_fn=lossf, ep_group=ep_group,
                                        config=fxoverlap.OverlapConfig(**config), merge=opts.get("merge", True),
                                        scale_grads=scale_grads, **opts.get("schedule_kwargs", {}))
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    losses: list = []
    args = (x,) if has_first else ()
    kwargs = dict(target=y, losses=losses, loss_kwargs=lkw or None) if has_last else {}
    # the stage calls of each merged OVERLAP_F_B step, in the order they ran
    import fxoverlap.pipeline_parallel as fxpp
    import torch.distributed.pipelining.schedules as pl_schedules
    from fxoverlap.backend_autograd import Turns
    from fxoverlap.runtime import ProgramRunner

    merged_calls: list[list[tuple[str, str]]] = []
    orig_turns, orig_call, orig_plain = Turns.run, ProgramRunner.call_stage, ProgramRunner.call_plain
    orig_batch, orig_wait = pl_schedules._batch_p2p, fxpp._wait_works
    # each OVERLAP_F_B step: its F and B stage indices, whether it merged, and its events in
    # order: stage calls (direction, kind), sends issued ("send", desc: "fxoverlap_fwd_send" /
    # "fxoverlap_bwd_send" for the step's early sends), receive waits ("wait", what)
    overlap_steps: list[dict] = []
    current: list = [None]
    sends = {"total": 0, "early": 0}  # non-empty send batches of the whole step (pipelining's and ours)

    def turns(self, other, forward, after_forward=None):
        merged_calls.append([])
        try:
            return orig_turns(self, other, forward, after_forward)
        finally:
            merged_calls.append(None)

    # weight-gradient parts (delay_wgrad) run: inside a BACKWARD_WEIGHT action or elsewhere
    wgrad_calls = {"in_W": 0, "elsewhere": 0}
    in_weight_step = [False]

    def note(stage):
        what = (str(stage.direction), str(stage.kind) + (f".{stage.part}" if str(stage.part) else ""))
        if merged_calls and merged_calls[-1] is not None:
            merged_calls[-1].append(what)
        if current[0] is not None:
            current[0].append(what)
        if str(stage.part) == "wgrad":
            wgrad_calls["in_W" if in_weight_step[0] else "elsewhere"] += 1

    def call_stage(self, node, stage, mb, cross, *bound):
        note(stage)
        return orig_call(self, node, stage, mb, cross, *bound)

    def call_plain(self, stage, mb, *bound):  # the runtime's launch where nothing wraps the stage
        note(stage)
        return orig_plain(self, stage, mb, *bound)

    ours = list(sched.fxoverlap_run.stages.values())  # the stages the schedule runs (built from ours)

    def batch_p2p(ops, desc=None):
        if ops and all(op.op is dist.isend for op in ops):
            sends["total"] += 1
            sends["early"] += bool(desc and desc.startswith("fxoverlap"))
            if current[0] is not None:
                current[0].append(("send", desc or "pipelining"))
        return orig_batch(ops, desc=desc)

    def wait_works(works, what):
        if works is not None and current[0] is not None:
            current[0].append(("wait", what))
        return orig_wait(works, what)

    fmap = getattr(sched, "_comp_type_to_function_map", {})
    # the custom functions pipeline_schedule registered (multi-stage schedules), before we wrap two
    handlers = sorted(str(k) for k in fmap)
    orig_fmap = dict(fmap)
    if pl_schedules.BACKWARD_WEIGHT in fmap:  # BACKWARD_WEIGHT actions run through fxoverlap's custom function
        def weight_step(action, ctx, orig=fmap[pl_schedules.BACKWARD_WEIGHT]):
            in_weight_step[0] = True
            try:
                return orig(action, ctx)
            finally:
                in_weight_step[0] = False

        fmap[pl_schedules.BACKWARD_WEIGHT] = weight_step
    if pl_schedules.OVERLAP_F_B in fmap:
        orig_overlap = fmap[pl_schedules.OVERLAP_F_B]

        def overlap(action, ctx):
            f, b = sorted(action.sub_actions, key=lambda a: a.computation_type != pl_schedules.FORWARD)
            before = sched.fxoverlap_merged_steps
            current[0] = []
            overlap_steps.append({"f": f.stage_index, "b": b.stage_index, "events": current[0]})
            try:
                orig_overlap(action, ctx)
            finally:
                current[0] = None
                overlap_steps[-1]["merged"] = sched.fxoverlap_merged_steps > before

        fmap[pl_schedules.OVERLAP_F_B] = overlap
    Turns.run, ProgramRunner.call_stage, ProgramRunner.call_plain = turns, call_stage, call_plain
    pl_schedules._batch_p2p, fxpp._wait_works = batch_p2p, wait_works
    try:
        sched.step(*args, **kwargs)
    finally:
        Turns.run, ProgramRunner.call_stage, ProgramRunner.call_plain = orig_turns, orig_call, orig_plain
        pl_schedules._batch_p2p, fxpp._wait_works = orig_batch, orig_wait
        fmap.update(orig_fmap)
    order = getattr(sched, "pipeline_order_with_comms", None)
    send_actions = None if order is None else sum(
        a.computation_type in (pl_schedules.SEND_F, pl_schedules.SEND_B) for a in order[sched.rank])

    out: dict = {"rank": rank, "stages": mine, "schedule_type": type(sched).__name__,
                 "is_subclass": isinstance(sched, cls)}
    worst, scale, bitwise, missing, count, rel, dtensor_grads, kinds = 0.0, 0.0, True, [], 0, 0.0, 0, []
    for st in stages:
        for p in st.submod.parameters():
            k = names[id(p)]
            r = ref.get(k)
            if (r is None) != (p.grad is None):
                missing.append(k)
                continue
            if r is None:
                continue
            count += 1
            if _layout(p.grad) != _layout(r):  # a DTensor gradient: the reference's mesh and placements
                kinds.append((k, _layout(p.grad), _layout(r)))
            g, r = _local(p.grad), _local(r)  # torchtitan's EP: DTensor gradients, compared shard by shard
            dtensor_grads += g is not p.grad
            rel = max(rel, ((g.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)).item())
            worst = max(worst, (g.double() - r.double()).abs().max().item())
            scale = max(scale, r.double().abs().max().item())
            bitwise &= torch.equal(g, r)
    out.update(grad_rel_l2=rel, grad_max_abs_diff=worst, grad_max_abs_ref=scale, grad_bitwise=bitwise, missing=missing,
               n_grads=count, dtensor_grads=dtensor_grads, grad_kinds_differ=kinds)
    if has_last:
        out["losses"] = [float(v.detach()) for v in losses]
        out["ref_losses"] = [float(v) for v in ref_losses]
        out["loss_bitwise"] = all(torch.equal(a.detach(), b) for a, b in zip(losses, ref_losses))
    out["forward_calls"] = {st.stage_index: st.fxoverlap_state.forward_calls for st in ours}
    out["overlap_steps"] = getattr(sched, "fxoverlap_overlap_steps", None)
    out["merged_steps"] = getattr(sched, "fxoverlap_merged_steps", None)
    out["merged_calls"] = [c for c in merged_calls if c is not None]
    out["wgrad_calls"] = wgrad_calls
    out["overlap_events"] = overlap_steps
    out["sends"] = dict(sends, actions=send_actions)
    out["stage_rank"] = None if order is None else dict(sched.stage_index_to_group_rank)
    out["num_stages"] = n_stages
    out["hook_calls"] = len(hook_calls)
    out["handlers"] = handlers
    out["graphs"] = {st.stage_index: len(st.fxoverlap_state.steps) for st in ours}
    # fxoverlap parks nothing on pipelining's objects: its state is in fxoverlap_run / fxoverlap_state
    out["parked"] = sorted({n for o in (sched, *ours, *stages) for n in vars(o) if n.startswith("_fxoverlap")})
    out["user_stages_untouched"] = all(type(st) is pipelining.PipelineStage and st.dw_builder is None
                                       and "forward_maybe_with_nosync" not in vars(st) for st in stages)
    out["fxoverlap_stages"] = {i: [(str(s.kind), str(s.direction), s.layer) for s in v]
                               for i, v in sched.fxoverlap_stages.items()}
    return out


def error_case(rank: int, world: int, which: str) -> dict:
    """One rank, one pipeline stage holding the whole model: the error ``which`` raises."""
    import torch.distributed.pipelining as pipelining

    model, vocab = _build("ref", None)
    make = {"nolist": NoListStage, "dtensor": DTensorHeadStage, "ok": RefStage}[which]
    mod = make(model, list(range(N_LAYERS)), True, True)
    stage = pipelining.PipelineStage(mod, 0, 1, torch.device("cpu"), group=dist.group.WORLD)
    sched = fxoverlap.pipeline_schedule(pipelining.Schedule1F1B, stage, 2, loss_fn=loss_fn)
    x = torch.randint(0, vocab, (4, SEQ))
    try:
        sched.step(x, target=x, losses=[])
    except Exception as e:  # the error, and the fxoverlap error in its chain
        chain, cur = [], e
        while cur is not None:
            chain.append((type(cur).__name__, str(cur)[:2000]))
            cur = cur.__cause__ or cur.__context__
        return {"raised": True, "chain": chain}
    return {"raised": False, "grads": sum(p.grad is not None for p in mod.parameters())}


def _is_expert(name: str) -> bool:
    """Whether a parameter of the reference model is an expert weight (held by one EP rank)."""
    return ".moe.experts." in name


def _grad_diff(stages: list, names: dict[int, str], ref: dict[str, torch.Tensor]) -> dict:
    """The stages' parameter gradients against the reference's (by name): the worst relative
    L2 difference of a parameter, the worst absolute one, the largest reference entry."""
    worst = scale = rel = 0.0
    missing, count = [], 0
    for st in stages:
        for p in st.submod.parameters():
            k = names[id(p)]
            if (ref.get(k) is None) != (p.grad is None):
                missing.append(k)
                continue
            count += 1
            d = p.grad.double() - ref[k].double()
            rel = max(rel, (d.norm() / ref[k].double().norm().clamp_min(1e-30)).item())
            worst = max(worst, d.abs().max().item())
            scale = max(scale, ref[k].double().abs().max().item())
    return {"missing": missing, "n_grads": count, "max_abs_diff": worst, "max_abs_ref": scale, "grad_rel_l2": rel}


def _dp_reference(ep_group, seed: int, n_mb: int, group_of, size: int):
    """The data-parallel reference of the DP cases: the unpipelined reference model, eager, on
    this rank's own data (``seed``), each gradient divided by the microbatch count, summed over
    ``group_of(name)`` (None: not summed) and divided by ``size``, as ``fxoverlap.optimize``
    reduces them. Returns ``(x, y, losses, gradients by parameter name)``."""
    g = torch.Generator().manual_seed(seed)
    model, vocab = _build("ref", ep_group)
    x = torch.randint(0, vocab, (n_mb * BATCH_PER_MB, SEQ), generator=g)
    y = torch.randint(0, vocab, (n_mb * BATCH_PER_MB, SEQ), generator=g)
    ref_losses = []
    for xi, yi in zip(x.chunk(n_mb), y.chunk(n_mb)):
        loss = loss_fn(model(xi), yi)
        loss.backward()
        ref_losses.append(loss.detach())
    ref = {}
    for k, p in model.named_parameters():
        if p.grad is not None:
            gr = p.grad / n_mb
            if (group := group_of(k)) is not None:
                dist.all_reduce(gr, group=group)
            ref[k] = gr / size
    return x, y, ref_losses, ref


def run_edp_case(rank: int, world: int) -> dict:
    """PP 1 x DP 4 with EP 2 inside (4 ranks): each rank a one-stage pipeline of its own (the
    whole model, Schedule1F1B, 4 microbatches), ``dp_group`` the world, EP groups {0, 1} and
    {2, 3}, ``expert_dp_group`` the ranks holding the same experts ({0, 2}, {1, 3}); each rank
    its own data. The reference: the eager model, gradients divided by the microbatch count,
    dense ones summed over the world and expert ones over the expert-DP group, both divided by 4."""
    import torch.distributed.pipelining as pipelining

    n_mb, ep = 4, 2
    ep_groups = [dist.new_group(list(range(r, r + ep))) for r in range(0, world, ep)]
    edp_groups = [dist.new_group(list(range(e, world, ep))) for e in range(ep)]
    pp_groups = [dist.new_group([r]) for r in range(world)]
    ep_group, expert_dp_group, pp_group = ep_groups[rank // ep], edp_groups[rank % ep], pp_groups[rank]
    dp_group = dist.group.WORLD
    x, y, ref_losses, ref = _dp_reference(
        ep_group, 100 + rank, n_mb, lambda k: expert_dp_group if _is_expert(k) else dp_group, world)

    model, _ = _build("ref", ep_group)
    names = {id(p): k for k, p in model.named_parameters()}
    stage = pipelining.PipelineStage(RefStage(model, list(range(N_LAYERS)), True, True), 0, 1, torch.device("cpu"),
                                     group=pp_group)
    sched = fxoverlap.pipeline_schedule(pipelining.Schedule1F1B, stage, n_mb, loss_fn=loss_fn, ep_group=ep_group,
                                        config=fxoverlap.OverlapConfig(compiler="eager"), dp_group=dp_group,
                                        expert_dp_group=expert_dp_group)
    losses: list = []
    sched.step(x, target=y, losses=losses)
    red = sched.fxoverlap_run.stages[0].fxoverlap_state.reducer
    return {"rank": rank, **_grad_diff([stage], names, ref),
            "loss_bitwise": len(losses) == n_mb and all(torch.equal(a.detach(), b) for a, b in zip(losses, ref_losses)),
            "expert_params": sorted(k for k, role in red.roles.items() if role == "expert"),
            "want_expert_params": sorted(k for k, _ in stage.submod.named_parameters() if _is_expert(k)),
            "reducers": [(r.size, r.divisor, len(r.params)) for r in red.reducers]}


def run_dp_case(rank: int, world: int, schedule: str, mode: str = "ddp", opts: dict | None = None) -> dict:
    """PP 2 x DP 2 on 4 ranks, each DP rank its own data: ``mode="ddp"``: each stage module
    in DistributedDataParallel over its DP group; ``"dp_group"``: plain stage modules,
    ``pipeline_schedule(..., dp_group=...)`` reduces. ``opts``: ``config`` (OverlapConfig fields),
    ``steps`` (1: steps run, gradients zeroed before the last), ``ep`` (1; 2: the DP group is
    also the EP group, each pipeline rank's 2 ranks holding 2 experts each, ``expert_dp_group=None``:
    ``"dp_group"`` mode only). The reference: the unpipelined model, eager, gradients divided by
    the microbatch count, then as ``fxoverlap.optimize`` reduces them: dense ones averaged over
    the DP group, expert ones (their peers in expert_dp_group: none) divided by its size."""
    import torch.distributed.pipelining as pipelining
    from torch.nn.parallel import DistributedDataParallel as DDP

    n_mb, dp = 4, 2
    opts = opts or {}
    ep = opts.get("ep", 1)
    _gloo_v_warmup()
    pp, pp_rank, dp_rank, ep_group, pp_group = pp_ep_groups(dp)
    ep_group = ep_group if ep > 1 else None  # the rows of the mesh: with ep=2 the EP groups
    dp_group = None
    for r in range(pp):  # the rows of the mesh (the groups pp_ep_groups made first) again, as DP groups
        g = dist.new_group(list(range(r * dp, (r + 1) * dp)))
        if r == pp_rank:
            dp_group = g
    # an expert's gradient already sums over its EP group's tokens: nothing to sum it over
    x, y, ref_losses, ref = _dp_reference(
        ep_group, 100 + dp_rank, n_mb, lambda k: None if ep > 1 and _is_expert(k) else dp_group, dp)

    model, _ = _build("ref", ep_group)
    names = {id(p): k for k, p in model.named_parameters()}
    n_stages, mine = stage_layout(schedule, pp, pp_rank)
    per = N_LAYERS // n_stages
    stages = []
    for s in mine:
        mod = RefStage(model, list(range(s * per, (s + 1) * per)), s == 0, s == n_stages - 1)
        if mode == "ddp":
            mod = DDP(mod, process_group=dp_group)
        stages.append(pipelining.PipelineStage(mod, s, n_stages, torch.device("cpu"), group=pp_group))
    cls = getattr(pipelining, schedule)
    arg = stages[0] if schedule == "Schedule1F1B" else stages
    config = fxoverlap.OverlapConfig(compiler="eager", **opts.get("config", {}))
    errors = {}
    if ep > 1:  # what the groups' check refuses here, before the schedule is made (nothing installed)
        alone = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
        for what, edp in (("expert_dp_is_dp", dp_group), ("expert_dp_of_peer", alone[rank ^ 1])):
            try:
                fxoverlap.pipeline_schedule(cls, arg, n_mb, loss_fn=loss_fn, config=config, ep_group=ep_group,
                                            dp_group=dp_group, expert_dp_group=edp)
                errors[what] = "no error"
            except Exception as e:
                errors[what] = f"{type(e).__name__}: {e}"
    sched = fxoverlap.pipeline_schedule(cls, arg, n_mb, loss_fn=loss_fn, config=config, ep_group=ep_group,
                                        dp_group=dp_group if mode == "dp_group" else None)
    has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    # when each stage's dp_group reduction started: (stage, its backwards run in the step by then)
    starts: list[tuple[int, int]] = []
    stages = list(sched.fxoverlap_run.stages.values())  # the stages the schedule runs (built from ours)
    for st in stages:
        red = st.fxoverlap_state.reducer
        if red is not None:
            orig_start = red.start

            def start(st=st, orig=orig_start):
                starts.append((st.stage_index, st.fxoverlap_state.backwards))
                orig()

            red.start = start
    losses: list = []
    for i in range(opts.get("steps", 1)):
        if i:  # a later step: the same gradients again, from zero
            for st in stages:
                st.submod.zero_grad(set_to_none=True)
        losses = []
        sched.step(*((x,) if has_first else ()), **(dict(target=y, losses=losses) if has_last else {}))
    return {"rank": rank, **_grad_diff(stages, names, ref),
            "stages": {i: len(v) for i, v in sched.fxoverlap_stages.items()}, "reduce_starts": starts,
            "buckets": {st.stage_index: len(st.fxoverlap_state.reducer.buckets()) for st in stages
                        if st.fxoverlap_state.reducer is not None},
            "merged_steps": getattr(sched, "fxoverlap_merged_steps", None),
            "overlap_steps": getattr(sched, "fxoverlap_overlap_steps", None),
            "loss_bitwise": all(torch.equal(a.detach(), b) for a, b in zip(losses, ref_losses)) if has_last else None,
            "n_losses": len(losses),
            # the reduction's roles: the expert parameters it found, and the expected ones, by name
            "expert_params": sorted(names[id(p)] for st in stages if st.fxoverlap_state.reducer is not None
                                    for n, p in st.submod.named_parameters()
                                    if st.fxoverlap_state.reducer.roles.get(n) == "expert"),
            "want_expert_params": sorted(names[id(p)] for st in stages if st.fxoverlap_state.reducer is not None
                                         for p in st.submod.parameters() if _is_expert(names[id(p)])),
            # per stage: (group size, divisor, parameters) of each reducer
            "reducers": {st.stage_index: [(r.size, r.divisor, len(r.params)) for r in st.fxoverlap_state.reducer.reducers]
                         for st in stages if st.fxoverlap_state.reducer is not None},
            "errors": errors}


def dp_error_case(rank: int, world: int) -> dict:
    """What ``pipeline_schedule(..., dp_group=...)`` refuses, each error as ``"Type: message"``;
    the stages are built only (nothing runs). Two ranks: the pipeline group is the world."""
    import torch.distributed.pipelining as pipelining
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, _ = _build("ref", None)

    def stage(wrap=lambda m: m):
        mod = wrap(RefStage(model, list(range(N_LAYERS)), rank == 0, rank == world - 1))
        return pipelining.PipelineStage(mod, rank, world, torch.device("cpu"), group=dist.group.WORLD)

    def error(**kwargs) -> str:
        st = kwargs.pop("st", None) or stage()
        try:
            fxoverlap.pipeline_schedule(pipelining.Schedule1F1B, st, 4, loss_fn=loss_fn, **kwargs)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    groups = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    mine = groups[rank]  # a DP group of this rank alone: meets the pipeline group in this rank
    return {
        "not_group": error(dp_group="dp"),
        "ddp": error(st=stage(lambda m: DDP(m, process_group=mine)), dp_group=mine),
        "reduce_scatter": error(dp_group=mine, config=fxoverlap.OverlapConfig(grad_reduce="reduce_scatter")),
        "bucket_without_dp": error(config=fxoverlap.OverlapConfig(reduce_bucket_mb=1.0)),
        "shares_pipeline": error(dp_group=dist.group.WORLD),
        "expert_dp_without_dp": error(expert_dp_group=mine),
        "ep_outside_dp": error(dp_group=mine, ep_group=dist.group.WORLD),
        "expert_dp_not_group": error(dp_group=mine, expert_dp_group=[0]),
    }


def privates_case(rank: int, world: int) -> dict:
    """Which of ``fxoverlap.pipelining_privates.NEEDED`` the pinned torch lacks: each looked up
    on ``schedules``, on a multi-stage runtime schedule and on its ``PipelineStage``s (built
    only; nothing runs). One rank, two stages of a linear layer each."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import schedules

    from fxoverlap.pipelining_privates import NEEDED, has_internal

    stages = [pipelining.PipelineStage(nn.Linear(4, 4), s, 2, torch.device("cpu")) for s in range(2)]
    sched = pipelining.ScheduleInterleaved1F1B(stages, 2, loss_fn=lambda out, tgt: out.sum())
    owners = {"schedules": schedules, "schedule": sched, "stage": stages[0]}
    return {"missing": [f"{where}.{name}" for where, name in NEEDED if not has_internal(owners[where], name)],
            "checked": len(NEEDED), "runtime": isinstance(sched, schedules._PipelineScheduleRuntime)}
