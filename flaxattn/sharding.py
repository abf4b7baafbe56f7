"""Logical axis names and the default rules that map them to mesh axes.

Model code names axes logically (`batch`, `seq`, `embed`, `heads`, `kv_heads`, `head_dim`,
`mlp`, `vocab`) and never holds a mesh; the caller sets one:

  mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules(mesh, kv_heads=2)):
    model = nnx.jit(make_model)()   # parameters are sharded as they are created

`rules(mesh, ...)` fits `DEFAULT_RULES` to the mesh (docs/design.md, "Sharding").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec

# A rule maps a logical name to None (replicated), one mesh axis, or a tuple of them.
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("seq", ("context_ring", "context")),  # Ulysses x ring: ring outer (ContextParallel.seq_axes)
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def _as_tuple(axes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _as_entry(axes: tuple[str, ...]):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def _fit(axes, mesh_shape: dict[str, int], size: int | None, used=frozenset()) -> tuple[str, ...]:
  """The mesh axes of `axes` that exist, are unused and together divide `size` (greedy)."""
  kept = []
  for axis in _as_tuple(axes):
    if axis not in mesh_shape or axis in used:
      continue
    if size is not None and size % (math.prod(mesh_shape[a] for a in kept) * mesh_shape[axis]):
      continue
    kept.append(axis)
  return tuple(kept)


def default_axes(logical: str) -> tuple[str, ...]:
  """The mesh axes `DEFAULT_RULES` maps logical name `logical` to."""
  return _as_tuple(dict(DEFAULT_RULES)[logical])


def dividing_axes(mesh, axes, *sizes: int) -> tuple[str, ...]:
  """The axes of `axes` in `mesh`, not already manual there (inside a `shard_map`), whose
  running product divides every one of `sizes` (greedy, in order)."""
  kept, product = [], 1
  for axis in axes:
    if (axis in mesh.axis_names and axis not in mesh.manual_axes
        and all(n % (product * mesh.shape[axis]) == 0 for n in sizes)):
      kept.append(axis)
      product *= mesh.shape[axis]
  return tuple(kept)


def per_batch_and_head(fn, q_shape, kv_heads: int, layout,
                       leading_specs=()) -> Callable[..., Any]:
  """`fn(*leading, q, k, v, layout) -> (out, lse)` run per (batch, head) shard of the
  current mesh's automatic axes, the batch over `default_axes("batch")` and the heads over
  `default_axes("heads")` where they divide q `q_shape` `[B, T, H, D]` and the `kv_heads`;
  `fn` itself without a mesh. A Pallas call is opaque to automatic partitioning, which
  would gather its operands whole. `leading_specs`: the specs of `fn`'s leading arguments
  (prefixes: `PartitionSpec()` gives every shard a whole tree). Each shard's `layout`
  carries the global index of its first batch row and head (`Layout.shifted`), which
  programmable masks and scores read."""
  mesh = jax.sharding.get_abstract_mesh()
  auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)  # empty without a mesh
  if not auto:
    return fn
  batch = dividing_axes(mesh, default_axes("batch"), q_shape[0]) or None
  heads = dividing_axes(mesh, default_axes("heads"), q_shape[2], kv_heads) or None
  qkv, seq = PartitionSpec(batch, None, heads), PartitionSpec(batch, None)

  def shard(*args):
    *leading, q, k, v, layout = args
    rows = jax.lax.axis_index(batch) * q.shape[0] if batch else 0
    first_head = jax.lax.axis_index(heads) * q.shape[2] if heads else 0
    return fn(*leading, q, k, v, layout.shifted(rows, first_head))
  # Per-token ids `[B, T]` split with the batch; the offsets (scalars) are whole.
  layout_specs = jax.tree.map(lambda x: seq if jnp.ndim(x) == 2 else PartitionSpec(), layout)
  return jax.shard_map(shard, in_specs=(*leading_specs, qkv, qkv, qkv, layout_specs),
                       out_specs=(qkv, PartitionSpec(batch, None, heads)), axis_names=auto,
                       check_vma=False)


def _mesh_shape(mesh) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def rules(mesh, base: Rules = DEFAULT_RULES, **dim_sizes: int) -> Rules:
  """`base` fitted to `mesh`, for `nnx.logical_axis_rules`.

  Args:
    mesh: a `jax.sharding.Mesh` or `AbstractMesh`.
    base: rules to fit, `(logical_name, mesh_axes)` pairs.
    **dim_sizes: sizes of logical dimensions that a mesh axis may not divide, e.g.
      `kv_heads=2`; mesh axes that do not divide them are dropped (replicated).

  Returns:
    Rules naming only axes of `mesh`.

  Raises:
    ValueError: a `dim_sizes` name that `base` does not know, or a size that is not a
    positive int.
  """
  names = {name for name, _ in base}
  for name, size in dim_sizes.items():
    if name not in names:
      raise ValueError(f"rules(..., {name}=...) expects a logical name of the rules"
                       f" {sorted(names)}, got {name!r}.")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
      raise ValueError(f"rules(..., {name}=...) expects a positive int size, got {size!r}.")
  shape = _mesh_shape(mesh)
  return tuple((name, _as_entry(_fit(axes, shape, dim_sizes.get(name)))) for name, axes in base)


def active_rules() -> Rules:
  """The rules set by the innermost `nnx.logical_axis_rules` (empty if none)."""
  return tuple(flax_spmd.get_logical_axis_rules())


def logical_to_spec(names, shape=None, *, rules: Rules | None = None, mesh=None) -> PartitionSpec:
  """The `PartitionSpec` of an array whose axes have logical `names` (None = replicated).

  Mesh axes absent from `mesh`, manual there (inside a `shard_map`, where each device holds
  its own block), already used by an earlier dimension (e.g. `embed` after `batch` took
  `fsdp`), or not dividing the dimension in `shape` are dropped. As in flax, a
  name without a rule is taken to be a mesh axis name.

  Args:
    names: one logical name or None per array axis.
    shape: the array's shape, to drop mesh axes that do not divide a dimension; optional.
    rules: default the active `nnx.logical_axis_rules`, else `DEFAULT_RULES`.
    mesh: default the mesh set with `jax.set_mesh`.
  """
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  table = dict(rules if rules is not None else (active_rules() or DEFAULT_RULES))
  mesh_shape = _mesh_shape(mesh)
  used: set[str] = set(getattr(mesh, "manual_axes", ()))
  spec = []
  for i, name in enumerate(names):
    axes = () if name is None else _fit(table.get(name, name), mesh_shape,
                                        None if shape is None else shape[i], frozenset(used))
    used.update(axes)
    spec.append(_as_entry(axes))
  return PartitionSpec(*spec)


def constrain(x: jax.Array, names) -> jax.Array:
  """`x` with a sharding constraint from logical axis `names` (one per axis of `x`).

  A no-op unless both a mesh (`jax.set_mesh`) and rules (`nnx.logical_axis_rules`) are
  set, so single-device code needs neither; without rules every axis would resolve to
  replicated, which is a constraint nobody asked for.

  Raises:
    ValueError: `names` does not have one entry per axis of `x`.
  """
  if len(names) != x.ndim:
    raise ValueError(f"constrain expects one logical name per axis of x {x.shape}, got {names}.")
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not active_rules():
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh=mesh))


def param_metadata(names: tuple[str, ...], metadata) -> dict:
  """Variable metadata carrying logical `names` as `out_sharding`, unless `metadata` has one.

  Flax shards a variable with `out_sharding` as it is created, which needs a mesh and rules;
  without both we keep the names but skip that step so single-device code needs nothing
  (`nnx.get_partition_spec` still reads them).
  """
  metadata = dict(metadata)
  if "out_sharding" in metadata:
    return metadata
  metadata["out_sharding"] = names
  if jax.sharding.get_abstract_mesh().empty or not active_rules():
    metadata.setdefault("eager_sharding", False)
  return metadata
