"""Decoding with the KV cache sharded over the context axis, on simulated CPU devices; and
`train.sample.generate` against its own decode step dispatched from Python.

  python -m bench.decode [--json bench/results/decode_cpu.json] [--lengths 32768 131072]
      [--compare-only] [--backend auto]
  python -m bench.decode --generate [--json bench/results/decode_generate_cpu.json]

Sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax (on a GPU host
the GPUs are the devices: a cp or the prefill needing more than there are is skipped, with
a line saying how many it needs). One
`flaxattn.MultiHeadAttention` layer: in_features 512, H=8 query heads, Hkv=2, D=64,
causal, float32, B=1, `context_parallel=ContextParallel()` (ring, load balanced) on a mesh
`jax.make_mesh((cp,), ("context",))` of the first cp devices, no context parallelism at
cp = 1. For each cache length S and cp:
  1. per-device cache memory: the bytes of device 0's shard of the cached keys, values,
     segment ids and positions (`addressable_shards`), against cp = 1;
  2. per-token decode time: the cache is filled to S - 64 tokens (random keys and values,
     placed as decode steps place them: token j on device j % cp, local slot j // cp),
     then `--steps` one-token decode calls of `nnx.jit(layer, donate the layer)`; the
     median. The cp devices share this host's CPU cores (and the host is shared with other
     work), so wall time compares total work, not parallel speed-up;
  3. bytes one decode step moves between devices: the collectives of the compiled step
     (`flaxattn.aot.collectives`: each collective's result bytes, per device), at every S.
And, compile only, what a ring prefill of `--prefill` tokens moves (cp = 4): collective
permutes of its ring, and an all-gather only of the queries (for the merge with an
already filled cache, skipped at run time while the cache is empty).
Last, on one device, the dense comparison at each S: the layer's per-token decode step
(as in 2., cp = 1) against `jax.nn.dot_product_attention(implementation="xla")` alone over
the same cache (a boolean mask from the cached segment ids and positions), timed in
alternation: medians, bests (the least disturbed by other work on a shared host) and
their ratios. `--compare-only` runs only this part; `--backend blockwise` gives the layer
the kernel its decode steps ran before split_k.

`--generate` runs only this: `train.sample.generate` (prefill and a loop of decode steps in
one compiled program) against `train.sample.step` jitted alone (`jax.jit` over the model's
split state, its cache donated, its next position computed inside) and called back to back
from Python, feeding each step's outputs to the next without reading them, as a serving
loop that dispatches each token would. The model has configs/demo.yaml's sizes (`GEN_CONFIG`:
2 layers, dim 128, vocab 256, float32, the default backend), greedy. Batch 1 and 8 (prompts
of 64, 60, ..., 36 tokens: rows of different lengths). generate runs for each count of new
tokens in `GEN_TOKENS` (224 to 448: one cache bucket of 512 slots, so one compiled program);
its time per token is the slope of a least-squares line through (tokens, seconds): the
prefill, the dispatch and the host's reads are its intercept. The step runs 448 - 224 steps
from the cache a call of 224 tokens leaves. Everything is timed `--repeats` times, in
alternation, by two clocks: the process's CPU time (every thread's, dispatch included:
what a busy shared host leaves steady) and wall time; each figure is the best of its runs
(the least disturbed by other work).
The ratio is generate's time per token over the step's (goal: at most 0.8); tokens/s are
the batch over the time per token; end to end, the batch's tokens of the longest call over
its time, prefill included.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from bench import devices  # noqa: E402
from flaxattn import Causal, ContextParallel, MultiHeadAttention, aot  # noqa: E402
from models.llama import Llama, LlamaConfig  # noqa: E402
from train import sample  # noqa: E402

E, H, HKV, D, B = 512, 8, 2, 64, 1
MIB = 2**20
ROOM = 64  # empty slots left for the timed steps


def _layer(cp, backend="auto"):
  return MultiHeadAttention(H, E, num_kv_heads=HKV, mask=Causal(), context_parallel=cp,
                            backend=backend, rngs=nnx.Rngs(0))


def _fill(m, length: int, n: int, filled: int):
  """The cache as `filled` decode steps would leave it (random keys and values)."""
  slot_J = np.arange(filled) % n * (length // n) + np.arange(filled) // n
  ids, pos = np.zeros((B, length), np.int32), np.zeros((B, length), np.int32)
  ids[:, slot_J], pos[:, slot_J] = 1, np.arange(filled)
  k, v = (jax.random.normal(jax.random.key(i), (B, length, HKV, D), jnp.float32)
          * jnp.asarray(ids)[..., None, None] for i in range(2))
  cache = m.cache
  for var, value in ((cache.keys, k), (cache.values, v), (cache.segment_ids, ids),
                     (cache.positions, pos)):
    var[...] = jax.device_put(jnp.asarray(value), var[...].sharding)
  cache.last[...] = jnp.asarray([[1, filled - 1]], jnp.int32)
  cache.index[...] = jnp.int32(filled)


@nnx.jit(donate_argnums=0)
def _step(m, x):
  return m(x, decode=True)


def _cache_bytes(m) -> int:
  return sum(v[...].addressable_shards[0].data.nbytes
             for v in (m.cache.keys, m.cache.values, m.cache.segment_ids, m.cache.positions))


def decode_case(length: int, n: int, steps: int) -> dict:
  """Cache bytes on device 0, median decode-step seconds and the step's collectives."""
  cp = None if n == 1 else ContextParallel()
  mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
  with jax.set_mesh(mesh):
    m = _layer(cp)
    m.init_cache((B, length, E))
    _fill(m, length, n, length - ROOM)
    x = jax.random.normal(jax.random.key(1), (B, 1, E), jnp.float32)
    graphdef, state = nnx.split(m)
    text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, decode=True)).lower(
        state, x).compile().as_text()
    jax.block_until_ready(_step(m, x))  # compile and warm up
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      jax.block_until_ready(_step(m, x))
      times.append(time.perf_counter() - start)
    cache = _cache_bytes(m)
  moved = aot.collectives(text)
  return dict(length=length, cp=n, cache_bytes_per_device=cache,
              step_seconds=float(np.median(times)),
              collectives={k: v for k, v in moved.items()},
              step_bytes=sum(v["bytes"] for v in moved.values()))


