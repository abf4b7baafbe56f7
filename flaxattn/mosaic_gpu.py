"""Flash attention for Hopper GPUs as warp-specialized Mosaic GPU kernels: the `mosaic_gpu` kernel.

Three kernels, forward, dQ and dK/dV, on pallas_gpu's run-time block schedule
(`flaxattn.blocks`) and its rows (`flaxattn.rows`: a KV head's G query heads fold into rows).
A thread block holds three warpgroups: a producer that copies with TMA the blocks the
schedule lists into a ring of `stages` shared-memory slots (FULL blocks first, then PARTIAL;
EMPTY blocks are never loaded), and two consumers of 64 rows each (keys, in dK/dV) that
multiply with WGMMA on the tensor cores and mask the partial blocks from segment ids and
the mask itself (`masks.allowed`), as blockwise and pallas_gpu do; a score mod changes every
block's scores. The mods read their operands at one index per block (scalar loads: its
lowering has no gather), and dQ sums a score mod's operands' gradients per row
(`_backward`). In the forward the
consumers take turns on the tensor cores (a barrier both arrive at twice a block), so one's
softmax runs beside the other's matmuls.

Lowered for "gpu" it is a Mosaic GPU kernel for sm_90a (`mosaic_gpu_v2`); elsewhere it runs
in JAX's GPU interpret mode (jax 0.12 on), which simulates shared memory, barriers, TMA and
WGMMA on the CPU. The kernels are written in the form it runs: both operands of every WGMMA
in shared memory (the forward's probabilities too: it reads no register operand), and the
forward's rescaled output accumulator carried in registers, each block's product added to
it (it runs no `run_state` accumulator); dQ and dK/dV accumulate in place. A NaN or inf in
a key or value reaches only the rows allowed to see it, and no gradient where no row sees
it, as in blockwise and pallas_gpu (`_apart`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flaxattn import aot, checks, registry
from flaxattn.blocks import round_up, visit_order
from flaxattn.mods import ScoreMod, batch_reads, change_scores
from flaxattn.rows import Bound, Ids, Mods, RowKernel, Rows

ROWS = 64  # a consumer warpgroup's rows (WGMMA's M): query rows, or keys in dK/dV
CONSUMERS = 2  # consumer warpgroups of a thread block, beside its producer
TILE = ROWS * CONSUMERS  # the rows (keys, in dK/dV) of a thread block
DIM_UNIT = 64  # head dims pad to a multiple: a 128-byte swizzled row of 16-bit elements
# dK/dV keeps two accumulators of 64 x D float32 per consumer: 128 registers a thread at 128.
MAX_HEAD_DIM = 128
MAX_BLOCK = 256  # WGMMA's largest N
# Registers a thread, set when the warpgroups part (setmaxnreg): the 65,536 of an SM split
# between two consumers and a producer that only issues copies (as FA3 splits them).
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 240, 24
_DTYPES = ("bfloat16", "float16")
# GPU interpret mode runs these kernels from jax 0.12 on: jax 0.10.2's interpreter cannot
# read a transposed shared-memory operand of WGMMA (q @ k.T).
INTERPRET_JAX = (0, 12)
_LOG2E = math.log2(math.e)
_WGMMA = plgpu.Layout.WGMMA
_ROW = _WGMMA.reduce(1)  # a value per row of a WGMMA tile
_COL = _WGMMA.reduce(0)  # a value per column
# jax 0.10's `plgpu.load(ref, idx)`; 0.12's `plgpu.load(ref.at[idx])`.
_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters
_ACC = plgpu.ACC  # pyright: ignore[reportPrivateImportUsage] (WGMMA's accumulator type)


def _cpu_devices() -> int:
  """This process's CPU devices, which interpret mode runs on."""
  return len(jax.devices("cpu"))


def _interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


