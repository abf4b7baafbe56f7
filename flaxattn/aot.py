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

GIB = 2**30
# The extra that installs both compilers (pyproject.toml).
EXTRA = "flaxattn[aot]"
# JAX preallocates this fraction of a GPU's memory for its arrays unless
# XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise (JAX's GPU memory allocation docs).
GPU_MEM_FRACTION = 0.75


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
    reserve; on GPU `mem_fraction` (default: XLA_PYTHON_CLIENT_MEM_FRACTION, else JAX's
    0.75) of the memory."""
    if self.chip.available_bytes is not None:
      return self.chip.available_bytes
    if mem_fraction is None:
      mem_fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEM_FRACTION))
    return int(self.chip.hbm_bytes * mem_fraction)


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
    raise ValueError(f"target {name!r}: no {chip.name} slice of {n} {chip.count}; expected a"
                     f" power of two ({'8 to 4096 cores' if chip.dims == 3 else '1 to 256'}"
                     f" chips), e.g. {chip.name}-{16 if chip.dims == 3 else 8}.")
  return Target(spelled, chip, chips, f"{chip.topology_name}:{'x'.join(map(str, shape))}")


def _torus(chips: int, dims: int) -> tuple[int, ...] | None:
  """Google Cloud's topology of `chips` (a power of two), or None."""
  if chips < 1 or chips & (chips - 1):
    return None
  if dims == 2:
    side = 1 << (chips.bit_length() - 1) // 2  # 8 -> 2x4, 16 -> 4x4, 128 -> 8x16
    return (side, chips // side) if chips <= 256 else None
  if not 4 <= chips <= 2048:
    return None
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
  """
  missing = missing_package(t.platform)
  if missing:
    raise MissingCompiler(missing)
  return list(_devices(t.platform, t.topology, t.chip.config))


@functools.cache
def _devices(platform: str, topology: str, config: str) -> tuple:
  from jax.experimental import topologies
  if platform == "tpu":
    # No chip is opened; without this a second process (a test worker, a compile beside a
    # run) is refused at libtpu's lock file.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # One chip is less than the default host (2x2); its bounds must say so.
    one = {"chips_per_host_bounds": [1, 1, 1]} if topology.endswith(":1x1") else {}
    return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu",
                                              **one).devices)
  text = importlib.resources.files("flaxattn.targets").joinpath(config).read_text()
  name = config.removesuffix(".txtpb")
  return tuple(topologies.get_topology_desc(platform="cuda", topology_name=name,
                                            topology=topology, target_config=text).devices)


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
# calls in their backend config (`name = "flash_forward"`), cuDNN calls in their target.
_CUSTOM_CALL = re.compile(r"%([\w.-]+) = [^\n]*?custom_call_target=\"([^\"]+)\"([^\n]*)")
_TRITON_NAME = re.compile(r'\bname = "([^"]+)"')


def kernels(hlo_text: str) -> dict[str, int]:
  """Each kernel's name in a compiled program's text (`compiled.as_text()`) and how many
  calls to it the program holds: Pallas TPU and Triton kernels by their names, cuDNN calls
  by their custom-call target (`__cudnn$fmha...`)."""
  found: dict[str, int] = {}
  for instruction, call_target, rest in _CUSTOM_CALL.findall(hlo_text):
    if call_target == "tpu_custom_call":
      name = re.sub(r"\.\d+$", "", instruction)
    elif "triton" in call_target:
      named = _TRITON_NAME.search(rest)
      name = named.group(1) if named else call_target
    elif call_target.startswith("__cudnn$fmha"):
      name = call_target
    else:
      continue
    found[name] = found.get(name, 0) + 1
  return found


# The scheduled program ---------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# Bytes per element of the element types a collective moves (s4/u4 round up: a transfer
# moves whole bytes).
ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
            "u32": 4, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
            "f32": 4, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
_LINE = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*)$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%?([\w.\-]+)|\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIPS = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')
# Custom calls that compute nothing: buffer bookkeeping and placement annotations.
_NOT_KERNELS = ("AllocateBuffer", "MoveToHost", "MoveToDevice", "annotate_device_placement",
                "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape")
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
  computation: the computation whose schedule holds it.
  """

  kind: str
  bytes: int
  exposed: bool
  kernels: int
  times: int
  name: str
  computation: str


@dataclasses.dataclass(frozen=True)
class _Instruction:
  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str

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
  operands = tuple(re.findall(r"%([\w.\-]+)", tail[len(opcode):close]))
  return _Instruction(name, shape, opcode.strip(), operands, tail[close + 1:])


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


def _array_bytes(shape: str) -> int:
  return sum(ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
             for dtype, dims in _ARRAY.findall(shape) if dtype in ITEMSIZE)


def collectives_in(hlo_text: str) -> list[Collective]:
  """Every collective of a compiled program's scheduled text (`compiled.as_text()`) that
  runs, with its bytes and whether compute hides it (`Collective`), in schedule order;
  loops' bodies are read in their own schedules. Of a conditional's branches, the one that
  moves the most bytes counts (the others run instead of it).

  A start is paired with its done by operand, or across a loop's back edge (started at the
  end of one iteration, done in the next) in order; then what runs between is the rest of
  the iteration after the start and the part of the next before the done."""
  computations, entry = _computations(hlo_text)
  compute_memo: dict[str, tuple[int, bool]] = {}

  def compute(name: str) -> tuple[int, bool]:
    """(kernels, anything computed) of running computation `name`."""
    if name not in compute_memo:
      compute_memo[name] = (0, False)
      kernels, computes = 0, False
      for instruction in computations.get(name, []):
        k, c = _computes(instruction)
        kernels, computes = kernels + k, computes or c
      compute_memo[name] = (kernels, computes)
    return compute_memo[name]

  def _computes(instruction: _Instruction) -> tuple[int, bool]:
    op = instruction.opcode
    if op == "custom-call":
      target = re.search(r'custom_call_target="([^"]+)"', instruction.attributes)
      kernel = not target or target.group(1) not in _NOT_KERNELS
      return int(kernel), kernel
    if op in ("fusion", "dot", "convolution"):
      # A fusion's own computation may hold a kernel call (XLA's GPU emitters): count it.
      return (compute(instruction.called[0])[0] if instruction.called else 0), True
    if op in ("while", "conditional", "call") or (op == "async-start"
                                                  and not _collective_kind(instruction)):
      parts = [compute(c) for c in instruction.called]
      kernels = sum(k for k, _ in parts)
      return int(kernels > 0), any(c for _, c in parts)
    return 0, False

  def _collective_kind(instruction: _Instruction) -> str | None:
    op = instruction.opcode
    if op in _STARTS:
      return _STARTS[op]
    if op in COLLECTIVES or op == "recv":
      return "collective-permute" if op == "recv" else op
    if op in ("async-start", "fusion"):  # a collective wrapped in a computation
      for called in instruction.called:
        for inner in computations.get(called, []):
          kind = _collective_kind(inner)
          if kind:
            return kind
    return None

  def walk(name: str, times: int, seen: tuple[str, ...]) -> list[Collective]:
    if name in seen:
      return []
    schedule = computations.get(name, [])
    by_name = {instruction.name: i for i, instruction in enumerate(schedule)}
    found: list[Collective] = []
    starts: list[int] = []
    done_of: dict[int, int] = {}
    carried: list[int] = []  # dones whose start is in the previous iteration
    for i, instruction in enumerate(schedule):
      op = instruction.opcode
      if op in _STARTS or op == "recv" or (op == "async-start" and _collective_kind(instruction)):
        starts.append(i)
      elif op in _DONES:
        j = by_name.get(instruction.operands[0]) if instruction.operands else None
        while j is not None and schedule[j].opcode == "async-update":
          j = by_name.get(schedule[j].operands[0])
        if j is not None and j in starts:
          done_of[j] = i
        elif op != "async-done" or _collective_kind(instruction) is not None:
          carried.append(i)
      elif op == "while":
        trips = _TRIPS.search(instruction.attributes)
        body = re.search(r"\bbody=%?([\w.\-]+)", instruction.attributes)
        if body:
          found += walk(body.group(1), times * (int(trips.group(1)) if trips else 1),
                        (*seen, name))
      elif op == "conditional":
        branches = [walk(b, times, (*seen, name)) for b in instruction.called]
        if branches:
          found += max(branches, key=lambda b: sum(c.bytes * c.times for c in b))
      elif op in COLLECTIVES or (op == "fusion" and _collective_kind(instruction)):
        found.append(Collective(_collective_kind(instruction) or op,
                                _array_bytes(instruction.shape), True, 0, times,
                                instruction.name, name))
      elif op in ("call", "async-start"):
        for called in instruction.called:
          found += walk(called, times, (*seen, name))
    unpaired = [s for s in starts if s not in done_of]
    for s, d in zip(unpaired, carried, strict=False):
      done_of[s] = d
    for s in starts:
      d = done_of.get(s)
      if d is None:  # done outside this computation: what follows the start here runs
        between, done = schedule[s + 1:], schedule[s]
      elif d > s:
        between, done = schedule[s + 1:d], schedule[d]
      else:  # across the loop's back edge
        between, done = schedule[s + 1:] + schedule[:d], schedule[d]
      parts = [_computes(instruction) for instruction in between]
      kernels = sum(k for k, _ in parts)
      start = schedule[s]
      kind = _collective_kind(start) or start.opcode
      found.append(Collective(kind, _array_bytes(done.shape if d is not None else start.shape),
                              not any(c for _, c in parts), kernels, times, start.name, name))
    return found

  return walk(entry, 1, ()) if entry else []


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
