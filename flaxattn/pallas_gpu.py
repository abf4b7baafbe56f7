"""Flash attention as Pallas kernels lowered by Triton for NVIDIA GPUs: the `pallas_gpu` kernel.

Three `pallas_call`s, forward, dQ and dK/dV, on the run-time block schedule of
`flaxattn.blocks` (the blockwise kernel's): each query block loops over its key blocks
(each key block over its query blocks in dK/dV) in two loops, the full blocks unmasked,
then the partial ones masked from segment ids and the mask itself (`masks.allowed`: a
MaskMod's function evaluated on the block); empty blocks are never visited. A score mod
changes every block's scores; the mods read their operands by gathers, and dQ adds the
score mod's operands' gradients by atomic adds (`flaxattn.rows`, `Mods`). Neither loop
branches, so Triton pipelines each loop's
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jax.ref import addupdate

from flaxattn import aot, checks, registry
from flaxattn.blocks import round_up, visit_order
from flaxattn.masks import Coords, values_apart
from flaxattn.mods import ScoreMod, change_scores
from flaxattn.rows import Bound, Ids, Mods, RowKernel, Rows

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

  # `rows.RowTiling`: whole blocks, head dims padded to a power of two (Triton's tensors).
  def padding(self, rows: int, keys: int, d: int, dv: int) -> tuple[int, int, int, int]:
    return round_up(rows, self.rows), round_up(keys, self.keys), _pow2(d), _pow2(dv)

  @property
  def unit(self) -> tuple[int, int]:  # every pass's blocks
    return self.rows, self.keys

  def forward(self, rows: Rows, *, score_mod: ScoreMod | None, scale: float,
              soft_cap: float | None):
    return _forward_rows(rows, self, score_mod=score_mod, scale=scale, soft_cap=soft_cap)

  def backward(self, rows: Rows, lse, dout, delta, *, score_mod: ScoreMod | None, scale: float,
               soft_cap: float | None):
    return _backward_rows(rows, self, lse, dout, delta, score_mod=score_mod, scale=scale,
                          soft_cap=soft_cap)


# The kernels. Their refs hold one (batch, KV head)'s rows `[R, Dp]` or one block of them,
# keys `[S, Dp]` or one block, ids `[R]`/`[S]`, the block's row of the schedule and its
# visit bounds `[1]`.


def _dot(a, b, contract: tuple[int, int]):
  """A float32 matmul of 2-D `a` and `b` over axes `contract` (e.g. (1, 1): a @ b.T)."""
  return jax.lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                             preferred_element_type=jnp.float32)


def _scores(q, k, scale: float, soft_cap: float | None, mod=None):
  """Scaled scores `[rows, keys]` float32 as the softmax reads them before masking
  (`mods.change_scores`: soft-capped, then changed by `mod`), and their pullback for the
  backward passes."""
  return change_scores(_dot(q, k, (1, 1)) * scale, soft_cap, mod)


def _program():
  """The program's (batch row, KV head), read at the kernel's top: Pallas interpret mode
  resolves program ids there, not inside a loop's body."""
  return pl.program_id(0), pl.program_id(1)


def _place(x, side: int):
  """A row's (side 0) or key's (side 1) vector on a block's `[rows, keys]` axes."""
  return x[:, None] if side == 0 else x[None, :]


def _ids(block, seg_ref, pos_ref, index_ref=None, head_ref=None) -> Ids:
  """The `Ids` of a block (`pl.ds`, or `slice(None)` for the whole block the program holds)."""
  return Ids.load(lambda ref: ref[block], seg_ref, pos_ref, index_ref, head_ref)


def _allowed(at: Bound, where: Coords, rows: Ids, keys: Ids):
  """`[rows, keys]` bool: the same non-zero segment id, and the mask allows the pair."""
  return at.allowed(where, rows, keys, _place)