@dataclasses.dataclass(frozen=True)
class Tiling:
  """The kernels' static shape (a `rows.RowTiling`): keys per block of the forward
  (`keys`) and of dQ (`dq_keys`), each consumer's 64 rows against them; query rows per
  block of dK/dV (`dkv_rows`), each consumer's 64 keys against them; `stages`
  shared-memory slots the producer fills ahead; GPU interpret mode. The defaults are the
  largest blocks whose kernels compile for sm_90 at D = 128 without spilling registers
  (`python -m bench.mosaic_compile`)."""

  keys: int = 128
  dq_keys: int = 64
  dkv_rows: int = 64
  stages: int = 2
  interpret: bool = False

  def padding(self, rows: int, keys: int, d: int, dv: int) -> tuple[int, int, int, int]:
    return (round_up(rows, math.lcm(TILE, self.dkv_rows)),
            round_up(keys, math.lcm(TILE, self.keys, self.dq_keys)),
            round_up(d, DIM_UNIT), round_up(dv, DIM_UNIT))

  @property
  def unit(self) -> tuple[int, int]:  # the passes' blocks divide into these
    return (math.gcd(TILE, self.dkv_rows), math.gcd(TILE, self.keys, self.dq_keys))

  def forward(self, rows: Rows, *, score_mod: ScoreMod | None, scale: float,
              soft_cap: float | None):
    return _forward(rows, self, score_mod=score_mod, scale=scale, soft_cap=soft_cap)

  def backward(self, rows: Rows, lse, dout, delta, *, score_mod: ScoreMod | None, scale: float,
               soft_cap: float | None):
    return _backward(rows, self, lse, dout, delta, score_mod=score_mod, scale=scale,
                     soft_cap=soft_cap)


# Pieces of the three kernels.


def _load(ref, layout):
  """`ref` (shared or global memory) into registers in `layout`."""
  if _LOAD_TAKES_INDEX:
    return plgpu.load(ref, (), layout=layout, optimized=False)  # pyright: ignore[reportCallIssue]
  return plgpu.load(ref, layout=layout, optimized=False)  # pyright: ignore[reportCallIssue]


def _smem(shape, dtype):
  """Shared memory for a WGMMA operand: tiled and swizzled as its minor dim allows."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(shape[-1] * bits)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle * 8 // bits)),
                                              plgpu.SwizzleTransform(swizzle)))


def _matmul(a, b, shape, meanwhile=None):
  """a @ b (shared-memory operands; b may be `.T`) as float32 `shape` in registers;
  `meanwhile()` runs while the tensor cores multiply."""
  def body(acc):
    plgpu.wgmma(acc, a, b)
    if meanwhile is not None:
      meanwhile()
    return acc[...]
  return pl.run_scoped(body, _ACC(shape, jnp.float32))


def _accumulated(loop, *shapes):
  """The float32 accumulators of `shapes` (zeros) that `loop(*accumulators)` adds WGMMA
  products into in place, as registers once it is done, and what `loop` returns."""
  def body(*accumulators):
    out = loop(*accumulators)
    return tuple(acc[...] for acc in accumulators), out
  return pl.run_scoped(body, *(_ACC(shape, jnp.float32) for shape in shapes))


def _spread(x, shape, axis: int):
  """A row (axis 0) or column (axis 1) vector broadcast to a WGMMA tile of `shape`."""
  return lax.broadcast_in_dim(x, shape, [axis])


def _scores(s, scale: float, soft_cap: float | None, mod=None):
  """Scores in log2 units (exp2 of them is e^(scale x s), soft-capped, changed by `mod`:
  `mods.change_scores`) and their pullback for the backward passes. Without a score mod
  the scale (and cap) fold into one multiply with log2(e)."""
  if mod is not None:
    s, back = change_scores(s * scale, soft_cap, mod)
    return s * _LOG2E, back
  if soft_cap is None:
    return s * (scale * _LOG2E), lambda ds: (ds, [])
  tanh = jnp.tanh(s * (scale / soft_cap))
  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
  return tanh * (soft_cap * _LOG2E), lambda ds: (ds * (1.0 - tanh * tanh), [])


def _ids(batch, block, layout, seg_ref, pos_ref, index_ref=None, head_ref=None) -> Ids:
  """The `Ids` of batch row `batch`'s rows or keys `block`, in `layout` (`_ROW`: one a row
  of a WGMMA tile; `_COL`: one a column)."""
  return Ids.load(lambda ref: _load(ref.at[batch, block], layout), seg_ref, pos_ref,
                  index_ref, head_ref)


def _block_scores(s, scale: float, soft_cap: float | None, at: Bound, partial, ids,
                  backward: bool = False, reads: list | None = None):
  """A block's scores `s` (q.k) as `_scores` gives them, masked where `partial` (a
  run-time bool, `_masked`), and their pullback (`backward`; the score mod's reads'
  gradients per score where `reads` collects them: `ScoreMod.vjp`, `spread`). `ids()`
  gives the block's (`Coords`, rows' `Ids`, keys' `Ids`, placing of a vector on the
  block), loaded only where something reads them: with a score mod every block, else a
  partial block's mask."""
  found = None if at.score_mod is None else ids()
  mod = None if found is None else at.mod(found[0], backward, reads, spread=True)
  s, back = _scores(s, scale, soft_cap, mod)

  def allowed():
    return at.allowed(*(found or ids()))
  return _masked(partial, allowed, s), back


