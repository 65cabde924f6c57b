"""The errors and warnings of tuning."""

from __future__ import annotations

from fxoverlap.ir.errors import FxOverlapError


class TuneError(FxOverlapError, RuntimeError):
    """Tuning could not run as asked (the message names what and the fix)."""


class CandidateMismatch(TuneError):
    """The ranks enumerated different candidate lists (another config, EP size or device on some
    rank): raised on every rank, before any timing, so none waits in a collective."""


class TuneWarning(UserWarning):
    """What the measurement revealed: ``CUDA_DEVICE_MAX_CONNECTIONS=1``, a link slower than the
    compute can hide, a candidate too close to the device's memory (or out of it), timed steps
    that spread more than a choice can be sure of."""


class TuneSkipped(TuneWarning):
    """Tuning needs CUDA events (or a timer passed in): the config is kept as given."""
