"""The layer's KV cache under context parallelism: slots sharded over the sequence axes,
a prefill that writes each device's own tokens, decode steps merged exactly by lse.

Placement (docs/design.md, "Decoding under context parallelism"): device d of the n
sequence shards holds slots `[d S/n, (d+1) S/n)` of the global cache `[B, S, ...]` and fills
its own slots in order. After `i` tokens, device d has written `i // n + (d < i % n)`:
  - a prefill (T new tokens, T a multiple of what the strategy splits the sequence into)
    leaves each device's T / n tokens, in the strategy's order (load-balanced or not), in
    its next T / n slots;
  - other calls (a decode step) place new token i + j round-robin: on device (i + j) % n,
    local slot (i + j) // n.
Both keep the counts within one of each other. Masks read the slots' segment ids and
positions, so the order of tokens in the cache never matters.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from flaxattn import balance, sharding
from flaxattn.context_parallel import ContextParallel, axis_size
from flaxattn.ring import merge_weights

_F32 = 4  # bytes of the float32 statistics and partial outputs


def shards(cp: ContextParallel) -> int:
  """How many devices the sequence (and the cache) is split over: the product of the sizes
  of `cp.seq_axes` in the current mesh."""
  return math.prod(axis_size(cp, axis) for axis in cp.seq_axes)


def check_length(cp: ContextParallel, max_length: int) -> None:
  """Raises ValueError unless `max_length` divides over the sequence shards."""
  n = shards(cp)
  if max_length % n:
    raise ValueError(
        f"init_cache(input_shape=...) expects max_length divisible by the {n} sequence shards of"
        f" context_parallel over {cp.seq_axes} (each device holds max_length / {n} slots), got"
        f" max_length {max_length}; round it up to {-(-max_length // n) * n}.")


def prefill_multiple(cp: ContextParallel) -> int:
  """What a prefill's length must be a multiple of: the sequence shards (and, load
  balanced, 2 chunks per balanced shard)."""
  return math.lcm(shards(cp), 2 * cp.balanced_shards() if cp.load_balance else 1)


def is_prefill(cp: ContextParallel, t: int) -> bool:
  """Whether T new tokens run the context-parallel strategy (a prefill) rather than a
  decode step: T is a multiple of `prefill_multiple`."""
  return t % prefill_multiple(cp) == 0


def last_token(cp: ContextParallel | None, t: int, prefill: bool) -> int:
  """The array index of the last of T new tokens in their original order (a load-balanced
  prefill holds it inside the arrays, not at the end)."""
  n = cp.balanced_shards() if prefill and cp is not None else 1
  if n == 1:
    return t - 1
  return int(np.argmax(balance.load_balance(np.arange(t)[None], n)[0]))


@dataclasses.dataclass(frozen=True)
class Specs:
  """Partition specs of the sharded cache and of the call's arrays for the `shard_map`s."""

  axes: tuple[str, ...]  # the sequence axes, outer first
  kv: P  # cached keys/values [B, S, K, D]
  ids: P  # cached segment ids / positions [B, S]
  q: P  # new tokens [B, T, H, D], sequence not sharded (a decode step)
  q_ids: P  # their ids [B, T]

  def sequence_sharded(self) -> Specs:
    """The specs of a prefill, whose new tokens are sharded over the sequence axes too."""
    return dataclasses.replace(self, q=self.kv, q_ids=self.ids)


def specs(cp: ContextParallel, batch: int, heads: int, kv_heads: int) -> Specs:
  """The cache's sharding: sequence over `cp.seq_axes`; batch and heads over the axes of
  `cp.batch_axes` / `cp.head_axes` that divide them, as inside `context_parallel_attention`."""
  mesh = jax.sharding.get_abstract_mesh()
  b = sharding.dividing_axes(mesh, [a for a in cp.batch_axes if a not in cp.seq_axes], batch)
  h = sharding.dividing_axes(mesh, [a for a in cp.head_axes if a not in cp.seq_axes], heads,
                             kv_heads)
  b, h = b or None, h or None
  seq = cp.seq_axes[0] if len(cp.seq_axes) == 1 else cp.seq_axes
  return Specs(cp.seq_axes, kv=P(b, seq, h), ids=P(b, seq), q=P(b, None, h), q_ids=P(b, None))


def zeros(shape, dtype, spec: P) -> jax.Array:
  """A zero array sharded by `spec` over the current mesh."""
  return lax.with_sharding_constraint(jnp.zeros(shape, dtype), spec)


def _shard_map(body, in_specs, out_specs):
  mesh = jax.sharding.get_abstract_mesh()
  manual = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
  return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names=manual,
                       check_vma=False)


def _filled(axes, index):
  """(this device's shard, n, slots it has filled) after `index` tokens."""
  d = lax.axis_index(axes)
  n = lax.psum(1, axes)
  return d, n, index // n + (d < index % n).astype(index.dtype)


def update_slice(cache, new, start, refused):
  """`lax.dynamic_update_slice(cache, new, start)`, or `cache` unchanged where the scalar
  bool `refused` holds (None: never), without a conditional: what is there is written back,
  read at the same start (which clamps the same way where the tokens overflow)."""
  if refused is not None:
    new = jnp.where(refused, lax.dynamic_slice(cache, start, new.shape), new)
  return lax.dynamic_update_slice(cache, new, start)