def _block_ids(at: Bound, program, groups: int, rows: Ids, keys: Ids, shape, rows_axis: int):
  """What `_block_scores`'s `ids()` gives for a block of `shape` whose rows (queries) lie
  along `rows_axis` (0; 1 as dK/dV holds the block, keys along rows)."""
  def place(x, side):  # side 0: a row's vector, 1: a key's
    return _spread(x, shape, rows_axis if side == 0 else 1 - rows_axis)
  return at.coords(program, groups, rows, keys, place), rows, keys, place


@dataclasses.dataclass(frozen=True)
class _Tile:
  """Where the running thread is (tile, KV head, batch row, warpgroup) and its tile's row
  of the schedule: `n` blocks listed, the first `full` of them FULL."""

  tile: Any
  head: Any
  batch: Any
  wg: Any
  full: Any
  n: Any
  order_ref: Any

  @classmethod
  def here(cls, order_ref, full_ref, partial_ref) -> _Tile:
    tile, head, batch, wg = (lax.axis_index(a) for a in ("tile", "head", "batch", "wg"))
    full = full_ref[batch, tile]
    return cls(tile, head, batch, wg, full, full + partial_ref[batch, tile], order_ref)

  def block(self, i):
    """The index of the i-th block listed."""
    return self.order_ref[self.batch, self.tile, i]

  def own(self):
    """The running consumer's 64 rows (keys, in dK/dV)."""
    return pl.ds((self.tile * CONSUMERS + self.wg) * ROWS, ROWS)

  def run(self, size: int, stages: int, copies, free, consumer) -> None:
    """The producer copies the i-th block listed (of `size` rows: `ref.at[b, h, j * size:
    (j + 1) * size]` for block j) from each of `copies` (global ref `[B, K, L, ...]`, its
    slots, their barriers) into slot i mod stages, once both consumers have freed the
    slot's previous block (`free`); the consumers run `consumer()`."""
    @pl.when(self.wg == CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      def load(i):
        slot, rows = lax.rem(i, stages), pl.ds(self.block(i) * size, size)
        for ref, slots, loaded in copies:
          plgpu.copy_gmem_to_smem(ref.at[self.batch, self.head, rows], slots.at[slot],
                                  loaded.at[slot])
      for i in range(stages):
        pl.when(i < self.n)(functools.partial(load, jnp.int32(i)))

      def refill(i, carry):
        plgpu.barrier_wait(free.at[lax.rem(i, stages)])
        load(i)
        return carry
      lax.fori_loop(jnp.int32(stages), self.n, refill, None)

    @pl.when(self.wg < CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      consumer()


def _masked(partial, allowed, s):
  """`s` with -inf where `allowed()` is False in a PARTIAL block (`partial`, a run-time
  bool: the schedule lists a tile's FULL blocks first), else `s` as it is. One loop over
  both kinds: two loops in a row spill registers, ptxas moving the accumulators between
  them (84 bytes in dK/dV at D = 128)."""
  return lax.cond(partial, lambda: jnp.where(allowed(), s, -jnp.inf), lambda: s)


def _store(pairs):
  """Copies (registers, shared memory, global memory) triples out: registers to shared
  memory, then TMA to global memory, waited for."""
  for value, smem, _ in pairs:
    smem[...] = value.astype(smem.dtype)
  plgpu.commit_smem()
  for _, smem, gmem in pairs:
    plgpu.copy_smem_to_gmem(smem, gmem)
  plgpu.wait_smem_to_gmem(0)


# The kernels. Global refs: q `[B, K, Rp, Dp]`, k `[B, K, Sp, Dp]`, v `[B, K, Sp, Dvp]`, ids
# `[B, Rp]` / `[B, Sp]`, per-row lse and delta `[B, K, Rp]`, the schedule's order
# `[B, tiles, m]` and counts `[B, tiles]`. Grid (tile, KV head, batch row), 3 warpgroups.


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, q_pos_ref, kv_seg_ref, kv_pos_ref, order_ref,
                    full_ref, partial_ref, mod_refs, out_ref, lse_ref, q_smem, k_smem, v_smem,
                    p_smem, o_smem, lse_smem, q_loaded, k_loaded, v_loaded, free, turn, *,
                    mods: Mods, scale, soft_cap, tiling, groups):
  at = _Tile.here(order_ref, full_ref, partial_ref)
  b, h, wg = at.batch, at.head, at.wg
  keys, stages = tiling.keys, tiling.stages
  bound = mods.bind(mod_refs)

  def consumer():
    rows = at.own()
    q = q_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q, q_loaded.at[wg])
    row_ids = _ids(b, rows, _ROW, q_seg_ref, q_pos_ref, bound.q_index_ref, bound.q_head_ref)
    plgpu.barrier_wait(q_loaded.at[wg])
    dv = v_smem.shape[-1]

    def take_turn():  # the other consumer's matmuls run while this one's softmax does
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(turn)

    def step(i, carry):
      m, denom, acc = carry
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(k_loaded.at[slot])
      cols = pl.ds(at.block(i) * keys, keys)

      def ids():
        keys_ = _ids(b, cols, _COL, kv_seg_ref, kv_pos_ref, bound.kv_index_ref)
        return _block_ids(bound, (b, h), groups, row_ids, keys_, (ROWS, keys), 0)
      s, _ = _block_scores(_matmul(q, k_smem.at[slot].T, (ROWS, keys), take_turn), scale,
                           soft_cap, bound, i >= at.full, ids)
      m_new = jnp.maximum(m, s.max(axis=1))
      # A row that has seen no allowed key keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p = jnp.exp2(s - _spread(m_safe, s.shape, 0))
      alpha = jnp.exp2(m - m_safe)
      p_smem.at[wg][...] = p.astype(p_smem.dtype)
      plgpu.commit_smem()
      plgpu.barrier_arrive(turn)  # this softmax is done
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_wait(turn)  # the other consumer's is too: the tensor cores are free
      pv = _matmul(p_smem.at[wg], v_smem.at[slot], (ROWS, dv))
      plgpu.barrier_arrive(free.at[slot])
      return m_new, denom * alpha + p.sum(axis=1), acc * _spread(alpha, acc.shape, 0) + pv

    init = (plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), _ROW),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), _ROW),
            plgpu.layout_cast(jnp.zeros((ROWS, dv), jnp.float32), _WGMMA))
    pl.when(wg == 1)(take_turn)  # consumer 0 multiplies first
    m, denom, acc = lax.fori_loop(0, at.n, step, init)
    pl.when(wg == 0)(take_turn)
    empty = denom == 0.0
    safe = jnp.where(empty, 1.0, denom)
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(safe)) * (1 / _LOG2E))
    out = acc / _spread(safe, acc.shape, 0)  # a row with nothing to see: 0 / 1
    _store([(out, q if o_smem is None else o_smem.at[wg], out_ref.at[b, h, rows]),
            (lse, lse_smem.at[wg], lse_ref.at[b, h, rows])])

  at.run(keys, stages, [(k_ref, k_smem, k_loaded), (v_ref, v_smem, v_loaded)], free, consumer)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, q_pos_ref,
               kv_seg_ref, kv_pos_ref, order_ref, full_ref, partial_ref, mod_refs, dq_ref,
               sums_ref, q_smem, do_smem, k_smem, v_smem, ds_smem, sums_smem, q_loaded, k_loaded,
               v_loaded, free, *, mods: Mods, scale, soft_cap, tiling, groups, reads: int):
  at = _Tile.here(order_ref, full_ref, partial_ref)
  b, h, wg = at.batch, at.head, at.wg
  keys, stages = tiling.dq_keys, tiling.stages
  bound = mods.bind(mod_refs)

  def consumer():
    rows = at.own()
    q, do = q_smem.at[wg], do_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q, q_loaded.at[2 * wg])
    plgpu.copy_gmem_to_smem(do_ref.at[b, h, rows], do, q_loaded.at[2 * wg + 1])
    row_ids = _ids(b, rows, _ROW, q_seg_ref, q_pos_ref, bound.q_index_ref, bound.q_head_ref)
    lse = _load(lse_ref.at[b, h, rows], _ROW) * _LOG2E
    delta = _load(delta_ref.at[b, h, rows], _ROW)
    plgpu.barrier_wait(q_loaded.at[2 * wg])
    plgpu.barrier_wait(q_loaded.at[2 * wg + 1])
    dp = q_smem.shape[-1]

    def step(dq, i, sums):
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(k_loaded.at[slot])
      s = _matmul(q, k_smem.at[slot].T, (ROWS, keys))
      plgpu.barrier_wait(v_loaded.at[slot])
      dprob = _matmul(do, v_smem.at[slot].T, (ROWS, keys))
      cols = pl.ds(at.block(i) * keys, keys)

      def ids():
        keys_ = _ids(b, cols, _COL, kv_seg_ref, kv_pos_ref, bound.kv_index_ref)
        return _block_ids(bound, (b, h), groups, row_ids, keys_, (ROWS, keys), 0)
      found = [] if reads else None
      s, back = _block_scores(s, scale, soft_cap, bound, i >= at.full, ids, True, found)
      p = jnp.exp2(s - _spread(lse, s.shape, 0))
      ds, d_reads = back(p * (dprob - _spread(delta, s.shape, 0)))
      ds_smem.at[wg][...] = ds.astype(ds_smem.dtype)
      plgpu.commit_smem()
      plgpu.wgmma(dq, ds_smem.at[wg], k_smem.at[slot])
      plgpu.wgmma_wait(0)  # done reading the slot
      plgpu.barrier_arrive(free.at[slot])
      # The score mod's reads' gradients, summed per row (the lowering reduces one axis at
      # a time); `_backward` sums the rows and adds them at the reads' indices.
      return tuple(total + d.sum(axis=1) for total, d in zip(sums, d_reads, strict=True))

    zeros = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), _ROW)
    (dq,), sums = _accumulated(lambda dq: lax.fori_loop(
        0, at.n, functools.partial(step, dq), (zeros,) * reads), (ROWS, dp))
    _store([(dq * scale, q, dq_ref.at[b, h, rows]),  # the sums' refs: a list of one or none
            *((total, sums_smem[0].at[n, wg], sums_ref[0].at[n, b, h, rows])
              for n, total in enumerate(sums))])

  at.run(keys, stages, [(k_ref, k_smem, k_loaded), (v_ref, v_smem, v_loaded)], free, consumer)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, q_pos_ref,
                kv_seg_ref, kv_pos_ref, order_ref, full_ref, partial_ref, mod_refs, dk_ref, dv_ref,
                k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, p_smem, ds_smem, kv_loaded,
                q_loaded, do_loaded, lse_loaded, delta_loaded, free, *, mods: Mods, scale,
                soft_cap, tiling, groups):
  at = _Tile.here(order_ref, full_ref, partial_ref)
  b, h, wg = at.batch, at.head, at.wg
  block, stages = tiling.dkv_rows, tiling.stages
  bound = mods.bind(mod_refs)

  def consumer():
    keys = at.own()
    k, v = k_smem.at[wg], v_smem.at[wg]
    plgpu.copy_gmem_to_smem(k_ref.at[b, h, keys], k, kv_loaded.at[2 * wg])
    plgpu.copy_gmem_to_smem(v_ref.at[b, h, keys], v, kv_loaded.at[2 * wg + 1])
    key_ids = _ids(b, keys, _ROW, kv_seg_ref, kv_pos_ref, bound.kv_index_ref)
    plgpu.barrier_wait(kv_loaded.at[2 * wg])
    plgpu.barrier_wait(kv_loaded.at[2 * wg + 1])
    dp, dvp = k_smem.shape[-1], v_smem.shape[-1]
    shape = (ROWS, block)  # keys x query rows: the transposed scores

    def step(dk, dv, i, carry):
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(q_loaded.at[slot])
      cols = pl.ds(at.block(i) * block, block)

      def ids():
        rows = _ids(b, cols, _COL, q_seg_ref, q_pos_ref, bound.q_index_ref, bound.q_head_ref)
        return _block_ids(bound, (b, h), groups, rows, key_ids, shape, 1)
      s, back = _block_scores(_matmul(k, q_smem.at[slot].T, shape), scale, soft_cap, bound,
                              i >= at.full, ids, backward=True)
      plgpu.barrier_wait(lse_loaded.at[slot])
      p = jnp.exp2(s - _spread(_load(lse_smem.at[slot], _COL) * _LOG2E, shape, 1))
      p_smem.at[wg][...] = p.astype(p_smem.dtype)
      plgpu.commit_smem()
      plgpu.barrier_wait(do_loaded.at[slot])
      plgpu.wgmma(dv, p_smem.at[wg], do_smem.at[slot])  # runs on while dP is computed
      dprob = _matmul(v, do_smem.at[slot].T, shape)
      plgpu.barrier_wait(delta_loaded.at[slot])
      ds, _ = back(p * (dprob - _spread(_load(delta_smem.at[slot], _COL), shape, 1)))
      ds_smem.at[wg][...] = ds.astype(ds_smem.dtype)
      plgpu.commit_smem()
      plgpu.wgmma(dk, ds_smem.at[wg], q_smem.at[slot])
      plgpu.wgmma_wait(0)  # done reading the slot
      plgpu.barrier_arrive(free.at[slot])
      return carry

    def loop(dk, dv):
      lax.fori_loop(0, at.n, functools.partial(step, dk, dv), None)
    (dk, dv), _ = _accumulated(loop, (ROWS, dp), (ROWS, dvp))
    _store([(dk * scale, k, dk_ref.at[b, h, keys]), (dv, v, dv_ref.at[b, h, keys])])

  at.run(block, stages, [(q_ref, q_smem, q_loaded), (do_ref, do_smem, do_loaded),
                         (lse_ref, lse_smem, lse_loaded), (delta_ref, delta_smem, delta_loaded)],
         free, consumer)


