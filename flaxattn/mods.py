"""Programmable masks and scores, as PyTorch's FlexAttention has them: `MaskMod(fn,
*operands)`, a `Mask` whose rule is a JAX function, and `ScoreMod(fn, *operands)`, a
change to every score before masking.

  prefix_lm = flaxattn.MaskMod(
      lambda b, h, q_idx, kv_idx, prefix_len: (kv_idx <= q_idx) | (kv_idx < prefix_len[b]),
      prefix_len)                                       # prefix_len [B] int32, traced
  alibi = flaxattn.ScoreMod(
      lambda score, b, h, q_idx, kv_idx, slopes: score - slopes[h] * jnp.abs(q_idx - kv_idx),
      slopes)                                           # slopes [H] float32: trained

Operands are pytrees of arrays and the leaves of the mod's pytree: traced, so a new value
(a batch's prefix lengths) runs the same compiled program; float operands of a ScoreMod
receive gradients. The function itself is static (hashed by identity).

The functions take int32 index arrays that broadcast against each other, each with the
axes a kernel's tile needs (any rank): `b` the batch row, `h` the query head, `q_idx` /
`kv_idx` the token indices in the row as the caller passed it (`flaxattn.masks.Coords`).
Under context parallelism with load balancing they are the indices of the caller's order
before `flaxattn.load_balance`: with `load_balance=True` (row order) by the dual-chunk
permutation; with `load_balance="document"` as the start of the token's document in the
row plus its position, the documents numbered in row order (segment ids 1, 2, ...) and
counted from the row's start, so the indices are the original ones for rows packed as
`train.data` packs them (documents back to back, padding last).

A mask's blocks are classified on device from `fn` (`flaxattn.blocks.refine`), only those
that the built-in parts of a combination and the segment ids leave open; nothing is
evaluated per element on the host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxattn.masks import And, Coords, Mask, Not, Or

# Probe sizes of the batch, head, query and key axes: distinct, so the probe's result shape
# tells which coordinates a function reads.
_PROBE = (2, 3, 5, 7)


def _probe_args():
  """int32 (b, h, q_idx, kv_idx) shapes `[2,1,1,1]`, `[1,3,1,1]`, `[1,1,5,1]`, `[1,1,1,7]`."""
  shapes = [tuple(n if i == axis else 1 for i in range(4)) for axis, n in enumerate(_PROBE)]
  return [jax.ShapeDtypeStruct(s, jnp.int32) for s in shapes]


def _name(fn) -> str:
  return getattr(fn, "__name__", type(fn).__name__)


def _check_operands(what: str, operands) -> None:
  for leaf in jax.tree.leaves(operands):
    if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
      raise TypeError(f"{what} expects operands that are arrays (a pytree of them), got"
                      f" {type(leaf).__name__} {leaf!r}; pass jnp.asarray(value).")


def _result(what: str, fn, args, operands):
  """`jax.eval_shape` of `fn(*args, *operands)`, naming `what` when it fails."""
  try:
    return jax.eval_shape(lambda args, ops: fn(*args, *ops), args, operands)
  except Exception as e:  # any error inside the user's function: say whose it is
    raise TypeError(f"{what} {_name(fn)} failed on int32 index arrays of shapes"
                    f" {[a.shape for a in args[-4:]]} (b, h, q_idx, kv_idx, broadcasting): "
                    f"{type(e).__name__}: {e}") from e


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class MaskMod(Mask):
  """A mask given by a function: `fn(b, h, q_idx, kv_idx, *operands)` returns a bool array,
  True where query `q_idx` of batch row `b`, query head `h` may see key `kv_idx` (see the
  module docstring for the coordinates). Segment ids still separate documents on top of
  it. Combines with the built-ins and other masks by `&`, `|` and `~`.

  Raises:
    TypeError: `fn` not callable, an operand that is not an array, or `fn` failing or
      returning other than bool on broadcasting int32 index arrays.
    ValueError: a result shape that does not broadcast against the indices.
  """

  fn: Callable[..., Any]
  operands: tuple = ()
  by_row: bool = False  # the result varies with b (from the probe)
  by_head: bool = False  # the result varies with h

  def __init__(self, fn: Callable[..., Any], *operands):
    if not callable(fn):
      raise TypeError(f"MaskMod expects a function fn(b, h, q_idx, kv_idx, *operands) -> bool as"
                      f" its first argument (mask_mod), got {fn!r}.")
    _check_operands("MaskMod", operands)
    out = _result("mask_mod", fn, _probe_args(), operands)
    if out.dtype != jnp.bool_:
      raise TypeError(f"mask_mod {_name(fn)} expects a bool result (True: the key may be seen),"
                      f" got {out.dtype} of shape {out.shape}; compare, e.g. kv_idx <= q_idx,"
                      " or cast with .astype(bool).")
    try:
      shape = np.broadcast_shapes(out.shape, _PROBE)
    except ValueError:
      shape = None
    if shape != _PROBE:
      raise ValueError(f"mask_mod {_name(fn)} expects a result that broadcasts against its index"
                       f" arguments (probed with {_probe_shapes()}), got shape"
                       f" {out.shape}; build it from elementwise ops on b, h, q_idx and kv_idx.")
    full = (1,) * (4 - len(out.shape)) + tuple(out.shape)
    _init(self, fn, tuple(operands), full[0] != 1, full[1] != 1)

  def evaluate(self, coords: Coords):
    return self.fn(coords.b, coords.h, coords.q_index, coords.kv_index, *self.operands)

  def allows(self, q_pos, k_pos):
    raise TypeError(f"{self!r} is evaluated on batch rows, heads and token indices"
                    " (`evaluate(Coords(...))`), not on positions alone.")

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    # Nothing known from position bounds: every block is left to `blocks.refine`.
    false = (q_lo != q_lo) | (k_lo != k_lo)
    return false, false

  @property
  def needs_tiles(self) -> bool:
    return True

  @property
  def per_head(self) -> bool:
    return self.by_head

  @property
  def reads_index(self) -> bool:
    return True

  def __repr__(self):
    return f"MaskMod({_name(self.fn)}, {_describe(self.operands)})"


def _init(obj, fn, operands, *flags):
  object.__setattr__(obj, "fn", fn)
  object.__setattr__(obj, "operands", operands)
  names = [f.name for f in dataclasses.fields(obj)][2:]
  for name, flag in zip(names, flags, strict=True):
    object.__setattr__(obj, name, flag)


def _probe_shapes() -> str:
  return ", ".join(f"{n} {a.shape}" for n, a in zip(("b", "h", "q_idx", "kv_idx"),
                                                     _probe_args(), strict=True))


def _describe(operands) -> str:
  leaves = jax.tree.leaves(operands)
  return "operands=(" + ", ".join(f"{jnp.dtype(x.dtype).name}{list(x.shape)}" for x in leaves) + ")"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ScoreMod:
  """A change to the scores: `fn(score, b, h, q_idx, kv_idx, *operands)` returns the new
  score. `score` is the float32 scaled score (after `logit_soft_cap`, which applies first),
  the index arrays as for `MaskMod`; masking applies after. Float operands receive
  gradients (ALiBi slopes, a relative-position bias table).

  Raises:
    TypeError: `fn` not callable, an operand that is not an array, or `fn` failing or
      returning other than a float array of the score's shape.
  """

  fn: Callable[..., Any]
  operands: tuple = ()

  def __init__(self, fn: Callable[..., Any], *operands):
    if not callable(fn):
      raise TypeError(f"ScoreMod expects a function fn(score, b, h, q_idx, kv_idx, *operands) ->"
                      f" score as its first argument (score_mod), got {fn!r}.")
    _check_operands("ScoreMod", operands)
    score = jax.ShapeDtypeStruct(_PROBE, jnp.float32)
    out = _result("score_mod", fn, [score, *_probe_args()], operands)
    if not jnp.issubdtype(out.dtype, jnp.floating) or out.shape != _PROBE:
      raise TypeError(f"score_mod {_name(fn)} expects the new scores, a float array of the"
                      f" score's shape {_PROBE} (float32 scores of shape (b, h, q, kv) in the"
                      f" probe), got {out.dtype} of shape {out.shape}.")
    _init(self, fn, tuple(operands))

  def __call__(self, score, coords: Coords):
    """The new scores (float32), given float32 `score` and where they sit."""
    out = self.fn(score, coords.b, coords.h, coords.q_index, coords.kv_index, *self.operands)
    return out.astype(jnp.float32)

  def float_operands(self) -> list:
    """The operands' floating leaves (the ones that receive gradients), in leaf order."""
    return [x for x in jax.tree.leaves(self.operands) if jnp.issubdtype(x.dtype, jnp.floating)]

  def vjp(self, score, coords: Coords, reads: list | None = None, spread: bool = False):
    """(new scores, pullback): `pullback(d_new)` gives (d_score, [d_read float32 for each
    float read]). An array leaf of the operands is read whole: its reads are
    `float_operands`, its d the operand's gradient. A leaf that is an `Operand` (in a
    kernel's memory) is read by each indexing: its d is the gradient at that index, and
    `reads` receives (which of `float_operands`, index) of each such read, in order
    (None: these reads get no gradient). `spread`: each such read's d per score, of the
    score's shape (the read broadcast to it), for a kernel that sums them itself."""
    leaves, treedef = jax.tree.flatten(self.operands)
    whole = [i for i, x in enumerate(leaves)
             if not isinstance(x, Operand) and jnp.issubdtype(x.dtype, jnp.floating)]
    found = []  # (position, index, value) of each indexing of an Operand leaf

    def with_hooks(ops, hook):
      return [dataclasses.replace(x, hook=functools.partial(hook, i))
              if isinstance(x, Operand) else x for i, x in enumerate(ops)]

    def call(score, ops):
      out = self.fn(score, coords.b, coords.h, coords.q_index, coords.kv_index,
                    *jax.tree.unflatten(treedef, ops))
      return out.astype(jnp.float32)

    def record(i, op, index):
      found.append((i, index, op.load(index)))
      return found[-1][2]
    if any(isinstance(x, Operand) for x in leaves):  # finds the reads, each loaded once
      call(score, with_hooks(leaves, record))
    parts = [n for n, (_, _, x) in enumerate(found)
             if reads is not None and jnp.issubdtype(x.dtype, jnp.floating)]

    def apply(score, floats, read_floats):
      ops = list(leaves)
      for i, x in zip(whole, floats, strict=True):
        ops[i] = x
      values = [x for _, _, x in found]
      for n, x in zip(parts, read_floats, strict=True):
        values[n] = x
      replay = iter(values)
      return call(score, with_hooks(ops, lambda i, op, index: next(replay)))

    out, pullback = jax.vjp(apply, score, [leaves[i] for i in whole], [
        jnp.broadcast_to(found[n][2], score.shape) if spread else found[n][2] for n in parts])
    if reads is not None:
      floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]
      reads.extend((floats.index(found[n][0]), found[n][1]) for n in parts)

    def back(d_new):
      d_score, d_whole, d_parts = pullback(d_new)
      return d_score, [d.astype(jnp.float32) for d in (*d_whole, *d_parts)]
    return out, back

  def cotangent(self, d_floats: list) -> ScoreMod:
    """This mod's cotangent for a custom VJP: `d_floats` (one per `float_operands`) in
    their leaves' dtypes, float0 zeros for the others."""
    grads = iter(d_floats)
    return jax.tree.map(
        lambda x: next(grads).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else zero_cotangent(x), self)

  def __repr__(self):
    return f"ScoreMod({_name(self.fn)}, {_describe(self.operands)})"


