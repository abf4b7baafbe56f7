"""`python -m train.sample RUN_DIR --prompt TEXT [--prompt TEXT ...] --max_new_tokens N`:
text from a trained run.

  python -m train.sample runs/demo --prompt "def main(" --max_new_tokens 64
  python -m train.sample runs/demo --prompt "import " --prompt "class " --max_new_tokens 64 \\
      --temperature 0.8 --top_p 0.95 --seed 1

The run's config.json gives the model, its copy of its tokenizer's files (or
data.tokenizer) the tokenizer; its newest checkpoint gives the parameters, read without
changing the run_dir (`train.export.restore_model`; a run may still be training there); a
`scan_layers` model is decoded through `models.llama.unroll_layers`. Each prompt is one
document from position 0, beginning with the special tokens the run's tokenizer begins a
document with (`Tokenizer.document`; no end). Several prompts are one batch, each row what
that prompt alone would give. `generate` runs as one compiled program: one decode call fills
the KV cache with the prompts (prefill), then a loop on the device draws a token per prompt
per step, until `--max_new_tokens` or the tokenizer's EOS token (where it has one) in every
row. Greedy at temperature 0, else temperature and nucleus (top-p) sampling with a JAX PRNG
key from the seed. Runs on one device of the run's platform; with `--context_parallel N`, on
a mesh of N devices (axis `context`) with the run's `context_parallel` strategy and load
balancing: each layer's KV cache is sharded over them (N simulated devices on a CPU host
need XLA_FLAGS=--xla_force_host_platform_device_count=N). Greedy tokens are the same either
way. Prints each prompt followed by its new text (several: each after a line
`--- prompt I`).

Exit status 0; 2 for a bad argument or run_dir (one line naming it, before anything is
allocated or compiled: the KV cache's length is checked as it will be allocated, the prompt
padded to split over the devices); 1 when the newest checkpoint does not restore
(`train.checkpoint.CheckpointError`); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import flaxattn
from flaxattn import balance
from flaxattn import decode as cp_decode
from models.llama import Llama, unroll_layers


def next_token(logits_BV: jax.Array, key: jax.Array, temperature, top_p) -> jax.Array:
  """The next token `[B]` int32 of each row from its logits `[B, V]`.

  Args:
    logits_BV: next-token logits.
    key: a JAX PRNG key (unused at temperature 0). Every row draws with it as it would
      alone (a batch of one), so a row's tokens do not depend on the rows beside it.
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

  def draw(logits_V):  # the key is not mapped: each row's noise is a batch of one's
    return jax.random.categorical(key, logits_V[None], axis=-1)[0]
  return jax.vmap(draw)(logits_BV).astype(jnp.int32)


def step(model: Llama, tokens_B, positions_B, key, temperature, top_p):
  """A decode step: the next token `[B]` int32 of each row after `tokens_B` `[B]` int at
  `positions_B` `[B]` int32 (each row's position in its document, segment id 1), appended
  to the model's KV caches; sampled as `next_token` samples. One step of `generate`'s loop,
  and what a caller that dispatches each token itself would jit."""
  ids_B1 = jnp.ones((tokens_B.shape[0], 1), jnp.int32)
  logits_B1V = model(tokens_B[:, None], segment_ids=ids_B1, positions=positions_B[:, None],
                     decode=True)
  return next_token(logits_B1V[:, 0], key, temperature, top_p)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames="cache")