# The calls.


def _schedule(ops: Rows, q_block: int, kv_block: int, axis: int):
  """The visiting order (int32 `[B, tiles, m]`) and the counts of FULL and PARTIAL blocks
  (`[B, tiles]`) of query blocks of `q_block` rows against key blocks of `kv_block`, for
  tiles along axis 3 - `axis` (`blocks.visit_order`)."""
  order, full, partial = visit_order(jnp, ops.kinds(q_block, kv_block), axis)
  return order.astype(jnp.int32), full, partial


def _apart(ops: Rows, forward: bool) -> Rows:
  """`ops` with each non-finite key or value row kept from the rows the mask does not let
  see it, as blockwise and pallas_gpu keep it in each PARTIAL block (`masks.values_apart`).
  Here WGMMA reads K and V as the producer copied them, and 0 (a masked probability or dS)
  times NaN or inf is NaN, which would reach every row of the tiles visiting the key's block;
  so the rows are replaced once, before the kernels (elementwise, O(S x D) beside the
  kernels' O(T x S x D)). Forward: a non-finite value row is zeroed and its key made NaN,
  whose scores the mask turns to -inf in the rows that do not see it, and the rows that do
  get NaN (out and lse). Backward: non-finite key and value rows are zeroed."""
  def bad(x):  # [B, K, L, 1]: a row holding NaN or inf
    return ~jnp.isfinite(x).all(axis=-1, keepdims=True)
  k, v = ops.k_BKSD, ops.v_BKSD
  if forward:
    bad_v = bad(v)
    k = jnp.where(bad_v, jnp.asarray(jnp.nan, k.dtype), k)
    v = jnp.where(bad_v, jnp.zeros((), v.dtype), v)
  else:
    k, v = (jnp.where(bad(x), jnp.zeros((), x.dtype), x) for x in (k, v))
  return dataclasses.replace(ops, k_BKSD=k, v_BKSD=v)


