"""Tokenizers: text -> int32 ids.

The default is byte-level (UTF-8 bytes, ids 0..255, no special tokens): every document is
its own packed segment, so no BOS/EOS is needed to separate documents, and nothing is
downloaded. For real runs: a Hugging Face `tokenizer.json` (the `tokenizers` package; the
format of Llama 3, Qwen and current Mistral), or a SentencePiece `.model`.

Each tokenizer has `encode` (the text's ids, no special tokens), `begin` and `end` (the
special ids a document starts and ends with, as transformers adds them to one text) and
`document` (the three together), and `files` (the bytes of the files it was read from,
which a run keeps in its run_dir, `train.run_dir.save_tokenizer`).
"""

from __future__ import annotations

import importlib
import json

import numpy as np
from etils import epath

from train import storage
from train.config import ConfigError

HF_FILE = "tokenizer.json"
# Read beside tokenizer.json: the names of its BOS and EOS tokens.
HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
SP_FILE = "tokenizer.model"  # the name transformers reads a SentencePiece model by
KEY = "config key 'data.tokenizer'"



def _package(name: str, path: str):
  """The optional package `name`, installed by the extra of the same name.

  Raises:
    ConfigError: it is not installed, naming the key, the file and the extra.
  """
  try:
    return importlib.import_module(name)
  except ImportError:
    raise ConfigError(f"{KEY} ({path!r}) needs the {name} package: pip install"
                      f" 'flaxattn[{name}]' (or {name}), or set data.tokenizer=bytes.") from None

class Tokenizer:
  """What every tokenizer here has (see the module docstring)."""

  begin: tuple[int, ...] = ()
  end: tuple[int, ...] = ()
  bos_id: int | None = None  # the tokens named BOS and EOS (whether or not they are added)
  eos_id: int | None = None
  files: dict[str, bytes] = {}
  vocab_size: int

  def encode(self, text: str) -> np.ndarray:
    """The text's ids `[n]` int32, no special tokens. Every tokenizer here encodes every
    text that encodes to UTF-8 (no lone surrogate): what corpus listing lets through
    (`train.data.sources`)."""
    raise NotImplementedError

  def decode(self, ids) -> str:
    """The text of `ids` (special tokens left out)."""
    raise NotImplementedError

  def piece(self, i: int | None) -> str | None:
    """The text of token `i` as the vocabulary holds it (None for None, or no vocabulary)."""
    return None

  def document(self, text: str, end: bool = True) -> np.ndarray:
    """One document's ids `[n]` int32: `begin`, the text's, and (with `end`) `end`. Each
    document is encoded alone, so special tokens never cross into another document; a
    prompt to continue takes `end=False`."""
    parts = [np.asarray(self.begin, np.int32), self.encode(text)]
    return np.concatenate(parts + ([np.asarray(self.end, np.int32)] if end else []))


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes as ids 0..255."""

  vocab_size = 256

  def encode(self, text: str) -> np.ndarray:
    """ids `[len(text.encode())]` int32."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")