def _block_mods(at: Bound, masked: bool, program, groups: int, load_ids,
                backward: bool = False, reads: list | None = None):
  """What a block needs of the mask and score mod: its `allowed` (a function; None for a
  full block) and score `mod` (`Bound.mod`, for a `backward` pass, `reads` collecting its
  reads; None without a score mod). `load_ids()` gives the rows' and keys' `Ids`, loaded
  only where something reads them (a full block without a score mod reads no ids)."""
  if not masked and at.score_mod is None:
    return None, None
  rows, keys = load_ids()
  where = at.coords(program, groups, rows, keys, _place)
  allowed = (lambda: _allowed(at, where, rows, keys)) if masked else None
  return allowed, at.mod(where, backward, reads)


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
                    full_ref, partial_ref, *refs, mods: Mods, scale, soft_cap, keys, groups):
  *mod_refs, out_ref, lse_ref = refs
  at, program = mods.bind(mod_refs), _program()
  q = q_ref[...]
  rows = _ids(slice(None), q_seg_ref, q_pos_ref, at.q_index_ref, at.q_head_ref)
  dv = v_ref.shape[-1]

  def update(masked, j, carry):
    m, denom, acc = carry
    cols = pl.ds(j * keys, keys)
    allowed, mod = _block_mods(at, masked, program, groups, lambda: (rows, _ids(
        cols, kv_seg_ref, kv_pos_ref, at.kv_index_ref)))
    s, _ = _scores(q, k_ref[cols, :], scale, soft_cap, mod)
    v = v_ref[cols, :]
    if allowed is not None:
      allowed = allowed()
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

  init = (jnp.full((q.shape[0],), -jnp.inf, jnp.float32),
          jnp.zeros((q.shape[0],), jnp.float32), jnp.zeros((q.shape[0], dv), jnp.float32))
  m, denom, acc = _visit(order_ref, full_ref, partial_ref, update, init)
  empty = denom == 0.0
  safe = jnp.where(empty, 1.0, denom)
  out_ref[...] = jnp.where(empty[:, None], 0.0, acc / safe[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(safe))


def _probs_and_grads(q, k, v, do, lse, delta, allowed, scale, soft_cap, mod):
  """p and dS of one block (dS: the loss's gradient w.r.t. the scaled scores before the
  cap; the scale itself is applied to dQ and dK once, at the end), k as dQ takes it, and
  the gradients of the score mod's float reads (`mods.change_scores`), and q as dK takes
  it. `allowed` (a partial block): masked-out keys' non-finite keys and values are zeroed,
  so they reach neither dP nor dQ; an excluded pair's dS is 0 even where dP overflowed (a
  huge value: 0 x inf would be NaN); a non-finite query row is zeroed for dK, where its
  excluded pairs' dS (0) would carry it (its allowed pairs' dS are NaN already)."""
  q_dk = q
  if allowed is not None:
    ok = allowed()
    k, v = (values_apart(x, ok)[0] for x in (k, v))
    bad_R = jnp.sum(q.astype(jnp.float32) * 0.0, axis=-1) != 0.0  # NaN or inf in the row
    q_dk = jnp.where(bad_R[:, None], jnp.zeros((), q.dtype), q)
  s, back = _scores(q, k, scale, soft_cap, mod)
  if allowed is not None:
    s = jnp.where(ok, s, -jnp.inf)
  p = jnp.exp(s - lse[:, None])
  ds, d_reads = back(p * (_dot(do, v, (1, 1)) - delta[:, None]))
  if allowed is not None:
    ds = jnp.where(ok, ds, 0.0)
  return p, ds, q_dk, k, d_reads


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, q_pos_ref, kv_seg_ref,
               kv_pos_ref, order_ref, full_ref, partial_ref, *refs, mods: Mods, scale, soft_cap,
               keys, groups):
  # The score mod's gradients are added into outputs aliased to zeros inputs (`_pass`).
  n = mods.floats
  mod_refs, dq_ref, grad_refs = refs[:len(refs) - 1 - 2 * n], refs[-1 - n], refs[len(refs) - n:]
  at, program = mods.bind(mod_refs), _program()
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  rows = _ids(slice(None), q_seg_ref, q_pos_ref, at.q_index_ref, at.q_head_ref)

  def update(masked, j, dq):
    cols = pl.ds(j * keys, keys)
    reads = []
    allowed, mod = _block_mods(at, masked, program, groups, lambda: (rows, _ids(
        cols, kv_seg_ref, kv_pos_ref, at.kv_index_ref)), True, reads)
    _, ds, _, k, d_reads = _probs_and_grads(q, k_ref[cols, :], v_ref[cols, :], do, lse,
                                            delta, allowed, scale, soft_cap, mod)
    # Each read's gradient is added at the indices it read, which elements of a block and
    # other programs share: atomic adds in Triton, a scatter-add in interpret mode
    # (`addupdate`; interpret mode's `pl_triton.atomic_add` counts an index that
    # repeats within one add once).
    for (operand, index), d in zip(reads, d_reads, strict=True):
      addupdate(grad_refs[operand], (0, *index), d)
    return dq + _dot(ds.astype(k.dtype), k, (1, 0))

  dq = _visit(order_ref, full_ref, partial_ref, update, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, q_pos_ref, kv_seg_ref,
                kv_pos_ref, order_ref, full_ref, partial_ref, *refs, mods: Mods, scale, soft_cap,
                rows, groups):
  *mod_refs, dk_ref, dv_ref = refs
  at, program = mods.bind(mod_refs), _program()
  k, v = k_ref[...], v_ref[...]
  keys = _ids(slice(None), kv_seg_ref, kv_pos_ref, at.kv_index_ref)

  def update(masked, i, carry):
    dk, dv = carry
    block = pl.ds(i * rows, rows)
    q, do = q_ref[block, :], do_ref[block, :]
    allowed, mod = _block_mods(at, masked, program, groups, lambda: (_ids(
        block, q_seg_ref, q_pos_ref, at.q_index_ref, at.q_head_ref), keys), True)
    p, ds, q_dk, _, _ = _probs_and_grads(q, k, v, do, lse_ref[block], delta_ref[block],
                                         allowed, scale, soft_cap, mod)
    return (dk + _dot(ds.astype(q.dtype), q_dk, (0, 0)),
            dv + _dot(p.astype(do.dtype), do, (0, 0)))

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = _visit(order_ref, full_ref, partial_ref, update, init)
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# The three calls on rows (`flaxattn.rows`).

