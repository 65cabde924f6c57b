"""The import rule (setup.cfg ``[importlinter]``), checked with import-linter.

import-linter builds its graph by walking the package directory, so it would not see
``passes/`` and ``kernels/``, which install as ``fxoverlap.passes`` / ``fxoverlap.kernels``
through setuptools' ``package_dir`` mapping. The test lays the sources out as installed in a
temporary directory and lints that copy; it first checks that the copy's graph does contain
the passes and kernels (so a contract about them cannot pass vacuously), and that a planted
violation (the IR importing a pass) fails the lint.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytest.importorskip("importlinter")


def _installed_layout(tmp: pathlib.Path) -> pathlib.Path:
    pkg = tmp / "fxoverlap"
    ignore = shutil.ignore_patterns("__pycache__", "passes", "kernels")  # worktree symlinks, if any
    shutil.copytree(ROOT / "fxoverlap", pkg, ignore=ignore)
    shutil.copytree(ROOT / "passes", pkg / "passes", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "kernels", pkg / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.cfg", tmp / "setup.cfg")
    return tmp


def _lint(tmp: pathlib.Path) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports") or str(pathlib.Path(sys.executable).parent / "lint-imports")
    env = {"PYTHONPATH": str(tmp), "PATH": str(pathlib.Path(sys.executable).parent)}
    return subprocess.run([lint, str(tmp / "setup.cfg"), "--no-cache"], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300)


def test_graph_sees_passes_and_kernels(tmp_path):
    import grimp

    tmp = _installed_layout(tmp_path)
    code = ("import grimp, sys; g = grimp.build_graph('fxoverlap', cache_dir=None); "
            "print(sorted(m for m in g.modules if m.startswith(('fxoverlap.passes.', 'fxoverlap.kernels.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp, env={"PYTHONPATH": str(tmp)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "fxoverlap.passes.tag" in out.stdout and "fxoverlap.kernels.a2a" in out.stdout, out.stdout
    assert grimp  # imported: the pinned grimp is importlinter's


def test_import_rule_holds(tmp_path):
    out = _lint(_installed_layout(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 kept, 0 broken" in out.stdout, out.stdout


def test_planted_violation_fails(tmp_path):
    tmp = _installed_layout(tmp_path)
    stage = tmp / "fxoverlap" / "ir" / "stage.py"
    stage.write_text(stage.read_text() + "\nfrom fxoverlap.passes import tag  # planted\n")
    out = _lint(tmp)
    assert out.returncode != 0
    assert "BROKEN" in out.stdout and "fxoverlap.ir.stage -> fxoverlap.passes" in out.stdout, out.stdout


def test_fronts_independence_contract_catches_a_pipeline_import_of_the_backend(tmp_path):
    """The front ends are independent adapters: pipeline_parallel importing fxoverlap.backend
    (say, for a helper of the backend's) fails the lint."""
    tmp = _installed_layout(tmp_path)
    pp = tmp / "fxoverlap" / "pipeline_parallel.py"
    pp.write_text(pp.read_text() + "\nfrom fxoverlap.backend import fxoverlap_backend  # planted\n")
    out = _lint(tmp)
    assert out.returncode != 0
    assert "BROKEN" in out.stdout and "fxoverlap.pipeline_parallel -> fxoverlap.backend" in out.stdout, out.stdout
