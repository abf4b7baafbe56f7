"""Corpus files as byte streams: plain, gzip (`.gz`) or zstd (`.zst`), opened as paths of
`train.storage` (local paths and `gs://` URLs alike), never copied to local disk.

A compressed stream has no random access: its byte n is known only once everything before
it is decompressed. So the readers (`train.data.sources`) list a compressed file in one
pass, front to back, noting where each record lies in the decompressed stream, and cut
that stream at record boundaries into blocks of about `BLOCK_BYTES`. A block is read back
through `Cursors`: decompressors left where earlier reads of the file stopped. A read
continues the nearest one at or before the block (decompressing the blocks in between,
which it hands back too, so that a reader a block behind finds them cached), or starts one
at the beginning of the file. Read in stream order, as the pipeline reads a compressed
file's blocks (`train.data.pipeline.order`), a file is decompressed about once per epoch.
Memory: a decompressor's window per cursor (`MAX_CURSORS` in all) and the blocks the
readers cache (`train.data.sources.BLOCK_CACHE`).
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import io
import itertools
import threading
import typing
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO

import numpy as np
from etils import epath

from train.config import ConfigError

COMPRESSIONS = (".gz", ".zst")
# A compressed file's records are read back in blocks of about this many decompressed bytes
# (of whole records; a longer record is a block of its own).
BLOCK_BYTES = 8 << 20
MAX_CURSORS = 8  # open decompressors, all files together (each holds its file open)
_INPUT = 1 << 16  # compressed bytes fed to the zstd decompressor at once


class Damaged(Exception):
  """A compressed stream that ends early (`truncated`: what came before is as written) or
  does not decompress (its bytes are damaged somewhere); the message says which."""

  def __init__(self, message: str, truncated: bool = False):
    super().__init__(message)
    self.truncated = truncated


def compression(name: str) -> str | None:
  """The compression suffix of file `name` (".gz", ".zst"; any case), or None."""
  suffix = name[name.rfind("."):].lower()
  return suffix if suffix in COMPRESSIONS else None


class _Zstd(io.RawIOBase):
  """The decompressed bytes of zstd frames read from `raw` (one after another, as the zstd
  tool writes them). Raises EOFError where the input ends inside a frame: python-zstandard's
  stream readers return the bytes they have without a word."""

  def __init__(self, raw: BinaryIO):
    try:
      import zstandard  # an optional extra: only .zst corpora need it
    except ImportError:
      raise ConfigError("data.source holds .zst files, which need the zstandard package:"
                        " pip install 'flaxattn[zstd]' (or zstandard).") from None
    self.raw, self.dctx = raw, zstandard.ZstdDecompressor()
    self.frame, self.in_frame, self.pending = self.dctx.decompressobj(), False, b""

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    while not self.pending:
      data = self.raw.read(_INPUT)
      if not data:
        if self.in_frame:
          raise EOFError("the zstd stream ends inside a frame (truncated)")
        return 0
      out = []
      while data:  # the frame's end may fall inside `data`: the next frame starts there
        if self.frame.eof:
          self.frame = self.dctx.decompressobj()
        out.append(self.frame.decompress(data))
        self.in_frame = not self.frame.eof
        data = self.frame.unused_data if self.frame.eof else b""
      self.pending = b"".join(out)
    n = min(len(buffer), len(self.pending))
    buffer[:n] = self.pending[:n]
    self.pending = self.pending[n:]
    return n


def _errors() -> tuple[type[BaseException], ...]:
  """What reading a damaged gzip or zstd stream raises."""
  errors: tuple[type[BaseException], ...] = (EOFError, gzip.BadGzipFile, zlib.error)
  try:
    import zstandard
    errors += (zstandard.ZstdError,)
  except ImportError:
    pass
  return errors


def _damaged(e: BaseException, suffix: str) -> Damaged:
  if isinstance(e, EOFError):
    return Damaged(f"its {suffix[1:]} stream ends early (truncated)", truncated=True)
  why = str(e).splitlines()[0] if str(e) else type(e).__name__
  return Damaged(f"its {suffix[1:]} stream does not decompress ({why})")


def _open(path: epath.Path) -> tuple[BinaryIO, BinaryIO]:
  """(the file, its bytes decompressed as its suffix says)."""
  raw = typing.cast(BinaryIO, path.open("rb"))
  suffix = compression(path.name)
  if suffix is None:  # a bucket's file (gcsfs) has no readline(size): buffered here
    return raw, raw if isinstance(raw, io.BufferedIOBase) else typing.cast(
        BinaryIO, io.BufferedReader(typing.cast(typing.Any, raw), 1 << 20))
  try:
    stream = gzip.GzipFile(fileobj=raw) if suffix == ".gz" else _Zstd(raw)
  except BaseException:
    raw.close()
    raise
  return raw, typing.cast(BinaryIO, io.BufferedReader(stream, 1 << 20)
                          if isinstance(stream, _Zstd) else stream)


@contextlib.contextmanager
def open_stream(path: epath.Path) -> Iterator[BinaryIO]:
  """`path`'s bytes, decompressed as its suffix says, as a buffered binary file (read,
  readline).

  Raises (also from the reads inside the `with`):
    Damaged: the compressed stream ends early or does not decompress.
    ConfigError: a `.zst` file without the zstandard package.
  """
  raw, stream = _open(path)
  try:
    yield stream
  except _errors() as e:
    raise _damaged(e, compression(path.name) or "") from None
  finally:
    raw.close()


class _Cursor:
  """A decompressor of one file, at decompressed byte `pos`."""

  def __init__(self, path: epath.Path):
    self.path, self.pos = path, 0
    self.raw, self.stream = _open(path)

  def read(self, n: int) -> bytes:
    """The next `n` bytes; Damaged if the stream ends before them."""
    try:
      data = self.stream.read(n)
    except _errors() as e:
      raise _damaged(e, compression(self.path.name) or "") from None
    self.pos += len(data)
    if len(data) < n:
      raise Damaged(f"its decompressed stream ends at byte {self.pos}, before byte"
                    f" {self.pos - len(data) + n} where listing found a record")
    return data

  def close(self) -> None:
    self.raw.close()


class Cursors:
  """Reads of blocks of compressed files (see the module docstring), from any thread: one
  at a time, continuing the nearest decompressor at or before the block. At most
  `MAX_CURSORS` stay open, the least recently used closed first."""

  def __init__(self, max_cursors: int = MAX_CURSORS):
    self.max, self.lock, self._keys = max_cursors, threading.Lock(), itertools.count()
    self.cursors: collections.OrderedDict[int, _Cursor] = collections.OrderedDict()

  def read_block(self, path: epath.Path, starts: np.ndarray, block: int,
                 peek: Callable[[int], bytes | None],
                 keep: Callable[[int, bytes], None]) -> bytes:
    """Block `block` of `path`'s decompressed stream, cut at the offsets `starts` (block b
    is bytes `starts[b]` to `starts[b + 1]`), unless `peek(block)` has it (a cache, looked
    at under this lock: another thread may have decompressed it meanwhile). It and each
    block decompressed on the way to it are given to `keep(b, data)`.

    Raises:
      Damaged: the stream is damaged, or shorter than `starts` says (the file changed
        since it was listed).
    """
    with self.lock:
      if (data := peek(block)) is not None:
        return data
      here = [(c.pos, key) for key, c in self.cursors.items()
              if c.path == path and c.pos <= starts[block]]
      key, cursor = ((max(here)[1], self.cursors.pop(max(here)[1])) if here
                     else (next(self._keys), _Cursor(path)))
      try:
        # Reads stop at a block's end, and a new cursor starts at 0: at a block's start.
        b = int(np.searchsorted(starts, cursor.pos, side="right")) - 1
        while b < block:
          keep(b, cursor.read(int(starts[b + 1] - starts[b])))
          b += 1
        data = cursor.read(int(starts[block + 1] - starts[block]))
      except BaseException:
        cursor.close()
        raise
      keep(block, data)
      self.cursors[key] = cursor
      while len(self.cursors) > self.max:
        self.cursors.popitem(last=False)[1].close()
      return data


CURSORS = Cursors()