def _first_line(e: Exception) -> str:
  return str(e).splitlines()[0] if str(e) else type(e).__name__


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model file (`.model`); ids as the model numbers them. No special
  tokens are added to a document (`begin` and `end` are empty).

  Raises:
    ConfigError: the `sentencepiece` package is not installed, or the file is not a
      SentencePiece model it reads.
  """

  def __init__(self, path: str):
    sentencepiece = _package("sentencepiece", path)
    data = storage.path(path).read_bytes()
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)
    except (OSError, RuntimeError) as e:  # what it raises for a file it cannot parse
      raise ConfigError(f"{KEY} expects a SentencePiece .model file, got"
                        f" {path!r}, which sentencepiece cannot read ({_first_line(e)}).") from None
    self.vocab_size = self._sp.get_piece_size()
    self.bos_id, self.eos_id = (i if i >= 0 else None for i in (self._sp.bos_id(),
                                                                 self._sp.eos_id()))
    self.files = {SP_FILE: data}

  def piece(self, i: int | None) -> str | None:
    """The text of token `i` (None for None)."""
    return None if i is None else self._sp.id_to_piece(i)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in ids])


def _json_object(path: epath.Path) -> dict:
  """The JSON object in `path`; {} when there is no such file.

  Raises:
    ConfigError naming the key and the file: not a JSON object.
  """
  if not path.is_file():
    return {}
  try:
    value = json.loads(path.read_bytes())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"{KEY}: {str(path)!r} is not JSON ({e}); restore the tokenizer's"
                      " files.") from None
  if not isinstance(value, dict):
    raise ConfigError(f"{KEY}: {str(path)!r} expects a JSON object, got a JSON"
                      f" {type(value).__name__}; restore the tokenizer's files.")
  return value


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
  """A Hugging Face `tokenizer.json` (the `tokenizers` package).

  The special tokens a document starts and ends with are those transformers adds to one
  text: the ones the tokenizer's post-processor adds (Llama 3's: BOS; Qwen's: none).
  transformers 5 reads `add_bos_token` / `add_eos_token` of tokenizer_config.json only for
  a tokenizer without tokenizer.json (it drops them when it loads one; checked in 5.24's
  `PreTrainedTokenizerBase._from_pretrained`), so they are not read here either.
  tokenizer_config.json (or special_tokens_map.json) names the BOS and EOS tokens
  (`bos_id`, `eos_id`), which `train.init_from.check_tokenizer` compares with a checkpoint's.

  Args:
    path: a `tokenizer.json`, or a directory holding one (a Hugging Face model directory).

  Raises:
    ConfigError: the `tokenizers` package is missing; the file does not read, a file
      beside it is not a JSON object, or a special token it names is not in the vocabulary.
  """

  def __init__(self, path: str):
    tokenizers = _package("tokenizers", path)
    p = storage.path(path)
    file = p / HF_FILE if p.is_dir() else p
    data = file.read_bytes()
    try:  # from the bytes, not the path: a gs:// URL reads through `train.storage`
      self._tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
      raise ConfigError(f"{KEY} expects a Hugging Face tokenizer.json, got {str(file)!r},"
                        f" which the tokenizers package cannot read ({_first_line(e)}).") from None
    # Every file the tokenizer was read from, the config ones where present.
    self.files = {HF_FILE: data}
    self.files.update({n: (file.parent / n).read_bytes() for n in HF_CONFIG_FILES
                       if (file.parent / n).is_file()})
    config, names = (_json_object(file.parent / n) for n in HF_CONFIG_FILES)
    self.bos_id, self.eos_id = (
        self._id(_token_text(config.get(k, names.get(k))), k, file.parent)
        for k in ("bos_token", "eos_token"))
    self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
    # The post-processor's special tokens around a one-token text: the leading ones begin a
    # document, the trailing ones end it.
    probe = self._tok.encode("a", add_special_tokens=True)
    special = probe.special_tokens_mask
    lead = next((i for i, s in enumerate(special) if not s), len(special))
    trail = next((i for i, s in enumerate(reversed(special)) if not s), 0)
    self.begin = tuple(probe.ids[:lead])
    self.end = tuple(probe.ids[len(special) - trail:])

  def _id(self, token: str | None, key: str, where: epath.Path) -> int | None:
    if token is None:
      return None
    i = self._tok.token_to_id(token)
    if i is None:
      raise ConfigError(f"{KEY}: the {key} {token!r} that {str(where)!r}'s"
                        f" {' or '.join(HF_CONFIG_FILES)} names is not in its {HF_FILE}'s"
                        " vocabulary; restore the tokenizer's files.")
    return i

  def piece(self, i: int | None) -> str | None:
    """The text of token `i` (None for None)."""
    return None if i is None else self._tok.id_to_token(i)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def make(name: str, vocab_size: int | None = None):
  """The tokenizer `name` names: `ByteTokenizer` for "bytes"; `HFTokenizer` for a `.json`
  file or a directory holding tokenizer.json; else `SentencePieceTokenizer` (a `.model`
  file, or a directory holding tokenizer.model).

  Args:
    vocab_size: the model's vocabulary (`model.vocab_size`), which must hold the
      tokenizer's ids; None: not checked.

  Raises:
    ConfigError: `name` is neither "bytes" nor an existing file or such a directory, or
      its tokenizer does not read (see the classes); a tokenizer with more ids than
      `vocab_size`.
  """
  expects = (f"{KEY} expects 'bytes', a Hugging Face tokenizer.json (or a directory holding"
             " one, such as a model directory) or the path of a SentencePiece .model file; got"
             f" {name!r}")
  path = None if name == "bytes" else storage.path(name)
  if path is None:
    tok = ByteTokenizer()
  elif path.is_dir():
    if (path / HF_FILE).is_file():
      tok = HFTokenizer(name)
    elif (path / SP_FILE).is_file():
      tok = SentencePieceTokenizer(str(path / SP_FILE))
    else:
      raise ConfigError(f"{expects}, a directory with neither {HF_FILE} nor {SP_FILE}.")
  elif not path.is_file():
    raise ConfigError(f"{expects}, which is not a file.")
  elif path.suffix == ".json":
    tok = HFTokenizer(name)
  else:
    tok = SentencePieceTokenizer(name)
  if vocab_size is not None:
    check_vocab(tok, vocab_size, name)
  return tok


def check_vocab(tok, vocab_size: int, name: str) -> None:
  """Raises ConfigError unless the model's `vocab_size` holds every id of `tok` (the
  tokenizer data.tokenizer=`name`)."""
  if tok.vocab_size > vocab_size:
    raise ConfigError(f"model.vocab_size ({vocab_size}) expects at least the tokenizer's"
                      f" vocabulary ({tok.vocab_size}, data.tokenizer={name!r}).")
