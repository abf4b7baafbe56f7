"""The eval: held-out loss, overall and by position in the segment, from one forward pass.

A token's position is the one in `positions` (its index in its packed segment; a document
longer than a row restarts at 0 in each piece). Positions fall in buckets whose upper bounds
double up to seq_len (`position_bounds`: 256, 512, ..., seq_len; a smaller first bound for
short rows), so a curve of loss against position shows whether the model uses the context
it is given: with more of it, later tokens are predicted better.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.llama import Llama, token_losses

FIRST_BOUND = 256  # the first bucket's upper bound, where seq_len is long enough
MIN_BUCKETS = 4  # buckets of a short row (a first bound of seq_len / 8)


def position_bounds(seq_len: int) -> tuple[int, ...]:
  """Upper bounds (exclusive) of the position buckets of rows of `seq_len` tokens: the
  first min(256, seq_len // 8) (at least 1), each next one twice the last, the last
  `seq_len`. 4096 -> (256, 512, 1024, 2048, 4096); 256 -> (32, 64, 128, 256)."""
  bound = max(1, min(FIRST_BOUND, seq_len // 2 ** (MIN_BUCKETS - 1)))
  bounds = []
  while bound < seq_len:
    bounds.append(bound)
    bound *= 2
  return (*bounds, seq_len)


@nnx.jit
def eval_step(model: Llama, batch: dict) -> dict:
  """Sums of one batch (global `[B, T]` arrays) per position bucket (`position_bounds(T)`):
  `loss_sum_K` (weighted cross entropy) and `tokens_K` (weights), `[K]` float32. Every
  token is in one bucket, so they add up to the batch's totals."""
  ce_BT = token_losses(model, batch)
  weights_BT = batch["weights"].astype(jnp.float32)
  bounds_K = jnp.asarray(position_bounds(batch["positions"].shape[1]), jnp.int32)
  # A token's bucket: the number of bounds at or below its position.
  bucket_BT = jnp.sum(batch["positions"][..., None] >= bounds_K, axis=-1)
  in_bucket_BTK = jax.nn.one_hot(bucket_BT, len(bounds_K)) * weights_BT[..., None]
  return {"loss_sum_K": jnp.einsum("BT,BTK->K", ce_BT, in_bucket_BTK),
          "tokens_K": jnp.sum(in_bucket_BTK, axis=(0, 1))}


def summary(sums: dict, seq_len: int) -> dict:
  """An eval's metrics from the totals of `eval_step`'s sums over its batches (host
  numbers): `eval_loss`, `eval_tokens`, and `eval_loss_by_position` /
  `eval_tokens_by_position` mapping each bucket's upper bound (a string, as JSON keys
  are) to its mean loss / its tokens, for buckets with tokens. `eval_loss` is the mean of
  the buckets' losses weighted by their tokens (both from the same sums)."""
  tokens = float(sum(sums["tokens_K"]))
  by_loss, by_tokens = {}, {}
  for bound, loss_sum, n in zip(position_bounds(seq_len), sums["loss_sum_K"],
                                sums["tokens_K"], strict=True):
    if n > 0:
      by_loss[str(bound)], by_tokens[str(bound)] = float(loss_sum) / float(n), float(n)
  return {"eval_loss": float(sum(sums["loss_sum_K"])) / max(tokens, 1.0), "eval_tokens": tokens,
          "eval_loss_by_position": by_loss, "eval_tokens_by_position": by_tokens}