@jax.jit
def _dense(q_BTHD, k_BSKD, v_BSKD, ids_BS, pos_BS, q_pos_B):
  """Plain XLA attention of the new token over the whole cache: what a decode step's
  attention costs without a kernel of ours."""
  allowed_BS = (ids_BS == 1) & (pos_BS <= q_pos_B[:, None])
  return jax.nn.dot_product_attention(q_BTHD, k_BSKD, v_BSKD, mask=allowed_BS[:, None, None],
                                      implementation="xla")


def dense_comparison(length: int, steps: int, backend: str = "auto") -> dict:
  """Median and best seconds of the layer's decode step (cp = 1, `backend`) and of `_dense`
  on a copy of the same cache, timed in alternation, and their ratios."""
  m = _layer(None, backend)
  m.init_cache((B, length, E))
  _fill(m, length, 1, length - ROOM)
  # Copies: the layer's step donates the cache's buffers.
  k, v, ids, pos = (jnp.copy(c[...]) for c in (m.cache.keys, m.cache.values,
                                               m.cache.segment_ids, m.cache.positions))
  q = jax.random.normal(jax.random.key(2), (B, 1, H, D), jnp.float32)
  q_pos = jnp.full((B,), length - ROOM, jnp.int32)
  x = jax.random.normal(jax.random.key(1), (B, 1, E), jnp.float32)
  jax.block_until_ready((_step(m, x), _dense(q, k, v, ids, pos, q_pos)))  # compile, warm up
  layer, dense = [], []
  for _ in range(steps):
    for times, run in ((layer, lambda: _step(m, x)),
                       (dense, lambda: _dense(q, k, v, ids, pos, q_pos))):
      start = time.perf_counter()
      jax.block_until_ready(run())
      times.append(time.perf_counter() - start)
  step, plain = float(np.median(layer)), float(np.median(dense))
  best_step, best_plain = float(np.min(layer)), float(np.min(dense))
  return dict(length=length, step_seconds=step, dense_seconds=plain, ratio=step / plain,
              best_step_seconds=best_step, best_dense_seconds=best_plain,
              best_ratio=best_step / best_plain)


