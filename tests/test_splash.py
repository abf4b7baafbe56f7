"""The splash kernel (Pallas interpret mode on CPU) against the reference, and its decline rules.

Interpret mode is slow: T=256 with 128-blocks (a 2x2 block grid, so documents cross block
edges), D=64, GQA 4 query heads on 2 KV heads.
"""

import tracemalloc
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jax.sharding import PartitionSpec as P

import flaxattn
from flaxattn import blocks, splash
from flaxattn.layout import Layout
from flaxattn.masks import Band
from helpers import as_layout, compare, mesh, qkv, random_packing

B, T, H, HKV, D = 2, 256, 4, 2, 64


_splash_128 = splash.Splash(block_q=128, block_kv=128)


def _packed(seed, pad_tail=0):
  """Segment ids and positions `[B, T]` (numpy) and their Layout."""
  seg, pos = random_packing(seed, B, T, max_docs=5, pad_tail=pad_tail)
  return seg, pos, as_layout(seg, pos)


@pytest.mark.parametrize("mask", [flaxattn.Causal(), flaxattn.Local(40), flaxattn.Full(),
                                  flaxattn.Chunked(64), flaxattn.Chunked(96) & flaxattn.Local(50)],
                         ids=str)
def test_default_positions_match_reference(mask):
  q, k, v = qkv(1, B, T, T, H, HKV, D, jnp.float32)
  compare(_splash_128, Layout(), mask, q, k, v, jnp.float32)


@pytest.mark.parametrize("mask", [flaxattn.Causal(), flaxattn.Causal() & flaxattn.Local(30),
                                  flaxattn.Full()], ids=str)
def test_packed_documents_match_reference(mask):
  """Documents (positions restarting at 0) crossing block edges, and a padding tail."""
  q, k, v = qkv(2, B, T, T, H, HKV, D, jnp.float32)
  _, _, layout = _packed(2, pad_tail=20)
  compare(_splash_128, layout, mask, q, k, v, jnp.float32)


WINDOWS = [flaxattn.Window(20, 10), flaxattn.Window(0, 40), flaxattn.Window(30, 0, offset=-5)]


def _window_oracle(q, k, v, seg, pos, window, scale):
  """Out and lse of `window` written out from its definition: a query at position p sees the
  keys of its non-zero segment at p + offset - left <= k <= p + offset + right."""
  d = pos[:, None, :].astype(np.int64) - pos[:, :, None]  # k - p, [B, T, S]
  lo = -np.inf if window.left is None else window.offset - window.left
  hi = np.inf if window.right is None else window.offset + window.right
  seen = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0) & (d >= lo) & (d <= hi)
  g = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, g, axis=2) for x in (k, v))
  scores = jnp.where(seen[:, None], jnp.einsum("bthd,bshd->bhts", q, k) * scale, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)
  p = jnp.exp(scores - jnp.where(jnp.isinf(lse), 0, lse)[..., None])
  return jnp.einsum("bhts,bshd->bthd", p, v), lse.transpose(0, 2, 1)


@pytest.mark.parametrize("kernel", [flaxattn.reference.Reference(),
                                    flaxattn.blockwise.Blockwise(block_q=64, block_kv=64),
                                    _splash_128], ids=lambda k: k.name)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_windows_match_a_dense_oracle(window, kernel):
  """Two-sided, right-only and shifted windows over packed documents crossing block edges:
  out and lse as written out from the definition; splash's gradients as the reference's
  (blockwise's: tests/test_peer_splash_cases.py)."""
  q, k, v = qkv(7, 1, T, T, H, HKV, D, jnp.float32)
  seg, pos = random_packing(7, 1, T, max_docs=4, pad_tail=10)
  layout = as_layout(seg, pos)
  out, lse = kernel(q, k, v, layout, mask=window, scale=0.3, return_lse=True)
  want_out, want_lse = _window_oracle(q, k, v, seg, pos, window, 0.3)
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
  np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse),
                             np.where(np.isinf(want_lse), 0, want_lse), atol=2e-5, rtol=2e-5)
  if kernel.name == "splash":
    compare(kernel, layout, window, q, k, v, jnp.float32)


