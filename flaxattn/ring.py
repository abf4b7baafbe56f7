"""The ring: each device's keys and values passed round the context-parallel devices with
`ppermute`, partial results merged by lse.

Owns `RingStep`, the one protocol of a kernel's per-device computation under context
parallelism, and the three custom VJPs that run one over the ring's steps: the full ring
(backward a second ring carrying dK/dV), the window-aware ring (only the neighbouring keys
a bounded mask reaches, `ring_fetches`), and the gathered keys served as ring steps (the
all-gather strategy of a kernel that computes per step). All merge through `merge_partials`
(`merge_weights`, the one lse merge, for two parts).
Derivations: docs/design.md, "Context parallelism".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxattn.layout import Layout
from flaxattn.masks import Mask, reach
from flaxattn.mods import ScoreMod


class RingStep:
  """A kernel's per-device computation under context parallelism, run inside the strategy's
  `shard_map` on the device's own queries and one shard of keys per step.

  A step is a pytree (`jax.tree_util.register_dataclass`): its array fields, the per-call
  state such as block metadata or a run-time exactness check, are operands of the
  `shard_map`, sharded as `specs()` says; its other fields are static. Step `step` of the
  ring visits the keys of device (r - step) mod n, r the device's index.
  """

  unrolled: bool = False  # True: steps run unrolled and `step` is a Python int

  def specs(self):
    """The step's `PartitionSpec` pytree for the `shard_map` (default: arrays replicated)."""
    return jax.tree.map(lambda _: P(), self)

  def forward(self, step, q, k, v, layout: Layout):
    """(out `[B, T, H, Dv]`, lse `[B, T, H]` float32) of the local queries q against the
    visiting keys k/v (`layout` their ids), or None when nothing is computed."""
    raise NotImplementedError

  def backward(self, step, q, k, v, layout: Layout, out, lse, dout, dlse):
    """(dq, dk, dv) of `forward`'s step given the merged out/lse over all steps and their
    cotangents, or None when nothing is computed; a step with differentiable operands of
    its own (a score mod's) adds their gradients, float32, as a fourth (`operand_zeros`)."""
    raise NotImplementedError

  def operand_zeros(self) -> list:
    """Zeros of the step's differentiable operands' gradients (float32), which `backward`
    returns as a fourth element: none by default."""
    return []

  def cotangent(self, d_operands: list):
    """The step's own cotangent in a custom VJP from its operands' summed gradients; None:
    the step has none to differentiate."""
    return None

  def gathered(self, axis: str, n: int, q, k, v, layout: Layout):
    """The all-gather strategy: (out, lse) of the local queries against all keys (k/v
    gathered over `axis` of size n, in device order). By default the n shards of the
    gathered keys are served as ring steps (`gathered_steps`)."""
    return gathered_steps(axis, n, self, q, k, v, layout)


@functools.partial(jax.tree_util.register_dataclass, data_fields=[],
                   meta_fields=["kernel", "mask", "scale", "soft_cap", "score_mod"])
@dataclasses.dataclass(frozen=True)
class Gathered(RingStep):
  """Any kernel on the gathered keys: the all-gather strategy of a kernel without per-step
  passes (`registry.Kernel.ring_step`'s default)."""

  kernel: Callable[..., tuple[jax.Array, jax.Array]]
  mask: Mask  # static, as the kernel: a MaskMod's operands are closed over
  scale: float
  soft_cap: float | None = None
  score_mod: ScoreMod | None = None  # likewise: the gradients leave through the shard_map

  def gathered(self, axis, n, q, k, v, layout):
    options = {} if self.soft_cap is None else dict(soft_cap=self.soft_cap)
    options |= {} if self.score_mod is None else dict(score_mod=self.score_mod)
    return self.kernel(q, k, v, layout, mask=self.mask, scale=self.scale, return_lse=True,
                       **options)


