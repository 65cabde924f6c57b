"""A training loop changes the model between calls: each change gives eager's answer in the new
state (a program compiled anew under its :class:`~fxoverlap.program_key.ProgramKey`), or a named
refusal. One test per key field, each starting from a program compiled in the old state.

Reference: the same loop in eager PyTorch on a copy of the model (same weights, data, seed);
CPU, eager stages: bitwise.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxoverlap
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.program_key import RepeatedRecompileWarning, UnsupportedModelState, fn_key
from fxoverlap.testing import run_distributed, token_batches
from rng_models import RandomTransformer

EAGER = fxoverlap.OverlapConfig(compiler="eager")


def _loss(out, tokens):
    return out.float().pow(2).mean()


def _mbs(n: int = 2, seed: int = 0, shape=(2, 16)):
    return [(t,) for t, _ in token_batches(256, n, shape=shape, seed=seed)]


def _model(seed: int = 0, **cfg) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(MoEConfig.tiny(**cfg), None)


def _eager(model: nn.Module, mbs, loss_fn=_loss) -> list[torch.Tensor]:
    losses = []
    for mb in mbs:
        loss = model(*mb) if loss_fn is None else loss_fn(model(*mb), *mb)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _same(model: nn.Module, ref: nn.Module, losses=None, ref_losses=None) -> None:
    """Losses and every parameter's .grad (None included) bitwise equal."""
    if losses is not None:
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    for name, p in want.items():
        g = got[name].grad
        assert (g is None) == (p.grad is None), name
        assert g is None or torch.equal(g, p.grad), name


def _step(engine, model, ref, mbs, loss_fn=_loss, check=lambda model: None):
    losses = engine.forward_backward(mbs, loss_fn)
    ref_losses = _eager(ref, mbs, loss_fn)
    _same(model, ref, losses, ref_losses)
    check(model)
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


def _pair(**cfg):
    model = _model(**cfg)
    return model, copy.deepcopy(model), fxoverlap.optimize(model, None, EAGER)


# ---------------------------------------------------------------- training flags
def test_eval_and_train_switch_programs_both_ways():
    """model.eval() turns dropout off for forward_backward and engine(x); train() back on; each
    state compiles once and is reused after."""
    torch.manual_seed(0)
    model = RandomTransformer(MoEConfig.tiny(), None, p=0.25)
    ref = copy.deepcopy(model)
    engine = fxoverlap.optimize(model, None, EAGER)
    mbs = token_batches(256, 2, seed=1)
    for mode in ("train", "eval", "train", "eval"):
        for m in (model, ref):
            getattr(m, mode)()
        torch.manual_seed(5)
        losses = engine.forward_backward(mbs)
        torch.manual_seed(5)
        ref_losses = _eager(ref, mbs, None)
        _same(model, ref, losses, ref_losses)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch.manual_seed(6)
            out = engine(*mbs[0])
            torch.manual_seed(6)
            assert torch.equal(out, ref(*mbs[0]))
    assert engine.cache.compiles == 4  # train and eval, each for forward_backward and engine(x)


# ---------------------------------------------------------------- params: requires_grad, dtype, new objects
def test_freezing_after_the_first_step_and_unfreezing_later():
    model, ref, engine = _pair()
    mbs = _mbs()
    _step(engine, model, ref, mbs)
    for m in (model, ref):
        m.layers[0].requires_grad_(False)
    _step(engine, model, ref, mbs, check=lambda m: all(p.grad is None for p in m.layers[0].parameters()) or 1 / 0)
    for m in (model, ref):
        m.layers[0].requires_grad_(True)
    _step(engine, model, ref, mbs,
          check=lambda m: all(p.grad is not None for p in m.layers[0].parameters()) or 1 / 0)


def test_frozen_parameters_are_not_moved_by_the_optimizer():
    model, ref, engine = _pair()
    mbs = _mbs()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(3):
        if step == 1:
            for m in (model, ref):
                m.output.weight.requires_grad_(False)
        frozen = model.output.weight.detach().clone()
        losses = engine.forward_backward(mbs, _loss)
        _same(model, ref, losses, _eager(ref, mbs))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        if step >= 1:
            assert torch.equal(model.output.weight, frozen)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def test_new_parameter_objects_keep_training():
    """load_state_dict(assign=True) and model.to(dtype) make new parameter objects: the program
    writes their .grad, not the old ones'."""
    model, ref, engine = _pair()
    mbs = _mbs()
    _step(engine, model, ref, mbs)
    state = {k: v.clone() + 0.01 for k, v in ref.state_dict().items()}
    old = list(model.parameters())
    model.load_state_dict(state, assign=True)
    ref.load_state_dict(state, assign=True)
    assert not any(p is q for p, q in zip(old, model.parameters()))
    losses = engine.forward_backward(mbs, _loss)
    _same(model, ref, losses, _eager(ref, mbs))
    assert all(p.grad is None for p in old)
    assert engine.cache.compiles == 1  # same metadata: the program is reused
    model.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    for m in (model, ref):
        m.to(torch.float64)
    _step(engine, model, ref, mbs)  # a dtype change compiles anew
    assert engine.cache.compiles == 2


