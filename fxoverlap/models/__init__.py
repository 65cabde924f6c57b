"""Reference models: plain PyTorch, written the way torchtitan writes them."""

from fxoverlap.models.moe import MoEConfig, MoETransformer

__all__ = ["MoEConfig", "MoETransformer"]
