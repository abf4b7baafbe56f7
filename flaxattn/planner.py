"""Choosing a context-parallel strategy: the cost model behind `strategy="auto"`.

Each strategy gets an estimate per device, forward+backward: compute seconds, bytes moved
and the seconds they take, peak K/V memory, and a total that overlaps what the strategy
overlaps (the ring overlaps each step's transfer with the step's compute; all-gather and
all-to-all move first, then compute). The platform numbers are TPU v5p's and H100's fitted to
compiled step estimates (`PLATFORMS`), the CPU's nominal; none is measured: override them
with `dataclasses.replace(PLATFORMS["tpu"], link=...)` and pass `platform=`.
Derivations: docs/design.md, "Choosing a strategy".
"""

from __future__ import annotations

import dataclasses
import math

from flaxattn.masks import Band, Mask, NoBand, band, reach
from flaxattn.ring import ring_fetches


def communication(strategy: str, load_balance: bool | str, mask: Mask, t: int, n: int,
                  has_positions: bool, n_ring: int | None = None) -> str:
  """The lines `explain` prints about the context parallelism: what each device receives
  (`n` devices on the context axis; `n_ring`: the ring axis of Ulysses x ring) and, in
  per-document order, which paths do not apply."""
  text = _transfers(strategy, load_balance, mask, t, n, has_positions, n_ring)
  if load_balance != "document":
    return text
  return text + (
      "\ntoken order: per document (load_balance='document'): every device holds the same"
      " attention work; kernels that mask on the token index (splash, cuDNN) run only after a"
      " per-batch check that positions follow it, which a batch with a document split over"
      " shards fails, so such a batch runs the blockwise steps")


def _transfers(strategy, load_balance, mask, t, n, has_positions, n_ring) -> str:
  if strategy == "all_gather":
    return f"context parallel (all_gather): every device gathers the keys of all {n} shards."
  lines = []
  if strategy == "ulysses":
    lines.append(f"context parallel (ulysses): all-to-alls over {n} devices trade sequence"
                 f" shards for head shards (q, k, v in, out back); each device then sees"
                 + (f" its ring shard, T/{n_ring} tokens, for H/{n} heads" if n_ring else
                    f" all T tokens for H/{n} heads"))
    if not n_ring:
      return lines[0] + "."
    n = n_ring
  fetches = ring_fetches(mask, t, n, load_balance)
  if fetches is None:
    lines.append(f"ring over {n} devices: keys of every other shard visit,"
                 f" {n - 1} step{'s' if n > 2 else ''}")
    if load_balance == "document" and reach(mask) is not None:
      lines[-1] += (f" (per-document order: {mask!r} is short, but a document's neighbouring"
                    " tokens may be on any shard, so the window-aware ring's neighbour fetches"
                    " do not apply)")
  else:
    bound = reach(mask)
    assert bound is not None  # fetches exist only for a bounded reach
    back, ahead = bound
    chunk = t // (2 * n)
    sides = "before" if not ahead else "after" if not back else "beside"
    if load_balance and all(part is not None for _, part in fetches):
      what = (f"at most one chunk (T/2cp = {chunk} tokens), so each device receives only"
              f" the chunk {sides} each of its own: half a shard from each neighbouring device")
    elif load_balance:
      m = len(fetches) // 2
      what = (f"{m} chunks of T/2cp = {chunk} tokens, so each device receives only the shards"
              f" of the {m} devices on each side ({2 * m} of {n - 1} steps)")
    else:
      what = (f"{len(fetches)} shard(s) of T/cp = {t // n} tokens, so each device receives only"
              f" the {len(fetches)} shard(s) {sides} its own ({len(fetches)} of {n - 1} steps)")
    check = ("; positions checked per batch at run time, a batch whose positions do not"
             " follow the token index runs every step" if has_positions else "")
    reaches = f"back {back}" + (f" and ahead {ahead}" if ahead else "")
    lines.append(f"ring over {n} devices: {mask!r} reaches {reaches} tokens, within"
                 f" {what}{check}")
  return ("context parallel: " if len(lines) == 1 else "") + "; then ".join(lines) + "."


