"""Attention benchmark on this machine, every number from the same run.

  python -m bench.attention [--json results.json] [--quick]

Forward+backward (gradient of sum(out**2) w.r.t. q, k, v), B=1, H=4, D=64, float32:
  1. causal T=4096: flaxattn fused vs jax.nn.dot_product_attention(implementation="xla")
     and JAX's splash kernel (Pallas, interpret mode on CPU), as time ratios;
  2. 16 packed causal documents of 512 tokens in T=8192: fused vs the same attention through
     jax.nn.dot_product_attention with a dense [T, T] mask built from the segment ids;
  3. compiled temp memory (memory_analysis) of fused at T=4096 and 16384;
  4. seqlens_and_offsets at T=131072, max_segments=256 beside the O(T^2) mask derivation;
  5. useful attention GFLOP/s (allowed query-key pairs x H x D x 2 flops x 6 matmuls:
     2 forward, 4 backward; recomputation not counted) as a fraction of this CPU's float32
     matmul GFLOP/s (2048 x 2048 x 2048), measured in the same run;
  6. features, causal T=4096 (T=1024 quick): attention sinks, logit soft cap (D=64), and
     Dv != D (D=192, Dv=128, as MLA) on fused, each beside the same attention without
     the feature on fused ("cost" = the ratio) and beside the same attention written with
     jax.nn.dot_product_attention where it can express it (Dv: v zero-padded to D, output
     sliced), else the dense reference backend.
Times are the best of `--repeats` runs after one compile-and-warm-up run. `--ratios` runs
parts 1 and 2 only. The table names the kernel "fused" ran, and the script exits with
status 1 when jax.nn's time over fused's falls below `MIN_RATIO` for a case: fused must beat
the dense causal call, and by 8x the dense packed one, whose 16 documents leave 1/16 of its
work useful (a kernel that skips blocks: 43x to 83x here; pallas_gpu in interpret mode,
which "fused" ran on CPU for a while: 1.3x to 2.1x).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

import flaxattn
from bench import seqlens as seqlens_bench
from flaxattn import registry
from flaxattn.layout import Layout
from flaxattn.selftest import best_time

B, H, D = 1, 4, 64
# Per case (by its first word): the least jax.nn time over fused time that passes.
MIN_RATIO = {"causal": 1.0, "16": 8.0}


def fwd_bwd(attn):
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v) ** 2), argnums=(0, 1, 2)))


def qkv(t: int):
  keys = jax.random.split(jax.random.key(0), 3)
  return tuple(jax.random.normal(kk, (B, t, H, D), jnp.float32) for kk in keys)


def matmul_gflops(repeats: int) -> float:
  n = 2048
  a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  return 2 * n**3 / best_time(jax.jit(lambda a: a @ a), (a,), repeats) / 1e9


def splash_causal(t: int):
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * H)
  blocks = splash.BlockSizes(block_q=512, block_kv=512, block_kv_compute=512, block_q_dkv=512,
                             block_kv_dkv=512, block_kv_dkv_compute=512, block_q_dq=512,
                             block_kv_dq=512)
  kernel = splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                  interpret=True)

  def attn(q, k, v):  # splash takes [H, T, D] per example and does not scale
    def to_htd(x):
      return x[0].transpose(1, 0, 2)
    return kernel(to_htd(q) * D**-0.5, to_htd(k), to_htd(v)).transpose(1, 0, 2)[None]
  return attn


def causal_pairs(t: int) -> int:
  return t * (t + 1) // 2


def useful_gflops(pairs: int, seconds: float) -> float:
  return pairs * H * D * 2 * 6 / seconds / 1e9


def fused_kernel(q, layout: Layout | None = None) -> str:
  """The kernel backend="fused" runs for causal self attention on `q` on this platform."""
  return registry.select("fused", registry.Call.of(q, q, q, flaxattn.Causal(), layout or Layout(),
                                                   return_lse=False)).name


def bench_causal(t: int, repeats: int, matmul: float) -> list[dict]:
  args = qkv(t)
  rows = []
  impls = {
      f"flaxattn fused ({fused_kernel(args[0])})":
          lambda q, k, v: flaxattn.attention(q, k, v, backend="fused"),
      "jax.nn xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                 implementation="xla"),
      "jax splash (interpret)": splash_causal(t),
  }
  for name, attn in impls.items():
    sec = best_time(fwd_bwd(attn), args, repeats)
    rows.append(dict(case=f"causal T={t}", impl=name, seconds=sec,
                     gflops=useful_gflops(causal_pairs(t), sec)))
  base = rows[0]["seconds"]
  for r in rows:
    r["speedup_of_fused"] = r["seconds"] / base
    r["matmul_fraction"] = r["gflops"] / matmul
  return rows


def bench_packed(t: int, doc: int, repeats: int, matmul: float) -> list[dict]:
  args = qkv(t)
  seg = jnp.repeat(jnp.arange(1, t // doc + 1, dtype=jnp.int32), doc)[None]
  pos = jnp.tile(jnp.arange(doc, dtype=jnp.int32), t // doc)[None]

  def dense(q, k, v):
    allowed = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])
    return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], implementation="xla")

  impls = {
      f"flaxattn fused ({fused_kernel(args[0], Layout(seg, seg, pos, pos))})":
          lambda q, k, v: flaxattn.attention(q, k, v, segment_ids=seg, positions=pos,
                                             backend="fused"),
      "jax.nn xla + dense mask": dense,
  }
  pairs = (t // doc) * causal_pairs(doc)
  rows = []
  for name, attn in impls.items():
    sec = best_time(fwd_bwd(attn), args, repeats)
    rows.append(dict(case=f"{t // doc} docs x {doc} in T={t}", impl=name, seconds=sec,
                     gflops=useful_gflops(pairs, sec)))
  for r in rows:
    r["speedup_of_fused"] = r["seconds"] / rows[0]["seconds"]
    r["matmul_fraction"] = r["gflops"] / matmul
  return rows


def bench_features(t: int, repeats: int) -> list[dict]:
  """Each feature on fused: its time, its cost over the same call without it, and the
  time of the same attention by jax.nn (or the reference) in the same run."""
  keys = jax.random.split(jax.random.key(2), 4)
  def normal(i, d):
    return jax.random.normal(keys[i], (B, t, H, d), jnp.float32)
  q64, k64, v64 = normal(0, 64), normal(1, 64), normal(2, 64)
  q192, k192, v128 = normal(0, 192), normal(1, 192), normal(2, 128)
  v192 = normal(2, 192)
  sinks = jax.random.normal(keys[3], (H,), jnp.float32)
  def fused(**kw):
    def fn(q, k, v):
      return flaxattn.attention(q, k, v, backend="fused", **kw)
    return fn

  def reference(**kw):
    def fn(q, k, v):
      return flaxattn.attention(q, k, v, backend="reference", **kw)
    return fn

  def jax_nn_padded_v(q, k, v):  # jax.nn needs Dv == D: zero columns cost the same matmuls
    pad = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - v.shape[-1])))
    out = jax.nn.dot_product_attention(q, k, pad, is_causal=True, implementation="xla")
    return out[..., :v.shape[-1]]

  cases = [  # (feature, args, fused with it, fused without it, other impl name, other impl)
      ("sinks", (q64, k64, v64), fused(sinks=sinks), fused(), "flaxattn reference",
       reference(sinks=sinks)),
      ("soft cap 30", (q64, k64, v64), fused(logit_soft_cap=30.0), fused(), "flaxattn reference",
       reference(logit_soft_cap=30.0)),
      ("Dv 128 != D 192", (q192, k192, v128), fused(), None, "jax.nn xla (v padded)",
       jax_nn_padded_v),
  ]
  rows = []
  for feature, args, with_it, without, other_name, other in cases:
    sec = best_time(fwd_bwd(with_it), args, repeats)
    # Without Dv != D: the same call with v at q/k's head dim.
    base_args = args if without is not None else (q192, k192, v192)
    base = best_time(fwd_bwd(without or fused()), base_args, repeats)
    other_sec = best_time(fwd_bwd(other), args, repeats)
    rows.append(dict(case=f"causal T={t}, {feature}", fused_seconds=sec,
                     fused_without_seconds=base, cost=sec / base, other=other_name,
                     other_seconds=other_sec, other_over_fused=other_sec / sec))
  return rows


def fused_temp_mib(t: int) -> float:
  x = jax.ShapeDtypeStruct((B, t, H, D), jnp.float32)
  f = fwd_bwd(lambda q, k, v: flaxattn.attention(q, k, v, backend="fused"))
  return f.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes / 2**20


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", help="write the results to this file")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
  parser.add_argument("--ratios", action="store_true",
                      help="parts 1 and 2 only: fused against jax.nn in the same run")
  args = parser.parse_args()
  t_causal, t_packed, doc = (1024, 2048, 128) if args.quick else (4096, 8192, 512)

  matmul = matmul_gflops(args.repeats)
  print(f"device: {jax.devices()[0].device_kind}; float32 matmul {matmul:.1f} GFLOP/s")
  rows = (bench_causal(t_causal, args.repeats, matmul)
          + bench_packed(t_packed, doc, args.repeats, matmul))
  print(f"\n{'case':<26} {'impl':<26} {'seconds':>9} {'x fused':>8} {'GFLOP/s':>8}"
        f" {'of matmul':>9}")
  for r in rows:
    print(f"{r['case']:<26} {r['impl']:<26} {r['seconds']:>9.3f} {r['speedup_of_fused']:>8.2f}"
          f" {r['gflops']:>8.1f} {r['matmul_fraction']:>9.2f}")
  slower = [f"{r['case']}: {r['speedup_of_fused']:.2f}x" for r in rows
            if r["impl"].startswith("jax.nn") and not args.quick
            and r["speedup_of_fused"] < MIN_RATIO[r["case"].split()[0]]]
  if slower:
    print(f"fused against jax.nn.dot_product_attention (xla) below {MIN_RATIO} on {slower}:"
          " check which kernel it runs (flaxattn.explain(..., backend='fused')).")
  if args.ratios:
    if args.json:
      with open(args.json, "w") as f:
        json.dump(dict(matmul_gflops=matmul, attention=rows), f, indent=2)
    sys.exit(1 if slower else 0)

  features = bench_features(t_causal, args.repeats)
  print(f"\n{'feature':<30} {'fused s':>8} {'without s':>9} {'cost':>6}  {'other':<24}"
        f" {'other s':>8} {'x fused':>8}")
  for r in features:
    print(f"{r['case']:<30} {r['fused_seconds']:>8.3f} {r['fused_without_seconds']:>9.3f}"
          f" {r['cost']:>6.2f}  {r['other']:<24} {r['other_seconds']:>8.3f}"
          f" {r['other_over_fused']:>8.2f}")

  memory = {t: fused_temp_mib(t) for t in ((1024, 4096) if args.quick else (4096, 16384))}
  lo, hi = memory
  print(f"\nfused fwd+bwd compiled temp: T={lo}: {memory[lo]:.1f} MiB, T={hi}: {memory[hi]:.1f} MiB"
        f" (ratio {memory[hi] / memory[lo]:.2f} for {hi // lo}x T)")

  seg_rows = seqlens_bench.run(**({"t": 8192, "max_segments": 64} if args.quick else {}))
  print()
  print(seqlens_bench.table(seg_rows))

  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(matmul_gflops=matmul, attention=rows, features=features,
                     fused_temp_mib={str(k): v for k, v in memory.items()},
                     seqlens=seg_rows), f, indent=2)
  sys.exit(1 if slower else 0)


if __name__ == "__main__":
  main()
