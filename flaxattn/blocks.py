"""Block sparsity for every kernel: which (query block, key block) pairs hold no allowed
pair (EMPTY), some (PARTIAL: masked inside the block), or only allowed pairs (FULL).

Two classifications, one enum:
  - static, from the token order alone (`TokenOrder`, `block_mask`, `per_device`): a band
    mask (a window of offsets k - q, a chunk) on original token indices, exact from each
    block's runs of contiguous indices in O(blocks); what kernels that mask on the token
    index (splash) build at trace time;
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

from flaxattn.layout import Layout, resolve
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
  `k_lo..k_hi` (original indices, inclusive runs, int64)? Exact, not conservative."""
  if normal.chunk is None:
    return _offsets_meet(normal, k_lo - q_hi, k_hi - q_lo)
  # Pairs of one chunk j: runs clipped to it. Chunks between the first and the last that
  # both runs reach are covered by both whole, so one of them stands for all.
  c = normal.chunk
  first = np.maximum(floor_div(q_lo, c), floor_div(k_lo, c))
  last = np.minimum(floor_div(q_hi, c), floor_div(k_hi, c))

  def in_chunk(j):
    start = j * c
    return _offsets_meet(normal, np.maximum(k_lo, start) - np.minimum(q_hi, start + c - 1),
                         np.minimum(k_hi, start + c - 1) - np.maximum(q_lo, start))
  some = ((first <= last) & (in_chunk(first)[0] | in_chunk(last)[0]
                             | ((last - first >= 2) & in_chunk(first + 1)[0])))
  chunks = [floor_div(x, c) for x in (q_lo, q_hi, k_lo, k_hi)]
  one_chunk = (chunks[0] == chunks[1]) & (chunks[1] == chunks[2]) & (chunks[2] == chunks[3])
  every = one_chunk & in_chunk(first)[1]
  return some, every


def _offsets_meet(normal: Band, d_lo, d_hi):
  """`(some, every)`: does the band's window of offsets meet / hold every offset in
  [d_lo, d_hi] (pairs of two runs take every offset between their extremes)?"""
  some = d_lo <= d_hi
  every = np.ones(np.shape(some), bool)
  if normal.lo is not None:
    some, every = some & (d_hi >= normal.lo), every & (d_lo >= normal.lo)
  if normal.hi is not None:
    some, every = some & (d_lo <= normal.hi), every & (d_hi <= normal.hi)
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


def schedule(mask: Mask, toks: Tokens, heads: int, bq: int, bk: int, by_head: bool = False):
  """The block schedule `[B, nq, nk]` of `mask` over `toks` (`block_schedule`, then
  `refine` for a mask with programmable parts), for `heads` query heads (with `by_head`
  each head's own, as `refine` gives it); a `Shared` mask's own map where `bind` found it
  built for this call and the blocks are multiples of it."""
  if isinstance(mask, Shared) and mask.bound and not by_head:
    kinds = mask.kinds_for(toks, bq, bk)
    if kinds is not None:
      return kinds
  kinds = block_schedule(jnp, mask, toks.q_seg, toks.kv_seg, toks.q_pos, toks.kv_pos, bq, bk)
  return refine(mask, kinds, toks, heads, bq, bk, by_head)


# Tile elements `refine` evaluates per step of its loops (a few MiB of bools): small tiles
# go several key blocks and query blocks at a time, so a map of 64-token blocks does not
# take a loop step per block.
REFINE_ELEMENTS = 1 << 22


