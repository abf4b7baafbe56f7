"""Corpus files -> documents: one reader per format behind one protocol, `Source`.

A source is one file's records with random access, in the shape of grain's
`RandomAccessDataSource` (`__len__`, `__getitem__`), plus what listing and shuffling need:
a name per record for messages, the records that can be trained on and a hash of each
one's content (both found once, when the source is opened), and the block each record is
read in. Files are listed, opened and read through `train.storage` (local paths and
`gs://` URLs alike), never copied to local disk: a record of a plain file is one ranged
read, a parquet row group is read through a file object of its shard.

  file name (any case)          a record                         its block
  .txt[.gz|.zst]                the whole file                   the file
  .jsonl[.gz|.zst]              a non-blank line                 the line; compressed: a block
  .json[.gz|.zst]               a line (JSON Lines), or an       as .jsonl
                                element of a top-level array
  .parquet                      a row                            its row group

Every other file under `data.source` is named in a warning, with their count.

`.json` is what the tools that write it mean by it: JSON Lines (`datasets`' `to_json`,
pandas' `to_json(lines=True)`) when its first non-blank character is not `[`, else one JSON
array of objects (pandas' `orient="records"`), which listing parses whole (memory: a few
times the file). A `.json` file that is neither is a bad record (see below).

Compressed files (`.gz`, `.zst`) are streamed (`train.data.streams`): listed in one pass,
their records read back in blocks of about `streams.BLOCK_BYTES` decompressed bytes, which
the shuffle reads in stream order (`train.data.pipeline.order`). A compressed `.txt` is one
document, decompressed whole when read, as a plain one is read whole.

Bad records. A record that cannot be trained on is found when its file is listed, so that
it can never stop a run inside the pipeline (and again at each resume): a `.jsonl` line that
is not UTF-8 JSON, not an object, or whose text field is missing, null or not a string; a
text with a lone surrogate (valid JSON, `"\\ud800"`, but no tokenizer encodes it: text that
encodes to UTF-8 is what every tokenizer here accepts); a line longer than
`MAX_RECORD_BYTES`; a `.txt` that holds NUL bytes or is mostly not UTF-8 (a few undecodable
bytes read as U+FFFD); a null or invalid UTF-8 parquet value, or a row group that does not
decode; a file that is not parquet; a compressed stream that ends early or does not
decompress (a stream that ends early keeps the records before that point; one whose bytes
are damaged, none). `list_documents` skips and counts
them, or refuses the corpus (`data.bad_records`). A UTF-8 byte order mark starting a file is
not part of its text; empty documents are listed, and give no training piece.

Content hashes. Each record's hash (64 bits of BLAKE2b of its text's UTF-8 bytes) decides
the held-out split (`split_documents`): a document stays held out (or in training) when
lines are inserted before it, files are added, renamed or regrouped, and every copy of a
duplicated text is on the same side, so no held-out text is also trained on. The hashes of
a file's documents, in order, with the blocks they share, make its digest
(`Documents.fingerprint`): what a saved data position depends on, which a resume compares
(`train.run_dir.check_corpus`). A record read back is checked against its hash, so a file
changed under a running job stops it at that record (BadRecord, naming the file), never
trains on other text.

Parquet row groups, and the blocks of compressed files, are read on demand and kept decoded
in one small cache shared by every source (`BLOCK_CACHE` blocks), never a whole shard.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import hashlib
import itertools
import json
import logging
import re
import sysconfig
import threading
import typing
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
from etils import epath

from train import storage
from train.config import ConfigError
from train.data import streams

log = logging.getLogger(__name__)

# A text file with more undecodable bytes than this share is not UTF-8 text (binary, or
# another encoding); fewer are a few damaged characters, read as U+FFFD.
MAX_UNDECODABLE = 0.01
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes that `surrogateescape` kept
# A JSON record longer than this is a bad record: a file without line breaks (binary, or
# one huge value) is not held in memory as one line.
MAX_RECORD_BYTES = 1 << 28
# Decoded blocks (parquet row groups, blocks of compressed files) kept at once, all sources
# together: enough for the window the pipeline shuffles in and its read-ahead.
BLOCK_CACHE = 8
BOM = b"\xef\xbb\xbf"
TEXT_FORMATS = (".txt", ".jsonl", ".json")  # read plain or compressed (`streams.COMPRESSIONS`)
FORMATS = TEXT_FORMATS + (".parquet",)
_SHOWN = 5  # bad records named in a message that lists them
_SHOWN_FILES = 20  # files named in the warning of files not read


class BadRecord(ValueError):
  """A record that cannot be trained on; the message says why."""


class Source(Protocol):
  """The records of one corpus file, found when it was opened: `good`, the indices of the
  records that can be trained on, in order (int64); `hashes`, each record's content hash
  (uint64: of its text's UTF-8 bytes; 0 for a bad record); `problems`, a line per bad
  record; `ordered`, whether its blocks are read in order (a compressed stream)."""

  name: str
  good: np.ndarray
  hashes: np.ndarray
  problems: list[str]
  ordered: bool

  def __len__(self) -> int:
    """Records in the file, bad ones included."""
    ...

  def __getitem__(self, index: int) -> str:
    """The text of record `index`; raises BadRecord if it is no longer the text listed
    (the file changed since it was opened)."""
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
      BadRecord: the record is no longer the text listed (its file changed since listing).
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

  def _by_source(self) -> Iterator[tuple[Source, np.ndarray]]:
    """(a source, the positions of its documents here) for each source with documents."""
    by_source = np.argsort(self.source_ids, kind="stable")
    ids = self.source_ids[by_source]
    for run in np.split(by_source, np.flatnonzero(ids[1:] != ids[:-1]) + 1):
      if len(run):
        yield self.sources[self.source_ids[run[0]]], run

  def hashes(self) -> np.ndarray:
    """Each document's content hash (`Source.hashes`), uint64."""
    out = np.zeros(len(self), np.uint64)
    for source, run in self._by_source():
      out[run] = source.hashes[self.records[run]]
    return out

  def block_starts(self) -> np.ndarray:
    """Where each run of consecutive documents of one block begins (`Source.blocks`: a
    parquet row group, a block of a compressed file; else each document is one), then
    `len(self)`; int64."""
    blocks = np.zeros(len(self), np.int64)
    for source, run in self._by_source():
      blocks[run] = source.blocks(self.records[run])
    new = (self.source_ids[1:] != self.source_ids[:-1]) | (blocks[1:] != blocks[:-1])
    return np.concatenate([[0], 1 + np.flatnonzero(new), [len(self)]]).astype(np.int64)

  def fingerprint(self) -> dict[str, str]:
    """For each listed file (every source, whatever part of it is here), a digest of what a
    data position depends on: its trainable records' content hashes in order, and which of
    them share a block (which the shuffle keeps together)."""
    out = {}
    for source in self.sources:
      digest = hashlib.blake2b(digest_size=16)
      digest.update(source.hashes[source.good].tobytes())
      digest.update(np.packbits(np.diff(source.blocks(source.good)) != 0).tobytes())
      out[source.name] = digest.hexdigest()
    return out


def _hash(data) -> int:
  """64 bits of BLAKE2b of `data` (bytes or a buffer)."""
  return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _utf8(text: str) -> bytes:
  """`text`'s UTF-8 bytes, or BadRecord: a lone surrogate, which JSON's `\\ud800` escapes
  give and no tokenizer encodes."""
  try:
    return text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise BadRecord(f"holds a lone surrogate (U+{ord(text[e.start]):04X} at character"
                    f" {e.start}), which no tokenizer encodes") from None


def _checked(source: Source, index: int, text: str | None) -> str:
  """`text`, read back as record `index` of `source` (None: it did not read), if its hash
  is the one listed."""
  try:
    same = text is not None and _hash(_utf8(text)) == source.hashes[index]
  except BadRecord:
    same = False
  if text is None or not same:
    raise BadRecord(f"{source.name} changed after the corpus was listed"
                    f" ({source.record_name(index)} is no longer the text listed); restore the"
                    " file as it was and rerun to resume from the last checkpoint, or start"
                    " over on the changed corpus (a new run_dir, or resume=false).")
  return text


class _Blocks:
  """Decoded blocks (parquet row groups, blocks of compressed files) by key, the `size`
  used last, shared by every source (the pipeline reads from several threads)."""

  def __init__(self, size: int):
    self.size, self.lock, self.blocks = size, threading.Lock(), collections.OrderedDict()

  def peek(self, key):
    """The block `key` if it is cached, else None."""
    with self.lock:
      if key in self.blocks:
        self.blocks.move_to_end(key)
        return self.blocks[key]
    return None

  def put(self, key, block) -> None:
    with self.lock:
      self.blocks[key] = block
      while len(self.blocks) > self.size:
        self.blocks.popitem(last=False)

  def get(self, key, load: Callable):
    """Block `key`, decoded by `load()` if it is not cached (outside the lock: other
    threads' cached reads need not wait for it)."""
    block = self.peek(key)
    if block is None:
      block = load()
      self.put(key, block)
    return block


BLOCKS = _Blocks(BLOCK_CACHE)


def _text(raw: bytes) -> str:
  """The text of a `.txt` file's bytes (a leading BOM dropped, a few undecodable bytes as
  U+FFFD), or BadRecord: binary or mostly not UTF-8."""
  raw = raw.removeprefix(BOM)
  if b"\0" in raw:
    raise BadRecord("binary (holds NUL bytes)")
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    bad = len(_UNDECODABLE.findall(raw.decode("utf-8", errors="surrogateescape")))
    if bad > MAX_UNDECODABLE * len(raw):
      raise BadRecord(f"not UTF-8 text ({bad} of {len(raw)} bytes undecodable)") from None
    return raw.decode("utf-8", errors="replace")


class TextFile:
  """A `.txt` file (or the standard library's `.py`), plain or compressed: one document,
  read whole."""

  ordered = False

  def __init__(self, path: epath.Path, name: str):
    self.path, self.name = path, name
    self.hashes = np.zeros(1, np.uint64)
    try:
      self.hashes[0] = _hash(_utf8(self._read()))
      self.good, self.problems = np.zeros(1, np.int64), []
    except (BadRecord, streams.Damaged) as e:
      self.good, self.problems = np.zeros(0, np.int64), [f"{name}: {e}"]

  def _read(self) -> str:
    with streams.open_stream(self.path) as f:
      return _text(f.read())

  def __len__(self) -> int:
    return 1

  def __getitem__(self, index: int) -> str:
    try:
      text = self._read()
    except (BadRecord, streams.Damaged, OSError):
      text = None  # not the text listed: `_checked` says so
    return _checked(self, index, text)

  def record_name(self, index: int) -> str:
    return self.name

  def blocks(self, indices: np.ndarray) -> np.ndarray:
    return np.zeros(len(indices), np.int64)


class _NotJson(BadRecord):
  """A record that is not JSON at all."""


def _parse(raw: bytes | None):
  """The JSON value of a record's bytes (None: a record longer than `MAX_RECORD_BYTES`),
  or BadRecord."""
  if raw is None:
    raise BadRecord(f"longer than {MAX_RECORD_BYTES} bytes")
  try:
    text = raw.decode("utf-8")  # not json's guess of UTF-16 or UTF-32
  except UnicodeDecodeError as e:
    raise BadRecord(f"not UTF-8 (byte {e.start})") from None
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise _NotJson(f"not JSON ({e.msg})") from None
  except (ValueError, RecursionError) as e:  # an integer of > 4300 digits; deep nesting
    raise BadRecord(f"JSON that Python does not read ({_first_line(e)})") from None


def _json_type(value) -> str:
  """JSON's name for the type of a parsed value."""
  names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
           type(None): "null", int: "a number", float: "a number"}
  return names.get(type(value), type(value).__name__)


