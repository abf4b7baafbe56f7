"""A model of cuDNN for CPU: JAX's cuDNN primitives get a CPU lowering that computes what
cuDNN computes (the layer under JAX's own seqlens/offsets normalization): sequences from the
flattened seqlens and element offsets (each tensor's offsets divided by ITS per-token
stride, as cuDNN reads them), top-left causal and sliding-window masks by index within a
sequence, natural-log stats `[B * M, H, T]`, and a backward that uses O only through
D = rowsum(dO * O). Rows cuDNN leaves undefined come back as NaN, so the glue must select
them away. Everything else (JAX's checks, left-shift of slots, element offsets, custom
partitioning) is JAX's real code. `installed()` puts it in place; the `fake_cudnn` fixture
(conftest.py) and the multi-device scripts use it.

Like cuDNN, the model is one opaque call in the compiled program: numpy on the host, behind
a `jax.pure_callback`, so XLA compiles a call rather than the attention of every call site
(a ring of cuDNN steps has dozens).
"""

import contextlib
from unittest import mock

import jax
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fsa
from jax._src.interpreters import mlir


def _tokens(query, key, q_seqlen, kv_seqlen, q_offsets, kv_offsets, mask_type):
  """Where each flattened token sits: (its cuDNN sequence, its index inside it, whether a
  sequence holds it) for the `B * T` queries and for the `B * S` keys, and the start and
  length of every sequence's queries."""
  b, t, n, d = query.shape
  _, s, nkv, _ = key.shape
  if q_offsets.ndim == 2:  # packed: B * M sequences, offsets in elements of each tensor
    count = b * (q_offsets.shape[1] - 1)  # JAX's [B, M + 1] offsets, read flat as cuDNN does
    q_start = q_offsets.reshape(-1)[:count] // (n * d)
    kv_start = kv_offsets.reshape(-1)[:count] // (nkv * d)
    q_len, kv_len = q_seqlen.reshape(-1)[:count], kv_seqlen.reshape(-1)[:count]
  else:
    q_start, kv_start = np.arange(b) * t, np.arange(b) * s
    padded = mask_type in (fsa.MaskType.PADDING, fsa.MaskType.PADDING_CAUSAL)
    q_len = q_seqlen if padded else np.full((b,), t)
    kv_len = kv_seqlen if padded else np.full((b,), s)

  def place(start, length, tokens):
    index = np.arange(tokens)[None, :] - start[:, None]  # [sequences, tokens]
    inside = (index >= 0) & (index < length[:, None])
    sequence = np.where(inside, np.arange(len(start))[:, None], 0).sum(0)
    return sequence, np.where(inside, index, 0).sum(0), inside.any(0)

  return place(q_start, q_len, b * t), place(kv_start, kv_len, b * s), (q_start, q_len)


def _flat(x, heads_kv=None):
  """`[B, T, H, D]` as float32 `[B * T, H, D]`, or `[B * T, Hkv, G, D]` with `heads_kv`
  (query head h reads key head h // G)."""
  x = x.reshape((-1,) + x.shape[2:]).astype(np.float32)
  return x if heads_kv is None else x.reshape(x.shape[0], heads_kv, -1, x.shape[-1])


def _probs(q, k, queries, keys, scale, mask_type, window, lse=None):
  """Softmax probabilities `[Hkv, G, Nq, Nk]` over all flattened tokens, and the lse."""
  (q_seq, q_idx, q_ok), (kv_seq, kv_idx, kv_ok) = queries, keys
  scores = np.einsum("nkgd,mkd->kgnm", q, k) * scale
  allowed = (q_seq[:, None] == kv_seq[None, :]) & q_ok[:, None] & kv_ok[None, :]
  if mask_type in (fsa.MaskType.CAUSAL, fsa.MaskType.PADDING_CAUSAL):
    allowed &= kv_idx[None, :] <= q_idx[:, None]
  if window:
    allowed &= kv_idx[None, :] > q_idx[:, None] - window
  scores = np.where(allowed, scores, -np.inf)
  if lse is None:
    top = scores.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    lse = (np.log(np.exp(scores - top).sum(-1, keepdims=True)) + top)[..., 0]
  return np.exp(scores - lse[..., None]), lse


def _written(x, ok, like):
  """Rows cuDNN does not write are undefined: NaN."""
  return np.where(ok[:, None, None], x.reshape(ok.shape[0], -1, x.shape[-1]), np.nan
                  ).reshape(like.shape).astype(like.dtype)


