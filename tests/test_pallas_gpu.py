"""The `pallas_gpu` kernel: in Pallas interpret mode on this CPU host against attention written
out from the definitions (every mask, packed rows, padding, GQA, sinks, soft cap, Dv != D,
bfloat16, cross attention), programmable masks and scores against the reference (their
operands' gradients too), as the ring's local step, its block schedule (skipped blocks are
never visited), and programs lowered for CUDA that hold its Triton kernels."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import flaxattn
from bench import triton_compile
from flaxattn import balance, blocks, pallas_gpu, registry
from flaxattn.layout import Layout
from helpers import (
  TOL,
  as_layout,
  compare_mods,
  dense_oracle,
  devices,
  grads_of,
  legal_layout,
  mod_patterns,
  normal,
  qkv,
  random_packing,
)

SCALE = 0.3
# Blocks of 16 rows and 16 keys: with 2 query heads per KV head a query block holds 8
# tokens, so documents of random_packing cross block boundaries.
KERNEL = pallas_gpu.PallasGpu(block_q=16, block_kv=16)
# Interpret mode on every platform: the block counts are read by callbacks in the kernels,
# which Triton cannot compile.
COUNTED = pallas_gpu.PallasGpu(block_q=16, block_kv=16, interpret=True)
TRITON = triton_compile.TRITON_CALL


def _attend(layout, mask, kernel=KERNEL, soft_cap=None, use_sinks=False):
  def attend(q, k, v, sinks):
    return flaxattn.attention(q, k, v, mask=mask, layout=layout, scale=SCALE, backend=kernel,
                              sinks=sinks if use_sinks else None, logit_soft_cap=soft_cap,
                              return_lse=True)
  return attend


def _check(layout, mask, q, k, v, dtype=jnp.float32, soft_cap=None, use_sinks=False):
  """Out, lse and the gradients of q, k, v and the sinks (of a loss that reads the lse)
  against `dense_oracle`; returns the kernel's (grads, (out, lse))."""
  sinks = normal((q.shape[2],), 7)
  def oracle(q, k, v, s):
    return dense_oracle(q, k, v, layout, mask, SCALE, s if use_sinks else None, soft_cap)
  want_g, (want_o, want_l) = grads_of(oracle, 4)(q, k, v, sinks)
  got = grads_of(_attend(layout, mask, soft_cap=soft_cap, use_sinks=use_sinks), 4)(q, k, v, sinks)
  got_g, (got_o, got_l) = got
  tol = TOL[dtype]
  np.testing.assert_allclose(got_o, want_o, **tol)
  np.testing.assert_array_equal(np.isinf(got_l), np.isinf(want_l))
  def finite(x):
    return np.where(np.isinf(x), 0, x)
  np.testing.assert_allclose(finite(got_l), finite(want_l), **tol)
  for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got_g, want_g, strict=True):
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    scale = max(1.0, float(jnp.abs(w.astype(jnp.float32)).max()))
    np.testing.assert_allclose(np.asarray(g, np.float32) / scale, np.asarray(w, np.float32) / scale,
                               err_msg=name, **tol)
  return got


# mask, query heads, KV heads, dtype; T = 44 tokens, packed rows with padding.
CASES = [
    (flaxattn.Causal(), 4, 2, jnp.float32),
    (flaxattn.Full(), 4, 1, jnp.float32),
    (flaxattn.Local(5), 4, 2, jnp.float32),
    (flaxattn.Chunked(8), 4, 4, jnp.float32),
    (flaxattn.Chunked(16) & flaxattn.Local(7), 6, 2, jnp.float32),  # 3 rows a token
    (flaxattn.Causal(), 4, 2, jnp.bfloat16),
]


