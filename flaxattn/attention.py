"""`flaxattn.attention`: the one functional entry point, its input checks and `explain`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from flaxattn import checks, registry
from flaxattn.context_parallel import ContextParallel, axis_size, context_parallel_attention
from flaxattn.fused import Fused
from flaxattn.layout import Layout
from flaxattn.masks import Causal, Mask, check_mask
from flaxattn.reference import reference_attention
from flaxattn.splash import Splash

registry.register(
    Fused(),
    platforms={"default": 0, "cpu": 0, "gpu": 0, "tpu": 1})
registry.register(
    Splash(),
    platforms={"tpu": 0, "default": 50, "cpu": 50, "gpu": 50})
registry.register(
    registry.FunctionKernel("reference", reference_attention),
    platforms={"default": 100, "cpu": 100, "gpu": 100, "tpu": 100})


def _shape_error(arg: str, value, expected: str) -> ValueError:
  shape = getattr(value, "shape", None)
  dtype = getattr(value, "dtype", None)
  return ValueError(f"{arg} expects {expected}, got shape {shape} dtype {dtype}.")


def check_qkv(q, k, v) -> None:
  """Raises ValueError unless q `[B,T,H,D]`, k/v `[B,S,Hkv,D]` floating, same dtype, H % Hkv == 0."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise _shape_error(name, x, "a 4-D array [batch, seq, heads, head_dim]")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise _shape_error(name, x, "a floating dtype (float32, bfloat16, float16)")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v expect one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first.")
  if k.shape != v.shape:
    raise ValueError(f"k and v expect the same shape [B, S, Hkv, D], got {k.shape} and {v.shape}.")
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(f"q {q.shape} and k {k.shape} expect the same batch (dim 0) and head_dim (dim 3).")
  if q.shape[2] % k.shape[2]:
    raise ValueError(
        f"q heads ({q.shape[2]}) expect a multiple of k/v heads ({k.shape[2]}) for grouped-query"
        f" attention; got q {q.shape}, k {k.shape}.")


_INT32 = np.iinfo(np.int32)


def check_ids(arg: str, x, batch: int, length: int, ref: str):
  """`x` `[batch, length]` as int32, or None. Integers wider than int32 are checked to fit
  (on the host, or at run time when traced): narrowing them would merge documents.

  Raises:
    ValueError: not an integer array of that shape, or values outside int32.
  """
  if x is None:
    return None
  if getattr(x, "shape", None) != (batch, length) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise _shape_error(arg, x, f"an integer array of shape {(batch, length)} ([batch, seq] of {ref})")
  if x.dtype == jnp.int32:
    return x
  info = jnp.iinfo(x.dtype)
  if info.min < _INT32.min or info.max > _INT32.max:
    xp = np if isinstance(x, np.ndarray) else jnp  # jnp would narrow numpy int64 first
    lo, hi = xp.min(x), xp.max(x)
    checks.raise_if(
        (lo < _INT32.min) | (hi > _INT32.max),
        lambda lo, hi: ValueError(
            f"{arg} expects values that fit in int32 [{_INT32.min}, {_INT32.max}], got {x.dtype}"
            f" values in [{lo}, {hi}]; renumber them (segment ids only need to differ between"
            " documents of a row, positions to count within one)."),
        lo, hi)
  return x.astype(jnp.int32)


def make_layout(q, k, segment_ids, positions, kv_segment_ids, kv_positions) -> Layout:
  """Checks the packed-layout arguments against q `[B,T,...]` and k `[B,S,...]`; fills kv defaults."""
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  segment_ids = check_ids("segment_ids", segment_ids, b, t, "q")
  positions = check_ids("positions", positions, b, t, "q")
  kv_segment_ids = check_ids("kv_segment_ids", kv_segment_ids, b, s, "k/v")
  kv_positions = check_ids("kv_positions", kv_positions, b, s, "k/v")
  if kv_segment_ids is None and segment_ids is not None:
    if s != t:
      raise ValueError(f"kv_segment_ids is required when keys ({s}) and queries ({t}) differ in length"
                       " and segment_ids is given.")
    kv_segment_ids = segment_ids
  if kv_positions is None and positions is not None and s == t:
    kv_positions = positions
  if segment_ids is None and kv_segment_ids is not None:
    raise ValueError("segment_ids is required when kv_segment_ids is given (got only kv_segment_ids).")
  return Layout(segment_ids, kv_segment_ids, positions, kv_positions)


