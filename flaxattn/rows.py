"""Query heads folded into rows: the layout, autodiff and ring step of the GPU flash kernels.

pallas_gpu (Triton) and mosaic_gpu (Mosaic GPU, Hopper) run on one layout: the G query heads
of a KV head fold into the rows of a query block, ordered (token, group), so K/V are never
repeated; each row carries its token's segment id and position. Rows, keys and head dims
are padded to the kernel's units. A kernel supplies its passes on rows (a `RowTiling`);
this module makes them attention `[B, T, H, Dv]` with a custom VJP, `checked.Passes` for a
fallback, the ring's step, and the registry behaviour both kernels share (`RowKernel`).

A programmable mask or score mod (`flaxattn.mods`) is evaluated inside the kernels on each
block's coordinates (`Mods`): the kernels take each row's token index and query head, each
key's token index and the mods' operands as inputs, and the mods' functions read the
operands from memory by indexing them (`mods.Operand`). A programmable mask's block map is
found once per call (`blocks.refine`) and kept for the backward passes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from flaxattn import registry, sharding
from flaxattn.blocks import Tokens, block_schedule, merge, pad_axis1, round_up, schedule, tokens
from flaxattn.layout import Layout
from flaxattn.masks import Coords, Mask, allowed
from flaxattn.mods import ScoreMod, in_kernel, reads, zero_cotangents
from flaxattn.ring import RingStep


@dataclasses.dataclass(frozen=True)
class Rows:
  """A call in the kernels' layout: q `[B, K, Rp, Dp]` (rows (token, group) of each KV head,
  padded to whole blocks, head dim padded), k `[B, K, Sp, Dp]`, v `[B, K, Sp, Dvp]`, the
  ids per row and per key (`Tokens` of rows `[B, Rp]` and keys `[B, Sp]`, padding as
  segment 0), the mask, and a programmable mask's block map `found` at blocks of `unit`
  (rows, keys) (None for built-ins: each pass computes its own from the ids)."""

  q_BKRD: jax.Array
  k_BKSD: jax.Array
  v_BKSD: jax.Array
  toks: Tokens
  mask: Mask
  found: jax.Array | None = None
  unit: tuple[int, int] = (1, 1)

  def kinds(self, rows: int, keys: int):
    """The block kinds `[B, Rp / rows, Sp / keys]` int8 of blocks of `rows` rows and `keys`
    keys (multiples of `unit` where the map was found): from the ids for built-in masks, a
    few ops over block bounds; else the found map merged (`blocks.merge`)."""
    if self.found is None:
      toks = self.toks
      return block_schedule(jnp, self.mask, toks.q_seg, toks.kv_seg, toks.q_pos, toks.kv_pos,
                            rows, keys).astype(np.int8)
    return merge(self.found, rows // self.unit[0], keys // self.unit[1])


@dataclasses.dataclass(frozen=True)
class Mods:
  """A call's mask and score mod as the kernels take them. Where either reads coordinates
  (`reads_index`), the kernels take extra inputs (`inputs`): each row's token index and
  query head among its KV head's `[B, Rp]`, each key's token index `[B, Sp]`, the global
  index of the first batch row and query head `[2]`, then the operands' leaves, the mask's
  and the score mod's (these last two whole); a kernel reads them back with `bind`."""

  mask: Mask
  score_mod: ScoreMod | None = None

  @property
  def reads_index(self) -> bool:
    return self.mask.reads_index or self.score_mod is not None

  def inputs(self, toks: Tokens) -> list:
    if not self.reads_index:
      return []
    offsets = jnp.stack([jnp.asarray(toks.row_offset, jnp.int32),
                         jnp.asarray(toks.head_offset, jnp.int32)])
    return [toks.q_index, toks.q_head, toks.kv_index, offsets,
            *jax.tree.leaves((self.mask, self.score_mod))]

  def bind(self, refs) -> Bound:
    """The mods inside a kernel, given the refs of `inputs` (none where it has none)."""
    if not self.reads_index:
      return Bound(self.mask)
    q_index, q_head, kv_index, offsets, *leaves = refs
    n = len(jax.tree.leaves(self.mask))
    score_mod = None if self.score_mod is None else in_kernel(self.score_mod, leaves[n:])
    return Bound(in_kernel(self.mask, leaves[:n]), score_mod, offsets, q_index, q_head,
                 kv_index)

  def gradients(self) -> list:
    """Zeros `[*shape]` float32 for each of the score mod's `float_operands`: where a
    backward kernel adds their gradients."""
    floats = [] if self.score_mod is None else self.score_mod.float_operands()
    return [jnp.zeros(x.shape, jnp.float32) for x in floats]

  @property
  def floats(self) -> int:
    """How many `float_operands` the score mod has (gradients a backward pass adds)."""
    return 0 if self.score_mod is None else len(self.score_mod.float_operands())