@pytest.mark.parametrize("mask,h,hkv,dtype", CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_matches_definition_on_packed_rows(mask, h, hkv, dtype):
  b, t = 2, 44
  q, k, v = qkv(1, b, t, t, h, hkv, 8, dtype)
  seg, pos = random_packing(hkv, b, t, max_docs=5, pad_tail=3)
  _check(as_layout(seg, pos), mask, q, k, v, dtype)


def test_sinks_soft_cap_and_dv():
  """Sinks (applied outside the kernel: its lse and lse cotangent carry them), a logit soft
  cap and Dv = 12 != D = 20 (head dims Triton pads to 32 and 16), MQA, a window."""
  b, t = 2, 44
  q, k, _ = qkv(2, b, t, t, 4, 1, 20)
  v = normal((b, t, 1, 12), 9)
  seg, pos = random_packing(2, b, t, max_docs=4, pad_tail=3)
  _check(as_layout(seg, pos), flaxattn.Local(9), q, k, v, soft_cap=1.5, use_sinks=True)


def test_cross_attention_on_legal_layouts():
  """S != T, keys with their own ids: odd ids, padding runs, documents with queries and no
  keys (their rows see nothing), position gaps."""
  b, t, s = 2, 40, 28
  q, k, v = qkv(3, b, t, s, 4, 2, 8)
  seg, pos, kv_seg, kv_pos = legal_layout(3, b, t, s)
  _check(as_layout(seg, pos, kv_seg, kv_pos), flaxattn.Causal(), q, k, v)


def test_default_layout_and_rows_with_nothing_to_see():
  """The all-default layout (a schedule known at trace time); then a batch row of padding
  only and a padded tail: zeros, lse -inf and zero gradients, never NaN."""
  b, t = 2, 44
  q, k, v = qkv(4, b, t, t, 4, 2, 8)
  _check(Layout(), flaxattn.Causal(), q, k, v)
  seg, pos = random_packing(4, b, t, max_docs=3, pad_tail=5)
  seg[1] = 0
  (dq, dk, dv, _), (out, lse) = _check(as_layout(seg, pos), flaxattn.Causal(), q, k, v)
  empty = seg == 0
  assert np.all(np.asarray(out)[empty] == 0) and np.all(np.isneginf(np.asarray(lse)[empty]))
  for g in (dq, dk, dv):
    assert np.all(np.asarray(g)[empty] == 0)


@pytest.mark.parametrize("mask_of,score_of", [("prefix_lm", "alibi"), ("per_head_window", "t5"),
                                               ("local_or_prefix", "row_bias")])
def test_mask_and_score_mods_match_the_reference(mask_of, score_of):
  """A MaskMod (alone, or OR'ed with a built-in) applied elementwise inside the kernels'
  partial blocks, and a ScoreMod on every block visited, whose operands the kernels gather
  (`slopes[h]`, `table[bucket(q - k), h]`, `bias[b]`), on packed rows with padding and GQA:
  out, lse, dq, dk, dv and the score mod's operands' gradients against the reference."""
  b, t, h = 2, 48, 4
  q, k, v = qkv(12, b, t, t, h, 2, 16)
  seg, pos = random_packing(12, b, t, max_docs=3, pad_tail=3)
  patterns = mod_patterns(b, h, t)
  compare_mods(KERNEL, as_layout(seg, pos), patterns[mask_of][0], patterns[score_of][1], q, k, v)


def test_mods_it_cannot_read_decline_with_the_reason():
  """An operand used other than by indexing (a kernel holds it in memory) declines, naming
  the function, and "auto" runs the next kernel; so do mods under context parallelism (the
  steps pass them no global indices)."""
  w = jnp.float32(2.0)
  call = _gpu_call(score_mod=flaxattn.ScoreMod(lambda s, b, h, q, k, w: s * w, w))
  reason = registry.get("pallas_gpu").unsupported_reason(call)
  assert "score_mod <lambda> failed on its operands as a kernel holds them" in reason
  assert registry.select("auto", call).name == "blockwise"
  fine = _gpu_call(score_mod=flaxattn.ScoreMod(lambda s, b, h, q, k, w: s * w[()], w))
  assert registry.get("pallas_gpu").unsupported_reason(fine) is None
  ring = dataclasses.replace(fine, cp_size=2, cp_strategy="ring")
  assert "without context parallelism only" in registry.get("pallas_gpu").unsupported_reason(
      ring)


def _counting(monkeypatch):
  """Counts, at run time (a callback in the interpreted kernels), the blocks whose scores
  the kernels compute ("live") and those of them they mask ("masked")."""
  visits = {"live": 0, "masked": 0}

  def counted(name, fn):
    def count():
      visits[name] += 1

    def wrapper(*args):
      jax.debug.callback(count)
      return fn(*args)
    return wrapper
  monkeypatch.setattr(pallas_gpu, "_scores", counted("live", pallas_gpu._scores))
  monkeypatch.setattr(pallas_gpu, "_allowed", counted("masked", pallas_gpu._allowed))
  return visits


@pytest.mark.parametrize("mask", [flaxattn.Causal(),
                                  flaxattn.MaskMod(lambda b, h, q, k: k <= q)],
                         ids=["Causal", "MaskMod"])
def test_schedule_visits_only_live_blocks(monkeypatch, mask):
  """A causal mask over 4 query and 4 key blocks visits 10 pairs in each of the forward, dQ
  and dK/dV passes, not 16, and masks only the 4 on the diagonal: the built-in from its
  block bounds, the same mask as a function from its block map found on device."""
  visits = _counting(monkeypatch)
  q, k, v = qkv(5, 1, 64, 64, 1, 1, 16)
  def loss(q, k, v):
    return flaxattn.attention(q, k, v, mask=mask, backend=COUNTED).sum()
  jax.block_until_ready(flaxattn.attention(q, k, v, mask=mask, backend=COUNTED))
  assert visits == {"live": 10, "masked": 4}
  visits.update(live=0, masked=0)
  jax.block_until_ready(jax.grad(loss, (0, 1, 2))(q, k, v))
  assert visits == {"live": 30, "masked": 12}


def test_skipped_blocks_inside_the_range_are_never_loaded(monkeypatch):
  """The middle one of three key blocks belongs to a document no query is in, and its keys
  and values are NaN: a visit (masked or not: 0 x NaN is NaN) would poison the output and
  the gradients. The forward and dQ loops never visit it, and the two they visit hold one
  document and are not masked; dK/dV has no query block for it."""
  visits = _counting(monkeypatch)
  b, t, s = 1, 16, 48
  q, k, v = qkv(6, b, t, s, 1, 1, 16)  # one query block of 16 rows
  kv_seg = np.ones((b, s), np.int32)
  kv_seg[:, 16:32] = 9
  layout = as_layout(np.ones((b, t), np.int32), None, kv_seg, None)
  poisoned = [jnp.where((kv_seg == 9)[..., None, None], jnp.nan, x) for x in (k, v)]
  sinks = normal((1,), 7)
  got_g, (got_o, got_l) = grads_of(_attend(layout, flaxattn.Full(), COUNTED), 4)(
      q, *poisoned, sinks)
  assert visits == {"live": 6, "masked": 0}, visits
  def oracle(q, k, v, s):
    return dense_oracle(q, k, v, layout, flaxattn.Full(), SCALE)
  want_g, (want_o, want_l) = grads_of(oracle, 4)(q, k, v, sinks)
  for got, want in zip([got_o, got_l, *got_g[:3]], [want_o, want_l, *want_g[:3]], strict=True):
    np.testing.assert_allclose(got, want, **TOL[jnp.float32])


# As the ring's local step: cp_check.run_case's cases (the reference without context
# parallelism, errors relative to its largest magnitude) on 2 of this process's devices.
def _cp_case(strategy, mask, hkv, features=False):
  name = f"pallas_gpu-{strategy}-{mask}-hkv{hkv}" + ("-sinks-cap-dv" if features else "")
  return dict(name=name, mesh=dict(context=2), strategy=strategy, lb=True, mask=mask, h=4,
              hkv=hkv, packed=True, pipeline=False, t=64, backend=KERNEL, features=features,
              dtype="float32")


@pytest.mark.parametrize("case", [
    _cp_case("ring", "causal", 2),
    _cp_case("ring", "local", 1, features=True),
    _cp_case("all_gather", "chunked", 2),
], ids=lambda c: c["name"])
def test_context_parallel_row_order(case):
  import cp_check  # pylint: disable=import-outside-toplevel (a helper module, not a test file)
  result = cp_check.run_case(case)
  errors = {k: result[k] for k in ("out", "lse", "dq", "dk", "dv", "dsinks") if k in result}
  assert max(errors.values()) < 1e-5, errors
  assert result["collective_permutes"] > 0 or case["strategy"] == "all_gather", result


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_parallel_document_order(strategy):
  """Per-document load balancing (`balance_plan`): each device's tokens in no index order."""
  mesh = jax.sharding.Mesh(np.array(devices(2)), ("context",),
                           axis_types=(AxisType.Auto,))
  cp = flaxattn.ContextParallel(strategy=strategy, load_balance="document")
  t, mask = 64, flaxattn.Causal()
  seg, pos = random_packing(11, 2, t, max_docs=5, cp=2)
  plan = balance.balance_plan(seg, 2, [mask], block=1)
  q, k, v = qkv(5, 2, t, t, 4, 2, 8)

  def reference(q, k, v):
    return flaxattn.attention(q, k, v, mask=mask, segment_ids=seg, positions=pos,
                              backend="reference", return_lse=True)

  def parallel(q, k, v):
    out, lse = flaxattn.attention(
        plan.apply(q), plan.apply(k), plan.apply(v), mask=mask, segment_ids=plan.apply(seg),
        positions=plan.apply(pos), context_parallel=cp, return_lse=True, backend=KERNEL)
    return plan.undo(out), plan.undo(lse)

  want = grads_of(reference)(q, k, v)
  with jax.set_mesh(mesh):
    got = grads_of(parallel)(q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    w = np.asarray(w)
    finite = np.isfinite(w)
    np.testing.assert_array_equal(np.isfinite(g), finite)
    np.testing.assert_allclose(np.asarray(g)[finite], w[finite],
                               atol=1e-5 * np.abs(w[finite]).max())


@pytest.mark.parametrize("mods", [None, ("prefix_lm", "alibi")], ids=["builtin", "mods"])
def test_under_a_mesh_runs_per_batch_and_head_shard(mods):
  """Without context parallelism on a (data, fsdp, tensor) mesh: per batch and head shard
  (shard_map), nothing floating-point gathered; against the reference. A mask and score
  mod read each shard's global batch rows and heads (`prefix[b]`, `slopes[h]`), and the
  score mod's operands' gradients sum over the shards."""
  import cp_check  # pylint: disable=import-outside-toplevel
  mesh = cp_check.mesh_of(dict(data=2, fsdp=2, tensor=2))
  b, t = 4, 32
  q, k, v = qkv(7, b, t, t, 4, 2, 8)
  seg, pos = random_packing(7, b, t, max_docs=4, pad_tail=5)
  patterns = mod_patterns(b, 4, t)
  mask, score_mod = ((flaxattn.Causal(), None) if mods is None else
                     (patterns[mods[0]][0], patterns[mods[1]][1]))
  def attend(backend):
    return lambda q, k, v, score_mod: flaxattn.attention(
        q, k, v, segment_ids=seg, positions=pos, mask=mask, score_mod=score_mod,
        backend=backend, return_lse=True)
  want = grads_of(attend("reference"), 4)(q, k, v, score_mod)
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None,
                                                                     "tensor"))
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    compiled = grads_of(attend(KERNEL), 4).lower(*args, score_mod).compile()
    got = compiled(*args, score_mod)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    w = np.where(np.isinf(w), 0, w)
    np.testing.assert_allclose(np.where(w == 0, 0, g), w, atol=1e-5 * max(1, np.abs(w).max()))
  assert not re.search(r"f32\[[^\]]*\]\S* all-gather", compiled.as_text())
  assert got[1][0].sharding.spec == spec.spec


