"""`python -m train.compile CONFIG [key=value ...] --target TARGET`: whether a run fits a
TPU slice or NVIDIA GPUs, answered from any host by the target's own compiler.

  python -m train.compile configs/tpu_v5p_8b.yaml --target v5p-128
  python -m train.compile configs/gpu_8x_8b.yaml --target 8xh100 --json
  python -m train.compile configs/gpu_demo.yaml --target h100 --fit seq_len

The trainer's step (`train.loop.train_step` on the state and batch `python -m train` builds:
`train.mesh.make`, `train.state.abstract_state`, `train.data.abstract_batch`) is compiled
for TARGET's compile-only devices (`flaxattn.aot`), and XLA's memory plan per device is
reported with what the target lets a program use. No chip and no data are needed: libtpu
compiles for TPU (Mosaic kernels included), the CUDA plugin and ptxas for NVIDIA
(`pip install "flaxattn[aot]"`). One answer is one compile: 90 to 310 s for an 8B model on
a 2-core host.

TARGET: `v5e-N`, `v6e-N` (N chips), `v5p-N` (N TensorCores, 2 per chip: v5p-128 is 64
chips), or `h100`, `h200`, `a100-80g` with an optional count per host (`8xh100`) and
`--hosts M`. v4 is refused (`flaxattn.aot.REFUSED`).

Reported (a table, or one JSON line with --json):
  per_device_bytes  arguments (parameters, optimizer state, batch), temporaries, outputs,
                    aliased (outputs written over the donated state) and total = arguments +
                    temporaries + outputs - aliased, as XLA's memory plan gives them;
                    peak, the compiler's own most-bytes-live figure (arguments included; on
                    TPU the 8B example's is well below total; fit is judged on total:
                    flaxattn.aot.Memory); host_temporaries, in the host's memory (remat
                    "offload"), not in total;
  hbm_bytes         what a program may use: on TPU the HBM less the runtime's reserve, on
                    GPU JAX's preallocated fraction (0.75, or XLA_PYTHON_CLIENT_MEM_FRACTION);
  fits              total + MARGIN x hbm_bytes <= hbm_bytes;
  kernels, the mesh and the physical axes each mesh axis spans, compile_s, warnings (the
  partitioner's rematerializations; cuDNN workspaces, which the plan omits);
  collectives       {kind: {count, bytes, exposed_bytes}} per device and step, read from
                    the compiler's schedule (`flaxattn.aot.collectives`): executions,
                    result bytes, and the bytes of those with nothing computed between
                    their start and their done;
  xla_flags         the compiler flags it compiled with: the platform's overlap flags
                    (`train.xla_flags`, as `python -m train` sets them; config key
                    overlap_flags) added to the environment's.

Exit status: 0 fits; 1 does not fit (one line: total, HBM, the largest arrays; the
compiler's own out-of-memory refusal counts); 2 bad input (config, target, a mesh the target
cannot hold, the compiler not installed: the extra to install).

--fit seq_len: the longest seq_len that fits (model.max_seq_len raised with it): powers of
two up or down from the config's, then once between the last that fits and the first that
does not, each compile reported as it finishes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
import tempfile
import time

GIB = 2**30
# Headroom for what the plan leaves out (the runtime's own buffers, collectives' scratch,
# fragmentation). A judgment, not yet calibrated: no run on a TPU or GPU has been compared
# with its plan.
MARGIN = 0.05
_REMAT = re.compile(r"Involuntary full rematerialization[^\n]*")
_ARRAY = re.compile(
    r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]+)\](\{[^}]*\})?")
_HOST = "S(5)"  # a layout's memory space 5: the host's memory
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


class BadInput(Exception):
  """Exit status 2: the message says what to fix."""


@dataclasses.dataclass
class Result:
  """One compile's answer (see the module docstring); `error`: the compiler's refusal."""

  target: str
  devices: int
  mesh: dict
  physical_axes: str
  seq_len: int
  per_device_bytes: dict
  hbm_bytes: int
  fits: bool
  kernels: dict
  collectives: dict
  xla_flags: str
  compile_s: float
  warnings: list
  largest: list
  error: str | None = None

  def summary(self) -> str:
    """One line: fits or not, total against HBM, the largest arrays."""
    total = self.per_device_bytes.get("total", 0)
    head = "fits" if self.fits else "does not fit"
    size = (f"refused by the compiler: {self.error}" if self.error else
            f"total {total / GIB:.2f} GiB + {MARGIN:.0%} margin vs {self.hbm_bytes / GIB:.2f} GiB"
            " usable per device")
    largest = ", ".join(self.largest[:3])
    return (f"{head}: {self.target} seq_len {self.seq_len}: {size}"
            + (f"; largest arrays: {largest}" if largest and not self.fits else ""))


def compile_step(cfg, target) -> Result:
  """Compiles `cfg`'s train step for `target` (`flaxattn.aot.Target`) and reads its plan.

  Raises:
    BadInput: the compiler is missing, or the config does not fit the target's devices.
  """
  import jax
  from flax import nnx

  from flaxattn import aot, cudnn
  from train import data, loop, state, xla_flags
  from train import mesh as mesh_lib
  from train.config import ConfigError

  try:
    devices = aot.devices(target)
  except aot.MissingCompiler as e:
    raise BadInput(str(e)) from None
  try:
    parallel = mesh_lib.make(cfg, devices)
  except ConfigError as e:
    raise BadInput(f"config error for {target.name} ({target.devices} devices): {e}") from None
  mesh = parallel.mesh
  hbm = target.hbm_bytes()
  begin = time.perf_counter()
  substituted = _Collect()
  logging.getLogger("flaxattn").addHandler(substituted)
  try:
    with _stderr_to() as log, jax.set_mesh(mesh), nnx.logical_axis_rules(parallel.rules):
      _, graphdef, abstract = state.abstract_state(cfg, mesh, parallel.cp)
      batch = data.abstract_batch(mesh, cfg.batch_size, cfg.seq_len)
      lowered = loop.train_step.lower(nnx.merge(graphdef, abstract), batch)
      try:
        compiled, refusal = lowered.compile(), None
      except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        compiled, refusal = None, str(e).strip().splitlines()[0]
  finally:
    logging.getLogger("flaxattn").removeHandler(substituted)
  seconds = time.perf_counter() - begin
  # The registry's kernel substitutions (a GPU kernel that cannot be traced on this host),
  # then the partitioner's rematerializations.
  warnings = sorted(set(substituted.messages)) + sorted(set(_REMAT.findall("".join(log))))
  if compiled is None:
    plan, text, fits = {}, "", False
    # The refusal names no buffers: the program's arrays before partitioning instead.
    largest = [f"{a} (global)" for a in _largest(_stablehlo_shapes(lowered))]
  else:
    memory = aot.memory(compiled)
    plan, text = memory.as_dict(), compiled.as_text() or ""
    fits, largest = memory.total + MARGIN * hbm <= hbm, _largest(text)
  kernels = aot.kernels(text)
  missing = cudnn.missing_here() if target.platform == "gpu" else None
  if missing:
    warnings.append(missing)
  if any(k.startswith("__cudnn") for k in kernels):
    warnings.append("cuDNN calls: their workspace is not in the plan (a deviceless compile"
                    " does not size it); measure on the GPU.")
  return Result(target=target.name, devices=target.devices, mesh=dict(mesh.shape),
                physical_axes=mesh_lib.describe_axes(mesh), seq_len=cfg.seq_len,
                per_device_bytes=plan, hbm_bytes=hbm, fits=fits, kernels=kernels,
                collectives=aot.collectives(text),
                xla_flags=os.environ.get(xla_flags.TABLE[target.platform][0], ""),
                compile_s=seconds, warnings=warnings,
                largest=largest,
                error=refusal and refusal[refusal.find("RESOURCE_EXHAUSTED"):].rstrip("."))


class _Collect(logging.Handler):
  """Keeps the messages of warnings logged while it is attached."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


