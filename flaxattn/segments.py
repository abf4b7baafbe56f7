"""Per-document lengths and offsets (cuDNN's THD descriptor) from segment ids.

`seqlens_and_offsets` walks run boundaries with a cumulative sum and scatters into
`max_segments` bins, O(block + max_segments) temporaries per row, never a `[T, T]` mask.
Conventions follow JAX's THD `dot_product_attention`: seqlens `[B, M]`, offsets
`[B, M + 1]`, unused slots -1 on both (docs/design.md).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

# Tokens per step of the walk along a row; bounds temporary memory, not the result.
_BLOCK = 8192


class SeqlensOffsets(NamedTuple):
  """THD descriptor of a batch: slot n of the q side and of the kv side are one document.

  With M = max_segments, all int32:
    q_seqlens   `[B, M]`      tokens of the document in slot n on the query side.
    q_offsets   `[B, M + 1]`  index in the row where that document starts.
    kv_seqlens  `[B, M]`      the same for keys/values (equal to the q side for self-attention).
    kv_offsets  `[B, M + 1]`
    num_segments `[B]`        slots the row needs. Slots `>= num_segments` hold -1 in
                              seqlens and offsets; the last offsets column is always -1.

  A document present on one side only keeps its slot, with length 0 and offset 0 on the
  other side (an empty pair: its queries see no key, the caller must zero them).
  A row with `num_segments > M` (see `valid`) does not fit: its first M slots are
  filled, the rest is lost, and the descriptor must not be used for that row.
  """

  q_seqlens: jax.Array
  q_offsets: jax.Array
  kv_seqlens: jax.Array
  kv_offsets: jax.Array
  num_segments: jax.Array

  @property
  def valid(self) -> jax.Array:
    """`[B]` bool: the row's documents fit in max_segments slots."""
    return self.num_segments <= self.q_seqlens.shape[-1]


def seqlens_and_offsets(segment_ids, max_segments: int, kv_segment_ids=None, *,
                        check: bool = False) -> SeqlensOffsets:
  """Lengths and start offsets of the documents of packed rows, in O(T + max_segments).

  A segment is a maximal run of equal non-zero ids in a row (0 is padding). Ids need not
  be sorted nor dense: `[3, 3, 1, 1, 0, 0]` has two segments, of lengths 2 and 2.

  Self-attention (`kv_segment_ids=None`): slot n is the n-th segment of the row; the kv
  fields are the q fields.
  Cross attention: slots pair segments by id, never by rank. The k-th segment with id X
  on the q side and the k-th with id X on the kv side share a slot (k is 0 when documents
  are contiguous, as packed data is). Slots are ordered by first appearance: every q
  segment in q order, then kv segments without a q partner in kv order. A segment
  present on one side only gets length 0 and offset 0 on the other.

  Jit-able with `max_segments` static; nothing of shape `[T, T]` or `[T, max_segments]`
  is built.

  Args:
    segment_ids: `[B, T]` integer array. 0 = padding, documents numbered by positive ints.
    max_segments: static Python int > 0, the slots per row (M).
    kv_segment_ids: optional `[B, S]` integer array for keys/values (cross attention).
    check: if True, a row with more than `max_segments` documents raises through
      `jax.experimental.checkify`: eagerly a `checkify.JaxRuntimeError` right away;
      under `jit` the caller must functionalize the call with
      `checkify.checkify(f)` and `err.throw()` (plain `jit` refuses to trace it).
      With False, compare `num_segments` (or `.valid`) yourself.

  Returns:
    `SeqlensOffsets` (q_seqlens, q_offsets, kv_seqlens, kv_offsets, num_segments), all
    int32, seqlens `[B, M]`, offsets `[B, M + 1]`, num_segments `[B]`; unused slots -1.
    `num_segments` is exact when it is <= M; past M it is only guaranteed to be > M
    (in cross attention it may then over-count).

  Raises:
    TypeError: ids are not integer arrays, or max_segments is not an int.
    ValueError: ids are not 2-D, max_segments <= 0, or the batch sizes differ.
  """
  _check_ids("segment_ids", segment_ids)
  if isinstance(max_segments, bool) or not isinstance(max_segments, numbers.Integral):
    raise TypeError(f"max_segments must be a static Python int, got {max_segments!r}"
                    f" ({type(max_segments).__name__}). Pass it as a constant"
                    " (static_argnames under jit).")
  if max_segments <= 0:
    raise ValueError(f"max_segments must be > 0, got {max_segments}. Pass the most"
                     " documents a row may hold.")
  m = int(max_segments)
  ids_BT = jnp.asarray(segment_ids)

  if kv_segment_ids is None:
    start_BM, len_BM, _, n_B = _runs(ids_BT, m, with_ids=False)
    used_BM = jnp.arange(m) < n_B[:, None]
    seqlens_BM = jnp.where(used_BM, len_BM, -1)
    offsets_BMp1 = _offsets(jnp.where(used_BM, start_BM, -1))
    out = SeqlensOffsets(seqlens_BM, offsets_BMp1, seqlens_BM, offsets_BMp1, n_B)
  else:
    _check_ids("kv_segment_ids", kv_segment_ids)
    if np.shape(kv_segment_ids)[0] != np.shape(segment_ids)[0]:
      raise ValueError(f"kv_segment_ids has batch {np.shape(kv_segment_ids)[0]} (shape"
                       f" {np.shape(kv_segment_ids)}) but segment_ids has batch"
                       f" {np.shape(segment_ids)[0]} (shape {np.shape(segment_ids)});"
                       " both must be [B, ...] with the same B.")
    out = _cross(ids_BT, jnp.asarray(kv_segment_ids), m)

  if check:
    worst = jnp.argmax(out.num_segments)
    checkify.check(jnp.all(out.valid),
                   "seqlens_and_offsets: row {row} has {n} documents but max_segments="
                   f"{m}; raise max_segments to at least that or pack fewer documents.",
                   row=worst, n=out.num_segments[worst])
  return out


