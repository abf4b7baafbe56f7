"""`python -m train.compile CONFIG [key=value ...] --target TARGET`: whether a run fits a
TPU slice or NVIDIA GPUs, answered from any host by the target's own compiler.

  python -m train.compile configs/tpu_v5p_8b.yaml --target v5p-128
  python -m train.compile configs/gpu_8x_8b.yaml --target 8xh100 --json
  python -m train.compile configs/gpu_demo.yaml --target h100 --fit seq_len
  python -m train.compile configs/tpu_v5p_8b_cp64.yaml --target v5p-128 \
      --compare context_parallel.strategy=ring,all_gather

The trainer's step (`train.state.train_step` on the state and batch `python -m train` builds:
`train.mesh.make`, `train.state.abstract_state`, `train.data.abstract_batch`) is compiled
for TARGET's compile-only devices (`flaxattn.aot`), and XLA's memory plan per device is
reported with what the target lets a program use. No chip and no data are needed: libtpu
compiles for TPU (Mosaic kernels included), the CUDA plugin and ptxas for NVIDIA
(`pip install "flaxattn[aot]"`). One answer is one compile: 90 to 310 s for an 8B model on
a 2-core host.

TARGET: `v5e-N`, `v6e-N` (N chips), `v5p-N` (N TensorCores, 2 per chip: v5p-128 is 64
chips), or `h100`, `h200`, `a100-80g` with an optional count per host (`8xh100`) and
`--hosts M`. v4 is refused (`flaxattn.aot.REFUSED`).

The model is the one `python -m train` would train: with `init_from`, its checkpoint's
config (or, resuming, the run_dir's) read as the trainer reads it. Where `init_from` is not
on this host, the config's `model.*` keys (which the trainer requires to give the
checkpoint's parameters), refused naming `init_from` when they give LlamaConfig's
defaults; `--model_config PATH` (a copy of the checkpoint's config.json, or a directory
holding one) adds what the trainer takes from it: the options the config does not set and
the check of the sizes. The report names the model and where it came from.

Reported (a table, or one JSON line with --json):
  per_device_bytes  arguments (parameters, optimizer state, batch), temporaries, outputs,
                    aliased (outputs written over the donated state) and total = arguments +
                    temporaries + outputs - aliased, as XLA's memory plan gives them;
                    peak, the compiler's own most-bytes-live figure (arguments included; on
                    TPU the 8B example's is well below total; fit is judged on total:
                    flaxattn.aot.Memory); host_temporaries, in the host's memory (remat
                    "offload"), not in total;
  hbm_bytes         what a program may use: on TPU the HBM less the runtime's reserve, on
                    GPU JAX's preallocated fraction (0.75, or XLA_CLIENT_MEM_FRACTION /
                    XLA_PYTHON_CLIENT_MEM_FRACTION in (0, 1]; all of it with
                    XLA_PYTHON_CLIENT_ALLOCATOR=platform: `flaxattn.aot.gpu_mem_fraction`);
  fits              total + MARGIN x hbm_bytes <= hbm_bytes;
  model, kernels, the mesh and the physical axes each mesh axis spans, compile_s, warnings
  (the partitioner's rematerializations; cuDNN workspaces, which the plan omits);
  collectives       {kind: {count, bytes, exposed_bytes}} per device and step, read from
                    the compiler's schedule (`flaxattn.aot.collectives`): executions,
                    result bytes, and the bytes of those with nothing computed between
                    their start and their done;
  xla_flags         the compiler flags it compiled with: the platform's overlap flags
                    (`train.xla_flags`, as `python -m train` sets them; config key
                    overlap_flags) added to the environment's;
  estimate          a roofline estimate of the step (`flaxattn.aot.estimate`: step_s,
                    compute_s, memory_s, comm_s, exposed_comm_s, mfu, tokens_per_s,
                    flops, model_flops, hbm_bytes, bound) from the compiled program and
                    the chip's published peaks: the step's FLOPs at peak, its HBM traffic
                    at the memory bandwidth, its collectives at the links' bandwidth, the
                    exposed ones added. A lower bound, not a measurement: kernels at peak
                    whatever their size, no launch or host costs, no imbalance
                    (docs/design.md, "The step estimate");
  choice            with context_parallel.strategy auto: the strategy chosen as the
                    trainer chooses it (`train.strategy`: each strategy the mesh runs
                    compiled, the lowest step_s), why, and each one's estimate; the
                    report is the chosen one's.

The environment: JAX_PLATFORMS must be unset or cpu (it is set to cpu); JAX's GPU client
variables (XLA_CLIENT_MEM_FRACTION, XLA_PYTHON_CLIENT_*) are checked as JAX would read them
for a GPU target; XLA_FLAGS, and for TPU LIBTPU_INIT_ARGS and TPU_*, are tried in a child
process first where set (native code ends a process on a flag it does not know); JAX's own
options (JAX_ENABLE_X64, ...) are read by JAX. A value any of them refuses is exit status 2,
one line naming it. What the CUDA plugin and libtpu print on a host without their chip
(no driver, no TPU VM metadata) is left out of stderr.

Exit status: 0 fits; 1 does not fit (one line: total, HBM, the largest arrays; the
compiler's own out-of-memory refusal counts); 2 bad input (config, target, a mesh the target
cannot hold, an environment variable, the compiler not installed: the extra to install; a
step the compiler refuses for another reason than memory, with the variables set that
change the program).

--compare SPEC (repeatable): one compile and one row (with --json one JSON line, its
"alternative" the overrides) per alternative: `key=a,b,c` is one per value, several
`key=value` items in quotes one together (`--compare "mesh.context=16 mesh.context_ring=4
context_parallel.strategy=ulysses"`); exit status 0 when every one fits, else 1.

--fit seq_len: the longest seq_len that fits (model.max_seq_len raised with it), among the
lengths the mesh splits (multiples of `train.mesh.seq_multiple`: 1, or e.g. 3 for a context
axis of 3): the config's rounded down to that multiple times a power of two, doubled or
halved (not below 1024), then once between the last that fits and the first that does
not, each compile reported as it finishes. A config error is exit status 2, as without
--fit.
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
  model: str
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
  estimate: dict = dataclasses.field(default_factory=dict)
  choice: dict | None = None

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


def compile_step(cfg, target, model: str = "the config's model.* keys") -> Result:
  """Compiles `cfg`'s train step for `target` (`flaxattn.aot.Target`) and reads its plan;
  `model` says where `cfg.model` came from (`load`), for the report.

  Raises:
    BadInput: the compiler is missing or does not start with the environment, or refuses
      the step for another reason than memory.
    ConfigError: the config does not fit the target's devices (its `keys` name the keys).
  """
  import jax

  from flaxattn import aot, cudnn
  from train import mesh as mesh_lib
  from train import xla_flags
  from train.config import ConfigError

  try:
    with _native_stderr():  # the compiler's start
      devices = aot.devices(target)
    hbm = target.hbm_bytes()
  except (aot.MissingCompiler, ValueError) as e:
    raise BadInput(str(e)) from None
  try:
    parallel = mesh_lib.make(cfg, devices)
  except ConfigError as e:
    raise ConfigError(f"config error for {target.name} ({target.devices} devices): {e}",
                      e.keys) from None
  mesh = parallel.mesh
  begin = time.perf_counter()
  substituted = _Collect()
  logging.getLogger("flaxattn").addHandler(substituted)
  try:
    with _native_stderr(echo=False) as log, jax.set_mesh(mesh):
      lowered = lower_step(cfg, parallel)
      try:
        compiled, refusal = lowered.compile(), None
      except Exception as e:  # Pallas re-raises the compiler's error as its own
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "RESOURCE_EXHAUSTED" in said:
          compiled, refusal = None, said
        elif isinstance(e, jax.errors.JaxRuntimeError) or isinstance(
            e.__cause__, jax.errors.JaxRuntimeError):
          raise BadInput(f"the {target.name} compiler refuses the step: {said}"
                         + _program_environment()) from None
        else:
          raise
  finally:
    logging.getLogger("flaxattn").removeHandler(substituted)
  seconds = time.perf_counter() - begin
  # The registry's kernel substitutions (a GPU kernel that cannot be traced on this host),
  # then the partitioner's rematerializations.
  warnings = sorted(set(substituted.messages)) + sorted(set(_REMAT.findall("".join(log))))
  if compiled is None:
    plan, text, fits, estimate = {}, "", False, {}
    # The refusal names no buffers: the program's arrays before partitioning instead.
    largest = [f"{a} (global)" for a in _largest(_stablehlo_shapes(lowered))]
  else:
    memory = aot.memory(compiled)
    plan, text = memory.as_dict(), compiled.as_text() or ""
    fits, largest = memory.total + MARGIN * hbm <= hbm, _largest(text)
    estimate = dataclasses.asdict(step_estimate(cfg, text, target.chip, mesh))
  kernels = aot.kernels(text)
  missing = cudnn.missing_here() if target.platform == "gpu" else None
  if missing:
    warnings.append(missing)
  if any(k.startswith("__cudnn") for k in kernels):
    warnings.append("cuDNN calls: their workspace is not in the plan (a deviceless compile"
                    " does not size it); measure on the GPU.")
  return Result(target=target.name, devices=target.devices, mesh=dict(mesh.shape),
                physical_axes=mesh_lib.describe_axes(mesh), seq_len=cfg.seq_len,
                model=f"{_shape(cfg.model)}, from {model}",
                per_device_bytes=plan, hbm_bytes=hbm, fits=fits, kernels=kernels,
                collectives=aot.collectives(text),
                xla_flags=os.environ.get(xla_flags.TABLE[target.platform][0], ""),
                compile_s=seconds, warnings=warnings,
                largest=largest,
                error=refusal and refusal[refusal.find("RESOURCE_EXHAUSTED"):].rstrip("."),
                estimate=estimate)


def lower_step(cfg, parallel):
  """The trainer's step (`train.state.train_step`) of run `cfg` lowered on `parallel`
  (`train.mesh.make`), on the state and batch `python -m train` builds
  (`train.state.abstract_state`, `train.data.abstract_batch`): shapes only, no memory."""
  from flax import nnx

  from train import data, state

  with nnx.logical_axis_rules(parallel.rules):
    _, graphdef, abstract = state.abstract_state(cfg, parallel.mesh, parallel.cp)
    batch = data.abstract_batch(parallel.mesh, cfg.batch_size, cfg.seq_len)
    return state.train_step.lower(nnx.merge(graphdef, abstract), batch)


def estimate_on(cfg, devices, chip):
  """The estimate (`step_estimate`) of run `cfg`'s step compiled for `devices` (this
  process's own, of `chip`), or None when its plan does not fit their memory (`MARGIN`
  kept, as `compile_step` judges it). What the trainer's `strategy: auto` compiles.

  Raises:
    ConfigError: as `train.mesh.make`.
  """
  import jax

  from flaxattn import aot
  from train import mesh as mesh_lib

  parallel = mesh_lib.make(cfg, devices)
  with jax.set_mesh(parallel.mesh):
    lowered = lower_step(cfg, parallel)
    try:
      compiled = lowered.compile()
    except Exception as e:
      if "RESOURCE_EXHAUSTED" in str(e):
        return None
      raise
  hbm = aot.Target(chip.name, chip, len(devices), "").hbm_bytes()
  if aot.memory(compiled).total + MARGIN * hbm > hbm:
    return None
  return step_estimate(cfg, compiled.as_text() or "", chip, parallel.mesh)


def step_estimate(cfg, text: str, chip, mesh):
  """`flaxattn.aot.estimate` of run `cfg`'s compiled step (`text`) on `mesh` of `chip`: its
  FLOPs counted from the model (`models.llama.step_flops_per_token`, each row one causal
  document), its memory traffic and collectives read from the program."""
  from flaxattn import aot
  from models.llama import flops_per_token, step_flops_per_token

  tokens = cfg.batch_size * cfg.seq_len
  return aot.estimate(text, chip, list(mesh.devices.flat),
                      flops=step_flops_per_token(cfg.model, cfg.seq_len) * tokens,
                      model_flops=flops_per_token(cfg.model, cfg.seq_len) * tokens,
                      tokens=tokens)


def compile_run(cfg, target, model: str = "the config's model.* keys") -> Result:
  """`compile_step`, with `context_parallel.strategy: auto` chosen as the trainer chooses it
  (`train.strategy.choose`): the step compiled once per strategy the mesh runs, the
  fastest estimate's `Result` returned with `choice` (the strategy, why, and each
  alternative's estimate; an alternative that does not fit has none). Where none fits,
  the first alternative's `Result`, its `choice` saying so.

  Raises:
    as `compile_step`.
  """
  from train import strategy
  from train.config import ConfigError

  if not strategy.needed(cfg):
    return compile_step(cfg, target, model)
  results: dict[str, Result] = {}

  def seconds(c) -> float | None:
    r = results[c.context_parallel.strategy] = compile_step(c, target, model)
    return r.estimate["step_s"] if r.fits else None

  try:
    choice = strategy.choose(cfg, target.devices, seconds)
  except ConfigError:
    if not results:  # no strategy runs on this mesh: a config error
      raise
    first = next(iter(results.values()))
    first.choice = {"strategy": None, "by": "compile", "alternatives": {
        s: r.estimate for s, r in results.items()}, "reason": "no strategy fits"}
    return first
  chosen = results.get(choice.strategy) or compile_step(
      strategy.with_strategy(cfg, choice.strategy), target, model)
  chosen.choice = {"strategy": choice.strategy, "by": choice.by, "reason": choice.reason,
                   "alternatives": {s: (r.estimate if r.fits else {})
                                    for s, r in results.items()}}
  return chosen


def alternatives(specs: list[str]) -> list[list[str]]:
  """The alternatives of `--compare` SPECs, each a list of key=value overrides: a SPEC is
  key=value items separated by spaces, one alternative, or one per value where an item's
  value lists several with commas (`context_parallel.strategy=ring,all_gather`; several
  such items: every combination).

  Raises:
    BadInput: an item that is not key=value.
  """
  found = []
  for spec in specs:
    combos: list[list[str]] = [[]]
    for item in spec.split():
      key, sep, values = item.partition("=")
      if not sep or not key or not values:
        raise BadInput(f"--compare expects key=value[,value...] items, got {item!r} in"
                       f" {spec!r}; e.g. --compare context_parallel.strategy=ring,all_gather.")
      combos = [[*c, f"{key}={v}"] for c in combos for v in values.split(",")]
    found += combos
  return found


def _compare_row(label: str, r: Result) -> str:
  e, total = r.estimate, r.per_device_bytes.get("total")
  size = "-" if total is None else f"{total / GIB:.2f}"
  if not e:
    return f"| {label} | {'yes' if r.fits else 'no'} | {size} |" + " - |" * 7 + \
        f" {r.compile_s:.0f} |"
  return (f"| {label} | {'yes' if r.fits else 'no'} | {size} | {e['step_s']:.4g} |"
          f" {e['compute_s']:.4g} | {e['memory_s']:.4g} | {e['exposed_comm_s']:.4g} |"
          f" {e['comm_s']:.4g} | {e['mfu']:.1%} | {e['tokens_per_s']:,.0f} | {r.compile_s:.0f} |")


COMPARE_HEADER = ("| alternative | fits | total GiB | step s | compute s | memory s | exposed s"
                  " | collectives s | MFU | tokens/s | compile s |\n|" + "---|" * 11)


class _Collect(logging.Handler):
  """Keeps the messages of warnings logged while it is attached."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


