"""train.sample: KV-cache generation equals the full forward's argmax step by step, nucleus
and temperature sampling, and `python -m train.sample` on a tiny trained run."""

import dataclasses
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxattn
import helpers
import trainer
from helpers import normal
from models.llama import Llama, LlamaConfig
from train import sample

SMALL = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                    max_seq_len=24, attention_backend="reference")
PROMPT = np.array([5, 17, 3, 40, 22, 9], np.int32)


@pytest.fixture(scope="module")
def windowed():
  """Sliding-window layers (window 3, shorter than the text) with sinks, global every 2nd."""
  cfg = dataclasses.replace(SMALL, sliding_window=3, global_every=2, attention_sinks=True)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  for b in model.layers:
    b.attn.sinks[...] = normal(b.attn.sinks.shape, 5)
  return model


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def test_greedy_generation_is_the_full_forward_argmax_step_by_step(windowed):
  new = sample.generate(windowed, PROMPT, 8)
  text = np.concatenate([PROMPT, new])
  logits = np.asarray(_forward(windowed, jnp.asarray(text)[None]))[0]
  # Token i of the text is the argmax of the full forward at position i - 1.
  np.testing.assert_array_equal(np.argmax(logits[len(PROMPT) - 1:-1], axis=-1), new)


def test_top_p_near_zero_is_greedy_and_seeds_reproduce(windowed):
  greedy = sample.generate(windowed, PROMPT, 8)
  nucleus = sample.generate(windowed, PROMPT, 8, temperature=1.0, top_p=1e-6, seed=3)
  np.testing.assert_array_equal(nucleus, greedy)
  def draw(seed):
    return sample.generate(windowed, PROMPT, 8, temperature=2.0, seed=seed)
  np.testing.assert_array_equal(draw(1), draw(1))
  assert not np.array_equal(draw(1), draw(2))


def test_next_token_draws_only_from_the_nucleus():
  # Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two.
  logits = jnp.log(jnp.array([[0.15, 0.5, 0.05, 0.3]]))
  keys = jax.random.split(jax.random.key(0), 400)
  draws = np.asarray(jax.jit(jax.vmap(lambda k: sample.next_token(logits, k, 1.0, 0.7)))(keys))
  assert set(draws.ravel()) == {1, 3}
  assert int(sample.next_token(logits, keys[0], 0.0, 1.0)[0]) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), r"--max_new_tokens expects a positive int, got 0"),
    (dict(max_new_tokens=19), r"--max_new_tokens expects at most 18 .* got 19"),
    (dict(temperature=-1.0), r"--temperature expects a finite number >= 0.*got -1.0"),
    (dict(temperature=float("inf")), r"--temperature expects a finite number >= 0.*got inf"),
    (dict(temperature=float("nan")), r"--temperature expects a finite number >= 0.*got nan"),
    (dict(top_p=0.0), r"--top_p expects a number in \(0, 1\], got 0.0"),
    (dict(prompt=np.zeros(25, np.int32)), r"--prompt expects at most .*max_seq_len=24.*got 25"),
    (dict(prompt=np.zeros(0, np.int32)), r"--prompt expects text of at least one token"),
])
def test_generate_errors_name_the_argument(windowed, kwargs, match):
  kwargs = {"prompt": PROMPT, "max_new_tokens": 4, **kwargs}
  with pytest.raises(ValueError, match=match):
    sample.generate(windowed, kwargs.pop("prompt"), kwargs.pop("max_new_tokens"), **kwargs)


@pytest.mark.parametrize("args, message", [
    (["--seed", "46116860184273879040"], "--seed expects an int in [-2**63, 2**63 - 1]"),
    (["--seed", str(2**63)], f"got {2**63}"),
    (["--prompt", "a\udcff"], "--prompt expects UTF-8 text, got byte 0xff at character 1"),
])
def test_seed_and_prompt_are_checked_before_the_run_is_read(tmp_path, capsys, args, message):
  """One line, exit status 2, naming the argument: a seed JAX's PRNG key cannot hold
  (OverflowError before), a prompt with a byte that is not UTF-8 (a TypeError or a line
  naming no argument before, by tokenizer)."""
  argv = [str(tmp_path / "no run here"), "--prompt", "x", "--max_new_tokens", "4", *args]
  assert sample.main(argv) == 2
  line, = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("sample error: ") and message in line, line
  sample.check_sampling(4, 0.0, 1.0, seed=-2**63)  # the whole signed 64-bit range is a seed


