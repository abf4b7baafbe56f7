"""Compile-only devices of chips this host does not have: Cloud TPU slices and NVIDIA GPUs.

  devs = flaxattn.aot.devices(flaxattn.aot.target("v5p-128"))   # 64 compile-only TPU v5p
  mesh = jax.make_mesh((64,), ("fsdp",), devices=devs)
  compiled = jax.jit(f).lower(*abstract_args).compile()         # the real TPU compiler
  flaxattn.aot.memory(compiled)                                 # its per-device plan

`jax.jit(...).lower(...).compile()` over a mesh of these devices runs the target's own
compiler (libtpu for TPU, Mosaic included; XLA's GPU compiler with its Triton for NVIDIA)
on this host, without the chip. TPU needs libtpu (`pip install "flaxattn[aot]"` or
`"jax[tpu]"`), NVIDIA the CUDA 12 plugin (`jax-cuda12-plugin` with XLA's ptxas); run the
process with `JAX_PLATFORMS=cpu` so neither looks for a local chip.

TARGETS is the one table of targets: Cloud TPU accelerator types (`v5e-N`, `v6e-N`: N
chips; `v5p-N`: N TensorCores, two per chip) and NVIDIA GPUs (`h100`, `h200`, `a100-80g`,
with `8xh100` for eight per host), each with its memory per device and what a program may
use of it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import importlib.util
import math
import os
import re
import subprocess
import sys

GIB = 2**30
# The extra that installs both compilers (pyproject.toml).
EXTRA = "flaxattn[aot]"
# JAX preallocates this fraction of a GPU's memory for its arrays unless
# XLA_CLIENT_MEM_FRACTION (old name XLA_PYTHON_CLIENT_MEM_FRACTION) says otherwise (JAX's GPU
# memory allocation docs).
GPU_MEM_FRACTION = 0.75
MEM_FRACTION = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
# The other variables JAX's GPU client reads (jaxlib's `generate_pjrt_gpu_plugin_options`),
# also for compile-only GPU devices: a value it cannot parse ends in a traceback about the
# topology, one it misreads ("no" is true) goes unnoticed. Each: whether a value is good,
# and what is expected.
_GPU_CLIENT = {
    "XLA_PYTHON_CLIENT_ALLOCATOR": (
        lambda v: v.lower() in ("default", "platform", "bfc", "cuda_async", "vmm"),
        "one of default, platform, bfc, cuda_async, vmm"),
    "XLA_PYTHON_CLIENT_PREALLOCATE": (
        lambda v: v in ("true", "false", "True", "False", "1", "0"),
        "true or false (JAX reads any value but false, False and 0 as true)"),
    "XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB": (
        lambda v: v.strip().isdigit(), "a whole number of MiB >= 0"),
    "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": (lambda v: v.strip() in ("0", "1"), "0 or 1"),
    "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": (lambda v: v.strip() in ("0", "1"), "0 or 1"),
}


@dataclasses.dataclass(frozen=True)
class Chip:
  """One kind of accelerator.

  platform: "tpu" or "gpu". hbm_bytes: its memory per device. available_bytes (TPU): what the
  TPU compiler lets a program plan, the rest being the runtime's reserve. count: what N of an
  accelerator type counts ("chips" or "cores" (two per chip, one device per chip)); for GPUs
  "gpus". dims: the torus's dimensions (TPU). config: the GpuTargetConfigProto file (GPU).
  """

  name: str
  platform: str
  hbm_bytes: int
  available_bytes: int | None = None
  count: str = "chips"
  dims: int = 2
  topology_name: str = ""
  config: str = ""
  kind: str = ""  # GPU: the device kind its compile-only devices report
  capability: tuple[int, int] | None = None  # GPU: CUDA compute capability

  @property
  def reserve_bytes(self) -> int:
    """The TPU runtime's share of the memory (0 for GPUs, whose limit is a fraction)."""
    return 0 if self.available_bytes is None else self.hbm_bytes - self.available_bytes


