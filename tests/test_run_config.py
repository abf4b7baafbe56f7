"""The configs around a run's checkpoints: what `init_from` takes from its source and from
the YAML, which changes a resume refuses (derived from the model's parameters), a run_dir
config.json that is JSON but not a config, and the platform name JAX is given. All before
any jax computation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from train import config, distributed, init_from, run_dir, xla_flags
from train.config import ConfigError
from trainer import ROOT, clean_env, command, run

SIZES = ["model.vocab_size=97", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
         "model.n_kv_heads=2", "model.ffn_dim=96", "seq_len=128"]


def _hf_dir(path, **fields):
  """A Hugging Face config.json of the `SIZES` model (transformers 5's layout) beside an
  empty safetensors index: enough for `init_from.resolve`, which reads no tensor."""
  path.mkdir()
  hf = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, hidden_act="silu", rms_norm_eps=1e-5,
            max_position_embeddings=256, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                 low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64))
  hf.update(fields)
  (path / "config.json").write_text(json.dumps(hf))
  (path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
  return path


def test_init_from_reads_transformers_5_rope_parameters(tmp_path):
  source = _hf_dir(tmp_path / "hf")
  cfg = init_from.resolve(config.load(None, SIZES + [f"init_from={source}",
                                                     f"run_dir={tmp_path / 'run'}"]))
  assert cfg.model.rope_theta == 500000.0
  assert cfg.model.rope_scaling.kind == "llama3" and cfg.model.rope_scaling.factor == 8.0


def test_init_from_takes_the_yaml_attention_options(tmp_path):
  """Options that keep the parameters' shapes come from the YAML where it sets them (a
  Hugging Face Llama has none of them), else from the source."""
  source = _hf_dir(tmp_path / "hf")
  options = ["model.sliding_window=32", "model.global_every=2", "model.logit_soft_cap=30.0"]
  cfg = init_from.resolve(config.load(None, SIZES + options + [
      f"init_from={source}", f"run_dir={tmp_path / 'run'}"]))
  assert (cfg.model.sliding_window, cfg.model.global_every, cfg.model.logit_soft_cap) == (
      32, 2, 30.0)
  assert cfg.model.rope_theta == 500000.0  # not set in the YAML: the source's
  cfg = init_from.resolve(config.load(None, SIZES + ["model.chunk_size=16", f"init_from={source}",
                                                     f"run_dir={tmp_path / 'run'}"]))
  assert cfg.model.chunk_size == 16


def _saved(tmp_path, *overrides) -> config.TrainConfig:
  """A run_dir whose config.json was saved with `overrides`."""
  cfg = config.load(None, SIZES + [f"run_dir={tmp_path}", *overrides])
  run_dir.create(cfg.run_dir)
  run_dir.save_config(cfg)
  return cfg


@pytest.mark.parametrize("saved, now, keys", [
    ([], ["model.attention_sinks=true"], ["model.attention_sinks (saved False, now True)"]),
    ([], ["model.n_layers=3"], ["model.n_layers (saved 2, now 3)"]),
    (["model.scan_layers=true"], [], ["model.scan_layers (saved True, now False)"]),
    ([], ["model.tie_embeddings=false", "model.dim=128"],
     ["model.tie_embeddings (saved True, now False)", "model.dim (saved 64, now 128)"]),
])
def test_resume_refuses_a_change_of_the_parameters_naming_the_key(tmp_path, saved, now, keys):
  _saved(tmp_path, *saved)
  with pytest.raises(ConfigError) as e:
    run_dir.check(config.load(None, SIZES + [f"run_dir={tmp_path}", *now]))
  assert all(k in str(e.value) for k in keys), str(e.value)


def test_resume_with_sinks_changed_exits_2_before_compiling(tmp_path):
  """The trainer's exit status and message, with the config.json a run of `command` saves."""
  runs = tmp_path / "run"
  saved = config.load(str(ROOT / "configs" / "demo.yaml"), command(runs)[4:])
  run_dir.create(saved.run_dir)
  run_dir.save_config(saved)
  proc = run(command(runs, "model.attention_sinks=true"))
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "model.attention_sinks (saved False, now True)" in proc.stderr, proc.stderr
  assert "Traceback" not in proc.stderr


def test_resume_lets_through_options_that_keep_the_parameters(tmp_path):
  _saved(tmp_path)
  run_dir.check(config.load(None, SIZES + [
      f"run_dir={tmp_path}", "model.sliding_window=32", "model.rope_theta=500000.0",
      "model.remat=full", "steps=7"]))


