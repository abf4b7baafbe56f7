"""flaxattn.MultiHeadAttention: drop-in equality with nnx, GQA, RoPE on packed rows, decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxattn.layer import MultiHeadAttention
from flaxattn.masks import Causal, Full, Local
from flaxattn.rope import RoPE
from helpers import normal

B, T, E = 2, 8, 16


@nnx.jit(static_argnames=("mask", "decode", "is_causal"))
def run(model, *inputs, **kw):
  """`model(*inputs, **kw)` jitted: one compile is much faster than op-by-op on CPU."""
  return model(*inputs, **kw)


@nnx.jit
def run_nnx(model, *inputs, mask=None):
  """`run` for nnx.MultiHeadAttention, whose mask is an array."""
  return model(*inputs, mask=mask)


def _pair(mask, **kw):
  """(ours, theirs) with theirs' parameters copied into ours (initialized differently)."""
  theirs = nnx.MultiHeadAttention(decode=False, rngs=nnx.Rngs(0), **kw)
  ours = MultiHeadAttention(mask=mask, backend="reference", rngs=nnx.Rngs(1), **kw)
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  return ours, theirs


DROP_IN = [
    dict(num_heads=4, in_features=E),
    dict(num_heads=4, in_features=E, qkv_features=32, out_features=8, num_kv_heads=2,
         normalize_qk=True),
    dict(num_heads=2, in_features=E, in_kv_features=12, use_bias=False),
]


@pytest.mark.parametrize("kw", DROP_IN)
def test_drop_in_same_parameters_and_full_output(kw):
  theirs = nnx.MultiHeadAttention(decode=False, rngs=nnx.Rngs(0), **kw)
  ours = MultiHeadAttention(mask=Full(), backend="reference", rngs=nnx.Rngs(1), **kw)
  def shapes(m):
    return jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(m, nnx.Param)))
  assert shapes(ours) == shapes(theirs)
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  s = 6 if "in_kv_features" in kw else T  # cross attention with a different length
  xq, xkv = normal((B, T, E)), normal((B, s, kw.get("in_kv_features", E)), 1)
  np.testing.assert_allclose(run(ours, xq, xkv), run_nnx(theirs, xq, xkv), atol=1e-5)


def test_drop_in_causal_output_and_param_gradient():
  kw = dict(num_heads=4, in_features=E, num_kv_heads=2)
  ours, theirs = _pair(Causal(), **kw)
  x = normal((B, T, E))
  causal = nnx.make_causal_mask(x[..., 0])
  np.testing.assert_allclose(run(ours, x), run_nnx(theirs, x, mask=causal), atol=1e-5)

  @nnx.jit
  def grads(model, **call):
    def loss(model):
      return jnp.sum(jnp.sin(model(x, **call)))
    return nnx.to_pure_dict(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Param))(model))

  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
               grads(ours), grads(theirs, mask=causal))


def test_call_mask_overrides_and_is_causal():
  ours, theirs = _pair(Full(), num_heads=4, in_features=E)
  x = normal((B, T, E))
  want = run_nnx(theirs, x, mask=nnx.make_causal_mask(x[..., 0]))
  np.testing.assert_allclose(run(ours, x, mask=Causal()), want, atol=1e-5)
  np.testing.assert_allclose(run(ours, x, is_causal=True), want, atol=1e-5)


def test_default_backend_matches_reference_on_packed_rows():
  kw = dict(num_heads=4, in_features=E, num_kv_heads=2, rope=RoPE())
  auto = MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ref = MultiHeadAttention(**kw, backend="reference", rngs=nnx.Rngs(0))
  seg = jnp.array([[1] * 3 + [2] * 4 + [0]] * B, jnp.int32)
  pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]] * B, jnp.int32)
  x = normal((B, T, E))
  np.testing.assert_allclose(run(auto, x, segment_ids=seg, positions=pos),
                             run(ref, x, segment_ids=seg, positions=pos), atol=1e-5)


