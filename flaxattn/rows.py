"""Query heads folded into rows: the layout, autodiff and ring step of the GPU flash kernels.

pallas_gpu (Triton) and mosaic_gpu (Mosaic GPU, Hopper) run on one layout: the G query heads
of a KV head fold into the rows of a query block, ordered (token, group), so K/V are never
repeated; each row carries its token's segment id and position. Rows, keys and head dims
are padded to the kernel's units. A kernel supplies its passes on rows (a `RowTiling`);
this module makes them attention `[B, T, H, Dv]` with a custom VJP, `checked.Passes` for a
fallback, the ring's step, and the registry behaviour both kernels share (`RowKernel`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp

from flaxattn import registry, sharding
from flaxattn.blocks import round_up
from flaxattn.layout import Layout
from flaxattn.masks import Mask
from flaxattn.ring import RingStep


@dataclasses.dataclass(frozen=True)
class Rows:
  """A call in the kernels' layout: q `[B, K, Rp, Dp]` (rows (token, group) of each KV head,
  padded to whole blocks, head dim padded), k `[B, K, Sp, Dp]`, v `[B, K, Sp, Dvp]`, and the
  ids per row and per key `[B, Rp]` / `[B, Sp]` (padding as segment 0)."""

  q_BKRD: jax.Array
  k_BKSD: jax.Array
  v_BKSD: jax.Array
  ids: tuple  # q_seg_BR, q_pos_BR, kv_seg_BS, kv_pos_BS


class RowTiling(Protocol):
  """A kernel's static shape as the shared wrapper reads it: the padding units and the
  passes on `Rows`. Hashable (a custom VJP's static argument)."""

  interpret: bool

  def padding(self, rows: int, keys: int, d: int, dv: int) -> tuple[int, int, int, int]:
    """Padded rows, keys, head dim and value head dim of a call of `rows` rows."""
    ...

  def forward(self, rows: Rows, *, mask: Mask, scale: float,
              soft_cap: float | None) -> tuple[jax.Array, jax.Array]:
    """out `[B, K, Rp, Dvp]` (q's dtype) and lse `[B, K, Rp]` float32."""
    ...

  def backward(self, rows: Rows, lse, dout, delta, *, mask: Mask, scale: float,
               soft_cap: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq `[B, K, Rp, Dp]`, dk `[B, K, Sp, Dp]`, dv `[B, K, Sp, Dvp]` given lse (0 where a
    row sees no key), dout `[B, K, Rp, Dvp]` and delta = rowsum(dout * out) - dlse."""
    ...


def _ids(layout: Layout, b: int, t: int, s: int, g: int, rows_pad: int, s_pad: int):
  """(q_seg, q_pos, kv_seg, kv_pos): ids per row `[B, Rp]` (each token's, repeated for its
  G rows) and per key `[B, Sp]`, padding as segment 0. Always computed in the program, the
  default layout too: the schedule built from them then costs the program O(T) to build,
  where one known at trace time would be an O(T^2 / 4096) constant inside it (a cuda
  export of a causal T = 512K forward and backward: 518 MiB serialized, now 0.03 MiB)."""
  full = layout.materialize(b, t, s)

  def pad(x, length):
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1])))

  def rows(x):
    return pad(jnp.repeat(x, g, axis=1), rows_pad)
  return (rows(full.q_segment_ids), rows(full.q_positions), pad(full.kv_segment_ids, s_pad),
          pad(full.kv_positions, s_pad))


def to_rows(x, hkv: int, length: int, dim: int):
  """`[B, L, H, D]` -> `[B, K, length, dim]`: the rows (token, group) of each KV head, zero
  padded to `length` rows and `dim` features (for k and v, H = K: a row per token)."""
  b, n, h, d = x.shape
  x = jnp.moveaxis(x.reshape(b, n, hkv, h // hkv, d), 2, 1).reshape(b, hkv, n * (h // hkv), d)
  return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, dim - d)))


def from_rows(x, n: int, h: int, d: int):
  """`[B, K, Rp, Dp]` -> `[B, n, h, d]`, the padding dropped."""
  b, hkv = x.shape[:2]
  x = x[:, :, :n * (h // hkv), :d].reshape(b, hkv, n, h // hkv, d)
  return jnp.moveaxis(x, 1, 2).reshape(b, n, h, d)


def fold(q, k, v, layout: Layout, tiling: RowTiling) -> Rows:
  """q `[B, T, H, D]`, k `[B, S, Hkv, D]`, v `[B, S, Hkv, Dv]` and their ids as `Rows`,
  padded as `tiling.padding` says."""
  b, t, h, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  rows_pad, s_pad, dp, dvp = tiling.padding(t * (h // hkv), s, d, v.shape[-1])
  return Rows(to_rows(q, hkv, rows_pad, dp), to_rows(k, hkv, s_pad, dp),
              to_rows(v, hkv, s_pad, dvp), _ids(layout, b, t, s, h // hkv, rows_pad, s_pad))


def pad_to(rows: int, keys: int, row_unit: int, key_unit: int) -> tuple[int, int]:
  """`rows` and `keys` rounded up to their units."""
  return round_up(rows, row_unit), round_up(keys, key_unit)


def forward(q, k, v, layout: Layout, *, mask: Mask, scale: float, tiling: RowTiling,
            soft_cap: float | None = None):
  """Forward pass without autodiff rules: out `[B, T, H, Dv]` (q dtype), lse `[B, T, H]` f32."""
  out, lse = tiling.forward(fold(q, k, v, layout, tiling), mask=mask, scale=scale,
                            soft_cap=soft_cap)
  t, h = q.shape[1:3]
  return from_rows(out, t, h, v.shape[-1]), from_rows(lse[..., None], t, h, 1)[..., 0]


def backward(q, k, v, layout: Layout, out, lse, dout, dlse, *, mask: Mask, scale: float,
             tiling: RowTiling, soft_cap: float | None = None):
  """Gradients (dq, dk, dv) of the attention of q against k/v, given the rows' output `out`
  and log-sum-exp `lse` (which may cover more keys than k/v: the ring passes the merged
  result of every step) and their cotangents `dout`, `dlse` (float32 `[B, T, H]`)."""
  ops = fold(q, k, v, layout, tiling)
  hkv, rows_pad = k.shape[2], ops.q_BKRD.shape[2]
  dvp = ops.v_BKSD.shape[-1]

  def rows(x, dim):
    return to_rows(x, hkv, rows_pad, dim)
  out_r, dout_r = rows(out, dvp), rows(dout, dvp)
  lse_r = rows(lse[..., None], 1)[..., 0]
  dlse_r = rows(dlse.astype(jnp.float32)[..., None], 1)[..., 0]
  # d lse / d s = p, so an lse cotangent shifts the softmax-Jacobian term row by row.
  delta = jnp.einsum("bkrd,bkrd->bkr", dout_r.astype(jnp.float32),
                     out_r.astype(jnp.float32)) - dlse_r
  lse_r = jnp.where(jnp.isfinite(lse_r), lse_r, 0.0)  # rows with no key: every p is exp(-inf) = 0
  dq, dk, dv = tiling.backward(ops, lse_r, dout_r, delta, mask=mask, scale=scale,
                               soft_cap=soft_cap)
  t, h, d = q.shape[1:]
  s = k.shape[1]
  return (from_rows(dq, t, h, d), from_rows(dk, s, hkv, d),
          from_rows(dv, s, hkv, v.shape[-1]))


def _primal(q, k, v, layout, mask, scale, tiling, soft_cap) -> tuple[jax.Array, jax.Array]:
  return forward(q, k, v, layout, mask=mask, scale=scale, tiling=tiling, soft_cap=soft_cap)


# Applied as a call, not a decorator through functools.partial, so the result stays typed.
_attention = jax.custom_vjp(_primal, nondiff_argnums=(4, 5, 6, 7))


def _attention_fwd(q, k, v, layout, mask, scale, tiling, soft_cap):
  out, lse = _primal(q, k, v, layout, mask, scale, tiling, soft_cap)
  return (out, lse), (q, k, v, layout, out, lse)


def _attention_bwd(mask, scale, tiling, soft_cap, residuals, cotangents):
  q, k, v, layout, out, lse = residuals
  dout, dlse = cotangents
  dq, dk, dv = backward(q, k, v, layout, out, lse, dout, dlse, mask=mask, scale=scale,
                        tiling=tiling, soft_cap=soft_cap)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
              tiling: RowTiling, soft_cap: float | None = None):
  """Attention `[B, T, H, Dv]` (and lse `[B, T, H]` float32 with `return_lse`) by the
  passes of `tiling`, differentiable, per (batch, head) shard of the mesh in force."""
  def attend(q, k, v, layout):
    return _attention(q, k, v, layout, mask, float(scale), tiling, soft_cap)
  attend = sharding.per_batch_and_head(attend, q.shape, k.shape[2], layout)
  out, lse = attend(q, k, v, layout)
  return (out, lse) if return_lse else out


@functools.partial(jax.tree_util.register_dataclass, data_fields=[],
                   meta_fields=["kernel", "mask", "scale", "chunk", "soft_cap"])
@dataclasses.dataclass(frozen=True)
class Step(RingStep):
  """A row kernel's passes as the ring's per-device step: the same kernels at every step,
  the block schedule from the visiting keys' ids, blocks fitted to the load-balanced chunks
  of `chunk` tokens (None: not load balanced)."""

  kernel: RowKernel
  mask: Mask
  scale: float
  chunk: int | None = None
  soft_cap: float | None = None

  @property
  def unrolled(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]
    """Compiled for a GPU the steps run unrolled: a scan's loop holds its float32
    accumulators twice (H100, 16K tokens per device, 16 heads on 8: 1.07 against 0.69 GiB
    of temporaries at cp=4, docs/design.md). In interpret mode (tests) one scanned step
    is traced once."""
    return self.kernel.interpret is not True

  def forward(self, step, q, k, v, layout):
    return forward(q, k, v, layout, mask=self.mask, scale=self.scale,
                   tiling=self.kernel.tiling(q, k, v, self.chunk), soft_cap=self.soft_cap)

  def backward(self, step, q, k, v, layout, out, lse, dout, dlse):
    return backward(q, k, v, layout, out, lse, dout, dlse, mask=self.mask, scale=self.scale,
                    tiling=self.kernel.tiling(q, k, v, self.chunk), soft_cap=self.soft_cap)


@dataclasses.dataclass(frozen=True)
class Passes:
  """A row kernel's passes as `checked.Passes` (`operands` unused; no lse cotangent is a
  zero one): what cuDNN falls back on for a batch it cannot serve exactly, on a GPU."""

  kernel: RowKernel
  mask: Mask
  scale: float
  soft_cap: float | None = None

  def forward(self, operands, q, k, v, layout: Layout):
    return forward(q, k, v, layout, mask=self.mask, scale=self.scale,
                   tiling=self.kernel.tiling(q, k, v), soft_cap=self.soft_cap)

  def backward(self, operands, q, k, v, layout: Layout, out, lse, dout, dlse):
    dlse = jnp.zeros(lse.shape, jnp.float32) if dlse is None else dlse
    dq, dk, dv = backward(q, k, v, layout, out, lse, dout, dlse, mask=self.mask,
                          scale=self.scale, tiling=self.kernel.tiling(q, k, v),
                          soft_cap=self.soft_cap)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


class RowKernel(registry.Kernel):
  """A GPU flash kernel on rows: compiled on GPU, interpreted elsewhere (`interpret`: None
  decides by the platform), every mask, packed rows, GQA, soft cap, Dv != D and the ring.
  Subclasses (frozen dataclasses with an `interpret` field) implement `tiling` and set
  `interpreter`, the name of the mode that runs them off GPU."""

  interpret: bool | None = None
  interpreter: str = ""
  ring: bool = True
  soft_cap: bool = True

  def tiling(self, q, k, v, chunk: int | None = None) -> RowTiling:
    """The kernel's `RowTiling` for these operands; `chunk`: tokens in a load-balanced chunk
    of a ring's shard (None: not load balanced)."""
    raise NotImplementedError

  def interpreted(self) -> bool:
    """Whether a program traced now runs the kernels in interpret mode."""
    return jax.default_backend() != "gpu" if self.interpret is None else self.interpret

  def on(self, platform: str) -> RowKernel:
    # Interpret mode off its platform; on it, as asked (None: compiled).
    return dataclasses.replace(self, interpret=platform != "gpu" or self.interpret is True)  # pyright: ignore[reportArgumentType]

  def for_tests_on(self, platform: str) -> str | None:
    if platform != "gpu" and self.interpret is not False:
      return f"{self.interpreter} off GPU: for tests, not speed"
    if self.interpret is True:  # kept on its own platform (`on`)
      return f"{self.interpreter} (interpret=True): for tests, not speed"
    return None

  def describe(self, call: registry.Call) -> str | None:
    return self.for_tests_on(call.platform)

  def __call__(self, q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
               soft_cap: float | None = None):
    return attention(q, k, v, layout, mask=mask, scale=scale, return_lse=return_lse,
                     tiling=self.tiling(q, k, v), soft_cap=soft_cap)

  def passes(self, mask: Mask, scale: float, soft_cap: float | None = None) -> Passes:
    return Passes(self, mask, float(scale), soft_cap)

  def ring_step(self, *, strategy: str, mask: Mask, scale: float, shards: int, axis: str,
                load_balance: bool, q_shape, kv_shape, layout: Layout,
                soft_cap: float | None = None) -> RingStep:
    if strategy != "ring":
      return super().ring_step(strategy=strategy, mask=mask, scale=scale, shards=shards,
                               axis=axis, load_balance=load_balance, q_shape=q_shape,
                               kv_shape=kv_shape, layout=layout, soft_cap=soft_cap)
    chunk = q_shape[1] // shards // 2 if load_balance else None
    return Step(self, mask, float(scale), chunk, soft_cap)
