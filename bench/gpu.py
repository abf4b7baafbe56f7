"""The GPU report: flaxattn's attention kernels beside JAX's, tokamax's and torch's, and one
trainer step, on one NVIDIA GPU; every number from one run (meant to take under 8 minutes on
one H100).

  python -m bench.gpu [--json PATH] [--quick] [--lengths T ...] [--repeats N]
                      [--trainer-steps N] [--tilings] [--decode] [--rows [ROW ...]]

Without a GPU (jax.default_backend() is not "gpu") it prints one line saying why, measures
nothing and exits 0; with --json the file holds {"skipped": why}.

Attention: B=1, 16 query heads on 8 KV heads, D=128, bfloat16 (`bench.measure`), at T = 8K,
32K and 128K (--quick: 8K and 32K), in five cases:
  causal    one causal document;
  packed    16 equal causal documents (segment ids and positions);
  local     one document, Local(4096);
  chunked   one document, Chunked(8192) (Llama 4's chunked attention);
  document  16 equal causal documents of T/16 - 32 tokens, then 512 tokens of padding, in
            the document order of a 2-way ring's load balancing
            (`flaxattn.balance_plan(segment_ids, 2, block=128)`, as the trainer orders rows
            with data.balance=document), run as one plain call on the whole reordered row
            with the plan's renumbered segment ids and positions: the shape each ring
            step's kernel sees, documents cut into pieces whose positions are not the token
            index. (The packed row itself would not do: its documents fill the row's
            quarters exactly, the row order balances them perfectly, and balance_plan keeps
            that order, documents whole.)
Rows:
  pallas_gpu      flaxattn.pallas_gpu.PallasGpu();
  mosaic_gpu      flaxattn.mosaic_gpu.MosaicGpu() (Hopper: declines other GPUs, saying why);
  cudnn           flaxattn.cudnn.Cudnn(), with its default THD memory budget;
  cudnn_thd16/32  Cudnn(max_segments=16 / 32, thd_budget=2**50): packed rows through cuDNN's
                  THD layout whatever their temporaries;
  blockwise       flaxattn's pure-JAX kernel, the last fallback;
  auto            backend="auto", what a user gets: the kernel it picks, whose row holds the
                  same program (its figures are that row's);
  jax_nn_cudnn    jax.nn.dot_product_attention(implementation="cudnn"), where it serves the
                  case (one document, causal or a window);
  docs_as_rows    the row's 16 documents as 16 batch rows through jax.nn cuDNN: the same
                  attention with no packing to pay for, the ideal of a packed row;
  tokamax_mosaic, tokamax_triton  tokamax.dot_product_attention, where tokamax is installed;
  torch_sdpa      torch's scaled_dot_product_attention (causal), where torch has CUDA.
flaxattn's rows call `flaxattn.attention(..., backend=kernel)`, segment ids and positions
passed as arguments of the compiled programs (run-time checks see them as data). Every row
says whether it serves the case, and if not why (the registry's reason for flaxattn's
kernels). A cuDNN row whose batch fails cuDNN's run-time check (documents that are not runs
of positions 0, 1, ... in its slots) runs its fallback: status "fallback", measured. Per
cell: forward and forward+backward TFLOP/s of useful work (`bench.measure`: only the pairs
the mask and documents allow), each as a fraction of the bf16 matmul of 8192^3 timed in the
same run, and the compiled forward+backward temporaries; "OOM" where the temporaries exceed
the GPU's free memory or a run runs out of it. Times: the median of up to --repeats runs
after one warm-up, as many as fit in about half a second.

Trainer: `bench.train_step` on configs/demo.yaml with `TRAINER_OVERRIDES` (the demo model in
bfloat16 on rows of 32K tokens from the trainer's own pipeline, one GPU, no context
parallelism): tokens/s and step time, the median of --trainer-steps steps after 2 warm-up
steps, and model TFLOP/s from the batch's documents (`train.throughput.Flops`) beside the
upper bound of rows counted as one causal document each (`models.llama.flops_per_token`).

--tilings: pallas_gpu under each tiling of `TILINGS` (block_q x block_kv, warps, pipeline
stages) and mosaic_gpu under each of `MOSAIC_TILINGS` (keys per block of the forward and of
dQ, query rows per block of dK/dV, shared-memory stages), the first of each its default for
D=128 bf16, on the causal and packed cases at 32K, forward and forward+backward TFLOP/s as
above, in a table per kernel and the JSON's "tilings" (cells with a "tiling" field).

--decode: the decode row, against the bandwidth floor. One `flaxattn.MultiHeadAttention`
layer of an 8B-class model (`DecodeShape`: E=4096, H=32 on 8 KV heads, D=128, bf16
parameters and cache, RoPE, causal, B=1) over a cache of S = 32K and 128K slots holding
S - 128 tokens. Timed in alternation, medians of --repeats x 3: the step, one `jax.jit` over
the layer's split state with the cache donated, called back to back from Python (one
dispatch per token); the step in a loop on the device (`DecodeShape.loop` steps in one
`lax.fori_loop`, as `train.sample.generate` runs them, per step; its cache not donated, so
every run starts from the same one); the new token's attention alone (`flaxattn.attention`,
"auto"); and `jax.nn.dot_product_attention(implementation="xla")` over the same cache with
a boolean mask. The floor: the bytes the step must read (the cache's keys, values, segment
ids and positions and the layer's weights, once) over the rate of a device-to-device copy
measured in the same run (bytes read plus written). Goal: the step within `DECODE_GOAL`
(2x) of the floor. `--rows` with no row runs no kernel table (the decode row alone).

JSON: {"device", "jax", "command", "shapes", "matmul_tflops", "lengths", "cells": [{"kernel",
"case", "length", "status", "reason", "runs", "same_as", "pairs", "fwd_tflops", "fb_tflops",
"fwd_of_matmul", "fb_of_matmul", "fwd_ms", "fb_ms", "temp_bytes", ...}], "tilings": [...],
"decode": {"copy_bytes_per_s", "rows": [{"length", "kernel", "step_ms", "loop_step_ms",
"floor_ms", "step_over_floor", "loop_over_floor", ...}]}, "trainer": {...}, "wall_s"};
status is one of ok, fallback, declined, absent, OOM, error.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import flaxattn
from bench import measure, peers
from flaxattn import cudnn, registry
from flaxattn.cudnn import Cudnn
from flaxattn.layout import resolve
from flaxattn.masks import Mask, band
from flaxattn.mosaic_gpu import MosaicGpu
from flaxattn.pallas_gpu import PallasGpu

CASES = {  # name: what it is
    "causal": "one causal document",
    "packed": "16 equal causal documents",
    "local": "one document, Local(4096)",
    "chunked": "one document, Chunked(8192)",
    "document": "16 equal causal documents and padding in a 2-way ring's document order",
}
LENGTHS, QUICK_LENGTHS = (8192, 32768, 131072), (8192, 32768)
WINDOW, CHUNK = 4096, 8192
# The document case's ring and pieces: balance_plan's default block, as the trainer takes it.
RING, BALANCE_BLOCK = 2, 128
SHORTER = 32  # tokens by which the document case's documents are shorter than T / 16
NO_BUDGET = 1 << 50
WARMUP, BUDGET_S = 1, 0.5
ROWS = {  # name: label in the tables
    "pallas_gpu": "flaxattn pallas_gpu (Triton)",
    "mosaic_gpu": "flaxattn mosaic_gpu (Mosaic GPU, Hopper)",
    "cudnn": "flaxattn cuDNN (default budget)",
    "cudnn_thd16": "flaxattn cuDNN THD, 16 slots",
    "cudnn_thd32": "flaxattn cuDNN THD, 32 slots",
    "blockwise": "flaxattn blockwise",
    "auto": "flaxattn auto",
    "jax_nn_cudnn": "jax.nn cuDNN",
    "docs_as_rows": "docs as batch rows, jax.nn cuDNN (ideal)",
    "tokamax_mosaic": "tokamax Mosaic GPU",
    "tokamax_triton": "tokamax Triton",
    "torch_sdpa": "torch SDPA",
}
# pallas_gpu tilings for --tilings: (block_q, block_kv, num_warps, num_stages); the first is
# its default for D=128 bf16 on Hopper GPUs, the second elsewhere. Each is compiled by XLA's
# Triton when it runs: a tiling over the GPU's shared memory is reported as an error.
TILINGS = ((128, 64, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 128, 8, 2), (128, 64, 4, 2),
           (64, 64, 8, 3))
# mosaic_gpu tilings for --tilings: (block_kv, block_kv_dq, block_q_dkv, stages); the first
# is its default. Each compiles for sm_90 within shared memory (`bench.mosaic_compile
# --tilings`: 128 keys in dQ spill 8 bytes, 1 stage 52 and 168; 128 query rows in dK/dV or
# 3 stages at 128 keys would exceed shared memory).
MOSAIC_TILINGS = ((128, 64, 64, 2), (64, 64, 64, 2), (128, 128, 64, 2), (64, 64, 64, 4),
                  (128, 64, 64, 1))
TILING_CASES, TILING_LENGTH = ("causal", "packed"), 32768
PEER_LIBRARIES = {"tokamax_mosaic": "tokamax", "tokamax_triton": "tokamax", "torch_sdpa": "torch"}
DEMO_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "configs", "demo.yaml")
TRAINER_OVERRIDES = ("platform=", "num_devices=0", "mesh.context=1", "model.dtype=bfloat16",
                     "seq_len=32768", "model.max_seq_len=32768")
DECODE_LENGTHS = (32768, 131072)
DECODE_GOAL = 2.0  # the step's time over the bandwidth floor
COPY_BYTES = 2 << 30


@dataclasses.dataclass(frozen=True)
class DecodeShape:
  """The decode row's layer (head_dim = embed / heads), the empty slots its cache keeps for
  the timed steps, and the steps of its device loop."""

  embed: int = 4096
  heads: int = 32
  kv_heads: int = 8
  room: int = 128
  loop: int = 64


def flaxattn_kernels() -> dict[str, registry.Kernel]:
  """flaxattn's rows (all but auto) and their kernels."""
  thd = {f"cudnn_thd{m}": Cudnn(max_segments=m, thd_budget=NO_BUDGET) for m in (16, 32)}
  return {"pallas_gpu": PallasGpu(), "mosaic_gpu": MosaicGpu(), "cudnn": Cudnn(), **thd,
          "blockwise": registry.get("blockwise")}


