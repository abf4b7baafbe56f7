"""The trainer's own step, built and timed: the state of `train.state.make_state`, the jitted
`train.loop.train_step` that `python -m train` runs, and a global batch from the trainer's
data pipeline (`train.data`) in the trainer's token order. `bench.training` times its
variants on simulated CPU devices with it, `bench.gpu` one step on one GPU.

Sets up no devices: the caller's process decides the platform (and simulated devices)
before jax starts.
"""

from __future__ import annotations

import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType

import flaxattn
from models.llama import layer_masks
from train import config as config_lib
from train import data, loop
from train import mesh as mesh_lib
from train.data import tokenizers as tokenizer_lib
from train.state import make_state


def dense_mask_attention(q, k, v, *, mask, segment_ids=None, positions=None,
                         kv_segment_ids=None, kv_positions=None, backend=None,
                         context_parallel=None, **unused):
  """`flaxattn.attention`'s signature; plain jax.nn.dot_product_attention with a dense
  [B, 1, T, S] mask from segment ids and positions (causal masks only, no CP)."""
  del backend, unused
  if context_parallel is not None or mask != flaxattn.Causal():
    raise ValueError(f"dense_mask_attention serves Causal() without CP, got {mask!r}, "
                     f"{context_parallel!r}.")
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
  kv_pos = positions if kv_positions is None else kv_positions
  allowed = ((segment_ids[:, :, None] == kv_seg[:, None, :]) & (segment_ids[:, :, None] != 0)
             & (kv_pos[:, None, :] <= positions[:, :, None]))
  assert allowed.shape == (b, t, s)
  return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], implementation="xla")


def one_batch(cfg, index: int | None, min_docs: int) -> tuple[int, dict]:
  """(its index, one local batch: numpy, original token order) from the trainer's pipeline:
  batch `index`, or with index None the first batch whose every row holds at least
  `min_docs` documents."""
  tok = tokenizer_lib.make(cfg.data.tokenizer)
  docs = data.list_documents(cfg.data.source, cfg.data.bad_records, cfg.data.text_field)
  train_docs, _ = data.split_documents(docs, cfg.data.eval_fraction)
  ds = data.pipeline(train_docs, tok, cfg.data, seq_len=cfg.seq_len, batch=cfg.batch_size,
                     seed=cfg.seed, shard_index=0, shard_count=1, shuffle=True)
  it = iter(ds)
  for i in range(10_000):
    batch = {k: np.array(v) for k, v in next(it).items()}
    docs = min(len(np.unique(r[r > 0])) for r in batch["segment_ids"])
    if i == index or (index is None and docs >= min_docs):
      break
  else:
    raise SystemExit(f"no batch with >= {min_docs} documents per row in the first 10000")
  del it, ds  # stop the reader threads before timing
  gc.collect()
  time.sleep(1.0)
  return i, batch


class Variant:
  """One variant's mesh, state and global batch, compiled and warmed up; `step()` runs and
  times one training step (wall seconds, process CPU seconds)."""

  def __init__(self, name: str, cfg, local: dict, *, cp_size: int, dense: bool, warmup: int):
    self.name, self.cfg, self.dense = name, cfg, dense
    if cp_size > 1:
      parallel = mesh_lib.make(cfg)
      assert parallel.mesh.shape["context"] == cp_size, dict(parallel.mesh.shape)
      self.mesh, self.rules, self.cp = parallel.mesh, parallel.rules, parallel.cp
    else:
      axes = config_lib.MESH_AXES
      self.mesh = jax.make_mesh((1,) * len(axes), axes, axis_types=(AxisType.Auto,) * len(axes),
                                devices=jax.devices()[:1])
      self.rules, self.cp = mesh_lib.rules(self.mesh, cfg.model), None
    batches = data.GlobalBatches(self.mesh, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                 cp=self.cp, masks=layer_masks(cfg.model))
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules):
      self.state = nnx.jit(
          lambda: make_state(cfg.model, cfg.optimizer, cfg.steps, cfg.seed, self.cp))()
      if dense:  # Llama does not expose attention_fn: patch the layer instances
        for block in self.state.model.layers:
          block.attn.attention_fn = dense_mask_attention
      self.batch = jax.block_until_ready(batches.to_global(local))
    self.first_step_s, _, out = self._run()
    self.first_loss = float(out["loss"])
    for _ in range(warmup - 1):
      self._run()
    self.times, self.cpu = [], []

  def _run(self):
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules):
      cpu0, start = time.process_time(), time.perf_counter()
      out = jax.block_until_ready(loop.train_step(self.state, self.batch))
      return time.perf_counter() - start, time.process_time() - cpu0, out

  def step(self) -> None:
    wall, cpu, _ = self._run()
    self.times.append(wall)
    self.cpu.append(cpu)

  def result(self) -> dict:
    cfg, tokens = self.cfg, self.cfg.batch_size * self.cfg.seq_len
    median = statistics.median(self.times)
    return dict(variant=self.name, mesh=dict(self.mesh.shape), devices=self.mesh.size,
                strategy=None if self.cp is None else self.cp.strategy,
                load_balance=None if self.cp is None else self.cp.load_balance,
                attention="jax.nn.dot_product_attention xla + dense mask" if self.dense
                else f"flaxattn (backend={cfg.model.attention_backend})",
                first_step_s=self.first_step_s, first_loss=self.first_loss,
                step_times=self.times, median_step_s=median, best_step_s=min(self.times),
                cores_used=sum(self.cpu) / sum(self.times), tokens_per_step=tokens,
                tokens_per_s=tokens / median, tokens_per_s_best=tokens / min(self.times))
