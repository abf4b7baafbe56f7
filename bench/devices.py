"""The devices a benchmark part needs: on fewer (one GPU, where the simulated CPU devices
are not the default backend) the part is skipped with a line saying how many it needs."""

from __future__ import annotations

import jax


def shortfall(needed: int) -> str | None:
  """Why `needed` devices are not there ("needs 8 devices, 1 present (gpu)"), or None."""
  have = jax.device_count()
  if have >= needed:
    return None
  return f"needs {needed} devices, {have} present ({jax.default_backend()})"


def enough(needed: int, part: str) -> bool:
  """Whether this process sees at least `needed` devices; if not, prints that `part` is
  skipped and why."""
  why = shortfall(needed)
  if why:
    print(f"{part}: skipped, {why}.", flush=True)
  return why is None