@dataclasses.dataclass(frozen=True)
class Case:
  """One case at one length: the mask, segment ids and positions `[1, T]` int32 numpy (None:
  one document), the equal documents at the start of the row and their length, and the
  allowed pairs (counted in the original order)."""

  name: str
  length: int
  mask: Mask
  segment_ids: np.ndarray | None
  positions: np.ndarray | None
  docs: int
  doc_length: int
  pairs: int

  def shapes(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """q and k/v as shapes."""
    return (jax.ShapeDtypeStruct((1, self.length, measure.H, measure.D), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, self.length, measure.HKV, measure.D), jnp.bfloat16))

  def ids(self) -> tuple[jax.Array, ...]:
    """The segment ids and positions as jax arrays, () for one document: the arguments of
    flaxattn's programs after q, k, v."""
    if self.segment_ids is None:
      return ()
    return jnp.asarray(self.segment_ids), jnp.asarray(self.positions)


def make_case(name: str, t: int) -> Case:
  """Case `name` (one of `CASES`) at length `t`.

  Raises:
    ValueError: an unknown case name, or a length at which the document case's order keeps
      every document whole (T < 8192: documents too short to cut into pieces of 128).
  """
  masks = {"causal": flaxattn.Causal(), "local": flaxattn.Local(WINDOW),
           "chunked": flaxattn.Chunked(CHUNK)}
  if name in masks:
    mask = masks[name]
    return Case(name, t, mask, None, None, 1, t,
                measure.useful_pairs(mask, np.ones((1, t), np.int32)))
  if name not in CASES:
    raise ValueError(f"make_case expects one of {tuple(CASES)}, got {name!r}.")
  n = t // measure.DOCS - (SHORTER if name == "document" else 0)
  seg, pos = measure.packed_row(t, n)
  pairs = measure.useful_pairs(flaxattn.Causal(), seg)
  if name == "document":
    plan = flaxattn.balance_plan(seg, RING, block=BALANCE_BLOCK)
    seg, pos = np.asarray(plan.segment_ids(seg)), np.asarray(plan.apply(pos))
    runs = np.count_nonzero((seg[0] != 0) & (seg[0] != np.r_[0, seg[0, :-1]]))
    if runs == measure.DOCS:
      raise ValueError(f"make_case('document', {t}) expects documents cut into pieces, but"
                       f" its order keeps each whole ({plan.describe()}); take T >= 8192.")
  return Case(name, t, flaxattn.Causal(), seg, pos, measure.DOCS, n, pairs)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a row does in a case, decided before anything runs.

  status: "ok" (served), "fallback" (served, but the batch fails a run-time check and the
    kernel's fallback runs), "declined", or "absent" (the library is not installed).
  reason: why it declines or falls back, or what the kernel adds (e.g. cuDNN's THD slots).
  runs: the kernel that runs, for auto.
  same_as: (row, case) of the same length whose program this is: its figures are copied.
  """

  status: str
  reason: str | None = None
  runs: str | None = None
  same_as: tuple[str, str] | None = None


def _cudnn_exact(kernel: Cudnn, case: Case) -> bool:
  """Whether cuDNN's run-time check passes on the case's batch (`cudnn.served_by_cudnn`)."""
  q, kv = case.shapes()

  def exact(seg, pos):  # one program: op by op, the check compiles dozens
    return cudnn.served_by_cudnn(q, kv, resolve(q.shape, kv.shape, seg, pos), mask=case.mask,
                                 max_segments=kernel.max_segments)
  return bool(jax.jit(exact)(*case.ids()))


def _flaxattn_plan(name: str, case: Case) -> Plan:
  kernels = flaxattn_kernels()
  q, kv = case.shapes()
  with flaxattn.lowering_for("gpu"):  # fallbacks are named for the GPU, wherever this runs
    call = registry.Call.of(q, kv, kv, case.mask, resolve(q.shape, kv.shape, *case.ids()),
                            return_lse=False)
    if name == "auto":
      try:
        kernel = registry.select("auto", call)
      except ValueError as e:
        return Plan("declined", str(e))
      passed = registry.order("gpu")[:registry.order("gpu").index(kernel.name)]
      reason = "; ".join(f"{n} declines: {registry.get(n).unsupported_reason(call)}"
                         for n in passed)
      row = next((n for n, k in kernels.items() if k == kernel), None)
      inner = _flaxattn_plan(row, case) if row is not None else Plan("ok")
      return Plan(inner.status, "; ".join(r for r in (reason, inner.reason) if r) or None,
                  runs=kernel.name, same_as=None if row is None else (row, case.name))
    kernel = kernels[name]
    reason = kernel.unsupported_reason(call)
    if reason is not None:
      return Plan("declined", reason)
    described = kernel.describe(call)
    if not isinstance(kernel, Cudnn):
      return Plan("ok", described)
    if case.segment_ids is None:
      if name == "cudnn":
        return Plan("ok", described)
      return Plan("ok", "no segment ids: the unpacked call, the cudnn row's program",
                  same_as=("cudnn", case.name))
    if not _cudnn_exact(kernel, case):
      return Plan("fallback", f"cuDNN's run-time check fails on this batch (documents that are"
                  f" not runs of positions 0, 1, ... in its slots); {described}")
    return Plan("ok", described)


def plan(name: str, case: Case, missing: dict[str, str | None]) -> Plan:
  """What row `name` (of `ROWS`) does in `case` on an NVIDIA GPU; `missing`: why each peer
  library (`PEER_LIBRARIES`) cannot run here, or None. Decided from the call alone (and
  cuDNN's run-time check on the case's batch), so it answers on any host."""
  if name == "auto" or name in flaxattn_kernels():
    return _flaxattn_plan(name, case)
  if name == "docs_as_rows":
    if case.docs == 1:
      return Plan("declined", "one document: jax_nn_cudnn is its ideal")
    return Plan("ok", f"{case.docs} rows of {case.doc_length} tokens")
  library = PEER_LIBRARIES.get(name, "jax")
  if missing.get(library):
    return Plan("absent", missing[library])
  who = {"jax": "jax.nn.dot_product_attention", "tokamax": "tokamax.dot_product_attention",
         "torch": "torch's scaled_dot_product_attention"}[library]
  if case.segment_ids is not None:
    return Plan("declined", f"{who} has no segment ids (packed documents); docs_as_rows runs"
                " the same documents as batch rows")
  normal = band(case.mask)
  if normal.chunk is not None:
    return Plan("declined", f"{who} has no chunked mask")
  if normal.hi not in (None, 0) or (normal.hi is None and normal.lo is not None):
    return Plan("declined", f"{who} has no window with keys after the query")
  if library == "torch" and normal.lo is not None:
    return Plan("declined", f"{who} has no sliding window but through a dense [T, T] mask")
  return Plan("ok")


def _attention_fn(name: str, case: Case, kernel: registry.Kernel | None = None):
  """The function a JAX row runs on (q, k, v, *case.ids()) for flaxattn's rows, (q, k, v)
  for the others; `kernel`: the one flaxattn's row `name` runs instead of its own."""
  lo = band(case.mask).lo  # a causal window's (`_plan` declines others)
  window = None if lo is None else 1 - lo
  if name == "auto" or name in flaxattn_kernels():
    backend: Any = kernel or ("auto" if name == "auto" else flaxattn_kernels()[name])

    def attn(q, k, v, *ids):
      seg, pos = ids or (None, None)
      return flaxattn.attention(q, k, v, mask=case.mask, segment_ids=seg, positions=pos,
                                backend=backend)
    return attn
  if name == "jax_nn_cudnn":
    return lambda q, k, v: peers.jax_nn_cudnn(q, k, v, window=window)
  if name == "docs_as_rows":
    return peers.docs_as_rows(case.docs, case.doc_length)
  attend = peers.tokamax_attention(name.removeprefix("tokamax_"))
  return lambda q, k, v: attend(q, k, v, window=window)


def _free_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats()
  if not stats or "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _failure(e: Exception) -> dict:
  text = f"{type(e).__name__}: {e}"
  oom = any(s in text.lower() for s in ("resource_exhausted", "out of memory", "outofmemory"))
  return dict(status="OOM" if oom else "error", error=(text.splitlines() or [""])[0][:300])


def figures(case: Case, fwd_s: float, fb_s: float, matmul: float) -> dict:
  """A cell's throughput from its forward and forward+backward seconds."""
  fwd_flops, fb_flops = measure.flops(case.pairs)
  out = {}
  for label, flops, seconds in (("fwd", fwd_flops, fwd_s), ("fb", fb_flops, fb_s)):
    tflops = flops / seconds / 1e12
    out.update({f"{label}_ms": round(seconds * 1e3, 3), f"{label}_tflops": round(tflops, 1),
                f"{label}_of_matmul": round(tflops / matmul, 3)})
  return out


def _run_jax(name: str, case: Case, qkv, matmul: float, repeats: int,
             kernel: registry.Kernel | None = None) -> dict:
  args = (*qkv, *case.ids()) if name == "auto" or name in flaxattn_kernels() else qkv
  try:
    compiled = measure.compile_pair(_attention_fn(name, case, kernel), args)
    result = dict(temp_bytes=compiled.temp_bytes)
    free = _free_bytes()
    need = (compiled.temp_bytes or 0) + (compiled.output_bytes or 0)
    if free is not None and need > free:
      return dict(result, status="OOM", error=f"the forward+backward needs {need / 2**30:.1f}"
                  f" GiB of temporaries and outputs, {free / 2**30:.1f} GiB are free")
    fwd_s = measure.median_seconds(compiled.forward, args, repeats, warmup=WARMUP,
                                   budget_s=BUDGET_S)
    fb_s = measure.median_seconds(compiled.forward_backward, args, repeats, warmup=WARMUP,
                                  budget_s=BUDGET_S)
    return dict(result, **figures(case, fwd_s, fb_s, matmul))
  except Exception as e:  # a cell that cannot run (memory, a kernel's limits) is a result
    return _failure(e)
  finally:
    gc.collect()


def _run_torch(case: Case, matmul: float, repeats: int) -> dict:
  try:
    forward, forward_backward = peers.torch_sdpa(case.length, measure.H, measure.HKV, measure.D)
    fwd_s, fb_s = (measure.median_seconds(fn, (), repeats, warmup=WARMUP, budget_s=BUDGET_S)
                   for fn in (forward, forward_backward))
    return figures(case, fwd_s, fb_s, matmul)
  except Exception as e:  # as in _run_jax
    return _failure(e)


def run_cells(lengths, repeats: int, matmul: float, missing: dict[str, str | None],
              rows=tuple(ROWS), cases=tuple(CASES)) -> list[dict]:
  """Each of `rows` in each of `cases` at every length, printed as it goes."""
  cells: dict[tuple[str, str, int], dict] = {}
  for t in lengths:
    qkv = measure.inputs(t)
    for case in (make_case(name, t) for name in cases):
      for name in rows:
        p = plan(name, case, missing)
        if p.same_as is not None and (*p.same_as, t) not in cells:  # that row did not run
          p = dataclasses.replace(p, same_as=None)
        fwd_flops, fb_flops = measure.flops(case.pairs)
        cell = dict(kernel=name, label=ROWS[name], case=case.name, length=t, status=p.status,
                    reason=p.reason, runs=p.runs, pairs=case.pairs, fwd_flops=fwd_flops,
                    fb_flops=fb_flops,
                    same_as=None if p.same_as is None else dict(kernel=p.same_as[0],
                                                                case=p.same_as[1]))
        start = time.perf_counter()
        if p.same_as is not None:  # the same program: its figures and how it went
          ref = cells[(*p.same_as, t)]
          cell.update({k: v for k, v in ref.items() if k not in cell}, status=ref["status"])
        elif p.status in ("ok", "fallback"):
          run = (_run_torch(case, matmul, repeats) if name == "torch_sdpa"
                 else _run_jax(name, case, qkv, matmul, repeats))
          cell.update(run)
        cells[(name, case.name, t)] = cell
        print(f"  {_length(t):>5} {case.name:9} {name:15} {cell['status']:9}"
              f" {_number(cell.get('fwd_tflops')):>6} {_number(cell.get('fb_tflops')):>6}"
              f" TFLOP/s  {time.perf_counter() - start:6.1f} s", flush=True)
    del qkv
    gc.collect()
  return list(cells.values())


def tiled_kernels() -> list[tuple[str, str, registry.Kernel]]:
  """(kernel name, tiling label, kernel) for --tilings: `TILINGS`, then `MOSAIC_TILINGS`."""
  tiled: list[tuple[str, str, registry.Kernel]] = [
      ("pallas_gpu", f"{bq}x{bkv} w{warps} s{stages}",
       PallasGpu(block_q=bq, block_kv=bkv, num_warps=warps, num_stages=stages))
      for bq, bkv, warps, stages in TILINGS]
  return tiled + [("mosaic_gpu", f"kv{kv} dq{dq} dkv{dkv} s{stages}",
                   MosaicGpu(block_kv=kv, block_kv_dq=dq, block_q_dkv=dkv, stages=stages))
                  for kv, dq, dkv, stages in MOSAIC_TILINGS]


def run_tilings(repeats: int, matmul: float) -> list[dict]:
  """pallas_gpu and mosaic_gpu under each of their tilings (`tiled_kernels`) on
  `TILING_CASES` at `TILING_LENGTH`, printed as it goes."""
  qkv = measure.inputs(TILING_LENGTH)
  cells = []
  for case in (make_case(name, TILING_LENGTH) for name in TILING_CASES):
    for name, tiling, kernel in tiled_kernels():
      start = time.perf_counter()
      cell = dict(kernel=name, tiling=tiling, case=case.name, length=TILING_LENGTH,
                  status="ok", **_run_jax(name, case, qkv, matmul, repeats, kernel))
      cells.append(cell)
      print(f"  {_length(TILING_LENGTH):>5} {case.name:9} {name} {tiling:18} "
            f"{cell['status']:6} {_number(cell.get('fwd_tflops')):>6}"
            f" {_number(cell.get('fb_tflops')):>6} TFLOP/s  {time.perf_counter() - start:6.1f} s",
            flush=True)
  del qkv
  gc.collect()
  return cells


def tiling_table(cells: list[dict]) -> list[str]:
  """Per kernel, one markdown row per tiling: forward and forward+backward TFLOP/s in each
  case."""
  by = {(c["kernel"], c["tiling"], c["case"]): c for c in cells}
  heads = [f"{case} {part}" for case in TILING_CASES for part in ("fwd", "f+b")]
  what = {"pallas_gpu": "block_q x block_kv, warps, stages",
          "mosaic_gpu": "keys fwd, keys dQ, rows dK/dV, stages"}
  lines = []
  for kernel in dict.fromkeys(c["kernel"] for c in cells):
    lines += ["", f"### {kernel} tilings at {_length(TILING_LENGTH)}: TFLOP/s of useful work",
              "", f"| {what[kernel]} | " + " | ".join(heads) + " |",
              "|---|" + "---:|" * len(heads)]
    for tiling in dict.fromkeys(c["tiling"] for c in cells if c["kernel"] == kernel):
      values = [_cell_text(by.get((kernel, tiling, case)), key) for case in TILING_CASES
                for key in ("fwd_tflops", "fb_tflops")]
      lines.append(f"| {tiling} | " + " | ".join(values) + " |")
  return lines


def _length(t: int) -> str:
  return f"{t // 1024}K" if t % 1024 == 0 else str(t)


def _number(x) -> str:
  if x is None:
    return "-"
  return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


def _number_ratio(cell: dict | None) -> str:
  if cell is None or cell.get("fb_of_matmul") is None:
    return "-"
  return f"{cell['fb_of_matmul']:.2f}"


def _cell_text(cell: dict | None, key: str) -> str:
  if cell is None:
    return ""
  if cell.get(key) is None:
    return "-" if cell["status"] in ("ok", "fallback") else str(cell["status"])
  return _number(cell[key]) + ("*" if cell["status"] == "fallback" else "")


def tables(cells: list[dict], lengths, matmul: float) -> list[str]:
  """Markdown tables, one per case (rows: kernels; TFLOP/s forward and forward+backward per
  length, f+b over the matmul, f+b temporaries), each with one line per row and outcome."""
  by = {(c["kernel"], c["case"], c["length"]): c for c in cells}
  lines = []
  run = {c["kernel"] for c in cells}
  for case in (case for case in CASES if any(c["case"] == case for c in cells)):
    heads = [f"{_length(t)} {part}" for t in lengths for part in ("fwd", "f+b")]
    lines += ["", f"### {case}: {CASES[case]}; TFLOP/s of useful work (matmul {matmul:.0f})",
              "",
              "| kernel | " + " | ".join(heads) + " | f+b / matmul | temp f+b MiB |",
              "|---|" + "---:|" * (len(heads) + 2)]
    for name, label in ((n, label) for n, label in ROWS.items() if n in run):
      row = [by.get((name, case, t)) for t in lengths]
      values = [_cell_text(c, k) for c in row for k in ("fwd_tflops", "fb_tflops")]
      ratio = " / ".join(_number_ratio(c) for c in row)
      temp = " / ".join("-" if c is None or c.get("temp_bytes") is None
                        else f"{c['temp_bytes'] / 2**20:,.0f}" for c in row)
      lines.append(f"| {label} | " + " | ".join(values) + f" | {ratio} | {temp} |")
    lines.append("")
    for name in ROWS:
      outcomes: dict[tuple, list[str]] = {}
      for t in lengths:
        c = by.get((name, case, t))
        if c is not None:
          key = (c["status"], c.get("error") or c.get("reason"), c.get("runs"),
                 None if c.get("same_as") is None else tuple(c["same_as"].values()))
          outcomes.setdefault(key, []).append(_length(t))
      for (status, why, runs, same), at in outcomes.items():
        parts = [f"runs {runs}" if runs else "",
                 f"the program of {same[0]} ({same[1]})" if same else "", why or ""]
        text = "; ".join(p for p in parts if p)
        lines.append(f"- {name} at {', '.join(at)}: {status}" + (f": {text}" if text else ""))
  lines.append("\n(* the kernel's fallback ran: the batch failed its run-time check)")
  return lines


def copy_bandwidth(repeats: int, nbytes: int = COPY_BYTES) -> float:
  """Bytes read plus written per second of a device-to-device copy of `nbytes`."""
  x = jnp.ones((nbytes // 4,), jnp.float32) * jax.random.normal(jax.random.key(0), ())
  copy = jax.jit(lambda x: x + 1)  # one read and one write of every element
  return 2 * nbytes / measure.median_seconds(copy, (x,), repeats)


@jax.jit
def _dense_decode(q, k, v, ids, pos, q_pos):
  allowed = (ids == 1) & (pos <= q_pos[:, None])
  return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None, None], implementation="xla")


@jax.jit
def _attention_decode(q, k, v, ids, pos, q_pos):
  return flaxattn.attention(q, k, v, segment_ids=jnp.ones((1, 1), jnp.int32),
                            positions=q_pos[:, None], kv_segment_ids=ids, kv_positions=pos)


def decode_row(length: int, repeats: int, bandwidth: float,
               shape: DecodeShape = DecodeShape()) -> dict:
  """The decode row at cache length `length` (see the module doc), its floor from
  `bandwidth` (bytes per second, `copy_bandwidth`)."""
  e, h, hkv, room = shape.embed, shape.heads, shape.kv_heads, shape.room
  d = e // h
  m = flaxattn.MultiHeadAttention(h, e, num_kv_heads=hkv, mask=flaxattn.Causal(),
                                  rope=flaxattn.RoPE(500000.0), dtype=jnp.bfloat16,
                                  param_dtype=jnp.bfloat16, use_bias=False, rngs=nnx.Rngs(0))
  m.init_cache((1, length, e), dtype=jnp.bfloat16)
  filled = length - room
  ids = np.zeros((1, length), np.int32)
  pos = np.zeros((1, length), np.int32)
  ids[:, :filled], pos[:, :filled] = 1, np.arange(filled)
  k, v = (jax.random.normal(jax.random.key(i), (1, length, hkv, d), jnp.bfloat16)
          * jnp.asarray(ids, jnp.bfloat16)[..., None, None] for i in range(2))
  cache = m.cache
  for var, value in ((cache.keys, k), (cache.values, v), (cache.segment_ids, ids),
                     (cache.positions, pos)):
    var[...] = jnp.asarray(value)
  cache.last[...] = jnp.asarray([[1, filled - 1]], jnp.int32)
  cache.index[...] = jnp.int32(filled)
  weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  cache_bytes = sum(c[...].nbytes for c in (cache.keys, cache.values, cache.segment_ids,
                                             cache.positions))
  # Copies for the attention alone: the step donates the cache's buffers.
  kc, vc, idc, posc = (jnp.copy(c[...]) for c in (cache.keys, cache.values, cache.segment_ids,
                                                   cache.positions))
  q = jax.random.normal(jax.random.key(2), (1, 1, h, d), jnp.bfloat16)
  q_pos = jnp.full((1,), filled, jnp.int32)
  attention_args = (q, kc, vc, idc, posc, q_pos)
  with flaxattn.lowering_for("gpu"):
    kernel = registry.select("auto", registry.Call.of(
        q, kc, vc, flaxattn.Causal(), resolve(q.shape, kc.shape, jnp.ones((1, 1), jnp.int32),
                                              q_pos[:, None], idc, posc),
        return_lse=False)).name
  graphdef, cached, rest = nnx.split(m, nnx.Cache, ...)

  def step(cached, rest, x):
    layer = nnx.merge(graphdef, cached, rest)
    return layer(x, decode=True), nnx.state(layer, nnx.Cache)

  def loop(cached, rest, x):
    def one(_, carry):
      y, cached = step(carry[1], rest, carry[0])
      return y, cached
    return lax.fori_loop(0, shape.loop, one, (x, cached))[0]

  stepped, looped = jax.jit(step, donate_argnums=0), jax.jit(loop)
  x = jax.random.normal(jax.random.key(1), (1, 1, e), jnp.bfloat16)
  state = {"cache": cached}

  def run_step():
    y, state["cache"] = stepped(state["cache"], rest, x)
    return y
  runs = {"step": run_step, "loop": lambda: looped(state["cache"], rest, x),
          "attention": lambda: _attention_decode(*attention_args),
          "jax_nn": lambda: _dense_decode(*attention_args)}
  jax.block_until_ready([run() for run in runs.values()])  # compiled, warmed up
  times: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(min(repeats * 3, room - 2)):  # each step writes a slot of the room
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append(time.perf_counter() - start)
  nnx.merge(graphdef, state["cache"], rest).cache.check()  # no step was refused
  med = {name: float(np.median(t)) for name, t in times.items()}
  med["loop"] /= shape.loop
  floor = (weights + cache_bytes) / bandwidth
  return dict(length=length, kernel=kernel, step_ms=med["step"] * 1e3,
              loop_step_ms=med["loop"] * 1e3, attention_ms=med["attention"] * 1e3,
              jax_nn_xla_ms=med["jax_nn"] * 1e3, bytes_read=weights + cache_bytes,
              floor_ms=floor * 1e3, step_over_floor=med["step"] / floor,
              loop_over_floor=med["loop"] / floor, goal=DECODE_GOAL,
              best_step_ms=min(times["step"]) * 1e3)


def decode_table(rows: list[dict]) -> list[str]:
  lines = ["| S | attention runs | step (ms) | step in a device loop (ms) | floor (ms) |"
           " step / floor | loop / floor | attention alone (ms) | jax.nn xla (ms) |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {_length(r['length'])} | {r['kernel']} | {r['step_ms']:.3f} |"
                 f" {r['loop_step_ms']:.3f} | {r['floor_ms']:.3f} | {r['step_over_floor']:.2f} |"
                 f" {r['loop_over_floor']:.2f} | {r['attention_ms']:.3f} |"
                 f" {r['jax_nn_xla_ms']:.3f} |")
  lines.append(f"(goal: the step within {DECODE_GOAL:g}x the floor)")
  return lines


def trainer_step(steps: int, matmul: float) -> dict:
  """One training step of the demo model on one GPU (`bench.train_step`), timed; or why
  not (the trainer's extra not installed, a failure)."""
  try:
    from bench.train_step import Variant, one_batch
    from models.llama import flops_per_token, layer_masks
    from train import config as config_lib
    from train.throughput import Flops
  except ImportError as e:
    return dict(status="absent", reason=f"the trainer's dependencies are missing ({e});"
                " pip install -e '.[train]'")
  try:
    cfg = config_lib.load(DEMO_CONFIG, TRAINER_OVERRIDES)
    index, local = one_batch(cfg, None, min_docs=3)
    variant = Variant("demo, one GPU", cfg, local, cp_size=1, dense=False, warmup=2)
    for _ in range(steps):
      variant.step()
    result = variant.result()
  except Exception as e:  # the report still holds the kernels' figures
    return _failure(e)
  m = cfg.model
  q = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len, m.n_heads, m.attn_head_dim),
                           jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len, m.n_kv_heads, m.attn_head_dim),
                            jnp.bfloat16)
  seg = local["segment_ids"]
  layout = resolve(q.shape, kv.shape, seg, local.get("positions"))
  with flaxattn.lowering_for("gpu"):
    kernels = sorted({registry.select(m.attention_backend, registry.Call.of(
        q, kv, kv, mask, layout, return_lse=False)).name for mask in layer_masks(m)})
  flops = Flops(variant.state.model, layer_masks(m)).of(seg)  # the batch's documents
  fpt = flops_per_token(m, cfg.seq_len)
  return dict(status="ok", config="configs/demo.yaml", overrides=list(TRAINER_OVERRIDES),
              batch_index=index, document_lengths=[
                  [int(np.sum(r == s)) for s in np.unique(r[r > 0])] for r in seg],
              attention_kernels=kernels, tokens_per_step=result["tokens_per_step"],
              tokens_per_s=result["tokens_per_s"], median_step_s=result["median_step_s"],
              best_step_s=result["best_step_s"], first_step_s=result["first_step_s"],
              first_loss=result["first_loss"], step_times=result["step_times"],
              model_flops=flops, model_tflops=flops / result["median_step_s"] / 1e12,
              model_of_matmul=flops / result["median_step_s"] / 1e12 / matmul,
              upper_bound_tflops=fpt * result["tokens_per_s"] / 1e12)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", help="write the report to this file")
  parser.add_argument("--quick", action="store_true", help="8K and 32K only")
  parser.add_argument("--lengths", type=int, nargs="+",
                      help="sequence lengths, multiples of 4096 from 8192 (default 8K 32K 128K)")
  parser.add_argument("--repeats", type=int, default=10, help="most timed runs per figure")
  parser.add_argument("--rows", nargs="*", choices=tuple(ROWS), default=tuple(ROWS),
                      help="the rows to run (default all; none: no kernel table)")
  parser.add_argument("--cases", nargs="+", choices=tuple(CASES), default=tuple(CASES),
                      help="the cases to run (default all)")
  parser.add_argument("--tilings", action="store_true",
                      help="also pallas_gpu under each of TILINGS and mosaic_gpu under each of"
                      " MOSAIC_TILINGS at 32K")
  parser.add_argument("--trainer-steps", type=int, default=10,
                      help="timed trainer steps (0: no trainer step)")
  parser.add_argument("--decode", action="store_true",
                      help="also the decode row: the layer's decode step against the bandwidth"
                      " floor at 32K and 128K")
  args = parser.parse_args(argv)
  lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
  if any(t % (measure.DOCS * RING * BALANCE_BLOCK) or t < 8192 for t in lengths):
    parser.error(f"--lengths expects multiples of {measure.DOCS * RING * BALANCE_BLOCK} from"
                 f" 8192 ({measure.DOCS} documents cut into blocks of {BALANCE_BLOCK} on {RING}"
                 f" shards), got {lengths}")
  if args.repeats < 1 or args.trainer_steps < 0:
    parser.error("--repeats expects >= 1 and --trainer-steps >= 0")
  for t in lengths:  # before anything is measured
    try:
      make_case("document", t)
    except ValueError as e:
      parser.error(f"--lengths: {e}")
  platform = jax.default_backend()
  if platform != "gpu":
    why = f"no GPU (jax.default_backend() is {platform!r})"
    print(f"bench.gpu: {why}; nothing measured")
    if args.json:
      with open(args.json, "w") as f:
        json.dump(dict(skipped=why), f, indent=2)
    return 0

  wall = time.perf_counter()
  device = jax.devices()[0].device_kind
  matmul = measure.matmul_tflops(args.repeats)
  missing = {library: peers.missing(library) for library in set(PEER_LIBRARIES.values())}
  print(f"{device}, jax {jax.__version__}: bf16 matmul {measure.MATMUL_N}^3 {matmul:.1f}"
        f" TFLOP/s. Attention B=1, H={measure.H} on {measure.HKV} KV heads, D={measure.D},"
        f" bfloat16, T = {', '.join(map(_length, lengths))}", flush=True)
  for library, why in sorted(missing.items()):
    if why:
      print(f"  {library}: skipped, {why}")
  cells, lines = [], []
  if args.rows:  # none: the decode row alone
    cells = run_cells(lengths, args.repeats, matmul, missing, args.rows, args.cases)
    lines = tables(cells, lengths, matmul)
    print("\n".join(lines))
  tilings = []
  if args.tilings:
    print(f"\npallas_gpu and mosaic_gpu tilings at {_length(TILING_LENGTH)}", flush=True)
    tilings = run_tilings(args.repeats, matmul)
    lines += tiling_table(tilings)
    print("\n".join(tiling_table(tilings)))
  decode = None
  if args.decode:
    print(f"\ndecode step: {DecodeShape()}, bf16, B=1", flush=True)
    try:
      bandwidth = copy_bandwidth(args.repeats)
      decode = dict(copy_bytes_per_s=bandwidth, rows=[])
      for length in DECODE_LENGTHS:
        decode["rows"].append(decode_row(length, args.repeats, bandwidth))
        print(json.dumps(decode["rows"][-1]), flush=True)
      lines += decode_table(decode["rows"])
      print("\n".join(decode_table(decode["rows"])))
    except Exception as e:  # the report keeps what was measured
      decode = dict(decode or {}, **_failure(e))
      print(f"  decode: {decode['error']}")
  trainer = None
  if args.trainer_steps:
    print(f"\ntrainer: {DEMO_CONFIG} with {' '.join(TRAINER_OVERRIDES)}, one GPU", flush=True)
    trainer = trainer_step(args.trainer_steps, matmul)
    if trainer["status"] == "ok":
      print(f"  {trainer['tokens_per_s']:,.0f} tokens/s, step {trainer['median_step_s']:.4f} s"
            f" (median of {args.trainer_steps}; best {trainer['best_step_s']:.4f} s, first"
            f" {trainer['first_step_s']:.1f} s with compiling), attention"
            f" {', '.join(trainer['attention_kernels'])}, documents per row"
            f" {trainer['document_lengths']}; model {trainer['model_tflops']:.1f} TFLOP/s"
            f" (the batch's documents) = {trainer['model_of_matmul']:.2f} of the matmul;"
            f" counting each row as one causal document, an upper bound:"
            f" {trainer['upper_bound_tflops']:.1f} TFLOP/s")
    else:
      print(f"  {trainer['status']}: {trainer.get('reason') or trainer.get('error')}")
  elapsed = time.perf_counter() - wall
  print(f"\nbench.gpu: {elapsed:.0f} s", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=device, jax=jax.__version__,
                     command=" ".join(["python -m bench.gpu", *sys.argv[1:]]),
                     shapes=dict(B=1, H=measure.H, HKV=measure.HKV, D=measure.D,
                                 dtype="bfloat16", docs=measure.DOCS, window=WINDOW,
                                 chunk=CHUNK, ring=RING, balance_block=BALANCE_BLOCK),
                     matmul_tflops=matmul, lengths=list(lengths), missing=missing,
                     cells=cells, tilings=tilings, decode=decode, table=lines, trainer=trainer,
                     wall_s=elapsed), f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
