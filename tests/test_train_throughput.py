"""The trainer's model FLOPs and peak (`train.throughput`): a packed batch's FLOPs equal a
count of every allowed (query, key) pair, so its MFU cannot exceed what the device did."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import flaxattn
import helpers
from flaxattn.masks import band
from models.llama import Llama, LlamaConfig, flops_per_token, layer_masks
from train import throughput

MASKS = [flaxattn.Causal(), flaxattn.Local(5), flaxattn.Chunked(8), flaxattn.Full(),
         flaxattn.Chunked(8) & flaxattn.Local(3), flaxattn.Local(40), flaxattn.Window(3, 5),
         flaxattn.Window(0, 7, offset=2), flaxattn.Window(None, 2, offset=-6),
         flaxattn.Chunked(8) & flaxattn.Window(4, 0, offset=-1)]


def _packed(rng, rows: int, t: int) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids and positions of `rows` rows of `t` tokens: documents of random lengths
  (1 to t), padding between some and at the end."""
  seg, pos = np.zeros((rows, t), np.int32), np.zeros((rows, t), np.int32)
  for r in range(rows):
    i, doc = 0, 1
    while i < t:
      n = min(int(rng.integers(1, t // 2)), t - i)
      if rng.random() < 0.2:  # padding
        i += n
        continue
      seg[r, i:i + n], pos[r, i:i + n] = doc, np.arange(n)
      i, doc = i + n, doc + 1
  return seg, pos


def _brute_force_pairs(mask, seg, pos) -> int:
  """Every (query, key) pair of every row: same non-zero document, allowed by the mask."""
  total = 0
  for s, p in zip(seg, pos, strict=True):
    same = (s[:, None] == s[None, :]) & (s[:, None] != 0)
    total += int((same & np.asarray(mask.allows(p[:, None], p[None, :]))).sum())
  return total


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_pairs_per_document_equal_a_count_of_every_pair(mask):
  seg, pos = _packed(np.random.default_rng(0), rows=4, t=96)
  n = throughput.document_lengths(seg)
  assert n.sum() == (seg != 0).sum() and len(n) >= 8
  want = _brute_force_pairs(mask, seg, pos)
  assert int(band(mask).pairs(n).sum()) == want
  # the closed form is the per-token count the load balancing weighs tokens with
  assert int(flaxattn.balance.token_work(seg, [mask]).sum()) == want


def _model(**options) -> Llama:
  cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96,
                    max_seq_len=256, **options)
  return nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("options", [
    {}, dict(sliding_window=5, global_every=2), dict(chunk_size=8, global_every=4),
    dict(tie_embeddings=False, scan_layers=True)], ids=str)
def test_batch_flops_of_a_packed_batch_with_mixed_masks(options):
  """Matmuls per token that is not padding, plus 12 x H x D per allowed pair of each layer:
  against the brute-force count, and against `flops_per_token` (its matmul term; each row
  one causal document) for rows that are one document each."""
  model = _model(**options)
  masks = layer_masks(model.config)
  flops = throughput.Flops(model, masks)
  seg, pos = _packed(np.random.default_rng(1), rows=3, t=64)
  pairs = sum(_brute_force_pairs(m, seg, pos) for m in masks)
  per_pair = 12 * model.config.n_heads * model.config.attn_head_dim
  got = flops.of(seg)
  assert got == pytest.approx(flops.per_token * (seg != 0).sum() + per_pair * pairs, rel=1e-12)
  whole = np.ones((2, 64), np.int32)
  if not options:  # causal: flops_per_token counts T / 2 keys a query; a row has T (T + 1) / 2
    assert flops.of(whole) == pytest.approx(
        2 * 64 * (flops_per_token(model.config, 64) + per_pair * len(masks) / 2), rel=1e-12)
  # each row as one causal document: far more than a packed batch's
  assert got <= flops_per_token(model.config, 64) * seg.size


def test_measured_peak_is_per_device_with_the_devices_sharing_the_cores():
  """Eight simulated devices share this host's cores: each gets a fraction of what one
  device alone gets, and the peak says so."""
  cpus = helpers.devices(8)
  assert all(d.platform == "cpu" for d in cpus)  # a GPU host's tests: its simulated CPUs

  def mesh(n):
    return jax.make_mesh((n,), ("d",), axis_types=(AxisType.Auto,), devices=cpus[:n])
  one = throughput.peak(mesh(1), 0.0)
  eight = throughput.peak(mesh(8), 0.0)
  assert one is not None and eight is not None and eight.source == "measured"
  assert eight.flops < 0.75 * one.flops, (eight, one)
  assert throughput.peak(mesh(8), 123.0) == throughput.Peak(123e12, "config")
