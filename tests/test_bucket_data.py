"""A run's data on a bucket (the `gcs_emulator` fixture: a GCS emulator on loopback): a
corpus of every format there lists and reads as its local copy, streamed (no file of it
reaches the local disk); a tokenizer.json there reads; the trainer trains from both,
resumes exactly, and `train.export` and `train.sample` read the run's copy of the tokenizer
on the bucket; a corpus file changed under the running trainer stops it with one line
naming the file, and a resume then refuses the changed corpus."""

from __future__ import annotations

import gzip
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import uuid

import grain
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from fsspec.spec import AbstractBufferedFile

import corpora
from gcs import checkpoints, create_bucket, delete, metrics, objects, upload_dir, write
from train import demo_tokenizer
from train.data import list_documents, order, sources, streams, tokenizers
from trainer import ROOT, TIMEOUT, clean_env, kill_group, poll, start, wait


@pytest.fixture
def no_local_files(tmp_path, monkeypatch):
  """An empty working directory and temporary directory for the test (`tempfile`'s and
  `TMPDIR`), which must hold nothing at its end."""
  work, temp = tmp_path / "work", tmp_path / "temp"
  work.mkdir()
  temp.mkdir()
  monkeypatch.chdir(work)
  monkeypatch.setattr(tempfile, "tempdir", str(temp))
  monkeypatch.setenv("TMPDIR", str(temp))
  yield
  assert not any(work.iterdir()) and not any(temp.iterdir()), (
      list(work.rglob("*")), list(temp.rglob("*")))


