"""The training loop. `run` is three parts: `_setup` (the devices and the data, where
config errors surface before anything is written or compiled), `train.state.restore_state`
(the state to start from) and `_loop` (a jitted step per batch, metrics, periodic eval and
checkpoints, and a clean save-and-exit on SIGTERM or SIGINT, or on a corpus file changed
under the run, which is then raised).

The host reads and places step n + 1's batch while the device runs step n, then waits for
step n and dispatches step n + 1. A step's time is the wall time between the completions
of consecutive steps (the first step's from the loop's start, compiling included; an eval
or a save in between counts in the next step's), so the steps' times add up to the run's
and none reads below its own dispatch. A line per `log_every` steps goes to the `logging`
module (`train.throughput.format_step`), and a summary at the end.

Resume semantics: a run with an existing `run_dir` restores parameters, optimizer state
(with its step) and the data iterator's position from the newest usable checkpoint at
step s and continues with step s + 1: the batches, the learning rates and (on CPU,
bit for bit) the losses are those of a run that was never stopped. Metrics lines after s
stay in metrics.jsonl; the redone steps' lines are appended (see `train.metrics`). What a
resume refuses, and how a run starts over, is in `train.run_dir`; SIGTERM and SIGINT in
`train.stop`. A run stopped during an eval has saved the eval's step without its eval: the
resumed run, finding no eval line for the step it starts from where one is due, evaluates
first (its time counts in the first step's). A run with `init_from` evaluates the model it
starts from at step 0, before its first step (`train.evaluation`); a resume finds that eval
line and does not redo it.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

import jax
import numpy as np
from flax import nnx

import flaxattn
from models.llama import loss_fn
from train import data, distributed, evaluation, init_from, metrics, storage, strategy, throughput
from train import mesh as mesh_lib
from train import run_dir as run_dir_lib
from train import state as state_lib
from train.compile import estimate_on
from train.config import ConfigError, TrainConfig
from train.data import tokenizers
from train.state import Start, TrainState, restore_state, train_step
from train.stop import Stopped, StopRequest

log = logging.getLogger(__name__)


def run(cfg: TrainConfig) -> tuple[int, bool]:
  """Trains `cfg` to `cfg.steps` (or until SIGTERM or SIGINT), resuming from `cfg.run_dir`.

  Returns:
    (the last step done, whether a signal stopped the run).

  Raises:
    ConfigError: the config does not fit the devices, the tokenizer, the data or the
      run_dir (raised before anything is written or compiled).
    train.checkpoint.CheckpointError: checkpoints exist but the run cannot resume.
    train.data.BadRecord: a document read is not the one listed (a file of `data.source`
      changed under the run); the steps done were saved.
  """
  stop = StopRequest()
  try:
    try:
      parallel, run_data, tok = _setup(cfg, stop)
    except Stopped:
      log.warning("%s before the first step: nothing to save; exiting.", stop.name)
      return 0, True
    with jax.set_mesh(parallel.mesh), nnx.logical_axis_rules(parallel.rules):
      start = restore_state(cfg, parallel.mesh, parallel.cp)
      run_dir_lib.save_tokenizer(cfg.run_dir, tok)  # the run_dir now holds this run's files
      run_dir_lib.save_corpus(cfg.run_dir, run_data.corpus)
      return _loop(cfg, parallel.mesh, run_data, start, stop)
  finally:
    stop.close()


def _setup(cfg: TrainConfig, stop: StopRequest
           ) -> tuple[mesh_lib.Parallelism, data.Data, tokenizers.Tokenizer]:
  """The run's parallelism, data and tokenizer.

  Raises:
    ConfigError: see `train.run_dir.load_tokenizer`, `train.init_from.check_tokenizer`,
      `train.data.tokenizers.check_vocab`, `train.distributed.start_backend`,
      `train.strategy.resolve`, `train.mesh.make`, `train.data.make` and
      `train.run_dir.check_corpus`.
    Stopped: SIGTERM or SIGINT while reading documents.
  """
  # Before jax starts; a resumed run reads the copy its checkpoints were trained with.
  tok = run_dir_lib.load_tokenizer(cfg.run_dir, cfg, copy=init_from.resuming(cfg))
  init_from.check_tokenizer(cfg, tok)  # first: its errors name the checkpoint
  tokenizers.check_vocab(tok, cfg.model.vocab_size, cfg.data.tokenizer)
  distributed.start_backend(cfg.platform)
  # Strategy "auto" becomes one strategy here, logged with its reason; the config keeps it.
  parallel = mesh_lib.make(strategy.resolve(cfg, jax.devices(), estimate_on))
  _check_backend(cfg, parallel)
  run_data = data.make(cfg, tok, parallel.mesh, parallel.cp, stop.call)
  run_dir_lib.check_corpus(cfg, run_data.corpus)
  return parallel, run_data, tok


def _check_backend(cfg: TrainConfig, parallel: mesh_lib.Parallelism) -> None:
  """An explicit `model.attention_backend` must serve every attention call of the run on
  these devices (a kernel of another platform, a length it cannot split): the model's loss
  is traced on the run's shapes (no memory, nothing compiled), so that its refusal is a
  config error here rather than a traceback at step 1. "auto" and the aliases ("fused")
  fall back to a kernel that serves; they are not traced twice.

  Raises:
    ConfigError naming model.attention_backend: the kernel declines a call.
  """
  backend = cfg.model.attention_backend
  if backend == "auto" or backend in flaxattn.registry.ALIASES:
    return
  with jax.set_mesh(parallel.mesh), nnx.logical_axis_rules(parallel.rules):
    _, graphdef, abstract = state_lib.abstract_state(cfg, parallel.mesh, parallel.cp)
    batch = data.abstract_batch(parallel.mesh, cfg.batch_size, cfg.seq_len)
    try:
      jax.eval_shape(lambda s, b: loss_fn(nnx.merge(graphdef, s).model, b), abstract, batch)
    except flaxattn.registry.BackendError as e:
      raise ConfigError(f"config key 'model.attention_backend' ({backend!r}) on"
                        f" {jax.devices()[0].platform} with this config: {e}",
                        ("model.attention_backend",)) from None


@dataclasses.dataclass
class _Step:
  """A dispatched step: its metrics on the device, its model FLOPs, and the host's seconds
  on it (`host`: reading and placing its batch, metrics and logging; `dispatch`: its call)."""

  step: int
  out: dict
  flops: float
  host: float
  dispatch: float


def _loop(cfg: TrainConfig, mesh, run_data: data.Data, start: Start, stop: StopRequest
          ) -> tuple[int, bool]:
  """Trains from `start` to `cfg.steps` (or a signal) on `mesh`: steps, evals, saves,
  metrics and the summary; returns (the last step done, whether a signal stopped it)."""
  step, state, ckpts = start.step, start.state, start.checkpoints
  if step >= cfg.steps:
    log.info("run_dir %s is already at step %d >= steps %d", cfg.run_dir, step, cfg.steps)
  batches, data_it = run_data.batches, iter(run_data.train)
  if start.position is not None:
    data_it.set_state(start.position)
  position = data_it.get_state()  # after the last batch trained on: what a save records
  flops = throughput.Flops(state.model, run_data.masks)
  reporter = _Reporter(cfg, throughput.Rates(mesh.size, throughput.peak(
      mesh, cfg.peak_tflops_per_device)), start)
  saved, stopped, pending, changed = step, False, None, None
  try:
    if _eval_missing(cfg, run_data, step, reporter.writer):
      if step:
        log.warning("step %d has no eval in metrics.jsonl (the run stopped during it):"
                    " evaluating it now", step)
      else:
        log.info("evaluating the model of init_from before training (step 0)")
      reporter.writer.write(step, _evaluate(state, run_data.eval, batches,
                                            cfg.data.eval_batches, stop))
    while step < cfg.steps:
      begin = time.perf_counter()
      local = stop.call(lambda: next(data_it))
      # This process's rows stand for those of the processes that read other shards.
      step_flops = flops.of(local["segment_ids"]) * batches.shard_count
      batch = batches.to_global(local)
      waited = reporter.report(pending) if pending else 0.0
      dispatch = time.perf_counter()
      out = train_step(state, batch)
      dispatch = time.perf_counter() - dispatch
      step += 1
      position = data_it.get_state()
      pending = _Step(step, out, step_flops, time.perf_counter() - begin - waited - dispatch,
                      dispatch)
      save_now = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
      eval_now = _eval_due(cfg, run_data, step)
      if save_now or eval_now or step == cfg.steps:
        reporter.report(pending)
        pending = None
      paused = time.perf_counter()
      if save_now:
        ckpts.save(step, nnx.state(state), position)
        reporter.writer.flush()  # the lines of the steps this checkpoint holds
        saved = step
      if eval_now:
        reporter.writer.write(step, _evaluate(state, run_data.eval, batches,
                                              cfg.data.eval_batches, stop))
      reporter.paused += time.perf_counter() - paused
  except Stopped:
    stopped = True
  except data.BadRecord as e:  # a corpus file changed; raised on every process at once
    changed = e  # (`StopRequest.call`): the steps done are saved, as at a stop
  why = stop.name if stopped else "a file of data.source changed" if changed else None
  try:
    if pending:
      reporter.report(pending)
    if saved != step:
      ckpts.save(step, nnx.state(state), position)
      if why:
        log.warning("%s: saved step %d; exiting.", why, step)
    elif why:
      log.warning("%s: step %d is saved already; exiting.", why, step)
  finally:
    reporter.close()
    ckpts.close()  # waits for the saves in flight
  if changed is not None:
    raise changed
  wall = time.perf_counter() - reporter.started
  reporter.writer.plot()
  if jax.process_index() == 0:
    log.info("%s", reporter.summary(step, wall, ckpts.directory))
  return step, stopped


def _eval_due(cfg: TrainConfig, run_data: data.Data, step: int) -> bool:
  """Whether the run evaluates after step `step`, where there are held-out documents:
  every `eval_every` steps and after the last; at step 0 (before training) with
  `init_from`, so that the model it starts from has its curve too."""
  if run_data.eval is None:
    return False
  if step == 0:
    return bool(cfg.init_from)
  return step % cfg.eval_every == 0 or step == cfg.steps


def _eval_missing(cfg: TrainConfig, run_data: data.Data, step: int,
                  writer: metrics.MetricsWriter) -> bool:
  """Whether step `step`, where a run starts or resumes, is due an eval that its metrics
  lack (step 0 of a new run with `init_from`, or the earlier run stopped during it); every
  process gets process 0's answer, which has the file."""
  missing = (_eval_due(cfg, run_data, step) and jax.process_index() == 0
             and step not in writer.evaluated)
  return distributed.process_max(int(missing)) == 1


