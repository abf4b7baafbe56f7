"""The cases of tokamax's attention conformance class, said with flaxattn's arguments.

Source: openxla/tokamax, `tokamax/_src/ops/attention/test_base.py`, `AttentionTestBase` as
released in tokamax 0.0.12 (commit 4936e75cb40bac9a746f0f10c4bb6887f4c217d8). Of its 73
cases (the tests tokamax itself skips, `test_vmap`, `test_invalid_shapes` and
`test_bench`, not counted), the 64 that flaxattn can say run here, each on blockwise (in
32-token blocks, so that block edges fall inside every mask) with out, lse and the
gradients of q, k, v and of the bias, and on the reference with out and lse, against
attention written out from the definitions (`helpers.dense_oracle`, fed the peer's mask
and bias as dense arrays). The peer's two forward-only cases (padding with NaNs, partial
attention) stay forward only.
Lengths are the peer's divided by 8 (1024 tokens become 128, and its other lengths and
mask bounds with them); head dims and head counts are the peer's.

How flaxattn says them: no mask is `Full()`; an additive bias, per-head or not, a
`ScoreMod` reading the array (`helpers.array_bias`; with tanh clipping, the cap after the
bias, as the peer applies it); a boolean mask array of any broadcasting shape a `MaskMod`
reading it (`helpers.array_mask`); the peer's range masks (`q_start`, `q_end`, `k_start`,
`k_end`, per head too) a `MaskMod` of the bounds; causal masks `Causal()` on positions
(the peer's `q_indices` / `k_indices` as positions); padding as segment id 0; a local
window `Local`; no batch axis or several, folded into one by the caller; partial
attention, two calls over halves of the keys merged by their lse.

Not expressible (9): quantized operands (qwix int8 x2, int4 x3), `logits_dtype` (scores
in bfloat16 or float16 x2: flaxattn always scores in float32), dropout x1 (it scales
probabilities after the softmax, which no change of the scores can do), and unnormalized
output x1 (`normalize_output=False` needs each row's running maximum, which flaxattn does
not return).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxattn
from flaxattn import MaskMod, ScoreMod
from flaxattn.blockwise import Blockwise
from helpers import (
  array_bias,
  array_mask,
  as_layout,
  assert_results_close,
  at,
  dense_oracle,
  grads_of,
  normal,
)

T = 128  # the peer's 1024
B, H, D = 2, 4, 64
# Each backend, and whether its gradients are checked: the reference's are JAX's autodiff of
# the same dense formula as the oracle's, so it is checked forward (out and lse) only.
BACKENDS = {"blockwise": (Blockwise(block_q=32, block_kv=32), True),
            "reference": ("reference", False)}


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
  """One peer case. The mask is given once, from the peer's definition, as one of:
  `mask_array` (the shape of a random boolean mask), `ranges` (the peer's range bounds), or
  `allowed` (a numpy bool array broadcasting to `[B, H, T, S]`) with `options` (the
  `flaxattn.attention` arguments that say it). None of them: every key."""

  name: str
  q: tuple = (B, T, H, D)  # [..., T, H, D]: leading axes folded into one batch axis
  kv: tuple | None = None  # k's shape; None: q's
  dv: int | None = None  # v's last axis, where it differs from k's
  dtype: Any = jnp.float32
  bias: tuple | None = None  # the shape of a random additive logits bias
  cap: float | None = None  # tanh clipping of the (biased) logits
  mask_array: tuple | None = None
  ranges: dict | None = None
  allowed: np.ndarray | None = None
  options: Callable[[], dict] = dict
  uniform: bool = False  # inputs in [1, 2) rather than standard normal
  call: str = "one"  # "halves": two calls merged; "poisoned": NaN in the padding
  grads: bool = True


def per_head(*parts, step: int = 0):
  """int32 `[H, N]` bounds: the parts (ranges, tuples, ints) end to end, plus `step * h`
  on head h; `[1, N]` when `step` is 0."""
  row = np.concatenate([np.atleast_1d(np.asarray(p, np.int32)) for p in parts])
  return row[None] + step * np.arange(H if step else 1, dtype=np.int32)[:, None]


def ranges_allowed(t: int, s: int, q_start=None, q_end=None, k_start=None, k_end=None,
                   causal=False):
  """The peer's range mask from its definition: query i sees key j where
  q_start[j] <= i < q_end[j] and k_start[i] <= j < k_end[i] (bounds `[H|1, N]`), and
  j <= i if causal. Numpy bool `[H|1, T, S]`."""
  i, j = np.arange(t)[:, None], np.arange(s)[None]
  ok = np.ones((1, t, s), bool)
  for bound, holds in ((q_start, lambda x: i >= x[..., None, :]),
                       (q_end, lambda x: i < x[..., None, :]),
                       (k_start, lambda x: j >= x[..., :, None]),
                       (k_end, lambda x: j < x[..., :, None])):
    if bound is not None:
      ok = ok & holds(bound)
  return ok & (j <= i) if causal else ok


def _in_ranges(b, h, q_idx, kv_idx, q_start, q_end, k_start, k_end):
  return ((at(q_start, b, h, kv_idx) <= q_idx) & (q_idx < at(q_end, b, h, kv_idx))
          & (at(k_start, b, h, q_idx) <= kv_idx) & (kv_idx < at(k_end, b, h, q_idx)))


def ranges_mask(t: int, s: int, q_start=None, q_end=None, k_start=None, k_end=None,
                causal=False):
  """The range mask as flaxattn says it: a MaskMod of the bounds, each given for every key
  (`q_*`, `[H|1, S]`) or query (`k_*`, `[H|1, T]`), absent ones never binding; and
  `Causal()` on positions."""
  def full(x, default, n):
    x = np.asarray(default if x is None else x, np.int32)
    return jnp.asarray(np.broadcast_to(x, (x.shape[0], n)))
  mod = MaskMod(_in_ranges, full(q_start, [[0]], s), full(q_end, [[2**30]], s),
                full(k_start, [[0]], t), full(k_end, [[2**30]], t))
  return mod & flaxattn.Causal() if causal else mod


def _index_in_5_to_37(b, h, q_idx, kv_idx, index):
  """The peer's q_start=42, q_end=298 (divided by 8) on the queries' own indices."""
  return (index[q_idx] >= 5) & (index[q_idx] < 37)


def _tri(t, s, below=0):
  return np.tri(t, s, below, dtype=bool)


def _valid(lengths, n):
  return np.arange(n)[None] < np.asarray(lengths)[:, None]


_PERM = np.random.default_rng(0).permutation(T // 2).astype(np.int32)
_Q_VALID, _K_VALID = _valid([57, 123], T), _valid([15, 125], T)  # the peer's lengths / 8
_PADDED = _Q_VALID[:, None, :, None] & _K_VALID[:, None, None, :]


def _padding():
  return dict(segment_ids=_Q_VALID.astype(np.int32), kv_segment_ids=_K_VALID.astype(np.int32))


_HALF, _FLAT = T // 2, 12  # the hourglasses' waist, and half the offset one's flat stretch
_HOURGLASS = dict(k_start=per_head(range(_HALF), range(_HALF - 1, -1, -1)),
                  k_end=per_head(range(T, _HALF, -1), range(_HALF + 1, T + 1)))
_UP, _DOWN = per_head(range(T)), per_head(range(1, T + 1))
_MASK_API = {
    "k_end=i+1": dict(k_end=_DOWN),
    "k_start=i": dict(k_start=_UP),
    "q_start=j": dict(q_start=_UP),
    "q_start=T-1-j": dict(q_start=per_head(range(T - 1, -1, -1))),
    "q_end=j+1": dict(q_end=_DOWN),
    "q_end=T-j": dict(q_end=per_head(range(T, 0, -1))),
    "hourglass": _HOURGLASS,
    "hourglass-offset-per-head": dict(
        k_start=per_head(range(_HALF - _FLAT), (_HALF - _FLAT - 1,) * 2 * _FLAT,
                         range(_HALF - _FLAT - 1, -1, -1), step=3),
        k_end=per_head(range(T, _HALF + _FLAT, -1), (T - _HALF + _FLAT + 1,) * 2 * _FLAT,
                       range(_HALF + _FLAT + 1, T + 1), step=3)),
    "hourglass-transposed": dict(q_start=_HOURGLASS["k_start"], q_end=_HOURGLASS["k_end"]),
    "k_start=T/2-causal": dict(k_start=per_head(_HALF), causal=True),
    "k_end=T/2+1-causal": dict(k_end=per_head(_HALF + 1), causal=True),
    "k_start=T/4-k_end=3T/4+1-causal": dict(k_start=per_head(T // 4),
                                             k_end=per_head(3 * T // 4 + 1), causal=True),
    "q_start=17-k_start=i": dict(q_start=per_head(17), k_start=_UP),
    "q_start=T/8-k_end=i+1": dict(q_start=per_head(T // 8), k_end=_DOWN),
    "q_end=T-17-k_start=i": dict(q_end=per_head(T - 17), k_start=_UP),
    "q_end=7T/8-k_end=i+1": dict(q_end=per_head(7 * T // 8), k_end=_DOWN),
    "k_start=9T/16": dict(k_start=per_head(9 * T // 16)),
}
_SHAPES = [(2, 4, T, T), (2, 4, T, 1), (2, 4, 1, T), (2, 1, T, T), (1, 4, T, T)]


def _dims(shape):
  return "x".join(map(str, shape))


CASES = [
    *[Case(f"self_attention-{jnp.dtype(d).name}", dtype=d)
      for d in (jnp.float32, jnp.bfloat16, jnp.float16)],
    Case("cross_attention", kv=(B, 3 * T // 2, H, D)),
    Case("cross_attention-bias", kv=(B, 3 * T // 2, H, D), bias=(B, H, T, 3 * T // 2)),
    *[Case(f"different_output_head_dim-{d}-{dv}", q=(B, T, H, d), dv=dv)
      for d in (24, 128) for dv in (64, 112)],
    *[Case(f"small_sequences-{t}-{s}", q=(2, t, 4, 64), kv=(2, s, 4, 64), uniform=True)
      for t, s in ((8, 256), (256, 8), (7, 8))],
    Case("multi_query_attention", kv=(B, T, 1, D)),
    Case("grouped_query_attention", q=(B, T, 16, D), kv=(B, T, 4, D)),
    Case("no_batch_dim", q=(T, H, D)),
    Case("multiple_batch_dims", q=(2, 3, 4, T, H, D)),
    Case("non_power_of_two_q_seq_len", q=(B, 14, H, D), kv=(B, T, H, D)),
    Case("non_power_of_two_head_dim", q=(B, T, H, 48)),
    Case("small_non_power_of_two_head_dim", q=(B, T, H, 24)),
    *[Case(f"bias-{_dims(s)}", bias=s) for s in [*_SHAPES, (4, T, T)]],
    *[Case(f"mask-{_dims(s)}", mask_array=s)
      for s in [*_SHAPES, (2, 1, T, 1), (1, 4, T, 1), (2, 1, 1, T), (1, 4, 1, T)]],
    Case("causal_mask", allowed=_tri(T, T), options=lambda: dict(mask=flaxattn.Causal())),
    *[Case(f"causal_mask_cross_attention-{s}", kv=(B, s, H, D), allowed=_tri(T, s),
           options=lambda: dict(mask=flaxattn.Causal())) for s in (T // 2, 67)],
    Case("causal_mask_q_indices", q=(B, T // 2, H, D), allowed=_tri(T // 2, T // 2)[_PERM],
         options=lambda: dict(mask=flaxattn.Causal(), positions=np.stack([_PERM] * B),
                              kv_positions=np.stack([np.arange(T // 2)] * B))),
    Case("causal_mask_k_indices", q=(B, T // 2, H, D), allowed=_tri(T // 2, T // 2)[:, _PERM],
         options=lambda: dict(mask=flaxattn.Causal(), positions=np.stack([np.arange(T // 2)] * B),
                              kv_positions=np.stack([_PERM] * B))),
    Case("q_start_end_indices", q=(B, T // 2, H, D),
         allowed=((_PERM >= 5) & (_PERM < 37))[:, None],
         options=lambda: dict(mask=MaskMod(_index_in_5_to_37, jnp.asarray(_PERM)))),
    Case("padding_mask", allowed=_PADDED, options=_padding),
    Case("padding_mask_with_nans", allowed=_PADDED, options=_padding, call="poisoned",
         grads=False),
    Case("local_attention_mask", allowed=_tri(T, T) & ~_tri(T, T, -16),
         options=lambda: dict(mask=flaxattn.Local(16))),
    Case("mask_api-causal", allowed=_tri(T, T), options=lambda: dict(mask=flaxattn.Causal())),
    *[Case(f"mask_api-{name}", ranges=r) for name, r in _MASK_API.items()],
    Case("tanh_clipping", cap=10.0),
    Case("tanh_clipping-bias", bias=(B, H, T, T), cap=10.0),
    Case("partial_attention", call="halves", grads=False),
]


def _inputs(case: Case):
  """q, k, v in the peer's shapes and the case's dtype, and the bias (float32) or None."""
  kv = case.kv or case.q
  shapes = case.q, kv, (*kv[:-1], case.dv or kv[-1])
  if case.uniform:
    rng = np.random.default_rng(0)
    qkv = [jnp.asarray(rng.uniform(1, 2, s), case.dtype) for s in shapes]
  else:
    qkv = [normal(s, 10 + i, case.dtype) for i, s in enumerate(shapes)]
  return *qkv, None if case.bias is None else normal(case.bias, 2)


def _mask(case: Case, t: int, s: int):
  """(allowed, options): the peer's mask (numpy bool, broadcasting to `[B, H, T, S]`, or
  None for every key) and the flaxattn arguments that say it."""
  if case.mask_array is not None:
    allowed = np.random.default_rng(3).random(case.mask_array) < 0.5
    # Stored at full length on the token axes (the same values): masks that differ only
    # in which token axis broadcasts share a program.
    stored = np.broadcast_to(allowed, (*allowed.shape[:2], t, s))
    return allowed, dict(mask=array_mask(stored))
  if case.ranges is not None:
    return ranges_allowed(t, s, **case.ranges), dict(mask=ranges_mask(t, s, **case.ranges))
  return case.allowed, dict(mask=flaxattn.Full()) | case.options()


def _fold(x):
  return x.reshape(-1, *x.shape[-3:])


def _unfold(lead, out, lse):
  return out.reshape(*lead, *out.shape[1:]), lse.reshape(*lead, *lse.shape[1:])


def _results(attend, args, grads: bool):
  """`(grads, (out, lse))` as `grads_of` gives them; without grads, none."""
  return grads_of(attend, len(args))(*args) if grads else ((), attend(*args))


# The oracle's own reading of the dense arrays (not the helpers' that flaxattn's side uses).
def _dense_mask(b, h, q_idx, kv_idx, allowed_BHTS):
  return allowed_BHTS[b, h, q_idx, kv_idx]


def _dense_logits(score, b, h, q_idx, kv_idx, bias_BHTS, cap):
  """The peer's logits: the scaled score plus the bias, then tanh clipping."""
  logits = score + bias_BHTS[b, h, q_idx, kv_idx]
  return logits if cap is None else cap * jnp.tanh(logits / cap)


