"""flaxattn: attention for long-context training in JAX and Flax NNX.

Public API:
  attention, explain                     the functional entry point and its dispatch report
  Full, Causal, Local, Chunked, Mask     masks on positions and segments
  seqlens_and_offsets                    THD descriptor from segment ids, O(T + max_segments)
  MultiHeadAttention                     NNX layer, a drop-in for flax.nnx.MultiHeadAttention
  sharding                               default logical-axis rules
"""

from flaxattn.attention import attention, explain
from flaxattn.masks import Causal, Chunked, Full, Local, Mask

__all__ = [
    "attention", "explain",
    "Mask", "Full", "Causal", "Local", "Chunked",
]
