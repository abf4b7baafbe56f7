"""A corpus with every kind of odd record the data readers meet (`odd_corpus`), in every
format, plain and compressed, with what listing must make of each: the documents kept and
their texts, the bad records and why, and the files not read. Shared by the readers' tests
(test_train_sources.py) and the trainer's two-process run over it (test_train_data.py)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

BOM = b"\xef\xbb\xbf"
HUGE = 9 << 17  # bytes of the longest good record: 1.1 MiB, past every buffer of a reader


@dataclasses.dataclass
class Expected:
  """What listing `odd_corpus` must give.

  texts: document name -> its text, for every document kept (and no other).
  prefixes: for a damaged compressed file, the texts of its records; the documents kept of
    it (and named in `texts` by the test) are a non-empty prefix of them.
  problems: where (the start of a bad record's line in the warning) -> a part of its why.
  unread: the files not read (named in a warning).
  cases: the odd inputs written (a line, a file, a row, an array element, ...: each one
    whose outcome the above say).
  """

  texts: dict[str, str] = dataclasses.field(default_factory=dict)
  prefixes: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  problems: dict[str, str] = dataclasses.field(default_factory=dict)
  unread: list[str] = dataclasses.field(default_factory=list)
  cases: int = 0


OK, BAD, BLANK = "ok", "bad", "blank"
# A JSON Lines file: each line's bytes, and what it is: (OK, its text), (BAD, why) or BLANK.
LINES = [
    (b'{"text": "plain ascii"}', OK, "plain ascii"),
    (json.dumps({"text": "\u00e9 \u65e5\u672c \U0001f600"}, ensure_ascii=False).encode(), OK,
     "\u00e9 \u65e5\u672c \U0001f600"),
    (b'{"text": "escaped pair \\ud83d\\ude00"}', OK, "escaped pair \U0001f600"),
    (b'{"text": "lone \\ud800 high surrogate"}', BAD, "lone surrogate (U+D800"),
    (b'{"text": "lone \\udc00 low surrogate"}', BAD, "lone surrogate (U+DC00"),
    (b'{"text": "invalid \xff\xfe UTF-8"}', BAD, "not UTF-8"),
    (b'{"text": "escaped NUL \\u0000 is text"}', OK, "escaped NUL \0 is text"),
    (b'{"text": "raw NUL \x00 byte"}', BAD, "not JSON (Invalid control character"),
    (b'{"text": null}', BAD, "expects a string 'text', got null"),
    (b'{"body": "no text field"}', BAD, "got no such field"),
    (b'{"text": 5}', BAD, "got a number"),
    (b'{"text": ["a list"]}', BAD, "got an array"),
    (b'{"text": {"an": "object"}}', BAD, "got an object"),
    (b'[1, 2]', BAD, "not a JSON object (an array)"),
    (b'"a string"', BAD, "not a JSON object (a string)"),
    (b'null', BAD, "not a JSON object (null)"),
    (b'{"text": ""}', OK, ""),
    (b'   \t', BLANK, None),
    (b'', BLANK, None),
    (b'{"text": "CRLF line"}\r', OK, "CRLF line"),
    (b'{"text": "other fields", "n": NaN, "m": [1, {"x": null}]}', OK, "other fields"),
    (b'{"text": "first", "text": "the last of duplicate keys"}', OK, "the last of duplicate keys"),
    (b'[' * 100_000 + b']' * 100_000, BAD, "JSON that Python does not read"),
    (b'{"text": "a long integer", "n": ' + b'7' * 5000 + b'}', BAD,
     "JSON that Python does not read"),
    (b'{"text": "\\ufeffan escaped BOM is text"}', OK, "\ufeffan escaped BOM is text"),
    (b'not JSON at all', BAD, "not JSON (Expecting value"),
    (json.dumps({"text": "huge " * (HUGE // 5)}).encode(), OK, "huge " * (HUGE // 5)),
    (b'{"text": "a truncated last line', BAD, "not JSON (Unterminated string"),
]


def _jsonl(lines) -> bytes:
  """A JSON Lines file of `lines` (`LINES` entries), with a BOM; no newline after the last."""
  return BOM + b"\n".join(line for line, *_ in lines)


def _expect_lines(expected: Expected, name: str, lines) -> None:
  expected.cases += len(lines)
  for number, (_, kind, value) in enumerate(lines):
    if kind == OK:
      expected.texts[f"{name}:{number}"] = value
    elif kind == BAD:
      expected.problems[f"{name} line {number + 1}:"] = value


TEXTS = {  # .txt files: bytes -> (OK, text) or (BAD, why)
    "good.txt": (b"a plain text file\n", OK, "a plain text file\n"),
    "bom.txt": (BOM + b"a BOM is not text", OK, "a BOM is not text"),
    "crlf.txt": (b"line one\r\nline two\r\n", OK, "line one\r\nline two\r\n"),
    "nul.txt": (b"binary \x00 bytes", BAD, "binary (holds NUL bytes)"),
    "utf16.txt": ("UTF-16 text".encode("utf-16"), BAD, "binary (holds NUL bytes)"),
    "latin1.txt": ("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e".encode("latin-1"), BAD,
                   "not UTF-8 text (4 of 17 bytes undecodable)"),
    "few_bad.txt": (b"x" * 500 + b"\xff" + b"y" * 500, OK, "x" * 500 + "\ufffd" + "y" * 500),
    "empty.txt": (b"", OK, ""),
}

ARRAY = [{"text": "element zero"}, 5, {"body": "no text"}, {"text": "lone \ud800"},
         {"text": "\u00e9l\u00e9ment \U0001f600"}, {"text": None}]


def _write(path: pathlib.Path, data: bytes) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data)


def _compressed(data: bytes, suffix: str) -> bytes:
  return gzip.compress(data) if suffix == ".gz" else zstandard.ZstdCompressor().compress(data)


def _text_files(root: pathlib.Path, expected: Expected, suffix: str) -> None:
  """The `.txt`, `.jsonl` and `.json` cases, compressed with `suffix` ("" for none)."""

  def write(name: str, data: bytes) -> str:
    _write(root / (name + suffix), _compressed(data, suffix) if suffix else data)
    return name + suffix

  name = write("records.jsonl", _jsonl(LINES))
  _expect_lines(expected, name, LINES)
  name = write("sub/UPPER.JSONL", b"\n".join(line for line, *_ in LINES[:3]) + b"\n")
  _expect_lines(expected, name, LINES[:3])
  for file, (data, kind, value) in TEXTS.items():
    expected.cases += 1
    name = write(f"texts/{file}", data)
    if kind == OK:
      expected.texts[name] = value
    else:
      expected.problems[f"{name}:"] = value
  name = write("lines.json", b"\n".join(line for line, *_ in LINES[:3]))
  _expect_lines(expected, name, LINES[:3])
  # A JSON array (pretty-printed), with a BOM; elements: good, not an object, no text
  # field, a lone surrogate, good, null text.
  array = BOM + json.dumps(ARRAY, indent=2).encode()
  expected.cases += len(ARRAY) + 5  # its elements; a cut array, text after one, an object,
  # an empty .json and .jsonl
  name = write("array.json", array)
  expected.texts.update({f"{name}:0": "element zero", f"{name}:4": ARRAY[4]["text"]})
  expected.problems.update({f"{name} element 1:": "not a JSON object (a number)",
                            f"{name} element 2:": "got no such field",
                            f"{name} element 3:": "lone surrogate (U+D800",
                            f"{name} element 5:": "got null"})
  name = write("array_cut.json", json.dumps(ARRAY[:1] * 3).encode()[:-20])
  expected.texts.update({f"{name}:{i}": "element zero" for i in range(2)})
  expected.problems[f"{name}:"] = "not JSON from element 2 on"
  name = write("array_tail.json", json.dumps(ARRAY[:1]).encode() + b" trailing")
  expected.texts[f"{name}:0"] = "element zero"
  expected.problems[f"{name}:"] = "something follows it"
  name = write("object.json", json.dumps({"text": "one object"}, indent=2).encode())
  expected.problems[f"{name}:"] = "neither JSON Lines nor a JSON array of objects"
  write("empty.json", b"")
  write("empty.jsonl", b"")


def _damaged_streams(root: pathlib.Path, expected: Expected) -> None:
  """Compressed files that end early, do not decompress, or hold several streams."""
  lines = [json.dumps({"text": f"streamed line {i} " + "word " * (i % 50)}).encode()
           for i in range(3000)]
  texts = [json.loads(line)["text"] for line in lines]
  data = b"\n".join(lines) + b"\n"
  expected.cases += 11  # cut, two streams, not compressed, a cut text, zero bytes; a bad CRC
  for suffix in (".gz", ".zst"):
    packed = _compressed(data, suffix)
    _write(root / f"streams/cut.jsonl{suffix}", packed[:len(packed) * 3 // 5])
    expected.prefixes[f"streams/cut.jsonl{suffix}"] = texts
    expected.problems[f"streams/cut.jsonl{suffix}:"] = "stream ends early (truncated)"
    _write(root / f"streams/two.jsonl{suffix}",
           _compressed(data[:len(lines[0]) + 1], suffix) + _compressed(data, suffix))
    expected.texts.update({f"streams/two.jsonl{suffix}:{i}": t
                           for i, t in enumerate(texts[:1] + texts)})
    _write(root / f"streams/plain.txt{suffix}", b"not compressed at all")
    expected.problems[f"streams/plain.txt{suffix}:"] = "stream does not decompress"
    cut = _compressed(b"a text file that ends early " * 2000, suffix)
    _write(root / f"streams/cut.txt{suffix}", cut[:len(cut) // 2])
    expected.problems[f"streams/cut.txt{suffix}:"] = "stream ends early (truncated)"
    _write(root / f"streams/zero_bytes.txt{suffix}", b"")  # an empty stream: an empty text
    expected.texts[f"streams/zero_bytes.txt{suffix}"] = ""
  flipped = bytearray(_compressed(data, ".gz"))
  flipped[-6] ^= 0xFF  # the CRC of the decompressed bytes
  _write(root / "streams/crc.jsonl.gz", bytes(flipped))  # damaged: none of it is read
  expected.problems["streams/crc.jsonl.gz:"] = "stream does not decompress (CRC check failed"


def _parquet(root: pathlib.Path, expected: Expected) -> None:
  """Parquet shards: nulls, invalid UTF-8 from a writer that does not check it, a
  dictionary (pandas categorical), large and view strings, no rows, not parquet, a row group
  that does not decode."""
  (root / "parquet").mkdir()

  def shard(name: str, column, rows: list, group: int = 2) -> None:
    expected.cases += len(rows) + (not rows)
    pq.write_table(pa.table({"text": column, "n": list(range(len(column)))}),
                   root / "parquet" / name, row_group_size=group)
    for r, value in enumerate(rows):
      if isinstance(value, str):
        expected.texts[f"parquet/{name}:{r}"] = value
      elif value is None:
        expected.problems[f"parquet/{name} row {r}:"] = "null 'text'"

  shard("nulls.parquet", ["p0", None, "p2", "\u00e9"], ["p0", None, "p2", "\u00e9"])
  data, offsets = b"good" + b"bad \xff\xfe" + b"fine", np.array([0, 4, 10, 14], np.int32)
  invalid = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(offsets.tobytes()),
                                                   pa.py_buffer(data)])  # unchecked
  shard("invalid_utf8.parquet", invalid, ["good", 0, "fine"])  # 0: the row not UTF-8
  expected.problems["parquet/invalid_utf8.parquet row 1:"] = "'text' is not UTF-8 (byte 4)"
  categories = pa.array(["cat a", "cat b", None, "cat a"]).dictionary_encode()
  shard("dictionary.parquet", categories, ["cat a", "cat b", None, "cat a"])
  shard("large.parquet", pa.array(["large 0", "large 1"], pa.large_string()),
        ["large 0", "large 1"])
  if hasattr(pa, "string_view"):  # pyarrow >= 16
    shard("view.parquet", pa.array(["view 0", None], pa.string_view()), ["view 0", None])
  shard("no_rows.parquet", pa.array([], pa.string()), [])
  for name, data in (("not_parquet.parquet", b"PAR1 but not parquet"), ("zero.parquet", b"")):
    expected.cases += 1
    _write(root / "parquet" / name, data)
    expected.problems[f"parquet/{name}:"] = "not a parquet file pyarrow can read"
  # Row group 0's snappy-compressed page overwritten: it does not decode; group 1 does.
  pq.write_table(pa.table({"text": [f"row {r} " + "x" * 300 for r in range(8)]}),
                 root / "parquet" / "corrupt.parquet", row_group_size=4, compression="snappy")
  expected.cases += 2  # a row group that decodes, one that does not
  raw = bytearray((root / "parquet" / "corrupt.parquet").read_bytes())
  raw[60:120] = bytes(60)
  (root / "parquet" / "corrupt.parquet").write_bytes(bytes(raw))
  expected.problems["parquet/corrupt.parquet rows 0 to 3:"] = "row group 0 does not decode"
  expected.texts.update({f"parquet/corrupt.parquet:{r}": f"row {r} " + "x" * 300
                         for r in range(4, 8)})


def odd_corpus(root: pathlib.Path) -> Expected:
  """Writes the corpus under `root` (which it creates); returns what listing must give."""
  root.mkdir(parents=True)
  expected = Expected()
  for suffix in ("", ".gz", ".zst"):
    _text_files(root, expected, suffix)
  _damaged_streams(root, expected)
  _parquet(root, expected)
  expected.unread = ["README.md", "data.csv", "x.jsonl.bz2", "y.parquet.gz", ".hidden",
                     "sub/notes.rst", "Mixed.Txt.gz.part"]
  for name in expected.unread:
    _write(root / name, b"not read")
  expected.cases += len(expected.unread) + 1
  _write(root / "sub/Mixed.Txt.GZ", gzip.compress(b"any case"))
  expected.texts["sub/Mixed.Txt.GZ"] = "any case"
  return expected
