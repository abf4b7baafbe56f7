"""Errors that depend on data: raised at once where the values are known on the host, and
from inside the compiled program where they are traced (jit, nnx.jit, scan).

Under a trace the check is a `lax.cond` whose true branch is a host callback that raises,
so a passing check costs one scalar comparison and no host round trip; a failing one stops
the program with the error's message (surfaced by JAX as a runtime error that contains it).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.core  # jax.core.Tracer: jax imports the module but does not export the name
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
