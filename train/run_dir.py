"""The run directory: what a run keeps there, and how a run starts in it.

  checkpoints/<step>/      orbax checkpoints (`train.checkpoint`)
  checkpoints_unusable/    damaged steps, set aside when restoring
  config.json              the config the checkpoints were saved with
  tokenizer/               a copy of the files of the run's tokenizer (`save_tokenizer`):
                           resume, export and sample read it, not data.tokenizer's path
  corpus.json              the fingerprint of the corpus its data positions count in
                           (`save_corpus`, `check_corpus`)
  metrics.jsonl, tensorboard/, loss.png, eval_loss_by_position.png   (`train.metrics`)
  archive/<time>/          an earlier run's files, moved there when a run starts over

A run_dir is a local directory or a `gs://BUCKET/PATH` URL: every file goes through
`train.storage`.

`check` runs before anything else: it compares the config with the saved one. A change
that gives the model other parameters (`models.llama.param_changes`: derived from the
model's parameter shapes, so every option that changes them is caught) or a data stream
other than the one whose position was saved (`DATA_KEYS`) would resume state that does not
fit, so it is refused with a config error naming the keys, and nothing in the directory is
touched; other differences (steps, learning rate, eval_every, a sliding window, ...) are
logged and let through. Once the corpus is listed, `check_corpus` refuses a corpus whose
files changed since (a data position counts documents of the corpus it was saved in).
`resume=false` skips the comparisons and starts over, moving the
earlier run's files into `archive/` (nothing is deleted; remove the archive to free its
space).
"""

from __future__ import annotations

import datetime
import json
import logging

import jax

from models.llama import param_changes
from train import distributed, storage
from train.config import ConfigError, TrainConfig, from_dict, to_dict
from train.data import tokenizers

log = logging.getLogger(__name__)

# The data stream whose iterator position each checkpoint holds.
DATA_KEYS = ("seq_len", "batch_size", "seed", "data.source", "data.text_field",
             "data.tokenizer", "data.eval_fraction", "data.packing_bins")
# Keys every config.json the trainer writes holds: a resume compares them. (A config.json
# saved before data.text_field existed lacks it, and loads with its default.)
SAVED_KEYS = tuple(k for k in DATA_KEYS if k != "data.text_field") + tuple(
    f"model.{k}" for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"))
CHECKPOINT_FILES = ("checkpoints", "checkpoints_unusable")
CORPUS_FILE = "corpus.json"
OUTPUT_FILES = ("config.json", "tokenizer", CORPUS_FILE, "metrics.jsonl", "tensorboard",
                "loss.png", "eval_loss_by_position.png")
TOKENIZER_DIR = "tokenizer"


def timestamp() -> str:
  """Local time to the microsecond, for names of set-aside and archived files."""
  return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")


def saved_config(run_dir: str) -> TrainConfig:
  """The config that `run_dir`'s checkpoints were saved with: its config.json.

  Raises:
    ConfigError naming config.json: missing, not JSON, not a JSON object holding the keys
      the trainer writes (`SAVED_KEYS`), or values the schema rejects.
  """
  path = storage.path(run_dir) / "config.json"
  fix = ("restore it from a backup or the run's archive/; to start a new run here instead, pass"
         " resume=false (the run's files are moved to archive/).")
  try:
    values = json.loads(path.read_text())
  except FileNotFoundError:
    raise ConfigError(f"{path}: missing; the config of the run's checkpoints is written there"
                      " with the first checkpoint.") from None
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"{path}, the config of the run's checkpoints, is not JSON ({e}); {fix}"
                      ) from None
  if not isinstance(values, dict):
    got = f"a JSON {type(values).__name__} ({json.dumps(values)[:60]})"
  elif missing := [k for k in SAVED_KEYS if _flat(values).get(k) is None]:
    got = f"an object without {', '.join(missing)}"
  else:
    got = None
  if got:
    raise ConfigError(f"{path}, the config of the run's checkpoints, expects a JSON object of"
                      f" the run's config keys (as the trainer writes it), got {got}; {fix}")
  try:
    return from_dict(values)
  except ConfigError as e:
    raise ConfigError(f"{path}, the config of the run's checkpoints, does not load: {e}") from None


