"""Splash kernel construction cost (lazy masks vs a NumpyMask) and GPU attention throughput.

Part 1 measures splash's lazy masks against a NumpyMask of the whole sequence; part 2, on an
NVIDIA GPU only, attention kernel throughput (cuDNN THD, jax.nn cuDNN, blockwise).

  python -m bench.kernels [--json results.json] [--lengths 8192 16384] [--long 32768]
                          [--gpu-only] [--gpu-lengths 8192 32768] [--repeats 10]

Causal attention, B=1, H=8 query heads on 2 KV heads, D=128, bfloat16, forward+backward
(gradient of the sum of the output w.r.t. q, k, v). For each case, in a fresh subprocess:
  - build: making the splash kernel (the host-side mask processing: MaskInfo per block);
  - lower: `jax.jit(grad).lower(...)` on shape-only arguments (no data allocated);
  - peak host memory: the rise of the process's peak RSS (ru_maxrss) over its value
    after imports, so it counts numpy, Python and XLA allocations alike.
Rows:
  - flaxattn "splash" (lazy CausalMask) at each length and at the long length (target
    < 30 s build+lower and < 2 GiB);
  - at the long length, flaxattn splash as the ring's local kernel on 8 load-balanced
    (simulated) devices: the 8 per-step kernels (lazy masks on the permuted order) and the
    lowering of the context-parallel fwd+bwd;
  - JAX's splash kernel with `NumpyMask(np.tril(np.ones((T, T), bool)))`, the O(T^2) way
    (host memory T^2 bytes for the mask alone, plus its hash copy), at the shorter lengths.
Off TPU the kernel lowers in Pallas interpret mode; build cost and host memory are the same
as on TPU, lowering differs (Mosaic on TPU).

GPU section (runs when jax.default_backend() == "gpu"; otherwise it prints why it is
skipped). B=1, 16 query heads on 8 KV heads, D=128, bfloat16, at each --gpu-lengths T, for
"causal" (one causal document) and "packed" (16 equal causal documents in the row):
  - flaxattn cuDNN: `flaxattn.cudnn.cudnn_attention` (plain BTNH call for one document,
    THD seqlens/offsets for packed rows); for causal also through THD with one document
    (segment ids all 1), to show what the packed layout costs;
  - jax.nn.dot_product_attention(implementation="cudnn"): is_causal=True. It has no THD
    offsets; packed rows are run as a batch of 16 rows of T/16 tokens, which is the same
    attention only because the documents have equal length; and, at T <= 8192, with the
    [T, T] boolean mask that packing with unequal documents would need (cuDNN gets it as a
    dense bias);
  - flaxattn blockwise: `flaxattn.blockwise.blockwise_attention`.
Timed: forward (out) and forward+backward (gradient of sum(out) w.r.t. q, k, v), median of
--repeats runs after two warm-up runs, each ended by block_until_ready. Useful FLOPs count
only allowed (query, key) pairs: forward 4 * D * H * pairs (two matmuls), forward+backward
3.5x that (the backward's five matmuls, the QK^T recomputation included, as FlashAttention
counts). Each kernel is also shown as a fraction of the GPU's bf16 matmul TFLOP/s
(8192 x 8192 x 8192), measured in the same run. "temp MiB" is XLA's compiled temporary
memory of the forward+backward (cuDNN workspaces included). These measurements are
`bench.measure`'s, shared with `python -m bench.gpu` (the fuller GPU report: every kernel,
more masks and lengths, a trainer step).
"""

from __future__ import annotations

import argparse
import contextlib
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
  from flaxattn import blocks, splash
  from flaxattn.layout import Layout

  q = jax.ShapeDtypeStruct((1, t, H, D), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, HKV, D), jnp.bfloat16)
  interpret = jax.default_backend() != "tpu"
  base = _rss_mib()
  start = time.perf_counter()
  if kind == "lazy":
    splash.Splash(block_q=BLOCK, block_kv=BLOCK).kernel(flaxattn.Causal(), blocks.TokenOrder(),
                                                       q.shape, kv.shape)
    def attn(q, k, v):
      return flaxattn.attention(q, k, v, backend="splash")
  elif kind == "ring8":
    # Context parallelism over 8 (simulated) devices, load-balanced: one kernel per ring step.
    from jax.sharding import AxisType

    from bench import devices
    if why := devices.shortfall(8):  # JAX_PLATFORMS names a platform with fewer devices
      return dict(mask_kind=kind, T=t, error=f"skipped, {why}")
    cp = flaxattn.ContextParallel()
    splash.Splash(block_q=BLOCK, block_kv=BLOCK).ring_step(
        strategy="ring", axis=cp.axis, shards=8, load_balance=True, mask=flaxattn.Causal(),
        scale=D ** -0.5, q_shape=q.shape, kv_shape=kv.shape, layout=Layout(shards=8))
    mesh = jax.make_mesh((8,), (cp.axis,), axis_types=(AxisType.Auto,))
    def attn(q, k, v):
      return flaxattn.attention(q, k, v, backend="splash", context_parallel=cp)
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
  with jax.set_mesh(mesh) if kind == "ring8" else contextlib.nullcontext():
    jax.jit(grad).lower(q, kv, kv)
  lower = time.perf_counter() - start
  names = {"lazy": "flaxattn splash (lazy CausalMask)", "numpy": "splash + NumpyMask [T, T]",
           "ring8": "flaxattn splash ring, 8 shards (lazy)"}
  return dict(kernel=names[kind], mask_kind=kind, T=t, build_s=round(build, 2),
              lower_s=round(lower, 2), total_s=round(build + lower, 2),
              peak_host_mib=round(_rss_mib() - base, 1), platform=jax.default_backend())


