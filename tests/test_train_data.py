"""The trainer on corpora it cannot fully train on, in subprocesses (`trainer.TINY`): no
usable training or held-out documents (a config error at once, where the pipeline used
to search forever), and records that are not text (skipped and counted, or a config error
that lists them)."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

import corpora
from train import config, distributed
from train import run_dir as run_dir_lib
from train.data import BadRecord
from train.stop import StopRequest
from trainer import (
  checkpoints,
  clean_env,
  command,
  losses,
  refused,
  run,
  train,
  two_processes,
)


def _hash(text: str) -> int:
  """The content hash the held-out split orders documents by (`train.data.sources`)."""
  return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@pytest.mark.slow  # runs the trainer
@pytest.mark.parametrize("split", ["train", "eval"])
def test_corpus_without_usable_documents_is_a_config_error(tmp_path, split):
  """Every training document (or every held-out one) is empty or one byte, so no piece
  has a next-token target: exit 2 naming the key to change, in seconds, before the
  run_dir is created."""
  corpus, run_dir = tmp_path / "corpus", tmp_path / "run"
  corpus.mkdir()
  short = min(map(chr, range(33, 127)), key=_hash)  # the one-byte text of the smallest hash
  texts = [short, ""] + [f"long enough {i} " * 30 if split == "eval" else c
                         for i, c in enumerate("0123456789") if c != short]
  # With this fraction no text's hash is held out, so the trainer holds out the text of
  # the smallest hash alone: here `short` or the empty one.
  fraction = 1e-5
  assert min(texts, key=_hash) in (short, "") and min(map(_hash, texts)) > fraction * 2**64
  for i, text in enumerate(texts):
    (corpus / f"doc{i:02d}.txt").write_text(text)
  proc = run(command(run_dir, f"data.source={corpus}", f"data.eval_fraction={fraction}"),
             timeout=60)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  key = "data.source" if split == "train" else "data.eval_fraction"
  assert f"config error: {key}" in proc.stderr and "empty or shorter" in proc.stderr, proc.stderr
  assert not run_dir.exists()


def _snapshot(run_dir) -> dict[str, tuple[int, int]]:
  """Every file under `run_dir`: its size and modification time (ns)."""
  return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
          for p in sorted(run_dir.rglob("*"))}


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
  removing step 6); a resume on the corpus with a line inserted is refused (exit 2 naming
  the file, nothing written); data.bad_records=error refuses the corpus with a config error
  that names them."""
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

  # One line inserted at the top of the .jsonl: the saved data positions count documents of
  # the corpus as it was, so the resume is refused, naming the file, and nothing is written.
  before, lines = _snapshot(run_dir), (corpus / "corpus.jsonl").read_bytes()
  (corpus / "corpus.jsonl").write_bytes(b'{"text": "new"}\n' + lines)
  refused(command(run_dir, f"data.source={corpus}", "steps=8"), "config error: data.source",
          "corpus.jsonl", "changed", "resume=false")
  assert _snapshot(run_dir) == before
  (corpus / "corpus.jsonl").write_bytes(lines)

  proc = run(command(tmp_path / "strict", f"data.source={corpus}", "data.bad_records=error"))
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "config error: data.source" in proc.stderr and "has 6 records" in proc.stderr
  assert all(name in proc.stderr for name in bad[:5]) and "data.bad_records=skip" in proc.stderr


