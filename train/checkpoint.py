"""Orbax checkpoints of a run: model parameters, optimizer state (with its step) and each
process's data-iterator position, in `{run_dir}/checkpoints/<step>/{state,data}`.

Saves are asynchronous (the arrays are copied, written in the background); orbax writes a
step into a temporary directory and renames it when complete, so a run killed mid-save
leaves no half step behind.

The run_dir may be a bucket (`gs://`): orbax writes it through TensorStore, which every
process reaches, and the positions through `train.storage`; there, where nothing renames,
orbax marks a complete step with a commit_success.txt and lists only the marked ones.

Restoring tries the newest step first. A step is moved to `{run_dir}/checkpoints_unusable/`
(with a warning) and the next older one tried only on evidence that its files are
damaged: an item directory or the state's metadata missing, a data position file missing
or not JSON, or TensorStore reporting stored bytes missing or undecodable. Any other
failure (a state that does not fit this config, positions saved by another number of
processes, a transient read error) stops the run with every checkpoint left in place.
All processes of a job reach the same decision. A run whose checkpoints were all set
aside does not start over by itself: that takes `resume=false`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.path import gcs_utils

from train import distributed, storage
from train import run_dir as run_dir_lib
from train.config import TrainConfig

log = logging.getLogger(__name__)

# Orbax asks whether a bucket has a hierarchical namespace before it lists or deletes steps
# there, by reading the bucket's metadata through google-cloud-storage: a permission
# (storage.buckets.get) that object roles lack, so a resume, an export or a deletion of an
# old step would stop with a 403. `storage` answers instead, taking such a bucket for a flat
# one.
gcs_utils.is_hierarchical_namespace_enabled = storage.hierarchical_namespace

ITEMS = ("state", "data")
# TensorStore error messages start with a status code. These say that stored bytes are
# absent or do not decode: a missing file or key, a file shorter than its index says, an
# undecodable index, a chunk that does not decompress. Transient errors (UNAVAILABLE,
# DEADLINE_EXCEEDED, ...) and orbax's shape and tree mismatches are not among them.
_DAMAGE = re.compile(r"(NOT_FOUND|OUT_OF_RANGE|DATA_LOSS|FAILED_PRECONDITION): ")


class CheckpointError(RuntimeError):
  """Checkpoints exist but the run cannot resume from them; nothing was deleted."""


class NoUsableCheckpoint(CheckpointError):
  """Every checkpoint of a run is damaged (now or when an earlier run set it aside)."""


class _Damaged(Exception):
  """Evidence that a step's files are damaged; the message says which."""


def _position_file() -> str:
  return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def _read_position(directory: epath.Path) -> dict:
  """This process's data position in a step's `data` directory.

  Raises:
    _Damaged: the file is missing beside those of the other processes, or not JSON.
    ValueError: the step holds the positions of another number of processes.
  """
  path = directory / _position_file()
  if not path.exists():
    saved = sorted(p.name for p in directory.glob("process_*-of-*.json"))
    if saved and not any(n.endswith(f"-of-{jax.process_count()}.json") for n in saved):
      raise ValueError(f"{directory} holds the data positions of another number of processes"
                       f" ({', '.join(saved)}); resume with as many processes as saved them.")
    raise _Damaged(f"{path} is missing")
  try:
    return json.loads(path.read_text())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise _Damaged(f"{path} is not JSON ({e})") from None


class _PositionHandler(ocp.CheckpointHandler):
  """Each process's data-iterator position (a JSON-able dict) as
  `data/process_<index>-of-<count>.json` (the layout of grain's own handler)."""

  def save(self, directory: epath.Path, args: PositionSave):
    (directory / _position_file()).write_text(json.dumps(args.position, indent=1))

  def restore(self, directory: epath.Path, args: PositionRestore | None = None) -> dict:
    del args
    return _read_position(epath.Path(directory))


@ocp.args.register_with_handler(_PositionHandler, for_save=True)
@dataclasses.dataclass
class PositionSave(ocp.args.CheckpointArgs):
  position: dict


# Orbax's handler registry takes a handler with a save and a restore argument type; the
# positions are read with `_read_position` (orbax's restore is collective, see below).
@ocp.args.register_with_handler(_PositionHandler, for_restore=True)
@dataclasses.dataclass
class PositionRestore(ocp.args.CheckpointArgs):
  pass


def _damage_in(error: BaseException | None) -> str | None:
  """What `error` or one of its causes says is damaged: a `_Damaged` message or a
  TensorStore message that reports damaged bytes (without its long spec); None if it
  says nothing of damage."""
  while error is not None:
    if isinstance(error, _Damaged) or _DAMAGE.match(str(error)):
      return str(error).split(" [tensorstore_spec=")[0]
    error = error.__cause__ or error.__context__
  return None


