"""Bench runs of several processes: one process per row (mode, configuration), each under a time
limit, the rows within a budget. The subcommands ``rows``, ``emulated``, ``slots``, ``one`` and
``peer`` of ``python -m fxoverlap.bench`` (they replace scripts/gpu_rows.sh, gpu_emulated.sh,
gpu_chunks_quick.sh, gpu_slots.sh, gpu_one.sh and gpu_bench.sh, and run the same commands).

A row never shares its process with another one, so its peak memory, compile caches, allocator
pools and CUDA graphs are its own. Each row's output goes to ``OUT/<name>.log``; the runner's own
log (``OUT/<command>.log``) gets one line per row and an excerpt of its result. With a budget, a
row starts only if the time used plus its expected time (``--est``) fits in it; the log says which
were skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence

from fxoverlap.bench.commands import PROG, repo_root, self_command, subprocess_env, torchrun_command

# NVLink multicast stays off on the shared hosts (docs/benchmarks.md)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
INDUCTOR_CACHE = "/tmp/fxoverlap_inductor_cache"  # shared by a run's processes: later rows compile faster


@dataclasses.dataclass
class Step:
    """One process: ``cmd`` with ``env`` changes (a value of None unsets), its output to ``log``."""

    name: str
    cmd: list[str]
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)
    timeout_s: float | None = None  # None: the runner's
    log: str | None = None  # None: OUT/<name>.log


class Runner:
    """Runs steps one after another, each in its own process (and process group, killed as a whole
    at its time limit), within ``budget_s`` seconds from the runner's start (0: no budget).

    ``clip_reserve_s`` None: a step starts if used + ``est_s`` <= budget, with its own timeout
    (scripts/gpu_rows.sh). A number: a step gets at most budget - used - reserve seconds, and is
    skipped when that is under ``est_s`` (scripts/gpu_bench.sh)."""

    def __init__(self, out: str, log_name: str, *, budget_s: float = 0.0, est_s: float = 45.0,
                 timeout_s: float = 150.0, clip_reserve_s: float | None = None, dry: bool = False,
                 echo: Callable[[str], None] | None = None) -> None:
        self.out, self.tag, self.dry = out, log_name, dry
        self.budget_s, self.est_s, self.timeout_s, self.clip_reserve_s = budget_s, est_s, timeout_s, clip_reserve_s
        os.makedirs(out, exist_ok=True)
        self.log = os.path.join(out, f"{log_name}.log")
        self.t0 = time.monotonic()
        self.failed: list[str] = []
        self.echo = echo or (lambda s: print(s, flush=True))

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, msg: str) -> None:
        """A line to stdout and the runner's log: ``[tag HH:MM:SS +Ns] msg``."""
        line = f"[{self.tag} {time.strftime('%H:%M:%S')} +{int(self.elapsed())}s] {msg}"
        self.echo(line)
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def limit(self, step: Step) -> float | None:
        """The step's time limit, or None when the budget leaves no room for it."""
        timeout = self.timeout_s if step.timeout_s is None else step.timeout_s
        if self.budget_s <= 0:
            return timeout
        used = self.elapsed()
        if self.clip_reserve_s is None:
            return None if used + self.est_s > self.budget_s else timeout
        left = self.budget_s - used - self.clip_reserve_s
        return None if left < self.est_s else min(timeout, left)

    def run(self, step: Step) -> int | None:
        """Run ``step``; its exit status (124 at its time limit), or None when skipped."""
        limit = self.limit(step)
        if limit is None:
            self.say(f"skip {step.name} (budget: {int(self.elapsed())}s used of {self.budget_s:g}s)")
            self.failed.append(f"{step.name}(skipped)")
            return None
        env_txt = " ".join(f"{k}={v}" if v is not None else f"-u {k}" for k, v in step.env.items())
        self.say(f"step {step.name} (timeout {limit:.0f}s): {env_txt + ' ' if env_txt else ''}{shlex.join(step.cmd)}")
        if self.dry:
            return 0
        env = subprocess_env()
        env.setdefault("PYTHONUNBUFFERED", "1")
        for k, v in step.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        log = step.log or os.path.join(self.out, f"{step.name}.log")
        t0 = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(step.cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = 124  # as timeout(1): SIGTERM to the whole process group (torchrun and its ranks), then SIGKILL
                _kill_group(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    _kill_group(proc, signal.SIGKILL)
                    proc.wait()
        if rc:
            self.failed.append(f"{step.name}(rc={rc})")
            self.say(f"step {step.name} failed (rc {rc}) after {time.monotonic() - t0:.0f}s; see {log}")
        return rc


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group the step's process leads (start_new_session)
    except ProcessLookupError:
        pass


def grep(path: str, pattern: str, *, after: int = 0, exclude: str | None = None, tail: int | None = None,
         head: int | None = None, cut: int | None = None) -> list[str]:
    """Lines of ``path`` matching ``pattern`` (and ``after`` lines after each), as grep -A would."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out, until = [], -1
    for i, line in enumerate(lines):
        if re.search(pattern, line):
            until = i + after
        if i <= until and not (exclude and re.search(exclude, line)):
            out.append(line)
    out = out[-tail:] if tail else out
    out = out[:head] if head else out
    return [line[:cut] for line in out] if cut else out


def install(runner: Runner) -> None:
    """``pip install -e`` this checkout, as the GPU scripts did: the ``fxoverlap`` torch.compile backend
    is found through the package's entry point, so a copied tree needs it installed."""
    if runner.dry:
        return
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                           repo_root()], capture_output=True, text=True)
    with open(runner.log, "a") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode:
        runner.say("pip install failed (running from the tree)")