# Module-level programs, so that cases of one shape and one kind of mask share a compile.
@functools.partial(jax.jit, static_argnames=("cap", "grads"))
def oracle_results(args, allowed_BHTS, cap, grads):
  """Attention written out on the folded arrays, the peer's mask and bias made dense."""
  def attend(q, k, v, bias=None):
    lead = q.shape[:-3]
    q, k, v = map(_fold, (q, k, v))
    mask = MaskMod(_dense_mask, allowed_BHTS)
    mod = None if bias is None else ScoreMod(functools.partial(_dense_logits, cap=cap),
                                             jnp.broadcast_to(bias, allowed_BHTS.shape))
    out, lse = dense_oracle(q, k, v, as_layout(None), mask, q.shape[-1] ** -0.5,
                            soft_cap=cap if bias is None else None, score_mod=mod)
    return _unfold(lead, out, lse)
  return _results(attend, args, grads)


@functools.partial(jax.jit, static_argnames=("backend", "cap", "call", "grads"))
def flaxattn_results(args, options, backend, cap, call, grads):
  """flaxattn on the case's arrays in the peer's shapes, with `options` saying its mask."""
  kwargs: dict[str, Any] = {**options, "backend": backend, "return_lse": True}
  if len(args) == 3 and cap is not None:
    kwargs["logit_soft_cap"] = cap

  def attend(q, k, v, bias=None):
    lead = q.shape[:-3]
    given = kwargs if bias is None else {**kwargs, "score_mod": array_bias(bias, cap)}
    if call == "halves":  # the peer's partial attention: two halves of the keys
      s = k.shape[1] // 2
      (o1, l1), (o2, l2) = (flaxattn.attention(q, k[:, part], v[:, part], **given)
                            for part in (slice(None, s), slice(s, None)))
      lse = jnp.logaddexp(l1, l2)
      out = o1 * jnp.exp(l1 - lse)[..., None] + o2 * jnp.exp(l2 - lse)[..., None]
      return out.astype(q.dtype), lse
    if call == "poisoned":  # NaN queries and keys, huge values in the padding
      q = jnp.where(_Q_VALID[:, :, None, None], q, jnp.nan)
      k = jnp.where(_K_VALID[:, :, None, None], k, jnp.nan)
      v = jnp.where(_K_VALID[:, :, None, None], v, jnp.finfo(jnp.float32).max)
    return _unfold(lead, *flaxattn.attention(_fold(q), _fold(k), _fold(v), **given))
  return _results(attend, args, grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_peer_case(case: Case, backend: str):
  *qkv, bias = _inputs(case)
  args = (*qkv, bias) if bias is not None else tuple(qkv)
  q, k = (_fold(x) for x in qkv[:2])
  allowed, options = _mask(case, q.shape[1], k.shape[1])
  dense = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
  allowed_BHTS = np.broadcast_to(True if allowed is None else allowed, dense)
  kernel, with_grads = BACKENDS[backend]
  grads = case.grads and with_grads
  want_g, want = oracle_results(args, allowed_BHTS, case.cap, case.grads)
  got = flaxattn_results(args, options, kernel, case.cap, case.call, grads)
  names = ("dq", "dk", "dv", "dbias")[:len(args) if grads else 0]
  assert_results_close(got, (want_g if grads else (), want), case.dtype, names)
