"""`KVCache`: the decode state of one attention layer, as one object.

It holds the keys and values of every token written so far, each slot's segment id and
position (masks read them, so the order of the slots never matters), the segment id and
position of the last token written (what default ids in decode continue), the number of
tokens written, the refusal it has recorded, the context parallelism it was allocated for
(its sharding) and the token order a prefill arrives in under it:
  - "none": the original order (one device, or no load balancing);
  - "row": `flaxattn.load_balance` row order, whose last token is known from the shape;
  - "document": per-document order, which only the data pipeline knows: decode calls must
    pass explicit segment ids and positions.

A call that cannot be served (new tokens that do not fit, default segment ids after a cache
that ends in padding) is refused and writes nothing. Where the cache is concrete (an eager
call) it raises a ValueError at once. Inside a compiled program the refusal is recorded on
the device instead, with no conditional and no host callback in the program (raising there
would fail every array the program returns, and a check on the host would cost a round trip
per layer and step): the call writes nothing, keeps the index, returns NaN and sets the
cache's sticky `error` (the reason, the cache index and the number of new tokens). Every
later call is refused the same way, so the cache stays as it was before the first refused
call, until the host reads the error: `KVCache.check()`, the layer's next eager decode call
and `train.sample.generate`'s return raise it with the message the eager call would have
raised, and clear it.

The cache after a call is computed as values (`append`, `attend_sharded` return an `Update`)
and written by `commit` once the layer has its output, so a call that raises on the host for
any other reason (a kernel that declines it, an `attention_fn` that raises) leaves the cache
as it was.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from flaxattn import balance, checks
from flaxattn import decode as cp_decode
from flaxattn.context_parallel import ContextParallel
from flaxattn.ring import merge_partials

ORDERS = ("none", "row", "document")
# A cache's variables after a call, computed before any is written: keys, values, segment
# ids, positions, last, index, error (`KVCache.commit` writes them).
Update = tuple
# Why a call was refused, the first entry of `KVCache.error` (0: nothing refused).
FULL, AFTER_PADDING = 1, 2


def refusal(code: int, index: int, tokens: int, max_length: int) -> ValueError:
  """The error of a decode call of `tokens` new tokens at cache index `index` (tokens written
  before it) refused for `code` (`FULL` or `AFTER_PADDING`), in a cache of `max_length`."""
  if code == FULL:
    return ValueError(
        f"decode expects the new tokens to fit the KV cache: writing {tokens} token(s) at cache"
        f" index {index} needs {index + tokens} slots, the cache has max_length {max_length}."
        " Nothing was written; call init_cache with a larger max_length.")
  return ValueError(
      f"segment_ids expects the new tokens' segment ids in decode when the cache ends in"
      f" padding (segment id 0 at cache index {index - 1}): there is no document to"
      " continue. Pass segment_ids (and positions).")


def is_refused(error):
  """Whether a call is refused, from the cache's error record after it (`KVCache.new_tokens`):
  None where the record is None (an eager call, refused by raising), else a traced bool."""
  return None if error is None else error[0] != 0


def token_order(cp: ContextParallel | None) -> str:
  """The order a prefill's tokens arrive in under `cp` (one of `ORDERS`); needs the mesh
  when `cp` balances rows."""
  if cp is None or cp.load_balance is False:
    return "none"
  if cp.load_balance == "document":
    return "document"
  return "row" if cp.balanced_shards() > 1 else "none"


# What a cache may hold: the floating dtypes the kernels compute in. Keys and values are cast
# to the cache's dtype on write, so an integer, bool, complex or 8-bit float cache would cut
# them and decode would be wrong without an error.
DTYPES = ("float32", "bfloat16", "float16", "float64")
_MAX_LENGTH = 2**31 - 1  # the index and positions are int32


def check_dtype(dtype):
  """`dtype` as a numpy dtype, one of `DTYPES`.

  Raises:
    ValueError: anything else (an integer, bool, complex or float8 dtype, or not a dtype).
  """
  try:
    found = jnp.dtype(dtype)
  except TypeError:
    found = None
  if found is None or found.name not in DTYPES:
    got = repr(dtype) if found is None else found.name
    raise ValueError(f"dtype expects a floating dtype the kernels compute in, one of {DTYPES}"
                     f" (float64 under jax.enable_x64), got {got}: the cache casts keys and"
                     " values to it on write, which would cut them. Pass the dtype of the"
                     " layer's computation, e.g. jnp.bfloat16 or the default jnp.float32.")
  return found


def _check_config(batch, max_length, kv_heads, head_dim, v_head_dim, heads,
                  context_parallel) -> tuple[int, ...]:
  """`batch` as a tuple of axes, everything checked (see `KVCache`)."""
  if isinstance(batch, (tuple, list)):
    for i, n in enumerate(batch):
      checks.positive_int(f"KVCache(batch={tuple(batch)!r}) axis {i}", n)
    batch_axes = tuple(int(n) for n in batch)
  else:
    checks.positive_int("KVCache(batch=...)", batch)
    batch_axes = (int(batch),)
  for arg, value in (("max_length", max_length), ("kv_heads", kv_heads),
                     ("head_dim", head_dim), ("v_head_dim", v_head_dim), ("heads", heads)):
    checks.positive_int(f"KVCache({arg}=...)", value)
  if max_length > _MAX_LENGTH:
    raise ValueError(f"KVCache(max_length=...) expects at most {_MAX_LENGTH} slots (the cache"
                     f" index is int32), got {max_length}.")
  if heads % kv_heads:
    raise ValueError(f"KVCache(heads=...) expects a multiple of kv_heads ({kv_heads}), got"
                     f" {heads}: each KV head serves heads // kv_heads query heads.")
  if context_parallel is not None and not isinstance(context_parallel, ContextParallel):
    raise TypeError(f"KVCache(context_parallel=...) expects a flaxattn.ContextParallel or None,"
                    f" got {context_parallel!r} ({checks.type_name(context_parallel)}).")
  return batch_axes


class KVCache(nnx.Module):
  """The KV cache of one `flaxattn.MultiHeadAttention` layer (`init_cache`).

  Variables (`nnx.Cache`): `keys` `[B, S, Hkv, D]`, `values` `[B, S, Hkv, Dv]`,
  `segment_ids` and `positions` `[B, S]` int32 (segment id 0: an empty slot, never
  attended), `last` `[B, 2]` int32 (segment id and position of the last token written in
  the original order), `index` int32 scalar (tokens written), `error` `[3]` int32 (the
  reason, cache index and new tokens of the first call refused inside a compiled program
  since the host last read it, `refusal`'s arguments; zeros: none). Static: `context_parallel`
  (None: one device), `order` (see the module doc), `heads` (query heads, for the sharding
  of the heads).

  With `context_parallel` the slots are sharded over its sequence axes (`max_length / n`
  per device) and tokens are placed as `flaxattn.decode` says; create it under the mesh.

  Args:
    batch: rows B, an int, or the leading (batch) axes of the layer's inputs, a tuple of
      ints (none, one or several, as nnx), folded into one: B is their product. They are
      kept as `batch_axes`, the leading axes of the layer's `cached_key` and `cached_value`.
    max_length: slots per row, at most 2**31 - 1 (the index is int32).
    kv_heads, head_dim, v_head_dim: Hkv, D, Dv.
    dtype: of the cached keys and values: float32, bfloat16 or float16 (float64 under
      `jax.enable_x64`); new keys and values are cast to it on write.
    heads: query heads H, a multiple of `kv_heads`.
    context_parallel: a `flaxattn.ContextParallel`, or None for one device.

  Raises:
    ValueError: a size that is not a positive int (`batch`'s axes, `max_length`,
      `kv_heads`, `head_dim`, `v_head_dim`, `heads`), `heads` not a multiple of `kv_heads`,
      a `dtype` that is not one of the floating dtypes above, and with `context_parallel`,
      no mesh or `max_length` not divisible by the sequence shards.
    TypeError: `context_parallel` not a `flaxattn.ContextParallel` or None.
  """

  def __init__(self, batch: int | tuple[int, ...], max_length: int, kv_heads: int,
               head_dim: int, v_head_dim: int, dtype, *, heads: int,
               context_parallel: ContextParallel | None = None):
    batch_axes = _check_config(batch, max_length, kv_heads, head_dim, v_head_dim, heads,
                               context_parallel)
    dtype = check_dtype(dtype)
    self.batch_axes = batch_axes
    self.context_parallel = context_parallel
    self.order = token_order(context_parallel)
    self.heads = heads
    batch = math.prod(batch_axes)
    shape = (batch, max_length, kv_heads)

    def zeros(shape, dtype, spec):
      return jnp.zeros(shape, dtype)

    kv_spec = ids_spec = None
    if context_parallel is not None:
      cp_decode.check_length(context_parallel, max_length)
      specs = cp_decode.specs(context_parallel, batch, heads, kv_heads)
      zeros, kv_spec, ids_spec = cp_decode.zeros, specs.kv, specs.ids
    self.keys = nnx.Cache(zeros(shape + (head_dim,), dtype, kv_spec))
    self.values = nnx.Cache(zeros(shape + (v_head_dim,), dtype, kv_spec))
    self.segment_ids = nnx.Cache(zeros((batch, max_length), jnp.int32, ids_spec))
    self.positions = nnx.Cache(zeros((batch, max_length), jnp.int32, ids_spec))
    self.last = nnx.Cache(jnp.zeros((batch, 2), jnp.int32))
    self.index = nnx.Cache(jnp.array(0, dtype=jnp.int32))
    self.error = nnx.Cache(jnp.zeros((3,), jnp.int32))

  @property
  def max_length(self) -> int:
    return self.keys.shape[1]

  def check(self) -> None:
    """Raises the refusal recorded on the device by a call inside a compiled program, if any,
    and clears it (see the module doc). It reads the device, so call it where the host
    reads results anyway; the layer calls it at each eager decode call.

    Raises:
      ValueError: a call was refused, with the message an eager call would have raised
        (naming the cache index the call was made at); the cache holds what it held before
        that call. Also when called inside a compiled program, where nothing can be read.
    """
    error = self.error[...]
    if checks.traced(error):
      raise ValueError("KVCache.check() expects a cache on the host, got one traced inside a"
                       " compiled program, which cannot read the device; call it after the"
                       " program returns.")
    # Replicated wherever it lives: any one device's copy is the whole record.
    code, index, tokens = (int(x) for x in np.asarray(error.addressable_data(0)))
    if code:
      self.error[...] = jnp.zeros_like(error)
      raise refusal(code, index, tokens, self.max_length)

  def check_keys(self, k, context_parallel) -> None:
    """Raises ValueError unless new keys `k` `[B, T, Hkv, D]` fit this cache's shape and the
    layer decodes with the context parallelism the cache was allocated for."""
    b, max_length, hkv, d = self.keys.shape
    if k.shape[0] != b:
      raise ValueError(f"decode expects the batch the KV cache was made for, {b} row(s) (leading"
                       f" axes {self.batch_axes}), got new keys of shape {k.shape}, {k.shape[0]}"
                       " row(s); call init_cache with the leading axes of the decode calls.")
    if k.shape[2:] != (hkv, d):
      raise ValueError(f"decode expects keys [B, T, {hkv}, {d}] (the KV heads and head_dim the"
                       f" cache was made for), got {k.shape}; call init_cache on this layer.")
    if k.shape[1] > max_length:
      raise ValueError(f"decode expects at most max_length = {max_length} new tokens (the"
                       f" cache's slots), got {k.shape[1]}; call init_cache with a max_length"
                       f" of at least {k.shape[1]} plus the tokens cached before them.")
    if context_parallel != self.context_parallel:
      raise ValueError(f"decode expects the context_parallel the KV cache was allocated with,"
                       f" {self.context_parallel!r}, got {context_parallel!r}: the cache's"
                       " slots are laid out for it. Call init_cache again after changing"
                       " context_parallel.")

  def is_prefill(self, t: int) -> bool:
    """Whether T new tokens are a prefill run with the context-parallel strategy (T a
    multiple of its split), arriving in `order`, rather than a decode step in the original
    order. Always False on one device."""
    cp = self.context_parallel
    return cp is not None and cp_decode.is_prefill(cp, t)

  def new_tokens(self, t: int, segment_ids, positions, prefill: bool):
    """(segment ids, positions `[B, T]` of T new tokens with defaults filled in (see
    `MultiHeadAttention.__call__`), the cache's error record after the call): checked
    before anything is written. The record is None where the cache is concrete (an eager
    call, which raises instead); else a traced `[3]` int32 (`KVCache.error`), non-zero
    where the call is refused (`is_refused`): the cache holds a refusal already, the tokens
    do not fit, or default segment ids follow padding.

    Raises:
      ValueError: a default in document order; ids or positions not `[B, T]`; and, when
        the cache is concrete, a refusal recorded before (`check`), tokens that do not fit
        or default segment ids after a cache that ends in padding.
    """
    if self.order == "document" and (segment_ids is None or positions is None):
      raise ValueError(
          f"segment_ids and positions expect the new tokens' values in decode under"
          f" ContextParallel(load_balance='document'), got segment_ids"
          f" {'None' if segment_ids is None else 'given'} and positions"
          f" {'None' if positions is None else 'given'}: in document order only the data"
          " pipeline knows where each token came from, so the cache can neither number a"
          " prefill's tokens nor tell which of them came last. Pass both (each new token's"
          " document and its position in it).")
    if prefill and self.order == "row":  # defaults follow the original order
      n = self.context_parallel.balanced_shards()  # pyright: ignore[reportOptionalMemberAccess]

      def unload(x):
        return None if x is None else balance.unload_balance(x, n)

      ids_BT, pos_BT, after_padding = self._defaults(t, unload(segment_ids), unload(positions))
      ids_BT, pos_BT = (jnp.asarray(balance.load_balance(x, n)) for x in (ids_BT, pos_BT))
    else:
      ids_BT, pos_BT, after_padding = self._defaults(t, segment_ids, positions)
    full = self._full(t, ids_BT, pos_BT)
    return ids_BT, pos_BT, self._record(t, {AFTER_PADDING: after_padding, FULL: full})

  def _record(self, t: int, reasons: dict):
    """The error record after a call of T tokens (see `new_tokens`), from `reasons`, the
    scalar bools (or None) of each refusal code, in the order they are reported."""
    i = self.index[...]
    if not checks.traced(i, *reasons.values()):
      self.check()
      for code, failed in reasons.items():
        if failed is not None and bool(failed):
          raise refusal(code, int(i), t, self.max_length)
      return None
    record = jnp.zeros((3,), jnp.int32)
    for code, failed in reversed(reasons.items()):  # the first that holds is recorded
      if failed is not None:
        record = jnp.where(failed, jnp.stack([jnp.int32(code), i, jnp.int32(t)]), record)
    before = self.error[...]
    return jnp.where(before[0] != 0, before, record)  # sticky: the first refusal stays

  def _defaults(self, t: int, segment_ids, positions):
    b = self.keys.shape[0]
    i = self.index[...]
    empty = i == 0
    last_B2 = self.last[...]
    last_seg_B1, last_pos_B1 = last_B2[:, :1], last_B2[:, 1:]
    after_padding = None
    if segment_ids is None:
      after_padding = ~empty & jnp.any(last_seg_B1 == 0)
      segment_ids = jnp.broadcast_to(jnp.where(empty, 1, last_seg_B1), (b, t))
    if positions is None:
      iota_T = jnp.arange(t, dtype=jnp.int32)
      prev_BT = jnp.concatenate([last_seg_B1, segment_ids[:, :-1]], axis=1)
      starts_BT = (segment_ids != prev_BT) | (empty & (iota_T == 0))
      run_start_BT = lax.cummax(jnp.where(starts_BT, iota_T, 0), axis=1)
      continued_BT = (run_start_BT == 0) & ~starts_BT[:, :1]
      positions = iota_T - run_start_BT + jnp.where(continued_BT, last_pos_B1 + 1, 0)
    return segment_ids, positions, after_padding

  def _full(self, t: int, segment_ids, positions):
    """Whether T new tokens overflow the cache (a scalar bool), their ids checked."""
    for arg, ids in (("segment_ids", segment_ids), ("positions", positions)):
      if ids.shape != (self.keys.shape[0], t):
        raise ValueError(f"{arg} expects shape {(self.keys.shape[0], t)} [batch, new tokens] in"
                         f" decode, got {ids.shape}.")
    return self.index[...] + t > self.max_length

  def _advance(self, t: int, segment_ids, positions, error, prefill: bool):
    """(last `[B, 2]`, index, error) after T new tokens: the last of them in the original
    order, the new count and the call's error record, or what they were where the call
    was refused."""
    i, last_B2, refused = self.index[...], self.last[...], is_refused(error)
    if self.order != "document":  # document order never reads `last` (`new_tokens`)
      j = cp_decode.last_token(self.context_parallel if self.order == "row" else None, t,
                               prefill)
      new_B2 = jnp.stack([segment_ids[:, j], positions[:, j]], axis=1)
      last_B2 = new_B2 if refused is None else jnp.where(refused, last_B2, new_B2)
    index = i + (t if refused is None else jnp.where(refused, 0, t))
    return last_B2, index, self.error[...] if error is None else error

  def _variables(self) -> tuple[nnx.Cache, ...]:
    """The variables of an `Update`, in its order."""
    return (self.keys, self.values, self.segment_ids, self.positions, self.last, self.index,
            self.error)

  def commit(self, update: Update) -> None:
    """Writes an `Update`: what `append` or `attend_sharded` computed the cache to be after
    the call. The layer calls it last, so nothing is written by a call that raises."""
    for variable, value in zip(self._variables(), update, strict=True):
      variable[...] = value

  def append(self, k, v, segment_ids, positions, error):
    """One device: the whole cache with the T new tokens at `index` (keys and values in k's
    and v's dtypes, segment ids, positions), and the `Update` that writes them (the cache as
    it was where the error record `error` refuses the call) for `commit`. Nothing is
    written here."""
    i = self.index[...]
    t = k.shape[1]
    zero = jnp.zeros((), jnp.int32)
    written = []
    for cache, new in ((self.keys, k), (self.values, v), (self.segment_ids, segment_ids),
                       (self.positions, positions)):
      start = (zero, i) + (zero,) * (new.ndim - 2)
      written.append(cp_decode.update_slice(cache[...], new.astype(cache.dtype), start,
                                            is_refused(error)))
    update = (*written, *self._advance(t, segment_ids, positions, error, prefill=False))
    keys, values, ids, pos = written
    return keys.astype(k.dtype), values.astype(v.dtype), ids, pos, update

  def indices(self, t: int) -> dict:
    """The token indices a programmable mask or score reads in a call of T new tokens on
    one device (`flaxattn.masks.Coords`): the slots they are written to (the cache fills
    its slots in order, so a slot is the token's index in the sequence) and every slot."""
    b = self.keys.shape[0]
    slots = jnp.arange(self.max_length, dtype=jnp.int32)
    new = self.index[...] + jnp.arange(t, dtype=jnp.int32)
    return dict(q_index=jnp.broadcast_to(new, (b, t)),
                kv_index=jnp.broadcast_to(slots, (b, self.max_length)))

  def attend_sharded(self, q, k, v, segment_ids, positions, error, attention_fn, options,
                     prefill: bool):
    """Context parallelism: (out `[B, T, H, Dv]` float32, lse `[B, T, H]`) of the new tokens
    against the sharded cache with them, and the `Update` that writes them (the cache as it
    was where the error record `error` refuses the call) for `commit`. Nothing is written
    here; a refused call still attends (every device alike, so the collectives match).

    A prefill runs the strategy over the new tokens (`attention_fn` with
    `context_parallel`), merged by lse with what the cache held before; a decode step
    attends on every shard and merges. Each device writes its own slots.
    `attention_fn(q, k, v, segment_ids=, positions=, [kv_segment_ids=, kv_positions=,
    context_parallel=,] **options)` returns (out, lse).
    """
    cp = self.context_parallel
    assert cp is not None  # the caller decodes under context parallelism
    # The new tokens attend to their keys as the cache holds them (rounded to its dtype), as
    # on one device, where they are read back from the cache.
    k, v = (x.astype(c.dtype).astype(x.dtype) for x, c in ((k, self.keys), (v, self.values)))
    i = self.index[...]
    t = k.shape[1]
    specs = cp_decode.specs(cp, q.shape[0], self.heads, self.keys.shape[2])

    def local(q, k, v, q_ids, q_pos, kv_ids, kv_pos):  # one device's slots
      return attention_fn(q, k.astype(q.dtype), v.astype(q.dtype), segment_ids=q_ids,
                          positions=q_pos, kv_segment_ids=kv_ids, kv_positions=kv_pos,
                          **options)

    cache = tuple(c[...] for c in (self.keys, self.values, self.segment_ids, self.positions))
    new = (k.astype(cache[0].dtype), v.astype(cache[1].dtype), segment_ids, positions)

    refused = is_refused(error)
    if prefill:  # the new tokens among themselves, then against what was cached before
      out, lse = attention_fn(q, k, v, segment_ids=segment_ids, positions=positions,
                              context_parallel=cp, **options)
      before = cp_decode.attend(local, q, cache, segment_ids, positions,
                                specs.sequence_sharded(), sequence_sharded=True, when=i > 0)
      out, lse = merge_partials(out.astype(jnp.float32), lse, *before)
      cache = cp_decode.write(cache, new, i, specs.sequence_sharded(), prefill=True,
                              refused=refused)
    else:
      cache = cp_decode.write(cache, new, i, specs, prefill=False, refused=refused)
      out, lse = cp_decode.attend(local, q, cache, segment_ids, positions, specs)
    return out, lse, (*cache, *self._advance(t, segment_ids, positions, error, prefill))
