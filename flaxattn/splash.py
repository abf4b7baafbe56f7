"""Splash attention (JAX's Pallas TPU kernel): the `splash` kernel.

Owns lazy splash masks built from a mask's normal form (never a `NumpyMask`) on the
`blocks.TokenOrder` that maps context-parallel shards back to original token indices, GQA through
the MQA kernel, the lse and gradients with its cotangent, and the run-time check that index
masking is exact for a batch (else the blockwise kernel runs it). A mask without a normal
form (a `MaskMod`, `|`, `~`) runs on a block map found on device per call (`BlockMap`), the
masks of its partial blocks built there (`MapPasses`; never on the host). Off TPU it runs in
Pallas interpret mode. Derivations: docs/design.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jax.experimental.pallas.ops.tpu.splash_attention import (
  splash_attention_mask_info as mask_info_lib,
)
from jax.sharding import PartitionSpec as P

from flaxattn import blocks, blockwise, checked, checks, registry, sharding, splash_blocks
from flaxattn.blocks import TokenOrder
from flaxattn.layout import Layout, index_check, needs_index_check
from flaxattn.masks import Band, Mask, NoBand, allowed, band
from flaxattn.ring import RingStep

LANES = 128  # splash's blocks are multiples of the TPU lane width
# Rows whose lse is below this saw no key: splash leaves them at its mask value (finite
# garbage, or NaN when every block was skipped). Real lse values are nowhere near.
_EMPTY_LSE = sk.DEFAULT_MASK_VALUE / 2
# Stands in for lse = -inf in the backward pass: exp(score - this) = 0 for every score.
_NO_KEYS_LSE = 1e30
# Bytes the fused backward's dq partials may take per kernel call (`Splash.fused_dq_budget`).
# A judgment, as the speed trade-off can only be timed on a TPU: a quarter GiB is under 2% of
# the smallest TPU HBM (v5e, 16 GiB), so the fused kernel never decides whether a model fits,
# and it keeps the fused backward up to T = 4096 with 16 heads of 128 (128 MiB in bf16).
FUSED_DQ_BUDGET = 256 << 20

@dataclasses.dataclass(frozen=True)
class _OrderedRule:
  """The mask function of a kernel whose rows and columns are in `order`: the mask's own rule
  on original indices (numpy on the host, jax inside the kernel). Hashable, and holds no
  per-token state: one exists per ring step."""

  normal: Band
  order: TokenOrder
  shard_len: int

  def __call__(self, q_index, col):
    return self.normal.mask.allows(q_index, self.order.key_original(q_index, col, self.shard_len))


def _mask_function(normal: Band, shape: tuple[int, int], order: TokenOrder):
  """What splash evaluates inside partial blocks, on (original query index, key column);
  None for Full (no partial blocks)."""
  if normal == Band():
    return None
  if order.shards > 1 or normal.chunk is not None:
    # Our rule on original indices (splash's own chunked mask divides with an op Mosaic
    # cannot lower for TPU from another host).
    return _OrderedRule(normal, order, shape[0] // order.shards)
  if normal == Band(hi=0):
    return sm.CausalMask(shape).mask_function
  # Splash's window: q + offset - left <= k <= q + offset + right, sizes >= 0, so the offset
  # is the one of the band nearest 0. A side beyond the sequence bounds nothing: dropped, so
  # the sums of indices stay far from int32's limits (a band that allows nothing in the
  # sequence has no kernel).
  lo = None if normal.lo is None or normal.lo <= 1 - shape[0] else normal.lo
  hi = None if normal.hi is None or normal.hi >= shape[1] - 1 else normal.hi
  offset = lo if lo is not None and lo > 0 else hi if hi is not None and hi < 0 else 0
  return sm.LocalMask(shape, window_size=(None if lo is None else offset - lo,
                                          None if hi is None else hi - offset),
                      offset=offset).mask_function


def block_size(length: int, requested: int) -> int:
  """The largest multiple of 128 that is at most `requested` and divides `length`."""
  for b in range(min(requested, length) // LANES * LANES, 0, -LANES):
    if length % b == 0:
      return b
  raise ValueError(f"splash needs a block size that is a multiple of {LANES}, at most"
                   f" {requested} and dividing the sequence length {length}; none exists.")


def default_block(head_dim: int) -> int:
  """Block edge for a head dimension: 512 up to D = 128, smaller for wider heads so that
  a block's q, k, v and accumulator tiles stay within the same on-chip memory."""
  return max(LANES, 512 * 128 // max(head_dim, 128) // LANES * LANES)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kernel", "which"],
                   meta_fields=["rows"])