def _field(value, field: str) -> str:
  """The string `field` of the JSON value `value`, or BadRecord."""
  if not isinstance(value, dict):
    raise BadRecord(f"not a JSON object ({_json_type(value)})")
  if not isinstance(value.get(field), str):
    got = "no such field" if field not in value else _json_type(value[field])
    raise BadRecord(f"expects a string {field!r}, got {got}")
  return value[field]


def _lines(f) -> Iterator[tuple[int, int, int, bytes | None]]:
  """(line number, offset, size, bytes) of each line of binary file `f` (size and bytes
  with its newline; the bytes None for a line longer than `MAX_RECORD_BYTES`, which is not
  held in memory). A BOM that starts the file is skipped."""
  offset, number = 0, 0
  while line := f.readline(MAX_RECORD_BYTES + 1):
    if number == 0 and line.startswith(BOM):
      line, offset = line[len(BOM):], len(BOM)
    size = len(line)
    if size > MAX_RECORD_BYTES and not line.endswith(b"\n"):  # a longer line: skip its rest
      line = None
      while (rest := f.readline(MAX_RECORD_BYTES)) and not rest.endswith(b"\n"):
        size += len(rest)
      size += len(rest)
    yield number, offset, size, line
    offset, number = offset + size, number + 1


_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's white space


