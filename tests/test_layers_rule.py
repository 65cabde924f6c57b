"""The import rule (setup.cfg ``[importlinter]``), checked with import-linter on the package as
it installs.

import-linter builds its graph by walking the package directory, so it would not see
``passes/`` and ``kernels/``, which install as ``fxoverlap.passes`` / ``fxoverlap.kernels``
through setuptools' ``package_dir`` mapping (the editable install maps them with an import
hook, which the walk does not follow). So the test has setuptools itself lay the package out,
with ``build_py`` from setup.cfg's ``[options]`` (the tree a wheel installs), and lints that:
a new package or mapping in setup.cfg is linted as it installs, with no copy rule of our own.
It first checks that the built graph does contain the passes and kernels (so a contract about
them cannot pass vacuously), and that planted violations fail the lint.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytest.importorskip("importlinter")
pytest.importorskip("setuptools")


def _installed_layout(tmp: pathlib.Path) -> pathlib.Path:
    """The package as installed, under ``tmp`` (setuptools' build_py, run on the repository's
    setup.cfg; it writes nothing into the repository), with setup.cfg beside it for the lint."""
    out = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                          "--build-lib", str(tmp)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    shutil.copy(ROOT / "setup.cfg", tmp / "setup.cfg")
    return tmp


def _lint(tmp: pathlib.Path) -> subprocess.CompletedProcess:
    # this interpreter's own script first (another one on PATH may be a shell shim, and PATH is cut below)
    own = pathlib.Path(sys.executable).parent / "lint-imports"
    lint = str(own) if own.exists() else (shutil.which("lint-imports") or str(own))
    env = {"PYTHONPATH": str(tmp), "PATH": str(pathlib.Path(sys.executable).parent)}
    return subprocess.run([lint, str(tmp / "setup.cfg"), "--no-cache"], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300)


def test_graph_sees_passes_and_kernels(tmp_path):
    import grimp

    tmp = _installed_layout(tmp_path)
    assert not (tmp / "passes").exists() and not (tmp / "kernels").exists()  # nothing called passes lands there
    code = ("import grimp, sys; g = grimp.build_graph('fxoverlap', cache_dir=None); "
            "print(sorted(m for m in g.modules if m.startswith(('fxoverlap.passes.', 'fxoverlap.kernels.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp, env={"PYTHONPATH": str(tmp)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for module in ("fxoverlap.passes.tag", "fxoverlap.kernels.a2a", "fxoverlap.kernels.emulated_link"):
        assert module in out.stdout, out.stdout
    assert grimp  # imported: the pinned grimp is importlinter's


def test_import_rule_holds(tmp_path):
    out = _lint(_installed_layout(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 kept, 0 broken" in out.stdout, out.stdout


def test_planted_violations_fail(tmp_path):
    """The IR importing a pass, and a comm op importing the emulated link (what the ops did before
    the link became a group stand-in), each break their contract."""
    tmp = _installed_layout(tmp_path)
    stage = tmp / "fxoverlap" / "ir" / "stage.py"
    stage.write_text(stage.read_text() + "\nfrom fxoverlap.passes import tag  # planted\n")
    ops = tmp / "fxoverlap" / "ops.py"
    ops.write_text(ops.read_text() + "\nfrom fxoverlap.kernels import emulated_link  # planted\n")
    out = _lint(tmp)
    assert out.returncode != 0
    assert "BROKEN" in out.stdout and "fxoverlap.ir.stage -> fxoverlap.passes" in out.stdout, out.stdout
    assert "the comm ops import no emulated link (it is their group: a2a.GroupStandIn) BROKEN" in out.stdout, out.stdout
    assert "fxoverlap.ops -> fxoverlap.kernels.emulated_link" in out.stdout, out.stdout


def test_fronts_independence_contract_catches_a_pipeline_import_of_the_backend(tmp_path):
    """The front ends are independent adapters: pipeline_parallel importing fxoverlap.backend
    (say, for a helper of the backend's) fails the lint."""
    tmp = _installed_layout(tmp_path)
    pp = tmp / "fxoverlap" / "pipeline_parallel.py"
    pp.write_text(pp.read_text() + "\nfrom fxoverlap.backend import fxoverlap_backend  # planted\n")
    out = _lint(tmp)
    assert out.returncode != 0
    assert "BROKEN" in out.stdout and "fxoverlap.pipeline_parallel -> fxoverlap.backend" in out.stdout, out.stdout
