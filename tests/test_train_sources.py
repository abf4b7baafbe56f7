"""Corpus readers (`train.data.sources`) and the document order (`train.data.pipeline.order`)
on generated parquet shards and `.jsonl` files; and a trainer run on a parquet corpus
several times larger than its own peak memory."""

from __future__ import annotations

import collections
import gzip
import json
import shutil
import sys

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import corpora
from train import demo_tokenizer
from train.config import ConfigError, DataConfig
from train.data import (
  list_documents,
  order,
  pipeline,
  shard,
  sources,
  split_documents,
  streams,
  tokenizers,
)
from trainer import TIMEOUT, command, run

GROUP = 4  # rows per row group of the small corpora


def _write_shards(root, shards: int = 3, rows: int = 20, group: int = GROUP, **columns):
  """`shards` parquet files of `rows` rows ("shard s row r ..." texts) in row groups of
  `group`, plus `columns` (name -> a function of (shard, row)); returns root."""
  root.mkdir(exist_ok=True)
  for s in range(shards):
    table = {"text": [f"shard {s} row {r} " + "word " * (r % 7 + 3) for r in range(rows)]}
    table.update({k: [f(s, r) for r in range(rows)] for k, f in columns.items()})
    pq.write_table(pa.table(table), root / f"part-{s}.parquet", row_group_size=group)
  return root


def test_parquet_rows_are_documents_named_by_shard_and_row(tmp_path):
  root = _write_shards(tmp_path / "corpus")
  docs = list_documents(str(root))
  assert [d.name for d in docs] == [f"part-{s}.parquet:{r}" for s in range(3) for r in range(20)]
  assert docs[27].read() == "shard 1 row 7 " + "word " * 3
  # The held-out split hashes names, so it does not depend on how rows are grouped.
  regrouped = list_documents(str(_write_shards(tmp_path / "regrouped", group=7)))
  held = [d.name for d in split_documents(docs, 0.2)[1]]
  assert held == [d.name for d in split_documents(regrouped, 0.2)[1]] and 0 < len(held) < 60


