"""Helpers for multi-rank tests: start ``world_size`` gloo ranks on 127.0.0.1."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fxoverlap.ir.errors import FxOverlapError

#: ``spawn`` restores a fresh interpreter per rank (each re-imports torch and fxoverlap, 3-6 s
#: of CPU); the default, ``forkserver``, forks ranks from one server that imported them once.
START_METHOD_ENV = "FXOVERLAP_TEST_START_METHOD"
_START_METHODS = ("forkserver", "spawn")
#: What the fork server imports once, before it forks any rank. Only imports: the server is a
#: fresh interpreter, so no state of the calling process (a test's torch._dynamo config, say)
#: reaches it.
_PRELOAD = ("torch", "torch.distributed", "fxoverlap", "fxoverlap.testing")
#: Variables read when torch, fxoverlap or Python import (TORCH_LOGS, TORCHINDUCTOR_*,
#: OMP_NUM_THREADS, PYTHONHASHSEED, ...): the server imported those with the environment it
#: started with, so a call that changes one of them starts its ranks with spawn instead.
_IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "PYTHON", "CUDA", "LD_")
#: The environment the fork server starts with: this module's import (test collection, before
#: any test's monkeypatch), not whatever test happens to start the first ranks.
_SERVER_ENV = dict(os.environ)


class RankError(FxOverlapError, RuntimeError):
    """A rank of a multi-process test run raised; the message holds each failing rank's error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, payload: bytes, env: dict[str, str], out_dir: str) -> None:
    # The caller's environment at call time, before anything reads it (a forked rank holds the
    # fork server's); then the test function and its arguments, whose modules may read it.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # Test ranks trace graphs on a heap that holds all of torch: freeze what the fork server
    # imported (later collections skip it) and collect cycles less often, as tests/conftest.py
    # does for the pytest process (the collector's passes cost several % of a rank's time).
    gc.freeze()
    gc.set_threshold(20000, 20, 20)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn, args = pickle.loads(payload)
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException as e:  # report, don't hang the other rank's join
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    _leave_together(rank, world_size)
    dist.destroy_process_group()
    # The result is on disk: leave without the interpreter's teardown, where a library
    # thread still running can abort the process ("terminate called without an active
    # exception", seen once in CI after a rank's work was done).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave_together(rank: int, world_size: int, timeout_s: float = 60.0) -> None:
    """Rank 0 hosts the job's TCPStore: it leaves only once every rank is done with the store
    (or after ``timeout_s``), so a rank still creating a group through the store does not see
    "Broken pipe" (seen once: ``dist.new_group`` on rank 1 after rank 0 had returned)."""
    store = dist.distributed_c10d._get_default_store()
    store.add("fxoverlap_ranks_done", 1)
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        while store.add("fxoverlap_ranks_done", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.01)


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _start_method(env: dict[str, str]) -> str:
    """``spawn`` or ``forkserver`` (starting the server if it is not running)."""
    method = env.get(START_METHOD_ENV, "forkserver")
    if method not in _START_METHODS:
        raise FxOverlapError(f"fxoverlap.testing: {START_METHOD_ENV}={method!r} is not a start method "
                             f"for test ranks; use one of {', '.join(_START_METHODS)}")
    changed = {k for k in env.keys() | _SERVER_ENV.keys() if env.get(k) != _SERVER_ENV.get(k)}
    if method == "spawn" or any(k.startswith(_IMPORT_TIME_ENV) for k in changed):
        return "spawn"
    # pytest's __main__ is imported by every rank (multiprocessing restores the caller's
    # __main__ in it): import pytest in the server too.
    preload = [*_PRELOAD, *(["pytest"] if "pytest" in sys.modules else [])]
    multiprocessing.set_forkserver_preload(preload)
    with _environ(_SERVER_ENV):
        multiprocessing.forkserver.ensure_running()
    return "forkserver"