@dataclasses.dataclass(frozen=True)
class Platform:
  """Per-device numbers the cost model uses (`PLATFORMS`: fitted to compiled estimates, not
  measured; replace them with measured ones where there are some).

  flops: attention FLOP/s a device sustains on long sequences; half_rate_tokens: the query
  length per kernel call at which it sustains half of that (short calls keep fewer cores
  busy and pay fixed costs); link: bytes/s a device sends to its ring neighbour;
  all_to_all: bytes/s per device of an all-to-all over the context axis; step_overhead:
  fixed seconds per ring step (kernel launch and synchronisation).
  """

  flops: float
  half_rate_tokens: int
  link: float
  all_to_all: float
  step_overhead: float

  def compute_seconds(self, flops: float, tokens: int) -> float:
    """Seconds of `flops` in kernel calls of `tokens` queries each."""
    return flops / self.flops * (tokens + self.half_rate_tokens) / tokens


PLATFORMS = {
    # TPU v5p and H100 SXM calibrated against compiled estimates (`python -m bench.calibrate
    # --platform v5p|h100`, bench/results/calibrate_v5p.json and calibrate_h100.json):
    # attention alone, ring, all_gather and Ulysses at 2K, 8K and 32K tokens a device over
    # 2, 4 and 8 devices, each compiled and estimated by `flaxattn.aot.estimate`. flops and
    # link are the figures those estimates take (the chip's peak bf16 FLOP/s, one ICI port
    # or NVLink one way), the rest fitted: RMS of log(model / estimate) 0.17 (v5p) and 0.15
    # (H100), against 0.86 and 0.85 for the nominal numbers before. The estimates are
    # rooflines: kernels at peak whatever their length, hence half_rate_tokens 0.
    "tpu": Platform(flops=4.59e14, half_rate_tokens=0, link=1e11, all_to_all=1.92e11,
                    step_overhead=0.0),
    "gpu": Platform(flops=9.894e14, half_rate_tokens=0, link=4.5e11, all_to_all=8.66e11,
                    step_overhead=2.3e-5),
    # Simulated devices sharing a host's cores: memory copies, slow compute (nominal).
    "cpu": Platform(flops=5e10, half_rate_tokens=128, link=5e9, all_to_all=5e9,
                    step_overhead=1e-4),
}


@dataclasses.dataclass(frozen=True)
class Cost:
  """The estimate of one strategy, per device, forward+backward (None fields: not possible)."""

  strategy: str
  seconds: float | None
  compute_s: float = 0.0
  comm_s: float = 0.0
  bytes_moved: int = 0
  kv_memory: int = 0  # bytes of keys and values held at once
  why_not: str | None = None

  def line(self) -> str:
    if self.seconds is None:
      return f"{self.strategy:>10}: not possible: {self.why_not}"
    return (f"{self.strategy:>10}: {self.seconds * 1e3:9.3f} ms (compute {self.compute_s * 1e3:.3f}"
            f" ms, {self.bytes_moved / 2**20:.1f} MiB moved in {self.comm_s * 1e3:.3f} ms,"
            f" K/V held {self.kv_memory / 2**20:.1f} MiB)")


