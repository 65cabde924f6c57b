"""Workers for tests/test_rank_start.py (ranks import this module by name, through the
tests/support entry that conftest puts on sys.path)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

MARK = 1234  # what a rank writes into a torch._dynamo config; no later rank may see it


def what_the_rank_sees(rank: int, world: int, names: list[str]) -> dict:
    """The rank's view of the caller's state: the given environment variables, whether
    tests/support is on sys.path, the working directory, a torch._dynamo setting (then
    overwritten, for the next call to check), the parent's pid, and an all-reduce."""
    seen = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = MARK
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return dict(env={n: os.environ.get(n) for n in names},
                support=any(os.path.basename(p) == "support" and os.path.isdir(p) for p in sys.path),
                cwd=os.getcwd(), recompile_limit=seen, ppid=os.getppid(), sum=t.item())


def fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")