def test_gqa_shapes_and_logical_names_without_mesh():
  m = MultiHeadAttention(8, 32, qkv_features=64, num_kv_heads=2, out_features=24, rngs=nnx.Rngs(0))
  assert m.query.kernel.shape == (32, 8, 8)
  assert m.key.kernel.shape == m.value.kernel.shape == (32, 2, 8)
  assert m.value.bias.shape == (2, 8)
  assert m.out.kernel.shape == (8, 8, 24)
  assert m.query.kernel.get_metadata()["out_sharding"] == ("embed", "heads", "head_dim")
  assert m.key.kernel.get_metadata()["out_sharding"] == ("embed", "kv_heads", "head_dim")
  assert m.value.bias.get_metadata()["out_sharding"] == ("kv_heads", "head_dim")
  assert m.out.kernel.get_metadata()["out_sharding"] == ("heads", "head_dim", "embed")
  assert run(m, normal((B, T, 32))).shape == (B, T, 24)


def test_update_from_pure_dict_keeps_logical_names():
  theirs = nnx.MultiHeadAttention(4, E, decode=False, rngs=nnx.Rngs(0))
  ours = MultiHeadAttention(4, E, rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.to_pure_dict(nnx.state(theirs, nnx.Param)))
  np.testing.assert_array_equal(ours.key.kernel[...], theirs.key.kernel[...])
  assert ours.key.kernel.get_metadata()["out_sharding"] == ("embed", "kv_heads", "head_dim")


def test_rope_positions_restart_per_document():
  m = MultiHeadAttention(4, E, num_kv_heads=2, rope=RoPE(), backend="reference", rngs=nnx.Rngs(0))
  x = normal((1, 12, E))
  seg = jnp.array([[1] * 5 + [2] * 7], jnp.int32)
  pos = jnp.array([list(range(5)) + list(range(7))], jnp.int32)
  packed = run(m, x, segment_ids=seg, positions=pos)
  np.testing.assert_allclose(packed[:, 5:], run(m, x[:, 5:]), atol=1e-5)
  np.testing.assert_allclose(packed[:, :5], run(m, x[:, :5]), atol=1e-5)
  # RoPE changes the output, and only relative positions matter: shifting a whole
  # document's positions leaves its output unchanged.
  plain = MultiHeadAttention(4, E, num_kv_heads=2, backend="reference", rngs=nnx.Rngs(0))
  assert not np.allclose(run(plain, x[:, 5:]), run(m, x[:, 5:]), atol=1e-3)
  shifted = run(m, x[:, 5:], positions=jnp.arange(100, 107, dtype=jnp.int32)[None])
  np.testing.assert_allclose(shifted, run(m, x[:, 5:]), atol=1e-4)


@pytest.mark.parametrize("mask", [Causal(), Local(3)])
def test_decode_token_by_token_matches_full_forward(mask):
  m = MultiHeadAttention(4, E, num_kv_heads=2, rope=RoPE(), mask=mask, normalize_qk=True,
                         backend="reference", rngs=nnx.Rngs(0))
  x = normal((B, T, E))
  full = run(m, x)
  m.init_cache((B, T, E))
  outs = [run(m, x[:, :3], decode=True)]  # prefill three tokens, then one at a time
  outs += [run(m, x[:, t:t + 1], decode=True) for t in range(3, T)]
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5)
  assert m.cache.keys.shape == (B, T, 2, 4) and int(m.cache.index[...]) == T


def test_decode_skips_padding_slots():
  m = MultiHeadAttention(2, E, rope=RoPE(), backend="reference", rngs=nnx.Rngs(0))
  x = normal((1, 6, E))
  m.init_cache((1, 8, E))
  # Two padding tokens first (segment 0) are cached but never attended to.
  seg = jnp.array([[0, 0, 1, 1, 1, 1]], jnp.int32)
  pos = jnp.array([[0, 0, 0, 1, 2, 3]], jnp.int32)
  out = run(m, x, decode=True, segment_ids=seg, positions=pos)
  np.testing.assert_allclose(out[:, 2:], run(m, x[:, 2:]), atol=1e-5)
  nxt = run(m, normal((1, 1, E), 3), decode=True, positions=jnp.array([[4]], jnp.int32))
  want = m(jnp.concatenate([x[:, 2:], normal((1, 1, E), 3)], axis=1))[:, -1:]
  np.testing.assert_allclose(nxt, want, atol=1e-5)


