"""Run metrics: `{run_dir}/metrics.jsonl` (one JSON object per line, flushed each step),
TensorBoard events in `{run_dir}/tensorboard/`, the loss curve `{run_dir}/loss.png` and the
eval loss by position `{run_dir}/eval_loss_by_position.png`.

Lines are `{"step": s, "loss": ..., "grad_norm": ..., "lr": ..., "tokens": ...,
"tokens_per_s": ..., "tokens_per_s_per_device": ..., "tflops_per_device": ..., "mfu": ...
(null without a known peak, see `train.throughput`), "step_time": ..., "host_time": ...,
"dispatch_time": ...}` for training steps and `{"step": s, "eval_loss": ...,
"eval_tokens": ..., "eval_loss_by_position": {"256": ..., "512": ..., ...},
"eval_tokens_by_position": {...}}` for evals (by position: each bucket's upper bound in
tokens to its mean loss and its tokens, `train.evaluation`; in TensorBoard as scalars
`eval_loss_by_position/256`, ...). `step` counts optimizer steps done (1 after the first;
0: the eval of an `init_from` model before training).
tflops_per_device and mfu count the batch's model FLOPs (`train.throughput`).
step_time: seconds between this step's completion and the previous one's (the first
step's from the loop's start; evals and saves between steps count in the next one's), so
the steps add up to the run's wall time; host_time: the host's own work for the step
(data, metrics, logging), which overlaps the device's;
dispatch_time: the step's call until it returns (the loop calls it once the step before
is done, and the device waits for it meanwhile).
Only process 0 writes.

The run_dir may be a bucket (`train.storage`): there lines are appended (and TensorBoard's
events uploaded) every `BUCKET_FLUSH_S` seconds, at each eval and checkpoint and at the
end, rather than at each step (an append to an object is two requests); a kill loses the
lines since, of steps that the resumed run redoes.

The file is only ever appended to. A run resumed from a checkpoint older than its last
lines (killed between two checkpoints) redoes those steps and appends their lines again:
`read` takes the last line of each step as current, and the earlier ones stay in the file.
A run that starts over at step 0 finds no metrics.jsonl (`train.run_dir` archives it).
"""

from __future__ import annotations

import json
import logging
import sys
import time

import jax
from etils import epath

from train import storage

log = logging.getLogger(__name__)

BUCKET_FLUSH_S = 30.0


def _rows(text: str) -> list[dict]:
  rows = []
  for line in text.splitlines():
    try:
      row = json.loads(line)
    except ValueError:
      continue  # a line cut short by a kill
    if isinstance(row, dict) and isinstance(row.get("step"), int):
      rows.append(row)
  return rows


def read(run_dir: str) -> list[dict]:
  """The current metrics of a run in step order: for each step and kind (training or
  eval line), the last line written."""
  current = {}
  for row in _rows((storage.path(run_dir) / "metrics.jsonl").read_text()):
    current[row["step"], "eval_loss" in row] = row
  return [current[k] for k in sorted(current)]


class MetricsWriter:
  """Appends metrics of a run that has done `start_step` steps. `evaluated`: the steps
  with an eval line in the file (process 0; empty on the others).

  Args:
    run_dir: the run directory.
    start_step: steps already done (0 for a new run).
  """

  def __init__(self, run_dir: str, start_step: int):
    self.path = storage.path(run_dir) / "metrics.jsonl"
    self.enabled = jax.process_index() == 0
    self.evaluated: set[int] = set()
    if not self.enabled:
      return
    text = self.path.read_text() if self.path.exists() else ""
    self.evaluated = {r["step"] for r in _rows(text) if "eval_loss" in r}
    redone = sorted({r["step"] for r in _rows(text) if r["step"] > start_step})
    if redone:
      log.warning("%s has lines for steps %d..%d, past the checkpoint at step %d: they stay,"
                  " and the redone steps are appended after them (the last line of a step"
                  " is current).", self.path, redone[0], redone[-1], start_step)
    self._pending = "\n" if text and not text.endswith("\n") else ""  # ends a line cut short
    self._every = BUCKET_FLUSH_S if storage.is_url(run_dir) else 0.0
    self._flushed = time.monotonic()
    self._tb = _summary_writer()(str(self.path.parent / "tensorboard"),
                                 purge_step=start_step + 1)

  def write(self, step: int, values: dict) -> None:
    """One line `{"step": step, **values}`, flushed (on a bucket: see the module
    docstring); scalars to TensorBoard too (a dict of scalars as `name/key`)."""
    if not self.enabled:
      return
    self._pending += json.dumps({"step": step, **values}) + "\n"
    for name, value in values.items():
      for tag, scalar in (value.items() if isinstance(value, dict) else [("", value)]):
        self._tb.add_scalar(f"{name}/{tag}" if tag else name, scalar, step)
    if "eval_loss" in values or time.monotonic() - self._flushed >= self._every:
      self.flush()

  def flush(self) -> None:
    """Writes the lines and events not written yet."""
    if self.enabled:
      storage.append(self.path, self._pending.encode())
      self._pending = ""
      self._tb.flush()
      self._flushed = time.monotonic()

  def close(self) -> None:
    if self.enabled:
      self.flush()
      self._tb.close()

  def plot(self) -> None:
    """Draws the run's loss.png (`plot_loss`) and eval_loss_by_position.png
    (`plot_loss_by_position`, where evals have it) on process 0."""
    if self.enabled:
      plot_loss(str(self.path.parent))
      plot_loss_by_position(str(self.path.parent))


