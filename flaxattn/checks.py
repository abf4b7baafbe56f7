"""Checks of arguments: numbers (`number`), and errors that depend on data (`raise_if`),
raised at once where the values are known on the host, and from inside the compiled program
where they are traced (jit, nnx.jit, scan).

Under a trace the check is a `lax.cond` whose true branch is a host callback, so a passing
check costs one scalar comparison on the device (on a GPU, the predicate's copy to the host).
The callback raises: the program stops with the error's message (surfaced by JAX as a
runtime error that contains it), and every array it returns fails. Calls that update state
(a KV cache's decode step) record their refusals on the device instead (`flaxattn.kv_cache`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import jax
import jax.core  # jax.core.Tracer: jax imports the module but does not export the name
import jax.numpy as jnp
import numpy as np


def traced(*xs) -> bool:
  """Whether any of `xs` is traced (inside jit, nnx.jit, scan), i.e. not known on the host."""
  return any(isinstance(x, jax.core.Tracer) for x in xs)


def raise_if(failed, error: Callable[..., Exception], *values) -> None:
  """Raises `error(*values)` (values as numpy) if the scalar bool `failed` is true.

  Args:
    failed: scalar bool, Python or array (traced or not).
    error: builds the exception from the values, e.g. a ValueError naming the argument,
      the value received and what was expected.
    values: arrays the message needs (traced or not).
  """
  if not traced(failed, *values):
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
      value), inf, NaN, an int past float's range, or outside `valid`. A ValueError for
      every case, as for the other numbers of the library (sizes, positions).
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
  try:
    x = float(value)
  except OverflowError:  # a Python int past float's range
    x = math.inf
  if not (math.isfinite(x) and valid(x)):
    raise ValueError(f"{arg} expects {expected}, got {value!r}{why}.")
  return x


def integer(arg: str, value, expected: str, valid: Callable[[int], bool], hint: str = "") -> int:
  """`value` as a Python int: an integer (Python or numpy, not a bool) that `valid` accepts.
  Sizes and counts of a kernel's options are checked where the option is made, so that a
  zero, a fraction or a flag there fails with its name instead of deep inside a call.

  Args:
    arg: how the message names the option, e.g. "SplitK(chunk=...)".
    value: the value given.
    expected: what the message says is expected, e.g. "a positive int".
    valid: the range, on the value as an int.
    hint: appended to the message after "; ": what to do.

  Raises:
    ValueError: a bool, a float (even integral), a string, None or any other non-integer,
      or an integer outside `valid`.
  """
  why = f"; {hint}" if hint else ""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{arg} expects {expected}, got {value!r} ({type_name(value)}){why}.")
  if not valid(int(value)):
    raise ValueError(f"{arg} expects {expected}, got {value!r}{why}.")
  return int(value)


def boolean(arg: str, value, hint: str = "") -> bool:
  """`value` as a bool: True or False (Python or numpy). A string or a number there is a
  mistake that truth testing would hide ("no" is true).

  Raises:
    ValueError: anything else, naming `arg` and the value.
  """
  if not isinstance(value, (bool, np.bool_)):
    why = f"; {hint}" if hint else ""
    raise ValueError(f"{arg} expects True or False, got {value!r} ({type_name(value)}){why}.")
  return bool(value)


def positive_int(arg: str, value, optional: bool = False) -> None:
  """Raises ValueError unless `value` is a positive int (None too where `optional`): a size.

  Args:
    arg: how the message names the argument, e.g. "KVCache(max_length=...)".
    value: the value received; a bool is refused (True would be a size of 1).
  """
  if not (optional and value is None):
    integer(arg, value, "a positive int" + (" or None" if optional else ""), lambda x: x > 0)


def type_name(value) -> str:
  """The name of `value`'s type for an error message, with its module outside the builtins
  (`numpy.bool` for np.True_, which `bool` alone would hide)."""
  kind = type(value)
  return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