def merge_weights(lse_N, axis: int = 0):
  """The exact merge of N partial softmax results over disjoint key sets, from their lse
  stacked on `axis`: (weights `lse_N`'s shape, merged lse with `axis` removed). The merged
  output is the sum over `axis` of weights * partial outputs; weight n is exp(lse_n - lse),
  lse = log sum_n exp(lse_n). A row with no key in any part gets weights 0 and lse -inf.
  The one merge of the ring, context-parallel decode and split_k's chunks."""
  # The shift cancels: no gradient flows through it (and none through max's ties).
  top = jax.lax.stop_gradient(jnp.max(lse_N, axis=axis, keepdims=True))
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  total = jnp.sum(jnp.exp(lse_N - top), axis=axis, keepdims=True)
  seen = total > 0
  lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
  return jnp.exp(lse_N - jnp.where(seen, lse, 0.0)), jnp.squeeze(lse, axis)


def merge_partials(out, lse, out_s, lse_s):
  """Combines two partial softmax results over disjoint key sets: out `[B, T, H, Dv]`
  float32 with lse `[B, T, H]`, and another such pair (out_s in any float dtype); rows
  with no key on either side stay zeros / -inf. The ring's merge, and the layer's prefill
  into a filled sharded cache."""
  w_2BTH, new = merge_weights(jnp.stack([lse, lse_s]))
  return out * w_2BTH[0, ..., None] + out_s.astype(jnp.float32) * w_2BTH[1, ..., None], new