def test_explain_names_splash_for_windows_on_tpu():
  """Two-sided, right-only and shifted windows on TPU: splash, not its blockwise fallback."""
  q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 4096, 2, 128), jnp.bfloat16)
  seg = np.repeat(np.arange(1, 5, dtype=np.int32), 1024)[None]
  for window in (*WINDOWS, flaxattn.Window(256, 256), flaxattn.Window(None, 0, offset=-1)):
    with flaxattn.lowering_for("tpu"):
      text = flaxattn.explain(q, kv, kv, mask=window, segment_ids=seg, print_fn=None)
    assert "backend='auto' -> splash (" in text and "  splash: accepts" in text, text
    assert text.endswith("tpu: splash"), text


def _prefix_lm(prefix_len):
  """Bidirectional over each row's first `prefix_len[b]` tokens, causal after them."""
  return flaxattn.MaskMod(lambda b, h, q, k, n: (k <= q) | (k < n[b]), prefix_len)


def _documents(doc_ids):
  """Causal inside documents given as an operand `[B, T]` (no segment ids)."""
  return flaxattn.MaskMod(lambda b, h, q, k, d: (d[b, q] == d[b, k]) & (k <= q), doc_ids)


def _window_per_head(windows):
  return flaxattn.MaskMod(lambda b, h, q, k, w: (k <= q) & (k > q - w[h]), windows)


# (mask, batch rows): one row where the mask does not read the row (a row of its own is
# one more kernel call per row in interpret mode).
MASK_MODS = {
    "prefix_lm": (lambda: _prefix_lm(jnp.array([40, 170], jnp.int32)), 2),
    "documents": (lambda: _documents(jnp.asarray(
        np.repeat(np.arange(5), [30, 70, 60, 90, 6])[None], jnp.int32)), 1),
    "local_or_prefix": (lambda: flaxattn.Local(20) | flaxattn.MaskMod(
        lambda b, h, q, k, n: k < n[b], jnp.array([100], jnp.int32)), 1),
    "window_per_head": (lambda: _window_per_head(jnp.array([3, 40], jnp.int32)), 1),
}


@pytest.mark.parametrize("name", MASK_MODS)
def test_programmable_masks_run_on_splash_exactly(name):
  """MaskMods (per batch row, per head, documents as an operand, OR-ed with a window) over
  packed documents: splash's block map found on device, the masks of its partial blocks
  built there, within the default bound (so the kernel, not its fallback, runs): out, lse
  and gradients as the reference's."""
  make, b = MASK_MODS[name]
  mask = make()
  q, k, v = qkv(14, b, T, T, 2, 1, 32, jnp.float32)
  seg, pos = random_packing(14, b, T, max_docs=5, pad_tail=6)
  layout = as_layout(seg, pos)
  kernel = splash.Splash(block_q=128, block_kv=128)
  held = splash.BlockMap.of(mask, layout, q.shape, 1, 128, 128).partial_counts()
  assert 0 < int(held.max()) <= kernel._per_row(T, 128, 128) * (2 if mask.per_head else 1)
  compare(kernel, layout, mask, q, k, v, jnp.float32)


def test_programmable_mask_past_the_bound_runs_blockwise():
  """More PARTIAL blocks than `partial_blocks` holds: the run-time check sends the call to
  the blockwise kernel, still exact."""
  mask = _prefix_lm(jnp.array([40], jnp.int32))
  q, k, v = qkv(15, 1, T, T, 2, 1, 32, jnp.float32)
  seg, pos = random_packing(15, 1, T, max_docs=5)
  layout = as_layout(seg, pos)
  assert int(splash.BlockMap.of(mask, layout, q.shape, 1, 128, 128).partial_counts().max()) > 1
  compare(splash.Splash(block_q=128, block_kv=128, partial_blocks=1), layout, mask, q, k, v,
          jnp.float32)


