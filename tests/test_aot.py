"""Compile-only targets (flaxattn.aot): the target table, and programs compiled by the
targets' own compilers on this host (skipped, naming the package, where libtpu or the CUDA
plugin is not installed: `pip install "flaxattn[aot]"`)."""

import re

import jax
import jax.numpy as jnp
import pytest

from flaxattn import aot
from helpers import compile_for, target_devices


@pytest.mark.parametrize("name, devices, topology", [
    ("v5p-8", 4, "v5p:2x2x1"), ("v5p-128", 64, "v5p:4x4x4"), ("v5p-512", 256, "v5p:4x8x8"),
    ("v5e-1", 1, "v5e:1x1"), ("v5e-8", 8, "v5e:2x4"), ("v6e-256", 256, "v6e:16x16"),
    ("h100", 1, "1x1x1"), ("8xH100", 8, "1x1x8"), ("a100-80g", 1, "1x1x1")])
def test_targets_name_their_topology(name, devices, topology):
  t = aot.target(name)
  assert (t.devices, t.topology) == (devices, topology)


def test_hosts_multiply_gpus():
  t = aot.target("8xh200", hosts=2)
  assert (t.devices, t.topology, t.platform) == (16, "1x2x8", "gpu")


@pytest.mark.parametrize("name, says", [
    ("v4-8", "v4 is not a compile target"), ("v5p-12", "power of two"),
    ("v5e-512", "power of two"), ("b200", "target expects one of"),
    ("v5p-9", "power of two"),
    ("v5p-3", "no v5p slice of 3 cores; expected a power of two from 8 to 4096 cores, e.g."
              " v5p-16."),
    ("v5p-8192", "from 8 to 4096 cores"), ("v5p-4", "from 8 to 4096 cores"),
    ("v5e-0", "no v5e slice of 0 chips; expected a power of two from 1 to 256 chips, e.g."
              " v5e-8."),
    ("v6e-512", "from 1 to 256 chips")])
def test_bad_targets_say_why(name, says):
  with pytest.raises(ValueError, match=re.escape(says)):
    aot.target(name)


def test_hbm_a_program_may_use():
  assert aot.target("v5e-8").hbm_bytes() == int(15.75 * aot.GIB)
  h100 = aot.target("h100")
  assert h100.hbm_bytes(0.9) == int(0.9 * 84978434048)


def test_gpu_fraction_from_the_environment(monkeypatch):
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  assert aot.target("h100").hbm_bytes() == 84978434048 // 2
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
  assert aot.target("h100").hbm_bytes() == int(0.75 * 84978434048)


@pytest.mark.parametrize("value", ["2", "abc", "nan", "0", "-0.5", "inf"])
def test_a_gpu_fraction_outside_0_1_is_refused_naming_the_variable(monkeypatch, value):
  """2 planned 158 GiB on an 80 GB H100; abc and nan were raw errors naming no variable."""
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", value)
  with pytest.raises(ValueError, match=rf"XLA_PYTHON_CLIENT_MEM_FRACTION expects .* in \(0, 1\]"
                                       rf".*got '{re.escape(value)}'"):
    aot.target("h100").hbm_bytes()
  assert aot.target("v5e-8").hbm_bytes() == int(15.75 * aot.GIB)  # a TPU reads no fraction


def test_the_gpu_clients_variables_as_jax_reads_them(monkeypatch):
  """JAX's new name XLA_CLIENT_MEM_FRACTION is read; both names at once are refused, as JAX
  refuses them; an empty value is unset; the platform allocator allocates from the whole
  memory; a value JAX's GPU client refuses or misreads is refused, naming it."""
  h100, memory = aot.target("h100"), 84978434048
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
  assert h100.hbm_bytes() == int(0.9 * memory)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
  with pytest.raises(ValueError, match="XLA_CLIENT_MEM_FRACTION='0.9' and"
                                       " XLA_PYTHON_CLIENT_MEM_FRACTION='0.8' are both set"):
    h100.hbm_bytes()
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "")
  assert h100.hbm_bytes() == int(0.8 * memory)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
  assert h100.hbm_bytes() == memory
  for name, value in (("XLA_PYTHON_CLIENT_ALLOCATOR", "bogus"),
                      ("XLA_PYTHON_CLIENT_PREALLOCATE", "no"),
                      ("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", "1.5"),
                      ("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", "yes")):
    with monkeypatch.context() as m:
      m.setenv(name, value)
      with pytest.raises(ValueError, match=rf"variable {name} expects .*, got '{value}'"):
        aot.gpu_mem_fraction()


@pytest.mark.parametrize("name, kind", [("v5p-8", "TPU v5"), ("h100", "NVIDIA H100 80GB HBM3"),
                                        ("a100-80g", "NVIDIA A100-SXM4-80GB")])
def test_compiles_and_reads_the_memory_plan(name, kind):
  assert target_devices(name)[0].device_kind == kind
  n = 1024
  x = jax.ShapeDtypeStruct((n, n), jnp.float32)
  # tanh(x @ x.T) is a temporary beside the argument and the output (4 MiB each).
  compiled = compile_for(name, lambda x: jnp.tanh(x @ x.T) @ x, x)
  plan = aot.memory(compiled)
  assert plan.arguments == plan.outputs == 4 * n * n
  assert 0 < plan.temporaries < 64 * n * n
  assert plan.total == plan.arguments + plan.temporaries + plan.outputs - plan.aliased
  assert plan.peak >= max(plan.arguments, plan.outputs)  # the compiler's own figure


def test_reads_kernels_and_collectives():
  text = ('%splash_mha_fwd.3 = f32[2] custom-call(%a), custom_call_target="tpu_custom_call"\n'
          '%pallas_call.1 = f32[2] custom-call(%a), custom_call_target="__gpu$xla.gpu.triton",'
          ' backend_config={name = "flash_dq"}\n'
          '%c = f32[2] custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"\n'
          '%ag = f32[4] all-gather-start(%x), dimensions={0}\n'
          '%ar.1 = f32[4] all-reduce(%x), to_apply=%add\n')
  assert aot.kernels(text) == {"splash_mha_fwd": 1, "flash_dq": 1, "__cudnn$fmhaSoftmax": 1}
  assert aot.collectives(text) == {"all-gather": 1, "all-reduce": 1}
