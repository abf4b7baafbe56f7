"""The training state: the model and its optimizer (`TrainState`), made fresh
(`make_state`) or found where a run starts (`restore_state`).

A run starts from the newest usable checkpoint of its run_dir (state and data position,
see `train.checkpoint`); without one, or with `resume=false`, at step 0 from `init_from`'s
weights (optimizer fresh, see `train.init_from`) or a random initialization, after moving
an earlier run's files to `archive/` (see `train.run_dir`).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import optax
from flax import nnx

from models.llama import Llama, LlamaConfig, loss_fn
from train import init_from, optimizer, run_dir
from train.checkpoint import Checkpoints
from train.config import OptimizerConfig, TrainConfig

log = logging.getLogger(__name__)


class TrainState(nnx.Module):
  """What a checkpoint holds besides the data position: the model and its optimizer; and
  the optimizer's learning rate by step (`schedule`, static: not in a checkpoint)."""

  def __init__(self, model: Llama, opt: nnx.Optimizer, schedule: optax.Schedule):
    self.model = model
    self.optimizer = opt
    self.schedule = schedule


# The state is donated: its new value reuses the old one's buffers, so a step holds one copy
# of the parameters and optimizer moments, not two.
@nnx.jit(donate_argnums=0)
def train_step(state: TrainState, batch: dict) -> dict:
  """One AdamW step on `batch` (global `[B, T]` arrays), updating `state` in place (its
  arrays are donated); returns scalar metrics."""
  (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(state.model, batch)
  state.optimizer.update(state.model, grads)
  return {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": aux["tokens"]}


def make_state(model: LlamaConfig, opt: OptimizerConfig, steps: int, seed: int = 0,
               context_parallel=None) -> TrainState:
  """A random `Llama(model)` (from `seed`) and its AdamW optimizer over `steps` steps
  (`train.optimizer`). Call under the run's `jax.set_mesh` and `nnx.logical_axis_rules` for
  sharded arrays, inside `nnx.jit` (or `nnx.eval_shape` for shapes only).

  Args:
    context_parallel: the model's `flaxattn.ContextParallel`, or None.
  """
  llama = Llama(model, context_parallel=context_parallel, rngs=nnx.Rngs(seed))
  lr = optimizer.schedule(opt, steps)
  return TrainState(llama, nnx.Optimizer(llama, optimizer.make(opt, lr), wrt=nnx.Param), lr)


def abstract_state(cfg: TrainConfig, mesh, cp):
  """(init, graphdef, abstract state) of run `cfg`'s `TrainState` on `mesh`: `init()` makes
  it (`make_state`), the abstract state holds its arrays' shapes, dtypes and shardings (no
  memory). What `restore_state` restores into and `train.compile` compiles for."""
  def init():
    return make_state(cfg.model, cfg.optimizer, cfg.steps, cfg.seed, cp)

  graphdef, abstract = nnx.get_abstract_model(init, mesh)
  return init, graphdef, abstract


@dataclasses.dataclass
class Start:
  """Where a run starts: the steps done, the state, the data iterator's position to go on
  from (None at step 0) and the run's checkpoints."""

  step: int
  state: TrainState
  position: dict | None
  checkpoints: Checkpoints


def restore_state(cfg: TrainConfig, mesh, cp) -> Start:
  """The state run `cfg` starts from (see the module docstring), on `mesh` with context
  parallelism `cp` (or None). Call under the run's `jax.set_mesh` and
  `nnx.logical_axis_rules`.

  Reads `init_from`'s weights first (not when resuming): the config errors come before
  anything is written. Then creates the run_dir.

  Raises:
    ConfigError: the run_dir cannot be created, or `init_from` does not load.
    train.checkpoint.CheckpointError: checkpoints exist but none restores.
  """
  init, graphdef, abstract = abstract_state(cfg, mesh, cp)
  params = nnx.state(nnx.merge(graphdef, abstract).model, nnx.Param)
  log.info("model: %.2fM parameters", sum(x.size for x in jax.tree.leaves(params)) / 1e6)
  weights = (init_from.load(cfg, cp, graphdef, abstract)
             if cfg.init_from and not init_from.resuming(cfg) else None)
  run_dir.create(cfg.run_dir, start_over=not cfg.resume)
  ckpts = Checkpoints(cfg)
  restored = ckpts.restore_latest(abstract) if cfg.resume else None
  if restored is not None:
    step, state, position = restored
    log.info("resumed from step %d of %s", step, ckpts.directory)
    return Start(step, nnx.merge(graphdef, state), position, ckpts)
  if cfg.resume:
    run_dir.archive(cfg.run_dir, run_dir.OUTPUT_FILES, "no checkpoint to resume")
  state = nnx.jit(init)()
  if weights is not None:
    nnx.update(state.model, weights)
    log.info("initialized the model from %s (optimizer fresh, step 0)", cfg.init_from)
  return Start(0, state, None, ckpts)
