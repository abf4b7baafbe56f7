"""Splash's block metadata: the `MaskInfo` arrays of a static block classification
(`flaxattn.blocks.block_mask`, in closed form, O(blocks)), and its scalar-memory sizing.

JAX's `process_mask` evaluates the mask on every token pair of every block to classify it;
here the classification comes from `blocks`, and this module lays it out as
`process_mask` / `process_mask_dkv` do for one mask shared by all heads, one head shard,
the dK/dV grid unshrunk (as the fused backward needs; the dK/dV kernel without dq reads it
too). Partial blocks are masked in the kernel by the
mask function, so no block is ever materialized. Derivation: docs/design.md (Splash).
"""

from __future__ import annotations

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_mask_info as mask_info_lib,
)

from flaxattn.blocks import EMPTY

# TPU scalar memory for one kernel's prefetched operands (1 MiB on v4 / v5: the limit in the
# "would exceed memory (size=1048576)" compile error MaxText met with splash at 1M tokens).
SMEM_BYTES = 1 << 20


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