@dataclasses.dataclass(frozen=True)
class Ids:
  """The ids of a block's rows or keys as a kernel loaded them: segment ids, positions, and
  where a programmable mask or score reads them, token indices and (rows) query heads."""

  seg: Any
  pos: Any
  index: Any = None
  head: Any = None

  @classmethod
  def load(cls, load, seg_ref, pos_ref, index_ref=None, head_ref=None) -> Ids:
    """`load(ref)` of each ref given (None for the others)."""
    return cls(*(None if ref is None else load(ref)
                 for ref in (seg_ref, pos_ref, index_ref, head_ref)))


@dataclasses.dataclass(frozen=True)
class Bound:
  """`Mods` inside a kernel: the mask and score mod with their operands read from the
  kernel's refs (`mods.Operand`), and the refs of the coordinates (None where nothing
  reads them)."""

  mask: Mask
  score_mod: ScoreMod | None = None
  offsets_ref: Any = None
  q_index_ref: Any = None
  q_head_ref: Any = None
  kv_index_ref: Any = None

  def coords(self, program, groups: int, rows: Ids, keys: Ids, place) -> Coords:
    """`Coords` of a block of `program` (the kernel's batch row and KV head) whose rows
    and keys have these `Ids` (rows' heads among the KV head's `groups`), each vector put
    on the block's axes by `place(x, 0)` (rows) or `place(x, 1)` (keys)."""
    def on(x, side):
      return None if x is None else place(x, side)
    if self.offsets_ref is None:  # nothing reads them: the built-ins read positions only
      return Coords(None, None, None, None, on(rows.pos, 0), on(keys.pos, 1))
    batch, kv_head = program
    return Coords(self.offsets_ref[0] + batch,
                  self.offsets_ref[1] + kv_head * groups + on(rows.head, 0),
                  on(rows.index, 0), on(keys.index, 1), on(rows.pos, 0), on(keys.pos, 1))

  def mod(self, where: Coords, backward: bool = False, reads: list | None = None,
          spread: bool = False):
    """The `mod` of `mods.change_scores` for a block at `where`: the score mod (None
    without one), with its pullback for a `backward` pass (`ScoreMod.vjp`; its operands'
    gradients where `reads` collects its reads, per score where `spread`)."""
    score_mod = self.score_mod
    if score_mod is None:
      return None
    if not backward:
      return lambda s: (score_mod(s, where), None)
    return lambda s: score_mod.vjp(s, where, reads, spread)

  def allowed(self, where: Coords, rows: Ids, keys: Ids, place):
    """bool: the rows and keys share a non-zero segment id and the mask allows the pair
    (`place` as for `coords`)."""
    return allowed(self.mask, where, place(rows.seg, 0), place(keys.seg, 1))


class RowTiling(Protocol):
  """A kernel's static shape as the shared wrapper reads it: the padding units, the blocks
  of a found block map and the passes on `Rows`. Hashable (a custom VJP's static
  argument)."""

  interpret: bool

  def padding(self, rows: int, keys: int, d: int, dv: int) -> tuple[int, int, int, int]:
    """Padded rows, keys, head dim and value head dim of a call of `rows` rows."""
    ...

  @property
  def unit(self) -> tuple[int, int]:
    """(rows, keys) of the blocks a found block map is kept at: each pass's blocks are
    multiples of them."""
    ...

  def forward(self, rows: Rows, *, score_mod: ScoreMod | None, scale: float,
              soft_cap: float | None) -> tuple[jax.Array, jax.Array]:
    """out `[B, K, Rp, Dvp]` (q's dtype) and lse `[B, K, Rp]` float32."""
    ...

  def backward(self, rows: Rows, lse, dout, delta, *, score_mod: ScoreMod | None,
               scale: float, soft_cap: float | None) -> tuple[jax.Array, jax.Array, jax.Array,
                                                              list]:
    """dq `[B, K, Rp, Dp]`, dk `[B, K, Sp, Dp]`, dv `[B, K, Sp, Dvp]` given lse (0 where a
    row sees no key), dout `[B, K, Rp, Dvp]` and delta = rowsum(dout * out) - dlse; and the
    gradients (float32) of the score mod's `float_operands`."""
    ...


