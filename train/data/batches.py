"""Packed local batches -> global arrays, in the run's token order.

`GlobalBatches` permutes every per-token array into the load-balanced order (under context
parallelism, `data.balance`: per document by one `flaxattn.balance_plan` of the batch, or
the whole row by `flaxattn.load_balance`) and assembles global arrays with
`jax.make_array_from_process_local_data`: batch over (data, fsdp), sequence over
(context_ring, context).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flaxattn

BATCH_SPEC = P(("data", "fsdp"), ("context_ring", "context"))  # ContextParallel.seq_axes
KEYS = ("tokens", "targets", "weights", "segment_ids", "positions")
DTYPES = {"tokens": np.int32, "targets": np.int32, "weights": np.float32,
          "segment_ids": np.int32, "positions": np.int32}


class GlobalBatches:
  """This process's part of global `[batch_size, seq_len]` batches, assembled into
  `jax.Array`s sharded `P(("data", "fsdp"), ("context_ring", "context"))` over `mesh`.

  The rows (and columns, if the context axis spans processes) that this process's devices
  hold decide which data shard it reads: processes holding the same rows read the same
  shard and keep their own columns.

  Args:
    mesh: the training mesh (`train.config.MESH_AXES`).
    cp: the run's context parallelism, whose token order (`ContextParallel.load_balance`
      over its `balanced_shards`) the batches are permuted into; None: the original order.
    masks: with per-document order, the model's masks, one per layer
      (`models.llama.layer_masks`), which weigh each token's work.
  """

  def __init__(self, mesh, *, batch_size: int, seq_len: int,
               cp: flaxattn.ContextParallel | None = None, masks=None):
    self.sharding = NamedSharding(mesh, BATCH_SPEC)
    self.shape = (batch_size, seq_len)
    self.shards = 1 if cp is None else cp.balanced_shards(mesh)
    # "document", True (row order) or None (the original order)
    self.order = cp.load_balance if cp is not None and self.shards > 1 else None
    self.masks = masks
    index = self.sharding.addressable_devices_indices_map(self.shape).values()
    # jax annotates each index `| None`; it builds them from devices_indices_map (no None).
    rows = [i[0].indices(batch_size) for i in index]  # pyright: ignore[reportOptionalSubscript]
    cols = [i[1].indices(seq_len) for i in index]  # pyright: ignore[reportOptionalSubscript]
    self.rows = slice(min(r[0] for r in rows), max(r[1] for r in rows))
    self.cols = slice(min(c[0] for c in cols), max(c[1] for c in cols))
    self.local_batch = self.rows.stop - self.rows.start
    self.shard_index = self.rows.start // self.local_batch
    self.shard_count = batch_size // self.local_batch

  def to_global(self, local: dict) -> dict:
    """Global arrays of a local batch (dict of `[local_batch, seq_len]` numpy arrays)."""
    out = {}
    plan = None
    if self.order == "document":  # one plan for every array
      plan = flaxattn.balance_plan(local["segment_ids"], self.shards, self.masks)
    for key in KEYS:
      x = local[key]
      if plan is not None:  # renumbered ids: the same documents, narrower ranges per block
        x = plan.segment_ids(x) if key == "segment_ids" else plan.apply(x)
      elif self.order is True:
        x = flaxattn.load_balance(x, self.shards)
      out[key] = jax.make_array_from_process_local_data(
          self.sharding, x[:, self.cols].astype(DTYPES[key], copy=False), self.shape)
    return out


def abstract_batch(mesh, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch a train step takes (`GlobalBatches.to_global`'s arrays) as shapes,
  dtypes and shardings over `mesh`: `KEYS` -> `[batch_size, seq_len]`."""
  sharding = NamedSharding(mesh, BATCH_SPEC)
  return {key: jax.ShapeDtypeStruct((batch_size, seq_len), DTYPES[key], sharding=sharding)
          for key in KEYS}