def _flatten(mod):
  return (mod.operands,), tuple(getattr(mod, f.name) for f in dataclasses.fields(mod)
                                if f.name != "operands")


def _unflatten(cls):
  def build(aux, children):
    obj = object.__new__(cls)  # no probe: the leaves may be anything while JAX rebuilds it
    _init(obj, aux[0], children[0], *aux[1:])
    return obj
  return build


for _cls in (MaskMod, ScoreMod):
  jax.tree_util.register_pytree_node(_cls, _flatten, _unflatten(_cls))


def zero_cotangent(x):
  """The zero cotangent of array `x` (float0 for integers and bools)."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros(x.shape, x.dtype)
  return np.zeros(x.shape, jax.dtypes.float0)


def zero_cotangents(tree):
  """`zero_cotangent` of every leaf of `tree` (a mask's operands: they receive none)."""
  return jax.tree.map(zero_cotangent, tree)


def check_score_mod(score_mod) -> ScoreMod | None:
  """`score_mod` if it is a `ScoreMod` or None, else a TypeError saying what is accepted."""
  if score_mod is None or isinstance(score_mod, ScoreMod):
    return score_mod
  raise TypeError(f"score_mod expects a flaxattn.ScoreMod(fn, *operands) or None, got"
                  f" {score_mod!r} ({type(score_mod).__name__}); wrap a function"
                  " fn(score, b, h, q_idx, kv_idx, *operands) in flaxattn.ScoreMod.")


@dataclasses.dataclass(frozen=True)
class Operand:
  """A leaf of a mod's operands inside a GPU kernel: the ref that holds it, which the mod's
  function reads by indexing (`prefix_len[b]`, `slopes[h]`, `table[bucket, h]`, `w[()]`),
  each read a load from memory at the indices (a gather where they are arrays), as
  FlexAttention's functions read the tensors they capture. An index wraps once when
  negative and is clamped to its axis, as jnp's indexing reads it. `hook(operand, index)`,
  where set, stands for the load (how `ScoreMod.vjp` records and replays the reads)."""

  ref: Any
  hook: Callable[..., Any] | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.ref.shape)

  @property
  def dtype(self):
    return self.ref.dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def load(self, index):
    """The values at `index` (normalized by `__getitem__`), read from the ref."""
    return self.ref[index]

  def __getitem__(self, index):
    index = _in_bounds(index, self.shape)
    return self.load(index) if self.hook is None else self.hook(self, index)


