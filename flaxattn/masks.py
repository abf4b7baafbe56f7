"""Attention masks as data: small hashable values on positions, never on array indices.

Every mask answers `evaluate(coords)`: which scores of a tile it allows, given where they
sit (`Coords`: batch row, query head, token indices and positions). The built-ins read
positions only (`allows(q_pos, k_pos)`); a `flaxattn.MaskMod` reads anything (`mods.py`).
For a block of positions, `block_kinds` says certainly empty / certainly dense
(conservative), on numpy and jax arrays; a mask with programmable parts (`needs_tiles`)
leaves its blocks to be classified on device from tiles (`blocks.refine`). Masks combine
with `&`, `|` and `~`. `band(mask)` is the one normal form that splash and cuDNN read: the
offsets k - q a query may see, and one chunk size.
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


def plus(x, n: int):
  """`x + n` for positions `x` (int, numpy or jax) and 0 <= n < 2**31, saturating at the
  dtype's maximum instead of wrapping to large negative values."""
  if isinstance(x, int):
    return x + n
  high = np.iinfo(x.dtype).max
  return np.minimum(x, high - n) + n if isinstance(x, (np.ndarray, np.integer)) else (
      jnp.minimum(x, jnp.asarray(high - n, x.dtype)) + jnp.asarray(n, x.dtype))


def at_least(k, q, n: int):
  """`k >= q + n` for positions (int, numpy or jax, broadcasting) and |n| < 2**31, exact for
  every int32: where one side saturates (`minus`, `plus`) the other decides."""
  if n == 0:
    return k >= q
  if n < 0:
    return k >= minus(q, -n)
  return (plus(q, n) <= k) & (minus(k, n) >= q)


def at_most(k, q, n: int):
  """`k <= q + n`, exact as `at_least`."""
  return at_least(q, k, -n)


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

  def allows(self, q_pos, k_pos):
    return _offsets_allow(1 - self.window, 0, q_pos, k_pos)

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    return _offsets_block_kinds(1 - self.window, 0, q_lo, q_hi, k_lo, k_hi)

  @property
  def is_causal(self) -> bool:
    return True


@_static
@dataclasses.dataclass(frozen=True)
class Window(Mask):
  """Sliding window with a size on each side, as splash's `LocalMask`: a query at position p
  sees keys at p + offset - left <= k <= p + offset + right. None leaves a side unbounded.

    Window(4, 4)          a bidirectional window: 4 keys on each side and the query's own
    Window(w - 1, 0)      the same keys as Local(w): w of them, the query's own the last
    Window(0, 8)          the query's own key and the 8 after it
    Window(None, 0, -1)   every earlier key, not the query's own

  Args:
    left, right: keys seen before / after position p + offset: ints >= 0, or None.
    offset: shifts the window (negative: back), an int.
  Raises:
    ValueError: a size or offset that is not an int in its range, or bounds offset - left
      or offset + right beyond int32 positions' +-(2**31 - 1).
  """

  left: int | None
  right: int | None
  offset: int = 0

  def __post_init__(self):
    for arg in ("left", "right"):
      value = getattr(self, arg)
      if value is not None:
        object.__setattr__(self, arg, checks.integer(
            f"Window({arg}=...)", value, f"an int in [0, {MAX_SIZE}] or None (unbounded)",
            lambda x: 0 <= x <= MAX_SIZE, f"the {arg} size counts keys on that side"))
    object.__setattr__(self, "offset", checks.integer(
        "Window(offset=...)", self.offset, f"an int in [-{MAX_SIZE}, {MAX_SIZE}]",
        lambda x: abs(x) <= MAX_SIZE, "positions are int32"))
    for name, bound in (("offset - left", self.lo), ("offset + right", self.hi)):
      if bound is not None and abs(bound) > MAX_SIZE:
        raise ValueError(f"Window({self.left}, {self.right}, offset={self.offset}) expects"
                         f" {name} in [-{MAX_SIZE}, {MAX_SIZE}] (positions are int32), got"
                         f" {bound}; pass None for a side without a bound.")

  @property
  def lo(self) -> int | None:
    """The smallest offset k - p seen; None: unbounded."""
    return None if self.left is None else self.offset - self.left

  @property
  def hi(self) -> int | None:
    """The largest offset k - p seen; None: unbounded."""
    return None if self.right is None else self.offset + self.right

  def allows(self, q_pos, k_pos):
    return _offsets_allow(self.lo, self.hi, q_pos, k_pos)

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    return _offsets_block_kinds(self.lo, self.hi, q_lo, q_hi, k_lo, k_hi)

  @property
  def is_causal(self) -> bool:
    return self.hi is not None and self.hi <= 0


def _offsets_allow(lo: int | None, hi: int | None, q_pos, k_pos):
  """lo <= k - q <= hi (None: no bound on that side), exact on int32 positions."""
  parts = [f(k_pos, q_pos, n) for f, n in ((at_least, lo), (at_most, hi)) if n is not None]
  if not parts:
    return (q_pos == q_pos) & (k_pos == k_pos)
  return functools.reduce(operator.and_, parts)