def _generate(graphdef, cache, rest, tokens_BP, ids_BP, pos_BP, last_B, keys_N, temperature,
              top_p, max_new_tokens, eos_id, greedy: bool):
  """The whole of `generate` on the device: (new tokens `[B, N]`, how many of them are
  generated, the KV caches after them). The prompts `[B, P]` (padding: segment id 0, each
  row's last prompt token at `last_B`) fill the caches in one call; then a loop of `step`s
  while fewer than `max_new_tokens` are out and some row has not drawn `eos_id`. N is the
  static length of `keys_N`; `max_new_tokens` and `eos_id` are run-time values, so one
  program serves every count up to N."""
  model = nnx.merge(graphdef, cache, rest)
  temperature = 0 if greedy else temperature
  x_BPE = model.hidden(model.embeddings(tokens_BP), segment_ids=ids_BP, positions=pos_BP,
                       decode=True)
  x_B1E = jnp.take_along_axis(x_BPE, last_B[:, None, None], axis=1)
  token_B = next_token(model.logits(x_B1E)[:, 0], keys_N[0], temperature, top_p)
  out_BN = jnp.zeros((token_B.shape[0], keys_N.shape[0]), jnp.int32).at[:, 0].set(token_B)
  next_B = jnp.max(jnp.where(ids_BP != 0, pos_BP, -1), axis=1) + 1  # the first new position

  def more(carry):
    n, _, done_B, _, _ = carry
    return (n < max_new_tokens) & ~jnp.all(done_B)

  def one(carry):
    n, token_B, done_B, out_BN, cache = carry
    model = nnx.merge(graphdef, cache, rest)
    token_B = step(model, token_B, next_B + n - 1, keys_N[n], temperature, top_p)
    out_BN = lax.dynamic_update_slice_in_dim(out_BN, token_B[:, None], n, axis=1)
    return n + 1, token_B, done_B | (token_B == eos_id), out_BN, nnx.state(model, nnx.Cache)

  carry = (jnp.int32(1), token_B, token_B == eos_id, out_BN, nnx.state(model, nnx.Cache))
  n, _, _, out_BN, cache = lax.while_loop(more, one, carry)
  return out_BN, n, cache


def _prompt_rows(cp, prompts: list[np.ndarray], t: int):
  """The prompts as rows `[B, t]` for one prefill: tokens, segment ids (1, then 0 for the
  padding after each prompt, never attended), positions, in `flaxattn.load_balance` order
  where `cp` balances; and the array index `[B]` of each row's last prompt token."""
  b = len(prompts)
  tokens, seg, pos = (np.zeros((b, t), np.int32) for _ in range(3))
  for row, prompt in enumerate(prompts):
    real = slice(0, prompt.size)
    tokens[row, real], seg[row, real], pos[row, real] = prompt, 1, np.arange(prompt.size)
  order = np.broadcast_to(np.arange(t), (b, t))
  if cp is not None and cp.load_balance and cp.balanced_shards() > 1:
    tokens, seg, pos, order = (np.asarray(balance.load_balance(x, cp.balanced_shards()))
                               for x in (tokens, seg, pos, order))
  last = [int(np.argmax(order[row] == prompt.size - 1)) for row, prompt in enumerate(prompts)]
  return tokens, seg, pos, np.asarray(last, np.int32)


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


def _multiples(cp) -> tuple[int, int]:
  """What the prefill's length and the cache's must be multiples of under context
  parallelism `cp` (None: one device): what a prefill splits into, and the shards."""
  if cp is None:
    return 1, 1
  return cp_decode.prefill_multiple(cp), cp_decode.shards(cp)


