"""The training loop: model and optimizer created sharded (or the model read from
`init_from`), resumed from the latest checkpoint, a jitted step per batch, metrics,
periodic eval and checkpoints, and a clean save-and-exit on SIGTERM.

The host does not wait for each step: it dispatches step n + 1, then fetches step n's
metrics (evals, saves and the last step wait for their step first). A line per
`log_every` steps goes to the `logging` module (`train.throughput.format_step`), and a
summary at the end.

Resume semantics: a run with an existing `run_dir` restores parameters, optimizer state
(with its step) and the data iterator's position from the newest usable checkpoint at
step s and continues with step s + 1: the batches, the learning rates and (on CPU,
bit for bit) the losses are those of a run that was never stopped. Metrics lines after s
stay in metrics.jsonl; the redone steps' lines are appended (see `train.metrics`). What a
resume refuses, and how a run starts over, is in `train.run_dir`; SIGTERM in `train.stop`.
"""

from __future__ import annotations

import logging
import pathlib
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

import flaxattn
from models.llama import LAYERS_AXIS, Llama, flops_per_token, layer_masks, loss_fn, num_params
from train import data, distributed, init_from, metrics, optimizer, run_dir, throughput
from train import mesh as mesh_lib
from train import tokenizer as tokenizer_lib
from train.checkpoint import Checkpoints
from train.config import ConfigError, TrainConfig
from train.stop import Stopped, StopRequest

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


# The state is donated: its new value reuses the old one's buffers, so a step holds one copy
# of the parameters and optimizer moments, not two.
@nnx.jit(donate_argnums=0)
def train_step(state: TrainState, batch: dict) -> dict:
  """One AdamW step on `batch` (global `[B, T]` arrays), updating `state` in place (its
  arrays are donated); returns scalar metrics."""
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

    def check(docs=docs, what=what, fix=fix):
      return data.check_usable(
          data.shard(docs, batches.shard_index, batches.shard_count), tok, what, fix)
    stop.call(check)
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
                               cp=shards if shards > 1 else None, balance=cfg.data.balance,
                               masks=layer_masks(cfg.model))
  return mesh, rules, cp, batches


