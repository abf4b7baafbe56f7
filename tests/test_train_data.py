"""The trainer on corpora it cannot fully train on, in subprocesses (`trainer.TINY`): no
usable training or held-out documents (a config error at once, where the pipeline used
to search forever), and records that are not text (skipped and counted, or a config error
that lists them)."""

from __future__ import annotations

import json
import shutil
import zlib

import pytest

from trainer import checkpoints, clean_env, command, losses, run, train


@pytest.mark.slow  # runs the trainer
@pytest.mark.parametrize("split", ["train", "eval"])
def test_corpus_without_usable_documents_is_a_config_error(tmp_path, split):
  """Every training document (or every held-out one) is empty or one byte, so no piece
  has a next-token target: exit 2 naming the key to change, in seconds, before the
  run_dir is created."""
  corpus, run_dir = tmp_path / "corpus", tmp_path / "run"
  corpus.mkdir()
  for i in range(20):
    (corpus / f"doc{i:02d}.txt").write_text("x" if split == "train" else "long enough " * 30)
  (corpus / "empty.txt").write_text("")
  (corpus / "a.txt").write_text("x")
  # With this fraction no name's hash is held out, so the trainer holds out the first
  # document, a.txt, alone (asserted here with the same hash).
  fraction = 1e-5
  assert all(zlib.crc32(p.name.encode()) % 100_000 >= fraction * 100_000
             for p in corpus.iterdir())
  proc = run(command(run_dir, f"data.source={corpus}", f"data.eval_fraction={fraction}"),
             timeout=60)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  key = "data.source" if split == "train" else "data.eval_fraction"
  assert f"config error: {key}" in proc.stderr and "empty or shorter" in proc.stderr, proc.stderr
  assert not run_dir.exists()


def _corpus_with_bad_records(corpus) -> list[str]:
  """A `.jsonl` of good lines and five bad ones, a good and a binary `.txt`; returns the
  names the trainer gives the bad records."""
  corpus.mkdir()
  words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
  good = [json.dumps({"text": " ".join(words[(i + j) % 10] for j in range(60))}).encode()
          for i in range(30)]
  bad = [b"not json", json.dumps({"txt": "no text key"}).encode(),
         json.dumps({"text": 5}).encode(), b"[1, 2]", b'{"text": "\xff\xfe not UTF-8"}']
  lines = good[:]
  for i, line in enumerate(bad):
    lines.insert(1 + 6 * i, line)
  (corpus / "corpus.jsonl").write_bytes(b"\n".join(lines) + b"\n")
  (corpus / "good.txt").write_text(" ".join(words * 30))
  (corpus / "binary.txt").write_bytes(bytes(range(256)) * 4)
  return ["binary.txt"] + [f"corpus.jsonl line {2 + 6 * i}" for i in range(len(bad))]


@pytest.mark.slow  # runs the trainer
def test_bad_records_are_skipped_and_counted(tmp_path):
  """Five bad `.jsonl` lines (not JSON, no "text", a number for "text", not an object, not
  UTF-8) and a binary `.txt` among good documents: the run trains past them and counts
  them in a warning, and so does its resume (after a kill past step 4, simulated by
  removing step 6); data.bad_records=error refuses the corpus with a config error that
  names them."""
  corpus, run_dir, log = tmp_path / "corpus", tmp_path / "run", tmp_path / "log.txt"
  bad = _corpus_with_bad_records(corpus)
  env = clean_env()  # with the session's compilation cache: the resume reuses it
  out = train(run_dir, f"data.source={corpus}", "steps=6", log=log, env=env)
  assert "skipped 6 bad records of 37 (data.bad_records=skip)" in out, out[-4000:]
  assert all(name in out for name in bad[:5]), out[-4000:]
  shutil.rmtree(run_dir / "checkpoints" / "6")
  out = train(run_dir, f"data.source={corpus}", "steps=6", log=log, env=env)
  assert "resumed from step 4 " in out and "skipped 6 bad records" in out, out[-4000:]
  assert sorted(losses(run_dir)) == list(range(1, 7)) and checkpoints(run_dir)[-1] == 6

  proc = run(command(tmp_path / "strict", f"data.source={corpus}", "data.bad_records=error"))
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "config error: data.source" in proc.stderr and "has 6 records" in proc.stderr
  assert all(name in proc.stderr for name in bad[:5]) and "data.bad_records=skip" in proc.stderr
