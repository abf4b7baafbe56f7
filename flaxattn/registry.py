"""Which attention kernels exist, in which order each platform prefers them, and who serves a call.

Every kernel subclasses `Kernel` and says whether it serves a call (`unsupported_reason`,
context parallelism included). `backend="auto"` takes the first kernel of the platform's
row of `BACKENDS` that accepts; a name of `ALIASES` the first of its kernels that accepts;
an explicit kernel that declines raises with its reason and the kernels that would accept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging

import jax
import numpy as np
from jax._src import config as jax_config

from flaxattn.layout import Layout
from flaxattn.masks import Mask
from flaxattn.mods import ScoreMod
from flaxattn.ring import Gathered, RingStep

# Per platform, fastest first. Kernel modules load when first consulted, so a JAX change to
# the private API one uses breaks that backend only (`import flaxattn` itself uses one:
# `jax._src.config`, for `lowering_for`'s config state).
BACKENDS: dict[str, list[str]] = {
    "tpu": ["split_k",     # decode steps (at most 16 queries against a longer cache)
            "splash",      # Pallas TPU kernel with lazy masks; exact by a run-time check
            "blockwise"],  # whatever splash declines
    "gpu": ["split_k",     # decode steps, as on TPU
            "cudnn",       # cuDNN fused THD attention, where it is exact
            "mosaic_gpu",  # Mosaic GPU flash attention on Hopper, 16-bit, D <= 128: what
                           # cuDNN declines there (packed rows past its budget, Chunked...)
            "pallas_gpu",  # flash attention in Pallas (Triton): whatever both decline
                           # (other GPUs, float32, head dims 129-256)
            "blockwise"],  # whatever both decline (head dims above 256, float64)
    "cpu": ["split_k",     # decode steps, as on TPU
            "blockwise"],  # flash attention in JAX: serves every call
}
# Names that stand for "the first of these kernels that accepts".
ALIASES = {"fused": ("cudnn", "mosaic_gpu", "pallas_gpu", "blockwise")}
# Where each built-in kernel lives ("module:class"); `register` adds kernel objects.
_BUILTIN = {
    "blockwise": "flaxattn.blockwise:Blockwise",
    "cudnn": "flaxattn.cudnn:Cudnn",
    "mosaic_gpu": "flaxattn.mosaic_gpu:MosaicGpu",
    "pallas_gpu": "flaxattn.pallas_gpu:PallasGpu",
    "reference": "flaxattn.reference:Reference",
    "splash": "flaxattn.splash:Splash",
    "split_k": "flaxattn.split_k:SplitK",
}
_KERNELS: dict[str, Kernel] = {}
log = logging.getLogger("flaxattn")
PLATFORMS = ("cpu", "gpu", "tpu")
# `jax.lax.platform_dependent`'s names of the platforms a program may be lowered for.
LOWERING = {"cpu": "cpu", "cuda": "gpu", "tpu": "tpu"}
# The platforms programs traced now are lowered for ("tpu", "cpu,tpu"), "" for the devices'
# own. A JAX config state, so that it keys JAX's trace caches: a function traced for CPU
# and then exported for TPU is traced again (env FLAXATTN_LOWERING_PLATFORMS sets it too).
_LOWERING_FOR = jax_config.string_or_object_state(
    "flaxattn_lowering_platforms", "", "Platforms flaxattn traces kernels for (see"
    " flaxattn.lowering_for); empty: the platform of the devices the program runs on.",
    include_in_trace_context=True)


@contextlib.contextmanager
def lowering_for(*platforms: str):
  """Programs traced inside hold the attention kernels of `platforms` ("cpu", "gpu" or
  "cuda", "tpu") instead of those of the devices they run on: how a host exports a program
  for another platform, e.g. on a CPU host
  `with flaxattn.lowering_for("tpu"): jax.export.export(jax.jit(f), platforms=("tpu",))(x)`
  (compiled splash kernels). The tracing must happen inside. Several platforms: one program
  holds each one's kernel under `jax.lax.platform_dependent` (tracing costs each kernel's
  build).

  Raises:
    ValueError: no platform, or one not among cpu, gpu (cuda), tpu.
  """
  names = [LOWERING.get(p, p) for p in platforms]
  if not names or any(n not in PLATFORMS for n in names):
    raise ValueError(f"lowering_for expects one or more of {PLATFORMS} (or 'cuda'), got"
                     f" {platforms!r}; e.g. flaxattn.lowering_for('tpu').")
  with _LOWERING_FOR(",".join(dict.fromkeys(names))):
    yield


def lowering_platforms() -> tuple[str, ...]:
  """The platforms a program traced now holds kernels for (the first is its `Call`'s): those
  of `lowering_for`, else the platform of the devices it runs on (the mesh's devices under
  `jax.set_mesh`, else the default backend)."""
  chosen = _LOWERING_FOR.value
  if chosen:
    return tuple(LOWERING.get(p, p) for p in str(chosen).split(","))
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return (getattr(device, "platform", None) or jax.default_backend(),)


@dataclasses.dataclass(frozen=True)
class Call:
  """What a kernel may look at to decide whether it serves a call (all static)."""

  platform: str
  q_shape: tuple[int, ...]
  kv_shape: tuple[int, ...]
  dtype: str
  mask: Mask
  has_segment_ids: bool
  has_positions: bool
  return_lse: bool
  cp_size: int = 1  # devices the sequence is split over (context parallelism)
  cp_strategy: str | None = None  # "ring", "all_gather", "ulysses" or None
  ring_size: int | None = None  # Ulysses x ring: the ring's devices (of cp_size), else None
  has_sinks: bool = False  # applied outside the kernels (attention.apply_sinks): for the record
  soft_cap: float | None = None  # scores become soft_cap * tanh(scores / soft_cap)
  v_head_dim: int | None = None  # Dv of v `[B, S, Hkv, Dv]`; None: the same as q/k's D
  score_mod: ScoreMod | None = None  # a `flaxattn.ScoreMod` (hashed by identity)

  @property
  def dv(self) -> int:
    """The head dimension of v and of the output."""
    return self.q_shape[-1] if self.v_head_dim is None else self.v_head_dim

  @classmethod
  def of(cls, q, k, v, mask: Mask, layout: Layout, return_lse: bool, cp_size: int = 1,
         cp_strategy: str | None = None, ring_size: int | None = None, has_sinks: bool = False,
         soft_cap: float | None = None, score_mod: ScoreMod | None = None) -> Call:
    """The call of `flaxattn.attention` for these arguments, on the (first) platform it is
    lowered for (`lowering_platforms`)."""
    return cls(platform=lowering_platforms()[0], q_shape=tuple(q.shape), kv_shape=tuple(k.shape),
               dtype=str(np.dtype(q.dtype)), mask=mask,
               has_segment_ids=layout.q_segment_ids is not None,
               has_positions=layout.q_positions is not None or layout.kv_positions is not None,
               return_lse=return_lse, cp_size=cp_size, cp_strategy=cp_strategy,
               ring_size=ring_size, has_sinks=has_sinks, soft_cap=soft_cap,
               v_head_dim=None if v.shape[-1] == q.shape[-1] else v.shape[-1],
               score_mod=score_mod)

  def local(self) -> Call:
    """The call the kernel itself serves: under Ulysses a plain call on the whole sequence,
    or with a ring axis a ring over `ring_size` devices; other calls as they are."""
    if self.cp_strategy != "ulysses":
      return self
    ring = self.ring_size is not None
    return dataclasses.replace(self, cp_size=self.ring_size if ring else 1,
                               cp_strategy="ring" if ring else None, ring_size=None)

  def strategy_text(self) -> str:
    """The context parallelism in words, e.g. "ulysses over 2 x ring over 2 devices"."""
    if self.ring_size is None:
      return f"{self.cp_strategy} over {self.cp_size} devices"
    return (f"{self.cp_strategy} over {self.cp_size // self.ring_size} x ring over"
            f" {self.ring_size} devices")


class Kernel:
  """An attention kernel. Subclasses set `name` and implement `reason` and `__call__`;
  those with per-block passes for the ring strategy set `ring = True` and implement
  `ring_step` for it (a `flaxattn.ring.RingStep`)."""

  name: str = ""
  ring: bool = False
  # True: `__call__` and the per-device computation take `soft_cap=` (logit soft-capping).
  soft_cap: bool = False
  # True: the kernel serves masks with `flaxattn.MaskMod` parts (`Mask.needs_tiles`).
  mask_mod: bool = False
  # True: `__call__` and the per-device computation take `score_mod=` (a `flaxattn.ScoreMod`).
  score_mod: bool = False
  # False: tracing needs the platform's own libraries (cuDNN), so a program traced on
  # another platform's host cannot hold this kernel for it.
  traces_anywhere: bool = True

  def unsupported_reason(self, call: Call) -> str | None:
    """None if the kernel serves `call` (with its context parallelism), else why not.
    `reason` sees the call the kernel itself runs (`Call.local`): any kernel serves Ulysses
    without a ring axis, a plain call on the whole sequence."""
    local = call.local()
    reason = self.reason(local)
    if reason is None and call.soft_cap is not None and not self.soft_cap:
      able = [n for n in names() if get(n).soft_cap]
      reason = (f"{self.name} has no logit soft-capping (logit_soft_cap={call.soft_cap}); use"
                f" one of {able}.")
    if reason is None and call.mask.needs_tiles and not self.mask_mod:
      able = [n for n in names() if get(n).mask_mod]
      reason = (f"{self.name} has no programmable masks (mask {call.mask} holds a MaskMod); use"
                f" one of {able}.")
    if reason is None and call.score_mod is not None and not self.score_mod:
      able = [n for n in names() if get(n).score_mod]
      reason = (f"{self.name} has no score mods (score_mod={call.score_mod}); use one of"
                f" {able}.")
    if reason is None and local.cp_strategy == "ring" and not self.ring:
      able = [n for n in names() if get(n).ring]
      other = ("strategy='ulysses' without ring_axis" if call.cp_strategy == "ulysses" else
               "strategy='all_gather' or 'ulysses'")
      reason = (f"{self.name} has no per-block passes for the ring strategy; use {other}, or"
                f" one of {able}.")
    return reason

  def reason(self, call: Call) -> str | None:
    """The kernel's own limits: None, or a sentence saying what it cannot serve and why
    (`call` as the kernel runs it, `Call.local`)."""
    return None

  def describe(self, call: Call) -> str | None:
    """What `explain` adds after the kernel's name (e.g. a run-time check), or None
    (`call` as the kernel runs it, `Call.local`)."""
    return None

  def on(self, platform: str) -> Kernel:
    """This kernel with its options resolved for lowering on `platform` (e.g. splash's
    interpret mode off TPU)."""
    return self

  def for_tests_on(self, platform: str) -> str | None:
    """None, or why the kernel runs on `platform` for tests, not speed (a Pallas kernel in
    interpret mode off its own platform): "auto" and the aliases then pass it by, an
    explicit backend still runs it."""
    return None

  def __call__(self, q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool):
    """Attention `[B, T, H, Dv]` (and log-sum-exp `[B, T, H]` float32 with `return_lse`).
    Kernels with `soft_cap = True` also take `soft_cap=` (a float or None)."""
    raise NotImplementedError

  def passes(self, mask: Mask, scale: float, soft_cap: float | None = None):
    """The kernel's forward and backward passes without autodiff rules, as
    `flaxattn.checked.Passes`: what a kernel exact only for some data runs on a batch it
    cannot serve. None: the kernel has none to offer (it is itself exact only for some
    data, or has no backward of its own)."""
    return None

  def ring_step(self, *, strategy: str, mask: Mask, scale: float, shards: int, axis: str,
                load_balance: bool, q_shape, kv_shape, layout: Layout,
                soft_cap: float | None = None, score_mod: ScoreMod | None = None) -> RingStep:
    """The per-device computation of context-parallel attention (a `flaxattn.ring.RingStep`)
    for `strategy` "ring" (also Ulysses x ring's, over the ring axis) or "all_gather" over
    `shards` devices of mesh axis `axis`, for global shapes q `[B, T, H, D]` and k/v
    `kv_shape` with the call's `layout` (default positions not yet materialized), tokens in
    row order when `load_balance`; `soft_cap` only for kernels with `soft_cap = True`,
    `score_mod` only for kernels with `score_mod = True`.
    Ulysses alone calls the kernel itself. The default serves "all_gather", the one strategy
    that `unsupported_reason` lets through without `ring`, by calling the kernel on the
    gathered keys."""
    return Gathered(self, mask, scale, soft_cap, score_mod)


def register(kernel: Kernel, *, platforms=(), before: str | None = None,
             after: str | None = None) -> None:
  """Adds `kernel` (replacing one of the same name) and places it in each platform's row of
  `BACKENDS`: before or after the named kernel, else last.

  Raises:
    ValueError: not a `Kernel`, both `before` and `after`, or a platform's row without them.
  """
  if not isinstance(kernel, Kernel) or not kernel.name:
    raise ValueError(f"register expects a named flaxattn.registry.Kernel, got {kernel!r}.")
  if before is not None and after is not None:
    raise ValueError(f"register expects before= or after=, not both (got {before!r}, {after!r}).")
  for platform in platforms:
    row = BACKENDS.setdefault(platform, [])
    if kernel.name in row:
      row.remove(kernel.name)
    anchor = before or after
    if anchor is None:
      row.append(kernel.name)
    elif anchor not in row:
      raise ValueError(f"register(..., {'before' if before else 'after'}={anchor!r}) expects a"
                       f" kernel of the {platform} row {row}.")
    else:
      row.insert(row.index(anchor) + (after is not None), kernel.name)
  _KERNELS[kernel.name] = kernel


def names() -> list[str]:
  """The registered kernels' names."""
  return sorted(set(_BUILTIN) | set(_KERNELS))


def kernel_modules() -> dict[str, str]:
  """The built-in kernels' modules by short name ("splash": "flaxattn.splash"), for
  `flaxattn.<name>` to load on first use."""
  modules = (spec.split(":")[0] for spec in _BUILTIN.values())
  return {m.rsplit(".", 1)[1]: m for m in modules}


def backend_names() -> list[str]:
  """Every string `backend=` takes: "auto", the aliases and the kernel names."""
  return ["auto", *ALIASES, *names()]


def get(name: str) -> Kernel:
  """The kernel called `name`, its module imported on first use."""
  if name not in _KERNELS:
    module, cls = _BUILTIN[name].split(":")
    _KERNELS[name] = getattr(importlib.import_module(module), cls)()
  return _KERNELS[name]


def order(platform: str) -> list[str]:
  return BACKENDS.get(platform, BACKENDS["cpu"])


def reasons(call: Call, kernels=None) -> dict[str, str | None]:
  """Each kernel's answer for `call` (every registered one by default): None or why not."""
  return {name: get(name).unsupported_reason(call) for name in (kernels or names())}


def _passed_by(kernel: Kernel, call: Call, traced_here: bool = False) -> str | None:
  """Why "auto" and the aliases pass `kernel` by for `call`, or None if they may take it."""
  reason = kernel.unsupported_reason(call)
  if reason is not None:
    return f"declines: {reason}"
  slow = kernel.for_tests_on(call.platform)
  if slow is not None:
    return f"passed by ({slow}; backend={kernel.name!r} runs it)"
  if traced_here and not kernel.traces_anywhere:
    return f"passed by (needs {call.platform}'s libraries while tracing)"
  return None


def _first(candidates, call: Call, backend, traced_here: bool = False) -> Kernel:
  passed = []  # kernels that serve the call but cannot be traced on this host
  for name in candidates:
    kernel = get(name)
    if _passed_by(kernel, call, traced_here) is None:
      if passed:
        log.warning("%s substituted for %s on %s: %s needs its platform's libraries while"
                    " tracing, and this host is %s; q %s, k/v %s, mask %s", kernel.name,
                    passed[0], call.platform, passed[0], jax.default_backend(), call.q_shape,
                    call.kv_shape, call.mask)
      return kernel
    if kernel.unsupported_reason(call) is None and kernel.for_tests_on(call.platform) is None:
      passed.append(name)
  raise ValueError(f"backend={backend!r}: no kernel serves this call on {call.platform}:\n"
                   + "\n".join(f"  {n}: {_passed_by(get(n), call, traced_here) or 'accepts'}"
                               for n in candidates))


class BackendError(ValueError):
  """An explicit backend that cannot serve a call (a ValueError, as before: callers that
  catch those keep working; a trainer tells it from other errors by its type)."""


def select(backend, call: Call, traced_here: bool = False) -> Kernel:
  """The kernel that serves `call` for `backend`: "auto", an alias ("fused"), a kernel name,
  or a kernel object (how a kernel's options, e.g. splash block sizes, are set).
  `traced_here`: the call's platform is not this process's, so "auto" and aliases skip
  kernels that cannot be traced here.

  Raises:
    ValueError: unknown backend; `BackendError`: an explicit backend that cannot serve the
      call.
  """
  if isinstance(backend, Kernel):
    kernel = backend
  elif backend == "auto":
    return _first(order(call.platform), call, backend, traced_here)
  elif backend in ALIASES:
    return _first(ALIASES[backend], call, backend, traced_here)
  elif isinstance(backend, str) and backend in names():
    kernel = get(backend)
  else:
    raise ValueError(f"backend expects one of {backend_names()} or a kernel"
                     f" object (e.g. flaxattn.splash.Splash(block_q=256)), got {backend!r}.")
  reason = kernel.unsupported_reason(call)
  if reason is not None:
    able = [n for n, r in reasons(call).items() if r is None]
    raise BackendError(f"backend={backend!r} cannot serve this call: {reason} Kernels that can:"
                     f" {able or 'none'}; or pass backend='auto'.")
  return kernel


def per_platform(backend, call: Call) -> dict[str, Kernel]:
  """The kernel of each platform the program is lowered for (`lowering_platforms`; the
  first is `call.platform`), keyed by `LOWERING` name and resolved for it (`Kernel.on`):
  only these are traced. A platform other than this process's backend skips kernels that
  cannot be traced here (`traces_anywhere = False`).

  Raises:
    ValueError: as `select`, or an explicit kernel that cannot be traced on this host.
  """
  here = jax.default_backend()
  kernels = {}
  for platform in lowering_platforms():
    away = platform != here
    kernel = select(backend, dataclasses.replace(call, platform=platform), traced_here=away)
    if away and not kernel.traces_anywhere:
      raise ValueError(f"backend={backend!r}: {kernel.name} needs its platform's libraries"
                       f" while tracing, so a {here} host cannot trace it for {platform}; trace"
                       f" on a {platform} host, or pass backend='auto'.")
    kernels[lowering_name(platform)] = kernel.on(platform)
  return kernels


def lowering_name(platform: str) -> str:
  """The `LOWERING` name of a registry platform ("gpu" -> "cuda")."""
  return {v: k for k, v in LOWERING.items()}[platform]


def _format_reasons(answers: dict[str, str | None]) -> str:
  return "\n".join(f"  {n}: {'accepts' if r is None else 'declines: ' + r}"
                   for n, r in answers.items())


def _resolve(backend, call: Call) -> str:
  """What `backend` runs for `call`: the kernel's name, what it adds (`describe`), and for
  "auto" or an alias why the kernels before it declined."""
  try:
    kernel = select(backend, call)
  except ValueError as e:
    return f"error: {e}"
  notes = [kernel.describe(call.local())]
  if isinstance(backend, str) and (backend == "auto" or backend in ALIASES):
    candidates = order(call.platform) if backend == "auto" else ALIASES[backend]
    notes += [f"{n} {_passed_by(get(n), call)}"
              for n in candidates[:candidates.index(kernel.name)]]
  notes = [n for n in notes if n]
  return kernel.name + (f" ({'; '.join(notes)})" if notes else "")


def describe(backend, call: Call) -> str:
  """Human-readable account of how `backend` resolves for `call` on its platform (every
  kernel's answer), then what it would run on each platform."""
  cp = f"; context parallel: {call.strategy_text()}" if call.cp_strategy else ""
  extras = "".join([f"; v head_dim {call.dv}" if call.v_head_dim is not None else "",
                    f"; logit_soft_cap {call.soft_cap}" if call.soft_cap is not None else "",
                    f"; score_mod {call.score_mod}" if call.score_mod is not None else "",
                    "; sinks (applied to every kernel's out and lse)" if call.has_sinks else ""])
  lines = [f"platform: {call.platform}; q {call.q_shape}, k/v {call.kv_shape}, {call.dtype};"
           f" mask {call.mask}; segment_ids: {call.has_segment_ids};"
           f" positions: {call.has_positions}{cp}{extras}",
           f"order on {call.platform}: {order(call.platform)}",
           _format_reasons(reasons(call)),
           f"backend={backend!r} -> {_resolve(backend, call)}",
           f"per platform, backend={backend!r}:"]
  lines += [f"  {p}: {_resolve(backend, dataclasses.replace(call, platform=p))}" for p in PLATFORMS]
  try:
    traced = per_platform(backend, call)
  except ValueError as e:
    return "\n".join(lines + [f"a program traced now: error: {e}"])
  why = ("set by flaxattn.lowering_for" if _LOWERING_FOR.value else "the platform of the devices"
         " it runs on; flaxattn.lowering_for(...) to lower for another")
  lines.append(f"a program traced now holds kernels for ({why}): "
               + ", ".join(f"{LOWERING[p]}: {k.name}" for p, k in traced.items()))
  return "\n".join(lines)
