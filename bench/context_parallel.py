"""Context-parallel attention benchmark on simulated CPU devices, every number from the same run.

  python -m bench.context_parallel [--json bench/results/context_parallel_cpu.json] [--quick]

Sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax, so the host
CPU shows up as 8 devices (on a GPU host the GPUs are the devices: a part that needs more
than there are is skipped, with a line saying how many it needs). Everything is causal,
forward+backward (gradient of sum(out**2) w.r.t. q, k, v), B=1, H=4, D=64, float32, with
meshes
`jax.make_mesh((cp,), ("context",), axis_types=(Auto,), devices=jax.devices()[:cp])` used
under `with jax.set_mesh(mesh):` and q/k/v sharded P(None, "context").

ContextParallel(load_balance=True) (the default) takes the inputs to be in
`flaxattn.load_balance` order and derives the permuted positions itself. The inputs here are
random, so permuting them would change nothing measured: no permutation of data is done.

  1. per-device compiled temp memory (`memory_analysis()`, which under SPMD describes the
     per-device program: argument sizes shrink as 1/cp) of ring attention at T=16384 for
     cp = 2, 4, 8, and the ratio cp=8 / cp=2 (target <= 0.45); all_gather alongside;
  2. compute balance, exact, with numpy: the ring is replayed (device r holds its shard's
     positions, at step s it sees the keys of device (r - s) mod cp) and the (query block,
     key block) pairs the local blockwise kernel computes (kind != EMPTY, from
     `flaxattn.blocks.block_schedule` with the kernel's block size for length T/cp) are
     counted per device, with and without load balancing, cp=8, T=16384; and FULL vs PARTIAL
     (masked) blocks per ring step;
  3. ring vs all_gather at T=32768, cp=8: step time, per-device temp memory, and useful
     GFLOP/s (causal pairs T(T+1)/2 x H x D x 2 flops x 6 matmuls: 2 forward, 4 backward),
     beside single-device `flaxattn.attention(..., backend="fused")` (no mesh) at the same T.
     The 8 simulated devices share this machine's CPU cores, so wall time compares the total
     work done, not parallel speedup.
  4. the GPU ring's kernel per step, reported on this host: for causal, packed (6 x cp
     documents of random lengths, crossing shard edges, positions restarting at 0), packed
     with 48 x cp documents (more than a call's 32 THD slots), packed with positions that
     step by 2 (not the token index), and Local cases at cp = 4 and 8, what `flaxattn.explain` says
     the GPU runs, and for cuDNN the piece each device computes at each ring step
     (`flaxattn.cudnn_ring.ring_plan`; the all-gather strategy computes the same pieces, one per
     gathered shard), with the run-time checks evaluated on the batch: the global check
     (positions follow the token index inside documents; a failing batch runs every step
     blockwise) and each call's own check (`cudnn.served_by_cudnn`).
  5. GPU only (skipped, saying why, without at least 2 GPUs): ring over all GPUs with cuDNN
     steps vs blockwise steps, and cuDNN on one GPU, causal T=32768, B=1, H=32, Hkv=8,
     D=128, bfloat16, forward+backward TFLOP/s (per device for the ring).
  6. every strategy (ring, all_gather, ulysses, and Ulysses 4 x ring 2 on a 2-D mesh) at
     each `--strategy-lengths` T on 8 devices, causal and Local(4096) (`--strategy-masks`),
     B=1, H=Hkv=8, D=64, float32, load balanced: bytes the compiled per-device program
     moves in collectives (`flaxattn.aot.collectives`, loops counted by their trip counts),
     per-device temp memory, model FLOPs per device, wall time; the strategy
     `strategy="auto"` picks (cost_model="cpu") and its time over the measured best.
     `--parts 6` runs just this part.
  7. the local kernel's rate against its call length, on one device: causal, forward+backward,
     float32, D=64, at each `--strategy-lengths` T, the call Ulysses makes on 8 devices
     (all T tokens, H/8 = 1 head) and the blockwise kernel on T/8 tokens with all 8 heads
     (a ring step's query length); model GFLOP/s of each.
Times are the best of `--repeats` runs after one compile-and-warm-up run.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flaxattn  # noqa: E402
from bench import devices  # noqa: E402
from bench.attention import B, D, H, best_time, causal_pairs, qkv, useful_gflops  # noqa: E402
from flaxattn import aot, blocks, blockwise, cudnn, cudnn_ring  # noqa: E402
from flaxattn.blockwise import ring_block  # noqa: E402
from flaxattn.layout import Layout, index_check, resolve  # noqa: E402

AXIS = "context"
MIB = 2**20


def make_mesh(cp: int):
  return jax.make_mesh((cp,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:cp])


def fwd_bwd(strategy: str | None, load_balance: bool = True):
  """jit(grad(sum(out**2))) w.r.t. q, k, v; strategy None: single device, no context parallel."""
  cp = None if strategy is None else flaxattn.ContextParallel(
      axis=AXIS, strategy=strategy, load_balance=load_balance)

  def loss(q, k, v):
    return jnp.sum(flaxattn.attention(q, k, v, backend="fused", context_parallel=cp) ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def memory(fn, t: int, sharding=None) -> dict:
  x = jax.ShapeDtypeStruct((B, t, H, D), jnp.float32, sharding=sharding)
  m = fn.lower(x, x, x).compile().memory_analysis()
  return dict(temp_mib=m.temp_size_in_bytes / MIB, argument_mib=m.argument_size_in_bytes / MIB,
              output_mib=m.output_size_in_bytes / MIB)


# 1. memory ---------------------------------------------------------------------------------

def bench_memory(t: int, cps) -> list[dict]:
  rows = []
  for cp in cps:
    mesh = make_mesh(cp)
    with jax.set_mesh(mesh):
      for strategy in ("ring", "all_gather"):
        rows.append(dict(t=t, cp=cp, strategy=strategy,
                         **memory(fwd_bwd(strategy), t, NamedSharding(mesh, P(None, AXIS)))))
  return rows


# 2. compute balance ------------------------------------------------------------------------

def ring_schedule(t: int, cp: int, load_balance: bool):
  """Replays the ring with numpy. Returns (bq, counts [cp, cp, 3]): for device r at ring step s
  the number of EMPTY / PARTIAL / FULL (query block, key block) pairs of the local kernel
  (indexed by `BlockKind`)."""
  pos = np.arange(t, dtype=np.int32)[None]
  if load_balance:
    pos = np.asarray(flaxattn.load_balance(pos, cp, axis=1))
  local = t // cp
  shards = pos.reshape(1, cp, local).transpose(1, 0, 2)  # [cp, 1, local]: shard r's positions
  # The ring's block size, clipped as blockwise._prepare clips it for a local length T / cp.
  bq = bk = blockwise._block_size(local, ring_block(t, cp, load_balance))
  assert local % bq == 0 and local % bk == 0, "padding not modelled"
  seg = np.ones((1, local), np.int32)
  counts = np.zeros((cp, cp, 3), np.int64)
  for r in range(cp):
    for s in range(cp):
      kinds = blocks.block_schedule(np, flaxattn.Causal(), seg, seg, shards[r],
                                    shards[(r - s) % cp], bq, bk)
      counts[r, s] = np.bincount(kinds.ravel(), minlength=3)
  return bq, bk, counts


def bench_balance(t: int, cp: int) -> dict:
  out = {}
  for lb in (True, False):
    bq, bk, counts = ring_schedule(t, cp, lb)
    computed = counts[:, :, blocks.FULL] + counts[:, :, blocks.PARTIAL]  # [cp, cp]
    per_device = computed.sum(1)
    out["balanced" if lb else "contiguous"] = dict(
        t=t, cp=cp, load_balance=lb, block_q=bq, block_k=bk,
        blocks_per_step=int(counts[0, 0].sum()),
        computed_per_device=per_device.tolist(),
        max_over_min=float(per_device.max() / per_device.min()),
        full_per_step=counts[:, :, blocks.FULL].tolist(),
        partial_per_step=counts[:, :, blocks.PARTIAL].tolist(),
        total_computed=int(per_device.sum()))
  return out


# 3. ring vs all_gather vs single device ----------------------------------------------------

def bench_strategies(t: int, cp: int, repeats: int) -> list[dict]:
  rows = []
  host = qkv(t)
  mesh = make_mesh(cp)
  sharding = NamedSharding(mesh, P(None, AXIS))
  with jax.set_mesh(mesh):
    args = tuple(jax.device_put(x, sharding) for x in host)
    for strategy in ("ring", "all_gather"):
      fn = fwd_bwd(strategy)
      mem = memory(fn, t, sharding)
      start = time.perf_counter()
      sec = best_time(fn, args, repeats)
      rows.append(dict(case=f"causal T={t}", impl=f"{strategy} cp={cp}", seconds=sec,
                       gflops=useful_gflops(causal_pairs(t), sec),
                       total_seconds=time.perf_counter() - start, **mem))
  fn = fwd_bwd(None)
  mem = memory(fn, t)
  start = time.perf_counter()
  sec = best_time(fn, host, repeats)
  rows.append(dict(case=f"causal T={t}", impl="fused, 1 device", seconds=sec,
                   gflops=useful_gflops(causal_pairs(t), sec),
                   total_seconds=time.perf_counter() - start, **mem))
  base = rows[-1]["seconds"]
  for r in rows:
    r["x_single_device"] = r["seconds"] / base
  return rows


# 4. the GPU ring's kernel per step, from this host ------------------------------------------

PIECE_LETTERS = "OAFL-"  # cudnn_ring.PIECES: Own tokens (call's mask), All keys, First key chunk,
#                          Last query chunk (unmasked), nothing


def _packing(t: int, docs: int, seed: int = 0):
  """Segment ids and positions `[1, t]` of `docs` documents of random lengths (positions
  restart at 0 in each)."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, t), docs - 1, replace=False))
  lengths = np.diff(np.concatenate([[0], cuts, [t]]))
  seg = np.repeat(np.arange(1, docs + 1, dtype=np.int32), lengths)[None]
  pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])[None]
  return seg, pos


