"""Attention masks as data: small hashable values on positions, never on array indices.

Every mask answers `evaluate(coords)`: which scores of a tile it allows, given where they
sit (`Coords`: batch row, query head, token indices and positions). The built-ins read
positions only (`allows(q_pos, k_pos)`); a `flaxattn.MaskMod` reads anything (`mods.py`).
For a block of positions, `block_kinds` says certainly empty / certainly dense
(conservative), on numpy and jax arrays; a mask with programmable parts (`needs_tiles`)
leaves its blocks to be classified on device from tiles (`blocks.refine`). Masks combine
with `&`, `|` and `~`. `band(mask)` is the one normal form that splash and cuDNN read.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxattn import checks

# Positions are int32; `minus` and `floor_div` are exact for sizes up to its maximum.
MAX_SIZE = 2**31 - 1


def _check_size(cls_name: str, arg: str, value) -> int:
  return checks.integer(f"{cls_name}({arg}=...)", value, f"a positive int of at most {MAX_SIZE}"
                        " (positions are int32)", lambda x: 0 < x <= MAX_SIZE,
                        f"pass the {arg} in tokens, e.g. {cls_name}(128)")


def floor_div(x, n: int):
  """`x // n` for int arrays, numpy or jax, exact for every int32 (no intermediate
  overflows near -2**31). For jax it avoids `sign` (what `//` lowers through), which Mosaic
  cannot lower for TPU from another host, so masks evaluated inside a splash kernel lower
  anywhere: for x < 0, floor(x / n) = trunc((x + 1) / n) - 1."""
  if isinstance(x, (int, np.ndarray, np.integer)):
    return x // n
  neg = x < 0
  return (jax.lax.div(jnp.where(neg, x + 1, x), jnp.asarray(n, x.dtype))
          - jnp.where(neg, 1, 0).astype(x.dtype))


def minus(x, n: int):
  """`x - n` for positions `x` (int, numpy or jax) and 0 <= n < 2**31, saturating at the
  dtype's minimum instead of wrapping to large positive values. Exact in `k >= minus(q, n)`:
  where q - n is below the minimum, every key position satisfies both."""
  if isinstance(x, int):
    return x - n
  low = np.iinfo(x.dtype).min
  return np.maximum(x, low + n) - n if isinstance(x, (np.ndarray, np.integer)) else (
      jnp.maximum(x, jnp.asarray(low + n, x.dtype)) - jnp.asarray(n, x.dtype))


def values_apart(v, allowed):
  """`v` with its non-finite keys zeroed, and which rows are allowed to see one of them:
  `p @ v` gives 0 * NaN = NaN where a masked key's value is NaN or inf (a padding token's),
  so a kernel multiplies by these values and sets the rows returned to NaN, and a value
  that the mask excludes reaches no output. Sums only (no boolean reductions): Triton
  lowers it too.

  Args:
    v: `[..., S, Dv]` values (or keys) of one block, any float dtype.
    allowed: bool `[..., R, S]`, broadcasting against v's leading axes: which rows may see
      which keys.
  Returns:
    v in its dtype with non-finite keys zeroed, and bool `[..., R]`: rows allowed a
    non-finite key (their output is NaN, as without the zeroing).
  """
  bad_S = jnp.sum(v.astype(jnp.float32) * 0.0, axis=-1) != 0.0  # inf * 0 and NaN give NaN
  clean = jnp.where(bad_S[..., None], jnp.zeros((), v.dtype), v)
  seen_R = jnp.sum(jnp.where(allowed & bad_S[..., None, :], 1.0, 0.0), axis=-1) > 0.0
  return clean, seen_R


@dataclasses.dataclass(frozen=True)
class Coords:
  """Where the scores of a tile sit, as int32 arrays that broadcast against each other (a
  kernel gives each the axes of its tile): `b` the batch row and `h` the query head (both
  global: under sharding, the index in the whole batch and over all heads), `q_index` /
  `kv_index` each token's index in the row as the caller ordered it (under load-balanced
  context parallelism, the order before balancing), `q_pos` / `kv_pos` positions in the
  document."""

  b: Any
  h: Any
  q_index: Any
  kv_index: Any
  q_pos: Any
  kv_pos: Any


class Mask:
  """Base class of all masks. Subclasses are frozen dataclasses and pytrees (the operands
  of a `MaskMod` are their leaves, traced; everything else is static)."""

  def allows(self, q_pos, k_pos):
    """Boolean array broadcast from `q_pos` and `k_pos`: True where attention is allowed.
    Masks on positions only; others raise (they need `evaluate`)."""
    raise NotImplementedError

  def evaluate(self, coords: Coords):
    """Boolean array broadcast from `coords`: True where attention is allowed."""
    return self.allows(coords.q_pos, coords.kv_pos)

  @property
  def needs_tiles(self) -> bool:
    """True when `block_kinds` cannot classify some blocks from position bounds (a
    `MaskMod` inside): kernels then classify those blocks from tiles (`blocks.refine`)."""
    return False

  @property
  def per_head(self) -> bool:
    """True when the mask may differ between query heads."""
    return False

  @property
  def reads_index(self) -> bool:
    """True when the mask reads token indices or batch rows (`Coords.q_index`, ...), which
    kernels then compute; the built-ins read positions only."""
    return False

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    """Returns `(skip, full)` boolean arrays broadcast from the position bounds."""
    raise NotImplementedError

  @property
  def is_causal(self) -> bool:
    """True if no query ever sees a key at a later position."""
    return False

  def __and__(self, other: Mask) -> Mask:
    if not isinstance(other, Mask):
      return NotImplemented
    return And(_parts(And, self, other))

  def __or__(self, other: Mask) -> Mask:
    if not isinstance(other, Mask):
      return NotImplemented
    return Or(_parts(Or, self, other))

  def __invert__(self) -> Mask:
    return self.mask if isinstance(self, Not) else Not(self)


def _parts(cls, *masks: Mask) -> tuple[Mask, ...]:
  """The operands of `cls` (And or Or) over `masks`, nested ones of the same kind flattened."""
  out: list[Mask] = []
  for m in masks:
    out.extend(m.masks if isinstance(m, _Combination) and isinstance(m, cls) else (m,))
  return tuple(out)


def _static(cls):
  """Registers a mask class without traced fields as a pytree with no leaves."""
  fields = [f.name for f in dataclasses.fields(cls)]
  return jax.tree_util.register_dataclass(cls, data_fields=[], meta_fields=fields)


@_static
@dataclasses.dataclass(frozen=True)
class Full(Mask):
  """Every query sees every key of its document."""

  def allows(self, q_pos, k_pos):
    return (q_pos == q_pos) & (k_pos == k_pos)

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    false = (q_lo != q_lo) | (k_lo != k_lo)
    return false, ~false


@_static
@dataclasses.dataclass(frozen=True)
class Causal(Mask):
  """A query at position p sees keys at positions k <= p."""

  def allows(self, q_pos, k_pos):
    return k_pos <= q_pos

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    return k_lo > q_hi, k_hi <= q_lo

  @property
  def is_causal(self) -> bool:
    return True


@_static
@dataclasses.dataclass(frozen=True)
class Local(Mask):
  """Sliding window: a query at position p sees keys at p - window < k <= p."""

  window: int

  def __post_init__(self):
    object.__setattr__(self, "window", _check_size("Local", "window", self.window))

  # q - window + 1 <= k, saturated (`minus`): positions near -2**31 do not wrap.
  def allows(self, q_pos, k_pos):
    return (k_pos <= q_pos) & (k_pos >= minus(q_pos, self.window - 1))

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    skip = (k_lo > q_hi) | (k_hi < minus(q_lo, self.window - 1))
    full = (k_hi <= q_lo) & (k_lo >= minus(q_hi, self.window - 1))
    return skip, full

  @property
  def is_causal(self) -> bool:
    return True


@_static
@dataclasses.dataclass(frozen=True)
class Chunked(Mask):
  """Llama 4 chunked attention: causal inside aligned chunks of `size` positions.

  A query at position p sees keys k <= p with k // size == p // size.
  """

  size: int

  def __post_init__(self):
    object.__setattr__(self, "size", _check_size("Chunked", "size", self.size))

  def allows(self, q_pos, k_pos):
    return (k_pos <= q_pos) & (floor_div(k_pos, self.size) == floor_div(q_pos, self.size))

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    q_lo_c, q_hi_c, k_lo_c, k_hi_c = (floor_div(x, self.size) for x in (q_lo, q_hi, k_lo, k_hi))
    skip = (k_lo > q_hi) | (k_hi_c < q_lo_c) | (k_lo_c > q_hi_c)
    one_chunk = (q_lo_c == q_hi_c) & (k_lo_c == k_hi_c) & (k_lo_c == q_lo_c)
    full = (k_hi <= q_lo) & one_chunk
    return skip, full

  @property
  def is_causal(self) -> bool:
    return True


class _Combination(Mask):
  """`And` / `Or`: a tuple of parts, each a pytree (so a `MaskMod`'s operands stay leaves)."""

  masks: tuple[Mask, ...]

  def __post_init__(self):
    if not self.masks or not all(isinstance(m, Mask) for m in self.masks):
      raise ValueError(f"{type(self).__name__}(masks=...) expects a non-empty tuple of Mask, got"
                       f" {self.masks!r}")

  @property
  def needs_tiles(self) -> bool:
    return any(m.needs_tiles for m in self.masks)

  @property
  def per_head(self) -> bool:
    return any(m.per_head for m in self.masks)

  @property
  def reads_index(self) -> bool:
    return any(m.reads_index for m in self.masks)


@dataclasses.dataclass(frozen=True)
class And(_Combination):
  """Intersection of masks: a pair is allowed only if every part allows it."""

  masks: tuple[Mask, ...]

  def allows(self, q_pos, k_pos):
    return functools.reduce(operator.and_, [m.allows(q_pos, k_pos) for m in self.masks])

  def evaluate(self, coords: Coords):
    return functools.reduce(operator.and_, [m.evaluate(coords) for m in self.masks])

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    skip, full = self.masks[0].block_kinds(q_lo, q_hi, k_lo, k_hi)
    for m in self.masks[1:]:
      s, f = m.block_kinds(q_lo, q_hi, k_lo, k_hi)
      skip, full = skip | s, full & f
    return skip, full

  @property
  def is_causal(self) -> bool:
    return any(m.is_causal for m in self.masks)


@dataclasses.dataclass(frozen=True)
class Or(_Combination):
  """Union of masks: a pair is allowed if some part allows it (segment ids still separate
  documents), e.g. `Local(512) | MaskMod(prefix, prefix_len)`."""

  masks: tuple[Mask, ...]

  def allows(self, q_pos, k_pos):
    return functools.reduce(operator.or_, [m.allows(q_pos, k_pos) for m in self.masks])

  def evaluate(self, coords: Coords):
    return functools.reduce(operator.or_, [m.evaluate(coords) for m in self.masks])

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    skip, full = self.masks[0].block_kinds(q_lo, q_hi, k_lo, k_hi)
    for m in self.masks[1:]:
      s, f = m.block_kinds(q_lo, q_hi, k_lo, k_hi)
      skip, full = skip & s, full | f
    return skip, full

  @property
  def is_causal(self) -> bool:
    return all(m.is_causal for m in self.masks)


@dataclasses.dataclass(frozen=True)
class Not(Mask):
  """Complement of a mask (`~mask`): the pairs of a document that `mask` does not allow."""

  mask: Mask

  def __post_init__(self):
    if not isinstance(self.mask, Mask):
      raise ValueError(f"Not(mask=...) expects a Mask, got {self.mask!r}")

  def allows(self, q_pos, k_pos):
    return ~self.mask.allows(q_pos, k_pos)

  def evaluate(self, coords: Coords):
    return ~self.mask.evaluate(coords)

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    skip, full = self.mask.block_kinds(q_lo, q_hi, k_lo, k_hi)
    return full, skip

  @property
  def needs_tiles(self) -> bool:
    return self.mask.needs_tiles

  @property
  def per_head(self) -> bool:
    return self.mask.per_head

  @property
  def reads_index(self) -> bool:
    return self.mask.reads_index


for _cls, _fields in ((And, ["masks"]), (Or, ["masks"]), (Not, ["mask"])):
  jax.tree_util.register_dataclass(_cls, data_fields=_fields, meta_fields=[])


def check_mask(mask) -> Mask:
  """Returns `mask` if it is a `Mask`, else raises a TypeError saying what is accepted."""
  if not isinstance(mask, Mask):
    raise TypeError(
        f"mask expects a flaxattn mask (Full(), Causal(), Local(window), Chunked(size),"
        f" MaskMod(fn, *operands), or a combination with &, | and ~), got {mask!r}"
        f" ({type(mask).__name__})."
    )
  return mask


def allowed(mask: Mask, coords: Coords, q_seg, kv_seg):
  """Bool, broadcast from the arguments: the query and the key share a non-zero segment id
  and `mask` allows the pair (the rule every kernel applies inside a partial block)."""
  return (q_seg == kv_seg) & (q_seg != 0) & mask.evaluate(coords)


class NoBand(ValueError):
  """A mask with no normal form; the message says why."""


@dataclasses.dataclass(frozen=True)
class Band:
  """The normal form of a mask: causal or not, the smallest window, one chunk size.

  Local and Chunked are causal, so `window` or `chunk` imply `causal`. Hashable, so a kernel
  built for a mask is cached by its band.
  """

  causal: bool = False
  window: int | None = None
  chunk: int | None = None

  @property
  def mask(self) -> Mask:
    """The mask this band is the normal form of (its `allows` is the one rule)."""
    parts = [m for m in (Local(self.window) if self.window else None,
                         Chunked(self.chunk) if self.chunk else None) if m is not None]
    if not parts:
      return Causal() if self.causal else Full()
    return parts[0] if len(parts) == 1 else And(tuple(parts))


def band(mask: Mask) -> Band:
  """`mask` in normal form.

  Raises:
    NoBand: Chunked masks of different sizes combined (no single chunk size), or a mask
      type other than Full, Causal, Local, Chunked.
  """
  causal, windows, chunks = False, set(), set()
  for m in (mask.masks if isinstance(mask, And) else (mask,)):
    causal |= m.is_causal
    if isinstance(m, Local):
      windows.add(m.window)
    elif isinstance(m, Chunked):
      chunks.add(m.size)
    elif not isinstance(m, (Full, Causal)):
      raise NoBand(f"mask {m!r} has no normal form (causal, sliding window, chunks).")
  if len(chunks) > 1:
    raise NoBand(f"Chunked masks of different sizes {sorted(chunks)} combined have no single"
                 " chunk size.")
  return Band(causal, min(windows, default=None), min(chunks, default=None))


def reach(mask: Mask) -> int | None:
  """R: a query sees keys at most R - 1 tokens back (the smallest window or chunk size), or
  None when the mask has no bound."""
  try:
    normal = band(mask)
  except NoBand:
    return None
  return min((x for x in (normal.window, normal.chunk) if x), default=None)
