"""Dense reference attention: float32 einsum and softmax, O(T * S) memory. The test oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flaxattn import registry
from flaxattn.layout import Layout
from flaxattn.masks import Coords, Mask, allowed, values_apart
from flaxattn.mods import ScoreMod


def coords(layout: Layout, heads: int, q_len: int, kv_len: int) -> Coords:
  """`Coords` of the scores `[B, H, T, S]` of a call (`layout` materialized)."""
  assert layout.q_positions is not None and layout.kv_positions is not None
  b = layout.q_positions.shape[0]
  q_index, kv_index = layout.indices(b, q_len, kv_len)
  row, head = layout.offsets()
  return Coords(row + jnp.arange(b, dtype=jnp.int32)[:, None, None, None],
                head + jnp.arange(heads, dtype=jnp.int32)[None, :, None, None],
                q_index[:, None, :, None], kv_index[:, None, None, :],
                layout.q_positions[:, None, :, None], layout.kv_positions[:, None, None, :])


def dense_mask(mask: Mask, layout: Layout, heads: int = 1) -> jax.Array:
  """Boolean `[B, H', T, S]`: True where query t of head h may attend key s (H' = `heads`
  where the mask differs between heads, else 1). Materialized: tests only."""
  # `layout` is materialized: every field an array.
  assert layout.q_segment_ids is not None and layout.kv_segment_ids is not None
  b, t = layout.q_segment_ids.shape
  s = layout.kv_segment_ids.shape[1]
  where = coords(layout, heads if mask.per_head else 1, t, s)
  ok = allowed(mask, where, layout.q_segment_ids[:, None, :, None],
               layout.kv_segment_ids[:, None, None, :])
  return jnp.broadcast_to(ok, (b, heads if mask.per_head else 1, t, s))


def reference_attention(q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
                        soft_cap: float | None = None, score_mod: ScoreMod | None = None):
  """Attention by materializing scores.

  Args:
    q: `[B, T, H, D]`. k: `[B, S, Hkv, D]`, v: `[B, S, Hkv, Dv]` with H divisible by Hkv.
    layout: segment ids and positions (None fields take the defaults).
    soft_cap: scores become `soft_cap * tanh(scale * q.k / soft_cap)` before masking, or None.
    score_mod: a `flaxattn.ScoreMod` applied after the cap, before masking, or None.
  Returns:
    `[B, T, H, Dv]` in q's dtype, and with `return_lse` also the log-sum-exp `[B, T, H]`
    float32 (-inf for a row with nothing to attend to, whose output is zeros).
  """
  b, t, h, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = h // hkv
  layout = layout.materialize(b, t, s)
  # [B, K, G, T, S], K = G = 1 where the mask is the same for every head.
  allowed_BKGTS = dense_mask(mask, layout, h).reshape(b, -1, g if mask.per_head else 1, t, s)
  q_BTKGD = q.astype(jnp.float32).reshape(b, t, hkv, g, d)
  # A masked-out key's NaN or inf (key or value) would reach every row through 0 * NaN, in
  # the output or in dQ: zeroed, and the rows allowed to see one set to NaN (a head sees
  # one if any head of its group does).
  allowed_BKTS = allowed_BKGTS.any(2)
  k_BKSD, k_bad_BKT = values_apart(k.astype(jnp.float32).transpose(0, 2, 1, 3), allowed_BKTS)
  v_BKSD, v_bad_BKT = values_apart(v.astype(jnp.float32).transpose(0, 2, 1, 3), allowed_BKTS)
  bad_BKT = k_bad_BKT | v_bad_BKT
  # A query's non-finite features reach no key's gradient it may not see (dK sums dS x q).
  q_BKGTD, _ = values_apart(q_BTKGD.transpose(0, 2, 3, 1, 4), jnp.swapaxes(
      jnp.broadcast_to(allowed_BKGTS, (b, hkv, g, t, s)), -1, -2))
  scores_BKGTS = jnp.einsum("bkgtd,bksd->bkgts", q_BKGTD, k_BKSD) * scale
  if soft_cap is not None:
    scores_BKGTS = soft_cap * jnp.tanh(scores_BKGTS / soft_cap)
  if score_mod is not None:
    where = coords(layout, h, t, s)
    scores_BKGTS = score_mod(scores_BKGTS.reshape(b, h, t, s), where).reshape(scores_BKGTS.shape)
  scores_BKGTS = jnp.where(allowed_BKGTS, scores_BKGTS, -jnp.inf)
  lse_BKGT = jax.nn.logsumexp(scores_BKGTS, axis=-1)
  # A row with no allowed key has lse = -inf; keep its probabilities (and gradients) zero.
  safe_lse = jnp.where(jnp.isfinite(lse_BKGT), lse_BKGT, 0.0)
  # Zero where masked, as a value: the gradient of an excluded pair stays 0 even where its
  # value is huge (dP = dO . v overflowing to inf would give 0 x inf = NaN in every row).
  probs_BKGTS = jnp.where(allowed_BKGTS, jnp.exp(scores_BKGTS - safe_lse[..., None]), 0.0)
  out_BTKGD = jnp.einsum("bkgts,bksd->btkgd", probs_BKGTS, v_BKSD)
  out_BTKGD = jnp.where(bad_BKT.transpose(0, 2, 1)[..., None, None], jnp.nan, out_BTKGD)
  out = out_BTKGD.reshape(b, t, h, v.shape[-1]).astype(q.dtype)
  if not return_lse:
    return out
  lse_BKGT = jnp.where(bad_BKT[:, :, None], jnp.nan, lse_BKGT)
  lse_BTH = lse_BKGT.transpose(0, 3, 1, 2).reshape(b, t, h)
  return out, lse_BTH


@dataclasses.dataclass(frozen=True)
class Reference(registry.Kernel):
  """`backend="reference"`: every call on one device or gathered keys; never chosen by
  "auto" (O(T * S) memory)."""

  name: str = "reference"
  soft_cap: bool = True
  mask_mod: bool = True
  score_mod: bool = True

  def __call__(self, q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
               soft_cap: float | None = None, score_mod: ScoreMod | None = None):
    return reference_attention(q, k, v, layout, mask=mask, scale=scale, return_lse=return_lse,
                               soft_cap=soft_cap, score_mod=score_mod)
