"""The attention's analytic cost model (`flaxattn.planner`) calibrated against compiled
estimates: attention alone compiled for a grid of lengths and context sizes, each program's
`flaxattn.aot.estimate` read, and the planner's platform numbers fitted to them.

  python -m bench.calibrate [--platform v5p|h100] [--cps 2 4 8] [--tokens 2048 8192 32768]
                            [--json PATH] [--cells PATH]

Each cell is `bench.ring_compiled.compile_case` (forward+backward, B=1, H=16 on 8 K/V
heads, D=128, bfloat16, causal, load balanced) with strategy ring, all_gather and ulysses,
`--tokens` per device over cp devices (`--cells`: those of an earlier `--json`, refitted
without compiling). The fit: the `planner.Platform` whose estimates (`planner.plan`) are
nearest the compiled ones (`fit`: in squared log ratio, and in each strategy's ratio to
the others at its grid point): its flops the chip's peak and its ring link one ICI port
(what the estimates take), half_rate_tokens, all_to_all and step_overhead found by
Nelder-Mead over their logarithms from the nominal numbers. Printed: each
cell's compiled estimate, the nominal and the fitted model's, and how often each picks the
compiled estimate's fastest strategy; then the fitted platform, which `planner.PLATFORMS`
takes (tpu: v5p's fit, gpu: H100's). The estimate is a roofline from published peaks: the
fit inherits what it leaves out (`flaxattn.aot.estimate`), and is no measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np

STRATEGIES = ("ring", "all_gather", "ulysses")
FIELDS = ("half_rate_tokens", "all_to_all", "step_overhead")  # fitted
PLANNER = {"v5p": "tpu", "h100": "gpu"}


def modelled(platform, tokens: int, cp: int, strategy: str) -> float:
  """The planner's seconds of one cell on `platform` (a `planner.Platform`)."""
  import flaxattn
  from flaxattn import planner

  t = tokens * cp
  _, costs = planner.plan((1, t, 16, 128), (1, t, 8, 128), 2, flaxattn.Causal(), True, cp,
                          platform)
  seconds = next(c.seconds for c in costs if c.strategy == strategy)
  assert seconds is not None
  return seconds


def platform_of(x: np.ndarray, chip):
  """The `planner.Platform` of the fitted logarithms `x` (`FIELDS`) on `chip`: its peak
  FLOP/s and one link port, the figures the compiled estimates are made of."""
  from flaxattn import planner
  values = dict(zip(FIELDS, map(float, np.exp(x)), strict=True))
  values["half_rate_tokens"] = int(round(values["half_rate_tokens"]))
  return planner.Platform(flops=chip.peak_flops, link=chip.ici_bandwidth / 2 / chip.ici_ports,
                          **values)


def fit(cells: list[dict], start, chip) -> tuple:
  """(the fitted `planner.Platform`, its loss) over `cells`: the mean squared log ratio of
  modelled to compiled seconds, plus that of each strategy's seconds relative to the other
  strategies' at its grid point (the ranking `auto` reads, which the first term alone
  fits loosely where the strategies differ by a few percent). Compute at `chip`'s peak and
  the ring's link one port of it, as the estimates count them; the rest fitted from
  `start`, by Nelder-Mead restarted from its own answer until it stops improving."""
  def loss(x):
    p = platform_of(x, chip)
    return mismatch(cells, [modelled(p, c["tokens"], c["cp"], c["strategy"]) for c in cells])

  x, value = np.log([float(getattr(start, f)) for f in FIELDS]), math.inf
  while True:
    x_next, better = nelder_mead(loss, x)
    if better > value - 1e-6:
      return platform_of(x, chip), value
    x, value = x_next, better


def nelder_mead(f, x0: np.ndarray, step: float = 1.0, iterations: int = 600):
  """The minimum of `f` near `x0` (standard coefficients; a simplex of `step` per axis)."""
  simplex = [x0] + [x0 + step * np.eye(len(x0))[i] for i in range(len(x0))]
  values = [f(x) for x in simplex]
  for _ in range(iterations):
    order = np.argsort(values)
    simplex, values = [simplex[i] for i in order], [values[i] for i in order]
    centre = np.mean(simplex[:-1], axis=0)
    reflected = centre + (centre - simplex[-1])
    r = f(reflected)
    if r < values[0]:
      expanded = centre + 2 * (centre - simplex[-1])
      e = f(expanded)
      simplex[-1], values[-1] = (expanded, e) if e < r else (reflected, r)
    elif r < values[-2]:
      simplex[-1], values[-1] = reflected, r
    else:
      contracted = centre + 0.5 * (simplex[-1] - centre)
      c = f(contracted)
      if c < values[-1]:
        simplex[-1], values[-1] = contracted, c
      else:
        simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
        values = [f(x) for x in simplex]
  i = int(np.argmin(values))
  return simplex[i], values[i]


