"""`python -m train.sample RUN_DIR --prompt TEXT --max_new_tokens N`: text from a trained run.

  python -m train.sample runs/demo --prompt "def main(" --max_new_tokens 64
  python -m train.sample runs/demo --prompt "import " --max_new_tokens 64 \\
      --temperature 0.8 --top_p 0.95 --seed 1

The run's config.json gives the model, its copy of its tokenizer's files (or
data.tokenizer) the tokenizer; its newest checkpoint gives the parameters, read without
changing the run_dir (`train.export.restore_model`; a run may still be training there); a
`scan_layers` model is decoded through `models.llama.unroll_layers`. The prompt is one
document from position 0, beginning with the special tokens the run's tokenizer begins a
document with (`Tokenizer.document`; no end): one decode call fills the KV cache with it
(prefill), then each new token is one decode call. Greedy at temperature 0, else
temperature and nucleus (top-p) sampling with a JAX PRNG key from the seed. Runs on one
device of the run's platform; with `--context_parallel N`, on a mesh of N devices (axis
`context`) with the run's `context_parallel` strategy and load balancing: each layer's KV
cache is sharded over them (N simulated devices on a CPU host need
XLA_FLAGS=--xla_force_host_platform_device_count=N). Greedy tokens are the same either
way. Prints the prompt followed by the new text.

Exit status 0; 2 for a bad argument or run_dir (one line naming it, before anything is
allocated or compiled: the KV cache's length is checked as it will be allocated, the prompt
padded to split over the devices); 1 when the newest checkpoint does not restore
(`train.checkpoint.CheckpointError`); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxattn import balance
from flaxattn import decode as cp_decode
from models.llama import Llama, unroll_layers


def next_token(logits_BV: jax.Array, key: jax.Array, temperature, top_p) -> jax.Array:
  """The next token `[B]` int32 of each row from its logits `[B, V]`.

  Args:
    logits_BV: next-token logits.
    key: a JAX PRNG key (unused at temperature 0).
    temperature: 0 (a Python number) for the argmax; else a float or traced scalar > 0 that
      divides the logits before sampling.
    top_p: nucleus sampling: only the most probable tokens whose probabilities sum to at
      least `top_p` are drawn from (the most probable one always); 1 keeps every token.

  `generate` checks both values (`check_sampling`); this function does not.
  """
  if isinstance(temperature, (int, float)) and temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV.astype(jnp.float32) / temperature
  probs_BV = jax.nn.softmax(logits_BV, axis=-1)
  sorted_BV = jnp.flip(jnp.sort(probs_BV, axis=-1), axis=-1)
  # A token is kept when the mass of the more probable ones is still below top_p.
  kept_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV < top_p
  least_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  logits_BV = jnp.where(probs_BV >= least_B1, logits_BV, -jnp.inf)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


@nnx.jit(static_argnames="greedy")
def _decode(model: Llama, tokens_BT, key, temperature, top_p, greedy: bool, ids=(None, None),
            last=-1):
  # One program for every temperature > 0 and top_p: only greediness is static.
  logits_BTV = model(tokens_BT, segment_ids=ids[0], positions=ids[1], decode=True)
  return next_token(logits_BTV[:, last], key, 0 if greedy else temperature, top_p)


def _sharded_prompt(cp, prompt, t: int):
  """A prompt laid out for a context-parallel prefill: padded (segment id 0) to `t` tokens
  (`_cache_length`), in load-balanced order when `cp` balances; returns (tokens, (segment
  ids, positions)) `[1, t]` and the array index of the last prompt token."""
  tokens, seg, pos = (np.zeros((1, t), np.int32) for _ in range(3))
  real = slice(0, prompt.size)
  tokens[0, real], seg[0, real], pos[0, real] = prompt, 1, np.arange(prompt.size)
  order = np.arange(t)[None]
  if cp.load_balance and cp.balanced_shards() > 1:
    tokens, seg, pos, order = (balance.load_balance(x, cp.balanced_shards())
                               for x in (tokens, seg, pos, order))
  return tokens, (seg, pos), int(np.argmax(order[0] == prompt.size - 1))


# jax.random.key takes a seed that fits a signed 64-bit int.
SEED_RANGE = (-2**63, 2**63 - 1)


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int = 0) -> None:
  """Checks the arguments of `generate` that need no model.

  Raises:
    ValueError: `max_new_tokens` < 1, `temperature` not finite or < 0, `top_p` outside
      (0, 1], or `seed` not an int in `SEED_RANGE`.
  """
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"--max_new_tokens expects a positive int, got {max_new_tokens!r}.")
  if isinstance(seed, bool) or not isinstance(seed, int) or not (
      SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
    raise ValueError(f"--seed expects an int in [-2**63, 2**63 - 1] (a 64-bit PRNG seed), got"
                     f" {seed!r}.")
  if not (math.isfinite(temperature) and temperature >= 0):
    raise ValueError(f"--temperature expects a finite number >= 0 (0 = greedy), got"
                     f" {temperature!r}.")
  if not 0 < top_p <= 1:
    raise ValueError(f"--top_p expects a number in (0, 1], got {top_p!r}.")


def check_prompt(text: str) -> None:
  """Refuses a prompt that is not text: a command line's bytes that are not UTF-8 reach
  Python as lone surrogates (`\\udcff` for byte 0xff), which no tokenizer encodes.

  Raises:
    ValueError naming --prompt, the byte and its place.
  """
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    char = text[e.start]
    byte = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else repr(char)
    raise ValueError(f"--prompt expects UTF-8 text, got {byte} at character {e.start}, which is"
                     " not UTF-8; pass the prompt in UTF-8.") from None


def _cache_length(cp, prompt_tokens: int, max_new_tokens: int) -> tuple[int, int]:
  """(the prompt's length as prefilled, the KV cache's length) for `max_new_tokens` after
  a prompt of `prompt_tokens`: under context parallelism `cp` the prompt is padded to a
  multiple of what a prefill splits into, and the cache to a multiple of the shards."""
  if cp is None:
    return prompt_tokens, prompt_tokens + max_new_tokens
  parts, shards = cp_decode.prefill_multiple(cp), cp_decode.shards(cp)
  prefill = -(-prompt_tokens // parts) * parts
  return prefill, -(-(prefill + max_new_tokens) // shards) * shards


def generate(model: Llama, prompt, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, context_parallel=None) -> np.ndarray:
  """`max_new_tokens` tokens continuing `prompt`, decoded with a KV cache.

  Args:
    model: a `Llama` of the unrolled layout (see `models.llama.unroll_layers`); its KV
      cache is (re)allocated for `len(prompt) + max_new_tokens` tokens. With its
      `context_parallel` set, call under the mesh: the prompt is padded to a length that
      splits over the sequence shards (in load-balanced order where it balances), prefilled
      with the strategy, and the cache is sharded (`Llama.init_cache`).
    context_parallel: a `flaxattn.ContextParallel` the model decodes with from now on (see
      `Llama.init_cache`); None: the model's own.
    prompt: token ids `[P]` int, one document from position 0.
    max_new_tokens: how many tokens to generate.
    temperature: 0 for greedy decoding, else the sampling temperature.
    top_p: nucleus sampling mass in (0, 1] (see `next_token`).
    seed: the PRNG seed of the sampling; the same seed draws the same tokens.

  Returns:
    the new token ids `[max_new_tokens]` int32 (numpy).

  Raises:
    ValueError: a prompt not `[P]` or empty, `max_new_tokens` < 1, `temperature` not
      finite or < 0, `top_p` outside (0, 1], a `seed` out of `SEED_RANGE`, or a KV cache
      (prompt and new tokens, padded under context parallelism) longer than the model's
      max_seq_len; before anything is allocated or compiled.
  """
  prompt = np.asarray(prompt, np.int32)
  limit = model.config.max_seq_len
  if prompt.ndim != 1:
    raise ValueError(f"generate(prompt=...) expects token ids of shape [P], got shape"
                     f" {prompt.shape}.")
  if prompt.size == 0:
    raise ValueError(f"--prompt expects text of at least one token, got {prompt.size} tokens.")
  if prompt.size > limit:
    raise ValueError(f"--prompt expects at most the model's max_seq_len={limit} tokens, got"
                     f" {prompt.size}; shorten the prompt.")
  check_sampling(max_new_tokens, temperature, top_p, seed)
  cp = context_parallel or model.context_parallel
  prefill, slots = _cache_length(cp, prompt.size, max_new_tokens)
  if slots > limit:
    shards = 1 if cp is None else cp_decode.shards(cp)
    padded = "" if cp is None else (f", padded to {prefill} to split over {shards} devices,"
                                    f" the cache to a multiple of {shards}")
    most = limit // shards * shards - prefill
    if most < 1:
      raise ValueError(f"--prompt of {prompt.size} tokens{padded} leaves no room for a new token"
                       f" in max_seq_len={limit}; shorten the prompt.")
    raise ValueError(f"--max_new_tokens expects at most {most} after a prompt of {prompt.size}"
                     f" tokens{padded} (max_seq_len={limit}), got {max_new_tokens}; generate"
                     " fewer tokens or shorten the prompt.")
  keys = jax.random.split(jax.random.key(seed), max_new_tokens)
  args = (jnp.float32(temperature), jnp.float32(top_p), temperature == 0)
  if cp is None:
    model.init_cache(1, slots)
    token_B = _decode(model, jnp.asarray(prompt)[None], keys[0], *args)
  else:  # explicit ids: the padding of the prompt is never attended
    tokens, ids, last = _sharded_prompt(cp, prompt, prefill)
    model.init_cache(1, slots, context_parallel=cp)
    token_B = _decode(model, jnp.asarray(tokens), keys[0], *args, ids=ids, last=last)
  out = [token_B]
  for i, key in enumerate(keys[1:]):
    ids = (None, None) if cp is None else (np.ones((1, 1), np.int32),
                                           np.full((1, 1), prompt.size + i, np.int32))
    token_B = _decode(model, token_B[:, None], key, *args, ids=ids)
    out.append(token_B)
  return np.asarray(jnp.concatenate(out))


def load(run_dir: str):
  """`(model, tokenizer, step)` of `run_dir`'s newest checkpoint.

  The model is unrolled (ready for `generate`) and on the default device of the run's
  platform. Nothing in `run_dir` changes. `run_dir` may be a `gs://` URL (`train.storage`).

  Raises:
    ValueError: `run_dir` is a URL that cannot be read (`train.storage.check`), is not a
      directory, has no checkpoint, or no config.json that
      is a valid trainer config; the run's tokenizer cannot be made or its platform does
      not start here (`train.config.ConfigError`).
    train.checkpoint.CheckpointError: the newest checkpoint does not restore.
  """
  from train import config, distributed, storage
  from train import run_dir as run_dir_lib
  from train.distributed import jax_platforms
  from train.export import restore_model

  storage.check(run_dir, "RUN_DIR")
  path = storage.path(run_dir)
  if not path.is_dir():
    raise ValueError(f"RUN_DIR expects the run_dir of a `python -m train` run, got {run_dir!r},"
                     " which is not a directory.")
  if not (path / "config.json").is_file():
    raise ValueError(f"RUN_DIR expects a run_dir with config.json (written with each"
                     f" checkpoint), got {run_dir!r} without one; pass the run_dir of a run"
                     " that saved a checkpoint.")
  try:
    cfg = run_dir_lib.saved_config(run_dir)
  except config.ConfigError as e:
    raise ValueError(f"RUN_DIR expects a run_dir whose config.json is a trainer config, got"
                     f" {run_dir!r}, where it is not: {str(e).rstrip('.')}. Restore"
                     " config.json or pass another run_dir.") from None
  ckpt_dir = path / "checkpoints"
  if not ckpt_dir.is_dir() or not any(p.name.isdigit() for p in ckpt_dir.iterdir()):
    raise ValueError(f"RUN_DIR expects a run_dir with a checkpoint, got {run_dir!r} with none in"
                     f" {ckpt_dir}; train longer (checkpoint_every) or pass another run_dir.")
  if cfg.platform:
    jax.config.update("jax_platforms", jax_platforms(cfg.platform))
  tok = run_dir_lib.load_tokenizer(run_dir, cfg)
  distributed.start_backend(cfg.platform, f"the run's platform ({path / 'config.json'})",
                            "sample on a machine with that platform")
  step, model = restore_model(run_dir, cfg, jax.devices()[0])
  return unroll_layers(model), tok, step


@contextlib.contextmanager
def on_mesh(model: Llama, run_dir: str, n: int, devices=None):
  """With n > 1: a mesh of n of `devices` (default `jax.devices()`; axis `context`) set
  around the block, the model's parameters replicated on it; yields a `ContextParallel`
  over `context` with the run's strategy and the dual-chunk order. n = 1: nothing changes,
  yields None.

  Raises:
    ValueError: n < 1 or more than the devices there are.
  """
  from jax.sharding import AxisType, NamedSharding, PartitionSpec

  import flaxattn
  from train import run_dir as run_dir_lib

  devices = jax.devices() if devices is None else devices
  if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(devices):
    more = (isinstance(n, int) and not isinstance(n, bool) and n > len(devices))
    raise ValueError(f"--context_parallel expects a number of devices in [1,"
                     f" {len(devices)}], got {n!r}" + (
                         f"; on a CPU host set XLA_FLAGS=--xla_force_host_platform_device_count"
                         f"={n} to simulate them." if more else "."))
  if n == 1:
    yield None
    return
  run = run_dir_lib.saved_config(run_dir).context_parallel
  mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,), devices=devices[:n])
  state = jax.device_put(nnx.state(model), NamedSharding(mesh, PartitionSpec()))
  nnx.update(model, state)
  with jax.set_mesh(mesh):
    # The prompt's token order is the sampler's own: dual chunk (the prefill's output is the
    # same in any order), whatever order the run trained in.
    yield flaxattn.ContextParallel("context", strategy=run.strategy, load_balance=True)


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m train.sample", description=(__doc__ or "").split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dir", metavar="RUN_DIR", help="the run_dir of a `python -m train` run")
  parser.add_argument("--prompt", required=True, help="the text to continue")
  parser.add_argument("--max_new_tokens", type=int, required=True, help="tokens to generate")
  parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
  parser.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]")
  parser.add_argument("--seed", type=int, default=0, help="PRNG seed of the sampling")
  parser.add_argument("--context_parallel", type=int, default=1, metavar="N",
                      help="shard the KV cache over N devices with the run's context_parallel"
                      " strategy (default 1: one device)")
  args = parser.parse_args(argv)
  from train import checkpoint

  for noisy in ("orbax", "jax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax notes that it reads read-only
  try:
    check_sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    check_prompt(args.prompt)
    model, tok, _ = load(args.run_dir)
    with on_mesh(model, args.run_dir, args.context_parallel) as cp:
      new = generate(model, tok.document(args.prompt, end=False), args.max_new_tokens,
                     temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                     context_parallel=cp)
  except checkpoint.CheckpointError as e:
    print(f"checkpoint error: {e}", file=sys.stderr)
    return 1
  except ValueError as e:  # one line, as the trainer's errors (argparse's own add the usage)
    print(f"sample error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("sample interrupted.", file=sys.stderr)
    return 130
  print(args.prompt + tok.decode(new))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