def test_batch_and_head_dependent_masks_under_a_mesh():
  """Splash runs per (batch, head) shard of a data x tensor mesh: each shard's block map
  and masks see the global batch row and head."""
  mask = flaxattn.MaskMod(lambda b, h, q, k, n, w: ((k <= q) & (k > q - w[h])) | (k < n[b]),
                          jnp.array([40, 170], jnp.int32), jnp.array([3, 9, 30, 70], jnp.int32))
  q, k, v = qkv(16, 2, T, T, 4, 2, 32, jnp.float32)
  seg, pos, _ = _packed(16)

  def attend(backend):
    return jax.jit(lambda q, k, v: flaxattn.attention(q, k, v, mask=mask, segment_ids=seg,
                                                      positions=pos, backend=backend))
  want = attend("reference")(q, k, v)
  with jax.set_mesh(mesh({"data": 2, "tensor": 2})):
    got = attend(splash.Splash(block_q=128, block_kv=128))(q, k, v)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_explain_on_tpu_for_mask_and_score_mods():
  """A MaskMod runs on splash through its block map; a ScoreMod on blockwise, and splash
  says why; under context parallelism a MaskMod is blockwise's."""
  q = jax.ShapeDtypeStruct((2, 4096, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 4096, 2, 128), jnp.bfloat16)
  prefix = _prefix_lm(jnp.array([300, 1000], jnp.int32))
  alibi = flaxattn.ScoreMod(lambda s, b, h, q, k, slopes: s - slopes[h] * jnp.abs(q - k),
                            jnp.ones(8))
  with flaxattn.lowering_for("tpu"):
    text = flaxattn.explain(q, kv, kv, mask=prefix, print_fn=None)
    assert "tpu: splash (MaskMod(" in text and "has no band: its block map is found on device" \
           in text and "at most 32 per batch row (512 x 512 each)" in text, text
    text = flaxattn.explain(q, kv, kv, score_mod=alibi, print_fn=None)
    assert "tpu: blockwise (" in text and "splash declines: splash (JAX's Pallas TPU kernel)" \
           " changes scores only by a logit soft cap" in text, text
    call = flaxattn.registry.Call(platform="tpu", q_shape=q.shape, kv_shape=kv.shape,
                                  dtype="bfloat16", mask=prefix, has_segment_ids=False,
                                  has_positions=False, return_lse=False, cp_size=4,
                                  cp_strategy="ulysses")
    assert "not per context shard; use 'blockwise'" in splash.Splash().unsupported_reason(call)


def test_public_entry_point_bfloat16_default_blocks():
  q, k, v = qkv(3, 1, T, T, H, HKV, D, jnp.bfloat16)
  seg, pos, _ = _packed(3)
  got = flaxattn.attention(q, k, v, segment_ids=seg[:1], positions=pos[:1], backend="splash")
  want = flaxattn.attention(q, k, v, segment_ids=seg[:1], positions=pos[:1], backend="reference")
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=3e-2, rtol=3e-2)


def test_padding_rows_are_zero_with_finite_gradients():
  q, k, v = qkv(4, 1, T, T, 2, 1, D, jnp.float32)
  seg = np.ones((1, T), np.int32)
  seg[0, 200:] = 0

  def f(q, k, v):
    out, lse = flaxattn.attention(q, k, v, segment_ids=seg, backend="splash", return_lse=True)
    return jnp.sum(out ** 2), (out, lse)

  grads, (out, lse) = jax.grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  np.testing.assert_array_equal(out[0, 200:], 0.0)
  assert np.all(np.isneginf(lse[0, 200:])) and np.all(np.isfinite(lse[0, :200]))
  for g in grads:
    assert np.all(np.isfinite(g))
  np.testing.assert_array_equal(grads[0][0, 200:], 0.0)
  np.testing.assert_array_equal(grads[1][0, 200:], 0.0)  # padding keys are seen by no one


def _declines(match, q, k, v, **kwargs):
  with pytest.raises(ValueError, match=match):
    flaxattn.attention(q, k, v, backend="splash", **kwargs)


def test_decline_reasons():
  q, k, v = qkv(5, 1, T, T, 2, 2, D, jnp.float32)
  seg, pos, _ = _packed(5)
  seg, pos = seg[:1], pos[:1]
  _declines("multiple of 128, got 200", q[:, :200], k[:, :200], v[:, :200])
  _declines("query length 256 != key length 128", q, k[:, :128], v[:, :128], mask=flaxattn.Full())
  _declines("changes scores only by a logit soft cap", q, k, v,
            score_mod=flaxattn.ScoreMod(lambda s, b, h, q, k: s * 2))
  # Full ignores positions, so explicit positions are fine without segment ids.
  flaxattn.attention(q, k, v, mask=flaxattn.Full(), positions=pos, backend="splash")


def test_auto_on_cpu_prefers_blockwise():
  q, k, v = qkv(6, 1, T, T, 2, 2, D, jnp.float32)
  text = flaxattn.explain(q, k, v, print_fn=None)
  assert "splash: accepts" in text and "backend='auto' -> blockwise" in text


