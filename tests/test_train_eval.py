"""The eval's loss by position in the segment (`train.evaluation`), in process on a tiny
model; the trainer's records of it are in test_train.py."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from helpers import random_packing
from models.llama import Llama, LlamaConfig, make_targets, token_losses
from train.evaluation import eval_step, position_bounds, summary


@pytest.mark.parametrize("seq_len, bounds", [
    (4096, (256, 512, 1024, 2048, 4096)), (3000, (256, 512, 1024, 2048, 3000)),
    (256, (32, 64, 128, 256)), (100, (12, 24, 48, 96, 100)), (4, (1, 2, 4))])
def test_position_bounds_double_up_to_seq_len(seq_len, bounds):
  assert position_bounds(seq_len) == bounds


def test_eval_step_buckets_each_token_by_its_position():
  """Two batches of packed rows (positions restart per segment, padding weighs nothing):
  each bucket's sums are those of the tokens whose position falls in it, computed here
  from `token_losses` with numpy; the summary's buckets, weighted by their tokens, give
  its eval_loss."""
  model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                            ffn_dim=64), rngs=nnx.Rngs(0))
  bounds = np.asarray(position_bounds(128))  # 16, 32, 64, 128
  totals, want = {}, {"loss_sum_K": np.zeros(4), "tokens_K": np.zeros(4)}
  for seed in (0, 1):
    segment_ids, positions = random_packing(seed, 2, 128, max_docs=3, pad_tail=9)
    tokens = np.random.default_rng(seed).integers(0, 64, (2, 128)).astype(np.int32)
    targets, weights = make_targets(tokens, segment_ids)
    batch = {"tokens": tokens, "targets": targets, "weights": weights,
             "segment_ids": segment_ids, "positions": positions}
    sums = {k: np.asarray(v, np.float64) for k, v in eval_step(model, batch).items()}
    ce = np.asarray(token_losses(model, batch), np.float64)
    bucket = np.searchsorted(bounds, positions, side="right")
    for k in range(4):
      w = weights * (bucket == k)
      want["loss_sum_K"][k] += np.sum(ce * w)
      want["tokens_K"][k] += np.sum(w)
    totals = {k: totals.get(k, 0.0) + v for k, v in sums.items()}
  assert positions.max() >= 64 and all(want["tokens_K"] > 0), want  # every bucket is used
  np.testing.assert_allclose(totals["loss_sum_K"], want["loss_sum_K"], rtol=1e-5)
  np.testing.assert_array_equal(totals["tokens_K"], want["tokens_K"])
  out = summary(totals, 128)
  assert list(out["eval_loss_by_position"]) == ["16", "32", "64", "128"]
  mean = sum(out["eval_loss_by_position"][b] * out["eval_tokens_by_position"][b]
             for b in out["eval_loss_by_position"]) / out["eval_tokens"]
  assert mean == pytest.approx(out["eval_loss"], rel=1e-12)
  assert out["eval_loss"] == pytest.approx(np.sum(want["loss_sum_K"]) / out["eval_tokens"],
                                           rel=1e-5)
  assert sum(out["eval_tokens_by_position"].values()) == out["eval_tokens"]