# Programs lowered for CUDA from this host: the Triton kernels, compiled, not interpreted
# (`triton_compile.cuda_export`: for an H100 named on the mesh in force).
def cuda_program(fn, *args) -> str:
  return triton_compile.cuda_export(fn, *args).mlir_module()


def _loss(**kwargs):
  def loss(q, k, v):
    out, lse = flaxattn.attention(q, k, v, backend="pallas_gpu", return_lse=True, **kwargs)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
  return loss


@pytest.mark.parametrize("mask,dtype,d,dv,cap", [
    (flaxattn.Causal(), jnp.bfloat16, 128, 128, None),
    (flaxattn.Chunked(1024) & flaxattn.Local(300), jnp.float16, 96, 64, 30.0),
    (flaxattn.Full(), jnp.float32, 256, 256, None),
], ids=["causal-bf16", "chunked-local-f16-cap-dv", "full-f32-d256"])
def test_lowers_triton_kernels_for_cuda(mask, dtype, d, dv, cap):
  """Forward: one Triton kernel; forward and backward: three (forward, dQ, dK/dV), and no
  interpret-mode loop outside them. At T = 8192 no [T, T] array anywhere."""
  b, t = 1, 8192
  q = jax.ShapeDtypeStruct((b, t, 8, d), dtype)
  k = jax.ShapeDtypeStruct((b, t, 2, d), dtype)
  v = jax.ShapeDtypeStruct((b, t, 2, dv), dtype)
  ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
  options = dict(mask=mask, logit_soft_cap=cap)

  def forward(q, k, v, seg, pos):
    return flaxattn.attention(q, k, v, segment_ids=seg, positions=pos, backend="pallas_gpu",
                              **options)

  def grads(q, k, v, seg, pos):
    return jax.grad(_loss(segment_ids=seg, positions=pos, **options), (0, 1, 2))(q, k, v)
  for fn, kernels in ((forward, 1), (grads, 3)):
    text = cuda_program(fn, q, k, v, ids, ids)
    assert text.count(TRITON) == kernels, (fn.__name__, text.count(TRITON))
    assert "stablehlo.while" not in text, fn.__name__
    assert not re.search(rf"tensor<[^>]*{t}x{t}", text), fn.__name__