def ring_fetches(mask: Mask, t: int, n: int, load_balance: bool | str):
  """The ring steps a mask with a bounded reach needs besides step 0 (`masks.reach`: at most
  `back` keys before a query and `ahead` after it; `Local`, `Window`, `Chunked`), as
  `((step, part), ...)`: at step s the keys of shard (r - s) mod n, whole (`part` None) or
  only their first (0) or second (1) half. None: every step is needed, always so in
  per-document order (`load_balance="document"`), where a document's neighbouring tokens
  may be on any shard.

  Load balanced (chunks of c = T / 2n, device r holds chunks r and 2n-1-r), a query reaches
  m = ceil(back / c) chunks back and ceil(ahead / c) ahead. Both at most 1 and n >= 3: back,
  chunk r - 1 (first half of device r - 1, step 1) and chunk 2n-2-r (second half of device
  r + 1, step n - 1); ahead, chunk r + 1 (first half of device r + 1) and chunk 2n-r (second
  half of device r - 1). Farther, m the larger, while 2m < n - 1: the whole shards of
  devices r - m .. r + m (steps 1..m and n-m..n-1). Contiguous (shards of L = T / n):
  ceil(back / L) steps back and ceil(ahead / L) ahead. Exact when positions follow the token
  index inside documents (docs/design.md)."""
  r = reach(mask)
  if r is None or load_balance == "document":
    return None
  back, ahead = r
  if load_balance:
    c = t // (2 * n)
    m_back, m_ahead = -(-back // c), -(-ahead // c)
    if n >= 3 and max(m_back, m_ahead) <= 1:
      def side(back_half: int, ahead_half: int) -> set[int]:
        return {h for h, m in ((back_half, m_back), (ahead_half, m_ahead)) if m}
      halves = {1: side(0, 1), n - 1: side(1, 0)}
      return tuple((step, None if len(parts) == 2 else min(parts))
                   for step, parts in halves.items() if parts)
    m = max(m_back, m_ahead)
    if 2 * m < n - 1:
      return (tuple((s, None) for s in range(1, m + 1))
              + tuple((n - s, None) for s in range(m, 0, -1)))
    return None
  steps_back, steps_ahead = -(-back // (t // n)), -(-ahead // (t // n))
  if steps_back + steps_ahead >= n - 1:
    return None
  return (tuple((step, None) for step in range(1, steps_back + 1))
          + tuple((n - step, None) for step in range(steps_ahead, 0, -1)))


def ring(axis: str, n: int, fetches, checked: bool, grad_dtype=jnp.float32, groups: int = 1):
  """The ring over `axis` (n devices) as a `shard_map` body `(step, near, q, k, v, layout)
  -> (out, lse)`: every step; with `fetches` (`ring_fetches`) only those steps; with
  `checked`, per batch the fetched steps where `near` (a scalar bool: positions follow the
  token index) holds, else every step. The backward sums the steps' partial gradients in
  `grad_dtype` (None: the inputs' dtype; `ContextParallel.grad_dtype`). With `groups` > 1
  the device's K/V heads (dividing by it) go round in that many groups, one ring after the
  other (`_by_heads`)."""
  def full(step, near, *args):
    return _ring(axis, n, grad_dtype, groups, step, *args)

  if fetches is None:
    return full

  def window(step, near, *args):
    return _window_ring(axis, n, fetches, grad_dtype, groups, step, *args)

  if not checked:
    return window
  return lambda step, near, *args: jax.lax.cond(near, lambda: window(step, near, *args),
                                               lambda: full(step, near, *args))


def all_gather(axis: str, n: int, step, near, q, k, v, layout: Layout):
  """The all-gather strategy as a `shard_map` body: the keys and their ids gathered over
  `axis`, then `step.gathered` (a `RingStep`)."""
  def gather(x, at=1):
    return jax.lax.all_gather(x, axis, axis=at, tiled=True)

  return step.gathered(axis, n, q, gather(k), gather(v),
                       layout.visiting(gather(layout.kv_ids(), 2)))


def _shift(x, axis: str, n: int):
  return jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


def _after(done, x):
  """`x` as a value that exists only once `done` does (`optimization_barrier`), so that
  nothing computed from it, a transfer included, starts earlier."""
  return jax.lax.optimization_barrier((done, x))


def _steps(step: RingStep, n: int, body, carry):
  """Runs `body(carry, i)` for ring steps 0 .. n-2: a scan, or unrolled when the step's
  computation differs per step (`i` is then a Python int)."""
  if step.unrolled:
    for i in range(n - 1):
      carry = body(carry, i)
    return carry
  return jax.lax.scan(lambda c, i: (body(c, i), None), carry, jnp.arange(n - 1))[0]


def _zeros_f32(x):
  return jnp.zeros(x.shape, jnp.float32)


def _sum(dtype, acc, grad):
  """acc + grad, added in float32 and held in `dtype` (None: acc's own)."""
  return (acc.astype(jnp.float32) + grad.astype(jnp.float32)).astype(
      acc.dtype if dtype is None else dtype)


def _group_of(x, group: int, groups: int):
  """Group `group` of `groups` along the heads (axis 2)."""
  size = x.shape[2] // groups
  return jax.lax.slice_in_dim(x, group * size, (group + 1) * size, axis=2)


def _group_layout(layout: Layout, group: int, heads: int) -> Layout:
  """The layout of head group `group` of `heads` query heads each: its first head's global
  index, where a programmable mask or score reads it (`Layout.head_offset` set)."""
  if layout.head_offset is None or group == 0:
    return layout
  return layout.shifted(heads=group * heads)


def _by_heads(groups: int, fwd, q, k, v):
  """`fwd(group, q, k, v) -> ((out, lse), residuals)` run on `groups` groups of heads, each group's
  query heads with the K/V heads they read (q `[B, T, H, D]`, k/v `[B, S, Hkv, D]`; Hkv
  divides by `groups`), one after the other: a group starts once the previous group's
  result exists (`_after`), so a device holds one group's blocks, partial results and
  gradient sums at a time, 1 / groups of the whole ring's. Returns ((out, lse) of all
  heads, (q, k, v) and the groups' residuals) for `_by_heads_bwd`, which takes each group's
  q, k, v again from the whole ones when it starts: a group's slices are copies, and kept
  from the forward on they would hold every group's. One group: `fwd` itself."""
  results, residuals = [], []
  for g in range(groups):
    # K/V sliced before the tie (the first transfer, of a slice, then starts beside the
    # group's first kernel), q after it: one group's copy of q at a time.
    q_g = q
    kv = (k, v) if groups == 1 else tuple(_group_of(x, g, groups) for x in (k, v))
    if results:
      _, (q_g, kv) = _after(results[-1], (q_g, kv))
    qkv = (q_g if groups == 1 else _group_of(q_g, g, groups), *kv)
    result, res = fwd(g, *qkv)
    results.append(result)
    residuals.append(res)
  outs, lses = zip(*results, strict=True)
  out, lse = (outs[0], lses[0]) if groups == 1 else (jnp.concatenate(x, 2) for x in (outs, lses))
  return (out, lse), ((q, k, v), tuple(residuals))


def _by_heads_bwd(bwd, residuals, cotangents):
  """`_by_heads`'s backward. `bwd(residuals, (q, k, v), (dout, dlse), wait) -> (ready, home)` runs
  one group's ring up to its last kernel: `ready` holds its dQ and its dK/dV still one step
  short of home, `home(ready) -> (dq, dk, dv, d_operands)` sends them there (and gives the
  step's operands' gradients, `RingStep.operand_zeros`). Each group's residuals start with the
  step, whose cotangent (`RingStep.cotangent`) takes the groups' summed gradients. The groups
  run in order: a group starts, its q, k, v and cotangents sliced, once the previous group's
  `ready` exists, so the previous group's last dK/dV go home beside this group's first kernel,
  and this group's second kernel waits for them to arrive (`wait`): no more than one group's
  sums are ever on their way home. Starting a group on dQ alone let the compiler keep every
  group's dK/dV sums to the end (v5p, cp=4: 1.09 GiB of temporaries against 0.71)."""
  qkv, residuals = residuals
  groups = len(residuals)
  step = residuals[0][0]
  if groups == 1:
    ready, home = bwd(residuals[0], qkv, cotangents, None)
    *grads, d_ops = home(ready)
    return step.cotangent(d_ops), *grads, None
  grads, ready = [], cotangents  # the first group's slices: taken once the backward starts
  for g, res in enumerate(residuals):
    _, (qkv_g, cotangents_g) = _after(ready, (qkv, cotangents))
    qkv_g, cotangents_g = ([_group_of(x, g, groups) for x in xs] for xs in (qkv_g, cotangents_g))
    ready, home = bwd(res, qkv_g, cotangents_g, grads[-1][:3] if grads else None)
    grads.append(home(ready))
  d_ops = [sum(parts) for parts in zip(*(g[3] for g in grads), strict=True)]
  return (step.cotangent(d_ops),
          *(jnp.concatenate(x, 2) for x in zip(*(g[:3] for g in grads), strict=True)), None)


def _ring_primal(axis, n, grad_dtype, groups, step, q, k, v,
                 layout) -> tuple[jax.Array, jax.Array]:
  return _ring_fwd(axis, n, grad_dtype, groups, step, q, k, v, layout)[0]


# The custom VJPs here are applied as calls, not as decorators through functools.partial,
# so that their results stay typed.
_ring = jax.custom_vjp(_ring_primal, nondiff_argnums=(0, 1, 2, 3))


def _rotate(axis: str, n: int, step: RingStep, kernel, accumulate, zeros, kv, ids,
            travel=None, wait=None):
  """The ring's n steps: at step i `kernel(i, kv, ids)` (a partial result or None) on the
  visiting block kv (a pair) with its ids `[2, B, S]`, folded into an accumulator by
  `accumulate(acc, partial)`. With `travel`, the accumulator belongs to the visiting block
  and travels with it: `travel(acc)` sends the previous step's on, to the device that now
  holds that block, while this step's kernel runs (it is needed only after it), and brings
  this block's. Returns the final accumulator (with `travel`, the last block's, one device
  short of home), or None when every step was skipped.

  The accumulator of scanned steps starts as `zeros()` (in the dtype the caller sums in);
  unrolled steps start from None and keep the first partial result as the kernel made it,
  which the first fold then reads exactly: until then it is held, and travels, in the
  kernel's dtype.

  Each step sends its block on before its kernel and hands the arrived block to the next
  step only after it, with the kernel's result and then the accumulator ordered in between
  (`_after`): the transfer is in flight while the kernel runs, not only beside the merge (a
  scheduler that sees cheap work there starts the transfer after the kernel), and the next
  transfer cannot start before this kernel has finished, so a device holds two blocks, the
  visiting one and the arriving one, never all of them."""
  def body(carry, i):
    acc, kv, ids = carry
    arriving = _shift((kv, ids), axis, n)
    # Step 0 visits the device's own block: its accumulator starts here. A scanned step
    # cannot tell, and sends the zeros it starts with.
    if travel is not None and acc is not None and not (isinstance(i, int) and i == 0):
      acc = travel(acc)
    partial, arriving = _after(kernel(i, kv, ids), arriving)
    acc, arriving = _after(accumulate(acc, partial), arriving)
    if wait is not None and isinstance(i, int) and i == 0:
      _, arriving = _after(wait, arriving)
    return acc, *arriving

  if wait is not None and not step.unrolled:  # a scan's first step cannot tell: wait here
    _, (kv, ids) = _after(wait, (kv, ids))
  acc, kv, ids = _steps(step, n, body, (None if step.unrolled else zeros(), kv, ids))
  if travel is not None and acc is not None and n > 1:
    acc = travel(acc)
  return accumulate(acc, kernel(n - 1, kv, ids))  # the last block: nothing left to send


def _ring_fwd(axis, n, grad_dtype, groups, step, q, k, v, layout):
  return _by_heads(groups, lambda g, q, k, v: _group_ring_fwd(
      axis, n, step, q, k, v, _group_layout(layout, g, q.shape[2])), q, k, v)


def _ring_bwd(axis, n, grad_dtype, groups, residuals, cotangents):
  return _by_heads_bwd(functools.partial(_group_ring_bwd, axis, n, grad_dtype), residuals,
                       cotangents)


def _group_ring_fwd(axis, n, step, q, k, v, layout):
  def kernel(i, kv, ids):
    return step.forward(i, q, *kv, layout.visiting(ids))

  def accumulate(acc, partial):
    if partial is None or acc is None:
      return acc if partial is None else partial
    return merge_partials(*acc, *partial)

  def zeros():
    return (jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32),
            jnp.full(q.shape[:3], -jnp.inf, jnp.float32))

  ids = layout.kv_ids()
  # K/V a pair, not one stacked buffer: v may have its own head dim.
  out, lse = _rotate(axis, n, step, kernel, accumulate, zeros, (k, v), ids) or zeros()
  out = out.astype(q.dtype)
  return (out, lse), (step, layout, out, lse)


def _group_ring_bwd(axis, n, grad_dtype, residuals, qkv, cotangents, wait):
  step, layout, out, lse = residuals
  q, k, v = qkv
  dout, dlse = cotangents
  dq_dtype, dkv_dtype = (x.dtype if grad_dtype is None else grad_dtype for x in (q, k))

  def kernel(i, kv, ids):
    return step.backward(i, q, *kv, layout.visiting(ids), out, lse, dout, dlse)

  def accumulate(acc, grads):
    if grads is None:
      return acc
    dq_s, dk_s, dv_s, *d_ops_s = grads
    dkv_s = jnp.concatenate([dk_s, dv_s], -1)  # one buffer: one transfer
    d_ops_s = d_ops_s[0] if d_ops_s else []
    if acc is None:
      return dq_s, dkv_s, d_ops_s
    return (_sum(dq_dtype, acc[0], dq_s), _sum(dkv_dtype, acc[1], dkv_s),
            [a + x for a, x in zip(acc[2], d_ops_s, strict=True)])

  def travel(acc):  # dK/dV travel; dQ and the operands' gradients stay
    return acc[0], _shift(acc[1], axis, n), acc[2]

  def zeros():
    return (jnp.zeros(q.shape, dq_dtype),
            jnp.zeros(k.shape[:3] + (k.shape[3] + v.shape[3],), dkv_dtype), step.operand_zeros())

  # The backward's own blocks, tied to the cotangent: XLA would otherwise reuse the blocks
  # the forward received, keeping every one of them live from the forward on.
  _, (kv, ids) = _after(dout, ((k, v), layout.kv_ids()))
  ready = _rotate(axis, n, step, kernel, accumulate, zeros, kv, ids, travel, wait)

  def home(ready):
    dq, dkv, d_ops = zeros() if ready is None else travel(ready)
    dk, dv = jnp.split(dkv, [k.shape[3]], -1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_ops

  return ready, home


_ring.defvjp(_ring_fwd, _ring_bwd)


def _move(x, axis: str, n: int, step: int, part, back: bool = False):
  """`x` `[B, T/n, ...]` of device (r - step) mod n (`back`: sent to it instead); with `part`
  (0 or 1) only that half along the sequence travels. Callers tie what arrives to the
  kernel beside it (`_after`) and only then put it in place (`_placed`): padded before the
  tie, the plans held more (v5p, window-aware ring in 4 head groups, cp=4: 0.727 GiB of
  temporaries against 0.696)."""
  pairs = [(i, (i + step) % n) for i in range(n)]
  pairs = [(j, i) for i, j in pairs] if back else pairs
  return jax.lax.ppermute(x if part is None else jnp.split(x, 2, axis=1)[part], axis, pairs)


def _placed(got, part):
  """A `_move`d `part` at its half of the sequence, the other half zeros (`part` None: as is)."""
  if part is None:
    return got
  zeros = jnp.zeros_like(got)
  return jnp.concatenate([got, zeros] if part == 0 else [zeros, got], axis=1)


def _merged(step: RingStep, q, v, pieces):
  """(out in q's dtype, lse) of `step.forward` over `pieces` of (i, k, v, layout), merged by
  lse."""
  out = jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32)
  lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
  for i, k_s, v_s, lay in pieces:
    partial = step.forward(i, q, k_s, v_s, lay)
    if partial is not None:
      out, lse = merge_partials(out, lse, *partial)
  return out.astype(q.dtype), lse


def _window_ring_primal(axis, n, fetches, grad_dtype, groups, step, q, k, v,
                        layout) -> tuple[jax.Array, jax.Array]:
  return _window_ring_fwd(axis, n, fetches, grad_dtype, groups, step, q, k, v, layout)[0]


_window_ring = jax.custom_vjp(_window_ring_primal, nondiff_argnums=(0, 1, 2, 3, 4))


def _window_ring_fwd(axis, n, fetches, grad_dtype, groups, step, q, k, v, layout):
  return _by_heads(groups, lambda g, q, k, v: _group_window_fwd(
      axis, n, fetches, step, q, k, v, _group_layout(layout, g, q.shape[2])), q, k, v)


def _window_ring_bwd(axis, n, fetches, grad_dtype, groups, residuals, cotangents):
  return _by_heads_bwd(functools.partial(_group_window_bwd, axis, n, fetches, grad_dtype),
                       residuals, cotangents)


def _group_window_fwd(axis, n, fetches, step, q, k, v, layout):
  # As in `_rotate`: each fetch is in flight while the previous visit's kernel runs, and the
  # one after it starts only once that kernel has finished.
  local = (k, v, layout.kv_ids())
  visits = [local]
  out = jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32)
  lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
  for j, i in enumerate((0, *(i for i, _ in fetches))):
    arriving = None
    if j < len(fetches):  # ids travel whole
      i_next, part = fetches[j]
      arriving = (*(_move(x, axis, n, i_next, part) for x in local[:2]),
                  _move(local[2], axis, n, i_next, None))
    k_s, v_s, ids = visits[j]
    partial, arriving = _after(step.forward(i, q, k_s, v_s, layout.visiting(ids)), arriving)
    if partial is not None:
      out, lse = merge_partials(out, lse, *partial)
    (out, lse), local = _after((out, lse), local)
    if arriving is not None:
      visits.append((_placed(arriving[0], part), _placed(arriving[1], part), arriving[2]))
  out = out.astype(q.dtype)
  return (out, lse), (step, layout, visits[1:], out, lse)