@np.errstate(invalid="ignore", divide="ignore")
def _forward(query, key, value, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *, scale,
             mask_type, window, is_training):
  b, t, h, d = query.shape
  hkv = key.shape[2]
  queries, keys, (q_start, q_len) = _tokens(query, key, q_seqlen, kv_seqlen, q_offsets,
                                            kv_offsets, mask_type)
  p, lse = _probs(_flat(query, hkv), _flat(key), queries, keys, scale, mask_type, window)
  out = _written(np.einsum("kgnm,mkd->nkgd", p, _flat(value)), queries[2], query)
  if not is_training:
    return (out,)
  # Stats `[sequences, H, T]`: sequence c's i-th query is flattened row q_start[c] + i.
  lse = lse.reshape(h, b * t)
  index = np.arange(t)
  stats = lse[:, np.clip(q_start[:, None] + index, 0, b * t - 1)]  # [H, sequences, T]
  stats = np.where(index < q_len[:, None], stats, np.nan).astype(np.float32)
  return out, stats.transpose(1, 0, 2)


@np.errstate(invalid="ignore", divide="ignore")
def _backward(query, key, value, q_seqlen, kv_seqlen, q_offsets, kv_offsets, stats, out, dout,
              *, scale, mask_type, window):
  hkv = key.shape[2]
  queries, keys, _ = _tokens(query, key, q_seqlen, kv_seqlen, q_offsets, kv_offsets, mask_type)
  q_seq, q_idx, q_ok = queries
  lse = stats[q_seq, :, np.where(q_ok, q_idx, 0)].T  # [H, B * T]
  q, k, v = _flat(query, hkv), _flat(key), _flat(value)
  o, do = _flat(out, hkv), _flat(dout, hkv)
  p, _ = _probs(q, k, queries, keys, scale, mask_type, window, lse.reshape(hkv, -1, len(q_ok)))
  p = np.where(q_ok[:, None], p, 0.0)
  dv = np.einsum("kgnm,nkgd->mkd", p, do)
  dp = np.einsum("nkgd,mkd->kgnm", do, v)
  ds = p * (dp - np.einsum("nkgd,nkgd->kgn", do, o)[..., None])  # O only through D
  dq = scale * np.einsum("kgnm,mkd->nkgd", ds, k)
  dk = scale * np.einsum("kgnm,nkgd->mkd", ds, q)
  return (_written(dq, q_ok, query), _written(dk, keys[2], key), _written(dv, keys[2], value))


def _on_host(fn, results, *args, **static):
  """`fn(*args, **static)` in numpy, as one opaque call in the compiled program."""
  def run(*arrays):
    return fn(*(np.asarray(a) for a in arrays), **static)
  shapes = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results]
  return list(jax.pure_callback(run, shapes, *args))


def _plain(variadic_args, layout, score_mod_args, score_mod_name):
  """The model serves BTNH without bias, dropout mask or score function. jax 0.12's
  primitives take score function operands and a name (+ jaxpr) that jax 0.10 and 0.11's
  do not: both are accepted, as absent."""
  assert layout == fsa.AttentionLayout.BTNH.value and variadic_args == (False, False)
  assert not score_mod_args and score_mod_name is None, "no score function in the model"


def _fake_fwd(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
              page_table_k, page_table_v, *score_mod_args, scale, seed, dropout_rate,
              variadic_args, mask_type, layout, sliding_window_length, is_training,
              score_mod_name=None, score_mod_jaxpr=None):
  _plain(variadic_args, layout, score_mod_args, score_mod_name)
  b, t, h, _ = query.shape
  sequences = b * (q_offsets.shape[1] - 1) if q_offsets.ndim == 2 else b
  results = [query] + [jax.ShapeDtypeStruct((sequences, h, t), np.float32)] * is_training
  return _on_host(_forward, results, query, key, value, q_seqlen, kv_seqlen, q_offsets,
                  kv_offsets, scale=scale, mask_type=mask_type, window=sliding_window_length,
                  is_training=is_training)


def _fake_bwd(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
              page_table_k, page_table_v, stats, out, dout, *score_mod_args, scale, seed,
              dropout_rate, variadic_args, mask_type, layout, sliding_window_length,
              score_mod_name=None, score_mod_jaxpr=None):
  _plain(variadic_args, layout, score_mod_args, score_mod_name)
  return _on_host(_backward, [query, key, value], query, key, value, q_seqlen, kv_seqlen,
                  q_offsets, kv_offsets, stats, out, dout, scale=scale, mask_type=mask_type,
                  window=sliding_window_length)


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