def log_versions(runner: Runner) -> None:
    """torch, triton and the GPU, in the runner's log (the GPU's name from a child process: this one
    holds no CUDA context while the rows run)."""
    import torch

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "-"
    gpu = "no GPU"
    if torch.cuda.is_available() and not runner.dry:
        proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                              capture_output=True, text=True)
        gpu = ((proc.stdout or proc.stderr).strip().splitlines() or ["?"])[-1]
    runner.say(f"torch {torch.__version__} {tv} {gpu}")


def _common(p: argparse.ArgumentParser, *, out: str, budget: float, est: float, timeout: float) -> None:
    g = p.add_argument_group("runner")
    g.add_argument("--out", default=out, help=f"logs and JSON (default {out})")
    g.add_argument("--budget", type=float, default=budget, help="seconds for the whole run (0: none); a row "
                   "starts only if the time used plus --est fits")
    g.add_argument("--est", type=float, default=est, help="a row's expected seconds (for the budget)")
    g.add_argument("--timeout", type=float, default=timeout, help="seconds per row's process")
    g.add_argument("--no-install", action="store_true", help="skip pip install -e of this checkout")
    g.add_argument("--dry-run", action="store_true", help="print the rows' commands, run nothing")
    g.add_argument("--launcher", choices=("torchrun", "python"), default="torchrun",
                   help="start each bench row under torchrun (1 rank; default) or as one plain process")


def _start(args: argparse.Namespace, tag: str, **kw) -> Runner:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", INDUCTOR_CACHE)
    runner = Runner(args.out, tag, budget_s=args.budget, est_s=args.est, timeout_s=args.timeout, dry=args.dry_run, **kw)
    if not args.no_install:
        install(runner)
    log_versions(runner)
    return runner


def bench_cmd(args: argparse.Namespace, *flags: str) -> list[str]:
    """One rank of ``python -m fxoverlap.bench run FLAGS``, under torchrun or not (``--launcher``)."""
    if args.launcher == "python":
        return self_command("run", *flags)
    return torchrun_command(1, "run", *flags)


def _table(runner: Runner) -> None:
    from fxoverlap.bench.emulated_table import table

    if runner.dry:
        return
    try:
        text = table(runner.out)
    except Exception as e:  # noqa: BLE001 -- the rows are on disk; the table can be made again
        runner.say(f"no table: {type(e).__name__}: {e}"[:300])
        return
    path = os.path.join(runner.out, "emulated_table.md")
    with open(path, "w") as f:
        f.write(text + "\n")
    runner.say(f"table: {path}")


def _report(runner: Runner, log: str, *patterns: tuple[str, dict]) -> None:
    for pattern, kw in patterns:
        for line in grep(log, pattern, **kw):
            runner.say("  " + line)


# ---------------------------------------------------------------- rows (scripts/gpu_rows.sh)

