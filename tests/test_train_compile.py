"""`python -m train.compile`: the trainer's step compiled for a named target, its exit
statuses and its report. The compiles need libtpu / the CUDA plugin (`flaxattn[aot]`) and
are skipped, naming them, without."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding

import helpers
from bench import aot as aot_bench
from flaxattn import aot, sharding
from helpers import target_devices, target_precision
from models.llama import chunked_token_losses, embedding_rows
from train import compile as train_compile
from train import config, xla_flags
from train import mesh as mesh_lib

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


@pytest.mark.parametrize("argv", [
    ["configs/gpu_demo.yaml", "seq_len=65536", "--target", "h100", "seq_len=99999"],
    ["--target", "h100", "configs/gpu_demo.yaml", "seq_len=99999"],
    ["configs/gpu_demo.yaml", "--target", "h100", "--json", "seq_len=99999"],
])
def test_overrides_may_come_after_the_options(capsys, argv):
  """key=value anywhere on the line, in order (the last of a key counts), as `python -m
  train` reads them: after --target they were "unrecognized arguments" before. The value
  reaches the config check (exit 2 before any compile)."""
  status, out, err = run(capsys, *argv)
  assert status == 2 and not out, (out, err)
  assert err.startswith("error: seq_len (99999) expects at most model.max_seq_len"), err


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
  # H100 is Hopper: "auto" runs mosaic_gpu's three kernels on the packed rows cuDNN declines
  assert {"mosaic_forward", "mosaic_dq", "mosaic_dkv"} <= set(r["kernels"])
  assert r["model"] == ("dim 2048, 1 layers, 16 heads (4 K/V), ffn 5632, vocab 256, from the"
                        " config's model.* keys")
  _check_estimate(r["estimate"], aot.TARGETS["h100"], 1, 4096)


ESTIMATE_KEYS = ("step_s", "compute_s", "memory_s", "exposed_comm_s", "mfu", "tokens_per_s")


def _check_estimate(e: dict, chip, chips: int, tokens: int) -> None:
  """An estimate's keys present and positive (exposed collectives on more than one chip),
  and consistent: the step at least each part, MFU the model's FLOPs over the step at the
  chips' peak."""
  assert all(e[k] > 0 for k in ESTIMATE_KEYS if k != "exposed_comm_s"), e
  assert e["exposed_comm_s"] > 0 if chips > 1 else e["exposed_comm_s"] == 0, e
  assert e["step_s"] >= max(e["compute_s"], e["memory_s"], e["exposed_comm_s"]), e
  assert e["mfu"] == pytest.approx(e["model_flops"] / (e["step_s"] * chip.peak_flops * chips))
  assert e["tokens_per_s"] == pytest.approx(tokens / e["step_s"])
  assert e["flops"] > e["model_flops"] > 0  # the step recomputes (remat, flash backward)


# The 8B example cut to one layer of 2 heads on 1 K/V head, one row of 4096 tokens over a
# context axis of 4 (v5p-8): the ring and all_gather run it; Ulysses cannot split 2 heads.
TINY_CP4 = ["model.n_layers=1", "model.dim=256", "model.n_heads=2", "model.n_kv_heads=1",
            "model.ffn_dim=512", "model.vocab_size=512", "seq_len=4096",
            "model.max_seq_len=4096", "batch_size=1", "mesh.data=1", "mesh.fsdp=1",
            "mesh.context=4", "model.remat=full"]


def test_auto_compiles_each_strategy_and_takes_the_lowest_estimate(capsys):
  """`context_parallel.strategy: auto` as the trainer chooses it: the step compiled once per
  strategy the mesh runs, each estimated, the lowest taken. The estimate's keys, for each;
  and parameters and optimizer state over the context axis (`mesh.fsdp_over_context`):
  the plan's arguments hold a quarter of them and the batch."""
  from models.llama import flops_per_token, num_params
  from train.config import load as load_config

  target_devices("v5p-8")
  status, out, _ = run(capsys, "configs/tpu_v5p_8b.yaml", *TINY_CP4,
                       "context_parallel.strategy=auto", "mesh.fsdp_over_context=true",
                       "--target", "v5p-8", "--json")
  r = json.loads(out)
  assert status == 0 and r["fits"], r
  choice = r["choice"]
  estimates = choice["alternatives"]
  assert set(estimates) == {"ring", "all_gather"} and choice["by"] == "compile", choice
  for e in estimates.values():
    _check_estimate(e, aot.TARGETS["v5p"], 4, 4096)
  fastest = min(estimates, key=lambda s: estimates[s]["step_s"])
  assert choice["strategy"] == fastest and r["estimate"] == estimates[fastest], choice
  assert all(s in choice["reason"] for s in estimates) and "ulysses cannot run" in choice[
      "reason"], choice["reason"]
  cfg = load_config("configs/tpu_v5p_8b.yaml", TINY_CP4)
  assert r["estimate"]["model_flops"] == pytest.approx(flops_per_token(cfg.model, 4096) * 4096)
  # float32 parameters and two Adam moments, a quarter on each chip.
  state = 3 * 4 * num_params(cfg.model)
  assert state / 4 <= r["per_device_bytes"]["arguments"] < state / 4 * 1.05, r


