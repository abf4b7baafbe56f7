"""Rotary position embeddings (RoPE) driven by positions.

Rotations use each token's position inside its document, so packed documents restart at 0
and a document gets the same embeddings alone or packed. Pairs are (i, i + head_dim/2)
("rotate half", as Llama and MaxText do it), not interleaved (i, i + 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flaxattn import checks

SCALINGS = ("default", "linear", "llama3", "yarn")
MAX_POSITION = 2**31 - 1  # positions are int32
# yarn's attention factor scales cos and sin, so scores grow by its square; published
# models use about 1 (0.1 ln(factor) + 1), and past this float32 scores overflow.
MAX_ATTENTION_FACTOR = 1e3


@dataclasses.dataclass(frozen=True)
class RoPEScaling:
  """Context extension of RoPE's frequencies, as Hugging Face `rope_scaling` defines it.

  kind: "default" (none), "linear" (every frequency / factor), "llama3" (Llama 3.1: long
    wavelengths / factor, short ones kept, a smooth blend between, set by
    `low_freq_factor`/`high_freq_factor` against `original_max_position`), "yarn" (per
    frequency blend of extrapolation and interpolation between `beta_fast` and
    `beta_slow` rotations over `original_max_position`, cos/sin scaled by
    `attention_factor`, default 0.1 ln(factor) + 1).
  Raises:
    ValueError: unknown kind; a number field that is not a number (a bool, a string), or
      inf or NaN (which would give NaN rotations); factor < 1; a freq factor, beta or
      attention_factor not positive; original_max_position not a positive int; llama3/yarn
      without original_max_position; llama3 without high_freq_factor > low_freq_factor;
      yarn with beta_fast < beta_slow.
  """

  kind: str = "default"
  factor: float = 1.0
  original_max_position: int | None = None
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None

  def __post_init__(self):
    if self.kind not in SCALINGS:
      raise ValueError(f"RoPEScaling(kind=...) expects one of {SCALINGS}, got {self.kind!r}.")
    # Numbers are stored as floats: the dataclass stays hashable (a static argument) when
    # given a numpy or 0-d array value.
    def number(field, expected, valid):
      value = checks.number(f"RoPEScaling({field}=...)", getattr(self, field), expected, valid)
      object.__setattr__(self, field, value)

    number("factor", "a number >= 1 (finite)", lambda x: x >= 1)
    for field in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
      number(field, "a positive number (finite)", lambda x: x > 0)
    if self.attention_factor is not None:  # scales q and k: scores grow by its square
      number("attention_factor", f"a positive number at most {MAX_ATTENTION_FACTOR:g} or None",
             lambda x: 0 < x <= MAX_ATTENTION_FACTOR)
    old = self.original_max_position
    if old is not None:
      if (isinstance(old, bool) or not isinstance(old, (int, np.integer)) or old < 1
          or old > MAX_POSITION):
        raise ValueError(f"RoPEScaling(original_max_position=...) expects a positive int at"
                         f" most {MAX_POSITION} (the context length the model was trained at;"
                         f" positions are int32) or None, got {old!r} ({checks.type_name(old)}).")
      object.__setattr__(self, "original_max_position", int(old))
    if self.kind in ("llama3", "yarn") and old is None:
      raise ValueError(f"RoPEScaling(kind={self.kind!r}) expects original_max_position (the"
                       " context length the model was trained at), got None.")
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
      raise ValueError(f"RoPEScaling(kind='llama3') expects high_freq_factor > low_freq_factor"
                       f" > 0, got {self.high_freq_factor} and {self.low_freq_factor}.")
    # Pairs that turn more than beta_fast times extrapolate, fewer than beta_slow
    # interpolate (inv_freq): the other way round the blend runs backwards.
    if self.kind == "yarn" and self.beta_fast < self.beta_slow:
      raise ValueError(f"RoPEScaling(kind='yarn') expects beta_fast >= beta_slow (e.g. 32.0 and"
                       f" 1.0), got {self.beta_fast} and {self.beta_slow}.")

  def inv_freq(self, base: np.ndarray, theta: float, d: int) -> np.ndarray:
    """The scaled inverse frequencies (float64, `[d / 2]`) from the unscaled `base`."""
    if self.kind == "default":
      return base
    if self.kind == "linear":
      return base / self.factor
    old = self.original_max_position
    assert old is not None  # __post_init__ requires it for llama3 and yarn
    if self.kind == "llama3":
      wavelength = 2 * np.pi / base
      # 0 where the wavelength is longer than old / low_freq_factor, 1 where shorter than
      # old / high_freq_factor, linear in old / wavelength between.
      keep = np.clip((old / wavelength - self.low_freq_factor)
                     / (self.high_freq_factor - self.low_freq_factor), 0.0, 1.0)
      return (1 - keep) * base / self.factor + keep * base
    # yarn: dimension pair i turns old * base[i] / 2 pi times over the original context;
    # pairs that turn more than beta_fast times extrapolate, fewer than beta_slow interpolate.
    def pair(turns):
      return d * np.log(old / (turns * 2 * np.pi)) / (2 * np.log(theta))
    low = max(np.floor(pair(self.beta_fast)), 0)
    high = min(np.ceil(pair(self.beta_slow)), d - 1)
    high = high + 0.001 if high == low else high
    extrapolate = 1 - np.clip((np.arange(d // 2) - low) / (high - low), 0.0, 1.0)
    return base / self.factor * (1 - extrapolate) + base * extrapolate

  def cos_sin_factor(self) -> float:
    """What cos and sin are multiplied by (yarn's attention factor; 1 otherwise)."""
    if self.kind != "yarn":
      return 1.0
    if self.attention_factor is not None:
      return self.attention_factor
    return 0.1 * np.log(self.factor) + 1.0


@dataclasses.dataclass(frozen=True)
class RoPE:
  """Rotary embedding with base wavelength `theta` and optional `scaling` (hashable, usable
  as a static argument).

  Raises:
    ValueError: theta not a number (a bool, a string), <= 1, inf or NaN, or scaling not a
      `RoPEScaling` or None.
  """

  theta: float = 10000.0
  scaling: RoPEScaling | None = None

  def __post_init__(self):
    theta = checks.number("RoPE(theta=...)", self.theta, "a number > 1 (finite)", lambda x: x > 1,
                          "10000.0 is usual")
    object.__setattr__(self, "theta", theta)  # a float: hashable, whatever number was given
    if self.scaling is not None and not isinstance(self.scaling, RoPEScaling):
      raise ValueError("RoPE(scaling=...) expects a flaxattn.RoPEScaling or None, got"
                       f" {self.scaling!r}.")

  def inv_freq(self, d: int) -> np.ndarray:
    """Inverse frequencies `[d / 2]` float64: theta^(-2i/d), then the scaling."""
    base = self.theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    return base if self.scaling is None else self.scaling.inv_freq(base, self.theta, d)

  def __call__(self, x_BTHD: jax.Array, positions_BT: jax.Array | np.ndarray) -> jax.Array:
    """Rotates `x_BTHD` `[B, T, H, D]` (D even) by `positions_BT` `[B, T]` int.

    Computed in float32 (angles of long positions need it), returned in x's dtype.

    Raises:
      ValueError: D odd, or positions not of shape `[B, T]`.
    """
    b, t, _, d = x_BTHD.shape
    if d % 2:
      raise ValueError(f"RoPE expects an even head_dim, got x of shape {x_BTHD.shape}.")
    if positions_BT.shape != (b, t):
      raise ValueError(f"RoPE expects positions of shape {(b, t)}, got {positions_BT.shape}.")
    inv_freq_R = jnp.asarray(self.inv_freq(d), jnp.float32)
    angle_BTR = positions_BT.astype(jnp.float32)[..., None] * inv_freq_R
    factor = 1.0 if self.scaling is None else self.scaling.cos_sin_factor()
    sin_BT1R = (factor * jnp.sin(angle_BTR))[:, :, None]
    cos_BT1R = (factor * jnp.cos(angle_BTR))[:, :, None]
    x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos_BT1R - x2 * sin_BT1R, x2 * cos_BT1R + x1 * sin_BT1R], axis=-1)
    return out.astype(x_BTHD.dtype)
