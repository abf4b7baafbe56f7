"""`python -m train CONFIG.yaml [key=value ...]`: train, resuming from the run_dir.

  python -m train configs/demo.yaml
  python -m train configs/demo.yaml steps=20 model.dim=128 run_dir=runs/small

Overrides use dotted keys of `train.config.TrainConfig`; `python -m train --help` lists
them. Exit status 0 after the last step or after a SIGTERM-triggered save; 2 for a config
error (reported before any compilation).
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str]) -> int:
  from train import config

  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__ + "\nKeys:\n  " + "\n  ".join(config.valid_keys()))
    return 0 if argv else 2
  path, overrides = (None, argv) if "=" in argv[0] else (argv[0], argv[1:])
  try:
    cfg = config.load(path, overrides)
    from train import distributed
    distributed.setup(cfg)  # before anything starts a jax backend
  except config.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "orbax", "jax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  from train import loop
  try:
    loop.run(cfg)
  except config.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