# What native code writes to stderr that tells a user of compile-only devices nothing: the
# CUDA plugin's missing driver (at JAX's import), libtpu's missing TPU VM metadata
# (accelerator type, worker hostnames) and the trace of that complaint.
NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|WARNING: Logging before InitGoogle\(\) is written to STDERR"
    r"|cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"
    r"|could not determine TPU (accelerator type|worker hostnames)"
    r"|^=== Source Location Trace: ===\s*$"
    r"|^\S*libtpu_init_utils\.cc:\d+\s*$")


@contextlib.contextmanager
def _native_stderr(echo: bool = True):
  """Holds back what is written to the process's stderr (fd 2, where XLA, libtpu and the
  CUDA plugin log) in the block; yields a list that holds the text afterwards. With `echo`,
  the lines that are not `NOISE` are then written to stderr, also when the block raises.
  A process that native code ends inside the block loses what it wrote there
  (`flaxattn.aot.check_native_flags` starts such code in a child first)."""
  sys.stderr.flush()
  saved, captured = os.dup(2), []
  with tempfile.TemporaryFile("w+", errors="replace") as f:
    os.dup2(f.fileno(), 2)
    try:
      yield captured
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      f.seek(0)
      captured.append(f.read())
      kept = [line for line in captured[0].splitlines(keepends=True) if not NOISE.search(line)]
      if echo and kept:
        sys.stderr.write("".join(kept))
        sys.stderr.flush()


