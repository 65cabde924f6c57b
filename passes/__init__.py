"""fxoverlap's graph passes, one per module, each with one public entry point.

capture -> dispatcher -> tag -> side -> rng -> recompute -> split -> cudagraph -> inductor   (once per plan)
schedule -> [reduce] -> streams -> free                                                     (once per microbatch count)

``fxoverlap.pipeline`` runs them in this order for both entry points: ``PASSES`` (read here as
``fxoverlap.passes.PASSES``) is that list, capture excepted (the entry points capture).
"""

from fxoverlap.passes.capture import Capture, CaptureError, capture
from fxoverlap.passes.split import split
from fxoverlap.passes.tag import TagError, tag



def __getattr__(name: str):
    if name in ("PASSES", "Pass", "PassState"):  # defined with the pass manager (it imports these modules)
        import fxoverlap.pipeline

        return getattr(fxoverlap.pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PASSES", "Pass", "PassState", "Capture", "CaptureError", "TagError", "capture", "split", "tag"]