@pytest.mark.parametrize("text", ["[]", '"x"', "{}", "null"])
def test_config_json_not_a_config_object_is_a_config_error(tmp_path, text):
  """In the trainer (resume check), init_from, `train.export` and `train.sample`: exit 2
  or ConfigError, naming config.json, without a traceback."""
  runs = tmp_path / "run"
  _saved(runs)
  (runs / "checkpoints" / "1").mkdir(parents=True)
  (runs / "config.json").write_text(text)
  with pytest.raises(ConfigError, match="config.json"):
    run_dir.check(config.load(None, SIZES + [f"run_dir={runs}"]))
  with pytest.raises(ConfigError, match="config.json"):
    init_from.resolve(config.load(None, SIZES + [f"init_from={runs}",
                                                 f"run_dir={tmp_path / 'new'}"]))
  if text != "[]":  # one subprocess of each entry point is enough
    return
  for cmd in (command(runs), [sys.executable, "-m", "train.export", str(runs), str(tmp_path / "o")],
              [sys.executable, "-m", "train.sample", str(runs), "--prompt", "a",
               "--max_new_tokens", "1"]):
    proc = run(cmd)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config.json" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_export_refuses_a_model_no_checkpoint_holds_before_reading_it(tmp_path, capsys):
  """A run with a window in 3 of 4 layers and sinks: no Hugging Face architecture written
  here holds it, so export exits 2 naming the option, and writes nothing."""
  from train import export

  runs = tmp_path / "run"
  _saved(runs, "model.n_layers=4", "model.sliding_window=16", "model.attention_sinks=true")
  (runs / "checkpoints" / "4").mkdir(parents=True)
  assert export.main([str(runs), str(tmp_path / "out")]) == 2
  assert "model.attention_sinks=True cannot be written" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def test_init_from_qwen3_and_mistral_sources(tmp_path):
  """A Mistral source's window comes with it; a Qwen3 source's q/k norm and biases change
  the parameters, so the YAML must set them (a config error names them otherwise)."""
  mistral = _hf_dir(tmp_path / "mistral", architectures=["MistralForCausalLM"], sliding_window=16)
  cfg = init_from.resolve(config.load(None, SIZES + [f"init_from={mistral}",
                                                     f"run_dir={tmp_path / 'run'}"]))
  assert (cfg.model.sliding_window, cfg.model.global_every) == (16, 0)
  # A key the YAML sets to its default value still overrides the source's.
  unwindowed = SIZES + ["model.sliding_window=null", f"init_from={mistral}",
                        f"run_dir={tmp_path / 'run'}"]
  cfg = init_from.resolve(config.load(None, unwindowed), config.set_keys(None, unwindowed))
  assert cfg.model.sliding_window is None
  qwen3 = _hf_dir(tmp_path / "qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32)
  with pytest.raises(ConfigError) as e:
    init_from.resolve(config.load(None, SIZES + [f"init_from={qwen3}",
                                                 f"run_dir={tmp_path / 'run'}"]))
  assert all(k in str(e.value) for k in ("model.head_dim=32", "model.qk_norm=True")), e.value
  cfg = init_from.resolve(config.load(None, SIZES + [
      "model.head_dim=32", "model.qk_norm=true", f"init_from={qwen3}",
      f"run_dir={tmp_path / 'run'}"]))
  assert cfg.model.qk_norm and cfg.model.attn_head_dim == 32


def test_saved_config_with_load_balance_key_still_reads(tmp_path):
  """config.json of runs saved before data.balance holds context_parallel.load_balance:
  read as data.balance row / none, so those runs resume; a disagreeing pair is an error."""
  values = config.to_dict(config.load(None, SIZES))
  values["data"].pop("balance")
  for old, balance in ((True, "row"), (False, "none")):
    values["context_parallel"]["load_balance"] = old
    assert config.from_dict(values).data.balance == balance
  values["data"]["balance"] = "document"
  with pytest.raises(ConfigError, match="disagree"):
    config.from_dict(values)


def test_platform_gives_jax_one_backend_each():
  """`platform: gpu` (configs/gpu_8x_8b.yaml) reaches JAX as "cuda": JAX expands "gpu" to
  CUDA and ROCm, and fails on an NVIDIA host when ROCm does not start. Every choice names
  exactly one JAX backend."""
  from jax._src import xla_bridge
  gpu_run = config.load(str(ROOT / "configs" / "gpu_8x_8b.yaml"), [])
  assert distributed.jax_platforms(gpu_run.platform) == "cuda"
  for platform in config.PLATFORMS:
    name = distributed.jax_platforms(platform)
    assert xla_bridge.expand_platform_alias(name) == [name], (platform, name)


@pytest.mark.parametrize("value", [0, 1073741794])
def test_heartbeat_timeout_out_of_range_is_one_config_error_line(value):
  """jax.distributed takes `jax_heartbeat_timeout_s` of the key as an int32: a larger one
  ended a two-process job with a TypeError on every process. The largest it takes is the
  bound (`test_jax_distributed_takes_the_largest_heartbeat_timeout`)."""
  top = config.HEARTBEAT_TIMEOUT_MAX_S
  assert top == 1073741793
  assert config.load(None, [f"heartbeat_timeout_s={top}"]).heartbeat_timeout_s == top
  with pytest.raises(ConfigError) as e:
    config.load(None, [f"heartbeat_timeout_s={value}"])
  assert e.value.keys == ("heartbeat_timeout_s",)
  assert str(e.value).startswith("config key 'heartbeat_timeout_s' expects an int in [1,"
                                 " 1073741793] (seconds;"), str(e.value)
  assert str(e.value).endswith(f", got {value}.") and "\n" not in str(e.value)


def test_jax_distributed_takes_the_largest_heartbeat_timeout():
  """A one-process job started as the trainer starts one (`train.distributed._initialize`):
  heartbeat_timeout_s one above the config's bound is jax's TypeError (as the config check
  stands in for), the bound itself starts the job."""
  import portpicker

  top = config.HEARTBEAT_TIMEOUT_MAX_S
  int32_max = 2**31 - 1
  assert distributed.jax_heartbeat_timeout_s(top) <= int32_max < (
      distributed.jax_heartbeat_timeout_s(top + 1))
  code = (f"from train import distributed\n"
          f"try:\n"
          f"  distributed._initialize('on', {top + 1})\n"
          f"except TypeError as e:\n"
          f"  print('REFUSED', type(e).__name__)\n"
          f"distributed._initialize('on', {top})\n"
          f"import jax\n"
          f"print('STARTED', jax.process_count())\n"
          f"jax.distributed.shutdown()\n")
  env = clean_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{portpicker.pick_unused_port()}",
                  JAX_NUM_PROCESSES="1", JAX_PROCESS_ID="0", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["REFUSED", "TypeError", "STARTED", "1"], proc.stdout


def test_overlap_flags_are_added_where_the_environment_sets_none():
  """Each platform's flags go to its own variable; a flag the user set keeps the user's
  value; applying twice adds nothing more; CPU has none."""
  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"
                          " --xla_gpu_enable_latency_hiding_scheduler=false"}
  added = xla_flags.apply(["tpu", "gpu", "cpu"], environ)
  tpu_variable, tpu_flags = xla_flags.TABLE["tpu"]
  assert environ[tpu_variable].split() == [f"--{n}={v}" for n, v in tpu_flags]
  gpu = environ["XLA_FLAGS"].split()
  assert gpu[:2] == ["--xla_force_host_platform_device_count=4",
                     "--xla_gpu_enable_latency_hiding_scheduler=false"]
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in gpu
  assert "--xla_gpu_enable_pipelined_all_gather=true" in gpu
  assert added["XLA_FLAGS"] == gpu[2:]
  assert xla_flags.apply(["tpu", "gpu"], environ) == {}
  assert xla_flags.apply(["tpu", "gpu"], environ, offload=True) == {
      tpu_variable: [f"--{n}={v}" for n, v in xla_flags.OFFLOAD["tpu"]]}  # TPU's alone
  assert xla_flags.platforms_of("cpu") == ("cpu",)
  assert xla_flags.platforms_of("") == ("tpu", "gpu")
  assert config.load(str(ROOT / "configs" / "tpu_v5p_8b.yaml"), []).overlap_flags
  assert not config.load(None, ["overlap_flags=false"]).overlap_flags


