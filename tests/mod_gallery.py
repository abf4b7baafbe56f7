"""The patterns of attention-gym's gallery (the FlexAttention examples) written as flaxattn
`MaskMod`s and `ScoreMod`s, with operands drawn for a batch: the cases of the conformance
suite (test_conformance.py) and of the context-parallel one (test_context_parallel.py).

A pattern builds `(mask, score_mod)` for a batch of `b` rows, `h` heads and `t` tokens from
a seed. `packed`: run it with random documents as segment ids on top (the document pattern
brings its own as an operand instead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

import flaxattn
from flaxattn import MaskMod, ScoreMod

CAP = 20.0  # the soft cap of the soft-cap patterns


@dataclasses.dataclass(frozen=True)
class Pattern:
  name: str
  make: Callable[[int, int, int, int], tuple[flaxattn.Mask, ScoreMod | None]]
  packed: bool = True

  def __str__(self):
    return self.name


def _rng(seed: int):
  return np.random.default_rng(seed)


def causal(b, h, t, seed):
  return MaskMod(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx), None


def sliding_window(b, h, t, seed):
  w = t // 8
  return MaskMod(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < w)), None


def prefix_lm(b, h, t, seed):
  """A bidirectional prefix of its own length in every row, causal after it."""
  prefix_B = jnp.asarray(_rng(seed).integers(0, t, b), jnp.int32)
  return MaskMod(lambda b, h, q_idx, kv_idx, prefix: (kv_idx <= q_idx) | (kv_idx < prefix[b]),
                 prefix_B), None


def document(b, h, t, seed):
  """Causal inside documents given as an operand of ids `[B, T]` (not as segment ids)."""
  starts_BT = _rng(seed).random((b, t)) < 6 / t
  docs_BT = jnp.asarray(np.cumsum(starts_BT, axis=1), jnp.int32)
  return MaskMod(lambda b, h, q_idx, kv_idx, docs: (docs[b, q_idx] == docs[b, kv_idx])
                 & (kv_idx <= q_idx), docs_BT), None


def dilated_window(b, h, t, seed):
  w = t // 4
  return MaskMod(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < w)
                 & ((q_idx - kv_idx) % 2 == 0)), None


def per_head_window(b, h, t, seed):
  window_H = jnp.asarray(_rng(seed).integers(1, t, h), jnp.int32)
  return MaskMod(lambda b, h, q_idx, kv_idx, window: (kv_idx <= q_idx)
                 & (q_idx - kv_idx < window[h]), window_H), None


def local_or_prefix(b, h, t, seed):
  """A built-in window OR a per-row prefix: the union flaxattn could not express before."""
  prefix_B = jnp.asarray(_rng(seed).integers(0, t // 2, b), jnp.int32)
  return flaxattn.Local(t // 8) | MaskMod(lambda b, h, q_idx, kv_idx, prefix: kv_idx < prefix[b],
                                          prefix_B), None


def alibi(b, h, t, seed):
  slopes_H = jnp.asarray(2.0 ** (-8.0 * np.arange(1, h + 1) / h), jnp.float32)
  return flaxattn.Causal(), ScoreMod(
      lambda score, b, h, q_idx, kv_idx, slopes: score - slopes[h] * (q_idx - kv_idx), slopes_H)


def t5_bucket(distance, buckets: int = 16, exact: int = 8, far: int = 128):
  """T5's relative position bucket of a causal distance >= 0: `exact` buckets of one
  distance each, then logarithmic up to `far`, the last bucket beyond."""
  d = jnp.maximum(distance, 1).astype(jnp.float32)
  log = exact + jnp.log(d / exact) / np.log(far / exact) * (buckets - exact)
  return jnp.where(distance < exact, distance,
                   jnp.minimum(log.astype(jnp.int32), buckets - 1)).astype(jnp.int32)


def t5_bias(b, h, t, seed):
  table_NH = jnp.asarray(_rng(seed).standard_normal((16, h)), jnp.float32)
  return flaxattn.Causal(), ScoreMod(
      lambda score, b, h, q_idx, kv_idx, table: score + table[t5_bucket(q_idx - kv_idx), h],
      table_NH)


def soft_cap(b, h, t, seed):
  return flaxattn.Causal(), ScoreMod(
      lambda score, b, h, q_idx, kv_idx: CAP * jnp.tanh(score / CAP))


def soft_cap_and_bias(b, h, t, seed):
  bias_H = jnp.asarray(_rng(seed).standard_normal(h), jnp.float32)
  return flaxattn.Causal(), ScoreMod(
      lambda score, b, h, q_idx, kv_idx, bias: CAP * jnp.tanh(score / CAP) + bias[h], bias_H)


PATTERNS = [
    Pattern("causal", causal),
    Pattern("sliding-window", sliding_window),
    Pattern("prefix-lm", prefix_lm),
    Pattern("document", document, packed=False),
    Pattern("dilated-window", dilated_window),
    Pattern("per-head-window", per_head_window),
    Pattern("local-or-prefix", local_or_prefix),
    Pattern("alibi", alibi),
    Pattern("t5-bias", t5_bias),
    Pattern("soft-cap", soft_cap),
    Pattern("soft-cap-and-bias", soft_cap_and_bias),
]
