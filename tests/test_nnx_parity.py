"""flaxattn.MultiHeadAttention in the scenarios nnx.MultiHeadAttention is tested in: the same
outputs as `flax.linen.MultiHeadDotProductAttention` with its parameters copied over, over
use_bias x dtype x param_dtype x precision x decode x normalize_qk, and inputs with no batch
axis or several (`[..., T, F]`), in full calls and in decode."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import flaxattn
from helpers import normal, random_packing, rel_error

HEADS, QKV, F, T = 2, 8, 6, 5
# Relative to the largest output magnitude: float32 matches to rounding; bfloat16 computation
# rounds the projections, and linen also the softmax, to 8 bits of mantissa.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 4e-2}


def _pair(batch=(2,), **kw):
  """(ours, linen module, params): both run the same parameters, drawn on the host (no
  compiled initializer), whose tree must be the one linen initializes on `[*batch, T, F]`.
  Ours runs the reference kernel (the kernels are checked against it elsewhere), eagerly:
  each case then compiles only the few primitives it has not met, not a whole program."""
  theirs = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=QKV, **kw)
  shapes = jax.eval_shape(theirs.init, jax.random.key(0), jnp.ones(batch + (T, F)))["params"]
  rng = np.random.default_rng(0)
  dtype = kw.get("param_dtype", jnp.float32)
  params = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) / 2, dtype), shapes)
  ours = nnx.eval_shape(lambda: flaxattn.MultiHeadAttention(
      HEADS, F, QKV, **kw, backend="reference", rngs=nnx.Rngs(1)))
  state = nnx.state(ours, nnx.Param)
  assert jax.tree.structure(nnx.to_pure_dict(state)) == jax.tree.structure(params)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(ours, state)
  return ours, theirs, params


def _decode_both(ours, theirs, params, x_BTF, dtype):
  """Both decoders fed `x` one token at a time from an empty cache of T slots: outputs
  `[..., T, out]`, ours then linen's."""
  ours.init_cache(x_BTF.shape, dtype)
  cache_shapes = jax.eval_shape(theirs.init, jax.random.key(0), x_BTF)["cache"]
  cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), cache_shapes)
  def step(cache, x):
    return theirs.apply({"params": params, "cache": cache}, x, mutable=["cache"])
  got, want = [], []
  for i in range(x_BTF.shape[-2]):
    x = x_BTF[..., i:i + 1, :]
    got.append(ours(x, decode=True))
    out, variables = step(cache, x)
    cache = variables["cache"]
    want.append(out)
  return jnp.concatenate(got, axis=-2), jnp.concatenate(want, axis=-2)


SCENARIOS = list(itertools.product(
    (True, False), (jnp.float32, jnp.bfloat16), (jnp.float32, jnp.bfloat16),
    (None, jax.lax.Precision.HIGHEST), (False, True), (False, True)))


