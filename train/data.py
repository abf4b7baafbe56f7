"""Documents -> packed rows -> global batches, through grain.

Per process:
  documents (sorted; bad records left out; the held-out ones by a hash of their name)
  -> this process's shard -> shuffled each epoch, repeated -> read + tokenize -> split into
  pieces of <= seq_len -> first-fit packed into rows of seq_len (`segment_ids` 1, 2, ...
  and `positions` restarting at 0; 0 = padding) -> batched -> next-token targets and
  weights (`models.llama.make_targets`, in the original token order).
Then `GlobalBatches` permutes every per-token array into the load-balanced order (under
context parallelism, `data.balance`: per document by one `flaxattn.balance_plan` of the
batch, or the whole row by `flaxattn.load_balance`) and assembles global arrays with
`jax.make_array_from_process_local_data`: batch over (data, fsdp), sequence over
(context_ring, context).
The grain iterator's state (`get_state`/`set_state`) is what checkpoints save.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re
import sysconfig
import zlib
from collections.abc import Callable

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flaxattn
from models.llama import layer_masks, make_targets
from train.config import ConfigError, DataConfig, TrainConfig

log = logging.getLogger(__name__)

BATCH_SPEC = P(("data", "fsdp"), ("context_ring", "context"))  # ContextParallel.seq_axes
KEYS = ("tokens", "targets", "weights", "segment_ids", "positions")
DTYPES = {"tokens": np.int32, "targets": np.int32, "weights": np.float32,
          "segment_ids": np.int32, "positions": np.int32}
MIN_TOKENS = 2  # a piece needs a token and its next-token target
# A text file with more undecodable bytes than this share is not UTF-8 text (binary, or
# another encoding); fewer are a few damaged characters, read as U+FFFD.
MAX_UNDECODABLE = 0.01
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes that `surrogateescape` kept


class BadRecord(ValueError):
  """A record that cannot be trained on; the message says why."""


def _record_text(line: bytes) -> str:
  """The "text" of a `.jsonl` line, or BadRecord."""
  try:
    record = json.loads(line)
  except UnicodeDecodeError:
    raise BadRecord("not UTF-8") from None
  except json.JSONDecodeError as e:
    raise BadRecord(f"not JSON ({e.msg})") from None
  if not isinstance(record, dict) or not isinstance(record.get("text"), str):
    raise BadRecord('not a JSON object with a string "text"')
  return record["text"]


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


@dataclasses.dataclass(frozen=True)
class Document:
  """One document: a whole file (`line` -1) or line `line` of a `.jsonl` file at byte
  `offset`. `name` is stable across machines (the eval split hashes it)."""

  name: str
  path: str
  line: int = -1
  offset: int = 0

  def read(self) -> str:
    """The document's text (listing checked it; a few undecodable bytes read as U+FFFD).

    Raises:
      BadRecord: the `.jsonl` line is no longer valid (its file changed since listing).
    """
    if self.line < 0:
      return pathlib.Path(self.path).read_bytes().decode("utf-8", errors="replace")
    with open(self.path, "rb") as f:
      f.seek(self.offset)
      line = f.readline()
    try:
      return _record_text(line)
    except BadRecord as e:
      raise BadRecord(f"{self.name}: {e}; the file changed after the corpus was listed.") from None


def _stdlib_files() -> tuple[pathlib.Path, list[pathlib.Path]]:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "dist-packages"}  # installed packages, not the standard library
  return root, [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)]


def _file_documents(path: pathlib.Path, name: str) -> tuple[list[Document], list[str]]:
  """(documents, problems) of one file: its lines for `.jsonl`, else the whole file."""
  if path.suffix != ".jsonl":
    try:
      _check_text(path.read_bytes())
    except BadRecord as e:
      return [], [f"{name}: {e}"]
    return [Document(name, str(path))], []
  docs, problems, offset = [], [], 0
  with open(path, "rb") as f:
    for i, line in enumerate(f):
      if line.strip():
        try:
          _record_text(line)
          docs.append(Document(f"{name}:{i}", str(path), i, offset))
        except BadRecord as e:
          problems.append(f"{name} line {i + 1}: {e}")
      offset += len(line)
  return docs, problems


def list_documents(source: str, bad_records: str = "skip") -> list[Document]:
  """All documents of `source` ("stdlib" or a directory), in a deterministic order.

  Every record is checked here, so that a bad one cannot stop training when the pipeline
  reaches it (and again at each resume): with `bad_records` "skip" (see
  `DataConfig.bad_records`) bad records are left out and counted in a warning.

  Raises:
    ConfigError: the directory does not exist or holds no usable `.txt`/`.jsonl`
      documents; bad records with `bad_records` "error".
  """
  if source == "stdlib":
    root, files = _stdlib_files()
  else:
    root = pathlib.Path(source)
    if not root.is_dir():
      raise ConfigError(f"data.source expects 'stdlib' or a directory, got {source!r}"
                        " (not a directory).")
    files = [p for p in root.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file()]
  docs, problems = [], []
  for path in sorted(files):
    file_docs, file_problems = _file_documents(path, path.relative_to(root).as_posix())
    docs += file_docs
    problems += file_problems
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
                      " with a 'text' field).")
  return docs


def split_documents(docs: list[Document], eval_fraction: float) -> tuple[list, list]:
  """(train, eval): a document is held out when the hash of its name falls in
  `eval_fraction`; at least one is held out when `eval_fraction` > 0.

  Raises:
    ConfigError: nothing left to train on.
  """
  held = [zlib.crc32(d.name.encode()) % 100_000 < eval_fraction * 100_000 for d in docs]
  if eval_fraction > 0 and not any(held):
    held[0] = True
  train = [d for d, h in zip(docs, held, strict=True) if not h]
  if not train:
    raise ConfigError(f"data.eval_fraction={eval_fraction} leaves no training documents.")
  return train, [d for d, h in zip(docs, held, strict=True) if h]


def shard(docs: list[Document], index: int, count: int) -> list[Document]:
  """Shard `index` of `count` of `docs` (every count-th document).

  Raises:
    ConfigError: the shard holds no documents.
  """
  part = docs[index::count]
  if not part:
    raise ConfigError(f"data shard {index} of {count} holds no documents; use more"
                      " documents or fewer data-parallel processes.")
  return part


def check_usable(docs: list[Document], tokenizer, what: str, fix: str) -> None:
  """Raises ConfigError naming `what` and `fix` unless a document of `docs` has
  `MIN_TOKENS` tokens. The pipeline repeats its documents forever, so one such document
  keeps it from running dry, and with none it would search forever. Reads documents in
  order until one qualifies (usually the first)."""
  for doc in docs:
    if len(tokenizer.encode(doc.read())) >= MIN_TOKENS:
      return
  raise ConfigError(f"{what}: none of its {len(docs)} documents has the {MIN_TOKENS} tokens"
                    f" a training piece needs (all are empty or shorter); {fix}.")


def check_evals(cfg: TrainConfig, held_out: int) -> None:
  """Raises ConfigError unless evals (`eval_every` > 0) have something to evaluate:
  `held_out` > 0 documents and `data.eval_batches` >= 1. (A saved config with neither
  still loads: its model can be exported and sampled.)"""
  if not held_out:
    raise ConfigError(f"config key 'eval_every' ({cfg.eval_every}) evaluates on held-out"
                      f" documents, but data.eval_fraction={cfg.data.eval_fraction} holds none"
                      " out; set data.eval_fraction > 0, or eval_every=0 for no evals.")
  if cfg.data.eval_batches < 1:
    raise ConfigError(f"config key 'data.eval_batches' expects at least 1 when evals run"
                      f" (eval_every={cfg.eval_every}), got {cfg.data.eval_batches}; set"
                      " eval_every=0 for no evals.")


class _SplitPieces(grain.experimental.FlatMapTransform):
  """A tokenized document -> pieces of at most `seq_len` tokens (the packer refuses longer
  ones); pieces with fewer than `MIN_TOKENS` tokens have no next-token target and are
  dropped."""

  def __init__(self, seq_len: int):
    self.seq_len = seq_len
    self.max_fan_out = 1 << 20  # unused by the iterator version; required by the base

  def flat_map(self, ids):
    pieces = [ids[i:i + self.seq_len] for i in range(0, len(ids), self.seq_len)]
    return [{"tokens": p} for p in pieces if len(p) >= MIN_TOKENS]


def _with_targets(packed: dict) -> dict:
  tokens, segment_ids = packed["tokens"], packed["tokens_segment_ids"]
  targets, weights = make_targets(tokens, segment_ids)
  return {"tokens": tokens, "targets": targets, "weights": weights,
          "segment_ids": segment_ids, "positions": packed["tokens_positions"]}


def pipeline(docs: list[Document], tokenizer, cfg: DataConfig, *, seq_len: int, batch: int,
             seed: int, shard_index: int, shard_count: int, shuffle: bool) -> grain.IterDataset:
  """Endless packed batches (dicts of `[batch, seq_len]` numpy arrays, keys `KEYS`) of
  shard `shard_index` of `shard_count` of `docs`; `check_usable` tells whether any come.

  Raises:
    ConfigError: the shard holds no documents.
  """
  source = grain.MapDataset.source(shard(docs, shard_index, shard_count))
  if shuffle:
    source = source.shuffle(seed)
  ds = source.repeat(None).map(lambda d: tokenizer.encode(d.read()))
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.read_threads,
                                            prefetch_buffer_size=4 * cfg.packing_bins))
  ds = grain.experimental.FlatMapIterDataset(ds, _SplitPieces(seq_len))
  ds = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"tokens": seq_len}, num_packing_bins=max(cfg.packing_bins, batch),
      seed=seed, shuffle_bins=shuffle)
  return ds.batch(batch, drop_remainder=True).map(_with_targets)


class GlobalBatches:
  """This process's part of global `[batch_size, seq_len]` batches, assembled into
  `jax.Array`s sharded `P(("data", "fsdp"), ("context_ring", "context"))` over `mesh`.

  The rows (and columns, if the context axis spans processes) that this process's devices
  hold decide which data shard it reads: processes holding the same rows read the same
  shard and keep their own columns.

  Args:
    mesh: the training mesh (`train.config.MESH_AXES`).
    cp: the run's context parallelism, whose token order (`ContextParallel.load_balance`
      over its `balanced_shards`) the batches are permuted into; None: the original order.
    masks: with per-document order, the model's masks, one per layer
      (`models.llama.layer_masks`), which weigh each token's work.
  """

  def __init__(self, mesh, *, batch_size: int, seq_len: int,
               cp: flaxattn.ContextParallel | None = None, masks=None):
    self.sharding = NamedSharding(mesh, BATCH_SPEC)
    self.shape = (batch_size, seq_len)
    self.shards = 1 if cp is None else cp.balanced_shards(mesh)
    # "document", True (row order) or None (the original order)
    self.order = cp.load_balance if cp is not None and self.shards > 1 else None
    self.masks = masks
    index = self.sharding.addressable_devices_indices_map(self.shape).values()
    # jax annotates each index `| None`; it builds them from devices_indices_map (no None).
    rows = [i[0].indices(batch_size) for i in index]  # pyright: ignore[reportOptionalSubscript]
    cols = [i[1].indices(seq_len) for i in index]  # pyright: ignore[reportOptionalSubscript]
    self.rows = slice(min(r[0] for r in rows), max(r[1] for r in rows))
    self.cols = slice(min(c[0] for c in cols), max(c[1] for c in cols))
    self.local_batch = self.rows.stop - self.rows.start
    self.shard_index = self.rows.start // self.local_batch
    self.shard_count = batch_size // self.local_batch

  def to_global(self, local: dict) -> dict:
    """Global arrays of a local batch (dict of `[local_batch, seq_len]` numpy arrays)."""
    out = {}
    plan = None
    if self.order == "document":  # one plan for every array
      plan = flaxattn.balance_plan(local["segment_ids"], self.shards, self.masks)
    for key in KEYS:
      x = local[key]
      if plan is not None:  # renumbered ids: the same documents, narrower ranges per block
        x = plan.segment_ids(x) if key == "segment_ids" else plan.apply(x)
      elif self.order is True:
        x = flaxattn.load_balance(x, self.shards)
      out[key] = jax.make_array_from_process_local_data(
          self.sharding, x[:, self.cols].astype(DTYPES[key], copy=False), self.shape)
    return out


def abstract_batch(mesh, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch a train step takes (`GlobalBatches.to_global`'s arrays) as shapes,
  dtypes and shardings over `mesh`: `KEYS` -> `[batch_size, seq_len]`."""
  sharding = NamedSharding(mesh, BATCH_SPEC)
  return {key: jax.ShapeDtypeStruct((batch_size, seq_len), DTYPES[key], sharding=sharding)
          for key in KEYS}


