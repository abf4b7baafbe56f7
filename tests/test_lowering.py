"""Programs lowered for TPU from this CPU host (`jax.export`, platforms=("tpu",)): the
traced program holds splash compiled by Mosaic (`tpu_custom_call`), never an interpret-mode
loop, alone and under context parallelism on simulated CPU device meshes."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxattn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASKS = [flaxattn.Full(), flaxattn.Causal(), flaxattn.Local(100), flaxattn.Chunked(128),
         flaxattn.Causal() & flaxattn.Local(200)]


def _packed(b, t):
  """Four documents per row (ids only: positions default to the index, exact for splash)."""
  return jnp.asarray(np.repeat(np.arange(1, 5), t // 4)[None].repeat(b, 0), jnp.int32)


def tpu_program(fn, *args) -> str:
  return jax.export.export(jax.jit(fn), platforms=("tpu",))(*args).mlir_module()


def _grad_fn(**kwargs):
  def loss(q, k, v):
    out = flaxattn.attention(q, k, v, **kwargs)
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return jax.grad(loss, (0, 1, 2))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: d.__name__)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_auto_lowers_compiled_splash_for_tpu(mask, dtype):
  b, t = 2, 512
  q = jax.ShapeDtypeStruct((b, t, 4, 128), dtype)
  kv = jax.ShapeDtypeStruct((b, t, 2, 128), dtype)
  text = tpu_program(_grad_fn(mask=mask, segment_ids=_packed(b, t)), q, kv, kv)
  # Forward and the fused backward: Mosaic kernels; no interpret-mode (or blockwise) loop.
  assert text.count("tpu_custom_call") == 2, text.count("tpu_custom_call")
  assert "stablehlo.while" not in text


def test_same_program_lowers_blockwise_for_cpu():
  q = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  fn = _grad_fn(segment_ids=_packed(1, 256))
  cpu = jax.export.export(jax.jit(fn), platforms=("cpu",))(q, kv, kv).mlir_module()
  assert "tpu_custom_call" not in cpu and "stablehlo.while" in cpu
  assert "tpu_custom_call" in tpu_program(fn, q, kv, kv)
  assert jax.jit(fn)(q, kv, kv)[0].shape == q.shape  # and it runs here


def test_explicit_positions_keep_the_exact_path_next_to_the_kernel():
  """With positions the run-time check selects splash or the blockwise passes per batch."""
  b, t = 1, 512
  q = jax.ShapeDtypeStruct((b, t, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, 2, 64), jnp.bfloat16)
  pos = jnp.asarray(np.tile(np.arange(t // 4), 4)[None], jnp.int32)
  text = tpu_program(_grad_fn(segment_ids=_packed(b, t), positions=pos), q, kv, kv)
  assert text.count("tpu_custom_call") == 2 and "stablehlo.case" in text


@pytest.mark.parametrize("n", [4, 8])
def test_context_parallel_lowers_compiled_splash_for_tpu(n):
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tpu_lowering.py"), str(n)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  results = {r["strategy"]: r for r in map(json.loads, out.stdout.splitlines())}
  ring, gather = results["ring"], results["all_gather"]
  assert ring["tpu_custom_calls"] >= 2 and gather["tpu_custom_calls"] == 2, results
  assert ring["collective_permutes"] > 0 and ring["float_all_gathers"] == 0, ring
  assert ring["while_loops"] == 0 and gather["while_loops"] == 0, results
  # Ulysses: splash on the whole sequence (forward and backward) between all-to-alls of q, k,
  # v and out each way (the loss leaves lse unused); the hybrid's ring inside permutes.
  for name in ["ulysses", "ulysses_ring"] if n == 4 else ["ulysses_ring"]:
    r = results[name]
    assert r["tpu_custom_calls"] >= 2 and r["all_to_alls"] == 8 and r["float_all_gathers"] == 0, r
    assert (r["collective_permutes"] > 0) == (name == "ulysses_ring"), r


def test_llama_train_step_of_the_tpu_config_lowers_for_tpu():
  """configs/tpu_v5p_8b.yaml's model and mesh axes scaled down (tests/tpu_train_step.py):
  the whole train step (scanned layers, remat, ring over context) lowers for TPU with
  compiled splash kernels and the ring's collective-permutes."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tpu_train_step.py")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  held = json.loads(out.stdout.splitlines()[-1])
  assert held["tpu_custom_calls"] >= 8 and held["collective_permutes"] > 0, held