def test_nnx_view_allocates_cache():
  m = MultiHeadAttention(2, E, rngs=nnx.Rngs(0))
  v = nnx.view(m, decode=True, batch_size=3, max_length=5)
  assert v.decode and v.cache.keys.shape == (3, 5, 2, 8)


@pytest.mark.parametrize("make, match", [
    (lambda: MultiHeadAttention(6, 24, num_kv_heads=4, rngs=nnx.Rngs(0)),
     r"num_kv_heads \(4\) expects a divisor of num_heads \(6\)"),
    (lambda: MultiHeadAttention(4, 16, qkv_features=18, rngs=nnx.Rngs(0)),
     r"qkv_features \(18\) expects a multiple of num_heads \(4\)"),
    (lambda: MultiHeadAttention(0, 16, rngs=nnx.Rngs(0)), r"num_heads=.*positive int.*got 0"),
    (lambda: MultiHeadAttention(4, 16, dropout_rate=0.1, rngs=nnx.Rngs(0)),
     r"dropout_rate expects 0.0, got 0.1"),
    (lambda: MultiHeadAttention(4, 12, rope=RoPE(), rngs=nnx.Rngs(0)),
     r"rope expects an even head_dim, got head_dim 3"),
    (lambda: RoPE(theta=0.5), r"theta=.*got 0.5"),
])
def test_constructor_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("call, match", [
    (lambda m: m(normal((E,))),
     r"inputs_q expects an array \[\.\.\., seq, features\] .* got shape \(16,\)"),
    (lambda m: m(normal((B, T, E)), normal((3, T, E))),
     r"inputs_k expects the leading \(batch\) axes of inputs_q, \(2,\), got shape \(3, 8, 16\)"),
    (lambda m: m(normal((3, B, T, E)), segment_ids=jnp.ones((B, T), jnp.int32)),
     r"segment_ids expects shape \(3, 2, 8\) \(the inputs' leading axes, then tokens\), got"
     r" shape \(2, 8\)"),
    (lambda m: m(normal((B, T, 12))),
     r"inputs_q expects 16 features \(in_features=16\), got shape"),
    (lambda m: m(normal((B, T, E)), mask=nnx.make_causal_mask(jnp.ones((B, T)))),
     r"mask expects a flaxattn mask .* got ArrayImpl of shape \(2, 1, 8, 8\).*segment_ids"),
    (lambda m: m(normal((B, T, E)), sow_weights=True), r"sow_weights expects False"),
    (lambda m: m(normal((B, 1, E)), decode=True),
     r"decode=True expects a KV cache: call init_cache"),
    (lambda m: m(normal((B, T, E)), None, normal((B, T, E))),
     r"inputs_k expects an array when inputs_v"),
    (lambda m: m(normal((B, 0, E))),
     r"inputs_q expects at least one token \(axis -2\) in every batch axis, got shape"
     r" \(2, 0, 16\)"),
])
def test_call_errors(call, match):
  m = MultiHeadAttention(4, E, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match):
    call(m)


def test_decode_cache_mismatch_error():
  m = MultiHeadAttention(4, E, rngs=nnx.Rngs(0))
  m.init_cache((B, T, E))
  with pytest.raises(ValueError, match=r"decode expects the batch the KV cache was made for, 2"):
    m(normal((3, 1, E)), decode=True)


