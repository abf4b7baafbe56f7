"""The run's parallelism, built once: the device mesh (axes data, fsdp, tensor,
context_ring, context, all `AxisType.Auto`), the model's logical sharding rules on it, and
the context parallelism over its sequence axes.

The mesh's device order is `jax.make_mesh`'s, where each mesh axis runs along whole
physical axes of the TPU torus; where the torus has no such order for the mesh's sizes
(v6e-256 as fsdp 64 x context 4), physical axes are split between mesh axes
(`mesh_utils.create_device_mesh(allow_split_physical_axes=True)`), and `physical_axes`
says which mesh axis spans which: a ring over a split axis takes longer steps.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType

import flaxattn
from flaxattn.context_parallel import head_groups_for
from models.llama import LAYERS_AXIS, LlamaConfig
from train.config import MESH_AXES, ConfigError, MeshConfig, TrainConfig, context_parallel

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Parallelism:
  """mesh: over all devices; rules: for `nnx.logical_axis_rules`; cp: the context
  parallelism, None when the sequence is not sharded."""

  mesh: jax.sharding.Mesh
  rules: tuple
  cp: flaxattn.ContextParallel | None


def make(cfg: TrainConfig, devices=None) -> Parallelism:
  """The parallelism of `cfg.mesh` over `devices` (default: all of them), after checking
  that the batch and the sequence split evenly over it (`check`). A ring runs over
  `context_ring` inside Ulysses over `context` when `context_ring` > 1.

  Raises:
    ConfigError: as `check`.
  """
  devices = jax.devices() if devices is None else devices
  cp = check(cfg, len(devices))
  mesh = _device_mesh(axis_sizes(cfg.mesh, len(devices)), devices)
  log.info("mesh %s; physical axes %s", dict(mesh.shape), describe_axes(mesh))
  return Parallelism(mesh, rules(mesh, cfg.model, cfg.mesh.fsdp_over_context), cp)


def check(cfg: TrainConfig, num_devices: int) -> flaxattn.ContextParallel | None:
  """The context parallelism of run `cfg` on `num_devices` devices (None when the mesh does
  not shard the sequence), after checking that the run splits over its mesh.

  Raises:
    ConfigError (its `keys` name the keys at fault): sizes that do not multiply to the
      device count (`mesh`); `batch_size` not a multiple of data x fsdp; a `seq_len` that
      is not a multiple of `seq_multiple`; heads that Ulysses cannot split over its axis
      (`model.n_heads`, `model.n_kv_heads`: `flaxattn.ContextParallel.check_shapes`); a
      `context_parallel.head_groups` that does not divide the K/V heads each device's ring
      holds (`flaxattn.context_parallel.ring_head_groups`).
  """
  shape = axis_sizes(cfg.mesh, num_devices)
  sizes = dict(zip(MESH_AXES, shape, strict=True))
  batch_parts = sizes["data"] * sizes["fsdp"]
  if cfg.batch_size % batch_parts:
    raise ConfigError(f"batch_size ({cfg.batch_size}) expects a multiple of mesh data x fsdp"
                      f" ({batch_parts}).", keys=("batch_size",))
  mesh = jax.sharding.AbstractMesh(shape, MESH_AXES)
  cp = _context_parallel(cfg, sizes)
  if cp is None:
    return None
  where = (f"over mesh {sizes} with context_parallel.strategy="
           f"{cfg.context_parallel.strategy!r} and data.balance={cfg.data.balance}")
  multiple = _seq_multiple(cfg, cp, mesh)
  if cfg.seq_len % multiple:
    lower = cfg.seq_len // multiple * multiple
    shards = math.prod(mesh.shape[a] for a in cp.seq_axes)
    why = (f"{shards} sequence shards" if multiple == shards else
           f"{shards} sequence shards, each holding 2 chunks under load balancing")
    raise ConfigError(f"seq_len ({cfg.seq_len}) expects a multiple of {multiple} ({why}) {where};"
                      f" set seq_len={lower + multiple}" + (f" or {lower}" if lower else "")
                      + ".", keys=("seq_len",))
  m = cfg.model
  q_shape = (cfg.batch_size, cfg.seq_len, m.n_heads, m.attn_head_dim)
  kv_shape = (cfg.batch_size, cfg.seq_len, m.n_kv_heads, m.attn_head_dim)
  try:
    cp.check_shapes(q_shape, kv_shape, mesh)
  except ValueError as e:
    raise ConfigError(f"model.n_heads ({m.n_heads}) and model.n_kv_heads ({m.n_kv_heads}) do"
                      f" not split {where}: {e}",
                      keys=("model.n_heads", "model.n_kv_heads")) from None
  try:  # the ring's own rule, asked before anything is written rather than at step 1
    head_groups_for(cp, q_shape, kv_shape, mesh)
  except ValueError as e:
    auto = (" (strategy 'auto' may choose the ring for any layer)"
            if cp.strategy == "auto" else "")
    raise ConfigError(f"config key 'context_parallel.head_groups' ({cp.head_groups}) with"
                      f" model.n_kv_heads ({m.n_kv_heads}) {where}{auto}: {e}",
                      keys=("context_parallel.head_groups", "model.n_kv_heads")) from None
  return cp


def seq_multiple(cfg: TrainConfig, num_devices: int) -> int:
  """What `cfg.seq_len` must be a multiple of on `cfg.mesh` over `num_devices` devices: 1
  without context parallelism; else the sequence shards, and twice the load-balanced ones
  under data.balance "row" or "document" (`make` refuses other lengths).

  Raises:
    ConfigError: mesh sizes that do not multiply to `num_devices`.
  """
  shape = axis_sizes(cfg.mesh, num_devices)
  cp = _context_parallel(cfg, dict(zip(MESH_AXES, shape, strict=True)))
  return _seq_multiple(cfg, cp, jax.sharding.AbstractMesh(shape, MESH_AXES))


def _context_parallel(cfg: TrainConfig, sizes: dict) -> flaxattn.ContextParallel | None:
  """The run's context parallelism over mesh axes of `sizes`; None when they do not shard
  the sequence."""
  if sizes["context_ring"] * sizes["context"] == 1:
    return None
  return context_parallel(cfg.context_parallel, cfg.data.balance,
                          ring=sizes["context_ring"] > 1)


def _seq_multiple(cfg: TrainConfig, cp: flaxattn.ContextParallel | None, mesh) -> int:
  if cp is None:
    return 1
  multiple = cp.length_multiple(mesh)
  if cfg.data.balance == "document":
    # The model's layers index the tokens by the dual chunk in any balanced order
    # (`flaxattn.layout.Layout.index`: RoPE's positions, splash's exactness check), which
    # needs two chunks a shard as the row order does.
    multiple = math.lcm(multiple, 2 * cp.balanced_shards(mesh))
  return multiple


def _device_mesh(shape: tuple[int, ...], devices) -> jax.sharding.Mesh:
  """A mesh of `shape` over `devices` (see the module docstring for the order)."""
  types = (AxisType.Auto,) * len(MESH_AXES)
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
  except NotImplementedError:  # no assignment without splitting a physical axis
    ordered = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  mesh = jax.sharding.Mesh(ordered, MESH_AXES, axis_types=types)
  log.warning("mesh %s splits physical axes of the %s topology: %s", dict(mesh.shape),
              devices[0].device_kind, describe_axes(mesh))
  return mesh


def physical_axes(mesh: jax.sharding.Mesh) -> dict[str, tuple[str, ...]]:
  """For each mesh axis of more than one device, the physical axes its steps move along:
  on TPU the torus's `x`, `y`, `z` (and `core` where a chip has two devices), elsewhere
  `host` (the process) and `device`."""
  flat = list(mesh.devices.flat)
  if flat[0].platform == "tpu":
    names = ("x", "y", "z", "core")
    coords = [(*d.coords, getattr(d, "core_on_chip", 0)) for d in flat]
  else:
    names = ("host", "device")
    # A device's place within its host: the same place on two hosts is no step along
    # "device" (ids are global: they differ across hosts).
    place = {d.id: i for host in {d.process_index for d in flat}
             for i, d in enumerate(sorted((d for d in flat if d.process_index == host),
                                          key=lambda d: d.id))}
    coords = [(d.process_index, place[d.id]) for d in flat]
  grid = np.asarray(coords).reshape(*mesh.devices.shape, len(names))
  spans = {}
  for i, axis in enumerate(mesh.axis_names):
    if mesh.devices.shape[i] > 1:
      moved = np.diff(grid, axis=i) != 0
      spans[axis] = tuple(n for j, n in enumerate(names) if moved[..., j].any())
  return spans


def describe_axes(mesh: jax.sharding.Mesh) -> str:
  """`physical_axes` as text, naming the physical axes that two mesh axes share (split)."""
  spans = physical_axes(mesh)
  # Within a host, GPUs share one switch (NVLink): only torus axes and hosts can be split.
  shared = {p for a in spans for p in spans[a]
            if p != "device" and sum(p in s for s in spans.values()) > 1}
  text = ", ".join(f"{a} over {'+'.join(s)}" for a, s in spans.items()) or "one device"
  return text + (f" (split: {', '.join(sorted(shared))})" if shared else "")


def axis_sizes(sizes: MeshConfig, num_devices: int) -> tuple[int, ...]:
  """The axis sizes of `sizes` in `MESH_AXES` order, -1 filled.

  Raises:
    ConfigError: more than one -1, a size < 1, or a product that is not `num_devices`.
  """
  shape = [getattr(sizes, a) for a in MESH_AXES]
  keys = tuple(f"mesh.{a}" for a in MESH_AXES)
  if sum(s == -1 for s in shape) > 1 or any(s < 1 and s != -1 for s in shape):
    raise ConfigError(f"mesh expects positive sizes with at most one -1, got {sizes}.", keys)
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ConfigError(f"mesh {sizes} cannot fill -1: {num_devices} devices are not a"
                        f" multiple of the other axes' product {known}.", keys)
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) != num_devices:
    named = dict(zip(MESH_AXES, shape, strict=True))
    raise ConfigError(f"mesh {named} has {math.prod(shape)} devices, but there are"
                      f" {num_devices}; set one axis to -1 or fix the sizes.", keys)
  return tuple(shape)


def rules(mesh, model: LlamaConfig, fsdp_over_context: bool = False) -> tuple:
  """The logical sharding rules of `Llama(model)` on `mesh` (`flaxattn.sharding.rules`
  fitted to the model's sizes); with `fsdp_over_context` (`MeshConfig`), `embed` over the
  context axes after fsdp. An activation's `embed` stays unsharded either way: its batch
  and sequence take those axes first (`flaxattn.sharding.logical_to_spec`)."""
  m = model
  base = flaxattn.sharding.DEFAULT_RULES
  if fsdp_over_context:
    embed = (*flaxattn.sharding.default_axes("embed"), *flaxattn.sharding.default_axes("seq"))
    base = tuple((name, embed if name == "embed" else axes) for name, axes in base)
  # Stacked layers (scan_layers) are replicated: every device holds its part of each layer.
  return (*flaxattn.sharding.rules(mesh, base, kv_heads=m.n_kv_heads, heads=m.n_heads,
                                   mlp=m.ffn_dim, vocab=m.vocab_size, embed=m.dim),
          (LAYERS_AXIS, None))