@dataclasses.dataclass(frozen=True)
class ShardedKernel:
  """A splash kernel whose queries are split over devices, holding each distinct device's
  block metadata once (`blocks.per_device`): the mask infos' block rows are `rows`
  per distinct device, `which[r]` names device r's, and `q_sequence` is the whole sequence's
  (sharded with the queries). Splash's own layout holds every device's rows: at cp=128 and
  10M tokens, 128 ring steps x 128 devices of them."""

  kernel: sk.SplashAttentionKernel  # forward, dK/dV mask infos (the dQ kernel reads the forward)
  which: Any  # [shards] int32 (device r's rows); a PartitionSpec in `specs()`
  rows: int  # query blocks per device

  @property
  def patterns(self) -> int:
    """The number of distinct devices' rows held."""
    return int(np.max(self.which)) + 1

  def specs(self, axis: str) -> ShardedKernel:
    """shard_map specs: the distinct metadata replicated, `which` and `q_sequence` over `axis`."""
    def spec(path, leaf):
      return P(axis) if path[-1].name == "q_sequence" else P()
    return ShardedKernel(jax.tree_util.tree_map_with_path(spec, self.kernel), P(axis), self.rows)

  def infos(self) -> tuple[mask_info_lib.MaskInfo, mask_info_lib.MaskInfo]:
    fwd, dkv = self.kernel.fwd_mask_info, self.kernel.dkv_mask_info
    assert dkv is not None
    return fwd, dkv

  def local(self) -> sk.SplashAttentionKernel:
    """Inside the shard_map: this device's kernel (its block rows picked by its `which`)."""
    start = self.which[0] * self.rows
    def pick(info: mask_info_lib.MaskInfo) -> mask_info_lib.MaskInfo:
      return info._replace(**{
          f: jax.lax.dynamic_slice_in_dim(getattr(info, f), start, self.rows, axis=1)
          for f in ("data_next", "block_mask")})
    fwd, dkv = self.infos()
    return sk.SplashAttentionKernel(pick(fwd), None, pick(dkv), **self.kernel.kwargs)

  def whole(self) -> tuple[mask_info_lib.MaskInfo, mask_info_lib.MaskInfo]:
    """The (forward, dK/dV) mask infos over all devices, in splash's own layout (numpy)."""
    def expand(info: mask_info_lib.MaskInfo) -> mask_info_lib.MaskInfo:
      return info._replace(**{
          f: np.concatenate([getattr(info, f)[:, p * self.rows:(p + 1) * self.rows]
                             for p in self.which], axis=1)
          for f in ("data_next", "block_mask")})
    fwd, dkv = self.infos()
    return expand(fwd), expand(dkv)


Kernel = sk.SplashAttentionKernel | ShardedKernel


def smem_bytes(kernel: Kernel) -> int:
  """Bytes of TPU scalar memory one device's block metadata of `kernel` takes (the larger of
  the forward's and the dK/dV's)."""
  if isinstance(kernel, ShardedKernel):
    devices, infos = kernel.patterns, kernel.infos()
  else:
    devices, infos = 1, (kernel.fwd_mask_info, kernel.dkv_mask_info)
  return max(splash_blocks.smem_bytes(info, devices) for info in infos if info is not None)


def _local(kernel: Kernel | None) -> sk.SplashAttentionKernel | None:
  return kernel.local() if isinstance(kernel, ShardedKernel) else kernel