def visible_pairs(mask: Mask, t: int) -> int:
  """(query, key) pairs `mask` shows in one document of `t` tokens (`masks.Band.pairs`;
  masks without a normal form count as causal)."""
  try:
    normal = band(mask)
  except NoBand:
    normal = Band(hi=0)
  return int(normal.pairs(t))


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What the model needs of a call: q `[B, T, H, D]`, k/v `[B, T, Hkv, D]`, bytes per
  element, the mask and whether the tokens are load balanced."""

  b: int
  t: int
  h: int
  hkv: int
  d: int
  itemsize: int
  mask: Mask
  load_balance: bool | str  # True: row order, "document", False

  def flops(self) -> float:
    """Forward (2 matmuls) + backward (5): 7 x 2 B H D flops per visible pair."""
    return 14.0 * self.b * self.h * self.d * visible_pairs(self.mask, self.t)

  def kv_bytes(self, tokens: int, kv_heads: int | None = None) -> int:
    """Bytes of K and V for `tokens` tokens (and `kv_heads` heads)."""
    heads = self.hkv if kv_heads is None else kv_heads
    return 2 * self.b * tokens * heads * self.d * self.itemsize

  def imbalance(self) -> float:
    """Slowest device's compute over the mean: causal without load balancing, about 2."""
    try:
      hi = band(self.mask).hi
    except NoBand:
      hi = 0  # counted as causal
    causal = hi is not None and hi <= 0
    return 2.0 if causal and not self.load_balance else 1.0


