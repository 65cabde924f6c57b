"""The base of every error fxoverlap raises."""


class FxOverlapError(Exception):
    """Base class of every error fxoverlap raises (in ``fxoverlap``, its passes and kernels).

    Each concrete error also keeps the builtin base it always had (``TagError`` is a
    ``RuntimeError``, ``InputError`` a ``TypeError``, ...), so ``except RuntimeError`` keeps
    catching what it caught, and ``except fxoverlap.FxOverlapError`` catches all of ours."""


class InternalError(FxOverlapError, AssertionError):
    """An invariant of fxoverlap's own passes or runtime does not hold (a stage never placed,
    a value read before it is made, ...): a bug in fxoverlap, not in the model. An
    ``AssertionError``, as these checks always raised."""
