"""Block sparsity for every kernel: which (query block, key block) pairs hold no allowed
pair (EMPTY), some (PARTIAL: masked inside the block), or only allowed pairs (FULL).

Two classifications, one enum:
  - static, from the token order alone (`TokenOrder`, `block_mask`, `per_device`): a band
    mask (causal, window, chunk) on original token indices, exact from each block's runs
    of contiguous indices in O(blocks); what kernels that mask on the token index (splash)
    build at trace time;
  - run-time, from segment ids and positions (`block_schedule`, `visit_bounds`,
    `visit_order`, `schedule`): each block's ranges of ids and positions, in the program;
    what kernels that mask on the data (blockwise, pallas_gpu) loop over.
Derivations: docs/design.md (Splash; Blockwise).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxattn.layout import Layout
from flaxattn.masks import Band, Coords, Mask, allowed, floor_div


class BlockKind(enum.IntEnum):
  """What a (query block, key block) pair needs; the values are splash's `block_mask`'s."""

  EMPTY = 0  # no allowed pair: never loaded
  PARTIAL = 1  # some allowed pairs: computed with the mask
  FULL = 2  # every pair allowed: computed without a mask


EMPTY, PARTIAL, FULL = BlockKind.EMPTY, BlockKind.PARTIAL, BlockKind.FULL


def skip_block(n, carry):
  """The EMPTY branch of `by_kind`: nothing of block n is loaded, the carry passes."""
  return carry


def by_kind(update):
  """The `lax.switch` branches of a kernel's loop over blocks, indexed by `BlockKind`:
  EMPTY `skip_block`, PARTIAL `update(True, n, carry)` (masked), FULL
  `update(False, n, carry)`."""
  by = {EMPTY: skip_block, PARTIAL: functools.partial(update, True),
        FULL: functools.partial(update, False)}
  return [by[kind] for kind in sorted(by)]


@dataclasses.dataclass(frozen=True)
class TokenOrder:
  """Where a kernel's rows and columns sit in the original sequence.

  The sequence (T tokens) is split over `shards` devices of `T / shards` tokens each, in
  `flaxattn.load_balance` order when `load_balance`. Rows are the queries of all shards,
  in shard order. Columns are the keys of one shard, the one device r receives at ring
  step `step` (shard r - step), or, with `step=None`, all shards in shard order (gathered).
  """

  shards: int = 1
  load_balance: bool = False
  step: int | None = None

  def original(self, shard, local, shard_len: int):
    """Original index of token `local` of shard `shard` (numpy or jax integers)."""
    if not self.load_balance:
      return shard * shard_len + local
    chunk_len = shard_len // 2
    second = floor_div(local, chunk_len)  # 0: chunk `shard`, 1: chunk 2n-1-shard
    chunk = shard + second * (2 * self.shards - 1 - 2 * shard)
    return chunk * chunk_len + local - second * chunk_len

  def shard_of(self, index, shard_len: int):
    """The shard holding the token of original index `index`."""
    if not self.load_balance:
      return floor_div(index, shard_len)
    chunk = floor_div(index, shard_len // 2)
    return chunk + floor_div(chunk, self.shards) * (2 * self.shards - 1 - 2 * chunk)

  def key_original(self, q_index, col, shard_len: int):
    """Original index of key column `col` for a query of original index `q_index`.

    Called on a block's `[bq, 1]` query and `[1, bkv]` column indices: the arithmetic is
    arranged so that as much as possible stays on one of the two vectors (the host visits
    every block of T x T when the kernel is built)."""
    if self.step is None:
      shard = floor_div(col, shard_len)
      return self.original(shard, col - shard * shard_len, shard_len)
    source = self.shard_of(q_index, shard_len) + (self.shards - self.step)
    source = source - self.shards * floor_div(source, self.shards)  # mod
    if not self.load_balance:
      return source * shard_len + col
    chunk_len = shard_len // 2
    second = floor_div(col, chunk_len)
    first_start = source * chunk_len
    second_start = (2 * self.shards - 1 - source) * chunk_len
    return first_start + second * (second_start - first_start) + (col - second * chunk_len)



def _runs(order, shard, lo, length: int, shard_len: int):
  """Original-index runs `(first, last, valid)` of local tokens `lo .. lo + length - 1` of
  `shard` (int arrays of one shape): one run, or two where a load-balanced shard's block
  crosses from its first chunk into its second."""
  shard, lo = np.broadcast_arrays(shard, lo)
  hi = lo + length - 1
  if not order.load_balance:
    return [(order.original(shard, lo, shard_len), order.original(shard, hi, shard_len),
             np.ones(lo.shape, bool))]
  half = shard_len // 2
  runs = []
  for a, b, valid in ((lo, np.minimum(hi, half - 1), lo < half),
                      (np.maximum(lo, half), hi, hi >= half)):
    runs.append((order.original(shard, a, shard_len), order.original(shard, b, shard_len), valid))
  return runs


def _pair_kinds(normal: Band, q_lo, q_hi, k_lo, k_hi):
  """`(some, every)`: does the mask allow some / every pair of queries `q_lo..q_hi` and keys
  `k_lo..k_hi` (original indices, inclusive runs)? Exact, not conservative."""
  if not normal.causal:
    true = np.ones(np.broadcast_shapes(np.shape(q_lo), np.shape(k_lo)), bool)
    return true, true
  # Some pair: the keys start at or before the last query, and either the runs overlap (the
  # diagonal q == k is allowed) or the closest pair (q_lo, k_hi) is allowed.
  some, every = k_lo <= q_hi, k_hi <= q_lo
  if normal.window is not None:
    some = some & (k_hi > q_lo - normal.window)
    every = every & (k_lo > q_hi - normal.window)  # the farthest pair (q_hi, k_lo)
  if normal.chunk is not None:
    c = normal.chunk
    some = some & ((k_hi >= q_lo) | (floor_div(k_hi, c) == floor_div(q_lo, c)))
    every = every & (floor_div(k_lo, c) == floor_div(q_hi, c))
  return some, every


def block_mask(normal: Band, order, q_len: int, kv_len: int, bq: int, bkv: int) -> np.ndarray:
  """int32 `[q_len / bq, kv_len / bkv]`: EMPTY, PARTIAL or FULL for every (query block, key
  block) of a kernel whose rows and columns are in `order` (a `splash.TokenOrder`).
  Query blocks lie inside one shard (`bq` divides `q_len / order.shards`); so do key blocks."""
  shard_len = q_len // order.shards
  segment = shard_len // 2 if order.load_balance else shard_len
  if segment % bq or segment % bkv:  # blocks cross a load-balanced shard's two chunks
    return _block_mask_by_runs(normal, order, q_len, kv_len, bq, bkv)
  # Blocks tile segments of contiguous original indices (a shard, or a balanced shard's
  # chunk). A band mask on a pair of segments depends only on their offset (and on the
  # alignment to the chunk size), so each distinct pair is classified once and copied.
  def starts(shard):
    if not order.load_balance:
      return [order.original(shard, 0, shard_len)]
    return [order.original(shard, 0, shard_len), order.original(shard, segment, shard_len)]
  q_blocks, kv_blocks = segment // bq, segment // bkv
  period = normal.chunk or 1
  blocks = np.empty((q_len // bq, kv_len // bkv), np.int32)
  pairs = {}
  for shard in range(order.shards):
    if order.step is None:
      keys = [k for s in range(kv_len // shard_len) for k in starts(s)]
    else:
      keys = starts((shard - order.step) % order.shards)
    for i, q_start in enumerate(starts(shard)):
      row = (shard * len(starts(shard)) + i) * q_blocks
      for j, k_start in enumerate(keys):
        key = (q_start % period, k_start - q_start)
        if key not in pairs:
          pairs[key] = _segment_pair(normal, key[0], key[0] + key[1], segment, bq, bkv)
        blocks[row:row + q_blocks, j * kv_blocks:(j + 1) * kv_blocks] = pairs[key]
  return blocks


def _segment_pair(normal: Band, q_start: int, k_start: int, length: int, bq: int, bkv: int):
  """Block kinds of queries `q_start ..` against keys `k_start ..`, `length` each."""
  q_lo = q_start + np.arange(length // bq, dtype=np.int64)[:, None] * bq
  k_lo = k_start + np.arange(length // bkv, dtype=np.int64)[None] * bkv
  some, every = _pair_kinds(normal, q_lo, q_lo + bq - 1, k_lo, k_lo + bkv - 1)
  return np.where(some, np.where(every, FULL, PARTIAL), EMPTY)


def _block_mask_by_runs(normal: Band, order, q_len: int, kv_len: int, bq: int,
                        bkv: int) -> np.ndarray:
  """`block_mask` where a block may cover two runs (every block classified on its own)."""
  shard_len = q_len // order.shards
  rows = np.arange(q_len // bq, dtype=np.int64) * bq
  q_shard = rows // shard_len
  q_runs = [(a[:, None], b[:, None], v[:, None])
            for a, b, v in _runs(order, q_shard, rows % shard_len, bq, shard_len)]
  cols = np.arange(kv_len // bkv, dtype=np.int64) * bkv
  if order.step is None:  # every shard's keys, in shard order
    k_runs = [(a[None], b[None], v[None])
              for a, b, v in _runs(order, cols // shard_len, cols % shard_len, bkv, shard_len)]
  else:  # the keys of shard (r - step) mod shards, for the queries of shard r
    source = (q_shard - order.step) % order.shards
    k_runs = [(a[source], b[source], v[source]) for a, b, v in
              _runs(order, np.arange(order.shards)[:, None], cols[None], bkv, shard_len)]
  some = np.zeros((len(rows), len(cols)), bool)
  every = np.ones((len(rows), len(cols)), bool)
  for q_lo, q_hi, q_valid in q_runs:
    for k_lo, k_hi, k_valid in k_runs:
      s, e = _pair_kinds(normal, q_lo, q_hi, k_lo, k_hi)
      valid = q_valid & k_valid
      some |= valid & s
      every &= ~valid | e
  return np.where(some, np.where(every, FULL, PARTIAL), EMPTY).astype(np.int32)


def per_device(blocks: np.ndarray, shards: int) -> tuple[np.ndarray, np.ndarray]:
  """`(patterns [P * rows, kv_blocks], which [shards] int32)`: the distinct rows of `blocks`
  that one device of `shards` holds (`rows` query blocks each, in first-seen order), and
  which of them device r holds. A ring step's devices see the same few relations between
  their shards and the visiting one (a causal balanced ring step: at most 2 at any cp), so a program
  holds P copies where splash's `process_mask` holds `shards`."""
  per = blocks.reshape(shards, -1, blocks.shape[1])
  seen: dict[bytes, int] = {}
  which = np.array([seen.setdefault(device.tobytes(), len(seen)) for device in per], np.int32)
  first = np.unique(which, return_index=True)[1]
  return per[first].reshape(-1, blocks.shape[1]), which


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def pad_axis1(x, length: int, value: float = 0):
  pad = length - x.shape[1]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def block_ranges(xp, seg, pos, block: int):
  """Per-block bounds over non-padding tokens: (seg_lo, seg_hi, pos_lo, pos_hi, dense).

  seg/pos: `[B, L]` with L a multiple of `block`. Returns `[B, L // block]` arrays;
  `dense` is True where the block has no padding token.
  """
  b, length = seg.shape
  seg = seg.reshape(b, length // block, block)
  pos = pos.reshape(b, length // block, block)
  real = seg != 0
  big = np.int32(np.iinfo(np.int32).max)
  def lo(x):
    return xp.where(real, x, big).min(-1)

  def hi(x):
    return xp.where(real, x, -big).max(-1)
  return lo(seg), hi(seg), lo(pos), hi(pos), real.all(-1)


def block_schedule(xp, mask: Mask, q_seg, kv_seg, q_pos, kv_pos, bq: int, bk: int):
  """The run-time block schedule `[B, nq, nk]` int32 of `BlockKind`s (numpy or jax by
  `xp`) of query blocks of `bq` tokens against key blocks of `bk`, from segment ids and
  positions `[B, L]` (L a multiple of the block): EMPTY where no query sees a key (other
  documents, padding, or the mask's band), FULL where one document fills both blocks and
  the band covers every pair, else PARTIAL."""
  qs_lo, qs_hi, qp_lo, qp_hi, q_dense = (x[:, :, None]
                                         for x in block_ranges(xp, q_seg, q_pos, bq))
  ks_lo, ks_hi, kp_lo, kp_hi, k_dense = (x[:, None, :]
                                         for x in block_ranges(xp, kv_seg, kv_pos, bk))
  # An all-padding block has lo > hi, so the overlap test below rules it out.
  segs_overlap = (qs_lo <= ks_hi) & (ks_lo <= qs_hi)
  one_doc = (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo) & q_dense & k_dense
  mask_skip, mask_full = mask.block_kinds(qp_lo, qp_hi, kp_lo, kp_hi)
  skip = ~segs_overlap | mask_skip
  full = one_doc & mask_full
  return xp.where(skip, EMPTY, xp.where(full, FULL, PARTIAL)).astype(np.int32)


def visit_bounds(xp, kinds, axis: int):
  """First and one-past-last non-EMPTY block along `axis` (0, 0 when all are EMPTY): the
  range a kernel loops over (per query block its key blocks: axis 2 of `[B, nq, nk]`; per
  key block its query blocks: axis 1)."""
  live = kinds != EMPTY
  n = kinds.shape[axis]
  any_live = live.any(axis)
  first = xp.argmax(live, axis=axis)
  last = n - xp.argmax(xp.flip(live, axis=axis), axis=axis)
  zero = xp.zeros_like(first)
  return (xp.where(any_live, first, zero).astype(np.int32),
          xp.where(any_live, last, zero).astype(np.int32))


def visit_order(xp, kinds, axis: int):
  """The blocks along `axis` that each block of the other axis visits, for a kernel that
  runs two loops with no branch inside (a compiler software-pipelines such a loop's reads
  ahead of its matmuls, as Triton does; a branch per block stops it): `order` `[B, n, m]`,
  the FULL blocks first, then the PARTIAL ones, each ascending, the EMPTY ones last and
  never visited (int16 where m fits), and how many FULL and how many PARTIAL (`[B, n]`
  int32 each). Axis 2 of `[B, nq, nk]`: per query block its key blocks; axis 1: per key
  block its query blocks."""
  if axis == 1:
    kinds = kinds.transpose(0, 2, 1)
  rank = xp.where(kinds == FULL, 0, xp.where(kinds == PARTIAL, 1, 2)).astype(np.int8)
  index = np.int16 if kinds.shape[-1] <= np.iinfo(np.int16).max else np.int32
  order = xp.argsort(rank, axis=-1, stable=True).astype(index)
  return (order, (rank == 0).sum(-1).astype(np.int32), (rank == 1).sum(-1).astype(np.int32))


@dataclasses.dataclass(frozen=True)
class Tokens:
  """A kernel's per-token arrays, padded to whole blocks (padding as segment 0): segment ids
  and positions of queries `[B, Tp]` and keys `[B, Sp]`, and where a programmable mask or
  score reads them, token indices (`flaxattn.masks.Coords`; else None) and the global index
  of the first batch row and query head (`Layout.offsets`). Where a kernel's query rows fold
  the `groups` query heads of a KV head (`flaxattn.rows`), the query arrays are per row and
  `q_head` gives each row's query head among its KV head's (with the token indices)."""

  q_seg: Any
  kv_seg: Any
  q_pos: Any
  kv_pos: Any
  q_index: Any = None
  kv_index: Any = None
  row_offset: Any = 0
  head_offset: Any = 0
  q_head: Any = None
  groups: int = 1

  def coords(self, b, h, q: tuple, kv: tuple, q_axes, kv_axes) -> Coords:
    """`Coords` of a tile: row `b` (local), heads `h` (local, broadcasting: query heads, or
    KV heads where rows fold query heads), the `q = (start, size)` query tokens (rows) and
    `kv = (start, size)` keys of the padded axes, placed on axes `q_axes` / `kv_axes` of
    the tile (`jnp.expand_dims` axes, e.g. (0, 2, 3))."""
    def side(x, at, axes):
      return None if x is None else jnp.expand_dims(slice_tokens(x, b, *at), axes)
    if self.q_head is not None:
      h = h * self.groups + side(self.q_head, q, q_axes)
    return Coords(b + self.row_offset, h + self.head_offset,
                  side(self.q_index, q, q_axes), side(self.kv_index, kv, kv_axes),
                  side(self.q_pos, q, q_axes), side(self.kv_pos, kv, kv_axes))


jax.tree_util.register_dataclass(
    Tokens, data_fields=[f.name for f in dataclasses.fields(Tokens) if f.name != "groups"],
    meta_fields=["groups"])


def slice_tokens(x_BL, b, start, size: int):
  """`x_BL[b, start:start + size]` for traced `b` and `start`, as a dynamic slice."""
  b, start = (jnp.asarray(i, jnp.int32) for i in (b, start))
  return jax.lax.dynamic_slice(x_BL, (b, start), (1, size))[0]


def tokens(mask: Mask, layout: Layout, b, t_pad, s_pad, t, s, reads_index: bool = False) -> Tokens:
  """A call's `Tokens`, computed in the program, for the default layout too: a schedule
  built from ids known at trace time would be a constant of O(T^2 / (bq x bk)) entries
  inside the program (32 MiB of program text for a causal T = 512K forward and backward).
  Token indices where `mask` or a score mod (`reads_index`) reads them."""
  def default_arrays(length, padded):
    seg = jnp.broadcast_to((jnp.arange(padded) < length).astype(np.int32), (b, padded))
    pos = jnp.broadcast_to(jnp.arange(padded, dtype=np.int32), (b, padded))
    return seg, pos

  if layout.is_default:
    q_seg, q_pos = default_arrays(t, t_pad)
    kv_seg, kv_pos = default_arrays(s, s_pad)
  else:
    full = layout.materialize(b, t, s)
    q_seg, kv_seg, q_pos, kv_pos = (
        pad_axis1(x, n) for x, n in ((full.q_segment_ids, t_pad), (full.kv_segment_ids, s_pad),
                                     (full.q_positions, t_pad), (full.kv_positions, s_pad)))
  index = (None, None)
  if reads_index or mask.reads_index:
    q_index, kv_index = layout.indices(b, t, s)
    index = (pad_axis1(q_index, t_pad), pad_axis1(kv_index, s_pad))
  row, head = (jnp.asarray(x, jnp.int32) for x in layout.offsets())
  return Tokens(q_seg, kv_seg, q_pos, kv_pos, *index, row, head)


def schedule(mask: Mask, toks: Tokens, heads: int, bq: int, bk: int):
  """The block schedule `[B, nq, nk]` of `mask` over `toks` (`block_schedule`, then
  `refine` for a mask with programmable parts), for `heads` query heads."""
  kinds = block_schedule(jnp, mask, toks.q_seg, toks.kv_seg, toks.q_pos, toks.kv_pos, bq, bk)
  return refine(mask, kinds, toks, heads, bq, bk)


def refine(mask: Mask, kinds, toks: Tokens, heads: int, bq: int, bk: int):
  """`kinds` `[B, nq, nk]` (from `block_schedule`) made exact for a mask with programmable
  parts (`Mask.needs_tiles`): each block still PARTIAL is classified from the mask itself,
  evaluated on its `[heads, bq, bk]` tile (one head where the mask is the same for all) on
  device; blocks the segments or the built-in parts rule out or fill are never evaluated.
  `heads`: query heads, or KV heads where rows fold query heads (`Tokens.q_head`).
  Memory: one tile at a time besides the schedule. Other masks: `kinds` as they are."""
  if not mask.needs_tiles:
    return kinds
  b, nq, nk = kinds.shape
  lo, hi = visit_bounds(jnp, kinds, axis=2)
  h = jnp.arange(heads if mask.per_head else 1, dtype=jnp.int32)[:, None, None]

  def row(n):
    bi, i = n // nq, n % nq
    q = (i * bq, bq)
    q_seg = slice_tokens(toks.q_seg, bi, *q)[None, :, None]

    def tile(j, kinds_N):
      kv = (j * bk, bk)
      ok = allowed(mask, toks.coords(bi, h, q, kv, (0, 2), (0, 1)), q_seg,
                   slice_tokens(toks.kv_seg, bi, *kv)[None, None, :])
      kind = jnp.where(ok.any(), jnp.where(ok.all(), FULL, PARTIAL), EMPTY).astype(kinds.dtype)
      return kinds_N.at[j].set(jnp.where(kinds_N[j] == PARTIAL, kind, kinds_N[j]))
    return jax.lax.fori_loop(lo[bi, i], hi[bi, i], tile, kinds[bi, i])

  return jax.lax.map(row, jnp.arange(b * nq, dtype=jnp.int32)).reshape(b, nq, nk)


def merge(kinds, rows: int, cols: int):
  """`kinds` `[B, nq, nk]` with each `rows` x `cols` blocks merged into one: EMPTY where all
  of them are, FULL where all are, else PARTIAL (exact: a merged block's pairs are its
  parts'). How kernels whose passes use different blocks read one block map."""
  if rows == cols == 1:
    return kinds
  b, nq, nk = kinds.shape
  parts = kinds.reshape(b, nq // rows, rows, nk // cols, cols)
  empty, full = ((parts == kind).all((2, 4)) for kind in (EMPTY, FULL))
  return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(kinds.dtype)