def ring(s: Shapes, n: int, p: Platform, fetches=None) -> Cost:
  """The ring over n devices (`fetches`: `ring.ring_fetches`, None = every step)."""
  shard = s.kv_bytes(s.t // n)
  if fetches is None:
    steps = n - 1
    per_step = shard
    moved = (3 * n - 2) * shard  # K/V fwd, again bwd, dK/dV back home
  else:
    steps = len(fetches)
    per_step = shard if any(part is None for _, part in fetches) else shard // 2
    moved = 2 * steps * per_step  # K/V there, their gradients back
  compute = p.compute_seconds(s.flops() / n * s.imbalance(), s.t // n)
  step_compute = compute / (steps + 1)
  comm = moved / p.link
  seconds = (step_compute + steps * max(step_compute, comm / max(steps, 1))
             + (steps + 1) * p.step_overhead)
  return Cost("ring", seconds, compute, comm, moved, 2 * shard)


def all_gather(s: Shapes, n: int, p: Platform) -> Cost:
  """K/V gathered (forward), their gradients reduce-scattered (backward)."""
  shard = s.kv_bytes(s.t // n)
  moved = 2 * (n - 1) * shard
  compute = p.compute_seconds(s.flops() / n * s.imbalance(), s.t // n)
  comm = moved / p.link
  return Cost("all_gather", compute + comm + p.step_overhead, compute, comm, moved, n * shard)


def ulysses_kv_heads(h: int, hkv: int, n: int) -> int | None:
  """KV heads after the least replication that lets n devices split the heads (each device's
  query heads then share its KV heads), or None when the heads cannot be split."""
  kv = math.lcm(hkv, n)
  return kv if h % n == 0 and h % kv == 0 else None


def ulysses(s: Shapes, n: int, p: Platform) -> Cost:
  """All-to-all to heads sharded (q, k, v in, out back; the same again backward)."""
  kv = ulysses_kv_heads(s.h, s.hkv, n)
  if kv is None:
    return Cost("ulysses", None, why_not=f"{s.h} query heads on {s.hkv} KV heads do not split"
                f" over {n} devices")
  local = s.t // n
  q_bytes = s.b * local * s.h * s.d * s.itemsize
  moved = int(2 * (2 * q_bytes + s.kv_bytes(local, kv)) * (n - 1) / n)
  compute = p.compute_seconds(s.flops() / n, s.t)
  comm = moved / p.all_to_all
  return Cost("ulysses", compute + comm, compute, comm, moved, s.kv_bytes(s.t, kv // n))


def hybrid(s: Shapes, n_ulysses: int, n_ring: int, p: Platform) -> Cost:
  """All-to-all over n_ulysses devices, then the ring over n_ring on T / n_ring tokens."""
  kv = ulysses_kv_heads(s.h, s.hkv, n_ulysses)
  if kv is None:
    return Cost("ulysses_ring", None, why_not=f"{s.h} query heads on {s.hkv} KV heads do not"
                f" split over {n_ulysses} devices")
  n = n_ulysses * n_ring
  local = s.t // n
  q_bytes = s.b * local * s.h * s.d * s.itemsize
  a2a = int(2 * (2 * q_bytes + s.kv_bytes(local, kv)) * (n_ulysses - 1) / n_ulysses)
  inner = dataclasses.replace(s, h=s.h // n_ulysses, hkv=kv // n_ulysses)
  r = ring(inner, n_ring, p)
  assert r.seconds is not None  # the ring is always possible
  comm = a2a / p.all_to_all + r.comm_s
  return Cost("ulysses_ring", r.seconds + a2a / p.all_to_all, r.compute_s, comm,
              a2a + r.bytes_moved, r.kv_memory)


def plan(q_shape, kv_shape, itemsize: int, mask: Mask, load_balance: bool | str, n: int,
         platform: str | Platform, n_ring: int | None = None) -> tuple[Cost, list[Cost]]:
  """The fastest strategy for q `[B, T, H, D]` and k/v `[B, T, Hkv, D]` sharded over n
  devices (ties: less K/V memory), and every strategy's estimate. `load_balance` is
  `ContextParallel`'s: per-document order ("document") counts as balanced with every ring
  step, and with a short window adds the row order's window-aware ring for comparison.

  `n_ring`: a 2-D context mesh (Ulysses over n devices, a ring over n_ring), on which the
  hybrid is the one strategy that uses both axes. `platform`: a `PLATFORMS` key or numbers.

  Raises:
    ValueError: no strategy can split the call (the reasons of each).
  """
  p = PLATFORMS[platform] if isinstance(platform, str) else platform
  b, t, h, d = q_shape
  s = Shapes(b, t, h, kv_shape[2], d, itemsize, mask, load_balance)
  if n_ring:
    costs = [hybrid(s, n, n_ring, p)]
  else:
    costs = [ring(s, n, p, ring_fetches(mask, t, n, load_balance)), all_gather(s, n, p),
             ulysses(s, n, p)]
    costs += _row_order_ring(s, n, p, costs[0])
  possible = [c for c in costs if c.seconds is not None]
  if not possible:
    raise ValueError("no context-parallel strategy serves this call: "
                     + "; ".join(f"{c.strategy}: {c.why_not}" for c in costs))
  return min(possible, key=lambda c: (c.seconds, c.kv_memory)), costs


def _row_order_ring(s: Shapes, n: int, p: Platform, here: Cost) -> list[Cost]:
  """In per-document order with a short window or chunks: the window-aware ring that row
  order would allow, as a line for `explain` (the token order is the data's, not the
  call's to choose)."""
  if s.load_balance != "document":
    return []
  fetches = ring_fetches(s.mask, s.t, n, True)
  if fetches is None:
    return []
  alt = ring(dataclasses.replace(s, load_balance=True), n, p, fetches)
  assert alt.seconds is not None and here.seconds is not None  # rings are always possible
  return [Cost("ring, row order", None, why_not=(
      f"the data is in per-document order; in row order (load_balance=True) the window-aware"
      f" ring would take {alt.seconds * 1e3:.3f} ms ({alt.bytes_moved / 2**20:.1f} MiB moved)"
      f" against {here.seconds * 1e3:.3f} ms here, if its rows are as even as one document"
      " per row (packed rows of long-tailed lengths are not: bench/README.md)"))]


def describe_plan(best: Cost, costs: list[Cost]) -> str:
  """The lines `explain` prints for `strategy="auto"`."""
  lines = [f"strategy='auto' chose {best.strategy}; per-device estimates, forward+backward"
           " (platform numbers: flaxattn.planner.PLATFORMS,"
           " ContextParallel(cost_model=...)):"]
  lines += ["  " + c.line() for c in costs]
  others = [c for c in costs if c.seconds is not None and c is not best]
  if others:
    runner = min(others, key=lambda c: c.seconds or 0.0)  # all have seconds
    assert runner.seconds is not None and best.seconds is not None
    lines.append(f"  {best.strategy} wins: estimated {runner.seconds / best.seconds:.2f}x faster"
                 f" than {runner.strategy}, the next best")
  return "\n".join(lines)
