"""Marker functions that appear in a program graph besides stage calls.

The runtime interprets them; calling one directly does nothing useful.
"""

from __future__ import annotations


def record_event(name: str, stream: str) -> None:
    """Record event ``name`` on ``stream`` after the work issued there so far."""


def wait_event(name: str, stream: str) -> None:
    """Make ``stream`` wait for event ``name`` before running further work."""


def free(microbatch: int, *values: str) -> None:
    """Drop ``values`` of ``microbatch`` from the value store (their last use has run)."""


for _f in (record_event, wait_event, free):
    _f.__module__ = "fxoverlap.program"