def test_fsdp_over_context_gives_each_chip_one_nth_of_the_state():
  """The 8B example cut down on v5p-8 at context 4, fsdp 1: every parameter and optimizer
  moment is whole on each chip over fsdp alone, a quarter with `mesh.fsdp_over_context`."""
  import math

  from train import state

  devices = target_devices("v5p-8")
  for over, parts in (("false", 1), ("true", 4)):
    cfg = config.load("configs/tpu_v5p_8b.yaml", [*SCALED, "batch_size=1", "mesh.data=1",
                                                  "mesh.fsdp=1", "mesh.context=4",
                                                  f"mesh.fsdp_over_context={over}"])
    parallel = mesh_lib.make(cfg, devices)
    with jax.set_mesh(parallel.mesh), nnx.logical_axis_rules(parallel.rules):
      _, _, abstract = state.abstract_state(cfg, parallel.mesh, parallel.cp)
    arrays = [x for x in jax.tree.leaves(abstract) if x.ndim]
    assert len(arrays) > 10
    for x in arrays:
      assert math.prod(x.sharding.shard_shape(x.shape)) * parts == math.prod(x.shape), x


def _v5p_fsdp_context():
  """A v5p mesh of fsdp 2 x context 2 (compile-only devices), and `sharded(shape, dtype,
  logical names)`: an abstract array laid out on it by the default rules."""
  found = target_devices("v5p-8")
  mesh = jax.make_mesh((2, 2), ("fsdp", "context"), axis_types=(AxisType.Auto,) * 2,
                       devices=found[:4])

  def sharded(shape, dtype, names):
    spec = sharding.logical_to_spec(names, shape, rules=sharding.DEFAULT_RULES, mesh=mesh)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
  return mesh, sharded


