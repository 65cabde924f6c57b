"""``fxoverlap.tune``: the overlap knobs chosen by timing a few real steps of the user's own model.

``tune(model, ep_group, microbatches, loss_fn=..., budget_s=60, config=None) -> OverlapConfig``
times candidate settings of ``chunks`` (and ``chunks_in_merged_steps`` where a ``Space`` asks), ``delay_wgrad`` with
``expert_wgrad_slot``, ``dispatcher``, ``sm_carveout`` and ``comm_stream_priority``, on these
microbatches, and returns ``config`` with the fastest (docs/tune.md). :func:`tune_with_report`
returns the same choice with the table of what was tried (:class:`TuneResult`).

How (each piece a module of its own, unit-tested on CPU in ``tests/test_tune.py``):

1. ``candidates``: the candidate settings (:func:`enumerate_candidates`) and their grouping by
   compiled program (:func:`program_groups`).
2. ``step_model``: stage times measured once on the defaults' program predict every other
   candidate's step (:class:`StageProfile`, :func:`predict_ms`); ``search`` times the program
   groups in the order the model ranks them until ``budget_s`` is spent, through a ``session``
   (the engines and structures of one tuning run).
3. ``timers``: how a step is timed (:class:`CudaEventTimer`, :class:`WallTimer`, or a test's own
   :class:`Timer`).
4. ``cache``: the result on disk, keyed by what it depends on (:func:`cache_key`, :class:`TuneCache`).
5. ``ranks``: every rank times the same programs in the same order and ends with the same choice.

``api`` holds the entry points, ``errors`` the errors and warnings. Tuning runs real steps:
``p.grad``, the model's buffers and the RNG states are restored after it. Note ``fxoverlap.tune``
is the function (``fxoverlap/__init__.py`` exports it over this package's name): import this
package's names with ``from fxoverlap.tune import ...``.
"""

from fxoverlap.tune.api import tune, tune_with_report
from fxoverlap.tune.cache import CACHE_ENV, CACHE_VERSION, TuneCache, cache_dir, cache_key, digest, link_key, \
    model_signature
from fxoverlap.tune.candidates import TUNED_FIELDS, Candidate, Space, applicable_dispatchers, default_candidate, \
    enumerate_candidates, program_groups
from fxoverlap.tune.errors import CandidateMismatch, TuneError, TuneSkipped, TuneWarning
from fxoverlap.tune.search import HEADROOM_SHARE, REPORT_MICROBATCHES, TuneResult
from fxoverlap.tune.step_model import CHUNK_COST, WGRAD_SHARE, Call, StageProfile, calls_of, predict_ms, replay, \
    stream_busy_ms
from fxoverlap.tune.timers import CudaEventTimer, Timer, WallTimer

__all__ = ["tune", "tune_with_report", "TuneResult", "TuneError", "CandidateMismatch", "TuneWarning", "TuneSkipped",
           "Candidate", "Space", "TUNED_FIELDS", "default_candidate", "applicable_dispatchers",
           "enumerate_candidates", "program_groups", "Call", "calls_of", "replay", "StageProfile", "predict_ms",
           "stream_busy_ms", "CHUNK_COST", "WGRAD_SHARE", "Timer", "CudaEventTimer", "WallTimer", "digest",
           "model_signature", "link_key", "cache_key", "cache_dir", "TuneCache", "CACHE_ENV", "CACHE_VERSION",
           "HEADROOM_SHARE", "REPORT_MICROBATCHES"]
