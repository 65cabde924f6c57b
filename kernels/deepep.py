"""DeepEP dispatcher backend: imported only when a model asks for it."""

from __future__ import annotations


def require_deep_ep():
    """Return the ``deep_ep`` module or raise an error that says how to get it."""
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "fxoverlap: the DeepEP dispatcher backend needs the `deep_ep` package; "
            "install DeepEP (https://github.com/deepseek-ai/DeepEP) for this backend, "
            "or use the default torch.distributed all-to-all backend"
        ) from e
    return deep_ep


# Op names DeepEP registers when its dispatch/combine are traced; the tag pass
# recognises them as communication without importing deep_ep.
DEEPEP_DISPATCH_OPS = ("deep_ep::dispatch", "deep_ep::intranode_dispatch", "deep_ep::internode_dispatch")
DEEPEP_COMBINE_OPS = ("deep_ep::combine", "deep_ep::intranode_combine", "deep_ep::internode_combine")