def test_mods_lower_into_the_triton_kernels():
  """A MaskMod OR'ed with a built-in and a T5 bias table, forward and backward, lowered
  for CUDA: the functions inside the three Triton kernels, the table gathered in each and
  its gradient added in dQ by atomic adds; no [T, T] array at T = 8192 (the block map is
  found from tiles, one at a time)."""
  b, t = 2, 8192
  q = jax.ShapeDtypeStruct((b, t, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, 2, 64), jnp.bfloat16)
  patterns = mod_patterns(b, 8, t)
  options = dict(mask=patterns["local_or_prefix"][0])

  def loss(q, k, v, table):
    return _loss(score_mod=flaxattn.ScoreMod(patterns["t5"][1].fn, table), **options)(q, k, v)

  def grads(q, k, v, table):
    return jax.grad(loss, (0, 1, 2, 3))(q, k, v, table)
  table = patterns["t5"][1].operands[0]
  kernels = triton_compile.triton_modules(grads, q, kv, kv, table)
  assert [name for name, _ in kernels] == ["flash_forward", "flash_dq", "flash_dkv"]
  for name, ir in kernels:
    gathers = re.findall(r"tt.load %\S+ : tensor<\d+x\d+x!tt.ptr<f32>>", ir)
    assert gathers, name  # the table, read at each score's bucket and head
    assert ("tt.atomic_rmw fadd" in ir) == (name == "flash_dq"), name
  text = cuda_program(grads, q, kv, kv, table)
  assert text.count(TRITON) == 3
  assert not re.search(rf"tensor<[^>]*{t}x{t}", text)


