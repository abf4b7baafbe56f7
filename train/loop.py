"""The training loop. `run` is three parts: `_setup` (the devices and the data, where
config errors surface before anything is written or compiled), `train.state.restore_state`
(the state to start from) and `_loop` (a jitted step per batch, metrics, periodic eval and
checkpoints, and a clean save-and-exit on SIGTERM).

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

from models.llama import Llama, flops_per_token, loss_fn
from train import data, metrics, optimizer, throughput, tokenizer
from train import mesh as mesh_lib
from train.config import TrainConfig
from train.state import Start, TrainState, restore_state
from train.stop import Stopped, StopRequest

log = logging.getLogger(__name__)


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


def run(cfg: TrainConfig) -> tuple[int, bool]:
  """Trains `cfg` to `cfg.steps` (or until SIGTERM), resuming from `cfg.run_dir`.

  Returns:
    (the last step done, whether a SIGTERM stopped the run).

  Raises:
    ConfigError: the config does not fit the devices, the tokenizer, the data or the
      run_dir (raised before anything is written or compiled).
    train.checkpoint.CheckpointError: checkpoints exist but the run cannot resume.
  """
  stop = StopRequest()
  try:
    parallel, run_data = _setup(cfg, stop)
  except Stopped:
    log.warning("SIGTERM before the first step: nothing to save; exiting.")
    return 0, True
  with jax.set_mesh(parallel.mesh), nnx.logical_axis_rules(parallel.rules):
    start = restore_state(cfg, parallel.mesh, parallel.cp)
    return _loop(cfg, parallel.mesh, run_data, start, stop)


def _setup(cfg: TrainConfig, stop: StopRequest) -> tuple[mesh_lib.Parallelism, data.Data]:
  """The run's parallelism and data.

  Raises:
    ConfigError: see `train.tokenizer.make`, `train.mesh.make` and `train.data.make`.
    Stopped: SIGTERM while reading documents.
  """
  tok = tokenizer.make(cfg.data.tokenizer, cfg.model.vocab_size)  # before jax starts
  parallel = mesh_lib.make(cfg)
  return parallel, data.make(cfg, tok, parallel.mesh, parallel.cp, stop.call)


def _loop(cfg: TrainConfig, mesh, run_data: data.Data, start: Start, stop: StopRequest
          ) -> tuple[int, bool]:
  """Trains from `start` to `cfg.steps` (or a SIGTERM) on `mesh`: steps, evals, saves,
  metrics and the summary; returns (the last step done, whether a SIGTERM stopped it)."""
  step, state, ckpts = start.step, start.state, start.checkpoints
  if step >= cfg.steps:
    log.info("run_dir %s is already at step %d >= steps %d", cfg.run_dir, step, cfg.steps)
  batches, data_it = run_data.batches, iter(run_data.train)
  if start.position is not None:
    data_it.set_state(start.position)
  position = data_it.get_state()  # after the last batch trained on: what a save records
  device = mesh.devices.flat[0]
  reporter = _Reporter(cfg, throughput.Rates(
      flops_per_token(cfg.model, cfg.seq_len), mesh.size,
      throughput.peak(device.device_kind, device.platform, cfg.peak_tflops_per_device)), step)
  saved, stopped = step, False
  pending = None  # (step, metrics on device, host seconds) of the step not yet reported
  try:
    while step < cfg.steps:
      begin = time.perf_counter()
      batch = batches.to_global(stop.call(lambda: next(data_it)))
      dispatch = time.perf_counter()
      out = train_step(state, batch)  # dispatched: the device runs it while the host goes on
      dispatch = time.perf_counter() - dispatch
      step += 1
      position = data_it.get_state()
      waited = reporter.report(*pending) if pending else 0.0
      pending = (step, out, time.perf_counter() - begin - waited - dispatch, dispatch)
      save_now = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
      eval_now = run_data.eval is not None and (step % cfg.eval_every == 0 or step == cfg.steps)
      if save_now or eval_now or step == cfg.steps:
        reporter.report(*pending)
        pending = None
      if save_now:
        ckpts.save(step, nnx.state(state), position)
        saved = step
      if eval_now:
        reporter.writer.write(step, _evaluate(state, run_data.eval, batches,
                                              cfg.data.eval_batches, stop))
      if save_now or eval_now:
        reporter.restart_clock()
  except Stopped:
    stopped = True
  try:
    if pending:
      reporter.report(*pending)
    if saved != step:
      ckpts.save(step, nnx.state(state), position)
      if stopped:
        log.warning("SIGTERM: saved step %d; exiting.", step)
    elif stopped:
      log.warning("SIGTERM: step %d is saved already; exiting.", step)
  finally:
    reporter.close()
    ckpts.close()  # waits for the saves in flight
  reporter.writer.plot()
  if jax.process_index() == 0:
    log.info("%s", reporter.summary(step, ckpts.directory))
  return step, stopped


def _evaluate(state: TrainState, eval_ds, batches: data.GlobalBatches, num: int,
              stop: StopRequest) -> dict:
  """Mean eval loss over `num` held-out batches.

  Raises:
    Stopped: SIGTERM while waiting for a batch.
  """
  total, tokens = 0.0, 0.0
  it = iter(eval_ds)  # a fresh iterator: the same held-out batches every time
  for _ in range(num):
    local = stop.call(lambda: next(it))
    loss_sum, n = eval_step(state.model, batches.to_global(local))
    total, tokens = total + float(loss_sum), tokens + float(n)
  return {"eval_loss": total / max(tokens, 1.0), "eval_tokens": tokens}


class _Reporter:
  """Fetches each step's metrics once the step is done, writes them every `log_every`
  steps (metrics.jsonl, TensorBoard, a log line, the progress bar) and keeps totals for
  the summary.

  Step time is the time between the completions of consecutive steps (the loop dispatches
  step n + 1 before fetching step n's metrics), restarted after evals and saves."""

  def __init__(self, cfg: TrainConfig, rates: throughput.Rates, start_step: int):
    self.cfg, self.rates = cfg, rates
    self.writer = metrics.MetricsWriter(cfg.run_dir, start_step)
    self.bar = _progress(start_step, cfg.steps)
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

  def close(self) -> None:
    self.bar.close()
    self.writer.close()

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


def _progress(start: int, total: int):
  from tqdm import tqdm
  return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
              disable=jax.process_index() != 0 or not sys.stderr.isatty())
