"""The kernels compiled, not only lowered: splash for TPU v5e, v5p and v6e by libtpu (Mosaic
included), pallas_gpu for H100 (sm_90) and A100 (sm_80) by XLA's GPU compiler (its Triton and
ptxas), mosaic_gpu for H100 (Mosaic GPU and ptxas), both GPU kernels with programmable masks
and scores, split_k's decode step for both, each on
one compile-only device of the target (`helpers.compile_for`). Each test finds its kernels in
the compiled program. Skipped, naming the package, without libtpu / the CUDA plugin (`pip
install "flaxattn[aot]"`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxattn
from bench import mosaic_compile
from flaxattn import aot, cudnn
from flaxattn.cudnn import Cudnn
from flaxattn.layer import MultiHeadAttention
from helpers import compile_for, mod_patterns, target_devices

# The lowering tests' masks (tests/test_lowering.py).
MASKS = [flaxattn.Full(), flaxattn.Causal(), flaxattn.Local(100), flaxattn.Chunked(128),
         flaxattn.Causal() & flaxattn.Local(200)]


def _grads(**kwargs):
  def loss(q, k, v):
    out = flaxattn.attention(q, k, v, **kwargs)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return jax.grad(loss, (0, 1, 2))


def _packed(b, t, docs=4):
  """`docs` documents per row (ids only: positions default to the index)."""
  return jnp.asarray(np.repeat(np.arange(1, docs + 1), t // docs)[None].repeat(b, 0), jnp.int32)


def _splash(target, mask, dtype, t=1024):
  q = jax.ShapeDtypeStruct((2, t, 4, 128), dtype)
  kv = jax.ShapeDtypeStruct((2, t, 2, 128), dtype)
  compiled = compile_for(target, _grads(mask=mask, segment_ids=_packed(2, t)), q, kv, kv)
  found = aot.kernels(compiled.as_text())
  # The forward and the fused backward, as Mosaic kernels; nothing else serves the call.
  assert found == {"splash_mqa_fwd_segmented_residuals": 1,
                   "splash_mqa_dkv_segmented_no_residuals": 1}, found


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: d.__name__)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_splash_compiles_for_v5p(mask, dtype):
  _splash("v5p-8", mask, dtype)


@pytest.mark.parametrize("mask", [flaxattn.Window(256, 256), flaxattn.Window(0, 384),
                                  flaxattn.Window(100, 0, offset=-64)], ids=str)
def test_splash_windows_compile_for_v5p(mask):
  """Two-sided, right-only and shifted windows stay on splash's kernels (its LocalMask)."""
  _splash("v5p-8", mask, jnp.bfloat16)


def test_splash_compiles_a_mask_mod_for_v5p():
  """A prefix-LM MaskMod with per-row lengths (a traced operand) over packed documents:
  splash's forward and fused backward kernels, their metadata and partial blocks' masks
  built on device; the blockwise kernel beside them only as the exact fallback (XLA ops)."""
  t = 1024
  q = jax.ShapeDtypeStruct((2, t, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, t, 2, 128), jnp.bfloat16)

  def loss(q, k, v, prefix_len):
    mask = flaxattn.MaskMod(lambda b, h, q, k, n: (k <= q) | (k < n[b]), prefix_len)
    out = flaxattn.attention(q, k, v, mask=mask, segment_ids=_packed(2, t))
    return jnp.sum(out.astype(jnp.float32) ** 2)
  compiled = compile_for("v5p-8", jax.grad(loss, (0, 1, 2)), q, kv, kv,
                         jax.ShapeDtypeStruct((2,), jnp.int32))
  found = aot.kernels(compiled.as_text())
  assert found == {"splash_mqa_fwd_segmented_residuals": 1,
                   "splash_mqa_dkv_segmented_no_residuals": 1}, found


def test_a_score_mod_on_tpu_compiles_to_blockwise():
  """ALiBi on TPU: splash declines (no score function in its kernel), so the program holds
  the blockwise kernel (XLA ops, no Pallas call), slopes' gradients included."""
  t = 1024
  q = jax.ShapeDtypeStruct((2, t, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, t, 2, 128), jnp.bfloat16)

  def loss(q, k, v, slopes):
    alibi = flaxattn.ScoreMod(lambda s, b, h, q, k, m: s - m[h] * jnp.abs(q - k), slopes)
    out = flaxattn.attention(q, k, v, score_mod=alibi, segment_ids=_packed(2, t))
    return jnp.sum(out.astype(jnp.float32) ** 2)
  compiled = compile_for("v5p-8", jax.grad(loss, (0, 1, 2, 3)), q, kv, kv,
                         jax.ShapeDtypeStruct((4,), jnp.float32))
  assert aot.kernels(compiled.as_text()) == {}


