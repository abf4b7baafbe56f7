"""The model options of Qwen2 / Qwen3 checkpoints (projection biases, q/k RMSNorm, a head dim
of its own) and Mistral's windows in every layer: today's Llama keeps its parameters, and a
model with them decodes with the KV cache exactly as its full forward computes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import normal
from models.llama import Llama, LlamaConfig, layer_masks, param_shapes
from train import sample

SMALL = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                    max_seq_len=24, attention_backend="reference")


def test_default_options_keep_the_llama_parameters():
  attn = jax.tree.map(lambda x: x.shape, param_shapes(SMALL)["layers"][0]["attn"])
  assert attn == {"query": {"kernel": (32, 4, 8)}, "key": {"kernel": (32, 2, 8)},
                  "value": {"kernel": (32, 2, 8)}, "out": {"kernel": (4, 8, 32)}}


def test_qwen_options_give_the_qwen_parameters():
  qwen2 = param_shapes(dataclasses.replace(SMALL, qkv_bias=True))["layers"][0]["attn"]
  assert "bias" in qwen2["query"] and "bias" not in qwen2["out"]
  qwen3 = param_shapes(dataclasses.replace(SMALL, qk_norm=True, head_dim=12, qkv_bias=True,
                                           out_bias=True))["layers"][0]["attn"]
  shapes = jax.tree.map(lambda x: x.shape, qwen3)
  assert shapes["query"] == {"kernel": (32, 4, 12), "bias": (4, 12)}
  assert shapes["query_ln"] == shapes["key_ln"] == {"scale": (12,)}
  assert shapes["out"] == {"kernel": (4, 12, 32), "bias": (32,)}


def test_global_every_zero_windows_every_layer():
  import flaxattn

  cfg = dataclasses.replace(SMALL, n_layers=3, sliding_window=4, global_every=0)
  assert layer_masks(cfg) == (flaxattn.Local(4),) * 3 and cfg.period == 1


@pytest.mark.parametrize("fields", [
    dict(qkv_bias=True, sliding_window=3, global_every=0),  # Qwen2's biases, Mistral's window
    dict(qk_norm=True, head_dim=12, qkv_bias=True, out_bias=True),  # Qwen3
])
def test_decode_is_the_full_forward_argmax(fields):
  model = Llama(dataclasses.replace(SMALL, **fields), rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  # Random biases and norm scales, so that a term the decode path drops would show.
  state = jax.tree.map(lambda x: x + normal(x.shape, x.size) * 0.5, state)
  nnx.update(model, state)
  prompt = np.array([5, 17, 3, 40, 22, 9], np.int32)
  new = sample.generate(model, prompt, 8)
  text = np.concatenate([prompt, new])
  logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(text)[None]))[0]
  np.testing.assert_array_equal(np.argmax(logits[len(prompt) - 1:-1], axis=-1), new)