def _after_space(text: str, i: int) -> int:
  """The index of the first character of `text` at or after `i` that is not JSON white
  space."""
  match = _SPACE.match(text, i)
  return match.end() if match else i


def _elements(data: bytes) -> Iterator[tuple[int, int, int, object]]:
  """(index, offset, size, value) of each element of the JSON array `data` (UTF-8, a BOM
  allowed), offsets and sizes in bytes.

  Raises:
    BadRecord: not UTF-8, or not JSON from some element on (the ones before were given).
  """
  start = len(BOM) if data.startswith(BOM) else 0
  try:
    text = data[start:].decode("utf-8")
  except UnicodeDecodeError as e:
    raise BadRecord(f"not UTF-8 (byte {start + e.start})") from None
  ascii_only = text.isascii()
  decoder = json.JSONDecoder()
  i = _after_space(text, text.index("[") + 1)  # the caller saw "[" first
  byte, char = start + len(text[:i].encode()), i  # `byte`: the bytes of text[:char]
  index = 0
  while i < len(text) and text[i] != "]":
    try:
      value, end = decoder.raw_decode(text, i)
    except json.JSONDecodeError as e:
      raise BadRecord(f"not JSON from element {index} on ({e.msg} at character {e.pos})"
                      ) from None
    except (ValueError, RecursionError) as e:  # see `_parse`
      raise BadRecord(f"JSON that Python does not read from element {index} on"
                      f" ({_first_line(e)})") from None
    if not ascii_only:
      byte += len(text[char:i].encode())
      size = len(text[i:end].encode())
    else:
      byte, size = start + i, end - i
    yield index, byte, size, value
    byte, char, index = byte + size, end, index + 1
    i = _after_space(text, end)
    if i < len(text) and text[i] == ",":
      i = _after_space(text, i + 1)
    elif i < len(text) and text[i] != "]":
      raise BadRecord(f"not JSON after its {index} elements (expected ',' or ']')")
  if i >= len(text) or text[_after_space(text, i + 1):]:
    raise BadRecord(f"not JSON after its {index} elements (the array is not closed, or"
                    " something follows it)")