@pytest.mark.parametrize("target", ["v5e-8", "v6e-8"])
@pytest.mark.parametrize("mask, dtype", [(flaxattn.Causal(), jnp.bfloat16),
                                         (flaxattn.Chunked(128), jnp.float32)],
                         ids=["causal-bf16", "chunked-f32"])
def test_splash_compiles_for_v5e_and_v6e(target, mask, dtype):
  _splash(target, mask, dtype)


def _pallas_gpu(target, mask, dtype, d, dv, cap, t=2048, docs=4):
  q = jax.ShapeDtypeStruct((1, t, 8, d), dtype)
  k = jax.ShapeDtypeStruct((1, t, 2, d), dtype)
  v = jax.ShapeDtypeStruct((1, t, 2, dv), dtype)
  seg = _packed(1, t, docs)
  return compile_for(target, _grads(mask=mask, segment_ids=seg, backend="pallas_gpu",
                                    logit_soft_cap=cap), q, k, v)


# The Triton lowering tests' cases (tests/test_pallas_gpu.py).
GPU_CASES = [(flaxattn.Causal(), jnp.bfloat16, 128, 128, None),
             (flaxattn.Chunked(1024) & flaxattn.Local(300), jnp.float16, 96, 64, 30.0),
             (flaxattn.Full(), jnp.float32, 256, 256, None)]


@pytest.mark.parametrize("target", ["h100", "a100-80g"])
@pytest.mark.parametrize("mask, dtype, d, dv, cap", GPU_CASES,
                         ids=["causal-bf16", "chunked-local-f16-cap-dv", "full-f32-d256"])
def test_pallas_gpu_compiles_for_sm90_and_sm80(target, mask, dtype, d, dv, cap):
  found = aot.kernels(_pallas_gpu(target, mask, dtype, d, dv, cap).as_text())
  assert found == {"flash_forward": 1, "flash_dq": 1, "flash_dkv": 1}, found


@pytest.mark.parametrize("target", ["h100", "a100-80g"])
def test_pallas_gpu_compiles_mods_for_sm90_and_sm80(target):
  """A window OR'ed with a MaskMod (per-row prefix lengths) and a T5 bias table, forward
  and backward with the table's gradient: the functions inside the three Triton kernels
  (the table gathered, its gradient added by atomic adds in dQ), compiled by ptxas."""
  t = 2048
  q = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16)
  patterns = mod_patterns(1, 8, t)
  mask, t5 = patterns["local_or_prefix"][0], patterns["t5"][1]

  def loss(q, k, v, table):
    out = flaxattn.attention(q, k, v, mask=mask, score_mod=flaxattn.ScoreMod(t5.fn, table),
                             segment_ids=_packed(1, t), backend="pallas_gpu")
    return jnp.sum(out.astype(jnp.float32) ** 2)
  table = jax.ShapeDtypeStruct(t5.operands[0].shape, jnp.float32)
  compiled = compile_for(target, jax.grad(loss, (0, 1, 2, 3)), q, kv, kv, table)
  found = aot.kernels(compiled.as_text())
  assert found == {"flash_forward": 1, "flash_dq": 1, "flash_dkv": 1}, found


