"""fxoverlap's graph passes, one per module, each with one public entry point.

capture -> dispatcher -> tag -> side -> rng -> recompute -> split -> cudagraph -> inductor   (once per plan)
schedule -> [reduce] -> streams -> free                                                     (once per microbatch count)

``fxoverlap.pipeline`` runs them in this order for both entry points.
"""

from fxoverlap.passes.capture import Capture, CaptureError, capture
from fxoverlap.passes.split import split
from fxoverlap.passes.tag import TagError, tag

__all__ = ["Capture", "CaptureError", "TagError", "capture", "split", "tag"]
