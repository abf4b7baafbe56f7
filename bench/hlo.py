"""Bytes a compiled (per-device) program moves in collectives, read from its HLO text.

Each collective's result size counts once per execution: ops inside a while body count
`known_trip_count` times (XLA records it for the loops `lax.scan` makes), ops inside a
conditional count for its largest branch, ops in called computations as often as the
caller runs. Result sizes, not link traffic: an all-gather's result is the whole gathered
array, of which (n - 1) / n arrived from other devices.
"""

from __future__ import annotations

import re

import numpy as np

KINDS = ("collective-permute", "all-gather", "all-to-all", "reduce-scatter", "all-reduce")
ITEMSIZE = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s8": 1,
            "u8": 1, "pred": 1}
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


def _result_bytes(result: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(result):
    if dtype in ITEMSIZE:
      total += ITEMSIZE[dtype] * int(np.prod([int(x) for x in dims.split(",") if x]))
  return total


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
  comps, name, entry = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      name = header.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif name is not None and line.startswith("  "):
      comps[name].append(line)
  return comps, entry


def collectives(text: str) -> dict[str, dict[str, int]]:
  """`{kind: {"count": executions, "bytes": result bytes}}` of the program's collectives
  (`kind` in `KINDS`; the async "-start" form counts, its "-done" does not)."""
  comps, entry = _computations(text)
  memo: dict[str, dict] = {}

  def walk(name: str) -> dict:
    if name in memo:
      return memo[name]
    memo[name] = {}
    total = {k: [0, 0] for k in KINDS}

    def add(part, times=1):
      for k, (count, size) in part.items():
        total[k][0] += count * times
        total[k][1] += size * times

    for line in comps.get(name, []):
      rhs = line.partition(" = ")[2]
      kind = next((k for k in KINDS if f" {k}(" in f" {rhs}" or f" {k}-start(" in f" {rhs}"), None)
      if kind is not None:
        total[kind][0] += 1
        total[kind][1] += _result_bytes(rhs.split(kind)[0])
      if " while(" in rhs:
        trips = re.search(r'known_trip_count":\{"n":"(\d+)"', rhs)
        body = re.search(r"body=%?([\w.\-]+)", rhs).group(1)
        add(walk(body), int(trips.group(1)) if trips else 1)
      elif " conditional(" in rhs:
        branches = re.search(r"branch_computations=\{([^}]*)\}", rhs)
        names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
        parts = [walk(b) for b in names]
        if parts:
          add(max(parts, key=lambda p: sum(size for _, size in p.values())))
      else:
        for called in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", rhs):
          add(walk(called))
    memo[name] = {k: tuple(v) for k, v in total.items() if v[0]}
    return memo[name]

  return {k: dict(count=c, bytes=b) for k, (c, b) in walk(entry).items()}
