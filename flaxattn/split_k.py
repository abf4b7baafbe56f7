"""Split-K (flash-decoding) attention for decode-shaped calls: the `split_k` kernel.

A decode step has a few queries and a long cache. The blockwise kernel walks the cache one
key block after another; here the keys are cut into C chunks of L and all chunks are
computed at once, one batched XLA computation: each chunk's partial output and lse, then
the chunks merged exactly by lse (`ring.merge_weights`, the merge of context-parallel
decode). Plain XLA ops, so autodiff gives the gradients, but for the weighted sum of values,
whose weights' gradient stays float32 (`_weighted_values`). docs/design.md, "Decode steps".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from flaxattn import checks, registry
from flaxattn.blocks import pad_axis1
from flaxattn.layout import Layout
from flaxattn.masks import Coords, Mask, allowed
from flaxattn.mods import ScoreMod
from flaxattn.ring import merge_weights

# A decode step, or a short draft of speculative decoding. T x G query rows per KV head
# (64 at G = 4) already fill the training kernels' query tiles, and past them split-K's
# dense T x S scores cost more than the blocks those kernels skip.
MAX_QUERIES = 16
# Keys per chunk at most (docs/design.md, "Decode steps"): on CPU any size from 512 keys to
# one chunk timed alike; on a GPU, chunks x batch x KV heads are the pieces of work.
DEFAULT_CHUNK = 2048
# The float32 scores `[B, H, T, S]` are materialized (and kept for the backward pass).
DEFAULT_SCORE_BUDGET = 1 << 30
_GIB = 2**30


def chunking(s: int, chunk: int) -> tuple[int, int]:
  """(C, L): C chunks of L keys that cover S keys. C is the fewest chunks of at most `chunk`
  keys, or up to twice as many where that divides S exactly (no padding, which would copy
  the cache); else S is padded by fewer than C keys."""
  c = -(-s // chunk)
  c = next((n for n in range(c, 2 * c + 1) if s % n == 0), c)
  return c, -(-s // c)


@jax.custom_vjp
def _weighted_values(p_BKCTGL, v_BCLKD):
  """The chunks' unnormalized outputs `[B, K, C, T, G, Dv]` float32: float32 weights p, cast
  to v's dtype for the matmul as every kernel does. Its gradient w.r.t. p stays float32: the
  softmax's backward subtracts two nearly equal terms from it (a query seeing one key gets
  exactly zero), and autodiff's cotangent in v's dtype (bfloat16) left errors of 3% of the
  largest dK there."""
  return jnp.einsum("bkctgl,bclkd->bkctgd", p_BKCTGL.astype(v_BCLKD.dtype), v_BCLKD,
                    preferred_element_type=jnp.float32)


def _weighted_values_fwd(p_BKCTGL, v_BCLKD):
  return _weighted_values(p_BKCTGL, v_BCLKD), (p_BKCTGL, v_BCLKD)


def _weighted_values_bwd(saved, dacc_BKCTGD):
  p_BKCTGL, v_BCLKD = saved
  dp_BKCTGL = jnp.einsum("bkctgd,bclkd->bkctgl", dacc_BKCTGD, v_BCLKD.astype(jnp.float32),
                         preferred_element_type=jnp.float32)
  dv_BCLKD = jnp.einsum("bkctgl,bkctgd->bclkd", p_BKCTGL.astype(v_BCLKD.dtype),
                        dacc_BKCTGD.astype(v_BCLKD.dtype), preferred_element_type=jnp.float32)
  return dp_BKCTGL, dv_BCLKD.astype(v_BCLKD.dtype)


_weighted_values.defvjp(_weighted_values_fwd, _weighted_values_bwd)


def split_k_attention(q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
                      chunk: int = DEFAULT_CHUNK, soft_cap: float | None = None,
                      score_mod: ScoreMod | None = None):
  """Attention with the keys in chunks, every chunk at once.

  Args:
    q: `[B, T, H, D]`; k: `[B, S, Hkv, D]`, v: `[B, S, Hkv, Dv]` (H a multiple of Hkv), any
      float dtype; scores, softmax and accumulation are float32.
    layout: segment ids / positions (None fields are defaults); for a programmable mask or
      score, the token indices (a decode step's: the cache slots of the new tokens and of
      the keys).
    chunk: keys per chunk at most (`chunking`); padding keys get segment id 0.
    soft_cap: scores become `soft_cap * tanh(scores / soft_cap)` (after the scale), or None.
    score_mod: a `flaxattn.ScoreMod` applied after the cap, or None.
  Returns:
    `[B, T, H, Dv]` in q's dtype; with `return_lse` also lse `[B, T, H]` float32 (-inf
    where a query has nothing to attend to; its output and gradients are zero).
  """
  b, t, h, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  g = h // hkv
  c, length = chunking(s, chunk)
  full = layout.materialize(b, t, s)
  assert full.q_segment_ids is not None and full.q_positions is not None  # materialized

  def chunks(x):  # [B, S, ...] -> [B, C, L, ...]; padding keys get segment id 0
    return pad_axis1(x, c * length).reshape((b, c, length) + x.shape[2:])

  k_BCLKD, v_BCLKD = chunks(k), chunks(v)

  # Where the scores `[B, K, C, T, G, L]` sit (`flaxattn.masks.Coords`).
  def keys(x):
    return chunks(x)[:, None, :, None, None, :]

  def queries(x):
    return x[:, None, None, :, None, None]

  reads = mask.reads_index or score_mod is not None
  q_index, kv_index = full.indices(b, t, s) if reads else (None, None)
  row, head = full.offsets()
  coords = Coords(row + jnp.arange(b, dtype=jnp.int32).reshape(b, 1, 1, 1, 1, 1),
                  head + jnp.arange(h, dtype=jnp.int32).reshape(1, hkv, 1, 1, g, 1),
                  None if q_index is None else queries(q_index),
                  None if kv_index is None else keys(kv_index),
                  queries(full.q_positions), keys(full.kv_positions))
  allowed_BKCTGL = allowed(mask, coords, queries(full.q_segment_ids), keys(full.kv_segment_ids))
  # Scale q once instead of every score; the G query heads of a KV head are rows of its
  # matmul, so K/V are read once per group.
  q_BTKGD = (q * jnp.asarray(scale, q.dtype)).reshape(b, t, hkv, g, d)
  scores_BKCTGL = jnp.einsum("btkgd,bclkd->bkctgl", q_BTKGD, k_BCLKD,
                             preferred_element_type=jnp.float32)
  if soft_cap is not None:
    scores_BKCTGL = soft_cap * jnp.tanh(scores_BKCTGL / soft_cap)
  if score_mod is not None:
    scores_BKCTGL = score_mod(scores_BKCTGL, coords)
  scores_BKCTGL = jnp.where(allowed_BKCTGL, scores_BKCTGL, -jnp.inf)
  # Each chunk's partial softmax, shifted by its max (no gradient: the shift cancels; a
  # chunk with no allowed key shifts by 0 so that exp gives 0, not NaN).
  top_BKCTG = lax.stop_gradient(scores_BKCTGL.max(-1))
  top_BKCTG = jnp.where(jnp.isfinite(top_BKCTG), top_BKCTG, 0.0)
  p_BKCTGL = jnp.exp(scores_BKCTGL - top_BKCTG[..., None])
  denom_BKCTG = p_BKCTGL.sum(-1)
  seen_BKCTG = denom_BKCTG > 0
  denom_BKCTG = jnp.where(seen_BKCTG, denom_BKCTG, 1.0)
  acc_BKCTGD = _weighted_values(p_BKCTGL, v_BCLKD)
  lse_BKCTG = jnp.where(seen_BKCTG, top_BKCTG + jnp.log(denom_BKCTG), -jnp.inf)
  # Chunk c's partial output is acc_c / denom_c; the merge weighs it by w_c.
  w_BKCTG, lse_BKTG = merge_weights(lse_BKCTG, axis=2)
  out_BKTGD = jnp.sum(acc_BKCTGD * (w_BKCTG / denom_BKCTG)[..., None], axis=2)
  out = out_BKTGD.transpose(0, 2, 1, 3, 4).reshape(b, t, h, v.shape[-1]).astype(q.dtype)
  if not return_lse:
    return out
  return out, lse_BKTG.transpose(0, 2, 1, 3).reshape(b, t, h)


@dataclasses.dataclass(frozen=True)
class SplitK(registry.Kernel):
  """`backend="split_k"`: decode-shaped calls (at most `MAX_QUERIES` queries against more
  keys) whose float32 scores fit `score_budget` bytes; every mask (programmable ones too),
  score mod, layout, GQA, soft cap, Dv != D, lse; first on every platform, so "auto" takes
  it for decode steps only.

  Raises:
    ValueError: `chunk` not a positive int (a bool, a float, a string), or `score_budget`
      not a positive finite number.
  """

  chunk: int = DEFAULT_CHUNK
  score_budget: int = DEFAULT_SCORE_BUDGET
  name: str = "split_k"
  soft_cap: bool = True
  mask_mod: bool = True
  score_mod: bool = True

  def __post_init__(self):
    checks.integer("SplitK(chunk=...)", self.chunk, "a positive int (keys per chunk)",
                   lambda x: x > 0, f"{DEFAULT_CHUNK} is the default")
    checks.number("SplitK(score_budget=...)", self.score_budget, "a positive number of bytes"
                  " (finite)", lambda x: x > 0, f"{DEFAULT_SCORE_BUDGET} (1 GiB) is the default")

  def reason(self, call: registry.Call) -> str | None:
    b, t, h = call.q_shape[:3]
    s = call.kv_shape[1]
    if t > MAX_QUERIES:
      return f"split_k serves decode steps of at most {MAX_QUERIES} queries; this call has {t}."
    if s <= t:
      return (f"split_k serves a few queries against more keys; this call has {s} keys for {t}"
              " queries.")
    scores = 4 * b * h * t * s
    if scores > self.score_budget:
      return (f"split_k's float32 scores [B, H, T, S] = [{b}, {h}, {t}, {s}] would take"
              f" {scores / _GIB:.2f} GiB, over its budget of {self.score_budget / _GIB:.2f}"
              " GiB (SplitK(score_budget=...)); blockwise streams them in blocks.")
    return None

  def describe(self, call: registry.Call) -> str | None:
    s = call.kv_shape[1]
    c, length = chunking(s, self.chunk)
    pad = f", padded by {c * length - s}" if c * length != s else ""
    return (f"a decode step: the {s} keys in {c} chunk{'s' if c > 1 else ''} of {length}{pad},"
            " all chunks at once in one XLA computation, merged by lse")

  def __call__(self, q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
               soft_cap: float | None = None, score_mod: ScoreMod | None = None):
    return split_k_attention(q, k, v, layout, mask=mask, scale=scale, return_lse=return_lse,
                             chunk=self.chunk, soft_cap=soft_cap, score_mod=score_mod)