def test_long_causal_kernel_builds_without_dense_mask(monkeypatch):
  """T=32768: no NumpyMask, and host memory far below one [T, T] bool array (1 GiB)."""
  def no_numpy_mask(*args, **kwargs):
    raise AssertionError("splash built a NumpyMask of the whole sequence")

  monkeypatch.setattr(sm.NumpyMask, "__post_init__", no_numpy_mask)
  t = 32768
  tracemalloc.start()
  try:
    # uncached
    splash._kernel.__wrapped__(Band(hi=0), blocks.TokenOrder(), t, t, 4, 512, 512, True)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 64 * 2**20, f"peak host allocation {peak / 2**20:.0f} MiB"


def _ring_blocks(mask, load_balance, n=4, t=4096):
  """Blocks each device computes over the ring's steps (from the kernels' MaskInfo), and the
  number of steps with nothing to compute anywhere (no kernel at all)."""
  step = splash.Splash().ring_step(
      strategy="ring", axis="context", shards=n, load_balance=load_balance, mask=mask,
      scale=1.0, q_shape=(1, t, 2, 128), kv_shape=(1, t, 2, 128), layout=Layout())
  assert step.exact is None  # default positions: exact for any data
  per_device = np.zeros(n, int)
  for kernel in step.kernels:
    if kernel is not None:
      fwd, _ = kernel.whole()
      per_device += (fwd.block_mask[0] > 0).reshape(n, -1).sum(1)
  return per_device, sum(k is None for k in step.kernels)


def test_ring_kernels_balance_causal_work_and_drop_empty_steps():
  balanced, _ = _ring_blocks(flaxattn.Causal(), True)
  contiguous, _ = _ring_blocks(flaxattn.Causal(), False)
  # 1024 tokens per device, 512-blocks: 3 blocks on the diagonal step, 2 (half) on the others.
  np.testing.assert_array_equal(balanced, [9, 9, 9, 9])
  np.testing.assert_array_equal(contiguous, [3, 7, 11, 15])
  # Chunks of 512 are the load-balanced chunks: only the diagonal step has a kernel, and
  # on it each device's two chunks see only themselves.
  per_device, empty_steps = _ring_blocks(flaxattn.Chunked(512), True)
  assert empty_steps == 3 and per_device.tolist() == [2, 2, 2, 2]


@pytest.mark.parametrize("n", [4, 16, 64])
def test_ring_kernels_hold_each_distinct_devices_metadata_once(n):
  """A balanced causal ring step's devices see the visiting shard either before or after
  their own (step 0: their own): at most 2 distinct devices' rows per step at any cp, where
  splash's own layout holds n. Local(256) likewise."""
  t = n * 512
  for mask in (flaxattn.Causal(), flaxattn.Local(256)):
    step = splash.Splash(block_q=128, block_kv=128).ring_step(
        strategy="ring", axis="context", shards=n, load_balance=True, mask=mask, scale=1.0,
        q_shape=(1, t, 2, 128), kv_shape=(1, t, 2, 128), layout=Layout())
    kernels = [k for k in step.kernels if k is not None]
    assert kernels and all(isinstance(k, splash.ShardedKernel) for k in kernels)
    assert max(k.patterns for k in kernels) == 2, (mask, [k.patterns for k in kernels])
    held = sum(k.kernel.fwd_mask_info.block_mask.size for k in kernels)
    whole = sum(k.whole()[0].block_mask.size for k in kernels)
    assert held * n <= whole * 2


def test_block_sizes_from_head_dim_and_overridable():
  assert [splash.default_block(d) for d in (64, 128, 256)] == [512, 512, 256]
  assert splash.Splash().blocks(1536, 1536, 128) == (512, 512)
  assert splash.Splash(block_q=256).blocks(1536, 1536, 64) == (256, 512)
  with pytest.raises(ValueError,
                     match=r"Splash\(block_q=...\) expects a positive multiple of 128.*got 100"):
    splash.Splash(block_q=100)
  q, k, v = qkv(8, 1, T, T, H, HKV, D, jnp.float32)
  got = flaxattn.attention(q, k, v, backend=splash.Splash(block_q=128, block_kv=256))
  want = flaxattn.attention(q, k, v, backend="reference")
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_context_parallel_needs_128_tokens_per_device():
  call = flaxattn.registry.Call(platform="tpu", q_shape=(1, 512, 2, 64), kv_shape=(1, 512, 2, 64),
                                dtype="bfloat16", mask=flaxattn.Causal(), has_segment_ids=False,
                                has_positions=False, return_lse=False, cp_size=8)
  assert "per device (T / 8 context shards) that is a multiple of 128, got 64" in (
      splash.Splash().unsupported_reason(call))


