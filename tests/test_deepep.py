"""torchtitan's DeepEP / HybridEP ops (``deepep::``, ``hybridep::``) through fxoverlap on CPU, one rank.

torchtitan 0.3.0's modules that register them do not import here (``deepep.py`` needs
DeepEP V2, ``hybridep.py`` a ``torch._library.opaque_object.CustomClassBase`` that torch
2.13 lacks), so ``support/deepep_mirror.py`` defines them in the same namespaces with
torchtitan's schema strings (checked against torchtitan's source below), CPU kernels
that behave as DeepEP on one rank, and a tiny MoE that calls them as torchtitan's
``DeepEPTokenDispatcher`` / ``HybridEPTokenDispatcher`` do. The tag pass must give those
nodes (forward, and the backward exchanges) the dispatch/combine kinds, the stages must
include comm dispatch/combine stages both ways, and the overlapped step must equal eager.
"""

from __future__ import annotations

import ast
import os

import expecttest
import pytest
import torch

import deepep_mirror
import fxoverlap
import fxoverlap.config
from fxoverlap import OverlapConfig
from fxoverlap.config import DispatcherUnavailable
from fxoverlap.engine import format_stage_table
from fxoverlap.ir.meta import TAG_KEY, op_name
from fxoverlap.passes import capture, split, tag
from fxoverlap.passes.dispatcher import DispatcherError, dispatcher
from fxoverlap.ir.stage import Direction, StageKind, StreamKind
from fxoverlap.testing import take_grads, token_batches
from snapshot_utils import requires_pinned_torch

BACKENDS = ["deepep", "hybridep"]
# The exchange each backward op is: combine_bwd is dispatch's backward, dispatch_bwd combine's.
BWD_KIND = {"hybridep.combine_bwd": StageKind.DISPATCH, "hybridep.dispatch_bwd": StageKind.COMBINE}


def _titan_source(name: str) -> str:
    spec = pytest.importorskip("torchtitan")
    path = os.path.join(os.path.dirname(spec.__file__), "distributed", "deepep", f"{name}.py")
    with open(path) as f:
        return f.read()


def test_deepep_schemas_are_torchtitans():
    """The mirror's deepep:: schemas are the strings torchtitan's deepep.py passes to ``_lib.define``."""
    tree = ast.parse(_titan_source("deepep"))
    defined = [ast.literal_eval(c.args[0]) for c in ast.walk(tree)
               if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "define"]
    assert sorted(defined) == sorted(deepep_mirror.DEEPEP_SCHEMAS.values())


_TYPES = {"torch.Tensor": "Tensor", "DispatchHandle": "Tensor", "int": "int", "str": "str", "bool": "bool",
          "float | None": "Optional[float]", "int | None": "Optional[int]"}


def test_hybridep_schemas_are_torchtitans():
    """The mirror's hybridep:: schemas are what ``torch.library.custom_op`` infers from torchtitan's
    hybridep.py signatures (names, types, defaults, outputs), with its opaque ``DispatchHandle`` as Tensor."""
    tree = ast.parse(_titan_source("hybridep"))
    ops = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for d in fn.decorator_list:
            if isinstance(d, ast.Call) and ast.unparse(d.func) == "torch.library.custom_op":
                ops[ast.literal_eval(d.args[0]).split("::")[1]] = fn
    assert sorted(ops) == sorted(deepep_mirror.HYBRIDEP_SCHEMAS)
    for name, fn in ops.items():
        schema = torch._C.parse_schema(deepep_mirror.HYBRIDEP_SCHEMAS[name])
        args = fn.args.args
        defaults = [None] * (len(args) - len(fn.args.defaults)) + [ast.literal_eval(d) for d in fn.args.defaults]
        assert [a.arg for a in args] == [a.name for a in schema.arguments], name
        assert [_TYPES[ast.unparse(a.annotation)] for a in args] == [str(a.type) for a in schema.arguments], name
        assert defaults == [a.default_value for a in schema.arguments], name
        ret = ast.unparse(fn.returns)
        outs = [t.strip() for t in ret[len("tuple["):-1].split(",")] if ret.startswith("tuple[") else [ret]
        assert [_TYPES[t] for t in outs] == [str(r.type) for r in schema.returns], name


