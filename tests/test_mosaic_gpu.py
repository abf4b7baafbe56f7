"""The `mosaic_gpu` kernel in GPU interpret mode on this CPU host (jax 0.12 and later: the
interpreter simulates its shared memory, barriers, TMA copies and WGMMA) against attention
written out from the definitions: every conformance case in bfloat16, blocks the schedule
skips never loaded, the warp-specialized pipeline free of data races, the ring's step,
programmable masks and scores against the reference; its declines and options; programs
lowered for CUDA that hold its kernels. Compiled for sm_90: tests/test_kernels_compiled.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import flaxattn
from bench import triton_compile
from flaxattn import mosaic_gpu, registry
from flaxattn.attention import apply_sinks
from flaxattn.ring import merge_partials
from helpers import (
  TOL,
  as_layout,
  compare_mods,
  dense_oracle,
  devices,
  grads_of,
  mod_patterns,
  normal,
  qkv,
  random_packing,
)
from test_conformance import KernelConformance

SCALE = 0.3
interprets = pytest.mark.skipif(
    jax.__version_info__ < mosaic_gpu.INTERPRET_JAX,
    reason=f"GPU interpret mode of jax {jax.__version__} cannot run mosaic_gpu's kernels (a"
           " transposed shared-memory operand of WGMMA); jax >= 0.12 runs them")


@interprets
class TestConformance(KernelConformance):
  name = "mosaic_gpu"
  dtype = jnp.bfloat16
  batch = 1  # interpreted, a batch row costs ~15 s


def _compare(got, want, names):
  for name, g, w in zip(names, got, want, strict=True):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    finite = np.isfinite(w)
    np.testing.assert_array_equal(np.isfinite(g), finite, err_msg=name)
    scale = max(1.0, float(np.abs(w[finite]).max()))
    np.testing.assert_allclose(np.where(finite, g, 0) / scale, np.where(finite, w, 0) / scale,
                               err_msg=name, **TOL[jnp.bfloat16])


@interprets
def test_skipped_blocks_are_never_loaded():
  """Keys 128..255 belong to a document no query is in, and their keys and values are NaN:
  a visit (masked or not: 0 x NaN is NaN) would poison the output and the gradients. The
  forward and dQ loops never load them; dK/dV has no query block for their tile."""
  b, t, s = 1, 64, 384
  q, k, v = qkv(6, b, t, s, 2, 1, 64, jnp.bfloat16)
  kv_seg = np.ones((b, s), np.int32)
  kv_seg[:, 128:256] = 9
  layout = as_layout(np.ones((b, t), np.int32), None, kv_seg, None)
  poisoned = [jnp.where((kv_seg == 9)[..., None, None], jnp.nan, x) for x in (k, v)]

  def attend(q, k, v, _):
    return flaxattn.attention(q, k, v, mask=flaxattn.Full(), layout=layout, scale=SCALE,
                              backend="mosaic_gpu", return_lse=True)

  def oracle(q, k, v, _):
    return dense_oracle(q, k, v, layout, flaxattn.Full(), SCALE)
  got_g, got = grads_of(attend, 3)(q, *poisoned, None)
  want_g, want = grads_of(oracle, 3)(q, k, v, None)
  dk, dv = (np.where((kv_seg == 9)[..., None, None], 0, x) for x in got_g[1:])
  _compare([*got, got_g[0], dk, dv], [*want, *want_g], ["out", "lse", "dq", "dk", "dv"])


# A document of 18 tokens, 2 padding tokens, a document of 28: 48 tokens of 2 query heads
# per KV head, 96 rows, one tile; every block the schedule lists is PARTIAL.
GAP_SEG = np.array([[1] * 18 + [0] * 2 + [2] * 28], np.int32)
GAP_POS = np.array([list(range(18)) + [0, 0] + list(range(28))], np.int32)


@interprets
def test_a_non_finite_key_or_value_reaches_only_the_rows_that_see_it():
  """As blockwise and pallas_gpu (tests/test_attention.py): padding tokens with an inf key
  or a NaN or inf value, which no row sees, change neither the output nor any gradient;
  a NaN value of token 30 (position 10 of the second document) makes the rows that see
  it (tokens 30..47 of its KV head's query heads) NaN and no other: the earlier tokens of
  its document, the other document and the padding stay exact. Before, a masked
  non-finite value reached every row of a tile that visits its key block, and a masked
  non-finite key or value every dQ row of such a tile."""
  q, k, v = qkv(8, 1, 48, 48, 4, 2, 64, jnp.bfloat16)
  layout = as_layout(GAP_SEG, GAP_POS)

  def attend(q, k, v, _):
    return flaxattn.attention(q, k, v, layout=layout, scale=SCALE, backend="mosaic_gpu",
                              return_lse=True)

  def oracle(q, k, v, _):
    return dense_oracle(q, k, v, layout, flaxattn.Causal(), SCALE)
  want_g, want = grads_of(oracle, 3)(q, k, v, None)
  unseen_k = k.at[0, 18, 0, 3].set(jnp.inf)
  unseen_v = v.at[0, 19, 0, 3].set(jnp.nan).at[0, 18, 1, 5].set(jnp.inf)
  got_g, got = grads_of(attend, 3)(q, unseen_k, unseen_v, None)
  _compare([*got, *got_g], [*want, *want_g], ["out", "lse", "dq", "dk", "dv"])

  out, _ = jax.jit(attend)(q, k, v.at[0, 30, 0, 3].set(jnp.nan), None)
  sees = np.zeros((48, 4), bool)
  sees[30:, :2] = True  # KV head 0: query heads 0 and 1
  assert np.isnan(np.asarray(out[0], np.float32)[sees]).all()
  _compare([out[0][~sees]], [want[0][0][~sees]], ["out of the rows that do not see it"])


@interprets
def test_pipeline_has_no_data_race(monkeypatch):
  """The interpreter's race detector (vector clocks over the producer's TMA copies, the
  consumers' reads and writes and the barriers between them) finds no race in the forward,
  dQ and dK/dV of a packed causal call whose tiles visit more key blocks than there are
  shared-memory slots, so the producer refills slots the consumers free, FULL blocks and
  PARTIAL ones both; and the result is right."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interpreter
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  monkeypatch.setattr(mosaic_gpu, "_interpret_params",
                      lambda: InterpretGPUParams(detect_races=True))
  interpreter.reset_gpu_interpret_mode_state()
  t = 256
  q, k, v = qkv(7, 1, t, t, 2, 2, 64, jnp.bfloat16)
  seg = np.repeat(np.array([[1, 2]], np.int32), [200, 56], axis=1)
  pos = np.concatenate([np.arange(200), np.arange(56)])[None].astype(np.int32)
  layout = as_layout(seg, pos)
  kernel = mosaic_gpu.MosaicGpu(block_kv=64, block_kv_dq=64, block_q_dkv=64)

  def attend(q, k, v, _):
    return flaxattn.attention(q, k, v, layout=layout, scale=SCALE, backend=kernel,
                              return_lse=True)

  def oracle(q, k, v, _):
    return dense_oracle(q, k, v, layout, flaxattn.Causal(), SCALE)
  got_g, got = grads_of(attend, 3)(q, k, v, None)
  assert not interpreter.get_races().races_found
  want_g, want = grads_of(oracle, 3)(q, k, v, None)
  _compare([*got, *got_g], [*want, *want_g], ["out", "lse", "dq", "dk", "dv"])


@interprets
def test_ring_step_in_document_order_merges_to_the_whole_call():
  """As the ring's per-device step on one device, in a 2-way ring's document order
  (`flaxattn.balance_plan`: documents cut into pieces whose positions are not the token
  index): the keys in two shards (two steps), outputs merged by lse
  (`ring.merge_partials`), each step's backward given the merged out and lse (which cover
  the other shard's keys too) and their cotangents; with GQA, Chunked, sinks, a soft cap
  and Dv != D. Equals the whole call, values and gradients."""
  b, t, h, hkv = 1, 128, 4, 2
  mask = flaxattn.Chunked(48)
  q, k, _ = qkv(8, b, t, t, h, hkv, 64, jnp.bfloat16)
  v = normal((b, t, hkv, 32), 9, jnp.bfloat16)
  seg, pos = random_packing(8, b, t, max_docs=3, pad_tail=5)
  plan = flaxattn.balance_plan(seg, 2, block=16)
  seg, pos = np.asarray(plan.segment_ids(seg)), np.asarray(plan.apply(pos))
  assert np.any(np.diff(pos[0][seg[0] == 1]) < 0)  # a document's pieces out of order
  sinks = normal((h,), 7)
  step = registry.get("mosaic_gpu").on("cpu").ring_step(
      strategy="ring", mask=mask, scale=SCALE, shards=2, axis="context", load_balance=False,
      q_shape=q.shape, kv_shape=k.shape, layout=as_layout(seg, pos), soft_cap=2.0)
  halves = [slice(0, t // 2), slice(t // 2, t)]

  def part_of(p):  # step p's keys, values and layout
    return k[:, p], v[:, p], as_layout(seg, pos, seg[:, p], pos[:, p])

  def merged(q):  # the ring's forward: each step, merged by lse
    out, lse = step.forward(0, q, *part_of(halves[0]))
    out, lse = merge_partials(out.astype(jnp.float32), lse,
                              *step.forward(1, q, *part_of(halves[1])))
    return out.astype(q.dtype), lse

  def loss_cotangents(out, lse):
    return jax.grad(lambda o, s: jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(
        jnp.where(jnp.isfinite(s), s, 0)), (0, 1))(out, lse)

  @jax.jit
  def ring(q):  # the ring's passes, as one program
    raw_out, raw_lse = merged(q)
    (out, lse), pullback = jax.vjp(lambda o, s: apply_sinks(o, s, sinks), raw_out, raw_lse)
    dout, dlse = pullback(loss_cotangents(out, lse))
    grads = [step.backward(s, q, *part_of(p), raw_out, raw_lse, dout, dlse)
             for s, p in enumerate(halves)]
    dq = sum(g[0].astype(jnp.float32) for g in grads)
    dk, dv = (jnp.concatenate([g[i] for g in grads], axis=1) for i in (1, 2))
    return out, lse, dq, dk, dv
  out, lse, dq, dk, dv = ring(q)
  layout = as_layout(seg, pos)

  def oracle(q, k, v):
    return dense_oracle(q, k, v, layout, mask, SCALE, sinks, 2.0)
  (want_out, want_lse), pullback = jax.vjp(oracle, q, k, v)
  want_g = pullback(loss_cotangents(want_out, want_lse))
  _compare([out, lse, dq, dk, dv], [want_out, want_lse, *want_g],
           ["out", "lse", "dq", "dk", "dv"])


@interprets
@pytest.mark.parametrize("mask_of,score_of", [("prefix_lm", "alibi_scaled"),
                                               ("per_head_window", "row_bias"),
                                               ("local_or_prefix", None)])
def test_mask_and_score_mods_match_the_reference(mask_of, score_of):
  """A MaskMod (alone, or OR'ed with a built-in) applied elementwise inside the kernels'
  partial blocks, and a ScoreMod on every block visited, whose operands are read at one
  index per block (`w[()]`, `bias[b]`), on packed rows with padding and GQA: out, lse, dq,
  dk, dv and the score mod's operands' gradients against the reference."""
  b, t, h = 1, 256, 4
  q, k, v = qkv(12, b, t, t, h, 2, 64, jnp.bfloat16)
  seg, pos = random_packing(12, b, t, max_docs=3, pad_tail=9)
  patterns = mod_patterns(b, h, t)
  score_mod = None if score_of is None else patterns[score_of][1]
  compare_mods("mosaic_gpu", as_layout(seg, pos), patterns[mask_of][0], score_mod, q, k, v,
               jnp.bfloat16)


def test_mods_it_cannot_read_decline_with_the_reason():
  """Mosaic GPU loads scalars or whole tiles, no gather: a mod that reads its operand at
  indices varying within a block (ALiBi's `slopes[h]`, a T5 table) declines with the
  reason, and "auto" takes pallas_gpu on a GPU; one read at an index per batch row runs."""
  patterns = mod_patterns(2, 4, 256)
  kernel = registry.get("mosaic_gpu").on("gpu")
  for name in ("alibi", "t5"):
    call = _gpu_call(score_mod=patterns[name][1])
    assert "pallas_gpu gathers them" in kernel.unsupported_reason(call), name
    assert registry.select("auto", call).name == "pallas_gpu"
  for mask, score_mod in (patterns["local_or_prefix"], patterns["row_bias"]):
    assert kernel.unsupported_reason(_gpu_call(mask=mask, score_mod=score_mod)) is None


def _on_hopper() -> bool:
  device = jax.devices()[0]
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"


on_hopper = pytest.mark.skipif(not _on_hopper(), reason="needs a Hopper GPU (sm_90: H100, H200),"
                               " where the kernels run compiled; none present")


# mask, query heads, KV heads, head dim, value dim, soft cap: packed rows of T = 1000 (not a
# multiple of any block) with padding, so tiles hold full, partial and skipped blocks.
HOPPER_CASES = [
    (flaxattn.Causal(), 8, 2, 128, 128, None),
    (flaxattn.Full(), 4, 4, 64, 64, None),
    (flaxattn.Local(200), 8, 1, 128, 64, None),
    (flaxattn.Chunked(256) & flaxattn.Local(100), 6, 2, 96, 96, 2.0),
]


@on_hopper
@pytest.mark.parametrize("mask,h,hkv,d,dv,cap", HOPPER_CASES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_compiled_on_hopper_matches_definition(mask, h, hkv, d, dv, cap):
  """The kernels as they run on a Hopper GPU (Mosaic GPU, not the interpreter): packed rows
  with padding, GQA and MQA, every mask kind, head dims below 128 (padded to 64's), Dv != D
  and a soft cap; out, lse and the three gradients against the definition."""
  b, t = 2, 1000
  q, k, _ = qkv(11, b, t, t, h, hkv, d, jnp.bfloat16)
  v = normal((b, t, hkv, dv), 12, jnp.bfloat16)
  seg, pos = random_packing(13, b, t, max_docs=6, pad_tail=40, min_len=30)
  layout = as_layout(seg, pos)
  assert mosaic_gpu.MosaicGpu().on("gpu").interpret is False

  def attend(q, k, v, _):
    return flaxattn.attention(q, k, v, mask=mask, layout=layout, scale=SCALE,
                              logit_soft_cap=cap, backend="mosaic_gpu", return_lse=True)

  def oracle(q, k, v, _):
    return dense_oracle(q, k, v, layout, mask, SCALE, None, cap)
  got_g, got = grads_of(attend, 3)(q, k, v, None)
  want_g, want = grads_of(oracle, 3)(q, k, v, None)
  _compare([*got, *got_g], [*want, *want_g], ["out", "lse", "dq", "dk", "dv"])


def _gpu_call(**kw):
  shape = (1, 256, 4, 128)
  fields = dict(platform="gpu", q_shape=shape, kv_shape=shape, dtype="bfloat16",
                mask=flaxattn.Causal(), has_segment_ids=True, has_positions=True,
                return_lse=True)
  return registry.Call(**{**fields, **kw})


def test_declines_with_reasons_and_checks_its_options(monkeypatch):
  kernel = registry.get("mosaic_gpu")
  assert kernel.unsupported_reason(_gpu_call(soft_cap=30.0, v_head_dim=64, cp_size=4,
                                             cp_strategy="ring")) is None
  assert "takes bfloat16 or float16 (WGMMA's 16-bit operands), got float32" in (
      kernel.unsupported_reason(_gpu_call(dtype="float32")))
  assert "head dims up to 128, got D=256" in kernel.unsupported_reason(
      _gpu_call(q_shape=(1, 256, 4, 256), kv_shape=(1, 256, 4, 256)))
  a100 = jax.sharding.AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB", num_cores=108,
                                     platform="gpu")
  if jax.default_backend() != "gpu":  # a GPU host's own GPU decides
    with jax.sharding.use_abstract_mesh(jax.sharding.get_abstract_mesh().update(
        abstract_device=a100)):
      assert "Hopper's WGMMA (sm_90), which this GPU (sm_80) lacks" in (
          kernel.unsupported_reason(_gpu_call()))
  monkeypatch.setattr(mosaic_gpu, "_cpu_devices", lambda: 1)
  monkeypatch.setattr(mosaic_gpu, "INTERPRET_JAX", (0, 0))  # any jax's interpreter
  assert "--xla_force_host_platform_device_count=2" in kernel.unsupported_reason(
      _gpu_call(platform="cpu"))
  monkeypatch.setattr(mosaic_gpu, "INTERPRET_JAX", (99, 0))
  assert "GPU interpret mode of jax" in kernel.unsupported_reason(_gpu_call(platform="cpu"))
  assert kernel.on("gpu").interpret is False and kernel.on("cpu").interpret is True
  asked = mosaic_gpu.MosaicGpu(interpret=True)
  assert asked.on("gpu").interpret is True and "interpret=True" in asked.for_tests_on("gpu")
  for arg, value in (("block_kv", 96), ("block_kv_dq", 512), ("block_q_dkv", 32)):
    with pytest.raises(ValueError, match=rf"MosaicGpu\({arg}=...\) expects a multiple of 64"):
      mosaic_gpu.MosaicGpu(**{arg: value})
  with pytest.raises(ValueError, match=r"MosaicGpu\(stages=...\) expects an int from 1 to 4"):
    mosaic_gpu.MosaicGpu(stages=0)


def test_auto_and_fused_take_it_on_hopper_where_cudnn_declines():
  """On GPU "auto" and "fused" take it after cudnn, before pallas_gpu (measured ahead of
  pallas_gpu on an H200 in every case, bench/README.md): a bfloat16 chunked call (which
  cuDNN has not) lowers to its three kernels for a Hopper target or a GPU not named, and
  to pallas_gpu's Triton kernels for an A100; off GPU it is never chosen."""
  q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
  assert registry.order("gpu")[1:4] == ["cudnn", "mosaic_gpu", "pallas_gpu"]
  assert registry.ALIASES["fused"][:3] == ("cudnn", "mosaic_gpu", "pallas_gpu")
  with flaxattn.lowering_for("gpu"):
    text = flaxattn.explain(q, q, q, mask=flaxattn.Chunked(128), print_fn=None)
  assert "  gpu: mosaic_gpu (" in text and "  cpu: blockwise (" in text
  assert "  mosaic_gpu: accepts\n" in text

  def loss(q, k, v):
    out = flaxattn.attention(q, k, v, mask=flaxattn.Chunked(128), backend="fused")
    return out.astype(jnp.float32).sum()
  grad = jax.grad(loss, (0, 1, 2))
  assert _cuda_calls(grad, q, q, q) == 3
  if jax.default_backend() != "gpu":  # a GPU host's own GPU decides
    program = triton_compile.cuda_export(grad, q, q, q, arch=80).mlir_module()
    assert "mosaic_gpu_v2" not in program
    assert program.count(triton_compile.TRITON_CALL) == 3


def _cuda_calls(fn, *args) -> int:
  return triton_compile.cuda_export(fn, *args).mlir_module().count("mosaic_gpu_v2")


def _loss(**kwargs):
  def loss(q, k, v):
    out, lse = flaxattn.attention(q, k, v, backend="mosaic_gpu", return_lse=True, **kwargs)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
  return loss


@pytest.mark.parametrize("strategy,kernels", [(None, 3), ("ring", 6), ("all_gather", 3),
                                              ("ulysses", 3)])
def test_lowers_mosaic_kernels_for_cuda(strategy, kernels):
  """Forward and backward lowered for CUDA from this host hold the three Mosaic GPU kernels,
  not their interpreter; the ring holds the forward twice (its scanned steps and the last
  one) and dQ, dK/dV twice; all-gather and Ulysses call each once."""
  if strategy is None:
    q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    assert _cuda_calls(jax.grad(_loss(), (0, 1, 2)), q, kv, kv) == kernels
    return
  mesh = jax.sharding.Mesh(np.array(devices(2)), ("context",), axis_types=(AxisType.Auto,))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "context"))
  q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16, sharding=spec)
  k = jax.ShapeDtypeStruct((1, 4096, 2, 128), jnp.bfloat16, sharding=spec)
  v = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.bfloat16, sharding=spec)  # Dv != D
  cp = flaxattn.ContextParallel(strategy=strategy)
  with jax.set_mesh(mesh):
    assert _cuda_calls(jax.grad(_loss(context_parallel=cp), (0, 1, 2)), q, k, v) == kernels