def _flat(values: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in values.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def check(cfg: TrainConfig) -> None:
  """Refuses a config whose model has other parameters than the run's saved config.json
  (`models.llama.param_changes`) or whose `DATA_KEYS` differ (unless `cfg.resume` is
  false); logs the other differences. Reads files only; starts no jax backend.

  Raises:
    ConfigError: naming each refused key with its saved and new value, or a saved
      config.json that does not load (`saved_config`).
  """
  path = storage.path(cfg.run_dir) / "config.json"
  if not cfg.resume or not path.is_file():
    return
  saved_cfg = saved_config(cfg.run_dir)
  saved, new = _flat(to_dict(saved_cfg)), _flat(to_dict(cfg))
  changed = {k: (saved[k], new[k]) for k in new if saved.get(k) != new[k]}
  refused = [f"model.{k} (saved {getattr(saved_cfg.model, k)!r}, now {getattr(cfg.model, k)!r})"
             for k in param_changes(saved_cfg.model, cfg.model)]
  refused += [f"{k} (saved {changed[k][0]!r}, now {changed[k][1]!r})" for k in DATA_KEYS
              if k in changed]
  if refused:
    raise ConfigError(
        f"run_dir {cfg.run_dir!r} holds a run saved with another value of "
        + ", ".join(refused) + ". These keys decide the model's parameters or the data stream"
        " the checkpoints resume, so its checkpoints cannot continue under this config."
        " Resume with the saved values (config.json in the run_dir), use a new run_dir, or"
        " pass resume=false to start over (the run's files are moved to archive/, not deleted).")
  if changed:
    log.info("resuming %s with changed config keys: %s", cfg.run_dir,
             ", ".join(f"{k} {old!r} -> {now!r}" for k, (old, now) in changed.items()))


def create(run_dir: str, start_over: bool = False) -> None:
  """Creates the run directory `run_dir` if needed (a bucket's needs no creating: its
  objects' names hold the path); with `start_over`, moves an earlier run's files in it to
  `archive/` (`archive`).

  Raises:
    ConfigError: it cannot be created (or is not a directory); nothing was moved.
  """
  try:
    if not storage.is_url(run_dir):
      storage.path(run_dir).mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"config key 'run_dir' expects a directory that exists or can be created;"
                      f" got {run_dir!r} ({e.strerror}: {e.filename}). Choose another"
                      " path.") from None
  if start_over:
    archive(run_dir, CHECKPOINT_FILES + OUTPUT_FILES, "resume=false")


def save_config(cfg: TrainConfig) -> None:
  """Writes config.json (atomically: a run killed meanwhile leaves the old one)."""
  storage.write_atomic(storage.path(cfg.run_dir) / "config.json",
                       json.dumps(to_dict(cfg), indent=2))


def save_tokenizer(run_dir: str, tok: tokenizers.Tokenizer) -> None:
  """Copies the files the run's tokenizer `tok` was read from (`tok.files`; none for
  "bytes") into `run_dir`'s tokenizer/, on process 0, unless a copy is there: a run that
  resumes keeps the copy its checkpoints were trained with (a run that starts over has
  moved it to archive/). `storage.write_dir`: a run killed meanwhile leaves no partial
  copy locally; on a bucket, the next start completes one."""
  target = storage.path(run_dir) / TOKENIZER_DIR
  if (jax.process_index() != 0 or not tok.files
      or all((target / name).exists() for name in tok.files)):
    return
  storage.write_dir(target, tok.files)


def save_corpus(run_dir: str, corpus: dict[str, str]) -> None:
  """Writes the fingerprint of the run's corpus (`train.data.Data.corpus`) to `run_dir`'s
  corpus.json on process 0, unless one is there (a resumed run's, which `check_corpus`
  found equal; a run that starts over has moved it to archive/). Atomically."""
  path = storage.path(run_dir) / CORPUS_FILE
  if jax.process_index() != 0 or path.exists():
    return
  storage.write_atomic(path, json.dumps({"files": corpus}, indent=0))