# available_bytes: the "available HBM" in libtpu 0.0.42's RESOURCE_EXHAUSTED refusal of an
# oversized program compiled for one chip of each kind from a CPU host (15.75G, 95.74G,
# 31.25G, in GiB). hbm_bytes: Google Cloud's TPU pages (v5e 16 GiB, v6e 32 GiB per chip; v5p
# is listed as 95 GB, and the compiler's 95.74 GiB available leaves 96 GiB less the 0.25 GiB
# that v5e keeps back) and the GPU target configs' device_memory_size.
TARGETS: dict[str, Chip] = {
    "v5e": Chip("v5e", "tpu", 16 * GIB, int(15.75 * GIB), "chips", 2, "v5e"),
    "v5p": Chip("v5p", "tpu", 96 * GIB, int(95.74 * GIB), "cores", 3, "v5p"),
    "v6e": Chip("v6e", "tpu", 32 * GIB, int(31.25 * GIB), "chips", 2, "v6e"),
    "h100": Chip("h100", "gpu", 84978434048, count="gpus", config="h100.txtpb",
                 kind="NVIDIA H100 80GB HBM3", capability=(9, 0)),
    "h200": Chip("h200", "gpu", 150754820096, count="gpus", config="h200.txtpb",
                 kind="NVIDIA H200", capability=(9, 0)),
    "a100-80g": Chip("a100-80g", "gpu", 85899345920, count="gpus", config="a100-80g.txtpb",
                     kind="NVIDIA A100-SXM4-80GB", capability=(8, 0)),
}
# Refused by name: the compile-only v4 topology has one device per TensorCore (two per chip),
# and JAX's mesh helpers refuse it; a v4 slice runs megacore, one device per chip, so a plan
# per core would be the wrong program with half the memory.
REFUSED = {"v4": "TPU v4 is not a compile target: its compile-only topology has one device per"
                 " TensorCore, while a v4 slice runs one device per chip (megacore), so the"
                 " plan would not be the one the slice runs. Compile for v5p-N (the same"
                 " megacore counting) instead."}


@dataclasses.dataclass(frozen=True)
class Target:
  """A named target: `chip` x `devices`, laid out as `topology` (TPU: "v5p:4x4x4"; GPU:
  "1xHOSTSxPER_HOST")."""

  name: str
  chip: Chip
  devices: int
  topology: str

  @property
  def platform(self) -> str:
    return self.chip.platform

  def hbm_bytes(self, mem_fraction: float | None = None) -> int:
    """The bytes a program may use on one device: on TPU the HBM less the runtime's
    reserve; on GPU `mem_fraction` (default: `gpu_mem_fraction()`, from the environment)
    of the memory.

    Raises:
      ValueError: a GPU target and a variable of JAX's GPU client it cannot use
        (`gpu_mem_fraction`).
    """
    if self.chip.available_bytes is not None:
      return self.chip.available_bytes
    if mem_fraction is None:
      mem_fraction = gpu_mem_fraction()
    return int(self.chip.hbm_bytes * mem_fraction)


def gpu_mem_fraction() -> float:
  """The share of a GPU's memory JAX lets a program use, as the environment sets it:
  XLA_CLIENT_MEM_FRACTION or its old name XLA_PYTHON_CLIENT_MEM_FRACTION (empty: unset),
  else `GPU_MEM_FRACTION`; 1 with XLA_PYTHON_CLIENT_ALLOCATOR=platform, which allocates on
  demand from the whole memory. Checks every variable of JAX's GPU client (`_GPU_CLIENT`).

  Raises:
    ValueError: one line naming the variable, its value and what it expects: a fraction
      that is not a number in (0, 1], both names of it set (JAX refuses that too), or a
      value of another variable that JAX's GPU client refuses or misreads.
  """
  for name, (good, expected) in _GPU_CLIENT.items():
    value = os.environ.get(name, "")
    if value and not good(value):
      raise ValueError(f"environment variable {name} expects {expected}, got {value!r}; fix"
                       " it or unset it.")
  set_ = {n: os.environ[n] for n in MEM_FRACTION if os.environ.get(n)}
  if len(set_) > 1:
    raise ValueError(f"environment variables {' and '.join(f'{n}={v!r}' for n, v in set_.items())}"
                     f" are both set (JAX refuses that); keep {MEM_FRACTION[0]} only.")
  fraction = GPU_MEM_FRACTION
  for name, value in set_.items():
    try:
      fraction = float(value)
    except ValueError:
      fraction = math.nan
    if not 0 < fraction <= 1:  # NaN too
      raise ValueError(f"environment variable {name} expects the share of a GPU's memory JAX"
                       f" may use, a number in (0, 1] (default {GPU_MEM_FRACTION}), got"
                       f" {value!r}; set e.g. {name}=0.9, or unset it.")
  if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
    return 1.0
  return fraction


def gpu_capability(device_kind: str) -> tuple[int, int] | None:
  """The compute capability of a target GPU by its device kind, None for another kind."""
  return next((c.capability for c in TARGETS.values() if c.kind == device_kind), None)


