"""flaxattn: attention for long-context training in JAX and Flax NNX.

Public API:
  attention, explain                     the functional entry point and its dispatch report
  lowering_for                           trace kernels for another platform (TPU export on CPU)
  Full, Causal, Local, Window, Chunked,  masks on positions and segments (combine with &, |, ~)
    Mask
  MaskMod, ScoreMod                      programmable masks and scores (JAX functions of the
                                         batch row, head and token indices, as in FlexAttention)
  seqlens_and_offsets                    THD descriptor from segment ids, O(T + max_segments)
  MultiHeadAttention, RoPE, RoPEScaling  NNX layer (a drop-in for flax.nnx.MultiHeadAttention),
                                         rotary embeddings with Hugging Face rope_scaling
                                         (linear, llama3, yarn)
  KVCache                                the layer's decode state (`init_cache`) as one object
  nnx_attention_fn                       flaxattn kernels inside stock nnx.MultiHeadAttention
  ContextParallel, load_balance,         ring / all-gather / Ulysses (and Ulysses x ring) attention
    unload_balance                       over a sharded sequence, and the load-balanced token order
  balance_plan, BalancePlan              (row: dual chunk; per document, weighed by the masks)
  sharding                               default logical-axis rules for (data, fsdp, tensor,
                                         context_ring, context)
  selftest                               every kernel against the reference on this machine,
                                         and timings
"""

from flaxattn import sharding
from flaxattn.attention import attention, explain
from flaxattn.balance import BalancePlan, balance_plan, load_balance, unload_balance
from flaxattn.context_parallel import ContextParallel
from flaxattn.kv_cache import KVCache
from flaxattn.layer import MultiHeadAttention
from flaxattn.masks import Causal, Chunked, Full, Local, Mask, Window
from flaxattn.mods import MaskMod, ScoreMod
from flaxattn.registry import lowering_for
from flaxattn.rope import RoPE, RoPEScaling
from flaxattn.segments import SeqlensOffsets, seqlens_and_offsets
from flaxattn.stock_nnx import nnx_attention_fn

__all__ = [
    "attention", "explain", "lowering_for",
    "Mask", "Full", "Causal", "Local", "Window", "Chunked", "MaskMod", "ScoreMod",
    "seqlens_and_offsets", "SeqlensOffsets",
    "ContextParallel", "load_balance", "unload_balance", "balance_plan", "BalancePlan",
    "MultiHeadAttention", "KVCache", "RoPE", "RoPEScaling", "nnx_attention_fn", "sharding",
    # Loaded on first use by __getattr__ below, which pyright does not follow.
    "selftest",  # pyright: ignore[reportUnsupportedDunderAll]
]


def __getattr__(name):
  # The registry's kernel modules load on first use (`flaxattn.splash.Splash`): some use
  # JAX private APIs. So does `flaxattn.selftest` (callable: `flaxattn.selftest(quick=True)`).
  from flaxattn import registry  # pylint: disable=import-outside-toplevel
  modules = {**registry.kernel_modules(), "selftest": "flaxattn.selftest"}
  if name in modules:
    import importlib  # pylint: disable=import-outside-toplevel
    return importlib.import_module(modules[name])
  raise AttributeError(f"module 'flaxattn' has no attribute {name!r}")
