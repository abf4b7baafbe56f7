"""Splash's block metadata (`MaskInfo`) in closed form, in O(number of blocks).

JAX's `process_mask` evaluates the mask on every token pair of every block to classify it
(empty / partial / full). Here each block's rows and columns are at most two runs of
contiguous original indices (a load-balanced shard is two chunks), and a band mask (causal,
window, chunk) on two runs is classified exactly from their bounds; where blocks tile whole
segments of contiguous indices, each distinct pair of segments is classified once. The
arrays are those `process_mask` / `process_mask_dkv` produce for one mask shared by all
heads, one head shard, fused backward (the dK/dV grid unshrunk); partial blocks are masked
in the kernel by the mask function, so no block is ever materialized. Derivation:
docs/design.md (Splash).
"""

from __future__ import annotations

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_mask_info as mask_info_lib,
)

from flaxattn.masks import Band, floor_div

EMPTY, PARTIAL, FULL = 0, 1, 2  # splash's block_mask values
# TPU scalar memory for one kernel's prefetched operands (1 MiB on v4 / v5: the limit in the
# "would exceed memory (size=1048576)" compile error MaxText met with splash at 1M tokens).
SMEM_BYTES = 1 << 20


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


def forward_info(blocks: np.ndarray, q_sequence) -> mask_info_lib.MaskInfo:
  """The forward MaskInfo of `blocks` (from `block_mask`, not all EMPTY): splash's shrunk
  grid, each query row's non-empty key blocks first, in order, padded with EMPTY / 0."""
  nonempty = blocks != EMPTY
  col = np.arange(blocks.shape[1], dtype=np.int32)
  # Sorting puts each row's non-empty columns first, in order (empty ones shifted past them).
  first = np.sort(np.where(nonempty, col, col + blocks.shape[1]), axis=1)
  first = first[:, :nonempty.sum(1).max()]
  valid = first < blocks.shape[1]
  data_next = np.where(valid, first, 0).astype(np.int32)
  shrunk = np.where(valid, np.take_along_axis(blocks, data_next, 1), EMPTY).astype(np.int32)
  return _info(shrunk, data_next, q_sequence)


def dkv_info(blocks: np.ndarray, q_shards: int, q_sequence) -> mask_info_lib.MaskInfo:
  """The dK/dV MaskInfo of `blocks` with query rows split over `q_shards` devices (grid not
  shrunk): per shard, walking key block by key block and down each one's query blocks,
  `data_next` holds the shard-local query block of the next non-empty block (wrapping to the
  shard's first; 0 for a shard with none)."""
  nq, nk = blocks.shape
  per = nq // q_shards
  walk = blocks.reshape(q_shards, per, nk).transpose(0, 2, 1).reshape(q_shards, nk * per)
  none = nk * per
  at = np.where(walk != EMPTY, np.arange(nk * per, dtype=np.int32), np.int32(none))
  following = np.minimum.accumulate(at[:, ::-1], axis=1)[:, ::-1]
  following = np.where(following == none, following[:, :1], following)
  local = np.where(following == none, 0, following % per).astype(np.int32)
  data_next = local.reshape(q_shards, nk, per).transpose(0, 2, 1).reshape(nq, nk)
  return _info(blocks, data_next, q_sequence)


def _info(blocks, data_next, q_sequence) -> mask_info_lib.MaskInfo:
  # splash keeps these in scalar memory, in the smallest integer type that holds them
  small = mask_info_lib._downcast_to_small_type  # pylint: disable=protected-access
  return mask_info_lib.MaskInfo(data_next=small(data_next[None]), mask_next=None,
                                block_mask=small(blocks[None]), partial_mask_blocks=None,
                                q_sequence=q_sequence)


def smem_bytes(info: mask_info_lib.MaskInfo, q_shards: int) -> int:
  """Bytes of scalar memory one device's kernel holds for `info` (its query shard's rows of
  data_next, block_mask and mask_next, which splash prefetches whole)."""
  return sum(a.size * a.dtype.itemsize // q_shards
             for a in (info.data_next, info.block_mask, info.mask_next) if a is not None)


def smem_bound(q_rows: int, kv_len: int, bq: int, bkv: int) -> int:
  """Upper bound of `smem_bytes` for `q_rows` query tokens per device and `kv_len` keys: the
  unshrunk grid, one byte of block_mask and the smallest type that holds a block index."""
  q_blocks, kv_blocks = q_rows // bq, kv_len // bkv
  index = 1 if max(q_blocks, kv_blocks) <= 127 else 2 if max(q_blocks, kv_blocks) <= 32767 else 4
  return q_blocks * kv_blocks * (1 + index)
