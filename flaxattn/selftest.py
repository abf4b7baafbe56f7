"""`python -m flaxattn.selftest [--quick]`: check flaxattn on the machine it runs on.

Every kernel that accepts a call is compared with the reference (forward, log-sum-exp and
gradients) on small shapes: every mask, packed and default layouts, GQA, float32 and
bfloat16, and decode steps (3 queries against the packed keys); every context-parallel
strategy when there are several devices (Ulysses where they divide the 4 query heads).
Then causal and packed forward+backward are timed beside a matmul of the same dtype in the
same run. Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import types
import zlib
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from flaxattn import registry
from flaxattn.attention import attention
from flaxattn.balance import load_balance
from flaxattn.context_parallel import STRATEGIES, ContextParallel
from flaxattn.masks import Causal, Chunked, Full, Local

MASKS = (Full(), Causal(), Local(48), Chunked(64), Causal() & Local(100))
# Largest error relative to the reference's largest magnitude. Accelerators run float32
# matmuls at reduced precision by default, so they get bfloat16-like tolerances there too.
HEADS = 4  # query heads of every case (2 K/V heads)
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
ACCELERATOR_TOLERANCE = {"float32": 5e-3, "bfloat16": 2e-2}
DECODE_QUERIES = 3  # a decode step's new tokens (split_k serves at most 16)


@dataclasses.dataclass(frozen=True)
class Case:
  kernel: str
  mask: object
  dtype: str
  packed: bool
  strategy: str | None = None
  decode: bool = False  # `DECODE_QUERIES` queries against the packed keys, as a cache

  def __str__(self):
    cp = f", {self.strategy} over {jax.device_count()} devices" if self.strategy else ""
    packing = "packed" if self.packed else "one document"
    step = f", decode step of {DECODE_QUERIES} queries" if self.decode else ""
    return f"{self.kernel}: {self.mask}, {self.dtype}, {packing}{cp}{step}"


def _layout(b: int, t: int, packed: bool, seed: int):
  """Segment ids and positions of documents of random lengths with a padding tail."""
  if not packed:
    return None, None
  rng = np.random.default_rng(seed)
  seg = np.zeros((b, t), np.int32)
  pos = np.zeros((b, t), np.int32)
  for row in range(b):
    cuts = np.sort(rng.choice(np.arange(1, t - 8), size=4, replace=False))
    for doc, (start, end) in enumerate(zip([0, *cuts], [*cuts, t - 8], strict=True), 1):
      seg[row, start:end], pos[row, start:end] = doc, np.arange(end - start)
  return seg, pos


def _inputs(b, t, h, hkv, d, dtype, seed):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
               for shape in ((b, t, h, d), (b, t, hkv, d), (b, t, hkv, d)))


def relative_error(got, want) -> float:
  """Largest |got - want| relative to the largest |want|; inf where they differ in which
  entries are finite."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  finite = np.isfinite(want)
  if not np.array_equal(np.isfinite(got), finite):
    return float("inf")
  got, want = np.where(finite, got, 0), np.where(finite, want, 0)
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _fwd_bwd(backend, mask, seg, pos, cp=None, kv_ids=(None, None)):
  def loss(q, k, v):
    out, lse = attention(q, k, v, mask=mask, segment_ids=seg, positions=pos,
                         kv_segment_ids=kv_ids[0], kv_positions=kv_ids[1], backend=backend,
                         context_parallel=cp, return_lse=True)
    finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32))) + jnp.sum(
        jnp.sin(finite)), (out, lse)
  return jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))


