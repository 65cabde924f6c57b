"""Bad input gets a clear error naming the node, the op and the reason (or a documented fallback).

Every error fxoverlap raises derives from ``fxoverlap.FxOverlapError`` and keeps its builtin base:

* every ``Exception`` subclass defined in a module of fxoverlap (``fxoverlap.passes`` and
  ``fxoverlap.kernels`` included) derives from ``FxOverlapError``;
* no ``raise <builtin exception>(...)`` is left in ``fxoverlap/``, ``passes/`` or ``kernels/``
  (an AST check; the check itself is shown to flag a planted ``raise ValueError("x")``);
* the errors whose builtin base callers catch keep it.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pathlib
import pkgutil

import pytest
import torch
import torch.nn as nn

import error_cases
import fxoverlap
from fxoverlap import FxOverlapError, ops
from fxoverlap.models import MoEConfig
from fxoverlap.passes import CaptureError, TagError, capture, split, tag
from fxoverlap.testing import run_distributed

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.ffn = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.ffn(x)


class Stack(nn.Module):
    def __init__(self, n=2, reduce=True):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.reduce = reduce

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).sum() if self.reduce else x


def test_no_layers_falls_back_with_warning_and_stays_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    engine = fxoverlap.optimize(model)
    with pytest.warns(UserWarning, match="no decoder layers found"):
        engine.forward_backward([(x,)], loss_fn=lambda out, x: out.sum())
    assert [s.name for s in engine.stages] == ["fwd_model_head", "bwd_model_head"]
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))


class TopLevelA2A(Stack):
    def forward(self, x):
        counts = torch.tensor([x.shape[0]])
        x, _ = ops.dispatch(x, counts, None)  # an all-to-all outside every layer
        return super().forward(x)


def test_all_to_all_outside_layers_names_node_and_op():
    with pytest.raises(TagError, match=r"node dispatch \(fxoverlap\.dispatch\) is an all-to-all outside every decoder layer"):
        tag(capture(TopLevelA2A(), (torch.randn(4, 8),)))


def test_non_scalar_output_without_loss_fn():
    engine = fxoverlap.optimize(Stack(reduce=False))
    with pytest.raises(CaptureError, match=r"returned a tensor of shape \[4, 8\].*pass loss_fn="):
        engine.forward_backward([torch.randn(4, 8)])
    # ... and the same model works once a loss function is given
    losses = engine.forward_backward([torch.randn(4, 8)], loss_fn=lambda out, x: out.mean())
    assert losses[0].dim() == 0


class SyncBlock(Block):
    def forward(self, x):
        scale = x.detach().abs().max().item()  # host sync
        return x + self.ffn(x) * scale


def test_host_sync_marks_stage_not_capturable():
    model = Stack()
    model.layers[1] = SyncBlock()
    cap = capture(model, (torch.randn(4, 8),))
    stages = {s.name: s for s in split(tag(cap), cap.num_layers)}
    assert not stages["fwd_l1_attn"].capturable
    assert "host sync at node _local_scalar_dense" in stages["fwd_l1_attn"].not_capturable_reason
    assert stages["fwd_l0_mlp"].capturable


def test_empty_microbatch_list():
    with pytest.raises(ValueError, match="empty list of microbatches"):
        fxoverlap.optimize(Stack()).forward_backward([])


def test_microbatch_shapes_differ():
    engine = fxoverlap.optimize(Stack())
    with pytest.raises(ValueError, match=r"microbatch 1 has inputs \(float32\[2, 8\]\) but microbatch 0 has \(float32\[4, 8\]\)"):
        engine.forward_backward([torch.randn(4, 8), torch.randn(2, 8)])


def test_new_shapes_in_a_later_call_are_captured_anew():
    torch.manual_seed(0)
    model = Stack()
    engine = fxoverlap.optimize(model)
    for rows in (4, 6):
        x = torch.randn(rows, 8)
        model.zero_grad(set_to_none=True)
        model(x).backward()
        ref = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        engine.forward_backward([x])
        assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))
    # one plan per input signature, kept: the last call ran the 6-row plan's program, and
    # the 4-row plan is still there, with a capture of its own
    six, four = engine.plan([torch.randn(6, 8)]), engine.plan([torch.randn(4, 8)])
    assert engine.program is six.program
    assert four.capture is not six.capture and four.capture.signature != six.capture.signature
    assert engine.plan([torch.randn(4, 8)]).program is four.program


def test_config_errors():
    with pytest.raises(ValueError, match="mhc_recompute_group"):
        fxoverlap.OverlapConfig(mhc_recompute_group=0)
    with pytest.raises(ValueError, match="layer_pattern entries"):
        MoEConfig.tiny(layer_pattern=("moe", "mlp"))
    with pytest.raises(ValueError, match="token_dedup needs routing='dropless'"):
        MoEConfig.tiny(routing="capacity", token_dedup=True)


def test_expert_count_not_divisible_by_group():
    for msg, token_msg in run_distributed(error_cases.bad_expert_split):
        assert "has 3 experts" in msg and "group of 2 ranks" in msg
        assert "token_dispatch: 3 experts cannot be split" in token_msg and "group of 2 ranks" in token_msg


def test_rank_failure_does_not_hang_peers():
    """Documented behaviour: the failing rank aborts the EP group, so a peer blocked
    in a collective gets a connection error instead of waiting for a timeout."""
    (kind0, msg0, t0), (kind1, msg1, t1) = run_distributed(error_cases.rank_failure)
    assert kind1 == "StageFailed" and "stage fwd_l1_attn" in msg1 and "injected failure" in msg1
    assert kind0 == "StageFailed" and "fwd_l1_dispatch" in msg0
    assert t0 < 60, f"peer took {t0:.1f}s to notice"


# ================================================================ one base: FxOverlapError

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("fxoverlap", "passes", "kernels")

# modules not imported here, with the reason
NOT_IMPORTED = {
    "fxoverlap.bench.__main__": "runs the benchmark when imported (python -m fxoverlap.bench)",
}
# modules that need a GPU toolchain to import: skipped, with the reason, where it is missing
NEEDS = {
    "fxoverlap.kernels.symm_mem": "triton",
    "fxoverlap.kernels.row_sum": "triton",
}


def _modules() -> list[str]:
    # passes/ and kernels/ install as fxoverlap.passes / fxoverlap.kernels through package_dir: walk each
    import fxoverlap.kernels
    import fxoverlap.passes

    names = set()
    for pkg in (fxoverlap, fxoverlap.passes, fxoverlap.kernels):
        names |= {m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")}
    names |= {"fxoverlap.passes", "fxoverlap.kernels"}
    assert {"fxoverlap.passes.tag", "fxoverlap.kernels.a2a", "fxoverlap.ir.errors"} <= set(names)
    return sorted(n for n in names if n not in NOT_IMPORTED)


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        need = NEEDS.get(name)
        if need is not None and need in str(e):
            pytest.skip(f"{name} needs {need} to import: {e}")
        raise


@pytest.mark.parametrize("name", _modules())
def test_every_error_defined_derives_from_fxoverlap_error(name):
    mod = _import(name)
    defined = [c for _, c in inspect.getmembers(mod, inspect.isclass)
               if c.__module__ == mod.__name__ and issubclass(c, Exception) and not issubclass(c, Warning)]
    bad = [c.__qualname__ for c in defined if not issubclass(c, FxOverlapError)]
    assert not bad, f"{name} defines exceptions that do not derive from fxoverlap.FxOverlapError: {bad}"


# ------------------------------------------------------------------ no raw builtin raises

BUILTIN_ERRORS = frozenset(
    n for n in dir(builtins)
    if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), Exception)
    and not issubclass(getattr(builtins, n), Warning)
)


def builtin_raises(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: Name`` for each ``raise <builtin exception>`` / ``raise <builtin>(...)`` in ``source``.
    ``raise SystemExit(...)`` (a script's exit status) is not an error and is not flagged."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS:
                out.append((node.lineno, f"{filename}:{node.lineno}: {exc.id}"))
    return [hit for _, hit in sorted(out)]


def _sources() -> list[pathlib.Path]:
    # fxoverlap/passes and fxoverlap/kernels may be links to passes/ and kernels/: read those once
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))
             if p.relative_to(ROOT).parts[:2] not in (("fxoverlap", "passes"), ("fxoverlap", "kernels"))]
    assert len(files) > 30, files
    return files


def test_checker_flags_a_planted_raw_raise():
    src = "def f(x):\n    if x:\n        raise ValueError('x')\n    raise KeyError\n"
    assert builtin_raises(src, "planted.py") == ["planted.py:3: ValueError", "planted.py:4: KeyError"]
    ours = ("from fxoverlap.config import ConfigError\n"
            "def f(e):\n    raise ConfigError('x')\n    raise\n    raise e\n    raise SystemExit(0)\n")
    assert builtin_raises(ours) == []


def test_no_raw_builtin_raise_in_fxoverlap():
    found = [hit for p in _sources() for hit in builtin_raises(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, ("raise one of fxoverlap's errors (an FxOverlapError keeping the builtin base), "
                       "not a builtin exception:\n" + "\n".join(found))


# ------------------------------------------------------------------ builtin bases kept

def test_errors_keep_their_builtin_base():
    from fxoverlap.config import ConfigError, DispatcherUnavailable
    from fxoverlap.engine import InputError, MicrobatchError, MicrobatchMismatch
    from fxoverlap.expert_parallel import ExpertParallelError
    from fxoverlap.ir.errors import InternalError
    from fxoverlap.passes.capture import CaptureError
    from fxoverlap.passes.reduce import ReduceError
    from fxoverlap.passes.tag import TagError
    from fxoverlap.runtime import StageFailed

    for cls, base in [(ConfigError, ValueError), (DispatcherUnavailable, ImportError),
                      (DispatcherUnavailable, ValueError), (InputError, TypeError), (MicrobatchError, ValueError),
                      (MicrobatchMismatch, ValueError), (ExpertParallelError, ValueError),
                      (InternalError, AssertionError), (CaptureError, RuntimeError),
                      (ReduceError, NotImplementedError), (TagError, RuntimeError), (StageFailed, RuntimeError)]:
        assert issubclass(cls, FxOverlapError) and issubclass(cls, base), (cls, base)
    assert fxoverlap.FxOverlapError is FxOverlapError and fxoverlap.ConfigError is ConfigError


def test_config_errors_are_ours_and_value_errors():
    from fxoverlap.config import OverlapConfig

    for bad in ({"dispatcher": "nope"}, {"compiler": "tvm"}, {"reduce_bucket_mb": -1},
                {"dispatch_capacity_factor": 0}, {"mhc_recompute_group": 0}, {"grad_reduce": "x"}):
        with pytest.raises(fxoverlap.ConfigError):
            OverlapConfig(**bad)
        with pytest.raises(ValueError):
            OverlapConfig(**bad)


def test_region_and_model_config_errors():
    from fxoverlap.models.moe import MoEConfig, ModelConfigError
    from fxoverlap.region import RegionError

    with pytest.raises(RegionError, match="unknown region"):
        with fxoverlap.region("nope"):
            pass
    with pytest.raises(ModelConfigError, match="top_k"):
        MoEConfig(top_k=0)
    assert issubclass(RegionError, ValueError) and issubclass(ModelConfigError, ValueError)


# ================================================================ the torch.compile backend

def test_backend_refuses_fields_it_cannot_honour():
    import fxoverlap.backend as fxb

    for opts, names in [({"record_memory": True}, ["record_memory"]),
                        ({"grad_reduce": "reduce_scatter", "reduce_bucket_mb": 0}, ["grad_reduce", "reduce_bucket_mb"]),
                        ({"dispatch_capacity_factor": 1.5, "dispatcher": "padded"}, ["dispatch_capacity_factor"])]:
        with pytest.raises(fxoverlap.ConfigError, match="cannot honour") as e:
            fxb.backend_config(opts)
        assert all(n in str(e.value) for n in names) and "fxoverlap.optimize" in str(e.value)
    # their defaults are what the backend does: passing them is no error
    fxb.backend_config({"record_memory": False, "grad_reduce": "all_reduce", "reduce_bucket_mb": 25.0})


def test_backend_refuses_unknown_options_naming_close_matches():
    import fxoverlap.backend as fxb

    with pytest.raises(fxoverlap.ConfigError, match=r"unknown option 'chunk' \(did you mean 'chunks'") as e:
        fxb.backend_config({"chunk": 2})
    assert "OverlapConfig field" in str(e.value) and "torch._inductor.config" in str(e.value)
    with pytest.raises(fxoverlap.ConfigError, match=r"'delay_wgard' \(did you mean 'delay_wgrad'") as e:
        fxb.backend_config(delay_wgard=True)
    with pytest.raises(ValueError, match=r"'max_autotun' \(did you mean 'max_autotune'"):
        fxb.backend_config({"max_autotun": True})
    cfg = fxb.backend_config({"max_autotune": True, "triton.cudagraphs": False, "overlap": False})
    assert dict(cfg.compile_options) == {"max_autotune": True, "triton.cudagraphs": False} and not cfg.side_stages
    with pytest.raises(fxoverlap.ConfigError, match="unknown mode"):
        fxb.backend_config(mode="fastest")


def test_unknown_config_field_names_the_closest_field():
    """``OverlapConfig(chunk=2)``: a ConfigError that is also the TypeError Python raises for an
    unknown keyword, with the closest field; the backend's options use the same check."""
    import dataclasses

    import fxoverlap.backend as fxb
    from fxoverlap.config import UnknownConfigField

    with pytest.raises(UnknownConfigField, match=r"unknown field 'chunk' \(did you mean 'chunks'") as e:
        fxoverlap.OverlapConfig(chunk=2)
    assert isinstance(e.value, TypeError) and isinstance(e.value, fxoverlap.ConfigError)
    assert "chunks_in_merged_steps" in str(e.value)  # the fields are listed
    with pytest.raises(TypeError, match=r"'delay_wgard' \(did you mean 'delay_wgrad'"):
        dataclasses.replace(fxoverlap.OverlapConfig(), delay_wgard=True)
    with pytest.raises(UnknownConfigField, match=r"'zzz'(?! \(did you mean)"):
        fxoverlap.OverlapConfig(zzz=1)
    with pytest.raises(UnknownConfigField, match=r"unknown option 'chunk' \(did you mean 'chunks'"):
        fxb.backend_config({"chunk": 2})
    # known fields, by keyword and by position, are as before
    assert fxoverlap.OverlapConfig("eager", None, "layers").layer_container == "layers"
    assert fxoverlap.OverlapConfig(chunks=2) == fxoverlap.OverlapConfig(chunks=2)


