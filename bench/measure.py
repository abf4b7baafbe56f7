"""How the GPU benchmarks (`bench.kernels`' GPU section, `bench.gpu`) measure an attention
kernel: the shapes, the useful work, the compiled temporaries, the times and the yardstick.

Shapes: B=1, `H` query heads on `HKV` KV heads, head dim `D`, bfloat16; packed rows hold
`DOCS` equal documents. Useful work counts only the (query, key) pairs that the mask and the
documents allow (`useful_pairs`): forward 4 x D x H flops a pair (two matmuls),
forward+backward `FWD_BWD_PER_FWD` times that (the backward's five matmuls, QK^T
recomputed, as FlashAttention counts). Forward+backward is the gradient of the sum of the
output (float32) w.r.t. q, k, v. Temporaries: XLA's
`memory_analysis().temp_size_in_bytes` of the compiled forward+backward (cuDNN's workspaces
included). The yardstick: a bfloat16 matmul of 8192^3 in the same run.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxattn.balance import token_work
from flaxattn.masks import Mask
from flaxattn.selftest import run_times

H, HKV, D, DOCS = 16, 8, 128, 16
FWD_BWD_PER_FWD = 3.5
MATMUL_N = 8192


def useful_pairs(mask: Mask, segment_ids) -> int:
  """The (query, key) pairs `mask` allows in rows `segment_ids` `[..., T]` (int, numpy; a
  document is a run of one non-zero id, its positions counting from 0; 0 is padding): the
  keys each query sees (`flaxattn.balance.token_work`, O(T) per row, never `[T, T]`),
  summed. Count a reordered row in its original order: the pairs are the same."""
  return int(token_work(np.asarray(segment_ids), [mask]).sum())


def packed_row(t: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids and positions `[1, t]` int32 numpy of `DOCS` equal documents of `length`
  tokens (default t / DOCS: filling the row), then padding (id 0, position 0)."""
  n = t // DOCS if length is None else length
  pad = t - DOCS * n
  return (np.pad(np.repeat(np.arange(1, DOCS + 1, dtype=np.int32), n), (0, pad))[None],
          np.pad(np.tile(np.arange(n, dtype=np.int32), DOCS), (0, pad))[None])


def flops(pairs: int, heads: int = H, head_dim: int = D) -> tuple[float, float]:
  """(forward, forward+backward) useful flops of `pairs` allowed pairs."""
  forward = 4.0 * head_dim * heads * pairs
  return forward, FWD_BWD_PER_FWD * forward


def inputs(t: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q `[1, t, H, D]`, k and v `[1, t, HKV, D]`: standard normal bfloat16, seeded by t."""
  keys = jax.random.split(jax.random.key(t), 3)
  return (jax.random.normal(keys[0], (1, t, H, D), jnp.bfloat16),
          jax.random.normal(keys[1], (1, t, HKV, D), jnp.bfloat16),
          jax.random.normal(keys[2], (1, t, HKV, D), jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class Compiled:
  """An attention function compiled for its arguments: the forward, the forward+backward,
  and the forward+backward's temporary and output bytes (None where XLA gives no memory
  analysis)."""

  forward: Any
  forward_backward: Any
  temp_bytes: int | None
  output_bytes: int | None


def compile_pair(attn, args) -> Compiled:
  """`attn(*args)` (q, k, v first; the rest, e.g. segment ids, not differentiated) and the
  gradient of the sum of its output w.r.t. q, k, v, compiled ahead of time.

  Raises what compiling raises (e.g. out of memory, a kernel's own errors).
  """
  def loss(*a):
    return jnp.sum(attn(*a).astype(jnp.float32))
  forward = jax.jit(attn).lower(*args).compile()
  forward_backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  memory = forward_backward.memory_analysis()
  if memory is None:
    return Compiled(forward, forward_backward, None, None)
  return Compiled(forward, forward_backward, int(memory.temp_size_in_bytes),
                  int(memory.output_size_in_bytes))


def median_seconds(fn, args, repeats: int, *, warmup: int = 2,
                   budget_s: float | None = None) -> float:
  """The median seconds of `fn(*args)` over `repeats` runs after `warmup` untimed ones, each
  ended by `block_until_ready` (`fn` that returns no jax arrays must wait itself). With
  `budget_s`, only as many of the `repeats` runs as fit in about that many seconds, judged
  by the first (at least one)."""
  if budget_s is None:
    return statistics.median(run_times(fn, args, repeats, warmup=warmup))
  times = run_times(fn, args, 1, warmup=warmup)
  more = min(repeats, int(budget_s / max(times[0], 1e-9))) - 1
  return statistics.median(times + run_times(fn, args, max(more, 0), warmup=0))


def matmul_tflops(repeats: int) -> float:
  """TFLOP/s of a bfloat16 matmul of `MATMUL_N`^3 on the default device (median)."""
  a = jax.random.normal(jax.random.key(0), (MATMUL_N, MATMUL_N), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (MATMUL_N, MATMUL_N), jnp.bfloat16)
  return 2 * MATMUL_N**3 / median_seconds(jax.jit(jnp.matmul), (a, b), repeats) / 1e12