def _check(case: Case, t: int, mesh) -> float:
  """Largest relative error of out, lse, dq, dk, dv against the reference."""
  b, h, hkv, d = 2, HEADS, 2, 64
  n = 1 if case.strategy is None else mesh.shape["context"]
  q, k, v = _inputs(b, t, h, hkv, d, case.dtype, seed=zlib.crc32(str(case).encode()))
  seg, pos = _layout(b, t, case.packed, seed=1)
  kv_ids = (None, None)
  if case.decode:  # queries at slots of the keys, the last one padding (nothing to see)
    assert seg is not None and pos is not None  # decode cases are packed
    slots = np.linspace(t // 4, t - 1, DECODE_QUERIES).astype(int)
    kv_ids = (seg, pos)
    q, seg, pos = q[:, slots], seg[:, slots], pos[:, slots]
  ref_pos = pos
  if case.strategy is not None:  # what a load-balancing pipeline feeds in
    index = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    q, k, v, seg, pos, ref_pos = (
        None if x is None else load_balance(x, n)
        for x in (q, k, v, seg, pos, index if pos is None else pos))
  want = _fwd_bwd("reference", case.mask, seg, ref_pos, kv_ids=kv_ids)(q, k, v)
  if case.strategy is None:
    got = _fwd_bwd(case.kernel, case.mask, seg, pos, kv_ids=kv_ids)(q, k, v)
  else:
    with jax.set_mesh(mesh):
      cp = ContextParallel(strategy=case.strategy)
      got = _fwd_bwd(case.kernel, case.mask, seg, pos, cp)(q, k, v)
  return max(relative_error(g, w)
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def _cases(platform: str, quick: bool, t: int):
  if quick:
    dtypes = ("bfloat16",) if platform != "cpu" else ("float32",)
  else:
    dtypes = ("float32", "bfloat16")
  masks = MASKS[1:4] if quick else MASKS
  for kernel in registry.names():
    if kernel == "reference":
      continue
    for mask in masks:
      for dtype in dtypes:
        for packed in ((True,) if quick else (False, True)):
          call = registry.Call(platform, (2, t, HEADS, 64), (2, t, 2, 64), dtype, mask, packed,
                               packed, True)
          if registry.get(kernel).unsupported_reason(call) is None:
            yield Case(kernel, mask, dtype, packed)
        step = registry.Call(platform, (2, DECODE_QUERIES, HEADS, 64), (2, t, 2, 64), dtype,
                             mask, True, True, True)
        if registry.get(kernel).unsupported_reason(step) is None:
          yield Case(kernel, mask, dtype, True, decode=True)


def _cp_cases(quick: bool, devices: int):
  masks = (Causal(),) if quick else MASKS
  for strategy in STRATEGIES:
    if strategy == "ulysses" and HEADS % devices:  # Ulysses splits the heads over the devices
      continue
    for mask in masks:
      yield Case("auto", mask, "float32", True, strategy)


MATMUL_EDGE = 8192  # the yardstick on accelerators: large enough to reach the device's rate
MATMUL_EDGE_CPU = 2048


def _matmul_flops(dtype, n: int, repeats: int) -> float:
  a = jnp.ones((n, n), dtype)
  return 2 * n ** 3 / best_time(jax.jit(lambda a: a @ a), (a,), repeats)


def run_times(fn, args, repeats: int, warmup: int = 1) -> list[float]:
  """Seconds of `repeats` calls of `fn(*args)` after `warmup` untimed ones, each ended by
  `block_until_ready`."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return times


def best_time(fn, args, repeats: int) -> float:
  return min(run_times(fn, args, repeats))


def _timings(lengths, dtype, repeats: int, print_fn):
  """Causal and packed (16 documents) forward+backward of backend="auto"; TFLOP/s counts
  the allowed query-key pairs x H x D x 2 flops x 6 matmuls (2 forward, 4 backward)."""
  b, h, hkv, d = 1, 8, 2, 128
  # The yardstick must reach the device's rate, or a kernel reads above it: a 4096^3 bf16
  # matmul measured 402 TFLOP/s on an H100 where 8192^3 measured 664. On a CPU 2048^3
  # reaches its rate already (and 8192^3 would take seconds).
  n = MATMUL_EDGE_CPU if jax.default_backend() == "cpu" else MATMUL_EDGE
  matmul = _matmul_flops(dtype, n, max(repeats, 3))
  print_fn(f"\n{'case':<28}{'T':>7}{'seconds':>10}{'TFLOP/s':>9}{'of matmul':>11}")
  for t in lengths:
    q, k, v = _inputs(b, t, h, hkv, d, dtype, seed=t)
    for name, docs in (("causal", 1), ("16 packed documents", 16)):
      seg = pos = None
      if docs > 1:
        seg = jnp.asarray(np.repeat(np.arange(1, docs + 1), t // docs)[None], jnp.int32)
        pos = jnp.asarray(np.tile(np.arange(t // docs), docs)[None], jnp.int32)

      def loss(q, k, v, seg=seg, pos=pos):
        # Without return_lse, one array (attention's annotation covers both).
        out = cast(jax.Array, attention(q, k, v, segment_ids=seg, positions=pos))
        return jnp.sum(out.astype(jnp.float32) ** 2)
      seconds = best_time(jax.jit(jax.grad(loss, (0, 1, 2))), (q, k, v), repeats)
      per_doc = t // docs
      flops = docs * per_doc * (per_doc + 1) / 2 * h * d * 2 * 6
      print_fn(f"{name:<28}{t:>7}{seconds:>10.4f}{flops / seconds / 1e12:>9.3f}"
               f"{flops / seconds / matmul:>11.2f}")
  print_fn(f"(of matmul: against a {n}^3 {jnp.dtype(dtype).name} matmul timed in the same run"
           f" after a warm-up, best of {max(repeats, 3)}: {matmul / 1e12:.3f} TFLOP/s)")


def selftest(quick: bool = False, print_fn=print) -> bool:
  """Checks every kernel (and context-parallel strategy with several devices) against the
  reference here, then times attention beside a matmul. Returns True if all match."""
  platform = jax.default_backend()
  t = 256  # splash's blocks are 128 tokens: two of them, so documents cross block edges
  tolerance = TOLERANCE if platform == "cpu" else ACCELERATOR_TOLERANCE
  print_fn(f"flaxattn selftest on {jax.device_count()} {platform} device(s)"
           f" ({jax.devices()[0].device_kind}), jax {jax.__version__}")
  cases = list(_cases(platform, quick, t))
  mesh, n = None, 1
  if jax.device_count() > 1:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    cases += list(_cp_cases(quick, n))
  ok = True
  for case in cases:
    error = _check(case, t * (n if case.strategy else 1), mesh)
    passed = error <= tolerance[case.dtype]
    ok &= passed
    print_fn(f"  {'ok  ' if passed else 'FAIL'} {case}: max relative error {error:.2e}"
             f" (tolerance {tolerance[case.dtype]:.0e})")
  lengths = (1024, 2048) if quick else (8192, 32768)
  _timings(lengths, jnp.float32 if platform == "cpu" else jnp.bfloat16, 1 if quick else 3, print_fn)
  print_fn(f"\n{'all kernels match the reference' if ok else 'MISMATCH: see FAIL above'}")
  return ok


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="fewer cases and short sequences (under a minute on a CPU)")
  args = parser.parse_args(argv)
  return 0 if selftest(quick=args.quick) else 1


class _CallableModule(types.ModuleType):
  """`flaxattn.selftest(...)` calls `selftest` while `python -m flaxattn.selftest` runs
  this module: one name for both."""

  def __call__(self, quick: bool = False, print_fn=print) -> bool:
    return selftest(quick=quick, print_fn=print_fn)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
  sys.exit(main())
