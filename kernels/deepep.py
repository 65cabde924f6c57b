"""DeepEP's op names, so the tag pass recognises DeepEP communication without importing ``deep_ep``."""

from __future__ import annotations

# Op names DeepEP registers when its dispatch/combine are traced.
DEEPEP_DISPATCH_OPS = ("deep_ep::dispatch", "deep_ep::intranode_dispatch", "deep_ep::internode_dispatch")
DEEPEP_COMBINE_OPS = ("deep_ep::combine", "deep_ep::intranode_combine", "deep_ep::internode_combine")
