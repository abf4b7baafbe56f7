"""Kernel registry: which attention kernels exist, on which platforms, in which order.

Each kernel states whether it can serve a call and, if not, why. `backend="auto"` takes
the first kernel of the platform's list that accepts the call; an explicit backend that
declines raises an error naming its reason and the kernels that would accept.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax
import numpy as np

from flaxattn.layout import Layout
from flaxattn.masks import Mask


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

  @classmethod
  def of(cls, q, k, mask: Mask, layout: Layout, return_lse: bool, cp_size: int = 1) -> Call:
    """The call of `flaxattn.attention` on the current platform for these arguments."""
    return cls(platform=current_platform(), q_shape=tuple(q.shape), kv_shape=tuple(k.shape),
               dtype=str(np.dtype(q.dtype)), mask=mask,
               has_segment_ids=layout.q_segment_ids is not None,
               has_positions=layout.q_positions is not None or layout.kv_positions is not None,
               return_lse=return_lse, cp_size=cp_size)


class Kernel(Protocol):
  name: str

  def unsupported_reason(self, call: Call) -> str | None:
    """None if the kernel serves `call`, else a sentence saying why not."""

  def __call__(self, q, k, v, layout, *, mask: Mask, scale: float, return_lse: bool):
    """Attention `[B, T, H, D]` (and log-sum-exp `[B, T, H]` float32 with `return_lse`)."""


@dataclasses.dataclass(frozen=True)
class FunctionKernel:
  """A kernel made of a function and a support predicate."""

  name: str
  fn: Callable
  reason_fn: Callable[[Call], str | None] = lambda call: None

  def unsupported_reason(self, call: Call) -> str | None:
    return self.reason_fn(call)

  def __call__(self, q, k, v, layout, *, mask, scale, return_lse):
    return self.fn(q, k, v, layout, mask=mask, scale=scale, return_lse=return_lse)


_KERNELS: dict[str, Kernel] = {}
# Preference per platform, fastest first. Platforms not listed use "default".
_ORDER: dict[str, list[str]] = {"default": []}


def register(kernel: Kernel, *, platforms: dict[str, int] | None = None) -> None:
  """Adds `kernel`; `platforms` maps platform name ("cpu", "gpu", "tpu", "default")
  to its rank in that platform's list (lower is preferred)."""
  _KERNELS[kernel.name] = kernel
  for platform, rank in (platforms or {"default": 100}).items():
    order = _ORDER.setdefault(platform, [])
    if kernel.name in order:
      order.remove(kernel.name)
    order.insert(min(rank, len(order)), kernel.name)


def names() -> list[str]:
  return sorted(_KERNELS)


def order(platform: str) -> list[str]:
  return _ORDER.get(platform, _ORDER["default"]) or _ORDER["default"]


def current_platform() -> str:
  return jax.default_backend()


def reasons(call: Call) -> dict[str, str | None]:
  """Every registered kernel's answer for `call`: None (accepts) or why not."""
  return {name: _KERNELS[name].unsupported_reason(call) for name in names()}


def select(backend, call: Call) -> Kernel:
  """The kernel that serves `call` for `backend` ("auto", a kernel name or a kernel object,
  which is how a kernel's options such as splash block sizes are set).

  Raises:
    ValueError: unknown backend, or an explicit backend that cannot serve the call.
  """
  if not isinstance(backend, str):
    if not hasattr(backend, "unsupported_reason"):
      raise ValueError(f"backend expects 'auto', a kernel name in {names()} or a kernel object"
                       f" (e.g. flaxattn.splash.Splash(block_q=256)), got {backend!r}.")
    reason = backend.unsupported_reason(call)
    if reason is not None:
      raise ValueError(f"backend={backend!r} cannot serve this call: {reason}")
    return backend
  if backend == "auto":
    for name in order(call.platform):
      if _KERNELS[name].unsupported_reason(call) is None:
        return _KERNELS[name]
    raise ValueError(f"backend='auto': no kernel serves this call on {call.platform}:\n"
                     + _format_reasons(reasons(call)))
  if backend not in _KERNELS:
    raise ValueError(f"backend expects 'auto' or one of {names()}, got {backend!r}.")
  reason = _KERNELS[backend].unsupported_reason(call)
  if reason is not None:
    able = [n for n, r in reasons(call).items() if r is None]
    raise ValueError(
        f"backend={backend!r} cannot serve this call: {reason} "
        f"Kernels that can: {able or 'none'}; or pass backend='auto'.")
  return _KERNELS[backend]


def _format_reasons(answers: dict[str, str | None]) -> str:
  return "\n".join(f"  {n}: {'accepts' if r is None else 'declines: ' + r}"
                   for n, r in answers.items())


PLATFORMS = ("cpu", "gpu", "tpu")


def _resolve(backend, call: Call) -> str:
  """What `backend` runs for `call`: a kernel name, with the kernel's own account of which
  implementation it uses where it has several (e.g. "fused (cudnn)")."""
  try:
    kernel = select(backend, call)
  except ValueError as e:
    return f"error: {e}"
  detail = kernel.describe(call) if hasattr(kernel, "describe") else None
  return kernel.name if detail is None else f"{kernel.name} ({detail})"


def describe(backend, call: Call) -> str:
  """Human-readable account of how `backend` resolves for `call` on its platform (every
  kernel's answer), then what it would run on each platform."""
  lines = [f"platform: {call.platform}; q {call.q_shape}, k/v {call.kv_shape}, {call.dtype};"
           f" mask {call.mask}; segment_ids: {call.has_segment_ids};"
           f" positions: {call.has_positions}"
           + (f"; context parallel over {call.cp_size} devices" if call.cp_size > 1 else ""),
           f"order on {call.platform}: {order(call.platform)}"]
  lines.append(_format_reasons(reasons(call)))
  lines.append(f"backend={backend!r} -> {_resolve(backend, call)}")
  lines.append(f"per platform, backend={backend!r}:")
  lines += [f"  {p}: {_resolve(backend, dataclasses.replace(call, platform=p))}" for p in PLATFORMS]
  return "\n".join(lines)
