"""Checks of arguments: numbers (`number`), and errors that depend on data (`raise_if`),
raised at once where the values are known on the host, and from inside the compiled program
where they are traced (jit, nnx.jit, scan).

Under a trace the check is a `lax.cond` whose true branch is a host callback that raises,
so a passing check costs one scalar comparison and no host round trip; a failing one stops
the program with the error's message (surfaced by JAX as a runtime error that contains it).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import jax
import jax.core  # jax.core.Tracer: jax imports the module but does not export the name
import jax.numpy as jnp
import numpy as np


def raise_if(failed, error: Callable[..., Exception], *values) -> None:
  """Raises `error(*values)` (values as numpy) if the scalar bool `failed` is true.

  Args:
    failed: scalar bool, Python or array (traced or not).
    error: builds the exception from the values, e.g. a ValueError naming the argument,
      the value received and what was expected.
    values: arrays the message needs (traced or not).
  """
  if not any(isinstance(x, jax.core.Tracer) for x in (failed, *values)):
    if bool(failed):
      raise error(*(np.asarray(x) for x in values))
    return

  def fail(*host_values):
    raise error(*host_values)

  jax.lax.cond(failed, lambda: jax.debug.callback(fail, *values), lambda: None)


def number(arg: str, value, expected: str, valid: Callable[[float], bool], hint: str = "") -> float:
  """`value` as a float: a real number, finite, in the range `valid` accepts. Numbers that
  set up a computation (a scale, a soft cap, a RoPE base) are checked where they enter:
  inf or NaN there gives NaN outputs, not an error, and a bool there is a mistake.

  Args:
    arg: how the message names the argument, e.g. "scale" or "RoPE(theta=...)".
    value: a Python or numpy int or float, or a 0-d integer or floating array known on the
      host (not traced).
    expected: what the message says is expected, e.g. "a positive number (finite)".
    valid: the range, on the value as a float.
    hint: appended to the message after "; ": what to do, e.g. "10000.0 is usual".

  Raises:
    ValueError: not a real number (a bool, a string, an array that is not 0-d, a traced
      value), inf, NaN, or outside `valid`. A ValueError for every case, as for the other
      numbers of the library (sizes, positions).
  """
  why = f"; {hint}" if hint else ""
  dtype = getattr(value, "dtype", None)
  scalar = isinstance(value, numbers.Real) and not isinstance(value, bool)
  zero_d = (dtype is not None and getattr(value, "ndim", None) == 0
            and (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)))
  if isinstance(value, jax.core.Tracer):
    raise ValueError(f"{arg} expects {expected}, known when the call is traced, got the traced"
                     f" {value!r}; pass a Python number (a static argument under jit).")
  if not (scalar or zero_d):
    raise ValueError(f"{arg} expects {expected}, got {value!r} ({type_name(value)}){why}.")
  x = float(value)
  if not (math.isfinite(x) and valid(x)):
    raise ValueError(f"{arg} expects {expected}, got {value!r}{why}.")
  return x


def type_name(value) -> str:
  """The name of `value`'s type for an error message, with its module outside the builtins
  (`numpy.bool` for np.True_, which `bool` alone would hide)."""
  kind = type(value)
  return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
