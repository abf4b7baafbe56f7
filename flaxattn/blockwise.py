"""Blockwise (flash) attention in JAX with a custom VJP, O(T) memory: the `blockwise` kernel.

Runs the run-time block schedule of `flaxattn.blocks` (which (query block, key block) pairs
are skipped, dense or masked); owns the forward and backward passes and their use as the
ring's per-device step.
Internally q is `[B, K, T, G, D]` so GQA folds into the matmul rows (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flaxattn import checks, registry
from flaxattn.blocks import (
  Tokens,
  by_kind,
  pad_axis1,
  round_up,
  schedule,
  slice_tokens,
  tokens,
  visit_bounds,
)
from flaxattn.layout import Layout
from flaxattn.masks import Mask, allowed, values_apart
from flaxattn.mods import ScoreMod, change_scores, zero_cotangents
from flaxattn.ring import RingStep

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 512


def _block_size(length: int, requested: int) -> int:
  return min(requested, round_up(length, 8))


def _int32(*idx):
  """Slice indices as int32: dynamic slices take one index dtype, and under x64 a Python int
  would become int64 beside the int32 loop counters."""
  return tuple(jnp.asarray(i, jnp.int32) for i in idx)


def _at(x, *idx):
  """x[idx] for traced scalar indices, as a dynamic slice (not a gather)."""
  return jax.lax.dynamic_slice(x, _int32(*idx), (1,) * len(idx)).reshape(())


def _block(x, bi, start, size):
  """Row `bi`, tokens `start:start + size` (axis 2) of a `[B, K, L, ...]` array:
  `[K, size, ...]`."""
  return jax.lax.dynamic_slice(x, _int32(bi, 0, start, *(0,) * (x.ndim - 3)),
                               (1, x.shape[1], size) + x.shape[3:])[0]


def _tile(toks: Tokens, bi, q, kv, heads):
  """`Coords` of a block's scores laid out `[K, bq, G, bk]`: `heads` `[K, 1, G, 1]` local
  query heads (KV head k, group g: head k * G + g), queries `q` and keys `kv` (start,
  size)."""
  return toks.coords(bi, heads, q, kv, (0, 2, 3), (0, 1, 2))


def _heads(hkv: int, g: int):
  return jnp.arange(hkv * g, dtype=jnp.int32).reshape(hkv, 1, g, 1)


def _allowed(mask: Mask, toks: Tokens, bi, q, kv, hkv: int, g: int):
  """Mask of one block `[K', bq * G, bk]` for rows ordered (query, group); K' = K for a mask
  that differs between heads, else 1."""
  heads = _heads(hkv, g) if mask.per_head else jnp.zeros((1, 1, 1, 1), jnp.int32)
  q_seg = slice_tokens(toks.q_seg, bi, *q)[None, :, None, None]
  kv_seg = slice_tokens(toks.kv_seg, bi, *kv)[None, None, None, :]
  ok = allowed(mask, _tile(toks, bi, q, kv, heads), q_seg, kv_seg)
  k_ = hkv if mask.per_head else 1
  return jnp.broadcast_to(ok, (k_, q[1], g, kv[1])).reshape(k_, q[1] * g, kv[1])


def _scores(q_blk, k_blk, allowed, soft_cap: float | None, mod=None):
  """Scores of a block `[K, bq * G, bk]` (`mods.change_scores`: soft-capped, then changed by
  `mod`, a function of the scores laid out `[K, bq, G, bk]`, or None), masked where
  `allowed` is given (a partial block); and the pullback of the scores before masking, for
  the backward pass: `back(ds) -> (ds of q.k, [d of each float operand of the mod])`."""
  s = jnp.einsum("hmd,hkd->hmk", q_blk, k_blk, preferred_element_type=jnp.float32)
  s, back = change_scores(s, soft_cap, mod)
  if allowed is not None:
    s = jnp.where(allowed, s, -jnp.inf)
  return s, back


def _score_mod(score_mod: ScoreMod | None, toks: Tokens, bi, q, kv, hkv: int, g: int):
  """The `mod` of `_scores` for one block: `score_mod` on the block's scores, or None."""
  if score_mod is None:
    return None

  def mod(s):
    out, back = score_mod.vjp(s.reshape(hkv, q[1], g, kv[1]),
                              _tile(toks, bi, q, kv, _heads(hkv, g)))

    def pullback(ds):
      d_s, d_ops = back(ds.reshape(out.shape))
      return d_s.reshape(s.shape), d_ops
    return out.reshape(s.shape), pullback
  return mod