def _offsets_block_kinds(lo: int | None, hi: int | None, q_lo, q_hi, k_lo, k_hi):
  """`(skip, full)` of `_offsets_allow` for queries in [q_lo, q_hi] and keys in [k_lo, k_hi]:
  skip where even the pair of offset closest to the window misses it, full where the
  pairs of both extreme offsets fall in it."""
  false = (q_lo != q_lo) | (k_lo != k_lo)
  skip, full = false, ~false
  if lo is not None:
    skip, full = skip | ~at_least(k_hi, q_lo, lo), full & at_least(k_lo, q_hi, lo)
  if hi is not None:
    skip, full = skip | ~at_most(k_lo, q_hi, hi), full & at_most(k_hi, q_lo, hi)
  return skip, full


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
        f"mask expects a flaxattn mask (Full(), Causal(), Local(window), Window(left, right),"
        f" Chunked(size),"
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
  """The normal form of a mask: a query at position q sees keys k with lo <= k - q <= hi
  (None: no bound on that side) and, with `chunk`, only keys in its own aligned chunk of
  `chunk` positions. Chunked is causal, so with `chunk` hi <= 0. Hashable, so a kernel
  built for a mask is cached by its band.
  """

  lo: int | None = None
  hi: int | None = None
  chunk: int | None = None

  @property
  def mask(self) -> Mask:
    """The mask this band is the normal form of (its `allows` is the one rule)."""
    window = _offsets_mask(self.lo, self.hi)
    if self.chunk and window == Causal():  # Chunked is causal itself
      window = None
    parts = [m for m in (window, Chunked(self.chunk) if self.chunk else None) if m is not None]
    if not parts:
      return Full()
    return parts[0] if len(parts) == 1 else And(tuple(parts))

  def keys_seen(self, pos, doc_len):
    """int64 numpy, broadcast: the keys a query at position `pos` sees in a document of
    `doc_len` tokens (positions 0 .. doc_len - 1)."""
    pos, doc_len = np.asarray(pos, np.int64), np.asarray(doc_len, np.int64)
    first, last = np.zeros_like(pos), doc_len - 1
    if self.lo is not None:
      first = np.maximum(first, pos + self.lo)
    if self.hi is not None:
      last = np.minimum(last, pos + self.hi)
    if self.chunk:
      start = pos - pos % self.chunk
      first, last = np.maximum(first, start), np.minimum(last, start + self.chunk - 1)
    return np.maximum(last - first + 1, 0)

  def pairs(self, n):
    """int64 numpy, elementwise: the (query, key) pairs allowed in a document of `n` tokens,
    the sum of `keys_seen` over its positions in closed form."""
    n = np.asarray(n, np.int64)
    if self.chunk:
      within = dataclasses.replace(self, chunk=None)
      return n // self.chunk * within.pairs(self.chunk) + within.pairs(n % self.chunk)
    lo = -(n - 1) if self.lo is None else np.maximum(self.lo, -(n - 1))
    hi = n - 1 if self.hi is None else np.minimum(self.hi, n - 1)

    def tri(x):  # 0 + 1 + ... + x, 0 for x = -1
      return x * (x + 1) // 2
    # Offset d is seen by the n - |d| queries that have a key there: sum over [lo, hi].
    abs_sum = np.where(lo >= 0, tri(hi) - tri(lo - 1),
                       np.where(hi <= 0, tri(-lo) - tri(-hi - 1), tri(-lo) + tri(hi)))
    return np.where(hi >= lo, (hi - lo + 1) * n - abs_sum, 0)


def _offsets_mask(lo: int | None, hi: int | None) -> Mask | None:
  """The built-in mask of `lo <= k - q <= hi` (None where both are None), simplest first."""
  if hi is not None and lo is None:
    return Causal() if hi == 0 else Window(None, 0, hi)
  if lo is None:
    return None
  if hi is None:
    return Window(0, None, lo)
  if hi == 0 and lo <= 0:
    return Local(1 - lo)
  if lo > hi:  # an intersection of windows that allows nothing
    return And((Window(0, None, lo), Window(None, 0, hi)))
  offset = min(max(0, lo), hi)
  return Window(offset - lo, hi - offset, offset)


def band(mask: Mask) -> Band:
  """`mask` in normal form.

  Raises:
    NoBand: Chunked masks of different sizes combined (no single chunk size), or a mask
      type other than Full, Causal, Local, Window, Chunked (an `|`, `~` or MaskMod).
  """
  lo, hi, chunks = None, None, set()
  for m in (mask.masks if isinstance(mask, And) else (mask,)):
    if isinstance(m, Full):
      continue
    if isinstance(m, (Causal, Chunked)):
      bounds = (None, 0)
    elif isinstance(m, Local):
      bounds = (1 - m.window, 0)
    elif isinstance(m, Window):
      bounds = (m.lo, m.hi)
    else:
      raise NoBand(f"mask {m!r} has no normal form (a window of offsets k - q, chunks).")
    if isinstance(m, Chunked):
      chunks.add(m.size)
    lo = bounds[0] if lo is None else lo if bounds[0] is None else max(lo, bounds[0])
    hi = bounds[1] if hi is None else hi if bounds[1] is None else min(hi, bounds[1])
  if len(chunks) > 1:
    raise NoBand(f"Chunked masks of different sizes {sorted(chunks)} combined have no single"
                 " chunk size.")
  return Band(lo, hi, min(chunks, default=None))


def reach(mask: Mask) -> tuple[int, int] | None:
  """`(back, ahead)`: a query sees keys at most `back` positions before its own and `ahead`
  after it (a window's sides, a chunk's size - 1 back), or None when a side is unbounded."""
  try:
    normal = band(mask)
  except NoBand:
    return None
  back = None if normal.lo is None else max(0, -normal.lo)
  if normal.chunk:
    back = normal.chunk - 1 if back is None else min(back, normal.chunk - 1)
  ahead = None if normal.hi is None else max(0, normal.hi)
  return None if back is None or ahead is None else (back, ahead)