ROW_FIELDS = ("name", "modes", "microbatches", "overlap_config", "flags", "env")
DEFAULT_ROW_FLAGS = "--emulate-ep 8 --link-gbps 100 --routing dropless"


@dataclasses.dataclass
class Row:
    """``name|modes|microbatches|overlap-config|bench flags|env``: one bench process."""

    name: str
    modes: str
    microbatches: str
    overlap_config: str = ""
    flags: str = ""
    env: str = ""


def parse_rows(specs: Sequence[str]) -> list[Row]:
    """Rows from specs (each may hold several, separated by ';' or new lines); blank names are skipped."""
    rows = []
    for spec in specs:
        for text in re.split(r"[;\n]", spec):
            parts = [s.strip() for s in text.split("|")]
            if not parts[0]:
                continue
            if len(parts) < 3 or len(parts) > len(ROW_FIELDS):
                raise SystemExit(f"{PROG} rows: {text.strip()!r} is not name|modes|microbatches[|overlap-config"
                                 "[|bench flags[|env]]]")
            rows.append(Row(*parts))
    return rows


def row_step(args: argparse.Namespace, row: Row) -> Step:
    flags = shlex.split(row.flags or args.default_flags)
    cmd = bench_cmd(args, "--out", args.out, "--name", row.name, *flags, "--microbatches", row.microbatches,
                    "--modes", row.modes, "--warmup", str(args.warmup), "--iters", str(args.iters),
                    "--no-stage-timing", "--no-grad-check",
                    *(["--overlap-config", row.overlap_config] if row.overlap_config else []))
    env = dict(kv.split("=", 1) for kv in row.env.split())
    return Step(row.name, cmd, env)


def rows_main(argv: Sequence[str] | None = None) -> int:
    """``python -m fxoverlap.bench rows``: see the module docstring and ``--help``."""
    p = argparse.ArgumentParser(
        prog=f"{PROG} rows", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Bench rows on ONE GPU, one process per row (all figures emulated with the default flags).",
        epilog="A row is 'name|modes|microbatches|overlap-config|bench flags|env', e.g.\n"
               "  --rows 'opt|fxoverlap|8|||' 'carve16|fxoverlap|8|sm_carveout=16||' \\\n"
               "         'lt16|fxoverlap|8|sm_carveout=16||TORCH_BLAS_PREFER_CUBLASLT=1' \\\n"
               "         'ep2|fxoverlap|8|delay_wgrad=0|--emulate-ep 2 --link nvlink|'\n"
               "(several rows in one argument: separated by ';' or new lines). A row's bench flags replace\n"
               f"--default-flags ({DEFAULT_ROW_FLAGS}); every row runs --warmup/--iters steps, no stage\n"
               "timing, no gradient check; then OUT/emulated_table.md.")
    p.add_argument("--rows", nargs="+", default=["opt|fxoverlap|8|||"], help="the rows (see below)")
    p.add_argument("--default-flags", default=DEFAULT_ROW_FLAGS, help="bench flags of a row that gives none")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--probe", action="store_true", help="first the carveout probe (OUT/carveout_probe.jsonl)")
    _common(p, out="bench_out/gpu_rows", budget=540, est=45, timeout=150)
    args = p.parse_args(argv)
    rows = parse_rows(args.rows)
    runner = _start(args, "gpu_rows")
    if args.probe:
        runner.say("carveout probe")
        probe = os.path.join(args.out, "carveout_probe.jsonl")
        rc = runner.run(Step("carveout_probe", self_command("carveout"), timeout_s=120, log=probe))
        runner.say(f"probe rc={rc} ({len(grep(probe, '^{'))} rows)")
    for row in rows:
        step = row_step(args, row)
        if runner.limit(step) is not None:
            runner.say(f"row {row.name}: modes {row.modes}, {row.microbatches} microbatches, config "
                       f"'{row.overlap_config}', flags '{row.flags}', env '{row.env}'")
        if runner.run(step) is None or runner.dry:
            continue
        log = os.path.join(args.out, f"{row.name}.log")
        # the printed table (emulated, or a row without --emulate-ep), then the last errors
        _report(runner, log, (r"^mode (\(emulated\) )? ", dict(after=8)), (r"Error|error:", dict(tail=3, cut=300)))
    _table(runner)
    runner.say("done")
    return 0


# ---------------------------------------------------------------- emulated (scripts/gpu_emulated.sh)

