"""``python -m fxoverlap.bench [SUBCOMMAND] ...``: one way to run each measurement.

With no subcommand (or flags first) it is ``run``, the benchmark of :mod:`fxoverlap.bench`, so
``python -m fxoverlap.bench --tiny`` and ``torchrun ... -m fxoverlap.bench`` do what they did.
Each subcommand's module is imported only when it is asked for (the GPU checks import CUDA-only
kernels and the test suite's model helpers). ``python -m fxoverlap.bench SUBCOMMAND --help``
lists its flags; docs/benchmarks.md maps the scripts/ that these replaced to them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from fxoverlap.ir.errors import FxOverlapError

PROG = "python -m fxoverlap.bench"


class Command(NamedTuple):
    module: str  # under fxoverlap.bench
    func: str  # called with no arguments, sys.argv set to the subcommand's
    help: str
    launch: str  # how it is started: "python", "torchrun" (any number of ranks) or "either"


COMMANDS: dict[str, Command] = {
    "run": Command("run", "main", "the benchmark (the default): eager, torch.compile, the backend and "
                   "fxoverlap on one model, or emulated EP N on one device", "either"),
    "pp": Command("pp", "main", "PP x EP: pipelining with fxoverlap's stages against eager", "torchrun"),
    "rows": Command("rows", "rows_main", "bench rows on one GPU, one process per row, within a time budget "
                    "(was scripts/gpu_rows.sh)", "python"),
    "emulated": Command("rows", "emulated_main", "the emulated-EP table by tiers, one process per "
                        "(configuration, mode) (was scripts/gpu_emulated.sh, gpu_chunks_quick.sh)", "python"),
    "slots": Command("rows", "slots_main", "the merged steps' slot balance rows and their analysis "
                     "(was scripts/gpu_slots.sh)", "python"),
    "one": Command("rows", "one_main", "the one-GPU benchmark (EP 1) and its GPU checks (was scripts/gpu_one.sh)",
                   "python"),
    "peer": Command("rows", "peer_main", "the 2-GPU benchmark beside the Megatron-Core peer, NVLink and "
                    "P2P off (was scripts/gpu_bench.sh)", "python"),
    "summary": Command("summary", "main", "markdown tables of a folder of bench JSON (and peer logs)", "python"),
    "table": Command("emulated_table", "main", "the emulated-EP table of a folder of bench JSON", "python"),
    "hf-timeline": Command("hf_timeline", "main", "one HF model and mode at released shapes with its last step "
                           "under torch.profiler: per-stream busy time, holds, launches, syncs", "python"),
    "host-time": Command("host_time", "main", "host (Python) ms per training step of both front ends, CPU, "
                         "tiny shapes", "python"),
    "slot-balance": Command("slot_balance", "main", "where the merged steps lose the link's time, from a "
                            "stage-timed bench JSON", "python"),
    "checks": Command("gpu_checks", "main", "GPU checks: bf16 numerics, memory, recompute, CSAN, row_sum, "
                      "symm_mem, activation checkpointing", "torchrun"),
    "cudagraph": Command("gpu_cudagraph", "main", "CUDA graphs against eager: numerics, time, teardown", "torchrun"),
    "fp8": Command("gpu_fp8", "main", "FP8 rowwise experts (expert_dtype='fp8_rowwise'): kernels, numerics "
                   "against eager-FP8 and bf16 (SQNR per experts stage), speed rows at the Qwen3-30B-A3B layer "
                   "shape, the loss curve; one GPU SM89+, torchao 0.18.0", "python"),
    "chunks": Command("gpu_chunks", "main", "OverlapConfig(chunks=K) against chunks=1 and eager, one GPU", "python"),
    "rng": Command("gpu_rng", "main", "random ops draw what eager draws, one GPU", "python"),
    "dtensor": Command("gpu_dtensor", "main", "DTensor parameters and inputs through optimize", "torchrun"),
    "link": Command("gpu_link", "main", "the emulated link's hold kernel, alone and beside GEMMs", "python"),
    "carveout": Command("gpu_carveout", "main", "compute kernels beside the hold kernel, per SM carveout "
                        "(JSON lines on stdout)", "python"),
    "tune": Command("gpu_tune", "main", "fxoverlap.tune against an exhaustive sweep and the defaults, per model "
                    "and emulated link speed (JSON lines to --out)", "python"),
    "dp": Command("gpu_dp", "main", "data-parallel gradient reduction inside the program, measured", "torchrun"),
    "hf": Command("hf_gpu", "cli", "transformers MoE families through expert_parallel on one GPU "
                  "(--real: released layer shapes, one process per (model, mode))", "python"),
    "families": Command("hf_families", "main", "transformers MoE families on 2 gloo ranks (CPU), the table "
                        "of docs/models.md", "python"),
    "linear-attention": Command("linear_attention", "main", "reproduction: gated DeltaNet's backward under "
                                "aot_eager, without fxoverlap", "python"),
}
DEFAULT = "run"


class BenchCommandError(FxOverlapError, RuntimeError):
    """A bench subcommand cannot run here (e.g. it needs the source checkout's tests/support)."""


def repo_root() -> str:
    """The source checkout this package runs from (fxoverlap/bench/ is two levels below it)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def support_dir() -> str:
    """tests/support of the source checkout: the model helpers some GPU checks share with the tests."""
    path = os.path.join(repo_root(), "tests", "support")
    if not os.path.isdir(path):
        raise BenchCommandError(f"fxoverlap.bench: {path} not found; this subcommand runs from a source "
                                "checkout (pip install -e .), not an installed wheel")
    return path


def use_support() -> None:
    """Put tests/support on sys.path (once), for the checks that build the tests' models."""
    path = support_dir()
    if path not in sys.path:
        sys.path.insert(0, path)


class SupportModule:
    """A module of tests/support imported on first use, so that importing a subcommand's module
    (``--help``, the suite's import checks) needs neither tests/support nor what it imports."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        use_support()
        return getattr(importlib.import_module(self._name), attr)


def subprocess_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default os.environ) with this checkout first on PYTHONPATH: a child started with
    ``-m fxoverlap.bench`` runs the same code as its parent, whatever its working directory."""
    env = dict(os.environ if env is None else env)
    root = repo_root()
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([root, *parts])
    return env


def self_command(name: str, *args: str) -> list[str]:
    """This Python running subcommand ``name`` (one process, no torchrun)."""
    return [sys.executable, "-m", "fxoverlap.bench", name, *args]


def torchrun_command(nproc: int, name: str, *args: str) -> list[str]:
    """torchrun (``--standalone``) with ``nproc`` ranks running subcommand ``name``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "fxoverlap.bench", name, *args]


@contextlib.contextmanager
def _argv(name: str, args: Sequence[str]) -> Iterator[None]:
    # the moved scripts parse sys.argv (argparse's default): set it to the subcommand's
    saved = sys.argv
    sys.argv = [f"{PROG} {name}", *args]
    try:
        yield
    finally:
        sys.argv = saved


def overview() -> str:
    """The top-level help: the subcommands, one line each."""
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="fxoverlap's measurements. With no subcommand, or flags first, the subcommand is "
                    f"'{DEFAULT}' (python -m fxoverlap.bench --tiny == python -m fxoverlap.bench run --tiny).",
        epilog=f"'{PROG} SUBCOMMAND --help' lists a subcommand's flags. Launch: python = one process; "
               "torchrun = one process per rank (torchrun --nproc-per-node N -m fxoverlap.bench SUBCOMMAND).")
    sub = p.add_subparsers(dest="command", metavar="SUBCOMMAND")
    for name, c in COMMANDS.items():
        sub.add_parser(name, help=f"{c.help} [{c.launch}]", add_help=False)
    return p.format_help()


def split(argv: Sequence[str]) -> tuple[str, list[str]]:
    """(subcommand, its arguments): the first argument if it names one, else the default."""
    argv = list(argv)
    if argv and argv[0] in COMMANDS:
        return argv[0], argv[1:]
    return DEFAULT, argv


def main(argv: Sequence[str] | None = None) -> Any:
    """Run the subcommand ``argv`` names (default: sys.argv[1:])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(overview())
        return None
    name, args = split(argv)
    if argv and not argv[0].startswith("-") and name == DEFAULT and argv[0] != DEFAULT:
        # a word that is no subcommand: the benchmark takes no positional arguments either
        raise SystemExit(f"{PROG}: unknown subcommand {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    c = COMMANDS[name]
    func = getattr(importlib.import_module(f"fxoverlap.bench.{c.module}"), c.func)
    with _argv(name, args):
        return func()
