"""What summing the ring's gradients in the inputs' dtype costs in accuracy, on simulated CPU
devices.

  python -m bench.ring_grad_dtype [--cps 2 4 8] [--json PATH]

bfloat16 q/k/v (standard normal), B=1, H=4 on 2 K/V heads, D=64, 256 tokens per device,
causal, load balanced (`flaxattn.load_balance`), `ContextParallel(strategy="ring")` with
`grad_dtype` float32 (the default) and None (the inputs' dtype), the platform's kernel (on
CPU the blockwise one). The gradients of sum(out * w) (w a fixed normal array, float32)
w.r.t. q, k and v are compared with the reference kernel's on the same bfloat16 inputs
computed in float32 (`backend="reference"`, positions in the permuted order): per gradient
the root-mean-square error over the reference's root-mean-square, and the largest error
over the largest reference magnitude.

Sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys


def errors(cp: int, tokens: int = 256) -> dict:
  """{grad_dtype: {"dq"|"dk"|"dv": (rms relative, max relative)}} at `cp` devices."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import flaxattn

  mesh = jax.make_mesh((cp,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:cp])
  t = tokens * cp
  rng = np.random.default_rng(0)
  q, k, v, w = (rng.standard_normal(shape, np.float32)
                for shape in ((1, t, 4, 64), (1, t, 2, 64), (1, t, 2, 64), (1, t, 4, 64)))
  q, k, v, w = (flaxattn.load_balance(x, cp) for x in (q, k, v, w))
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  positions = flaxattn.load_balance(np.arange(t)[None], cp)

  def loss(q, k, v, **options):
    return jnp.sum(flaxattn.attention(q, k, v, **options).astype(jnp.float32) * w)

  want = jax.jit(jax.grad(lambda *a: loss(*a, positions=positions, backend="reference"),
                          (0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))
  found = {}
  for name, grad_dtype in (("float32", jnp.float32), ("inputs", None)):
    context = flaxattn.ContextParallel(grad_dtype=grad_dtype)
    with jax.set_mesh(mesh):
      got = jax.jit(jax.grad(lambda *a, c=context: loss(*a, context_parallel=c),
                             (0, 1, 2)))(q, k, v)
    found[name] = {}
    for d, g, r in zip(("dq", "dk", "dv"), got, want, strict=True):
      g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
      found[name][d] = (float(np.sqrt(np.mean((g - r) ** 2)) / np.sqrt(np.mean(r ** 2))),
                        float(np.abs(g - r).max() / np.abs(r).max()))
  return found


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--cps", nargs="+", type=int, default=[2, 4, 8], choices=[2, 4, 8])
  parser.add_argument("--json", help="write the errors here")
  args = parser.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  print("| cp | grad | float32 sums: rms (max) | inputs' dtype: rms (max) | ratio of rms |\n"
        "|---:|---|---|---|---:|")
  results = {}
  for cp in args.cps:
    results[cp] = found = errors(cp)
    for d in ("dq", "dk", "dv"):
      (a, a_max), (b, b_max) = found["float32"][d], found["inputs"][d]
      print(f"| {cp} | {d} | {a:.2e} ({a_max:.2e}) | {b:.2e} ({b_max:.2e}) | {b / a:.2f} |",
            flush=True)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