def prefill_collectives(t: int, n: int) -> dict:
  """Collectives of a ring prefill of t tokens into an empty cache of 2t slots (compiled)."""
  mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
  with jax.set_mesh(mesh):
    m = _layer(ContextParallel())
    m.init_cache((B, 2 * t, E))
    graphdef, state = nnx.split(m)
    x = jax.ShapeDtypeStruct((B, t, E), jnp.float32)
    text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, decode=True)).lower(
        state, x).compile().as_text()
  return aot.collectives(text)


def sharded(args):
  """The table of 1.-3. and the prefill's collectives (None with fewer than 4 devices)."""
  cps = [n for n in args.cps if devices.enough(n, f"cp={n}")]
  rows = []
  print("| cache length | cp | cache per device (MiB) | x cp=1 | decode step (ms) | bytes per step"
        " (collectives) |")
  print("|---:|---:|---:|---:|---:|---|")
  for length in args.lengths:
    base = None
    for n in cps:
      row = decode_case(length, n, args.steps)
      base = base or row["cache_bytes_per_device"]
      rows.append(row)
      kinds = ", ".join(f"{k} {v['count']}x {v['bytes']} B" for k, v in row["collectives"].items())
      print(f"| {length} | {n} | {row['cache_bytes_per_device'] / MIB:.2f} |"
            f" {row['cache_bytes_per_device'] / base:.3f} | {row['step_seconds'] * 1e3:.2f} |"
            f" {row['step_bytes']} ({kinds or 'none'}) |", flush=True)
  prefill = None
  if devices.enough(4, "\nring prefill, cp=4"):
    prefill = prefill_collectives(args.prefill, 4)
    print(f"\nring prefill of {args.prefill} tokens, cp=4, per device: "
          + ", ".join(f"{k} {v['count']}x {v['bytes']} B" for k, v in prefill.items()))
  return rows, prefill


# generate's model: configs/demo.yaml's sizes. Its prompts and counts of new tokens whose
# caches share one bucket (64 + 224 to 64 + 448 tokens: 512 slots, one program).
GEN_CONFIG = LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                         ffn_dim=384, max_seq_len=4096)
GEN_PROMPT = 64
GEN_TOKENS = (224, 280, 336, 392, 448)


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _timed(run) -> dict[str, float]:
  """Seconds of `run()` by each of `CLOCKS`."""
  start = {name: clock() for name, clock in CLOCKS.items()}
  run()
  return {name: clock() - start[name] for name, clock in CLOCKS.items()}


