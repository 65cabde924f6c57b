"""fxoverlap.testing.run_distributed: how ranks start (a fork server that imported torch
and fxoverlap once, or spawn with FXOVERLAP_TEST_START_METHOD=spawn) and what they see of
the calling test: its os.environ and sys.path at the call, none of its module state."""

from __future__ import annotations

import multiprocessing.forkserver
import os

import pytest
import torch

from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.testing import START_METHOD_ENV, RankError, run_distributed
from rank_start_cases import MARK, fails, what_the_rank_sees

NAMES = ["FXO_RANK_START_SET", "FXO_RANK_START_GONE"]


def _server_pid() -> int | None:
    return multiprocessing.forkserver._forkserver._forkserver_pid


@pytest.fixture
def forkserver(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)


def _check(results: list[dict], world: int) -> None:
    default = torch._dynamo.config.recompile_limit
    assert default != MARK
    for r in results:
        assert r["env"] == {"FXO_RANK_START_SET": "yes", "FXO_RANK_START_GONE": None}, r
        assert r["support"] and r["cwd"] == os.getcwd(), r
        assert r["recompile_limit"] == default, r  # not the caller's 3, not a previous rank's MARK
        assert r["sum"] == world * (world + 1) / 2, r


@pytest.mark.parametrize("world", [2, 4])
def test_forkserver_ranks_see_the_callers_environment_not_its_state(world, monkeypatch, forkserver):
    monkeypatch.setenv("FXO_RANK_START_GONE", "1")
    run_distributed(what_the_rank_sees, NAMES, world_size=world)  # starts the server if need be
    monkeypatch.setenv("FXO_RANK_START_SET", "yes")
    monkeypatch.delenv("FXO_RANK_START_GONE")
    default = torch._dynamo.config.recompile_limit
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 3)
    results = run_distributed(what_the_rank_sees, NAMES, world_size=world)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", default)
    _check(results, world)
    assert {r["ppid"] for r in results} == {_server_pid()}, (results, _server_pid())


@pytest.mark.slow
def test_an_import_time_variable_changed_falls_back_to_spawn(monkeypatch, forkserver):
    """torch read TORCH_* when the server imported it: a call that changes one gets fresh ranks."""
    monkeypatch.setenv("FXO_RANK_START_SET", "yes")
    monkeypatch.setenv("TORCH_FXO_RANK_START", "1")
    results = run_distributed(what_the_rank_sees, NAMES)
    _check(results, 2)
    assert {r["ppid"] for r in results} == {os.getpid()}


@pytest.mark.slow
def test_spawn_on_request(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    monkeypatch.setenv("FXO_RANK_START_SET", "yes")
    results = run_distributed(what_the_rank_sees, NAMES)
    _check(results, 2)
    assert {r["ppid"] for r in results} == {os.getpid()}


def test_a_failing_rank_is_reported(forkserver):
    with pytest.raises(RankError, match="rank 1: ValueError: rank 1 refuses"):
        run_distributed(fails)


def test_an_unknown_start_method_is_refused(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(FxOverlapError, match=f"{START_METHOD_ENV}='fork' is not a start method"):
        run_distributed(fails)
