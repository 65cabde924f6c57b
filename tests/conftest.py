import os
import sys

# tests/support holds the helper modules (models, cases, snapshot renderers); tests import
# them by name (`import numerics_cases`). Spawned ranks unpickle worker functions by that
# module name too: multiprocessing's spawn hands them this sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

import gc  # noqa: E402

import pytest  # noqa: E402

# The cyclic garbage collector: a session keeps torch, transformers and the module-level caches
# of shared spawns and engines alive (several hundred thousand objects), and each tracing run
# makes tens of thousands of short-lived FX nodes and fake tensors. With Python's default
# thresholds (700, 10, 10) the collector ran thousands of young and dozens of full passes over
# that heap: 7% of the time of tests/test_training_loop.py, test_cudagraph.py and test_backend.py
# together, 3% with these thresholds and the collected modules frozen (gc.freeze: never scanned
# again). Garbage cycles are still collected, later; tests that need them gone call gc.collect().
gc.set_threshold(20000, 20, 20)


def pytest_collection_finish(session) -> None:
    """Freeze what the imports and the collection made: later collections skip it."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def fp8_here(monkeypatch):
    """Let ``expert_dtype="fp8_rowwise"`` through on CPU: the FP8 ops run their reference math
    (tests/test_fp8.py, and FP8 with CUDA graphs in tests/test_cudagraph.py)."""
    from fxoverlap import fp8_ops

    monkeypatch.setattr(fp8_ops, "fp8_unavailable", lambda device: [])
