"""The device mesh of a run: axes (data, fsdp, tensor, context_ring, context), all
`AxisType.Auto`, and the context parallelism over its sequence axes."""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType

import flaxattn
from train.config import BALANCE, MESH_AXES, ConfigError, TrainConfig


def make(cfg: TrainConfig) -> jax.sharding.Mesh:
  """The mesh of `cfg.mesh` over all devices, after checking that the batch and sequence
  split evenly over it.

  Raises:
    ConfigError: sizes that do not multiply to the device count; `batch_size` not a
      multiple of data x fsdp; `seq_len` not a multiple of context_ring x context (and of
      2 x the load-balanced shards with row load balancing).
  """
  shape = cfg.mesh.shape(jax.device_count())
  sizes = dict(zip(MESH_AXES, shape, strict=True))
  batch_parts = sizes["data"] * sizes["fsdp"]
  if cfg.batch_size % batch_parts:
    raise ConfigError(f"batch_size ({cfg.batch_size}) expects a multiple of mesh data x fsdp"
                      f" ({batch_parts}).")
  mesh = jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
  cp = context_parallel(cfg, mesh)
  shards = sizes["context_ring"] * sizes["context"]
  balanced = 1 if cp is None or not cp.row_balanced else cp.balanced_shards(mesh)
  seq_parts = math.lcm(shards, 2 * balanced if balanced > 1 else 1)
  if cfg.seq_len % seq_parts:
    why = ", and 2 x the load-balanced shards (data.balance=row)" if balanced > 1 else ""
    raise ConfigError(f"seq_len ({cfg.seq_len}) expects a multiple of {seq_parts} (mesh"
                      f" context_ring x context{why}).")
  return mesh


def context_parallel(cfg: TrainConfig, mesh) -> flaxattn.ContextParallel | None:
  """The context parallelism of `cfg` over `mesh`: None when the sequence is not sharded;
  a ring over `context_ring` inside Ulysses over `context` when `context_ring` > 1."""
  if mesh.shape["context_ring"] * mesh.shape["context"] == 1:
    return None
  ring_axis = "context_ring" if mesh.shape["context_ring"] > 1 else None
  return flaxattn.ContextParallel("context", cfg.context_parallel.strategy,
                                  BALANCE[cfg.data.balance], ring_axis)