@functools.lru_cache(maxsize=1)
def local_gpu_capability() -> tuple[int, ...] | None:
  """The compute capability of this process's first GPU; None for a GPU that is not CUDA's
  or does not say."""
  import jax
  device = jax.devices("gpu")[0]
  if "cuda" not in device.client.platform_version.lower():
    return None
  capability = getattr(device, "compute_capability", None)
  return tuple(int(x) for x in capability.split(".")) if capability else None


def target_gpu_capability() -> tuple[int, ...] | None:
  """The compute capability of the GPU target named on the mesh in force (an abstract device
  of a kind in `TARGETS`, as `train.compile` sets) when this process has no GPU; else None."""
  import jax
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is None or device.platform != "gpu" or jax.default_backend() == "gpu":
    return None
  return gpu_capability(device.device_kind)


def traced_gpu_capability() -> tuple[int, ...] | None:
  """The compute capability of the NVIDIA GPU a program traced now is for: this process's
  first GPU on a GPU host (`local_gpu_capability`), else `target_gpu_capability`."""
  import jax
  if jax.default_backend() == "gpu":
    return local_gpu_capability()
  return target_gpu_capability()


def names() -> list[str]:
  """How targets are spelled, for messages and `--help`."""
  return ["v5e-N (N chips)", "v5p-N (N cores, 2 per chip)", "v6e-N (N chips)",
          *(f"[Nx]{n}" for n, c in TARGETS.items() if c.platform == "gpu")]


def target(name: str, hosts: int = 1) -> Target:
  """The target `name`: a Cloud TPU accelerator type (`v5e-8`, `v5p-128`, `v6e-256`) or an
  NVIDIA GPU with an optional count per host (`h100`, `8xh100`) over `hosts` hosts.

  TPU slices take Google Cloud's topologies for power-of-two chip counts: `2xK` / `KxK`
  squares and rectangles for v5e and v6e (1x1 to 16x16), and for v5p 2x2x1 doubled along its
  shortest side (v5p-128: 4x4x4).

  Raises:
    ValueError: an unknown name, a count with no topology, `hosts` < 1 or hosts for a TPU
      (a slice's hosts follow from its type), or v4 (`REFUSED`).
  """
  if not isinstance(hosts, int) or hosts < 1:
    raise ValueError(f"hosts expects a positive int, got {hosts!r}.")
  spelled = name.strip().lower()
  gpu = re.fullmatch(r"(?:(\d+)x)?([a-z0-9-]+)", spelled)
  if gpu and gpu.group(2) in TARGETS and TARGETS[gpu.group(2)].platform == "gpu":
    per_host = int(gpu.group(1) or 1)
    if per_host < 1:
      raise ValueError(f"target {name!r} expects at least one GPU per host.")
    return Target(spelled, TARGETS[gpu.group(2)], per_host * hosts, f"1x{hosts}x{per_host}")
  tpu = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", spelled)
  if tpu and tpu.group(1) in REFUSED:
    raise ValueError(f"target {name!r}: {REFUSED[tpu.group(1)]}")
  if not tpu or tpu.group(1) not in TARGETS:
    raise ValueError(f"target expects one of {names()}, got {name!r}.")
  if hosts != 1:
    raise ValueError(f"hosts expects 1 for a TPU slice (its hosts follow from {name!r}), got"
                     f" {hosts}.")
  chip, n = TARGETS[tpu.group(1)], int(tpu.group(2))
  chips = n // 2 if chip.count == "cores" else n
  shape = _torus(chips, chip.dims)
  if shape is None or (chip.count == "cores" and n % 2):
    least, most = _TORUS_CHIPS[chip.dims]
    per_chip = 2 if chip.count == "cores" else 1
    raise ValueError(f"target {name!r}: no {chip.name} slice of {n} {chip.count}; expected a"
                     f" power of two from {least * per_chip} to {most * per_chip} {chip.count},"
                     f" e.g. {chip.name}-{8 * per_chip}.")
  return Target(spelled, chip, chips, f"{chip.topology_name}:{'x'.join(map(str, shape))}")


# The chips of the smallest and the largest slice, by the torus's dimensions.
_TORUS_CHIPS = {2: (1, 256), 3: (4, 2048)}


def _torus(chips: int, dims: int) -> tuple[int, ...] | None:
  """Google Cloud's topology of `chips` (a power of two), or None."""
  least, most = _TORUS_CHIPS[dims]
  if not least <= chips <= most or chips & (chips - 1):
    return None
  if dims == 2:
    side = 1 << (chips.bit_length() - 1) // 2  # 8 -> 2x4, 16 -> 4x4, 128 -> 8x16
    return side, chips // side
  shape = [2, 2, 1]
  while math.prod(shape) < chips:  # 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...
    shape[max(i for i, s in enumerate(shape) if s == min(shape))] *= 2
  return tuple(shape)


