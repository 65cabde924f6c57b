"""The pass manager (``fxoverlap.passes.PASSES``, ``OverlapConfig.disable_passes``) and what it
reports: one ``TORCH_LOGS="fxoverlap"`` line per pass, ``TORCH_TRACE`` artifacts per pass that
``tlparse`` renders. torch reads both variables at import, so those tests run a subprocess."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import fxoverlap
import fxoverlap.passes
from fxoverlap import pipeline
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.testing import eager_steps, grad_diff, take_grads, token_batches

# the backend's documented setup: dropless dispatch traced into the graph (data-dependent sizes)
fxoverlap.enable_dynamic_output_shapes()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDER = ["dispatcher", "tag", "side", "rng", "chunk", "recompute", "split", "cudagraph", "inductor",
         "schedule", "reduce", "shard", "streams", "free"]

# A tiny MoE model on one rank, through optimize (2 microbatches) and, with BACKEND, torch.compile.
SCRIPT = textwrap.dedent("""
    import os, torch, fxoverlap
    fxoverlap.enable_dynamic_output_shapes()  # the documented set-up: the dropless dispatch stays in one graph
    from fxoverlap.models import MoEConfig, MoETransformer
    from fxoverlap.testing import token_batches
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32)
    model = MoETransformer(cfg, None)
    mbs = token_batches(cfg.vocab_size, 2, (2, 16), seed=0)
    fxoverlap.optimize(model, None).forward_backward(mbs)
    if os.environ.get("BACKEND"):
        torch.compile(model, backend="fxoverlap")(*mbs[0]).backward()
    print("done")
""")


def _run(env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_TRACE")}
    env = {**base, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **env}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-4000:]
    return proc


def test_pass_list_in_order():
    assert fxoverlap.passes.PASSES is pipeline.PASSES
    assert [p.name for p in fxoverlap.passes.PASSES] == ORDER
    assert {p.name: p.phase for p in pipeline.PASSES} == {
        n: "stages" if i < ORDER.index("schedule") else "program" for i, n in enumerate(ORDER)}
    assert pipeline.SWITCHABLE == ("side", "chunk", "cudagraph", "inductor", "free")
    assert all(p.why for p in pipeline.PASSES)


@pytest.mark.parametrize("name", ["rng", "streams", "no_such_pass"])
def test_disable_unknown_or_unswitchable(name):
    """Refused when the engine is made, before any capture (the config itself stays a leaf)."""
    with pytest.raises(ValueError, match="side, chunk, cudagraph, inductor, free") as e:
        fxoverlap.optimize(torch.nn.Linear(2, 2), None, fxoverlap.OverlapConfig(disable_passes=(name,)))
    assert repr(name) in str(e.value)
    with pytest.raises(ValueError, match="side, chunk, cudagraph, inductor, free") as e:  # the backend's options
        fxoverlap.backend.backend_config({"disable_passes": (name,)})
    assert repr(name) in str(e.value)


def test_disabled_pass_does_not_run(caplog):
    """side switched off: no side stages, and the step is still bitwise eager's (1 rank)."""
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32)
    model = MoETransformer(cfg, None)
    mbs = token_batches(cfg.vocab_size, 2, (2, 16), seed=0)
    ref_losses = eager_steps(model, mbs)
    ref = take_grads(model)
    config = fxoverlap.OverlapConfig(disable_passes=["side"])
    assert config.disable_passes == ("side",)
    with caplog.at_level(logging.INFO, logger="fxoverlap"):
        engine = fxoverlap.optimize(model, None, config)
        losses = engine.forward_backward(mbs)
    assert not [s.name for s in engine.stages if s.name.endswith("_side")]
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert grad_diff(model, ref)[2]
    lines = {r.name: r.getMessage() for r in caplog.records if r.name.startswith("fxoverlap.passes.")}
    assert "skipped (OverlapConfig.disable_passes)" in lines["fxoverlap.passes.side"]
    assert " ms " in lines["fxoverlap.passes.tag"]


def test_torch_logs_one_line_per_pass():
    err = _run({"TORCH_LOGS": "fxoverlap"}).stderr
    lines = [line for line in err.splitlines() if "fxoverlap pass " in line]
    assert [line.split("fxoverlap pass ")[1].split()[0] for line in lines] == ORDER, err[-4000:]
    tag = next(line for line in lines if "fxoverlap pass tag " in line)
    assert " ms " in tag and "nodes ->" in tag
    assert "stages (" in next(line for line in lines if "fxoverlap pass split " in line)
    assert "program nodes" in next(line for line in lines if "fxoverlap pass free " in line)
    # without TORCH_LOGS, nothing: test_torch_trace_artifacts's run (TORCH_TRACE only) checks it


def test_torch_trace_artifacts(tmp_path):
    trace = tmp_path / "trace"
    proc = _run({"TORCH_TRACE": str(trace), "BACKEND": "1"})
    # without TORCH_LOGS no pass line reaches stderr (the trace goes to its files only); this
    # run serves test_torch_logs_one_line_per_pass's "without" case (a subprocess is seconds)
    assert "fxoverlap pass " not in proc.stderr, proc.stderr[-4000:]
    records = []
    for f in trace.iterdir():
        for line in f.read_text().splitlines():
            if '"artifact"' in line and "fxoverlap_" in line:
                records.append(json.loads(line[line.index("{"):]))
    names = [r["artifact"]["name"] for r in records]
    expected = {"fxoverlap_tag_graph", "fxoverlap_split_graph", "fxoverlap_split_stage_table",
                "fxoverlap_schedule_program", "fxoverlap_streams_plan", "fxoverlap_free_program",
                "fxoverlap_free_plan"}
    assert expected <= set(names), names
    # once from optimize (no compile id) and once from inside torch.compile (with one)
    assert names.count("fxoverlap_free_plan") == 2
    assert any("frame_id" in r for r in records if r["artifact"]["name"] == "fxoverlap_free_plan")
    tlparse = shutil.which("tlparse")
    if tlparse is None:
        pytest.skip("tlparse is not installed (pip install -e .[test])")
    out = tmp_path / "tl"
    (log,) = trace.iterdir()  # one process, one trace file
    subprocess.run([tlparse, str(log), "-o", str(out), "--no-browser", "--overwrite"], check=True,
                   capture_output=True, timeout=300)
    index = (out / "index.html").read_text()
    for name in expected:
        assert name in index, name
    plans = [p for p in out.rglob("fxoverlap_free_plan_*.txt")]
    assert len(plans) == 2 and all("run fwd_l0_attn" in p.read_text() for p in plans)
