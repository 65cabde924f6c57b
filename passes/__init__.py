"""fxoverlap's graph passes, one per module, each with one public entry point.

capture -> tag -> recompute -> split -> schedule -> streams -> cudagraph -> free
"""

from fxoverlap.passes.capture import Capture, CaptureError, capture
from fxoverlap.passes.split import split
from fxoverlap.passes.tag import TagError, tag

__all__ = ["Capture", "CaptureError", "TagError", "capture", "split", "tag"]
