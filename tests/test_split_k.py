"""The split_k kernel: "auto" takes it for decode steps only (one device and each shard of a
sharded cache), it equals attention written out from the definitions on packed caches with
padding, and a layer decoding through it equals its full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxattn
from flaxattn import Causal, Chunked, ContextParallel, Full, Local, MultiHeadAttention, RoPE
from flaxattn.split_k import SplitK, chunking
from helpers import TOL, as_layout, dense_oracle, grads_of, mesh, normal, random_packing

E = 16


def _program(m, t: int) -> str:
  """The jaxpr of the layer's decode call of t new tokens."""
  graphdef, state = nnx.split(m)
  return str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x, decode=True))(
      state, jnp.zeros((1, t, E))))


def test_auto_takes_split_k_for_a_decode_step_and_a_training_kernel_for_a_prefill():
  cache = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.float32)
  step = jax.ShapeDtypeStruct((1, 1, 8, 64), jnp.float32)
  text = flaxattn.explain(step, cache, cache, decode=True, print_fn=None)
  assert "segment_ids: True; positions: True" in text  # the cache's, as the layer passes them
  assert ("backend='auto' -> split_k (a decode step: the 4096 keys in 2 chunks of 2048, all"
          " chunks at once in one XLA computation, merged by lse)") in text
  assert "decode: q are 1 new token(s) attending to 4096 cache slots" in text
  prefill = jax.ShapeDtypeStruct((1, 64, 8, 64), jnp.float32)
  text = flaxattn.explain(prefill, cache, cache, decode=True, print_fn=None)
  # float32 on a GPU: cuDNN declines the dtype and pallas_gpu serves it.
  training = "pallas_gpu" if jax.default_backend() == "gpu" else "blockwise"
  assert (f"backend='auto' -> {training} (split_k declines: split_k serves decode steps of at"
          " most 16 queries; this call has 64.") in text
  # The layer's programs: no loop over key blocks in a step; a loop in a prefill (blockwise's,
  # or inside pallas_gpu's kernels).
  m = MultiHeadAttention(4, E, num_kv_heads=2, mask=Causal(), rngs=nnx.Rngs(0))
  m.init_cache((1, 4096, E))
  assert "while[" not in _program(m, 1)
  assert "while[" in _program(m, 64)


def test_a_decode_step_lowered_for_cuda_is_split_k_without_a_loop():
  """What a GPU runs for one bf16 token over a 32K cache, exported from this host: split_k's
  one XLA computation (no while loop over key blocks, no cuDNN or Triton call)."""
  m = MultiHeadAttention(8, 64, num_kv_heads=2, mask=Causal(), dtype=jnp.bfloat16,
                         rngs=nnx.Rngs(0))
  m.init_cache((1, 32768, 64), dtype=jnp.bfloat16)
  graphdef, state = nnx.split(m)

  def step(state, x):
    return nnx.merge(graphdef, state)(x, decode=True)

  with flaxattn.lowering_for("gpu"):
    text = flaxattn.explain(jax.ShapeDtypeStruct((1, 1, 8, 8), jnp.bfloat16),
                            *[jax.ShapeDtypeStruct((1, 32768, 2, 8), jnp.bfloat16)] * 2,
                            decode=True, print_fn=None)
    exported = jax.export.export(jax.jit(step), platforms=("cuda",))(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state),
        jax.ShapeDtypeStruct((1, 1, 64), jnp.bfloat16))
  assert "backend='auto' -> split_k (a decode step: the 32768 keys in 16 chunks" in text, text
  module = exported.mlir_module()
  assert "stablehlo.while" not in module and "custom_call" not in module


def test_each_shard_of_a_sharded_cache_takes_split_k_and_a_prefill_does_not():
  with jax.set_mesh(mesh({"context": 4})):
    q = jax.ShapeDtypeStruct((1, 1, 4, 4), jnp.float32)
    cache = jax.ShapeDtypeStruct((1, 4096, 2, 4), jnp.float32)
    text = flaxattn.explain(q, cache, cache, decode=True, context_parallel=ContextParallel(),
                            print_fn=None)
    assert "k/v (1, 1024, 2, 4)" in text and "backend='auto' -> split_k" in text
    m = MultiHeadAttention(4, E, num_kv_heads=2, mask=Causal(),
                           context_parallel=ContextParallel(), rngs=nnx.Rngs(0))
    m.init_cache((1, 64, E))
    assert "while[" not in _program(m, 1)
    assert "while[" in _program(m, 16)  # a prefill: the ring of blockwise steps


def test_chunking_divides_where_it_can_and_pads_by_less_than_a_chunk_count():
  assert chunking(32768, 2048) == (16, 2048)
  assert chunking(5000, 2048) == (4, 1250)  # 3 chunks would pad; 4 divide
  assert chunking(4099, 2048) == (3, 1367)  # a prime: padded by 2
  assert chunking(100, 2048) == (1, 100)


def _cache(s: int, t: int):
  """Packed cache ids `[2, S]` with a padding run inside and at the end, and the ids of t
  queries: the last cached token of a document, an earlier one, and a query with no key
  (row 0: padding; row 1: a document the cache does not hold)."""
  seg, pos = random_packing(3, 2, s, max_docs=4, pad_tail=5, min_len=20)
  seg[:, 40:50] = 0
  last = [int(np.nonzero(row)[0][-1]) for row in seg]
  q_seg = np.stack([seg[b, [last[b], 30, 0]] for b in range(2)])
  q_pos = np.stack([pos[b, [last[b], 30, 0]] for b in range(2)])
  q_seg[0, 2], q_seg[1, 2] = 0, 99
  return q_seg[:, :t], q_pos[:, :t], seg, pos


