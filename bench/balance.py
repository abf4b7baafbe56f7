"""Load balancing of packed rows: per-device attention work, and one timed step.

  python -m bench.balance [--json bench/results/balance_cpu.json] [--repeats 5] [--no-time]

Sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax (on a GPU host
the GPUs are the devices: with fewer than 8 the timed step is skipped, saying so).

1. Work (exact arithmetic, no timing): a query sees as many keys as its mask and document
   allow (`flaxattn.balance.token_work`, summed over a model's layer masks); a device's
   work is the sum over the queries it holds. Per row, max/mean over the cp devices for
   three orders: contiguous shards, row order (`flaxattn.load_balance(x, cp)`, dual chunk)
   and document order (`flaxattn.balance_plan(seg, cp, masks)`); the mean over the rows and
   the worst row. Rows:
   - log-normal document lengths (median, sigma), packed first-fit into 20 rows (a document
     placed in the first row with room; one longer than a row split into row-sized
     pieces; drawing stops after 200 documents in a row fit nowhere; the rest is padding);
   - the demo corpus (the standard library's `.py` files, byte tokens, so a document's
     tokens are its file's bytes), shuffled, split into pieces of at most T, packed
     first-fit into 16 open rows (the trainer's `packing_bins`: a piece that fits none closes
     the fullest), the first 20 rows.
2. Time: one fwd+bwd (gradient of sum(out^2) w.r.t. q, k, v) of ring attention over 8
   simulated devices (blockwise kernel, causal, B=1, T=32768, H=4, D=64, float32, explicit
   segment ids and positions), on the row of 20 log-normal rows (median 2K, sigma 1.2)
   whose row order is worst, in row order (`ContextParallel(load_balance=True)`) and in
   document order (`load_balance="document"`, pieces of the blockwise kernel's 512-token
   blocks, documents renumbered by `BalancePlan.segment_ids`); best of `--repeats` after a
   warm-up. The 8
   devices share this host's CPU cores, so the wall time follows the total work more than
   the busiest device's. Hence also each device's own share timed alone, one device at a
   time: its queries against all keys, blockwise fwd+bwd on one device, best of
   `--repeats`; the slowest device's time is the step's critical path on devices that run
   in parallel. And, exact: the (query block, key block) pairs the blockwise kernel
   computes for each device's queries (`blocks.block_schedule`, 512-token blocks).
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
from jax.sharding import AxisType  # noqa: E402

import flaxattn  # noqa: E402
from bench import devices  # noqa: E402
from flaxattn import balance, blocks  # noqa: E402

ROWS = 20
BLOCK = 512  # the blockwise kernel's block on CPU (`flaxattn.blockwise.DEFAULT_BLOCK_Q`)
K = 1024
CAUSAL = [flaxattn.Causal()]
LOCAL = [flaxattn.Local(4096)]
# Models that mix sliding-window and global layers: gpt-oss alternates, Gemma 3 has five
# windowed layers per global one.
MIXED_1_1 = [flaxattn.Local(4096), flaxattn.Causal()]
MIXED_5_1 = [flaxattn.Local(4096)] * 5 + [flaxattn.Causal()]


def first_fit(lengths, t: int, rows: int | None = None, open_rows: int | None = None):
  """`[rows, t]` int32 segment ids of documents of `lengths` (an iterator), split into
  pieces of at most t, packed first-fit: into `rows` rows all open at once (stops after 200
  pieces in a row fit nowhere), or with `open_rows` open (a piece that fits none closes the
  fullest) until `rows` rows are closed."""
  done, open_ = [], []
  misses = 0

  def close(row):
    seg = np.zeros(t, np.int32)
    at = 0
    for i, n in enumerate(row, 1):
      seg[at:at + n] = i
      at += n
    done.append(seg)

  for n in lengths:
    for piece in [t] * (n // t) + ([n % t] if n % t else []):
      fits = [row for row in open_ if t - sum(row) >= piece]
      if fits:
        fits[0].append(piece)
        misses = 0
        continue
      if open_rows is None:
        if len(open_) < rows:
          open_.append([piece])
          continue
        misses += 1
        if misses >= 200:
          for row in open_:
            close(row)
          return np.stack(done)
        continue
      if len(open_) == open_rows:
        fullest = max(open_, key=sum)
        open_.remove(fullest)
        close(fullest)
        if len(done) == rows:
          return np.stack(done)
      open_.append([piece])
  raise ValueError("ran out of documents")


def lognormal_rows(t: int, median: int, sigma: float, seed: int = 0):
  rng = np.random.default_rng(seed)
  lengths = (max(1, int(rng.lognormal(np.log(median), sigma))) for _ in iter(int, 1))
  return first_fit(lengths, t, rows=ROWS)


def demo_rows(t: int, seed: int = 0):
  import logging  # pylint: disable=import-outside-toplevel

  from train.data import list_documents  # pylint: disable=import-outside-toplevel
  logging.getLogger("train.data").setLevel(logging.ERROR)  # the 3 undecodable files it skips
  docs = list_documents("stdlib")
  sizes = np.array([os.path.getsize(d.source.path) for d in docs])  # stdlib: TextFile
  sizes = sizes[np.random.default_rng(seed).permutation(len(sizes))]
  return first_fit((int(n) for n in sizes if n >= 2), t, rows=ROWS, open_rows=16)


def ratios(seg, cp: int, masks) -> dict:
  """max/mean per-device work of each order: mean over rows and the worst row."""
  work = balance.token_work(seg, masks)
  per_device = {
      "contiguous": work.reshape(len(seg), cp, -1).sum(-1),
      "row": flaxattn.load_balance(work, cp).reshape(len(seg), cp, -1).sum(-1),
      "document": balance.balance_plan(seg, cp, masks).shard_work,
  }
  out = {}
  for order, w in per_device.items():
    r = w.max(-1) / w.mean(-1)
    out[order] = {"mean": float(r.mean()), "worst": float(r.max())}
  return out


ROW_SETS = {  # name: rows
    "128K, cp=8, median 2K (sigma 1.2)": lambda: lognormal_rows(128 * K, 2 * K, 1.2),
    "128K, cp=8, median 8K (sigma 1.0)": lambda: lognormal_rows(128 * K, 8 * K, 1.0),
    "1M, cp=64, median 4K (sigma 1.5)": lambda: lognormal_rows(1024 * K, 4 * K, 1.5),
    "demo corpus 32K": lambda: demo_rows(32 * K),
    "demo corpus 128K": lambda: demo_rows(128 * K),
}


def work_tables(quick: bool) -> list[dict]:
  settings = [  # rows, cp, masks name, masks
      ("128K, cp=8, median 2K (sigma 1.2)", 8, "causal", CAUSAL),
      ("128K, cp=8, median 8K (sigma 1.0)", 8, "causal", CAUSAL),
      ("128K, cp=8, median 2K (sigma 1.2)", 8, "Local(4096)", LOCAL),
      ("128K, cp=8, median 2K (sigma 1.2)", 8, "Local(4096) + global 1:1", MIXED_1_1),
      ("128K, cp=8, median 2K (sigma 1.2)", 8, "Local(4096) + global 5:1", MIXED_5_1),
      ("1M, cp=64, median 4K (sigma 1.5)", 64, "causal", CAUSAL),
      ("1M, cp=64, median 4K (sigma 1.5)", 64, "Local(4096) + global 1:1", MIXED_1_1),
  ]
  for rows in ("demo corpus 32K", "demo corpus 128K"):
    for cp in (4, 8, 64):
      settings += [(rows, cp, "causal", CAUSAL), (rows, cp, "Local(4096) + global 1:1", MIXED_1_1)]
  if quick:
    settings = settings[:1]
  results, rows_of = [], {}
  for rows, cp, masks_name, masks in settings:
    if rows not in rows_of:
      rows_of[rows] = ROW_SETS[rows]()
    seg = rows_of[rows]
    name = f"{rows}{'' if 'cp=' in rows else f', cp={cp}'}, {masks_name}"
    start = time.perf_counter()
    r = ratios(seg, cp, masks)
    r.update(setting=name, cp=cp, rows=len(seg), t=seg.shape[1],
             padding=float((seg == 0).mean()), docs_per_row=float(
                 np.mean([len(np.unique(s[s > 0])) for s in seg])),
             seconds=time.perf_counter() - start)
    results.append(r)
    cells = [f"{r[o]['mean']:.{digits}f} ({r[o]['worst']:.{digits}f})"
             for o, digits in (("contiguous", 2), ("row", 2), ("document", 3))]
    print(f"| {name} | {r['docs_per_row']:.0f} | {' | '.join(cells)} |", flush=True)
  return results


def _best(fn, repeats: int) -> float:
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def timed_step(repeats: int) -> dict:
  t, cp, h, d = 32 * K, 8, 4, 64
  rows = lognormal_rows(t, 2 * K, 1.2, seed=1)
  work = balance.token_work(rows)
  row_order = flaxattn.load_balance(work, cp).reshape(len(rows), cp, -1).sum(-1)
  seg = rows[np.argmax(row_order.max(-1) / row_order.mean(-1))][None]
  index = np.arange(t)
  starts = np.r_[True, seg[0, 1:] != seg[0, :-1]]
  pos = (index - np.maximum.accumulate(np.where(starts, index, 0)))[None].astype(np.int32)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, t, h, d)), jnp.float32) for _ in range(3))
  mesh = jax.make_mesh((cp,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:cp])
  plan = balance.balance_plan(seg, cp, block=BLOCK)
  def row(x):
    return flaxattn.load_balance(x, cp)
  orders = {"row": (row, row, True), "document": (plan.apply, plan.segment_ids, "document")}
  out = {}
  for name, (permute, ids, lb) in orders.items():
    cpar = flaxattn.ContextParallel(load_balance=lb)
    s, p = ids(seg), permute(pos)
    qp, kp, vp = (permute(x) for x in (q, k, v))
    w = permute(balance.token_work(seg)).reshape(cp, -1).sum(-1)
    # The (query block, key block) pairs the blockwise kernel computes for each device's
    # queries (exact, from its schedule): what its time follows.
    kinds = blocks.block_schedule(np, flaxattn.Causal(), s, s, p, p, BLOCK, BLOCK)[0]
    computed = (kinds != blocks.EMPTY).reshape(cp, -1).sum(-1)

    def loss(q, k, v, s=s, p=p, cpar=cpar):
      out = flaxattn.attention(q, k, v, segment_ids=s, positions=p, context_parallel=cpar,
                               backend="blockwise")
      return jnp.sum(out.astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
      step = jax.jit(jax.grad(loss, (0, 1, 2)))
      seconds = _best(functools.partial(step, qp, kp, vp), repeats)

    def local_loss(q_r, k, v, s_r, p_r, s, p):
      out = flaxattn.attention(q_r, k, v, segment_ids=s_r, positions=p_r, kv_segment_ids=s,
                               kv_positions=p, backend="blockwise")
      return jnp.sum(out.astype(jnp.float32) ** 2)

    local = jax.jit(jax.grad(local_loss, (0, 1, 2)))
    n = t // cp

    def alone(r, local=local, qp=qp, kp=kp, vp=vp, s=s, p=p, n=n):
      return local(qp[:, r * n:(r + 1) * n], kp, vp, s[:, r * n:(r + 1) * n],
                   p[:, r * n:(r + 1) * n], s, p)
    per_device = [_best(functools.partial(alone, r), repeats) for r in range(cp)]
    out[name] = {"fwd_bwd_8_devices_s": seconds, "work_max_over_mean": float(w.max() / w.mean()),
                 "blocks_per_device": computed.tolist(),
                 "per_device_alone_s": per_device,
                 "per_device_alone_max_s": max(per_device),
                 "per_device_alone_max_over_mean": max(per_device) / float(np.mean(per_device))}
    print(f"| {name} | {w.max() / w.mean():.2f} | {computed.sum()} | {computed.max()}"
          f" ({computed.max() / computed.mean():.2f}) | {seconds:.3f} | {max(per_device):.3f} |"
          f" {max(per_device) / np.mean(per_device):.2f} |", flush=True)
  out["setting"] = dict(t=t, cp=cp, heads=h, head_dim=d,
                        docs=int(len(np.unique(seg[seg > 0]))), padding=float((seg == 0).mean()))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", help="write the results to this file")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--quick", action="store_true", help="one work setting")
  parser.add_argument("--no-time", action="store_true", help="skip the timed step")
  args = parser.parse_args()
  print("| rows, cp, documents, masks | docs/row | contiguous | row order | document order |")
  print("|---|---:|---:|---:|---:|")
  results = {"work": work_tables(args.quick)}
  if not args.no_time and devices.enough(8, "\nthe timed step (ring over 8 devices)"):
    print("\n| order | work max/mean | blocks computed | busiest device's blocks (max/mean) |"
          " fwd+bwd, 8 devices (s) | slowest device alone (s) | device times max/mean |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    results["time"] = timed_step(args.repeats)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