def test_program_size_does_not_grow_with_the_sequence():
  """The block schedule is computed in the program from the ids, the default layout's too:
  a causal forward and backward exported for CUDA at T = 131072 is the size of the one at
  T = 8192 (with a schedule built at trace time, a constant of O(T^2 / 4096) bytes, its
  text grew by 67 MiB from one to the other; serialized, it was 33.6 MiB at 131072 and
  518 MiB at 524288)."""
  def size(t):
    q = jax.ShapeDtypeStruct((1, t, 16, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16)
    return len(cuda_program(jax.grad(_loss(mask=flaxattn.Causal()), (0, 1, 2)), q, kv, kv))
  small, large = size(8192), size(131072)
  assert abs(large - small) < 2048 and large < 2**20, (small, large)


@pytest.mark.parametrize("strategy,kernels", [("ring", 6), ("all_gather", 3), ("ulysses", 3)])
def test_context_parallel_lowers_triton_kernels_for_cuda(strategy, kernels):
  """The ring holds the forward twice (its scanned steps and the last one) and dQ, dK/dV
  twice; all-gather and Ulysses call the kernel once. No interpret-mode loop."""
  mesh = jax.sharding.Mesh(np.array(devices(2)), ("context",),
                           axis_types=(AxisType.Auto,))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "context"))
  q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16, sharding=spec)
  kv = jax.ShapeDtypeStruct((1, 4096, 2, 128), jnp.bfloat16, sharding=spec)
  cp = flaxattn.ContextParallel(strategy=strategy)
  with jax.set_mesh(mesh):
    text = cuda_program(jax.grad(_loss(context_parallel=cp), (0, 1, 2)), q, kv, kv)
  assert text.count(TRITON) == kernels, text.count(TRITON)
  assert ("collective_permute" in text) == (strategy == "ring")