def _call(body, name: str, ops: Rows, tiling: Tiling, tiles: int, inputs, outputs, scratch):
  """One kernel on the grid (tile, KV head, batch row): two consumers and a producer."""
  b, hkv = ops.q_BKRD.shape[:2]
  return plgpu.kernel(body, out_type=outputs, scratch_types=scratch, grid=(tiles, hkv, b),
                      grid_names=("tile", "head", "batch"), num_threads=CONSUMERS + 1,
                      thread_name="wg", kernel_name=name,
                      compiler_params=plgpu.CompilerParams(approx_math=True),
                      interpret=_interpret_params() if tiling.interpret else None)(*inputs)


def _forward(ops: Rows, tiling: Tiling, *, score_mod: ScoreMod | None, scale: float,
             soft_cap: float | None):
  """out `[B, K, Rp, Dvp]` (q's dtype) and lse `[B, K, Rp]` float32: a thread block per
  tile of 128 rows, looping over its key blocks."""
  b, hkv, rows_pad, dp = ops.q_BKRD.shape
  dvp, dtype, stages = ops.v_BKSD.shape[-1], ops.q_BKRD.dtype, tiling.stages
  ops = _apart(ops, forward=True)
  order, full, partial = _schedule(ops, TILE, tiling.keys, axis=2)
  mods, toks = Mods(ops.mask, score_mod), ops.toks
  scratch = [_smem((CONSUMERS, ROWS, dp), dtype), _smem((stages, tiling.keys, dp), dtype),
             _smem((stages, tiling.keys, dvp), dtype), _smem((CONSUMERS, ROWS, tiling.keys), dtype),
             None if dvp == dp else _smem((CONSUMERS, ROWS, dvp), dtype),  # else q's
             plgpu.SMEM((CONSUMERS, ROWS), jnp.float32), plgpu.Barrier(num_barriers=CONSUMERS),
             plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
             plgpu.Barrier(num_arrivals=CONSUMERS)]
  body = functools.partial(_forward_kernel, mods=mods, scale=scale, soft_cap=soft_cap,
                           tiling=tiling, groups=toks.groups)
  outputs = (jax.ShapeDtypeStruct((b, hkv, rows_pad, dvp), dtype),
             jax.ShapeDtypeStruct((b, hkv, rows_pad), jnp.float32))
  return _call(body, "mosaic_forward", ops, tiling, rows_pad // TILE,
               (ops.q_BKRD, ops.k_BKSD, ops.v_BKSD, toks.q_seg, toks.q_pos, toks.kv_seg,
                toks.kv_pos, order, full, partial, mods.inputs(toks)), outputs, scratch)


