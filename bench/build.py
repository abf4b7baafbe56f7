"""Build-time benchmark: how long a long-context program takes to build, before step 1.

  python -m bench.build [--quick] [--json bench/results/build.json] [--timeout 900]
                        [--cases NAME ...] [--train]

Each case is the fwd+bwd (gradient of sum(out**2) w.r.t. q, k, v) of `flaxattn.attention`
with B=1, H=16, Hkv=4, D=128, bfloat16, packed segment ids (16 documents) and positions
(given explicitly, in load-balanced order under context parallelism, as a data pipeline
passes them), run in its own subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=N`
(N = cp, or 1), so the device count and the peak RSS are the case's own. Programs: one
device, and ring / all_gather / ulysses over N simulated CPU devices (load balanced, q/k/v
sharded over "context"). Columns:
  tpu_export_s   `with flaxattn.lowering_for("tpu"): jax.export.export(jax.jit(f),
                 platforms=("tpu",))(...)` (an error row says why it cannot build, e.g.
                 metadata that cannot fit TPU scalar memory, with the block sizes to raise);
  smem_kib       the largest per-device scalar-memory metadata of one splash kernel in it;
  rss_gib        peak host RSS of the case's process (all three builds);
  cpu_lower_s    `jax.jit(f).lower(...)` on this CPU host, default backend ("auto");
  blockwise_s    the same with backend="blockwise".
CPU lowers run first (after one untimed blockwise lower that pays JAX's one-off costs), so
they reuse nothing of the TPU build (nor the reverse: the platform switch keys JAX's trace
caches; each timed lower is a new function). `--train`: the train step of
configs/tpu_v5p_8b_extend_128k.yaml at full size (8B, T=131072, batch 16, fsdp 16 x context 4
on 64 simulated devices) lowered for TPU from abstract state (no parameter memory).
Wall times on a shared host: compare rows of one run.
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

K = 1024
MASKS = ("causal", "local4096", "chunked8192")
SIZES = (32 * K, 128 * K, K * K, 10 * K * K)
STRATEGIES = ("ring", "all_gather", "ulysses")
CPS = (8, 64, 128)


def all_cases() -> list[dict]:
  """Single device up to 1M; every strategy at cp 8, 64, 128 up to 10M; every mask."""
  cases = [dict(program="single", t=t, cp=1, mask=m) for t in SIZES[:3] for m in MASKS]
  cases += [dict(program=s, t=t, cp=cp, mask=m) for s in STRATEGIES for cp in CPS for t in SIZES
            for m in MASKS]
  return cases


def quick_cases() -> list[dict]:
  """The goal rows and one of each strategy, every mask on one of them."""
  rows = [("single", 128 * K, 1, "causal"), ("single", 128 * K, 1, "local4096"),
          ("ring", 128 * K, 8, "causal"), ("ring", 128 * K, 8, "chunked8192"),
          ("all_gather", 128 * K, 8, "causal"), ("ulysses", 128 * K, 8, "causal"),
          ("ring", K * K, 64, "causal")]
  return [dict(program=p, t=t, cp=cp, mask=m) for p, t, cp, m in rows]


def name(case: dict) -> str:
  t = case["t"]
  size = f"{t // (K * K)}M" if t >= K * K else f"{t // K}K"
  where = "single" if case["program"] == "single" else f"{case['program']}{case['cp']}"
  return f"{where}-{size}-{case['mask']}"


def _rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_case(case: dict) -> dict:
  """One case in this process (its device count already set)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import AxisType, NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  import flaxattn  # pylint: disable=import-outside-toplevel
  from flaxattn import splash  # pylint: disable=import-outside-toplevel

  t, cp_n = case["t"], case["cp"]
  mask = {"causal": flaxattn.Causal(), "local4096": flaxattn.Local(4096),
          "chunked8192": flaxattn.Chunked(8192)}[case["mask"]]
  cp = None if case["program"] == "single" else flaxattn.ContextParallel(strategy=case["program"])
  seg = np.repeat(np.arange(1, 17, dtype=np.int32), t // 16)[None]
  pos = np.tile(np.arange(t // 16, dtype=np.int32), 16)[None]
  if cp is not None:
    seg, pos = flaxattn.load_balance(seg, cp_n), flaxattn.load_balance(pos, cp_n)
  mesh = None
  if cp is not None:
    mesh = jax.make_mesh((cp_n,), ("context",), axis_types=(AxisType.Auto,))
  def shard(shape, dtype):
    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=None if mesh is None else NamedSharding(mesh, P(None, "context")))
  q, kv = shard((1, t, 16, 128), jnp.bfloat16), shard((1, t, 4, 128), jnp.bfloat16)
  ids = shard((1, t), jnp.int32)

  def grad_fn(backend):
    def loss(q, k, v, seg, pos):
      out = flaxattn.attention(q, k, v, mask=mask, segment_ids=seg, positions=pos,
                               context_parallel=cp, backend=backend)
      return jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, (0, 1, 2)))

  def timed(fn):
    start = time.perf_counter()
    fn()
    return round(time.perf_counter() - start, 2)

  args = (q, kv, kv, ids, ids)
  row = dict(case=name(case), **case)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    grad_fn("blockwise").lower(*args)  # warm-up: JAX's first trace pays one-off costs
    row["cpu_lower_s"] = timed(lambda: grad_fn("auto").lower(*args))
    row["blockwise_s"] = timed(lambda: grad_fn("blockwise").lower(*args))
    try:
      with flaxattn.lowering_for("tpu"):
        row["tpu_export_s"] = timed(
            lambda: jax.export.export(grad_fn("auto"), platforms=("tpu",))(*args))
        row["smem_kib"] = round(_smem(splash, flaxattn, mask, cp, cp_n, t) / K, 1)
    except ValueError as e:
      row["tpu_error"] = str(e)
  row["rss_gib"] = round(_rss_gib(), 2)
  return row


