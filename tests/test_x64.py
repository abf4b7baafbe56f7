"""Every path under `jax.enable_x64(True)`: each kernel that runs on CPU, the layer, decode
with the KV cache, and context parallelism (ring, all-gather, Ulysses). With x64 on, numpy
ids and Python ints are 64-bit, so every index that meets an int32 one must be cast at its
source; the results must not change."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flaxattn
from flaxattn import cudnn
from helpers import (
  TOL,
  as_layout,
  compare,
  devices,
  grads_of,
  normal,
  qkv,
  random_packing,
  rel_error,
)

ERR = 1e-5  # float32, relative to the largest reference magnitude


@pytest.fixture(autouse=True)
def x64():
  with jax.enable_x64(True):
    yield


def _packing(b, t, **kw):
  """Segment ids and positions as users hand them in under x64: numpy int64."""
  return tuple(x.astype(np.int64) for x in random_packing(0, b, t, **kw))


@pytest.mark.parametrize("backend,t", [("blockwise", 48), ("splash", 128)])
def test_kernels_match_reference(backend, t):
  q, k, v = qkv(0, 2, t, t, 4, 2, 8)
  seg, pos = _packing(2, t, max_docs=4, pad_tail=3)

  def attend(backend):
    return lambda q, k, v: flaxattn.attention(q, k, v, mask=flaxattn.Local(20), segment_ids=seg,
                                              positions=pos, backend=backend, return_lse=True)

  want = grads_of(attend("reference"))(q, k, v)
  got = grads_of(attend(backend))(q, k, v)
  assert got[1][0].dtype == jnp.float32
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert rel_error(g, w) < ERR


@pytest.mark.slow
def test_cudnn_on_its_cpu_model_matches_reference(fake_cudnn):
  q, k, v = qkv(1, 2, 64, 64, 4, 2, 16, jnp.bfloat16)
  layout = as_layout(*random_packing(1, 2, 64, pad_tail=5))  # int32, as `resolve` makes them
  compare(functools.partial(cudnn.cudnn_attention, max_segments=8), layout, flaxattn.Causal(),
          q, k, v, jnp.bfloat16)


def test_layer_and_decode():
  """The layer (default kernel) equals the reference kernel's, and decoding token by token
  from the KV cache, with int64 ids and positions, equals the causal call on the whole rows."""
  b, t, e = 2, 12, 16
  def make(backend):
    return flaxattn.MultiHeadAttention(
        4, e, num_kv_heads=2, mask=flaxattn.Causal(), rope=flaxattn.RoPE(), backend=backend,
        rngs=nnx.Rngs(0))
  model = make("auto")
  x = normal((b, t, e))
  seg, pos = _packing(b, t, max_docs=3)
  call = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p))
  want = call(model, x, seg, pos)
  assert want.dtype == jnp.float32
  assert rel_error(want, call(make("reference"), x, seg, pos)) < ERR
  model.init_cache((b, t, e))
  step = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p, decode=True))
  got = [step(model, x[:, :5], seg[:, :5], pos[:, :5])]  # a prefill, then one token at a time
  got += [step(model, x[:, i:i + 1], seg[:, i:i + 1], pos[:, i:i + 1]) for i in range(5, t)]
  assert int(model.cache.index[...]) == t
  np.testing.assert_allclose(jnp.concatenate(got, axis=1), want, **TOL[jnp.float32])


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "ulysses"])
def test_context_parallel(strategy):
  n, b, t = 4, 2, 64
  q, k, v = qkv(2, b, t, t, 4, 2, 8)
  cp = flaxattn.ContextParallel(strategy=strategy)
  seg, pos = (flaxattn.load_balance(x, n) for x in _packing(b, t, max_docs=6, pad_tail=3, cp=n))

  def attend(**kw):
    return lambda q, k, v: flaxattn.attention(q, k, v, mask=flaxattn.Causal(), segment_ids=seg,
                                              positions=pos, return_lse=True, **kw)

  want = grads_of(attend(backend="reference"))(q, k, v)
  mesh = Mesh(np.array(devices(n)), ("context",), axis_types=(AxisType.Auto,))
  def shard(x):
    return jax.device_put(x, NamedSharding(mesh, P(None, "context")))
  with jax.set_mesh(mesh):
    got = grads_of(attend(context_parallel=cp))(shard(q), shard(k), shard(v))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert rel_error(g, w) < ERR