def _cache_length(cp, prompt_tokens: int, max_new_tokens: int) -> tuple[int, int]:
  """(the prompt's length as prefilled, the KV cache's length), the least that fit
  `max_new_tokens` after a prompt of `prompt_tokens`: under context parallelism `cp` the
  prompt is padded to a multiple of what a prefill splits into, and the cache to a multiple
  of the shards."""
  parts, shards = _multiples(cp)
  prefill = -(-prompt_tokens // parts) * parts
  return prefill, -(-(prefill + max_new_tokens) // shards) * shards


def _bucket(n: int, multiple: int, most: int) -> int:
  """The least `multiple * 2**k` >= n, at most `most`; n rounded up to `multiple` where that
  is more."""
  b = multiple
  while b < n:
    b *= 2
  return max(min(b, most), -(-n // multiple) * multiple)


def buckets(cp, prompt_tokens: int, max_new_tokens: int, max_seq_len: int) -> tuple[int, int]:
  """(the prompt's length as prefilled, the KV cache's length) as `generate` allocates them:
  each padded to a power of two times its multiple (`_cache_length`), at most max_seq_len,
  so that one compiled program serves every prompt length and `max_new_tokens` of the same
  buckets. Where a bucket would not fit, the least length that does (`_cache_length`)."""
  parts, shards = _multiples(cp)
  most = max_seq_len // shards * shards
  prefill = _bucket(prompt_tokens, parts, (most - max_new_tokens) // parts * parts)
  return prefill, _bucket(prefill + max_new_tokens, shards, most)


def _as_prompts(prompts) -> tuple[list[np.ndarray], bool]:
  """(the prompts as int32 arrays, whether one prompt `[P]` was given rather than a list).

  Raises:
    ValueError: a prompt that is not `[P]` token ids, or no prompt.
  """
  one = not (isinstance(prompts, (list, tuple)) and prompts
             and all(np.ndim(p) == 1 for p in prompts))
  found = [np.asarray(prompts, np.int32)] if one else [np.asarray(p, np.int32) for p in prompts]
  for i, prompt in enumerate(found):
    if prompt.ndim != 1:
      which = "" if one else f" {i}"
      raise ValueError(f"generate(prompts=...) expects token ids of shape [P] or a list of"
                       f" them, got prompt{which} of shape {prompt.shape}.")
  return found, one


def generate(model: Llama, prompts, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             context_parallel=None):
  """Up to `max_new_tokens` tokens continuing each prompt, decoded with a KV cache in one
  compiled program: the prompts fill the caches in one call (prefill), then a
  `lax.while_loop` draws one token per row per step, on the device, until `max_new_tokens`
  or until every row has drawn `eos_id`.

  Prompts of different lengths share the batch: each row is padded after its prompt
  (segment id 0: never attended) and continues from its own position, so each row's
  tokens are those it would get alone, with the same seed. The prompt is padded to a power
  of two and the cache to a power of two (at most the model's max_seq_len;
  `buckets`), and the loop's bound is a run-time value: every `max_new_tokens` whose cache
  falls in the same bucket (and every prompt length in the same bucket) runs the same
  compiled program.

  Args:
    model: a `Llama` of the unrolled layout (see `models.llama.unroll_layers`); its KV
      caches are (re)allocated for `len(prompt) + max_new_tokens` tokens (bucketed). With
      its `context_parallel` set, call under the mesh: the prompts are padded to a length
      that splits over the sequence shards (in load-balanced order where it balances),
      prefilled with the strategy, and the caches are sharded (`Llama.init_cache`).
    prompts: token ids `[P]` int, one document from position 0; or a list of them, of any
      lengths (a batch).
    max_new_tokens: how many tokens to generate per prompt at most.
    temperature: 0 for greedy decoding, else the sampling temperature.
    top_p: nucleus sampling mass in (0, 1] (see `next_token`).
    seed: the PRNG seed of the sampling: token i of every row is drawn with the i-th key
      of `jax.random.split(jax.random.key(seed), ...)`, so the same seed draws the same
      tokens, alone or in a batch.
    eos_id: a token id that ends a row's continuation (kept as its last token); None:
      every row runs to `max_new_tokens`.
    context_parallel: a `flaxattn.ContextParallel` the model decodes with from now on (see
      `Llama.init_cache`); None: the model's own.

  Returns:
    For one prompt `[P]`: its new token ids `[N]` int32 (numpy), N = `max_new_tokens`, or
    fewer when it ends with `eos_id`. For a list: a list of them, one per prompt.

  Raises:
    ValueError: a prompt not `[P]` or empty, `max_new_tokens` < 1, `temperature` not
      finite or < 0, `top_p` outside (0, 1], a `seed` out of `SEED_RANGE`, or a KV cache
      (the longest prompt and new tokens, padded under context parallelism) longer than
      the model's max_seq_len; before anything is allocated or compiled. After the
      program, a decode call its KV caches refused (`flaxattn.KVCache.check`).
  """
  prompts, one = _as_prompts(prompts)
  limit = model.config.max_seq_len
  for prompt in prompts:
    if prompt.size == 0:
      raise ValueError(f"--prompt expects text of at least one token, got {prompt.size}"
                       " tokens.")
    if prompt.size > limit:
      raise ValueError(f"--prompt expects at most the model's max_seq_len={limit} tokens, got"
                       f" {prompt.size}; shorten the prompt.")
  check_sampling(max_new_tokens, temperature, top_p, seed)
  cp = context_parallel or model.context_parallel
  longest = max(prompt.size for prompt in prompts)
  prefill, slots = _cache_length(cp, longest, max_new_tokens)
  if slots > limit:
    shards = 1 if cp is None else cp_decode.shards(cp)
    padded = "" if cp is None else (f", padded to {prefill} to split over {shards} devices,"
                                    f" the cache to a multiple of {shards}")
    most = limit // shards * shards - prefill
    if most < 1:
      raise ValueError(f"--prompt of {longest} tokens{padded} leaves no room for a new token"
                       f" in max_seq_len={limit}; shorten the prompt.")
    raise ValueError(f"--max_new_tokens expects at most {most} after a prompt of {longest}"
                     f" tokens{padded} (max_seq_len={limit}), got {max_new_tokens}; generate"
                     " fewer tokens or shorten the prompt.")
  prefill, slots = buckets(cp, longest, max_new_tokens, limit)
  tokens, ids, pos, last = _prompt_rows(cp, prompts, prefill)
  model.init_cache(len(prompts), slots, context_parallel=cp)
  graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)
  # Token i is drawn with key i, as many keys as the cache has room for (a prefix of a
  # longer split is the same keys, so the bucket does not change the draws).
  keys_N = jax.random.split(jax.random.key(seed), slots - prefill)
  out_BN, n, cache = _generate(
      graphdef, cache, rest, tokens, ids, pos, last, keys_N, jnp.float32(temperature),
      jnp.float32(top_p), jnp.int32(max_new_tokens), jnp.int32(-1 if eos_id is None else eos_id),
      greedy=temperature == 0)
  nnx.update(model, cache)
  for _, cache in nnx.iter_modules(model):  # the host's read of the caches after the loop
    if isinstance(cache, flaxattn.KVCache):
      cache.check()
  out_BN = np.asarray(out_BN)[:, :int(n)]
  rows = [row[:_ends(row, eos_id)] for row in out_BN]
  return rows[0] if one else rows


def _ends(row: np.ndarray, eos_id: int | None) -> int:
  """How many tokens of `row` are its continuation: up to its first `eos_id`, kept."""
  hits = np.flatnonzero(row == eos_id) if eos_id is not None else np.zeros(0, int)
  return int(hits[0]) + 1 if hits.size else row.size


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
  parser.add_argument("--prompt", required=True, action="append",
                      help="the text to continue; repeat it for a batch of prompts")
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
    for prompt in args.prompt:
      check_prompt(prompt)
    model, tok, _ = load(args.run_dir)
    with on_mesh(model, args.run_dir, args.context_parallel) as cp:
      new = generate(model, [tok.document(p, end=False) for p in args.prompt],
                     args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                     seed=args.seed, eos_id=tok.eos_id, context_parallel=cp)
  except checkpoint.CheckpointError as e:
    print(f"checkpoint error: {e}", file=sys.stderr)
    return 1
  except ValueError as e:  # one line, as the trainer's errors (argparse's own add the usage)
    print(f"sample error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("sample interrupted.", file=sys.stderr)
    return 130
  for i, (prompt, tokens) in enumerate(zip(args.prompt, new, strict=True)):
    if len(args.prompt) > 1:
      print(f"--- prompt {i + 1}")
    print(prompt + tok.decode(tokens))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
