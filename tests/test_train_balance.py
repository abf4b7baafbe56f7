"""The trainer's `data.balance`: per-document and row load balancing train on the same
tokens, so the losses agree at every step up to reduction order."""

from __future__ import annotations

import math

import pytest

import helpers
from trainer import losses, metrics, train_together


@pytest.mark.slow
def test_document_balance_matches_row_balance(tmp_path):
  # a window in one layer of two: the plan weighs both masks
  common = ["steps=4", "checkpoint_every=0", "eval_every=0", "model.n_layers=2",
            "model.sliding_window=64", "model.global_every=2"]
  train_together(tmp_path, {name: [*common, f"data.balance={name}"]
                            for name in ("document", "row")})
  got, want = losses(tmp_path / "document"), losses(tmp_path / "row")
  assert sorted(got) == [1, 2, 3, 4] and all(math.isfinite(v) for v in got.values()), got
  assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (got, want)
  assert all(r["tokens_per_s"] > 0 for r in metrics(tmp_path / "document") if "tokens_per_s" in r)
  assert any("tokens_per_s" in r for r in metrics(tmp_path / "document"))


def test_balance_choices_and_the_context_parallel_they_set():
  devices = helpers.devices(8)
  from train import config  # pylint: disable=import-outside-toplevel
  with pytest.raises(config.ConfigError, match="'data.balance' expects one of 'document'"):
    config.load("configs/demo.yaml", ["data.balance=rows"])
  from train import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  on_8 = ["mesh.data=2", "batch_size=2"]  # the 8 devices tests see: data 2 x context 4
  for balance, expected in (("document", "document"), ("row", True), ("none", False)):
    cfg = config.load("configs/demo.yaml", [*on_8, f"data.balance={balance}"])
    assert mesh_lib.make(cfg, devices).cp.load_balance == expected
  # Row and document order need seq_len divisible by 2 x 4 chunks (the model's layers
  # index the tokens by the dual chunk in either: 4092 died at step 1 under "document");
  # without balancing, by the 4 shards.
  for balance in ("row", "document"):
    cfg = config.load("configs/demo.yaml", [*on_8, "seq_len=4092", f"data.balance={balance}"])
    with pytest.raises(config.ConfigError, match=rf"seq_len \(4092\) expects a multiple of 8"
                       rf" .*data.balance={balance}; set seq_len=4096 or 4088") as e:
      mesh_lib.make(cfg, devices)
    assert e.value.keys == ("seq_len",)
  mesh_lib.make(config.load("configs/demo.yaml", [*on_8, "seq_len=4092", "data.balance=none"]),
                devices)
