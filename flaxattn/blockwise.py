"""Blockwise attention (placeholder while the kernel is written)."""
from flaxattn.reference import reference_attention as blockwise_attention
