"""Splash's block metadata in closed form (`flaxattn.splash_blocks`) equals, array for array and
dtype for dtype, what JAX's `process_mask` / `process_mask_dkv` build by evaluating the mask on
every token pair (today's construction), for every token order splash runs in: alone and under
Ulysses (one shard), each ring step (ring, Ulysses x ring, the window-aware ring), gathered
keys (all_gather), load balancing on and off, and every mask normal form."""

import dataclasses

import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_mask_info as mask_info_lib,
)

import flaxattn
from flaxattn import blocks, splash, splash_blocks
from flaxattn.masks import band

T = 1024
MASKS = [flaxattn.Full(), flaxattn.Causal(), flaxattn.Local(200), flaxattn.Chunked(256),
         flaxattn.Chunked(384) & flaxattn.Local(300), flaxattn.Chunked(128) & flaxattn.Local(64),
         flaxattn.Window(100, 50), flaxattn.Window(0, 300, offset=40),
         flaxattn.Window(None, 0, offset=-130), flaxattn.Chunked(256) & flaxattn.Window(50, 0, -20)]
ORDERS = ([blocks.TokenOrder()]
          + [blocks.TokenOrder(4, lb, step) for lb in (False, True) for step in (None, 0, 1, 2, 3)]
          + [blocks.TokenOrder(2, True, step) for step in (None, 0, 1)])


class _Evaluated(sm._ComputableMask):  # pylint: disable=protected-access
  """A splash mask evaluated per token pair on the host: `rule` on rows `q_sequence`."""

  def __init__(self, rule, shape, q_sequence):
    super().__init__(shape, rule)
    self.q_sequence = q_sequence

  __eq__, __hash__ = object.__eq__, object.__hash__


def _today(normal, order, kv_len, bq, bkv):
  """Splash's own MaskInfos (forward, dK/dV) for the mask the kernel evaluates."""
  mask_function = splash._mask_function(normal, (T, kv_len), order)
  if mask_function is None:
    one = sm.FullMask((T, kv_len))
  else:
    rows = np.arange(T)
    shard_len = T // order.shards
    q_sequence = order.original(rows // shard_len, rows % shard_len, shard_len).astype(np.int32)
    one = _Evaluated(mask_function, (T, kv_len), q_sequence)
  mask = sm.MultiHeadMask([one] * 2)
  dkv, _ = mask_info_lib.process_mask_dkv(mask, (bq, bkv), head_shards=1,
                                          q_seq_shards=order.shards, shrink_grid=False)
  if not dkv.block_mask.any():
    return None, dkv
  fwd, _ = mask_info_lib.process_mask(mask, (bq, bkv), head_shards=1, q_seq_shards=1)
  return fwd, dkv


def _assert_same(got, want, what):
  for field in want._fields:
    a, b = getattr(got, field), getattr(want, field)
    assert (a is None) == (b is None), (what, field, a, b)
    if b is not None:
      a = np.asarray(a)
      assert (a.dtype, a.shape) == (b.dtype, b.shape), (what, field)
      np.testing.assert_array_equal(a, b, err_msg=f"{what} {field}")


@pytest.mark.parametrize("order", ORDERS, ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_closed_form_metadata_equals_per_pair_evaluation(mask, order):
  normal = band(mask)
  kv_len = T if order.step is None else T // order.shards
  sizes = [(128, 128), (256, 128), (128, 256)]  # (256, x) under 2 x 2 balanced shards: a
  for bq, bkv in sizes:                          # block crosses its shard's two chunks
    kernel = splash._kernel.__wrapped__(normal, order, T, kv_len, 2, bq, bkv, True)  # uncached
    fwd, dkv = _today(normal, order, kv_len, bq, bkv)
    if kernel is None:
      assert fwd is None, "an empty step has no kernel"
      continue
    partial = bool((dkv.block_mask == blocks.PARTIAL).any())
    assert (kernel_of(kernel).kwargs["mask_function"] is None) == (
      not partial or splash._mask_function(normal, (T, kv_len), order) is None)
    if not partial:  # no block evaluates the mask: no mask function, no row indices
      fwd, dkv = fwd._replace(q_sequence=None), dkv._replace(q_sequence=None)
    got_fwd, got_dkv = _infos(kernel)
    _assert_same(got_fwd, fwd, ("fwd", bq, bkv))
    _assert_same(got_dkv, dkv, ("dkv", bq, bkv))
    if isinstance(kernel, splash.ShardedKernel):
      _assert_each_device_picks_its_rows(kernel, got_fwd, got_dkv)


def kernel_of(kernel):
  return kernel.kernel if isinstance(kernel, splash.ShardedKernel) else kernel


def _infos(kernel):
  """(forward, dK/dV) mask infos in splash's own layout, every device's rows."""
  if isinstance(kernel, splash.ShardedKernel):
    return kernel.whole()
  return kernel.fwd_mask_info, kernel.dkv_mask_info


def _assert_each_device_picks_its_rows(kernel, fwd, dkv):
  """`ShardedKernel.local()` on device r (its `which` entry) gives device r's rows of the
  whole arrays; the distinct devices' rows are held once."""
  rows = kernel.rows
  assert kernel.patterns == len(set(kernel.which.tolist())) <= len(kernel.which)
  for r, p in enumerate(kernel.which):
    local = dataclasses.replace(kernel, which=np.array([p], np.int32)).local()
    for got, whole in ((local.fwd_mask_info, fwd), (local.dkv_mask_info, dkv)):
      for field in ("data_next", "block_mask"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got, field)), getattr(whole, field)[:, r * rows:(r + 1) * rows])


def test_metadata_that_cannot_fit_scalar_memory_raises_naming_block_sizes():
  """128K tokens on one device with 128-blocks: 1024 x 1024 blocks of metadata (3 MiB) cannot
  fit TPU scalar memory; the error names blocks that fit, and those build. Interpret mode
  (no scalar memory) is not limited."""
  t, causal = 131072, band(flaxattn.Causal())
  with pytest.raises(ValueError, match=r"block_q=128, block_kv=128 needs 3145728 bytes of TPU"
                     r" scalar memory.*Splash\(block_q=256, block_kv=256\)"):
    splash._kernel.__wrapped__(causal, blocks.TokenOrder(), t, t, 2, 128, 128, False)
  kernel = splash._kernel.__wrapped__(causal, blocks.TokenOrder(), t, t, 2, 256, 256, False)
  infos = _infos(kernel)
  assert max(splash_blocks.smem_bytes(i, 1) for i in infos) == 512 * 512 * 3
  interpreted = splash._kernel.__wrapped__(causal, blocks.TokenOrder(), t, t, 2, 128, 128, True)
  assert interpreted is not None