def missing_package(platform: str) -> str | None:
  """What to install to compile for `platform` ("tpu" or "gpu") on this host, or None when
  it is there."""
  module, what, extra = {"tpu": ("libtpu", "libtpu (jax[tpu])", "aot-tpu"),
                         "gpu": ("jax_cuda12_plugin", "the CUDA 12 plugin", "aot-cuda")}[platform]
  if importlib.util.find_spec(module) is None:
    return (f"compiling for {platform.upper()} needs {what}: pip install \"{EXTRA}\" (or"
            f" \"flaxattn[{extra}]\" for this platform only).")
  return None


class MissingCompiler(RuntimeError):
  """The target's compiler is not installed here; the message names the extra."""


def devices(t: Target) -> list:
  """The compile-only devices of `t`, in the order of its topology.

  Raises:
    MissingCompiler: libtpu or the CUDA plugin is not installed.
    ValueError: the environment holds a value the compiler cannot start with: a variable
      of JAX's GPU client (`gpu_mem_fraction`), or flags that native code refuses
      (`check_native_flags`); one line naming the variables.
  """
  missing = missing_package(t.platform)
  if missing:
    raise MissingCompiler(missing)
  if t.platform == "gpu":
    gpu_mem_fraction()
  check_native_flags(t)
  return list(_devices(t.platform, t.topology, t.chip.config))


# Platforms whose compile-only topology this process has made: their native code started.
_started: set[str] = set()


@functools.cache
def _devices(platform: str, topology: str, config: str) -> tuple:
  from jax.experimental import topologies
  if platform == "tpu":
    # No chip is opened; without this a second process (a test worker, a compile beside a
    # run) is refused at libtpu's lock file.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # One chip is less than the default host (2x2); its bounds must say so.
    one = {"chips_per_host_bounds": [1, 1, 1]} if topology.endswith(":1x1") else {}
    found = topologies.get_topology_desc(topology_name=topology, platform="tpu", **one).devices
  else:
    text = importlib.resources.files("flaxattn.targets").joinpath(config).read_text()
    name = config.removesuffix(".txtpb")
    found = topologies.get_topology_desc(platform="cuda", topology_name=name, topology=topology,
                                         target_config=text).devices
  _started.add(platform)
  return tuple(found)


# Flags that native code parses once, when it starts, and ends the process on when it cannot
# (XLA's `Unknown flag in XLA_FLAGS`, libtpu's `Unknown command line flag`), by platform:
# XLA's at the first backend, libtpu's (its own flags, and TPU_* that set some of them) at
# the first TPU topology.
_NATIVE_FLAGS = {"": ("XLA_FLAGS",), "tpu": ("LIBTPU_INIT_ARGS", "TPU_")}
# Set by JAX's import on a host without a TPU (and by libtpu's), not by a user.
_SET_BY_JAX = ("TPU_SKIP_MDS_QUERY", "TPU_LIBRARY_PATH")
# A native log line's prefix: severity, date, time, thread, file:line.
_LOG_PREFIX = re.compile(r"^[FEWI]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")
# An error line: XLA's (glog severity E or F) or libtpu's flag parser's.
_ERROR = re.compile(r"^([EF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] |ERROR: )")


def check_native_flags(t: Target) -> None:
  """Refuses flags in the environment that native code would end the process on, with exit
  status 1 and no Python exception: where `_NATIVE_FLAGS` of `t`'s platform are set and
  that code has not started in this process, it starts in a child process first, and its
  first error line becomes the error. Costs a second start of JAX (and libtpu) only then.

  Raises:
    ValueError: one line naming the variables, their values and the compiler's refusal.
  """
  import jax._src.xla_bridge as xla_bridge  # whether XLA read XLA_FLAGS in this process

  names = []
  if not xla_bridge.backends_are_initialized():
    names += _NATIVE_FLAGS[""]
  if t.platform == "tpu" and "tpu" not in _started:
    names += _NATIVE_FLAGS["tpu"]
  found = {k: v for k, v in os.environ.items() if v and k not in _SET_BY_JAX
           and any(k == n or n.endswith("_") and k.startswith(n) for n in names)}
  if not found:
    return
  code = ("import jax; jax.devices(); from flaxattn import aot;"
          f" aot._devices({t.platform!r}, {t.topology!r}, {t.chip.config!r})")
  path = os.pathsep.join(p for p in sys.path if p)
  child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path}, check=False)
  if child.returncode == 0:
    return
  lines = [line for line in child.stderr.splitlines() if line.strip()]
  # The first error is the cause (a "Check failed" and a usage text may follow); libtpu's
  # complaint about the TPU VM metadata a host without TPUs lacks is none.
  errors = [line for line in lines if _ERROR.match(line) and "could not determine TPU" not in line]
  said = (errors or lines or [f"exit status {child.returncode}"])[0 if errors else -1]
  said = _LOG_PREFIX.sub("", said).strip()
  raise ValueError(f"the {t.platform.upper()} compiler does not start with environment"
                   f" {', '.join(f'{k}={v!r}' for k, v in sorted(found.items()))}: {said};"
                   " fix or unset them.")