def test_auto_and_fused_take_it_where_cudnn_and_mosaic_gpu_decline():
  """On GPU the order is split_k (decode steps only), cudnn, mosaic_gpu, pallas_gpu,
  blockwise: a chunked call in float32 (cuDNN and mosaic_gpu take 16-bit dtypes) lowers to
  Triton kernels through backend="auto"; off GPU it is never chosen."""
  q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.float32)
  mask = flaxattn.Chunked(128)
  text = flaxattn.explain(q, kv, kv, mask=mask, print_fn=None)
  decline = ("split_k declines: split_k serves decode steps of at most 16 queries; this call"
             " has 512.")
  assert (f"gpu: pallas_gpu ({decline}; cudnn declines: cuDNN fused attention takes bfloat16"
          " or float16, got float32") in text
  assert "; mosaic_gpu declines: mosaic_gpu takes bfloat16 or float16" in text
  assert f"  cpu: blockwise ({decline})\n" in text
  def loss(q, k, v):
    return flaxattn.attention(q, k, v, mask=mask).astype(jnp.float32).sum()
  assert cuda_program(jax.grad(loss, (0, 1, 2)), q, kv, kv).count(TRITON) == 3


def _gpu_call(**kw):
  shape = (1, 256, 4, 64)
  fields = dict(platform="gpu", q_shape=shape, kv_shape=shape, dtype="bfloat16",
                mask=flaxattn.Causal(), has_segment_ids=True, has_positions=True,
                return_lse=True)
  return registry.Call(**{**fields, **kw})


def test_declines_with_reasons_and_checks_its_options():
  kernel = registry.get("pallas_gpu")
  assert kernel.unsupported_reason(_gpu_call(soft_cap=30.0, v_head_dim=32, cp_size=4,
                                             cp_strategy="ring")) is None
  assert "head dims up to 256, got D=512" in kernel.unsupported_reason(
      _gpu_call(q_shape=(1, 256, 4, 512), kv_shape=(1, 256, 4, 512)))
  assert "got float64" in kernel.unsupported_reason(_gpu_call(dtype="float64"))
  assert registry.select("fused", _gpu_call(dtype="float64")).name == "blockwise"
  assert kernel.on("gpu").interpret is False and kernel.on("cpu").interpret is True
  asked = pallas_gpu.PallasGpu(interpret=True)
  assert asked.on("gpu").interpret is True and "interpret=True" in asked.for_tests_on("gpu")
  with pytest.raises(ValueError, match=r"PallasGpu\(block_q=...\) expects a power of two >= 16"):
    pallas_gpu.PallasGpu(block_q=24)


def test_visit_order_lists_full_then_partial_blocks():
  """Per query block (axis 2) and per key block (axis 1): the FULL blocks ascending, then
  the PARTIAL ones ascending, with their counts; the same from numpy (trace time) and jax
  (in the program)."""
  kinds = np.random.default_rng(0).integers(0, 3, (2, 5, 7)).astype(np.int8)
  for axis in (2, 1):
    along = kinds if axis == 2 else kinds.transpose(0, 2, 1)
    got = blocks.visit_order(np, kinds, axis)
    got_jax = blocks.visit_order(jnp, jnp.asarray(kinds), axis)
    for g, j in zip(got, got_jax, strict=True):
      np.testing.assert_array_equal(g, j)
    order, full, partial = got
    assert order.dtype == np.int16 and full.dtype == partial.dtype == np.int32
    for b, n in np.ndindex(along.shape[:2]):
      row = along[b, n]
      want = [*np.flatnonzero(row == blocks.FULL), *np.flatnonzero(row == blocks.PARTIAL)]
      assert (full[b, n], partial[b, n]) == ((row == blocks.FULL).sum(),
                                             (row == blocks.PARTIAL).sum())
      assert list(order[b, n, :len(want)]) == want


