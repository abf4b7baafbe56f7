"""Run metrics: `{run_dir}/metrics.jsonl` (one JSON object per line, flushed each step),
TensorBoard events in `{run_dir}/tensorboard/`, and the loss curve `{run_dir}/loss.png`.

Lines are `{"step": s, "loss": ..., "grad_norm": ..., "lr": ..., "tokens": ...,
"tokens_per_s": ..., "step_time": ...}` for training steps and `{"step": s, "eval_loss":
..., "eval_tokens": ...}` for evals. `step` counts optimizer steps done (1 after the first).
Only process 0 writes.
"""

from __future__ import annotations

import json
import pathlib

import jax


class MetricsWriter:
  """Appends metrics of a run, resuming at `start_step`: lines of later steps (written
  after the checkpoint being resumed) are dropped, so the file reads as one run.

  Args:
    run_dir: the run directory.
    start_step: steps already done (0 for a new run).
  """

  def __init__(self, run_dir: str, start_step: int):
    self.path = pathlib.Path(run_dir) / "metrics.jsonl"
    self.enabled = jax.process_index() == 0
    if not self.enabled:
      return
    kept = []
    if self.path.exists():
      for line in self.path.read_text().splitlines():
        try:
          if json.loads(line)["step"] <= start_step:
            kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
          pass  # a line cut short by a kill
    self.path.write_text("".join(kept))
    self._file = self.path.open("a")
    from tensorboardX import SummaryWriter
    self._tb = SummaryWriter(str(pathlib.Path(run_dir) / "tensorboard"),
                             purge_step=start_step + 1)

  def write(self, step: int, values: dict) -> None:
    """One line `{"step": step, **values}`, flushed; scalars to TensorBoard too."""
    if not self.enabled:
      return
    self._file.write(json.dumps({"step": step, **values}) + "\n")
    self._file.flush()
    for name, value in values.items():
      self._tb.add_scalar(name, value, step)
    self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._file.close()
      self._tb.close()


def plot_loss(run_dir: str) -> pathlib.Path:
  """Draws train and eval loss by step from `{run_dir}/metrics.jsonl` to `loss.png`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  run = pathlib.Path(run_dir)
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  fig, ax = plt.subplots(figsize=(7, 4))
  for key, style in (("loss", "-"), ("eval_loss", "o-")):
    points = [(r["step"], r[key]) for r in rows if key in r]
    if points:
      ax.plot(*zip(*points), style, label=key, markersize=3)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats / token)")
  ax.set_title(run.name)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  out = run / "loss.png"
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out