@dataclasses.dataclass(frozen=True)
class Memory:
  """XLA's memory plan of a compiled program, bytes per device. total = arguments +
  temporaries + outputs - aliased (outputs written over donated arguments). `peak` is the
  compiler's own figure for the most bytes live at once, arguments included: on TPU it can
  be well below total (the 8B example at 128K on v5p-128: 24.27 GiB against 35.06), because
  libtpu's temporaries figure holds more than its dumped buffer assignment; for a small
  program it can be above it (a 1024 x 1024 float32 matmul chain on v5p: peak 12.0 MiB,
  total 10.0 MiB). Which one a chip really allocates is unmeasured here; fit is judged on
  total. `host_temporaries`: temporaries in the host's memory (remat "offload"'s saved
  layer inputs), not counted in total."""

  arguments: int
  temporaries: int
  outputs: int
  aliased: int
  peak: int
  host_temporaries: int = 0

  @property
  def total(self) -> int:
    return self.arguments + self.temporaries + self.outputs - self.aliased

  def as_dict(self) -> dict[str, int]:
    return {**dataclasses.asdict(self), "total": self.total}


def memory(compiled) -> Memory:
  """The per-device plan of `compiled` (a `jax.stages.Compiled`)."""
  m = compiled.memory_analysis()
  return Memory(m.argument_size_in_bytes, m.temp_size_in_bytes, m.output_size_in_bytes,
                m.alias_size_in_bytes, m.peak_memory_in_bytes,
                getattr(m, "host_temp_size_in_bytes", 0) or 0)


# Kernels as a compiled program names them: Pallas TPU calls carry the kernel's name as the
# instruction's (`%splash_mqa_fwd.1 = ... custom_call_target="tpu_custom_call"`), Triton
# calls in their backend config (`name = "flash_forward"`), Mosaic GPU calls in the symbol
# of the module serialized there (`mosaic_forward_mosaic_gpu`), cuDNN calls in their target.
_CUSTOM_CALL = re.compile(r"%([\w.-]+) = [^\n]*?custom_call_target=\"([^\"]+)\"([^\n]*)")
_TRITON_NAME = re.compile(r'\bname = "([^"]+)"')
_MOSAIC_GPU_NAME = re.compile(r"\\00([\w.-]+)_mosaic_gpu\\00")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_COLLECTIVE = re.compile(r"= [^\n=]*? (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def kernels(hlo_text: str) -> dict[str, int]:
  """Each kernel's name in a compiled program's text (`compiled.as_text()`) and how many
  calls to it the program holds: Pallas TPU, Triton and Mosaic GPU kernels by their names,
  cuDNN calls by their custom-call target (`__cudnn$fmha...`)."""
  found: dict[str, int] = {}
  for instruction, call_target, rest in _CUSTOM_CALL.findall(hlo_text):
    if call_target == "tpu_custom_call":
      name = re.sub(r"\.\d+$", "", instruction)
    elif "triton" in call_target:
      named = _TRITON_NAME.search(rest)
      name = named.group(1) if named else call_target
    elif call_target.startswith("mosaic_gpu"):
      # The kernel's symbol comes last, after the module's `stable_mosaic_gpu` version.
      name = ([call_target] + _MOSAIC_GPU_NAME.findall(rest))[-1]
    elif call_target.startswith("__cudnn$fmha"):
      name = call_target
    else:
      continue
    found[name] = found.get(name, 0) + 1
  return found


def collectives(hlo_text: str) -> dict[str, int]:
  """How many collectives of each kind (`COLLECTIVES`) a compiled program's text holds (an
  asynchronous one counts once, at its start)."""
  found: dict[str, int] = {}
  for kind in _COLLECTIVE.findall(hlo_text):
    found[kind] = found.get(kind, 0) + 1
  return found