WHOLE = "whole"  # a `_spec` block: the whole array for every program (an operand, its gradient)


def _spec(x, block: int | str | None) -> pl.BlockSpec:
  """The BlockSpec of `x` on the grid (batch, KV head, n): `[B, K, L, ...]` per (batch, KV
  head) or `[B, L]` per batch row, cut along L into blocks of `block` (block n), or whole
  (None); or `x` whole for every program (`WHOLE`)."""
  if isinstance(block, str):  # WHOLE
    return pl.BlockSpec(x.shape, lambda b, h, n: (0,) * x.ndim)
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


def _pass(kernel, ops: Rows, tiling: Tiling, name: str, blocks: int, inputs, outputs,
          added=()):
  """One `pallas_call` on the grid (batch, KV head, `blocks`); `inputs` and `outputs` are
  (array or ShapeDtypeStruct, block size or None) pairs (see `_spec`). `added`: float32
  arrays the kernel adds into whole (atomic adds), outputs after `outputs`, each aliased
  to an input of its initial value after `inputs`."""
  b, hkv = ops.q_BKRD.shape[:2]
  inputs = [*inputs, *((x, WHOLE) for x in added)]
  outputs = [*outputs, *((x, WHOLE) for x in added)]
  call = pl.pallas_call(
      kernel, grid=(b, hkv, blocks), in_specs=[_spec(x, n) for x, n in inputs],
      out_specs=[_spec(x, n) for x, n in outputs],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x, _ in outputs],
      input_output_aliases={len(inputs) - len(added) + i: len(outputs) - len(added) + i
                            for i in range(len(added))},
      compiler_params=pl_triton.CompilerParams(num_warps=tiling.num_warps,
                                               num_stages=tiling.num_stages),
      interpret=tiling.interpret, name=name)
  with (jax.default_matmul_precision(tiling.float32_dots) if tiling.float32_dots
        else contextlib.nullcontext()):  # the kernel is traced here
    return call(*[x for x, _ in inputs])


def _mod_inputs(mods: Mods, ops: Rows, row_block: int | None, key_block: int | None):
  """`mods.inputs` with their blocks: rows' and keys' ids as `row_block` and `key_block`,
  the rest whole."""
  found = mods.inputs(ops.toks)
  return [(x, n) for x, n in zip(found, [row_block, row_block, key_block], strict=False)] + [
      (x, WHOLE) for x in found[3:]]


def _forward_rows(ops: Rows, tiling: Tiling, *, score_mod: ScoreMod | None, scale: float,
                  soft_cap: float | None):
  """out `[B, K, Rp, Dvp]` (q's dtype) and lse `[B, K, Rp]` float32: a grid over query
  blocks, each looping over its key-block range."""
  b, hkv, rows_pad, _ = ops.q_BKRD.shape
  rows, keys = tiling.rows, tiling.keys
  kinds = ops.kinds(rows, keys)
  nk = kinds.shape[2]
  toks = ops.toks
  mods = Mods(ops.mask, score_mod)
  order, full, partial = _schedule_operands(kinds, axis=2)
  out = jax.ShapeDtypeStruct((b, hkv, rows_pad, ops.v_BKSD.shape[-1]), ops.q_BKRD.dtype)
  lse = jax.ShapeDtypeStruct((b, hkv, rows_pad), jnp.float32)
  kernel = functools.partial(_forward_kernel, mods=mods, scale=scale, soft_cap=soft_cap,
                             keys=keys, groups=toks.groups)
  return _pass(kernel, ops, tiling, "flash_forward", rows_pad // rows,
               [(ops.q_BKRD, rows), (ops.k_BKSD, None), (ops.v_BKSD, None), (toks.q_seg, rows),
                (toks.q_pos, rows), (toks.kv_seg, None), (toks.kv_pos, None), (order, nk),
                (full, 1), (partial, 1), *_mod_inputs(mods, ops, rows, None)],
               [(out, rows), (lse, rows)])


