"""Every kernel against the dense reference: forward, log-sum-exp and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxattn
from flaxattn import registry
from flaxattn.blockwise import Blockwise, blockwise_attention
from flaxattn.layout import Layout
from flaxattn.pallas_gpu import PallasGpu
from flaxattn.splash import Splash
from helpers import TOL, as_layout, compare, grads_of, qkv, random_packing

MASKS = [flaxattn.Full(), flaxattn.Causal(), flaxattn.Local(7), flaxattn.Chunked(16),
         flaxattn.Causal() & flaxattn.Local(40)]


def _small_blocks(q, k, v, layout, *, mask, scale, return_lse):
  # Blocks of 16 queries x 32 keys so documents and T=100 cross many block edges.
  return blockwise_attention(q, k, v, layout, mask=mask, scale=scale, return_lse=return_lse,
                             block_q=16, block_kv=32)


# Each mask with and without packing; GQA ratios 1, 2, 4 cycle through the cases so every
# ratio meets packed and unpacked layouts without compiling all 30 combinations.
CASES = [(m, packed, (1, 2, 4)[(2 * i + packed) % 3])
         for i, m in enumerate(MASKS) for packed in (False, True)]


@pytest.mark.parametrize("mask,packed,groups", CASES, ids=lambda x: str(x))
def test_blockwise_matches_reference(mask, packed, groups):
  b, t, hkv, d = 2, 100, 2, 16
  q, k, v = qkv(groups, b, t, t, hkv * groups, hkv, d, jnp.float32)
  layout = as_layout(*random_packing(groups, b, t, max_docs=7, pad_tail=9)) if packed else Layout()
  compare(_small_blocks, layout, mask, q, k, v, jnp.float32)


@pytest.mark.parametrize("mask", [flaxattn.Causal(), flaxattn.Local(9), flaxattn.Chunked(8)],
                         ids=str)
def test_blockwise_bfloat16(mask):
  q, k, v = qkv(5, 2, 72, 72, 4, 2, 32, jnp.bfloat16)
  layout = as_layout(*random_packing(5, 2, 72, pad_tail=5))
  compare(_small_blocks, layout, mask, q, k, v, jnp.bfloat16)
  out = _small_blocks(q, k, v, layout, mask=mask, scale=0.3, return_lse=False)
  assert out.dtype == jnp.bfloat16


def test_cross_attention_different_lengths():
  """Queries and keys of different lengths, each with their own packing."""
  b, t, s = 2, 40, 90
  q, k, v = qkv(7, b, t, s, 4, 1, 16, jnp.float32)
  q_seg, q_pos = random_packing(7, b, t, max_docs=3, pad_tail=3)
  kv_seg, kv_pos = random_packing(8, b, s, max_docs=3, pad_tail=0)
  kv_pos = kv_pos * 0 + np.arange(s)  # keys indexed globally: a Full mask ignores them
  layout = as_layout(q_seg, q_pos, kv_seg=kv_seg, kv_pos=kv_pos)
  compare(_small_blocks, layout, flaxattn.Full(), q, k, v, jnp.float32)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_public_entry_point(backend):
  """flaxattn.attention routes to the kernel and matches jax.nn.dot_product_attention."""
  q, k, v = qkv(3, 2, 50, 50, 4, 2, 16, jnp.float32)
  got = flaxattn.attention(q, k, v, backend=backend)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  out, lse = flaxattn.attention(q, k, v, mask=flaxattn.Full(), backend=backend, return_lse=True)
  assert out.shape == q.shape and lse.shape == (2, 50, 4) and lse.dtype == jnp.float32


def test_public_packed_segments_default_kv():
  """kv_segment_ids / kv_positions default to the query ones for self attention."""
  q, k, v = qkv(4, 1, 64, 64, 2, 2, 8, jnp.float32)
  seg, pos = random_packing(4, 1, 64, pad_tail=4)
  got = flaxattn.attention(q, k, v, segment_ids=seg, positions=pos, backend="fused")
  want = flaxattn.attention(q, k, v, segment_ids=seg, positions=pos, kv_segment_ids=seg,
                            kv_positions=pos, backend="reference")
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  # The last document alone gives the same rows: nothing crosses a document boundary.
  rows = np.nonzero(seg[0] == seg.max())[0]
  alone = flaxattn.attention(q[:, rows], k[:, rows], v[:, rows], backend="fused")
  np.testing.assert_allclose(got[:, rows], alone, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_fully_masked_rows_are_zero_with_finite_gradients(backend):
  q, k, v = qkv(8, 1, 40, 40, 2, 2, 8, jnp.float32)
  seg = np.ones((1, 40), np.int32)
  seg[0, 30:] = 0  # padding queries see nothing
  pos = np.arange(40, dtype=np.int32)[None]
  kv_pos = pos + 5  # the first five queries are before every key: nothing causal to see

  def f(q, k, v):
    out, lse = flaxattn.attention(q, k, v, segment_ids=seg, positions=pos, kv_positions=kv_pos,
                                  backend=backend, return_lse=True)
    return jnp.sum(out ** 2), (out, lse)

  grads, (out, lse) = jax.grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  empty = np.r_[np.arange(5), np.arange(30, 40)]
  np.testing.assert_array_equal(out[0, empty], 0.0)
  assert np.all(np.isneginf(lse[0, empty]))
  for g in grads:
    assert np.all(np.isfinite(g))
  np.testing.assert_array_equal(grads[0][0, empty], 0.0)


def test_block_schedule_skips_other_documents():
  """Packed documents aligned to blocks: only diagonal blocks are visited."""
  from flaxattn.blocks import EMPTY, FULL, block_schedule
  seg = np.repeat(np.arange(1, 5, dtype=np.int32), 64)[None]
  pos = np.tile(np.arange(64, dtype=np.int32), 4)[None]
  kinds = block_schedule(np, flaxattn.Full(), seg, seg, pos, pos, 32, 32)
  live = kinds[0] != EMPTY
  assert live.sum() == 4 * 4  # 4 documents x (2 x 2) blocks each
  assert np.array_equal(live, np.kron(np.eye(4, dtype=bool), np.ones((2, 2), bool)))
  causal = block_schedule(np, flaxattn.Causal(), seg, seg, pos, pos, 32, 32)[0]
  # per document: 2 diagonal blocks and 1 full one
  assert (causal != EMPTY).sum() == 4 * 3 and (causal == FULL).sum() == 4


def test_fused_memory_is_linear_in_t():
  """Compiled temp memory of forward+backward grows ~linearly, far below a [T, T] buffer."""
  def temp(t):
    x = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
    f = jax.grad(lambda q, k, v: flaxattn.attention(q, k, v, backend="fused").sum(), (0, 1, 2))
    return jax.jit(f).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

  small, large = temp(2048), temp(8192)
  assert large <= 5 * small, (small, large)
  assert large < 8192 * 8192 * 4 / 4, large  # a quarter of one [T, T] float32 score matrix


def test_program_size_does_not_grow_with_the_sequence():
  """The default layout's block schedule is computed in the program, not embedded in it: a
  causal forward and backward at T = 131072 lowers to a program the size of the one at
  8192 (with a schedule built at trace time the program text grew by 4.7 MiB from one to
  the other)."""
  def size(t):
    q = jax.ShapeDtypeStruct((1, t, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.bfloat16)
    def loss(q, k, v):
      return flaxattn.attention(q, k, v, mask=flaxattn.Causal(), backend="blockwise").sum()
    return len(jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).as_text())
  small, large = size(8192), size(131072)
  assert abs(large - small) < 2048 and large < 2**20, (small, large)


def _long_call(platform: str, dtype: str = "bfloat16", t: int = 8192, q_len: int | None = None):
  return registry.Call(platform=platform, q_shape=(1, q_len or t, 8, 128),
                       kv_shape=(1, t, 8, 128), dtype=dtype, mask=flaxattn.Causal(),
                       has_segment_ids=False, has_positions=False, return_lse=False)


# What each alias picks for a long training call, per platform. cuDNN takes bfloat16 on a
# GPU; in float32 it declines and pallas_gpu follows. A Pallas kernel in interpret mode
# off its own platform is for tests: no alias picks it there.
ALIAS_PICKS = [
    ("cpu", "fused", "bfloat16", "blockwise"), ("cpu", "auto", "bfloat16", "blockwise"),
    ("tpu", "fused", "bfloat16", "blockwise"), ("tpu", "auto", "bfloat16", "splash"),
    ("gpu", "fused", "bfloat16", "cudnn"), ("gpu", "auto", "bfloat16", "cudnn"),
    ("gpu", "fused", "float32", "pallas_gpu"), ("gpu", "auto", "float32", "pallas_gpu"),
]


@pytest.mark.parametrize("platform,alias,dtype,picks", ALIAS_PICKS, ids=str)
def test_aliases_pick_per_platform_never_an_interpreted_kernel(platform, alias, dtype, picks):
  call = _long_call(platform, dtype)
  assert registry.select(alias, call).name == picks
  decode = _long_call(platform, dtype, q_len=1)
  assert registry.select("auto", decode).name == "split_k"
  assert registry.order(platform)[0] == "split_k"
  # An explicit backend still runs an interpreted kernel, and explain says why aliases don't.
  if platform != "gpu":
    assert registry.select("pallas_gpu", call).name == "pallas_gpu"
    assert "pallas_gpu passed by (Pallas interpret mode off GPU" in registry.describe("fused",
                                                                                       call)


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_programs_traced_for_cpu_or_tpu_hold_no_interpreted_kernel(platform):
  call = _long_call(jax.default_backend(), "float32")
  with flaxattn.lowering_for(platform):
    picks = {alias: registry.per_platform(alias, call) for alias in ("fused", "auto")}
  name = registry.lowering_name(platform)
  assert picks["fused"][name].name == "blockwise"
  assert picks["auto"][name].name == ("splash" if platform == "tpu" else "blockwise")
  assert picks["auto"][name].for_tests_on(platform) is None
  assert Splash(interpret=False).for_tests_on("cpu") is None


# A document of 18 tokens, 2 padding tokens, a document of 28: with blocks of 16 the
# padding shares partial blocks with both documents.
GAP_SEG = np.array([[1] * 18 + [0] * 2 + [2] * 28], np.int32)
GAP_POS = np.array([list(range(18)) + [0, 0] + list(range(28))], np.int32)


@pytest.mark.parametrize("backend", [
    "reference", "blockwise", Blockwise(block_q=16, block_kv=16), "pallas_gpu",
    PallasGpu(block_q=16, block_kv=16)], ids=lambda b: b if isinstance(b, str) else b.name + "16")
def test_an_excluded_non_finite_or_huge_token_reaches_only_the_rows_that_see_it(backend):
  q, k, v = qkv(8, 1, 48, 48, 4, 2, 16)
  attend = grads_of(lambda q, k, v: flaxattn.attention(
      q, k, v, segment_ids=GAP_SEG, positions=GAP_POS, backend=backend, return_lse=True))
  want_g, (want_o, want_l) = attend(q, k, v)
  # (which of q/k/v, token, value): padding keys (no row sees them) and a padding query
  # (it sees nothing), non-finite or huge; token 30, position 10 of the second document,
  # seen by that document's tokens 30..47.
  huge = float(np.finfo(np.float32).max)
  for which, token, value in [(w, t, x) for w, t in (("k", 18), ("v", 19), ("v", 30))
                              for x in (np.nan, np.inf)] + [("v", 19, huge), ("k", 18, huge),
                                                            ("q", 18, np.nan)]:
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].at[0, token, 0, 3].set(value)  # KV head 0: query heads 0, 1
    got_g, (got_o, got_l) = attend(*args.values())
    sees = np.arange(48) >= (30 if token == 30 else 48)
    case = f"{which}[{token}] = {value}"
    np.testing.assert_allclose(got_o[0, ~sees], want_o[0, ~sees], err_msg=case,
                               **TOL[jnp.float32])
    np.testing.assert_allclose(got_l[0, ~sees], want_l[0, ~sees], err_msg=case,
                               **TOL[jnp.float32])
    assert not np.isfinite(got_o[0, sees, :2]).any(), case
    if not sees.any():  # nothing sees it: every gradient as without it
      for name, got, want in zip("qkv", got_g, want_g, strict=True):
        np.testing.assert_allclose(got, want, err_msg=f"d{name}, {case}", **TOL[jnp.float32])