def _in_bounds(index, shape: tuple[int, ...]) -> tuple:
  """`index` of an array of `shape` as a tuple of one entry per leading axis: integers and
  integer arrays wrapped once when negative and clamped to the axis, slices as they are."""
  index = index if isinstance(index, tuple) else (index,)
  if any(i is Ellipsis for i in index):
    at = index.index(Ellipsis)
    index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
  if len(index) > len(shape):
    raise IndexError(f"an operand of shape {shape} read inside a kernel with {len(index)}"
                     f" indices {index}; index it with at most one entry per axis.")

  def entry(i, n):
    if isinstance(i, slice):
      return i
    if isinstance(i, (int, np.integer)):
      i = int(i)
      return min(max(i + n if i < 0 else i, 0), n - 1)
    if not jnp.issubdtype(i.dtype, jnp.integer):
      raise TypeError(f"an operand read inside a kernel takes integers, integer arrays and"
                      f" slices as indices, got {i!r}; index it with integer arrays.")
    return jnp.clip(jnp.where(i < 0, i + n, i), 0, n - 1)
  return tuple(entry(i, n) for i, n in zip(index, shape, strict=False))


def in_kernel(mod, refs: list):
  """`mod` (a mask or a `ScoreMod`, a pytree) with its operand leaves replaced by
  `Operand`s of `refs` (a kernel's refs of those leaves, in leaf order)."""
  return jax.tree.unflatten(jax.tree.structure(mod), [Operand(r) for r in refs])