def _backward(ops: Rows, tiling: Tiling, lse, dout, delta, *, score_mod: ScoreMod | None,
              scale: float, soft_cap: float | None):
  """dq `[B, K, Rp, Dp]`, dk `[B, K, Sp, Dp]`, dv `[B, K, Sp, Dvp]` and the score mod's
  operands' gradients (`RowTiling.backward`): dQ a thread block per tile of 128 rows
  looping over its key blocks, dK/dV one per tile of 128 keys looping over its query
  blocks. dQ sums the gradient of each of the score mod's float reads per row `[reads, B,
  K, Rp]` (O(T) memory each); each read's index depends on the batch row alone (scalar
  loads, `MosaicGpu.reason`), so the rows' sums of a batch row are added at the index the
  score mod reads for it (`mods.batch_reads`)."""
  dp, dvp = ops.q_BKRD.shape[-1], ops.v_BKSD.shape[-1]
  dtype, stages, keys, block = ops.q_BKRD.dtype, tiling.stages, tiling.dq_keys, tiling.dkv_rows
  ops = _apart(ops, forward=False)
  mods, toks = Mods(ops.mask, score_mod), ops.toks
  b = ops.q_BKRD.shape[0]
  found = [] if score_mod is None else batch_reads(
      score_mod, toks.row_offset + jnp.arange(b, dtype=jnp.int32))
  options = dict(mods=mods, scale=scale, soft_cap=soft_cap, tiling=tiling, groups=toks.groups)
  operands = (ops.q_BKRD, ops.k_BKSD, ops.v_BKSD, dout.astype(dtype), lse, delta, toks.q_seg,
              toks.q_pos, toks.kv_seg, toks.kv_pos)
  slots = plgpu.Barrier(num_barriers=stages)
  free = plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages)
  sums = [(len(found), *ops.q_BKRD.shape[:3])] if found else []
  dq, sums = _call(
      functools.partial(_dq_kernel, reads=len(found), **options), "mosaic_dq", ops, tiling,
      ops.q_BKRD.shape[2] // TILE,
      (*operands, *_schedule(ops, TILE, keys, axis=2), mods.inputs(toks)),
      (jax.ShapeDtypeStruct(ops.q_BKRD.shape, dtype),
       [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in sums]),
      [_smem((CONSUMERS, ROWS, dp), dtype), _smem((CONSUMERS, ROWS, dvp), dtype),
       _smem((stages, keys, dp), dtype), _smem((stages, keys, dvp), dtype),
       _smem((CONSUMERS, ROWS, keys), dtype),
       [plgpu.SMEM((len(found), CONSUMERS, ROWS), jnp.float32) for _ in sums],
       plgpu.Barrier(num_barriers=CONSUMERS * 2), slots, slots, free])
  dk, dv = _call(functools.partial(_dkv_kernel, **options), "mosaic_dkv", ops, tiling,
                 ops.k_BKSD.shape[2] // TILE,
                 (*operands, *_schedule(ops, block, TILE, axis=1), mods.inputs(toks)),
                 (jax.ShapeDtypeStruct(ops.k_BKSD.shape, dtype),
                  jax.ShapeDtypeStruct(ops.v_BKSD.shape, dtype)),
                 [_smem((CONSUMERS, ROWS, dp), dtype), _smem((CONSUMERS, ROWS, dvp), dtype),
                  _smem((stages, block, dp), dtype), _smem((stages, block, dvp), dtype),
                  plgpu.SMEM((stages, block), jnp.float32),
                  plgpu.SMEM((stages, block), jnp.float32),
                  _smem((CONSUMERS, ROWS, block), dtype), _smem((CONSUMERS, ROWS, block), dtype),
                  plgpu.Barrier(num_barriers=CONSUMERS * 2), slots, slots, slots, slots, free])
  d_ops = mods.gradients()
  for (operand, index), total in zip(found, [x.sum((2, 3)) for x in sums][0] if sums else [],
                                     strict=True):
    # An index without arrays reads the same element for every batch row.
    batched = any(jnp.ndim(i) for i in index)
    d_ops[operand] = d_ops[operand].at[index].add(total if batched else total.sum())
  return dq, dk, dv, d_ops