def run_distributed(fn: Callable, *args: Any, world_size: int = 2) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be importable (defined at module level); each rank sees the caller's
    ``os.environ``, ``sys.path`` and working directory as they are at the call. An exception on
    a rank is re-raised here with that rank's traceback. The ranks are forked from a server
    that imported torch and fxoverlap once (``FXOVERLAP_TEST_START_METHOD=spawn``: a fresh
    interpreter per rank, as before).
    """
    env = dict(os.environ)
    method = _start_method(env)
    payload = pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world_size, free_port(), payload, env, d), nprocs=world_size,
                           start_method=method)
        results = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    errors = [f"rank {r}: {msg}" for r, (status, msg) in enumerate(results) if status == "error"]
    if errors:
        raise RankError("\n".join(errors))
    return [value for _, value in results]


_ONCE: dict[str, list[Any]] = {}


def run_distributed_once(fn: Callable, *args: Any, world_size: int = 2) -> list[Any]:
    """:func:`run_distributed`, spawned once per distinct call: tests reading one spawn share it."""
    key = f"{fn.__module__}.{fn.__qualname__}{args!r}/{world_size}"
    if key not in _ONCE:
        _ONCE[key] = run_distributed(fn, *args, world_size=world_size)
    return _ONCE[key]


def token_batches(vocab: int, n: int, shape: tuple[int, int] = (2, 16), seed: int = 0,
                  device: torch.device | str | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` microbatches ``(tokens, labels)`` of random token ids below ``vocab``, each of
    ``shape``, from a CPU generator seeded with ``seed`` (so any device gets the same data)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mb = (torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
        out.append(mb if device is None else (mb[0].to(device), mb[1].to(device)))
    return out


def grad_compare(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``model``'s gradients against ``ref`` (parameter name -> tensor, on any device):
    ``max_abs_diff``, ``max_abs_ref`` (max |ref grad|), ``bitwise`` and ``missing`` (the
    parameters with a gradient on one side only)."""
    worst = scale = 0.0
    bitwise, missing = True, []
    for name, p in model.named_parameters():
        r = ref.get(name)
        if (r is None) != (p.grad is None):
            missing.append(name)
            continue
        if r is None:
            continue
        g = p.grad.detach()
        r = r.to(g.device)
        # exact: bf16/fp16 differences in fp32, fp32 ones in fp64
        dt = torch.float32 if g.dtype in (torch.bfloat16, torch.float16) else torch.float64
        worst = max(worst, (g.to(dt) - r.to(dt)).abs().max().item())
        scale = max(scale, r.to(dt).abs().max().item())
        bitwise &= torch.equal(g, r)
    return {"max_abs_diff": worst, "max_abs_ref": scale, "bitwise": bitwise, "missing": missing}


def grad_diff(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> tuple[float, float, bool]:
    """(max abs diff, max |ref grad|, bitwise) between ``model``'s grads and ``ref``;
    ``(inf, 0, False)`` when a parameter has a gradient on one side only."""
    c = grad_compare(model, ref)
    return (float("inf"), 0.0, False) if c["missing"] else (c["max_abs_diff"], c["max_abs_ref"], c["bitwise"])


def eager_steps(model: torch.nn.Module, microbatches, rounds: int = 1) -> list[torch.Tensor]:
    """The eager reference: ``loss = model(*mb); loss.backward()`` per microbatch; detached losses."""
    losses = []
    for _ in range(rounds):
        for mb in microbatches:
            loss = model(*mb)
            loss.backward()
            losses.append(loss.detach())
    return losses


def take_grads(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s gradients (cast to ``dtype`` if given); the model's are then cleared."""
    grads = {
        k: (p.grad.detach().to(dtype) if dtype is not None else p.grad.detach()).clone()
        for k, p in model.named_parameters() if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return grads


def rel_l2(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest per-parameter ``‖got - ref‖ / ‖ref‖`` and its parameter (inf if the sets differ)."""
    if ref.keys() != got.keys():
        return float("inf"), f"gradient sets differ: {sorted(ref.keys() ^ got.keys())[:3]}"
    worst, name = 0.0, ""
    for k in ref:
        d = ((got[k].float() - ref[k].float()).norm() / ref[k].float().norm().clamp_min(1e-30)).item()
        if d > worst:
            worst, name = d, k
    return worst, name


def share_plans(src, dst) -> None:
    """Let engine ``dst`` reuse engine ``src``'s captures and stages (it builds its own
    programs and runners), to spare a capture (and an Inductor compile) when comparing
    engines that differ in their data parallelism only: a capture depends on the model's
    structure and state, the inputs and the stage options (parameters are looked up by
    name at every run), not on the groups or the reduce mode."""
    import dataclasses

    from fxoverlap.compiled_program import CompiledModel
    from fxoverlap.program_key import group_keys

    for key, entry in src.cache.items():
        key = dataclasses.replace(key, config=repr(dst.config), groups=group_keys(dst._groups))
        dst.cache.put(key, CompiledModel(entry.capture, entry.stages))