def _backward_rows(ops: Rows, tiling: Tiling, lse, dout, delta, *, score_mod: ScoreMod | None,
                   scale: float, soft_cap: float | None):
  """dq `[B, K, Rp, Dp]`, dk `[B, K, Sp, Dp]`, dv `[B, K, Sp, Dvp]` and the score mod's
  operands' gradients (`RowTiling.backward`)."""
  rows, keys = tiling.rows, tiling.keys
  kinds = ops.kinds(rows, keys)
  nq, nk = kinds.shape[1:]
  toks = ops.toks
  mods = Mods(ops.mask, score_mod)
  options = dict(mods=mods, scale=scale, soft_cap=soft_cap, groups=toks.groups)

  def inputs(q_block, kv_block, visits):  # the operands of both passes, with their blocks
    return [(ops.q_BKRD, q_block), (ops.k_BKSD, kv_block), (ops.v_BKSD, kv_block),
            (dout, q_block), (lse, q_block), (delta, q_block), (toks.q_seg, q_block),
            (toks.q_pos, q_block), (toks.kv_seg, kv_block), (toks.kv_pos, kv_block),
            (visits[0], nk if q_block else nq), (visits[1], 1), (visits[2], 1),
            *_mod_inputs(mods, ops, q_block, kv_block)]

  # dQ: a grid over query blocks, each looping over its key-block range; it adds the score
  # mod's operands' gradients, each with a leading axis of one (Triton's lowering adds into
  # no 0-d ref).
  dq, *d_ops = _pass(functools.partial(_dq_kernel, keys=keys, **options), ops, tiling,
                     "flash_dq", nq, inputs(rows, None, _schedule_operands(kinds, axis=2)),
                     [(ops.q_BKRD, rows)], [x[None] for x in mods.gradients()])
  # dK/dV: a grid over key blocks, each looping over its query-block range.
  dk, dv = _pass(functools.partial(_dkv_kernel, rows=rows, **options), ops, tiling, "flash_dkv",
                 nk, inputs(None, keys, _schedule_operands(kinds, axis=1)),
                 [(ops.k_BKSD, keys), (ops.v_BKSD, keys)])
  return dq, dk, dv, [x[0] for x in d_ops]


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


@dataclasses.dataclass(frozen=True)
class PallasGpu(RowKernel):
  """`backend="pallas_gpu"`: flash attention in Pallas, compiled by Triton on NVIDIA GPUs
  (interpret mode elsewhere); every mask, programmable masks and scores (`flaxattn.mods`),
  packed rows, GQA, soft cap, Dv != D and the ring.

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
  interpreter = "Pallas interpret mode"
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

  def reason(self, call: registry.Call) -> str | None:
    if call.dtype not in _DTYPES:
      return (f"pallas_gpu takes {', '.join(_DTYPES)} (Triton's dots), got {call.dtype}; cast"
              " q, k, v or use 'blockwise'.")
    d = call.q_shape[-1]
    if max(d, call.dv) > MAX_HEAD_DIM:
      return (f"pallas_gpu's tiles are sized for head dims up to {MAX_HEAD_DIM}, got D={d},"
              f" Dv={call.dv}; the blockwise kernel serves wider heads.")
    return self.mods_reason(call)

  def tiling(self, q, k, v, chunk: int | None = None) -> Tiling:
    """This kernel's `Tiling` for these operands (`choose_tiling`)."""
    interpret = self.interpreted()
    capability = None if interpret else aot.traced_gpu_capability()
    precision = jax.config.jax_default_matmul_precision  # pyright: ignore[reportAttributeAccessIssue]
    return choose_tiling(q.shape, k.shape, v.shape[-1], itemsize=jnp.dtype(q.dtype).itemsize,
                         block_q=self.block_q, block_kv=self.block_kv,
                         num_warps=self.num_warps, num_stages=self.num_stages,
                         interpret=interpret, chunk=chunk, capability=capability,
                         precision=precision)