EPS = ((2, "nvlink"), (4, "nvlink"), (8, "nvlink"), (16, "ib400"), (32, "ib400"))


def tier_rows(tier: int) -> list[tuple]:
    """(ep, link, routing, microbatches, mode, chunks) of a tier of the emulated table (link: a preset,
    "gbpsN" for --link-gbps N, or "none")."""
    rows: list[tuple] = []
    if tier == 1:  # dropless, 8 microbatches; at EP 8 every mode
        rows += [(ep, link, "dropless", 8, mode, None) for ep, link in EPS for mode in ("compile", "fxoverlap")]
        rows += [(8, "nvlink", "dropless", 8, mode, None) for mode in ("eager", "backend", "fwd_compile", "fwd_fxoverlap")]
    elif tier == 2:  # capacity
        rows += [(ep, link, "capacity", 8, mode, None) for ep, link in EPS for mode in ("compile", "fxoverlap")]
    elif tier == 3:  # 4 microbatches
        rows += [(ep, link, r, 4, mode, None) for r in ("dropless", "capacity") for ep, link in EPS
                 for mode in ("compile", "fxoverlap")]
    elif tier == 4:  # chunks at EP 8, 100 GB/s (the point)
        rows += [(8, "gbps100", "dropless", 8, mode, None) for mode in ("compile", "fwd_compile")]
        rows += [(8, "gbps100", "dropless", 8, mode, c) for c in (1, 2, 4)
                 for mode in ("fxoverlap", "backend", "fwd_fxoverlap", "fwd_backend")]
    elif tier == 5:  # chunks at 4 microbatches, capacity, 300 GB/s and no link
        rows.append((8, "gbps100", "dropless", 4, "compile", None))
        rows += [(8, "gbps100", "dropless", 4, "fxoverlap", c) for c in (1, 2, 4)]
        rows.append((8, "gbps100", "capacity", 8, "compile", None))
        for c in (1, 2):
            rows += [(8, "gbps100", "capacity", 8, "fxoverlap", c), (8, "gbps100", "capacity", 8, "backend", c)]
        rows += [(8, "gbps300", "dropless", 8, "fxoverlap", c) for c in (1, 2)]
        rows += [(8, "none", "dropless", 8, "fxoverlap", c) for c in (1, 2)]
        rows.append((8, "none", "dropless", 8, "compile", None))
    else:
        raise SystemExit(f"{PROG} emulated: no tier {tier} (1-5)")
    return rows


def emulated_step(args: argparse.Namespace, ep: int, link: str, routing: str, mbs: int, mode: str,
                  chunks: int | None) -> Step:
    name = f"ep{ep}_{link}_{routing}_mb{mbs}_{mode}" + (f"_c{chunks}" if chunks else "")
    link_flags = ["--link-gbps", link[4:]] if link.startswith("gbps") else ["--link", link]
    cmd = bench_cmd(args, "--out", args.out, "--name", name, "--emulate-ep", str(ep), *link_flags,
                    "--skew", str(args.skew), "--routing", routing, "--microbatches", str(mbs), "--modes", mode,
                    "--warmup", str(args.warmup), "--iters", str(args.iters), "--no-stage-timing", "--no-grad-check",
                    *(["--overlap-config", f"chunks={chunks}"] if chunks else []), *shlex.split(args.extra))
    return Step(name, cmd)


