"""`python -m train.export RUN_DIR OUT_DIR [--dtype bfloat16]`: the model of a run's newest
checkpoint as a Hugging Face directory (`models.hf.save`: Llama, Mistral, Qwen2 or Qwen3,
whichever holds the model's options), which `models.hf.load` and `transformers` read.

The checkpoint is restored onto the host's CPU (whatever devices trained it), the model
config is the run's config.json. Exit status 0, or 2 with a message when RUN_DIR is not a
run with a checkpoint or its model has an option no Hugging Face architecture here holds
(`models.hf.ExportError`, naming it; nothing is written).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys


def restore_model(run_dir: str, cfg=None, device=None):
  """`(step, model)`: the `models.llama.Llama` of `run_dir`'s newest checkpoint, read
  without changing anything in `run_dir` (a run may still be training there), with the
  run's model config.

  Args:
    cfg: the run's `TrainConfig` where the caller has loaded it; None: its config.json.
    device: where the parameters go (whatever devices trained them); None: the host's CPU.

  Raises:
    ConfigError: `run_dir` has no loadable config.json.
    CheckpointError: it has no checkpoint, or the newest does not restore.
  """
  import jax
  from flax import nnx

  from train import checkpoint, config
  from train import run_dir as run_dir_lib
  from train.state import make_state

  if cfg is None:
    if not (pathlib.Path(run_dir) / "config.json").is_file():
      raise config.ConfigError(f"export expects a run_dir with config.json (a run of this"
                               f" trainer), got {run_dir!r}, which has none.")
    cfg = run_dir_lib.saved_config(run_dir)
  # The trainer's state (model and optimizer), so the tree matches the checkpoint's.
  graphdef, abstract = nnx.split(nnx.eval_shape(
      lambda: make_state(cfg.model, cfg.optimizer, cfg.steps)))
  where = jax.sharding.SingleDeviceSharding(device or jax.devices("cpu")[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                          abstract)
  step, state = checkpoint.restore_newest(run_dir, abstract)
  return step, nnx.merge(graphdef, state).model


def export(run_dir: str, out_dir: str, dtype: str = "bfloat16") -> int:
  """Writes the model of `run_dir`'s newest checkpoint to `out_dir` in Hugging Face format,
  tensors as `dtype`; returns the checkpoint's step.

  Raises:
    ConfigError, CheckpointError: as `restore_model`.
    models.hf.ExportError: an option no architecture holds (before the checkpoint is read).
    ValueError: unknown dtype.
  """
  from models import hf
  from train import run_dir as run_dir_lib

  if (pathlib.Path(run_dir) / "config.json").is_file():
    hf.architecture(run_dir_lib.saved_config(run_dir).model)  # refuse before restoring
  step, model = restore_model(run_dir)
  hf.save(model, out_dir, dtype=dtype)
  return step


def main(argv: list[str]) -> int:
  from models.hf import DTYPES, ExportError
  from train import checkpoint, config

  parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dir")
  parser.add_argument("out_dir")
  parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
  args = parser.parse_args(argv)
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax notes that it reads read-only
  try:
    step = export(args.run_dir, args.out_dir, args.dtype)
  except (config.ConfigError, checkpoint.CheckpointError, ExportError) as e:
    print(f"export error: {e}", file=sys.stderr)
    return 2
  print(f"wrote step {step} of {args.run_dir} to {args.out_dir} ({args.dtype})")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
