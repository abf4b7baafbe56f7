"""The GPU goals that `bench.gpu`'s table does not hold, on one NVIDIA GPU, in one run:

  python -m bench.gpu_goals [--json PATH] [--repeats N]

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

The shapes are B=1, H=16 on 8 KV heads, D=128 (`bench.measure`). TFLOP/s count useful work
only (`bench.measure.flops`). The decode step's goal is `python -m bench.gpu --decode`'s row.
Without a GPU it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flaxattn
from bench import measure
from flaxattn import registry
from flaxattn.layout import resolve
from flaxattn.pallas_gpu import PallasGpu

T_CHUNKED, CHUNK, LONG, SHORT, SHORT_DOCS = 32768, 8192, 16384, 512, 32
T_FLOAT32 = 8192
FLOAT32_TILINGS = ((64, 32), (64, 64))  # pallas_gpu's block_q x block_kv beside the default


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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--parts", nargs="+", default=["chunked", "float32"],
                      choices=["chunked", "float32"])
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