@dataclasses.dataclass(frozen=True)
class Data:
  """A run's data: the global batch builder, the endless batches of this process's shard
  of the training documents and of the held-out ones (None with `eval_every=0`), and the
  model's masks, one per layer, which weigh its tokens."""

  batches: GlobalBatches
  train: grain.IterDataset
  eval: grain.IterDataset | None
  masks: tuple[flaxattn.Mask, ...]


def make(cfg: TrainConfig, tok, mesh, cp: flaxattn.ContextParallel | None,
         wait: Callable) -> Data:
  """The data of `cfg` on `mesh`, tokenized by `tok`: the documents of `data.source` split
  into training and held-out ones, each part checked to yield rows.

  Args:
    cp: the run's context parallelism (see `GlobalBatches`).
    wait: runs a function that reads documents and returns its result, or raises
      `train.stop.Stopped` at a SIGTERM or SIGINT (`StopRequest.call`).

  Raises:
    ConfigError: no documents, or none long enough, in a shard (on any process); evals
      with nothing to evaluate (`check_evals`).
  """
  masks = layer_masks(cfg.model)
  batches = GlobalBatches(mesh, batch_size=cfg.batch_size, seq_len=cfg.seq_len, cp=cp,
                          masks=masks)
  train_docs, eval_docs = split_documents(
      list_documents(cfg.data.source, cfg.data.bad_records), cfg.data.eval_fraction)
  log.info("%d train / %d eval documents", len(train_docs), len(eval_docs))
  parts = [(train_docs, True, f"data.source {cfg.data.source!r} (the training documents)",
            "use longer documents")]
  if cfg.eval_every:
    check_evals(cfg, len(eval_docs))
    parts.append((eval_docs, False, f"data.eval_fraction={cfg.data.eval_fraction} (the held-out"
                  " documents)", "raise data.eval_fraction, or set eval_every=0 to skip eval"))
  pipes = []
  for docs, shuffle, what, fix in parts:

    def check(docs=docs, what=what, fix=fix):
      return check_usable(shard(docs, batches.shard_index, batches.shard_count), tok, what, fix)
    wait(check)
    pipes.append(pipeline(docs, tok, cfg.data, seq_len=cfg.seq_len, batch=batches.local_batch,
                          seed=cfg.seed, shard_index=batches.shard_index,
                          shard_count=batches.shard_count, shuffle=shuffle))
  return Data(batches, pipes[0], pipes[1] if len(pipes) > 1 else None, masks)
