"""Building blocks for model authors."""

from tandem.core.layers.attention import Attention

__all__ = ["Attention"]
