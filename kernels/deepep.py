"""The op names torchtitan registers for DeepEP and HybridEP, so the tag pass recognises
them without importing ``deep_ep`` or torchtitan.

torchtitan 0.3.0 (``torchtitan/distributed/deepep/``) wraps DeepEP V2's ``ElasticBuffer``
in ``deepep::dispatch`` / ``deepep::combine`` (``deepep.py``; dispatch's backward is a
combine and combine's a dispatch, run on the buffer inside the ops' autograd formulas) and
HybridEP (DeepEP's ``hybrid-ep`` branch) in ``hybridep::dispatch`` / ``hybridep::combine``
(``hybridep.py``), whose backwards are the ops ``hybridep::combine_bwd`` /
``hybridep::dispatch_bwd``. Backward nodes take their forward op's tag by ``seq_nr``, so
only the forward ops are listed for the tag pass.
"""

from __future__ import annotations

DEEPEP_DISPATCH_OPS = ("deepep::dispatch", "hybridep::dispatch")
DEEPEP_COMBINE_OPS = ("deepep::combine", "hybridep::combine")
# Backward exchanges (tagged by seq_nr as their forward op): combine_bwd is dispatch's
# backward, dispatch_bwd combine's.
DEEPEP_BACKWARD_OPS = ("hybridep::combine_bwd", "hybridep::dispatch_bwd")