CASES = [  # name, mask, T, Hkv (of 4 query heads), Dv (D = 16), soft cap, dtype, S, chunk
    ("causal-gqa-one-query", Causal(), 1, 2, 16, None, jnp.float32, 256, 48),
    ("causal-gqa-padded-chunks", Causal(), 3, 2, 16, None, jnp.float32, 251, 48),
    ("window-mqa-soft-cap-dv", Local(20) & Causal(), 3, 1, 24, 2.0, jnp.float32, 251, 32),
    ("chunked-one-query", Chunked(32), 1, 2, 16, None, jnp.float32, 251, 64),
    ("full-one-chunk", Full(), 3, 4, 16, None, jnp.float32, 256, 2048),
    ("causal-soft-cap-bfloat16", Causal(), 3, 2, 16, 5.0, jnp.bfloat16, 256, 48),
]


@pytest.mark.parametrize("name,mask,t,hkv,dv,cap,dtype,s,chunk", CASES, ids=[c[0] for c in CASES])
def test_matches_the_definition(name, mask, t, hkv, dv, cap, dtype, s, chunk):
  q = normal((2, t, 4, 16), 1, dtype)
  k, v = normal((2, s, hkv, 16), 2, dtype), normal((2, s, hkv, dv), 3, dtype)
  q_seg, q_pos, seg, pos = _cache(s, t)
  layout = as_layout(q_seg, q_pos, seg, pos)
  ids = dict(segment_ids=jnp.asarray(q_seg), positions=jnp.asarray(q_pos),
             kv_segment_ids=jnp.asarray(seg), kv_positions=jnp.asarray(pos))

  def attend(q, k, v):
    return flaxattn.attention(q, k, v, mask=mask, scale=0.3, backend=SplitK(chunk=chunk),
                              return_lse=True, logit_soft_cap=cap, **ids)

  def oracle(q, k, v):
    return dense_oracle(q, k, v, layout, mask, 0.3, soft_cap=cap)

  want_g, (want_o, want_l) = grads_of(oracle)(q, k, v)
  got_g, (got_o, got_l) = grads_of(attend)(q, k, v)
  tol = TOL[dtype]
  np.testing.assert_allclose(got_o, want_o, **tol)
  np.testing.assert_array_equal(np.isinf(got_l), np.isinf(want_l))
  np.testing.assert_allclose(np.where(np.isinf(got_l), 0, got_l),
                             np.where(np.isinf(want_l), 0, want_l), **tol)
  for arg, got, want in zip(("dq", "dk", "dv"), got_g, want_g, strict=True):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), arg
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got / scale, want / scale, err_msg=arg, **tol)
  if t == 3:  # the queries with nothing to see: zeros, lse -inf
    np.testing.assert_array_equal(np.asarray(got_o[:, 2], np.float32), 0.0)
    assert np.isneginf(got_l[:, 2]).all()


@pytest.mark.parametrize("mask", [Causal(), Local(3), Chunked(4), Local(5) & Chunked(4)])
def test_layer_decode_through_split_k_equals_its_full_forward(mask):
  m = MultiHeadAttention(4, E, num_kv_heads=2, rope=RoPE(), mask=mask, sinks=True,
                         logit_soft_cap=3.0, rngs=nnx.Rngs(0))
  m.sinks[...] = jnp.linspace(-1.0, 1.0, 4)
  x = normal((2, 10, E))
  # Row 1 starts with two padding tokens, cached but never attended.
  seg = jnp.asarray([[1] * 10, [0, 0] + [1] * 8], jnp.int32)
  pos = jnp.asarray([list(range(10)), [0, 0] + list(range(8))], jnp.int32)
  step = nnx.jit(lambda m, x, s, p: m(x, decode=True, segment_ids=s, positions=p))
  full = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p))(m, x, seg, pos)
  m.init_cache((2, 16, E))
  outs = [step(m, x[:, :3], seg[:, :3], pos[:, :3])]  # 3 tokens into 16 slots: split_k too
  outs += [step(m, x[:, i:i + 1], seg[:, i:i + 1], pos[:, i:i + 1]) for i in range(3, 10)]
  got = jnp.concatenate(outs, axis=1)
  np.testing.assert_allclose(got[0], full[0], atol=1e-5)
  np.testing.assert_allclose(got[1, 2:], full[1, 2:], atol=1e-5)


def test_bfloat16_gradients_of_a_query_seeing_one_key():
  """Chunked(64) puts a decode query at position 64 alone in its chunk: its softmax has one
  key, whose gradient is a difference of two equal terms. The weights' gradient stays
  float32 (autodiff's bfloat16 cotangent left 2.8% of the largest dK there)."""
  b, t, h, hkv, d = 2, 256, 4, 2, 64
  k, v = (normal((b, t, hkv, d), seed).astype(jnp.bfloat16) for seed in (1, 2))
  q = normal((b, 3, h, d), 3).astype(jnp.bfloat16)
  seg = np.ones((b, t), np.int32)
  pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  q_seg, q_pos = np.ones((b, 3), np.int32), np.array([[64, 100, 200]] * b, np.int32)

  def grads(backend):
    def loss(q, k, v):
      out, lse = flaxattn.attention(q, k, v, mask=Chunked(64), segment_ids=q_seg,
                                    positions=q_pos, kv_segment_ids=seg, kv_positions=pos,
                                    backend=backend, return_lse=True)
      return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32))) + jnp.sum(
          jnp.sin(lse))
    return jax.grad(loss, (0, 1, 2))(q, k, v)
  for got, want in zip(grads("split_k"), grads("reference"), strict=True):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
