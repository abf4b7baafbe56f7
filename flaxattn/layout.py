"""The packed layout of an attention call: segment ids and positions of queries and keys,
and `resolve`, the one place their defaults are decided.

`None` means the default: one document per row (segment id 1 everywhere) and positions
equal to the token index (under load-balanced context parallelism, the permuted index).
Kernels keep the distinction, because a call whose layout is all defaults has a block
structure known at trace time (a static schedule).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxattn import balance, checks
from flaxattn.masks import Band, Mask, band

_INT32 = np.iinfo(np.int32)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Segment ids `[B, T]`/`[B, S]` and positions, int32, or None for the defaults.

  `shards` > 1: the tokens are in `flaxattn.load_balance` order over that many context
  shards, so default positions are the permuted token index.

  What programmable masks and scores read besides (`flaxattn.masks.Coords`), None for the
  defaults: `q_index` / `kv_index`, each token's index in the caller's order (default: the
  original index, `index`); `row_offset` / `head_offset`, the global index of the first
  batch row and query head a kernel sees (default 0; set inside a `shard_map` that splits
  the batch or the heads).
  """

  q_segment_ids: jax.Array | np.ndarray | None = None
  kv_segment_ids: jax.Array | np.ndarray | None = None
  q_positions: jax.Array | np.ndarray | None = None
  kv_positions: jax.Array | np.ndarray | None = None
  shards: int = 1
  q_index: jax.Array | np.ndarray | None = None
  kv_index: jax.Array | np.ndarray | None = None
  row_offset: jax.Array | int | None = None
  head_offset: jax.Array | int | None = None

  @property
  def is_default(self) -> bool:
    return all(x is None for x in (self.q_segment_ids, self.kv_segment_ids, self.q_positions,
                                   self.kv_positions))

  def indices(self, batch: int, q_len: int, kv_len: int) -> tuple[Any, Any]:
    """Token indices of queries `[B, T]` and keys `[B, S]` in the caller's order, defaults
    filled in."""
    return (self.index(batch, q_len) if self.q_index is None else self.q_index,
            self.index(batch, kv_len) if self.kv_index is None else self.kv_index)

  def offsets(self) -> tuple[Any, Any]:
    """(row_offset, head_offset), 0 where not set."""
    return (0 if self.row_offset is None else self.row_offset,
            0 if self.head_offset is None else self.head_offset)

  def map_tokens(self, f) -> Layout:
    """This layout with `f` applied to each per-token array given (ids, positions, indices)."""
    return dataclasses.replace(self, **{name: f(getattr(self, name)) for name in TOKEN_FIELDS
                                        if getattr(self, name) is not None})

  def kv_ids(self):
    """The keys' per-token arrays stacked `[N, B, S]` int32 (segment ids, positions and,
    where given, indices; materialized): what travels with K/V round a ring."""
    return jnp.stack([x for x in (self.kv_segment_ids, self.kv_positions, self.kv_index)
                      if x is not None])

  def visiting(self, ids) -> Layout:
    """This layout's queries with the visiting keys' `kv_ids`."""
    # The per-device layout of a ring step: every field explicit, so no load balancing
    # (`shards`) is left to apply.
    return dataclasses.replace(self, kv_segment_ids=ids[0], kv_positions=ids[1],
                               kv_index=ids[2] if len(ids) > 2 else None, shards=1)

  def shifted(self, rows=0, heads=0) -> Layout:
    """This layout for a kernel that sees the rows and heads from `rows` and `heads` on of
    the ones this layout's kernel sees (a shard, a group of heads)."""
    row, head = self.offsets()
    return dataclasses.replace(self, row_offset=row + rows, head_offset=head + heads)

  def index(self, batch: int, length: int) -> jax.Array:
    """The default positions `[batch, length]` int32: each token's original index."""
    index_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return balance.load_balance(index_BT, self.shards) if self.shards > 1 else index_BT

  def positions(self, batch: int, q_len: int,
                kv_len: int) -> tuple[jax.Array | np.ndarray, jax.Array | np.ndarray]:
    """Positions of queries `[B, T]` and keys `[B, S]`, defaults filled in (e.g. for RoPE)."""
    full = self.materialize(batch, q_len, kv_len)
    assert full.q_positions is not None and full.kv_positions is not None  # filled in
    return full.q_positions, full.kv_positions

  def materialize(self, batch: int, q_len: int, kv_len: int) -> Layout:
    """Returns a Layout with every field an int32 array (defaults filled in)."""
    def ones(length):
      return jnp.ones((batch, length), jnp.int32)

    def pick(x, default):
      return default if x is None else x

    q_index = kv_index = None  # computed only where a field takes its default
    if self.q_positions is None or (self.kv_positions is None and kv_len == q_len):
      q_index = self.index(batch, q_len)
    if self.kv_positions is None:
      kv_index = q_index if kv_len == q_len else self.index(batch, kv_len)
    return dataclasses.replace(
        self, q_segment_ids=pick(self.q_segment_ids, ones(q_len)),
        kv_segment_ids=pick(self.kv_segment_ids, ones(kv_len)),
        q_positions=pick(self.q_positions, q_index), kv_positions=pick(self.kv_positions, kv_index))