def test_a_corpus_on_a_bucket_reads_as_its_local_copy(gcs_emulator, storage_env, monkeypatch,
                                                      tmp_path, no_local_files):
  """`corpora.odd_corpus` (.txt, .jsonl and .json files, plain, .gz and .zst; parquet shards
  of several row groups; every kind of odd record) uploaded to gs://corpus/corpus/: listed
  from there, it has the documents, bad records and fingerprint of its local copy, and read
  as the pipeline reads (shuffled by blocks, two threads, compressed files in many blocks)
  each document is the local copy's text, parquet row groups read through file objects of
  the bucket's shards. Nothing is written to local disk."""
  local = tmp_path / "corpus"
  corpora.odd_corpus(local)
  create_bucket(gcs_emulator, "corpus")
  upload_dir(gcs_emulator, "corpus", local, "corpus")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
  monkeypatch.setattr(streams, "BLOCK_BYTES", 1 << 14)
  monkeypatch.setattr(sources, "BLOCKS", sources._Blocks(sources.BLOCK_CACHE))
  monkeypatch.setattr(streams, "CURSORS", streams.Cursors())
  want = list_documents(str(local))
  texts = {d.name: d.read() for d in want}
  shards, parquet_file = [], pq.ParquetFile

  def spied(source, *args, **kwargs):
    shards.append(source)
    return parquet_file(source, *args, **kwargs)

  monkeypatch.setattr(pq, "ParquetFile", spied)
  got = list_documents("gs://corpus/corpus")
  assert [d.name for d in got] == [d.name for d in want]
  assert [p for s in got.sources for p in s.problems] == [p for s in want.sources
                                                         for p in s.problems]
  assert got.fingerprint() == want.fingerprint()
  assert any(len(s.starts) > 2 for s in got.sources if isinstance(s, sources.ParquetFile))
  ds = order(got, seed=0, shuffle=True).to_iter_dataset(
      grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
  read = {d.name: d.read() for _, d in zip(range(len(got)), ds, strict=False)}
  assert read == texts
  # Parquet shards (listed, and each row group read back) through file objects of the
  # bucket's objects (gcsfs's), never a local copy.
  assert len(shards) > 12 and all(isinstance(f, AbstractBufferedFile) for f in shards)


def test_a_tokenizer_on_a_bucket_reads(gcs_emulator, storage_env, monkeypatch, tmp_path,
                                       no_local_files):
  """A Hugging Face tokenizer.json (with its tokenizer_config.json) in gs://tokenizer/tok/,
  named by its directory or by the file: the tokenizer of the local copy."""
  local = tmp_path / "tok"
  demo_tokenizer.save_bpe(demo_tokenizer.train_bpe(demo_tokenizer.corpus(20_000), 300),
                          str(local))
  create_bucket(gcs_emulator, "tokenizer")
  upload_dir(gcs_emulator, "tokenizer", local, "tok")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
  want = tokenizers.make(str(local))
  text = "def f(x):\n  return x  # \u00e9"
  for name in ("tok", "tok/tokenizer.json"):
    tok = tokenizers.make(f"gs://tokenizer/{name}", vocab_size=300)
    assert tok.files == want.files and len(tok.files) == 2
    assert (tok.begin, tok.end, tok.bos_id, tok.eos_id) == (want.begin, want.end, want.bos_id,
                                                            want.eos_id)
    assert tok.document(text).tolist() == want.document(text).tolist()


def _training_corpus(root: pathlib.Path, tag: str) -> dict[str, list[str]]:
  """Pieces of the standard library's source as documents in a .jsonl file (half of them),
  two .txt files, a .jsonl.gz, a .jsonl.zst and a parquet shard of row groups of 4, their
  names holding `tag`; returns each file's texts."""
  texts = [t[i:i + 1500] for t in demo_tokenizer.corpus(60_000) for i in range(0, len(t), 1500)]
  files = {f"a-{tag}.jsonl": texts[0::2], f"b-{tag}.txt": [texts[1]],
           f"sub/c-{tag}.txt": [texts[3]], f"d-{tag}.jsonl.gz": texts[5::8],
           f"e-{tag}.jsonl.zst": texts[7::8], f"f-{tag}.parquet": texts[9::8] + texts[11::8]}
  (root / "sub").mkdir(parents=True)
  for name, docs in files.items():
    lines = "\n".join(json.dumps({"text": t}) for t in docs).encode()
    if name.endswith(".parquet"):
      pq.write_table(pa.table({"text": docs}), root / name, row_group_size=4)
    elif name.endswith(".txt"):
      (root / name).write_text(docs[0])
    else:
      (root / name).write_bytes(gzip.compress(lines) if name.endswith(".gz") else
                                zstandard.ZstdCompressor().compress(lines)
                                if name.endswith(".zst") else lines)
  return files


@pytest.mark.slow  # runs the trainer
def test_the_trainer_on_a_bucket_corpus_and_tokenizer(gcs_emulator, tmp_path):
  """The trainer on a corpus and a tokenizer.json in a bucket, its run_dir there too, at a
  constant learning rate after warmup (a run of 4 steps and a longer one agree):
  - 4 steps; then, with the step-4 checkpoint and the original tokenizer deleted, a longer
    run resumes at step 2 (data position, corpus fingerprint and tokenizer copy from the
    bucket) and redoes steps 3 and 4 with the same losses and eval loss;
  - once it is past step 4 a corpus file is rewritten: it saves the steps done and exits 2
    with one line naming the file, no checkpoint moved; a resume is refused naming it;
  - `train.export` and `train.sample` read the run, with its copy of the tokenizer.
  The working directory, the temporary directory and tmp_path hold no file of the corpus."""
  url, tag = gcs_emulator, uuid.uuid4().hex[:8]
  bucket = "run"
  temp = tmp_path / "temp"
  temp.mkdir()
  env = clean_env(STORAGE_EMULATOR_HOST=url, TMPDIR=str(temp))
  create_bucket(url, bucket)
  local = tmp_path / "upload"
  files = _training_corpus(local / "corpus", tag)
  demo_tokenizer.save_bpe(demo_tokenizer.train_bpe(demo_tokenizer.corpus(20_000), 300),
                          str(local / "tok"))
  upload_dir(url, bucket, local, tag)
  run, bucket_run, corpus = f"{tag}/run", f"gs://{bucket}/{tag}/run", f"gs://{bucket}/{tag}/corpus"
  overrides = [f"data.source={corpus}", f"data.tokenizer=gs://{bucket}/{tag}/tok",
               "model.vocab_size=300", "optimizer.min_lr_ratio=1", "checkpoint.max_to_keep=100",
               "data.packing_bins=1"]  # 4 documents read ahead: a changed file is met soon
  log = tmp_path / "run.txt"
  proc = start(bucket_run, *overrides, "steps=4", log=log, env=env)
  out = wait(proc, log)
  assert proc.returncode == 0, out[-4000:]
  first = metrics(url, bucket, run)
  assert [r["step"] for r in first if "loss" in r] == [1, 2, 3, 4]
  for name in objects(url, bucket, f"{run}/checkpoints/4/") + objects(url, bucket, f"{tag}/tok/"):
    delete(url, bucket, name)

  changed = f"a-{tag}.jsonl"
  proc = start(bucket_run, *overrides, "steps=100000", log=log, env=env)
  try:
    poll(proc, log, lambda: "step 5/" in log.read_text(), "step 5")
    saved = checkpoints(url, bucket, run)
    write(url, bucket, f"{tag}/corpus/{changed}", "\n".join(
        json.dumps({"text": t.upper()}) for t in files[changed]).encode())
    out = wait(proc, log)
  finally:
    if proc.poll() is None:
      kill_group(proc)
  assert "resumed from step 2 " in out, out[-4000:]
  rows = metrics(url, bucket, run)[len(first):]
  for key in ("loss", "eval_loss"):
    redone = {r["step"]: r[key] for r in rows if key in r and r["step"] <= 4}
    print(f"{key}: first run {[(r['step'], r[key]) for r in first if key in r]}, resumed {redone}")
    assert redone == {r["step"]: r[key] for r in first if key in r and r["step"] > 2}
  last = out.strip().splitlines()[-1]
  stopped = re.findall(r"a file of data.source changed: saved step (\d+); exiting", out)
  print(f"{changed} rewritten after step 5: {stopped}; exit {proc.returncode}: {last}")
  assert proc.returncode == 2 and "Traceback" not in out, out[-4000:]
  assert last.startswith(f"data error: data.source '{corpus}': {changed} changed after the"
                         " corpus was listed"), last
  assert len(stopped) == 1 and set(saved) < set(after := checkpoints(url, bucket, run)), out
  assert after[-1] == int(stopped[0]) and not objects(url, bucket, f"{run}/checkpoints_unusable/")
  proc = start(bucket_run, *overrides, "steps=100000", log=log, env=env)
  out = wait(proc, log)
  last = out.strip().splitlines()[-1]
  print(f"the resume: exit {proc.returncode}: {last}")
  assert proc.returncode == 2 and last.startswith(
      f"config error: data.source '{corpus}' is not the corpus that run_dir '{bucket_run}'"
      f" saved its data positions in (changed: {changed})"), out[-4000:]

  assert {f"{run}/tokenizer/{n}" for n in ("tokenizer.json", "tokenizer_config.json")} <= set(
      objects(url, bucket, f"{run}/tokenizer/")) and not objects(url, bucket, f"{tag}/tok/")
  export = subprocess.run([sys.executable, "-m", "train.export", bucket_run,
                           str(tmp_path / "export")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
  assert export.returncode == 0, export.stderr[-4000:]
  assert ((tmp_path / "export" / "tokenizer.json").read_bytes()
          == (local / "tok" / "tokenizer.json").read_bytes())
  sample = subprocess.run([sys.executable, "-m", "train.sample", bucket_run, "--prompt",
                           "def ", "--max_new_tokens", "4"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
  assert sample.returncode == 0 and sample.stdout.startswith("def "), sample.stderr[-4000:]

  local_files = [p for where in (ROOT, tmp_path, temp) for p in where.rglob(f"*{tag}*")
                 if local not in p.parents]
  assert not local_files and not any(temp.iterdir()), (local_files, list(temp.rglob("*")))
