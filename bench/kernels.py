"""Splash kernel construction cost: lazy masks vs a NumpyMask of the whole sequence.

  python bench/kernels.py [--json results.json] [--lengths 8192 16384] [--long 32768]

Causal attention, B=1, H=8 query heads on 2 KV heads, D=128, bfloat16, forward+backward
(gradient of the sum of the output w.r.t. q, k, v). For each case, in a fresh subprocess:
  - build: making the splash kernel (the host-side mask processing: MaskInfo per block);
  - lower: `jax.jit(grad).lower(...)` on shape-only arguments (no data allocated);
  - peak host memory: the rise of the process's peak RSS (ru_maxrss) over its value
    after imports, so it counts numpy, Python and XLA allocations alike.
Rows:
  - flaxattn "splash" (lazy CausalMask) at each length and at the long length (target
    < 30 s build+lower and < 2 GiB);
  - JAX's splash kernel with `NumpyMask(np.tril(np.ones((T, T), bool)))`, the O(T^2) way
    (host memory T^2 bytes for the mask alone, plus its hash copy), at the shorter lengths.
Off TPU the kernel lowers in Pallas interpret mode; build cost and host memory are the same
as on TPU, lowering differs (Mosaic on TPU).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

H, HKV, D = 8, 2, 128
BLOCK = 512


def _rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _measure(kind: str, t: int) -> dict:
  """One case in this process: build and lower times, peak RSS rise."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  import flaxattn
  from flaxattn import splash

  q = jax.ShapeDtypeStruct((1, t, H, D), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, HKV, D), jnp.bfloat16)
  interpret = jax.default_backend() != "tpu"
  base = _rss_mib()
  start = time.perf_counter()
  if kind == "lazy":
    splash._kernel((("causal",),), t, H // HKV, BLOCK, BLOCK, interpret)
    attn = lambda q, k, v: flaxattn.attention(q, k, v, backend="splash")
  else:
    mask = sm.MultiHeadMask([sm.NumpyMask(np.tril(np.ones((t, t), np.bool_)))] * (H // HKV))
    sizes = sk.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK,
                          block_q_dkv=BLOCK, block_kv_dkv=BLOCK, block_kv_dkv_compute=BLOCK,
                          use_fused_bwd_kernel=True)
    kernel = sk.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                interpret=interpret)
    del mask

    def attn(q, k, v):  # [B, T, H, D] -> per (batch, KV head) MQA calls, as flaxattn does
      g = H // HKV
      q5 = (q * D ** -0.5).reshape(1, t, HKV, g, D).transpose(0, 2, 3, 1, 4)
      k4, v4 = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
      return jax.vmap(jax.vmap(kernel))(q5, k4, v4)

  build = time.perf_counter() - start
  grad = jax.grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  start = time.perf_counter()
  jax.jit(grad).lower(q, kv, kv)
  lower = time.perf_counter() - start
  return dict(kernel="flaxattn splash (lazy CausalMask)" if kind == "lazy"
              else "splash + NumpyMask [T, T]", mask_kind=kind, T=t, build_s=round(build, 2),
              lower_s=round(lower, 2), total_s=round(build + lower, 2),
              peak_host_mib=round(_rss_mib() - base, 1), platform=jax.default_backend())


def _run_case(kind: str, t: int, timeout: int) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--one", kind, str(t)]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
  except subprocess.TimeoutExpired:
    return dict(mask_kind=kind, T=t, error=f"timed out after {timeout} s")
  except subprocess.CalledProcessError as e:
    return dict(mask_kind=kind, T=t, error=e.stderr.strip().splitlines()[-1][:200])
  return json.loads(done.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="also write the rows to this JSON file")
  parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384],
                      help="lengths measured both ways (lazy and NumpyMask)")
  parser.add_argument("--long", type=int, default=32768, help="length measured lazily only")
  parser.add_argument("--timeout", type=int, default=600, help="seconds per case")
  parser.add_argument("--one", nargs=2, metavar=("KIND", "T"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.one:
    print(json.dumps(_measure(args.one[0], int(args.one[1]))))
    return

  cases = [(kind, t) for t in args.lengths for kind in ("lazy", "numpy")] + [("lazy", args.long)]
  print(f"splash causal, H={H} on {HKV} KV heads, D={D}, bfloat16, blocks {BLOCK}; fwd+bwd")
  header = f"{'kernel':36} {'T':>6} {'build s':>8} {'lower s':>8} {'total s':>8} {'peak host MiB':>14}"
  print(header + "\n" + "-" * len(header), flush=True)
  rows = []
  for kind, t in cases:
    row = _run_case(kind, t, args.timeout)
    rows.append(row)
    if "error" in row:
      print(f"{kind:36} {t:>6} error: {row['error']}", flush=True)
    else:
      print(f"{row['kernel']:36} {t:>6} {row['build_s']:>8.2f} {row['lower_s']:>8.2f}"
            f" {row['total_s']:>8.2f} {row['peak_host_mib']:>14.1f}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
