"""Random packed layouts for tests: documents of uneven length, padding tails, short docs."""

from __future__ import annotations

import numpy as np


def random_packing(rng: np.random.Generator, batch: int, length: int, *, max_docs: int = 6,
                   pad_tail: int = 0, min_len: int = 1):
  """Segment ids and positions `[batch, length]` int32.

  Each row holds up to `max_docs` documents of random lengths (some as short as `min_len`)
  followed by `pad_tail` padding tokens (segment 0). Document ids count up from 1.
  """
  seg = np.zeros((batch, length), np.int32)
  pos = np.zeros((batch, length), np.int32)
  used = length - pad_tail
  for b in range(batch):
    n_docs = int(rng.integers(1, max_docs + 1))
    cuts = np.sort(rng.choice(np.arange(min_len, used), size=min(n_docs - 1, used - min_len),
                              replace=False)) if n_docs > 1 else np.array([], int)
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [used]])
    for n, (s, e) in enumerate(zip(starts, ends)):
      seg[b, s:e] = n + 1
      pos[b, s:e] = np.arange(e - s)
  return seg, pos


# Ids a legal layout may use besides small positive ones: negative, the largest int32, and a
# few reused on separate runs of a row (one document to the mask, however far apart).
ODD_IDS = (1, 2, 3, -5, 2**31 - 1, 77)


def legal_layout(rng: np.random.Generator, batch: int, length: int, kv_length: int | None = None):
  """Segment ids and positions that `flaxattn.attention` accepts but no packing pipeline
  produces: ids from `ODD_IDS` (repeated on separate runs, negative, huge), padding runs
  anywhere, documents of one token, positions with gaps, restarts and offsets.

  Returns `(seg, pos)` `[batch, length]` int32, or with `kv_length` also the keys'
  `(kv_seg, kv_pos)` `[batch, kv_length]`, whose ids only partly overlap the queries' (some
  documents have queries but no keys, others keys but no queries).
  """
  def side(n, ids):
    seg = np.zeros((batch, n), np.int32)
    pos = np.zeros((batch, n), np.int32)
    for b in range(batch):
      i = 0
      while i < n:
        run = min(n - i, int(rng.choice([1, rng.integers(1, 9), rng.integers(8, 48)])))
        seg[b, i:i + run] = 0 if rng.random() < 0.15 else rng.choice(ids)
        steps = rng.integers(1, 4, run) if rng.random() < 0.3 else np.ones(run, np.int64)
        start = rng.integers(0, 40) if rng.random() < 0.3 else 0
        pos[b, i:i + run] = start + np.cumsum(steps) - steps[0]
        i += run
    return seg, pos

  if kv_length is None:
    return side(length, ODD_IDS)
  return side(length, ODD_IDS[:4]) + side(kv_length, ODD_IDS[2:])
