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
use of it, and its published peak figures, which `estimate` turns a compiled program into
a roofline step time with.
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

import numpy as np

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

  The published peak figures of one device (chip or GPU), as its vendor states them:
  peak_flops, dense bfloat16 FLOP/s; hbm_bandwidth, bytes/s; ici_bandwidth, the
  interconnect's bytes/s per device counting both directions of every link (TPU ICI,
  NVLink); ici_ports, the links it is spread over (TPU: 2 per torus dimension; GPU: 1, the
  NVLink switch gives any one peer the whole of it).
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
  peak_flops: float = 0.0
  hbm_bandwidth: float = 0.0
  ici_bandwidth: float = 0.0
  ici_ports: int = 1

  @property
  def reserve_bytes(self) -> int:
    """The TPU runtime's share of the memory (0 for GPUs, whose limit is a fraction)."""
    return 0 if self.available_bytes is None else self.hbm_bytes - self.available_bytes


# available_bytes: the "available HBM" in libtpu 0.0.42's RESOURCE_EXHAUSTED refusal of an
# oversized program compiled for one chip of each kind from a CPU host (15.75G, 95.74G,
# 31.25G, in GiB). hbm_bytes: Google Cloud's TPU pages (v5e 16 GiB, v6e 32 GiB per chip; v5p
# is listed as 95 GB, and the compiler's 95.74 GiB available leaves 96 GiB less the 0.25 GiB
# that v5e keeps back) and the GPU target configs' device_memory_size.
# Peak figures, from the vendors' pages: Google Cloud's "TPU v5e", "TPU v5p" and "TPU v6e"
# pages (cloud.google.com/tpu/docs/v5e, /v5p, /v6e: peak compute per chip (bf16), HBM
# bandwidth per chip, bidirectional inter-chip interconnect (ICI) bandwidth per chip, ICI
# ports per chip or the torus's dimensions: v5e 197 TFLOP/s, 819 GB/s, 400 GB/s, 4 ports;
# v5p 459 TFLOP/s, 2765 GB/s, 1200 GB/s, 3D torus; v6e 918 TFLOP/s, 1638 GB/s, 800 GB/s, 4
# ports); NVIDIA's data sheets (nvidia.com/en-us/data-center/h100, /h200, /a100: SXM, BF16
# Tensor Core without sparsity 989.4 / 989.4 / 312 TFLOP/s, GPU memory bandwidth 3.35 /
# 4.8 / 2.039 TB/s, NVLink 900 / 900 / 600 GB/s).
TARGETS: dict[str, Chip] = {
    "v5e": Chip("v5e", "tpu", 16 * GIB, int(15.75 * GIB), "chips", 2, "v5e", peak_flops=197e12,
                hbm_bandwidth=819e9, ici_bandwidth=400e9, ici_ports=4),
    "v5p": Chip("v5p", "tpu", 96 * GIB, int(95.74 * GIB), "cores", 3, "v5p", peak_flops=459e12,
                hbm_bandwidth=2765e9, ici_bandwidth=1200e9, ici_ports=6),
    "v6e": Chip("v6e", "tpu", 32 * GIB, int(31.25 * GIB), "chips", 2, "v6e", peak_flops=918e12,
                hbm_bandwidth=1638e9, ici_bandwidth=800e9, ici_ports=4),
    "h100": Chip("h100", "gpu", 84978434048, count="gpus", config="h100.txtpb",
                 kind="NVIDIA H100 80GB HBM3", capability=(9, 0), peak_flops=989.4e12,
                 hbm_bandwidth=3.35e12, ici_bandwidth=900e9),
    "h200": Chip("h200", "gpu", 150754820096, count="gpus", config="h200.txtpb",
                 kind="NVIDIA H200", capability=(9, 0), peak_flops=989.4e12,
                 hbm_bandwidth=4.8e12, ici_bandwidth=900e9),
    "a100-80g": Chip("a100-80g", "gpu", 85899345920, count="gpus", config="a100-80g.txtpb",
                     kind="NVIDIA A100-SXM4-80GB", capability=(8, 0), peak_flops=312e12,
                     hbm_bandwidth=2.039e12, ici_bandwidth=600e9),
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


# Device kinds as `jax.Device.device_kind` spells them (a v5p chip reports "TPU v5", a v5e
# "TPU v5 lite"), to their chip; the first that the kind contains wins.
DEVICE_KINDS = (("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"), ("TPU v5 lite", "v5e"),
                ("TPU v5e", "v5e"), ("TPU v5p", "v5p"), ("TPU v5", "v5p"), ("H200", "h200"),
                ("H100", "h100"), ("A100-SXM4-80GB", "a100-80g"))


def chip_of(device_kind: str) -> Chip | None:
  """The chip of `TARGETS` that devices of `device_kind` are, or None (the CPU, a kind the
  table lacks)."""
  found = next((c for k, c in DEVICE_KINDS if k.lower() in device_kind.lower()), None)
  return TARGETS[found] if found else None


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
# Platforms whose environment's native flags `check_native_flags` has passed.
_flags_checked: set[str] = set()


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

  Once per platform and process: flags added after a check (`train.xla_flags`, a table
  checked against the installed compilers in the tests) are not tried again.

  Raises:
    ValueError: one line naming the variables, their values and the compiler's refusal.
  """
  import jax._src.xla_bridge as xla_bridge  # whether XLA read XLA_FLAGS in this process

  if t.platform in _flags_checked:
    return
  names = []
  if not xla_bridge.backends_are_initialized():
    names += _NATIVE_FLAGS[""]
  if t.platform == "tpu" and "tpu" not in _started:
    names += _NATIVE_FLAGS["tpu"]
  found = {k: v for k, v in os.environ.items() if v and k not in _SET_BY_JAX
           and any(k == n or n.endswith("_") and k.startswith(n) for n in names)}
  if not found:
    _flags_checked.add(t.platform)
    return
  code = ("import jax; jax.devices(); from flaxattn import aot;"
          f" aot._devices({t.platform!r}, {t.topology!r}, {t.chip.config!r})")
  path = os.pathsep.join(p for p in sys.path if p)
  child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path}, check=False)
  if child.returncode == 0:
    _flags_checked.add(t.platform)
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


def host_syncs(hlo_text: str) -> dict[str, int]:
  """How many instructions of a compiled program's text (`compiled.as_text()`) wait for the
  host each time they run, by kind: "conditional" (a GPU copies the predicate to the host to
  pick the branch), "while" (the same, every iteration) and "host_callback" (a Python
  callback: a custom call on CPU and GPU, a host transfer on TPU, counted once each)."""
  found = {"conditional": 0, "while": 0, "host_callback": 0}
  computations, _ = _computations(hlo_text)
  for instruction in (i for instructions in computations.values() for i in instructions):
    if instruction.opcode in ("conditional", "while"):
      found[instruction.opcode] += 1
    elif ((instruction.opcode == "custom-call"
           and any("callback" in t for t in _TARGET.findall(instruction.attributes)))
          or (instruction.opcode == "send" and "is_host_transfer=true" in instruction.attributes)):
      found["host_callback"] += 1
  return found


# The scheduled program ---------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# Bytes per element of the element types a collective moves (s4/u4 round up: a transfer
# moves whole bytes).
ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
            "u32": 4, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
            "f32": 4, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_LAID_OUT = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\([1-9]\d*\)")
# Instructions that touch no memory of their own (their parts are counted where they run).
_NOT_MEMORY = {"copy-done", "async-done", "async-update", "send", "send-done", "recv",
               "recv-done", "while", "conditional", "call", "partition-id", "replica-id",
               "iota", "add-dependency"}
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
_LINE = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*)$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%?([\w.\-]+)|\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIPS = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')
# Custom calls that compute nothing: buffer bookkeeping, placement annotations, and the ends
# of TPU's asynchronous collective fusions (a fusion that holds AsyncCollectiveStart starts
# a collective, one with AsyncCollectiveDone finishes it, fusions in between hold the
# collective's steps beside other work).
_MARKERS = {"AsyncCollectiveStart": "start", "AsyncCollectiveDone": "done"}
_NOT_KERNELS = ("AllocateBuffer", "MoveToHost", "MoveToDevice", "annotate_device_placement",
                "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", *_MARKERS)
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
# Instructions that pass values on without computing.
_PLUMBING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
             "optimization-barrier", "after-all"}
# The asynchronous forms: X-start ... X-done of a collective, async-start/-update/-done around
# a computation that holds one, recv ... recv-done (a collective-permute split into send and
# receive, counted on the receiving side).
_STARTS = {f"{kind}-start": kind for kind in COLLECTIVES}
_DONES = {*(f"{kind}-done" for kind in COLLECTIVES), "async-done", "recv-done"}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective in a compiled program's schedule (`collectives_in`), per device.

  kind: one of `COLLECTIVES`. bytes: its result's bytes, per execution. times: executions per
  run of the program (the trip counts of the loops around it). exposed: nothing that
  computes (a fusion, a kernel, a dot, or a loop, conditional or call holding one) is
  scheduled between its start and its done, so nothing can hide the transfer; a synchronous
  collective is exposed. kernels: the kernels (custom calls, or control flow holding one,
  each counted once) scheduled between its start and its done. name: its start's name;
  computation: the computation whose schedule holds it. group: the devices (partition ids)
  of its first replica group; () for a collective-permute, or where the program names none
  (every device).
  """

  kind: str
  bytes: int
  exposed: bool
  kernels: int
  times: int
  name: str
  computation: str
  group: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Instruction:
  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str
  arguments: str = ""  # the text between the opcode's parentheses (a constant's value)

  @property
  def called(self) -> list[str]:
    found = []
    for one, many in _CALLED.findall(self.attributes):
      found += [one] if one else [c.strip().lstrip("%") for c in many.split(",") if c.strip()]
    return found


def _closing(text: str, start: int) -> int:
  """The index of the parenthesis that closes the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i
  return len(text)


def _parse(rest: str, name: str) -> _Instruction:
  if rest.startswith("("):  # a tuple shape
    end = _closing(rest, 0) + 1
    shape, tail = rest[:end], rest[end:].lstrip()
  else:
    shape, _, tail = rest.partition(" ")
  opcode, paren, _ = tail.partition("(")
  if not paren:
    return _Instruction(name, shape, opcode.strip(), (), "")
  close = _closing(tail, len(opcode))
  arguments = tail[len(opcode) + 1:close]
  operands = tuple(re.findall(r"%([\w.\-]+)", arguments))
  return _Instruction(name, shape, opcode.strip(), operands, tail[close + 1:], arguments)


def _computations(hlo_text: str) -> tuple[dict[str, list[_Instruction]], str | None]:
  """Each computation's instructions in schedule order (a scheduled module's text lists
  them in the order they run), and the entry's name."""
  found: dict[str, list[_Instruction]] = {}
  current, entry = None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = found.setdefault(header.group(2), [])
      entry = header.group(2) if header.group(1) else entry
      continue
    instruction = _LINE.match(line)
    if instruction and current is not None:
      current.append(_parse(instruction.group(2), instruction.group(1)))
  return found, entry


