"""Documents -> packed rows, through grain; `make` assembles a run's data.

Per process:
  documents (`train.data.sources`; the held-out ones by a hash of their text) -> this
  process's shard -> shuffled each epoch (`order`), repeated -> read + tokenize -> split
  into pieces of <= seq_len -> first-fit packed into rows of seq_len (`segment_ids` 1, 2,
  ... and `positions` restarting at 0; 0 = padding) -> batched -> next-token targets and
  weights (`models.llama.make_targets`, in the original token order).
`train.data.batches.GlobalBatches` then makes global arrays of them.
The grain iterator's state (`get_state`/`set_state`) is what checkpoints save: every step
before the read is random access by index, so that state is a count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import sys
import threading
from collections.abc import Callable

import grain
import numpy as np

import flaxattn
from models.llama import layer_masks, make_targets
from train import distributed
from train.config import ConfigError, DataConfig, TrainConfig
from train.data import sources
from train.data.batches import GlobalBatches
from train.data.sources import Document, Documents

log = logging.getLogger(__name__)

MIN_TOKENS = 2  # a piece needs a token and its next-token target
# Shuffled parquet documents (and compressed files') are mixed within windows of this many
# (mean-sized) row groups (blocks).
WINDOW_BLOCKS = 2


def shard(docs: Documents, index: int, count: int) -> Documents:
  """Shard `index` of `count` of `docs`: every count-th block of documents
  (`Documents.block_starts`: a parquet row group, so that no two shards decode one; else a
  document).

  Raises:
    ConfigError: the shard holds no documents.
  """
  sizes = np.diff(docs.block_starts())
  part = docs[np.repeat(np.arange(len(sizes)) % count == index, sizes)]
  if not part:
    raise ConfigError(f"data shard {index} of {count} holds no documents; use more"
                      " documents (or parquet row groups) or fewer data-parallel processes.")
  return part


def check_usable(docs: Documents, tokenizer, what: str, fix: str) -> None:
  """Raises ConfigError naming `what` and `fix` unless a document of `docs` has
  `MIN_TOKENS` tokens. The pipeline repeats its documents forever, so one such document
  keeps it from running dry, and with none it would search forever. Reads documents in
  order until one qualifies (usually the first)."""
  for doc in docs:
    if len(tokenizer.document(doc.read())) >= MIN_TOKENS:
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


class _BlockShuffle:
  """`docs` endlessly, each epoch in a new order: their units in a random order, then the
  documents within each window of `self.window` in a random order; random access by index
  (a grain data source). A unit is a run of documents of one block (`Source.blocks`, as
  listing left them: a parquet row group), or all the blocks of a source read in order (a
  compressed stream: its blocks keep their order, so that an epoch decompresses it once).
  A window holds `window_blocks` blocks' worth of documents. Holds one epoch's order, an
  index per document."""

  def __init__(self, docs: Documents, seed: int, window_blocks: int = WINDOW_BLOCKS):
    self.docs, self.seed = docs, seed
    starts = docs.block_starts()
    self.window = window_blocks * math.ceil(len(docs) / (len(starts) - 1))
    first = starts[:-1]
    source = docs.source_ids[first]
    ordered = np.asarray([s.ordered for s in docs.sources], bool)[source]
    new_unit = np.ones(len(first), bool)
    new_unit[1:] = ~ordered[1:] | (source[1:] != source[:-1])
    self.starts = np.concatenate([first[new_unit], starts[-1:]])
    self.epoch = (-1, np.zeros(0, np.int64))  # the last epoch read and its order
    self.lock = threading.Lock()

  @property
  def units(self) -> int:
    return len(self.starts) - 1

  def __len__(self) -> int:
    return sys.maxsize

  def _order(self, epoch: int) -> np.ndarray:
    with self.lock:
      if self.epoch[0] != epoch:
        rng = np.random.default_rng([self.seed, epoch])
        units = rng.permutation(self.units)
        sizes = self.starts[units + 1] - self.starts[units]
        begins = np.cumsum(sizes) - sizes  # where each unit begins in the epoch
        docs = np.repeat(self.starts[units] - begins, sizes) + np.arange(len(self.docs))
        windows = np.arange(len(self.docs)) // self.window
        self.epoch = (epoch, docs[np.lexsort((rng.random(len(self.docs)), windows))])
      return self.epoch[1]

  def __getitem__(self, index: int) -> Document:
    epoch, i = divmod(index, len(self.docs))
    return self.docs[int(self._order(epoch)[i])]


def order(docs: Documents, *, seed: int, shuffle: bool) -> grain.MapDataset:
  """`docs` repeated forever, by index (so that the iterator's state is a count).

  Without `shuffle`, in their order. With it, shuffled anew each epoch: globally where
  every document is its own block and no source is read in order (`.txt`, plain JSON);
  else (`.parquet` row groups, compressed files) by units (`_BlockShuffle`: a row group, or
  a compressed file's blocks in order) in a random order, then within windows of
  `WINDOW_BLOCKS` blocks' worth of documents. A global shuffle of parquet rows would decode
  a row group per document, and of a compressed file's records decompress the file up to
  each one.
  """
  if not shuffle:
    return grain.MapDataset.source(docs).repeat(None)
  units = _BlockShuffle(docs, seed)
  if units.units == len(docs):
    return grain.MapDataset.source(docs).shuffle(seed).repeat(None)
  return grain.MapDataset.source(units)


def pipeline(docs: Documents, tokenizer, cfg: DataConfig, *, seq_len: int, batch: int,
             seed: int, shard_index: int, shard_count: int, shuffle: bool) -> grain.IterDataset:
  """Endless packed batches (dicts of `[batch, seq_len]` numpy arrays, keys `KEYS`) of
  shard `shard_index` of `shard_count` of `docs`; `check_usable` tells whether any come.

  Raises:
    ConfigError: the shard holds no documents.
  """
  ds = order(shard(docs, shard_index, shard_count), seed=seed, shuffle=shuffle)
  ds = ds.map(lambda d: tokenizer.document(d.read()))
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.read_threads,
                                            prefetch_buffer_size=4 * cfg.packing_bins))
  ds = grain.experimental.FlatMapIterDataset(ds, _SplitPieces(seq_len))
  ds = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"tokens": seq_len}, num_packing_bins=max(cfg.packing_bins, batch),
      seed=seed, shuffle_bins=shuffle)
  return ds.batch(batch, drop_remainder=True).map(_with_targets)


@dataclasses.dataclass(frozen=True)
class Data:
  """A run's data: the global batch builder, the endless batches of this process's shard
  of the training documents and of the held-out ones (None with `eval_every=0`), the
  model's masks, one per layer, which weigh its tokens, and the corpus's fingerprint
  (`Documents.fingerprint`: what its data positions depend on)."""

  batches: GlobalBatches
  train: grain.IterDataset
  eval: grain.IterDataset | None
  masks: tuple[flaxattn.Mask, ...]
  corpus: dict[str, str]


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
      with nothing to evaluate (`check_evals`); processes that list different corpora.
  """
  masks = layer_masks(cfg.model)
  batches = GlobalBatches(mesh, batch_size=cfg.batch_size, seq_len=cfg.seq_len, cp=cp,
                          masks=masks)
  docs = sources.list_documents(cfg.data.source, cfg.data.bad_records, cfg.data.text_field)
  corpus = docs.fingerprint()
  _check_same_everywhere(cfg.data.source, corpus)
  train_docs, eval_docs = sources.split_documents(docs, cfg.data.eval_fraction)
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
  return Data(batches, pipes[0], pipes[1] if len(pipes) > 1 else None, masks, corpus)


def _check_same_everywhere(source: str, corpus: dict[str, str]) -> None:
  """Raises ConfigError on every process unless every process listed the same corpus
  (`corpus`, its fingerprint): a host with another copy of it would take its shard of other
  documents, and hold out others. A collective."""
  text = json.dumps(corpus, sort_keys=True).encode()
  digest = int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little") >> 1
  if distributed.process_max(digest) != -distributed.process_max(-digest):  # int32s
    raise ConfigError(f"data.source {source!r} lists other files or contents on some processes"
                      " than on others; every process must read the same corpus: point"
                      " data.source at storage every host reads, or make the copies equal.")