def _first_character(path: epath.Path) -> bytes:
  """The first byte of `path`'s (decompressed) text that is not a BOM or white space; b""
  if none."""
  with streams.open_stream(path) as f:
    head = f.read(len(BOM)).removeprefix(BOM)
    while chunk := head or f.read(1 << 16):
      head = b""
      if stripped := chunk.lstrip(b" \t\r\n"):
        return stripped[:1]
  return b""


class JsonFile:
  """JSON documents (a string `text_field` each) of a `.jsonl` or `.json` file, plain or
  compressed: a non-blank line each, or (a `.json` file whose first non-blank character is
  `[`) an element of a JSON array each. Holds each record's number (its line, or index in
  the array), byte offset in the (decompressed) file and size, and a compressed file's
  blocks (where each begins in the decompressed stream, then its end)."""

  def __init__(self, path: epath.Path, name: str, text_field: str):
    self.path, self.name, self.field = path, name, text_field
    self.ordered = streams.compression(path.name) is not None
    json_suffix = name.lower().removesuffix(streams.compression(name) or "").endswith(".json")
    self.problems: list[str] = []
    numbers, offsets, sizes, hashes, good, starts = [], [], [], [], [], [0]
    self.array = False
    try:
      self.array = json_suffix and _first_character(path) == b"["
      with streams.open_stream(path) as f:
        records = (_elements(f.read()) if self.array
                   else ((n, o, s, line) for n, o, s, line in _lines(f)
                         if line is None or line.strip()))
        for number, offset, size, value in records:
          try:
            text = _field(value if self.array else _parse(typing.cast(bytes | None, value)),
                          text_field)
            hashes.append(_hash(_utf8(text)))
            good.append(len(numbers))
          except _NotJson as e:
            if json_suffix and not numbers:  # a .json file that is not JSON Lines either
              raise BadRecord(f"neither JSON Lines nor a JSON array of objects (line"
                              f" {number + 1}: {e})") from None
            hashes.append(0)
            self.problems.append(f"{self._where(number)}: {e}")
          except BadRecord as e:
            hashes.append(0)
            self.problems.append(f"{self._where(number)}: {e}")
          if offset - starts[-1] >= streams.BLOCK_BYTES:
            starts.append(offset)
          numbers.append(number)
          offsets.append(offset)
          sizes.append(size)
    except (BadRecord, streams.Damaged) as e:
      if isinstance(e, streams.Damaged) and not e.truncated:  # no record can be trusted
        numbers, offsets, sizes, hashes, good, starts = [], [], [], [], [], [0]
        self.problems = []
      kept = f"; its {len(good)} records before that are read" if good else ""
      self.problems.append(f"{name}: {e}{kept}")
    starts.append(offsets[-1] + sizes[-1] if offsets else 0)
    self.numbers, self.offsets = np.asarray(numbers, np.int64), np.asarray(offsets, np.int64)
    self.sizes = np.asarray(sizes, np.int64)
    self.hashes, self.good = np.asarray(hashes, np.uint64), np.asarray(good, np.int64)
    self.starts = np.asarray(starts, np.int64)

  def _where(self, number: int) -> str:
    return f"{self.name} {'element' if self.array else 'line'} {number + (not self.array)}"

  def __len__(self) -> int:
    return len(self.numbers)

  def _bytes(self, index: int) -> bytes:
    """Record `index`'s bytes (a line: with its newline)."""
    offset, size = int(self.offsets[index]), int(self.sizes[index])
    if not self.ordered:
      return storage.read_range(self.path, offset, offset + size)
    block = int(self.blocks(np.asarray([index]))[0])
    data = BLOCKS.peek((self.path, block))
    if data is None:
      data = streams.CURSORS.read_block(
          self.path, self.starts, block, peek=lambda b: BLOCKS.peek((self.path, b)),
          keep=lambda b, data: BLOCKS.put((self.path, b), data))
    start = offset - int(self.starts[block])
    return data[start:start + size]

  def __getitem__(self, index: int) -> str:
    try:
      text = _field(_parse(self._bytes(index)), self.field)
    except (BadRecord, streams.Damaged, OSError):
      text = None  # not the text listed: `_checked` says so
    return _checked(self, index, text)

  def record_name(self, index: int) -> str:
    return f"{self.name}:{self.numbers[index]}"

  def blocks(self, indices: np.ndarray) -> np.ndarray:
    if not self.ordered:
      return np.asarray(indices, np.int64)
    return np.searchsorted(self.starts, self.offsets[indices], side="right") - 1