def test_null_rows_follow_bad_records(tmp_path, caplog):
  root = tmp_path / "corpus"
  root.mkdir()
  texts = [None if r in (2, 9) else f"row {r} text" for r in range(12)]
  pq.write_table(pa.table({"text": texts}), root / "a.parquet", row_group_size=GROUP)
  (root / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\nnot json\n")
  docs = list_documents(str(root))
  assert [d.name for d in docs] == [f"a.parquet:{r}" for r in range(12) if r not in (2, 9)] + [
      "b.jsonl:0"]
  assert "skipped 3 bad records of 14" in caplog.text
  with pytest.raises(ConfigError, match="has 3 records") as e:
    list_documents(str(root), bad_records="error")
  assert "a.parquet row 2: null 'text'; a.parquet row 9" in str(e.value)
  assert "b.jsonl line 2: not JSON" in str(e.value)


def test_text_field_names_the_column_or_field(tmp_path):
  root = _write_shards(tmp_path / "corpus", shards=1, body=lambda s, r: f"body {r}",
                       number=lambda s, r: r)
  (root / "c.jsonl").write_text(json.dumps({"body": "from jsonl"}) + "\n")
  docs = list_documents(str(root), text_field="body")
  assert [d.read() for d in docs[:2]] == ["from jsonl", "body 0"]
  with pytest.raises(ConfigError) as e:
    list_documents(str(root), text_field="content")
  assert all(s in str(e.value) for s in ("'data.text_field'", "'content'", "part-0.parquet",
                                         "['text', 'body', 'number']")), e.value
  with pytest.raises(ConfigError, match="expects a column of strings.*int64"):
    list_documents(str(root), text_field="number")
  (root / "broken.parquet").write_bytes(b"not parquet at all")
  with pytest.raises(ConfigError, match="broken.parquet: not a parquet file pyarrow can read"):
    list_documents(str(root), bad_records="error")


def test_block_shuffle_reads_each_row_group_once_per_epoch(tmp_path, monkeypatch):
  """Shuffled parquet documents: every epoch is a permutation of the documents, new each
  epoch and the same for the same seed; read in order, an epoch decodes each row group
  once, and the cache never holds more than `BLOCK_CACHE` groups."""
  docs = list_documents(str(_write_shards(tmp_path / "corpus", shards=4, rows=40)))
  decoded = collections.Counter()
  read_group = sources.ParquetFile.read_group

  def counted(self, group):
    decoded[self.name, group] += 1
    assert len(sources.BLOCKS.blocks) <= sources.BLOCK_CACHE
    return read_group(self, group)

  monkeypatch.setattr(sources.ParquetFile, "read_group", counted)
  monkeypatch.setattr(sources, "BLOCKS", sources._Blocks(sources.BLOCK_CACHE))
  ds, n = order(docs, seed=3, shuffle=True), len(docs)
  epochs = [[ds[e * n + i].name for i in range(n)] for e in range(3)]
  assert all(sorted(e) == sorted(d.name for d in docs) for e in epochs)
  assert len({tuple(e) for e in epochs}) == 3
  assert epochs[0] == [order(docs, seed=3, shuffle=True)[i].name for i in range(n)]
  assert epochs[0] != [order(docs, seed=4, shuffle=True)[i].name for i in range(n)]
  assert epochs[0][:GROUP] != [d.name for d in docs[:GROUP]]
  for i in range(n):
    ds[n + i].read()
  assert sorted(decoded.values()) == [1] * (4 * 40 // GROUP), decoded


def test_shards_take_whole_row_groups(tmp_path):
  """Three processes' shards of parquet documents (split first: row groups with held-out
  rows): disjoint, together all documents, each row group in one shard; `.txt` documents
  are dealt one by one, as every count-th."""
  root = _write_shards(tmp_path / "corpus", shards=2, rows=30)
  for i in range(5):
    (root / f"doc{i}.txt").write_text(f"text {i}")
  docs = split_documents(list_documents(str(root)), 0.1)[0]
  parts = [shard(docs, i, 3) for i in range(3)]
  names = [[d.name for d in p] for p in parts]
  assert sorted(sum(names, [])) == sorted(d.name for d in docs)
  owner = {}
  for i, part in enumerate(names):
    for name in part:
      file, _, row = name.partition(":")
      block = (file, int(row) // GROUP if row else 0)  # a row group, or a text file
      assert owner.setdefault(block, i) == i, (block, owner[block], i)
  # The text files sort first, so they are the first blocks: dealt one to each shard in turn.
  texts = [d.name for d in docs if d.name.endswith(".txt")]
  assert [d.name for d in docs[:len(texts)]] == texts
  assert [[n for n in part if n.endswith(".txt")] for part in names] == [
      texts[i::3] for i in range(3)]


def test_parquet_pipeline_resumes_from_its_state(tmp_path):
  docs = list_documents(str(_write_shards(tmp_path / "corpus", rows=60)))
  tok = tokenizers.ByteTokenizer()

  def batches():
    return iter(pipeline(docs, tok, DataConfig(read_threads=2), seq_len=64, batch=2, seed=0,
                         shard_index=0, shard_count=1, shuffle=True))

  it = batches()
  for _ in range(5):
    next(it)
  state = it.get_state()
  want = [next(it)["tokens"] for _ in range(4)]
  resumed = batches()
  resumed.set_state(state)
  for w in want:
    np.testing.assert_array_equal(next(resumed)["tokens"], w)


# The trainer's `main`, then the process's peak resident memory.
# The trainer's own peak: VmHWM, the high-water mark of the process image since exec.
# getrusage's ru_maxrss would not do: Linux carries the forking process's peak across exec,
# so a child of a pytest worker that has grown to gigabytes reports the worker's peak.
MAIN_REPORTING_PEAK_RSS = (
    "import re, sys\n"
    "from train.__main__ import main\n"
    "rc = main(sys.argv[1:])\n"
    "status = open('/proc/self/status').read()\n"
    "print('PEAK_RSS_KIB', re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1))\n"
    "sys.exit(rc)\n")
DOC_BYTES = 1 << 16
CORPUS_GIB = 3.5


def _write_large_corpus(root, gib: float) -> int:
  """Parquet shards of `gib` GiB of text (64 KiB documents of random letters, 16 per row
  group, 512 per shard), uncompressed and without statistics: the bytes on disk are the
  text's, and listing must decode every row group to find nulls. Returns the bytes written."""
  root.mkdir()
  rng = np.random.default_rng(0)
  letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      ", np.uint8)
  pool = letters[rng.integers(0, len(letters), 64 << 20)]  # rotated: a new text per shard
  per_shard, docs = 512, int(gib * (1 << 30)) // DOC_BYTES
  for s in range(0, docs, per_shard):
    k = min(per_shard, docs - s)
    data = np.roll(pool, s * 4099)[:k * DOC_BYTES]
    offsets = np.arange(k + 1, dtype=np.int32) * DOC_BYTES
    text = pa.StringArray.from_buffers(k, pa.py_buffer(offsets), pa.py_buffer(data))
    pq.write_table(pa.table({"text": text}), root / f"shard-{s // per_shard:04d}.parquet",
                   row_group_size=16, compression="none", use_dictionary=False,
                   write_statistics=False)
  return sum(p.stat().st_size for p in root.iterdir())


@pytest.mark.slow  # writes 3.5 GiB and runs the trainer
def test_parquet_corpus_larger_than_memory_trains_in_bounded_memory(tmp_path):
  """A 3.5 GiB parquet corpus, listed (every row group decoded, one at a time) and trained
  on for 8 steps: the trainer's peak resident memory stays below a third of the corpus."""
  corpus = tmp_path / "corpus"
  try:
    size = _write_large_corpus(corpus, CORPUS_GIB)
    run_dir = tmp_path / "run"
    proc = run([sys.executable, "-c", MAIN_REPORTING_PEAK_RSS, *command(run_dir)[3:],
                f"data.source={corpus}", "steps=8"], timeout=TIMEOUT)
  finally:
    shutil.rmtree(corpus, ignore_errors=True)  # pytest keeps the last runs' tmp_path
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  peak = int(proc.stdout.split("PEAK_RSS_KIB ")[1].split()[0]) * 1024
  print(f"corpus {size / 2**20:.0f} MiB, trainer peak RSS {peak / 2**20:.0f} MiB")
  assert size >= 3 * peak, (size, peak)


def test_every_kind_of_odd_record_is_listed_as_documented(tmp_path, caplog, monkeypatch):
  """`corpora.odd_corpus`: every format, plain, gzip and zstd, with every kind of odd record
  (see corpora.py). Listing keeps exactly the documents it should, each read back as its
  text (compressed files in blocks); names each bad record with its reason, and each file
  it does not read."""
  monkeypatch.setattr(streams, "BLOCK_BYTES", 1 << 14)  # many blocks per compressed file
  expected = corpora.odd_corpus(tmp_path / "corpus")
  docs = list_documents(str(tmp_path / "corpus"))
  got = {d.name: d.read() for d in docs}
  for file, texts in expected.prefixes.items():
    kept = [got.pop(f"{file}:{i}") for i in range(len(texts)) if f"{file}:{i}" in got]
    assert 0 < len(kept) < len(texts) and kept == texts[:len(kept)], file
  assert sorted(got) == sorted(expected.texts)
  assert got == expected.texts
  problems = [p for source in docs.sources for p in source.problems]
  for where, why in expected.problems.items():
    found = [p for p in problems if p.startswith(where)]
    assert len(found) == 1 and why in found[0], (where, why, found)
  assert len(problems) == len(expected.problems), problems
  unread = f"{len(expected.unread)} file(s) not read"
  assert unread in caplog.text and all(n in caplog.text for n in expected.unread), caplog.text
  assert f"skipped {len(problems)} bad records of {len(problems) + len(docs)}" in caplog.text
  with pytest.raises(ConfigError, match=f"has {len(problems)} records that cannot be trained"):
    list_documents(str(tmp_path / "corpus"), bad_records="error")
  print(f"{expected.cases} cases")


@pytest.mark.parametrize("kind", ["bytes", "tokenizer.json", "sentencepiece"])
def test_every_tokenizer_encodes_every_document_listed(tmp_path, kind):
  """Each tokenizer (bytes; a tokenizer.json and a SentencePiece model trained on a little
  of the standard library) encodes every document `corpora.odd_corpus` lists: what listing
  lets through is what the tokenizers accept."""
  texts = demo_tokenizer.corpus(20_000)
  if kind == "bytes":
    tok = tokenizers.ByteTokenizer()
  elif kind == "tokenizer.json":
    demo_tokenizer.save_bpe(demo_tokenizer.train_bpe(texts, 300), str(tmp_path / "hf"), True,
                            True)
    tok = tokenizers.make(str(tmp_path / "hf"))
  else:
    spm = pytest.importorskip("sentencepiece", reason="needs the sentencepiece extra")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter("\n".join(texts).splitlines()), model_prefix=str(tmp_path / "sp"),
        vocab_size=400, model_type="bpe", byte_fallback=True, minloglevel=2)
    tok = tokenizers.make(str(tmp_path / "sp.model"))
  corpora.odd_corpus(tmp_path / "corpus")
  listed = {d.read() for d in list_documents(str(tmp_path / "corpus"))}  # each text once
  assert sum(len(tok.document(text)) for text in listed) > len(listed)


def test_held_out_documents_stay_held_out_when_the_corpus_changes(tmp_path):
  """The held-out split hashes each document's text: a line inserted at the top of a
  .jsonl, lines appended, a new file and a file renamed keep every held-out document held
  out (and every training one in training); a duplicate of a held-out text is held out
  too, so no held-out text is trained on."""
  root = tmp_path / "corpus"
  root.mkdir()
  lines = [json.dumps({"text": f"document {i}"}) for i in range(400)]
  (root / "a.jsonl").write_text("\n".join(lines) + "\n")
  (root / "b.txt").write_text("a text file")

  def split() -> tuple[set[str], set[str]]:
    train, held = split_documents(list_documents(str(root)), 0.1)
    return {d.read() for d in train}, {d.read() for d in held}

  train, held = split()
  assert 20 < len(held) < 80
  (root / "a.jsonl").write_text("\n".join([json.dumps({"text": "new first"}), *lines,
                                           json.dumps({"text": "document 7"}),
                                           json.dumps({"text": "appended"})]) + "\n")
  (root / "b.txt").rename(root / "renamed.txt")
  (root / "c.jsonl").write_text("\n".join(lines[:50]) + "\n")  # duplicates
  new_train, new_held = split()
  assert held <= new_held and train <= new_train and not new_train & new_held


def test_records_that_no_tokenizer_encodes_are_bad_records(tmp_path):
  """A .jsonl text with a lone surrogate (valid JSON) and a parquet string with invalid
  UTF-8 (from a writer that does not check it) are bad records at listing: skipped and
  counted, or refused with data.bad_records=error, never read into the pipeline."""
  root = tmp_path / "corpus"
  root.mkdir()
  (root / "a.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\ud800 surrogate"}\n')
  data, offsets = b"good" + b"bad \xff", np.array([0, 4, 9], np.int32)
  column = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(offsets.tobytes()),
                                                  pa.py_buffer(data)])
  pq.write_table(pa.table({"text": column}), root / "b.parquet")
  docs = list_documents(str(root))
  assert [d.name for d in docs] == ["a.jsonl:0", "b.parquet:0"]
  with pytest.raises(ConfigError, match="has 2 records") as e:
    list_documents(str(root), bad_records="error")
  assert "a.jsonl line 2: holds a lone surrogate (U+D800" in str(e.value)
  assert "b.parquet row 1: 'text' is not UTF-8" in str(e.value)