def _evaluate(state: TrainState, eval_ds, batches: data.GlobalBatches, num: int,
              stop: StopRequest) -> dict:
  """The eval's metrics over `num` held-out batches (`train.evaluation.summary`).

  Raises:
    Stopped: SIGTERM or SIGINT while waiting for a batch.
  """
  totals = {}
  it = iter(eval_ds)  # a fresh iterator: the same held-out batches every time
  for _ in range(num):
    local = stop.call(lambda: next(it))
    sums = jax.device_get(evaluation.eval_step(state.model, batches.to_global(local)))
    totals = {k: totals.get(k, 0.0) + np.asarray(v, np.float64) for k, v in sums.items()}
  return evaluation.summary(totals, batches.shape[1])


class _Reporter:
  """Waits for each step and reports it (metrics.jsonl, TensorBoard, a log line every
  `log_every` steps, the progress bar), and keeps totals for the summary."""

  def __init__(self, cfg: TrainConfig, rates: throughput.Rates, start: Start):
    self.cfg, self.rates, self.start_step = cfg, rates, start.step
    self.writer = metrics.MetricsWriter(cfg.run_dir, start.step)
    self.bar = _progress(start.step, cfg.steps)
    # On the host once: a schedule call per step would queue behind the running step.
    self.lrs = np.asarray(start.state.schedule(np.arange(cfg.steps)))
    self.tokens_per_step = cfg.batch_size * cfg.seq_len
    self.started = self.done_at = time.perf_counter()
    self.paused = 0.0  # seconds in evals and saves, left out of the summary's rates
    self.last = None
    self.first = None  # seconds of this run's first step (compiling)
    self.timed = [0.0, 0.0, 0.0, 0.0]  # tokens, FLOPs, seconds, paused after the first step

  def report(self, s: _Step) -> float:
    """Waits for step `s` and reports it; returns the seconds waited."""
    fetch = time.perf_counter()
    out = jax.device_get(s.out)
    now = time.perf_counter()
    elapsed, self.done_at = now - self.done_at, now
    m = {"loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
         "lr": float(self.lrs[s.step - 1]), "tokens": float(out["tokens"]),
         **self.rates.of(self.tokens_per_step, s.flops, elapsed), "step_time": elapsed,
         "host_time": s.host, "dispatch_time": s.dispatch}
    if self.first is None:
      self.first, self.paused = elapsed, 0.0
    else:
      for i, v in enumerate((self.tokens_per_step, s.flops, elapsed, self.paused)):
        self.timed[i] += v
      self.paused = 0.0
    self.last = (s.step, m)
    if s.step % self.cfg.log_every == 0 or s.step == self.cfg.steps:
      self.writer.write(s.step, m)
      if jax.process_index() == 0:
        log.info("%s", throughput.format_step(s.step, self.cfg.steps, m, self.rates.peak))
    self.bar.update(1)
    self.bar.set_postfix(loss=f"{m['loss']:.3f}")
    return now - fetch

  def close(self) -> None:
    self.bar.close()
    self.writer.close()

  def summary(self, step: int, wall: float, ckpt_dir) -> str:
    """The run's closing lines: steps, final loss, `wall` seconds of the loop and the steps'
    share, throughput, where its files are."""
    cfg = self.cfg
    run = storage.path(cfg.run_dir)
    lines = [f"done: step {step}/{cfg.steps} ({step - self.start_step} this run)"]
    if self.last is not None:
      lines[0] += f", final loss {self.last[1]['loss']:.4f} (step {self.last[0]})"
    if self.first is not None:
      seconds, paused = self.timed[2:]
      lines.append(f"wall time {wall:.2f} s, the steps {self.first + seconds:.2f} s of it: the"
                   f" first {self.first:.2f} s (compiling), the others {seconds:.2f} s with"
                   f" {paused:.2f} s of evals and saves between them")
    if self.timed[2] > self.timed[3]:
      tokens, flops, seconds, paused = self.timed
      r = self.rates.of(tokens, flops, seconds - paused)
      peak = self.rates.peak  # None exactly when r["mfu"] is
      mfu = ("n/a" if r["mfu"] is None or peak is None
             else f"{100 * r['mfu']:.2f}% ({peak.source} peak)")
      lines.append(f"throughput after the first step, evals and saves left out: tokens/s"
                   f" {r['tokens_per_s']:,.0f}, tokens/s/device"
                   f" {r['tokens_per_s_per_device']:,.0f}, TFLOP/s/device"
                   f" {r['tflops_per_device']:.4g}, MFU {mfu}")
    lines += [f"checkpoints: {ckpt_dir}", f"metrics: {run / 'metrics.jsonl'}",
              f"TensorBoard: {run / 'tensorboard'}", f"loss plot: {run / 'loss.png'}"]
    if (run / "eval_loss_by_position.png").exists():
      lines.append(f"eval loss by position: {run / 'eval_loss_by_position.png'}")
    return "\n  ".join(lines)


def _progress(start: int, total: int):
  from tqdm import tqdm
  return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
              disable=jax.process_index() != 0 or not sys.stderr.isatty())