def _group_window_bwd(axis, n, fetches, grad_dtype, residuals, qkv, cotangents, wait):
  step, layout, fetched, out, lse = residuals
  q, k, v = qkv
  dout, dlse = cotangents
  visits = [(k, v, layout.kv_ids()), *fetched]
  dq, dk, dv = (jnp.zeros(x.shape, x.dtype if grad_dtype is None else grad_dtype)
                for x in (q, k, v))
  d_ops = step.operand_zeros()
  home = None  # the previous visit's dK/dV on their way home, beside this visit's kernel
  home_part = None  # the half of the sequence they belong to
  last = None  # the last visit's, sent by `finish`
  steps = ((0, None), *fetches)
  for j, ((k_s, v_s, ids), (i, part)) in enumerate(zip(visits, steps, strict=True)):
    if j == 1 and wait is not None:  # the previous group's last dK/dV are home by now
      _, (k_s, v_s, ids) = _after(wait, (k_s, v_s, ids))
    grads, home = _after(step.backward(i, q, k_s, v_s, layout.visiting(ids), out, lse, dout,
                                       dlse), home)
    if home is not None:
      dk, dv = (_sum(None, acc, _placed(g, home_part))
                for acc, g in zip((dk, dv), home, strict=True))
      home = None
    if grads is None:
      continue
    dq_s, dk_s, dv_s, *d_ops_s = grads
    d_ops = [a + x for a, x in zip(d_ops, d_ops_s[0] if d_ops_s else [], strict=True)]
    dq = _sum(None, dq, dq_s)
    if not i:
      dk, dv = _sum(None, dk, dk_s), _sum(None, dv, dv_s)
    elif j < len(steps) - 1:  # partial gradients travel as the kernel made them; home sums them
      home, home_part = tuple(_move(g, axis, n, i, part, back=True) for g in (dk_s, dv_s)), part
    else:  # the last visit's: `finish` sends them, beside the next group's first kernel
      last = (dk_s, dv_s)

  def finish(ready):
    dq, dk, dv, last, d_ops = ready
    if last is not None:
      i, part = steps[-1]
      dk, dv = (_sum(None, acc, _placed(_move(g, axis, n, i, part, back=True), part))
                for acc, g in zip((dk, dv), last, strict=True))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_ops

  return (dq, dk, dv, last, d_ops), finish


