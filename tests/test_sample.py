"""train.sample: generation as one compiled program equals the full forward's argmax step by
step, alone and for a batch of prompts of different lengths (each row what it gets alone,
greedy or seeded); nucleus and temperature sampling; the end-of-sequence stop; one program
for every max_new_tokens of a bucket; a decode step that never waits for the host; and
`python -m train.sample` on a tiny trained run."""

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
from flaxattn import aot
from helpers import compile_for, normal
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
def _forward(model, tokens, segment_ids=None):
  return model(tokens, segment_ids=segment_ids)


def test_greedy_generation_is_the_full_forward_argmax_step_by_step(windowed):
  new = sample.generate(windowed, PROMPT, 8)
  text = np.concatenate([PROMPT, new])
  logits = np.asarray(_forward(windowed, jnp.asarray(text)[None]))[0]
  # Token i of the text is the argmax of the full forward at position i - 1.
  np.testing.assert_array_equal(np.argmax(logits[len(PROMPT) - 1:-1], axis=-1), new)


# Prompts of 6, 3 and 8 tokens: rows padded to the longest, with a document that ends early.
BATCH = [PROMPT, np.array([33, 2, 60], np.int32), np.array([8, 8, 1, 50, 12, 7, 44, 19], np.int32)]


def test_a_batch_of_prompts_is_the_full_forward_argmax_of_each(windowed):
  """Greedy rows of different lengths, each against the full forward of its own text (one
  padded batch: segment ids keep the texts apart)."""
  new = sample.generate(windowed, BATCH, 8)
  texts = [np.concatenate([p, n]) for p, n in zip(BATCH, new, strict=True)]
  tokens, seg = np.zeros((3, 16), np.int32), np.zeros((3, 16), np.int32)
  for row, text in enumerate(texts):
    tokens[row, :text.size], seg[row, :text.size] = text, 1
  logits = np.asarray(_forward(windowed, jnp.asarray(tokens), jnp.asarray(seg)))
  for row, (prompt, text) in enumerate(zip(BATCH, texts, strict=True)):
    want = np.argmax(logits[row, prompt.size - 1:text.size - 1], axis=-1)
    np.testing.assert_array_equal(want, text[prompt.size:], err_msg=f"row {row}")


def test_a_seeded_batch_draws_what_each_prompt_draws_alone(windowed):
  kwargs = dict(temperature=2.0, top_p=0.9, seed=4)
  alone = [sample.generate(windowed, prompt, 8, **kwargs) for prompt in BATCH]
  batch = sample.generate(windowed, BATCH, 8, **kwargs)
  for a, b in zip(alone, batch, strict=True):
    np.testing.assert_array_equal(a, b)
  assert len({tuple(a) for a in alone}) == 3


def test_generation_stops_at_the_end_token_and_keeps_one_program(windowed):
  """A row ends with its first eos_id (kept); the others go on. Every max_new_tokens in a
  bucket runs the same compiled program: the loop's bound is a run-time value."""
  greedy = sample.generate(windowed, BATCH, 8)
  eos = int(greedy[0][2])
  first = [int(np.flatnonzero(row == eos)[0]) + 1 if eos in row else 8 for row in greedy]
  stopped = sample.generate(windowed, BATCH, 8, eos_id=eos)
  for row, n, want in zip(stopped, first, greedy, strict=True):
    np.testing.assert_array_equal(row, want[:n])
  compiled = sample._generate._cache_size()  # pylint: disable=protected-access
  for n in (5, 7):  # a prompt of 8 and 8 new tokens: the cache's bucket is 16 slots
    got = sample.generate(windowed, BATCH, n)
    for row, want in zip(got, greedy, strict=True):
      np.testing.assert_array_equal(row, want[:n])
  assert sample._generate._cache_size() == compiled  # pylint: disable=protected-access


def test_a_refusal_inside_generate_raises_at_its_return(windowed, monkeypatch):
  """A cache two slots short of the tokens asked for (as if `buckets` were wrong): the
  loop's third step is refused on the device, and generate raises it when it returns,
  naming the cache index."""
  monkeypatch.setattr(sample, "buckets", lambda cp, p, n, limit: (8, 10))
  with pytest.raises(ValueError, match=r"writing 1 token\(s\) at cache index 10 needs 11"
                                       r" slots, the cache has max_length 10"):
    sample.generate(windowed, PROMPT, 4)


@pytest.mark.parametrize("target", [None, "h100", "v5p-8"], ids=["here", "h100", "v5p-8"])
def test_a_decode_step_never_waits_for_the_host(target):
  """The step generate's loop runs (`sample.step`, a 2-layer Llama with the default
  backend, sampling), compiled for this process's devices and by the H100 and v5p
  compilers: no conditional and no host callback (before, 2 conditionals and 6 callback
  references per layer here), nor a loop on the targets (on a CPU the PRNG's rounds are
  one, with its trip count known)."""
  model = Llama(dataclasses.replace(SMALL, attention_backend="auto"), rngs=nnx.Rngs(0))
  model.init_cache(2, 16)
  graphdef, state = nnx.split(model)

  def decode_step(state, tokens_B, positions_B, key):
    m = nnx.merge(graphdef, state)
    return sample.step(m, tokens_B, positions_B, key, 1.0, 0.9), nnx.state(m)

  args = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state),
          jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32),
          jax.ShapeDtypeStruct((), jax.random.key(0).dtype))
  if target is None:
    compiled = jax.jit(decode_step).lower(*args).compile()
  else:
    compiled = compile_for(target, decode_step, *args)
  found = aot.host_syncs(compiled.as_text())
  assert found["conditional"] == found["host_callback"] == 0, found
  assert target is None or found["while"] == 0, found


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
  """One prompt: its text. Two: each after a line naming it, the first as it is alone."""
  args = ["--max_new_tokens", "8", "--temperature", "0.7", "--top_p", "0.9", "--seed", "1"]
  one = trainer.run([sys.executable, "-m", "train.sample", str(run_dir), "--prompt", "def f(",
                     *args])
  assert one.returncode == 0, one.stderr[-3000:]
  assert one.stdout.startswith("def f(") and len(one.stdout.encode()) > len("def f(")
  two = trainer.run([sys.executable, "-m", "train.sample", str(run_dir), "--prompt", "def f(",
                     "--prompt", "import os", *args])
  assert two.returncode == 0, two.stderr[-3000:]
  first, second = two.stdout.split("--- prompt 2\n")
  assert first == "--- prompt 1\n" + one.stdout
  assert second.startswith("import os") and len(second) > len("import os\n")


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
