"""Attention masks as data: small hashable values on positions, never on array indices.

Every mask answers `allows(q_pos, k_pos)` and, for a block of positions, `block_kinds`
(certainly empty / certainly dense; conservative), both on numpy and jax arrays. Masks
combine with `&`. `band(mask)` is the one normal form that splash and cuDNN read.
"""

from __future__ import annotations

import dataclasses

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


class Mask:
  """Base class of all masks. Subclasses are frozen dataclasses."""

  def allows(self, q_pos, k_pos):
    """Boolean array broadcast from `q_pos` and `k_pos`: True where attention is allowed."""
    raise NotImplementedError

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
    parts = []
    for m in (self, other):
      parts.extend(m.masks if isinstance(m, And) else (m,))
    return And(tuple(parts))


@dataclasses.dataclass(frozen=True)
class Full(Mask):
  """Every query sees every key of its document."""

  def allows(self, q_pos, k_pos):
    return (q_pos == q_pos) & (k_pos == k_pos)

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    false = (q_lo != q_lo) | (k_lo != k_lo)
    return false, ~false


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


@dataclasses.dataclass(frozen=True)
class And(Mask):
  """Intersection of masks: a pair is allowed only if every part allows it."""

  masks: tuple[Mask, ...]

  def __post_init__(self):
    if not self.masks or not all(isinstance(m, Mask) for m in self.masks):
      raise ValueError(f"And(masks=...) expects a non-empty tuple of Mask, got {self.masks!r}")

  def allows(self, q_pos, k_pos):
    out = self.masks[0].allows(q_pos, k_pos)
    for m in self.masks[1:]:
      out = out & m.allows(q_pos, k_pos)
    return out

  def block_kinds(self, q_lo, q_hi, k_lo, k_hi):
    skip, full = self.masks[0].block_kinds(q_lo, q_hi, k_lo, k_hi)
    for m in self.masks[1:]:
      s, f = m.block_kinds(q_lo, q_hi, k_lo, k_hi)
      skip, full = skip | s, full & f
    return skip, full

  @property
  def is_causal(self) -> bool:
    return any(m.is_causal for m in self.masks)


def check_mask(mask) -> Mask:
  """Returns `mask` if it is a `Mask`, else raises a TypeError saying what is accepted."""
  if not isinstance(mask, Mask):
    raise TypeError(
        f"mask expects a flaxattn mask (Full(), Causal(), Local(window), Chunked(size),"
        f" or a combination with &), got {mask!r} ({type(mask).__name__})."
    )
  return mask


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
