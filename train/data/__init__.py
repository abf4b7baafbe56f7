"""A run's data: corpus files -> documents -> packed rows -> global batches.

  sources.py    one reader per corpus format (.txt, .jsonl, .json, .parquet) behind
                `Source`; listing, bad records, content hashes, the held-out split
  streams.py    files as byte streams (plain, .gz, .zst); blocks of compressed files
  pipeline.py   the grain pipeline: order, read + tokenize, split, pack, targets; `make`
  batches.py    `GlobalBatches`: local rows -> global arrays in the run's token order
  tokenizers.py text -> int32 ids (bytes, Hugging Face tokenizer.json, SentencePiece) behind
                `Tokenizer`; the pipeline needs only their `document` (one document's ids,
                with the special tokens that begin and end it)
"""

from train.data.batches import BATCH_SPEC, DTYPES, KEYS, GlobalBatches, abstract_batch
from train.data.pipeline import (
  MIN_TOKENS,
  Data,
  check_evals,
  check_usable,
  make,
  order,
  pipeline,
  shard,
)
from train.data.sources import (
  BadRecord,
  Document,
  Documents,
  Source,
  list_documents,
  split_documents,
)

__all__ = ["BATCH_SPEC", "DTYPES", "KEYS", "MIN_TOKENS", "BadRecord", "Data", "Document",
           "Documents", "GlobalBatches", "Source", "abstract_batch", "check_evals", "check_usable",
           "list_documents", "make", "order", "pipeline", "shard", "split_documents"]
