"""Orbax checkpoints of a run: model parameters, optimizer state (with its step) and the
grain data iterator's position, in `{run_dir}/checkpoints/<step>/{state,data}`.

Saves are asynchronous (the arrays are copied, written in the background); orbax writes a
step into a temporary directory and renames it when complete, so a run killed mid-save
leaves no half step behind. Restoring tries the newest step first; a step that fails to
restore (missing item, corrupt file) is moved to `{run_dir}/checkpoints_unusable/` with a
warning and the next older one is tried.
"""

from __future__ import annotations

import logging
import pathlib
import shutil
import time

import grain
import jax
import orbax.checkpoint as ocp

from train.config import CheckpointConfig

log = logging.getLogger(__name__)


class NoUsableCheckpoint(RuntimeError):
  """Every checkpoint of a run failed to restore."""


class Checkpoints:
  """A run's checkpoints.

  Args:
    run_dir: the run directory; checkpoints live in `{run_dir}/checkpoints`.
    cfg: how many to keep, and whether saves are asynchronous.
  """

  def __init__(self, run_dir: str, cfg: CheckpointConfig):
    self.directory = pathlib.Path(run_dir).absolute() / "checkpoints"
    self.unusable = self.directory.parent / "checkpoints_unusable"
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.max_to_keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=cfg.async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, state, data_iterator) -> None:
    """Starts saving `state` (an `nnx.State`) and the iterator position as step `step`;
    returns once the arrays are copied and the iterator state is written."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iterator)), force=True)

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self.manager.wait_until_finished()

  def restore_latest(self, abstract_state, make_iterator):
    """`(step, state, data_iterator)` of the newest checkpoint that restores, or None if
    the run has no checkpoint.

    Args:
      abstract_state: the target tree (`jax.ShapeDtypeStruct`s with shardings), e.g.
        from `nnx.get_abstract_model`.
      make_iterator: returns a fresh data iterator for the restored position to be set on.

    Raises:
      NoUsableCheckpoint: checkpoints exist but none restores.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      iterator = make_iterator()
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(iterator)))
        return step, restored["state"], iterator
      except Exception as e:  # orbax raises many kinds for a damaged step
        log.warning("checkpoint step %d in %s failed to restore (%s: %s); moving it to %s and"
                    " trying an earlier one.", step, self.directory, type(e).__name__, e,
                    self.unusable)
        self._set_aside(step)
    if steps:
      raise NoUsableCheckpoint(
          f"none of the checkpoints {steps} in {self.directory} restores (warnings above);"
          " use a new run_dir, or move the checkpoints away to start over.")
    return None

  def _set_aside(self, step: int) -> None:
    # Out of the manager's directory, so that a new save of this step does not collide.
    if jax.process_index() == 0:
      self.unusable.mkdir(parents=True, exist_ok=True)
      shutil.move(str(self.directory / str(step)),
                  str(self.unusable / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"))
    self.manager.reload()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
