"""`context_parallel.strategy: auto`: the one context-parallel strategy a run uses, chosen
when it starts as the fastest by an estimate of its whole step, with the reason logged.

The alternatives are the strategies the run's mesh can run (`alternatives`: with mesh
`context_ring` > 1 only Ulysses x ring). Each is estimated by one of two means:
- compiled (`step_seconds` given): the step compiled for the run's devices, as `python -m
  train.compile` compiles it, and `flaxattn.aot.estimate` read from the program; a step that
  does not fit the devices' memory is out;
- modelled: the attention's analytic cost model, `flaxattn.planner`, summed over the model's
  layers (each layer's mask), on the platform's numbers (`planner.PLATFORMS`: those of TPU
  and GPU calibrated against compiled estimates, bench/README.md, "The cost model
  calibrated").

The trainer compiles where the devices' chip has published peak figures
(`flaxattn.aot.chip_of`) and `context_parallel.auto_compile` is set: one compile per
alternative at start, each about as long as the step's own first compile; elsewhere (CPU)
it models.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

from train.config import MESH_AXES, ConfigError, TrainConfig

log = logging.getLogger(__name__)

# The strategies `auto` chooses among, in the order ties go.
STRATEGIES = ("ulysses", "all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class Choice:
  """strategy: the one chosen. seconds: each alternative's estimate (None: it does not fit
  the devices' memory). by: "compile" or "model". reason: one line saying why."""

  strategy: str
  seconds: dict[str, float | None]
  by: str
  reason: str


def with_strategy(cfg: TrainConfig, strategy: str) -> TrainConfig:
  """`cfg` with `context_parallel.strategy` set to `strategy`."""
  return dataclasses.replace(cfg, context_parallel=dataclasses.replace(
      cfg.context_parallel, strategy=strategy))


def needed(cfg: TrainConfig) -> bool:
  """Whether `cfg` asks for a choice: strategy "auto" on a mesh that shards the sequence."""
  mesh = cfg.mesh
  return (cfg.context_parallel.strategy == "auto"
          and (mesh.context != 1 or mesh.context_ring != 1))


def alternatives(cfg: TrainConfig, num_devices: int) -> tuple[list[str], dict[str, str]]:
  """(the strategies run `cfg` can take on `num_devices` devices, {strategy: why not} for
  the others): each checked as `train.mesh.check` checks a run.

  Raises:
    ConfigError: none can run; the reason of each.
  """
  from train import mesh as mesh_lib

  ring = cfg.mesh.context_ring != 1
  can, cannot = [], {}
  for strategy in (("ulysses",) if ring else STRATEGIES):
    try:
      mesh_lib.check(with_strategy(cfg, strategy), num_devices)
      can.append(strategy)
    except ConfigError as e:
      cannot[strategy] = str(e)
  if not can:
    raise ConfigError("context_parallel.strategy 'auto' finds no strategy this mesh runs: "
                      + "; ".join(f"{s}: {why}" for s, why in cannot.items()),
                      ("context_parallel.strategy",))
  return can, cannot


def choose(cfg: TrainConfig, num_devices: int,
           step_seconds: Callable[[TrainConfig], float | None] | None = None,
           platform: str = "tpu", why_modelled: str = "") -> Choice:
  """The strategy `cfg` (strategy "auto") takes on `num_devices` devices: the alternative
  with the smallest estimate, ties to the earlier of `STRATEGIES`. `step_seconds(cfg)`: a
  compiled estimate of the step (None: it does not fit); without it the analytic model on
  `platform`'s numbers, `why_modelled` saying why in the reason.

  Raises:
    ConfigError: no strategy can run, or (compiled) none fits.
  """
  can, cannot = alternatives(cfg, num_devices)
  skipped = "".join(f"; {s} cannot run ({why.split(':')[0]})" for s, why in cannot.items())
  if len(can) == 1:
    only = ("Ulysses x ring, the one strategy over mesh context_ring x context"
            if cfg.mesh.context_ring != 1 else "the only one this mesh runs")
    return Choice(can[0], {can[0]: None}, "none", f"{only}{skipped}")
  seconds: dict[str, float | None]
  if step_seconds is not None:
    seconds = {s: step_seconds(with_strategy(cfg, s)) for s in can}
    by = "compile"
    how = "compiled step, flaxattn.aot.estimate"
  else:
    seconds = {s: modelled_seconds(with_strategy(cfg, s), num_devices, platform) for s in can}
    by = "model"
    how = (f"attention's analytic model, flaxattn.planner.PLATFORMS[{platform!r}]"
           + (f"; {why_modelled}" if why_modelled else ""))
  fitting = [s for s in can if seconds[s] is not None]
  if not fitting:
    raise ConfigError(f"context_parallel.strategy 'auto': no strategy fits the devices' memory"
                      f" ({', '.join(can)} compiled){skipped}", ("context_parallel.strategy",))
  best = min(fitting, key=lambda s: (seconds[s], STRATEGIES.index(s)))
  listed = ", ".join(f"{s} {seconds[s]:.4g} s" if seconds[s] is not None
                     else f"{s} does not fit" for s in can)
  return Choice(best, seconds, by, f"the fastest by the {how}: {listed}{skipped}")