@contextlib.contextmanager
def _stderr_to():
  """The process's stderr (fd 2, where XLA logs) held back; yields a list that holds its
  text afterwards."""
  sys.stderr.flush()
  saved, captured = os.dup(2), []
  with tempfile.TemporaryFile("w+") as f:
    os.dup2(f.fileno(), 2)
    try:
      yield captured
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      f.seek(0)
      captured.append(f.read())


def _largest(text: str, n: int = 3) -> list[str]:
  """The `n` largest array shapes `text` names (a compiled program or the compiler's
  refusal), with their sizes."""
  sizes, spaces = {}, {}
  for dtype, dims, layout in _ARRAY.findall(text):
    shape = f"{dtype}[{dims}]"
    size = _BYTES[dtype] * math.prod(int(d) for d in dims.split(","))
    seen = spaces.setdefault(shape, set())
    if layout:  # a buffer's layout names its memory; a signature's shape names none
      seen.add(" (host)" if _HOST in layout else "")
    sizes[shape] = size
  sizes = {shape + space: size for shape, size in sizes.items()
           for space in (spaces[shape] or {""})}
  top = sorted(sizes, key=lambda s: (-sizes[s], s))[:n]
  return [f"{s} {sizes[s] / GIB:.2f} GiB" for s in top]


def _stablehlo_shapes(lowered) -> str:
  """The array types of a lowered program's text (`tensor<32768x128256xf32>`) in the
  compiled text's spelling (`f32[32768,128256]`), for `_largest`."""
  names = {"i1": "pred", "i8": "s8", "i16": "s16", "i32": "s32", "i64": "s64", "ui8": "u8",
           "ui32": "u32", "bf16": "bf16", "f16": "f16", "f32": "f32", "f64": "f64"}
  found = re.findall(r"tensor<((?:\d+x)+)(\w+)>", lowered.as_text())
  return " ".join(f"{names[t]}[{dims[:-1].replace('x', ',')}]" for dims, t in set(found)
                  if t in names)