def test_pallas_gpu_32k_packed_on_one_h100_plans_under_1_gib():
  """16 documents in T = 32768, H = 16 on 8 KV heads, D = 128, bf16, forward and backward:
  the temporaries stay O(T) (at most 1 GiB; a [T, T] score matrix alone would be 32 GiB)."""
  t, docs = 32768, 16
  q = jax.ShapeDtypeStruct((1, t, 16, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16)
  compiled = compile_for("h100", _grads(mask=flaxattn.Causal(), segment_ids=_packed(1, t, docs),
                                        backend="pallas_gpu"), q, kv, kv)
  assert set(aot.kernels(compiled.as_text())) == {"flash_forward", "flash_dq", "flash_dkv"}
  assert aot.memory(compiled).temporaries <= aot.GIB


@pytest.mark.parametrize("case", mosaic_compile.CASES[:2], ids=lambda case: case.name)
def test_mosaic_gpu_compiles_for_sm90_within_registers_and_shared_memory(case):
  """16 documents in T = 32768, H = 16 on 8 KV heads, forward and backward, compiled for an
  H100 (`bench.mosaic_compile`, whose child process reads ptxas's report and the launch;
  the second case: a soft cap, Chunked & Local, float16, Dv != D):
  the forward, dQ and dK/dV kernels, no register spilled, shared memory within an sm_90
  block's, and the temporaries O(T) (at most 1 GiB; a [T, T] score matrix alone would be
  32 GiB)."""
  target_devices("h100")  # skipped without the CUDA plugin
  result = mosaic_compile.compile_case(case, t=32768)
  assert result["found"] == {name: 1 for name in mosaic_compile.KERNELS}, result
  assert sorted(row["kernel"] for row in result["kernels"]) == sorted(mosaic_compile.KERNELS)
  for row in result["kernels"]:
    assert row["spill_stores"] == row["spill_loads"] == 0, row
    assert 0 < row["smem"] <= mosaic_compile.SMEM_LIMIT, row
  assert result["temporaries"] <= aot.GIB, result


def test_mosaic_gpu_compiles_mods_for_sm90():
  """A window OR'ed with a MaskMod and ALiBi times a learned scale (`bench.mosaic_compile`'s
  last case), forward and backward at T = 32768, compiled for an H100: the three kernels
  within an sm_90 block's shared memory, the forward and dK/dV spilling no register (dQ,
  which also sums the scale's gradient per row, spilled 20 bytes with ptxas 12.9), the
  temporaries O(T)."""
  target_devices("h100")  # skipped without the CUDA plugin
  result = mosaic_compile.compile_case(mosaic_compile.CASES[3], t=32768)
  assert result["found"] == {name: 1 for name in mosaic_compile.KERNELS}, result
  for row in result["kernels"]:
    assert 0 < row["smem"] <= mosaic_compile.SMEM_LIMIT, row
    if row["kernel"] != "mosaic_dq":
      assert row["spill_stores"] == row["spill_loads"] == 0, row
  assert result["temporaries"] <= aot.GIB, result


@pytest.mark.parametrize("target", ["v5p-8", "h100"])
def test_split_k_decode_step_compiles(target):
  """One bf16 token against a 32K cache through the layer: split_k's one XLA computation,
  no loop over key blocks, no other kernel."""
  m = MultiHeadAttention(8, 64, num_kv_heads=2, mask=flaxattn.Causal(), dtype=jnp.bfloat16,
                         rngs=nnx.Rngs(0))
  m.init_cache((1, 32768, 64), dtype=jnp.bfloat16)
  graphdef, state = nnx.split(m)

  def step(state, x):
    return nnx.merge(graphdef, state)(x, decode=True)
  args = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state),
          jax.ShapeDtypeStruct((1, 1, 64), jnp.bfloat16))
  text = compile_for(target, step, *args).as_text()
  assert "split_k" in text
  assert not aot.kernels(text) and not re.search(r"\bwhile\(", text)


def test_cudnn_compiles_for_an_h100_where_a_gpu_would_run_it():
  """Unpacked rows: "auto" takes cuDNN for the H100 target, as on the GPU itself."""
  target_devices("h100")  # the CUDA plugin first, then cuDNN's library beside it
  if cudnn.missing_here():
    pytest.skip(cudnn.missing_here())
  q = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16)
  found = aot.kernels(compile_for("h100", _grads(mask=flaxattn.Causal()), q, kv, kv).as_text())
  assert found == {"__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1}, found


def test_cudnn_packed_layout_asks_the_target_for_hopper():
  """JAX's packed-layout check reads the GPU: the H100 target passes it, the A100 target
  does not (cuDNN declines, naming the GPU)."""
  target_devices("h100")  # the CUDA plugin first, then cuDNN's library beside it
  if cudnn.missing_here():
    pytest.skip(cudnn.missing_here())
  t = 2048
  q = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16)
  packed = _grads(segment_ids=_packed(1, t), backend=Cudnn(max_segments=4, thd_budget=2**40))
  found = aot.kernels(compile_for("h100", packed, q, kv, kv).as_text())
  assert set(found) == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}, found
  with pytest.raises(ValueError, match="needs a Hopper or newer GPU; this is NVIDIA A100"):
    compile_for("a100-80g", packed, q, kv, kv)
