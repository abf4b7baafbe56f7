"""Context parallelism: attention with the sequence axis sharded over a mesh axis.

Owns `ContextParallel` (the options), the choice of strategy per call, and
`context_parallel_attention`, which checks a call and runs its strategy in one `shard_map`:
the ring and all-gather (`flaxattn.ring`, on the kernel's `RingStep`) or Ulysses
(`flaxattn.ulysses`, optionally around a ring over a second axis). Derivations:
docs/design.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxattn import balance, checks, planner, ring, sharding, ulysses
from flaxattn.layout import Layout, index_check
from flaxattn.masks import Mask
from flaxattn.mods import ScoreMod

STRATEGIES = ("ring", "all_gather", "ulysses", "auto")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """Run attention with the sequence axis sharded over mesh axis `axis`.

  Args:
    axis: mesh axis name the sequence (dim 1 of q/k/v) is sharded over.
    strategy: "ring", "all_gather", "ulysses" or "auto" (per call, the strategy
      `flaxattn.planner.plan` estimates fastest for its shapes, heads, mask and mesh; with
      `ring_axis` the hybrid, the one strategy over both axes). Ulysses turns
      sequence-sharded q/k/v into head-sharded ones with an all-to-all over `axis`, runs the
      kernel on the whole
      sequence and turns the result back: the query heads, and the key/value heads after
      repeating each as little as needed, must divide by the axis size (heads sharded over
      `head_axes` count per shard).
    load_balance: the token order of the per-token arrays, over `balanced_shards()` shards;
      exactly True, False or "document". True: `flaxattn.load_balance` row order (dual
      chunk); only the default positions depend on it (they become the permuted token
      indices), explicit positions are used as given. "document": per-document order
      (`flaxattn.load_balance(..., segment_ids=)`), which only the data knows: positions
      must be explicit, and the fast paths that read the row order (the window-aware ring,
      splash's and cuDNN's index masks) do not apply (`explain` says so). False: the
      original order. Ulysses alone gains nothing from it (each device sees every query)
      and undoes row order locally.
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
    grad_dtype: the dtype a ring's backward sums its steps' partial dQ and dK/dV in (dQ on
      the device, dK/dV travelling with their block). float32 (the default): each partial
      is added exactly. None: the inputs' dtype, as TransformerEngine's ring does: for
      bfloat16 inputs the ring then holds and sends half the bytes of gradient (from 3
      devices on, where the ring sums; docs/context_parallel.md has the memory and the
      error measured). Each sum still adds in float32; only what is held between steps is
      rounded. A dtype less precise than bfloat16 (float8) is refused.
    head_groups: how many groups of heads a ring (strategy "ring", or Ulysses x ring's)
      takes round one after the other, each group's query heads with the K/V heads they
      read: a device then holds one group's K/V blocks, partial results and gradient sums
      at a time, 1 / head_groups of them. It must divide the K/V heads each device's ring
      sees. None (the default): `ring_head_groups` picks, up to 4 groups while each keeps
      at least 65536 query rows (tokens x query heads) per device; 1 for shorter calls.
  Raises:
    TypeError: `load_balance` other than True, False or a string (1, 1.0, np.True_, None:
      the order is read by identity).
    ValueError: unknown strategy, load balancing string or cost model, a non-string axis,
      `batch_axes` or `head_axes` other than a tuple of axis names, a `ring_axis` that is
      `axis` or comes without strategy "ulysses" or "auto", a `grad_dtype` other than
      None or a floating dtype at least as precise as bfloat16 (float8 is refused), or
      `head_groups` other than None or a positive int.
  """

  axis: str = "context"
  strategy: str = "ring"
  load_balance: bool | str = True
  ring_axis: str | None = None
  batch_axes: tuple[str, ...] = ("data", "fsdp")
  head_axes: tuple[str, ...] = ("tensor",)
  cost_model: str | planner.Platform | None = None
  grad_dtype: Any = jnp.float32
  head_groups: int | None = None

  def __post_init__(self):
    if not isinstance(self.axis, str) or not self.axis:
      raise ValueError(f"ContextParallel(axis=...) expects a mesh axis name, got {self.axis!r}.")
    if self.strategy not in STRATEGIES:
      raise ValueError(f"ContextParallel(strategy=...) expects one of {STRATEGIES}, got"
                       f" {self.strategy!r}.")
    # By identity: the kernels test `load_balance is True` (row_balanced), and 1, 1.0 or
    # np.True_ would pass a test by equality while running in the other order.
    lb = self.load_balance
    if not (lb is True or lb is False or isinstance(lb, str)):
      raise TypeError(f"ContextParallel(load_balance=...) expects True (row order), False or"
                      f" 'document' (per-document order), got {lb!r} ({checks.type_name(lb)});"
                      " pass a Python bool, e.g. bool(x), or 'document'.")
    if isinstance(lb, str) and lb != "document":
      raise ValueError(f"ContextParallel(load_balance=...) expects True (row order), False or"
                       f" 'document' (per-document order), got {lb!r}.")
    if self.ring_axis is not None:
      if not isinstance(self.ring_axis, str) or self.ring_axis in ("", self.axis):
        raise ValueError(f"ContextParallel(ring_axis=...) expects None or a mesh axis name other"
                         f" than axis={self.axis!r}, got {self.ring_axis!r}.")
      if self.strategy not in ("ulysses", "auto"):
        raise ValueError(f"ContextParallel(ring_axis={self.ring_axis!r}) runs a ring inside"
                         f" Ulysses and expects strategy='ulysses' (or 'auto'), got"
                         f" {self.strategy!r}; for a ring over one axis leave ring_axis=None.")
    for field in ("batch_axes", "head_axes"):
      names = getattr(self, field)
      if not (isinstance(names, (tuple, list)) and all(isinstance(n, str) and n for n in names)):
        raise ValueError(f"ContextParallel({field}=...) expects a tuple of mesh axis names, got"
                         f" {names!r} ({checks.type_name(names)}); e.g. ('data', 'fsdp'), or ()"
                         " for none.")
      object.__setattr__(self, field, tuple(names))  # hashable: a static argument
    if not (self.cost_model is None or isinstance(self.cost_model, planner.Platform)
            or self.cost_model in planner.PLATFORMS):
      raise ValueError(f"ContextParallel(cost_model=...) expects None, one of"
                       f" {tuple(planner.PLATFORMS)} or a flaxattn.planner.Platform, got"
                       f" {self.cost_model!r}.")
    if self.grad_dtype is not None:
      try:
        dtype = jnp.dtype(self.grad_dtype)
      except TypeError:
        dtype = None
      # Sums held in fewer significand bits than bfloat16's drift: float8 gradients came out
      # 4-21% off the reference (4 devices, bfloat16 inputs), 16- and 32-bit ones 0.3-0.7%.
      if (dtype is None or not jnp.issubdtype(dtype, jnp.floating)
          or jnp.finfo(dtype).nmant < jnp.finfo(jnp.bfloat16).nmant):
        raise ValueError(f"ContextParallel(grad_dtype=...) expects None (the inputs' dtype) or"
                         f" a floating dtype at least as precise as bfloat16 (float32, bfloat16,"
                         f" float16, float64), got {self.grad_dtype!r}; pass jnp.float32 (exact"
                         " sums) or jnp.bfloat16 (half the bytes).")
      object.__setattr__(self, "grad_dtype", dtype)  # one hashable form: a static argument
    g = self.head_groups
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
      raise ValueError(f"ContextParallel(head_groups=...) expects None (chosen per call) or a"
                       f" positive int dividing the K/V heads of each device, got {g!r}"
                       f" ({checks.type_name(g)}).")

  @property
  def row_balanced(self) -> bool:
    """Whether the tokens are in row (dual-chunk) order, the one order a kernel can compute
    from the token index."""
    return self.load_balance is True

  @property
  def seq_axes(self) -> tuple[str, ...]:
    """The mesh axes the sequence is sharded over, outer first."""
    return (self.axis,) if self.ring_axis is None else (self.ring_axis, self.axis)

  def length_multiple(self, mesh=None) -> int:
    """What a sequence length must be a multiple of to split evenly over the sequence
    shards of `mesh` (default: the current mesh): the shards over `seq_axes`, and 2 x the
    balanced shards with row load balancing (each device holds two chunks)."""
    n = axis_size(self, mesh=mesh)
    ring_n = axis_size(self, self.ring_axis, mesh) if self.ring_axis else 1
    return math.lcm(n * ring_n, 2 * self.balanced_shards(mesh) if self.row_balanced else 1)

  def check_length(self, t: int, mesh=None) -> None:
    """Raises ValueError unless a sequence of `t` tokens splits evenly over the sequence
    shards of `mesh` (default: the current mesh): a multiple of `length_multiple`."""
    n = axis_size(self, mesh=mesh)
    ring_n = axis_size(self, self.ring_axis, mesh) if self.ring_axis else 1
    parts = self.length_multiple(mesh)
    if t % parts:
      if self.ring_axis is None:
        why = " (2 x axis size, load balancing)" if self.row_balanced else ""
      else:
        why = (f" ({ring_n} x {n} shards over {self.seq_axes}"
               f"{', each ring shard 2 chunks, load balancing' if self.row_balanced else ''})")
      raise ValueError(f"context_parallel over {self.axis!r} (size {n}) expects the sequence"
                       f" length ({t}) divisible by {parts}{why}.")

  def check_shapes(self, q_shape, kv_shape, mesh=None) -> int:
    """Raises ValueError unless attention of q `[B, T, H, D]` over k/v `[B, T, Hkv, D]`
    (global shapes) runs with this context parallelism on `mesh` (default: the current
    mesh): keys as long as queries, T split over the sequence shards (`check_length`) and,
    under Ulysses (strategy "ulysses", or "auto" with a `ring_axis`, which has only it), the
    heads of each head shard split over `axis`. The shape rules `context_parallel_attention`
    applies, asked without tracing (e.g. by a trainer, before it writes or compiles).

    Returns:
      how many times Ulysses repeats each K/V head (`ulysses.kv_repeat`); 1 for the others.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if kv_shape[1] != q_shape[1]:
      raise ValueError(f"context_parallel expects keys as long as queries (self attention), got"
                       f" q {tuple(q_shape)} and k {tuple(kv_shape)}.")
    self.check_length(q_shape[1], mesh)
    if self.strategy != "ulysses" and not (self.strategy == "auto" and self.ring_axis):
      return 1
    shards = math.prod(mesh.shape[a] for a in _head_axes(self, mesh, q_shape[2], kv_shape[2]))
    return ulysses.kv_repeat(self.axis, axis_size(self, mesh=mesh), q_shape[2] // shards,
                             kv_shape[2] // shards)

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


# `ring_head_groups`'s choice: at most this many groups, each of at least this many query
# rows (tokens x query heads) per device, so that every kernel call keeps a GPU's SMs busy.
MAX_HEAD_GROUPS = 4
MIN_GROUP_ROWS = 1 << 16


def ring_head_groups(cp: ContextParallel, rows: int, heads: int, kv_heads: int) -> int:
  """How many groups of heads a ring goes round in (`ContextParallel.head_groups`), for a
  device's ring with `rows` query tokens (batch x tokens), `heads` query heads and
  `kv_heads` K/V heads: the option, else the most groups up to `MAX_HEAD_GROUPS` that
  divide `kv_heads` and keep `MIN_GROUP_ROWS` query rows (tokens x query heads) each.

  Raises:
    ValueError: a `head_groups` that does not divide `kv_heads`.
  """
  if cp.head_groups is not None:
    if kv_heads % cp.head_groups:
      raise ValueError(f"ContextParallel(head_groups={cp.head_groups}) expects a divisor of"
                       f" the {kv_heads} K/V heads each device's ring holds, got"
                       f" {cp.head_groups}; pass one of"
                       f" {[g for g in range(1, kv_heads + 1) if kv_heads % g == 0]} or None.")
    return cp.head_groups
  return max(g for g in range(1, min(MAX_HEAD_GROUPS, kv_heads) + 1)
             if kv_heads % g == 0 and (g == 1 or rows * heads // g >= MIN_GROUP_ROWS))


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


def _head_axes(cp: ContextParallel, mesh, heads: int, kv_heads: int) -> tuple[str, ...]:
  """The axes of `cp.head_axes` (not sequence axes) that the heads stay sharded over inside
  the attention: those in `mesh` whose sizes divide `heads` and `kv_heads`."""
  return sharding.dividing_axes(mesh, [a for a in cp.head_axes if a not in cp.seq_axes], heads,
                                kv_heads)


def head_groups_for(cp: ContextParallel, q_shape, kv_shape, mesh=None) -> int:
  """The head groups (`ring_head_groups`) of the ring each device runs for a call of global
  shapes q `[B, T, H, D]` and k/v `[B, T, Hkv, D]` on `mesh` (default: the current mesh), its
  batch and heads over the axes that divide them and, inside Ulysses, the heads over its
  axis; 1 for a strategy without a ring (all_gather, Ulysses alone; "auto" resolved first,
  `choose`)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if cp.strategy == "all_gather" or (cp.strategy == "ulysses" and not cp.ring_axis):
    return 1
  repeat = cp.check_shapes(q_shape, kv_shape, mesh)
  b, t, h = q_shape[:3]
  batch = sharding.dividing_axes(mesh, [a for a in cp.batch_axes if a not in cp.seq_axes], b)
  split = math.prod(mesh.shape[a] for a in _head_axes(cp, mesh, h, kv_shape[2]))
  if cp.ring_axis:  # Ulysses's ring: the tokens of its ring shard, the heads over its axis
    split *= axis_size(cp, mesh=mesh)
  tokens = t // axis_size(cp, cp.ring_axis or cp.axis, mesh)
  rows = b // math.prod(mesh.shape[a] for a in batch) * tokens
  return ring_head_groups(cp, rows, h // split, kv_shape[2] * repeat // split)


def context_parallel_attention(q, k, v, layout: Layout, *, mask: Mask, scale: float,
                               cp: ContextParallel, kernel, return_lse: bool,
                               soft_cap: float | None = None, score_mod: ScoreMod | None = None):
  """Attention of q `[B, T, H, D]` over k `[B, T, Hkv, D]`, v `[B, T, Hkv, Dv]` sharded on
  dim 1 over `cp.seq_axes` (`soft_cap`, `score_mod`: the kernel's logit soft-capping and
  score mod, or None). A programmable mask or score mod sees the global batch rows, heads
  and token indices in the caller's order (`flaxattn.mods`): the indices are computed once
  here, before the tokens are split, and travel with them.

  `kernel` is the registry's kernel; its `ring_step` gives the per-device computation of
  the ring and all-gather strategies (`flaxattn.ring.RingStep`), passed into the
  `shard_map` as an operand; Ulysses calls the kernel on the whole sequence. `layout` comes
  from `flaxattn.layout.resolve` (default positions in load-balanced order when
  `cp.load_balance` is True).

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
  repeat = cp.check_shapes(q.shape, k.shape, mesh)  # Ulysses repeats each K/V head
  if cp.load_balance == "document":
    if layout.q_positions is None or layout.kv_positions is None:
      raise ValueError(
          f"context_parallel={cp} expects explicit positions: the original token order of a"
          " per-document balanced row is known only to the data, got positions=None. Pass"
          " positions=flaxattn.load_balance(positions, cp, segment_ids=segment_ids) (each"
          " token's position in its document, moved with the tokens).")
  coords = mask.reads_index or score_mod is not None  # global indices and offsets
  if coords and layout.q_index is None:
    if cp.load_balance == "document":
      full = layout.materialize(b, t, t)
      index = balance.original_index(full.q_segment_ids, full.q_positions)
    else:
      index = layout.index(b, t)
    layout = dataclasses.replace(layout, q_index=index, kv_index=index)
  if cp.load_balance == "document":
    layout = dataclasses.replace(layout, shards=1)  # kernels mask on the array index

  # Every mesh axis is manual: the batch and heads stay sharded over the axes that divide
  # them (left to automatic sharding, the compiler would gather the batch inside the ring's
  # loops), the rest are replicated, and a kernel called inside sees no automatic axes.
  batch = sharding.dividing_axes(mesh, [a for a in cp.batch_axes if a not in cp.seq_axes],
                                 b) or None
  heads = _head_axes(cp, mesh, q.shape[2], k.shape[2]) or None
  seq_axes = cp.seq_axes if cp.ring_axis else cp.axis
  # Ulysses's ids enter whole over its axis (int32, gathered there by the compiler, or
  # computed in place for the default positions): the all-to-all gives every device all
  # the tokens of its ring shard.
  seq = P(batch, cp.ring_axis) if cp.strategy == "ulysses" else P(batch, seq_axes)
  qkv = P(batch, seq_axes, heads)
  kv_shape = (*k.shape[:2], k.shape[2] * repeat, k.shape[3])
  options = dict(mask=mask, scale=scale) | ({} if soft_cap is None else dict(soft_cap=soft_cap))
  options |= {} if score_mod is None else dict(score_mod=score_mod)
  step = near = fetches = None
  if cp.strategy != "ulysses" or cp.ring_axis:  # a ring or the gathered keys: a RingStep
    shards = ring_n if cp.ring_axis else n
    step = kernel.ring_step(
        strategy="all_gather" if cp.strategy == "all_gather" else "ring", shards=shards,
        axis=cp.ring_axis or cp.axis, load_balance=cp.row_balanced, q_shape=q.shape,
        kv_shape=kv_shape, layout=layout, **options)
    if cp.strategy != "all_gather":  # a ring, alone or inside Ulysses: window-aware?
      fetches = ring.ring_fetches(mask, t, shards, cp.load_balance)
    if fetches is not None:  # explicit positions: do they follow the index (per batch)?
      index = layout.index(b, t)
      near = index_check(mask, layout, index, index)
    layout = layout.materialize(b, t, t)
  body: Callable[..., tuple[jax.Array, jax.Array]]
  if cp.strategy == "all_gather":
    body = functools.partial(ring.all_gather, cp.axis, n)
  elif cp.strategy == "ring":
    body = ring.ring(cp.axis, n, fetches, near is not None, cp.grad_dtype,
                     head_groups_for(cp, q.shape, k.shape, mesh))
  else:
    inner = (ring.ring(cp.ring_axis, ring_n, fetches, near is not None, cp.grad_dtype,
                       head_groups_for(cp, q.shape, k.shape, mesh))
             if cp.ring_axis
             else functools.partial(ulysses.whole_sequence, kernel, options,
                                    balanced if cp.row_balanced else 1))
    body = functools.partial(ulysses.ulysses, cp.axis, inner, repeat)
  if coords:
    body = sharding.offset_by_shard(body, batch or (), heads or ())
  manual = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
  specs = (None if step is None else step.specs(), P(), qkv, qkv, qkv,
           jax.tree.map(lambda _: seq, layout))
  run: Callable[..., tuple[jax.Array, jax.Array]] = jax.shard_map(
      body, in_specs=specs, out_specs=(qkv, qkv), axis_names=manual, check_vma=False)
  out, lse = run(step, near, q, k, v, layout)
  return (out, lse) if return_lse else out