def test_backend_unknown_option_is_an_error_on_cpu_too():
    model = Stack()
    compiled = torch.compile(model, backend="fxoverlap", options={"chunk": 2})
    with pytest.raises(Exception) as e:  # Dynamo wraps what a backend raises
        compiled(torch.randn(4, 8))
    chain = [e.value, *(x for x in (e.value.__cause__, e.value.__context__) if x is not None)]
    assert any(isinstance(x, fxoverlap.ConfigError) for x in chain) or "unknown option 'chunk'" in str(e.value)
    torch._dynamo.reset()


def test_backend_fallback_catches_expected_errors_only(monkeypatch):
    """Ours and the torch errors of FALLBACK_ERRORS fall back, with a warning; anything else
    (a bug in fxoverlap) propagates."""
    import fxoverlap.backend as fxb

    def raising(exc):
        def compile_step(*args, **kwargs):
            raise exc
        return compile_step

    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    x = torch.randn(1, 2, requires_grad=True)
    for exc in (TagError("no tag"), NotImplementedError("the derivative for '_unique2' is not implemented")):
        monkeypatch.setattr(fxb, "compile_step", raising(exc))
        with pytest.warns(fxb.FallbackWarning, match=str(exc)[:20]):
            assert fxb.fxoverlap_backend(gm, [x]) == gm.forward
    assert NotImplementedError in fxb.FALLBACK_ERRORS and FxOverlapError in fxb.FALLBACK_ERRORS
    for bug in (KeyError("stage"), AttributeError("x"), TypeError("bad call")):
        monkeypatch.setattr(fxb, "compile_step", raising(bug))
        with pytest.raises(type(bug)):
            fxb.fxoverlap_backend(gm, [x])