def _pyarrow():
  try:
    import pyarrow as pa  # an optional extra: only parquet corpora need it
    import pyarrow.parquet as pq
  except ImportError:
    raise ConfigError("data.source holds parquet shards, which need the pyarrow package:"
                      " pip install 'flaxattn[parquet]' (or pyarrow).") from None
  return pa, pq


def _is_text(kind) -> bool:
  """Whether arrow type `kind` holds strings: string, large_string, string_view, or a
  dictionary of them (a pandas categorical)."""
  pa, _ = _pyarrow()
  if pa.types.is_dictionary(kind):
    kind = kind.value_type
  return str(kind) in ("string", "large_string", "string_view")


def _plain(column):
  """A text column (a chunked array of `_is_text` type) as one string or large_string
  array."""
  pa, _ = _pyarrow()
  column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
  if pa.types.is_dictionary(column.type):
    column = column.dictionary_decode()
  if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
    column = column.cast(pa.large_string())  # string_view
  return column


class ParquetFile:
  """A `.parquet` shard: a document per row, its text column `text_field`; rows are read a
  row group at a time, through `BLOCKS`. Listing decodes each row group once (one at a
  time): a null or invalid UTF-8 value is a bad record, and so is each row of a row group
  that does not decode, and the whole file if it is not parquet.

  Raises:
    ConfigError: pyarrow is missing; the file has no column `text_field`, or not one of
      strings.
  """

  ordered = False

  def __init__(self, path: epath.Path, name: str, text_field: str):
    pa, pq = _pyarrow()
    self.path, self.name, self.field = path, name, text_field
    self.starts, self.problems = [0], []
    good, hashes = [], []
    with path.open("rb") as f:
      try:
        shard = pq.ParquetFile(f)
        meta, schema = shard.metadata, shard.schema_arrow
      except (pa.ArrowException, OSError) as e:
        shard = None
        self.problems.append(f"{name}: not a parquet file pyarrow can read ({_first_line(e)})")
      if shard is not None:
        self._check_column(schema, text_field)
        for g in range(meta.num_row_groups):
          self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
          group_hashes = np.zeros(self.starts[-1] - self.starts[-2], np.uint64)
          try:
            ok = self._list_group(g, _plain(shard.read_row_group(g, columns=[text_field]
                                                                 ).column(0)), group_hashes)
          except (pa.ArrowException, OSError) as e:
            ok = np.zeros(len(group_hashes), bool)
            self.problems.append(f"{name} rows {self.starts[-2]} to {self.starts[-1] - 1}: row"
                                 f" group {g} does not decode ({_first_line(e)})")
          good.append(self.starts[-2] + np.flatnonzero(ok))
          hashes.append(group_hashes)
    self.good = np.concatenate(good or [np.zeros(0)]).astype(np.int64)
    self.hashes = np.concatenate(hashes or [np.zeros(0)]).astype(np.uint64)

  def _check_column(self, schema, text_field: str) -> None:
    if text_field not in schema.names:
      raise ConfigError(f"config key 'data.text_field' ({text_field!r}) names no column of"
                        f" {self.path}, whose columns are {schema.names}; set data.text_field"
                        " to the column that holds the text.")
    kind = schema.field(text_field).type
    if not _is_text(kind):
      raise ConfigError(f"config key 'data.text_field' ({text_field!r}) expects a column of"
                        f" strings, but in {self.path} it holds {kind}; set data.text_field to"
                        " the column that holds the text.")

  def _list_group(self, group: int, column, hashes: np.ndarray) -> np.ndarray:
    """Which rows of row group `group` (its text `column`) are good; fills `hashes`."""
    pa, _ = _pyarrow()
    nulls = np.flatnonzero(~np.asarray(column.is_valid()))
    _, offsets, data = column.buffers()
    offsets = np.frombuffer(offsets, np.int64 if pa.types.is_large_string(column.type)
                            else np.int32)[column.offset:column.offset + len(column) + 1].tolist()
    data = memoryview(data if data is not None else b"")
    blake2b = hashlib.blake2b
    hashes[:] = np.frombuffer(b"".join([  # `_hash` of each value, at C speed
        blake2b(data[a:b], digest_size=8).digest() for a, b in itertools.pairwise(offsets)
    ]), "<u8")
    good = np.ones(len(column), bool)
    good[nulls] = False
    first = self.starts[group]
    try:
      column.validate(full=True)  # checks every value's UTF-8 (a non-validating writer's)
    except pa.ArrowInvalid:
      for i in np.flatnonzero(good).tolist():
        try:
          str(data[offsets[i]:offsets[i + 1]], "utf-8")
        except UnicodeDecodeError as e:
          good[i] = False
          self.problems.append(f"{self.name} row {first + i}: {self.field!r} is not UTF-8"
                               f" (byte {e.start})")
    self.problems += [f"{self.name} row {first + i}: null {self.field!r}" for i in nulls]
    hashes[~good] = 0
    return good

  def read_group(self, group: int):
    """Row group `group`'s text column, decoded (an arrow array of strings)."""
    _, pq = _pyarrow()
    with self.path.open("rb") as f:
      return _plain(pq.ParquetFile(f).read_row_group(group, columns=[self.field]).column(0))

  def __len__(self) -> int:
    return self.starts[-1]

  def __getitem__(self, index: int) -> str:
    group = int(self.blocks(np.asarray([index]))[0])
    try:
      text = BLOCKS.get((self.path, group), lambda: self.read_group(group))[
          index - self.starts[group]].as_py()
    except (ValueError, IndexError, OSError):  # arrow's errors derive from them
      text = None  # not the text listed: `_checked` says so
    return _checked(self, index, text if isinstance(text, str) else None)

  def record_name(self, index: int) -> str:
    return f"{self.name}:{index}"

  def blocks(self, indices: np.ndarray) -> np.ndarray:
    return np.searchsorted(self.starts, indices, side="right") - 1


