"""Errors that depend on data: raised at once where the values are known on the host, and
from inside the compiled program where they are traced (jit, nnx.jit, scan).

Under a trace the check is a `lax.cond` whose true branch is a host callback that raises,
so a passing check costs one scalar comparison and no host round trip; a failing one stops
the program with the error's message (surfaced by JAX as a runtime error that contains it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import jax.core  # jax.core.Tracer: jax imports the module but does not export the name
import numpy as np

log = logging.getLogger("flaxattn")


def _traced(*xs) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in xs)


def raise_if(failed, error: Callable[..., Exception], *values) -> None:
  """Raises `error(*values)` (values as numpy) if the scalar bool `failed` is true.

  Args:
    failed: scalar bool, Python or array (traced or not).
    error: builds the exception from the values, e.g. a ValueError naming the argument,
      the value received and what was expected.
    values: arrays the message needs (traced or not).
  """
  if not _traced(failed, *values):
    if bool(failed):
      raise error(*(np.asarray(x) for x in values))
    return

  def fail(*host_values):
    raise error(*host_values)

  jax.lax.cond(failed, lambda: jax.debug.callback(fail, *values), lambda: None)


def refuse_if(failed, error: Callable[..., Exception], *values):
  """Refuses a call that would change state (a KV cache): `error(*values)` when the scalar
  bool `failed` holds.

  Concrete values: raises at once, before anything is written, and returns None. Traced
  values: returns `failed` for the caller to write nothing and return NaN where it holds,
  and logs the error to the `flaxattn` logger when the program runs. A program that raises
  fails as a whole, asynchronously: every array it returns fails too, a layer's parameters
  included (nnx.jit returns them all), and on a mesh the next collective then waits for a
  device that never arrives.
  """
  if not _traced(failed, *values):
    if bool(failed):
      raise error(*(np.asarray(x) for x in values))
    return None

  def report(*host_values):
    log.error("%s The call ran inside a compiled program, where raising would discard every"
              " variable the program returns: it wrote nothing, kept the cache as it was and"
              " returned NaN.", error(*host_values))

  jax.lax.cond(failed, lambda: jax.debug.callback(report, *values), lambda: None)
  return failed