def _summary_writer():
  """tensorboardX's `SummaryWriter`, imported without torch. tensorboardX imports torch,
  where it is installed, only to accept torch tensors (a second of start-up, and a second
  framework in the process); the trainer writes Python floats."""
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    from tensorboardX import SummaryWriter
  else:
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
      from tensorboardX import SummaryWriter
    finally:
      del sys.modules["torch"]
  from tensorboardX import record_writer
  record_writer.register_writer_factory("gs", _BucketEvents)  # type: ignore[arg-type]
  return SummaryWriter


class _BucketEvents:
  """TensorBoard's event files on a bucket, through `train.storage` (tensorboardX's own
  writer for gs:// needs google-cloud-storage's client with a project, and uploads the
  whole file again at each flush): records are kept until a flush appends them."""

  def __init__(self, path: str):
    self.path, self._buffer = storage.path(path), bytearray()

  @classmethod
  def open(cls, path: str) -> _BucketEvents:  # tensorboardX's factory interface
    return cls(path)

  @staticmethod
  def directory_check(path: str) -> None:  # a bucket's directories need no creating
    del path

  def write(self, data: bytes) -> None:
    self._buffer += data

  def flush(self) -> None:
    storage.append(self.path, bytes(self._buffer))
    self._buffer.clear()

  def close(self) -> None:
    self.flush()


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _save(fig, out: epath.Path) -> epath.Path:
  with out.open("wb") as f:
    fig.savefig(f, format="png", dpi=100)
  return out


def plot_loss(run_dir: str) -> epath.Path:
  """Draws train and eval loss by step from `{run_dir}/metrics.jsonl` to `loss.png`."""
  plt = _pyplot()
  run = storage.path(run_dir)
  rows = read(run_dir)
  fig, ax = plt.subplots(figsize=(7, 4))
  for key, style in (("loss", "-"), ("eval_loss", "o-")):
    points = [(r["step"], r[key]) for r in rows if key in r]
    if points:
      ax.plot(*zip(*points, strict=True), style, label=key, markersize=3)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats / token)")
  ax.set_title(run.name)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  out = _save(fig, run / "loss.png")
  plt.close(fig)
  return out


def plot_loss_by_position(run_dir: str) -> epath.Path | None:
  """Draws each eval's loss by position in the segment (`eval_loss_by_position`: a line per
  eval step, x the bucket's upper bound on a log scale) from `{run_dir}/metrics.jsonl` to
  `eval_loss_by_position.png`; None where no eval has it."""
  rows = [r for r in read(run_dir) if isinstance(r.get("eval_loss_by_position"), dict)
          and r["eval_loss_by_position"]]
  if not rows:
    return None
  plt = _pyplot()
  run = storage.path(run_dir)
  fig, ax = plt.subplots(figsize=(7, 4))
  colors = plt.get_cmap("viridis")
  for i, r in enumerate(rows):
    points = sorted((int(k), v) for k, v in r["eval_loss_by_position"].items())
    ax.plot(*zip(*points, strict=True), "o-", markersize=3, label=f"step {r['step']}",
            color=colors(i / max(len(rows) - 1, 1)))
  ax.set_xscale("log", base=2)
  bounds = sorted({int(k) for r in rows for k in r["eval_loss_by_position"]})
  ax.set_xticks(bounds, [str(b) for b in bounds])
  ax.minorticks_off()
  ax.set_xlabel("position in the segment (bucket's upper bound, tokens)")
  ax.set_ylabel("eval loss (nats / token)")
  ax.set_title(f"{run.name}: eval loss by position")
  ax.grid(alpha=0.3)
  ax.legend(fontsize="small", ncol=2)
  fig.tight_layout()
  out = _save(fig, run / "eval_loss_by_position.png")
  plt.close(fig)
  return out