@functools.lru_cache(maxsize=512)  # a kernel per ring step, cp up to 128, a few masks
def _kernel(normal: Band, order: TokenOrder, q_len: int, kv_len: int, groups: int, bq: int,
            bkv: int, interpret: bool, soft_cap: float | None = None) -> Kernel | None:
  """The MQA splash kernel for `groups` query heads per KV head (cached: built once per
  shape, mask and block sizes, so retracing costs nothing): a `ShardedKernel` where the
  queries are split over devices. None when the mask allows nothing (a ring step whose keys
  no query may see)."""
  sizes = _sizes(bq, bkv)
  del groups  # every head has the same mask: splash keeps one copy of its metadata
  mask_function = _mask_function(normal, (q_len, kv_len), order)
  # The block metadata in closed form (blocks, splash_blocks), exactly what splash's `process_mask`
  # builds by evaluating the mask on every token pair; for sharded queries, each distinct
  # device's rows once (the dK/dV indices are relative to each query shard, and the forward
  # grid's width is the widest row of any device, so the rows are the same).
  kinds = blocks.block_mask(normal, order, q_len, kv_len, bq, bkv)
  if not kinds.any():
    return None
  if not (kinds == blocks.PARTIAL).any():
    # No partial block: the mask is never evaluated (full blocks need none), and without
    # a mask function the ring's steps of equal shapes share one trace of the kernel.
    mask_function = None
  which = None
  if order.shards > 1:
    kinds, which = blocks.per_device(kinds, order.shards)
  devices = 1 if which is None else int(which.max()) + 1
  q_sequence = (None if mask_function is None else
                _q_sequence(q_len, order.shards, order.load_balance))
  infos = (splash_blocks.forward_info(kinds, None),
           splash_blocks.dkv_info(kinds, devices, None))
  if not interpret:
    _check_smem(infos, devices, q_len // order.shards, kv_len, bq, bkv)
  # Host (numpy) constants, concrete inside any trace: a jax array made under `jax.set_mesh`
  # would be replicated on every device of the mesh (128 host copies on simulated devices).
  fwd, dkv = (info._replace(q_sequence=q_sequence) for info in infos)
  kernel = sk.SplashAttentionKernel(fwd, None, dkv, **_options(sizes, soft_cap, mask_function,
                                                               interpret))
  return kernel if which is None else ShardedKernel(kernel, which, q_len // order.shards // bq)


def _sizes(bq: int, bkv: int) -> sk.BlockSizes:
  """One block size for queries and one for keys, in every pass."""
  return sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                       block_kv_dkv=bkv, block_kv_dkv_compute=bkv, use_fused_bwd_kernel=True)


def _options(sizes: sk.BlockSizes, soft_cap: float | None, mask_function, interpret: bool):
  """A `SplashAttentionKernel`'s options beside its block metadata."""
  return dict(block_sizes=sizes, is_mqa=True, save_residuals=True,
              mask_value=sk.DEFAULT_MASK_VALUE, attn_logits_soft_cap=soft_cap,
              residual_checkpoint_name=None, mask_function=mask_function, interpret=interpret)


def _check_smem(infos, devices: int, rows: int, kv_len: int, bq: int, bkv: int):
  """Raises before compiling where a kernel's block metadata (`devices` devices' rows of
  `rows` query tokens each) cannot fit TPU scalar memory (Mosaic would fail with an
  allocation error), naming the block sizes that fit."""
  used = max(splash_blocks.smem_bytes(info, devices) for info in infos)
  if used <= splash_blocks.SMEM_BYTES:
    return
  larger = [(block_size(rows, f * bq), block_size(kv_len, f * bkv)) for f in (2, 4, 8, 16, 32)]
  fits = next((b for b in larger
               if splash_blocks.smem_bound(rows, kv_len, *b) <= splash_blocks.SMEM_BYTES), None)
  shard = "shard the sequence over more devices (context_parallel)."
  hint = (" Shard the sequence over more devices (context_parallel)." if fits is None else
          " Raise them, e.g. backend=flaxattn.splash.Splash(block_q="
          f"{fits[0]}, block_kv={fits[1]}), or {shard}")
  raise ValueError(
      f"splash's block metadata for {rows} query tokens per device and {kv_len} keys with"
      f" block_q={bq}, block_kv={bkv} needs {used} bytes of TPU scalar memory per kernel, more"
      f" than its {splash_blocks.SMEM_BYTES} bytes.{hint}")


@functools.lru_cache(maxsize=8)
def _q_sequence(q_len: int, shards: int, load_balance: bool) -> np.ndarray:
  """Each kernel row's original token index, one constant shared by every ring step's kernel."""
  rows = np.arange(q_len, dtype=np.int32)
  shard_len = q_len // shards
  order = TokenOrder(shards, load_balance)
  original = order.original(rows // shard_len, rows % shard_len, shard_len).astype(np.int32)
  original.flags.writeable = False  # shared by every kernel of this order
  return original


def _has_band(mask: Mask) -> bool:
  """Whether `mask` has a normal form (`masks.band`): lazy splash masks and closed-form
  block metadata; else a block map found on device (`BlockMap`)."""
  try:
    band(mask)
  except NoBand:
    return False
  return True


def _kernel_spec(kernel: Kernel | None, axis: str | None):
  """shard_map specs of a kernel's mask infos: replicated with `axis` None (a single-device
  kernel), else a `ShardedKernel`'s."""
  if isinstance(kernel, ShardedKernel):
    assert axis is not None
    return kernel.specs(axis)
  return jax.tree.map(lambda _: P(), kernel)


def fused_dq_bytes(q_shape, kv_len: int, itemsize: int, block_kv_dkv: int) -> int:
  """Bytes of the fused backward's dq partials for q `[B, T, H, D]` (one `[T, D]` per head
  and key block, in q's dtype, summed after the kernel): O(T x S / block_kv_dkv)."""
  b, t, h, d = q_shape
  return b * h * t * d * itemsize * (kv_len // block_kv_dkv)


def fused_backward(q_shape, kv_len: int, itemsize: int, block_kv_dkv: int,
                   budget: int | None) -> tuple[bool, str]:
  """Whether the fused dK/dV/dQ backward runs for a kernel call on q `[B, T, H, D]` (its dq
  partials within `budget` bytes, None: no limit), else the separate dK/dV and dQ kernels,
  and why in words (for `explain`)."""
  need = fused_dq_bytes(q_shape, kv_len, itemsize, block_kv_dkv)
  if budget is None or need <= budget:
    limit = "no budget" if budget is None else f"within fused_dq_budget {budget} bytes"
    return True, f"backward fused dK/dV/dQ: its dq partials take {need} bytes, {limit}"
  return False, (f"backward separate dK/dV and dQ kernels: the fused backward's dq partials"
                 f" would take {need} bytes, over fused_dq_budget {budget} bytes")


def _segment_ids(q_seg, kv_seg):
  return None if q_seg is None else sk.SegmentIds(q=q_seg, kv=kv_seg)


def _per_call(kernel, fn, heads_args, seg):
  """`fn(kernel, *args, seg)` for every batch row and KV head, stacked `[B, K, ...]`:
  `heads_args` `[B, K, ...]` each, `seg` per row (`SegmentIds` of `[B, T]`, or None). One
  kernel for all calls: vmapped (Pallas adds rows and heads to its grid). A `MapKernels`:
  a loop over rows (and KV heads, where the mask differs between heads), each call's
  kernel built inside it (`MapKernels.at`), so one call's masks are held at a time."""
  if not isinstance(kernel, MapKernels):
    over_heads = jax.vmap(lambda *a: fn(kernel, *a), in_axes=(*(0,) * len(heads_args), None))
    return jax.vmap(over_heads)(*heads_args, seg)

  def row(at):
    b, seg, *args = at
    if not kernel.per_head:
      one = kernel.at(b, 0)
      return jax.vmap(lambda *a: fn(one, *a, seg))(*args)
    return jax.lax.map(lambda at: fn(kernel.at(b, at[0]), *at[1:], seg),
                       (jnp.arange(args[0].shape[0], dtype=jnp.int32), *args))
  return jax.lax.map(row, (jnp.arange(heads_args[0].shape[0], dtype=jnp.int32), seg,
                           *heads_args))


def forward(kernel, q, k, v, q_seg, kv_seg, *, scale: float):
  """One splash call: q `[B, T, H, D]`, k `[B, S, Hkv, D]`, v `[B, S, Hkv, Dv]`, segment ids
  `[B, T]`/`[B, S]` or None. Returns out `[B, T, H, Dv]` in q's dtype and lse `[B, T, H]`
  float32; rows with no key (padding included) get zeros and lse -inf. The kernel carries
  the soft cap; a `ShardedKernel` is called inside its shard_map, `MapKernels` one per row
  (and head) (`_per_call`)."""
  b, t, h, d = q.shape
  kernel = _local(kernel)
  if kernel is None:  # no query sees any key under index masking
    return (jnp.zeros((b, t, h, v.shape[-1]), q.dtype), jnp.full((b, t, h), -jnp.inf, jnp.float32))
  hkv = k.shape[2]
  q_BKGTD = ((q * jnp.asarray(scale, q.dtype)).reshape(b, t, hkv, h // hkv, d)
             .transpose(0, 2, 3, 1, 4))
  k_BKSD, v_BKSD = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  out_BKGTD, (lse_BKGT,) = _per_call(
      kernel, lambda kernel, q, k, v, seg: kernel(q, k, v, segment_ids=seg),
      (q_BKGTD, k_BKSD, v_BKSD), _segment_ids(q_seg, kv_seg))
  out = out_BKGTD.transpose(0, 3, 1, 2, 4).reshape(b, t, h, v.shape[-1])
  lse = lse_BKGT.transpose(0, 3, 1, 2).reshape(b, t, h).astype(jnp.float32)
  empty = ~(lse > _EMPTY_LSE)  # NaN too
  if q_seg is not None:
    # Splash lets padding (segment 0) attend to padding; ours gives it nothing to attend to.
    empty = empty | (q_seg == 0)[:, :, None]
  out = jnp.where(empty[..., None], jnp.zeros((), out.dtype), out)
  return out, jnp.where(empty, -jnp.inf, lse)


def backward(kernel, q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, scale: float,
             fused_dq_budget: int | None = FUSED_DQ_BUDGET):
  """Gradients (dq, dk, dv) of a splash call given the (possibly merged) out and lse: splash's
  fused backward where its dq partials fit `fused_dq_budget` bytes on these (per-device)
  shapes, else its separate dK/dV and dQ kernels (`fused_backward`)."""
  kernel = _local(kernel)
  if kernel is None:
    return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
  b, t, h, d = q.shape
  hkv = k.shape[2]
  g = h // hkv
  def to_kernel(x):
    return x.reshape(b, t, hkv, g, *x.shape[3:]).transpose(0, 2, 3, 1, *range(4, x.ndim + 1))
  q_BKGTD = to_kernel(q * jnp.asarray(scale, q.dtype))
  out_BKGTD, dout_BKGTD = to_kernel(out), to_kernel(dout)
  lse_BKGT = to_kernel(jnp.where(jnp.isneginf(lse), _NO_KEYS_LSE, lse))
  # d lse / d s = p: an lse cotangent enters exactly as a shift of the row term di.
  di_BKGT = (jnp.einsum("bkgtd,bkgtd->bkgt", out_BKGTD.astype(jnp.float32),
                        dout_BKGTD.astype(jnp.float32)) - to_kernel(dlse.astype(jnp.float32)))
  sizes, kw = kernel.kwargs["block_sizes"], kernel.kwargs
  fused, _ = fused_backward(q.shape, k.shape[1], q.dtype.itemsize, sizes.block_kv_dkv,
                            fused_dq_budget)
  one = functools.partial(_backward, sizes=sizes, mask_value=kw["mask_value"],
                          soft_cap=kw["attn_logits_soft_cap"],
                          mask_function=kw["mask_function"], interpret=kw["interpret"])

  def call(kernel, q, k, v, lse, dout, di, seg):
    assert kernel.dkv_mask_info is not None  # built with the dK/dV kernel's metadata
    # The dQ kernel's grid is the forward's (same blocks), so it reads the forward's metadata.
    return one((kernel.dkv_mask_info, None if fused else kernel.fwd_mask_info), q, k, v, seg,
               lse, dout, di)
  dq, dk, dv = _per_call(kernel, call, (q_BKGTD, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                        lse_BKGT, dout_BKGTD, di_BKGT),
                         _segment_ids(q_seg, kv_seg))
  dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d) * jnp.asarray(scale, dq.dtype)
  return (dq.astype(q.dtype), dk.transpose(0, 2, 1, 3).astype(k.dtype),
          dv.transpose(0, 2, 1, 3).astype(v.dtype))


@functools.partial(jax.jit, static_argnames=("sizes", "mask_value", "soft_cap", "mask_function",
                                             "interpret"))
def _backward(infos, q, k, v, seg, lse, dout, di, *, sizes, mask_value, soft_cap,
              mask_function, interpret):
  """Splash's backward kernels for one query head group: the fused dK/dV/dQ kernel with
  `dq_info` None, else the dK/dV kernel and the dQ kernel on `dq_info`. Splash's own VJP
  cannot take an lse cotangent (it refuses to differentiate with save_residuals), so this
  calls the kernels directly (jax 0.10 internals). Jitted like splash's forward: ring steps
  with the same shapes and mask function trace it once. `infos`: (dK/dV's, dQ's or None)."""
  dkv_info, dq_info = infos
  dq, dk, dv = sk._splash_attention_bwd_dkv(  # pylint: disable=protected-access
      q, k, v, seg, None, lse, dout, di, bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv,
      bkv_compute=sizes.block_kv_dkv_compute, is_mqa=True, mask_info=dkv_info,
      mask_value=mask_value, attn_logits_soft_cap=soft_cap,
      use_fused_bwd_kernel=dq_info is None, q_layout=sizes.q_layout, k_layout=sizes.k_layout,
      v_layout=sizes.v_layout, mask_function=mask_function, interpret=interpret)
  if dq_info is not None:
    dq = sk._splash_attention_bwd_dq(  # pylint: disable=protected-access
        q, k, v, seg, None, lse, dout, di, bq=sizes.block_q, bkv=sizes.block_kv, is_mqa=True,
        mask_info=dq_info, mask_value=mask_value, attn_logits_soft_cap=soft_cap,
        q_layout=sizes.q_layout, k_layout=sizes.k_layout, v_layout=sizes.v_layout,
        mask_function=mask_function, interpret=interpret)
  assert dq is not None  # the fused backward kernel computes dq too
  return dq, dk, dv


@dataclasses.dataclass(frozen=True)
class Passes:
  """Splash's forward and backward as `checked.Passes`; `operands` is the kernel (a
  `ShardedKernel` is called inside its shard_map)."""

  scale: float
  fused_dq_budget: int | None = FUSED_DQ_BUDGET

  def forward(self, kernel, q, k, v, layout: Layout):
    return forward(kernel, q, k, v, layout.q_segment_ids, layout.kv_segment_ids,
                   scale=self.scale)

  def backward(self, kernel, q, k, v, layout: Layout, out, lse, dout, dlse):
    dlse = jnp.zeros(lse.shape, jnp.float32) if dlse is None else dlse
    return backward(kernel, q, k, v, layout.q_segment_ids, layout.kv_segment_ids, out, lse,
                    dout, dlse, scale=self.scale, fused_dq_budget=self.fused_dq_budget)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["mask", "kinds", "toks"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class BlockMap:
  """What splash runs a mask without a band on (a `MaskMod`, `|`, `~`): the mask (a pytree:
  a MaskMod's operands stay traced), its block map found on device (`blocks.schedule`),
  int8 `[B, K', G', nq, nk]` (K' x G' the query heads as KV heads x group where the mask
  differs between heads, else 1 x 1), and the tokens its blocks are evaluated on."""

  mask: Mask
  kinds: Any
  toks: blocks.Tokens

  @classmethod
  def of(cls, mask: Mask, layout: Layout, q_shape, kv_heads: int, bq: int, bkv: int) -> BlockMap:
    """The block map of one call (self attention) on q `[B, T, H, D]`."""
    b, t, h, _ = q_shape
    toks = blocks.tokens(mask, layout, b, t, t, t, t)
    kinds = blocks.schedule(mask, toks, h, bq, bkv, by_head=True)
    heads = (kv_heads, h // kv_heads) if mask.per_head else (1, 1)
    return cls(mask, kinds.reshape(b, *heads, *kinds.shape[2:]).astype(jnp.int8), toks)

  def partial_counts(self):
    """int32 `[B, K']`: each kernel call's PARTIAL blocks, whose masks it builds."""
    return (self.kinds == blocks.PARTIAL).sum((2, 3, 4), dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class MapPasses:
  """Splash's passes on a `BlockMap`: one kernel call per batch row (and KV head, where the
  mask differs between heads), each with MaskInfos built on device
  (`splash_blocks.device_infos`) and the masks of its PARTIAL blocks, at most `per_call`
  (the caller's run-time check), built on device from the mask and the tokens, `[bq, bkv]`
  each; the backward builds its own (transposed for dK/dV) rather than keeping the
  forward's. Segment ids go to the kernel as on a band mask."""

  scale: float
  bq: int
  bkv: int
  per_call: int
  soft_cap: float | None
  interpret: bool
  fused_dq_budget: int | None = FUSED_DQ_BUDGET

  def forward(self, operands: BlockMap, q, k, v, layout: Layout):
    return forward(self._kernels(operands, fwd=True, dkv=False), q, k, v, layout.q_segment_ids,
                   layout.kv_segment_ids, scale=self.scale)

  def backward(self, operands: BlockMap, q, k, v, layout: Layout, out, lse, dout, dlse):
    dlse = jnp.zeros(lse.shape, jnp.float32) if dlse is None else dlse
    fused, _ = fused_backward(q.shape, k.shape[1], q.dtype.itemsize, self.bkv,
                              self.fused_dq_budget)
    return backward(self._kernels(operands, fwd=not fused, dkv=True), q, k, v,
                    layout.q_segment_ids, layout.kv_segment_ids, out, lse, dout, dlse,
                    scale=self.scale, fused_dq_budget=self.fused_dq_budget)

  def _kernels(self, operands: BlockMap, fwd: bool, dkv: bool) -> MapKernels:
    return MapKernels(operands, self.bq, self.bkv, self.per_call, fwd, dkv, _options(
        _sizes(self.bq, self.bkv), self.soft_cap, None, self.interpret))


@dataclasses.dataclass(frozen=True)
class MapKernels:
  """The kernels of a `BlockMap`, one per call, built where the call runs (`_per_call`):
  `fwd` / `dkv` say which passes' masks to build (a pass reads one of them, the separate
  dQ kernel the forward's)."""

  operands: BlockMap
  bq: int
  bkv: int
  per_call: int
  fwd: bool
  dkv: bool
  kwargs: dict

  @property
  def per_head(self) -> bool:
    return self.operands.kinds.shape[1] > 1

  def at(self, b, kv_head) -> sk.SplashAttentionKernel:
    """The kernel of batch row `b` and KV head `kv_head` (traced ints)."""
    kinds = self.operands.kinds[b, kv_head]  # [G', nq, nk]
    flags = (kinds == blocks.PARTIAL).reshape(-1)
    # Slots in row-major order; a block that is not PARTIAL holds the last PARTIAL one's
    # (what `device_infos` repeats so as to copy no mask block for it).
    slots = jnp.clip(jnp.cumsum(flags, dtype=jnp.int32) - 1, 0, self.per_call - 1)
    fwd, dkv = splash_blocks.device_infos(kinds, slots.reshape(kinds.shape), self.per_call)
    if not self.kwargs["interpret"]:
      _check_smem((fwd, dkv), 1, kinds.shape[1] * self.bq, kinds.shape[2] * self.bkv, self.bq,
                  self.bkv)
    g_, i, j = jnp.unravel_index(jnp.nonzero(flags, size=self.per_call, fill_value=0)[0],
                                 kinds.shape)
    # Each block's query head (0 where the mask is the same for all: kv_head 0, G' 1).
    at = (b, kv_head * kinds.shape[0] + g_, i, j)
    fwd = fwd._replace(partial_mask_blocks=self._masks(at, False) if self.fwd else None)
    dkv = dkv._replace(partial_mask_blocks=self._masks(at, True) if self.dkv else None)
    return sk.SplashAttentionKernel(fwd, None, dkv, **self.kwargs)

  def _masks(self, at, transposed: bool):
    """bool `[P, bq, bkv]` (`[P, bkv, bq]` `transposed`): the masks of the blocks `at`
    (batch row, and per block query head, query block, key block), segment ids
    included, built a few at a time."""
    mask, toks = self.operands.mask, self.operands.toks
    b, *per_block = at

    def block(at):
      h, i, j = at
      q, kv = (i * self.bq, self.bq), (j * self.bkv, self.bkv)
      ok = jnp.broadcast_to(allowed(mask, toks.coords(b, h, q, kv, (1,), (0,)),
                                    blocks.slice_tokens(toks.q_seg, b, *q)[:, None],
                                    blocks.slice_tokens(toks.kv_seg, b, *kv)[None, :]),
                            (self.bq, self.bkv))
      return ok.T if transposed else ok
    return jax.lax.map(block, tuple(per_block), batch_size=8)


@dataclasses.dataclass(frozen=True)
class _BlockwiseOn:
  """The blockwise passes on a `BlockMap`'s mask: a call with more PARTIAL blocks than
  `MapPasses` holds runs these (its mask's operands are traced, so they travel with the
  operands rather than in the static passes)."""

  scale: float
  soft_cap: float | None

  def forward(self, operands: BlockMap, q, k, v, layout: Layout):
    return blockwise.Passes(operands.mask, self.scale, self.soft_cap).forward(None, q, k, v,
                                                                              layout)

  def backward(self, operands: BlockMap, q, k, v, layout: Layout, out, lse, dout, dlse):
    return blockwise.Passes(operands.mask, self.scale, self.soft_cap).backward(
        None, q, k, v, layout, out, lse, dout, dlse)


@dataclasses.dataclass(frozen=True)
class Splash(registry.Kernel):
  """The "splash" kernel. Block sizes default to `default_block(head_dim)` fitted to the
  sequence; pass `Splash(block_q=..., block_kv=...)` as `backend=` to override them.
  `interpret`: Pallas interpret mode; None decides by the platform the program is lowered
  for (compiled Mosaic on TPU, interpret mode elsewhere).

  `fused_dq_budget`: bytes the fused backward's dq partials may take per kernel call on one
  device (B x H x T x D x S / block_kv in q's dtype, `fused_dq_bytes`); above it the
  backward runs splash's separate dK/dV and dQ kernels, O(T) in memory, which recompute the
  scores (docs/kernels.md has the FLOPs of each). Default `FUSED_DQ_BUDGET` (256 MiB);
  0: always separate; None: always fused.

  `partial_blocks`: for a mask without a band (a `MaskMod`, `|`, `~`), the PARTIAL blocks
  per batch row (and query head, where the mask differs between heads) whose masks a call
  builds on device, bool `[block_q, block_kv]` each; a batch where a row needs more runs
  the blockwise kernel (a run-time check; `explain` says so). Default None: 2 x (T / block_q +
  T / block_kv), which causal-like masks over packed documents stay within."""

  block_q: int | None = None
  block_kv: int | None = None
  interpret: bool | None = None
  fused_dq_budget: int | None = FUSED_DQ_BUDGET
  partial_blocks: int | None = None
  name: str = "splash"
  ring: bool = True
  soft_cap: bool = True  # splash's attn_logits_soft_cap, after our scale as everywhere
  mask_mod: bool = True  # through a block map found on device (`BlockMap`, `MapPasses`)

  def on(self, platform: str) -> Splash:
    # Interpret mode off its platform; on it, as asked (None: compiled).
    return dataclasses.replace(self, interpret=platform != "tpu" or self.interpret is True)

  def __post_init__(self):
    for arg in ("block_q", "block_kv"):
      value = getattr(self, arg)
      if value is not None:
        checks.integer(f"Splash({arg}=...)", value, f"a positive multiple of {LANES} or None",
                       lambda x: x > 0 and x % LANES == 0)
    if self.interpret is not None:
      checks.boolean("Splash(interpret=...)", self.interpret, "None decides by the platform")
    if self.fused_dq_budget is not None:
      checks.integer("Splash(fused_dq_budget=...)", self.fused_dq_budget,
                     "bytes as an int >= 0 (0: always the separate dQ kernel) or None (always"
                     " fused)", lambda x: x >= 0)
    if self.partial_blocks is not None:
      checks.integer("Splash(partial_blocks=...)", self.partial_blocks, "a positive int (blocks"
                     " per batch row and head) or None (2 x the query and key blocks)",
                     lambda x: x > 0)

  def unsupported_reason(self, call: registry.Call) -> str | None:
    if call.cp_strategy is not None and not _has_band(call.mask):
      return (f"splash runs a mask without a band ({call.mask!r}) through a block map of the"
              " whole call, not per context shard; use 'blockwise', which runs it under"
              " context parallelism.")
    return super().unsupported_reason(call)

  def reason(self, call: registry.Call) -> str | None:
    """None if splash serves `call` exactly (docs/design.md), else why not."""
    t, s = call.q_shape[1], call.kv_shape[1]
    if t != s:
      return (f"splash serves self attention only (masks on token index): query length {t} !="
              f" key length {s}. Use 'fused'.")
    if t % (LANES * call.cp_size):
      per = "" if call.cp_size == 1 else f" per device (T / {call.cp_size} context shards)"
      return (f"splash needs a sequence length{per} that is a multiple of {LANES}, got"
              f" {t // call.cp_size if t % call.cp_size == 0 else t / call.cp_size}; pad the"
              " sequence (padding as segment 0) or use 'fused'.")
    if call.score_mod is not None:
      return (f"splash (JAX's Pallas TPU kernel) changes scores only by a logit soft cap, not"
              f" by a function (score_mod={call.score_mod}); on TPU the blockwise kernel runs"
              " it: flash attention in JAX, O(T) memory, skipping the blocks its block map"
              " rules out.")
    return None

  def for_tests_on(self, platform: str) -> str | None:
    if platform != "tpu" and self.interpret is not False:
      return "Pallas interpret mode off TPU: for tests, not speed"
    if self.interpret is True:  # kept on its own platform (`on`)
      return "Pallas interpret mode (interpret=True): for tests, not speed"
    return None

  def describe(self, call: registry.Call) -> str | None:
    """What runs: interpret mode off TPU, the run-time check where explicit positions meet
    a mask, and the backward (fused or separate dQ, by `fused_dq_budget` on the call's
    shapes per context shard)."""
    t, s = call.q_shape[1] // call.cp_size, call.kv_shape[1]
    if call.cp_strategy == "ring":
      s //= call.cp_size
    _, bkv = self.blocks(t, s, call.q_shape[3])
    _, backward = fused_backward((call.q_shape[0], t, *call.q_shape[2:]), s,
                                 np.dtype(call.dtype).itemsize, bkv, self.fused_dq_budget)
    notes = [self.for_tests_on(call.platform)]
    if not _has_band(call.mask):  # never under context parallelism (`unsupported_reason`)
      bq, _ = self.blocks(t, s, call.q_shape[3])
      notes.append(f"{call.mask!r} has no band: its block map is found on device per call and"
                   f" the masks of its PARTIAL blocks built there, at most"
                   f" {self._per_row(t, bq, bkv)} per batch row"
                   f"{' and query head' if call.mask.per_head else ''} ({bq} x {bkv} each); a"
                   " call with more runs the blockwise kernel, checked at run time; the forward"
                   " grid keeps every key block of a row")
    elif needs_index_check(call.mask, call.has_positions):
      notes.append("index masks; positions checked per batch at run time, a batch whose"
                   " documents are not the token index shifted runs the blockwise kernel")
    notes.append(f"{backward} (block_kv {bkv}; batch {call.q_shape[0]} and"
                 f" {call.q_shape[2]} heads as given, fewer per device where the mesh splits"
                 " them)")
    return "; ".join(n for n in notes if n)

  def blocks(self, q_len: int, kv_len: int, head_dim: int) -> tuple[int, int]:
    default = default_block(head_dim)
    return (block_size(q_len, self.block_q or default),
            block_size(kv_len, self.block_kv or default))

  def _per_row(self, t: int, bq: int, bkv: int) -> int:
    return self.partial_blocks or 2 * (t // bq + t // bkv)

  def kernel(self, mask: Mask, order: TokenOrder, q_shape, kv_shape, soft_cap=None):
    """The cached kernel for global shapes q `[B, T, H, D]`, k `[B, S, Hkv, D]` whose
    queries are split over `order.shards` devices, with logit soft cap `soft_cap` or None."""
    normal = band(mask)
    t, s = q_shape[1], kv_shape[1]
    shard_len = t // order.shards
    # A block straddling the two load-balanced chunks of a shard covers distant tokens and
    # is rarely skippable: cut blocks inside a chunk where the chunk allows it.
    chunk = shard_len // 2
    unit = chunk if order.load_balance and order.shards > 1 and chunk % LANES == 0 else shard_len
    bq, bkv = self.blocks(unit, s if order.shards == 1 else min(s, unit), q_shape[3])
    interpret = jax.default_backend() != "tpu" if self.interpret is None else self.interpret
    return _kernel(normal, order, t, s, q_shape[2] // kv_shape[2], bq, bkv, interpret, soft_cap)

  def __call__(self, q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
               soft_cap: float | None = None):
    """Splash attention over packed sequences (self attention, T a multiple of 128).

    Args:
      q: `[B, T, H, D]`; k: `[B, T, Hkv, D]`, v: `[B, T, Hkv, Dv]`, H a multiple of Hkv;
        float32/bfloat16.
      soft_cap: logit soft cap (applied to the scaled scores) or None.
      layout: segment ids (0 = padding) and positions; see docs/design.md for which
        positions are exact. Padding queries get zeros, lse -inf and zero gradients.
    Returns:
      `[B, T, H, D]` in q's dtype; with `return_lse` also lse `[B, T, H]` float32.
    Raises:
      ValueError: a call `unsupported_reason` declines (T not a multiple of 128, query and
        key lengths differ).
    """
    if k.shape[1] != q.shape[1]:
      raise ValueError(f"splash serves self attention only, got q {q.shape} and k {k.shape}.")
    if not _has_band(mask):
      return self._by_block_map(q, k, v, layout, mask, float(scale), return_lse, soft_cap)
    kernel = self.kernel(mask, TokenOrder(), q.shape, k.shape, soft_cap)
    index = layout.index(*q.shape[:2])
    exact = index_check(mask, layout, index, index)
    attend = functools.partial(checked.attention, Passes(float(scale), self.fused_dq_budget),
                               blockwise.Passes(mask, float(scale), soft_cap))
    attend = sharding.per_batch_and_head(attend, q.shape, k.shape[2], layout,
                                         (P(), _kernel_spec(kernel, None)))
    out, lse = attend(exact, kernel, q, k, v, layout)
    return (out, lse) if return_lse else out

  def _by_block_map(self, q, k, v, layout: Layout, mask: Mask, scale: float, return_lse: bool,
                    soft_cap: float | None):
    """`__call__` for a mask without a band: per device (batch and head shard) its
    `BlockMap`, then `MapPasses`, or blockwise where it holds more PARTIAL blocks than
    `partial_blocks` allows."""
    t, d = q.shape[1], q.shape[3]
    bq, bkv = self.blocks(t, t, d)
    interpret = jax.default_backend() != "tpu" if self.interpret is None else self.interpret

    def local(q, k, v, layout):
      group = q.shape[2] // k.shape[2] if mask.per_head else 1  # query heads of one call
      passes = MapPasses(scale, bq, bkv, self._per_row(t, bq, bkv) * group, soft_cap,
                         interpret, self.fused_dq_budget)
      operands = BlockMap.of(mask, layout, q.shape, k.shape[2], bq, bkv)
      exact = operands.partial_counts().max() <= passes.per_call
      return checked.attention(passes, _BlockwiseOn(scale, soft_cap), exact, operands, q, k, v,
                               layout)
    out, lse = sharding.per_batch_and_head(local, q.shape, k.shape[2], layout)(q, k, v, layout)
    return (out, lse) if return_lse else out

  def ring_step(self, *, strategy: str, mask: Mask, scale: float, shards: int, axis: str,
                load_balance: bool, q_shape, kv_shape, layout: Layout,
                soft_cap: float | None = None) -> SplashStep:
    """One kernel per ring step (or one for the gathered keys), each device's block metadata
    picked by its index on `axis`. A batch that fails `index_check` (on the global
    `layout`) runs the blockwise passes."""
    t = q_shape[1]
    if strategy == "ring":
      kernels = tuple(self.kernel(mask, TokenOrder(shards, load_balance, step), q_shape,
                                  (kv_shape[0], t // shards, *kv_shape[2:]), soft_cap)
                      for step in range(shards))
    else:
      kernels = (self.kernel(mask, TokenOrder(shards, load_balance, None), q_shape, kv_shape,
                             soft_cap),)
    index = layout.index(q_shape[0], t)
    exact = index_check(mask, layout, index, index)
    fallback = blockwise.ring_step(mask, scale, t, shards, load_balance, soft_cap)
    return SplashStep(kernels, exact, axis, float(scale), mask, fallback, self.fused_dq_budget)


# The blockwise ring step takes a traced step (it runs in a scan), so as a jitted call it is
# traced once for all of splash's unrolled ring steps instead of once per step.
@functools.partial(jax.jit, static_argnums=0)
def _fallback_forward(fallback, step, q, k, v, layout):
  return fallback.forward(step, q, k, v, layout)


@functools.partial(jax.jit, static_argnums=0)
def _fallback_backward(fallback, step, q, k, v, layout, out, lse, dout, dlse):
  return fallback.backward(step, q, k, v, layout, out, lse, dout, dlse)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kernels", "exact"],
                   meta_fields=["axis", "scale", "mask", "fallback", "fused_dq_budget"])
@dataclasses.dataclass(frozen=True)
class SplashStep(RingStep):
  """Splash as the per-device step of context parallelism: the `ShardedKernel`s (one per
  ring step, or one for the gathered keys; None where no query sees the step's keys), each
  device picking its own block metadata, and the run-time exactness flag (None: always
  exact)."""

  kernels: tuple
  exact: jax.Array | None
  axis: str
  scale: float
  mask: Mask
  fallback: blockwise.BlockwiseStep  # for batches splash cannot mask exactly
  fused_dq_budget: int | None = FUSED_DQ_BUDGET
  unrolled = True  # a kernel per ring step: the step must be static

  @property
  def passes(self) -> Passes:
    return Passes(self.scale, self.fused_dq_budget)

  def specs(self):
    kernels = tuple(_kernel_spec(k, self.axis) for k in self.kernels)
    return dataclasses.replace(self, kernels=kernels, exact=P())

  def forward(self, step: int, q, k, v, layout: Layout):
    kernel = self.kernels[step]
    if self.exact is None and kernel is None:  # no query sees these keys: skip the step
      return None
    return checked.either(
        self.exact, lambda: self.passes.forward(kernel, q, k, v, layout),
        lambda: _fallback_forward(self.fallback, jnp.int32(step), q, k, v, layout))

  def backward(self, step: int, q, k, v, layout: Layout, out, lse, dout, dlse):
    kernel = self.kernels[step]
    if self.exact is None and kernel is None:
      return None
    return checked.either(
        self.exact, lambda: self.passes.backward(kernel, q, k, v, layout, out, lse, dout, dlse),
        lambda: _fallback_backward(self.fallback, jnp.int32(step), q, k, v, layout, out, lse,
                                   dout, dlse))

  def gathered(self, axis, n, q, k, v, layout: Layout):
    return checked.attention(self.passes,
                             blockwise.Passes(self.mask, self.scale, self.fallback.soft_cap),
                             self.exact, self.kernels[0], q, k, v, layout)