def _first_line(e: BaseException) -> str:
  return str(e).splitlines()[0] if str(e) else type(e).__name__


def file_format(name: str) -> str | None:
  """The format (one of `FORMATS`) of the file `name` reads as, or None: matched without
  regard to case, after a `.gz` / `.zst` suffix for the text formats."""
  lower = name.lower()
  compressed = streams.compression(lower)
  base = lower.removesuffix(compressed or "")
  for suffix in TEXT_FORMATS if compressed else FORMATS:
    if base.endswith(suffix):
      return suffix
  return None


def _open(path: epath.Path, name: str, text_field: str) -> Source:
  kind = file_format(name)
  if kind in (".jsonl", ".json"):
    return JsonFile(path, name, text_field)
  if kind == ".parquet":
    return ParquetFile(path, name, text_field)
  return TextFile(path, name)  # .txt, and the standard library's .py


def _stdlib_files() -> tuple[epath.Path, list[str]]:
  root = storage.path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "dist-packages"}  # installed packages, not the standard library
  return root, [n for n in storage.files(root)
                if n.endswith(".py") and not skip & set(n.split("/"))]


def _corpus_files(root: epath.Path) -> tuple[list[str], list[str]]:
  """(the files under `root` that a reader reads, the others), as paths relative to it."""
  read, other = [], []
  for name in storage.files(root):
    (read if file_format(name.rsplit("/", 1)[-1]) else other).append(name)
  return read, other