def test_a_dictionary_column_is_text(tmp_path):
  """A parquet dictionary<string> column (a pandas categorical) is read as text."""
  root = tmp_path / "corpus"
  root.mkdir()
  column = pa.array(["red", "green", None, "red"]).dictionary_encode()
  pq.write_table(pa.table({"text": column}), root / "a.parquet")
  assert [d.read() for d in list_documents(str(root))] == ["red", "green", "red"]


def test_files_are_matched_in_any_case_and_the_others_named(tmp_path, caplog):
  """.JSONL, .json (JSON Lines, or a JSON array), .jsonl.gz, .txt.zst and the like are read
  beside a .txt; the files not read are named in a warning with their count; a source with
  no file to read is a config error that names them."""
  root = tmp_path / "corpus"
  root.mkdir()
  records = "\n".join(json.dumps({"text": f"record {i}"}) for i in range(3)).encode()
  (root / "README.txt").write_text("readme")
  (root / "a.JSONL").write_bytes(records)
  (root / "b.json").write_bytes(records)
  (root / "c.json").write_text(json.dumps([{"text": "in an array"}]))
  (root / "d.jsonl.gz").write_bytes(gzip.compress(records))
  (root / "e.Txt.Zst").write_bytes(zstandard.ZstdCompressor().compress(b"zstd text"))
  (root / "f.csv").write_text("text\nnot read\n")
  (root / "g.jsonl.bz2").write_bytes(b"not read")
  texts = sorted(d.read() for d in list_documents(str(root)))
  assert texts == sorted(["readme", "in an array", "zstd text"] + [f"record {i}" for i in
                                                                    range(3)] * 3)
  assert "2 file(s) not read" in caplog.text and "f.csv; g.jsonl.bz2" in caplog.text
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.md").write_text("x")
  with pytest.raises(ConfigError, match="holds no file the trainer reads.*notes.md"):
    list_documents(str(other))