def test_backend_falls_back_on_an_op_without_a_derivative():
    """torch.unique in a layer: the capture pass's trace of the backward raises autograd's
    NotImplementedError, which reaches the fallback (the one torch error seen there)."""
    import fxoverlap.backend as fxb

    class Uniq(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x) + torch.unique(x.round()).sum()
            return x.pow(2).sum()

    torch._dynamo.reset()
    model = Uniq()
    with pytest.warns(fxb.FallbackWarning, match="NotImplementedError: the derivative for '_unique2'"):
        torch.compile(model, backend="fxoverlap")(torch.randn(4, 8))  # (its backward fails in eager too)
    torch._dynamo.reset()


def test_backend_refuses_merged_step_options():
    """The backend's program has one microbatch: options that only shape the merged steps are
    refused with the reason, not silently ignored; their defaults pass."""
    import fxoverlap.backend as fxb

    for bad in ({"expert_wgrad_slot": 3}, {"chunks_in_merged_steps": True}):
        with pytest.raises(fxoverlap.ConfigError, match="no merged steps"):
            fxb.backend_config(bad)
    assert fxb.backend_config({"expert_wgrad_slot": 2}).expert_wgrad_slot == 2
    with pytest.raises(fxoverlap.ConfigError, match="expert_wgrad_slot"):
        fxoverlap.OverlapConfig(expert_wgrad_slot=4)


def test_per_device_defaults():
    """``None`` fields resolve per device: CPU keeps the bitwise-eager program (no chunks, no
    delayed weight gradients), CUDA gets the measured defaults (docs/benchmarks.md, 2026-12-02)."""
    from fxoverlap.config import DEFAULT_CUDA_CHUNKS, DEFAULT_CUDA_DELAY_WGRAD, DEFAULT_CUDA_SM_CARVEOUT

    cfg = fxoverlap.OverlapConfig()
    assert cfg.resolved_chunks("cpu") == 1 and cfg.resolved_delay_wgrad("cpu") is False
    assert cfg.resolved_chunks("cuda") == DEFAULT_CUDA_CHUNKS and cfg.resolved_delay_wgrad("cuda") is DEFAULT_CUDA_DELAY_WGRAD
    assert fxoverlap.OverlapConfig(delay_wgrad=False).resolved_delay_wgrad("cuda") is False
    assert cfg.resolved_sm_carveout("cpu") is None and cfg.resolved_sm_carveout("cuda") == DEFAULT_CUDA_SM_CARVEOUT
    assert fxoverlap.OverlapConfig(sm_carveout=0).resolved_sm_carveout("cuda") == 0