def test_deepcopy_of_the_engine_trains_the_copy():
    model, ref, engine = _pair()
    mbs = _mbs()
    _step(engine, model, ref, mbs)
    twin = copy.deepcopy(engine)
    assert twin.model is not model
    losses = twin.forward_backward(mbs, _loss)
    _same(twin.model, ref, losses, _eager(ref, mbs))
    assert all(p.grad is None for p in model.parameters())


def test_buffer_dtype_change_compiles_anew():
    base = _model()  # with a buffer the forward reads: a scale
    base.register_buffer("scale", torch.tensor(2.0))
    base.forward = functools.partial(_scaled_forward, base)
    ref = copy.deepcopy(base)
    ref.forward = functools.partial(_scaled_forward, ref)
    engine = fxoverlap.optimize(base, None, EAGER)
    mbs = _mbs()
    _step(engine, base, ref, mbs)
    for m in (base, ref):
        m.scale = m.scale.double()
    _step(engine, base, ref, mbs)
    assert engine.cache.compiles == 2


def _scaled_forward(self, tokens):
    return MoETransformer.forward(self, tokens) * self.scale


# ---------------------------------------------------------------- inputs
def test_input_shape_dtype_and_stride_each_compile_once():
    model, ref, engine = _pair()
    a, b = _mbs(shape=(2, 16)), _mbs(shape=(2, 24), seed=1)
    t = [(x[0].t().contiguous().t(),) for x in _mbs(shape=(16, 2), seed=2)]  # strided input
    assert not t[0][0].is_contiguous()
    for mbs in (a, b, t, a, b, t):
        _step(engine, model, ref, mbs)
    assert engine.cache.compiles == 3


# ---------------------------------------------------------------- grad mode, autocast, determinism
def test_grad_mode_is_part_of_the_key():
    model, ref, engine = _pair()
    x = _mbs()[0][0]
    with torch.no_grad():
        a = engine(x)
    b = engine(x)
    assert torch.equal(a, b) and torch.equal(a, ref(x).detach())
    assert engine.cache.compiles == 2


@pytest.mark.parametrize("first", [pytest.param("fp32", marks=pytest.mark.slow), "autocast"])
def test_autocast_switched_between_calls(first):
    """fp32 then autocast crashed in a backward stage; autocast then fp32 stayed bf16."""
    model, ref, engine = _pair()
    mbs = _mbs()
    order = [first, "autocast" if first == "fp32" else "fp32"]
    for mode in order:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else torch.autocast("cpu", enabled=False)
        with ctx:
            losses = engine.forward_backward(mbs, _loss)
            ref_losses = _eager(ref, mbs)
            out, ref_out = engine(mbs[0][0]), ref(mbs[0][0])
        _same(model, ref, losses, ref_losses)
        assert out.dtype == ref_out.dtype == (torch.bfloat16 if mode == "autocast" else torch.float32)
        assert torch.equal(out, ref_out.detach())
        model.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)


def test_deterministic_algorithms_compile_anew():
    model, ref, engine = _pair()
    mbs = _mbs()
    _step(engine, model, ref, mbs)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _step(engine, model, ref, mbs)
    finally:
        torch.use_deterministic_algorithms(was)
    assert engine.cache.compiles == 2


# ---------------------------------------------------------------- hooks
def test_forward_hook_added_and_removed_later():
    model, ref, engine = _pair()
    mbs = _mbs()
    _step(engine, model, ref, mbs)
    handles = [m.layers[1].register_forward_hook(lambda mod, args, out: out * 2) for m in (model, ref)]
    _step(engine, model, ref, mbs)
    pre = [m.layers[0].register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,)) for m in (model, ref)]
    _step(engine, model, ref, mbs)
    for h in handles + pre:
        h.remove()
    _step(engine, model, ref, mbs)
    assert engine.cache.compiles == 3  # no hooks (reused at the end), one, two


def test_parameter_tensor_hooks_and_post_accumulate_hooks_run_each_microbatch():
    model, ref, engine = _pair()
    mbs = _mbs(3)
    _step(engine, model, ref, mbs)
    seen = {"fx": [], "eager": []}
    for m, tag in ((model, "fx"), (ref, "eager")):
        m.output.weight.register_hook(lambda g: g * 3)
        m.norm.weight.register_hook(lambda g, tag=tag: seen[tag].append(("hook", g.norm().item())))
        m.norm.weight.register_post_accumulate_grad_hook(
            lambda p, tag=tag: seen[tag].append(("post", p.grad.norm().item())))
    _step(engine, model, ref, mbs)
    assert seen["fx"] == seen["eager"] and len(seen["fx"]) == 6
    assert engine.cache.compiles == 1  # honoured at run time: nothing recompiled


