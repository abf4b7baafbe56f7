"""Programs lowered for TPU from this CPU host (`flaxattn.lowering_for("tpu")` around
`jax.export`, platforms=("tpu",)): the traced program holds splash compiled by Mosaic
(`tpu_custom_call`), never an interpret-mode loop, alone and under context parallelism on
simulated CPU device meshes. Without the switch a program holds only its devices' kernels."""

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


# A causal ring's splash kernels, forward and fused backward: the diagonal step's, and one
# for the other steps (the same shapes and no partial block: they share one trace, so the
# module holds the kernel once however many steps call it).
_RING_KERNELS = 4


def _packed(b, t):
  """Four documents per row (ids only: positions default to the index, exact for splash)."""
  return jnp.asarray(np.repeat(np.arange(1, 5), t // 4)[None].repeat(b, 0), jnp.int32)


def tpu_program(fn, *args) -> str:
  with flaxattn.lowering_for("tpu"):
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


def test_default_program_holds_only_its_devices_kernel(monkeypatch):
  """On this CPU host a program holds the blockwise kernel and builds no splash metadata, even
  after the same function was traced for TPU (the switch keys JAX's trace caches); with
  `lowering_for("cpu", "tpu")` one program holds both and each lowering keeps its own."""
  from flaxattn import blocks  # pylint: disable=import-outside-toplevel
  q = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  fn = _grad_fn(segment_ids=_packed(1, 256), mask=flaxattn.Local(96))  # uncached: a new mask
  assert "tpu_custom_call" in tpu_program(fn, q, kv, kv)
  built = []
  monkeypatch.setattr(blocks, "block_mask", lambda *a: built.append(a))
  cpu = jax.jit(fn).lower(q, kv, kv).as_text()
  assert "tpu_custom_call" not in cpu and "while" in cpu and not built
  assert jax.jit(fn)(q, kv, kv)[0].shape == q.shape  # and it runs here
  text = flaxattn.explain(q, kv, kv, print_fn=None)
  assert "holds kernels for (the platform of the devices it runs on" in text
  assert "cpu: blockwise" in text
  monkeypatch.undo()
  with flaxattn.lowering_for("cpu", "tpu"):  # each export keeps its platform's branch
    assert "holds kernels for (set by flaxattn.lowering_for): cpu: blockwise, tpu: splash" in (
        flaxattn.explain(q, kv, kv, print_fn=None))
    cpu = jax.export.export(jax.jit(fn), platforms=("cpu",))(q, kv, kv).mlir_module()
    tpu = jax.export.export(jax.jit(fn), platforms=("tpu",))(q, kv, kv).mlir_module()
  assert "tpu_custom_call" not in cpu and "tpu_custom_call" in tpu
  with pytest.raises(ValueError, match=r"lowering_for expects one or more of .*got \('tpuu',\)"):
    with flaxattn.lowering_for("tpuu"):
      pass


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
  # A causal ring holds splash's forward and fused backward twice at any cp: the diagonal
  # step's, and one kernel that every other step calls (no partial block: one trace).
  assert ring["tpu_custom_calls"] == _RING_KERNELS and gather["tpu_custom_calls"] == 2, results
  assert ring["collective_permutes"] > 0 and ring["float_all_gathers"] == 0, ring
  assert ring["while_loops"] == 0 and gather["while_loops"] == 0, results
  # Ulysses: splash on the whole sequence (forward and backward) between all-to-alls of q, k,
  # v and out each way (the loss leaves lse unused); the hybrid's ring inside permutes.
  for name in ["ulysses", "ulysses_ring"] if n == 4 else ["ulysses_ring"]:
    r = results[name]
    kernels = _RING_KERNELS if name == "ulysses_ring" else 2
    assert r["tpu_custom_calls"] == kernels and r["all_to_alls"] == 8, r
    assert r["float_all_gathers"] == 0, r
    assert (r["collective_permutes"] > 0) == (name == "ulysses_ring"), r


def _train_step(devices: int, preset: str) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tpu_train_step.py"), preset],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.splitlines()[-1])


def test_the_tpu_demo_lowers_for_tpu_as_it_is():
  """configs/tpu_demo.yaml, unchanged, on one host of 8 chips (fsdp 8): the train step holds
  compiled splash kernels in the scanned layers' one body: the forward, its recomputation
  under remat, and the backward's dK/dV and dQ kernels (the fused backward's dq partials
  would take 8 GiB per device: 16 heads x 32768 x 128 in bf16 x 64 key blocks)."""
  held = _train_step(8, "tpu_demo")
  assert held["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1, "context_ring": 1, "context": 1}
  assert (held["seq_len"], held["batch_size"]) == (32768, 8), held
  assert held["tpu_custom_calls"] == 4, held


def test_llama_train_step_of_the_tpu_config_lowers_for_tpu():
  """configs/tpu_v5p_8b.yaml's model and mesh axes scaled down (tests/tpu_train_step.py):
  the whole train step (scanned layers, remat, ring over context) lowers for TPU with
  compiled splash kernels and the ring's collective-permutes."""
  held = _train_step(8, "small_8b")
  assert held["tpu_custom_calls"] >= _RING_KERNELS and held["collective_permutes"] > 0, held


def test_train_step_of_the_128k_config_lowers_for_tpu_at_full_length():
  """configs/tpu_v5p_8b_extend_128k.yaml at its full sequence length, batch and mesh
  (fsdp 16 x context 4 over 64 simulated devices), narrow and shallow."""
  held = _train_step(64, "small_128k")
  assert held["mesh"] == {"data": 1, "fsdp": 16, "tensor": 1, "context_ring": 1, "context": 4}, held
  assert (held["seq_len"], held["batch_size"]) == (131072, 16), held
  assert held["tpu_custom_calls"] >= _RING_KERNELS and held["collective_permutes"] > 0, held