def _shown(names: list[str], count: int = _SHOWN) -> str:
  more = f"; and {len(names) - count} more" if len(names) > count else ""
  return "; ".join(names[:count]) + more


def list_documents(source: str, bad_records: str = "skip",
                   text_field: str = "text") -> Documents:
  """All documents of `source` ("stdlib", or a directory of the files the module docstring
  lists, read recursively in sorted order), in a deterministic order.

  Every record is checked here, so that a bad one cannot stop training when the pipeline
  reaches it (and again at each resume): with `bad_records` "skip" (see
  `DataConfig.bad_records`) bad records are left out and counted in a warning. Files of
  other formats are named in a warning.

  Args:
    text_field: the field (JSON) or column (`.parquet`) holding a document's text.

  Raises:
    ConfigError: the directory does not exist, holds no file of a format read or no
      usable documents, or a file cannot be opened; bad records with `bad_records`
      "error"; a parquet shard without a string column `text_field` (or pyarrow missing).
  """
  if source == "stdlib":
    root, names = _stdlib_files()
  else:
    root = storage.path(source)
    if not root.is_dir():
      raise ConfigError(f"data.source expects 'stdlib' or a directory, got {source!r}"
                        " (not a directory).")
    names, other = _corpus_files(root)
    formats = ", ".join(f"{s}" for s in FORMATS)
    also = f" ({', '.join(TEXT_FORMATS)} also compressed: {', '.join(streams.COMPRESSIONS)})"
    if other:
      log.warning("data.source %r: %d file(s) not read, of other formats than %s%s: %s",
                  source, len(other), formats, also, _shown(sorted(other), _SHOWN_FILES))
    if not names:
      others = f": {_shown(sorted(other), _SHOWN_FILES)}" if other else ""
      raise ConfigError(f"data.source {source!r} holds no file the trainer reads ({formats}"
                        f"{also}, any case); it holds {len(other)} other files{others}. Point"
                        " data.source at the corpus directory.")
  opened, problems = [], []
  for name in sorted(names, key=lambda n: n.split("/")):
    try:
      opened.append(_open(root / name, name, text_field))
    except OSError as e:
      raise ConfigError(f"data.source {source!r}: cannot read {name} ({type(e).__name__}:"
                        f" {e.strerror or e}); fix its permissions or remove it.") from None
    problems += opened[-1].problems
  docs = Documents(opened, np.repeat(np.arange(len(opened), dtype=np.int32),
                                     [len(src.good) for src in opened]),
                   np.concatenate([src.good for src in opened] or [np.zeros(0, np.int64)]))
  if problems:
    if bad_records == "error":
      raise ConfigError(f"data.source {source!r} has {len(problems)} records that cannot be"
                        f" trained on: {_shown(problems)}. Fix or remove them, or set"
                        " data.bad_records=skip to leave them out.")
    log.warning("data.source %r: skipped %d bad records of %d (data.bad_records=skip): %s",
                source, len(problems), len(problems) + len(docs), _shown(problems))
  if not docs:
    raise ConfigError(f"data.source {source!r} holds no documents (.txt files, JSON records"
                      f" or .parquet rows with a string {text_field!r}).")
  return docs


def split_documents(docs: Documents, eval_fraction: float) -> tuple[Documents, Documents]:
  """(train, eval): a document is held out when its content hash (`Documents.hashes`)
  falls in `eval_fraction` of the hash range (see the module docstring); when that holds
  none out and `eval_fraction` > 0, the documents of the smallest hash are.

  Raises:
    ConfigError: nothing left to train on.
  """
  hashes = docs.hashes()
  held = (hashes >> np.uint64(11)) < np.uint64(eval_fraction * 2**53)
  if eval_fraction > 0 and not held.any():
    held = hashes == hashes.min()
  if held.all():
    raise ConfigError(f"data.eval_fraction={eval_fraction} leaves no training documents.")
  return docs[~held], docs[held]
