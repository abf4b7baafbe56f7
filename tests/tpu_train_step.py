"""The trainer's step for a TPU config, lowered for TPU from this CPU host on the config's
mesh axes over simulated CPU devices; run by test_lowering.py as
`XLA_FLAGS=--xla_force_host_platform_device_count=N python tests/tpu_train_step.py PRESET`
(N: the mesh's devices; PRESET a key of `PRESETS`). Prints one JSON line of what the
program holds. `bench.build --train` lowers the 128K extension config at full size."""

import json
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flaxattn
from train import config, loop
from train import mesh as mesh_lib
from train.data import KEYS
from train.state import make_state

# configs/tpu_v5p_8b.yaml: the 8B shape's ratios (GQA 4:1, head_dim 128), 2 layers, 2 x
# 4096-token rows, fsdp 2 x context 4 (8 devices).
SMALL_8B = ["model.dim=512", "model.n_heads=4", "model.n_kv_heads=1", "model.ffn_dim=1024",
            "model.n_layers=2", "model.vocab_size=1024", "model.max_seq_len=4096", "seq_len=4096",
            "batch_size=2", "mesh.fsdp=2", "mesh.context=4", "platform=cpu"]
# configs/tpu_v5p_8b_extend_128k.yaml at its full sequence length (131072), batch (16) and
# mesh (fsdp 16 x context 4: 64 devices), width and depth scaled down (GQA 4:1 kept).
SMALL_128K = ["model.dim=256", "model.n_heads=4", "model.n_kv_heads=1", "model.ffn_dim=512",
              "model.n_layers=2", "model.vocab_size=1024", "platform=cpu"]
FULL_128K = ["platform=cpu"]  # the 8B model itself (abstract: no parameter memory)
PRESETS = {"tpu_demo": ("configs/tpu_demo.yaml", ["platform=cpu"]),  # as it is, on 8 devices
           "small_8b": ("configs/tpu_v5p_8b.yaml", SMALL_8B),
           "small_128k": ("configs/tpu_v5p_8b_extend_128k.yaml", SMALL_128K),
           "full_128k": ("configs/tpu_v5p_8b_extend_128k.yaml", FULL_128K)}


def lower(path: str, overrides: list[str]) -> dict:
  """Lowers the train step of config `path` for TPU; what the program holds."""
  cfg = config.load(path, overrides)
  parallel = mesh_lib.make(cfg)
  mesh = parallel.mesh
  with jax.set_mesh(mesh), nnx.logical_axis_rules(parallel.rules):
    graphdef, abstract = nnx.get_abstract_model(
        lambda: make_state(cfg.model, cfg.optimizer, cfg.steps, cfg.seed, parallel.cp), mesh)

    def step(state, batch):
      state = nnx.merge(graphdef, state)
      out = loop.train_step(state, batch)
      return nnx.state(state), out

    rows = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    batch = {k: jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len),
                                     jnp.float32 if k == "weights" else jnp.int32, sharding=rows)
             for k in KEYS}
    with flaxattn.lowering_for("tpu"):
      text = jax.export.export(jax.jit(step), platforms=("tpu",))(abstract, batch).mlir_module()
  return dict(devices=mesh.size, mesh=dict(mesh.shape), seq_len=cfg.seq_len,
              batch_size=cfg.batch_size, tpu_custom_calls=text.count("tpu_custom_call"),
              collective_permutes=text.count("collective_permute"),
              while_loops=text.count("stablehlo.while"))


if __name__ == "__main__":
  print(json.dumps(lower(*PRESETS[sys.argv[1]])), flush=True)
