"""Throughput of a run: tokens/s, model TFLOP/s per device and MFU (model FLOPs utilization).

Model FLOPs of a step come from its batch (`Flops.of`, on the host as the batch is made):
forward and backward, 6 x the matmul parameters per token that is not padding, plus
12 x heads x head_dim per (query, key) pair that a layer's mask and the documents allow
(QK^T and PV), counted per document in closed form from each mask's normal form (a
document's sum of `flaxattn.balance.token_work`). Not counted: the embedding lookup,
norms, RoPE, softmax, activations, residual adds, rematerialization.
`models.llama.flops_per_token` counts each row as one causal document, which for packed
rows is an upper bound of the attention term, not what the step does.

MFU = model FLOPs per second per device / the device's dense peak FLOP/s. The peak comes
from, in order: the config key `peak_tflops_per_device`; the chip's in
`flaxattn.aot.TARGETS`, or `PEAK_TFLOPS`, by the device's kind; on CPU (no table entry: its
peak depends on the host and on what else runs there) float32 matmuls timed once at start
on all the run's devices at once, one each, so that simulated devices share the host's
cores as the training step's do; named "measured" in every line that uses it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxattn import aot
from flaxattn.masks import Mask, band
from models.llama import Llama

log = logging.getLogger(__name__)

# Dense bf16 peak TFLOP/s per device (chip or GPU), without sparsity, from the vendors' spec
# sheets, of the kinds `flaxattn.aot.TARGETS` does not hold (its chips' figures come from
# there). Matched against `jax.Device.device_kind` in this order (first match wins).
PEAK_TFLOPS = (
    ("TPU v4", 275.0),
    ("B200", 2250.0),
    ("A100", 312.0),         # the 40 GB card
)


def document_lengths(segment_ids) -> np.ndarray:
  """The token count of each document of `[..., T]` segment ids, in order: a document is a
  run of one non-zero id within a row. int64 `[documents]`."""
  ids = np.asarray(segment_ids)
  ids = ids.reshape(-1, ids.shape[-1])
  change = np.ones(ids.shape, bool)
  change[:, 1:] = ids[:, 1:] != ids[:, :-1]
  starts = np.flatnonzero(change)  # every row starts a run, so none spans two rows
  lengths = np.diff(np.append(starts, ids.size))
  return lengths[ids.reshape(-1)[starts] != 0].astype(np.int64)


class Flops:
  """Training FLOPs of `model` (a `models.llama.Llama`, real or abstract) on a batch, with
  `masks`, one per layer (`models.llama.layer_masks`); see the module docstring."""

  def __init__(self, model: Llama, masks: Sequence[Mask]):
    c = model.config
    # The Linear kernels, and the embedding where it is also the output projection; the
    # embedding lookup is no matmul.
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    kernels = sum(math.prod(leaf.shape) for path, leaf in
                  jax.tree_util.tree_leaves_with_path(params)
                  if getattr(path[-1], "key", None) == "kernel")
    tied = c.vocab_size * c.dim if c.tie_embeddings else 0
    self.per_token = 6.0 * (kernels + tied)
    self.per_pair = 12.0 * c.n_heads * c.attn_head_dim
    self.layers = collections.Counter(band(m) for m in masks)

  def of(self, segment_ids) -> float:
    """FLOPs of a batch of `[..., T]` segment ids, in O(documents) after one pass over the
    ids."""
    n = document_lengths(segment_ids)
    allowed = sum(count * int(normal.pairs(n).sum()) for normal, count in self.layers.items())
    return self.per_token * float(n.sum()) + self.per_pair * float(allowed)


@dataclasses.dataclass(frozen=True)
class Peak:
  """Peak FLOP/s of one device and where the number comes from."""

  flops: float
  source: str  # "config", "table" or "measured"


def measure_matmul_flops(mesh, size: int = 1024, repeats: int = 5) -> float:
  """FLOP/s per device of float32 `size`^3 matmuls, one on each device of `mesh`, all at
  once (best of `repeats`)."""
  stacked = NamedSharding(mesh, P(mesh.axis_names))
  x = jax.jit(lambda: jnp.ones((mesh.size, size, size), jnp.float32), out_shardings=stacked)()
  mm = jax.jit(lambda x: x @ x)
  mm(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    mm(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size**3 / best


def peak(mesh, configured_tflops: float) -> Peak | None:
  """The peak FLOP/s of one device of `mesh`: `configured_tflops` if > 0, else its chip's
  (`flaxattn.aot.chip_of`) or the `PEAK_TFLOPS` entry of its kind, else on CPU measured
  (`measure_matmul_flops` on the whole mesh); None (MFU not reported, logged once) for an
  accelerator with no entry."""
  if configured_tflops > 0:
    return Peak(configured_tflops * 1e12, "config")
  device = mesh.devices.flat[0]
  chip = aot.chip_of(device.device_kind)
  if chip is not None:
    return Peak(chip.peak_flops, "table")
  for name, tflops in PEAK_TFLOPS:
    if name.lower() in device.device_kind.lower():
      return Peak(tflops * 1e12, "table")
  if device.platform == "cpu":
    return Peak(measure_matmul_flops(mesh), "measured")
  log.warning("no peak FLOP/s known for device kind %r: MFU is not reported; set"
              " peak_tflops_per_device to the device's dense peak TFLOP/s.", device.device_kind)
  return None


@dataclasses.dataclass(frozen=True)
class Rates:
  """How to turn tokens, FLOPs and seconds into throughput numbers, over `devices`
  devices of peak `peak` each (None: unknown)."""

  devices: int
  peak: Peak | None

  def of(self, tokens: float, flops: float, seconds: float) -> dict:
    """tokens_per_s, tokens_per_s_per_device, tflops_per_device and mfu (None without a
    peak) of `tokens` and `flops` trained in `seconds`."""
    per_device = flops / seconds / self.devices
    return {"tokens_per_s": tokens / seconds, "tokens_per_s_per_device":
            tokens / seconds / self.devices, "tflops_per_device": per_device / 1e12,
            "mfu": None if self.peak is None else per_device / self.peak.flops}


def format_step(step: int, steps: int, m: dict, peak: Peak | None) -> str:
  """The log line of a training step's metrics `m` (from the loop and `Rates.of`)."""
  mfu = "MFU n/a" if m["mfu"] is None or peak is None else (
      f"MFU {100 * m['mfu']:.2f}% (peak {peak.flops / 1e12:.3g} TFLOP/s/device, {peak.source})")
  return (f"step {step}/{steps} | loss {m['loss']:.4f} | grad_norm {m['grad_norm']:.3f}"
          f" | lr {m['lr']:.3e} | tokens/s {m['tokens_per_s']:,.0f}"
          f" | tokens/s/device {m['tokens_per_s_per_device']:,.0f}"
          f" | TFLOP/s/device {m['tflops_per_device']:.4g} | {mfu}"
          f" | step {m['step_time']:.3f} s (host {m['host_time']:.3f} s, dispatch"
          f" {m['dispatch_time']:.3f} s)")
