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

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_mask_info as mask_info_lib,
)

from flaxattn.blocks import EMPTY, PARTIAL

# TPU scalar memory for one kernel's prefetched operands (1 MiB on v4 / v5: the limit in the
# "would exceed memory (size=1048576)" compile error MaxText met with splash at 1M tokens).
SMEM_BYTES = 1 << 20


def forward_info(blocks: np.ndarray, q_sequence) -> mask_info_lib.MaskInfo:
  """The forward MaskInfo of `blocks` (from `block_mask`, not all EMPTY): splash's shrunk
  grid, each query row's non-empty key blocks first, in order, padded with EMPTY / 0."""
  data_next, valid = _compact(np, blocks, int((blocks != EMPTY).sum(1).max()))
  shrunk = np.where(valid, np.take_along_axis(blocks, data_next, 1), EMPTY).astype(np.int32)
  return _info(shrunk, data_next, q_sequence)


def dkv_info(blocks: np.ndarray, q_shards: int, q_sequence) -> mask_info_lib.MaskInfo:
  """The dK/dV MaskInfo of `blocks` with query rows split over `q_shards` devices (grid not
  shrunk): per shard, walking key block by key block and down each one's query blocks,
  `data_next` holds the shard-local query block of the next non-empty block (wrapping to the
  shard's first; 0 for a shard with none)."""
  data_next, _ = _dkv_next(np, blocks, q_shards)
  return _info(blocks, data_next, q_sequence)


def _compact(xp, blocks, width: int):
  """`(data_next, valid)` `[..., nq, width]` int32 / bool: each row's non-empty key blocks
  first, in order, then 0 (not valid)."""
  nk = blocks.shape[-1]
  col = xp.arange(nk, dtype=np.int32)
  # Sorting puts each row's non-empty columns first, in order (empty ones shifted past them).
  first = xp.sort(xp.where(blocks != EMPTY, col, col + nk), axis=-1)[..., :width]
  valid = first < nk
  return xp.where(valid, first, 0).astype(np.int32), valid


def _dkv_next(xp, blocks, q_shards: int):
  """`(data_next, following)` `[nq, nk]` of the dK/dV walk (`dkv_info`): the shard-local query
  block of the next non-empty block, and that block's flat index in the walk of its shard
  (`[q_shards, nk * nq / q_shards]`, key block major)."""
  nq, nk = blocks.shape
  per = nq // q_shards
  walk = blocks.reshape(q_shards, per, nk).transpose(0, 2, 1).reshape(q_shards, nk * per)
  none = nk * per
  at = xp.where(walk != EMPTY, xp.arange(nk * per, dtype=np.int32), np.int32(none))
  following = (np.minimum.accumulate(at[:, ::-1], axis=1)[:, ::-1] if xp is np
               else jax.lax.cummin(at, axis=1, reverse=True))
  following = xp.where(following == none, following[:, :1], following)
  local = xp.where(following == none, 0, following % per).astype(np.int32)
  data_next = local.reshape(q_shards, nk, per).transpose(0, 2, 1).reshape(nq, nk)
  return data_next, xp.minimum(following, none - 1)


def _info(blocks, data_next, q_sequence) -> mask_info_lib.MaskInfo:
  # splash keeps these in scalar memory, in the smallest integer type that holds them
  small = mask_info_lib._downcast_to_small_type  # pylint: disable=protected-access
  return mask_info_lib.MaskInfo(data_next=small(data_next[None]), mask_next=None,
                                block_mask=small(blocks[None]), partial_mask_blocks=None,
                                q_sequence=q_sequence)


def device_infos(kinds, slots, partial_blocks: int) -> tuple[mask_info_lib.MaskInfo,
                                                              mask_info_lib.MaskInfo]:
  """The forward and dK/dV MaskInfos of a block map found on device, for one kernel call:
  `kinds` int `[H', nq, nk]` (`BlockKind`s, H' heads of their own or 1), the PARTIAL ones'
  masks at `slots` int32 `[H', nq, nk]` of `partial_blocks` materialized blocks, which the
  caller adds (`partial_mask_blocks`, `[partial_blocks, bq, bkv]` forward, transposed for
  dK/dV). As `forward_info` and `dkv_info` lay out a static map, but the forward grid keeps
  its width nk (each row's blocks first, then EMPTY): the widest row is known only at run
  time. Each EMPTY step's `mask_next` repeats the one a kernel last fetched or fetches next,
  so no mask block is copied for it: `slots` holds, at a block that is not PARTIAL, the
  slot of the last PARTIAL one before it in row-major order (the forward's)."""
  def one(kinds_NM, slots_NM):
    data_next, valid = _compact(jnp, kinds_NM, kinds_NM.shape[1])
    fwd_slots = jnp.where(valid, jnp.take_along_axis(slots_NM, data_next, 1), 0)
    fwd = (data_next, jnp.where(valid, jnp.take_along_axis(kinds_NM, data_next, 1), EMPTY),
           jax.lax.cummax(fwd_slots, axis=1))
    dkv_next, following = _dkv_next(jnp, kinds_NM, 1)
    # In the dK/dV walk (key block major): the last PARTIAL block's slot so far, at the
    # block each step fetches.
    walk_kinds, walk_slots = (x.T.reshape(1, -1) for x in (kinds_NM, slots_NM))
    at = jnp.arange(walk_kinds.size, dtype=jnp.int32)[None]
    last = jax.lax.cummax(jnp.where(walk_kinds == PARTIAL, at, 0), axis=1)
    carried = jnp.take_along_axis(walk_slots, last, 1)
    dkv_slots = jnp.take_along_axis(carried, following, 1).reshape(slots_NM.shape[::-1]).T
    return fwd, (dkv_next, kinds_NM, dkv_slots)

  fwd, dkv = jax.vmap(one)(kinds, slots)
  nq, nk = kinds.shape[1:]
  def info(data_next, block_mask, mask_next, rows_of_next: int):
    return mask_info_lib.MaskInfo(
        data_next=data_next.astype(_index_type(rows_of_next)), mask_next=mask_next.astype(
            _index_type(partial_blocks)), block_mask=block_mask.astype(np.int8),
        partial_mask_blocks=None, q_sequence=None)
  return info(*fwd, nk), info(*dkv, nq)


def _index_type(bound: int):
  """The smallest integer type of scalar memory for indices below `bound`, as splash's."""
  return np.int8 if bound <= 127 else np.int16 if bound <= 32767 else np.int32


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
