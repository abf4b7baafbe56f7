"""The GPU goals that `bench.gpu`'s table does not hold, on one NVIDIA GPU, in one run:

  python -m bench.gpu_goals [--json PATH] [--repeats N] [--steps N]

  chunked   Chunked(8192) over 33 documents in 32K (one of 16K, two chunks, then 32 of 512),
            in a 2-way ring's document order
            (`flaxattn.balance_plan(segment_ids, 2, block=128)`, as data.balance=document
            orders a row), bf16, `auto`; useful pairs counted in the original order.
  float32   one causal document of 8K in float32 under
            `jax.default_matmul_precision("highest")` (no TF32), `auto` beside
            jax.nn.dot_product_attention(implementation="xla") (and the largest difference
            between their outputs, relative to its largest), pallas_gpu at each of
            `FLOAT32_TILINGS`, and a float32 matmul of 8192^3 at the same precision as the
            yardstick.
  decode    `flaxattn.MultiHeadAttention` H=32 on 8 KV heads, E=4096, D=128, bf16 parameters
            and cache, RoPE, causal, B=1: the median of --steps one-token decode calls of
            `nnx.jit(layer, donate the layer)` over a cache holding S - 64 tokens, S = 32K and
            128K; beside it the bandwidth floor (the cache's keys, values, ids and positions
            plus the layer's weights, read once, over a device-to-device copy's rate measured
            in the same run, bytes read plus written) and the attention alone: the new
            token's `flaxattn.attention` over the cache (`auto`: split_k) against
            `jax.nn.dot_product_attention(implementation="xla")` with a boolean mask from the
            cached ids and positions, and split_k at each of `CHUNKS` keys per chunk, timed in
            alternation; then the same step as one `jax.jit` over `nnx.split(layer)`'s state
            (donated), without nnx.jit's host-side graph traversal.

The shapes are B=1, H=16 on 8 KV heads, D=128 (`bench.measure`) for the first two. TFLOP/s
count useful work only (`bench.measure.flops`). Without a GPU it says why and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flaxattn
from bench import measure
from flaxattn import registry
from flaxattn.layout import resolve
from flaxattn.pallas_gpu import PallasGpu
from flaxattn.split_k import SplitK

T_CHUNKED, CHUNK, LONG, SHORT, SHORT_DOCS = 32768, 8192, 16384, 512, 32
T_FLOAT32 = 8192
E, DEC_H, DEC_HKV, DEC_D = 4096, 32, 8, 128
LENGTHS = (32768, 131072)
ROOM = 128
CHUNKS = (1024, 2048, 4096, 8192, 16384)  # split_k's keys per chunk, timed for the attention
FLOAT32_TILINGS = ((64, 32), (64, 64))  # pallas_gpu's block_q x block_kv beside the default
COPY_BYTES = 2 << 30


def chunked_case() -> tuple[np.ndarray, np.ndarray, int, str]:
  """Segment ids and positions `[1, T]` in document order, the useful pairs (counted in the
  original order), and what the documents are."""
  lengths = [LONG] + [SHORT] * SHORT_DOCS
  seg = np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)[None]
  pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])[None]
  mask = flaxattn.Chunked(CHUNK)
  pairs = measure.useful_pairs(mask, seg)
  plan = flaxattn.balance_plan(seg, 2, block=128)
  return (np.asarray(plan.segment_ids(seg)), np.asarray(plan.apply(pos)), pairs,
          f"one document of {LONG} and {SHORT_DOCS} of {SHORT}")


def _kernel(q, kv, mask, seg=None, pos=None) -> str:
  with flaxattn.lowering_for("gpu"):
    call = registry.Call.of(q, kv, kv, mask, resolve(q.shape, kv.shape, seg, pos),
                            return_lse=False)
    return registry.select("auto", call).name


def _timed(attn, args, pairs, repeats, heads=measure.H, head_dim=measure.D) -> dict:
  compiled = measure.compile_pair(attn, args)
  fwd_s = measure.median_seconds(compiled.forward, args, repeats, warmup=1, budget_s=1.0)
  fb_s = measure.median_seconds(compiled.forward_backward, args, repeats, warmup=1, budget_s=1.0)
  fwd, fb = measure.flops(pairs, heads, head_dim)
  return dict(fwd_ms=fwd_s * 1e3, fb_ms=fb_s * 1e3, fwd_tflops=fwd / fwd_s / 1e12,
              fb_tflops=fb / fb_s / 1e12, temp_bytes=compiled.temp_bytes)


def chunked(repeats: int) -> dict:
  seg, pos, pairs, what = chunked_case()
  q, k, v = measure.inputs(T_CHUNKED)
  mask = flaxattn.Chunked(CHUNK)
  kernel = _kernel(q, k, mask, seg, pos)

  def attn(q, k, v, seg, pos):
    return flaxattn.attention(q, k, v, mask=mask, segment_ids=seg, positions=pos)
  out = _timed(attn, (q, k, v, jnp.asarray(seg), jnp.asarray(pos)), pairs, repeats)
  return dict(case="chunked", what=what, kernel=kernel, pairs=pairs, **out)


def float32(repeats: int) -> dict:
  with jax.default_matmul_precision("highest"):
    q, k, v = (x.astype(jnp.float32) for x in measure.inputs(T_FLOAT32))
    pairs = measure.useful_pairs(flaxattn.Causal(), np.ones((1, T_FLOAT32), np.int32))
    kernel = _kernel(q, k, flaxattn.Causal())
    ours = _timed(lambda q, k, v: flaxattn.attention(q, k, v), (q, k, v), pairs, repeats)

    def plain_fn(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    plain = _timed(plain_fn, (q, k, v), pairs, repeats)
    want = np.asarray(jax.jit(plain_fn)(q, k, v), np.float64)
    got = np.asarray(jax.jit(lambda q, k, v: flaxattn.attention(q, k, v))(q, k, v), np.float64)
    ours["max_error_vs_jax_nn"] = float(np.abs(got - want).max() / np.abs(want).max())
    tilings = {}
    for block_q, block_kv in FLOAT32_TILINGS:
      tiled = PallasGpu(block_q=block_q, block_kv=block_kv)
      try:
        tilings[f"{block_q}x{block_kv}"] = _timed(
            lambda q, k, v, tiled=tiled: flaxattn.attention(q, k, v, backend=tiled),
            (q, k, v), pairs, repeats)
      except Exception as e:  # a tiling over the shared memory is a result
        tilings[f"{block_q}x{block_kv}"] = dict(error=f"{type(e).__name__}: {e}"[:300])
    a = jax.random.normal(jax.random.key(0), (measure.MATMUL_N,) * 2, jnp.float32)
    b = jax.random.normal(jax.random.key(1), (measure.MATMUL_N,) * 2, jnp.float32)
    mm = jax.jit(jnp.matmul)
    matmul = 2 * measure.MATMUL_N**3 / measure.median_seconds(mm, (a, b), repeats) / 1e12
  return dict(case="float32", kernel=kernel, pairs=pairs, auto=ours, jax_nn_xla=plain,
              matmul_f32_tflops=matmul, pallas_gpu_tilings=tilings)


def copy_bandwidth(repeats: int) -> float:
  """Bytes read plus written per second of a device-to-device copy of `COPY_BYTES`."""
  x = jnp.ones((COPY_BYTES // 4,), jnp.float32) * jax.random.normal(jax.random.key(0), ())
  copy = jax.jit(lambda x: x + 1)  # one read and one write of every element
  return 2 * COPY_BYTES / measure.median_seconds(copy, (x,), repeats)


@nnx.jit(donate_argnums=0)
def _step(m, x):
  return m(x, decode=True)


@jax.jit
def _dense(q, k, v, ids, pos, q_pos):
  allowed = (ids == 1) & (pos <= q_pos[:, None])
  return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None, None], implementation="xla")


@functools.partial(jax.jit, static_argnames="chunk")
def _ours(q, k, v, ids, pos, q_pos, chunk=None):
  backend = "auto" if chunk is None else SplitK(chunk=chunk)
  return flaxattn.attention(q, k, v, segment_ids=jnp.ones((1, 1), jnp.int32),
                            positions=q_pos[:, None], kv_segment_ids=ids, kv_positions=pos,
                            backend=backend)


def decode(length: int, steps: int, bandwidth: float) -> dict:
  m = flaxattn.MultiHeadAttention(DEC_H, E, num_kv_heads=DEC_HKV, mask=flaxattn.Causal(),
                                  rope=flaxattn.RoPE(500000.0), dtype=jnp.bfloat16,
                                  param_dtype=jnp.bfloat16, use_bias=False, rngs=nnx.Rngs(0))
  m.init_cache((1, length, E), dtype=jnp.bfloat16)
  filled = length - ROOM
  ids = np.zeros((1, length), np.int32)
  pos = np.zeros((1, length), np.int32)
  ids[:, :filled], pos[:, :filled] = 1, np.arange(filled)
  k, v = (jax.random.normal(jax.random.key(i), (1, length, DEC_HKV, DEC_D), jnp.bfloat16)
          * jnp.asarray(ids, jnp.bfloat16)[..., None, None] for i in range(2))
  cache = m.cache
  for var, value in ((cache.keys, k), (cache.values, v), (cache.segment_ids, ids),
                     (cache.positions, pos)):
    var[...] = jnp.asarray(value)
  cache.last[...] = jnp.asarray([[1, filled - 1]], jnp.int32)
  cache.index[...] = jnp.int32(filled)
  weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  cache_bytes = sum(c[...].nbytes for c in (cache.keys, cache.values, cache.segment_ids,
                                             cache.positions))
  kc, vc, idc, posc = (jnp.copy(c[...]) for c in (cache.keys, cache.values, cache.segment_ids,
                                                   cache.positions))
  q = jax.random.normal(jax.random.key(2), (1, 1, DEC_H, DEC_D), jnp.bfloat16)
  q_pos = jnp.full((1,), filled, jnp.int32)
  x = jax.random.normal(jax.random.key(1), (1, 1, E), jnp.bfloat16)
  with flaxattn.lowering_for("gpu"):
    kernel = registry.select("auto", registry.Call.of(
        q, kc, vc, flaxattn.Causal(), resolve(q.shape, kc.shape, jnp.ones((1, 1), jnp.int32),
                                              q_pos[:, None], idc, posc),
        return_lse=False)).name
  args = (q, kc, vc, idc, posc, q_pos)
  runs = {"step": lambda: _step(m, x), "dense": lambda: _dense(*args),
          "ours": lambda: _ours(*args)}
  runs.update({f"chunk{c}": functools.partial(_ours, *args, chunk=c) for c in CHUNKS})
  jax.block_until_ready([run() for run in runs.values()])
  times: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(steps):
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append(time.perf_counter() - start)
  # The same step as one jax.jit over the layer's split state (donated): no nnx.jit graph
  # traversal on the host each call, what a serving loop compiles.
  graphdef, state = nnx.split(m)

  def functional(state, x):
    layer = nnx.merge(graphdef, state)
    return layer(x, decode=True), nnx.state(layer)
  step = jax.jit(functional, donate_argnums=0)
  y, state = step(state, x)
  jax.block_until_ready(y)
  times["step_jit"] = []
  for _ in range(steps // 2):
    start = time.perf_counter()
    y, state = step(state, x)
    jax.block_until_ready(y)
    times["step_jit"].append(time.perf_counter() - start)
  med = {name: float(np.median(t)) for name, t in times.items()}
  floor = (weights + cache_bytes) / bandwidth
  return dict(length=length, kernel=kernel, step_ms=med["step"] * 1e3,
              step_jit_ms=med["step_jit"] * 1e3,
              attention_ms=med["ours"] * 1e3, jax_nn_xla_ms=med["dense"] * 1e3,
              split_k_chunk_ms={c: med[f"chunk{c}"] * 1e3 for c in CHUNKS},
              bytes_read=weights + cache_bytes, floor_ms=floor * 1e3,
              step_over_floor=med["step"] / floor,
              step_jit_over_floor=med["step_jit"] / floor,
              attention_over_jax_nn=med["ours"] / med["dense"],
              best_step_ms=min(times["step"]) * 1e3)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--parts", nargs="+", default=["chunked", "float32", "decode"],
                      choices=["chunked", "float32", "decode"])
  args = parser.parse_args(argv)
  report: dict = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                      command=" ".join(["python -m bench.gpu_goals", *sys.argv[1:]]))

  def save():
    if args.json:
      with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
  if jax.default_backend() != "gpu":
    report["skipped"] = f"no GPU (jax.default_backend() is {jax.default_backend()!r})"
    print(f"bench.gpu_goals: {report['skipped']}; nothing measured")
    save()
    return 0
  print(report["device"], "jax", jax.__version__, flush=True)
  for part in args.parts:
    start = time.perf_counter()
    try:
      if part == "decode":
        bandwidth = copy_bandwidth(args.repeats)
        report["copy_bytes_per_s"] = bandwidth
        result = [decode(s, args.steps, bandwidth) for s in LENGTHS]
      else:
        result = {"chunked": chunked, "float32": float32}[part](args.repeats)
    except Exception as e:  # a part that fails is a result; the others still run
      result = dict(status="error", error=f"{type(e).__name__}: {e}"[:2000])
    report[part] = result
    print(part, f"({time.perf_counter() - start:.0f} s):", json.dumps(result, default=str),
          flush=True)
    save()
  return 0


if __name__ == "__main__":
  sys.exit(main())
