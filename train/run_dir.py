"""The run directory: what a run keeps there, and how a run starts in it.

  checkpoints/<step>/      orbax checkpoints (`train.checkpoint`)
  checkpoints_unusable/    damaged steps, set aside when restoring
  config.json              the config the checkpoints were saved with
  metrics.jsonl, tensorboard/, loss.png   (`train.metrics`)
  archive/<time>/          an earlier run's files, moved there when a run starts over

`check` runs before anything else: it compares the config with the saved one. A
difference in a key of `STATE_KEYS` would resume state that does not fit (arrays of other
shapes) or a data stream other than the one whose position was saved, so it is refused
with a config error, and nothing in the directory is touched; other differences (steps,
learning rate, eval_every, ...) are logged and let through. `resume=false` skips the
comparison and starts over, moving the earlier run's files into `archive/` (nothing is
deleted; remove the archive to free its space).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pathlib
import shutil

from train.config import ConfigError, TrainConfig, to_dict

log = logging.getLogger(__name__)

STATE_KEYS = (
    # the shapes and tree of the parameters and of the optimizer state
    "model.vocab_size", "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads",
    "model.ffn_dim", "model.tie_embeddings", "model.scan_layers",
    # the data stream whose iterator position each checkpoint holds
    "seq_len", "batch_size", "seed", "data.source", "data.tokenizer", "data.eval_fraction",
    "data.packing_bins",
)
CHECKPOINT_FILES = ("checkpoints", "checkpoints_unusable")
OUTPUT_FILES = ("config.json", "metrics.jsonl", "tensorboard", "loss.png")


def timestamp() -> str:
  """Local time to the microsecond, for names of set-aside and archived files."""
  return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")


def _flat(values: dict, prefix: str = "") -> dict:
  out = {}
  for key, value in values.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def check(cfg: TrainConfig) -> None:
  """Refuses a config whose `STATE_KEYS` differ from the run's saved config.json (unless
  `cfg.resume` is false); logs the other differences. Reads files only.

  Raises:
    ConfigError: naming each differing state key with its saved and new value, or a
      saved config.json that is not JSON.
  """
  path = pathlib.Path(cfg.run_dir) / "config.json"
  if not cfg.resume or not path.is_file():
    return
  try:
    saved = _flat(json.loads(path.read_text()))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"run_dir {cfg.run_dir!r}: config.json, the config of its checkpoints, is"
                      f" not JSON ({e}); restore it, or pass resume=false to start over.") from None
  new = _flat(to_dict(cfg))
  changed = {k: (saved[k], new[k]) for k in new if k in saved and saved[k] != new[k]}
  refused = [f"{k} (saved {old!r}, now {now!r})" for k, (old, now) in changed.items()
             if k in STATE_KEYS]
  if refused:
    raise ConfigError(
        f"run_dir {cfg.run_dir!r} holds a run saved with another value of "
        + ", ".join(refused) + ". These keys decide the shapes of the checkpointed state or"
        " the data stream it resumes, so its checkpoints cannot continue under this config."
        " Resume with the saved values (config.json in the run_dir), use a new run_dir, or"
        " pass resume=false to start over (the run's files are moved to archive/, not deleted).")
  if changed:
    log.info("resuming %s with changed config keys: %s", cfg.run_dir,
             ", ".join(f"{k} {old!r} -> {now!r}" for k, (old, now) in changed.items()))


def create(cfg: TrainConfig) -> pathlib.Path:
  """`cfg.run_dir`, created if needed.

  Raises:
    ConfigError: it cannot be created (or is not a directory).
  """
  path = pathlib.Path(cfg.run_dir)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"config key 'run_dir' expects a directory that exists or can be created;"
                      f" got {cfg.run_dir!r} ({e.strerror}: {e.filename}). Choose another"
                      " path.") from None
  return path


def save_config(cfg: TrainConfig) -> None:
  """Writes config.json (atomically: a run killed meanwhile leaves the old one)."""
  path = pathlib.Path(cfg.run_dir) / "config.json"
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(to_dict(cfg), indent=2))
  os.replace(tmp, path)


def archive(run_dir: str, names: tuple[str, ...]) -> pathlib.Path | None:
  """Moves the entries `names` of `run_dir` that exist (and are not empty directories)
  into a new `archive/<time>/`; returns it, or None if there was nothing to move."""
  paths = [pathlib.Path(run_dir) / n for n in names]
  present = [p for p in paths if p.is_file() or (p.is_dir() and any(p.iterdir()))]
  if not present:
    return None
  target = pathlib.Path(run_dir) / "archive" / timestamp()
  target.mkdir(parents=True)
  for p in present:
    shutil.move(str(p), str(target / p.name))
  return target