def test_module_backward_hooks_are_refused_by_name():
    model, _, engine = _pair()
    mbs = _mbs()
    engine.forward_backward(mbs, _loss)
    model.layers[1].attention.register_full_backward_hook(lambda *a: None)
    with pytest.raises(UnsupportedModelState, match=r"layers\.1\.attention .*backward hook.*register_hook"):
        engine.forward_backward(mbs, _loss)


# ---------------------------------------------------------------- the loss function
def test_a_fresh_lambda_each_call_reuses_one_program():
    model, ref, engine = _pair()
    mbs = _mbs()
    for _ in range(5):
        _step(engine, model, ref, mbs, lambda out, tokens: out.float().pow(2).mean())
    assert engine.cache.compiles == 1


def test_a_fresh_output_fn_each_forward_only_call_reuses_one_program():
    model, ref, engine = _pair()
    mbs = _mbs(3)
    for i in range(4):
        outs = engine.forward_only(mbs, output_fn=lambda out, tokens: out[:, -1])
        with torch.no_grad():
            assert all(torch.equal(o, ref(*mb)[:, -1]) for o, mb in zip(outs, mbs, strict=True))
    assert engine.cache.compiles == 1


def test_closure_values_are_in_the_key_and_the_cache_is_bounded():
    # A bound of 3 (the default is 8) evicts after a few compiles: each compile is a capture.
    assert fxoverlap.OverlapConfig().max_programs == 8
    model = _model()
    ref = copy.deepcopy(model)
    engine = fxoverlap.optimize(model, None, fxoverlap.OverlapConfig(compiler="eager", max_programs=3))
    mbs = _mbs(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            scale = float(i + 1)
            _step(engine, model, ref, mbs, lambda out, tokens: out.float().pow(2).mean() * scale)
    assert engine.cache.compiles == 5 and len(engine.cache) == 3
    repeated = [w for w in caught if issubclass(w.category, RepeatedRecompileWarning)]
    assert len(repeated) == 1 and "cache_hash" in str(repeated[0].message)


def test_cache_hash_and_partials_and_loss_modules():
    def scaled(out, tokens, k):
        return out.float().pow(2).mean() * k

    assert fn_key(functools.partial(scaled, k=2.0)) == fn_key(functools.partial(scaled, k=2.0))
    assert fn_key(functools.partial(scaled, k=2.0)) != fn_key(functools.partial(scaled, k=3.0))
    assert fn_key(nn.CrossEntropyLoss()) == fn_key(nn.CrossEntropyLoss())
    assert fn_key(nn.CrossEntropyLoss(label_smoothing=0.1)) != fn_key(nn.CrossEntropyLoss())
    a, b = (lambda o, t: o.sum()), (lambda o, t: o.mean())
    a.cache_hash = b.cache_hash = "same"
    assert fn_key(a) == fn_key(b)
    t1, t2 = torch.ones(1), torch.ones(1)
    assert fn_key(lambda o, t: o * t1) != fn_key(lambda o, t: o * t2)  # tensors by identity


# ---------------------------------------------------------------- wrappers
def test_ddp_wrappers_are_refused():
    run_distributed(_ddp_case, world_size=1)


def _ddp_case(rank: int, world: int) -> None:
    model = _model()
    with pytest.raises(UnsupportedModelState, match=r"DistributedDataParallel.*dp_group="):
        fxoverlap.optimize(nn.parallel.DistributedDataParallel(model), None, EAGER)
    engine = fxoverlap.optimize(model, None, EAGER)
    ddp = nn.parallel.DistributedDataParallel(model)  # built after optimize
    with pytest.raises(UnsupportedModelState, match=r"wraps the model .*dp_group="):
        engine.forward_backward(_mbs(), _loss)
    del ddp


def test_fully_shard_after_the_first_step_is_caught():
    run_distributed(_fsdp_case, world_size=1)


def _fsdp_case(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    engine = fxoverlap.optimize(model, None, EAGER)
    engine.forward_backward(_mbs(), _loss)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(fxoverlap.FxOverlapError, match="fully_shard"):
        engine.forward_backward(_mbs(), _loss)


# ---------------------------------------------------------------- with expert parallelism (2 gloo ranks)
def test_training_loop_changes_with_ep2():
    """eval, freezing, a new state dict by assign=True and a forward hook, on 2 EP ranks."""
    run_distributed(_ep_case)


def _ep_case(rank: int, world: int) -> None:
    group = dist.group.WORLD
    model, ref = (RandomTransformer(MoEConfig.tiny(), group, p=0.25) for _ in range(2))
    ref.load_state_dict(model.state_dict())  # (a model holding a process group cannot be deep-copied)
    engine = fxoverlap.optimize(model, group, EAGER)
    mbs = token_batches(256, 2, seed=rank)

    def step():
        torch.manual_seed(11)
        losses = engine.forward_backward(mbs)
        torch.manual_seed(11)
        _same(model, ref, losses, _eager(ref, mbs, None))
        model.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)

    step()
    model.eval(), ref.eval()
    step()
    for m in (model, ref):
        m.layers[0].requires_grad_(False)
    step()
    state = {k: v + 0.01 for k, v in ref.state_dict().items()}
    model.load_state_dict(state, assign=True), ref.load_state_dict(state, assign=True)
    step()
    for m in (model, ref):
        m.layers[1].register_forward_hook(lambda mod, args, out: out * 2)
    step()
    assert engine.cache.compiles == 4


# ---------------------------------------------------------------- the key's config and groups, the cache
def test_config_and_groups_are_in_the_key():
    from fxoverlap.program_key import program_key

    model, mbs = _model(), _mbs()
    key = functools.partial(program_key, model, mbs[0], (), _loss, "train")
    base = key(EAGER, {"ep": None})
    assert key(EAGER, {"ep": None}) == base
    assert key(fxoverlap.OverlapConfig(compiler="eager", chunks=2), {"ep": None}).differences(base) == [
        f"config: {EAGER!r} -> {fxoverlap.OverlapConfig(compiler='eager', chunks=2)!r}"]
    assert key(EAGER, {"ep": None, "dp": None}) != base


def test_the_cache_evicts_the_least_recently_used_and_closes_it():
    from fxoverlap.program_key import ProgramCache, program_key

    closed = []
    cache = ProgramCache(2, close=closed.append)
    model, x = _model(), _mbs()[0]
    keys = [program_key(model, (x[0][:, :n],), (), _loss, "train", EAGER, {}) for n in (4, 8, 12)]
    cache.put(keys[0], "a"), cache.put(keys[1], "b")
    assert cache.get(keys[0]) == "a"  # now the most recent
    cache.put(keys[2], "c")
    assert closed == ["b"] and cache.get(keys[1]) is None and len(cache) == 2


def test_every_compile_logs_why(caplog):
    import logging

    model, ref, engine = _pair()
    mbs = _mbs()
    with caplog.at_level(logging.INFO, logger="fxoverlap"):
        engine.forward_backward(mbs, _loss)
        model.layers[0].requires_grad_(False)
        engine.forward_backward(mbs, _loss)
        model.eval()
        engine.forward_backward(mbs, _loss)
    reasons = [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]
    assert len(reasons) == 3
    assert "first call" in reasons[0]
    assert "params 'layers.0." in reasons[1] and "True" in reasons[1]
    assert "now in eval mode" in reasons[2]


def test_the_model_walk_reads_what_named_modules_and_named_parameters_read():
    """``model_state``'s one walk (the key, the static values, the gradient sink: one lookup per
    call) gives exactly the training flags, hooks, parameters and buffers that the key read
    through ``named_modules`` / ``named_parameters`` / ``named_buffers`` before: a module shared
    under two names (its parameters under both, its flags and hooks once), a None child, a None
    parameter, eval mode and forward hooks deep in the tree; a module overriding
    ``named_modules`` is read through the methods."""
    from fxoverlap.program_key import _model_state_by_methods, model_state

    shared = nn.Linear(4, 4)
    shared.register_buffer("scale", torch.ones(4))
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), shared, nn.LayerNorm(4))
    model[0].register_module("missing", None)
    model[2].register_parameter("absent", None)
    model[0].eval()
    shared.eval()
    handle = shared.register_forward_hook(lambda m, a, o: None)
    model.register_forward_pre_hook(lambda m, a: None)
    fast, slow = model_state(model), _model_state_by_methods(model)
    assert fast == slow
    assert [n for n, _ in fast.params] == ["0.0.weight", "0.0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert fast.eval_modules == ("0", "0.0", "0.1") and [h[0] for h in fast.hooks] == ["", "0.0"]
    assert fast.tensors.params["1.weight"] is shared.weight and fast.tensors.buffers["1.scale"] is shared.scale
    handle.remove()
    assert model_state(model).hooks != fast.hooks

    class Renamed(nn.Sequential):
        def named_modules(self, *args, **kwargs):
            return super().named_modules(*args, **kwargs)

    odd = Renamed(nn.Linear(2, 2))
    assert model_state(odd) == _model_state_by_methods(odd)
    with pytest.raises(UnsupportedModelState):
        shared.register_full_backward_hook(lambda *a: None)
        model_state(model)
