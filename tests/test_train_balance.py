"""The trainer's `data.balance`: per-document and row load balancing train on the same
tokens, so the losses agree at every step up to reduction order."""

from __future__ import annotations

import math

import pytest

from trainer import kill_group, losses, metrics, start, wait


@pytest.mark.slow
def test_document_balance_matches_row_balance(tmp_path):
  runs = {name: (tmp_path / name, tmp_path / f"{name}.txt") for name in ("document", "row")}
  procs = {name: start(run_dir, "steps=4", "checkpoint_every=0", "eval_every=0",
                       # a window in one layer of two: the plan weighs both masks
                       "model.n_layers=2", "model.sliding_window=64", "model.global_every=2",
                       f"data.balance={name}", log=log)
           for name, (run_dir, log) in runs.items()}
  try:
    outs = {name: wait(p, runs[name][1]) for name, p in procs.items()}
  finally:
    for p in procs.values():
      if p.poll() is None:
        kill_group(p)
  for name, p in procs.items():
    assert p.returncode == 0, outs[name][-4000:]
  got, want = losses(runs["document"][0]), losses(runs["row"][0])
  assert sorted(got) == [1, 2, 3, 4] and all(math.isfinite(v) for v in got.values()), got
  assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (got, want)
  assert all(r["tokens_per_s"] > 0 for r in metrics(runs["document"][0]) if "tokens_per_s" in r)
  assert any("tokens_per_s" in r for r in metrics(runs["document"][0]))