def change_scores(s, soft_cap: float | None, mod=None):
  """Scores `s` (float32, scaled) as the softmax reads them before masking: soft-capped
  (`soft_cap * tanh(s / soft_cap)`; None: not), then changed by `mod` (`s -> (new s,
  pullback)`, `ScoreMod.vjp` on the block's coordinates, the pullback None where no
  backward pass follows; None: not); and their pullback `back(d) -> (d of s, [d of each
  float read of the mod])` for a backward pass."""
  tanh = mod_back = None
  if soft_cap is not None:
    tanh = jnp.tanh(s / soft_cap)
    s = soft_cap * tanh
  if mod is not None:
    s, mod_back = mod(s)

  def back(ds):
    d_reads = []
    if mod_back is not None:
      ds, d_reads = mod_back(ds)
    if tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
      ds = ds * (1.0 - tanh * tanh)
    return ds, d_reads
  return s, back


@dataclasses.dataclass(frozen=True)
class Read:
  """One read of an operand by a mod's function on a kernel's block (`reads`): whose
  function (`mask_mod` or `score_mod` and its name), the operand leaf read (`leaf`, its
  shape) and the shape of the values read (() where one index serves the whole block)."""

  owner: str
  leaf: tuple[int, ...]
  shape: tuple[int, ...]


