"""Rotary position embeddings (RoPE) driven by positions.

Rotations use each token's position inside its document, so packed documents restart at 0
and a document gets the same embeddings alone or packed. Pairs are (i, i + head_dim/2)
("rotate half", as Llama and MaxText do it), not interleaved (i, i + 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RoPE:
  """Rotary embedding with base wavelength `theta` (hashable, usable as a static argument)."""

  theta: float = 10000.0

  def __post_init__(self):
    if isinstance(self.theta, bool) or not isinstance(self.theta, (int, float)) or self.theta <= 1:
      raise ValueError(f"RoPE(theta=...) expects a number > 1, got {self.theta!r}; 10000.0 is usual.")

  def __call__(self, x_BTHD: jax.Array, positions_BT: jax.Array) -> jax.Array:
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
    half = d // 2
    inv_freq_R = self.theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BTR = positions_BT.astype(jnp.float32)[..., None] * inv_freq_R
    sin_BT1R, cos_BT1R = jnp.sin(angle_BTR)[:, :, None], jnp.cos(angle_BTR)[:, :, None]
    x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos_BT1R - x2 * sin_BT1R, x2 * cos_BT1R + x1 * sin_BT1R], axis=-1)
    return out.astype(x_BTHD.dtype)