def _model(backend: str) -> deepep_mirror.EPTransformer:
    torch.manual_seed(0)
    return deepep_mirror.EPTransformer(backend)


def _batches(n: int = 2):
    return token_batches(32, n, (2, 8))


def _tagged(backend: str):
    model = _model(backend)
    cap = capture(model, _batches(1)[0])
    return cap, tag(cap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tag_gives_torchtitans_ops_dispatch_and_combine(backend):
    cap, gm = _tagged(backend)
    seen = {}
    for n in gm.graph.nodes:
        name, t = op_name(n), n.meta.get(TAG_KEY)
        if not name.startswith(backend + "."):
            continue
        want = BWD_KIND.get(name) or {"dispatch": StageKind.DISPATCH, "combine": StageKind.COMBINE}[name.split(".")[1]]
        assert t.kind == want, (n.name, t)
        seen[n] = (t.direction, t.layer, t.kind)
    fwd = {v for v in seen.values() if v[0] is Direction.FWD}
    assert fwd == {(Direction.FWD, i, k) for i in range(2) for k in (StageKind.DISPATCH, StageKind.COMBINE)}
    if backend == "hybridep":  # its backward exchanges are ops too
        assert {v for v in seen.values() if v[0] is Direction.BWD} == {
            (Direction.BWD, i, k) for i in range(2) for k in (StageKind.DISPATCH, StageKind.COMBINE)}
    # deepep's backward exchanges run on its buffer inside the ops' autograd formulas (here a
    # copy): they take the forward op's tag by seq_nr, like every backward node.
    bwd_comm = {(t.layer, t.kind) for n in gm.graph.nodes if (t := n.meta.get(TAG_KEY)) is not None
                and t.direction is Direction.BWD and t.kind in (StageKind.DISPATCH, StageKind.COMBINE)}
    assert bwd_comm == {(i, k) for i in range(2) for k in (StageKind.DISPATCH, StageKind.COMBINE)}
    stages = split(gm, cap.num_layers)
    comm = {(s.direction, s.layer, s.kind) for s in stages if s.stream is StreamKind.COMM}
    assert comm == {(d, i, k) for d in Direction for i in range(2) for k in (StageKind.DISPATCH, StageKind.COMBINE)}


@requires_pinned_torch
class TestSnapshots(expecttest.TestCase):
    def test_deepep_stage_table(self):
        cap, gm = _tagged("deepep")
        self.assertExpectedInline(format_stage_table(split(gm, cap.num_layers)), """\
stage            layer  kind      dir  stream  ops  in  out  runs   capturable
fwd_model_embed  -1     embed     fwd  comp    1    2   1    eager  yes
fwd_l0_attn      0      attn      fwd  comp    33   6   19   eager  yes
fwd_l0_dispatch  0      dispatch  fwd  comm    6    3   5    eager  no: communication stage (stays eager on the comm stream)
fwd_l0_experts   0      experts   fwd  comp    21   8   12   eager  no: data-dependent shape at node index (aten.index)
fwd_l0_combine   0      combine   fwd  comm    1    2   1    eager  no: communication stage (stays eager on the comm stream)
fwd_l0_post      0      post      fwd  comp    3    3   1    eager  yes
fwd_l1_attn      1      attn      fwd  comp    33   6   19   eager  yes
fwd_l1_dispatch  1      dispatch  fwd  comm    6    3   5    eager  no: communication stage (stays eager on the comm stream)
fwd_l1_experts   1      experts   fwd  comp    21   8   12   eager  no: data-dependent shape at node index_4 (aten.index)
fwd_l1_combine   1      combine   fwd  comm    1    2   1    eager  no: communication stage (stays eager on the comm stream)
fwd_l1_post      1      post      fwd  comp    3    3   1    eager  yes
fwd_model_head   2      head      fwd  comp    18   4   10   eager  yes
bwd_model_head   2      head      bwd  comp    30   12  4    eager  yes
bwd_l1_combine   1      combine   bwd  comm    1    1   1    eager  no: communication stage (stays eager on the comm stream)
bwd_l1_experts   1      experts   bwd  comp    18   14  4    eager  no: data-dependent shape at node gather (aten.gather)
bwd_l1_dispatch  1      dispatch  bwd  comm    2    2   2    eager  no: communication stage (stays eager on the comm stream)
bwd_l1_attn      1      attn      bwd  comp    64   21  7    eager  yes
bwd_l0_combine   0      combine   bwd  comm    1    1   1    eager  no: communication stage (stays eager on the comm stream)
bwd_l0_experts   0      experts   bwd  comp    18   14  4    eager  no: data-dependent shape at node gather_1 (aten.gather)
bwd_l0_dispatch  0      dispatch  bwd  comm    2    2   2    eager  no: communication stage (stays eager on the comm stream)
bwd_l0_attn      0      attn      bwd  comp    63   21  6    eager  yes
bwd_model_embed  -1     embed     bwd  comp    1    2   1    eager  yes""")


def _eager(backend: str, mbs):
    model = _model(backend)
    losses = []
    for mb in mbs:
        loss = model(*mb)
        loss.backward()
        losses.append(loss.detach())
    return losses, take_grads(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapped_step_equals_eager(backend, monkeypatch):
    """Through ``optimize`` with ``dispatcher=backend`` (deep_ep faked present): losses and gradients bitwise."""
    monkeypatch.setattr(fxoverlap.config, "deepep_missing", lambda d: None)
    mbs = _batches(2)
    ref_losses, ref_grads = _eager(backend, mbs)
    model = _model(backend)
    engine = fxoverlap.optimize(model, None, OverlapConfig(compiler="eager", dispatcher=backend, progress=False))
    losses = engine.forward_backward(mbs)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    got = take_grads(model)
    assert got.keys() == ref_grads.keys()
    bad = [k for k in got if not torch.equal(got[k], ref_grads[k])]
    assert not bad, bad
    assert {(s.direction, s.kind) for s in engine.stages if s.stream is StreamKind.COMM} == {
        (d, k) for d in Direction for k in (StageKind.DISPATCH, StageKind.COMBINE)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_config_without_deep_ep_says_how_to_get_it(backend, monkeypatch):
    monkeypatch.setattr(fxoverlap.config, "deepep_missing", lambda d: "`import deep_ep` failed (test)")
    with pytest.raises(DispatcherUnavailable) as info:
        OverlapConfig(dispatcher=backend)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ImportError)
    msg = str(info.value)
    for part in ("github.com/deepseek-ai/DeepEP", "deep_ep/buffers/legacy.py", "`hybrid-ep` branch",
                 "DeepEP V2", "NCCL >= 2.30.4", f"torchtitan's {backend}:: ops",
                 "does not yet lower its own dispatch/combine ops"):
        assert part in msg, part


def test_deep_ep_is_not_installed_here():
    """On this CPU machine the real check fails too (if deep_ep ever gets installed, drop this)."""
    try:
        import deep_ep  # noqa: F401
    except Exception:  # noqa: BLE001
        with pytest.raises(DispatcherUnavailable, match=r"needs DeepEP: `import deep_ep` failed"):
            OverlapConfig(dispatcher="deepep")
    else:
        pytest.skip("deep_ep is installed")


def test_deepep_dispatcher_refuses_fxoverlaps_own_ops():
    from fxoverlap.models import MoEConfig, MoETransformer

    cfg = MoEConfig.tiny(n_layers=1, dim=32, n_heads=2, n_experts=4, expert_dim=16, dense_dim=32, vocab_size=32,
                         layer_pattern=("moe",))
    torch.manual_seed(0)
    cap = capture(MoETransformer(cfg), token_batches(32, 1, (2, 8))[0])
    with pytest.raises(DispatcherError, match=r"dispatcher='hybridep'\): node \w+ \(fxoverlap\.dispatch\.default\) is "
                                              r"fxoverlap's own dispatch, which fxoverlap does not yet lower"):
        dispatcher(cap.graph_module, "hybridep")
