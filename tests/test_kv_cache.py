"""The KV cache as decode leaves it: a call that raises writes nothing (eagerly and under
nnx.jit), the cache takes only floating keys and values and new tokens of the queries'
length, its constructor refuses sizes that are not sizes, and errors name what is wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxattn
from flaxattn.kv_cache import KVCache
from flaxattn.layer import MultiHeadAttention
from flaxattn.masks import Causal
from flaxattn.rope import RoPE
from helpers import normal

E = 16


def _layer(backend="auto", **kw):
  return MultiHeadAttention(2, E, mask=Causal(), backend=backend, rngs=nnx.Rngs(0), **kw)


def _values(m) -> list[np.ndarray]:
  """Every variable of `m` (parameters and cache) read back to the host."""
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(m))]


def _same(m, before) -> None:
  for a, b in zip(_values(m), before, strict=True):
    np.testing.assert_array_equal(a, b)


def _declining_fn(q, k, v, **kw):
  raise RuntimeError("attention_fn declines")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
@pytest.mark.parametrize("refuse, match", [
    (dict(backend="split_k"), r"split_k serves decode steps of at most 16 queries"),
    (dict(backend="cudnn"), r"backend='cudnn' cannot serve this call"),
    (dict(attention_fn=_declining_fn), r"attention_fn declines"),
], ids=["split_k", "cudnn", "attention_fn"])
def test_a_decode_call_that_raises_writes_nothing(jit, refuse, match):
  """A 20-token prefill that the kernel refuses (split_k serves at most 16 queries; cuDNN
  no CPU) leaves every variable as it was; the same call with the default backend then
  continues the cache as if the refused call had never been made."""
  if refuse.get("backend") == "cudnn" and jax.default_backend() == "gpu":
    pytest.skip("needs a platform where cuDNN declines; this host has a GPU")
  x = normal((1, 30, E))
  want = np.asarray(_layer()(x))  # the whole causal call
  m = _layer()
  m.init_cache((1, 32, E))
  first = m(x[:, :2], decode=True)
  before = _values(m)
  def call(m, x):
    return m(x, decode=True)

  defaults = {name: getattr(m, name) for name in refuse}
  for name, value in refuse.items():  # the layer's own backend (or attention_fn) raises
    setattr(m, name, value)
  with pytest.raises((ValueError, RuntimeError), match=match):
    (nnx.jit(call) if jit else call)(m, x[:, 2:22])
  _same(m, before)
  assert int(m.cache.index[...]) == 2
  for name, value in defaults.items():
    setattr(m, name, value)
  rest = m(x[:, 2:22], decode=True)
  assert int(m.cache.index[...]) == 22
  got = np.concatenate([np.asarray(first), np.asarray(rest)], axis=1)
  np.testing.assert_allclose(got, want[:, :22], atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_, jnp.complex64,
                                   jnp.float8_e4m3fn, "int32"])
def test_init_cache_refuses_dtypes_that_would_cut_keys(dtype):
  m = _layer()
  with pytest.raises(ValueError, match=r"dtype expects a floating dtype the kernels compute in"
                                       r".*got (int32|int8|bool|complex64|float8_e4m3fn)"):
    m.init_cache((1, 8, E), dtype)
  assert m.cache is None
  with pytest.raises(ValueError, match=r"dtype expects a floating dtype"):
    KVCache(1, 8, 2, 8, 8, dtype, heads=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_init_cache_takes_the_floating_dtypes(dtype):
  m = _layer()
  m.init_cache((1, 8, E), dtype)
  assert m.cache is not None and m.cache.keys.dtype == dtype and m.cached_value.dtype == dtype


@pytest.mark.parametrize("rope", [None, RoPE()], ids=["no-rope", "rope"])
@pytest.mark.parametrize("t, s", [(1, 3), (3, 1)])
def test_decode_expects_keys_of_the_queries_length(rope, t, s):
  """Decode writes one key per new query, with its segment id and position: keys of
  another length would leave cached keys marked empty, or live ids over zero keys."""
  m = _layer(rope=rope)
  m.init_cache((1, 8, E))
  m(normal((1, 2, E)), decode=True)
  before = _values(m)
  with pytest.raises(ValueError, match=rf"inputs_k and inputs_v expect inputs_q's length in"
                                       rf" decode, {t} new token\(s\), got {s}"):
    m(normal((1, t, E), 1), normal((1, s, E), 2), decode=True)
  _same(m, before)


def test_decode_errors_name_what_does_not_fit():
  """Too many new tokens for the cache name max_length, not the batch; another batch names
  the batch and the leading axes init_cache was given."""
  m = _layer()
  m.init_cache((2, 8, E))
  with pytest.raises(ValueError, match=r"decode expects at most max_length = 8 new tokens .*"
                                       r" got 9; call init_cache with a max_length of at least 9"):
    m(normal((2, 9, E)), decode=True)
  with pytest.raises(ValueError, match=r"decode expects the batch the KV cache was made for, 2"
                                       r" row\(s\) \(leading axes \(2,\)\), got new keys of"
                                       r" shape \(3, 1, 2, 8\)"):
    m(normal((3, 1, E)), decode=True)
  assert int(m.cache.index[...]) == 0


@pytest.mark.parametrize("args, kw, match", [
    ((1, -3, 2, 8, 8), {}, r"KVCache\(max_length=\.\.\.\) expects a positive int, got -3"),
    ((0, 8, 2, 8, 8), {}, r"KVCache\(batch=\.\.\.\) expects a positive int, got 0"),
    (((3, 0), 8, 2, 8, 8), {}, r"KVCache\(batch=\(3, 0\)\) axis 1 expects a positive int"),
    ((1, 8, 0, 8, 8), {}, r"KVCache\(kv_heads=\.\.\.\) expects a positive int, got 0"),
    ((1, 8, 2, 8.0, 8), {}, r"KVCache\(head_dim=\.\.\.\) expects a positive int, got 8.0"),
    ((1, 8, 2, 8, True), {}, r"KVCache\(v_head_dim=\.\.\.\) expects a positive int, got True"),
    ((1, 2**31, 2, 8, 8), {}, r"KVCache\(max_length=\.\.\.\) expects at most 2147483647"),
    ((1, 8, 2, 8, 8), dict(heads=3), r"KVCache\(heads=\.\.\.\) expects a multiple of kv_heads"),
    ((1, 8, 2, 8, 8), dict(context_parallel="ring"),
     r"KVCache\(context_parallel=\.\.\.\) expects a flaxattn.ContextParallel or None"),
])
def test_kv_cache_refuses_what_is_not_a_cache(args, kw, match):
  kw = dict(dict(heads=2), **kw)
  error = TypeError if "context_parallel" in kw else ValueError
  with pytest.raises(error, match=match):
    KVCache(*args, jnp.float32, **kw)


def test_kv_cache_folds_the_batch_axes():
  cache = KVCache((3, 2), 8, 2, 4, 6, jnp.bfloat16, heads=4)
  assert cache.batch_axes == (3, 2) and cache.keys.shape == (6, 8, 2, 4)
  assert cache.values.shape == (6, 8, 2, 6) and cache.segment_ids.shape == (6, 8)
  assert KVCache((), 8, 2, 4, 4, jnp.float32, heads=2).keys.shape == (1, 8, 2, 4)


def test_nnx_cache_names_are_read_only_views():
  m = _layer()
  assert m.cached_key is None and m.cached_value is None and m.cache_index is None
  m.init_cache((3, 2, 5, E))
  with pytest.raises(AttributeError, match=r"cached_key"):
    m.cached_key = jnp.zeros((3, 2, 5, 2, 8))
  m(normal((3, 2, 1, E)), decode=True)
  assert int(m.cache_index) == 1
  np.testing.assert_array_equal(m.cached_key[:, :, 0], m.cache.keys[...][:, 0].reshape(3, 2, 2, 8))
  assert flaxattn.KVCache is KVCache