def test_drop_in_defaults_behave_as_nnx():
  """Same arguments, same answer: no mask by default, in self and cross attention."""
  theirs = nnx.MultiHeadAttention(4, E, decode=False, rngs=nnx.Rngs(0))
  ours = MultiHeadAttention(4, E, rngs=nnx.Rngs(1))
  nnx.update(ours, nnx.state(theirs, nnx.Param))
  xq, xkv = normal((B, T, E)), normal((B, 5, E), 1)
  np.testing.assert_allclose(run(ours, xq), run_nnx(theirs, xq), atol=1e-5)
  np.testing.assert_allclose(run(ours, xq, xkv), run_nnx(theirs, xq, xkv), atol=1e-5)
  # Causal stays one argument away.
  causal = run_nnx(theirs, xq, mask=nnx.make_causal_mask(jnp.ones((B, T))))
  np.testing.assert_allclose(run(ours, xq, is_causal=True), causal, atol=1e-5)


def _decoder(max_length):
  m = MultiHeadAttention(2, E, rope=RoPE(), mask=Causal(), backend="reference", rngs=nnx.Rngs(0))
  m.init_cache((1, max_length, E))
  return m


def _values(m) -> list[np.ndarray]:
  """Every variable of `m` (parameters and cache) read back to the host."""
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(m))]


@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["eager", "jit"])
def test_decode_past_the_cache_is_refused_and_writes_nothing(jit):
  """Eagerly a ValueError before anything is written. Inside a program (a traced index) the
  call returns NaN, writes nothing and records the refusal in the cache; later calls are
  refused too, one that fits included (the first refusal sticks), and the next host read
  raises it, naming the call's cache index: `check()`, or the next eager decode call. Every
  variable is then what it was before the refused call, and the layer goes on."""
  call = run if jit else (lambda m, x, **kw: m(x, **kw))

  def refused(m, x, match, read):
    before = _values(m)
    if jit:
      assert np.isnan(np.asarray(call(m, x, decode=True))).all()
      assert np.isnan(np.asarray(call(m, x[:, :1], decode=True))).all()
      with pytest.raises(ValueError, match=match):
        read(m)
    else:
      with pytest.raises(ValueError, match=match):
        call(m, x, decode=True)
    for a, b in zip(_values(m), before, strict=True):
      np.testing.assert_array_equal(a, b)

  m = _decoder(4)
  for i in range(4):
    call(m, normal((1, 1, E), i), decode=True)
  refused(m, normal((1, 1, E), 9),
          r"writing 1 token\(s\) at cache index 4 needs 5 slots, the cache has max_length 4",
          lambda m: m.cache.check())
  m = _decoder(4)
  x = normal((1, 4, E))
  want = np.asarray(call(m, x, decode=False))
  call(m, x[:, :3], decode=True)
  refused(m, normal((1, 2, E), 1), r"writing 2 token\(s\) at cache index 3 needs 5 slots",
          lambda m: m(x[:, 3:], decode=True))
  assert int(m.cache.index[...]) == 3
  # The layer goes on: the token that fits, then a new cache.
  np.testing.assert_allclose(call(m, x[:, 3:], decode=True), want[:, 3:], atol=1e-5)
  m.init_cache((1, 4, E))
  np.testing.assert_allclose(call(m, x, decode=True), want, atol=1e-5)


def test_decode_of_no_tokens_is_refused_by_name():
  m = _decoder(4)
  with pytest.raises(ValueError, match=r"inputs_q expects at least one token"):
    m(normal((1, 0, E)), decode=True)
  assert int(m.cache.index[...]) == 0


def test_init_cache_checks_the_shape():
  m = MultiHeadAttention(2, E, rngs=nnx.Rngs(0))
  for shape in [(1, 8), (8,), (1, 8, E + 1), (1, 0, E), (True, 8, E), [1, 8.0, E]]:
    with pytest.raises(ValueError, match=r"init_cache\(input_shape=...\) expects \(\.\.\.,"
                       r" max_length, features\) .*in_features \(16\), got"):
      m.init_cache(shape)
  m.init_cache((8, E))  # no batch axes, as nnx
  assert m.cache is not None and m.cache.keys.shape == (1, 8, 2, 8)