def _run_case(kind: str, t: int, timeout: int) -> dict:
  cmd = [sys.executable, "-m", "bench.kernels", "--one", kind, str(t)]
  env = dict(os.environ)
  if kind == "ring8" and "JAX_PLATFORMS" not in env:
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True, env=env)
  except subprocess.TimeoutExpired:
    return dict(mask_kind=kind, T=t, error=f"timed out after {timeout} s")
  except subprocess.CalledProcessError as e:
    return dict(mask_kind=kind, T=t, error=e.stderr.strip().splitlines()[-1][:200])
  return json.loads(done.stdout.strip().splitlines()[-1])


def _gpu_kernels(t: int, case: str):
  """(name, attention fn of q, k, v) for one case; the fns close over the layout."""
  import jax
  import jax.numpy as jnp

  import flaxattn
  from bench import measure, peers
  from flaxattn import blockwise, cudnn
  from flaxattn.layout import Layout

  mask, scale = flaxattn.Causal(), measure.D ** -0.5
  if case == "causal":
    layouts = [("", Layout())]
    one_doc = jnp.ones((1, t), jnp.int32)
    layouts.append((" THD, 1 document", Layout(one_doc, one_doc)))
  else:
    seg, pos = (jnp.asarray(x) for x in measure.packed_row(t))
    layouts = [(" THD", Layout(seg, seg, pos, pos))]
  q_shape = jax.ShapeDtypeStruct((1, t, measure.H, measure.D), jnp.bfloat16)
  kv_shape = jax.ShapeDtypeStruct((1, t, measure.HKV, measure.D), jnp.bfloat16)
  for label, layout in layouts:  # else the numbers would be the blockwise fallback's
    assert cudnn.served_by_cudnn(q_shape, kv_shape, layout, mask=mask), label
  kernels = [(f"flaxattn cuDNN{label}", lambda q, k, v, layout=layout: cudnn.cudnn_attention(
      q, k, v, layout, mask=mask, scale=scale, return_lse=False)) for label, layout in layouts]
  if case == "causal":
    kernels.append(("jax.nn cuDNN is_causal", peers.jax_nn_cudnn))
  else:
    kernels.append(("jax.nn cuDNN, docs as batch rows", peers.docs_as_rows(measure.DOCS)))
    if t <= 8192:
      same = (seg[:, :, None] == seg[:, None, :]) & (pos[:, :, None] >= pos[:, None, :])
      kernels.append(("jax.nn cuDNN, [T, T] mask", lambda q, k, v: peers.jax_nn_cudnn(
          q, k, v, is_causal=False, mask=same[:, None])))
  layout = layouts[-1][1] if case == "packed" else Layout()
  kernels.append(("flaxattn blockwise", lambda q, k, v: blockwise.blockwise_attention(
      q, k, v, layout, mask=mask, scale=scale, return_lse=False)))
  return kernels