def _program_environment() -> str:
  """The environment variables set that change the program or its compiler (JAX's
  options, XLA's and libtpu's flags), as the tail of an error; "" when none is."""
  found = {k: v for k, v in sorted(os.environ.items())
           if v and (k.startswith("JAX_") and k != "JAX_PLATFORMS"
                     or k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"))}
  return (f" (with {', '.join(f'{k}={v!r}' for k, v in found.items())} set in the"
          " environment)" if found else "")


def _shape(m) -> str:
  """The model's size in a few words (`models.llama.LlamaConfig` `m`)."""
  return (f"dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads ({m.n_kv_heads} K/V), ffn"
          f" {m.ffn_dim}, vocab {m.vocab_size}")


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
          ("model", r.model), ("seq_len", str(r.seq_len))]
  if b:
    rows.append(("per device", ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in b.items())))
  rows += [("usable HBM", f"{r.hbm_bytes / GIB:.2f} GiB per device; margin {MARGIN:.0%}"),
           ("fits", "yes" if r.fits else "no" + (f" ({r.error})" if r.error else "")),
           ("kernels", ", ".join(f"{k} x{v}" for k, v in r.kernels.items()) or "none"),
           ("collectives", ", ".join(f"{k} x{v['count']} {v['bytes'] / GIB:.2f} GiB"
                                     for k, v in r.collectives.items()) or "none"),
           ("exposed", _exposed(r.collectives)),
           ("estimate", _estimate_line(r.estimate)),
           ("xla flags", r.xla_flags or "none"),
           ("compile", f"{r.compile_s:.1f} s")]
  if r.choice:
    rows.append(("auto", f"{r.choice['strategy']}: {r.choice['reason']}"))
  rows += [("warning", w) for w in r.warnings]
  return "\n".join(f"{k:12s} {v}" for k, v in rows)