def _smem(splash, flaxattn, mask, cp, n: int, t: int) -> int:
  """The largest per-device scalar-memory metadata of the splash kernels the case built
  (the kernels are cached: nothing is rebuilt)."""
  from flaxattn import blocks  # pylint: disable=import-outside-toplevel
  kernel = splash.Splash()
  q_shape, kv_shape = (1, t, 16, 128), (1, t, 4, 128)
  if cp is None or cp.strategy == "ulysses":  # the whole sequence on each device
    kernels = [kernel.kernel(mask, blocks.TokenOrder(), q_shape, kv_shape)]
  elif cp.strategy == "ring":
    kv_step = (1, t // n, 4, 128)
    kernels = [kernel.kernel(mask, blocks.TokenOrder(n, True, s), q_shape, kv_step)
               for s in range(n)]
  else:
    kernels = [kernel.kernel(mask, blocks.TokenOrder(n, True, None), q_shape, kv_shape)]
  return max(splash.smem_bytes(k) for k in kernels if k is not None)


def run_train() -> dict:
  """The full-size train step of the 128K extension config, lowered for TPU."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, os.path.join(root, "tests"))
  import tpu_train_step  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  held = tpu_train_step.lower(*tpu_train_step.PRESETS["full_128k"])
  return dict(case="train-8b-128k-fsdp16xcontext4",
              tpu_export_s=round(time.perf_counter() - start, 2),
              rss_gib=round(_rss_gib(), 2), **held)


def _spawn(case, timeout: float) -> dict:
  devices = 64 if case == "train" else case["cp"]
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "bench.build", "--one", json.dumps(case)]
  label = "train" if case == "train" else name(case)
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(case=label, error=f"timeout after {timeout:.0f} s")
  if out.returncode:
    return dict(case=label, error=(out.stderr.strip().splitlines() or ["?"])[-1][:300])
  return json.loads(out.stdout.strip().splitlines()[-1])


COLUMNS = ("case", "tpu_export_s", "smem_kib", "rss_gib", "cpu_lower_s", "blockwise_s")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="the goal rows only")
  parser.add_argument("--json", help="write the rows here")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per case")
  parser.add_argument("--cases", nargs="*", help="only these case names (see --list)")
  parser.add_argument("--list", action="store_true", help="print the case names")
  parser.add_argument("--train", action="store_true", help="also the full-size train step")
  parser.add_argument("--one", help=argparse.SUPPRESS)  # a case, in its own process
  args = parser.parse_args()
  if args.one:
    case = json.loads(args.one)
    try:
      row = run_train() if case == "train" else run_case(case)
    except ValueError as e:  # a case flaxattn refuses (e.g. heads that Ulysses cannot split)
      row = dict(case="train" if case == "train" else name(case), error=str(e)[:400])
    print(json.dumps(row), flush=True)
    return
  cases = quick_cases() if args.quick else all_cases()
  if args.cases:
    cases = [c for c in all_cases() if name(c) in args.cases]
  if args.list:
    print("\n".join(map(name, cases)))
    return
  rows = []
  print(" | ".join(COLUMNS), flush=True)
  for case in cases + (["train"] if args.train else []):
    row = _spawn(case, args.timeout)
    rows.append(row)
    error = row.get("error") or row.get("tpu_error")
    print(" | ".join(str(row.get(c, "")) for c in COLUMNS) + (f" | {error}" if error else ""),
          flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"load": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