def write(cache, new, index, s: Specs, prefill: bool, refused=None):
  """The cache after writing the new tokens at cache index `index` (see the module doc).

  Args:
    cache: (keys `[B, S, K, D]`, values `[B, S, K, Dv]`, segment ids `[B, S]`, positions
      `[B, S]`), sharded by `s`.
    new: the same four for the T new tokens (`[B, T, ...]`), in the cache's dtypes.
    index: int32 scalar, tokens written before; the caller refuses calls where T more do
      not fit.
    prefill: the new tokens are sharded over the sequence axes (`is_prefill`); else
      replicated over them and placed round-robin.
    refused: None, or a scalar bool (the same on every device): where it holds, the cache
      is returned as it was.
  """
  def body(index, refused, cache, new):
    d, n, filled = _filled(s.axes, index)
    if prefill:  # this device's shard, next in its slots
      def at(x):
        return (0, filled) + (0,) * (x.ndim - 2)
      return tuple(update_slice(c, x, at(x), refused) for c, x in zip(cache, new, strict=True))
    t, local = new[0].shape[1], cache[0].shape[1]
    logical_T = index + jnp.arange(t, dtype=index.dtype)
    mine_T = logical_T % n == d
    if refused is not None:
      mine_T = mine_T & ~refused
    slots_T = jnp.where(mine_T, logical_T // n, local)  # others' (and refused): out of range
    return tuple(c.at[:, slots_T].set(x, mode="drop") for c, x in zip(cache, new, strict=True))

  cache_specs = (s.kv, s.kv, s.ids, s.ids)
  new_specs = (s.kv, s.kv, s.ids, s.ids) if prefill else (s.q, s.q, s.q_ids, s.q_ids)
  return _shard_map(body, (P(), P(), cache_specs, new_specs), cache_specs)(index, refused,
                                                                          cache, new)


def merge(out, lse, axes):
  """The exact softmax result over the keys of every shard of `axes` (inside a shard_map).

  Each device holds (out `[B, T, H, Dv]`, lse `[B, T, H]`) of the same queries against its
  own keys. One all-gather of the lse (n x `[B, T, H]` float32) gives every device the
  weights exp(lse_d - lse); one all-reduce sums the weighted partial outputs. A row with no
  key on any device gives zeros and lse -inf.
  """
  w_NBTH, lse_BTH = merge_weights(lax.all_gather(lse, axes))
  w_BTH = jnp.take(w_NBTH, lax.axis_index(axes), axis=0)  # this device's (gathered in order)
  return lax.psum(out.astype(jnp.float32) * w_BTH[..., None], axes), lse_BTH


def attend(local, q, cache, q_ids, q_pos, s: Specs, sequence_sharded: bool = False, when=None):
  """(out `[B, T, H, Dv]` float32, lse `[B, T, H]`) of queries against the whole sharded
  cache: each device runs `local(q, k, v, q_ids, q_pos, kv_ids, kv_pos) -> (out, lse)` on its
  own slots and `merge` combines the shards. No keys or values move.

  `sequence_sharded`: q and its ids arrive sharded over the sequence axes (a prefill); they
  are gathered (queries, not keys) and each device keeps its own rows of the result.
  `when`: None, or a scalar bool; where false the result is zeros / -inf without any work.
  """
  def body(when, q, cache, q_ids, q_pos):
    rows = q.shape[1]

    def run():
      q_all, ids_all, pos_all = q, q_ids, q_pos
      if sequence_sharded:
        def gather(x):
          return lax.all_gather(x, s.axes, axis=1, tiled=True)
        q_all, ids_all, pos_all = gather(q), gather(q_ids), gather(q_pos)
      out, lse = local(q_all, cache[0], cache[1], ids_all, pos_all, cache[2], cache[3])
      out, lse = merge(out, lse, s.axes)
      if sequence_sharded:
        start = lax.axis_index(s.axes) * rows
        out, lse = (lax.dynamic_slice_in_dim(x, start, rows, axis=1) for x in (out, lse))
      return out, lse

    def nothing():
      shape = q.shape[:3]
      return (jnp.zeros(shape + cache[1].shape[3:], jnp.float32),
              jnp.full(shape, -jnp.inf, jnp.float32))

    return run() if when is None else lax.cond(when, run, nothing)

  q_spec, ids_spec = (s.kv, s.ids) if sequence_sharded else (s.q, s.q_ids)
  cache_specs = (s.kv, s.kv, s.ids, s.ids)
  return _shard_map(body, (P(), q_spec, cache_specs, ids_spec, ids_spec),
                    (q_spec, q_spec))(when, q, cache, q_ids, q_pos)


def communication(cp: ContextParallel, q_shape, v_head_dim: int, max_length: int) -> str:
  """What one decode call of q `[B, T, H, D]` moves between the sequence shards, for
  `explain`: the lse all-gather and the partial-output all-reduce, independent of the
  cache length (K/V stay where they were written)."""
  n = shards(cp)
  b, t, h = q_shape[:3]
  stats, partial = n * b * t * h * _F32, b * t * h * v_head_dim * _F32
  return (f"decode over {cp.seq_axes} ({n} shards): each device attends to its {max_length // n}"
          f" of {max_length} cache slots; per call it moves an all-gather of the lse"
          f" ({n} x [B, T, H] = [{b}, {t}, {h}] float32, {stats} bytes) and an all-reduce of the"
          f" partial output ([B, T, H, Dv] = [{b}, {t}, {h}, {v_head_dim}] float32,"
          f" {partial} bytes): {(stats + partial) // max(t, 1)} bytes per new token, whatever"
          " the cache length; no keys or values move. A prefill (T a multiple of the"
          f" strategy's split) runs {cp.strategy!r} over the new tokens and writes each"
          " device's own keys in place.")
