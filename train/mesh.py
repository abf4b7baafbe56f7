"""The device mesh of a run: axes (data, fsdp, tensor, context), all `AxisType.Auto`."""

from __future__ import annotations

import jax
from jax.sharding import AxisType

from train.config import MESH_AXES, ConfigError, TrainConfig


def make(cfg: TrainConfig) -> jax.sharding.Mesh:
  """The mesh of `cfg.mesh` over all devices, after checking that the batch and sequence
  split evenly over it.

  Raises:
    ConfigError: sizes that do not multiply to the device count; `batch_size` not a
      multiple of data x fsdp; `seq_len` not a multiple of context (2 x context with load
      balancing).
  """
  shape = cfg.mesh.shape(jax.device_count())
  sizes = dict(zip(MESH_AXES, shape))
  batch_parts = sizes["data"] * sizes["fsdp"]
  if cfg.batch_size % batch_parts:
    raise ConfigError(f"batch_size ({cfg.batch_size}) expects a multiple of mesh data x fsdp"
                      f" ({batch_parts}).")
  balanced = sizes["context"] > 1 and cfg.context_parallel.load_balance
  seq_parts = sizes["context"] * (2 if balanced else 1)
  if cfg.seq_len % seq_parts:
    raise ConfigError(f"seq_len ({cfg.seq_len}) expects a multiple of {seq_parts} (mesh context"
                      f"{' x 2, load balancing' if balanced else ''}).")
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