class Checkpoints:
  """The checkpoints of run `cfg`, in `{cfg.run_dir}/checkpoints`, kept and written as
  `cfg.checkpoint` says; the first save also writes `cfg` to the run_dir's config.json (the
  config of the checkpoints, which `train.run_dir.check` compares a resume with)."""

  def __init__(self, cfg: TrainConfig):
    self.config, self.config_saved = cfg, False
    self.directory = storage.path(cfg.run_dir) / "checkpoints"
    self.unusable = self.directory.parent / "checkpoints_unusable"
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.max_to_keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=cfg.checkpoint.async_save)
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "data": _PositionHandler()})

  def save(self, step: int, state, position: dict) -> None:
    """Starts saving `state` (an `nnx.State`) and this process's data position (the
    iterator's `get_state()`) as step `step`, and the config; returns once the arrays are
    copied."""
    if jax.process_index() == 0 and not self.config_saved:  # the config does not change
      run_dir_lib.save_config(self.config)
      self.config_saved = True
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=PositionSave(position)), force=True)

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self.manager.wait_until_finished()

  def restore_latest(self, abstract_state):
    """`(step, state, position)` of the newest checkpoint that restores, or None if the
    run has none (and none was set aside).

    Args:
      abstract_state: the target tree (`jax.ShapeDtypeStruct`s with shardings), e.g.
        from `nnx.get_abstract_model`.

    Raises:
      CheckpointError: a step failed to restore without evidence of damage (it and every
        other step stay where they are).
      NoUsableCheckpoint: checkpoints exist (or were set aside) but none restores.
    """
    for step in sorted(self.manager.all_steps(), reverse=True):
      # First this process's own checks of the step's files, then orbax's restore, which
      # is collective (it ends in a barrier): a process that failed a check alone would
      # leave the others waiting there.
      position = self._agreed(step, functools.partial(self._check, step))
      if position is None:
        continue

      def restore(step=step):
        return self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]
      state = self._agreed(step, restore)
      if state is not None:
        return step, state, position
    set_aside = ([p.name for p in storage.iterdir(self.unusable)] if self.unusable.is_dir()
                 else [])
    if set_aside:
      raise NoUsableCheckpoint(
          f"{self.directory} holds no checkpoint that restores, and {self.unusable} holds"
          f" {set_aside}, set aside as damaged (see the warnings of the run that moved them)."
          " The run does not start over by itself: restore them from a backup, or pass"
          " resume=false to start at step 0 (the run's files are moved to archive/).")
    return None

  def _check(self, step: int) -> dict:
    """This process's data position of `step`, once the step's files pass the checks
    that need no collective: both items there, the state's metadata readable."""
    missing = [name for name in ITEMS if not (self.directory / str(step) / name).is_dir()]
    if missing:
      raise _Damaged(f"item {', '.join(missing)} missing")
    if self.manager.item_metadata(step)["state"] is None:
      raise _Damaged("the state's metadata is missing")
    return _read_position(self.directory / str(step) / "data")

  def _agreed(self, step: int, fn):
    """`fn()` where it succeeds on every process; None, with `step` set aside, where it
    shows damage on any process and fails on none for another reason.

    Raises:
      CheckpointError: `fn` failed without evidence of damage on some process.
    """
    value = damage = error = None
    try:
      value = fn()
    except Exception as e:  # classified here, then reported alike by every process
      damage = _damage_in(e)
      error = None if damage else e
    outcome = distributed.process_max(2 if error else 1 if damage else 0)
    if outcome not in (0, 1, 2):  # a restore that failed before its barrier on some processes
      raise CheckpointError(f"the processes fell out of step restoring checkpoint step {step} in"
                            f" {self.directory}; every checkpoint was left in place. See each"
                            " process's log for the error, fix it and rerun.")
    if outcome == 2:
      reason = f"{type(error).__name__}: {error}" if error else "on another process (see its log)"
      raise CheckpointError(
          f"checkpoint step {step} in {self.directory} failed to restore: {reason}\n"
          "Its files show no damage, so every checkpoint was left in place. A config that"
          " does not fit the saved state (compare with the run's config.json), another number"
          " of processes, or a read error are the usual causes: fix it and rerun, or pass"
          " resume=false to start over (the run's files are moved to archive/).")
    if outcome == 1:
      log.warning("checkpoint step %d in %s is damaged (%s); moving it to %s and trying an"
                  " earlier one.", step, self.directory, damage or "on another process",
                  self.unusable)
      self._set_aside(step)
      return None
    return value

  def _set_aside(self, step: int) -> None:
    # Out of the manager's directory, so that a new save of this step does not collide.
    if jax.process_index() == 0:
      storage.move(self.directory / str(step),
                   self.unusable / f"{step}-{run_dir_lib.timestamp()}")
    distributed.barrier("checkpoint set aside")
    self.manager.reload()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def restore_newest(run_dir: str, abstract_state) -> tuple[int, object]:
  """`(step, state)` of the newest checkpoint of `run_dir`, read without changing anything
  there (for `init_from` and `train.export`; a run resumes with `Checkpoints`).

  Args:
    run_dir: a run directory of this trainer.
    abstract_state: the target tree, as for `Checkpoints.restore_latest`.

  Raises:
    CheckpointError: no checkpoint there, or the newest does not restore into
      `abstract_state` (the message says why).
  """
  directory = storage.path(run_dir) / "checkpoints"
  if not directory.is_dir():
    raise CheckpointError(f"{directory} holds no checkpoint; expected a run_dir of a run that"
                          " saved at least one step.")
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
                                      read_only=True, create=False, save_interval_steps=0),
                                  item_handlers={"state": ocp.StandardCheckpointHandler()})
  # Orbax's list holds finished steps only (on a bucket, a step being written is there
  # without its commit marker).
  steps = sorted(manager.all_steps())
  if not steps:
    manager.close()
    raise CheckpointError(f"{directory} holds no finished checkpoint; expected a run_dir of a"
                          " run that saved at least one step.")
  try:
    state = manager.restore(steps[-1], args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))["state"]
  except Exception as e:  # orbax raises many types; each means this step cannot be used
    raise CheckpointError(f"checkpoint step {steps[-1]} in {directory} does not restore:"
                          f" {type(e).__name__}: {str(e)[:2000]}") from e
  finally:
    manager.close()
  return steps[-1], state