def gpu_ring_plan(cp: int, case: str, t: int, h: int = 8, hkv: int = 2, d: int = 128) -> dict:
  """What the GPU ring runs per step for one case (see the module docstring, part 4)."""
  mask = flaxattn.Local(t // (4 * cp)) if case == "Local" else flaxattn.Causal()
  seg = pos = None
  if case.startswith("packed"):
    seg, pos = _packing(t, (48 if case == "packed, many documents" else 6) * cp)
    if case == "packed, positions x2":
      pos = pos * 2
  strategy = flaxattn.ContextParallel(axis=AXIS)
  q = jax.ShapeDtypeStruct((1, t, h, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, t, hkv, d), jnp.bfloat16)
  with jax.set_mesh(make_mesh(cp)):
    def balanced(x):
      return None if x is None else np.asarray(flaxattn.load_balance(x, cp))
    seg, pos = balanced(seg), balanced(pos)
    text = flaxattn.explain(q, k, k, mask=mask, segment_ids=seg, positions=pos,
                            context_parallel=strategy, print_fn=None)
    layout = resolve(q.shape, k.shape, seg, pos, context_parallel=strategy)
  gpu = next(line.strip()[len("gpu: "):] for line in text.splitlines()
             if line.strip().startswith("gpu: "))
  row = dict(cp=cp, t=t, case=case, mask=repr(mask), gpu=gpu)
  if not gpu.startswith("cudnn"):
    return row
  index = layout.index(1, t)
  check = index_check(mask, layout, index, index)
  row["global_check"] = None if check is None else bool(check)
  full = layout.materialize(1, t, t)
  def shard(x, r):
    return x[:, r * (t // cp):(r + 1) * (t // cp)]
  plan = cudnn_ring.ring_plan(cudnn.mask_band(mask)[0], cp, True)

  @functools.partial(jax.jit, static_argnums=0)
  def served(piece, visiting):  # the piece's call runs cuDNN: its own run-time check
    rows, cols, lay, piece_mask = cudnn_ring.ring_piece(piece, visiting, mask)
    q_piece = jax.ShapeDtypeStruct((1, lay.q_segment_ids.shape[1], h, d), jnp.bfloat16)
    k_piece = jax.ShapeDtypeStruct((1, lay.kv_segment_ids.shape[1], hkv, d), jnp.bfloat16)
    return cudnn.served_by_cudnn(q_piece, k_piece, lay, mask=piece_mask)

  steps = []
  for step in range(cp):
    cells = ""
    for r in range(cp):
      piece, j = int(plan[step, r]), (r - step) % cp
      letter = PIECE_LETTERS[piece]
      if check is not None and not check:
        letter = "b"
      elif piece != cudnn_ring.NOTHING and seg is not None:
        visiting = Layout(shard(full.q_segment_ids, r), shard(full.kv_segment_ids, j),
                          shard(full.q_positions, r), shard(full.kv_positions, j))
        letter = letter if bool(served(piece, visiting)) else letter.lower()
      cells += letter
    steps.append(cells)
  row["steps"] = steps
  return row


def print_gpu_ring_plans(rows: list[dict]):
  print("\n4. what the GPU ring runs per step (reported on this host from flaxattn.explain and"
        " cudnn_ring.ring_plan), load balanced,\n   B=1, H=8 on 2 KV heads, D=128, bfloat16,"
        f" T={rows[0]['t']}; packed = 6 x cp (many: 48 x cp) documents of random lengths,"
        " positions restarting at 0")
  pieces = zip(PIECE_LETTERS, cudnn_ring.PIECES, strict=True)
  print(f"   pieces: {', '.join(f'{letter} = {p}' for letter, p in pieces)};"
        "\n   lower case: that call's own run-time check fails on this batch and it runs blockwise;"
        " b = blockwise (the batch failed the global check)")
  for row in rows:
    print(f"\ncp={row['cp']} {row['case']} ({row['mask']}): gpu runs {row['gpu']}")
    if "steps" not in row:
      continue
    check = row["global_check"]
    print("   global check: " + ("not needed (default positions)" if check is None else
                                  "passes" if check else "FAILS: every step runs blockwise"))
    print(f"   {'':6}" + " ".join(f"{'r=' + str(r):>4}" for r in range(row["cp"])))
    for step, cells in enumerate(row["steps"]):
      print(f"   {'s=' + str(step):6}" + " ".join(f"{c:>4}" for c in cells))


# 5. GPU: the ring with cuDNN steps ---------------------------------------------------------

def bench_gpu_ring(t: int, repeats: int) -> list[dict]:
  """Ring over all GPUs with cuDNN vs blockwise steps, and cuDNN on one GPU (empty, after
  saying why, without at least 2 GPUs)."""
  gpus = jax.devices("gpu") if jax.default_backend() == "gpu" else []
  if len(gpus) < 2:
    print(f"\n5. GPU ring skipped: needs at least 2 NVIDIA GPUs, this host has {len(gpus)}"
          f" (jax.default_backend() is {jax.default_backend()!r}).")
    return []
  h, hkv, d = 32, 8, 128
  keys = jax.random.split(jax.random.key(0), 3)
  host = tuple(jax.random.normal(key, (1, t, n, d), jnp.bfloat16)
               for key, n in zip(keys, (h, hkv, hkv), strict=True))
  flops = 3.5 * 4 * d * h * causal_pairs(t)  # forward 2 matmuls, backward 5 (2.5 x forward)

  def run(backend: str, cp):
    def loss(q, k, v):
      return jnp.sum(flaxattn.attention(
          q, k, v, backend=backend, context_parallel=cp).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  rows = []
  mesh = jax.make_mesh((len(gpus),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=gpus)
  with jax.set_mesh(mesh):
    args = tuple(jax.device_put(x, NamedSharding(mesh, P(None, AXIS))) for x in host)
    for backend in ("cudnn", "blockwise"):
      sec = best_time(run(backend, flaxattn.ContextParallel(axis=AXIS)), args, repeats)
      rows.append(dict(impl=f"ring cp={len(gpus)}, {backend} steps", devices=len(gpus),
                       seconds=sec))
  sec = best_time(run("cudnn", None), tuple(jax.device_put(x, gpus[0]) for x in host), repeats)
  rows.append(dict(impl="cudnn, 1 GPU", devices=1, seconds=sec))
  print(f"\n5. GPU ({gpus[0].device_kind}) causal T={t}, B=1, H={h} on {hkv} KV heads, D={d},"
        " bfloat16, forward+backward")
  print(f"{'impl':<28} {'ms':>9} {'TFLOP/s':>9} {'per GPU':>9}")
  for r in rows:
    tflops = flops / r["seconds"] / 1e12
    r.update(t=t, tflops=tflops, tflops_per_device=tflops / r["devices"])
    print(f"{r['impl']:<28} {r['seconds'] * 1e3:>9.2f} {r['tflops']:>9.1f}"
          f" {r['tflops_per_device']:>9.1f}")
  return rows


# 6. every strategy, and auto's pick ---------------------------------------------------------

STRATEGY_H, STRATEGY_D = 8, 64


def bench_every_strategy(t: int, mask, repeats: int) -> list[dict]:
  """Part 6 for one T and mask: a row per strategy, and auto's pick."""
  from flaxattn import planner
  from flaxattn.context_parallel import choose

  keys = jax.random.split(jax.random.key(t), 3)
  host = tuple(jax.random.normal(key, (1, t, STRATEGY_H, STRATEGY_D), jnp.float32) for key in keys)
  flat = jax.make_mesh((8,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  grid = jax.make_mesh((2, 4), ("context_ring", AXIS), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  cases = [("ring", flat, flaxattn.ContextParallel(AXIS, "ring")),
           ("all_gather", flat, flaxattn.ContextParallel(AXIS, "all_gather")),
           ("ulysses", flat, flaxattn.ContextParallel(AXIS, "ulysses")),
           ("ulysses_ring", grid,
            flaxattn.ContextParallel(AXIS, "ulysses", ring_axis="context_ring"))]
  shapes = planner.Shapes(1, t, STRATEGY_H, STRATEGY_H, STRATEGY_D, 4, mask, True)
  rows = []
  for name, mesh, cp in cases:
    def loss(q, k, v, cp=cp):
      out = flaxattn.attention(q, k, v, mask=mask, backend="fused", context_parallel=cp)
      return jnp.sum(out * out)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
      sharding = NamedSharding(mesh, P(None, cp.seq_axes))
      args = tuple(jax.device_put(x, sharding) for x in host)
      compiled = fn.lower(*args).compile()
      moved = aot.collectives(compiled.as_text())
      seconds = best_time(fn, args, repeats)
    rows.append(dict(t=t, mask=repr(mask), strategy=name, seconds=seconds,
                     bytes_moved=sum(c["bytes"] for c in moved.values()), collectives=moved,
                     temp_mib=compiled.memory_analysis().temp_size_in_bytes / MIB,
                     gflop_per_device=shapes.flops() / 8 / 1e9))
  with jax.set_mesh(flat):
    q_shape = (1, t, STRATEGY_H, STRATEGY_D)
    picked, (best, _) = choose(flaxattn.ContextParallel(AXIS, "auto", cost_model="cpu"),
                               q_shape, q_shape, 4, mask)
  measured = min(rows, key=lambda r: r["seconds"])
  pick = next(r for r in rows if r["strategy"] == picked.strategy)
  for r in rows:
    r.update(auto_pick=picked.strategy, measured_best=measured["strategy"],
             pick_over_best=pick["seconds"] / measured["seconds"])
  return rows


def print_every_strategy(rows: list[dict]):
  print(f"\n6. every strategy on 8 devices, B=1, H=Hkv={STRATEGY_H}, D={STRATEGY_D}, float32, load"
        " balanced, forward+backward (per device)")
  print(f"{'T':>6} {'mask':<18} {'strategy':<13} {'seconds':>8} {'MiB moved':>10} {'temp MiB':>9}"
        f" {'GFLOP':>7}")
  for r in rows:
    print(f"{r['t']:>6} {r['mask']:<18} {r['strategy']:<13} {r['seconds']:>8.2f}"
          f" {r['bytes_moved'] / MIB:>10.1f} {r['temp_mib']:>9.1f} {r['gflop_per_device']:>7.1f}")
  for key in sorted({(r["t"], r["mask"]) for r in rows}):
    r = next(r for r in rows if (r["t"], r["mask"]) == key)
    print(f"T={key[0]} {key[1]}: auto (cost_model='cpu') picks {r['auto_pick']}, measured best"
          f" {r['measured_best']}; the pick takes {r['pick_over_best']:.2f}x the best time")


# 7. the kernel's rate by call length ---------------------------------------------------------

def bench_call_length(t: int, repeats: int) -> list[dict]:
  """Part 7 for one T: causal fused forward+backward on one device, Ulysses' call (T tokens,
  1 head) and a ring-step-length call (T/8 tokens, 8 heads)."""
  rows = []
  for tokens, heads in ((t, STRATEGY_H // 8), (t // 8, STRATEGY_H)):
    keys = jax.random.split(jax.random.key(tokens), 3)
    args = tuple(jax.random.normal(key, (1, tokens, heads, STRATEGY_D), jnp.float32)
                 for key in keys)

    def loss(q, k, v):
      return jnp.sum(flaxattn.attention(q, k, v, mask=flaxattn.Causal(), backend="fused") ** 2)
    seconds = best_time(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), args, repeats)
    flops = 14.0 * heads * STRATEGY_D * causal_pairs(tokens)
    rows.append(dict(t=t, tokens=tokens, heads=heads, seconds=seconds,
                     gflops=flops / seconds / 1e9))
  return rows


# -------------------------------------------------------------------------------------------

def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", help="write the results to this file")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
  parser.add_argument("--t-time", type=int,
                      help="T of parts 3 and 5 (default 32768; 4096 with --quick)")
  parser.add_argument("--strategy-lengths", type=int, nargs="+",
                      help="T of part 6 (default 16384 32768; 2048 with --quick)")
  parser.add_argument("--strategy-masks", nargs="+", default=["causal", "4096"],
                      help="masks of part 6: causal, or a Local window in tokens")
  parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7],
                      help="which parts to run (default all)")
  args = parser.parse_args()
  t_mem, t_bal, t_time = (4096, 4096, 4096) if args.quick else (16384, 16384, 32768)
  t_time = args.t_time or t_time
  lengths = args.strategy_lengths or ([2048] if args.quick else [16384, 32768])
  cps, cp_max = (2, 4, 8), 8
  start = time.perf_counter()
  cores = os.cpu_count()
  results = dict(devices=len(jax.devices()), cpu_cores=cores, quick=args.quick, parts=args.parts)
  print(f"{len(jax.devices())} {jax.devices()[0].platform} devices on {cores} CPU cores")
  print(f"B={B} H={H} D={D} float32, causal, forward+backward in parts 1-3")

  if 1 in args.parts and devices.enough(cp_max, "\n1. per-device compiled memory"):
    mem_rows = bench_memory(t_mem, cps)
    print(f"\n1. per-device compiled memory, T={t_mem} (MiB)")
    print(f"{'strategy':<11} {'cp':>3} {'T/cp':>6} {'temp':>8} {'args':>7} {'outputs':>8}")
    for r in mem_rows:
      print(f"{r['strategy']:<11} {r['cp']:>3} {t_mem // r['cp']:>6} {r['temp_mib']:>8.1f}"
            f" {r['argument_mib']:>7.1f} {r['output_mib']:>8.1f}")
    temp = {(r["strategy"], r["cp"]): r["temp_mib"] for r in mem_rows}
    ratios = {s: temp[(s, cps[-1])] / temp[(s, cps[0])] for s in ("ring", "all_gather")}
    print(f"temp cp={cps[-1]} / cp={cps[0]}: ring {ratios['ring']:.3f} (target <= 0.45),"
          f" all_gather {ratios['all_gather']:.3f}")
    print("(argument sizes fall as 1/cp: memory_analysis describes one device's program)")
    results.update(memory=mem_rows, temp_ratio_last_over_first=ratios)

  if 2 in args.parts:
    bal = bench_balance(t_bal, cp_max)
    b0 = bal["balanced"]
    print(f"\n2. blocks computed (kind != SKIP) per device over the {cp_max} ring steps, forward"
          f" (backward has the same schedule);\n   T={t_bal}, cp={cp_max},"
          f" local T/cp={t_bal // cp_max}, blocks {b0['block_q']}x{b0['block_k']},"
          f" {b0['blocks_per_step']} pairs per step")
    print(f"{'layout':<12} " + " ".join(f"{'r=' + str(r):>5}" for r in range(cp_max))
          + f" {'total':>6} {'max/min':>8}")
    for name, b in bal.items():
      print(f"{name:<12} " + " ".join(f"{c:>5}" for c in b["computed_per_device"])
            + f" {b['total_computed']:>6} {b['max_over_min']:>8.2f}")
    for name, b in bal.items():
      print(f"\n{name}: FULL/PARTIAL blocks per ring step s (rows: device r)")
      print(f"{'':<5}" + " ".join(f"{'s=' + str(s):>6}" for s in range(cp_max)))
      for r in range(cp_max):
        print(f"{'r=' + str(r):<5}" + " ".join(
            f"{str(b['full_per_step'][r][s]) + '/' + str(b['partial_per_step'][r][s]):>6}"
            for s in range(cp_max)))
      off = sum(b["partial_per_step"][r][s] for r in range(cp_max) for s in range(1, cp_max))
      print(f"PARTIAL blocks off the diagonal step (s>0): {off}")
    causal_total = causal_pairs(t_bal)
    ideal = causal_total / (b0['block_q'] * b0['block_k'])
    print(f"(ideal: {ideal:.1f} block-equivalents of causal pairs in all)")
    chunk = t_bal // (2 * cp_max)
    if chunk % b0["block_q"]:
      print(f"note: load-balanced chunks (T/2cp = {chunk}) are not a multiple of the block"
            f" ({b0['block_q']}): a block holds parts of two chunks, its position range spans both,"
            " and the schedule can only mask it, not skip it")

    results.update(balance=bal)

  if 3 in args.parts and devices.enough(cp_max, "\n3. ring vs all_gather"):
    print(f"\n3. ring vs all_gather, T={t_time}, cp={cp_max}, vs fused on one device (no mesh)")
    time_rows = bench_strategies(t_time, cp_max, args.repeats)
    print(f"{'case':<14} {'impl':<17} {'seconds':>8} {'x 1 dev':>8} {'GFLOP/s':>8}"
          f" {'temp MiB/dev':>13} {'args MiB/dev':>13}")
    for r in time_rows:
      print(f"{r['case']:<14} {r['impl']:<17} {r['seconds']:>8.2f} {r['x_single_device']:>8.2f}"
            f" {r['gflops']:>8.1f} {r['temp_mib']:>13.1f} {r['argument_mib']:>13.1f}")
    print(f"note: the {cp_max} simulated devices share {cores} CPU cores, so these wall times"
          " compare the total work done,\nnot parallel speedup; best of"
          f" {args.repeats} after a warm-up run.")
    results.update(strategies=time_rows)

  if 4 in args.parts:
    t_plan = 1024 if args.quick else 8192
    plan_rows = [gpu_ring_plan(cp, case, t_plan)
                 for cp in (4, 8) if devices.enough(cp, f"\n4. the GPU ring's plans at cp={cp}")
                 for case in ("causal", "packed", "packed, many documents", "packed, positions x2",
                              "Local")]
    if plan_rows:
      print_gpu_ring_plans(plan_rows)
    results.update(gpu_ring_plans=plan_rows)

  if 5 in args.parts:
    results.update(gpu_ring=bench_gpu_ring(t_time, args.repeats))

  if 6 in args.parts and devices.enough(8, "\n6. every strategy"):
    masks = [flaxattn.Causal() if m == "causal" else flaxattn.Local(int(m))
             for m in args.strategy_masks]
    rows = [r for t in lengths for mask in masks
            for r in bench_every_strategy(t, mask, args.repeats)]
    print_every_strategy(rows)
    results.update(every_strategy=rows)

  if 7 in args.parts:
    rows = [r for t in lengths for r in bench_call_length(t, args.repeats)]
    print("\n7. one device, causal, forward+backward, float32, D=64: the kernel's rate by call"
          " length")
    print(f"{'T':>6} {'tokens':>7} {'heads':>5} {'seconds':>8} {'GFLOP/s':>8}")
    for r in rows:
      print(f"{r['t']:>6} {r['tokens']:>7} {r['heads']:>5} {r['seconds']:>8.3f}"
            f" {r['gflops']:>8.1f}")
    results.update(call_length=rows)

  results["script_seconds"] = time.perf_counter() - start
  print(f"\nscript time {results['script_seconds']:.0f} s")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
