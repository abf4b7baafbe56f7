"""`python -m train CONFIG.yaml [key=value ...]`: train, resuming from the run_dir.

  python -m train configs/demo.yaml
  python -m train configs/demo.yaml steps=20 model.dim=128 run_dir=runs/small

Overrides use dotted keys of `train.config.TrainConfig`; `python -m train --help` lists
them. Exit status 0 after the last step or after a SIGTERM or SIGINT (Ctrl-C; saved if a
step was done since the last checkpoint); 2 for a config error, one line naming the key or
file (reported before anything is written to the run_dir or compiled), or a file of
`data.source` changed under the running job (one line, "data error: ...", naming it; the
steps done are saved as at a stop, no checkpoint is moved, and a resume refuses the changed
corpus until the file is restored); 1 when checkpoints exist but the run cannot resume from
them (`train.checkpoint.CheckpointError`, nothing deleted); 3 when a process of a
multi-process job was lost (`train.distributed`: one line names it, within config key
heartbeat_timeout_s).
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str]) -> int:
  try:
    return _main(argv)
  except KeyboardInterrupt:  # outside `train.loop.run`, which handles SIGINT: before it
    # nothing is trained, after it every step is saved
    print("SIGINT outside the training loop: no unsaved step; exiting.", file=sys.stderr)
    return 0


def _main(argv: list[str]) -> int:
  from train import config

  if not argv or argv[0] in ("-h", "--help"):
    print((__doc__ or "") + "\nKeys:\n  " + "\n  ".join(config.valid_keys()))
    return 0 if argv else 2
  import jax  # imported, not started: loop, run_dir and storage start no jax backend

  from train import checkpoint, distributed, init_from, loop, run_dir, storage, xla_flags
  from train.data import BadRecord

  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                      force=True)  # importing grain installed a root handler of its own
  for noisy in ("absl", "orbax", "jax", "fsspec", "gcsfs"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  path, overrides = (None, argv) if "=" in argv[0] else (argv[0], argv[1:])
  try:
    cfg = config.load(path, overrides)
    for key in ("run_dir", "init_from", "data.source", "data.tokenizer"):  # before any read
      storage.check(str(config.get(cfg, key)), f"config key {key!r}", write=key == "run_dir")
    cfg = init_from.resolve(cfg, config.set_keys(path, overrides))
    run_dir.check(cfg)
    if cfg.overlap_flags:  # XLA reads them once, when its backend starts
      xla_flags.apply(xla_flags.platforms_of(cfg.platform), offload=cfg.model.remat == "offload")
    distributed.setup(cfg)  # before anything starts a jax backend
    try:
      _, stopped = loop.run(cfg)
    except jax.errors.JaxRuntimeError as e:
      distributed.await_lost(e)  # exits with status 3 naming a lost process of the job
      raise
  except config.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  except BadRecord as e:  # a document read back is not the one listed (`train.data.sources`)
    print(f"data error: data.source {cfg.data.source!r}: {e}", file=sys.stderr)
    return 2
  except checkpoint.CheckpointError as e:
    print(f"checkpoint error: {e}", file=sys.stderr)
    return 1
  if stopped:
    # The state is saved. A data read blocked in a pipeline thread would hold up the
    # interpreter's exit (it joins thread pools), and a SIGTERM is followed by a SIGKILL.
    distributed.shutdown()  # every process of a job leaves together
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
  distributed.finish()  # jax's own shutdown at exit waits for the other processes
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
