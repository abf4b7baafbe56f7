"""Flash attention as Pallas kernels lowered by Triton for NVIDIA GPUs: the `pallas_gpu` kernel.

Three `pallas_call`s, forward, dQ and dK/dV, on the run-time block schedule of
`flaxattn.blocks` (the blockwise kernel's): each query block loops over its key blocks
(each key block over its query blocks in dK/dV) in two loops, the full blocks unmasked,
then the partial ones masked from segment ids and positions with the mask's own `allows`;
empty blocks are never visited. Neither loop branches, so Triton pipelines each loop's
reads ahead of its matmuls (`blocks.visit_order`). GQA folds the G query heads of a KV head
into the rows of a query block, ordered (token, group), so K/V are never repeated; each row
carries its token's segment id and position. Lowered for "gpu" it is compiled Triton
(`__gpu$xla.gpu.triton`); elsewhere it runs in Pallas interpret mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from flaxattn import aot, checks, registry, sharding
from flaxattn.blocks import block_schedule, round_up, visit_order
from flaxattn.layout import Layout
from flaxattn.masks import Mask, values_apart
from flaxattn.ring import RingStep

# Triton's dots take operands of at least 16 x 16, and its tensors have power-of-two sizes.
MIN_BLOCK = 16
MAX_HEAD_DIM = 256
MAX_WARPS = 32  # 1024 threads, the most a CUDA thread block holds
_DTYPES = ("float32", "bfloat16", "float16")


def _pow2(x: int) -> int:
  """The smallest power of two >= x, at least `MIN_BLOCK`."""
  return max(MIN_BLOCK, 1 << max(x - 1, 0).bit_length())


# Query rows of a block on Hopper GPUs in 16-bit dtypes up to D = 128 (`choose_tiling`): on
# an H200 (jax 0.11.2), causal bf16 at 32K, D=128, forward+backward ran at 270 TFLOP/s with
# 128 x 64 blocks against 138 with 64 x 64 (`python -m bench.gpu --tilings`); compiled for
# sm_90, its kernels fit the H100's 227 KiB of shared memory (`bench.triton_compile`).
HOPPER_ROWS = 128
# The float32 dots' precision on Hopper GPUs under each `jax_default_matmul_precision` (None:
# as JAX takes float32 on the platform, TF32 on GPUs): the full-precision settings run as
# three TF32 products (`TF32_TF32_F32_X3`, float32-level error), not Triton's IEEE path, whose
# FMA loops ran at 4.5 TFLOP/s on an H200 (`bench.gpu_goals`). Elsewhere the IEEE path stays:
# compiled for sm_89, the three-product dQ kernel needs 139,392 bytes of shared memory of
# 101,376 (`bench.triton_compile` under "highest").
FULL_PRECISION = ("highest", "float32", "F32_F32_F32")
THREE_TF32 = "TF32_TF32_F32_X3"


def default_block(head_dim: int, itemsize: int = 2) -> int:
  """Rows (and keys) of a block: a q, k or v tile of at most 64 x 128 bf16 (16 KiB), so
  64 up to D = 128 in bf16/f16 (32 at D = 256) and up to D = 64 in float32 (32 at 128, 16
  at 256). Triton's pipelined loops then keep the forward, dQ and dK/dV kernels within the
  99 KiB of shared memory of the smallest NVIDIA GPUs since Ampere (sm_86, sm_89): 99,072
  bytes at most, compiled for sm_80, sm_89 and sm_90 (`python -m bench.triton_compile`)."""
  return max(MIN_BLOCK, min(64, 64 * 256 // (itemsize * _pow2(head_dim))))


@dataclasses.dataclass(frozen=True)
class Tiling:
  """The kernels' static shape: `rows` query rows (a row is one query head of one token)
  and `keys` keys per block, Triton's warps and pipeline stages, and interpret mode."""

  rows: int
  keys: int
  num_warps: int = 4
  num_stages: int = 2
  interpret: bool = False
  float32_dots: str | None = None  # a `jax.default_matmul_precision` for the kernels' dots


# The kernels. Their refs hold one (batch, KV head)'s rows `[R, Dp]` or one block of them,
# keys `[S, Dp]` or one block, ids `[R]`/`[S]`, the block's row of the schedule and its
# visit bounds `[1]`.