def _table(r: Result) -> str:
  b = r.per_device_bytes
  rows = [("target", f"{r.target}: {r.devices} devices"),
          ("mesh", ", ".join(f"{k} {v}" for k, v in r.mesh.items()) + f" ({r.physical_axes})"),
          ("seq_len", str(r.seq_len))]
  if b:
    rows.append(("per device", ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in b.items())))
  rows += [("usable HBM", f"{r.hbm_bytes / GIB:.2f} GiB per device; margin {MARGIN:.0%}"),
           ("fits", "yes" if r.fits else "no" + (f" ({r.error})" if r.error else "")),
           ("kernels", ", ".join(f"{k} x{v}" for k, v in r.kernels.items()) or "none"),
           ("collectives", ", ".join(f"{k} x{v['count']} {v['bytes'] / GIB:.2f} GiB"
                                     for k, v in r.collectives.items()) or "none"),
           ("exposed", _exposed(r.collectives)),
           ("xla flags", r.xla_flags or "none"),
           ("compile", f"{r.compile_s:.1f} s")]
  rows += [("warning", w) for w in r.warnings]
  return "\n".join(f"{k:12s} {v}" for k, v in rows)


def _exposed(collectives: dict) -> str:
  """The collective bytes nothing computed beside, of all, per device and step."""
  moved = sum(v["bytes"] for v in collectives.values())
  exposed = sum(v["exposed_bytes"] for v in collectives.values())
  if not moved:
    return "none"
  return (f"{exposed / GIB:.2f} of {moved / GIB:.2f} GiB of collectives with no compute beside"
          f" them ({1 - exposed / moved:.1%} overlapped)")


def _load(path, overrides):
  """The config of `path` with `overrides`, `init_from`'s model read where it exists here."""
  import pathlib

  from train import config, init_from
  cfg = config.load(path, overrides)
  if cfg.init_from and pathlib.Path(cfg.init_from).exists():
    cfg = init_from.resolve(cfg, config.set_keys(path, overrides))
  return cfg


def fit_seq_len(path, overrides, target, report) -> int | None:
  """The longest seq_len that fits (see the module docstring), or None if not even the
  shortest power of two tried does; `report(result)` after each compile."""
  from train.config import ConfigError

  def fits(n: int) -> bool | None:
    """Whether seq_len `n` fits; None: the mesh cannot split it."""
    try:
      r = compile_step(_load(path, [*overrides, f"seq_len={n}", f"model.max_seq_len={n}"]),
                       target)
    except (BadInput, ConfigError) as e:
      if "split" in str(e) or "multiple" in str(e):
        return None
      raise
    report(r)
    return r.fits

  start = _load(path, overrides).seq_len
  n = 1 << (start.bit_length() - 1)
  if fits(n):
    while fits(2 * n):
      n *= 2
    best, above = n, 2 * n
  else:
    while n > 1024 and not fits(n // 2):
      n //= 2
    if n <= 1024:
      return None
    best, above = n // 2, n
  middle = (best + above) // 2
  if fits(middle):
    best = middle
  return best


def main(argv: list[str]) -> int:
  doc = __doc__ or ""
  parser = argparse.ArgumentParser(
      prog="python -m train.compile", description=doc.split("\n\n")[0],
      epilog=doc.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("config", nargs="?", help="YAML config (as python -m train)")
  parser.add_argument("overrides", nargs="*", help="key=value overrides")
  parser.add_argument("--target", required=True, help="v5e-N, v5p-N, v6e-N, [Nx]h100, ...")
  parser.add_argument("--hosts", type=int, default=1, help="GPU hosts (default 1)")
  parser.add_argument("--json", action="store_true", help="one JSON line")
  parser.add_argument("--fit", choices=["seq_len"], help="search the longest seq_len that fits")
  args = parser.parse_args(argv)
  path, overrides = args.config, list(args.overrides)
  if path is not None and "=" in path:
    path, overrides = None, [path, *overrides]
  # This host's own chips take no part: compile-only devices need no local backend.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from flaxattn import aot
  from train.config import ConfigError
  try:
    target = aot.target(args.target, args.hosts)
    if _load(path, overrides).overlap_flags:  # before the compiler starts: read once
      from train import xla_flags
      xla_flags.apply([target.platform])
    if args.fit:
      def report(r: Result):
        print(json.dumps(dataclasses.asdict(r)) if args.json else r.summary()
              + f" ({r.compile_s:.0f} s)", flush=True)
      best = fit_seq_len(path, overrides, target, report)
      line = {"target": target.name, "longest_seq_len": best}
      print(json.dumps(line) if args.json else f"longest seq_len that fits {target.name}:"
            f" {best if best else 'none of those tried'}")
      return 0 if best else 1
    result = compile_step(_load(path, overrides), target)
  except (ValueError, ConfigError, BadInput) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(dataclasses.asdict(result)))
  else:
    print(_table(result) if result.fits else result.summary())
  return 0 if result.fits else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