def _scalar(constant: _Instruction) -> int | None:
  """The integer a scalar constant instruction holds, or None."""
  value = re.fullmatch(r"-?\d+", constant.arguments.strip())
  return int(value.group(0)) if constant.opcode == "constant" and value else None


def _array_bytes(shape: str) -> int:
  return sum(ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
             for dtype, dims in _ARRAY.findall(shape) if dtype in ITEMSIZE)


def _memory_bytes(shape: str) -> int:
  """The bytes of the arrays of `shape` that live in the device's main memory: those whose
  layout names no other memory space (TPU: S(1) on-chip VMEM, S(2) synchronization flags,
  S(5) the host's memory)."""
  return sum(ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
             for dtype, dims, layout in _LAID_OUT.findall(shape)
             if dtype in ITEMSIZE and not _SPACE.search(layout))


def _tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a (possibly tuple) shape's text."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
    if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
      parts.append(shape[start:i].strip())
      start = i + 1
  return [p.removeprefix("/*index=").split("*/")[-1].strip() for p in parts if p]


def _first_group(attributes: str) -> tuple[int, ...] | None:
  """The partition ids of the first replica group in an instruction's attributes, in any of
  the three spellings XLA prints (explicit `{{0,1},{2,3}}`, iota `[2,2]<=[4]` with an
  optional transpose `T(1,0)`, and `mesh['axis_0'=2,'axis_1'=2] {'axis_1'}`); None where
  it names none, () for an empty list (every device)."""
  explicit = re.search(r"replica_groups=\{(\{[\d,\s]*\})?", attributes)
  if explicit:
    first = explicit.group(1)
    return tuple(int(x) for x in re.findall(r"\d+", first)) if first else ()
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
  if iota:
    groups = [int(x) for x in iota.group(1).split(",")]
    dims = [int(x) for x in iota.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(3):
      ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
    return tuple(int(x) for x in ids.reshape(groups[0], -1)[0])
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
  if mesh:
    sizes = dict((a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
    spanned = set(re.findall(r"'(\w+)'", mesh.group(2)))
    ids = np.arange(math.prod(sizes.values())).reshape(list(sizes.values()))
    index = tuple(slice(None) if a in spanned else 0 for a in sizes)
    return tuple(int(x) for x in ids[index].reshape(-1))
  return None


def collectives_in(hlo_text: str) -> list[Collective]:
  """Every collective of a compiled program's scheduled text (`compiled.as_text()`) that
  runs, with its bytes and whether compute hides it (`Collective`); loops' bodies are read
  in their own schedules. Of a conditional's branches, the one that moves the most bytes
  counts (the others run instead of it), of those that call a kernel where any does (the
  fast path a run-time check guards, not its fallback).

  A done is paired with its start through its operands (the start itself, or the steps of
  an asynchronous collective fusion in between), else across a loop's back edge (started
  at the end of one iteration, done in the next), in order; then what runs between is the
  rest of the iteration after the start and the part of the next before the done."""
  return _Schedule(hlo_text).collectives()


class _Schedule:
  """A compiled program's computations, read for `collectives_in`."""

  def __init__(self, hlo_text: str):
    self.computations, self.entry = _computations(hlo_text)
    self._computes: dict[str, tuple[int, bool]] = {}

  def collectives(self) -> list[Collective]:
    return self._walk(self.entry, 1, ()) if self.entry else []

  def _targets(self, instruction: _Instruction) -> list[str]:
    """The custom-call targets `instruction` is or its fusion holds."""
    if instruction.opcode == "custom-call":
      return _TARGET.findall(instruction.attributes)
    if instruction.opcode != "fusion":
      return []
    return [t for c in instruction.called for inner in self.computations.get(c, [])
            if inner.opcode == "custom-call" for t in _TARGET.findall(inner.attributes)]

  def _marker(self, instruction: _Instruction) -> str | None:
    return next((_MARKERS[t] for t in self._targets(instruction) if t in _MARKERS), None)

  def kind(self, instruction: _Instruction) -> str | None:
    """The collective `instruction` is, starts or wraps, or None."""
    op = instruction.opcode
    if op in _STARTS:
      return _STARTS[op]
    if op in COLLECTIVES or op == "recv":
      return "collective-permute" if op == "recv" else op
    if op in ("async-start", "async-done", "fusion"):  # a collective wrapped in a computation
      return next((k for c in instruction.called for inner in self.computations.get(c, [])
                   for k in [self.kind(inner)] if k), None)
    return None

  def computes(self, instruction: _Instruction) -> tuple[int, bool]:
    """(kernels, whether anything is computed) of running `instruction`."""
    op = instruction.opcode
    if op == "custom-call":
      kernel = not set(self._targets(instruction)) & set(_NOT_KERNELS)
      return int(kernel), kernel
    if op in ("dot", "convolution"):
      return 0, True
    if op in ("fusion", "while", "conditional", "call") or (op == "async-start"
                                                          and not self.kind(instruction)):
      parts = [self._computation_computes(c) for c in instruction.called]
      kernels = sum(k for k, _ in parts)
      # A loop or branch that holds kernels counts as one beside a transfer.
      return (kernels if op == "fusion" else int(kernels > 0)), any(c for _, c in parts)
    return 0, False

  def _computation_computes(self, name: str) -> tuple[int, bool]:
    if name not in self._computes:
      self._computes[name] = (0, False)  # a computation that calls itself computes nothing more
      kernels, computes = 0, False
      for instruction in self.computations.get(name, []):
        # A collective is no compute; a step of a chain is (it fuses the transfer into it).
        if instruction.opcode in _PLUMBING or (self.kind(instruction)
                                               and not self._chained(instruction)):
          continue
        k, c = self.computes(instruction)
        kernels, computes = kernels + k, computes or c or instruction.opcode not in (
            "while", "conditional", "call", "async-start", "async-done", "async-update",
            "custom-call")
      self._computes[name] = (kernels, computes)
    return self._computes[name]

  def _is_start(self, instruction: _Instruction) -> bool:
    op = instruction.opcode
    return (op in _STARTS or op == "recv" or self._marker(instruction) == "start"
            or (op == "async-start" and self.kind(instruction) is not None))

  def _is_done(self, instruction: _Instruction) -> bool:
    return ((instruction.opcode in _DONES and (instruction.opcode != "async-done"
                                               or self.kind(instruction) is not None))
            or self._marker(instruction) == "done")

  def _channel(self, instruction: _Instruction) -> str | None:
    """The channel of the collective a fusion holds: every step of one asynchronous
    collective fusion holds the same collective, with the same channel id."""
    return next((m.group(1) for c in instruction.called for inner in self.computations.get(c, [])
                 if self.kind(inner) for m in [_CHANNEL.search(inner.attributes)] if m), None)

  def _chained(self, instruction: _Instruction) -> bool:
    """Whether fusion `instruction` is a step of an asynchronous collective fusion (libtpu
    marks its collective with a `chain_id`): a step whose start and done are in another
    computation (a chain started before a loop and stepped beside the compute of each of
    its iterations) moves nothing of its own; the start counts the chain's bytes."""
    return any(self.kind(inner) and "chain_id=" in inner.attributes
               for c in instruction.called for inner in self.computations.get(c, []))

  def _pairs(self, schedule) -> tuple[dict[int, int], set[int], list[int]]:
    """({start: done}, the steps between an asynchronous collective fusion's start and done,
    the dones whose start is not in this computation)."""
    by_name = {instruction.name: i for i, instruction in enumerate(schedule)}
    done_of: dict[int, int] = {}
    steps: set[int] = set()
    carried: list[int] = []
    open_fusions: dict[str | None, list[int]] = {}  # started, by channel
    for i, instruction in enumerate(schedule):
      marker = self._marker(instruction)
      if marker == "start":
        open_fusions.setdefault(self._channel(instruction), []).append(i)
      elif marker == "done":
        started = open_fusions.get(self._channel(instruction))
        if started:
          done_of[started.pop(0)] = i
        else:
          carried.append(i)
      elif (instruction.opcode == "fusion" and self.kind(instruction)
            and open_fusions.get(self._channel(instruction))):
        steps.add(i)
      # An async-done names no collective: its start does.
      elif self._is_done(instruction) or instruction.opcode == "async-done":
        j = by_name.get(instruction.operands[0]) if instruction.operands else None
        while j is not None and schedule[j].opcode == "async-update":
          j = by_name.get(schedule[j].operands[0])
        if j is not None and self._is_start(schedule[j]):
          done_of[j] = i
        elif self._is_done(instruction):
          carried.append(i)
    return done_of, steps, carried

  def _walk(self, name: str, times: int, seen: tuple[str, ...]) -> list[Collective]:
    if name in seen:
      return []
    schedule = self.computations.get(name, [])
    starts = [i for i, instruction in enumerate(schedule) if self._is_start(instruction)]
    done_of, steps, carried = self._pairs(schedule)
    # The rest started at the end of the previous iteration.
    for s, d in zip([s for s in starts if s not in done_of], carried, strict=False):
      done_of[s] = d
    found: list[Collective] = []
    for i, instruction in enumerate(schedule):
      op = instruction.opcode
      if i in starts:
        found.append(self._async(name, schedule, i, done_of.get(i), times))
      elif op == "while":
        body = re.search(r"\bbody=%?([\w.\-]+)", instruction.attributes)
        if body:
          found += self._walk(body.group(1), times * self._trips(instruction, schedule),
                              (*seen, name))
      elif op == "conditional":
        branches = [self._walk(b, times, (*seen, name)) for b in self._runs(instruction)]
        if branches:
          found += max(branches, key=lambda b: sum(c.bytes * c.times for c in b))
      elif i not in steps and not self._is_done(instruction) and (
          op in COLLECTIVES or (op == "fusion" and self.kind(instruction)
                                and not self._chained(instruction))):
        found.append(Collective(self.kind(instruction) or op, _array_bytes(instruction.shape),
                                True, 0, times, instruction.name, name, self.group(instruction)))
      elif op in ("call", "async-start"):
        for called in instruction.called:
          found += self._walk(called, times, (*seen, name))
    return found

  def _runs(self, conditional: _Instruction) -> list[str]:
    """The branches of `conditional` that may be the one that runs: those that call a
    kernel where any does, else all. A kernel's branch is the path the condition guards
    (`flaxattn.checked`: the blockwise fallback, kernel-free, runs only for data the kernel
    cannot serve; the ring's steps: a kernel or nothing); readers take the largest of these."""
    kernels = [b for b in conditional.called if self._computation_computes(b)[0]]
    return kernels or list(conditional.called)

  def _trips(self, loop: _Instruction, schedule) -> int:
    """How many times `loop` runs its body: XLA's known trip count where the program says
    it; else read from its condition, `i < N` on a counter that starts at a constant (what
    libtpu prints for a scan); else 1."""
    known = _TRIPS.search(loop.attributes)
    if known:
      return int(known.group(1))
    condition = re.search(r"\bcondition=%?([\w.\-]+)", loop.attributes)
    instructions = self.computations.get(condition.group(1), []) if condition else []
    by_name = {i.name: i for i in instructions}
    test = next((i for i in instructions if i.opcode == "compare"
                 and "direction=LT" in i.attributes and len(i.operands) == 2), None)
    if test is None:
      return 1
    counter, bound = (by_name.get(o) for o in test.operands)
    index = re.search(r"index=(\d+)", counter.attributes) if counter else None
    if (bound is None or bound.opcode != "constant" or counter is None
        or counter.opcode != "get-tuple-element" or not index):
      return 1
    # The counter's start: that element of the tuple the loop starts from.
    callers = {i.name: i for i in schedule}
    state = callers.get(loop.operands[0]) if loop.operands else None
    start = (callers.get(state.operands[int(index.group(1))])
             if state is not None and state.opcode == "tuple" else None)
    while start is not None and start.opcode in ("copy", "bitcast") and start.operands:
      start = callers.get(start.operands[0])
    end, begin = _scalar(bound), None if start is None else _scalar(start)
    if end is None or begin is None:
      return 1
    return max(end - begin, 0)

  def _async(self, name, schedule, s: int, d: int | None, times: int) -> Collective:
    """The collective started at `s` and done at `d` (None: not in this computation)."""
    if d is None:  # done outside this computation: what follows the start here runs
      between, done = schedule[s + 1:], schedule[s]
    elif d > s:
      between, done = schedule[s + 1:d], schedule[d]
    else:  # across the loop's back edge
      between, done = schedule[s + 1:] + schedule[:d], schedule[d]
    parts = [self.computes(instruction) for instruction in between]
    start = schedule[s]
    return Collective(self.kind(start) or start.opcode, _array_bytes(done.shape),
                      not any(c for _, c in parts), sum(k for k, _ in parts), times,
                      start.name, name, self.group(start))

  def group(self, instruction: _Instruction) -> tuple[int, ...]:
    """The first replica group of the collective `instruction` is, starts or wraps."""
    found = _first_group(instruction.attributes)
    if found is None:
      found = next((g for c in instruction.called for inner in self.computations.get(c, [])
                    if self.kind(inner) for g in [_first_group(inner.attributes)]
                    if g is not None), None)
    return found or ()

  def hbm_bytes(self) -> int:
    """The bytes one run of the program reads and writes in the device's memory
    (`hbm_bytes`)."""
    return self._bytes(self.entry, ()) if self.entry else 0

  def _bytes(self, name: str, seen: tuple[str, ...]) -> int:
    if name in seen:
      return 0
    schedule = self.computations.get(name, [])
    shapes = {instruction.name: instruction.shape for instruction in schedule}
    total = 0
    for instruction in schedule:
      op = instruction.opcode
      inside = (*seen, name)
      if op == "while":
        body = re.search(r"\bbody=%?([\w.\-]+)", instruction.attributes)
        if body:
          total += self._trips(instruction, schedule) * self._bytes(body.group(1), inside)
      elif op == "conditional":
        total += max((self._bytes(b, inside) for b in self._runs(instruction)), default=0)
      elif op in ("call", "async-start") and not self.kind(instruction):
        total += sum(self._bytes(c, inside) for c in instruction.called)
      elif (op in _PLUMBING or op in _NOT_MEMORY or op in _DONES or self._marker(instruction)
            or (self.kind(instruction) and not self._chained(instruction))):
        continue  # collectives move their bytes over the links: `estimate`'s comm_s
      elif op == "fusion":
        total += self._fusion_bytes(instruction, shapes)
      elif op in ("dynamic-update-slice", "dynamic-slice"):  # in place: the update's bytes
        part = shapes.get(instruction.operands[1], "") if op == "dynamic-update-slice" and len(
            instruction.operands) > 1 else instruction.shape
        total += 2 * _memory_bytes(part)
      elif op == "copy-start":  # a prefetch: the source read, the destination written
        total += sum(_memory_bytes(shapes.get(o, "")) for o in instruction.operands[:1])
        total += _memory_bytes(_tuple_elements(instruction.shape)[0])
      else:
        total += _memory_bytes(instruction.shape) + sum(
            _memory_bytes(shapes.get(o, "")) for o in instruction.operands)
    return total

  def _fusion_bytes(self, fusion: _Instruction, shapes: dict[str, str]) -> int:
    """A fusion's bytes: each operand read once, but of an operand the fusion only slices,
    the slices; its result written, but of a result updated in place (a
    dynamic-update-slice of an operand), the update. So a loop's body that reads layer i
    of a stacked parameter, or writes row i of a stacked result, counts that layer or row.
    The buffers of a collective stepped through the fusion (libtpu's collective fusions),
    and results passed through, count nothing here."""
    inner = self.computations.get(fusion.called[0], []) if fusion.called else []
    by_name = {i.name: i for i in inner}
    users: dict[str, list[_Instruction]] = {}
    for i in inner:
      for o in i.operands:
        users.setdefault(o, []).append(i)

    def reads(name: str) -> int | None:
      """Bytes read of value `name` when only slices of it are used; None otherwise."""
      total = 0
      for user in users.get(name, []):
        if user.opcode in ("bitcast", "reshape"):
          part = reads(user.name)
        elif user.opcode in ("dynamic-slice", "slice", "gather") and user.operands[0] == name:
          part = _memory_bytes(user.shape)
        elif user.opcode == "dynamic-update-slice" and user.operands[0] == name:
          part = 0  # written in place: the update is counted as the result
        elif self.kind(user) or (user is root and user.opcode == "tuple"):
          part = 0  # a collective's step (its bytes are the links'), or passed through
        else:
          part = None
        if part is None:
          return None
        total += part
      return total

    root = inner[-1] if inner else None
    total = 0
    params = {int(i.arguments): i.name for i in inner
              if i.opcode == "parameter" and i.arguments.strip().isdigit()}
    for index, operand in enumerate(fusion.operands):
      whole = _memory_bytes(shapes.get(operand, ""))
      sliced = reads(params[index]) if index in params else None
      total += whole if sliced is None else min(sliced, whole)
    outputs = ([by_name.get(o) for o in root.operands] if root is not None
               and root.opcode == "tuple" else [root])
    pieces = _tuple_elements(fusion.shape)
    for k, piece in enumerate(pieces):
      out = outputs[k] if k < len(outputs) else None
      while out is not None and out.opcode in ("bitcast", "reshape") and out.operands:
        out = by_name.get(out.operands[0])
      if out is not None and out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
        update = by_name.get(out.operands[1])
        total += _memory_bytes(update.shape) if update is not None else 0
      elif out is not None and (out.opcode == "parameter" or self.kind(out)):
        continue  # passed through, or a collective's result (a step of a chain)
      else:
        total += _memory_bytes(piece)
    return total


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """`{kind: {"count", "bytes", "exposed_bytes"}}` of a compiled program's collectives
  (`collectives_in`), per device and per run: executions, result bytes moved, and the bytes
  of those that nothing computed beside (`Collective.exposed`)."""
  found: dict[str, dict[str, int]] = {}
  for c in collectives_in(hlo_text):
    row = found.setdefault(c.kind, {"count": 0, "bytes": 0, "exposed_bytes": 0})
    row["count"] += c.times
    row["bytes"] += c.bytes * c.times
    row["exposed_bytes"] += c.bytes * c.times if c.exposed else 0
  return found


# The estimate -------------------------------------------------------------------------------

# Bytes each device sends per byte of a collective's result, over a group of g devices, as
# the ring (bucket) algorithms move them: an all-gather receives the g - 1 shards it lacks; a
# reduce-scatter's result is one shard of the g it sums; an all-reduce is both.
_WIRE = {"all-gather": lambda g: (g - 1) / g, "reduce-scatter": lambda g: g - 1,
         "all-reduce": lambda g: 2 * (g - 1) / g, "all-to-all": lambda g: (g - 1) / g,
         "collective-permute": lambda g: 1.0}


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A roofline estimate of one run of a compiled program (`estimate`), per device.

  compute_s: `flops` at the chip's peak. memory_s: `hbm_bytes` at its memory bandwidth.
  comm_s: every collective at its links' bandwidth; exposed_comm_s: those with no compute
  scheduled beside them (`Collective.exposed`). step_s: max(compute_s, memory_s, comm_s -
  exposed_comm_s) + exposed_comm_s, so at least each part. mfu: `model_flops` / (step_s x
  peak x devices). tokens_per_s: `tokens` / step_s. bound: the largest term of the max.
  flops, model_flops: per step, all devices; hbm_bytes: per device.
  """

  step_s: float
  compute_s: float
  memory_s: float
  comm_s: float
  exposed_comm_s: float
  mfu: float
  tokens_per_s: float
  flops: float
  model_flops: float
  hbm_bytes: int
  bound: str

  def line(self) -> str:
    return (f"step {self.step_s:.3f} s ({self.bound} bound): compute {self.compute_s:.3f} s,"
            f" memory {self.memory_s:.3f} s, collectives {self.comm_s:.3f} s of which exposed"
            f" {self.exposed_comm_s:.3f} s; MFU {self.mfu:.1%}, {self.tokens_per_s:,.0f}"
            " tokens/s")


def hbm_bytes(hlo_text: str) -> int:
  """The bytes a compiled program (`compiled.as_text()`) reads and writes in a device's main
  memory per run: each kernel, fusion and unfused instruction its operands and results
  (slices of what it only slices, updates of what it updates in place), times the trip
  counts of the loops around it; of a conditional the branch with the most, among those
  that call a kernel where any does (as `collectives_in`); collectives and the on-chip and
  host memory spaces not counted."""
  return _Schedule(hlo_text).hbm_bytes()


def link_bandwidth(chip: Chip, devices, group: tuple[int, ...]) -> float:
  """Bytes/s one device sends to the others of `group` (partition ids into `devices`, the
  program's devices in order; () all of them): on TPU one direction of 2 ICI ports per torus
  dimension the group spans (at most the chip's ports); on GPU one direction of its NVLink,
  which a switch gives any peer whole."""
  per_port = chip.ici_bandwidth / 2 / chip.ici_ports
  if chip.platform != "tpu":
    return per_port
  members = [devices[i] for i in group] if group else list(devices)
  coords = np.asarray([d.coords for d in members])
  spanned = int((coords != coords[:1]).any(axis=0).sum()) if len(coords) > 1 else 0
  return per_port * min(chip.ici_ports, max(2 * spanned, 1))


def estimate(hlo_text: str, chip: Chip, devices, *, flops: float, model_flops: float,
             tokens: int) -> Estimate:
  """The roofline step time of a compiled program (`compiled.as_text()`) on `devices` (its
  devices in the program's order, of `chip`), from `chip`'s published peak figures:
  compute at peak FLOP/s, memory traffic (`hbm_bytes`) at the HBM bandwidth, each collective
  of the schedule (`collectives_in`) at the bandwidth of the links its group spans
  (`link_bandwidth`; a collective-permute sends to one neighbour over one port), overlapped
  ones hidden up to the larger of compute and memory, exposed ones added.

  `flops`: the FLOPs the step runs, all devices (XLA's cost analysis counts a loop's body
  once, a Pallas kernel as nothing and both branches of a conditional as the larger, so the
  caller counts them); `model_flops`: the model's FLOPs for MFU; `tokens`: per step.
  A lower bound, not a measurement: every unit at its peak at once, kernels at peak FLOP/s
  whatever their size, a kernel's operands read once, no launch or synchronization costs,
  no load imbalance, collectives over GPU hosts at NVLink speed.
  """
  schedule = _Schedule(hlo_text)
  n = len(devices)
  compute = flops / n / chip.peak_flops
  memory_bytes = schedule.hbm_bytes()
  memory = memory_bytes / chip.hbm_bandwidth
  comm = exposed = 0.0
  for c in schedule.collectives():
    g = len(c.group) or n
    wire = c.bytes * _WIRE.get(c.kind, lambda g: 1.0)(g) * c.times
    one_port = c.kind == "collective-permute"
    seconds = wire / (chip.ici_bandwidth / 2 / chip.ici_ports if one_port
                      else link_bandwidth(chip, devices, c.group))
    comm += seconds
    exposed += seconds if c.exposed else 0.0
  parts = {"compute": compute, "memory": memory, "communication": comm - exposed}
  bound = max(parts, key=lambda k: parts[k])
  step = parts[bound] + exposed
  if exposed > parts[bound]:
    bound = "communication"
  return Estimate(step_s=step, compute_s=compute, memory_s=memory, comm_s=comm,
                  exposed_comm_s=exposed, mfu=model_flops / (step * chip.peak_flops * n),
                  tokens_per_s=tokens / step, flops=flops, model_flops=model_flops,
                  hbm_bytes=memory_bytes, bound=bound)
