"""The packed layout of an attention call: segment ids and positions of queries and keys.

`None` means the default: one document per row (segment id 1 everywhere) and positions
equal to the token index. Kernels keep the distinction, because a call whose layout is
all defaults has a block structure known at trace time (a static schedule).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Layout:
  """Segment ids `[B, T]`/`[B, S]` and positions, int32, or None for the defaults."""

  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  q_positions: jax.Array | None = None
  kv_positions: jax.Array | None = None

  @property
  def is_default(self) -> bool:
    return all(x is None for x in dataclasses.astuple(self))

  def materialize(self, batch: int, q_len: int, kv_len: int) -> Layout:
    """Returns a Layout with every field an int32 array (defaults filled in)."""
    return Layout(
        q_segment_ids=_or_default(self.q_segment_ids, batch, q_len, ones=True),
        kv_segment_ids=_or_default(self.kv_segment_ids, batch, kv_len, ones=True),
        q_positions=_or_default(self.q_positions, batch, q_len, ones=False),
        kv_positions=_or_default(self.kv_positions, batch, kv_len, ones=False),
    )


def _or_default(x, batch: int, length: int, *, ones: bool) -> jax.Array:
  if x is not None:
    return x
  if ones:
    return jnp.ones((batch, length), jnp.int32)
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


jax.tree_util.register_dataclass(
    Layout,
    data_fields=["q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions"],
    meta_fields=[],
)