def test_default_blocks_keep_a_tile_within_16_kib():
  """A q, k or v tile holds at most 64 x 128 bfloat16 (16 KiB): blocks halve for float32
  and for D = 256 (the compiled kernels' shared memory then fits 99 KiB: docs/kernels.md)."""
  got = {(d, size): pallas_gpu.default_block(d, size) for d in (64, 96, 128, 256)
         for size in (2, 4)}
  assert got == {(64, 2): 64, (96, 2): 64, (128, 2): 64, (256, 2): 32,
                 (64, 4): 64, (96, 4): 32, (128, 4): 32, (256, 4): 16}
  q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 4096, 2, 128), jnp.float32)
  tiling = pallas_gpu.PallasGpu().tiling(q, kv, kv)
  assert (tiling.rows, tiling.keys) == (32, 32)


@pytest.mark.parametrize("case", [triton_compile.CASES[1], triton_compile.CASES[3]],
                         ids=lambda case: case.name)
def test_kernel_loops_hold_no_branch(case):
  """Each of the forward, dQ and dK/dV kernels, as lowered for CUDA, is two loops (full
  blocks, then partial ones) whose reads and dots sit in no branch: what Triton needs to
  pipeline a loop's reads ahead of its matmuls (a branch per block, as a switch on the
  block's kind, compiles to synchronous loads)."""
  _, kernels = triton_compile.case_kernels(case, t=2048)
  assert [name for name, _ in kernels] == ["flash_forward", "flash_dq", "flash_dkv"]
  for name, ir in kernels:
    ops = triton_compile.loop_structure(ir)
    assert ops["scf.for"] == 2 and ops["scf.if"] == ops["scf.while"] == 0, (name, ops)
    assert ops["tt.dot"] >= 4, (name, ops)


def test_kernels_compile_pipelined_within_shared_memory():
  """With the triton package: the bf16 D=128 and float32 D=128 kernels compiled for sm_89
  (99 KiB of shared memory a block) and sm_90 fit, and their loops read asynchronously."""
  pytest.importorskip("triton", reason="needs the triton package (pip install triton)")
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU host Pallas' Triton lowering does not take a GPU named on the mesh"
                " (jax 0.11.2 on an H200: 'No supported GPU devices found'): a CPU host's check")
  rows = triton_compile.compile_cases([triton_compile.CASES[1], triton_compile.CASES[5]],
                                      (89, 90), t=2048)
  assert len(rows) == 12
  for row in rows:
    assert row["smem"] <= row["smem_limit"] and row["pipelined"], row


@pytest.mark.parametrize("arch", [80, 89, 90])
def test_tiling_follows_the_gpu_it_is_lowered_for(arch):
  """128-row query blocks in 16-bit dtypes up to D = 128 on Hopper (sm_90: twice the
  throughput of 64 rows, measured on an H200), 64 elsewhere; float32 under "highest" takes
  three TF32 products on Hopper and Triton's IEEE dots elsewhere (the three products' dQ
  kernel would not fit an sm_89 block's shared memory); float32 under JAX's default stays
  TF32 everywhere."""
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU host its own GPU decides the tiling, not one named on the mesh")
  gpu = jax.sharding.AbstractDevice(device_kind=triton_compile.KINDS[arch], num_cores=132,
                                    platform="gpu")
  hopper = arch >= 90

  def tiling(dtype, d):
    q = jax.ShapeDtypeStruct((1, 8192, 16, d), dtype)
    kv = jax.ShapeDtypeStruct((1, 8192, 8, d), dtype)
    with jax.sharding.use_abstract_mesh(jax.sharding.get_abstract_mesh().update(
        abstract_device=gpu)), flaxattn.lowering_for("gpu"):
      return pallas_gpu.PallasGpu(interpret=False).tiling(q, kv, kv)
  for dtype, d in ((jnp.bfloat16, 128), (jnp.float16, 64)):
    assert (tiling(dtype, d).rows, tiling(dtype, d).keys) == ((128, 64) if hopper else (64, 64))
  assert (tiling(jnp.bfloat16, 256).rows, tiling(jnp.bfloat16, 256).keys) == (32, 32)
  with jax.default_matmul_precision("highest"):
    full = tiling(jnp.float32, 128)
  with jax.default_matmul_precision("default"):
    default = tiling(jnp.float32, 128)
  assert (full.rows, full.keys, default.rows, default.keys) == (32, 32, 32, 32)
  assert full.float32_dots == ("TF32_TF32_F32_X3" if hopper else None)
  assert default.float32_dots is None and tiling(jnp.bfloat16, 128).float32_dots is None