def test_the_loss_gathers_its_head_once_and_reduces_its_gradient_once():
  """The chunked loss and its gradient compiled for v5p (fsdp 2 x context 2, 4 chunks of
  1024 tokens per device): the output head is all-gathered once, before the chunk loop, and
  its float32 gradient reduced once after it (a reduce-scatter over fsdp, then an all-reduce
  of the shard over context, whose devices hold the other tokens); no collective of a head
  shard's size runs in the loop (the loop gathered the head and all-reduced its gradient in
  every chunk, forward and remat'd backward)."""
  e, v = 256, 4096
  mesh, sharded = _v5p_fsdp_context()
  head = sharded((e, v), jnp.float32, ("embed", "vocab"))
  x = sharded((2, 8192, e), jnp.bfloat16, ("batch", "seq", "embed"))
  targets = sharded((2, 8192), jnp.int32, ("batch", "seq"))

  def grads(head_EV, x_BTE, targets_BT):
    def loss(head_EV, x_BTE):
      return jnp.sum(chunked_token_losses(x_BTE, head_EV, targets_BT, dtype=jnp.bfloat16))
    return jax.value_and_grad(loss, argnums=(0, 1))(head_EV, x_BTE)

  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.DEFAULT_RULES), target_precision():
    compiled = jax.jit(grads).lower(head, x, targets).compile()
  schedule = aot.collectives_in(compiled.as_text() or "")
  shard = e * v * 2 // 2  # the bfloat16 head over fsdp 2
  assert not [c for c in schedule if c.times > 1 and c.bytes >= shard], schedule
  gathers = [c for c in schedule if c.kind == "all-gather" and c.bytes == e * v * 2]
  assert sum(c.times for c in gathers) == 1, schedule  # the backward keeps the forward's
  scatters = [c for c in schedule if c.kind == "reduce-scatter" and c.bytes == e * v * 4 // 2]
  assert sum(c.times for c in scatters) == 1, schedule
  sums = [c for c in schedule if c.kind == "all-reduce" and c.bytes == e * v * 4 // 2]
  assert sum(c.times for c in sums) == 1, schedule


def test_the_embedding_gradient_reduces_only_the_devices_own_block():
  """The embedding lookup's gradient compiled for v5p (fsdp 2 x context 2, the table's
  features over fsdp): one all-to-all of the rows' gradient, then the float32 sum of each
  device's own [V, E / fsdp] block over context; nothing of the whole table's size moves.
  The partitioner's own backward summed the blocks in bfloat16 at this size, and at the 8B
  example's scattered into the whole table and all-reduced it over fsdp and context (1 GiB
  per step, `python -m train.compile configs/tpu_v5p_8b.yaml --target v5p-128`)."""
  v, e = 32768, 256
  mesh, sharded = _v5p_fsdp_context()
  table = sharded((v, e), jnp.float32, ("vocab", "embed"))
  tokens = sharded((2, 8192), jnp.int32, ("batch", "seq"))
  w = sharded((2, 8192, e), jnp.bfloat16, ("batch", "seq", "embed"))

  def grad(table_VE, tokens_BT, w_BTE):
    return jax.grad(lambda t: jnp.sum(
        embedding_rows(t, tokens_BT, dtype=jnp.bfloat16) * w_BTE, dtype=jnp.float32))(table_VE)

  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.DEFAULT_RULES), target_precision():
    compiled = jax.jit(grad).lower(table, tokens, w).compile()
  text = compiled.as_text() or ""
  whole = [line for line in text.splitlines() if f"[{v},{e}]" in line
           and any(k in line for k in ("all-reduce", "all-gather", "reduce-scatter"))]
  assert not whole, whole
  schedule = aot.collectives_in(text)
  sums = [c for c in schedule if c.kind == "all-reduce" and c.bytes == v * e * 4 // 2]
  assert sum(c.times for c in sums) == 1, schedule
  assert sum(c.times for c in schedule if c.kind == "all-to-all") == 1, schedule


def test_v5p_slice_compiles_splash_the_ring_and_offload(capsys):
  """The 8B example's config cut down (4 layers of 512 features, 8192 tokens a row) on v5p-8
  at fsdp 2 x context 2, compiled with remat "full" and with its own "offload" (in this
  process: libtpu's flags are the same for both). Splash and the ring run, with the overlap
  flags. Offload: each scanned layer's input goes to the host's memory, which the plan
  reports apart (host_temporaries, arrays marked "(host)"), and the device's temporaries
  drop below "full"'s. By how much depends on what else is live at the plan's peak: 19.2 MB
  with the ring that received every block, 7.3 MB since it holds two (whose "full" plan is
  39 MB smaller; bench/README.md, "The ring compiled")."""
  target_devices("v5p-8")
  reports = {}
  for remat in ("full", "offload"):
    status, out, _ = run(capsys, "configs/tpu_v5p_8b.yaml", "model.n_layers=4", "model.dim=512",
                         "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=1024",
                         "model.vocab_size=1024", "seq_len=8192", "model.max_seq_len=8192",
                         "batch_size=2", "mesh.context=2", f"model.remat={remat}", "--target",
                         "v5p-8", "--json")
    assert status == 0, out
    reports[remat] = r = json.loads(out)
    assert r["fits"] and r["devices"] == 4
    assert r["mesh"]["fsdp"] == 2 and r["mesh"]["context"] == 2
    assert any(k.startswith("splash") for k in r["kernels"])
    permutes = r["collectives"]["collective-permute"]  # the ring
    assert permutes["count"] > 0 and 0 <= permutes["exposed_bytes"] <= permutes["bytes"]
    assert "--xla_tpu_enable_async_collective_fusion=true" in r["xla_flags"].split()
    assert r["hbm_bytes"] == int(95.74 * aot.GIB)
    _check_estimate(r["estimate"], aot.TARGETS["v5p"], 4, 2 * 8192)
    # remat "offload" adds the host-offload flags (`xla_flags.OFFLOAD`) to the table's.
    offload = {f"--{name}={value}" for name, value in xla_flags.OFFLOAD["tpu"]}
    assert (offload <= set(r["xla_flags"].split())) == (remat == "offload"), r
  plans = {remat: r["per_device_bytes"] for remat, r in reports.items()}
  # 4 layers' inputs of one row of 4096 tokens x 512 features in bf16 per device: 16 MiB.
  inputs = 4 * 4096 * 512 * 2
  assert plans["full"]["host_temporaries"] == 0
  assert plans["offload"]["host_temporaries"] >= inputs
  assert plans["full"]["temporaries"] - plans["offload"]["temporaries"] >= inputs // 4


def test_the_host_offload_flags_are_known_to_libtpu():
  """`xla_flags.OFFLOAD`'s flags, which remat "offload" adds: libtpu starts with them in a
  fresh process (it reads them once, when it starts, and aborts on a flag it does not
  know); what `main` adds is checked in the test above."""
  target_devices("v5p-8")
  t = aot.target("v5p-8")
  code = ("import jax; jax.devices(); from flaxattn import aot;"
          f" aot._devices({t.platform!r}, {t.topology!r}, {t.chip.config!r})")
  flags = " ".join(f"--{name}={value}" for name, value in xla_flags.OFFLOAD["tpu"])
  child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "LIBTPU_INIT_ARGS": flags},
                         check=False)
  assert child.returncode == 0, child.stderr[-2000:]


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
  attention = ("splash",) if target[:2] in ("v5", "v6") else ("mosaic_", "flash_", "__cudnn")
  assert any(k.startswith(attention) for k in r["kernels"]), r["kernels"]


