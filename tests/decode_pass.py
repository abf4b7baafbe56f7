"""An adversarial pass over decode: every kernel the registry says serves a decode step, in
the layer on one device and with the cache sharded over 4 devices (context parallelism),
against the layer with `backend="reference"` on one device fed the same tokens.

  python tests/decode_pass.py [--devices 1 4]

Each case is a prompt (packed documents and padding where the case says so; run with
`backend="auto"`, on 4 devices a prefill with the case's strategy), then decode calls of
1, 3, 1, 5 and 2 tokens with the kernel, defaults continuing the last document. Prints, per
kernel, devices and case, the worst error of the calls relative to the largest reference
output magnitude; then the counts and the worst error overall, and exits 1 past `TOL`. It
sets 8 simulated CPU devices before JAX starts. 8 minutes on a shared 2-core host, so a
script beside the tests (as cp_check.py), not a test.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import flaxattn  # noqa: E402
import helpers  # noqa: E402
from flaxattn import registry  # noqa: E402
from helpers import normal  # noqa: E402

E = 32
STEPS = (1, 3, 1, 5, 2)  # none a multiple of 8: decode steps, never a prefill, on 4 devices
TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  mask: flaxattn.Mask
  heads: int = 4
  kv_heads: int = 2
  prompt: int = 16
  packed: bool = False  # two documents and two padding tokens in the prompt
  sinks: bool = False
  soft_cap: float | None = None
  strategy: str = "ring"
  dtype: str = "float32"  # the cache's

  @property
  def slots(self) -> int:
    return self.prompt + sum(STEPS) + 4  # a multiple of 4: the cache divides over 4 devices


CASES = [
    Case("causal", flaxattn.Causal()),
    Case("local5-packed-mqa", flaxattn.Local(5), kv_heads=1, packed=True, strategy="all_gather"),
    Case("chunked4-sinks-softcap", flaxattn.Chunked(4), sinks=True, soft_cap=4.0,
         strategy="ulysses"),
    Case("causal-bf16-cache-packed", flaxattn.Causal(), packed=True, dtype="bfloat16"),
]


def decode_kernels(case: Case, devices: int) -> dict[str, str | None]:
  """Every registered kernel's answer for the case's decode step (T = 1 against its
  cache, or one device's shard of it), as the layer asks: None where it serves."""
  d = E // case.heads
  call = registry.Call(platform=jax.default_backend(), q_shape=(1, 1, case.heads, d),
                       kv_shape=(1, case.slots // devices, case.kv_heads, d),
                       dtype="float32", mask=case.mask, has_segment_ids=True,
                       has_positions=True, return_lse=devices > 1 or case.sinks,
                       has_sinks=case.sinks, soft_cap=case.soft_cap)
  return registry.reasons(call)


def _layer(case: Case, backend, cp=None):
  m = flaxattn.MultiHeadAttention(
      case.heads, E, num_kv_heads=case.kv_heads, mask=case.mask, rope=flaxattn.RoPE(),
      sinks=case.sinks, logit_soft_cap=case.soft_cap, backend=backend, context_parallel=cp,
      rngs=nnx.Rngs(0))
  if case.sinks:
    m.sinks[...] = jnp.linspace(-1.0, 1.0, case.heads)
  return m


@nnx.jit
def _call(m, x, seg, pos):
  return m(x, decode=True, segment_ids=seg, positions=pos)


def _inputs(case: Case):
  """[(x, segment ids, positions)] of the prompt and of each decode call."""
  x = normal((1, case.prompt + sum(STEPS), E), 7)
  seg = pos = None
  if case.packed:  # documents of 6 and 8 tokens, then two padding tokens
    seg = np.array([[1] * 6 + [2] * 8 + [0] * 2], np.int32)
    pos = np.array([list(range(6)) + list(range(8)) + [0, 0]], np.int32)
  calls = [(x[:, :case.prompt], seg, pos)]
  start = case.prompt
  for i, t in enumerate(STEPS):
    if case.packed and i == 0:  # after padding, defaults have no document to continue
      ids = (np.full((1, t), 2, np.int32), np.array([[8]], np.int32))
    else:
      ids = (None, None)
    calls.append((x[:, start:start + t], *ids))
    start += t
  return calls


def _run(m, calls, backend, shards: int = 1) -> list[np.ndarray]:
  """The outputs of the calls, the prompt with `backend="auto"`. Over `shards` devices the
  prompt is a load-balanced prefill: its arrays go in `flaxattn.load_balance` order."""
  def order(x):
    return x if shards == 1 or x is None else flaxattn.load_balance(x, shards)

  outs = []
  for i, (x, seg, pos) in enumerate(calls):
    m.backend = "auto" if i == 0 else backend
    if i == 0:
      out = _call(m, order(x), *(None if a is None else jnp.asarray(order(a)) for a in (seg, pos)))
      outs.append(np.asarray(out if shards == 1 else flaxattn.unload_balance(out, shards)))
    else:
      outs.append(np.asarray(_call(m, x, seg, pos), np.float32))
  return outs


def run_case(case: Case, kernel: str, devices: int, want, params) -> float:
  """The worst error of the kernel's decode calls against `want`, relative to the largest
  reference magnitude."""
  calls = _inputs(case)
  if devices == 1:
    m = _layer(case, kernel)
    nnx.update(m, params)
    m.init_cache((1, case.slots, E), jnp.dtype(case.dtype))
    got = _run(m, calls, kernel)
  else:
    mesh = helpers.mesh({"context": devices})
    with jax.set_mesh(mesh):
      m = _layer(case, kernel, flaxattn.ContextParallel(strategy=case.strategy))
      nnx.update(m, params)
      m.init_cache((1, case.slots, E), jnp.dtype(case.dtype))
      got = _run(m, calls, kernel, devices)
  scale = max(float(np.abs(w).max()) for w in want)
  return max(float(np.abs(g - w).max()) for g, w in zip(got[1:], want[1:], strict=True)) / scale


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 4])
  args = parser.parse_args()
  results = []
  declined = {}
  for case in CASES:
    ref = _layer(case, "reference")
    ref.init_cache((1, case.slots, E), jnp.dtype(case.dtype))
    params = nnx.state(ref, nnx.Param)
    want = _run(ref, _inputs(case), "reference")
    for devices in args.devices:
      answers = decode_kernels(case, devices)
      for name, reason in answers.items():
        if reason is not None:
          declined.setdefault(name, reason)
          continue
        if name == "reference":
          continue
        err = run_case(case, name, devices, want, params)
        results.append((name, devices, case.name, err))
        print(f"{name:11s} devices {devices}  {case.name:26s} worst {err:.2e}"
              f"  ({len(STEPS)} calls)", flush=True)
  print("\ndeclined decode steps (first reason):")
  for name, reason in declined.items():
    print(f"  {name}: {reason}")
  worst = max(results, key=lambda r: r[3])
  calls = len(results) * len(STEPS)
  print(f"\n{len(results)} (kernel, devices, case) runs, {calls} decode calls compared;"
        f" kernels {sorted({r[0] for r in results})}; worst {worst[3]:.2e}"
        f" ({worst[0]}, {worst[1]} devices, {worst[2]})")
  for devices in args.devices:
    mine = [r for r in results if r[1] == devices]
    if mine:
      print(f"  {devices} device(s): {len(mine)} runs, worst {max(r[3] for r in mine):.2e}")
  return int(worst[3] > TOL)


if __name__ == "__main__":
  sys.exit(main())
