"""`nnx_attention_fn`: flaxattn's kernels inside stock `flax.nnx.MultiHeadAttention`.

A user who keeps Flax's layer changes one argument, `attention_fn=flaxattn.nnx_attention_fn()`,
and gets the fused kernels. Flax's layer describes masking with dense `[.., T, S]` arrays;
flaxattn never builds them, so the mask pattern is fixed when the function is made, and a
dense mask reaching the function raises (packing and padding need `segment_ids`, which only
`flaxattn.MultiHeadAttention` takes).
"""

from __future__ import annotations

import math
from typing import cast

import jax
import jax.numpy as jnp

from flaxattn.attention import attention, check_scale, check_soft_cap
from flaxattn.masks import Causal, Full, Mask, check_mask


def _unsupported(arg: str, value, why: str) -> ValueError:
  return ValueError(
      f"flaxattn.nnx_attention_fn: {arg} expects None, got {type(value).__name__}"
      f"{' of shape ' + str(value.shape) if hasattr(value, 'shape') else ''}; {why} Use"
      " flaxattn.MultiHeadAttention (same parameters and call) with segment_ids=/positions="
      " for padding and packed documents, or keep Flax's default attention_fn.")


def nnx_attention_fn(mask: Mask = Full(), *, backend="auto", context_parallel=None,
                     scale: float | None = None, logit_soft_cap: float | None = None):
  """An `attention_fn` for `flax.nnx.MultiHeadAttention` that runs `flaxattn.attention`.

  Args:
    mask: the flaxattn mask every call applies (`Full()`, `Causal()`, `Local(w)`, ...);
      `is_causal=True` in the layer's call adds `Causal()`.
    backend, context_parallel, scale, logit_soft_cap: passed to `flaxattn.attention`.

  Returns:
    `fn(query, key, value, bias=None, mask=None, ..., is_causal=False)` with the keywords
    of `flax.nnx.dot_product_attention`: query `[..., T, H, D]`, key `[..., S, Hkv, D]`,
    value `[..., S, Hkv, Dv]` (leading batch axes of any number), returning `[..., T, H, Dv]`
    in the inputs' dtype (or `dtype`). `precision` is ignored: kernels accumulate in float32.

  Raises (when made):
    TypeError: `mask` is not a flaxattn mask.
    ValueError: `scale` or `logit_soft_cap` not a positive finite number.

  Raises (from the returned function):
    ValueError: a dense `mask` or `bias` array (flaxattn never applies `[T, S]` arrays:
      nnx passes one for user masks and for `decode=True`), `module` (`sow_weights=True`),
      or attention dropout (`dropout_rate` > 0 and not deterministic).
  """
  fixed_mask = check_mask(mask)
  # Checked here too (flaxattn.attention checks each call): a bad value fails where the
  # function is made, not at the layer's first call.
  check_scale(scale)
  check_soft_cap(logit_soft_cap)

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, promote_dtype=None, is_causal=False):
    del broadcast_dropout, dropout_rng, precision, promote_dtype
    if mask is not None:
      raise _unsupported("mask", mask, "the function's mask is fixed when it is made"
                         " (nnx_attention_fn(mask=...)) and dense masks are not applied.")
    if bias is not None:
      raise _unsupported("bias", bias, "attention biases need the [T, S] scores.")
    if module is not None:
      raise _unsupported("module", module, "sow_weights needs the [T, S] weights.")
    if dropout_rate > 0 and not deterministic:
      raise ValueError(f"flaxattn.nnx_attention_fn: dropout_rate expects 0 (or deterministic"
                       f" calls), got {dropout_rate}: the kernels never form the [T, S]"
                       " probabilities to drop; apply nnx.Dropout to the output instead.")
    pattern = fixed_mask
    if is_causal and not pattern.is_causal:
      pattern = Causal() if pattern == Full() else pattern & Causal()
    dtype = dtype or jnp.result_type(query, key, value)
    batch = query.shape[:-3]
    def flat(x):
      return x.astype(dtype).reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])
    # Without return_lse, one array (attention's annotation covers both).
    out = cast(jax.Array, attention(flat(query), flat(key), flat(value), mask=pattern,
                                    scale=scale, backend=backend,
                                    context_parallel=context_parallel,
                                    logit_soft_cap=logit_soft_cap))
    return out.reshape(batch + out.shape[1:])

  return attention_fn
