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