@dataclasses.dataclass(frozen=True)
class MosaicGpu(RowKernel):
  """`backend="mosaic_gpu"`: flash attention as warp-specialized Mosaic GPU kernels for
  Hopper (sm_90) in bfloat16 or float16, head dims up to 128 (GPU interpret mode elsewhere);
  every mask, packed rows, GQA, soft cap, Dv != D and the ring; programmable masks and
  scores whose operands are read at one index per block (`RowKernel.mods_reason`).

  `block_kv`: keys per block of the forward, `block_kv_dq`: of dQ, `block_q_dkv`: query
  rows per block of dK/dV (a row is one query head of one token), multiples of 64 up to
  256 (None: `Tiling`'s). `stages`: blocks the producer loads ahead (shared-memory slots).
  `interpret`: GPU interpret mode; None decides by the platform the program is lowered for
  (compiled on GPU, interpret mode elsewhere).

  Raises:
    ValueError: a block size not a multiple of 64 from 64 to 256, `stages` not 1 to 4,
      `interpret` not a bool or None.
  """

  block_kv: int | None = None
  block_kv_dq: int | None = None
  block_q_dkv: int | None = None
  stages: int = 2
  interpret: bool | None = None
  name: str = "mosaic_gpu"
  interpreter = "GPU interpret mode"
  gathers = False  # Mosaic GPU's lowering loads scalars or whole tiles (`mods_reason`)
  ring: bool = True
  soft_cap: bool = True

  def __post_init__(self):
    for arg in ("block_kv", "block_kv_dq", "block_q_dkv"):
      value = getattr(self, arg)
      if value is not None:
        checks.integer(f"MosaicGpu({arg}=...)", value, f"a multiple of {ROWS} from {ROWS} to"
                       f" {MAX_BLOCK} or None (WGMMA's tiles)",
                       lambda x: ROWS <= x <= MAX_BLOCK and x % ROWS == 0)
    checks.integer("MosaicGpu(stages=...)", self.stages, "an int from 1 to 4 (shared-memory"
                   " slots the producer fills ahead)", lambda x: 1 <= x <= 4, "2 is the default")
    if self.interpret is not None:
      checks.boolean("MosaicGpu(interpret=...)", self.interpret,
                     "None decides by the platform")

  def reason(self, call: registry.Call) -> str | None:
    if call.dtype not in _DTYPES:
      return (f"mosaic_gpu takes {' or '.join(_DTYPES)} (WGMMA's 16-bit operands), got"
              f" {call.dtype}; cast q, k, v or use 'pallas_gpu'.")
    d = call.q_shape[-1]
    if max(d, call.dv) > MAX_HEAD_DIM:
      return (f"mosaic_gpu's tiles are sized for head dims up to {MAX_HEAD_DIM}, got D={d},"
              f" Dv={call.dv}; the pallas_gpu kernel serves wider heads.")
    if call.platform == "gpu":
      capability = aot.traced_gpu_capability()
      if capability is not None and capability[0] != 9:
        return (f"mosaic_gpu's kernels use Hopper's WGMMA (sm_90), which this GPU (sm_"
                f"{''.join(map(str, capability[:2]))}) lacks; the pallas_gpu kernel serves it.")
    elif self.interpret is not False and jax.__version_info__ < INTERPRET_JAX:
      return (f"GPU interpret mode of jax {jax.__version__} cannot run mosaic_gpu's kernels (a"
              f" transposed shared-memory operand of WGMMA); jax >="
              f" {'.'.join(map(str, INTERPRET_JAX))} runs them, or use 'pallas_gpu'.")
    elif self.interpret is not False and _cpu_devices() < 2:
      return ("GPU interpret mode on a single CPU device can deadlock a program that holds"
              " several interpreted kernels (a forward and backward hung in 3 of 4 runs);"
              " start JAX with XLA_FLAGS=--xla_force_host_platform_device_count=2 or more,"
              " or use 'pallas_gpu'.")
    return self.mods_reason(call)

  def tiling(self, q, k, v, chunk: int | None = None) -> Tiling:
    """This kernel's `Tiling`: its block sizes where set, else `Tiling`'s (blocks do not
    follow a ring's load-balanced chunks: a block across two costs only skipping)."""
    default = Tiling()
    return Tiling(self.block_kv or default.keys, self.block_kv_dq or default.dq_keys,
                  self.block_q_dkv or default.dkv_rows, self.stages, self.interpreted())