# The trainer, where process 1 reads texts/good.txt as another copy of it would hold.
PROCESS_1_READS_ANOTHER_COPY = (
    "import os, sys\n"
    "from train.data import sources\n"
    "if os.environ['JAX_PROCESS_ID'] == '1':\n"
    "  read = sources.TextFile._read\n"
    "  sources.TextFile._read = lambda self: read(self) + ('!' if self.name == 'texts/good.txt'"
    " else '')\n"
    "from train.__main__ import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.slow  # runs the trainer as two processes, three times
def test_odd_corpus_on_two_processes(tmp_path):
  """`corpora.odd_corpus` (every format, plain and compressed, every kind of odd record)
  trained on by two processes (gloo, 2 CPU devices each, a data axis across them: each
  process reads its own shard): both skip and count the same bad records, name the same
  files not read, and train 4 steps with evals. Where one process reads another copy of a
  file, both refuse the corpus; once a file has changed, both refuse to resume (exit 2,
  naming it)."""
  corpus, run_dir = tmp_path / "corpus", tmp_path / "run"
  expected = corpora.odd_corpus(corpus)
  logs = [tmp_path / f"process{i}.txt" for i in range(2)]
  overrides = (f"data.source={corpus}", "steps=4", "eval_every=2", "batch_size=2",
               "mesh.data=2", "mesh.context=2")
  outs = two_processes(run_dir, logs, *overrides)
  skipped = f"skipped {len(expected.problems)} bad records of"
  unread = f"{len(expected.unread)} file(s) not read"
  assert all(skipped in out and unread in out for out in outs), outs[0][-4000:]
  assert sorted(losses(run_dir)) == [1, 2, 3, 4] and sorted(losses(run_dir, "eval_loss")) == [2, 4]
  outs = two_processes(run_dir, logs, *overrides, "steps=6", returncode=2,
                       main=PROCESS_1_READS_ANOTHER_COPY)
  assert all("lists other files or contents on some processes" in out for out in outs), outs[0]
  (corpus / "texts" / "good.txt").write_text("changed")
  outs = two_processes(run_dir, logs, *overrides, "steps=6", returncode=2)
  assert all("config error: data.source" in out and "changed: texts/good.txt" in out
             for out in outs), outs[0][-4000:]


def test_a_resume_compares_the_corpus_with_the_one_saved(tmp_path):
  """`run_dir_lib.check_corpus`: a resume (config.json saved) on the saved corpus goes through;
  on one with a file changed, new or gone it is a config error naming each; a corpus.json
  that does not read is one too; resume=false, or a run_dir without config.json (no
  checkpoint yet), compares nothing."""
  cfg = config.load(None, [f"run_dir={tmp_path}", "data.source=corpus"])
  run_dir_lib.save_corpus(str(tmp_path), {"a.jsonl": "1", "b.txt": "2", "c.txt": "3"})
  run_dir_lib.check_corpus(cfg, {"a.jsonl": "9"})  # no config.json: no checkpoint to continue
  run_dir_lib.save_config(cfg)
  run_dir_lib.check_corpus(cfg, {"a.jsonl": "1", "b.txt": "2", "c.txt": "3"})
  with pytest.raises(config.ConfigError) as e:
    run_dir_lib.check_corpus(cfg, {"a.jsonl": "1", "b.txt": "5", "d.txt": "4"})
  assert "(changed: b.txt; new: d.txt; gone: c.txt)" in str(e.value), e.value
  run_dir_lib.check_corpus(config.load(None, [f"run_dir={tmp_path}", "resume=false"]), {})
  (tmp_path / "corpus.json").write_text("[1]")
  with pytest.raises(config.ConfigError, match="corpus.json, the fingerprint of the run's"):
    run_dir_lib.check_corpus(cfg, {})


@pytest.mark.parametrize("elsewhere", [0, 1, 2, 3])
def test_a_changed_file_stops_every_process_alike(monkeypatch, elsewhere):
  """`StopRequest.call` (every read of the pipeline) where a document read is not the text
  listed (BadRecord: a corpus file changed under the run) on this process or another: each
  process raises a BadRecord after the agreement (which the others wait in), whatever the
  others met (nothing: 0, a config error: 1, a stop: 2, a BadRecord: 3), so that all save
  the same step and exit alike; one from another process names no file but says where to
  look."""
  agreed = []
  monkeypatch.setattr(distributed, "process_max",
                      lambda value: agreed.append(value) or max(value, elsewhere))

  def changed():
    raise BadRecord("a.jsonl changed after the corpus was listed")

  stop = StopRequest()
  try:
    with pytest.raises(BadRecord, match="^a.jsonl changed"):
      stop.call(changed)
    assert len(agreed) == 1
    if elsewhere == 3:
      with pytest.raises(BadRecord, match="read on another process .see its log"):
        stop.call(lambda: "a batch")
  finally:
    stop.close()