def test_mods_lower_into_the_mosaic_kernels():
  """A MaskMod OR'ed with a built-in and a score mod with a learned scale, forward and
  backward (the scale's gradient too), lowered for CUDA from this host: the three Mosaic
  GPU kernels hold them."""
  q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1024, 2, 128), jnp.bfloat16)
  patterns = mod_patterns(2, 8, 1024)
  mask, score_mod = patterns["local_or_prefix"][0], patterns["alibi_scaled"][1]

  def loss(q, k, v, w):
    return _loss(mask=mask, score_mod=flaxattn.ScoreMod(score_mod.fn, w))(q, k, v)
  assert _cuda_calls(jax.grad(loss, (0, 1, 2, 3)), q, kv, kv, score_mod.operands[0]) == 3


def test_default_tiling_pads_to_its_blocks():
  """Rows pad to whole tiles of 128 (two consumers of 64), keys to the forward's and dQ's
  blocks and dK/dV's tiles, head dims to multiples of 64 (a 128-byte swizzled row)."""
  tiling = mosaic_gpu.MosaicGpu(interpret=False).tiling(*(jnp.zeros((1, 8, 1, 8)),) * 3)
  assert dataclasses.astuple(tiling) == (128, 64, 64, 2, False)
  assert tiling.padding(300, 200, 80, 16) == (384, 256, 128, 64)
