"""Attention sinks, logit soft-capping and a value head dim of its own (Dv != D), on every
kernel, against attention written out from the definitions (`helpers.dense_oracle`):
output, lse and the gradients of q, k, v and the sinks. Also the layer's options, the model's
sliding-window pattern and `nnx_attention_fn` inside stock `nnx.MultiHeadAttention`.
Context parallelism with these features: cp_check.py (cases named `...-sinks-cap-dv...`).
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxattn
from flaxattn import cudnn, registry, splash
from flaxattn.attention import apply_sinks
from helpers import TOL, as_layout, dense_oracle, grads_of, normal, qkv, random_packing
from models import llama

SCALE = 0.3


def _data(seed, b, t, h, hkv, d, dv, dtype, pad_tail=3):
  q, k, v = qkv(seed, b, t, t, h, hkv, d, dtype)
  if dv != d:
    v = normal((b, t, hkv, dv), (seed, 9), dtype)
  sinks = normal((h,), (seed, 7))
  seg, pos = random_packing(seed, b, t, max_docs=5, pad_tail=pad_tail)
  return q, k, v, sinks, as_layout(seg, pos)


def _check(attend, q, k, v, sinks, layout, mask, dtype, soft_cap, use_sinks=True):
  """`attend(q, k, v, sinks) -> (out, lse)` against the oracle: out, lse, dq, dk, dv, dsinks."""
  def oracle(q, k, v, s):
    return dense_oracle(q, k, v, layout, mask, SCALE, s if use_sinks else None, soft_cap)
  want_g, (want_o, want_l) = grads_of(oracle, 4)(q, k, v, sinks)
  got_g, (got_o, got_l) = grads_of(attend, 4)(q, k, v, sinks)
  tol = TOL[dtype]
  np.testing.assert_allclose(got_o, want_o, **tol)
  np.testing.assert_array_equal(np.isinf(got_l), np.isinf(want_l))
  def finite(x):
    return np.where(np.isinf(x), 0, x)
  np.testing.assert_allclose(finite(got_l), finite(want_l), **tol)
  for name, got, want in zip(("dq", "dk", "dv", "dsinks"), got_g, want_g, strict=True):
    scale = max(1.0, float(jnp.abs(want.astype(jnp.float32)).max()))
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale,
                               np.asarray(want, np.float32) / scale, err_msg=name, **tol)


def _attend(backend, layout, mask, soft_cap, use_sinks=True):
  return lambda q, k, v, s: flaxattn.attention(
      q, k, v, mask=mask, segment_ids=layout.q_segment_ids, positions=layout.q_positions,
      scale=SCALE, backend=backend, sinks=s if use_sinks else None, logit_soft_cap=soft_cap,
      return_lse=True)


# Each feature alone, then all together with a window, packing, GQA; f32 and bf16.
CASES = [
    # sinks, soft_cap, dv, mask, hkv, dtype
    (True, None, 16, flaxattn.Causal(), 2, jnp.float32),
    (False, 1.5, 16, flaxattn.Causal(), 2, jnp.float32),
    (False, None, 12, flaxattn.Full(), 4, jnp.float32),
    (True, 1.5, 12, flaxattn.Local(9), 1, jnp.float32),
    (True, 1.5, 24, flaxattn.Causal() & flaxattn.Local(20), 2, jnp.bfloat16),
]


@pytest.mark.parametrize("backend", ["reference", flaxattn.blockwise.Blockwise(16, 32)],
                         ids=["reference", "blockwise"])
@pytest.mark.parametrize("use_sinks,soft_cap,dv,mask,hkv,dtype", CASES)
def test_kernel_matches_definition(backend, use_sinks, soft_cap, dv, mask, hkv, dtype):
  # T = 70 is a multiple of no block; head dims 12 and 20 are multiples of neither 8 nor 128.
  q, k, v, sinks, layout = _data(1, 2, 70, 4, hkv, 20 if dv == 12 else 16, dv, dtype)
  _check(_attend(backend, layout, mask, soft_cap, use_sinks), q, k, v, sinks, layout, mask,
         dtype, soft_cap, use_sinks)


def test_splash_all_features():
  """Splash's own soft cap and Dv != D (interpret mode), sinks outside it."""
  q, k, v, sinks, layout = _data(2, 1, 256, 2, 1, 16, 24, jnp.float32, pad_tail=0)
  mask = flaxattn.Causal()
  kernel = splash.Splash(block_q=128, block_kv=128)
  _check(_attend(kernel, layout, mask, 2.0), q, k, v, sinks, layout, mask, jnp.float32, 2.0)


