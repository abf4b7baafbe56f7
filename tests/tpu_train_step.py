"""The trainer's step for `configs/tpu_v5p_8b.yaml`'s model, scaled down to few layers and
short rows, on its mesh axes (fsdp x context over 8 simulated CPU devices), lowered for
TPU; run by test_lowering.py as `XLA_FLAGS=--xla_force_host_platform_device_count=8
python tests/tpu_train_step.py`. Prints one JSON line of what the program holds."""

import json

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from train import config, loop
from train.data import KEYS

# The 8B shape's ratios (GQA 4:1, head_dim 128), 2 layers, 2 x 1024-token rows.
SMALL = ["model.dim=512", "model.n_heads=4", "model.n_kv_heads=1", "model.ffn_dim=1024",
         "model.n_layers=2", "model.vocab_size=1024", "model.max_seq_len=4096", "seq_len=4096",
         "batch_size=2", "mesh.fsdp=2", "mesh.context=4", "platform=cpu"]


def main():
  cfg = config.load("configs/tpu_v5p_8b.yaml", SMALL)
  mesh, rules, cp, _ = loop._parallelism(cfg)  # pylint: disable=protected-access
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    graphdef, abstract = nnx.get_abstract_model(lambda: loop._make_state(cfg, cp), mesh)  # pylint: disable=protected-access

    def step(state, batch):
      state = nnx.merge(graphdef, state)
      out = loop.train_step(state, batch)
      return nnx.state(state), out

    rows = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    batch = {k: jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len),
                                     jnp.float32 if k == "weights" else jnp.int32, sharding=rows)
             for k in KEYS}
    text = jax.export.export(jax.jit(step), platforms=("tpu",))(abstract, batch).mlir_module()
  print(json.dumps(dict(tpu_custom_calls=text.count("tpu_custom_call"),
                        collective_permutes=text.count("collective_permute"),
                        while_loops=text.count("stablehlo.while"))), flush=True)


if __name__ == "__main__":
  main()
