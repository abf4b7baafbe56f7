"""Throughput of a run: tokens/s, TFLOP/s per device and MFU (model FLOPs utilization).

MFU = model FLOPs per second per device / the device's dense peak FLOP/s. Model FLOPs per
token are `models.llama.flops_per_token` at the trained `seq_len` (matmuls and attention,
forward and backward; no rematerialization counted). The peak comes from, in order:
the config key `peak_tflops_per_device`; `PEAK_TFLOPS` by the device's kind; on CPU (no
table entry: its peak depends on the host and on what else runs there) a float32 matmul
timed once at start on one device, named "measured" in every line that uses it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

# Dense bf16 peak TFLOP/s per device (chip or GPU), without sparsity, from the vendors'
# spec sheets. Matched against `jax.Device.device_kind` in this order (first match wins).
PEAK_TFLOPS = (
    ("TPU v6 lite", 918.0),  # Trillium (v6e)
    ("TPU v6e", 918.0),
    ("TPU v5 lite", 197.0),  # v5e
    ("TPU v5e", 197.0),
    ("TPU v5p", 459.0),
    ("TPU v5", 459.0),       # v5p reports "TPU v5"
    ("TPU v4", 275.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100", 989.0),         # SXM; the PCIe card is lower: set peak_tflops_per_device
    ("A100", 312.0),
)


@dataclasses.dataclass(frozen=True)
class Peak:
  """Peak FLOP/s of one device and where the number comes from."""

  flops: float
  source: str  # "config", "table" or "measured"


def measure_matmul_flops(size: int = 1024, repeats: int = 5) -> float:
  """FLOP/s of a float32 `size`^3 matmul on the default device (best of `repeats`)."""
  a = jnp.ones((size, size), jnp.float32)
  mm = jax.jit(lambda x: x @ x)
  mm(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    mm(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size**3 / best


def peak(device_kind: str, platform: str, configured_tflops: float) -> Peak | None:
  """The peak FLOP/s of one device: `configured_tflops` if > 0, else the `PEAK_TFLOPS`
  entry of `device_kind`, else on CPU a measured float32 matmul; None (MFU not reported,
  logged once) for an accelerator with no entry."""
  if configured_tflops > 0:
    return Peak(configured_tflops * 1e12, "config")
  for name, tflops in PEAK_TFLOPS:
    if name.lower() in device_kind.lower():
      return Peak(tflops * 1e12, "table")
  if platform == "cpu":
    return Peak(measure_matmul_flops(), "measured")
  log.warning("no peak FLOP/s known for device kind %r: MFU is not reported; set"
              " peak_tflops_per_device to the device's dense peak TFLOP/s.", device_kind)
  return None


@dataclasses.dataclass(frozen=True)
class Rates:
  """How to turn a step's tokens and time into throughput numbers.

  flops_per_token: model FLOPs per trained token; devices: devices of the run;
  peak: per-device peak, or None.
  """

  flops_per_token: float
  devices: int
  peak: Peak | None

  def of(self, tokens: float, seconds: float) -> dict:
    """tokens_per_s, tokens_per_s_per_device, tflops_per_device and mfu (None without a
    peak) of `tokens` trained in `seconds`."""
    per_s = tokens / seconds
    flops = self.flops_per_token * per_s / self.devices
    return {"tokens_per_s": per_s, "tokens_per_s_per_device": per_s / self.devices,
            "tflops_per_device": flops / 1e12,
            "mfu": None if self.peak is None else flops / self.peak.flops}


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
