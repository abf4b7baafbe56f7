"""Load balancing for causal context parallelism (dual-chunk layout).

The sequence is cut into 2 * cp chunks; device r holds chunks r and 2 * cp - 1 - r, so each
device gets one early and one late chunk and the causal work is even. Only reshapes,
flips and concatenation: no gather in the compiled program.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _namespace(x):
  # numpy stays numpy, so a host data pipeline permutes without a trip to the device.
  return np if isinstance(x, np.ndarray) else jnp


def _check(x, cp, axis: int) -> int:
  if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
    raise ValueError(f"cp expects a positive int (the context-parallel size), got {cp!r}.")
  axis = axis % x.ndim
  if x.shape[axis] % (2 * cp):
    raise ValueError(
        f"load balancing expects axis {axis} of x (length {x.shape[axis]}) divisible by 2 * cp ="
        f" {2 * cp}; pad the sequence to a multiple of {2 * cp}.")
  return axis


def load_balance(x, cp: int, axis: int = 1):
  """Reorders `x` along `axis` so that shard r of cp holds chunks r and 2cp-1-r.

  Args:
    x: any array (tokens `[B, T]`, segment ids, positions, activations `[B, T, H, D]`);
      numpy in, numpy out.
    cp: the context-parallel size; `x.shape[axis]` must be divisible by `2 * cp`.
  Raises:
    ValueError: cp not a positive int, or the axis length not divisible by 2 * cp.
  """
  axis = _check(x, cp, axis)
  xp = _namespace(x)
  shape = x.shape
  halves = x.reshape(shape[:axis] + (2, cp, shape[axis] // (2 * cp)) + shape[axis + 1:])
  first, second = halves[(slice(None),) * axis + (0,)], halves[(slice(None),) * axis + (1,)]
  pairs = xp.stack([first, xp.flip(second, axis=axis)], axis=axis + 1)
  return pairs.reshape(shape)


def unload_balance(x, cp: int, axis: int = 1):
  """Inverse of `load_balance`: back to the original token order."""
  axis = _check(x, cp, axis)
  xp = _namespace(x)
  shape = x.shape
  pairs = x.reshape(shape[:axis] + (cp, 2, shape[axis] // (2 * cp)) + shape[axis + 1:])
  index = lambda i: pairs[(slice(None),) * (axis + 1) + (i,)]
  return xp.concatenate([index(0), xp.flip(index(1), axis=axis)], axis=axis).reshape(shape)