def mismatch(cells: list[dict], seconds: list[float]) -> float:
  """`fit`'s loss of modelled `seconds` (one per cell) against the cells' estimates."""
  error = np.log(np.asarray(seconds)) - np.log([c["estimate_s"] for c in cells])
  points = [(c["cp"], c["tokens"]) for c in cells]
  centred = error - np.asarray([np.mean([e for e, q in zip(error, points, strict=True)
                                         if q == p]) for p in points])
  return float(np.mean(error ** 2) + np.mean(centred ** 2))


def picks(cells: list[dict], key: str) -> tuple[int, int]:
  """(grid points where `key`'s fastest strategy is the compiled estimate's, grid points)."""
  points = {}
  for c in cells:
    points.setdefault((c["cp"], c["tokens"]), []).append(c)
  agree = sum(min(p, key=lambda c: c[key])["strategy"] == min(p, key=lambda c: c["estimate_s"])[
      "strategy"] for p in points.values())
  return agree, len(points)


def compile_cells(platform: str, cps, tokens_per_device) -> list[dict]:
  """Each cell compiled (`bench.ring_compiled.compile_case`) and estimated, printed as it
  finishes."""
  from bench.ring_compiled import compile_case
  from train import xla_flags

  xla_flags.apply(["tpu", "gpu"])
  cells = []
  print("| cp | tokens per device | strategy | compiled estimate ms | bound | compile s |\n|"
        + "---|" * 6, flush=True)
  for cp in cps:
    for tokens in tokens_per_device:
      for strategy in STRATEGIES:
        row = compile_case(platform, cp, "causal", strategy, tokens)
        cells.append({"cp": cp, "tokens": tokens, "strategy": strategy,
                      "estimate_s": row.estimate["step_s"], "estimate": row.estimate,
                      "temporaries": row.temporaries, "compile_s": row.compile_s})
        print(f"| {cp} | {tokens} | {strategy} | {1e3 * row.estimate['step_s']:.3f}"
              f" | {row.estimate['bound']} | {row.compile_s:.0f} |", flush=True)
  return cells


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--platform", default="v5p", choices=sorted(PLANNER))
  parser.add_argument("--cps", nargs="+", type=int, default=[2, 4, 8], choices=[2, 4, 8])
  parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 8192, 32768])
  parser.add_argument("--json", help="write the cells and the fit here")
  parser.add_argument("--cells", help="fit the cells of an earlier --json instead of compiling")
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from flaxattn import planner

  if args.cells:
    with open(args.cells) as f:
      earlier = json.load(f)
    cells, args.platform = earlier["cells"], earlier["platform"]
  else:
    cells = compile_cells(args.platform, args.cps, args.tokens)
  nominal = planner.PLATFORMS[PLANNER[args.platform]]
  from flaxattn import aot
  fitted, error = fit(cells, nominal, aot.TARGETS[args.platform])
  for c in cells:
    c["nominal_s"] = modelled(nominal, c["tokens"], c["cp"], c["strategy"])
    c["fitted_s"] = modelled(fitted, c["tokens"], c["cp"], c["strategy"])
  print("\n| cp | tokens per device | strategy | compiled estimate ms | nominal model ms"
        " | fitted model ms |\n|" + "---|" * 6)
  for c in cells:
    print(f"| {c['cp']} | {c['tokens']} | {c['strategy']} | {1e3 * c['estimate_s']:.3f}"
          f" | {1e3 * c['nominal_s']:.3f} | {1e3 * c['fitted_s']:.3f} |")
  rms = {key: math.sqrt(float(np.mean([math.log(c[key] / c["estimate_s"]) ** 2
                                          for c in cells])))
         for key in ("nominal_s", "fitted_s")}
  summary = {"platform": args.platform, "nominal": dataclasses.asdict(nominal),
             "fitted": dataclasses.asdict(fitted), "loss": error,
             "rms_log_ratio": {"nominal": rms["nominal_s"], "fitted": rms["fitted_s"]},
             "picks": {"nominal": picks(cells, "nominal_s"), "fitted": picks(cells, "fitted_s")}}
  print(f"\nRMS of log(model / compiled): nominal {rms['nominal_s']:.3f}, fitted"
        f" {rms['fitted_s']:.3f}; the compiled estimate's fastest picked at"
        f" {summary['picks']['nominal'][0]} / {summary['picks']['nominal'][1]} grid points"
        f" (nominal) and {summary['picks']['fitted'][0]} / {summary['picks']['fitted'][1]}"
        f" (fitted)\nfitted: {fitted}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({**summary, "cells": cells}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