def _blockwise_fwd(q, k, v, toks: Tokens, kinds, lo, hi, *, mask, score_mod, bq, bk, soft_cap):
  """q `[B, K, T, G, D]` (already scaled), k `[B, K, S, D]`, v `[B, K, S, Dv]`.

  Returns out `[B, K, T, G, Dv]` (q dtype) and lse `[B, K, T, G]` float32 (T padded to blocks).
  """
  b, hkv, t_pad, g, d = q.shape
  dv = v.shape[-1]
  nq = t_pad // bq

  def one_query_block(n):
    bi, i = n // nq, n % nq
    q_blk = _block(q, bi, i * bq, bq).reshape(hkv, bq * g, d)
    rows = (i * bq, bq)

    def update(masked, j, carry):
      m, denom, acc = carry
      k_blk, v_blk = _block(k, bi, j * bk, bk), _block(v, bi, j * bk, bk)
      cols = (j * bk, bk)
      allowed = None
      if masked:
        allowed = _allowed(mask, toks, bi, rows, cols, hkv, g)
        v_blk, seen_bad = values_apart(v_blk, allowed)
      s, _ = _scores(q_blk, k_blk, allowed, soft_cap,
                     _score_mod(score_mod, toks, bi, rows, cols, hkv, g))
      m_new = jnp.maximum(m, s.max(-1))
      # A row that has seen no allowed key keeps m = -inf; shift by 0 so exp gives 0, not NaN.
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp(s - m_safe[..., None])
      alpha = jnp.exp(m - m_safe)
      denom = alpha * denom + p.sum(-1)
      pv = jnp.einsum("hmk,hkd->hmd", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
      if masked:
        pv = jnp.where(seen_bad[..., None], jnp.nan, pv)
      return m_new, denom, alpha[..., None] * acc + pv

    def body(j, carry):
      return jax.lax.switch(_at(kinds, bi, i, j), by_kind(update), j, carry)

    init = (jnp.full((hkv, bq * g), -jnp.inf, jnp.float32), jnp.zeros((hkv, bq * g), jnp.float32),
            jnp.zeros((hkv, bq * g, dv), jnp.float32))
    m, denom, acc = jax.lax.fori_loop(_at(lo, bi, i), _at(hi, bi, i), body, init)
    empty = denom == 0.0
    out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, denom)[..., None])
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, denom)))
    return out.astype(q.dtype), lse

  out, lse = jax.lax.map(one_query_block, jnp.arange(b * nq, dtype=jnp.int32))
  out = out.reshape(b, nq, hkv, bq, g, dv).transpose(0, 2, 1, 3, 4, 5).reshape(b, hkv, t_pad, g, dv)
  lse = lse.reshape(b, nq, hkv, bq, g).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t_pad, g)
  return out, lse