def test_cudnn_model_with_sinks(fake_cudnn):
  """cuDNN (through the CPU model) gives (out, lse); the sinks are applied outside it, in
  the one place every kernel shares."""
  q, k, v, sinks, layout = _data(3, 2, 64, 4, 2, 16, 16, jnp.bfloat16)
  mask = flaxattn.Causal()
  run = functools.partial(cudnn.cudnn_attention, mask=mask, scale=SCALE, return_lse=True,
                          max_segments=8)
  def attend(q, k, v, s):
    return apply_sinks(*run(q, k, v, layout), s)
  _check(attend, q, k, v, sinks, layout, mask, jnp.bfloat16, None)


def test_row_with_no_key_and_a_sink_gets_zeros():
  q, k, v, sinks, layout = _data(4, 1, 32, 2, 1, 8, 8, jnp.float32, pad_tail=4)
  out, lse = _attend("blockwise", layout, flaxattn.Causal(), 2.0)(q, k, v, sinks)
  np.testing.assert_array_equal(out[0, -4:], 0.0)
  np.testing.assert_allclose(lse[0, -4:], np.broadcast_to(sinks, (4, 2)))
  grads, _ = grads_of(_attend("blockwise", layout, flaxattn.Causal(), 2.0), 4)(q, k, v, sinks)
  assert all(np.isfinite(g).all() for g in grads)
  np.testing.assert_array_equal(grads[0][0, -4:], 0.0)


def _gpu_call(**kw):
  shape = (1, 256, 4, 64)
  fields = dict(platform="gpu", q_shape=shape, kv_shape=shape, dtype="bfloat16",
                mask=flaxattn.Causal(), has_segment_ids=False, has_positions=False,
                return_lse=True)
  return registry.Call(**{**fields, **kw})


@pytest.mark.parametrize("kw,words", [
    (dict(soft_cap=30.0), "no logit soft-capping, got logit_soft_cap=30.0"),
    (dict(v_head_dim=32), "v head_dim 32; the pallas_gpu and blockwise kernels serve Dv != D"),
])
def test_cudnn_declines_with_reason_and_fused_takes_the_next_kernel(kw, words):
  call = _gpu_call(**kw)
  assert words in registry.get("cudnn").unsupported_reason(call)
  assert registry.select("fused", call).name == "mosaic_gpu"
  for name in ("splash", "mosaic_gpu", "pallas_gpu", "blockwise", "reference"):  # splash: TPU
    assert registry.get(name).unsupported_reason(
        dataclasses.replace(call, platform="tpu" if name == "splash" else "gpu")) is None
  text = registry.describe("fused", call)
  assert words in text and "sinks" not in text


def test_a_kernel_without_soft_cap_declines_by_default():
  class Plain(registry.Kernel):
    name = "plain"
  assert "plain has no logit soft-capping (logit_soft_cap=30.0)" in Plain().unsupported_reason(
      _gpu_call(soft_cap=30.0))


def test_explain_reports_the_features():
  q, k, v, sinks, _ = _data(5, 1, 16, 2, 1, 8, 12, jnp.float32)
  text = flaxattn.explain(q, k, v, sinks=sinks, logit_soft_cap=5.0, print_fn=None)
  assert "v head_dim 12; logit_soft_cap 5.0; sinks" in text
  assert "backend='auto' -> blockwise" in text