def _tokens(mask: Mask, layout: Layout, b: int, t: int, s: int, g: int, rows_pad: int,
            s_pad: int, reads_index: bool) -> Tokens:
  """The call's `Tokens` per row `[B, Rp]` (each token's ids repeated for its G rows, with
  its query heads `q_head` where indices are read) and per key `[B, Sp]`, padding as
  segment 0. Always computed in the program, the default layout too: the schedule built
  from them then costs the program O(T) to build, where one known at trace time would be
  an O(T^2 / 4096) constant inside it (a cuda export of a causal T = 512K forward and
  backward: 518 MiB serialized, now 0.03 MiB)."""
  toks = tokens(mask, layout, b, t, s_pad, t, s, reads_index)

  def rows(x):
    return None if x is None else pad_axis1(jnp.repeat(x, g, axis=1), rows_pad)
  q_head = None
  if toks.q_index is not None:
    q_head = pad_axis1(jnp.broadcast_to(jnp.tile(jnp.arange(g, dtype=jnp.int32), t),
                                        (b, t * g)), rows_pad)
  return dataclasses.replace(toks, q_seg=rows(toks.q_seg), q_pos=rows(toks.q_pos),
                             q_index=rows(toks.q_index), q_head=q_head, groups=g)


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


def fold(q, k, v, layout: Layout, tiling: RowTiling, mods: Mods, found=None) -> Rows:
  """q `[B, T, H, D]`, k `[B, S, Hkv, D]`, v `[B, S, Hkv, Dv]` and their ids as `Rows`,
  padded as `tiling.padding` says, with a programmable mask's block map (`found` where
  the forward found it, else found here)."""
  b, t, h, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  rows_pad, s_pad, dp, dvp = tiling.padding(t * (h // hkv), s, d, v.shape[-1])
  toks = _tokens(mods.mask, layout, b, t, s, h // hkv, rows_pad, s_pad, mods.reads_index)
  if found is None and mods.mask.needs_tiles:
    found = schedule(mods.mask, toks, hkv, *tiling.unit).astype(np.int8)
  return Rows(to_rows(q, hkv, rows_pad, dp), to_rows(k, hkv, s_pad, dp),
              to_rows(v, hkv, s_pad, dvp), toks, mods.mask, found, tiling.unit)


def pad_to(rows: int, keys: int, row_unit: int, key_unit: int) -> tuple[int, int]:
  """`rows` and `keys` rounded up to their units."""
  return round_up(rows, row_unit), round_up(keys, key_unit)


def forward(q, k, v, layout: Layout, *, mask: Mask, scale: float, tiling: RowTiling,
            soft_cap: float | None = None, score_mod: ScoreMod | None = None, found=None):
  """Forward pass without autodiff rules: out `[B, T, H, Dv]` (q dtype), lse `[B, T, H]` f32,
  and a programmable mask's block map (None for built-ins), which `backward` takes back."""
  ops = fold(q, k, v, layout, tiling, Mods(mask, score_mod), found)
  out, lse = tiling.forward(ops, score_mod=score_mod, scale=scale, soft_cap=soft_cap)
  t, h = q.shape[1:3]
  return (from_rows(out, t, h, v.shape[-1]), from_rows(lse[..., None], t, h, 1)[..., 0],
          ops.found)


def backward(q, k, v, layout: Layout, out, lse, dout, dlse, *, mask: Mask, scale: float,
             tiling: RowTiling, soft_cap: float | None = None,
             score_mod: ScoreMod | None = None, found=None):
  """Gradients (dq, dk, dv) of the attention of q against k/v, given the rows' output `out`
  and log-sum-exp `lse` (which may cover more keys than k/v: the ring passes the merged
  result of every step) and their cotangents `dout`, `dlse` (float32 `[B, T, H]`); and a
  fourth, the gradients (float32) of the score mod's `float_operands` (none without one).
  `found`: the block map `forward` returned."""
  ops = fold(q, k, v, layout, tiling, Mods(mask, score_mod), found)
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
  dq, dk, dv, d_ops = tiling.backward(ops, lse_r, dout_r, delta, score_mod=score_mod,
                                      scale=scale, soft_cap=soft_cap)
  t, h, d = q.shape[1:]
  s = k.shape[1]
  return (from_rows(dq, t, h, d), from_rows(dk, s, hkv, d),
          from_rows(dv, s, hkv, v.shape[-1]), d_ops)


def _primal(q, k, v, layout, mods, scale, tiling, soft_cap) -> tuple[jax.Array, jax.Array]:
  return _attention_fwd(q, k, v, layout, mods, scale, tiling, soft_cap)[0]


# Applied as a call, not a decorator through functools.partial, so the result stays typed.
# `mods` (mask, score_mod): pytrees whose leaves (a MaskMod's or ScoreMod's operands) are
# traced; the score mod's float operands receive gradients.
_attention = jax.custom_vjp(_primal, nondiff_argnums=(5, 6, 7))


def _attention_fwd(q, k, v, layout, mods, scale, tiling, soft_cap):
  mask, score_mod = mods
  out, lse, found = forward(q, k, v, layout, mask=mask, scale=scale, tiling=tiling,
                            soft_cap=soft_cap, score_mod=score_mod)
  return (out, lse), (q, k, v, layout, mods, found, out, lse)


def _attention_bwd(scale, tiling, soft_cap, residuals, cotangents):
  q, k, v, layout, mods, found, out, lse = residuals
  mask, score_mod = mods
  dout, dlse = cotangents
  dq, dk, dv, d_ops = backward(q, k, v, layout, out, lse, dout, dlse, mask=mask, scale=scale,
                               tiling=tiling, soft_cap=soft_cap, score_mod=score_mod,
                               found=found)
  d_score = None if score_mod is None else score_mod.cotangent(d_ops)
  return dq, dk, dv, None, (zero_cotangents(mask), d_score)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
              tiling: RowTiling, soft_cap: float | None = None,
              score_mod: ScoreMod | None = None):
  """Attention `[B, T, H, Dv]` (and lse `[B, T, H]` float32 with `return_lse`) by the
  passes of `tiling`, differentiable (the score mod's float operands too), per (batch,
  head) shard of the mesh in force."""
  def attend(mods, q, k, v, layout):
    return _attention(q, k, v, layout, mods, float(scale), tiling, soft_cap)
  mods = (mask, score_mod)
  attend = sharding.per_batch_and_head(attend, q.shape, k.shape[2], layout,
                                       leading_specs=(PartitionSpec(),))
  out, lse = attend(mods, q, k, v, layout)
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
                   tiling=self.kernel.tiling(q, k, v, self.chunk), soft_cap=self.soft_cap)[:2]

  def backward(self, step, q, k, v, layout, out, lse, dout, dlse):
    return backward(q, k, v, layout, out, lse, dout, dlse, mask=self.mask, scale=self.scale,
                    tiling=self.kernel.tiling(q, k, v, self.chunk), soft_cap=self.soft_cap)[:3]


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
                   tiling=self.kernel.tiling(q, k, v), soft_cap=self.soft_cap)[:2]

  def backward(self, operands, q, k, v, layout: Layout, out, lse, dout, dlse):
    dlse = jnp.zeros(lse.shape, jnp.float32) if dlse is None else dlse
    dq, dk, dv, _ = backward(q, k, v, layout, out, lse, dout, dlse, mask=self.mask,
                             scale=self.scale, tiling=self.kernel.tiling(q, k, v),
                             soft_cap=self.soft_cap)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