@pytest.mark.parametrize("path, alternatives", [
    ("configs/tpu_v5p_8b_cp64.yaml", [["context_parallel.strategy=ring"],
                                      ["context_parallel.strategy=all_gather"],
                                      ["mesh.context=16", "mesh.context_ring=4",
                                       "context_parallel.strategy=ulysses"]]),
    ("configs/tpu_v5p_8b_1m.yaml", [["context_parallel.strategy=ring"]]),
    ("configs/tpu_v5p_7b_cp16.yaml", [[f"context_parallel.strategy={s}"]
                                      for s in ("ulysses", "all_gather", "ring")]),
])
def test_the_long_context_examples_split_over_v5p_128(path, alternatives):
  """The configs of MaxText's setups and of 1M tokens a row, with the alternatives their
  comments compile at full size (docs/context_parallel.md, `python -m train.compile
  --compare`): each passes the trainer's checks on v5p-128's 64 chips, at 64K to 256K for
  the CP=64 one. (Compiled scaled down they would not be the same program: a scaled row
  over 64 chips is too short for splash.)"""
  lengths = [65536, 131072, 262144] if "cp64" in path else [None]
  for alt in alternatives:
    for n in lengths:
      length = [f"seq_len={n}", f"model.max_seq_len={n}"] if n else []
      cfg = config.load(path, [*alt, *length])
      assert mesh_lib.check(cfg, 64) is not None


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


def _subprocess(env: dict, *argv) -> subprocess.CompletedProcess:
  """`python -m train.compile ARGV` in a fresh process, with `env` over this one's."""
  return subprocess.run([sys.executable, "-m", "train.compile", *argv], capture_output=True,
                        text=True, env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
                        check=False)


@pytest.mark.parametrize("target, env, names", [
    # XLA ended the process with status 1 ("does not fit") and, its stderr held, no line.
    ("h100", {"XLA_FLAGS": "--bogus_flag=1"}, ["XLA_FLAGS='--bogus_flag=1'",
                                               "Unknown flag in XLA_FLAGS"]),
    ("v5e-1", {"LIBTPU_INIT_ARGS": "--bogus_flag=1"}, ["LIBTPU_INIT_ARGS='--bogus_flag=1'",
                                                       "Unknown command line flag 'bogus_flag'"]),
    ("h100", {"JAX_ENABLE_X64": "maybe"}, ["'maybe'", "JAX_ENABLE_X64"]),
    # The compile-only topology is refused: libtpu starts, its noise is held back.
    ("v5e-1", {}, ["config error for v5e-1 (1 devices): mesh"]),
])
def test_the_environment_a_fresh_process_reads_is_exit_2_in_one_line(target, env, names):
  """Flags that native code reads when it starts, and JAX's options, each in a process that
  has not started them: one line on stderr (no CUDA plugin or libtpu noise), exit status
  2, naming the variable."""
  target_devices(target)
  proc = _subprocess(env, "configs/demo.yaml", "--target", target)
  assert proc.returncode == 2, proc.stderr
  line, = proc.stderr.strip().splitlines()
  assert line.startswith("error: ") and all(n in line for n in names), line