def test_compressed_files_are_decompressed_once_per_epoch(tmp_path, monkeypatch):
  """.jsonl.gz and .jsonl.zst files of many blocks, shuffled over two epochs and read in
  that order from two threads, as the pipeline reads them: each document read is its text,
  and each file is decompressed once per epoch (one decompressor started per file and
  epoch), not up to each record; the cache never holds more than `BLOCK_CACHE` blocks."""
  monkeypatch.setattr(streams, "BLOCK_BYTES", 1 << 12)
  monkeypatch.setattr(sources, "BLOCKS", sources._Blocks(sources.BLOCK_CACHE))
  monkeypatch.setattr(streams, "CURSORS", streams.Cursors())
  root = tmp_path / "corpus"
  root.mkdir()
  texts = [f"record {i} " + "word " * (i % 40) for i in range(2000)]
  data = "\n".join(json.dumps({"text": t}) for t in texts).encode()
  (root / "a.jsonl.gz").write_bytes(gzip.compress(data))
  (root / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
  docs = list_documents(str(root))
  assert all(len(np.unique(s.blocks(s.good))) > 50 for s in docs.sources)
  started = collections.Counter()
  cursor = streams._Cursor

  def counted(path):
    started[path.name] += 1
    assert len(sources.BLOCKS.blocks) <= sources.BLOCK_CACHE
    return cursor(path)

  monkeypatch.setattr(streams, "_Cursor", counted)
  ds = order(docs, seed=0, shuffle=True).to_iter_dataset(
      grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
  read = [(d.name, d.read()) for _, d in zip(range(2 * len(docs)), ds, strict=False)]
  assert all(text == texts[int(name.split(":")[1])] for name, text in read)
  names = sorted(d.name for d in docs)
  assert sorted(n for n, _ in read[:len(docs)]) == sorted(n for n, _ in read[len(docs):]) == names
  assert started == {"a.jsonl.gz": 2, "b.jsonl.zst": 2}, started


def test_a_line_longer_than_the_limit_is_a_bad_record(tmp_path, monkeypatch):
  """A JSON line longer than `MAX_RECORD_BYTES` (a file without line breaks) is a bad
  record, not held in memory, in a plain and a compressed file; the lines after it are
  read. A file that cannot be opened (a broken link) is a config error naming it."""
  monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 1000)
  root = tmp_path / "corpus"
  root.mkdir()
  data = b"\n".join([b'{"text": "before"}', json.dumps({"text": "x" * 5000}).encode(),
                     b'{"text": "after"}'])
  (root / "a.jsonl").write_bytes(data)
  (root / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
  docs = list_documents(str(root))
  assert [(d.name, d.read()) for d in docs] == [
      ("a.jsonl:0", "before"), ("a.jsonl:2", "after"), ("b.jsonl.zst:0", "before"),
      ("b.jsonl.zst:2", "after")]
  assert [p for s in docs.sources for p in s.problems] == [
      f"{n} line 2: longer than 1000 bytes" for n in ("a.jsonl", "b.jsonl.zst")]
  (root / "c.txt").symlink_to(tmp_path / "missing.txt")
  with pytest.raises(ConfigError, match="cannot read c.txt .FileNotFoundError"):
    list_documents(str(root))
