"""Load balancing for context parallelism: the token order that gives every shard the same
attention work.

Row order (dual chunk): the sequence is cut into 2 * cp chunks; shard r holds chunks r and
2 * cp - 1 - r, so each shard gets one early and one late chunk and the causal work of one
document filling the row is even. Only reshapes, flips and concatenation: no gather.

Document order (`segment_ids=`): packed rows hold many documents, and a row's dual chunk
leaves the shard that holds the long documents' tails with most of the work. Each document
is cut into 2 * cp pieces instead (of whole kernel blocks), pieces i and 2cp-1-i to one
shard; what does not split evenly goes where the work is least; padding goes last on
every shard. Where a row's pieces are too coarse to beat the row order (few blocks a
shard), the row takes the row order instead. The order depends on the data, so it is
planned on the host (`balance_plan`, numpy, O(T) per row) and applied with a gather. Cost
model: docs/design.md, "Load balancing".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import overload

import jax
import jax.core  # jax.core.Tracer: jax imports the module but does not export the name
import jax.numpy as jnp
import numpy as np

from flaxattn.masks import Causal, Mask, NoBand, band, check_mask


def _namespace(x):
  # numpy stays numpy, so a host data pipeline permutes without a trip to the device.
  return np if isinstance(x, np.ndarray) else jnp


def _check_cp(cp) -> None:
  if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
    raise ValueError(f"cp expects a positive int (the context-parallel size), got {cp!r}.")


def _check(x, cp, axis: int) -> int:
  _check_cp(cp)
  axis = axis % x.ndim
  if x.shape[axis] % (2 * cp):
    raise ValueError(
        f"load balancing expects axis {axis} of x (length {x.shape[axis]}) divisible by 2 * cp ="
        f" {2 * cp}; pad the sequence to a multiple of {2 * cp}.")
  return axis


@overload
def load_balance(x: np.ndarray, cp: int, axis: int = 1, *, segment_ids=None,
                 masks: Sequence[Mask] | None = None) -> np.ndarray: ...
@overload
def load_balance(x: jax.Array, cp: int, axis: int = 1, *, segment_ids=None,
                 masks: Sequence[Mask] | None = None) -> jax.Array: ...
def load_balance(x, cp: int, axis: int = 1, *, segment_ids=None,
                 masks: Sequence[Mask] | None = None):
  """Reorders `x` along `axis` so that each of cp shards gets the same attention work.

  Without `segment_ids`: row order, shard r holds chunks r and 2cp-1-r of 2cp.
  With `segment_ids`: document order, `balance_plan(segment_ids, cp, masks).apply(x, axis)`
  (a row whose document pieces balance no better takes the row order).

  Args:
    x: any array (tokens `[B, T]`, segment ids, positions, activations `[B, T, H, D]`);
      numpy in, numpy out (on the host); jax arrays too.
    cp: the context-parallel size.
    segment_ids: `[B, T]` int (`x.shape[:axis + 1]`) in the original order, 0 = padding,
      or None for row order.
    masks: with `segment_ids`, the model's masks, one per layer (default `[Causal()]`).
  Raises:
    ValueError: cp not a positive int; the axis length not divisible by 2 * cp (row order)
      or cp (document order); `segment_ids` of another shape.
  """
  if segment_ids is not None:
    return balance_plan(segment_ids, cp, masks).apply(x, axis)
  _masks_unused(masks)
  axis = _check(x, cp, axis)
  xp = _namespace(x)
  shape = x.shape
  halves = x.reshape(shape[:axis] + (2, cp, shape[axis] // (2 * cp)) + shape[axis + 1:])
  first, second = halves[(slice(None),) * axis + (0,)], halves[(slice(None),) * axis + (1,)]
  pairs = xp.stack([first, xp.flip(second, axis=axis)], axis=axis + 1)
  return pairs.reshape(shape)


@overload
def unload_balance(x: np.ndarray, cp: int, axis: int = 1, *, segment_ids=None,
                   masks: Sequence[Mask] | None = None) -> np.ndarray: ...
@overload
def unload_balance(x: jax.Array, cp: int, axis: int = 1, *, segment_ids=None,
                   masks: Sequence[Mask] | None = None) -> jax.Array: ...
def unload_balance(x, cp: int, axis: int = 1, *, segment_ids=None,
                   masks: Sequence[Mask] | None = None):
  """Inverse of `load_balance` with the same arguments: back to the original token order.
  `segment_ids` are the original order's (the array given to `load_balance`)."""
  if segment_ids is not None:
    return balance_plan(segment_ids, cp, masks).undo(x, axis)
  _masks_unused(masks)
  axis = _check(x, cp, axis)
  xp = _namespace(x)
  shape = x.shape
  pairs = x.reshape(shape[:axis] + (cp, 2, shape[axis] // (2 * cp)) + shape[axis + 1:])
  def index(i):
    return pairs[(slice(None),) * (axis + 1) + (i,)]
  return xp.concatenate([index(0), xp.flip(index(1), axis=axis)], axis=axis).reshape(shape)


def _masks_unused(masks) -> None:
  if masks is not None:
    raise ValueError(f"masks={masks!r} weighs documents and expects segment_ids; without them"
                     " the row order is fixed. Pass segment_ids=, or leave masks out.")


def _runs(seg_T: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(start, length) of each document of one row: a run of one non-zero segment id."""
  t = seg_T.shape[0]
  change = np.ones(t, bool)
  change[1:] = seg_T[1:] != seg_T[:-1]
  starts = np.flatnonzero(change)
  lengths = np.diff(np.append(starts, t))
  real = seg_T[starts] != 0
  return starts[real], lengths[real]


def token_work(segment_ids, masks: Sequence[Mask] | None = None) -> np.ndarray:
  """The attention work of each query token: the keys it sees, summed over `masks` (one per
  layer; default `[Causal()]`), from each mask's normal form. A document is a run of one
  non-zero segment id whose positions count from 0.

  Per mask, a token at position p of a document of n tokens sees: Full n; Causal p + 1;
  Local(w) min(p + 1, w); Chunked(c) p mod c + 1 (with both, the smaller); a Window the
  positions of its span inside the document (`masks.Band.keys_seen`); padding none. Masks
  without a normal form count as causal.

  Args:
    segment_ids: `[..., T]` int, numpy or a concrete jax array.
  Returns:
    `[..., T]` int64 numpy.
  Raises:
    TypeError: a mask that is not a flaxattn mask, or traced segment ids.
  """
  seg = _host_ids(segment_ids)
  bands = [_band(m) for m in _masks(masks)]
  flat = seg.reshape(-1, seg.shape[-1])
  work = np.zeros(flat.shape, np.int64)
  for row, seg_T in zip(work, flat, strict=True):
    starts, lengths = _runs(seg_T)
    pos = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    tokens = np.repeat(starts, lengths) + pos  # the documents' tokens, in order
    doc_len = np.repeat(lengths, lengths)
    for b in bands:
      row[tokens] += b.keys_seen(pos, doc_len)
  return work.reshape(seg.shape)


def _band(mask):
  try:
    return band(check_mask(mask))
  except NoBand:
    return band(Causal())


def _masks(masks) -> tuple[Mask, ...]:
  if masks is None:
    return (Causal(),)
  if isinstance(masks, Mask) or not masks:
    raise TypeError(f"masks expects a non-empty list of flaxattn masks (one per layer), got"
                    f" {masks!r}; e.g. masks=[Local(4096), Causal()].")
  return tuple(check_mask(m) for m in masks)


def _host_ids(segment_ids) -> np.ndarray:
  if isinstance(segment_ids, jax.core.Tracer):
    raise TypeError("segment_ids expects concrete values (numpy, or a jax array outside jit),"
                    " got a traced array: the document order is planned on the host; plan it"
                    " in the data pipeline, before the step.")
  seg = np.asarray(segment_ids)
  if seg.ndim < 1 or not np.issubdtype(seg.dtype, np.integer):
    raise ValueError(f"segment_ids expects an integer array [..., T], got shape {seg.shape}"
                     f" dtype {seg.dtype}.")
  return seg


@dataclasses.dataclass(frozen=True, eq=False)
class BalancePlan:
  """A token order over `cp` shards, per row the document order or the row order, from
  `balance_plan`.

  order: `[..., T]` int numpy: token j of the balanced row is token `order[..., j]` of the
    original; shard s holds balanced tokens s T/cp .. (s + 1) T/cp - 1.
  row_order: `[...]` bool: the row took the row order (`load_balance(arange(T), cp)`), its
    document pieces being too coarse to give a lighter busiest shard.
  document_work: `[..., cp]` int64: each shard's work (`token_work` summed) in document
    order.
  row_work: `[..., cp]` int64: the same in row order; None where T is not divisible by
    2 * cp (row order is then no candidate).
  """

  order: np.ndarray
  cp: int
  row_order: np.ndarray
  document_work: np.ndarray
  row_work: np.ndarray | None

  @property
  def shard_work(self) -> np.ndarray:
    """`[..., cp]` int64: each shard's work in the order taken."""
    if self.row_work is None:
      return self.document_work
    return np.where(self.row_order[..., None], self.row_work, self.document_work)

  def _gather(self, x, index, axis: int):
    axis = axis % x.ndim
    if x.shape[:axis + 1] != index.shape:
      raise ValueError(f"x expects its first {axis + 1} dims to be segment_ids' shape"
                       f" {index.shape} (axis={axis} is the sequence), got x of shape {x.shape};"
                       " pass axis= to name the sequence axis.")
    index = index.reshape(index.shape + (1,) * (x.ndim - axis - 1))
    if _namespace(x) is np:
      return np.take_along_axis(x, index, axis=axis)
    return jnp.take_along_axis(x, jnp.asarray(index), axis=axis)

  def apply(self, x, axis: int = 1):
    """`x` (`[..., T, ...]`, the sequence on `axis`) in the balanced order; numpy stays numpy."""
    return self._gather(x, self.order, axis)

  def undo(self, x, axis: int = 1):
    """Inverse of `apply`: `x` back in the original order."""
    inverse = np.empty_like(self.order)
    np.put_along_axis(inverse, self.order, np.arange(self.order.shape[-1]), axis=-1)
    return self._gather(x, inverse, axis)

  def segment_ids(self, segment_ids):
    """`apply(segment_ids)` with the documents renumbered 1, 2, ... in order of first
    appearance (padding stays 0): the same documents (ids only ever compare for equality),
    but each shard's whole documents get a narrow range of ids, which kernels that skip
    blocks by the range of ids in them (blockwise) need to skip across documents."""
    seg = self.apply(np.asarray(segment_ids), axis=-1)
    flat = seg.reshape(-1, seg.shape[-1])
    out = np.zeros_like(flat)
    for row, seg_T in zip(out, flat, strict=True):
      starts = np.flatnonzero(np.r_[True, seg_T[1:] != seg_T[:-1]])
      ids = seg_T[starts]
      # Each id's first run, in order: its rank among them is its new id.
      first = np.unique(ids[ids != 0], return_index=True)
      new = np.zeros(len(starts), seg_T.dtype)
      rank = np.empty(len(first[0]), np.int64)
      rank[np.argsort(first[1], kind="stable")] = np.arange(1, len(first[0]) + 1)
      new[ids != 0] = rank[np.searchsorted(first[0], ids[ids != 0])]
      row[:] = np.repeat(new, np.diff(np.r_[starts, seg_T.shape[0]]))
    out = out.reshape(seg.shape)
    return out if isinstance(segment_ids, np.ndarray) else jnp.asarray(out)

  def max_over_mean(self) -> np.ndarray:
    """`[...]` float: the busiest shard's work over the mean (1 is perfect balance)."""
    return _max_over_mean(self.shard_work)

  def describe(self) -> str:
    """Which order each row took and its max/mean, beside the order passed over, one line a
    row: "row 0: document order, max/mean 1.031 (row order 1.214)"."""
    taken = int(self.row_order.sum())
    lines = [f"balance plan over {self.cp} shards, rows in row order: {taken}, in document"
             f" order: {self.row_order.size - taken}"]
    document = _max_over_mean(self.document_work)
    row = None if self.row_work is None else _max_over_mean(self.row_work)
    for index in np.ndindex(self.row_order.shape):
      name = f"row {', '.join(map(str, index))}: " if index else ""
      if row is None:
        t = self.order.shape[-1]
        lines.append(f"{name}document order, max/mean {document[index]:.3f} (row order: T ="
                     f" {t} not divisible by 2 * cp = {2 * self.cp})")
      elif self.row_order[index]:
        lines.append(f"{name}row order, max/mean {row[index]:.3f} (document order"
                     f" {document[index]:.3f})")
      else:
        lines.append(f"{name}document order, max/mean {document[index]:.3f} (row order"
                     f" {row[index]:.3f})")
    return "\n".join(lines)


def _max_over_mean(shard_work: np.ndarray) -> np.ndarray:
  mean = shard_work.mean(-1)
  return shard_work.max(-1) / np.where(mean > 0, mean, 1)


def balance_plan(segment_ids, cp: int, masks: Sequence[Mask] | None = None, *,
                 block: int = 128) -> BalancePlan:
  """The per-document order of packed rows over cp shards, weighed by `masks`.

  A document of n tokens is cut into 2k pieces of q tokens, k = min(cp, n // 2 block) and q
  the most whole blocks with 2kq <= n; pieces i and 2k-1-i form pair i (head and tail:
  for a causal mask all pairs weigh the same). The middle n - 2kq tokens are cut the same
  way, down to fewer than 2 blocks, which stay whole, as do documents that short. Then
  every unit (a pair or a whole piece), heaviest first, goes to the shard with the least
  work that has room for it (a unit no shard has room for is spread over the least loaded
  ones). Inside a shard: pieces of whole blocks first, in the original order, so they stay
  aligned to the kernels' blocks, then the shorter pieces, then padding up to T / cp. Work
  is `token_work` summed over `masks`, so one order serves a model whose layers mix masks.
  Pieces smaller than a block would balance finer but cost block-skipping kernels more
  than they save; `block` is the trade (docs/design.md, "Load balancing").

  A row whose pieces are too coarse (few blocks a shard) can balance worse than the row
  order, so each row takes the row order where its busiest shard, by the same work, is no
  heavier than the document order's. A tie takes the row order: the pieces buy nothing
  there, and the row order is the fixed permutation, the same for every row (one document
  filling the row balances in row order at least as well as in pieces). Row order needs
  T divisible by 2 * cp; otherwise every row takes the document order.
  `BalancePlan.row_order` records the choice and `BalancePlan.describe()` prints it.

  O(T) per row plus a sort of the units (fewer than 2cp per document, and the short
  documents); never `[T, T]`.

  Args:
    segment_ids: `[..., T]` int, numpy or a concrete jax array, in the original order; 0 is
      padding, a document is a run of one non-zero id (positions counting from 0 in it).
    cp: the number of shards; T must be divisible by it.
    masks: the model's masks, one per layer (default `[Causal()]`).
    block: the granularity of pieces of documents, in tokens: the attention kernel's block
      (the blockwise kernel's CPU default is 512).
  Raises:
    ValueError: cp or block not a positive int, T not divisible by cp.
    TypeError: a mask that is not a flaxattn mask; traced segment ids.
  """
  _check_cp(cp)
  if isinstance(block, bool) or not isinstance(block, int) or block < 1:
    raise ValueError(f"block expects a positive int (tokens per kernel block), got {block!r}.")
  seg = _host_ids(segment_ids)
  t = seg.shape[-1]
  if t == 0:
    raise ValueError(f"document load balancing expects at least one token on the last axis of"
                     f" segment_ids, got shape {seg.shape}.")
  if t % cp:
    raise ValueError(f"document load balancing expects the sequence length ({t}) of"
                     f" segment_ids {seg.shape} divisible by cp = {cp}; pad the rows to a"
                     f" multiple of {cp}.")
  work = token_work(seg, masks).reshape(-1, t)
  flat = seg.reshape(-1, t)
  orders = np.empty(flat.shape, np.int64)
  loads = np.empty((flat.shape[0], cp), np.int64)
  for i, (seg_T, work_T) in enumerate(zip(flat, work, strict=True)):
    orders[i], loads[i] = _row_plan(seg_T, work_T, cp, block)
  row_order = np.zeros(flat.shape[0], bool)
  row_loads = None
  if t % (2 * cp) == 0:
    row_loads = load_balance(work, cp).reshape(-1, cp, t // cp).sum(-1)
    row_order = row_loads.max(-1) <= loads.max(-1)
    orders[row_order] = load_balance(np.arange(t), cp, axis=0)
  batch = seg.shape[:-1]
  return BalancePlan(orders.reshape(seg.shape), cp, row_order.reshape(batch),
                     loads.reshape(batch + (cp,)),
                     None if row_loads is None else row_loads.reshape(batch + (cp,)))


def _pairs(start: int, n: int, cp: int, block: int):
  """The units of one document's tokens start .. start + n - 1: (head, tail) slices of
  head-tail pairs, tail None for a unit placed whole (see `balance_plan`)."""
  k = min(cp, n // (2 * block))
  if not k:
    return [(slice(start, start + n), None)]
  q = n // (2 * k) // block * block
  pairs = [(slice(start + i * q, start + (i + 1) * q),
            slice(start + n - (i + 1) * q, start + n - i * q)) for i in range(k)]
  middle = n - 2 * k * q
  return pairs + (_pairs(start + k * q, middle, cp, block) if middle else [])


def _row_plan(seg_T: np.ndarray, work_T: np.ndarray, cp: int,
              block: int) -> tuple[np.ndarray, np.ndarray]:
  """(order `[T]`, work per shard `[cp]`) of one row (see `balance_plan`)."""
  t = seg_T.shape[0]
  cum = np.concatenate([[0], np.cumsum(work_T)])
  units = [u for start, n in zip(*_runs(seg_T), strict=True) for u in _pairs(start, n, cp, block)]

  def size(s):
    return 0 if s is None else s.stop - s.start

  def work(s):
    return 0 if s is None else cum[s.stop] - cum[s.start]
  units.sort(key=lambda u: -(work(u[0]) + work(u[1])))
  room = np.full(cp, t // cp)
  load = np.zeros(cp, np.int64)
  shard_T = np.full(t, -1, np.int64)
  for head, tail in units:
    n = size(head) + size(tail)
    fits = room >= n
    if fits.any():  # to the least loaded shard with room
      s = int(np.argmin(np.where(fits, load, np.iinfo(np.int64).max)))
      for part in (head, tail):
        if part is not None:
          shard_T[part] = s
      load[s] += work(head) + work(tail)
      room[s] -= n
      continue
    for part in (head, tail):  # no shard has room: over the least loaded ones
      start, stop = (0, 0) if part is None else (part.start, part.stop)
      while start < stop:
        s = int(np.argmin(np.where(room > 0, load, np.iinfo(np.int64).max)))
        m = min(stop - start, int(room[s]))
        shard_T[start:start + m] = s
        load[s] += cum[start + m] - cum[start]
        room[s] -= m
        start += m
  # Inside a shard: whole blocks first (so they stay aligned to the kernels' blocks), then
  # the pieces shorter than a block, then padding up to T / cp; each in the original order.
  kind_T = np.ones(t, np.int64)
  for head, tail in units:
    if size(head) % block == 0 and size(tail) % block == 0:
      kind_T[head] = 0
      if tail is not None:
        kind_T[tail] = 0
  pad = np.flatnonzero(shard_T < 0)
  shard_T[pad] = np.repeat(np.arange(cp), room)
  kind_T[pad] = 2
  # 16-bit keys: numpy's stable sort of them is a radix sort, O(T).
  key = (3 * shard_T + kind_T).astype(np.int16 if 3 * cp < 2**15 else np.int32)
  return np.argsort(key, kind="stable"), load


def original_index(segment_ids, positions):
  """Each token's index in its row before per-document load balancing (`load_balance(...,
  segment_ids=...)`), from the balanced rows' segment ids and positions `[B, T]`: the tokens
  of the documents with lower ids plus the token's position, documents numbered in row
  order and packed back to back from the row's start (padding, id 0, last). O(T log T)
  time, O(T) memory (a sort per row). int32 `[B, T]`."""
  big = jnp.iinfo(jnp.int32).max
  key_BT = jnp.where(segment_ids == 0, big, segment_ids).astype(jnp.int32)
  sorted_BT = jnp.sort(key_BT, axis=1)
  start_BT = jax.vmap(lambda s, k: jnp.searchsorted(s, k, side="left"))(sorted_BT, key_BT)
  return (start_BT + positions).astype(jnp.int32)