class RowKernel(registry.Kernel):
  """A GPU flash kernel on rows: compiled on GPU, interpreted elsewhere (`interpret`: None
  decides by the platform), every mask, programmable masks and scores (`Mods`), packed
  rows, GQA, soft cap, Dv != D and the ring.
  Subclasses (frozen dataclasses with an `interpret` field) implement `tiling` and set
  `interpreter`, the name of the mode that runs them off GPU."""

  interpret: bool | None = None
  interpreter: str = ""
  ring: bool = True
  soft_cap: bool = True
  mask_mod: bool = True
  score_mod: bool = True
  # Whether its kernels read a mod's operands at indices that vary within a block (the
  # head, token index: a gather); else at one index a block (a scalar load).
  gathers: bool = True

  def unsupported_reason(self, call: registry.Call) -> str | None:
    if call.cp_strategy is not None and (call.mask.reads_index or call.score_mod is not None):
      # The ring's and the gathered keys' steps (`Step`) take no score mod, nor the global
      # batch rows, heads and token indices a shard's mods read.
      return (f"{self.name} runs programmable masks and scores without context parallelism"
              f" only (context_parallel strategy {call.cp_strategy!r}: its steps pass no"
              " global indices to them).")
    return super().unsupported_reason(call)

  def mods_reason(self, call: registry.Call) -> str | None:
    """Why the kernels cannot evaluate the call's mask and score mod inside themselves
    (`mods.reads`), or None."""
    if not call.mask.reads_index and call.score_mod is None:
      return None
    try:
      found = reads(call.mask, call.score_mod)
    except TypeError as e:
      return (f"{self.name} evaluates masks and scores inside its kernels, where {e}; index"
              " the operands, or use 'blockwise'.")
    varying = [r for r in found if r.shape]
    if varying and not self.gathers:
      r = varying[0]
      return (f"{self.name} reads a mod's operands at one index per block (scalar loads: its"
              " lowering loads scalars or whole tiles from memory, it has no gather), but"
              f" {r.owner} reads its operand of shape {r.leaf} at indices that vary with the"
              " head, the query or the key; pallas_gpu gathers them.")
    return None

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
               soft_cap: float | None = None, score_mod: ScoreMod | None = None):
    return attention(q, k, v, layout, mask=mask, scale=scale, return_lse=return_lse,
                     tiling=self.tiling(q, k, v), soft_cap=soft_cap, score_mod=score_mod)

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
