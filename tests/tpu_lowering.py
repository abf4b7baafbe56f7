"""Context-parallel attention on N simulated CPU devices, lowered for TPU; run by
test_lowering.py as `XLA_FLAGS=--xla_force_host_platform_device_count=N python
tests/tpu_lowering.py N`. Prints one JSON line per strategy (Ulysses where N divides the 4
heads, Ulysses over 2 x ring over N / 2) with what the program holds."""

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import flaxattn


def main(n: int):
  b, t, h = 1, 256 * n, 4
  q = jax.ShapeDtypeStruct((b, t, h, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, 2, 128), jnp.bfloat16)
  line = {"context": n}
  hybrid = {"context_ring": n // 2, "context": 2}  # Ulysses over 2 x ring over n / 2
  strategies = [("ring", line, flaxattn.ContextParallel()),
                ("all_gather", line, flaxattn.ContextParallel(strategy="all_gather")),
                ("ulysses_ring", hybrid,
                 flaxattn.ContextParallel(strategy="ulysses", ring_axis="context_ring"))]
  if h % n == 0:
    strategies.append(("ulysses", line, flaxattn.ContextParallel(strategy="ulysses")))
  for strategy, axes, cp in strategies:
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))
    seg = flaxattn.load_balance(np.repeat(np.arange(1, 5), t // 4)[None].astype(np.int32),
                                cp.balanced_shards(mesh))

    def loss(q, k, v):
      out = flaxattn.attention(
          q, k, v, segment_ids=seg, context_parallel=cp)  # noqa: B023 (used in this iteration)
      return jnp.sum(out.astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh), flaxattn.lowering_for("tpu"):
      text = jax.export.export(jax.jit(jax.grad(loss, (0, 1, 2))), platforms=("tpu",))(
          q, kv, kv).mlir_module()
    gathers = re.findall(r'"stablehlo.all_gather"\(.*?\) -> tensor<[^>]*x(f32|bf16|f16)>', text)
    gathers += re.findall(r"stablehlo.all_gather.*-> tensor<[0-9x]*(?:f32|bf16|f16)>", text)
    print(json.dumps(dict(strategy=strategy, tpu_custom_calls=text.count("tpu_custom_call"),
                          collective_permutes=text.count("collective_permute"),
                          all_to_alls=text.count("stablehlo.all_to_all"),
                          float_all_gathers=len(gathers),
                          while_loops=text.count("stablehlo.while"))), flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]))