class _Reporter:
  """Fetches each step's metrics once the step is done, writes them every `log_every`
  steps (metrics.jsonl, TensorBoard, a log line) and keeps totals for the summary.

  Step time is the time between the completions of consecutive steps (the loop dispatches
  step n + 1 before fetching step n's metrics), restarted after evals and saves."""

  def __init__(self, cfg: TrainConfig, writer: metrics.MetricsWriter, rates: throughput.Rates,
               bar, start_step: int):
    self.cfg, self.writer, self.rates, self.bar = cfg, writer, rates, bar
    # On the host once: a schedule call per step would queue behind the running step.
    self.lrs = np.asarray(optimizer.schedule(cfg.optimizer, cfg.steps)(np.arange(cfg.steps)))
    self.tokens_per_step = cfg.batch_size * cfg.seq_len
    self.start_step, self.last = start_step, None
    self.timed_tokens = self.timed_seconds = 0.0  # steps after this process's first (compile)
    self.restart_clock()

  def restart_clock(self) -> None:
    self.done_at = time.perf_counter()

  def report(self, step: int, out: dict, host_time: float, dispatch_time: float) -> float:
    """Fetches step `step`'s metrics `out` (blocking until it is done) and reports them
    with the host's seconds on the step (data, metrics, logging) and in the step's call
    (its dispatch); returns the seconds waited."""
    fetch = time.perf_counter()
    out = jax.device_get(out)
    now = time.perf_counter()
    elapsed, self.done_at = now - self.done_at, now
    m = {"loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
         "lr": float(self.lrs[step - 1]), "tokens": float(out["tokens"]),
         **self.rates.of(self.tokens_per_step, elapsed), "step_time": elapsed,
         "host_time": host_time, "dispatch_time": dispatch_time}
    if step > self.start_step + 1:
      self.timed_tokens += self.tokens_per_step
      self.timed_seconds += elapsed
    self.last = (step, m)
    if step % self.cfg.log_every == 0 or step == self.cfg.steps:
      self.writer.write(step, m)
      if jax.process_index() == 0:
        log.info("%s", throughput.format_step(step, self.cfg.steps, m, self.rates.peak))
    self.bar.update(1)
    self.bar.set_postfix(loss=f"{m['loss']:.3f}")
    return now - fetch

  def summary(self, step: int, ckpt_dir) -> str:
    """The run's closing lines: steps, final loss, throughput, where its files are."""
    run = pathlib.Path(self.cfg.run_dir).absolute()
    lines = [f"done: step {step}/{self.cfg.steps} ({step - self.start_step} this run)"]
    if self.last is not None:
      lines[0] += f", final loss {self.last[1]['loss']:.4f} (step {self.last[0]})"
    if self.timed_seconds:
      r = self.rates.of(self.timed_tokens, self.timed_seconds)
      peak = self.rates.peak  # None exactly when r["mfu"] is
      mfu = ("n/a" if r["mfu"] is None or peak is None
             else f"{100 * r['mfu']:.2f}% ({peak.source} peak)")
      lines.append(f"throughput after the first step: tokens/s {r['tokens_per_s']:,.0f},"
                   f" tokens/s/device {r['tokens_per_s_per_device']:,.0f}, TFLOP/s/device"
                   f" {r['tflops_per_device']:.4g}, MFU {mfu}")
    lines += [f"checkpoints: {ckpt_dir}", f"metrics: {run / 'metrics.jsonl'}",
              f"TensorBoard: {run / 'tensorboard'}", f"loss plot: {run / 'loss.png'}"]
    return "\n  ".join(lines)


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

  def init():
    return _make_state(cfg, cp)

  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    graphdef, abstract = nnx.get_abstract_model(init, mesh)
    # Read before anything is written: a source that does not load is a config error.
    weights = (init_from.load(cfg, cp, graphdef, abstract)
               if cfg.init_from and not init_from.resuming(cfg) else None)
  run_dir.create(cfg)
  log.info("model: %.2fM parameters; mesh %s", num_params(cfg.model) / 1e6, dict(mesh.shape))
  device = jax.devices()[0]
  rates = throughput.Rates(flops_per_token(cfg.model, cfg.seq_len), mesh.size,
                           throughput.peak(device.device_kind, device.platform,
                                           cfg.peak_tflops_per_device))

  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    ckpts, restored = _start(cfg, abstract)
    data_it = iter(train_ds)
    if restored is None:
      step, state = 0, nnx.jit(init)()
      if weights is not None:
        nnx.update(state.model, weights)
        del weights
        log.info("initialized the model from %s (optimizer fresh, step 0)", cfg.init_from)
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
    bar = _progress(step, cfg.steps)
    reporter = _Reporter(cfg, writer, rates, bar, step)
    saved, stopped = step, False
    position = data_it.get_state()  # after the last batch trained on: what a save records
    pending = None  # (step, metrics on device, host seconds) of the step not yet reported
    try:
      try:
        while step < cfg.steps:
          start = time.perf_counter()
          batch = batches.to_global(stop.call(lambda: next(data_it)))
          dispatch = time.perf_counter()
          out = train_step(state, batch)  # dispatched: the device runs it while the host goes on
          dispatch = time.perf_counter() - dispatch
          step += 1
          position = data_it.get_state()
          waited = reporter.report(*pending) if pending else 0.0
          pending = (step, out, time.perf_counter() - start - waited - dispatch, dispatch)
          save_now = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
          eval_now = eval_ds is not None and (step % cfg.eval_every == 0 or step == cfg.steps)
          if save_now or eval_now or step == cfg.steps:
            reporter.report(*pending)
            pending = None
          if save_now:
            save(step, position)
            saved = step
          if eval_now:
            writer.write(step, _evaluate(state, eval_ds, batches, cfg.data.eval_batches, stop))
          if save_now or eval_now:
            reporter.restart_clock()
      except Stopped:
        stopped = True
      if pending:
        reporter.report(*pending)
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
    log.info("%s", reporter.summary(step, ckpts.directory))
  return step, stopped