_window_ring.defvjp(_window_ring_fwd, _window_ring_bwd)


def _gathered_steps_primal(axis, n, step, q, k, v, layout) -> tuple[jax.Array, jax.Array]:
  """The all-gather strategy for a kernel that computes ring steps: the gathered keys split
  back into the n shards they came from, shard j served as the ring's step (r - j) mod n
  (r the device index, so the step is traced) and merged by lse; the backward runs each
  step's backward with the merged result, as the ring does. Returns (out, lse)."""
  return _gathered_steps_fwd(axis, n, step, q, k, v, layout)[0]


gathered_steps = jax.custom_vjp(_gathered_steps_primal, nondiff_argnums=(0, 1))


def _shard_pieces(axis, n, k, v, layout):
  """(step, k, v, layout) per shard of the gathered keys, in shard order."""
  r = jax.lax.axis_index(axis)
  shards = (jnp.split(x, n, axis=1) for x in (k, v))
  ids = jnp.split(layout.kv_ids(), n, axis=2)
  for j, (k_j, v_j, ids_j) in enumerate(zip(*shards, ids, strict=True)):
    yield (r - j) % n, k_j, v_j, layout.visiting(ids_j)


def _gathered_steps_fwd(axis, n, step, q, k, v, layout):
  out, lse = _merged(step, q, v, _shard_pieces(axis, n, k, v, layout))
  return (out, lse), (step, q, k, v, layout, out, lse)


def _gathered_steps_bwd(axis, n, residuals, cotangents):
  step, q, k, v, layout, out, lse = residuals
  dout, dlse = cotangents
  dq, dks, dvs, d_ops = _zeros_f32(q), [], [], step.operand_zeros()
  for i, k_j, v_j, lay in _shard_pieces(axis, n, k, v, layout):
    grads = step.backward(i, q, k_j, v_j, lay, out, lse, dout, dlse)
    if grads is None:
      grads = (jnp.zeros_like(q), jnp.zeros_like(k_j), jnp.zeros_like(v_j))
    dq = dq + grads[0].astype(jnp.float32)
    dks.append(grads[1])
    dvs.append(grads[2])
    d_ops = [a + x for a, x in zip(d_ops, grads[3] if len(grads) > 3 else [], strict=True)]
  dk, dv = jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1)
  return (step.cotangent(d_ops), dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None)


gathered_steps.defvjp(_gathered_steps_fwd, _gathered_steps_bwd)
