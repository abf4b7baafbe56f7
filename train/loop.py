"""The training loop: model and optimizer created sharded, resumed from the latest
checkpoint, a jitted step per batch, metrics, periodic eval and checkpoints, and a clean
save-and-exit on SIGTERM.

Resume semantics: a run with an existing `run_dir` restores parameters, optimizer state
(with its step) and the data iterator's position from the newest usable checkpoint at
step s and continues with step s + 1: the batches, the learning rates and (on CPU,
bit for bit) the losses are those of a run that was never stopped. Metrics lines after s
stay in metrics.jsonl; the redone steps' lines are appended (see `train.metrics`). What a
resume refuses, and how a run starts over, is in `train.run_dir`; SIGTERM in `train.stop`.
"""

from __future__ import annotations

import logging
import sys
import time

import jax
import optax
from flax import nnx

import flaxattn
from models.llama import LAYERS_AXIS, Llama, loss_fn, num_params
from train import (data, distributed, mesh as mesh_lib, metrics, optimizer, run_dir,
                   tokenizer as tokenizer_lib)
from train.checkpoint import Checkpoints
from train.config import ConfigError, TrainConfig
from train.stop import StopRequest, Stopped

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


def _evaluate(state: TrainState, eval_ds, batches: data.GlobalBatches, num: int,
              stop: StopRequest) -> dict:
  """Mean eval loss over `num` held-out batches.

  Raises:
    Stopped: SIGTERM while waiting for a batch.
  """
  total, tokens = 0.0, 0.0
  it = iter(eval_ds)  # a fresh iterator: the same held-out batches every time
  for _ in range(num):
    loss_sum, n = eval_step(state.model, batches.to_global(stop.call(lambda: next(it))))
    total, tokens = total + float(loss_sum), tokens + float(n)
  return {"eval_loss": total / max(tokens, 1.0), "eval_tokens": tokens}


def _progress(start: int, total: int):
  from tqdm import tqdm
  return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
              disable=jax.process_index() != 0 or not sys.stderr.isatty())


def _data(cfg: TrainConfig, tok, batches: data.GlobalBatches, stop: StopRequest):
  """(train, eval or None) pipelines of this process's shard, each checked to yield rows.

  Raises:
    ConfigError: no documents, or none long enough, in a shard (on any process).
    Stopped: SIGTERM while reading documents.
  """
  train_docs, eval_docs = data.split_documents(
      data.list_documents(cfg.data.source, cfg.data.bad_records), cfg.data.eval_fraction)
  log.info("%d train / %d eval documents", len(train_docs), len(eval_docs))
  parts = [(train_docs, True, f"data.source {cfg.data.source!r} (the training documents)",
            "use longer documents")]
  if eval_docs and cfg.eval_every:
    parts.append((eval_docs, False, f"data.eval_fraction={cfg.data.eval_fraction} (the held-out"
                  " documents)", "raise data.eval_fraction, or set eval_every=0 to skip eval"))
  pipes = []
  for docs, shuffle, what, fix in parts:
    stop.call(lambda: data.check_usable(
        data.shard(docs, batches.shard_index, batches.shard_count), tok, what, fix))
    pipes.append(data.pipeline(docs, tok, cfg.data, seq_len=cfg.seq_len,
                               batch=batches.local_batch, seed=cfg.seed,
                               shard_index=batches.shard_index,
                               shard_count=batches.shard_count, shuffle=shuffle))
  return pipes[0], pipes[1] if len(pipes) > 1 else None


def _start(cfg: TrainConfig, abstract_state):
  """The run's Checkpoints and `(step, state, data position)` to resume from, or None to
  start at step 0: after `resume=false`, or when the run_dir holds no checkpoint. A start
  at step 0 first moves an earlier run's files to `archive/` (process 0)."""
  if not cfg.resume:
    _archive(cfg, run_dir.CHECKPOINT_FILES + run_dir.OUTPUT_FILES, "resume=false")
  ckpts = Checkpoints(cfg.run_dir, cfg.checkpoint)
  restored = ckpts.restore_latest(abstract_state) if cfg.resume else None
  if cfg.resume and restored is None:
    _archive(cfg, run_dir.OUTPUT_FILES, "no checkpoint to resume")
  return ckpts, restored


def _archive(cfg: TrainConfig, names: tuple[str, ...], why: str) -> None:
  if jax.process_index() == 0:
    moved = run_dir.archive(cfg.run_dir, names)
    if moved is not None:
      log.warning("%s: starting at step 0; moved the earlier run's %s to %s", why,
                  ", ".join(sorted(p.name for p in moved.iterdir())), moved)
  distributed.barrier("archive")


