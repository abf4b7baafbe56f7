"""The training loop: model and optimizer created sharded, resumed from the latest
checkpoint, a jitted step per batch, metrics, periodic eval and checkpoints, and a clean
save-and-exit on SIGTERM.

Resume semantics: a run with an existing `run_dir` restores parameters, optimizer state
(with its step) and the data iterator's position from the newest usable checkpoint at
step s and continues with step s + 1: the batches, the learning rates and (on CPU,
bit for bit) the losses are those of a run that was never stopped. Metrics lines after s
are dropped from metrics.jsonl and rewritten as the steps are redone.
"""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import flaxattn
from models.llama import Llama, loss_fn, num_params
from train import data, mesh as mesh_lib, metrics, optimizer, tokenizer as tokenizer_lib
from train.checkpoint import Checkpoints
from train.config import ConfigError, TrainConfig, to_dict

log = logging.getLogger(__name__)


class TrainState(nnx.Module):
  """What a checkpoint holds besides the data position: the model and its optimizer."""

  def __init__(self, model: Llama, opt: nnx.Optimizer):
    self.model = model
    self.optimizer = opt


def _make_state(cfg: TrainConfig, cp: flaxattn.ContextParallel | None) -> TrainState:
  model = Llama(cfg.model, context_parallel=cp, rngs=nnx.Rngs(cfg.seed))
  tx = optimizer.make(cfg.optimizer, cfg.steps)
  return TrainState(model, nnx.Optimizer(model, tx, wrt=nnx.Param))


@nnx.jit
def train_step(state: TrainState, batch: dict) -> dict:
  """One AdamW step on `batch` (global `[B, T]` arrays); returns scalar metrics."""
  (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(state.model, batch)
  state.optimizer.update(state.model, grads)
  return {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": aux["tokens"]}


@nnx.jit
def eval_step(model: Llama, batch: dict):
  loss, aux = loss_fn(model, batch)
  return loss * aux["tokens"], aux["tokens"]


class _StopRequest:
  """SIGTERM sets a flag; the loop finishes its step, saves and exits. All processes
  stop at the same step: the flag is or-ed over processes."""

  def __init__(self):
    self.local = False
    signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    self.local = True

  def __bool__(self) -> bool:
    if jax.process_count() == 1:
      return self.local
    return bool(np.any(multihost_utils.process_allgather(np.array(self.local))))


def _evaluate(state: TrainState, eval_ds, batches: data.GlobalBatches, num: int) -> dict:
  total, tokens = 0.0, 0.0
  it = iter(eval_ds)  # a fresh iterator: the same held-out batches every time
  for _ in range(num):
    loss_sum, n = eval_step(state.model, batches.to_global(next(it)))
    total, tokens = total + float(loss_sum), tokens + float(n)
  return {"eval_loss": total / max(tokens, 1.0), "eval_tokens": tokens}


def _progress(start: int, total: int):
  from tqdm import tqdm
  return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
              disable=jax.process_index() != 0 or not sys.stderr.isatty())


def run(cfg: TrainConfig) -> int:
  """Trains `cfg` to `cfg.steps` (or until SIGTERM), resuming from `cfg.run_dir`; returns
  the last step done.

  Raises:
    ConfigError: the config does not fit the devices or the tokenizer.
    train.checkpoint.NoUsableCheckpoint: checkpoints exist but none restores.
  """
  mesh = mesh_lib.make(cfg)
  tok = tokenizer_lib.make(cfg.data.tokenizer)
  if tok.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) expects at least the"
                      f" tokenizer's vocabulary ({tok.vocab_size}, data.tokenizer="
                      f"{cfg.data.tokenizer!r}).")
  m = cfg.model
  rules = flaxattn.sharding.rules(mesh, kv_heads=m.n_kv_heads, heads=m.n_heads, mlp=m.ffn_dim,
                                  vocab=m.vocab_size, embed=m.dim)
  cp_size = mesh.shape["context"]
  cp = None
  if cp_size > 1:
    cp = flaxattn.ContextParallel("context", cfg.context_parallel.strategy,
                                  cfg.context_parallel.load_balance)

  train_docs, eval_docs = data.split_documents(data.list_documents(cfg.data.source),
                                               cfg.data.eval_fraction)
  batches = data.GlobalBatches(mesh, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                               cp=cp_size if cp is not None and cp.load_balance else None)
  pipe = lambda docs, shuffle: data.pipeline(
      docs, tok, cfg.data, seq_len=cfg.seq_len, batch=batches.local_batch, seed=cfg.seed,
      shard_index=batches.shard_index, shard_count=batches.shard_count, shuffle=shuffle)
  train_ds = pipe(train_docs, True)
  eval_ds = pipe(eval_docs, False) if eval_docs and cfg.eval_every else None

  run_dir = pathlib.Path(cfg.run_dir)
  if jax.process_index() == 0:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
  log.info("model: %.2fM parameters; mesh %s; %d train / %d eval documents",
           num_params(m) / 1e6, dict(mesh.shape), len(train_docs), len(eval_docs))

  ckpts = Checkpoints(cfg.run_dir, cfg.checkpoint)
  stop = _StopRequest()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    init = lambda: _make_state(cfg, cp)
    graphdef, abstract = nnx.get_abstract_model(init, mesh)
    restored = ckpts.restore_latest(abstract, lambda: iter(train_ds))
    if restored is None:
      step, state, data_it = 0, nnx.jit(init)(), iter(train_ds)
    else:
      step, restored_state, data_it = restored
      state = nnx.merge(graphdef, restored_state)
      log.info("resumed from step %d of %s", step, ckpts.directory)
    if step >= cfg.steps:
      log.info("run_dir %s is already at step %d >= steps %d", cfg.run_dir, step, cfg.steps)

    writer = metrics.MetricsWriter(cfg.run_dir, step)
    lr = optimizer.schedule(cfg.optimizer, cfg.steps)
    bar = _progress(step, cfg.steps)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    saved = step
    try:
      while step < cfg.steps:
        start = time.perf_counter()
        batch = batches.to_global(next(data_it))
        out = jax.device_get(train_step(state, batch))
        elapsed = time.perf_counter() - start
        step += 1
        if step % cfg.log_every == 0 or step == cfg.steps:
          writer.write(step, {"loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
                              "lr": float(lr(step - 1)), "tokens": float(out["tokens"]),
                              "tokens_per_s": tokens_per_step / elapsed, "step_time": elapsed})
        bar.update(1)
        bar.set_postfix(loss=f"{float(out['loss']):.3f}")
        if eval_ds is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
          writer.write(step, _evaluate(state, eval_ds, batches, cfg.data.eval_batches))
        stopping = bool(stop)
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stopping:
          ckpts.save(step, nnx.state(state), data_it)
          saved = step
        if stopping:
          log.warning("SIGTERM: saved step %d; exiting.", step)
          break
      if saved != step:
        ckpts.save(step, nnx.state(state), data_it)
    finally:
      bar.close()
      ckpts.close()  # waits for the saves in flight
      writer.close()
  if jax.process_index() == 0:
    metrics.plot_loss(cfg.run_dir)
  return step
