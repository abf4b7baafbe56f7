"""The "fused" kernel: cuDNN's fused attention on GPU where it serves the call, the
blockwise (flash) kernel written in JAX everywhere else.

Which one runs is decided per call, statically, by `cudnn_unsupported_reason`; when cuDNN
declines on a GPU the reason is what `flaxattn.explain` prints next to the blockwise
fallback. Context parallelism always runs the blockwise passes: cuDNN masks by token index,
which load balancing permutes.
"""

from __future__ import annotations

import dataclasses

from flaxattn import registry
from flaxattn.blockwise import blockwise_attention
from flaxattn.cudnn import cudnn_attention, cudnn_unsupported_reason
from flaxattn.layout import Layout
from flaxattn.masks import Mask

CP_REASON = ("under context parallelism the blockwise passes run per block (cuDNN masks by"
             " token index, which load balancing permutes).")


@dataclasses.dataclass(frozen=True)
class Fused:
  """`backend="fused"`: accepts every call; see the module docstring for which kernel runs."""

  name: str = "fused"

  def unsupported_reason(self, call: registry.Call) -> str | None:
    return None

  def implementation(self, call: registry.Call) -> tuple[str, str | None]:
    """("cudnn" or "blockwise", why cuDNN declines where a GPU would otherwise use it)."""
    if call.platform != "gpu":
      return "blockwise", None
    reason = CP_REASON if call.cp_size > 1 else cudnn_unsupported_reason(call)
    return ("blockwise", reason) if reason else ("cudnn", None)

  def describe(self, call: registry.Call) -> str:
    impl, reason = self.implementation(call)
    return impl if reason is None else f"{impl}; cuDNN declines: {reason}"

  def __call__(self, q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool):
    """Attention `[B, T, H, D]` (and lse `[B, T, H]` float32); see `flaxattn.attention`."""
    call = registry.Call.of(q, k, mask, layout, return_lse)
    kernel = cudnn_attention if self.implementation(call)[0] == "cudnn" else blockwise_attention
    return kernel(q, k, v, layout, mask=mask, scale=scale, return_lse=return_lse)