@pytest.mark.parametrize("use_bias,dtype,param_dtype,precision,decode,normalize_qk", SCENARIOS,
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_matches_linen(use_bias, dtype, param_dtype, precision, decode, normalize_qk):
  ours, theirs, params = _pair(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                               precision=precision, normalize_qk=normalize_qk, decode=decode)
  x = normal((2, T, F))
  if decode:
    got, want = _decode_both(ours, theirs, params, x, dtype)
  else:
    got, want = ours(x), theirs.apply({"params": params}, x)
  assert got.shape == want.shape == (2, T, F) and got.dtype == want.dtype == dtype
  assert rel_error(got, want) < TOL[dtype]


@pytest.mark.parametrize("batch", [(), (3, 2)], ids=["no-batch", "two-batch-axes"])
@pytest.mark.parametrize("decode", [False, True])
def test_leading_axes_match_linen(batch, decode):
  """`[T, F]` (the rank nnx's own tests feed) and `[B1, B2, T, F]`, in full calls and in
  decode, where `init_cache` takes the same shape."""
  ours, theirs, params = _pair(batch, decode=decode)
  x = normal(batch + (T, F))
  if decode:
    got, want = _decode_both(ours, theirs, params, x, jnp.float32)
  else:
    got, want = ours(x), theirs.apply({"params": params}, x)
  assert got.shape == want.shape == batch + (T, F)
  assert rel_error(got, want) < TOL[jnp.float32]


def test_leading_axes_carry_packed_ids_and_positions():
  """Segment ids and positions `[B1, B2, T]` with `[B1, B2, T, F]` inputs are the folded
  `[B1 * B2, T]` call's, and `[T]` with `[T, F]` the `[1, T]` call's."""
  ours = flaxattn.MultiHeadAttention(HEADS, F, QKV, mask=flaxattn.Causal(), rope=flaxattn.RoPE(),
                                     backend="reference", rngs=nnx.Rngs(0))
  call = nnx.jit(lambda m, x, seg, pos: m(x, segment_ids=seg, positions=pos))
  t = 12
  seg, pos = random_packing(0, 6, t, max_docs=3, pad_tail=1)
  x = normal((6, t, F))
  want = call(ours, x, seg, pos)
  got = call(ours, x.reshape(3, 2, t, F), seg.reshape(3, 2, t), pos.reshape(3, 2, t))
  np.testing.assert_array_equal(got, want.reshape(3, 2, t, F))
  one = call(ours, x[:1], seg[:1], pos[:1])  # the same batch size: the same program, bit for bit
  np.testing.assert_array_equal(call(ours, x[0], seg[0], pos[0]), one[0])


@pytest.mark.parametrize("batch", [(), (2,), (3, 2)], ids=["no-batch", "one-batch", "two-batch"])
def test_flax_decode_scenario_through_nnx_cache_names(batch):
  """Flax's decode scenario on stock nnx and on ours with its parameters: `init_cache`, then
  one token at a time equals the causal call on the whole input, and after every step the
  cache read through nnx's names (`cached_key`, `cached_value`, `cache_index`) has nnx's
  shapes and, on one device, nnx's values."""
  kw = dict(num_heads=HEADS, in_features=F, qkv_features=QKV)
  theirs = nnx.MultiHeadAttention(**kw, decode=True, rngs=nnx.Rngs(0))
  ours = flaxattn.MultiHeadAttention(**kw, decode=True, mask=flaxattn.Causal(),
                                     backend="reference", rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  x = normal(batch + (T, F))
  full = ours(x, decode=False)
  theirs.init_cache(x.shape)
  ours.init_cache(x.shape)
  assert ours.cached_key.shape == theirs.cached_key.shape == batch + (T, HEADS, QKV // HEADS)
  assert ours.cached_value.shape == theirs.cached_value.shape
  steps = []
  for i in range(T):
    steps.append(ours(x[..., i:i + 1, :]))
    np.testing.assert_allclose(steps[-1], theirs(x[..., i:i + 1, :]), rtol=1e-5, atol=1e-5)
    assert int(ours.cache_index) == int(theirs.cache_index[...]) == i + 1
    for name in ("cached_key", "cached_value"):
      np.testing.assert_allclose(getattr(ours, name), getattr(theirs, name)[...], atol=1e-6)
  assert rel_error(jnp.concatenate(steps, axis=-2), full) < TOL[jnp.float32]


def test_flax_x64_decode_scenario():
  """Flax's `test_autoregressive_decode_with_x64`, on ours: a float64 cache under x64."""
  with jax.enable_x64(True):
    x = jnp.ones((1, 4, 4))
    module = flaxattn.MultiHeadAttention(in_features=4, num_heads=2, qkv_features=4,
                                         decode=True, rngs=nnx.Rngs(0))
    module.init_cache(x.shape, dtype=x.dtype)
    assert module.cached_key.shape == (1, 4, 2, 2)
    assert module.cached_value.shape == (1, 4, 2, 2)
    assert module.cached_key.dtype == jnp.float64
    y1 = module(x[:, :1, :])
    y2 = module(x[:, 1:2, :])
    assert y1.shape == (1, 1, 4) and y2.shape == (1, 1, 4)
    assert int(module.cache_index) == 2
