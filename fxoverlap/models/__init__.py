"""Reference models: plain PyTorch, written the way torchtitan writes them."""

from fxoverlap.models.moe import MoEConfig, MoEStage, MoETransformer

__all__ = ["MoEConfig", "MoEStage", "MoETransformer"]
