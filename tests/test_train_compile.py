"""`python -m train.compile`: the trainer's step compiled for a named target, its exit
statuses and its report. The compiles need libtpu / the CUDA plugin (`flaxattn[aot]`) and
are skipped, naming them, without."""

import importlib.util
import json
import os

import pytest

from bench import aot as aot_bench
from flaxattn import aot
from helpers import target_devices, target_precision
from train import compile as train_compile
from train import xla_flags

# The GPU demo's model cut to one layer and 4K tokens: seconds to compile.
SMALL = ["model.n_layers=1", "seq_len=4096", "model.max_seq_len=4096"]


@pytest.fixture(autouse=True)
def _environment_restored():
  """`main` adds the overlap flags to the process's environment (`train.xla_flags`), as a
  run's process needs them; each test here gets the environment it started with back."""
  saved = {variable: os.environ.get(variable) for variable, _ in xla_flags.TABLE.values()}
  yield
  for variable, value in saved.items():
    if value is None:
      os.environ.pop(variable, None)
    else:
      os.environ[variable] = value


def run(capsys, *argv) -> tuple[int, str, str]:
  with target_precision():
    status = train_compile.main(list(argv))
  out, err = capsys.readouterr()
  return status, out, err


@pytest.mark.parametrize("target, says", [("b200", "target expects one of"),
                                          ("v4-8", "v4 is not a compile target")])
def test_bad_target_is_exit_2(capsys, target, says):
  status, _, err = run(capsys, "configs/gpu_demo.yaml", "--target", target)
  assert status == 2 and says in err


def test_bad_config_is_exit_2(capsys):
  status, _, err = run(capsys, "configs/gpu_demo.yaml", "model.dimm=3", "--target", "h100")
  assert status == 2 and "model.dimm" in err


def test_missing_compiler_names_the_extra(capsys, monkeypatch):
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(aot.importlib.util, "find_spec", lambda name, *a: None
                      if name in ("libtpu", "jax_cuda12_plugin") else find_spec(name, *a))
  status, _, err = run(capsys, "configs/tpu_demo.yaml", "--target", "v5e-8")
  assert status == 2 and 'pip install "flaxattn[aot]"' in err and "libtpu" in err


def test_a_mesh_the_target_cannot_hold_is_exit_2(capsys):
  target_devices("h100")
  status, _, err = run(capsys, "configs/demo.yaml", "--target", "h100")  # 4 devices
  assert status == 2 and "mesh" in err and "h100 (1 devices)" in err


def test_fits_on_one_h100_with_the_gpu_kernels(capsys):
  target_devices("h100")
  status, out, _ = run(capsys, "configs/gpu_demo.yaml", *SMALL, "--target", "h100", "--json")
  r = json.loads(out)
  assert status == 0 and r["fits"] and r["target"] == "h100"
  b = r["per_device_bytes"]
  assert b["total"] == b["arguments"] + b["temporaries"] + b["outputs"] - b["aliased"] > 0
  # The state is donated: the new state is written over it.
  assert b["aliased"] > 0.9 * b["outputs"]
  assert r["hbm_bytes"] == int(0.75 * 84978434048)
  assert {"flash_forward", "flash_dq", "flash_dkv"} <= set(r["kernels"])


def test_v5p_slice_compiles_splash_and_the_ring(capsys):
  target_devices("v5p-8")
  status, out, _ = run(capsys, "configs/tpu_v5p_8b.yaml", "model.n_layers=1", "model.dim=256",
                       "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=512",
                       "model.vocab_size=1024", "seq_len=4096", "model.max_seq_len=4096",
                       "batch_size=2", "mesh.context=2", "--target", "v5p-8", "--json")
  r = json.loads(out)
  assert status == 0 and r["fits"] and r["devices"] == 4
  assert r["mesh"]["fsdp"] == 2 and r["mesh"]["context"] == 2
  assert any(k.startswith("splash") for k in r["kernels"])
  permutes = r["collectives"]["collective-permute"]  # the ring
  assert permutes["count"] > 0 and 0 <= permutes["exposed_bytes"] <= permutes["bytes"]
  assert "--xla_tpu_enable_async_collective_fusion=true" in r["xla_flags"].split()
  assert r["hbm_bytes"] == int(95.74 * aot.GIB)