def _estimate_line(e: dict) -> str:
  """The estimate in one line, named for what it is."""
  if not e:
    return "none (not compiled)"
  return (f"step {e['step_s']:.4g} s ({e['bound']} bound): compute {e['compute_s']:.4g} s,"
          f" memory {e['memory_s']:.4g} s, exposed collectives {e['exposed_comm_s']:.4g} s of"
          f" {e['comm_s']:.4g} s; MFU {e['mfu']:.1%}, {e['tokens_per_s']:,.0f} tokens/s"
          " (a roofline from the chip's published peaks: a lower bound on the step time)")


def _exposed(collectives: dict) -> str:
  """The collective bytes nothing computed beside, of all, per device and step."""
  moved = sum(v["bytes"] for v in collectives.values())
  exposed = sum(v["exposed_bytes"] for v in collectives.values())
  if not moved:
    return "none"
  return (f"{exposed / GIB:.2f} of {moved / GIB:.2f} GiB of collectives with no compute beside"
          f" them ({1 - exposed / moved:.1%} overlapped)")


def load(path, overrides, model_config: str | None = None):
  """The config of `path` with `overrides`, its model the one `python -m train` would train,
  and where that model comes from: `init_from`'s (or, resuming, the run_dir's) where it is
  on this host, read as the trainer reads it; else `model_config`, a copy of init_from's
  config.json (`init_from.resolve_from_copy`); else the config's `model.*` keys, when
  they give another model than `LlamaConfig`'s defaults (the trainer refuses keys that
  are not the checkpoint's).

  Raises:
    ConfigError: as `train.config.load` and `train.init_from.resolve`; `init_from` not on
      this host with neither `model_config` nor model keys (keys ("init_from",)), or
      `model_config` where init_from is not used or is on this host.
  """
  from models.llama import LlamaConfig, param_changes
  from train import config, init_from, storage
  from train.config import ConfigError

  cfg = config.load(path, overrides)
  keys = config.set_keys(path, overrides)
  source = cfg.init_from
  if not source:
    if model_config:
      raise ConfigError(f"--model_config ({model_config!r}) expects a config with init_from (it"
                        " stands for init_from's config.json), got init_from=''; drop it.",
                        ("init_from",))
    return cfg, "the config's model.* keys"
  here = (f"run_dir {cfg.run_dir!r} (resuming)" if init_from.resuming(cfg) else
          f"init_from {source!r}" if storage.path(source).exists() else None)
  if here and model_config:
    raise ConfigError(f"--model_config ({model_config!r}) stands for init_from's config.json"
                      f" where init_from is not on this host, but the model is read from {here};"
                      " drop --model_config.", ("init_from",))
  if here:
    return init_from.resolve(cfg, keys), here
  if model_config:
    return (init_from.resolve_from_copy(cfg, model_config, keys),
            f"--model_config {model_config!r} (init_from {source!r} is not on this host)")
  if not param_changes(LlamaConfig(), cfg.model):
    raise ConfigError(
        f"config key 'init_from' ({source!r}) is not on this host, and the config's model.*"
        " keys give LlamaConfig's defaults, not the checkpoint's model: pass --model_config"
        " with a copy of the checkpoint's config.json, or set its model.* keys (model.dim,"
        " model.n_layers, model.n_heads, model.n_kv_heads, model.ffn_dim, model.vocab_size).",
        ("init_from",))
  return cfg, (f"the config's model.* keys (init_from {source!r} is not on this host;"
               " python -m train checks them against it)")