TOKEN_FIELDS = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions", "q_index",
                "kv_index")

jax.tree_util.register_dataclass(
    Layout,
    data_fields=["q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions", "q_index",
                 "kv_index", "row_offset", "head_offset"],
    meta_fields=["shards"],
)


def shape_error(arg: str, value, expected: str) -> ValueError:
  shape = getattr(value, "shape", None)
  dtype = getattr(value, "dtype", None)
  return ValueError(f"{arg} expects {expected}, got shape {shape} dtype {dtype}.")


def check_ids(arg: str, x, batch: int, length: int, ref: str):
  """`x` `[batch, length]` as int32, or None. Integers wider than int32 are checked to fit
  (on the host, or at run time when traced): narrowing them would merge documents.

  Raises:
    ValueError: not an integer array of that shape, or values outside int32.
  """
  if x is None:
    return None
  if getattr(x, "shape", None) != (batch, length) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise shape_error(arg, x,
                      f"an integer array of shape {(batch, length)} ([batch, seq] of {ref})")
  if x.dtype == jnp.int32:
    return x
  info = jnp.iinfo(x.dtype)
  if info.min < _INT32.min or info.max > _INT32.max:
    xp = np if isinstance(x, np.ndarray) else jnp  # jnp would narrow numpy int64 first
    lo, hi = xp.min(x), xp.max(x)
    checks.raise_if(
        (lo < _INT32.min) | (hi > _INT32.max),
        lambda lo, hi: ValueError(
            f"{arg} expects values that fit in int32 [{_INT32.min}, {_INT32.max}], got {x.dtype}"
            f" values in [{lo}, {hi}]; renumber them (segment ids only need to differ between"
            " documents of a row, positions to count within one)."),
        lo, hi)
  return x.astype(jnp.int32)


def resolve(q_shape, kv_shape, segment_ids=None, positions=None, kv_segment_ids=None,
            kv_positions=None, context_parallel=None) -> Layout:
  """The layout of a call on q `[B, T, ...]` and k `[B, S, ...]`: ids checked and made int32;
  keys take the queries' segment ids (and positions, when S == T) unless given; default
  positions follow `context_parallel`'s load balancing. `flaxattn.attention` and the layer
  both resolve here, so RoPE sees exactly the positions the kernel masks with.

  Raises:
    ValueError: an argument of the wrong shape or dtype (naming it), kv_segment_ids without
      segment_ids, or segment_ids without kv_segment_ids when S != T.
  """
  b, t, s = q_shape[0], q_shape[1], kv_shape[1]
  segment_ids = check_ids("segment_ids", segment_ids, b, t, "q")
  positions = check_ids("positions", positions, b, t, "q")
  kv_segment_ids = check_ids("kv_segment_ids", kv_segment_ids, b, s, "k/v")
  kv_positions = check_ids("kv_positions", kv_positions, b, s, "k/v")
  if kv_segment_ids is None and segment_ids is not None:
    if s != t:
      raise ValueError(f"kv_segment_ids is required when keys ({s}) and queries ({t}) differ in"
                       " length and segment_ids is given.")
    kv_segment_ids = segment_ids
  if kv_positions is None and positions is not None and s == t:
    kv_positions = positions
  if segment_ids is None and kv_segment_ids is not None:
    raise ValueError("segment_ids is required when kv_segment_ids is given (got only"
                     " kv_segment_ids).")
  shards = 1 if context_parallel is None else context_parallel.balanced_shards()
  return Layout(segment_ids, kv_segment_ids, positions, kv_positions, shards)


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
  assert layout.q_positions is not None and layout.kv_positions is not None  # materialized
  same_kv = (layout.kv_segment_ids is layout.q_segment_ids
             and layout.kv_positions is layout.q_positions)
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


def needs_index_check(mask: Mask, has_positions: bool) -> bool:
  """Whether a kernel masking on token index depends on the data for exactness: explicit
  positions and a mask that reads them (`Full` does not; default positions are the index)."""
  return has_positions and band(mask) != Band()


def index_check(mask: Mask, layout: Layout, q_index, kv_index):
  """None when masking on token index is exact for any data of `layout`, else the scalar
  bool array `follows_index` (original token indices `q_index` `[B, T]`, `kv_index`
  `[B, S]` fill positions that were not given)."""
  if not needs_index_check(mask, layout.q_positions is not None or layout.kv_positions is not None):
    return None
  b, t = q_index.shape
  q_seg = jnp.ones((b, t), jnp.int32) if layout.q_segment_ids is None else layout.q_segment_ids
  kv_seg = q_seg if layout.kv_segment_ids is None else layout.kv_segment_ids
  q_pos = q_index if layout.q_positions is None else layout.q_positions
  kv_pos = kv_index if layout.kv_positions is None else layout.kv_positions
  return follows_index(Layout(q_seg, kv_seg, q_pos, kv_pos), q_index, kv_index, band(mask).chunk)