def reads(mask, score_mod: ScoreMod | None) -> list[Read]:
  """The reads of their operands that `mask` and `score_mod` make on a block laid out
  `[rows, keys]` (the batch row one index, the head, token index and position one per
  row or per key), found by tracing them abstractly with their operands as `Operand`s.

  Raises:
    TypeError: a function that uses an operand other than by indexing it (inside a kernel
      an operand is memory, read by indexing), naming the function and the error.
  """
  shapes = [(), (2, 1), (2, 1), (1, 3), (2, 1), (1, 3)]  # b, h, q_idx, kv_idx, positions
  where = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in shapes]
  score = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  found: list[Read] = []

  def trace(mod, name, run):
    leaves, treedef = jax.tree.flatten(mod)
    if not leaves:
      return

    def record(op, index):
      value = op.load(index)
      found.append(Read(name, op.shape, tuple(value.shape)))
      return value

    def go(score, where, leaves):
      run(jax.tree.unflatten(treedef, [Operand(x, record) for x in leaves]), score,
          Coords(*where))
    try:
      jax.eval_shape(go, score, where, [jax.ShapeDtypeStruct(x.shape, x.dtype)
                                        for x in leaves])
    except Exception as e:  # any error inside the user's function: say whose it is
      raise TypeError(f"{name} failed on its operands as a kernel holds them: memory that the"
                      " function reads by indexing (x[b], x[h], x[i, h], w[()] for a 0-d"
                      f" one), not arrays; {type(e).__name__}: {e}") from e
  for part in _parts_of(mask):
    trace(part, f"mask_mod {_name(part.fn)}", lambda m, s, c: m.evaluate(c))
  if score_mod is not None:
    trace(score_mod, f"score_mod {_name(score_mod.fn)}", lambda m, s, c: m(s, c))
  return found


def _parts_of(mask) -> list[MaskMod]:
  """The `MaskMod`s inside `mask` (a combination of masks)."""
  if isinstance(mask, MaskMod):
    return [mask]
  inner = mask.masks if isinstance(mask, (And, Or)) else [mask.mask] if isinstance(
      mask, Not) else []
  return [m for part in inner for m in _parts_of(part)]


def batch_reads(score_mod: ScoreMod, b) -> list:
  """The float reads of `score_mod` as `ScoreMod.vjp` lists them, where each reads at an
  index that depends on the batch row alone (what a kernel that loads only scalars runs,
  `reads`), evaluated for batch rows `b` (int32 `[B]`, global): (which of
  `float_operands`, index of arrays `[B]`) each."""
  leaves, treedef = jax.tree.flatten(score_mod)
  zero = jnp.zeros((), jnp.int32)
  coords = Coords(b, zero, zero, zero, zero, zero)
  found: list = []
  jax.tree.unflatten(treedef, [Operand(x) for x in leaves]).vjp(
      jnp.zeros(b.shape, jnp.float32), coords, found)
  return found