def test_generate_checks_the_padded_cache_it_will_allocate():
  """A 500-token prompt on 3 devices is prefilled as 504 tokens (a multiple of 2 chunks per
  device), and the cache rounds up to a multiple of 3: 12 new tokens need 516 slots, more
  than max_seq_len 512, though 500 + 12 fit. Refused before the cache is allocated; 6 fit."""
  model = Llama(dataclasses.replace(SMALL, max_seq_len=512), rngs=nnx.Rngs(0))
  mesh = jax.make_mesh((3,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=helpers.devices(3))
  cp = flaxattn.ContextParallel("context", strategy="ring", load_balance=True)
  prompt = np.arange(500, dtype=np.int32) % SMALL.vocab_size
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"--max_new_tokens expects at most 6 after a prompt of"
                                         r" 500 tokens, padded to 504 to split over 3 devices"):
      sample.generate(model, prompt, 12, context_parallel=cp)
    with pytest.raises(ValueError, match=r"--prompt of 510 tokens, padded to 510 .* leaves no"
                                         r" room"):
      sample.generate(model, np.resize(prompt, 510), 1, context_parallel=cp)
  assert all(b.attn.cache is None for b in model.layers)  # nothing allocated


# -- python -m train.sample on a tiny trained run --------------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """Two steps of a tiny scan_layers model with windowed layers, one device, max_seq_len 64
  (the reference backend compiles quickest)."""
  d = tmp_path_factory.mktemp("sample_run")
  trainer.train(d / "run", "steps=2", "checkpoint_every=2", "eval_every=0", "num_devices=1",
                "mesh.context=1", "seq_len=64", "model.max_seq_len=64", "model.n_layers=2",
                "model.scan_layers=true", "model.sliding_window=16", "model.global_every=2",
                "model.attention_backend=reference", log=d / "train.log")
  return d / "run"


@pytest.mark.slow  # runs the trainer
def test_sample_command_prints_text(run_dir):
  out = trainer.run([sys.executable, "-m", "train.sample", str(run_dir), "--prompt", "def f(",
                     "--max_new_tokens", "8", "--temperature", "0.7", "--top_p", "0.9",
                     "--seed", "1"])
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.startswith("def f(") and len(out.stdout.encode()) > len("def f(")


@pytest.mark.slow  # runs the trainer
def test_sample_command_errors(run_dir, tmp_path, capsys):
  no_ckpt = tmp_path / "no_ckpt"
  no_ckpt.mkdir()
  shutil.copy(run_dir / "config.json", no_ckpt)
  bad_config = tmp_path / "bad_config"
  bad_config.mkdir()
  (bad_config / "config.json").write_text('{"model": {"dim": ')
  cases = [
      ((tmp_path / "missing", "--prompt", "x", "--max_new_tokens", 4),
       "RUN_DIR expects the run_dir of a `python -m train` run, got"),
      ((no_ckpt, "--prompt", "x", "--max_new_tokens", 4), "RUN_DIR expects a run_dir with a"
       " checkpoint"),
      ((bad_config, "--prompt", "x", "--max_new_tokens", 4), "whose config.json is a trainer"
       " config, got"),
      ((run_dir, "--prompt", "x", "--max_new_tokens", 4, "--top_p", 1.5),
       "--top_p expects a number in (0, 1], got 1.5"),
      ((run_dir, "--prompt", "x" * 65, "--max_new_tokens", 4),
       "--prompt expects at most the model's max_seq_len=64 tokens, got 65"),
      ((run_dir, "--prompt", "x", "--max_new_tokens", 4, "--temperature", "inf"),
       "--temperature expects a finite number >= 0 (0 = greedy), got inf"),
      # 59 + 4 tokens fit in 64, but the prompt is prefilled as 60 and the cache rounds up
      # to 66 slots, a multiple of the 3 devices (the sampler takes the default backend's:
      # a one-device host refuses 3 first).
      ((run_dir, "--prompt", "x" * 59, "--max_new_tokens", 4, "--context_parallel", 3),
       "--max_new_tokens expects at most 3 after a prompt of 59 tokens, padded to 60"
       if jax.device_count() >= 3 else
       f"[1, {jax.device_count()}], got 3; on a CPU host set XLA_FLAGS="),
      ((run_dir, "--prompt", "x", "--max_new_tokens", 4, "--context_parallel", 0),
       f"--context_parallel expects a number of devices in [1, {jax.device_count()}], got 0."),
      # A command line's byte 0xff reaches Python as "\udcff".
      ((run_dir, "--prompt", "def \udcff(", "--max_new_tokens", 4),
       "--prompt expects UTF-8 text, got byte 0xff at character 4"),
      ((run_dir, "--prompt", "x", "--max_new_tokens", 4, "--seed", 46116860184273879040),
       "--seed expects an int in [-2**63, 2**63 - 1] (a 64-bit PRNG seed), got"),
  ]
  for args, message in cases:  # in this process: one line, exit status 2
    assert sample.main([str(a) for a in args]) == 2, args
    line, = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("sample error: ") and message in line, (args, line)