def _parallelism(cfg: TrainConfig):
  """The mesh, the logical sharding rules, the context parallelism (None without a context
  axis) and the global batch builder (load-balanced when the context parallelism is)."""
  mesh = mesh_lib.make(cfg)
  m = cfg.model
  # Stacked layers (scan_layers) are replicated: every device holds its part of each layer.
  rules = (*flaxattn.sharding.rules(mesh, kv_heads=m.n_kv_heads, heads=m.n_heads, mlp=m.ffn_dim,
                                    vocab=m.vocab_size, embed=m.dim), (LAYERS_AXIS, None))
  cp = mesh_lib.context_parallel(cfg, mesh)
  shards = 1 if cp is None else cp.balanced_shards(mesh)
  batches = data.GlobalBatches(mesh, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                               cp=shards if shards > 1 else None)
  return mesh, rules, cp, batches


def _step_metrics(out: dict, lr: float, tokens_per_step: int, elapsed: float) -> dict:
  return {"loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]), "lr": lr,
          "tokens": float(out["tokens"]), "tokens_per_s": tokens_per_step / elapsed,
          "step_time": elapsed}


def run(cfg: TrainConfig) -> tuple[int, bool]:
  """Trains `cfg` to `cfg.steps` (or until SIGTERM), resuming from `cfg.run_dir`.

  Returns:
    (the last step done, whether a SIGTERM stopped the run).

  Raises:
    ConfigError: the config does not fit the devices, the tokenizer, the data or the
      run_dir (raised before anything is written or compiled).
    train.checkpoint.CheckpointError: checkpoints exist but the run cannot resume.
  """
  tok = tokenizer_lib.make(cfg.data.tokenizer)
  if tok.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) expects at least the"
                      f" tokenizer's vocabulary ({tok.vocab_size}, data.tokenizer="
                      f"{cfg.data.tokenizer!r}).")
  mesh, rules, cp, batches = _parallelism(cfg)
  stop = StopRequest()
  try:
    train_ds, eval_ds = _data(cfg, tok, batches, stop)
  except Stopped:
    log.warning("SIGTERM before the first step: nothing to save; exiting.")
    return 0, True
  run_dir.create(cfg)
  log.info("model: %.2fM parameters; mesh %s", num_params(cfg.model) / 1e6, dict(mesh.shape))

  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    init = lambda: _make_state(cfg, cp)
    graphdef, abstract = nnx.get_abstract_model(init, mesh)
    ckpts, restored = _start(cfg, abstract)
    data_it = iter(train_ds)
    if restored is None:
      step, state = 0, nnx.jit(init)()
    else:
      step, restored_state, position = restored
      state = nnx.merge(graphdef, restored_state)
      data_it.set_state(position)
      log.info("resumed from step %d of %s", step, ckpts.directory)
    if step >= cfg.steps:
      log.info("run_dir %s is already at step %d >= steps %d", cfg.run_dir, step, cfg.steps)

    def save(step: int, position: dict) -> None:
      if jax.process_index() == 0:
        run_dir.save_config(cfg)  # the config of the checkpoints (`train.run_dir.check`)
      ckpts.save(step, nnx.state(state), position)

    writer = metrics.MetricsWriter(cfg.run_dir, step)
    lr = optimizer.schedule(cfg.optimizer, cfg.steps)
    bar = _progress(step, cfg.steps)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    saved, stopped = step, False
    position = data_it.get_state()  # after the last batch trained on: what a save records
    try:
      try:
        while step < cfg.steps:
          start = time.perf_counter()
          batch = batches.to_global(stop.call(lambda: next(data_it)))
          out = jax.device_get(train_step(state, batch))
          elapsed = time.perf_counter() - start
          step += 1
          position = data_it.get_state()
          if step % cfg.log_every == 0 or step == cfg.steps:
            writer.write(step, _step_metrics(out, float(lr(step - 1)), tokens_per_step, elapsed))
          bar.update(1)
          bar.set_postfix(loss=f"{float(out['loss']):.3f}")
          if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            save(step, position)
            saved = step
          if eval_ds is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            writer.write(step, _evaluate(state, eval_ds, batches, cfg.data.eval_batches, stop))
      except Stopped:
        stopped = True
      if saved != step:
        save(step, position)
        saved = step
        if stopped:
          log.warning("SIGTERM: saved step %d; exiting.", step)
      elif stopped:
        log.warning("SIGTERM: step %d is saved already; exiting.", step)
    finally:
      bar.close()
      ckpts.close()  # waits for the saves in flight
      writer.close()
  if jax.process_index() == 0:
    metrics.plot_loss(cfg.run_dir)
  return step, stopped