def _gpu_row(name: str, attn, t: int, case: str, matmul: float, repeats: int) -> dict:
  import jax
  import numpy as np

  import flaxattn
  from bench import measure

  seg = np.ones((1, t), np.int32) if case == "causal" else measure.packed_row(t)[0]
  fwd_flops, fwd_bwd_flops = measure.flops(measure.useful_pairs(flaxattn.Causal(), seg))
  row = dict(section="gpu", kernel=name, case=case, T=t, H=measure.H, HKV=measure.HKV,
             D=measure.D, device=jax.devices()[0].device_kind, matmul_tflops=round(matmul, 1))
  args = measure.inputs(t)
  try:
    compiled = measure.compile_pair(attn, args)
    if compiled.temp_bytes is not None:
      row["temp_mib"] = round(compiled.temp_bytes / 2**20, 1)
    for label, fn, flops in (("fwd", compiled.forward, fwd_flops),
                             ("fwd_bwd", compiled.forward_backward, fwd_bwd_flops)):
      seconds = measure.median_seconds(fn, args, repeats)
      row[f"{label}_ms"] = round(seconds * 1e3, 3)
      row[f"{label}_tflops"] = round(flops / seconds / 1e12, 1)
      row[f"{label}_of_matmul"] = round(flops / seconds / 1e12 / matmul, 3)
  except Exception as e:  # a kernel that cannot run this case (memory, unsupported) is a result
    row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
  return row


def gpu_section(lengths: list[int], repeats: int) -> list[dict]:
  """The GPU throughput rows (empty, after saying why, when there is no GPU)."""
  import jax

  from bench import measure

  if jax.default_backend() != "gpu":
    print(f"GPU section skipped: jax.default_backend() is {jax.default_backend()!r}; it"
          " measures cuDNN attention on an NVIDIA GPU.", flush=True)
    return []
  matmul = measure.matmul_tflops(repeats)
  print(f"\nGPU {jax.devices()[0].device_kind}: bf16 matmul 8192^3 {matmul:.1f} TFLOP/s."
        f" Attention B=1, H={measure.H} on {measure.HKV} KV heads, D={measure.D}, bfloat16;"
        f" causal = one document, packed = {measure.DOCS} equal causal documents.")
  header = (f"{'kernel':34} {'case':>6} {'T':>6} {'fwd ms':>8} {'TFLOP/s':>8} {'of mm':>6}"
            f" {'f+b ms':>8} {'TFLOP/s':>8} {'of mm':>6} {'temp MiB':>9}")
  print(header + "\n" + "-" * len(header), flush=True)
  rows = []
  for t in lengths:
    for case in ("causal", "packed"):
      for name, attn in _gpu_kernels(t, case):
        row = _gpu_row(name, attn, t, case, matmul, repeats)
        rows.append(row)
        if "error" in row:
          print(f"{name:34} {case:>6} {t:>6} error: {row['error']}", flush=True)
        else:
          print(f"{name:34} {case:>6} {t:>6} {row['fwd_ms']:>8.2f} {row['fwd_tflops']:>8.1f}"
                f" {row['fwd_of_matmul']:>6.0%} {row['fwd_bwd_ms']:>8.2f}"
                f" {row['fwd_bwd_tflops']:>8.1f} {row['fwd_bwd_of_matmul']:>6.0%}"
                f" {row.get('temp_mib', float('nan')):>9.1f}", flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="also write the rows to this JSON file")
  parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384],
                      help="lengths measured both ways (lazy and NumpyMask)")
  parser.add_argument("--long", type=int, default=32768, help="length measured lazily only")
  parser.add_argument("--timeout", type=int, default=600, help="seconds per case")
  parser.add_argument("--gpu-only", action="store_true",
                      help="skip the splash construction part, run only the GPU section")
  parser.add_argument("--gpu-lengths", type=int, nargs="+", default=[8192, 32768],
                      help="sequence lengths of the GPU section")
  parser.add_argument("--repeats", type=int, default=10, help="timed runs per GPU measurement")
  parser.add_argument("--one", nargs=2, metavar=("KIND", "T"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.one:
    print(json.dumps(_measure(args.one[0], int(args.one[1]))))
    return

  rows = []
  if not args.gpu_only:
    cases = ([(kind, t) for t in args.lengths for kind in ("lazy", "numpy")]
             + [("lazy", args.long), ("ring8", args.long)])
    print(f"splash causal, H={H} on {HKV} KV heads, D={D}, bfloat16, blocks {BLOCK}; fwd+bwd")
    header = (f"{'kernel':36} {'T':>6} {'build s':>8} {'lower s':>8} {'total s':>8}"
              f" {'peak host MiB':>14}")
    print(header + "\n" + "-" * len(header), flush=True)
    for kind, t in cases:
      row = _run_case(kind, t, args.timeout)
      rows.append(row)
      if "error" in row:
        print(f"{kind:36} {t:>6} error: {row['error']}", flush=True)
      else:
        print(f"{row['kernel']:36} {t:>6} {row['build_s']:>8.2f} {row['lower_s']:>8.2f}"
              f" {row['total_s']:>8.2f} {row['peak_host_mib']:>14.1f}", flush=True)
  # After the splash cases: they measure their own processes' memory from a clean start.
  rows += gpu_section(args.gpu_lengths, args.repeats)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
