"""The packed layout of an attention call: segment ids and positions of queries and keys.

`None` means the default: one document per row (segment id 1 everywhere) and positions
equal to the token index. Kernels keep the distinction, because a call whose layout is
all defaults has a block structure known at trace time (a static schedule).
"""

from __future__ import annotations

import dataclasses
import functools

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


def follows_index(layout: Layout, q_index, kv_index, chunk: int | None = None) -> jax.Array:
  """Scalar bool: a mask on token indices equals the same mask on positions for this layout.

  Kernels that mask by index (splash, cuDNN) see `q_index` `[B, T]` / `kv_index` `[B, S]`
  int32 (the original index of each token; under load balancing not the array index). The
  two masks agree on every pair of tokens that share a segment id when each document has
  one shift: position - index is the same for all its query and key tokens (and, with
  `chunk`, so is position // chunk - index // chunk, which aligns chunks). Padding is
  ignored. `layout` must be materialized. Any ids and any token order: the tokens are
  sorted by (segment id, shifts), O(T log T) time and O(T) memory, never `[T, T]`.
  """
  same_kv = layout.kv_segment_ids is layout.q_segment_ids and layout.kv_positions is layout.q_positions
  sides = [(layout.q_segment_ids, layout.q_positions, q_index)]
  if not (same_kv and kv_index is q_index):
    sides.append((layout.kv_segment_ids, layout.kv_positions, kv_index))
  ids, shift, chunk_shift = [], [], []
  for seg, pos, index in sides:
    real = seg != 0
    ids.append(seg)
    shift.append(jnp.where(real, pos - index, 0))
    if chunk is not None:
      chunk_shift.append(jnp.where(real, pos // chunk - index // chunk, 0))
  keys = [jnp.concatenate(x, axis=1) for x in (ids, shift, chunk_shift) if x]
  keys = jax.lax.sort(keys, dimension=1, num_keys=len(keys))
  same_doc = keys[0][:, 1:] == keys[0][:, :-1]
  return jnp.all(functools.reduce(
      jnp.logical_and, [~same_doc | (x[:, 1:] == x[:, :-1]) for x in keys[1:]]))
