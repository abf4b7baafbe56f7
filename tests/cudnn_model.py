"""A model of cuDNN for CPU: JAX's cuDNN primitives get a CPU lowering that computes what
cuDNN computes (the layer under JAX's own seqlens/offsets normalization): sequences from the
flattened seqlens and element offsets (each tensor's offsets divided by ITS per-token
stride, as cuDNN reads them), top-left causal and sliding-window masks by index within a
sequence, natural-log stats `[B * M, H, T]`, and a backward that uses O only through
D = rowsum(dO * O). Rows cuDNN leaves undefined come back as NaN, so the glue must select
them away. Everything else (JAX's checks, left-shift of slots, element offsets, custom
partitioning) is JAX's real code. `installed()` puts it in place; the `fake_cudnn` fixture
(conftest.py) and the multi-device scripts use it.
"""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as fsa
from jax._src.interpreters import mlir


def _sequences(query, key, q_seqlen, kv_seqlen, q_offsets, kv_offsets, mask_type):
  """Per cuDNN sequence: token indices into the flattened rows and their validity."""
  b, t, n, d = query.shape
  _, s, nkv, _ = key.shape
  if q_offsets.ndim == 2:  # packed: B * M sequences, offsets in elements of each tensor
    count = b * (q_offsets.shape[1] - 1)  # JAX's [B, M + 1] offsets, read flat as cuDNN does
    q_start = q_offsets.reshape(-1)[:count] // (n * d)
    kv_start = kv_offsets.reshape(-1)[:count] // (nkv * d)
    q_len, kv_len = q_seqlen.reshape(-1)[:count], kv_seqlen.reshape(-1)[:count]
  else:
    q_start, kv_start = jnp.arange(b) * t, jnp.arange(b) * s
    padded = mask_type in (fsa.MaskType.PADDING, fsa.MaskType.PADDING_CAUSAL)
    q_len = q_seqlen if padded else jnp.full((b,), t)
    kv_len = kv_seqlen if padded else jnp.full((b,), s)
  q_tok = q_start[:, None] + jnp.arange(t)
  kv_tok = kv_start[:, None] + jnp.arange(s)
  q_ok, kv_ok = jnp.arange(t) < q_len[:, None], jnp.arange(s) < kv_len[:, None]
  return jnp.where(q_ok, q_tok, b * t), q_ok, jnp.where(kv_ok, kv_tok, b * s), kv_ok


def _gather(x, tok):
  flat = x.reshape((-1,) + x.shape[2:]).astype(jnp.float32)
  return flat[jnp.clip(tok, 0, flat.shape[0] - 1)]


def _scatter(shape, tok, values, dtype):
  """Rows cuDNN does not write are undefined: NaN."""
  flat = jnp.full((shape[0] * shape[1],) + shape[2:], jnp.nan, jnp.float32)
  return flat.at[tok].set(values, mode="drop").reshape(shape).astype(dtype)


def _probs(q, k, q_ok, kv_ok, scale, mask_type, window, stats=None):
  g = q.shape[2] // k.shape[2]
  scores = jnp.einsum("ntgd,nsgd->ngts", q, jnp.repeat(k, g, axis=2)) * scale
  i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
  allowed = q_ok[:, None, :, None] & kv_ok[:, None, None, :]
  if mask_type in (fsa.MaskType.CAUSAL, fsa.MaskType.PADDING_CAUSAL):
    allowed &= j <= i
  if window:
    allowed &= j > i - window
  scores = jnp.where(allowed, scores, -jnp.inf)
  if stats is None:
    stats = jax.nn.logsumexp(scores, axis=-1)
  return jnp.exp(scores - stats[..., None]), stats


def _fake_fwd(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
              page_table_k, page_table_v, *, scale, seed, dropout_rate, variadic_args,
              mask_type, layout, sliding_window_length, is_training):
  assert layout == fsa.AttentionLayout.BTNH.value and variadic_args == (False, False)
  tq, q_ok, tk, kv_ok = _sequences(query, key, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
                                   mask_type)
  p, stats = _probs(_gather(query, tq), _gather(key, tk), q_ok, kv_ok, scale, mask_type,
                    sliding_window_length)
  g = query.shape[2] // key.shape[2]
  out = jnp.einsum("ngts,nsgd->ntgd", p, jnp.repeat(_gather(value, tk), g, axis=2))
  out = _scatter(query.shape, tq, out, query.dtype)
  stats = jnp.where(q_ok[:, None, :], stats, jnp.nan)
  return [out, stats] if is_training else [out]


def _fake_bwd(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
              page_table_k, page_table_v, stats, out, dout, *, scale, seed, dropout_rate,
              variadic_args, mask_type, layout, sliding_window_length):
  tq, q_ok, tk, kv_ok = _sequences(query, key, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
                                   mask_type)
  q, k, v = _gather(query, tq), _gather(key, tk), _gather(value, tk)
  o, do = _gather(out, tq), _gather(dout, tq)
  g = q.shape[2] // k.shape[2]
  p, _ = _probs(q, k, q_ok, kv_ok, scale, mask_type, sliding_window_length, stats)
  p = jnp.where(q_ok[:, None, :, None], p, 0.0)
  dv = jnp.einsum("ngts,ntgd->nsgd", p, do)
  dp = jnp.einsum("ntgd,nsgd->ngts", do, jnp.repeat(v, g, axis=2))
  ds = p * (dp - jnp.einsum("ntgd,ntgd->ngt", do, o)[..., None])  # O only through D
  dq = scale * jnp.einsum("ngts,nsgd->ntgd", ds, jnp.repeat(k, g, axis=2))
  dk = scale * jnp.einsum("ngts,ntgd->nsgd", ds, q)
  def fold(x):
    return x.reshape(x.shape[:2] + (key.shape[2], g, x.shape[-1])).sum(3)
  return [_scatter(query.shape, tq, dq, query.dtype),
          _scatter(key.shape, tk, fold(dk), key.dtype),
          _scatter(value.shape, tk, fold(dv), value.dtype)]


@contextlib.contextmanager
def installed():
  """JAX's cuDNN attention lowers to the model on CPU inside this context."""
  rules = mlir._platform_specific_lowerings["cpu"]  # pylint: disable=protected-access
  prims = (fsa._dot_product_attention_fwd_p, fsa._dot_product_attention_bwd_p)
  with mock.patch.object(fsa, "check_cudnn_version", lambda: 91000), \
       mock.patch.object(fsa, "check_compute_capability", lambda capability: True), \
       mock.patch.object(fsa, "is_cuda_compute_capability_equal", lambda capability: False):
    for prim, fake in zip(prims, (_fake_fwd, _fake_bwd), strict=True):
      mlir.register_lowering(prim, mlir.lower_fun(fake, multiple_results=True), platform="cpu")
    try:
      yield
    finally:
      for prim in prims:
        rules.pop(prim)