def modelled_seconds(cfg: TrainConfig, num_devices: int, platform: str) -> float:
  """`flaxattn.planner`'s seconds of run `cfg`'s attention (forward and backward, per
  device) with its strategy, summed over the model's layers: each layer's mask on the
  batch rows and heads one device's context group holds."""
  from flaxattn import planner
  from models.llama import layer_masks
  from train import mesh as mesh_lib
  from train.config import BALANCE

  sizes = dict(zip(MESH_AXES, mesh_lib.axis_sizes(cfg.mesh, num_devices), strict=True))
  m = cfg.model
  rows = max(cfg.batch_size // (sizes["data"] * sizes["fsdp"]), 1)
  heads, kv_heads = m.n_heads, m.n_kv_heads
  if heads % sizes["tensor"] == 0 and kv_heads % sizes["tensor"] == 0:
    heads, kv_heads = heads // sizes["tensor"], kv_heads // sizes["tensor"]
  q_shape = (rows, cfg.seq_len, heads, m.attn_head_dim)
  kv_shape = (rows, cfg.seq_len, kv_heads, m.attn_head_dim)
  name = {"ulysses": "ulysses_ring" if sizes["context_ring"] > 1 else "ulysses"}.get(
      cfg.context_parallel.strategy, cfg.context_parallel.strategy)
  itemsize = 2 if m.dtype == "bfloat16" else 4
  total = 0.0
  for mask in layer_masks(m):
    _, costs = planner.plan(q_shape, kv_shape, itemsize, mask, BALANCE[cfg.data.balance],
                            sizes["context"], platform, sizes["context_ring"]
                            if sizes["context_ring"] > 1 else None)
    cost = next(c for c in costs if c.strategy == name)
    if cost.seconds is None:
      return math.inf
    total += cost.seconds
  return total


def resolve(cfg: TrainConfig, devices, estimate_on: Callable) -> TrainConfig:
  """`cfg` with strategy "auto" replaced by the choice for `devices` (`choose`: compiled
  where their chip has published figures and `context_parallel.auto_compile` is set, else
  modelled), logged with its reason; any other `cfg` as it is. `estimate_on(cfg, devices,
  chip)`: a compiled step's estimate, or None where it does not fit
  (`train.compile.estimate_on`).

  Raises:
    ConfigError: as `choose`.
  """
  if not needed(cfg):
    return cfg
  from flaxattn import aot

  chip = aot.chip_of(devices[0].device_kind)
  platform = devices[0].platform
  why = ("context_parallel.auto_compile is false" if not cfg.context_parallel.auto_compile
         else f"no published peak figures for {devices[0].device_kind!r} devices" if chip is None
         else "")

  def step_seconds(c: TrainConfig) -> float | None:
    e = estimate_on(c, devices, chip)
    return None if e is None else e.step_s

  choice = choose(cfg, len(devices), None if why else step_seconds,
                  platform if platform in ("tpu", "gpu") else "cpu", why)
  log.info("context_parallel.strategy auto: %s (%s)", choice.strategy, choice.reason)
  return with_strategy(cfg, choice.strategy)
