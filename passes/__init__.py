"""fxoverlap's graph passes, one per module, each with one public entry point.

capture -> dispatcher -> tag -> side -> rng -> recompute -> split -> cudagraph -> inductor   (once per plan)
schedule -> [reduce] -> streams -> free                                                     (once per microbatch count)

``fxoverlap.passes.manager`` holds that list, capture excepted (the entry points capture), as
``PASSES`` (read here as ``fxoverlap.passes.PASSES``) and runs it; ``fxoverlap.pipeline`` calls it
for both entry points. The manager is not a pass: it adapts each pass's entry point to one
signature, logs it and emits its trace artifacts.
"""

from fxoverlap.passes.capture import Capture, CaptureError, capture
from fxoverlap.passes.manager import PASSES, Pass, PassState
from fxoverlap.passes.split import split
from fxoverlap.passes.tag import TagError, tag

__all__ = ["PASSES", "Pass", "PassState", "Capture", "CaptureError", "TagError", "capture", "split", "tag"]
