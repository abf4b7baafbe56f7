"""A fast path whose exactness depends on data seen only at run time, with its exact
fallback, written once: one `lax.cond` on the check (`either`), and one custom VJP around
both passes (`attention`). Splash and cuDNN mask on the token index or need documents
that fit their descriptor; a batch that breaks that runs the blockwise passes instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import jax
import jax.numpy as jnp

from flaxattn.layout import Layout

T = TypeVar("T")


def either(exact, fast: Callable[[], T], fallback: Callable[[], T]) -> T:
  """`fast()` where the scalar bool `exact` holds, else `fallback()` (both traced, one
  `lax.cond`); `exact` None: the fast path is exact for any data, and only it is traced."""
  return fast() if exact is None else jax.lax.cond(exact, fast, fallback)


class Passes(Protocol):
  """A kernel's forward and backward passes. `operands`: what the passes need beyond q, k,
  v and the layout (a kernel's block metadata, cuDNN's packing, a mask with traced
  operands), any pytree of arrays; the fast and the fallback passes get the same.
  Implementations are frozen dataclasses (hashable: they are static in the custom VJP)."""

  def forward(self, operands, q, k, v, layout: Layout, /) -> tuple[jax.Array, jax.Array]:
    """(out `[B, T, H, Dv]` in q's dtype, lse `[B, T, H]` float32)."""
    ...

  def backward(self, operands, q, k, v, layout: Layout, out, lse, dout, dlse,
               /) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) in q's, k's and v's dtypes. `dlse`: float32 `[B, T, H]`, or None when
    the lse has no cotangent (a pass may then skip work)."""
    ...


def attention(fast: Passes, fallback: Passes, exact, operands, q, k, v,
              layout: Layout) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of `fast` where `exact` holds (a scalar bool, or None: always), else of
  `fallback`, differentiable in q, k and v: the backward pass takes the same branch.
  `operands` go to both (a fallback that needs none ignores them)."""
  return _attention(fast, fallback, exact, operands, q, k, v, layout)


def forward(fast: Passes, fallback: Passes, exact, operands, q, k, v, layout: Layout):
  """The forward pass of `attention`, without autodiff rules."""
  return either(exact, lambda: fast.forward(operands, q, k, v, layout),
                lambda: fallback.forward(operands, q, k, v, layout))


def backward(fast: Passes, fallback: Passes, exact, operands, q, k, v, layout: Layout, out, lse,
             dout, dlse):
  """The backward pass of `attention` (the same branch as the forward's), given the
  output and lse of the rows (which may cover more keys than k/v: a ring passes the merged
  result) and their cotangents (`dlse` None: none)."""
  return either(exact, lambda: fast.backward(operands, q, k, v, layout, out, lse, dout, dlse),
                lambda: fallback.backward(operands, q, k, v, layout, out, lse, dout, dlse))


_primal = forward


# Applied as a call, not a decorator through functools.partial, so the result stays typed.
_attention = jax.custom_vjp(_primal, nondiff_argnums=(0, 1))


def _attention_fwd(fast, fallback, exact, operands, q, k, v, layout):
  # symbolic_zeros wraps every differentiable leaf in a CustomVJPPrimal.
  exact, operands, q, k, v, layout = jax.custom_derivatives.custom_vjp_primal_tree_values(
      (exact, operands, q, k, v, layout))
  out, lse = _primal(fast, fallback, exact, operands, q, k, v, layout)
  return (out, lse), (exact, operands, q, k, v, layout, out, lse)


def _attention_bwd(fast, fallback, residuals, cotangents):
  exact, operands, q, k, v, layout, out, lse = residuals
  dout, dlse = cotangents
  if isinstance(dout, jax.custom_derivatives.SymbolicZero):
    dout = jnp.zeros(out.shape, out.dtype)
  if isinstance(dlse, jax.custom_derivatives.SymbolicZero):
    dlse = None
  dq, dk, dv = backward(fast, fallback, exact, operands, q, k, v, layout, out, lse, dout, dlse)
  return None, None, dq, dk, dv, None


# Symbolic zeros tell the backward passes when the lse has no cotangent (cuDNN then skips
# a call).
_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