def test_readme_install_extras_pull_jax_in_the_supported_range():
  """Each `pip install -e ".[train,X]"` line of the README names an extra of pyproject.toml,
  and every accelerator extra asks for JAX with that extra in the range of `dependencies`."""
  import re
  import tomllib

  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  jax_pin = next(d for d in project["dependencies"] if d.startswith("jax"))
  extras = project["optional-dependencies"]
  named = re.findall(r'pip install -e "\.\[([a-z0-9_,]+)\]"', (ROOT / "README.md").read_text())
  accelerators = {x for line in named for x in line.split(",")} - {"train", "test", "aot"}
  assert accelerators == {"cuda12", "cuda13", "tpu"}, named
  pin = jax_pin[len("jax"):]
  for name in accelerators:
    assert extras[name] == [f"jax[{name}]{pin}"], (name, extras[name], jax_pin)
  # The compilers for chips a host lacks (flaxattn.aot), in the same range.
  assert ["aot"] in [line.split(",") for line in named]
  assert extras["aot-tpu"] == [f"jax[tpu]{pin}"] and extras["aot-cuda"][0] == (
      f"jax-cuda12-plugin{pin}"), (extras["aot-tpu"], extras["aot-cuda"])


@pytest.mark.parametrize("override, key, expected", [
    ("optimizer.lr=-1", "optimizer.lr", "got -1.0"),
    ("optimizer.lr=nan", "optimizer.lr", "got nan"),
    ("optimizer.lr=inf", "optimizer.lr", "got inf"),
    ("optimizer.clip_norm=-1", "optimizer.clip_norm", "got -1.0"),
    ("optimizer.warmup_steps=-5", "optimizer.warmup_steps", "got -5"),
    ("optimizer.min_lr_ratio=2", "optimizer.min_lr_ratio", "in [0, 1]"),
    ("optimizer.b2=1", "optimizer.b2", "in [0, 1)"),
    ("optimizer.eps=0", "optimizer.eps", "> 0"),
    ("checkpoint.max_to_keep=0", "checkpoint.max_to_keep", "an int >= 1, got 0"),
    ("data.read_threads=-1", "data.read_threads", "an int >= 0, got -1"),
    ("peak_tflops_per_device=nan", "peak_tflops_per_device", "got nan"),
])
def test_values_a_run_depends_on_are_checked_with_the_config(tmp_path, override, key, expected):
  """An override and the same value in a YAML file: one ConfigError line naming the key."""
  for load in (lambda: config.load(None, [override]),
               lambda: config.load(str(_yaml(tmp_path, override)))):
    with pytest.raises(ConfigError) as e:
      load()
    assert repr(key) in str(e.value) or f"{key} " in str(e.value), str(e.value)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def _yaml(tmp_path, override: str):
  """A YAML file setting the dotted key of `override` (`a.b=v`) to its value (YAML syntax)."""
  key, value = override.split("=")
  *sections, name = key.split(".")
  text = "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections))
  value = {"nan": ".nan", "inf": ".inf"}.get(value, value)
  path = tmp_path / "config.yaml"
  path.write_text(text + f"{'  ' * len(sections)}{name}: {value}\n")
  return path