def fit_seq_len(path, overrides, target, report, model_config: str | None = None) -> int | None:
  """The longest seq_len that fits (see the module docstring), or None if not even the
  shortest length tried does; `report(result)` after each compile.

  Raises:
    ConfigError, BadInput: as `compile_step`, for any config error but a length refused
      alone (keys ("seq_len",)), which is skipped.
  """
  from train import mesh as mesh_lib
  from train.config import ConfigError

  def fits(n: int) -> bool | None:
    """Whether seq_len `n` fits; None: the config check refuses this length."""
    try:
      cfg, model = load(path, [*overrides, f"seq_len={n}", f"model.max_seq_len={n}"],
                        model_config)
      r = compile_step(cfg, target, model)
    except ConfigError as e:
      if e.keys == ("seq_len",):
        return None
      raise
    report(r)
    return r.fits

  start = load(path, overrides, model_config)[0]
  # The lengths the mesh splits: multiples of `unit`, the config's rounded down to `unit`
  # times a power of two, doubled or halved (down to 1024 or `unit`), then one between.
  unit = mesh_lib.seq_multiple(start, target.devices)

  def half(n: int) -> int:
    return n // 2 // unit * unit

  n = unit << max(0, (start.seq_len // unit).bit_length() - 1)
  if fits(n):
    while fits(2 * n):
      n *= 2
    best, above = n, 2 * n
  else:
    while half(n) >= max(1024, unit) and not fits(half(n)):
      n = half(n)
    if half(n) < max(1024, unit):
      return None
    best, above = half(n), n
  middle = (best + above) // 2 // unit * unit
  if middle > best and fits(middle):
    best = middle
  return best


def main(argv: list[str]) -> int:
  doc = __doc__ or ""
  parser = argparse.ArgumentParser(
      prog="python -m train.compile", description=doc.split("\n\n")[0],
      epilog=doc.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("config", nargs="?", help="YAML config (as python -m train)")
  parser.add_argument("overrides", nargs="*",
                      help="key=value overrides, before or after the options")
  parser.add_argument("--target", required=True, help="v5e-N, v5p-N, v6e-N, [Nx]h100, ...")
  parser.add_argument("--hosts", type=int, default=1, help="GPU hosts (default 1)")
  parser.add_argument("--json", action="store_true", help="one JSON line")
  parser.add_argument("--fit", choices=["seq_len"], help="search the longest seq_len that fits")
  parser.add_argument("--compare", action="append", metavar="SPEC", default=[],
                      help="compile one alternative per value, a row each: key=a,b,c, or"
                      " several key=value items in quotes; may repeat")
  parser.add_argument("--model_config", metavar="PATH",
                      help="init_from's config.json (or a directory holding it) when init_from"
                      " is not on this host")
  args = parser.parse_intermixed_args(argv)  # key=value before or after the options
  path, overrides = args.config, list(args.overrides)
  if path is not None and "=" in path:
    path, overrides = None, [path, *overrides]
  # This host's own chips take no part: compile-only devices need no local backend (and
  # the CUDA plugin makes its compile-only devices only beside the CPU backend). JAX reads
  # the variable when it is imported.
  platforms = os.environ.get("JAX_PLATFORMS", "").strip()
  if not platforms:
    os.environ["JAX_PLATFORMS"] = "cpu"
  try:
    with _native_stderr():  # JAX's first import loads the compilers' plugins
      from flaxattn import aot
      from train.config import ConfigError
  except ValueError as e:  # a JAX option's environment variable (JAX_ENABLE_X64=maybe)
    print(f"error: {e}{_program_environment()}; JAX reads its options' variables when"
          " imported: fix or unset it.", file=sys.stderr)
    return 2
  try:
    target = aot.target(args.target, args.hosts)
    if platforms not in ("", "cpu"):
      raise BadInput(f"environment variable JAX_PLATFORMS expects cpu or nothing for"
                     f" train.compile (compile-only devices need no local backend), got"
                     f" {platforms!r}; unset it.")
    cfg, model = load(path, overrides, args.model_config)
    if cfg.overlap_flags:  # before the compiler starts: XLA reads them once
      from train import xla_flags
      if not aot.missing_package(target.platform):  # else devices() names the extra
        aot.check_native_flags(target)  # the user's own flags, before the table's join them
      xla_flags.apply([target.platform], offload=cfg.model.remat == "offload")
    if args.fit:
      def report(r: Result):
        print(json.dumps(dataclasses.asdict(r)) if args.json else r.summary()
              + f" ({r.compile_s:.0f} s)", flush=True)
      best = fit_seq_len(path, overrides, target, report, args.model_config)
      line = {"target": target.name, "longest_seq_len": best}
      print(json.dumps(line) if args.json else f"longest seq_len that fits {target.name}:"
            f" {best if best else 'none of those tried'}")
      return 0 if best else 1
    if args.compare:
      return _compare(path, overrides, target, alternatives(args.compare), args)
    result = compile_run(cfg, target, model)
  except (ValueError, ConfigError, BadInput) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(dataclasses.asdict(result)))
  else:
    print(_table(result) if result.fits else result.summary())
  return 0 if result.fits else 1


def _compare(path, overrides, target, alts: list[list[str]], args) -> int:
  """Compiles each alternative (`compile_run`) and prints a row (or a JSON line) each, as it
  finishes; 0 when every one fits.

  Raises:
    ConfigError, BadInput: as `load` and `compile_step`, for any alternative.
  """
  if not args.json:
    print(COMPARE_HEADER, flush=True)
  fits = True
  for alt in alts:
    cfg, model = load(path, [*overrides, *alt], args.model_config)
    r = compile_run(cfg, target, model)
    label = " ".join(alt)
    fits = fits and r.fits
    print(json.dumps({"alternative": label, **dataclasses.asdict(r)}) if args.json
          else _compare_row(label, r), flush=True)
  return 0 if fits else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