def refine(mask: Mask, kinds, toks: Tokens, heads: int, bq: int, bk: int, by_head: bool = False):
  """`kinds` `[B, nq, nk]` (from `block_schedule`) made exact for a mask with programmable
  parts (`Mask.needs_tiles`): each block still PARTIAL is classified from the mask itself,
  evaluated on its `[heads, bq, bk]` tile (one head where the mask is the same for all) on
  device. Per query block only its range of open key blocks (`visit_bounds`) is evaluated,
  C key blocks a step, R query blocks side by side, C x R tiles within `REFINE_ELEMENTS`
  (`heads`: query heads, or KV heads where rows fold query heads, `Tokens.q_head`);
  the blocks the segments or the built-in parts rule out or fill keep their kinds. Memory:
  those tiles besides the schedule. Other masks: `kinds` as they are.
  `by_head`: `[B, H', nq, nk]`, each head's kinds (H' = `heads` where the mask differs
  between heads, else 1), for a kernel that masks each head with metadata of its own;
  else one kind for all heads (EMPTY or FULL where every head's is)."""
  if not mask.needs_tiles:
    return kinds[:, None] if by_head else kinds
  b, nq, nk = kinds.shape
  lo, hi = visit_bounds(jnp, kinds, axis=2)
  h_ = heads if mask.per_head else 1
  h = jnp.arange(h_, dtype=jnp.int32)[:, None, None]
  c = max(1, min(nk, REFINE_ELEMENTS // (h_ * bq * bk)))  # key blocks a step
  r = max(1, min(b * nq, REFINE_ELEMENTS // (h_ * bq * bk * c)))  # query blocks side by side

  def row(n):
    bi, i = n // nq, n % nq
    q = (i * bq, bq)
    q_seg = slice_tokens(toks.q_seg, bi, *q)[None, :, None]
    first, last = lo[bi, i], hi[bi, i]

    def tiles(step, kinds_HN):
      j = first + step * c
      start = jnp.minimum(j, nk - c)  # the last step's slice ends at nk
      kv = (start * bk, c * bk)
      ok = allowed(mask, toks.coords(bi, h, q, kv, (0, 2), (0, 1)), q_seg,
                   slice_tokens(toks.kv_seg, bi, *kv)[None, None, :])
      ok_HQCK = jnp.broadcast_to(ok, (h_, bq, c * bk)).reshape(h_, bq, c, bk)
      kind_HC = jnp.where(ok_HQCK.any((1, 3)), jnp.where(ok_HQCK.all((1, 3)), FULL, PARTIAL),
                          EMPTY)
      old_HC = jax.lax.dynamic_slice_in_dim(kinds_HN, start, c, axis=1)
      blocks_C = start + jnp.arange(c)
      new_HC = jnp.where((blocks_C >= j) & (blocks_C < last) & (old_HC == PARTIAL), kind_HC,
                         old_HC)
      return jax.lax.dynamic_update_slice_in_dim(kinds_HN, new_HC.astype(kinds.dtype), start, 1)
    return jax.lax.fori_loop(0, (last - first + c - 1) // c, tiles,
                             jnp.broadcast_to(kinds[bi, i], (h_, nk)))

  kinds_BHNM = jax.lax.map(row, jnp.arange(b * nq, dtype=jnp.int32), batch_size=r).reshape(
      b, nq, h_, nk).transpose(0, 2, 1, 3)
  if by_head:
    return kinds_BHNM
  return jnp.where((kinds_BHNM == EMPTY).all(1), EMPTY,
                   jnp.where((kinds_BHNM == FULL).all(1), FULL, PARTIAL)).astype(kinds.dtype)

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


def block_map(mask: Mask, q_len: int, kv_len: int | None = None, *, segment_ids=None,
              positions=None, kv_segment_ids=None, kv_positions=None, batch: int = 1,
              heads: int = 1, block_q: int = 512, block_kv: int = 512) -> jax.Array:
  """The block map of `mask` for a call of `q_len` queries and `kv_len` keys (default
  `q_len`) with these segment ids and positions (`[batch, T]`, None: the defaults), in
  blocks of `block_q` x `block_kv` tokens: int32 `[batch, nq, nk]` of `BlockKind` values,
  what a kernel with those blocks skips (EMPTY), masks (PARTIAL) or runs unmasked (FULL).
  Computed on device as kernels do (`schedule`): for a `flaxattn.MaskMod`, only the blocks
  the segments and built-in parts leave open are evaluated. Jit it to build it once and
  share it (`MaskMod` operands and ids are traced).

  Raises:
    ValueError / TypeError naming a malformed argument (as `flaxattn.attention`).
  """
  kv_len = q_len if kv_len is None else kv_len
  layout = resolve((batch, q_len), (batch, kv_len), segment_ids, positions, kv_segment_ids,
                   kv_positions)
  bq, bk = min(block_q, round_up(q_len, 8)), min(block_kv, round_up(kv_len, 8))
  toks = tokens(mask, layout, batch, round_up(q_len, bq), round_up(kv_len, bk), q_len, kv_len)
  return schedule(mask, toks, heads, bq, bk)


def counts(kinds) -> dict[str, int]:
  """How many blocks of a block map are EMPTY, PARTIAL and FULL (host ints)."""
  kinds = np.asarray(kinds)
  return {kind.name.lower(): int((kinds == kind).sum()) for kind in BlockKind}


def draw(kinds, path: str | None = None, *, title: str = "") -> str:
  """A picture of a block map `[nq, nk]` (or the first row of `[B, nq, nk]`): text, one
  character a block (' ' empty, '#' full, '+' partial), query blocks down, key blocks
  across; with `path`, also a PNG there (needs matplotlib: white empty, grey partial,
  black full). Returns the text."""
  kinds = np.asarray(kinds)
  kinds = kinds[0] if kinds.ndim == 3 else kinds
  marks = np.array([" ", "+", "#"])[kinds]
  text = "\n".join("|" + "".join(row) + "|" for row in marks)
  if path is not None:
    import matplotlib  # an optional dependency, for the picture only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 4 * kinds.shape[0] / max(kinds.shape[1], 1) + 0.4))
    ax.imshow(kinds, cmap="Greys", vmin=0, vmax=2, interpolation="nearest")
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("key block")
    ax.set_ylabel("query block")
    c = counts(kinds)
    ax.set_title(title or f"{c['empty']} empty, {c['partial']} partial, {c['full']} full",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
  return text


@dataclasses.dataclass(frozen=True, eq=False)
class Shared(Mask):
  """`mask` with its block map built once (`share`), for the calls that attend with the
  same ids: the layers of a model, which otherwise each build it (`refine`). A call uses
  the map where its segment ids and positions are the very arrays it was built from (the
  same values in the program: `bind`; no data is compared), it runs on one device, and
  its kernel's blocks are whole multiples of the map's; any other call builds its own, so
  the result is exact either way. Everything else is `mask`'s."""

  mask: Mask
  kinds: Any  # int32 [B, nq, nk] of BlockKind
  ids: tuple  # (q_segment_ids, kv_segment_ids, q_positions, kv_positions) it was built from
  block_q: int
  block_kv: int
  q_len: int  # the call's T and S it was built for
  kv_len: int
  bound: bool = False  # `bind` found the call's ids to be `ids`

  def allows(self, q_pos, k_pos):
    return self.mask.allows(q_pos, k_pos)

  def evaluate(self, coords: Coords):
    return self.mask.evaluate(coords)

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    return self.mask.block_kinds(q_lo, q_hi, k_lo, k_hi)

  @property
  def needs_tiles(self) -> bool:
    return self.mask.needs_tiles

  @property
  def per_head(self) -> bool:
    return self.mask.per_head

  @property
  def reads_index(self) -> bool:
    return self.mask.reads_index

  @property
  def is_causal(self) -> bool:
    return self.mask.is_causal

  def kinds_for(self, toks: Tokens, bq: int, bk: int):
    """The map in blocks of `bq` x `bk` for the call `bind` bound it to, padded as `toks`,
    or None where this map does not serve it."""
    if bq % self.block_q or bk % self.block_kv:
      return None
    b, nq, nk = self.kinds.shape
    fq, fk = bq // self.block_q, bk // self.block_kv
    tq, tk = toks.q_seg.shape[1] // bq, toks.kv_seg.shape[1] // bk
    # The padding past the map's end is EMPTY (segment 0).
    kinds = jnp.pad(self.kinds, ((0, 0), (0, tq * fq - nq), (0, tk * fk - nk)),
                    constant_values=EMPTY)
    return merge(kinds, fq, fk).astype(jnp.int32)

  def __repr__(self):
    return f"Shared({self.mask!r}, blocks {self.block_q} x {self.block_kv})"


jax.tree_util.register_dataclass(Shared, data_fields=["mask", "kinds", "ids"],
                                 meta_fields=["block_q", "block_kv", "q_len", "kv_len", "bound"])


def bind(mask: Mask, layout: Layout, q_shape, kv_shape, sharded: bool = False) -> Mask:
  """`mask` for a call of `layout` on q `[B, T, ...]` and k `[B, S, ...]`, before anything
  is traced again (inside a custom VJP every argument is a new value): a `Shared` mask whose
  map was built for this call's shapes from its very ids marked `bound`, any other `Shared`
  mask unwrapped (its map does not serve the call: other ids or lengths, or a call whose
  kernels see `sharded` pieces of it), other masks as they are."""
  if not isinstance(mask, Shared):
    return mask
  ids = (layout.q_segment_ids, layout.kv_segment_ids, layout.q_positions, layout.kv_positions)
  same = all(a is b for a, b in zip(ids, mask.ids, strict=True))
  shapes = (q_shape[0], q_shape[1], kv_shape[1]) == (mask.kinds.shape[0], mask.q_len,
                                                     mask.kv_len)
  if sharded or not (same and shapes) or layout.shards != 1 or layout.q_index is not None:
    return mask.mask
  return dataclasses.replace(mask, bound=True)


def share(mask: Mask, q_len: int, kv_len: int | None = None, *, segment_ids=None,
          positions=None, kv_segment_ids=None, kv_positions=None, batch: int = 1,
          heads: int = 1, block_q: int = 512, block_kv: int = 512) -> Shared:
  """`mask` with its block map built once (`block_map`, same arguments), for every call
  that passes these very `segment_ids` and `positions` arrays (`Shared`): build it in the
  step, before the layers, and pass it as each layer's mask. Blocks of `block_q` x
  `block_kv` serve kernels whose blocks are multiples of them (blockwise: 512; smaller
  map blocks serve more kernels, with a larger map).

    mask = flaxattn.blocks.share(flaxattn.MaskMod(prefix_lm, prefix_len), t, batch=b,
                                 segment_ids=seg, positions=pos, heads=h)
    for layer in layers:
      x = layer(x, mask=mask, segment_ids=seg, positions=pos)
  """
  kinds = block_map(mask, q_len, kv_len, segment_ids=segment_ids, positions=positions,
                    kv_segment_ids=kv_segment_ids, kv_positions=kv_positions, batch=batch,
                    heads=heads, block_q=block_q, block_kv=block_kv)
  kv_len = q_len if kv_len is None else kv_len
  kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
  kv_pos = positions if kv_positions is None and kv_len == q_len else kv_positions
  # The blocks `block_map` took (shorter sequences than a block take one block).
  bq, bk = min(block_q, round_up(q_len, 8)), min(block_kv, round_up(kv_len, 8))
  return Shared(mask, kinds, (segment_ids, kv_seg, positions, kv_pos), bq, bk, q_len, kv_len)
