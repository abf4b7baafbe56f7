"""Context parallelism: attention with the sequence axis sharded over a mesh axis.

Owns `ContextParallel`, the ring (K/V passed with `ppermute`, partial results merged by
lse; backward a second ring carrying dK/dV) and all-gather strategies, and the protocol of
a kernel's per-device computation (`LocalAttention`). Derivations: docs/design.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxattn import sharding
from flaxattn.layout import Layout
from flaxattn.masks import Mask

STRATEGIES = ("ring", "all_gather")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """Run attention with the sequence axis sharded over mesh axis `axis`.

  Args:
    axis: mesh axis name the sequence (dim 1 of q/k/v) is sharded over.
    strategy: "ring" or "all_gather".
    load_balance: the per-token arrays are in `flaxattn.load_balance` order (dual chunk).
      Only the default positions depend on it (they become the permuted token indices);
      explicit positions are used as given.
    batch_axes, head_axes: mesh axes the batch and the heads may be sharded over; those in
      the mesh whose sizes divide the dimension stay sharded inside the attention (absent
      or non-dividing axes are replicated there).
  Raises:
    ValueError: unknown strategy or a non-string axis.
  """

  axis: str = "context"
  strategy: str = "ring"
  load_balance: bool = True
  batch_axes: tuple[str, ...] = ("data", "fsdp")
  head_axes: tuple[str, ...] = ("tensor",)

  def __post_init__(self):
    if not isinstance(self.axis, str) or not self.axis:
      raise ValueError(f"ContextParallel(axis=...) expects a mesh axis name, got {self.axis!r}.")
    if self.strategy not in STRATEGIES:
      raise ValueError(f"ContextParallel(strategy=...) expects one of {STRATEGIES}, got {self.strategy!r}.")

  def balanced_shards(self) -> int:
    """Shards the tokens are load-balanced over (1 without load balancing). Needs the mesh."""
    return axis_size(self) if self.load_balance else 1


def axis_size(cp: ContextParallel) -> int:
  """The size of `cp.axis` in the current mesh (raises if there is no mesh or no such axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ValueError(f"context_parallel={cp} needs a mesh: call under `with jax.set_mesh(mesh):`"
                     f" with a mesh that has an axis named {cp.axis!r}.")
  if cp.axis not in mesh.axis_names:
    raise ValueError(f"context_parallel axis {cp.axis!r} is not in the mesh; mesh axes are"
                     f" {tuple(mesh.axis_names)}. Pass ContextParallel(axis=<one of them>).")
  return mesh.shape[cp.axis]


def _merge(out, lse, out_s, lse_s):
  """Combines two partial softmax results over disjoint key sets (float32)."""
  new = jnp.logaddexp(lse, lse_s)
  safe = jnp.where(jnp.isfinite(new), new, 0.0)  # rows with no key anywhere stay 0 / -inf
  w, w_s = jnp.exp(lse - safe), jnp.exp(lse_s - safe)
  return out * w[..., None] + out_s.astype(jnp.float32) * w_s[..., None], new


def _shift(x, axis: str, n: int):
  return jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


class LocalAttention(Protocol):
  """A kernel's per-device computation under context parallelism (`data` is what the
  kernel's `context_parallel_local` returned with it, passed into the shard_map)."""

  unrolled: bool  # the ring runs its steps unrolled (the step is a Python int), else a scan

  def forward(self, step, data, q, k, v, layout: Layout):
    """Ring step `step`: (out, lse) of the local queries against the visiting keys, or None
    when nothing is computed."""

  def backward(self, step, data, q, k, v, layout: Layout, out, lse, dout, dlse):
    """Ring step `step`: (dq, dk, dv) given the merged out/lse and their cotangents, or None."""

  def gathered(self, data, q, k, v, layout: Layout):
    """All-gather strategy: (out, lse) of the local queries against all keys."""


@dataclasses.dataclass(frozen=True)
class Gathered:
  """Any kernel on the gathered keys: the all-gather strategy's default computation."""

  kernel: object
  mask: Mask
  scale: float
  soft_cap: float | None = None

  def gathered(self, data, q, k, v, layout):
    capped = {} if self.soft_cap is None else dict(soft_cap=self.soft_cap)
    return self.kernel(q, k, v, layout, mask=self.mask, scale=self.scale, return_lse=True, **capped)


def _steps(local, n: int, body, carry):
  """Runs `body(carry, step)` for steps 0 .. n-2: a scan, or unrolled when the local
  computation differs per step (the step is then a Python int)."""
  if local.unrolled:
    for step in range(n - 1):
      carry = body(carry, step)
    return carry
  return jax.lax.scan(lambda c, step: (body(c, step), None), carry, jnp.arange(n - 1))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(axis, n, local, data, q, k, v, layout):
  return _ring_fwd(axis, n, local, data, q, k, v, layout)[0]


def _ring_fwd(axis, n, local, data, q, k, v, layout):
  def compute(out, lse, kv, ids, step):
    lay = Layout(layout.q_segment_ids, ids[0], layout.q_positions, ids[1])
    partial = local.forward(step, data, q, *kv, lay)
    return (out, lse) if partial is None else _merge(out, lse, *partial)

  def step(carry, i):
    out, lse, kv, ids = carry
    # Send the block on before computing with it, so the transfer overlaps the compute.
    next_kv, next_ids = _shift(kv, axis, n), _shift(ids, axis, n)
    out, lse = compute(out, lse, kv, ids, i)
    return out, lse, next_kv, next_ids

  kv = (k, v)  # a pair, not one stacked buffer: v may have its own head dim
  ids = jnp.stack([layout.kv_segment_ids, layout.kv_positions])
  out = jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32)
  lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
  out, lse, kv, ids = _steps(local, n, step, (out, lse, kv, ids))
  out, lse = compute(out, lse, kv, ids, n - 1)  # the last block: nothing left to send
  out = out.astype(q.dtype)
  return (out, lse), (data, q, k, v, layout, out, lse)