def _call(q, k, mask, layout: Layout, return_lse: bool, context_parallel=None) -> registry.Call:
  if context_parallel is not None and not isinstance(context_parallel, ContextParallel):
    raise TypeError(f"context_parallel expects a flaxattn.ContextParallel or None, got"
                    f" {context_parallel!r}.")
  return registry.Call.of(q, k, mask, layout, return_lse,
                          1 if context_parallel is None else axis_size(context_parallel))


def attention(q, k, v, *, mask: Mask = Causal(), segment_ids=None, positions=None,
              kv_segment_ids=None, kv_positions=None, scale: float | None = None,
              backend: str = "auto", context_parallel=None, return_lse: bool = False):
  """Exact attention over packed sequences.

  Args:
    q: `[B, T, H, D]` float32/bfloat16/float16.
    k, v: `[B, S, Hkv, D]`, same dtype; H must be a multiple of Hkv (GQA/MQA).
    mask: a `flaxattn` mask on positions (default `Causal()`).
    segment_ids: `[B, T]` int, 0 = padding, documents 1, 2, ...; None = one document.
    positions: `[B, T]` int, position of each token inside its document; None = token index.
    kv_segment_ids, kv_positions: `[B, S]` for keys; default to the query ones when S == T.
    scale: score scale, default `D ** -0.5`.
    backend: "auto", a kernel name ("fused", "splash", "reference"; see `flaxattn.explain`),
      or a kernel object carrying options, e.g. `flaxattn.splash.Splash(block_q=256)`.
    context_parallel: a `flaxattn.ContextParallel` to run with the sequence axis sharded.
    return_lse: also return the log-sum-exp of each query row, `[B, T, H]` float32.

  Returns:
    `[B, T, H, D]` in q's dtype (and the log-sum-exp if asked). A query with nothing to
    attend to gets zeros (lse -inf) and zero gradients.

  Raises:
    ValueError / TypeError naming the offending argument on malformed input, and when an
    explicit backend cannot serve the call.
  """
  check_qkv(q, k, v)
  mask = check_mask(mask)
  layout = make_layout(q, k, segment_ids, positions, kv_segment_ids, kv_positions)
  if scale is None:
    scale = q.shape[-1] ** -0.5
  kernel = registry.select(backend, _call(q, k, mask, layout, return_lse, context_parallel))
  if context_parallel is None:
    return kernel(q, k, v, layout, mask=mask, scale=float(scale), return_lse=return_lse)
  return context_parallel_attention(q, k, v, layout, mask=mask, scale=float(scale),
                                    cp=context_parallel, kernel=kernel, return_lse=return_lse)


def explain(q, k, v, *, mask: Mask = Causal(), segment_ids=None, positions=None,
            kv_segment_ids=None, kv_positions=None, backend="auto", context_parallel=None,
            return_lse: bool = False, print_fn=print) -> str:
  """Prints (and returns) which kernel `attention` would use for these arguments on this
  platform, why each registered kernel accepts or declines, and what `backend` would run
  on each platform (cpu, gpu, tpu), including which implementation a kernel with several
  uses ("fused (cudnn)" or "fused (blockwise; cuDNN declines: ...)"). Arrays or
  `jax.ShapeDtypeStruct`s work; with `context_parallel`, call it under the mesh."""
  check_qkv(q, k, v)
  mask = check_mask(mask)
  layout = make_layout(q, k, segment_ids, positions, kv_segment_ids, kv_positions)
  text = registry.describe(backend, _call(q, k, mask, layout, return_lse, context_parallel))
  if print_fn is not None:
    print_fn(text)
  return text
