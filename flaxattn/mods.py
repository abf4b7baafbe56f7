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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxattn.masks import Coords, Mask

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

  def vjp(self, score, coords: Coords):
    """(new scores, pullback): `pullback(d_new)` gives (d_score, [d_operand] float32 for
    each of `float_operands`)."""
    leaves, treedef = jax.tree.flatten(self.operands)
    at = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]

    def apply(score, floats):
      ops = list(leaves)
      for i, x in zip(at, floats, strict=True):
        ops[i] = x
      out = self.fn(score, coords.b, coords.h, coords.q_index, coords.kv_index,
                    *jax.tree.unflatten(treedef, ops))
      return out.astype(jnp.float32)

    out, pullback = jax.vjp(apply, score, [leaves[i] for i in at])

    def back(d_new):
      d_score, d_floats = pullback(d_new)
      return d_score, [d.astype(jnp.float32) for d in d_floats]
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