def _ring_bwd(axis, n, local, residuals, cotangents):
  data, q, k, v, layout, out, lse = residuals
  dout, dlse = cotangents

  def compute(dq, dkv, kv, ids, step):
    lay = Layout(layout.q_segment_ids, ids[0], layout.q_positions, ids[1])
    grads = local.backward(step, data, q, *kv, lay, out, lse, dout, dlse)
    if grads is None:
      return dq, dkv
    dq_s, dk_s, dv_s = grads
    return dq + dq_s.astype(jnp.float32), (dkv[0] + dk_s.astype(jnp.float32),
                                           dkv[1] + dv_s.astype(jnp.float32))

  def step(carry, i):
    dq, dkv, kv, ids = carry
    next_kv, next_ids = _shift(kv, axis, n), _shift(ids, axis, n)
    dq, dkv = compute(dq, dkv, kv, ids, i)
    # dK/dV of the visiting block travel with it; after n shifts they are home.
    return dq, _shift(dkv, axis, n), next_kv, next_ids

  kv = (k, v)
  ids = jnp.stack([layout.kv_segment_ids, layout.kv_positions])
  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  init = (zeros(q), (zeros(k), zeros(v)), kv, ids)
  dq, dkv, kv, ids = _steps(local, n, step, init)
  dq, dkv = compute(dq, dkv, kv, ids, n - 1)
  dkv = _shift(dkv, axis, n)
  return None, dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def gathered_steps(axis, n, local, data, q, k, v, layout):
  """The all-gather strategy for a kernel that computes ring steps: the gathered keys split
  back into the n shards they came from, shard j served as the ring's step (r - j) mod n
  (r the device index, so the step is traced) and merged by lse; the backward runs each
  step's backward with the merged result, as the ring does. Returns (out, lse)."""
  return _gathered_steps_fwd(axis, n, local, data, q, k, v, layout)[0]


def _shard_pieces(axis, n, k, v, layout):
  """(step, k, v, layout) per shard of the gathered keys, in shard order."""
  r = jax.lax.axis_index(axis)
  split = lambda x: jnp.split(x, n, axis=1)
  for j, k_j, v_j, ids, pos in zip(range(n), split(k), split(v), split(layout.kv_segment_ids),
                                   split(layout.kv_positions)):
    yield (r - j) % n, k_j, v_j, Layout(layout.q_segment_ids, ids, layout.q_positions, pos)