def test_kernels_are_cached_across_traces():
  q, k, v = qkv(9, 1, T, T, H, HKV, D, jnp.float32)
  def attend(q, k, v):
    return flaxattn.attention(q, k, v, backend=splash.Splash(block_q=128))
  jax.jit(attend).lower(q, k, v)
  before = splash._kernel.cache_info()
  jax.jit(lambda q, k, v: attend(q, k, v) * 2).lower(q, k, v)  # a new trace, same kernel
  after = splash._kernel.cache_info()
  assert after.misses == before.misses and after.hits > before.hits


def _two_runs_of_one_id():
  """Segment id 1 on two separate runs, positions restarting per run (legal: one document
  to the mask, as the reference sees it, but not index-shifted)."""
  seg = np.array([[1] * 40 + [2] * 40 + [1] * 48], np.int32)
  pos = np.concatenate([np.arange(40), np.arange(40), np.arange(48)])[None].astype(np.int32)
  return seg, pos


@pytest.mark.parametrize("mask, layout", [
    (flaxattn.Causal(), "two_runs"), (flaxattn.Local(16), "two_runs"),
    (flaxattn.Local(16), "step_two"), (flaxattn.Chunked(32), "unaligned"),
    (flaxattn.Local(16), "no_segment_ids")], ids=str)
def test_positions_that_are_not_index_shifts_take_the_exact_path(mask, layout):
  """Layouts on which index masking differs from position masking (by up to 2.5 before the
  run-time check): the batch runs the blockwise kernel, forward and gradients."""
  q, k, v = qkv(11, 1, 128, 128, 2, 1, 16, jnp.float32)
  seg, pos = _two_runs_of_one_id()
  if layout == "step_two":
    seg, pos = np.ones_like(seg), (2 * np.arange(128, dtype=np.int32))[None]
  elif layout == "unaligned":  # documents of 50 and 78 tokens: the second starts mid-chunk
    seg = np.array([[1] * 50 + [2] * 78], np.int32)
    pos = np.concatenate([np.arange(50), np.arange(78)])[None].astype(np.int32)
  elif layout == "no_segment_ids":
    seg, pos = None, pos + 5
  lay = as_layout(seg, pos)
  index = jnp.arange(128, dtype=jnp.int32)[None]
  assert not bool(splash.index_check(mask, lay, index, index))
  compare(_splash_128, lay, mask, q, k, v, jnp.float32)


def test_index_check_passes_packed_pipelines_and_load_balanced_order():
  seg, pos, lay = _packed(12, pad_tail=9)
  index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  for mask in (flaxattn.Causal(), flaxattn.Local(30)):
    assert bool(splash.index_check(mask, lay, index, index))
  assert splash.index_check(flaxattn.Full(), lay, index, index) is None  # positions unread
  assert splash.index_check(flaxattn.Causal(), as_layout(seg), index, index) is None
  # Documents aligned to the chunk pass the chunked check, unaligned ones do not.
  aligned = jnp.asarray(np.repeat(np.arange(1, 5), 64)[None], jnp.int32)
  in_doc = jnp.asarray(np.tile(np.arange(64), 4)[None], jnp.int32)
  assert bool(splash.index_check(flaxattn.Chunked(32), Layout(aligned, aligned, in_doc, in_doc),
                                 index[:1], index[:1]))
  assert not bool(splash.index_check(flaxattn.Chunked(48), Layout(aligned, aligned, in_doc, in_doc),
                                     index[:1], index[:1]))
  # Load-balanced order: the kernel's index is the permuted original index.
  def lb(x):
    return flaxattn.load_balance(x, 4)
  assert bool(splash.index_check(flaxattn.Causal(), as_layout(lb(seg), lb(pos)), lb(index),
                                 lb(index)))
  assert not bool(splash.index_check(flaxattn.Causal(), as_layout(lb(seg), lb(pos)), index, index))


def test_explain_says_when_splash_checks_at_run_time():
  q = jax.ShapeDtypeStruct((1, T, 2, D), jnp.float32)
  seg, pos, _ = _packed(13)
  checked = flaxattn.explain(q, q, q, segment_ids=seg[:1], positions=pos[:1], backend="splash",
                             print_fn=None)
  assert "tpu: splash (index masks; positions checked per batch at run time" in checked
  plain = flaxattn.explain(q, q, q, segment_ids=seg[:1], backend="splash", print_fn=None)
  assert "tpu: splash (backward fused" in plain
  assert "index masks" not in plain