def _blockwise_bwd(q, k, v, out, lse, dout, dlse, toks: Tokens, kinds, lo_t, hi_t, *, mask,
                   score_mod, bq, bk, soft_cap):
  """Gradients for `_blockwise_fwd`: one pass over key blocks; dK/dV accumulate per key
  block, dQ in a float32 buffer updated in place, a score mod's float operands' gradients
  in float32 sums. Returns dq (w.r.t. the scaled q), dk, dv, [d of each float operand]."""
  b, hkv, t_pad, g, d = q.shape
  s_pad = k.shape[2]
  nk = s_pad // bk
  # d lse / d s = p, so an lse cotangent shifts the softmax-Jacobian term row by row.
  delta = jnp.einsum("bhtgd,bhtgd->bhtg", dout.astype(jnp.float32), out.astype(jnp.float32)) - dlse
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  d_ops0 = [] if score_mod is None else [jnp.zeros(x.shape, jnp.float32)
                                         for x in score_mod.float_operands()]

  def one_key_block(carry, n):
    dq, d_ops = carry
    bi, j = n // nk, n % nk
    k_blk, v_blk = _block(k, bi, j * bk, bk), _block(v, bi, j * bk, bk)
    cols = (j * bk, bk)

    def rows(x, i):  # query block i of a `[B, K, T, G, ...]` array as `[K, bq * G, ...]`
      return _block(x, bi, i * bq, bq).reshape((hkv, bq * g) + x.shape[4:])

    def update(masked, i, carry):
      dq, dk, dv, d_ops = carry
      q_blk, do_blk = rows(q, i), rows(dout, i)
      k_i, v_i, allowed = k_blk, v_blk, None
      if masked:  # masked-out keys' non-finite values stay out of dQ (ds @ k) and dP, and
        # a query's out of the dK of keys it may not see (dK sums ds x q)
        allowed = _allowed(mask, toks, bi, (i * bq, bq), cols, hkv, g)
        k_i, v_i = (values_apart(x, allowed)[0] for x in (k_blk, v_blk))
        q_blk = values_apart(q_blk, jnp.swapaxes(allowed, -1, -2))[0]
      s, back = _scores(q_blk, k_i, allowed, soft_cap,
                        _score_mod(score_mod, toks, bi, (i * bq, bq), cols, hkv, g))
      p = jnp.exp(s - rows(lse_safe, i)[..., None])
      dv = dv + jnp.einsum("hmk,hmd->hkd", p.astype(dout.dtype), do_blk,
                           preferred_element_type=jnp.float32)
      dp = jnp.einsum("hmd,hkd->hmk", do_blk, v_i, preferred_element_type=jnp.float32)
      ds, d_ops_blk = back(p * (dp - rows(delta, i)[..., None]))
      if allowed is not None:  # an excluded pair's ds is 0, even where dP overflowed
        ds = jnp.where(allowed, ds, 0.0)
      d_ops = [a + x for a, x in zip(d_ops, d_ops_blk, strict=True)]
      dk = dk + jnp.einsum("hmk,hmd->hkd", ds.astype(q.dtype), q_blk,
                           preferred_element_type=jnp.float32)
      dq_blk = jnp.einsum("hmk,hkd->hmd", ds.astype(k.dtype), k_i,
                          preferred_element_type=jnp.float32).reshape(1, hkv, bq, g, d)
      start = _int32(bi, 0, i * bq, 0, 0)
      dq = jax.lax.dynamic_update_slice(
          dq, jax.lax.dynamic_slice(dq, start, dq_blk.shape) + dq_blk, start)
      return dq, dk, dv, d_ops

    def body(i, carry):
      return jax.lax.switch(_at(kinds, bi, i, j), by_kind(update), i, carry)

    def zeros(dim):
      return jnp.zeros((hkv, bk, dim), jnp.float32)
    dq, dk, dv, d_ops = jax.lax.fori_loop(_at(lo_t, bi, j), _at(hi_t, bi, j), body,
                                          (dq, zeros(d), zeros(v.shape[-1]), d_ops))
    return (dq, d_ops), (dk, dv)

  dq0 = jnp.zeros(q.shape, jnp.float32)
  (dq, d_ops), (dk, dv) = jax.lax.scan(one_key_block, (dq0, d_ops0),
                                       jnp.arange(b * nk, dtype=jnp.int32))
  def to_kv(x):
    return (x.reshape(b, nk, hkv, bk, x.shape[-1]).transpose(0, 2, 1, 3, 4)
            .reshape(b, hkv, s_pad, x.shape[-1]))
  return dq, to_kv(dk), to_kv(dv), d_ops


