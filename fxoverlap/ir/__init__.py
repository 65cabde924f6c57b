"""fxoverlap's IR: what the passes produce and the runtime consumes, and nothing else.

* :mod:`~fxoverlap.ir.meta`: every metadata key (``node.meta``, ``GraphModule.meta``) and op names;
* :mod:`~fxoverlap.ir.capture`: :class:`Capture`, the joint graph of a train step and what its values mean;
* :mod:`~fxoverlap.ir.stage`: :class:`Tag` (where a node belongs) and :class:`Stage` (a subgraph
  the schedule moves), with the kinds, directions, parts and streams;
* :mod:`~fxoverlap.ir.program`: the program's node markers and the :class:`Step` each node carries;
* :mod:`~fxoverlap.ir.bucket`: gradient :class:`Bucket`\\ s of data parallelism;
* :mod:`~fxoverlap.ir.errors`: :class:`FxOverlapError`, the base of every error fxoverlap raises.

The dependency rule (checked in CI by import-linter, ``setup.cfg``): this package imports
nothing else of fxoverlap; passes import it (and the ops/kernels they lower to), the
runtime imports it and never a pass, the API layer (``optimize``, the backend, the engine,
``pipeline``) sits on top.
"""

from fxoverlap.ir.bucket import Bucket, GradSlot
from fxoverlap.ir.capture import Capture, Choice, SubclassLayout
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.ir.program import Step
from fxoverlap.ir.stage import Direction, Part, Stage, StageKind, StreamKind, Tag

__all__ = ["Bucket", "Capture", "Choice", "Direction", "FxOverlapError", "GradSlot", "Part", "Stage", "StageKind",
           "Step", "StreamKind", "SubclassLayout", "Tag"]