def _runs_dq_kernel(backend, q, k, v, layout) -> bool:
  """Whether the gradient of `backend`'s attention traces splash's dQ-only kernel."""
  def loss(q, k, v):
    out, lse = backend(q, k, v, layout, mask=flaxattn.Causal(), scale=0.3, return_lse=True)
    return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isinf(lse), 0, lse))
  return "splash_mqa_dq" in str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v))


@pytest.mark.parametrize("mask", [flaxattn.Causal(), flaxattn.Local(40), flaxattn.Chunked(96)],
                         ids=str)
def test_separate_dq_backward_matches_reference(mask):
  """Over its budget, the backward runs splash's dK/dV and dQ kernels: still exact."""
  over = splash.Splash(block_q=128, block_kv=128, fused_dq_budget=0)
  q, k, v = qkv(4, B, T, T, H, HKV, D, jnp.float32)
  _, _, layout = _packed(4, pad_tail=20)
  assert _runs_dq_kernel(over, q, k, v, layout)
  assert not _runs_dq_kernel(_splash_128, q, k, v, layout)  # 256 KiB of partials: fused
  compare(over, layout, mask, q, k, v, jnp.float32)


def test_fused_dq_budget_decides_by_the_partials_bytes():
  # [B, T, H, D] = [1, 32768, 16, 128] bf16 over 64 key blocks of 512: 8 GiB of partials.
  fused, why = splash.fused_backward((1, 32768, 16, 128), 32768, 2, 512, splash.FUSED_DQ_BUDGET)
  assert not fused and f"{8 << 30} bytes, over fused_dq_budget {256 << 20}" in why
  fused, why = splash.fused_backward((1, 4096, 16, 128), 4096, 2, 512, splash.FUSED_DQ_BUDGET)
  assert fused and f"take {128 << 20} bytes" in why
  assert splash.fused_backward((1, 32768, 16, 128), 32768, 2, 512, None)[0]
  assert not splash.fused_backward((1, 256, 1, 128), 256, 2, 128, 0)[0]
  with pytest.raises(ValueError, match=r"fused_dq_budget=.*got -1"):
    splash.Splash(fused_dq_budget=-1)
  q = jax.ShapeDtypeStruct((1, 32768, 16, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 32768, 8, 128), jnp.bfloat16)
  text = flaxattn.explain(q, kv, kv, backend="splash", print_fn=None)
  assert f"tpu: splash (backward separate dK/dV and dQ kernels: the fused backward's dq" \
         f" partials would take {8 << 30} bytes" in text


def _tpu_temporaries(backend, t: int) -> int:
  """Bytes of temporaries XLA plans for splash's forward and backward (causal, T=`t`, 16
  query and 8 KV heads of 128, bf16) compiled for one v5p chip from this host."""
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu")
  replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(topology.devices[:1], ("x",)), P())
  q = jax.ShapeDtypeStruct((1, t, 16, 128), jnp.bfloat16, sharding=replicated)
  kv = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16, sharding=replicated)
  def loss(q, k, v):
    out = cast(jax.Array, flaxattn.attention(q, k, v, backend=backend))
    return jnp.sum(out.astype(jnp.float32) ** 2)
  # The tests' "highest" float32 matmul precision would ask Mosaic for fp32 bf16 matmuls.
  with flaxattn.lowering_for("tpu"), jax.default_matmul_precision("default"):
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
  plan = compiled.memory_analysis()
  assert plan is not None
  return plan.temp_size_in_bytes


def test_backward_within_budget_compiled_for_tpu():
  """T=8192 on one v5p chip: the fused backward's dq partials alone are 512 MiB (16 key
  blocks of [16, 8192, 128] bf16); by the default budget the separate dQ kernel runs and
  the compiled temporaries stay under 192 MiB (100 MiB planned with libtpu 0.0.42)."""
  pytest.importorskip("libtpu", reason="needs libtpu (pip install 'jax[tpu]') to compile for"
                      " compile-only TPU devices")
  assert _tpu_temporaries(splash.Splash(), 8192) < 192 << 20
  assert _tpu_temporaries(splash.Splash(fused_dq_budget=None), 8192) > 512 << 20
