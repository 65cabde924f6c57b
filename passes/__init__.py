"""fxoverlap's graph passes, one per module, each with one public entry point.

capture -> tag -> side -> recompute -> split -> cudagraph -> inductor   (once per plan)
schedule -> streams -> free                                            (once per microbatch count)

``fxoverlap.pipeline`` runs them in this order for both entry points.
"""

from fxoverlap.passes.capture import Capture, CaptureError, capture
from fxoverlap.passes.split import split
from fxoverlap.passes.tag import TagError, tag

__all__ = ["Capture", "CaptureError", "TagError", "capture", "split", "tag"]