@pytest.mark.parametrize("target, env, names", [
    ("h100", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "2"},
     ["XLA_PYTHON_CLIENT_MEM_FRACTION expects", "(0, 1]", "got '2'"]),
    ("h100", {"XLA_PYTHON_CLIENT_ALLOCATOR": "bogus"}, ["XLA_PYTHON_CLIENT_ALLOCATOR", "'bogus'"]),
    ("h100", {"JAX_PLATFORMS": "cuda"}, ["JAX_PLATFORMS expects cpu", "got 'cuda'"]),
])
def test_the_environment_is_exit_2_in_one_line(capsys, monkeypatch, target, env, names):
  """A GPU memory fraction of 2 planned 158 GiB on an 80 GB H100 (exit 0); an allocator the
  GPU client refuses, or a platform whose backend cannot make these devices, were
  tracebacks with exit 1."""
  target_devices(target)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  status, _, err = run(capsys, "configs/gpu_demo.yaml", *SMALL, "--target", target)
  assert status == 2, err
  line, = err.strip().splitlines()
  assert all(n in line for n in names), line


def test_init_from_not_on_this_host_takes_the_model_keys_or_its_config_json(tmp_path, capsys):
  """Not LlamaConfig's defaults: without model keys, a config error naming init_from; with
  them, they are the model (python -m train requires them to give the checkpoint's
  parameters); --model_config reads a copy of the checkpoint's config.json as the trainer
  reads the checkpoint's: its options where the config sets none, its sizes checked."""
  from models import hf
  from models.llama import LlamaConfig

  status, _, err = run(capsys, "init_from=/nowhere/llama", "--target", "h100")
  assert status == 2 and "config key 'init_from' ('/nowhere/llama') is not on this host" in err
  with pytest.raises(config.ConfigError) as e:
    train_compile.load(None, ["init_from=/nowhere/llama"])
  assert e.value.keys == ("init_from",)
  cfg, model = train_compile.load("configs/gpu_demo.yaml", ["init_from=/nowhere/llama"])
  assert cfg.model.dim == 2048 and "model.* keys (init_from '/nowhere/llama' is not on" in model
  source = LlamaConfig(vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128,
                       sliding_window=32, global_every=0)
  (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(source, "bfloat16")))
  sizes = ["init_from=/nowhere/llama", "model.vocab_size=512", "model.dim=64",
           "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128"]
  for copy in (tmp_path, tmp_path / "config.json"):
    cfg, model = train_compile.load(None, [*sizes, "model.remat=full"], str(copy))
    # The checkpoint's windowed layers (Mistral: their kernels and masks), the run's remat.
    assert (cfg.model.sliding_window, cfg.model.global_every) == (32, 0)
    assert cfg.model.remat == "full"
    assert model.startswith(f"--model_config {str(copy)!r} (init_from '/nowhere/llama'")
  with pytest.raises(config.ConfigError, match=r"model.dim=64.* but the config has model.dim=32"):
    train_compile.load(None, [*sizes, "model.dim=32"], str(tmp_path))
  with pytest.raises(config.ConfigError, match="the model is read from init_from .* drop"):
    train_compile.load(None, [f"init_from={tmp_path}"], str(tmp_path))


@pytest.mark.parametrize("target, overrides, key", [
    ("2xh100", ["mesh.data=2", "batch_size=3"], "batch_size (3) expects a multiple"),
    ("8xh100", ["mesh.context=8", "context_parallel.strategy=ulysses", "model.n_heads=4",
                "model.n_kv_heads=4"], "model.n_heads (4) and model.n_kv_heads (4) do not split"),
])
def test_fit_config_errors_are_exit_2_naming_the_key(capsys, target, overrides, key):
  """Read as "this seq_len does not split" before (exit 1, "none of those tried")."""
  target_devices(target)
  status, out, err = run(capsys, "configs/gpu_demo.yaml", *SMALL, *overrides, "--target", target,
                         "--fit", "seq_len")
  assert status == 2 and key in err and not out, (out, err)