def generation(batch: int, repeats: int) -> dict:
  """Seconds per token of `generate` and of its step called back to back, for `batch`
  prompts, by each clock (see the module doc)."""
  model = Llama(GEN_CONFIG, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(batch)
  prompts = [rng.integers(0, GEN_CONFIG.vocab_size, GEN_PROMPT - 4 * i).astype(np.int32)
             for i in range(batch)]
  few, many = GEN_TOKENS[0], GEN_TOKENS[-1]
  lengths = jnp.asarray([p.size for p in prompts], jnp.int32)

  def after_few():
    """The model split after a call of `few` tokens, its last tokens and their positions."""
    last = sample.generate(model, prompts, few)
    return (*nnx.split(model, nnx.Cache, ...), jnp.asarray([row[-1] for row in last], jnp.int32),
            lengths + few - 1)

  graphdef, *first = after_few()

  def stepped(cache, rest, tokens_B, positions_B):  # the cache donated, as in generate
    m = nnx.merge(graphdef, cache, rest)
    next_B = sample.step(m, tokens_B, positions_B, jax.random.key(0), 0, 1.0)
    return nnx.state(m, nnx.Cache), next_B, positions_B + 1
  compiled = jax.jit(stepped, donate_argnums=0).lower(*first).compile()

  def steps() -> dict[str, float]:
    """Seconds of `many - few` steps from where a call of `few` tokens left the cache."""
    _, cache, rest, tokens_B, positions_B = after_few()

    def run():
      nonlocal cache, tokens_B, positions_B
      for _ in range(many - few):
        cache, tokens_B, positions_B = compiled(cache, rest, tokens_B, positions_B)
      jax.block_until_ready(tokens_B)
    return _timed(run)

  for n in GEN_TOKENS:
    sample.generate(model, prompts, n)  # compiled and warmed up
  times: dict[int | str, list[dict[str, float]]] = {n: [] for n in (*GEN_TOKENS, "step")}
  for _ in range(repeats):
    for n in GEN_TOKENS:
      times[n].append(_timed(lambda n=n: sample.generate(model, prompts, n)))
    times["step"].append(steps())
  row: dict = dict(batch=batch, prompt_tokens=[p.size for p in prompts],
                   new_tokens=list(GEN_TOKENS))
  for clock in CLOCKS:
    best = {n: min(t[clock] for t in runs) for n, runs in times.items()}
    per_token, fixed = (float(x) for x in np.polyfit(GEN_TOKENS, [best[n] for n in GEN_TOKENS],
                                                      1))
    step = best["step"] / (many - few)
    row[clock] = dict(generate_best_s=[best[n] for n in GEN_TOKENS], generate_per_token_s=per_token,
                      generate_fixed_s=fixed, step_per_token_s=step, ratio=per_token / step,
                      generate_tokens_per_s=batch / per_token, step_tokens_per_s=batch / step,
                      generate_end_to_end_tokens_per_s=batch * many / best[many])
  return row


def generate_table(repeats: int) -> list[dict]:
  c = GEN_CONFIG
  print(f"\ngenerate against its step called back to back: Llama of {c.n_layers} layers, dim"
        f" {c.dim}, vocab {c.vocab_size}, {c.dtype}, greedy; prompts of {GEN_PROMPT} tokens and"
        f" fewer; {GEN_TOKENS} new tokens; bests of {repeats}")
  print("| batch | clock | generate per token (ms) | step back to back (ms) | ratio |"
        " generate tokens/s | step tokens/s | generate end to end tokens/s |")
  print("|---:|---|---:|---:|---:|---:|---:|---:|")
  rows = []
  for batch in (1, 8):
    row = generation(batch, repeats)
    rows.append(row)
    for clock in CLOCKS:
      r = row[clock]
      print(f"| {batch} | {clock} | {r['generate_per_token_s'] * 1e3:.3f} |"
            f" {r['step_per_token_s'] * 1e3:.3f} | {r['ratio']:.2f} |"
            f" {r['generate_tokens_per_s']:.0f} | {r['step_tokens_per_s']:.0f} |"
            f" {r['generate_end_to_end_tokens_per_s']:.0f} |", flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
  parser.add_argument("--cps", type=int, nargs="+", default=[1, 4, 8])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--prefill", type=int, default=8192)
  parser.add_argument("--json", default=None)
  parser.add_argument("--compare-only", action="store_true",
                      help="only the dense comparison on one device")
  parser.add_argument("--generate", action="store_true",
                      help="only train.sample.generate against its step called back to back")
  parser.add_argument("--repeats", type=int, default=9,
                      help="timed runs of each figure in the --generate comparison")
  parser.add_argument("--backend", default="auto",
                      help="the layer's backend in the dense comparison (blockwise: what decode"
                      " steps ran before split_k)")
  args = parser.parse_args()
  if args.generate:
    rows = generate_table(args.repeats)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(dict(command=" ".join(["python -m bench.decode", *sys.argv[1:]]),
                       jax=jax.__version__, device=jax.devices()[0].device_kind,
                       load_average=os.getloadavg(), config=dataclasses.asdict(GEN_CONFIG),
                       generate=rows), f, indent=1, default=str)
    return
  rows, prefill = [], None
  if not args.compare_only:
    rows, prefill = sharded(args)
  print("\n| cache length S | decode step, layer (ms) | jax.nn xla attention (ms) | ratio |"
        " best step (ms) | best attention (ms) | ratio of bests |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  dense = []
  for length in args.lengths:
    row = dense_comparison(length, args.steps, args.backend)
    dense.append(row)
    print(f"| {length} | {row['step_seconds'] * 1e3:.2f} | {row['dense_seconds'] * 1e3:.2f} |"
          f" {row['ratio']:.2f} | {row['best_step_seconds'] * 1e3:.2f} |"
          f" {row['best_dense_seconds'] * 1e3:.2f} | {row['best_ratio']:.2f} |", flush=True)
  if args.json:
    result = dict(dense_comparison=dict(backend=args.backend, rows=dense))
    if rows:
      result = dict(decode=rows, prefill=prefill and dict(tokens=args.prefill, cp=4,
                                                          collectives=prefill), **result)
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
