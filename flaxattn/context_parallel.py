"""Context parallelism: attention with the sequence axis sharded over a mesh axis.

Owns `ContextParallel`, the ring (K/V passed with `ppermute`, partial results merged by
lse; backward a second ring carrying dK/dV), all-gather and Ulysses (all-to-all between
sequence and heads, optionally around a ring over a second axis) strategies, and the
protocol of a kernel's per-device computation (`LocalAttention`). Derivations:
docs/design.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxattn import balance, planner, sharding
from flaxattn.layout import Layout, index_check
from flaxattn.masks import Mask
from flaxattn.planner import ring_fetches

STRATEGIES = ("ring", "all_gather", "ulysses", "auto")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """Run attention with the sequence axis sharded over mesh axis `axis`.

  Args:
    axis: mesh axis name the sequence (dim 1 of q/k/v) is sharded over.
    strategy: "ring", "all_gather", "ulysses" or "auto" (per call, the strategy
      `flaxattn.planner.plan` estimates fastest for its shapes, heads, mask and mesh; with
      `ring_axis` the hybrid, the one strategy over both axes). Ulysses turns sequence-sharded q/k/v into
      head-sharded ones with an all-to-all over `axis`, runs the kernel on the whole
      sequence and turns the result back: the query heads, and the key/value heads after
      repeating each as little as needed, must divide by the axis size (heads sharded over
      `head_axes` count per shard).
    load_balance: the token order of the per-token arrays, over `balanced_shards()` shards.
      True: `flaxattn.load_balance` row order (dual chunk); only the default positions
      depend on it (they become the permuted token indices), explicit positions are used
      as given. "document": per-document order (`flaxattn.load_balance(...,
      segment_ids=)`), which only the data knows: positions must be explicit, and the fast
      paths that read the row order (the window-aware ring, splash's and cuDNN's index
      masks) do not apply (`explain` says so). False: the original order. Ulysses alone
      gains nothing from it (each device sees every query) and undoes row order locally.
    ring_axis: with strategy "ulysses", a second mesh axis for a 2-D hybrid: the sequence
      is sharded over (`ring_axis`, `axis`), ring outer; the all-to-all over `axis` gives
      each device its ring shard's whole sequence for its share of the heads, and a ring
      over `ring_axis` runs on those. Load balancing is over the ring only. Put `axis` on
      the faster links: it moves all of q/k/v twice per call, the ring only K/V.
    batch_axes, head_axes: mesh axes the batch and the heads may be sharded over; those in
      the mesh whose sizes divide the dimension stay sharded inside the attention (absent
      or non-dividing axes are replicated there).
    cost_model: the platform numbers `strategy="auto"` estimates with: a key of
      `flaxattn.planner.PLATFORMS` or a `planner.Platform`; None: the current backend's.
  Raises:
    ValueError: unknown strategy, load balancing or cost model, a non-string axis, or a
      `ring_axis` that is `axis` or comes without strategy "ulysses" or "auto".
  """

  axis: str = "context"
  strategy: str = "ring"
  load_balance: bool | str = True
  ring_axis: str | None = None
  batch_axes: tuple[str, ...] = ("data", "fsdp")
  head_axes: tuple[str, ...] = ("tensor",)
  cost_model: str | planner.Platform | None = None

  def __post_init__(self):
    if not isinstance(self.axis, str) or not self.axis:
      raise ValueError(f"ContextParallel(axis=...) expects a mesh axis name, got {self.axis!r}.")
    if self.strategy not in STRATEGIES:
      raise ValueError(f"ContextParallel(strategy=...) expects one of {STRATEGIES}, got {self.strategy!r}.")
    if self.load_balance not in (True, False, "document"):
      raise ValueError(f"ContextParallel(load_balance=...) expects True (row order), False or"
                       f" 'document' (per-document order), got {self.load_balance!r}.")
    if self.ring_axis is not None:
      if not isinstance(self.ring_axis, str) or self.ring_axis in ("", self.axis):
        raise ValueError(f"ContextParallel(ring_axis=...) expects None or a mesh axis name other"
                         f" than axis={self.axis!r}, got {self.ring_axis!r}.")
      if self.strategy not in ("ulysses", "auto"):
        raise ValueError(f"ContextParallel(ring_axis={self.ring_axis!r}) runs a ring inside"
                         f" Ulysses and expects strategy='ulysses' (or 'auto'), got"
                         f" {self.strategy!r}; for a ring over one axis leave ring_axis=None.")
    if not (self.cost_model is None or isinstance(self.cost_model, planner.Platform)
            or self.cost_model in planner.PLATFORMS):
      raise ValueError(f"ContextParallel(cost_model=...) expects None, one of"
                       f" {tuple(planner.PLATFORMS)} or a flaxattn.planner.Platform, got"
                       f" {self.cost_model!r}.")

  @property
  def row_balanced(self) -> bool:
    """Whether the tokens are in row (dual-chunk) order, the one order a kernel can compute
    from the token index."""
    return self.load_balance is True

  @property
  def seq_axes(self) -> tuple[str, ...]:
    """The mesh axes the sequence is sharded over, outer first."""
    return (self.axis,) if self.ring_axis is None else (self.ring_axis, self.axis)

  def balanced_shards(self, mesh=None) -> int:
    """Shards the tokens are load-balanced over (row or document order): the ring's size
    (`axis`, or `ring_axis` under Ulysses x ring), Ulysses's axis size alone, 1 without
    load balancing. Needs the mesh: `mesh`, else the one set with `jax.set_mesh`."""
    if not self.load_balance:
      return 1
    return axis_size(self, self.ring_axis or self.axis, mesh)


def choose(cp: ContextParallel, q_shape, kv_shape, itemsize: int, mask: Mask):
  """`cp` with `strategy="auto"` resolved for one call (q `[B, T, H, D]`, k/v `[B, T, Hkv,
  D]` of `itemsize` bytes, `mask`), and the planner's (best, estimates); other strategies
  come back as they are, with None. Needs the mesh.

  Raises:
    ValueError: no strategy can serve the call (the reason of each).
  """
  if cp.strategy != "auto":
    return cp, None
  n = axis_size(cp)
  n_ring = axis_size(cp, cp.ring_axis) if cp.ring_axis else None
  estimates = planner.plan(q_shape, kv_shape, itemsize, mask, cp.load_balance, n,
                           cp.cost_model or jax.default_backend(), n_ring)
  strategy = "ulysses" if estimates[0].strategy == "ulysses_ring" else estimates[0].strategy
  return dataclasses.replace(cp, strategy=strategy), estimates


def axis_size(cp: ContextParallel, axis: str | None = None, mesh=None) -> int:
  """The size of `axis` (default `cp.axis`) in `mesh` (default the current mesh).

  Raises:
    ValueError: no mesh, or no such axis in it.
  """
  axis = cp.axis if axis is None else axis
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty:
    raise ValueError(f"context_parallel={cp} needs a mesh: call under `with jax.set_mesh(mesh):`"
                     f" with a mesh that has the axes {cp.seq_axes}.")
  if axis not in mesh.axis_names:
    arg = "ring_axis" if axis == cp.ring_axis else "axis"
    raise ValueError(f"context_parallel axis {axis!r} is not in the mesh; mesh axes are"
                     f" {tuple(mesh.axis_names)}. Pass ContextParallel({arg}=<one of them>).")
  return mesh.shape[axis]


def merge_partials(out, lse, out_s, lse_s):
  """Combines two partial softmax results over disjoint key sets: out `[B, T, H, Dv]`
  float32 with lse `[B, T, H]`, and another such pair (out_s in any float dtype); rows
  with no key on either side stay zeros / -inf. Used by the ring and by the layer's
  prefill into a filled sharded cache."""
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
    return (out, lse) if partial is None else merge_partials(out, lse, *partial)

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


def _move(x, axis: str, n: int, step: int, part, back: bool = False):
  """`x` `[B, T/n, ...]` of device (r - step) mod n (`back`: sent to it instead). With `part`
  (0 or 1) only that half along the sequence travels; the other half arrives as zeros."""
  pairs = [(i, (i + step) % n) for i in range(n)]
  pairs = [(j, i) for i, j in pairs] if back else pairs
  if part is None:
    return jax.lax.ppermute(x, axis, pairs)
  got = jax.lax.ppermute(jnp.split(x, 2, axis=1)[part], axis, pairs)
  zeros = jnp.zeros_like(got)
  return jnp.concatenate([got, zeros] if part == 0 else [zeros, got], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _window_ring(axis, n, local, fetches, data, q, k, v, layout):
  return _window_ring_fwd(axis, n, local, fetches, data, q, k, v, layout)[0]


def _visits(axis, n, fetches, k, v, layout):
  """(step, k, v, layout) of step 0 and each fetch of `ring_fetches` (ids travel whole)."""
  yield 0, k, v, Layout(layout.q_segment_ids, layout.kv_segment_ids, layout.q_positions,
                        layout.kv_positions)  # local arrays: no global load balancing
  for step, part in fetches:
    ids = _move(jnp.stack([layout.kv_segment_ids, layout.kv_positions]), axis, n, step, None)
    yield (step, _move(k, axis, n, step, part), _move(v, axis, n, step, part),
           Layout(layout.q_segment_ids, ids[0], layout.q_positions, ids[1]))


def _merged_steps(local, data, q, v, pieces):
  """(out in q's dtype, lse) of `local.forward` over `pieces` of (step, k, v, layout),
  merged by lse."""
  out = jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32)
  lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
  for step, k_s, v_s, lay in pieces:
    partial = local.forward(step, data, q, k_s, v_s, lay)
    if partial is not None:
      out, lse = merge_partials(out, lse, *partial)
  return out.astype(q.dtype), lse


def _window_ring_fwd(axis, n, local, fetches, data, q, k, v, layout):
  visits = list(_visits(axis, n, fetches, k, v, layout))
  out, lse = _merged_steps(local, data, q, v, visits)
  return (out, lse), (data, q, [visit[1:] for visit in visits], out, lse)


def _window_ring_bwd(axis, n, local, fetches, residuals, cotangents):
  data, q, visits, out, lse = residuals
  dout, dlse = cotangents
  k, v = visits[0][:2]
  dq, dk, dv = (jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
  for (k_s, v_s, lay), (step, part) in zip(visits, ((0, None),) + fetches):
    grads = local.backward(step, data, q, k_s, v_s, lay, out, lse, dout, dlse)
    if grads is None:
      continue
    home = lambda g: (g if step == 0 else _move(g, axis, n, step, part, back=True)).astype(jnp.float32)
    dq, dk, dv = dq + grads[0].astype(jnp.float32), dk + home(grads[1]), dv + home(grads[2])
  return None, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_window_ring.defvjp(_window_ring_fwd, _window_ring_bwd)


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
  out, lse = _merged_steps(local, data, q, v, _shard_pieces(axis, n, k, v, layout))
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


def _to_heads(axis: str, x):
  """`[B, T/n, H, ...]` sharded over `axis` on the sequence -> `[B, T, H/n, ...]`."""
  return jax.lax.all_to_all(x, axis, 2, 1, tiled=True)


def _to_sequence(axis: str, x):
  """Inverse of `_to_heads`: `[B, T, H/n, ...]` -> `[B, T/n, H, ...]` (lse `[B, T, H/n]` too)."""
  return jax.lax.all_to_all(x, axis, 1, 2, tiled=True)


def _ulysses(axis, inner, kv_repeat, data, q, k, v, layout):
  """Per device: q `[B, T/n, H, D]`, k/v `[B, T/n, Hkv, D]` (the n devices of `axis`
  together hold T tokens) -> `inner(data, q, k, v, layout)` on `[B, T, H/n, D]`, the n
  shards' tokens in device order, with `layout`'s ids `[B, T]` of those tokens -> (out
  `[B, T/n, H, D]`, lse `[B, T/n, H]`).
  K/V heads are repeated `kv_repeat` times first, each next to itself, so that every group
  of query heads keeps its key/value head when the heads are split."""
  k, v = (jnp.repeat(x, kv_repeat, axis=2) for x in (k, v))
  out, lse = inner(data, *(_to_heads(axis, x) for x in (q, k, v)), layout)
  return _to_sequence(axis, out), _to_sequence(axis, lse)


def _whole_sequence(kernel, mask, scale, options, shards, data, q, k, v, layout):
  """Ulysses's inner computation without a ring (`data` is None): the kernel (with
  `options`, e.g. its soft cap) on the whole sequence in the original token order (the
  load balancing over `shards` undone with reshapes and flips), so default positions stay
  None and index-masking kernels take their check-free path."""
  unpermute = (lambda x: balance.unload_balance(x, shards)) if shards > 1 else (lambda x: x)
  permute = (lambda x: balance.load_balance(x, shards)) if shards > 1 else (lambda x: x)
  layout = dataclasses.replace(jax.tree.map(unpermute, layout), shards=1)
  out, lse = kernel(unpermute(q), unpermute(k), unpermute(v), layout, mask=mask, scale=scale,
                    return_lse=True, **options)
  return permute(out), permute(lse)


def _kv_repeat(cp: ContextParallel, n: int, heads: int, kv_heads: int) -> int:
  """How many times Ulysses repeats each K/V head so that n devices split the q heads
  `heads` and the K/V heads `kv_heads` alike (counts per head shard): lcm(kv_heads, n) /
  kv_heads. Each group of queries keeps its K/V head, since lcm(kv_heads, n) divides
  `heads` whenever n and kv_heads do.

  Raises:
    ValueError: n does not divide `heads`.
  """
  if heads % n:
    raise ValueError(
        f"context_parallel strategy 'ulysses' over {cp.axis!r} (size {n}) splits the query"
        f" heads over it and expects the heads per device ({heads}, of {kv_heads} K/V heads)"
        f" divisible by {n}; use strategy='ring' or 'all_gather', which do not split heads, or"
        f" a {cp.axis!r} axis whose size divides the heads.")
  return math.lcm(kv_heads, n) // kv_heads


def _ring_body(axis: str, n: int, local, fetches, checked: bool):
  """The ring over `axis`: every step, only the steps of `fetches` (window-aware), or with
  `checked` a per-batch choice between the two (`data` then carries the check)."""
  ring = functools.partial(_ring, axis, n, local)
  if fetches is None:
    return ring
  window = functools.partial(_window_ring, axis, n, local, fetches)
  if not checked:
    return window
  return lambda d, *args: jax.lax.cond(d[1], lambda: window(d[0], *args), lambda: ring(d[0], *args))


def context_parallel_attention(q, k, v, layout: Layout, *, mask: Mask, scale: float,
                               cp: ContextParallel, kernel, return_lse: bool,
                               soft_cap: float | None = None):
  """Attention of q `[B, T, H, D]` over k `[B, T, Hkv, D]`, v `[B, T, Hkv, Dv]` sharded on
  dim 1 over `cp.seq_axes` (`soft_cap`: the kernel's logit soft-capping, or None).

  `kernel` is the registry's kernel; its `context_parallel_local` gives the per-device
  computation of the ring and all-gather strategies, Ulysses calls it on the whole
  sequence. `layout` comes from `flaxattn.layout.resolve` (default positions in
  load-balanced order when `cp.load_balance` is True).

  Raises:
    ValueError: no mesh set, an axis not in the mesh, keys and queries of different
      lengths, T not divisible by the number of sequence shards (and by 2 x the balanced
      shards with row load balancing), default positions under document load balancing,
      or, for Ulysses, heads that do not split over its axis.
  """
  mesh = jax.sharding.get_abstract_mesh()
  n = axis_size(cp, mesh=mesh)
  ring_n = axis_size(cp, cp.ring_axis, mesh) if cp.ring_axis else 1
  balanced = cp.balanced_shards(mesh)
  b, t = q.shape[:2]
  if k.shape[1] != t:
    raise ValueError(f"context_parallel expects keys as long as queries (self attention), got"
                     f" q {q.shape} and k {k.shape}.")
  if cp.load_balance == "document":
    if layout.q_positions is None or layout.kv_positions is None:
      raise ValueError(
          f"context_parallel={cp} expects explicit positions: the original token order of a"
          " per-document balanced row is known only to the data, got positions=None. Pass"
          " positions=flaxattn.load_balance(positions, cp, segment_ids=segment_ids) (each"
          " token's position in its document, moved with the tokens).")
    layout = dataclasses.replace(layout, shards=1)  # kernels mask on the array index
  parts = math.lcm(n * ring_n, 2 * balanced if cp.row_balanced else 1)
  if t % parts:
    if cp.ring_axis is None:
      why = " (2 x axis size, load balancing)" if cp.row_balanced else ""
    else:
      why = (f" ({ring_n} x {n} shards over {cp.seq_axes}"
             f"{', each ring shard 2 chunks, load balancing' if cp.row_balanced else ''})")
    raise ValueError(f"context_parallel over {cp.axis!r} (size {n}) expects the sequence length"
                     f" ({t}) divisible by {parts}{why}.")

  # Every mesh axis is manual: the batch and heads stay sharded over the axes that divide
  # them (left to automatic sharding, the compiler would gather the batch inside the ring's
  # loops), the rest are replicated, and a kernel called inside sees no automatic axes.
  batch = sharding.dividing_axes(mesh, [a for a in cp.batch_axes if a not in cp.seq_axes], b) or None
  heads = sharding.dividing_axes(mesh, [a for a in cp.head_axes if a not in cp.seq_axes],
                                 q.shape[2], k.shape[2]) or None
  seq_axes = cp.seq_axes if cp.ring_axis else cp.axis
  # Ulysses's ids enter whole over its axis (int32, gathered there by the compiler, or
  # computed in place for the default positions): the all-to-all gives every device all
  # the tokens of its ring shard.
  seq = P(batch, cp.ring_axis) if cp.strategy == "ulysses" else P(batch, seq_axes)
  qkv = P(batch, seq_axes, heads)
  ulysses = cp.strategy == "ulysses"
  kv_shape = k.shape
  if ulysses:
    head_shards = math.prod(mesh.shape[a] for a in heads or ())
    kv_repeat = _kv_repeat(cp, n, q.shape[2] // head_shards, k.shape[2] // head_shards)
    kv_shape = (*k.shape[:2], k.shape[2] * kv_repeat, k.shape[3])
  capped = {} if soft_cap is None else dict(soft_cap=soft_cap)
  local = data = data_specs = fetches = near = None
  if not ulysses or cp.ring_axis:  # a ring or the gathered keys: the kernel's local passes
    ring_axis = cp.ring_axis or cp.axis
    shards = ring_n if cp.ring_axis else n
    local, data, data_specs = kernel.context_parallel_local(
        strategy="ring" if ulysses else cp.strategy, mask=mask, scale=scale,
        shards=shards, axis=ring_axis, load_balance=cp.row_balanced,
        q_shape=q.shape, kv_shape=kv_shape, layout=layout, **capped)
    if cp.strategy != "all_gather":  # a ring, alone or inside Ulysses: window-aware?
      fetches = ring_fetches(mask, t, shards, cp.load_balance)
    if fetches is not None:  # explicit positions: do they follow the index (per batch)?
      index = layout.index(b, t)
      near = index_check(mask, layout, index, index)
    layout = layout.materialize(b, t, t)
    if near is not None:
      data, data_specs = (data, near), (data_specs, P())
  if cp.strategy == "all_gather":
    body = functools.partial(_all_gather, cp.axis, local)
  elif cp.strategy == "ring":
    body = _ring_body(cp.axis, n, local, fetches, near is not None)
  else:
    inner = (_ring_body(cp.ring_axis, ring_n, local, fetches, near is not None) if cp.ring_axis
             else functools.partial(_whole_sequence, kernel, mask, scale, capped,
                                    balanced if cp.row_balanced else 1))
    body = functools.partial(_ulysses, cp.axis, inner, kv_repeat)
  manual = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
  out, lse = jax.shard_map(body, in_specs=(data_specs, qkv, qkv, qkv, jax.tree.map(lambda _: seq, layout)),
                           out_specs=(qkv, qkv), axis_names=manual,
                           check_vma=False)(data, q, k, v, layout)
  return (out, lse) if return_lse else out