def test_lr_zero_and_clip_norm_zero_are_accepted():
  """lr 0 (steps that change nothing: a run that only copies weights) and clip_norm 0 (no
  clipping): the second update after a large gradient is AdamW's unclipped one."""
  import jax.numpy as jnp
  import numpy as np

  from train import optimizer

  cfg = config.load(None, ["optimizer.lr=0", "optimizer.clip_norm=0"])
  assert (cfg.optimizer.lr, cfg.optimizer.clip_norm) == (0.0, 0.0)
  params = {"w": jnp.zeros(3)}

  def second_update(clip_norm):
    cfg = config.OptimizerConfig(lr=1.0, warmup_steps=0, clip_norm=clip_norm)
    opt = optimizer.make(cfg, optimizer.schedule(cfg, 4))
    state = opt.init(params)
    for g in ([300.0, -400.0, 0.0], [0.3, 0.1, 0.2]):  # Adam's first step is sign(g) alone
      update, state = opt.update({"w": jnp.array(g)}, state, params)
    return np.asarray(update["w"])

  np.testing.assert_array_equal(second_update(0.0), second_update(1e30))
  assert not np.allclose(second_update(0.0), second_update(1.0))


@pytest.mark.parametrize("make, expected", [
    (lambda d: d / "nowhere.yaml", "cannot be read (No such file or directory)"),
    (lambda d: d, "cannot be read (Is a directory)"),
    (lambda d: _write(d / "bad.yaml", "steps: [1, 2\nseq_len: 3\n"),
     "is not valid YAML: expected ',' or ']', but got ':' at line 2, column 8"),
    (lambda d: _write(d / "latin1.yaml", b"steps: 3 # \xe9\n"), "is not UTF-8 text"),
])
def test_unreadable_or_malformed_config_file_is_a_config_error(tmp_path, make, expected):
  path = str(make(tmp_path))
  with pytest.raises(ConfigError) as e:
    config.load(path)
  assert str(e.value).startswith(f"config file {path!r} ") and expected in str(e.value)
  assert "\n" not in str(e.value)


def _write(path, content):
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content)
  return path