def check_corpus(cfg: TrainConfig, corpus: dict[str, str]) -> None:
  """Refuses to resume a run (`cfg.resume`, its config.json saved with its first
  checkpoint) on another corpus than the one its data positions count in: `corpus`
  (`train.data.Data.corpus`) against its corpus.json (`save_corpus`; a run_dir without one
  is not checked).

  Raises:
    ConfigError: naming the files that changed, are new or are gone; or a corpus.json
      that does not read.
  """
  run = storage.path(cfg.run_dir)
  path = run / CORPUS_FILE
  if not cfg.resume or not (run / "config.json").is_file() or not path.is_file():
    return
  try:
    saved = json.loads(path.read_text())["files"]
    if not (isinstance(saved, dict) and all(isinstance(v, str) for v in saved.values())):
      raise TypeError
  except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
    raise ConfigError(f"{path}, the fingerprint of the run's corpus, expects a JSON object"
                      ' {"files": {name: digest}} as the trainer writes it; restore it from'
                      " the run's archive/ or a backup, or pass resume=false to start over"
                      " (the run's files are moved to archive/).") from None
  differ = [(what, sorted(names)) for what, names in (
      ("changed", [n for n in corpus.keys() & saved.keys() if corpus[n] != saved[n]]),
      ("new", corpus.keys() - saved.keys()), ("gone", saved.keys() - corpus.keys())) if names]
  if differ:
    listed = "; ".join(f"{what}: {', '.join(names[:5])}" + (
        f" and {len(names) - 5} more" if len(names) > 5 else "") for what, names in differ)
    raise ConfigError(
        f"data.source {cfg.data.source!r} is not the corpus that run_dir {cfg.run_dir!r}"
        f" saved its data positions in ({listed}). Its checkpoints continue at a position"
        " among that corpus's documents and evaluate on its held-out ones, so they cannot"
        " continue on this one. Restore those files, use a new run_dir, or pass resume=false"
        " to start over (the run's files are moved to archive/, not deleted).")


def load_tokenizer(run_dir: str, cfg: TrainConfig, *, copy: bool = True) -> tokenizers.Tokenizer:
  """The tokenizer of run `cfg` in `run_dir`: with `copy`, the run_dir's copy of its files
  (`save_tokenizer`) where there is one; else (or without one: a bytes tokenizer, a run
  before its first checkpoint) `data.tokenizer`'s.

  Raises:
    ConfigError: the tokenizer does not read (the copy's errors name the run_dir).
  """
  saved = storage.path(run_dir) / TOKENIZER_DIR
  if not (copy and saved.is_dir()):
    return tokenizers.make(cfg.data.tokenizer)
  try:
    return tokenizers.make(str(saved))
  except ConfigError as e:
    raise ConfigError(f"run_dir {run_dir!r}'s copy of its tokenizer ({saved}): {e} Remove"
                      f" {saved} to read data.tokenizer={cfg.data.tokenizer!r} again.") from None


def archive(run_dir: str, names: tuple[str, ...], why: str) -> None:
  """Moves the entries `names` of `run_dir` that exist (and are not empty directories)
  into a new `archive/<time>/` and logs `why` with what moved (on process 0; every process
  returns once it is done)."""
  if jax.process_index() == 0:
    paths = [storage.path(run_dir) / n for n in names]
    present = [p for p in paths if p.is_file() or (p.is_dir() and storage.iterdir(p))]
    if present:
      target = storage.path(run_dir) / "archive" / timestamp()
      for p in present:
        storage.move(p, target / p.name)
      log.warning("%s: starting at step 0; moved the earlier run's %s to %s", why,
                  ", ".join(sorted(p.name for p in present)), target)
  distributed.barrier("archive")
