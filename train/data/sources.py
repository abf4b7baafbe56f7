"""Corpus files -> documents: one reader per format behind one protocol, `Source`.

A source is one file's records with random access, in the shape of grain's
`RandomAccessDataSource` (`__len__`, `__getitem__`), plus what listing and shuffling need:
a stable name per record (the held-out split hashes it), the records that can be trained on
(checked once, when the source is opened), and the block each record is read in.

  format     a record               its name           its block
  .txt       the whole file         file               the file
  .jsonl     a non-blank line       file:line          the line
  .parquet   a row of a row group   file:row           the row group

`.jsonl.gz` / `.jsonl.zst` are not read: a compressed stream has no random access (reading
line n decompresses everything before it). Parquet row groups are read on demand and kept
decoded in one small cache shared by every parquet source (`ROW_GROUP_CACHE` groups), never
a whole shard; the pipeline shuffles parquet documents by row group plus a window
(`train.data.pipeline`) so that each group is decoded about once per epoch.
"""

from __future__ import annotations

import bisect
import collections
import collections.abc
import dataclasses
import json
import logging
import pathlib
import re
import sysconfig
import threading
import typing
import zlib
from typing import Protocol

import numpy as np

from train.config import ConfigError

log = logging.getLogger(__name__)

# A text file with more undecodable bytes than this share is not UTF-8 text (binary, or
# another encoding); fewer are a few damaged characters, read as U+FFFD.
MAX_UNDECODABLE = 0.01
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes that `surrogateescape` kept
# Decoded parquet row groups kept at once (all sources together): enough for the window the
# pipeline shuffles in and its read-ahead, a few groups.
ROW_GROUP_CACHE = 8


class BadRecord(ValueError):
  """A record that cannot be trained on; the message says why."""


class Source(Protocol):
  """The records of one corpus file. `good`: the indices of the records that can be trained
  on, in order (int64); `problems`: a line per record that cannot (both found when it was
  opened)."""

  name: str
  good: np.ndarray
  problems: list[str]

  def __len__(self) -> int:
    """Records in the file, bad ones included."""
    ...

  def __getitem__(self, index: int) -> str:
    """The text of record `index`; raises BadRecord if it is no longer valid (the file
    changed since it was opened)."""
    ...

  def record_name(self, index: int) -> str:
    """A name of record `index` that is the same on every machine."""
    ...

  def blocks(self, indices: np.ndarray) -> np.ndarray:
    """The block each record of `indices` is read in (int64): records of a block are cheap to
    read together."""
    ...


@dataclasses.dataclass(frozen=True)
class Document:
  """Record `index` of `source`."""

  source: Source
  index: int

  @property
  def name(self) -> str:
    return self.source.record_name(self.index)

  def read(self) -> str:
    """The document's text (a few undecodable bytes of a text file read as U+FFFD).

    Raises:
      BadRecord: the record is no longer valid (its file changed since listing).
    """
    return self.source[self.index]


class Documents(collections.abc.Sequence):
  """Documents as two arrays: for each, its source (an index into `sources`) and its record
  in it; a `Document` is made when one is read. 16 bytes a document: a corpus of many
  millions of rows is listed in memory. Slicing and boolean or index arrays give
  `Documents` of the same sources."""

  def __init__(self, sources: list[Source], source_ids: np.ndarray, records: np.ndarray):
    self.sources, self.source_ids, self.records = sources, source_ids, records

  def __len__(self) -> int:
    return len(self.records)

  @typing.overload
  def __getitem__(self, i: int) -> Document: ...
  @typing.overload
  def __getitem__(self, i: slice | np.ndarray) -> Documents: ...

  def __getitem__(self, i):
    if isinstance(i, slice | np.ndarray):
      return Documents(self.sources, self.source_ids[i], self.records[i])
    return Document(self.sources[self.source_ids[i]], int(self.records[i]))

  def block_starts(self) -> np.ndarray:
    """Where each run of consecutive documents of one block begins (`Source.blocks`: a
    parquet row group; else each document is one), then `len(self)`; int64."""
    blocks = np.zeros(len(self), np.int64)
    by_source = np.argsort(self.source_ids, kind="stable")
    ids = self.source_ids[by_source]
    for run in np.split(by_source, np.flatnonzero(ids[1:] != ids[:-1]) + 1):  # a source's
      blocks[run] = self.sources[self.source_ids[run[0]]].blocks(self.records[run])
    new = (self.source_ids[1:] != self.source_ids[:-1]) | (blocks[1:] != blocks[:-1])
    return np.concatenate([[0], 1 + np.flatnonzero(new), [len(self)]]).astype(np.int64)


def _check_text(raw: bytes) -> None:
  """BadRecord if the bytes of a text file are binary or mostly not UTF-8."""
  if b"\0" in raw:
    raise BadRecord("binary (holds NUL bytes)")
  try:
    raw.decode("utf-8")
  except UnicodeDecodeError:
    bad = len(_UNDECODABLE.findall(raw.decode("utf-8", errors="surrogateescape")))
    if bad > MAX_UNDECODABLE * len(raw):
      raise BadRecord(f"not UTF-8 text ({bad} of {len(raw)} bytes undecodable)") from None