def test_offload_keeps_the_layer_inputs_in_host_memory(capsys):
  """remat "offload" (the 8B example's): each scanned layer's input goes to the host's
  memory, which the plan reports apart (host_temporaries, arrays marked "(host)"), and the
  device's temporaries drop below "full"'s. By how much depends on what else is live at the
  plan's peak: 19.2 MB with the ring that received every block, 7.3 MB since it holds two
  (whose "full" plan is 39 MB smaller; bench/README.md, "The ring compiled")."""
  target_devices("v5p-8")
  plans = {}
  for remat in ("full", "offload"):
    status, out, _ = run(capsys, "configs/tpu_v5p_8b.yaml", "model.n_layers=4", "model.dim=512",
                         "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=1024",
                         "model.vocab_size=1024", "seq_len=8192", "model.max_seq_len=8192",
                         "batch_size=2", "mesh.context=2", f"model.remat={remat}", "--target",
                         "v5p-8", "--json")
    assert status == 0, out
    plans[remat] = json.loads(out)["per_device_bytes"]
  # 4 layers' inputs of one row of 4096 tokens x 512 features in bf16 per device: 16 MiB.
  inputs = 4 * 4096 * 512 * 2
  assert plans["full"]["host_temporaries"] == 0
  assert plans["offload"]["host_temporaries"] >= inputs
  assert plans["full"]["temporaries"] - plans["offload"]["temporaries"] >= inputs // 4


def test_the_compilers_refusal_is_exit_1_in_one_line(capsys):
  target_devices("v5e-8")
  # One layer whose MLP hidden activations, 65536 tokens x 262144 features in bf16 per chip,
  # are 32 GiB: more than a v5e chip's 16 GiB.
  status, out, _ = run(capsys, "configs/tpu_demo.yaml", "model.n_layers=1", "model.dim=256",
                       "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=262144",
                       "model.vocab_size=1024", "seq_len=65536", "model.max_seq_len=65536",
                       "--target", "v5e-8")
  assert status == 1
  assert out.count("\n") == 1 and out.startswith("does not fit: v5e-8 seq_len 65536")
  assert "RESOURCE_EXHAUSTED" in out and "available HBM (15.75G)" in out
  # The MLP's hidden activations, [B, T, ffn_dim], before they are split over the 8 chips.
  assert "bf16[8,65536,262144] 256.00 GiB (global)" in out.split("largest arrays: ")[1]


# Each example config's model cut down (one layer, head_dim 128, 4K tokens) on its target's
# whole topology and mesh; bench.aot compiles them at full size.
SCALED = ("model.n_layers=1", "model.dim=512", "model.n_heads=4", "model.n_kv_heads=2",
          "model.ffn_dim=1024", "model.vocab_size=1024", "seq_len=4096",
          "model.max_seq_len=4096")


@pytest.mark.parametrize("config, target, overrides", aot_bench.CASES,
                         ids=[f"{c[0].removeprefix('configs/')}-{c[1]}" for c in aot_bench.CASES])
def test_every_example_config_compiles_for_its_target(capsys, config, target, overrides):
  target_devices(target)
  status, out, _ = run(capsys, config, *overrides, *SCALED, "--target", target, "--json")
  r = json.loads(out)
  assert status == 0 and r["fits"], r
  assert r["devices"] == aot.target(target).devices
  attention = ("splash",) if target[:2] in ("v5", "v6") else ("flash_", "__cudnn")
  assert any(k.startswith(attention) for k in r["kernels"]), r["kernels"]


def test_v6e_256_builds_fsdp_64_by_context_4_and_says_what_it_splits():
  """jax.make_mesh finds no order for these sizes on a 16 x 16 torus; the trainer's mesh
  splits a physical axis and names it."""
  from train import config
  from train import mesh as mesh_lib
  devices = target_devices("v6e-256")
  cfg = config.load("configs/tpu_v5p_8b.yaml", ["batch_size=64", "mesh.fsdp=64",
                                                "mesh.context=4"])
  mesh = mesh_lib.make(cfg, devices).mesh
  assert dict(mesh.shape)["fsdp"] == 64 and dict(mesh.shape)["context"] == 4
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
  spans = mesh_lib.physical_axes(mesh)
  assert set(spans) == {"fsdp", "context"} and set(spans["fsdp"]) | set(spans["context"]) <= {
      "x", "y"}
  assert "(split: " in mesh_lib.describe_axes(mesh)
