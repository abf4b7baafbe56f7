"""Models built on flaxattn and flax.nnx.

  LlamaConfig, Llama     Llama-style decoder (GQA, RoPE on positions, SwiGLU, chunked layers)
  make_targets, loss_fn  next-token targets for packed rows, weighted cross entropy
  token_losses           the cross entropy of every token (the eval reads it by position)
  num_params, flops_per_token, layer_masks
  param_shapes, param_changes   parameter shapes from a config; the fields that change them
"""

from models.llama import (
  Llama,
  LlamaConfig,
  flops_per_token,
  layer_masks,
  loss_fn,
  make_targets,
  num_params,
  param_changes,
  param_shapes,
  token_losses,
)

__all__ = ["LlamaConfig", "Llama", "make_targets", "loss_fn", "num_params", "flops_per_token",
           "layer_masks", "param_shapes", "param_changes", "token_losses"]
