"""THD seqlens/offsets from segment ids: flaxattn's O(T) walk vs the O(T^2) mask derivation.

Compares compiled temporary memory (`memory_analysis().temp_size_in_bytes`; compiling
allocates nothing, so the [T, T] version can be measured at any T) and wall time. The
mask version is timed only at a small T, where its mask fits in memory.

  python -m bench.seqlens [--t 131072] [--max-segments 256] [--batch 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxattn.segments import seqlens_and_offsets

TIME_T = 8192  # largest T at which the [T, T] version is run, not only compiled


def mask_based(ids_BxT, max_segments: int):
  """Old TransformerEngine's way: a [T, T] same-document mask, lengths read off its rows."""
  nz_BxT = ids_BxT != 0
  same_BxTxT = (ids_BxT[:, :, None] == ids_BxT[:, None, :]) & nz_BxT[:, :, None]
  # In that code the mask was an input built by the caller, so it existed in memory;
  # the barrier keeps XLA from fusing it into the reduction and hiding its cost.
  same_BxTxT = jax.lax.optimization_barrier(same_BxTxT)
  len_BxT = jnp.sum(same_BxTxT, axis=-1, dtype=jnp.int32)
  prev_BxT = jnp.pad(ids_BxT[:, :-1], ((0, 0), (1, 0)))
  first_BxT = nz_BxT & (ids_BxT != prev_BxT)
  start_BxM = jax.vmap(lambda f: jnp.nonzero(f, size=max_segments, fill_value=-1)[0])(first_BxT)
  start_BxM = start_BxM.astype(jnp.int32)
  len_BxM = jnp.where(start_BxM >= 0,
                      jnp.take_along_axis(len_BxT, jnp.maximum(start_BxM, 0), 1), -1)
  return len_BxM, start_BxM


def packed_ids(batch: int, t: int, max_segments: int, seed: int = 0) -> np.ndarray:
  """Rows of max_segments // 2 documents of random lengths, then a padding tail."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch):
    n_docs = max(1, max_segments // 2)
    cuts = np.sort(rng.choice(np.arange(1, int(t * 0.9)), n_docs, replace=False))
    ids = rng.permutation(n_docs) + 1  # unsorted ids
    row = np.zeros(t, np.int32)
    for doc, (lo, hi) in enumerate(zip(np.r_[0, cuts[:-1]], cuts, strict=True)):
      row[lo:hi] = ids[doc]
    rows.append(row)
  return np.stack(rows)


def _ours(ids, m):
  d = seqlens_and_offsets(ids, m)
  return d.q_seqlens, d.q_offsets[:, :-1]


def _measure(name, fn, batch, t, m, *, timed: bool, repeats: int = 20) -> dict:
  f = jax.jit(fn, static_argnums=1)
  compiled = f.lower(jax.ShapeDtypeStruct((batch, t), jnp.int32), m).compile()
  row = {"impl": name, "batch": batch, "t": t, "max_segments": m,
         "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes), "time_ms": None}
  if timed:
    ids = jnp.asarray(packed_ids(batch, t, m))
    out = jax.block_until_ready(compiled(ids))
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(ids))
      times.append(time.perf_counter() - t0)
    row["time_ms"] = 1e3 * float(np.median(times))
    row["out"] = out
  return row


def run(t: int = 131072, max_segments: int = 256, batch: int = 1) -> list[dict]:
  """Memory at `t` for both versions; time at `t` for ours and at min(t, 8192) for both."""
  small = min(t, TIME_T)
  rows = [
      _measure("segments (O(T))", _ours, batch, t, max_segments, timed=True),
      _measure("mask (O(T^2))", mask_based, batch, t, max_segments, timed=False),
  ]
  if small != t:
    rows += [_measure("segments (O(T))", _ours, batch, small, max_segments, timed=True),
             _measure("mask (O(T^2))", mask_based, batch, small, max_segments, timed=True)]
  else:
    rows[1] = _measure("mask (O(T^2))", mask_based, batch, t, max_segments, timed=True)
  # Both must agree where both ran, or the timing compares different work.
  ours, theirs = rows[-2].pop("out"), rows[-1].pop("out")
  for a, b in zip(ours, theirs, strict=True):
    np.testing.assert_array_equal(a, b)
  for row in rows:
    row.pop("out", None)
  return rows


def table(rows) -> str:
  lines = [f"{'impl':<18}{'B':>3}{'T':>9}{'M':>6}{'temp':>14}{'time':>12}"]
  for r in rows:
    mib = r["temp_bytes"] / 2**20
    temp = f"{mib:,.2f} MiB" if mib < 1024 else f"{mib / 1024:,.1f} GiB"
    time_ms = "not run" if r["time_ms"] is None else f"{r['time_ms']:.3f} ms"
    lines.append(f"{r['impl']:<18}{r['batch']:>3}{r['t']:>9}{r['max_segments']:>6}{temp:>14}{time_ms:>12}")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--t", type=int, default=131072)
  p.add_argument("--max-segments", type=int, default=256)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
  args = p.parse_args()
  rows = run(args.t, args.max_segments, args.batch)
  print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})")
  print(table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"backend": jax.default_backend(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