def test_decode_defaults_continue_the_cached_document():
  """After a prefill of two packed documents, default ids/positions continue the second."""
  m = _decoder(8)
  x = normal((1, 6, E))
  seg = jnp.array([[1, 1, 2, 2, 2, 2]], jnp.int32)
  pos = jnp.array([[0, 1, 0, 1, 2, 3]], jnp.int32)
  run(m, x[:, :5], decode=True, segment_ids=seg[:, :5], positions=pos[:, :5])
  got = run(m, x[:, 5:], decode=True)
  want = run(m, x[:, 2:], decode=False)[:, -1:]  # document 2 alone
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_array_equal(m.cache.segment_ids[...][0, :6], seg[0])
  np.testing.assert_array_equal(m.cache.positions[...][0, :6], pos[0])
  # Explicit ids without positions: positions count inside each run, the first run
  # continuing the cached document 2 (position 4), the new document 3 from 0.
  run(m, normal((1, 2, E), 1), decode=True, segment_ids=jnp.array([[2, 3]], jnp.int32))
  np.testing.assert_array_equal(m.cache.positions[...][0, 6:8], [4, 0])


def test_decode_defaults_after_padding_raise():
  m = _decoder(8)
  m(normal((1, 3, E)), decode=True, segment_ids=jnp.array([[1, 1, 0]], jnp.int32),
    positions=jnp.array([[0, 1, 0]], jnp.int32))
  with pytest.raises(ValueError, match=r"cache ends in padding \(segment id 0 at cache index 2\)"):
    m(normal((1, 1, E)), decode=True)


@pytest.mark.parametrize("arg", ["segment_ids", "positions"])
def test_ids_wider_than_int32_raise_instead_of_narrowing(arg):
  m = MultiHeadAttention(2, E, mask=Causal(), backend="reference", rngs=nnx.Rngs(0))
  ids = np.array([[1] * 4 + [2**32 + 1] * 4], np.int64)  # narrowed, 2**32 + 1 would become 1
  with pytest.raises(ValueError, match=rf"{arg} expects values that fit in int32 .* got int64"
                                       r" values in \[1, 4294967297\]"):
    m(normal((1, 8, E)), **{arg: ids})
  fits = MultiHeadAttention(2, E, mask=Causal(), backend="reference", rngs=nnx.Rngs(0))(
      normal((1, 8, E)), **{arg: ids % 7})
  assert fits.shape == (1, 8, E)


def test_layer_hands_attention_its_resolved_layout(monkeypatch):
  """The ids are resolved once, in the layer (RoPE and the kernel see the same layout):
  `flaxattn.attention`, or a partial of it, takes the layout; another `attention_fn` gets
  the four arrays."""
  import functools
  import importlib

  import flaxattn
  from flaxattn import layout as layout_module
  attention_module = importlib.import_module("flaxattn.attention")
  calls = []

  def counted(*args, **kwargs):
    calls.append(1)
    return layout_module.resolve(*args, **kwargs)

  monkeypatch.setattr(attention_module, "resolve", counted)
  seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0]], jnp.int32)
  x = normal((1, 8, 16))
  got = {}

  def own(q, k, v, **kw):
    got.update(kw)
    return flaxattn.attention(q, k, v, **kw)

  outs = []
  for fn in (flaxattn.attention, functools.partial(flaxattn.attention, scale=0.25 ** 0.5), own):
    layer = MultiHeadAttention(2, 16, qkv_features=8, rope=RoPE(4), attention_fn=fn,
                               decode=False, rngs=nnx.Rngs(0))
    outs.append(layer(x, segment_ids=seg))
  assert calls == [1], "attention resolved the ids again only for the custom attention_fn"
  assert "layout" not in got and (np.asarray(got["segment_ids"]) == np.asarray(seg)).all()
  np.testing.assert_allclose(outs[0], outs[2], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)  # D ** -0.5 = 0.5