def emulated_main(argv: Sequence[str] | None = None) -> int:
    """``python -m fxoverlap.bench emulated``: the emulated-EP table on one GPU, by tiers."""
    p = argparse.ArgumentParser(
        prog=f"{PROG} emulated", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The emulated-EP table on ONE GPU: one EP-N rank's work at the Megatron peer's shape, every "
                    "dispatch/combine holding its stream as the emulated link would. One process per "
                    "(configuration, mode), each timed without the link (T_compute) and with it (T_step, T_comm).",
        epilog="Tiers: 1 dropless, 8 microbatches, EP 2/4/8 over NVLink and EP 16/32 over 400 Gb/s IB: compile and\n"
               "fxoverlap, at EP 8 also eager, backend and the forward-only modes; 2 the same with capacity\n"
               "routing; 3 both routings at 4 microbatches; 4 chunks 1/2/4 at EP 8, 100 GB/s (fxoverlap, backend,\n"
               "forward-only); 5 chunks at 4 microbatches, capacity routing, 300 GB/s and no link.\n"
               "First the link check (OUT/emucheck.jsonl), last OUT/emulated_table.md.")
    p.add_argument("--tiers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--skew", type=float, default=1.0)
    p.add_argument("--extra", default="", help='more bench flags for every row, e.g. "--overlap-config dispatcher=padded"')
    p.add_argument("--no-check", action="store_true", help="skip the hold kernel's check")
    _common(p, out="bench_out/gpu_emulated", budget=480, est=30, timeout=150)
    args = p.parse_args(argv)
    steps = [emulated_step(args, *r) for t in args.tiers for r in tier_rows(t)]
    runner = _start(args, "gpu_emulated")
    if not args.no_check:
        log = os.path.join(args.out, "emucheck.log")
        runner.run(Step("emucheck", self_command("link", "--out", os.path.join(args.out, "emucheck.jsonl")),
                        timeout_s=120, log=log))
        _report(runner, log, ("^EMUCHECK", dict(cut=300)))
    for step in steps:
        if runner.run(step) is None or runner.dry:
            continue
        log = os.path.join(args.out, f"{step.name}.log")
        _report(runner, log, (r"^mode \(emulated\)", dict(after=8, exclude="^mode", head=2)),
                (r"Error|error:", dict(tail=3, cut=300)))
    _table(runner)
    runner.say("done")
    return 0


# ---------------------------------------------------------------- slots (scripts/gpu_slots.sh)

SLOT_ROWS = ("base8_st:8:chunks=1:1 wg8_st:8:chunks=1,delay_wgrad=1:1 "
             "wg8_slot2:8:chunks=1,delay_wgrad=1,expert_wgrad_slot=2:0 base16:16:chunks=1:0 "
             "wg16:16:chunks=1,delay_wgrad=1:0 wg16_slot2:16:chunks=1,delay_wgrad=1,expert_wgrad_slot=2:0 "
             "c2wg8:8:chunks=2,delay_wgrad=1:0 c2wg8_slot2:8:chunks=2,delay_wgrad=1,expert_wgrad_slot=2:0")


def slots_main(argv: Sequence[str] | None = None) -> int:
    """``python -m fxoverlap.bench slots``: issue 24 item 3's rows and their slot balance."""
    p = argparse.ArgumentParser(
        prog=f"{PROG} slots", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Where the merged steps F(i+1) x B(i) lose the link's time, and the schedule candidate, at "
                    "the peer's shape, emulated EP 8 over 100 GB/s (all figures emulated), one GPU.",
        epilog="Rows 'name:microbatches:overlap-config:stage-timing(1/0)' (default: base8_st, wg8_st, wg8_slot2,\n"
               "base16, wg16, wg16_slot2, c2wg8, c2wg8_slot2); each times optimize without the link and with it;\n"
               "the stage-timed rows base8_st and wg8_st are then analysed by the slot-balance subcommand\n"
               "(OUT/slot_balance_*.txt), replayed at 16 microbatches and with expert_wgrad_slot=2.")
    p.add_argument("--rows", default=SLOT_ROWS, help="space-separated rows (see below)")
    p.add_argument("--link", default="--link-gbps 100", help="the bench's link flags")
    _common(p, out="bench_out/gpu_slots", budget=450, est=45, timeout=150)
    args = p.parse_args(argv)
    runner = _start(args, "gpu_slots")
    for row in args.rows.split():
        name, mbs, oc, st = row.split(":")
        stage = ["--stage-reps", "1", "--no-trace"] if st == "1" else ["--no-stage-timing"]
        cmd = bench_cmd(args, "--out", args.out, "--name", f"ep8_gbps100_dropless_mb{mbs}_fxoverlap_{name}",
                        "--emulate-ep", "8", *shlex.split(args.link), "--routing", "dropless", "--microbatches", mbs,
                        "--modes", "fxoverlap", "--warmup", "1", "--iters", "3", "--no-grad-check", *stage,
                        "--overlap-config", oc)
        if runner.run(Step(name, cmd)) is None or runner.dry:
            continue
        log = os.path.join(args.out, f"{name}.log")
        _report(runner, log, (r"^mode \(emulated\)", dict(after=3, tail=1)), (r"Error|error:", dict(tail=3, cut=300)))
    # the stage-timed rows' analysis (CPU; replays rebuild the program at a tiny shape, seconds each)
    for name in ("base8_st", "wg8_st"):
        j = os.path.join(args.out, f"ep8_gbps100_dropless_mb8_fxoverlap_{name}.json")
        if runner.dry or not os.path.exists(j) or '"stage_timing"' not in open(j).read():
            runner.say(f"no stage timing for {name}")
            continue
        txt = os.path.join(args.out, f"slot_balance_{name}.txt")
        runs = [("", ["--json-out", os.path.join(args.out, f"slot_balance_{name}.json")]),
                ("=== replayed at 16 microbatches", ["--microbatches", "16"])]
        if name == "wg8_st":
            runs += [(f"=== replayed at {m} microbatches with expert_wgrad_slot=2",
                      ["--microbatches", str(m), "--overlap-config", "delay_wgrad=1,expert_wgrad_slot=2"])
                     for m in (8, 16)]
        with open(txt, "w") as f:
            for title, extra in runs:
                if title:
                    f.write(f"\n{title}\n")
                    f.flush()
                try:
                    subprocess.run(self_command("slot-balance", j, *extra), stdout=f, stderr=subprocess.STDOUT,
                                   timeout=60, env=subprocess_env())
                except subprocess.TimeoutExpired:
                    f.write("timed out after 60 s\n")
        runner.say(f"slot balance {name}: {' '.join(grep(txt, '^Replay', head=1, cut=200))}")
    _table(runner)
    runner.say("done")
    return 0