def _dot(a, b, contract: tuple[int, int]):
  """A float32 matmul of 2-D `a` and `b` over axes `contract` (e.g. (1, 1): a @ b.T)."""
  return jax.lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                             preferred_element_type=jnp.float32)


def _scores(q, k, scale: float, soft_cap: float | None):
  """Scaled scores `[rows, keys]` float32, soft-capped, and tanh of the capped scores (None
  without a cap), whose 1 - tanh^2 the backward passes need."""
  s = _dot(q, k, (1, 1)) * scale
  if soft_cap is None:
    return s, None
  tanh = jnp.tanh(s / soft_cap)
  return soft_cap * tanh, tanh


def _allowed(mask: Mask, q_seg, kv_seg, q_pos, kv_pos):
  """`[rows, keys]` bool: the same non-zero segment id, and positions the mask allows."""
  same = (q_seg[:, None] == kv_seg[None, :]) & (q_seg[:, None] != 0)
  return same & mask.allows(q_pos[:, None], kv_pos[None, :])


def _visit(order_ref, full_ref, partial_ref, update, carry):
  """`update(masked, n, carry)` over the blocks n the schedule lists (`visit_order`): the
  full ones unmasked, then the partial ones masked, each in a loop of its own."""
  def loop(masked, start, stop, carry):
    def body(i, carry):
      return update(masked, order_ref[i].astype(jnp.int32), carry)
    return jax.lax.fori_loop(start, stop, body, carry)
  full = full_ref[0]
  return loop(True, full, full + partial_ref[0], loop(False, 0, full, carry))


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, q_pos_ref, kv_seg_ref, kv_pos_ref, order_ref,
                    full_ref, partial_ref, out_ref, lse_ref, *, mask, scale, soft_cap, keys):
  q, q_seg, q_pos = q_ref[...], q_seg_ref[...], q_pos_ref[...]
  rows, dv = q.shape[0], v_ref.shape[-1]

  def update(masked, j, carry):
    m, denom, acc = carry
    cols = pl.ds(j * keys, keys)
    s, _ = _scores(q, k_ref[cols, :], scale, soft_cap)
    v = v_ref[cols, :]
    if masked:
      allowed = _allowed(mask, q_seg, kv_seg_ref[cols], q_pos, kv_pos_ref[cols])
      s = jnp.where(allowed, s, -jnp.inf)
      v, seen_bad = values_apart(v, allowed)
    m_new = jnp.maximum(m, s.max(-1))
    # A row that has seen no allowed key keeps m = -inf; shift by 0 so exp gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[:, None])
    alpha = jnp.exp(m - m_safe)
    pv = _dot(p.astype(v.dtype), v, (1, 0))
    if masked:
      pv = jnp.where(seen_bad[:, None], jnp.nan, pv)
    return m_new, alpha * denom + p.sum(-1), alpha[:, None] * acc + pv

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, dv), jnp.float32))
  m, denom, acc = _visit(order_ref, full_ref, partial_ref, update, init)
  empty = denom == 0.0
  safe = jnp.where(empty, 1.0, denom)
  out_ref[...] = jnp.where(empty[:, None], 0.0, acc / safe[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(safe))


def _probs_and_grads(q, k, v, do, lse, delta, allowed, scale, soft_cap):
  """p and dS of one block (dS: the loss's gradient w.r.t. the scaled scores before the
  cap; the scale itself is applied to dQ and dK once, at the end), and k as dQ takes it.
  `allowed` (a partial block): masked-out keys' non-finite keys and values are zeroed, so
  they reach neither dP nor dQ."""
  if allowed is not None:
    ok = allowed()
    k, v = (values_apart(x, ok)[0] for x in (k, v))
  s, tanh = _scores(q, k, scale, soft_cap)
  if allowed is not None:
    s = jnp.where(ok, s, -jnp.inf)
  p = jnp.exp(s - lse[:, None])
  ds = p * (_dot(do, v, (1, 1)) - delta[:, None])
  if tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
    ds = ds * (1.0 - tanh * tanh)
  return p, ds, k


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, q_pos_ref, kv_seg_ref,
               kv_pos_ref, order_ref, full_ref, partial_ref, dq_ref, *, mask, scale, soft_cap,
               keys):
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  q_seg, q_pos = q_seg_ref[...], q_pos_ref[...]

  def update(masked, j, dq):
    cols = pl.ds(j * keys, keys)
    k = k_ref[cols, :]
    def allowed():
      return _allowed(mask, q_seg, kv_seg_ref[cols], q_pos, kv_pos_ref[cols])
    _, ds, k = _probs_and_grads(q, k, v_ref[cols, :], do, lse, delta,
                                allowed if masked else None, scale, soft_cap)
    return dq + _dot(ds.astype(k.dtype), k, (1, 0))

  dq = _visit(order_ref, full_ref, partial_ref, update, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, q_pos_ref, kv_seg_ref,
                kv_pos_ref, order_ref, full_ref, partial_ref, dk_ref, dv_ref, *, mask, scale,
                soft_cap, rows):
  k, v, kv_seg, kv_pos = k_ref[...], v_ref[...], kv_seg_ref[...], kv_pos_ref[...]

  def update(masked, i, carry):
    dk, dv = carry
    block = pl.ds(i * rows, rows)
    q, do = q_ref[block, :], do_ref[block, :]
    def allowed():
      return _allowed(mask, q_seg_ref[block], kv_seg, q_pos_ref[block], kv_pos)
    p, ds, _ = _probs_and_grads(q, k, v, do, lse_ref[block], delta_ref[block],
                                allowed if masked else None, scale, soft_cap)
    return dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv + _dot(p.astype(do.dtype), do, (0, 0))

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = _visit(order_ref, full_ref, partial_ref, update, init)
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# The wrapper: rows, padding, the schedule and the three calls.