class TextFile:
  """A `.txt` (or the standard library's `.py`) file: one document."""

  def __init__(self, path: pathlib.Path, name: str):
    self.path, self.name = path, name
    try:
      _check_text(path.read_bytes())
      self.good, self.problems = np.zeros(1, np.int64), []
    except BadRecord as e:
      self.good, self.problems = np.zeros(0, np.int64), [f"{name}: {e}"]

  def __len__(self) -> int:
    return 1

  def __getitem__(self, index: int) -> str:
    return self.path.read_bytes().decode("utf-8", errors="replace")

  def record_name(self, index: int) -> str:
    return self.name

  def blocks(self, indices: np.ndarray) -> np.ndarray:
    return np.zeros(len(indices), np.int64)


def _record_text(line: bytes, field: str) -> str:
  """The string `field` of a JSON object `line`, or BadRecord."""
  try:
    record = json.loads(line)
  except UnicodeDecodeError:
    raise BadRecord("not UTF-8") from None
  except json.JSONDecodeError as e:
    raise BadRecord(f"not JSON ({e.msg})") from None
  if not isinstance(record, dict) or not isinstance(record.get(field), str):
    raise BadRecord(f"not a JSON object with a string {field!r}")
  return record[field]


class JsonlFile:
  """A `.jsonl` file: a document per non-blank line, its string `text_field`. Holds the byte
  offset of each line."""

  def __init__(self, path: pathlib.Path, name: str, text_field: str):
    self.path, self.name, self.field = path, name, text_field
    lines, offsets, good, self.problems = [], [], [], []
    offset = 0
    with open(path, "rb") as f:
      for i, line in enumerate(f):
        if line.strip():
          try:
            _record_text(line, text_field)
            good.append(len(lines))
          except BadRecord as e:
            self.problems.append(f"{name} line {i + 1}: {e}")
          lines.append(i)
          offsets.append(offset)
        offset += len(line)
    self.lines, self.offsets = np.asarray(lines, np.int64), np.asarray(offsets, np.int64)
    self.good = np.asarray(good, np.int64)

  def __len__(self) -> int:
    return len(self.lines)

  def __getitem__(self, index: int) -> str:
    with open(self.path, "rb") as f:
      f.seek(int(self.offsets[index]))
      line = f.readline()
    try:
      return _record_text(line, self.field)
    except BadRecord as e:
      raise BadRecord(f"{self.record_name(index)}: {e}; the file changed after the corpus was"
                      " listed.") from None

  def record_name(self, index: int) -> str:
    return f"{self.name}:{self.lines[index]}"

  def blocks(self, indices: np.ndarray) -> np.ndarray:
    return np.asarray(indices, np.int64)


def _pyarrow_parquet(path: pathlib.Path):
  try:
    import pyarrow.parquet as pq  # an optional extra: only parquet corpora need it
  except ImportError:
    raise ConfigError(f"data.source holds parquet shards ({path}), which need the pyarrow"
                      " package: pip install 'flaxattn[parquet]' (or pyarrow).") from None
  return pq


class _RowGroups:
  """Decoded parquet row groups, the `size` used last, shared by every parquet source
  (the pipeline reads from several threads)."""

  def __init__(self, size: int):
    self.size, self.lock, self.groups = size, threading.Lock(), collections.OrderedDict()

  def get(self, source: ParquetFile, group: int):
    key = (source.path, group)
    with self.lock:
      if key in self.groups:
        self.groups.move_to_end(key)
        return self.groups[key]
    # Decoded outside the lock: other threads' cached reads need not wait for it.
    column = source.read_group(group)
    with self.lock:
      self.groups[key] = column
      while len(self.groups) > self.size:
        self.groups.popitem(last=False)
    return column


ROW_GROUPS = _RowGroups(ROW_GROUP_CACHE)


