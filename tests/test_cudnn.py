"""The cuDNN kernel: its decline rules, its glue on CPU against a model of cuDNN, and on a GPU
against the reference.

On CPU, the `fake_cudnn` fixture (conftest.py) gives JAX's cuDNN primitives a CPU lowering
that models cuDNN; everything above it is JAX's real code.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_ring_check
import flaxattn
from flaxattn import blockwise, cudnn, cudnn_ring, registry
from flaxattn.layout import Layout
from flaxattn.reference import reference_attention
from helpers import TOL, as_layout, compare, normal, qkv, random_packing

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU with cuDNN; none present")


def _call(platform="gpu", dtype="bfloat16", d=128, mask=flaxattn.Causal(), segments=True,
          positions=False, t=1024, s=1024):
  return registry.Call(platform=platform, q_shape=(2, t, 8, d), kv_shape=(2, s, 4, d),
                       dtype=dtype, mask=mask, has_segment_ids=segments,
                       has_positions=positions, return_lse=True)


# ---------------------------------------------------------------------------------------
# Decline rules (static: a CPU machine reasons about "gpu" from the call alone)


@pytest.mark.parametrize("call", [
    _call(), _call(segments=False), _call(mask=flaxattn.Full()), _call(mask=flaxattn.Local(64)),
    _call(mask=flaxattn.Causal() & flaxattn.Local(64) & flaxattn.Local(32)),
    _call(dtype="float16", d=64), _call(d=256), _call(positions=True),
    _call(positions=True, segments=False, mask=flaxattn.Full()), _call(t=100, s=300)],
    ids=lambda c: (f"{c.dtype}-d{c.q_shape[-1]}-{c.mask}-seg{c.has_segment_ids}"
                   f"-pos{c.has_positions}"))
def test_accepts(call):
  # Two slots keep packed rows within the default THD budget (test_thd_budget).
  assert cudnn.Cudnn(max_segments=2).unsupported_reason(call) is None


def test_thd_budget():
  """Packed rows through cuDNN's THD layout hold temporaries that grow with the slots
  (about 4.3 x slots x B x T x H x D x bytes on an H100, against 6 for the unpacked call):
  by default cuDNN takes them while that stays under twice the unpacked call's, else the
  next kernel serves them (mosaic_gpu for Hopper or a GPU not named, pallas_gpu for an
  A100), and the reason gives the bytes."""
  call = _call(t=32768, s=32768)  # B=2, H=8, D=128, bf16: B x T x H x D x bytes = 2**27
  packed, unpacked = cudnn.thd_bytes(call, 32)
  assert (packed, unpacked) == (int(4.3 * 32 * 2**27), int(6.0 * 2**27))
  reason = cudnn.Cudnn().unsupported_reason(call)
  assert ("packed (THD) layout with 32 slots would hold about 17.20 GiB of temporaries"
          in reason and "over its budget of 1.50 GiB (twice the unpacked call's" in reason)
  hopper = registry.get("mosaic_gpu").unsupported_reason(call) is None  # or a GPU not named
  assert registry.select("auto", call).name == ("mosaic_gpu" if hopper else "pallas_gpu")
  if not ON_GPU:  # a GPU host's own GPU decides
    with jax.sharding.use_abstract_mesh(jax.sharding.get_abstract_mesh().update(
        abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB",
                                                    num_cores=108, platform="gpu"))):
      assert registry.select("auto", call).name == "pallas_gpu"
  assert cudnn.Cudnn(max_segments=2).unsupported_reason(call) is None  # 1.07 GiB
  assert cudnn.Cudnn(max_segments=3).unsupported_reason(call) is not None  # 1.61 GiB
  assert cudnn.Cudnn(thd_budget=200 * 2**30).unsupported_reason(call) is None
  unpacked_call = _call(t=32768, s=32768, segments=False)
  assert registry.select("auto", unpacked_call).name == "cudnn"
  # Per device under context parallelism: the same rule on T / cp tokens.
  ring = dataclasses.replace(call, cp_size=4, cp_strategy="ring")
  assert "about 4.30 GiB" in cudnn.Cudnn().unsupported_reason(ring)
  assert "packed rows, 2 slots, about 1.07 GiB" in cudnn.Cudnn(max_segments=2).describe(call)


@pytest.mark.parametrize("call,words", [
    (_call(platform="cpu"), "NVIDIA GPUs; this call is on cpu"),
    (_call(platform="tpu"), "NVIDIA GPUs; this call is on tpu"),
    (_call(dtype="float32"), "cast q/k/v to bfloat16 or float16"),
    (_call(d=100), "head_dim a multiple of 8"),
    (_call(d=512), "at most 256"),
    (_call(mask=flaxattn.Chunked(64)), "no chunked mask"),
    (_call(mask=flaxattn.Causal() & flaxattn.Chunked(64)), "no chunked mask"),
    (_call(positions=True, segments=False), "explicit positions without segment_ids"),
    (_call(positions=True, segments=False, mask=flaxattn.Local(8)), "load-balanced"),
])
def test_declines_with_reason(call, words):
  assert words in cudnn.Cudnn().unsupported_reason(call)


def test_serves_context_parallelism_for_causal_and_full_masks_only():
  def cp(mask, strategy):
    return dataclasses.replace(_call(mask=mask), cp_size=4, cp_strategy=strategy)
  for strategy in ("ring", "all_gather"):
    for mask in (flaxattn.Causal(), flaxattn.Full()):
      assert cudnn.Cudnn(max_segments=2).unsupported_reason(cp(mask, strategy)) is None
      unpacked = dataclasses.replace(cp(mask, strategy), has_segment_ids=False)
      assert registry.select("auto", unpacked).name == "cudnn"
    local = cudnn.Cudnn().unsupported_reason(cp(flaxattn.Local(64), strategy))
    assert "straddles the context shards' chunks" in local
    assert "no chunked mask" in cudnn.Cudnn().unsupported_reason(cp(flaxattn.Chunked(64), strategy))
    local_call = cp(flaxattn.Local(64), strategy)
    hopper = registry.get("mosaic_gpu").unsupported_reason(local_call) is None
    assert registry.select("fused", local_call).name == ("mosaic_gpu" if hopper else "pallas_gpu")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_plan_covers_each_visible_chunk_pair_once(n, load_balance, causal):
  """Over a device's ring steps, the pieces of `ring_plan` cover each (query chunk, key
  chunk) pair the mask shows exactly once, and pieces other than the own-token call only
  pairs the mask shows whole (so an unmasked call is exact)."""
  chunks = (lambda r: (r, 2 * n - 1 - r)) if load_balance else (lambda r: (r,))
  plan = cudnn_ring.ring_plan(causal, n, load_balance)
  assert plan.shape == (n, n)
  for r in range(n):
    mine, seen = chunks(r), []
    for step in range(n):
      theirs = chunks((r - step) % n)
      pairs = {cudnn_ring.OWN: [(a, b) for a in mine for b in mine if b <= a or not causal],
               cudnn_ring.ALL: [(a, b) for a in mine for b in theirs],
               cudnn_ring.FIRST_KEYS: [(a, theirs[0]) for a in mine],
               cudnn_ring.LAST_QUERIES: [(mine[-1], b) for b in theirs],
               cudnn_ring.NOTHING: []}[plan[step, r]]
      assert (plan[step, r] == cudnn_ring.OWN) == (step == 0)
      if step and causal:
        assert all(b < a for a, b in pairs), (r, step, pairs)
      seen += pairs
    want = [(a, b) for a in mine for b in range(len(mine) * n) if b <= a or not causal]
    assert sorted(seen) == sorted(want), (r, seen)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_cases_on_cudnn_cover_both_strategies(n):
  """What `test_ring_steps_on_cudnn_match_reference` runs on n devices: exact on packings
  crossing chunk and shard edges, and with the blockwise fallbacks poisoned, so every step
  of those cases ran cuDNN (causal own tokens, unmasked halves; GQA; with and without load
  balancing)."""
  cases = cudnn_ring_check.cases(n)
  only_cudnn = sum(name.startswith("only-cudnn") for name, _, _ in cases)
  assert (len(cases), only_cudnn) == {2: (9, 6), 4: (7, 6), 8: (2, 2)}[n], cases
  assert {name.split("-")[-5] for name, _, _ in cases} == {"ring", "all_gather"}, cases


# Each case compiles a ring of cuDNN steps and its reference (seconds to tens of seconds):
# the quick tier keeps the cheapest case of each strategy.
QUICK_RING_CASES = {"2-only-cudnn-ring-causal-lb-default-hkv2",
                    "2-only-cudnn-all_gather-causal-nolb-default-hkv1"}


@pytest.mark.parametrize("n,only_cudnn,args", [
    pytest.param(n, only, args, id=f"{n}-{name}",
                 marks=[pytest.mark.slow] * (f"{n}-{name}" not in QUICK_RING_CASES))
    for n in (2, 4, 8) for name, only, args in cudnn_ring_check.cases(n)])
def test_ring_steps_on_cudnn_match_reference(fake_cudnn, monkeypatch, n, only_cudnn, args):
  """cuDNN (the CPU model) as the ring's kernel, and per gathered shard under all_gather, on
  n of the simulated devices: loss (out and lse) and gradients against the reference."""
  if only_cudnn:
    cudnn_ring_check.poison(monkeypatch)
  assert max(cudnn_ring_check.run(n, *args)) < 2e-2


def test_mask_band():
  assert cudnn.mask_band(flaxattn.Full()) == (False, None)
  assert cudnn.mask_band(flaxattn.Causal()) == (True, None)
  assert cudnn.mask_band(flaxattn.Local(9) & flaxattn.Full()) == (True, 9)
  assert cudnn.mask_band(flaxattn.Local(9) & flaxattn.Causal() & flaxattn.Local(4)) == (True, 4)
  with pytest.raises(ValueError, match="no chunked mask"):
    cudnn.mask_band(flaxattn.Chunked(4) & flaxattn.Causal())
  # A causal window in Window's terms is Local's; others have no cuDNN mask.
  assert cudnn.mask_band(flaxattn.Window(8, 0)) == (True, 9)
  assert cudnn.mask_band(flaxattn.Window(3, 5) & flaxattn.Causal()) == (True, 4)
  for mask in (flaxattn.Window(3, 5), flaxattn.Window(0, 7), flaxattn.Window(4, 0, offset=-1),
               flaxattn.Window(None, 0, offset=2)):
    with pytest.raises(ValueError, match=r"cuDNN's masks are causal.*pallas_gpu and blockwise"):
      cudnn.mask_band(mask)
  x = jnp.zeros((1, 16, 2, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="chunked"):
    cudnn.cudnn_attention(x, x, x, Layout(), mask=flaxattn.Chunked(4), scale=1.0, return_lse=False)


@pytest.fixture
def reference_fallback(monkeypatch):
  """Swaps the blockwise kernel, which packed calls compile as their fallback branch, for
  reference passes: still exact, much faster to compile. For tests that assert the cuDNN
  branch runs."""
  def forward(q, k, v, layout, *, mask, scale, soft_cap=None):
    assert soft_cap is None  # cuDNN has none
    return reference_attention(q, k, v, layout, mask=mask, scale=scale, return_lse=True)

  def backward(q, k, v, layout, out, lse, dout, dlse, *, mask, scale, soft_cap=None):
    _, vjp = jax.vjp(lambda q, k, v: forward(q, k, v, layout, mask=mask, scale=scale), q, k, v)
    return (*vjp((dout, dlse)), [])  # no score mod: none of its operands' gradients

  monkeypatch.setattr(blockwise, "forward", forward)
  monkeypatch.setattr(blockwise, "backward", backward)


def _kernel(max_segments):
  return functools.partial(cudnn.cudnn_attention, max_segments=max_segments)


def _takes_cudnn_branch(layout, mask, q, k, max_segments):
  """The run-time check passes: cuDNN's result is used, not the blockwise fallback's."""
  # The layout is closed over: kept whole, its shared arrays stay shared (self attention).
  return bool(jax.jit(lambda: cudnn.served_by_cudnn(q, k, layout, mask=mask,
                                                    max_segments=max_segments))())


def _doc_positions(seg):
  """Index of each token inside its run of equal ids."""
  pos = np.zeros_like(seg)
  for i in range(1, seg.shape[1]):
    pos[:, i] = np.where(seg[:, i] == seg[:, i - 1], pos[:, i - 1] + 1, 0)
  return pos


B, T, D = 2, 64, 16


def test_fake_packed_matches_reference(fake_cudnn, reference_fallback):
  """Packed rows with a padding tail and documents of 1+ tokens, GQA (one cuDNN call per
  query-head group on a JAX that scales key offsets by the query heads): forward, lse and
  gradients (with a cotangent on the lse)."""
  q, k, v = qkv(1, B, T, T, 4, 2, D, jnp.bfloat16)
  layout = as_layout(*random_packing(1, B, T, pad_tail=5))
  assert _takes_cudnn_branch(layout, flaxattn.Causal(), q, k, 8)
  compare(_kernel(8), layout, flaxattn.Causal(), q, k, v, jnp.bfloat16)


def test_fake_cross_attention_one_sided_documents(fake_cudnn, reference_fallback):
  """Cross attention, T != S: queries of documents without keys get zeros / -inf / zero
  gradients, keys of documents without queries zero gradients; positions restart at 0."""
  q_seg = np.array([[1] * 10 + [2] * 14 + [3] * 8 + [0] * 8, [4] * 30 + [5] * 10], np.int32)
  kv_seg = np.array([[2] * 20 + [1] * 12 + [6] * 16, [5] * 6 + [7] * 12 + [4] * 26 + [0] * 4],
                    np.int32)
  layout = as_layout(q_seg, _doc_positions(q_seg), kv_seg=kv_seg, kv_pos=_doc_positions(kv_seg))
  q, k, v = qkv(8, 2, 40, 48, 2, 2, D, jnp.bfloat16)
  mask = flaxattn.Causal() & flaxattn.Local(9)
  assert _takes_cudnn_branch(layout, mask, q, k, 8)
  # compare also checks that exactly the documents 3 (no keys) and 0 (padding) get lse -inf;
  # their outputs are selected to zero by the same per-token mask.
  compare(_kernel(8), layout, mask, q, k, v, jnp.bfloat16)


def test_fake_dense_rows_without_lse_cotangent(fake_cudnn):
  """No segment ids: the plain BTNH call, top-left causal (and window) when T != S; with
  return_lse=False the lse cotangent is a symbolic zero and its cuDNN call is skipped."""
  q, k, v = qkv(7, B, 40, T, 4, 2, D, jnp.bfloat16)
  mask = flaxattn.Causal() & flaxattn.Local(20)
  def loss(kernel):
    return lambda q, k, v: jnp.sum(kernel(
        q, k, v, Layout(), mask=mask, scale=0.3, return_lse=False).astype(jnp.float32) ** 2)
  jaxpr = str(jax.make_jaxpr(jax.grad(loss(cudnn.cudnn_attention)))(q, k, v))
  assert jaxpr.count("dot_product_attention_bwd_wrapper") == 1  # no second (lse) call
  def grads(kernel):
    return jax.jit(jax.grad(loss(kernel), (0, 1, 2)))(q, k, v)
  for name, got, want in zip("qkv", grads(cudnn.cudnn_attention), grads(reference_attention),
                             strict=True):
    scale = max(1.0, float(jnp.abs(want.astype(jnp.float32)).max()))
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale,
                               np.asarray(want, np.float32) / scale, err_msg=f"d{name}",
                               **TOL[jnp.bfloat16])


@jax.jit
def _ring_style(q, k, v, dout, dlse):
  mask, scale, half = flaxattn.Full(), 0.3, k.shape[1] // 2
  blocks = [(k[:, :half], v[:, :half]), (k[:, half:], v[:, half:])]
  parts = [cudnn.forward(q, kb, vb, Layout(), mask=mask, scale=scale) for kb, vb in blocks]
  lse = jnp.logaddexp(parts[0][1], parts[1][1])
  out = sum(jnp.exp(lse_b - lse)[..., None] * o.astype(jnp.float32) for o, lse_b in parts)
  grads = [cudnn.backward(q, kb, vb, Layout(), out.astype(q.dtype), lse, dout, dlse,
                                mask=mask, scale=scale) for kb, vb in blocks]
  dq = sum(g[0].astype(jnp.float32) for g in grads)
  dk = jnp.concatenate([g[1] for g in grads], axis=1)
  dv = jnp.concatenate([g[2] for g in grads], axis=1)

  def f(q, k, v):
    o, ref_lse = reference_attention(q, k, v, Layout(), mask=mask, scale=scale, return_lse=True)
    return jnp.sum(o.astype(jnp.float32) * dout.astype(jnp.float32)) + jnp.sum(ref_lse * dlse)

  return (dq, dk, dv), jax.grad(f, (0, 1, 2))(q, k, v)


def test_fake_ring_style_passes(fake_cudnn):
  """cudnn.forward on two key blocks merged by lse, then cudnn.backward per block with the
  merged output and lse (and an lse cotangent), equals attention over all keys."""
  q, k, v = qkv(10, B, T, T, 4, 2, D, jnp.bfloat16)
  dout, dlse = normal(q.shape, 11, jnp.bfloat16), normal(q.shape[:3], 12)

  got, want = _ring_style(q, k, v, dout, dlse)
  for name, g, w in zip("qkv", got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               err_msg=f"d{name}", atol=6e-2, rtol=6e-2)


def test_exactness_check_and_fallback(fake_cudnn):
  """Layouts cuDNN would get wrong fail the run-time check, and then still match (blockwise)."""
  mask = flaxattn.Causal()
  q, k, v = qkv(13, 1, T, T, 2, 2, D, jnp.bfloat16)

  many = jnp.asarray(np.repeat(np.arange(1, 17, dtype=np.int32), 4)[None])  # 16 documents
  pos = jnp.asarray(np.tile(np.arange(4, dtype=np.int32), 16)[None])
  repeated = jnp.asarray(np.array([[1] * 20 + [2] * 20 + [1] * 24], np.int32))
  shifted = pos + 3 * (many % 2)  # positions step by one but do not restart at 0: still exact
  halves = jnp.asarray(np.array([[1] * 32 + [2] * 32], np.int32))
  shorter = jnp.asarray(np.array([[1] * 32 + [2] * 16 + [0] * 16], np.int32))
  later = jnp.asarray(np.array([[1] * 16 + [2] * 48], np.int32))
  cases = [  # layout, max_segments, served by cuDNN
      (Layout(many, many, pos, pos), 16, True),
      (Layout(many, many, shifted, shifted), 16, True),
      (Layout(many, many, pos, pos), 8, False),  # more documents than slots
      (Layout(many, many, pos * 2, pos * 2), 16, False),  # positions step by two
      (Layout(repeated, repeated), 16, False),  # id 1 labels two runs
      (Layout(halves, shorter), 16, True),  # cross, default positions, same starts
      (Layout(halves, later), 16, False),  # cross, document 2 starts at 32 vs 16
  ]
  # The layouts are closed over: kept whole, their shared arrays stay shared.
  served = jax.jit(lambda: [cudnn.served_by_cudnn(q, k, layout, mask=mask, max_segments=m)
                            for layout, m, _ in cases])()
  assert [bool(x) for x in served] == [want for *_, want in cases]
  got = jax.jit(lambda q, k, v: _kernel(8)(q, k, v, Layout(many, many, pos, pos), mask=mask,
                                           scale=0.3, return_lse=False))(q, k, v)
  want = reference_attention(q, k, v, Layout(many, many, pos, pos), mask=mask, scale=0.3,
                             return_lse=False)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             **TOL[jnp.bfloat16])


# ---------------------------------------------------------------------------------------
# On a GPU: real cuDNN against the float32 reference


def _served(q, k, mask, packed):
  """Skips (with cuDNN's reason) what this GPU cannot run, e.g. THD before Hopper."""
  # The THD budget is a choice, not a capability: asked without it.
  reason = cudnn.Cudnn(thd_budget=1 << 60).unsupported_reason(registry.Call(
      platform="gpu", q_shape=q.shape, kv_shape=k.shape, dtype=str(q.dtype), mask=mask,
      has_segment_ids=packed, has_positions=packed, return_lse=True))
  if reason is not None:
    pytest.skip(reason)


@needs_gpu
@pytest.mark.parametrize("mask", [flaxattn.Causal(), flaxattn.Local(100), flaxattn.Full()], ids=str)
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_matches_reference(mask, groups, packed):
  """Random packed rows (up to 9 documents, a padding tail) or plain rows, MHA and GQA."""
  b, t, hkv, d = 2, 512, 2, 128
  q, k, v = qkv(20 + groups, b, t, t, hkv * groups, hkv, d, jnp.bfloat16)
  _served(q, k, mask, packed)
  layout = as_layout(*random_packing(21, b, t, max_docs=9, pad_tail=37)) if packed else Layout()
  if packed:
    assert _takes_cudnn_branch(layout, mask, q, k, None)
  compare(cudnn.cudnn_attention, layout, mask, q, k, v, jnp.bfloat16)


@needs_gpu
def test_gpu_cross_attention_one_sided_documents():
  """Document 2 has no keys, 3 no queries; positions restart at 0 in each document."""
  q_seg = np.array([[1] * 100 + [2] * 60 + [0] * 96] * 2, np.int32)
  kv_seg = np.array([[3] * 64 + [1] * 128 + [0] * 128] * 2, np.int32)
  q, k, v = qkv(30, 2, 256, 320, 8, 2, 64, jnp.bfloat16)
  layout = as_layout(q_seg, _doc_positions(q_seg), kv_seg=kv_seg, kv_pos=_doc_positions(kv_seg))
  for mask in (flaxattn.Causal(), flaxattn.Full()):
    _served(q, k, mask, True)
    assert _takes_cudnn_branch(layout, mask, q, k, None)
    compare(cudnn.cudnn_attention, layout, mask, q, k, v, jnp.bfloat16)
  out, lse = cudnn.cudnn_attention(q, k, v, layout, mask=flaxattn.Full(), scale=0.3,
                                   return_lse=True)
  np.testing.assert_array_equal(np.asarray(out[:, 100:], np.float32), 0.0)
  assert np.all(np.isneginf(lse[:, 100:])) and np.all(np.isfinite(lse[:, :100]))


@needs_gpu
def test_gpu_float16_dense_cross_lengths():
  q, k, v = qkv(31, 2, 200, 328, 4, 4, 64, jnp.float16)
  _served(q, k, flaxattn.Causal(), False)
  compare(cudnn.cudnn_attention, Layout(), flaxattn.Causal(), q, k, v, jnp.bfloat16)


@needs_gpu
def test_gpu_fused_backend_reaches_cudnn():
  """flaxattn.attention(backend="fused") on a GPU runs cuDNN (its compiled HLO calls it) on
  one document, a Cudnn kernel with room for THD's temporaries does on packed rows (fused
  takes the next kernel there: THD's temporaries are over the default budget), as does
  cudnn_attention itself, and all match the reference."""
  q, k, v = qkv(32, 1, 256, 256, 4, 2, 128, jnp.bfloat16)
  seg = jnp.asarray(random_packing(33, 1, 256, pad_tail=5)[0])
  for backend, kwargs in (("fused", {}),
                          (cudnn.Cudnn(thd_budget=1 << 40), dict(segment_ids=seg))):
    _served(q, k, flaxattn.Causal(), bool(kwargs))
    def loss(backend, kwargs=kwargs):
      return lambda q: jnp.sum(flaxattn.attention(
          q, k, v, backend=backend, **kwargs).astype(jnp.float32) ** 2)
    fused = jax.jit(jax.grad(loss(backend)))
    assert "__cudnn$fmha" in fused.lower(q).compile().as_text(), kwargs
    np.testing.assert_allclose(np.asarray(fused(q), np.float32),
                               np.asarray(jax.grad(loss("reference"))(q), np.float32),
                               **TOL[jnp.bfloat16])
  direct = jax.jit(lambda q: cudnn.cudnn_attention(
      q, k, v, as_layout(seg), mask=flaxattn.Causal(), scale=0.1, return_lse=False))
  assert "__cudnn$fmha" in direct.lower(q).compile().as_text()