def _gathered_steps_fwd(axis, n, local, data, q, k, v, layout):
  out = jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32)
  lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
  for step, k_j, v_j, lay in _shard_pieces(axis, n, k, v, layout):
    partial = local.forward(step, data, q, k_j, v_j, lay)
    if partial is not None:
      out, lse = _merge(out, lse, *partial)
  out = out.astype(q.dtype)
  return (out, lse), (data, q, k, v, layout, out, lse)


def _gathered_steps_bwd(axis, n, local, residuals, cotangents):
  data, q, k, v, layout, out, lse = residuals
  dout, dlse = cotangents
  dq, dks, dvs = jnp.zeros(q.shape, jnp.float32), [], []
  for step, k_j, v_j, lay in _shard_pieces(axis, n, k, v, layout):
    grads = local.backward(step, data, q, k_j, v_j, lay, out, lse, dout, dlse)
    if grads is None:
      grads = (jnp.zeros_like(q), jnp.zeros_like(k_j), jnp.zeros_like(v_j))
    dq = dq + grads[0].astype(jnp.float32)
    dks.append(grads[1])
    dvs.append(grads[2])
  dk, dv = jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1)
  return None, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


gathered_steps.defvjp(_gathered_steps_fwd, _gathered_steps_bwd)


def _all_gather(axis, local, data, q, k, v, layout):
  gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
  full = Layout(layout.q_segment_ids, gather(layout.kv_segment_ids), layout.q_positions,
                gather(layout.kv_positions))
  return local.gathered(data, q, gather(k), gather(v), full)


def context_parallel_attention(q, k, v, layout: Layout, *, mask: Mask, scale: float,
                               cp: ContextParallel, kernel, return_lse: bool,
                               soft_cap: float | None = None):
  """Attention of q `[B, T, H, D]` over k `[B, T, Hkv, D]`, v `[B, T, Hkv, Dv]` sharded over
  `cp.axis` on dim 1 (`soft_cap`: the kernel's logit soft-capping, or None).

  `kernel` is the registry's kernel; its `context_parallel_local` gives the per-device
  computation. `layout` comes from `flaxattn.layout.resolve` (default positions in
  load-balanced order when `cp.load_balance`).

  Raises:
    ValueError: no mesh set, axis not in the mesh, keys and queries of different lengths,
      or T not divisible by the axis size (2 x the axis size with load balancing).
  """
  n = axis_size(cp)
  b, t = q.shape[:2]
  if k.shape[1] != t:
    raise ValueError(f"context_parallel expects keys as long as queries (self attention), got"
                     f" q {q.shape} and k {k.shape}.")
  parts = 2 * n if cp.load_balance else n
  if t % parts:
    raise ValueError(f"context_parallel over {cp.axis!r} (size {n}) expects the sequence length"
                     f" ({t}) divisible by {parts}{' (2 x axis size, load balancing)' if cp.load_balance else ''}.")
  local, data, data_specs = kernel.context_parallel_local(
      strategy=cp.strategy, mask=mask, scale=scale, shards=n, axis=cp.axis,
      load_balance=cp.load_balance, q_shape=q.shape, kv_shape=k.shape, layout=layout,
      **({} if soft_cap is None else dict(soft_cap=soft_cap)))
  layout = layout.materialize(b, t, t)

  # Batch and head axes are manual too: left to automatic sharding, the compiler would
  # gather the batch inside the ring's loops.
  mesh = jax.sharding.get_abstract_mesh()
  batch = sharding.dividing_axes(mesh, [a for a in cp.batch_axes if a != cp.axis], b) or None
  heads = sharding.dividing_axes(mesh, [a for a in cp.head_axes if a != cp.axis], q.shape[2], k.shape[2]) or None
  seq = P(batch, cp.axis)
  qkv = P(batch, cp.axis, heads)
  if cp.strategy == "ring":
    body = functools.partial(_ring, cp.axis, n, local)
  else:
    body = functools.partial(_all_gather, cp.axis, local)
  manual = frozenset({cp.axis, *(batch or ()), *(heads or ())})
  out, lse = jax.shard_map(body, in_specs=(data_specs, qkv, qkv, qkv, jax.tree.map(lambda _: seq, layout)),
                           out_specs=(qkv, qkv), axis_names=manual,
                           check_vma=False)(data, q, k, v, layout)
  return (out, lse) if return_lse else out