@pytest.mark.parametrize("kw,match", [
    (dict(sinks=jnp.zeros((3,))), r"sinks expects a floating array \[H\] = \[2\].*shape \(3,\)"),
    (dict(sinks=jnp.zeros((2,), jnp.int32)), r"sinks expects a floating array"),
    (dict(logit_soft_cap=-1.0), r"logit_soft_cap expects a positive number .* got -1.0"),
    (dict(logit_soft_cap=True), r"logit_soft_cap expects a positive number"),
])
def test_bad_arguments_name_themselves(kw, match):
  q, k, v = qkv(0, 1, 16, 16, 2, 1, 8)
  with pytest.raises(ValueError, match=match):
    flaxattn.attention(q, k, v, **kw)


@pytest.mark.slow
def test_layer_options():
  x = normal((2, 16, 32))
  def make(**kw):
    return flaxattn.MultiHeadAttention(4, 32, num_kv_heads=2, mask=flaxattn.Causal(),
                                       rngs=nnx.Rngs(0), **kw)
  m = make(sinks=True, logit_soft_cap=3.0, v_head_dim=12)
  assert m.sinks.shape == (4,) and m.sinks.out_sharding == ("heads",)
  assert m.value.kernel.shape == (32, 2, 12) and m.out.kernel.shape == (4, 12, 32)
  m.sinks[...] = normal((4,), 1)
  # The layer runs flaxattn.attention with its sink parameter and cap.
  q, k, v = m._project(x, x, x, None)  # pylint: disable=protected-access
  want = flaxattn.attention(q, k, v, mask=flaxattn.Causal(), sinks=m.sinks[...],
                            logit_soft_cap=3.0, backend="reference")
  np.testing.assert_allclose(m(x), m.out(want), atol=1e-5, rtol=1e-5)
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)
  assert float(jnp.abs(grads["sinks"][...]).max()) > 0
  with pytest.raises(ValueError, match=r"logit_soft_cap expects a positive number"):
    make(logit_soft_cap=0.0)
  with pytest.raises(ValueError, match=r"v_head_dim=...\) expects a positive int"):
    make(v_head_dim=0)


@pytest.mark.parametrize("causal", [False, True])
def test_nnx_attention_fn_in_stock_layer_matches_its_default(causal):
  x = normal((2, 24, 32))
  def make(**kw):
    return nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0), **kw)
  stock, ours = make(), make(attention_fn=flaxattn.nnx_attention_fn())
  np.testing.assert_allclose(ours(x, is_causal=causal), stock(x, is_causal=causal),
                             atol=2e-5, rtol=2e-5)
  windowed = make(attention_fn=flaxattn.nnx_attention_fn(flaxattn.Local(5)))
  band = np.tril(np.ones((24, 24), bool)) & ~np.tril(np.ones((24, 24), bool), -5)
  np.testing.assert_allclose(windowed(x), stock(x, mask=jnp.asarray(band)), atol=2e-5, rtol=2e-5)


def test_nnx_attention_fn_rejects_what_it_cannot_apply():
  layer = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0),
                                 attention_fn=flaxattn.nnx_attention_fn())
  x = normal((1, 8, 32))
  with pytest.raises(ValueError, match=r"mask expects None, got .* shape \(1, 1, 8, 8\).*"
                                       r"flaxattn.MultiHeadAttention"):
    layer(x, mask=jnp.ones((1, 1, 8, 8), bool))
  with pytest.raises(ValueError, match=r"sow_weights"):
    layer(x, sow_weights=True)


def test_llama_sliding_window_pattern_and_options():
  config = llama.LlamaConfig(n_layers=4, sliding_window=8, global_every=2, attention_sinks=True,
                             logit_soft_cap=30.0, scan_layers=True)
  assert llama.layer_masks(config) == (flaxattn.Local(8), flaxattn.Causal()) * 2
  assert config.period == 2
  with pytest.raises(ValueError, match=r"sliding_window=...\) expects None with chunk_size"):
    llama.LlamaConfig(chunk_size=8, sliding_window=8)
  with pytest.raises(ValueError, match=r"logit_soft_cap=...\) expects a positive number"):
    llama.LlamaConfig(logit_soft_cap=-2.0)
  model = nnx.eval_shape(lambda: llama.Llama(config, rngs=nnx.Rngs(0)))
  sinks = model.layers.blocks[0].attn.sinks
  assert sinks.shape == (2, 8) and sinks.out_sharding == (llama.LAYERS_AXIS, "heads")