class ParquetFile:
  """A `.parquet` shard: a document per row, its string column `text_field`; rows are read
  a row group at a time, through `ROW_GROUPS`. A null value is a bad record. Holds the first
  row of each row group. Listing reads the shard's footer, and decodes only the row groups
  whose statistics do not say they hold no nulls.

  Raises:
    ConfigError: pyarrow is missing; the file is not parquet; it has no column
      `text_field`, or not one of strings.
  """

  def __init__(self, path: pathlib.Path, name: str, text_field: str):
    pq = _pyarrow_parquet(path)
    self.path, self.name, self.field = path, name, text_field
    try:
      meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged footer
      why = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise ConfigError(f"data.source: {path} is not a parquet file pyarrow can read ({why});"
                        " remove it from the corpus directory or replace it.") from None
    schema = meta.schema.to_arrow_schema()
    if text_field not in schema.names:
      raise ConfigError(f"config key 'data.text_field' ({text_field!r}) names no column of"
                        f" {path}, whose columns are {schema.names}; set data.text_field to"
                        " the column that holds the text.")
    kind = schema.field(text_field).type
    import pyarrow as pa
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
      raise ConfigError(f"config key 'data.text_field' ({text_field!r}) expects a column of"
                        f" strings, but in {path} it holds {kind}; set data.text_field to the"
                        " column that holds the text.")
    self.starts = [0]
    for g in range(meta.num_row_groups):
      self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
    good, self.problems = [], []
    column = next(i for i in range(meta.num_columns) if meta.schema.column(i).path == text_field)
    for g in range(meta.num_row_groups):
      stats = meta.row_group(g).column(column).statistics
      if stats is not None and stats.has_null_count and stats.null_count == 0:
        good.append(np.arange(self.starts[g], self.starts[g + 1]))  # no need to decode it
        continue
      valid = np.asarray(self.read_group(g).is_valid())  # one group decoded at a time
      good.append(self.starts[g] + np.flatnonzero(valid))
      self.problems += [f"{name} row {self.starts[g] + i}: null {text_field!r}"
                        for i in np.flatnonzero(~valid)]
    self.good = np.concatenate(good or [np.zeros(0)]).astype(np.int64)

  def read_group(self, group: int):
    """Row group `group`'s text column, decoded (an arrow array of strings)."""
    pq = _pyarrow_parquet(self.path)
    return pq.ParquetFile(self.path).read_row_group(group, columns=[self.field]).column(0)

  def __len__(self) -> int:
    return self.starts[-1]

  def __getitem__(self, index: int) -> str:
    group = bisect.bisect_right(self.starts, index) - 1
    text = ROW_GROUPS.get(self, group)[index - self.starts[group]].as_py()
    if text is None:
      raise BadRecord(f"{self.record_name(index)}: null {self.field!r}; the file changed after"
                      " the corpus was listed.")
    return text

  def record_name(self, index: int) -> str:
    return f"{self.name}:{index}"

  def blocks(self, indices: np.ndarray) -> np.ndarray:
    return np.searchsorted(self.starts, indices, side="right") - 1


READERS = {".txt": TextFile, ".jsonl": JsonlFile, ".parquet": ParquetFile}


def _open(path: pathlib.Path, name: str, text_field: str) -> Source:
  if path.suffix in (".txt", ".py"):  # .py: the standard library's files
    return TextFile(path, name)
  return READERS[path.suffix](path, name, text_field)


def _stdlib_files() -> tuple[pathlib.Path, list[pathlib.Path]]:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "dist-packages"}  # installed packages, not the standard library
  return root, [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)]


def list_documents(source: str, bad_records: str = "skip",
                   text_field: str = "text") -> Documents:
  """All documents of `source` ("stdlib" or a directory of `.txt`, `.jsonl` and `.parquet`
  files, read recursively in sorted order), in a deterministic order.

  Every record is checked here, so that a bad one cannot stop training when the pipeline
  reaches it (and again at each resume): with `bad_records` "skip" (see
  `DataConfig.bad_records`) bad records are left out and counted in a warning.

  Args:
    text_field: the field (`.jsonl`) or column (`.parquet`) holding a document's text.

  Raises:
    ConfigError: the directory does not exist or holds no usable documents; bad records with
      `bad_records` "error"; a parquet shard without a string column `text_field` (or
      pyarrow missing).
  """
  if source == "stdlib":
    root, files = _stdlib_files()
  else:
    root = pathlib.Path(source)
    if not root.is_dir():
      raise ConfigError(f"data.source expects 'stdlib' or a directory, got {source!r}"
                        " (not a directory).")
    files = [p for p in root.rglob("*") if p.suffix in READERS and p.is_file()]
  opened, problems = [], []
  for path in sorted(files):
    opened.append(_open(path, path.relative_to(root).as_posix(), text_field))
    problems += opened[-1].problems
  docs = Documents(opened, np.repeat(np.arange(len(opened), dtype=np.int32),
                                     [len(src.good) for src in opened]),
                   np.concatenate([src.good for src in opened] or [np.zeros(0, np.int64)]))
  if problems:
    more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
    shown = "; ".join(problems[:5]) + more
    if bad_records == "error":
      raise ConfigError(f"data.source {source!r} has {len(problems)} records that cannot be"
                        f" trained on: {shown}. Fix or remove them, or set"
                        " data.bad_records=skip to leave them out.")
    log.warning("data.source %r: skipped %d bad records of %d (data.bad_records=skip): %s",
                source, len(problems), len(problems) + len(docs), shown)
  if not docs:
    raise ConfigError(f"data.source {source!r} holds no documents (.txt files, .jsonl lines"
                      f" or .parquet rows with a string {text_field!r}).")
  return docs


def split_documents(docs: Documents, eval_fraction: float) -> tuple[Documents, Documents]:
  """(train, eval): a document is held out when the hash of its name falls in
  `eval_fraction`; at least one is held out when `eval_fraction` > 0.

  Raises:
    ConfigError: nothing left to train on.
  """
  held = np.asarray([zlib.crc32(d.name.encode()) % 100_000 < eval_fraction * 100_000
                     for d in docs], bool)
  if eval_fraction > 0 and not held.any():
    held[0] = True
  if held.all():
    raise ConfigError(f"data.eval_fraction={eval_fraction} leaves no training documents.")
  return docs[~held], docs[held]