# ---------------------------------------------------------------- one (scripts/gpu_one.sh)

SMALL_SHAPE = "--layers 2 --dim 1024 --heads 8 --experts 8 --top-k 2 --expert-dim 512 --vocab 8192 --seq 1024 --microbatches 4"


def one_main(argv: Sequence[str] | None = None) -> int:
    """``python -m fxoverlap.bench one``: the one-GPU benchmark (EP 1) and the GPU checks."""
    p = argparse.ArgumentParser(
        prog=f"{PROG} one", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The one-GPU benchmark (EP = 1) of fxoverlap against eager and torch.compile(model), and the "
                    "GPU checks of Inductor stages and CUDA graphs.",
        epilog="Parts: smoke (a tiny shape through every mode; stops with status 2 if fxoverlap or the backend\n"
               "fails); peer (the Megatron peer's shape on one rank, one process per routing, every mode; with\n"
               "--warm one more fxoverlap process for the first routing, Inductor's caches warm); small (a\n"
               "host-bound shape with CUDA graphs on); checks (the checks subcommand's numerics --small, then\n"
               "the cudagraph subcommand).")
    p.add_argument("--parts", nargs="+", default=["peer", "small", "checks"], choices=("smoke", "peer", "small", "checks"))
    p.add_argument("--routings", nargs="+", default=["dropless", "capacity", "dedup"])
    p.add_argument("--small-routings", nargs="+", default=["capacity", "dropless"])
    p.add_argument("--small-modes", default="eager,compile,fxoverlap")
    p.add_argument("--check-routings", default="dropless,capacity,dedup")
    p.add_argument("--modes", default="eager,compile,backend,fxoverlap", help="modes of the peer part's later routings")
    p.add_argument("--warm", type=int, choices=(0, 1), default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    _common(p, out="bench_out/gpu_one", budget=0, est=0, timeout=300)
    args = p.parse_args(argv)
    os.environ.update(NO_MULTICAST)
    runner = _start(args, "gpu_one")
    summary = (r"^(mode|eager|compile|backend|fxoverlap) |numerics|Error|error:", dict(exclude="Warning", tail=12))

    def bench(name: str, timeout: float, *flags: str) -> str:
        runner.run(Step(name, bench_cmd(args, "--out", args.out, "--name", name, "--no-stage-timing", "--warmup",
                                        str(args.warmup), "--iters", str(args.iters), *flags), timeout_s=timeout))
        log = os.path.join(args.out, f"{name}.log")
        _report(runner, log, summary)
        return log

    for part in args.parts:
        if part == "smoke":
            log = bench("smoke", 240, "--tiny", "--modes", "eager,backend,fxoverlap", "--iters", "1", "--warmup", "1",
                        "--routing", "dropless")
            if runner.dry:
                continue
            if not grep(log, "^fxoverlap "):
                runner.say("smoke failed: stopping")
                return 2
            if fell := grep(log, "running this graph as plain", head=3, cut=400) or grep(log, "falling back|FallbackWarning"):
                for line in fell:
                    runner.say("  " + line)
                runner.say("backend fell back: stopping")
                return 2
        elif part == "peer":
            for i, r in enumerate(args.routings):  # the first routing runs every mode
                bench(f"peer_{r}", args.timeout, "--routing", r, "--modes",
                      "eager,compile,backend,fxoverlap" if i == 0 else args.modes)
            if args.warm and args.routings:
                bench(f"peer_{args.routings[0]}_warm", 150, "--routing", args.routings[0], "--modes", "fxoverlap",
                      "--warmup", "1", "--iters", "3")
        elif part == "small":
            for r in args.small_routings:
                bench(f"small_{r}", 200, "--routing", r, "--modes", args.small_modes, "--iters", "20",
                      *shlex.split(SMALL_SHAPE), "--overlap-config", "cuda_graphs=1")
        elif part == "checks":
            log = os.path.join(args.out, "gpu_checks.log")
            runner.run(Step("gpu_checks", torchrun_command(1, "checks", "--checks", "numerics", "--small", "--routings",
                                                           args.check_routings, "--out",
                                                           os.path.join(args.out, "gpu_checks.jsonl")),
                            timeout_s=300, log=log))
            _report(runner, log, ("^CHECK", dict(cut=400)))
            log = os.path.join(args.out, "cudagraph.log")
            runner.run(Step("cudagraph", torchrun_command(1, "cudagraph", "--out", os.path.join(args.out, "cudagraph.jsonl")),
                            timeout_s=240, log=log))
            _report(runner, log, ("^CUDAGRAPH|TEARDOWN|Error", dict(cut=600)))
    runner.say("done")
    return 0


# ---------------------------------------------------------------- peer (scripts/gpu_bench.sh)

ROUTING_FLAGS = {  # ours, the peer's (None: the peer has no counterpart, its steps are skipped)
    "dropless": (["--routing", "dropless"], []),
    "capacity": (["--routing", "capacity", "--capacity-factor", "1.0"], ["--capacity-factor", "1.0"]),
    "dedup": (["--routing", "dedup"], None),
}


def peer_main(argv: Sequence[str] | None = None) -> int:
    """``python -m fxoverlap.bench peer``: fxoverlap and the Megatron-Core peer side by side (2 GPUs)."""
    p = argparse.ArgumentParser(
        prog=f"{PROG} peer", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The benchmark and the Megatron-Core peer, side by side, on a machine with 2 GPUs.",
        epilog="Needs, prepared on a machine with internet (the GPU machine has none):\n"
               "  pip download --no-deps --python-version 3.12 --only-binary=:all: megatron-core==0.19.2 -d .peer/\n"
               "  cp ../shared/peer/peer_megatron.py .peer/\n"
               "(.peer/ is git-ignored: name it in the device tool's carry). For each regime (nvlink; p2poff =\n"
               "NCCL_P2P_DISABLE=1) and routing: [--small] the small shape, the peer's shape, then the peer with\n"
               "its overlap off and on. Outputs go to --work, then to --out: gpu_bench.log, summary.md,\n"
               "results.tar.gz and each peer-shape run's Chrome trace. Exit status 1 if a step failed or was skipped.")
    p.add_argument("--regimes", nargs="+", default=["nvlink", "p2poff"], choices=("nvlink", "p2poff"))
    p.add_argument("--routings", nargs="+", default=["dropless", "dedup"], choices=tuple(ROUTING_FLAGS))
    p.add_argument("--small", nargs="*", default=None, metavar="REGIME",
                   help="also the small shape, in these regimes (no regime named: every regime)")
    p.add_argument("--small-args", default=SMALL_SHAPE)
    p.add_argument("--no-peer", action="store_true", help="skip the peer")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--stage-reps", type=int, default=2)
    p.add_argument("--bench-args", default="", help="extra bench flags of the peer-shape runs")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--work", default="/tmp/fxoverlap_gpu_bench")
    p.add_argument("--peer-dir", default=".peer")
    p.add_argument("--peer-site", default="/tmp/peer")
    _common(p, out="bench_out/gpu", budget=0, est=45, timeout=200)
    args = p.parse_args(argv)
    small = set() if args.small is None else set(args.small or args.regimes)
    os.environ.update(NO_MULTICAST)
    os.makedirs(args.work, exist_ok=True)
    if "FXOVERLAP_COMMIT" not in os.environ:  # a copy of the tree without .git: pass FXOVERLAP_COMMIT=<hash>
        git = subprocess.run(["git", "-C", repo_root(), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        os.environ["FXOVERLAP_COMMIT"] = git.stdout.strip() or "?"
    runner = Runner(args.out, "gpu_bench", budget_s=args.budget, est_s=args.est, timeout_s=args.timeout,
                    clip_reserve_s=30, dry=args.dry_run)
    runner.say(f"start; commit {os.environ['FXOVERLAP_COMMIT']}")
    for cmd in (["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
                ["nvidia-smi", "topo", "-m"]):
        if not args.dry_run and shutil.which(cmd[0]):
            runner.say(subprocess.run(cmd, capture_output=True, text=True).stdout.strip()[:2000])
    if not args.no_install:
        install(runner)
    log_versions(runner)
    peer = not args.no_peer
    wheels = sorted(glob.glob(os.path.join(args.peer_dir, "megatron_core*.whl")))
    if peer and not args.no_install and wheels:
        runner.run(Step("install_peer", [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                                         "--upgrade", "--target", args.peer_site, wheels[0]],
                        log=os.path.join(args.work, "install_peer.log")))
    script = os.path.join(args.peer_dir, "peer_megatron.py")
    if peer and not os.path.exists(script):
        runner.say(f"no {script}: skipping the peer (copy ../shared/peer/peer_megatron.py there)")
        peer = False
    common = ["--warmup", str(args.warmup), "--iters", str(args.iters)]

    def step(name: str, cmd: list[str], env: dict[str, str | None]) -> None:
        log = os.path.join(args.work, f"{name}.log")
        runner.run(Step(name, cmd, env, log=log))
        if os.path.exists(log):
            with open(log, errors="replace") as src, open(runner.log, "a") as dst:
                dst.write(src.read())

    for regime in args.regimes:
        env: dict[str, str | None] = {"NCCL_P2P_DISABLE": "1" if regime == "p2poff" else None}
        for routing in args.routings:
            ours, theirs = ROUTING_FLAGS[routing]
            tag = f"{regime}_{routing}"
            if regime in small:
                step(f"fx_small_{tag}", torchrun_command(
                    args.nproc, "run", *shlex.split(args.small_args), *ours, *common, "--stage-reps",
                    str(args.stage_reps), "--out", args.work, "--name", f"fx_small_{tag}", "--no-trace"), env)
            step(f"fx_{tag}", torchrun_command(
                args.nproc, "run", *ours, *common, "--stage-reps", str(args.stage_reps), "--out", args.work,
                "--name", f"fx_{tag}", *shlex.split(args.bench_args)), env)
            if peer and theirs is not None:
                pp = os.pathsep.join(x for x in (args.peer_site, os.environ.get("PYTHONPATH")) if x)
                for ov in (0, 1):
                    step(f"peer_{tag}_overlap{ov}", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(args.nproc), script, "--overlap", str(ov),
                                                    *common, *theirs], {**env, "PYTHONPATH": pp})
    if not args.dry_run:
        summary = os.path.join(args.out, "summary.md")
        with open(summary, "w") as f, open(runner.log, "a") as err:
            rc = subprocess.run(self_command("summary", args.work), stdout=f, stderr=err, env=subprocess_env()).returncode
        if rc:
            runner.say("summary failed")
        with open(summary) as f:
            runner.say("\n" + f.read())
        shutil.copy(summary, args.work)
        for t in glob.glob(os.path.join(args.work, "fx_*_trace.json.gz")):
            shutil.copy(t, args.out)
        with tarfile.open(os.path.join(args.out, "results.tar.gz"), "w:gz") as tar:
            for path in sorted(glob.glob(os.path.join(args.work, "*"))):
                if not path.endswith("_trace.json.gz"):
                    tar.add(path, arcname=os.path.basename(path))
    runner.say(f"end; failed steps: {' '.join(runner.failed) or 'none'}")
    return 1 if runner.failed else 0