def _rows_in(x, t_pad: int, hkv: int, fill=0.0):
  """`[B, T, H, ...]` -> `[B, K, T, G, ...]`, padding T with `fill`."""
  b, _, h = x.shape[:3]
  x = pad_axis1(x, t_pad, fill).reshape((b, t_pad, hkv, h // hkv) + x.shape[3:])
  return jnp.moveaxis(x, 2, 1)


def _rows_out(x, t: int):
  """`[B, K, T, G, ...]` -> `[B, T, H, ...]`."""
  b, hkv, t_pad, g = x.shape[:4]
  return jnp.moveaxis(x, 1, 2).reshape((b, t_pad, hkv * g) + x.shape[4:])[:, :t]


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the forward and backward passes of one call share: its `Tokens`, block sizes and
  block schedule `[B, nq, nk]` (built once per call: for a programmable mask, the block map
  found on device)."""

  toks: Tokens
  kinds: jax.Array
  bq: int
  bk: int


jax.tree_util.register_dataclass(Plan, data_fields=["toks", "kinds"], meta_fields=["bq", "bk"])


def plan(q, k, layout: Layout, mask: Mask, score_mod: ScoreMod | None = None,
         block_q: int = DEFAULT_BLOCK_Q, block_kv: int = DEFAULT_BLOCK_KV) -> Plan:
  """The `Plan` of a call on q `[B, T, H, D]` and k `[B, S, Hkv, D]`."""
  b, t, h, _ = q.shape
  s = k.shape[1]
  bq, bk = _block_size(t, block_q), _block_size(s, block_kv)
  toks = tokens(mask, layout, b, round_up(t, bq), round_up(s, bk), t, s,
                reads_index=score_mod is not None)
  return Plan(toks, schedule(mask, toks, h, bq, bk), bq, bk)


def _inputs(q, k, v, scale, p: Plan):
  t_pad, s_pad = p.toks.q_seg.shape[1], p.toks.kv_seg.shape[1]
  # Scale q once instead of every score block.
  q_BKTGD = _rows_in(q * jnp.asarray(scale, q.dtype), t_pad, k.shape[2])
  def kv_in(x):
    return pad_axis1(x, s_pad).transpose(0, 2, 1, 3)
  return q_BKTGD, kv_in(k), kv_in(v)


def forward(q, k, v, layout: Layout, *, mask: Mask, scale: float,
            block_q: int = DEFAULT_BLOCK_Q, block_kv: int = DEFAULT_BLOCK_KV,
            soft_cap: float | None = None, score_mod: ScoreMod | None = None,
            plan_: Plan | None = None):
  """Forward pass without autodiff rules: out `[B, T, H, Dv]` (q dtype), lse `[B, T, H]` f32.
  `plan_`: the call's `Plan` where the caller has it (else built here)."""
  p = plan(q, k, layout, mask, score_mod, block_q, block_kv) if plan_ is None else plan_
  q_BKTGD, k_BKSD, v_BKSD = _inputs(q, k, v, scale, p)
  lo, hi = visit_bounds(jnp, p.kinds, axis=2)
  out, lse = _blockwise_fwd(q_BKTGD, k_BKSD, v_BKSD, p.toks, p.kinds, lo, hi, mask=mask,
                            score_mod=score_mod, bq=p.bq, bk=p.bk, soft_cap=soft_cap)
  t = q.shape[1]
  return _rows_out(out, t), _rows_out(lse, t)


def backward(q, k, v, layout: Layout, out, lse, dout, dlse, *, mask: Mask, scale: float,
             block_q: int = DEFAULT_BLOCK_Q, block_kv: int = DEFAULT_BLOCK_KV,
             soft_cap: float | None = None, score_mod: ScoreMod | None = None,
             plan_: Plan | None = None):
  """Gradients (dq, dk, dv) of the attention of q against k/v, given the output `out` and
  log-sum-exp `lse` of the rows (which may cover more keys than k/v: ring attention passes the
  merged result of every key block) and their cotangents `dout`, `dlse` (float32 `[B, T, H]`).
  and a fourth: the gradients of the float operands of `score_mod` (`ScoreMod.float_operands`),
  float32 (none without one)."""
  p = plan(q, k, layout, mask, score_mod, block_q, block_kv) if plan_ is None else plan_
  q_BKTGD, k_BKSD, v_BKSD = _inputs(q, k, v, scale, p)
  lo_t, hi_t = visit_bounds(jnp, p.kinds, axis=1)
  t_pad, hkv = q_BKTGD.shape[2], k.shape[2]
  dq, dk, dv, d_ops = _blockwise_bwd(
      q_BKTGD, k_BKSD, v_BKSD, _rows_in(out, t_pad, hkv), _rows_in(lse, t_pad, hkv, -jnp.inf),
      _rows_in(dout, t_pad, hkv), _rows_in(dlse.astype(jnp.float32), t_pad, hkv), p.toks,
      p.kinds, lo_t, hi_t, mask=mask, score_mod=score_mod, bq=p.bq, bk=p.bk, soft_cap=soft_cap)
  def kv_out(x):
    return x.transpose(0, 2, 1, 3)[:, :k.shape[1]].astype(k.dtype)
  return (_rows_out(dq * scale, q.shape[1]).astype(q.dtype), kv_out(dk), kv_out(dv), d_ops)


def _primal(q, k, v, layout, mods, scale, block_q, block_kv,
            soft_cap) -> tuple[jax.Array, jax.Array]:
  return _attention_fwd(q, k, v, layout, mods, scale, block_q, block_kv, soft_cap)[0]


# Applied as a call, not a decorator through functools.partial, so the result stays typed.
# `mods` (mask, score_mod): pytrees whose leaves (a MaskMod's or ScoreMod's operands) are
# traced; the score mod's float operands receive gradients.
_attention = jax.custom_vjp(_primal, nondiff_argnums=(5, 6, 7, 8))


def _attention_fwd(q, k, v, layout, mods, scale, block_q, block_kv, soft_cap):
  mask, score_mod = mods
  p = plan(q, k, layout, mask, score_mod, block_q, block_kv)
  out, lse = forward(q, k, v, layout, mask=mask, scale=scale, soft_cap=soft_cap,
                     score_mod=score_mod, plan_=p)
  # A programmable mask's block map is kept for the backward pass (built once per call);
  # the built-ins' schedule is cheaper to build again than to hold ([B, nq, nk] int32 a
  # layer: 16 MiB at T = 1M).
  return (out, lse), (q, k, v, layout, mods, p if mask.needs_tiles else None, out, lse)


def _attention_bwd(scale, block_q, block_kv, soft_cap, residuals, cotangents):
  q, k, v, layout, mods, p, out, lse = residuals
  mask, score_mod = mods
  dout, dlse = cotangents
  dq, dk, dv, d_ops = backward(q, k, v, layout, out, lse, dout, dlse, mask=mask, scale=scale,
                               block_q=block_q, block_kv=block_kv, soft_cap=soft_cap,
                               score_mod=score_mod, plan_=p)
  d_score = None if score_mod is None else score_mod.cotangent(d_ops)
  return dq, dk, dv, None, (zero_cotangents(mask), d_score)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
                        block_q: int = DEFAULT_BLOCK_Q, block_kv: int = DEFAULT_BLOCK_KV,
                        soft_cap: float | None = None, score_mod: ScoreMod | None = None):
  """Flash attention with block skipping.

  Args:
    q: `[B, T, H, D]`; k: `[B, S, Hkv, D]`, v: `[B, S, Hkv, Dv]` (H a multiple of Hkv), any
      float dtype; scores, softmax and accumulation are float32.
    layout: segment ids / positions (None fields are defaults; all-None gives a static schedule).
    block_q, block_kv: block sizes (clipped to the padded lengths). T and S need not divide.
    soft_cap: scores become `soft_cap * tanh(scores / soft_cap)` (after the scale), or None.
    score_mod: a `flaxattn.ScoreMod` applied to every score after the cap, or None.
  Returns:
    `[B, T, H, Dv]` in q's dtype; with `return_lse` also lse `[B, T, H]` float32
    (-inf where a query has nothing to attend to; its output and gradients are zero).
  """
  out, lse = _attention(q, k, v, layout, (mask, score_mod), float(scale), block_q, block_kv,
                        soft_cap)
  return (out, lse) if return_lse else out


def ring_block(t: int, n: int, load_balance: bool) -> int:
  """Block size of the ring's passes for T = t over n devices. A block must not straddle the
  two load-balanced chunks of a shard: its position range would cover both and nothing in
  it could be skipped."""
  return min(DEFAULT_BLOCK_Q, t // (2 * n)) if load_balance else DEFAULT_BLOCK_Q


@functools.partial(jax.tree_util.register_dataclass, data_fields=["mask", "score_mod"],
                   meta_fields=["scale", "block", "soft_cap"])
@dataclasses.dataclass(frozen=True)
class BlockwiseStep(RingStep):
  """The blockwise passes as the ring's per-device step: the same computation at every step
  (so the ring runs a `lax.scan`), its block schedule from the visiting positions. The
  mask's and score mod's operands are the step's leaves; the score mod's float operands
  receive gradients (`operand_zeros`, `cotangent`)."""

  mask: Mask
  scale: float
  block: int
  soft_cap: float | None = None
  score_mod: ScoreMod | None = None

  def forward(self, step, q, k, v, layout):
    return forward(q, k, v, layout, mask=self.mask, scale=self.scale, block_q=self.block,
                   block_kv=self.block, soft_cap=self.soft_cap, score_mod=self.score_mod)

  def backward(self, step, q, k, v, layout, out, lse, dout, dlse):
    grads = backward(q, k, v, layout, out, lse, dout, dlse, mask=self.mask, scale=self.scale,
                     block_q=self.block, block_kv=self.block, soft_cap=self.soft_cap,
                     score_mod=self.score_mod)
    return grads if self.score_mod is not None else grads[:3]

  def operand_zeros(self) -> list:
    if self.score_mod is None:
      return []
    return [jnp.zeros(x.shape, jnp.float32) for x in self.score_mod.float_operands()]

  def cotangent(self, d_operands: list):
    if self.score_mod is None:
      return None
    return dataclasses.replace(self, mask=zero_cotangents(self.mask),
                               score_mod=self.score_mod.cotangent(d_operands))


@dataclasses.dataclass(frozen=True)
class Passes:
  """The blockwise passes as `checked.Passes`: the exact fallback of the kernels whose
  exactness depends on the data (`operands` unused; no lse cotangent is a zero one)."""

  mask: Mask
  scale: float
  soft_cap: float | None = None

  def forward(self, operands, q, k, v, layout: Layout):
    return forward(q, k, v, layout, mask=self.mask, scale=self.scale, soft_cap=self.soft_cap)

  def backward(self, operands, q, k, v, layout: Layout, out, lse, dout, dlse):
    dlse = jnp.zeros(lse.shape, jnp.float32) if dlse is None else dlse
    dq, dk, dv, _ = backward(q, k, v, layout, out, lse, dout, dlse, mask=self.mask,
                             scale=self.scale, soft_cap=self.soft_cap)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@dataclasses.dataclass(frozen=True)
class Blockwise(registry.Kernel):
  """`backend="blockwise"`: serves every call, every platform, and the ring (soft cap and
  Dv != D included)."""

  block_q: int = DEFAULT_BLOCK_Q
  block_kv: int = DEFAULT_BLOCK_KV
  name: str = "blockwise"
  ring: bool = True
  soft_cap: bool = True
  mask_mod: bool = True
  score_mod: bool = True

  def __post_init__(self):
    for arg in ("block_q", "block_kv"):
      checks.integer(f"Blockwise({arg}=...)", getattr(self, arg), "a positive int (tokens per"
                     " block)", lambda x: x > 0, "512 is the default")

  def __call__(self, q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
               soft_cap: float | None = None, score_mod: ScoreMod | None = None):
    return blockwise_attention(q, k, v, layout, mask=mask, scale=scale, return_lse=return_lse,
                               block_q=self.block_q, block_kv=self.block_kv, soft_cap=soft_cap,
                               score_mod=score_mod)

  def passes(self, mask: Mask, scale: float, soft_cap: float | None = None) -> Passes:
    return Passes(mask, float(scale), soft_cap)

  def ring_step(self, *, strategy: str, mask: Mask, scale: float, shards: int, axis: str,
                load_balance: bool, q_shape, kv_shape, layout: Layout,
                soft_cap: float | None = None, score_mod: ScoreMod | None = None) -> RingStep:
    if strategy != "ring":
      return super().ring_step(strategy=strategy, mask=mask, scale=scale, shards=shards,
                               axis=axis, load_balance=load_balance, q_shape=q_shape,
                               kv_shape=kv_shape, layout=layout, soft_cap=soft_cap,
                               score_mod=score_mod)
    return ring_step(mask, scale, q_shape[1], shards, load_balance, soft_cap, score_mod)


def ring_step(mask: Mask, scale: float, t: int, shards: int, load_balance: bool,
              soft_cap: float | None = None, score_mod: ScoreMod | None = None) -> BlockwiseStep:
  """The blockwise ring step for T = t over `shards` devices (also the exact path of the
  kernels that mask on the token index)."""
  return BlockwiseStep(mask, scale, ring_block(t, shards, load_balance), soft_cap, score_mod)