@dataclasses.dataclass(frozen=True)
class _Operands:
  """A call in the kernels' layout: q `[B, K, Rp, Dp]` (rows (token, group) of each KV head,
  padded to whole blocks, head dim padded to a power of two), k `[B, K, Sp, Dp]`, v
  `[B, K, Sp, Dvp]`, ids per row and per key `[B, Rp]` / `[B, Sp]`, the block schedule
  `[B, nq, nk]` int8 and the tiling."""

  q_BKRD: jax.Array
  k_BKSD: jax.Array
  v_BKSD: jax.Array
  ids: tuple  # q_seg_BR, q_pos_BR, kv_seg_BS, kv_pos_BS
  kinds: jax.Array
  tiling: Tiling


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


def _to_rows(x, hkv: int, length: int, dim: int):
  """`[B, L, H, D]` -> `[B, K, length, dim]`: the rows (token, group) of each KV head, zero
  padded to `length` rows and `dim` features (for k and v, H = K: a row per token)."""
  b, n, h, d = x.shape
  x = jnp.moveaxis(x.reshape(b, n, hkv, h // hkv, d), 2, 1).reshape(b, hkv, n * (h // hkv), d)
  return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, dim - d)))


def _from_rows(x, n: int, h: int, d: int):
  """`[B, K, Rp, Dp]` -> `[B, n, h, d]`, the padding dropped."""
  b, hkv = x.shape[:2]
  x = x[:, :, :n * (h // hkv), :d].reshape(b, hkv, n, h // hkv, d)
  return jnp.moveaxis(x, 1, 2).reshape(b, n, h, d)


def _prepare(q, k, v, layout: Layout, mask: Mask, tiling: Tiling) -> _Operands:
  b, t, h, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  rows_pad, s_pad = round_up(t * (h // hkv), tiling.rows), round_up(s, tiling.keys)
  q_seg, q_pos, kv_seg, kv_pos = _ids(layout, b, t, s, h // hkv, rows_pad, s_pad)
  # int8: the schedule has (T x G / block_q) x (S / block_kv) entries per batch row.
  kinds = block_schedule(jnp, mask, q_seg, kv_seg, q_pos, kv_pos, tiling.rows,
                         tiling.keys).astype(np.int8)
  return _Operands(_to_rows(q, hkv, rows_pad, _pow2(d)), _to_rows(k, hkv, s_pad, _pow2(d)),
                   _to_rows(v, hkv, s_pad, _pow2(v.shape[-1])), (q_seg, q_pos, kv_seg, kv_pos),
                   kinds, tiling)


def _spec(x, block: int | None) -> pl.BlockSpec:
  """The BlockSpec of `x` on the grid (batch, KV head, n): `[B, K, L, ...]` per (batch, KV
  head) or `[B, L]` per batch row, cut along L into blocks of `block` (block n), or whole
  (None)."""
  lead = 2 if x.ndim >= 3 else 1
  tail = x.shape[lead + 1:]
  def index(b, h, n):
    return (b, h)[:lead] + (0 if block is None else n,) + (0,) * len(tail)
  return pl.BlockSpec((None,) * lead + (x.shape[lead] if block is None else block, *tail), index)


def _schedule_operands(kinds, axis: int):
  """The schedule for a grid over blocks of axis 3 - `axis` looping along `axis` (2: key
  blocks, 1: query blocks): each block's visiting order as `[B, n * m]` rows of m block
  indices, and its counts of full and of partial blocks `[B, n]` (`visit_order`)."""
  order, full, partial = visit_order(jnp, kinds, axis)
  return order.reshape(order.shape[0], -1), full, partial


def _pass(kernel, ops: _Operands, name: str, blocks: int, inputs, outputs):
  """One `pallas_call` on the grid (batch, KV head, `blocks`); `inputs` and `outputs` are
  (array or ShapeDtypeStruct, block size or None) pairs (see `_spec`)."""
  b, hkv = ops.q_BKRD.shape[:2]
  tiling = ops.tiling
  call = pl.pallas_call(
      kernel, grid=(b, hkv, blocks), in_specs=[_spec(x, n) for x, n in inputs],
      out_specs=[_spec(x, n) for x, n in outputs],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x, _ in outputs],
      compiler_params=pl_triton.CompilerParams(num_warps=tiling.num_warps,
                                               num_stages=tiling.num_stages),
      interpret=tiling.interpret, name=name)
  with (jax.default_matmul_precision(tiling.float32_dots) if tiling.float32_dots
        else contextlib.nullcontext()):  # the kernel is traced here
    return call(*[x for x, _ in inputs])


def _forward_rows(ops: _Operands, *, mask: Mask, scale: float, soft_cap: float | None):
  """out `[B, K, Rp, Dvp]` (q's dtype) and lse `[B, K, Rp]` float32: a grid over query
  blocks, each looping over its key-block range."""
  b, hkv, rows_pad, _ = ops.q_BKRD.shape
  rows, keys, nk = ops.tiling.rows, ops.tiling.keys, ops.kinds.shape[2]
  q_seg, q_pos, kv_seg, kv_pos = ops.ids
  order, full, partial = _schedule_operands(ops.kinds, axis=2)
  out = jax.ShapeDtypeStruct((b, hkv, rows_pad, ops.v_BKSD.shape[-1]), ops.q_BKRD.dtype)
  lse = jax.ShapeDtypeStruct((b, hkv, rows_pad), jnp.float32)
  kernel = functools.partial(_forward_kernel, mask=mask, scale=scale, soft_cap=soft_cap,
                             keys=keys)
  return _pass(kernel, ops, "flash_forward", rows_pad // rows,
               [(ops.q_BKRD, rows), (ops.k_BKSD, None), (ops.v_BKSD, None), (q_seg, rows),
                (q_pos, rows), (kv_seg, None), (kv_pos, None), (order, nk), (full, 1),
                (partial, 1)],
               [(out, rows), (lse, rows)])


def _backward_rows(ops: _Operands, out, lse, dout, dlse, *, mask: Mask, scale: float,
                   soft_cap: float | None):
  """dq `[B, K, Rp, Dp]`, dk `[B, K, Sp, Dp]`, dv `[B, K, Sp, Dvp]` given out, lse, dout and
  dlse as rows (`[B, K, Rp, Dvp]`, `[B, K, Rp]`)."""
  rows, keys = ops.tiling.rows, ops.tiling.keys
  nq, nk = ops.kinds.shape[1:]
  q_seg, q_pos, kv_seg, kv_pos = ops.ids
  # d lse / d s = p, so an lse cotangent shifts the softmax-Jacobian term row by row.
  delta = jnp.einsum("bkrd,bkrd->bkr", dout.astype(jnp.float32), out.astype(jnp.float32)) - dlse
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows with no key: every p is exp(-inf) = 0
  options = dict(mask=mask, scale=scale, soft_cap=soft_cap)

  def inputs(q_block, kv_block, visits):  # the operands of both passes, with their blocks
    return [(ops.q_BKRD, q_block), (ops.k_BKSD, kv_block), (ops.v_BKSD, kv_block),
            (dout, q_block), (lse, q_block), (delta, q_block), (q_seg, q_block),
            (q_pos, q_block), (kv_seg, kv_block), (kv_pos, kv_block),
            (visits[0], nk if q_block else nq), (visits[1], 1), (visits[2], 1)]

  # dQ: a grid over query blocks, each looping over its key-block range.
  dq = _pass(functools.partial(_dq_kernel, keys=keys, **options), ops, "flash_dq", nq,
             inputs(rows, None, _schedule_operands(ops.kinds, axis=2)), [(ops.q_BKRD, rows)])[0]
  # dK/dV: a grid over key blocks, each looping over its query-block range.
  dk, dv = _pass(functools.partial(_dkv_kernel, rows=rows, **options), ops, "flash_dkv", nk,
                 inputs(None, keys, _schedule_operands(ops.kinds, axis=1)),
                 [(ops.k_BKSD, keys), (ops.v_BKSD, keys)])
  return dq, dk, dv


def forward(q, k, v, layout: Layout, *, mask: Mask, scale: float, tiling: Tiling,
            soft_cap: float | None = None):
  """Forward pass without autodiff rules: out `[B, T, H, Dv]` (q dtype), lse `[B, T, H]` f32."""
  ops = _prepare(q, k, v, layout, mask, tiling)
  out, lse = _forward_rows(ops, mask=mask, scale=scale, soft_cap=soft_cap)
  t, h = q.shape[1:3]
  return _from_rows(out, t, h, v.shape[-1]), _from_rows(lse[..., None], t, h, 1)[..., 0]


def backward(q, k, v, layout: Layout, out, lse, dout, dlse, *, mask: Mask, scale: float,
             tiling: Tiling, soft_cap: float | None = None):
  """Gradients (dq, dk, dv) of the attention of q against k/v, given the rows' output `out`
  and log-sum-exp `lse` (which may cover more keys than k/v: the ring passes the merged
  result of every step) and their cotangents `dout`, `dlse` (float32 `[B, T, H]`)."""
  ops = _prepare(q, k, v, layout, mask, tiling)
  hkv, rows_pad = k.shape[2], ops.q_BKRD.shape[2]
  dvp = ops.v_BKSD.shape[-1]
  def rows(x, dim):
    return _to_rows(x, hkv, rows_pad, dim)
  dq, dk, dv = _backward_rows(
      ops, rows(out, dvp), rows(lse[..., None], 1)[..., 0], rows(dout, dvp),
      rows(dlse.astype(jnp.float32)[..., None], 1)[..., 0], mask=mask, scale=scale,
      soft_cap=soft_cap)
  t, h, d = q.shape[1:]
  s = k.shape[1]
  return (_from_rows(dq, t, h, d), _from_rows(dk, s, hkv, d),
          _from_rows(dv, s, hkv, v.shape[-1]))


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


def choose_tiling(q_shape, kv_shape, dv: int, *, itemsize: int = 2, block_q: int | None = None,
           block_kv: int | None = None, num_warps: int | None = None, num_stages: int = 2,
           interpret: bool = False, chunk: int | None = None,
           capability: tuple[int, ...] | None = None,
           precision: str | None = None) -> Tiling:
  """The tiling of a call on q `[B, T, H, D]` and k `[B, S, Hkv, D]` (v's head dim `dv`,
  `itemsize` bytes an element): the requested block sizes fitted to the rows (T x G) and
  keys. Defaults: `default_block`, except query blocks of `HOPPER_ROWS` rows on GPUs of
  compute `capability` 9.0 or later in 16-bit dtypes up to head dim 128 (measured on an
  H200: twice the throughput of 64-row blocks, docs/kernels.md).
  `chunk`: tokens in a load-balanced chunk of a shard; blocks then divide it where they can,
  as a block straddling two chunks covers distant positions and is rarely skipped.
  `precision`: `jax_default_matmul_precision` where the call is traced; float32 under a
  full-precision one (`FULL_PRECISION`) takes three TF32 products on Hopper (`Tiling`)."""
  t, h, d = q_shape[1:]
  s, hkv = kv_shape[1:3]
  default = default_block(max(d, dv), itemsize)
  hopper = capability is not None and capability >= (9, 0)
  rows_default = HOPPER_ROWS if hopper and itemsize <= 2 and max(d, dv) <= 128 else default

  def fit(requested, length, unit):
    block = min(_pow2(requested), _pow2(length))
    while unit is not None and block > MIN_BLOCK and unit % block:
      block //= 2
    return block
  g = h // hkv
  warps = num_warps or (4 if _pow2(max(d, dv)) <= 64 else 8)
  return Tiling(fit(block_q or rows_default, t * g, None if chunk is None else chunk * g),
                fit(block_kv or default, s, chunk), warps, num_stages, interpret,
                THREE_TF32 if hopper and itemsize == 4 and precision in FULL_PRECISION
                else None)


def pallas_gpu_attention(q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
                         tiling: Tiling, soft_cap: float | None = None):
  """Flash attention with block skipping, as Pallas Triton kernels.

  Args:
    q: `[B, T, H, D]`; k: `[B, S, Hkv, D]`, v: `[B, S, Hkv, Dv]` (H a multiple of Hkv),
      float32, bfloat16 or float16; scores, softmax and accumulation are float32.
    layout: segment ids / positions (None fields are defaults; all-None gives a static
      schedule).
    tiling: block sizes and Triton options (`choose_tiling`); T and S need not divide.
    soft_cap: scores become `soft_cap * tanh(scores / soft_cap)` (after the scale), or None.
  Returns:
    `[B, T, H, Dv]` in q's dtype; with `return_lse` also lse `[B, T, H]` float32
    (-inf where a query has nothing to attend to; its output and gradients are zero).
  """
  def attend(q, k, v, layout):
    return _attention(q, k, v, layout, mask, float(scale), tiling, soft_cap)
  attend = sharding.per_batch_and_head(attend, q.shape, k.shape[2], layout)
  out, lse = attend(q, k, v, layout)
  return (out, lse) if return_lse else out


@functools.partial(jax.tree_util.register_dataclass, data_fields=[],
                   meta_fields=["kernel", "mask", "scale", "chunk", "soft_cap"])
@dataclasses.dataclass(frozen=True)
class PallasGpuStep(RingStep):
  """The Pallas GPU passes as the ring's per-device step: the same kernels at every step,
  the block schedule from the visiting keys' ids, blocks fitted to the load-balanced chunks
  of `chunk` tokens (None: not load balanced)."""

  kernel: PallasGpu
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

  def _tiling(self, q, k, v) -> Tiling:
    return self.kernel.tiling(q, k, v, self.chunk)

  def forward(self, step, q, k, v, layout):
    return forward(q, k, v, layout, mask=self.mask, scale=self.scale,
                   tiling=self._tiling(q, k, v), soft_cap=self.soft_cap)

  def backward(self, step, q, k, v, layout, out, lse, dout, dlse):
    return backward(q, k, v, layout, out, lse, dout, dlse, mask=self.mask, scale=self.scale,
                    tiling=self._tiling(q, k, v), soft_cap=self.soft_cap)


@dataclasses.dataclass(frozen=True)
class Passes:
  """The Pallas GPU passes as `checked.Passes` (`operands` unused; no lse cotangent is a
  zero one): what cuDNN falls back on for a batch it cannot serve exactly, on a GPU."""

  kernel: PallasGpu
  mask: Mask
  scale: float
  soft_cap: float | None = None

  def forward(self, operands, q, k, v, layout: Layout):
    return forward(q, k, v, layout, mask=self.mask, scale=self.scale,
                   tiling=self.kernel.tiling(q, k, v),
                   soft_cap=self.soft_cap)

  def backward(self, operands, q, k, v, layout: Layout, out, lse, dout, dlse):
    dlse = jnp.zeros(lse.shape, jnp.float32) if dlse is None else dlse
    dq, dk, dv = backward(q, k, v, layout, out, lse, dout, dlse, mask=self.mask,
                          scale=self.scale, tiling=self.kernel.tiling(q, k, v),
                          soft_cap=self.soft_cap)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@dataclasses.dataclass(frozen=True)
class PallasGpu(registry.Kernel):
  """`backend="pallas_gpu"`: flash attention in Pallas, compiled by Triton on NVIDIA GPUs
  (interpret mode elsewhere); every mask, packed rows, GQA, soft cap, Dv != D and the ring.

  `block_q`: query rows per block (a row is one query head of one token: a KV head's G
  query heads fold into rows) and `block_kv`: keys per block, powers of two >= 16 (None:
  `default_block` of the head dim and dtype), fitted to the sequence. `num_warps` (None: 4 up to
  head dim 64, else 8) and `num_stages` go to Triton. `interpret`: Pallas interpret mode;
  None decides by the platform the program is lowered for (compiled on GPU, interpret mode
  elsewhere).

  Raises:
    ValueError: a block size not a power of two >= 16, `num_warps` not a power of two from
      1 to 32, `num_stages` below 1, `interpret` not a bool or None (each also for a bool,
      float or string where an int is expected).
  """

  block_q: int | None = None
  block_kv: int | None = None
  num_warps: int | None = None
  num_stages: int = 2
  interpret: bool | None = None
  name: str = "pallas_gpu"
  ring: bool = True
  soft_cap: bool = True

  def __post_init__(self):
    for arg in ("block_q", "block_kv"):
      value = getattr(self, arg)
      if value is not None:
        checks.integer(f"PallasGpu({arg}=...)", value, f"a power of two >= {MIN_BLOCK} or None"
                       " (Triton's tensors and dots)", lambda x: x >= MIN_BLOCK and not x & (x - 1))
    if self.num_warps is not None:
      checks.integer("PallasGpu(num_warps=...)", self.num_warps, f"a power of two from 1 to"
                     f" {MAX_WARPS} or None (Triton's warps per program)",
                     lambda x: 1 <= x <= MAX_WARPS and not x & (x - 1), "None picks 4 or 8")
    checks.integer("PallasGpu(num_stages=...)", self.num_stages, "a positive int (Triton's"
                   " pipeline stages)", lambda x: x >= 1, "2 is the default")
    if self.interpret is not None:
      checks.boolean("PallasGpu(interpret=...)", self.interpret,
                     "None decides by the platform")

  def on(self, platform: str) -> PallasGpu:
    # Interpret mode off its platform; on it, as asked (None: compiled).
    return dataclasses.replace(self, interpret=platform != "gpu" or self.interpret is True)

  def reason(self, call: registry.Call) -> str | None:
    if call.dtype not in _DTYPES:
      return (f"pallas_gpu takes {', '.join(_DTYPES)} (Triton's dots), got {call.dtype}; cast"
              " q, k, v or use 'blockwise'.")
    d = call.q_shape[-1]
    if max(d, call.dv) > MAX_HEAD_DIM:
      return (f"pallas_gpu's tiles are sized for head dims up to {MAX_HEAD_DIM}, got D={d},"
              f" Dv={call.dv}; the blockwise kernel serves wider heads.")
    return None

  def for_tests_on(self, platform: str) -> str | None:
    if platform != "gpu" and self.interpret is not False:
      return "Pallas interpret mode off GPU: for tests, not speed"
    if self.interpret is True:  # kept on its own platform (`on`)
      return "Pallas interpret mode (interpret=True): for tests, not speed"
    return None

  def describe(self, call: registry.Call) -> str | None:
    return self.for_tests_on(call.platform)

  def tiling(self, q, k, v, chunk: int | None = None) -> Tiling:
    """This kernel's `Tiling` for these operands (`choose_tiling`)."""
    interpret = jax.default_backend() != "gpu" if self.interpret is None else self.interpret
    capability = None if interpret else aot.traced_gpu_capability()
    precision = jax.config.jax_default_matmul_precision  # pyright: ignore[reportAttributeAccessIssue]
    return choose_tiling(q.shape, k.shape, v.shape[-1], itemsize=jnp.dtype(q.dtype).itemsize,
                         block_q=self.block_q, block_kv=self.block_kv,
                         num_warps=self.num_warps, num_stages=self.num_stages,
                         interpret=interpret, chunk=chunk, capability=capability,
                         precision=precision)

  def __call__(self, q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
               soft_cap: float | None = None):
    return pallas_gpu_attention(q, k, v, layout, mask=mask, scale=scale, return_lse=return_lse,
                                tiling=self.tiling(q, k, v),
                                soft_cap=soft_cap)

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
    return PallasGpuStep(self, mask, float(scale), chunk, soft_cap)
