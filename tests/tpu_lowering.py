"""Context-parallel attention on N simulated CPU devices, lowered for TPU; run by
test_lowering.py as `XLA_FLAGS=--xla_force_host_platform_device_count=N python
tests/tpu_lowering.py N`. Prints one JSON line per strategy with what the program holds."""

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import flaxattn


def main(n: int):
  mesh = jax.make_mesh((n,), ("context",), axis_types=(AxisType.Auto,))
  b, t = 1, 256 * n
  q = jax.ShapeDtypeStruct((b, t, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, t, 2, 128), jnp.bfloat16)
  seg = flaxattn.load_balance(np.repeat(np.arange(1, 5), t // 4)[None].astype(np.int32), n)
  for strategy in ("ring", "all_gather"):
    cp = flaxattn.ContextParallel(strategy=strategy)

    def loss(q, k, v):
      out = flaxattn.attention(q, k, v, segment_ids=seg, context_parallel=cp)
      return jnp.sum(out.astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
      text = jax.export.export(jax.jit(jax.grad(loss, (0, 1, 2))), platforms=("tpu",))(
          q, kv, kv).mlir_module()
    gathers = re.findall(r'"stablehlo.all_gather"\(.*?\) -> tensor<[^>]*x(f32|bf16|f16)>', text)
    gathers += re.findall(r"stablehlo.all_gather.*-> tensor<[0-9x]*(?:f32|bf16|f16)>", text)
    print(json.dumps(dict(strategy=strategy, tpu_custom_calls=text.count("tpu_custom_call"),
                          collective_permutes=text.count("collective_permute"),
                          float_all_gathers=len(gathers),
                          while_loops=text.count("stablehlo.while"))), flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]))