@pytest.mark.parametrize("target, overrides, tried, best", [
    # Powers of two from the config's 32768 down, then one between: as before.
    ("h100", [], [32768, 16384, 8192, 12288], 8192),
    # A context axis of 3 splits multiples of 3 only (no power of two).
    ("3xh100", ["mesh.context=3"], [24576, 12288, 6144, 9216], 9216),
    # Row balancing over 3: multiples of 6.
    ("3xh100", ["mesh.context=3", "data.balance=row"], [24576, 12288, 6144, 9216], 9216),
])
def test_fit_tries_the_lengths_the_mesh_splits(monkeypatch, target, overrides, tried, best):
  """The search with each compile answered by the config check on simulated devices and
  "fits up to 10000 tokens": every length tried is one the mesh splits."""
  seen = []

  def compile_step(cfg, t, model=""):
    mesh_lib.make(cfg, helpers.devices(t.devices))  # the config check, as the compile's
    seen.append(cfg.seq_len)
    return train_compile.Result(
        target=t.name, devices=t.devices, mesh={}, physical_axes="", seq_len=cfg.seq_len,
        model=model, per_device_bytes={}, hbm_bytes=1, fits=cfg.seq_len <= 10000, kernels={},
        collectives={}, xla_flags="", compile_s=0.0, warnings=[], largest=[])

  monkeypatch.setattr(train_compile, "compile_step", compile_step)
  found = train_compile.fit_seq_len("configs/gpu_demo.yaml", overrides, aot.target(target),
                                    lambda r: None)
  assert (seen, found) == (tried, best)


def test_compare_prints_a_row_per_alternative(capsys, monkeypatch):
  """`--compare key=a,b` and a quoted set of keys: one compile and one row (or JSON line)
  per alternative, in order, each compiled with its overrides after the config's."""
  seen = []

  def compile_step(cfg, t, model=""):
    seen.append((cfg.context_parallel.strategy, cfg.mesh.context, cfg.mesh.context_ring))
    e = dict(step_s=1.0 + len(seen), compute_s=1.0, memory_s=0.5, comm_s=0.2,
             exposed_comm_s=0.1, mfu=0.4, tokens_per_s=100.0, flops=2.0, model_flops=1.0,
             hbm_bytes=1, bound="compute")
    return train_compile.Result(
        target=t.name, devices=t.devices, mesh={}, physical_axes="", seq_len=cfg.seq_len,
        model=model, per_device_bytes={"total": 2**30}, hbm_bytes=2**31, fits=True,
        kernels={}, collectives={}, xla_flags="", compile_s=1.0, warnings=[], largest=[],
        estimate=e)

  monkeypatch.setattr(train_compile, "compile_step", compile_step)
  argv = ["configs/demo_usp.yaml", "mesh.context_ring=1", "mesh.context=4", "mesh.fsdp=2",
          "--target", "8xh100", "--compare", "context_parallel.strategy=ring,all_gather",
          "--compare", "mesh.context=2 mesh.context_ring=2 context_parallel.strategy=ulysses"]
  status, out, _ = run(capsys, *argv)
  assert status == 0 and seen == [("ring", 4, 1), ("all_gather", 4, 1), ("ulysses", 2, 2)]
  rows = out.splitlines()[2:]
  assert [r.split(" | ")[0] for r in rows] == [
      "| context_parallel.strategy=ring", "| context_parallel.strategy=all_gather",
      "| mesh.context=2 mesh.context_ring=2 context_parallel.strategy=ulysses"]
  assert rows[0].split(" | ")[3:5] == ["2", "1"]  # step s, compute s
  seen.clear()
  status, out, _ = run(capsys, *argv, "--json")
  lines = [json.loads(x) for x in out.splitlines()]
  assert status == 0 and [x["alternative"] for x in lines] == [
      "context_parallel.strategy=ring", "context_parallel.strategy=all_gather",
      "mesh.context=2 mesh.context_ring=2 context_parallel.strategy=ulysses"]
  assert lines[2]["estimate"]["step_s"] == 4.0


def test_hosts_are_a_physical_axis_of_their_own():
  """Over 2 hosts of 4 GPUs, data 2 x fsdp 4 moves data across hosts only (it read
  "host+device": device ids differ across hosts)."""
  try:
    devices = aot.devices(aot.target("4xh100", hosts=2))
  except aot.MissingCompiler as e:
    pytest.skip(str(e))
  cfg = config.load("configs/gpu_demo.yaml", ["mesh.data=2", "mesh.fsdp=4", "batch_size=8"])
  mesh = mesh_lib.make(cfg, devices).mesh
  assert mesh_lib.describe_axes(mesh) == "data over host, fsdp over device"
  cfg = config.load("configs/gpu_demo.yaml", ["mesh.data=8", "batch_size=8"])
  assert mesh_lib.describe_axes(mesh_lib.make(cfg, devices).mesh) == "data over host+device"
