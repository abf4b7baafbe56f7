"""Tokenizers: text -> int32 ids.

The default is byte-level (UTF-8 bytes, ids 0..255, no special tokens): every document is
its own packed segment, so no BOS/EOS is needed to separate documents, and nothing is
downloaded. A SentencePiece model is the option for real runs.
"""

from __future__ import annotations

import os

import numpy as np

from train.config import ConfigError


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255."""

  vocab_size = 256

  def encode(self, text: str) -> np.ndarray:
    """ids `[len(text.encode())]` int32."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A SentencePiece model file (`.model`); ids as the model numbers them.

  Raises:
    ConfigError: the `sentencepiece` package is not installed, or the file is not a
      SentencePiece model it reads.
  """

  def __init__(self, path: str):
    try:
      # Only this option needs it: an optional extra, not installed where pyright runs in CI.
      import sentencepiece  # pyright: ignore[reportMissingImports]
    except ImportError:
      raise ConfigError(f"config key 'data.tokenizer' ({path!r}) needs the sentencepiece"
                        " package: pip install 'flaxattn[sentencepiece]' (or sentencepiece), or"
                        " set data.tokenizer=bytes.") from None
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:  # what it raises for a file it cannot parse
      raise ConfigError(f"config key 'data.tokenizer' expects a SentencePiece .model file, got"
                        f" {path!r}, which sentencepiece cannot read"
                        f" ({str(e).splitlines()[0] if str(e) else type(e).__name__}).") from None
    self.vocab_size = self._sp.get_piece_size()

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in ids])


def make(name: str, vocab_size: int | None = None):
  """`ByteTokenizer` for "bytes", else a `SentencePieceTokenizer` of the model at `name`.

  Args:
    vocab_size: the model's vocabulary (`model.vocab_size`), which must hold the
      tokenizer's ids; None: not checked.

  Raises:
    ConfigError: `name` is neither "bytes" nor an existing file, sentencepiece is missing
      or cannot read it; a tokenizer with more ids than `vocab_size`.
  """
  if name == "bytes":
    tok = ByteTokenizer()
  elif not os.path.isfile(name):
    raise ConfigError(f"config key 'data.tokenizer' expects 'bytes' or the path of a"
                      f" SentencePiece .model file; got {name!r}, which is not a file.")
  else:
    tok = SentencePieceTokenizer(name)
  if vocab_size is not None and tok.vocab_size > vocab_size:
    raise ConfigError(f"model.vocab_size ({vocab_size}) expects at least the tokenizer's"
                      f" vocabulary ({tok.vocab_size}, data.tokenizer={name!r}).")
  return tok