def test_ulysses_heads_are_refused_with_the_config_by_flaxattn():
  """2 heads on a Ulysses axis of 4: train.mesh.make asks flaxattn
  (`ContextParallel.check_shapes`), naming the model's keys, before any compilation; 4
  heads split."""
  import helpers
  from train import mesh

  ulysses = ["context_parallel.strategy=ulysses", "mesh.context=4", "mesh.data=-1",
             "batch_size=8", "model.n_kv_heads=1"]
  devices = helpers.devices(4)
  with pytest.raises(ConfigError) as e:
    mesh.make(config.load(None, SIZES + ulysses + ["model.n_heads=2"]), devices)
  assert "model.n_heads (2) and model.n_kv_heads (1) do not split" in str(e.value), str(e.value)
  assert "'ulysses' over 'context' (size 4)" in str(e.value) and "divisible by 4" in str(e.value)
  assert mesh.make(config.load(None, SIZES + ulysses + ["model.n_heads=4"]), devices).cp


def test_context_parallel_grad_dtype_reaches_the_rings_options():
  """context_parallel.grad_dtype: "float32" (default) or "inputs" (ContextParallel's None);
  anything else is one ConfigError line naming the key and the choices. head_groups: null
  (chosen per call) or an int >= 1."""
  import jax.numpy as jnp

  import helpers
  from train import mesh

  ring = ["mesh.context=4", "mesh.data=-1", "batch_size=8"]
  devices = helpers.devices(4)
  assert mesh.make(config.load(None, SIZES + ring), devices).cp.grad_dtype == jnp.float32
  inputs = config.load(None, SIZES + ring + ["context_parallel.grad_dtype=inputs"])
  assert mesh.make(inputs, devices).cp.grad_dtype is None
  for bad in ("bfloat16", "float8_e4m3fn"):  # the compute dtype is "inputs"; float8 never
    with pytest.raises(ConfigError) as e:
      config.load(None, [f"context_parallel.grad_dtype={bad}"])
    assert "context_parallel.grad_dtype" in str(e.value) and "'inputs'" in str(e.value), str(
        e.value)
    assert f"got {bad!r}" in str(e.value) and "\n" not in str(e.value)
  assert mesh.make(config.load(None, SIZES + ring), devices).cp.head_groups is None
  two = config.load(None, SIZES + ring + ["context_parallel.head_groups=2"])
  assert mesh.make(two, devices).cp.head_groups == 2
  with pytest.raises(ConfigError, match=r"'context_parallel.head_groups' expects an int >= 1,"
                                        r" got 0"):
    config.load(None, ["context_parallel.head_groups=0"])


@pytest.mark.parametrize("overrides, held", [
    (["mesh.context=4"], 2),  # the ring holds both K/V heads: 3 does not divide them
    (["mesh.context=4", "context_parallel.strategy=auto"], 2),  # may choose the ring
    (["mesh.context=2", "mesh.tensor=2"], 1),  # the heads split over tensor first
    (["mesh.context=2", "mesh.context_ring=2", "context_parallel.strategy=ulysses"], 1),
])
def test_head_groups_that_do_not_divide_the_rings_heads_are_a_config_error(overrides, held):
  """`train.mesh.make` asks the ring's own rule (`ring_head_groups` on each device's
  heads) for the config's shapes: a traceback at step 1 before, after checkpoints/,
  corpus.json and tensorboard/ were written. train.compile builds its mesh the same way."""
  import helpers
  from train import mesh

  devices = helpers.devices(4)
  base = SIZES + ["mesh.data=-1", "batch_size=8", *overrides]
  groups = [g for g in range(1, held + 1) if held % g == 0]
  with pytest.raises(ConfigError) as e:
    mesh.make(config.load(None, base + ["context_parallel.head_groups=3"]), devices)
  message = str(e.value)
  assert e.value.keys == ("context_parallel.head_groups", "model.n_kv_heads")
  assert message.startswith("config key 'context_parallel.head_groups' (3) with"
                            " model.n_kv_heads (2) over mesh"), message
  assert f"the {held} K/V heads each device's ring holds, got 3; pass one of {groups}" in message
  assert "\n" not in message
  fits = config.load(None, base + [f"context_parallel.head_groups={held}"])
  assert mesh.make(fits, devices).cp.head_groups == held


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_out_of_grains_range_is_a_config_error(seed):
  """grain shuffles with an unsigned 32-bit seed: others were accepted, then the first
  batch failed in grain."""
  with pytest.raises(ConfigError, match=rf"seed expects an int in \[0, 4294967295\].*got {seed}"
                     ) as e:
    config.load(None, [f"seed={seed}"])
  assert e.value.keys == ("seed",)
  assert config.load(None, [f"seed={2**32 - 1}"]).seed == 2**32 - 1
