"""cuDNN in the ring: each ring step (and each shard of the gathered keys) as cuDNN calls.

With positions that follow the token index, a device's step is one causal call on its own
tokens, an unmasked call on all the visiting keys or on one half of them or of the local
queries, or nothing (`ring_plan`). Owns those pieces and `CudnnStep`, the `RingStep` that
runs them. Derivations: docs/design.md, "cuDNN in the ring".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from flaxattn import checked
from flaxattn.layout import Layout
from flaxattn.masks import Full, Mask
from flaxattn.ring import RingStep

# The pieces of a ring step on cuDNN.
OWN, ALL, FIRST_KEYS, LAST_QUERIES, NOTHING = range(5)
PIECES = ("own tokens, the call's mask", "all keys, unmasked", "first key chunk, unmasked",
          "second query chunk, unmasked", "nothing")


def ring_plan(causal: bool, shards: int, load_balance: bool) -> np.ndarray:
  """`[step, device]` int: the piece (index into `PIECES`) device r computes at ring step s,
  when the keys of shard (r - s) mod n visit, for a causal mask or none (`causal` of
  `cudnn.mask_band`). Step 0 is the device's own tokens with the call's mask (their index
  order is their original order). Later steps, causal: without load balancing an earlier
  shard is seen whole and a later one not at all; with it, an earlier shard's first chunk is
  seen by all local queries and a later shard by the local second chunk. Full: every later
  step sees all keys."""
  plan = np.full((shards, shards), OWN, np.int32)
  for step in range(1, shards):
    for r in range(shards):
      earlier = (r - step) % shards < r
      if not causal:
        plan[step, r] = ALL
      elif load_balance:
        plan[step, r] = FIRST_KEYS if earlier else LAST_QUERIES
      else:
        plan[step, r] = ALL if earlier else NOTHING
  return plan


def ring_piece(piece: int, layout: Layout, mask: Mask) -> tuple[slice, slice, Layout, Mask]:
  """The cuDNN call of a ring piece (not `NOTHING`) on the visiting shard's `layout` (local
  queries, visiting keys, `[B, T]` each): (query rows, key rows, the call's layout, mask)."""
  q_ids, kv_ids, q_pos, kv_pos = (layout.q_segment_ids, layout.kv_segment_ids,
                                  layout.q_positions, layout.kv_positions)
  assert q_ids is not None and kv_ids is not None and q_pos is not None and kv_pos is not None
  half = q_ids.shape[1] // 2
  rows, cols = {OWN: (slice(None), slice(None)), ALL: (slice(None), slice(None)),
                FIRST_KEYS: (slice(None), slice(None, half)),
                LAST_QUERIES: (slice(half, None), slice(None))}[piece]
  if piece == OWN:  # the device's own tokens: queries and keys are one array
    return rows, cols, Layout(q_ids, q_ids, q_pos, q_pos), mask
  lay = Layout(q_ids[:, rows], kv_ids[:, cols], q_pos[:, rows], kv_pos[:, cols])
  return rows, cols, lay, Full()


def _place(x, rows: slice, n: int, fill):
  """`x`, the rows `rows` of a length-`n` sequence axis (axis 1), padded with `fill`."""
  start, stop, _ = rows.indices(n)
  pad = [(0, 0)] * x.ndim
  pad[1] = (start, n - stop)
  return jnp.pad(x, pad, constant_values=fill)


def _no_keys(q):
  b, t, h, _ = q.shape
  return jnp.zeros_like(q), jnp.full((b, t, h), -jnp.inf, jnp.float32)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["exact"],
    meta_fields=["mask", "causal", "scale", "axis", "shards", "load_balance", "packed",
                 "max_segments", "fused_forward", "fused_backward", "fallback"])
@dataclasses.dataclass(frozen=True)
class CudnnStep(RingStep):
  """cuDNN calls as the ring's per-device step, one piece of `ring_plan` per step and device.
  Each call checks its documents at run time (cuDNN's own check, inside `fused_forward` /
  `fused_backward`, `cudnn.forward` / `cudnn.backward`); `exact` is the global
  `index_check` (positions follow the token index inside each document; None: always), and
  a batch that fails it runs `fallback`, the blockwise step."""

  exact: jax.Array | None
  mask: Mask
  causal: bool
  scale: float
  axis: str
  shards: int
  load_balance: bool
  packed: bool
  max_segments: int | None
  fused_forward: Callable[..., tuple[jax.Array, jax.Array]]
  fused_backward: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
  fallback: RingStep
  unrolled = True  # each step has its own pieces

  def specs(self):
    return dataclasses.replace(self, exact=P())

  def _run_piece(self, step, piece_fn):
    """`piece_fn(piece)` for this device's piece of `step`: a Python int (the ring's
    unrolled steps) traces only the pieces that step uses; a traced step (the all-gather
    strategy's, which depends on the device index) traces all the plan uses."""
    plan = ring_plan(self.causal, self.shards, self.load_balance)
    used = sorted(set(np.unique(plan[step] if isinstance(step, int) else plan)))
    if len(used) == 1:
      return piece_fn(used[0])
    branch = np.zeros(len(PIECES), np.int32)
    branch[used] = np.arange(len(used))
    piece = jnp.asarray(plan)[step, jax.lax.axis_index(self.axis)]
    return jax.lax.switch(jnp.asarray(branch)[piece],
                          [functools.partial(piece_fn, p) for p in used])

  def forward(self, step, q, k, v, layout: Layout):
    def piece_fn(piece):
      if piece == NOTHING:
        return _no_keys(q)
      rows, cols, lay, mask = ring_piece(piece, layout, self.mask)
      out, lse = self.fused_forward(q[:, rows], k[:, cols], v[:, cols],
                                    lay if self.packed else Layout(), mask=mask,
                                    scale=self.scale, max_segments=self.max_segments)
      return _place(out, rows, q.shape[1], 0), _place(lse, rows, q.shape[1], -jnp.inf)

    return checked.either(self.exact, lambda: self._run_piece(step, piece_fn),
                          lambda: self.fallback.forward(step, q, k, v, layout))

  def backward(self, step, q, k, v, layout: Layout, out, lse, dout, dlse):
    def piece_fn(piece):
      if piece == NOTHING:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
      rows, cols, lay, mask = ring_piece(piece, layout, self.mask)
      dq, dk, dv = self.fused_backward(
          q[:, rows], k[:, cols], v[:, cols], lay if self.packed else Layout(), out[:, rows],
          lse[:, rows], dout[:, rows], None if dlse is None else dlse[:, rows], mask=mask,
          scale=self.scale, max_segments=self.max_segments)
      s = k.shape[1]
      return _place(dq, rows, q.shape[1], 0), _place(dk, cols, s, 0), _place(dv, cols, s, 0)

    return checked.either(
        self.exact, lambda: self._run_piece(step, piece_fn),
        lambda: self.fallback.backward(step, q, k, v, layout, out, lse, dout, dlse))