def _check_ids(name: str, ids) -> None:
  dtype = getattr(ids, "dtype", None)
  if dtype is None:
    dtype = np.asarray(ids).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array (0 = padding, documents 1, 2, ...),"
                    f" got dtype {dtype}. Cast it, e.g. {name}.astype(jnp.int32).")
  if np.ndim(ids) != 2:
    raise ValueError(f"{name} must be 2-D [batch, seq], got shape {np.shape(ids)}."
                     " Add a batch axis for a single row: ids[None].")


def _runs(ids_BT, m: int, *, with_ids: bool):
  """The first `m` runs of each row: start, length, id (or None), and the row's run count.

  Slots past a row's count hold junk; callers mask them with the count. The row is
  walked in blocks of `_BLOCK` tokens so that temporaries are O(block + m), not O(T):
  XLA keeps several T-long buffers alive for a whole-row cumsum and scatter.
  """
  b, t = ids_BT.shape
  blk = max(1, min(_BLOCK, t))
  rows_B1 = jnp.arange(b)[:, None]
  iota_L = jnp.arange(blk, dtype=jnp.int32)

  def step(i, carry):
    start_BM, len_BM, id_BM, n_B = carry
    # The last block is clamped to end at t; tokens an earlier block saw are masked.
    lo = jnp.minimum(i * blk, t - blk)
    ids_BL = jax.lax.dynamic_slice_in_dim(ids_BT, lo, blk, axis=1)
    before_B1 = jax.lax.dynamic_slice_in_dim(ids_BT, jnp.maximum(lo - 1, 0), 1, axis=1)
    before_B1 = jnp.where(lo > 0, before_B1, 0)  # 0 before the row: a row may open with a run
    prev_BL = jnp.concatenate([before_B1, ids_BL[:, :-1]], axis=1)
    nz_BL = (ids_BL != 0) & (lo + iota_L >= i * blk)
    # A run starts where a non-zero id differs from its left neighbour.
    first_BL = nz_BL & (ids_BL != prev_BL)
    rank_BL = n_B[:, None] + jnp.cumsum(first_BL, axis=1, dtype=jnp.int32) - 1
    # Slot m is out of range: scatters drop it, so runs past m never spill anywhere.
    slot_BL = jnp.where(nz_BL, rank_BL, m)
    len_BM = len_BM.at[rows_B1, slot_BL].add(1, mode="drop")
    first_slot_BL = jnp.where(first_BL, rank_BL, m)
    start_BM = start_BM.at[rows_B1, first_slot_BL].set(lo + iota_L, mode="drop")
    if with_ids:
      id_BM = id_BM.at[rows_B1, first_slot_BL].set(ids_BL, mode="drop")
    n_B = n_B + jnp.sum(first_BL, axis=1, dtype=jnp.int32)
    return start_BM, len_BM, id_BM, n_B

  zeros_BM = jnp.zeros((b, m), jnp.int32)
  init = (zeros_BM, zeros_BM, jnp.zeros((b, m), ids_BT.dtype) if with_ids else None,
          jnp.zeros((b,), jnp.int32))
  start_BM, len_BM, id_BM, n_B = jax.lax.fori_loop(0, -(-t // blk), step, init)
  return start_BM, len_BM, id_BM, n_B


def _cross(q_ids_BT, kv_ids_BS, m: int) -> SeqlensOffsets:
  """Descriptor for queries and keys with different segment ids, paired by id."""
  q_start, q_len, q_id, n_q = _runs(q_ids_BT, m, with_ids=True)
  kv_start, kv_len, kv_id, n_kv = _runs(kv_ids_BS, m, with_ids=True)
  b = q_id.shape[0]
  slot_M = jnp.arange(m)

  # Pair the first m runs of each side by (id, occurrence) with one sort of 2m entries
  # (O(m log m), no [m, m] compare): sorting by (invalid, id, index) puts each id's q
  # runs, then its kv runs, side by side, each in order of appearance.
  dtype = jnp.promote_types(q_id.dtype, kv_id.dtype)
  ids_B2M = jnp.concatenate([q_id.astype(dtype), kv_id.astype(dtype)], axis=1)
  invalid_B2M = jnp.concatenate([slot_M >= n_q[:, None], slot_M >= n_kv[:, None]], axis=1)
  idx_B2M = jnp.broadcast_to(jnp.arange(2 * m, dtype=jnp.int32), (b, 2 * m))
  inv_s, id_s, idx_s = jax.lax.sort((invalid_B2M.astype(jnp.int32), ids_B2M, idx_B2M),
                                    dimension=1, num_keys=3)
  i_2M = jnp.arange(2 * m, dtype=jnp.int32)
  is_kv = idx_s >= m
  new_id = (i_2M == 0) | (id_s != jnp.roll(id_s, 1, axis=1))
  new_side = new_id | (is_kv != jnp.roll(is_kv, 1, axis=1))
  group = jax.lax.cummax(jnp.where(new_id, i_2M, 0), axis=1)  # first entry of this id
  side = jax.lax.cummax(jnp.where(new_side, i_2M, 0), axis=1)  # first entry of this id and side
  # The k-th kv run of an id pairs with the k-th q run; `side - group` q runs precede it.
  k = i_2M - side
  matched = is_kv & (inv_s == 0) & (k < side - group)
  partner = jnp.take_along_axis(idx_s, jnp.minimum(group + k, 2 * m - 1), axis=1)
  rows_B1 = jnp.arange(b)[:, None]
  kv_partner_BM = jnp.full((b, m), -1, jnp.int32).at[
      rows_B1, jnp.where(is_kv, idx_s - m, m)].set(jnp.where(matched, partner, -1), mode="drop")

  # q runs keep their rank as slot; unpaired kv runs follow all q runs in kv order.
  kv_alone_BM = (slot_M < n_kv[:, None]) & (kv_partner_BM < 0)
  kv_slot_BM = jnp.where(kv_partner_BM >= 0, kv_partner_BM,
                          n_q[:, None] + jnp.cumsum(kv_alone_BM, axis=1, dtype=jnp.int32) - 1)
  kv_slot_BM = jnp.where(slot_M < n_kv[:, None], kv_slot_BM, m)  # junk runs: dropped
  # Exact unless a side has more than m runs; then matches past m are missed and this
  # over-counts, but stays >= that side's run count > m, so overflow is still reported.
  n_B = n_q + n_kv - jnp.sum(matched, axis=1, dtype=jnp.int32)

  used_BM = slot_M < n_B[:, None]
  empty_BM = jnp.where(used_BM, 0, -1).astype(jnp.int32)  # a used slot the side lacks: empty pair
  q_has = slot_M < n_q[:, None]
  q_seqlens = jnp.where(q_has, q_len, empty_BM)
  q_offsets = jnp.where(q_has, q_start, empty_BM)
  kv_seqlens = empty_BM.at[rows_B1, kv_slot_BM].set(kv_len, mode="drop")
  kv_offsets = empty_BM.at[rows_B1, kv_slot_BM].set(kv_start, mode="drop")
  return SeqlensOffsets(q_seqlens, _offsets(q_offsets), kv_seqlens, _offsets(kv_offsets), n_B)


def _offsets(start_BM):
  # cuDNN takes M + 1 offsets; JAX fills the last itself after packing rows, so it is -1.
  return jnp.pad(start_BM, ((0, 0), (0, 1)), constant_values=-1)
