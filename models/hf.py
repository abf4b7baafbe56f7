"""Hugging Face Llama checkpoints <-> `models.llama`: `config.json` + safetensors.

`load(path)` reads a `LlamaForCausalLM` directory (one `model.safetensors` or shards listed
in `model.safetensors.index.json`) into `Llama`, one tensor at a time, each placed on the
mesh shard by shard (`jax.make_array_from_callback`), so no device ever holds more than its
shards and the host holds one tensor. `save(model, path)` writes a directory `transformers`
loads. Parameters are float32 in the model and written back in the checkpoint's dtype, so a
bfloat16 or float32 checkpoint round-trips bit for bit.

Names: HF's `q_proj.weight` is `[H * D, E]` (out x in); ours `attn/query/kernel` is
`[E, H, D]`, `o_proj` `[E, H * D]` is `attn/out/kernel` `[H, D, E]`. Both rotate the two
halves of each head (`rotate_half`), so no permutation of q/k rows is needed.

    python -m models.hf random OUT_DIR [--size tiny]   # a random Llama in HF format
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import flaxattn
from models.llama import Llama, LlamaConfig

ARCHITECTURES = ("LlamaForCausalLM",)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be read as a Llama: the message names the file and
  the field or tensor."""


# ---------------------------------------------------------------------------------------
# config.json


def _rope_scaling(hf: dict, where: str) -> flaxattn.RoPEScaling:
  rs = hf.get("rope_scaling")
  if rs is None:
    return flaxattn.RoPEScaling()
  kind = rs.get("rope_type", rs.get("type"))
  get = lambda key, default=None: rs.get(key, default)
  try:
    if kind == "default":
      return flaxattn.RoPEScaling()
    if kind == "linear":
      return flaxattn.RoPEScaling("linear", float(get("factor")))
    if kind == "llama3":
      return flaxattn.RoPEScaling(
          "llama3", float(get("factor")), int(get("original_max_position_embeddings")),
          low_freq_factor=float(get("low_freq_factor", 1.0)),
          high_freq_factor=float(get("high_freq_factor", 4.0)))
    if kind == "yarn":
      factor = float(get("factor"))
      attention = get("attention_factor")
      mscale, mscale_all = get("mscale"), get("mscale_all_dim")
      if attention is None and mscale and mscale_all:
        m = lambda s: 0.1 * s * np.log(factor) + 1.0 if factor > 1 else 1.0
        attention = m(mscale) / m(mscale_all)
      return flaxattn.RoPEScaling(
          "yarn", factor,
          int(get("original_max_position_embeddings") or hf["max_position_embeddings"]),
          beta_fast=float(get("beta_fast", 32.0)), beta_slow=float(get("beta_slow", 1.0)),
          attention_factor=None if attention is None else float(attention))
  except (TypeError, KeyError, ValueError) as e:
    raise CheckpointError(f"{where}: rope_scaling {rs} is incomplete or invalid: {e}") from e
  raise CheckpointError(f"{where}: rope_scaling type {kind!r} is not supported; expected one of"
                        " default, linear, llama3, yarn.")


def config_from_hf(hf: dict, where: str = "config.json", **overrides) -> LlamaConfig:
  """The `LlamaConfig` of an HF `config.json` dict (`overrides`: our options, e.g.
  `dtype`, `scan_layers`, `max_seq_len`).

  Raises:
    CheckpointError: an architecture other than `LlamaForCausalLM`, a field with a value
      this model does not implement (`hidden_act`, `attention_bias`, `mlp_bias`, a
      `head_dim` other than hidden_size / num_attention_heads, an unknown `rope_scaling`),
      or a missing size, naming `where` and the field.
  """
  archs = hf.get("architectures") or []
  if not any(a in ARCHITECTURES for a in archs):
    raise CheckpointError(f"{where}: architectures {archs} is not supported; expected one of"
                          f" {ARCHITECTURES}.")
  unsupported = {"hidden_act": ("silu",), "attention_bias": (False, None),
                 "mlp_bias": (False, None)}
  for field, ok in unsupported.items():
    if hf.get(field) not in ok:
      raise CheckpointError(f"{where}: {field}={hf.get(field)!r} is not supported (expected"
                            f" {' or '.join(map(repr, ok))}).")
  try:
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    values = dict(vocab_size=int(hf["vocab_size"]), dim=dim, n_layers=int(hf["num_hidden_layers"]),
                  n_heads=heads, n_kv_heads=int(hf.get("num_key_value_heads") or heads),
                  ffn_dim=int(hf["intermediate_size"]),
                  rope_theta=float(hf.get("rope_theta", 10000.0)),
                  norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  max_seq_len=int(hf.get("max_position_embeddings", 2048)))
  except KeyError as e:
    raise CheckpointError(f"{where}: required field {e.args[0]!r} is missing.") from e
  if hf.get("head_dim") not in (None, dim // heads):
    raise CheckpointError(f"{where}: head_dim={hf['head_dim']} is not supported; this model uses"
                          f" hidden_size / num_attention_heads = {dim // heads}.")
  values["rope_scaling"] = _rope_scaling(hf, where)
  values.update(overrides)
  try:
    return LlamaConfig(**values)
  except ValueError as e:
    raise CheckpointError(f"{where}: {e}") from e


def config_to_hf(cfg: LlamaConfig, dtype: str) -> dict:
  """The HF `config.json` dict of `cfg`, tensors stored as `dtype`."""
  hf = dict(architectures=list(ARCHITECTURES), model_type="llama", vocab_size=cfg.vocab_size,
            hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.ffn_dim,
            head_dim=cfg.head_dim, hidden_act="silu", rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
            max_position_embeddings=cfg.max_seq_len, attention_bias=False, mlp_bias=False,
            torch_dtype=dtype)
  rs = cfg.rope_scaling
  if rs.kind == "linear":
    hf["rope_scaling"] = dict(rope_type="linear", factor=rs.factor)
  elif rs.kind == "llama3":
    hf["rope_scaling"] = dict(rope_type="llama3", factor=rs.factor,
                              original_max_position_embeddings=rs.original_max_position,
                              low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
  elif rs.kind == "yarn":
    hf["rope_scaling"] = dict(rope_type="yarn", factor=rs.factor,
                              original_max_position_embeddings=rs.original_max_position,
                              beta_fast=rs.beta_fast, beta_slow=rs.beta_slow,
                              **({} if rs.attention_factor is None else
                                 dict(attention_factor=rs.attention_factor)))
  return hf


# ---------------------------------------------------------------------------------------
# Tensor names and layouts


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One HF tensor: its name, and the map between its layout and ours."""

  name: str
  to_ours: object  # np array (HF layout) -> np array (ours)
  to_hf: object


def _linear(*our_shape):
  """HF Linear `[out, in]` <-> our kernel `[in, ...]` (reshaped to `our_shape`)."""
  return (lambda w: w.T.reshape(our_shape)), (lambda k: k.reshape(our_shape[0], -1).T)


def _out_proj(h, d, e):
  return (lambda w: w.T.reshape(h, d, e)), (lambda k: k.reshape(h * d, e).T)


_SAME = (lambda x: x), (lambda x: x)


def _layer_tensors(cfg: LlamaConfig) -> dict[tuple[str, ...], tuple[str, tuple]]:
  """Our path inside a block -> (HF name suffix inside layer i, (to_ours, to_hf))."""
  e, h, hkv, d, f = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
  return {
      ("attn_norm", "scale"): ("input_layernorm.weight", _SAME),
      ("attn", "query", "kernel"): ("self_attn.q_proj.weight", _linear(e, h, d)),
      ("attn", "key", "kernel"): ("self_attn.k_proj.weight", _linear(e, hkv, d)),
      ("attn", "value", "kernel"): ("self_attn.v_proj.weight", _linear(e, hkv, d)),
      ("attn", "out", "kernel"): ("self_attn.o_proj.weight", _out_proj(h, d, e)),
      ("mlp_norm", "scale"): ("post_attention_layernorm.weight", _SAME),
      ("mlp", "w1", "kernel"): ("mlp.gate_proj.weight", _linear(e, f)),
      ("mlp", "w3", "kernel"): ("mlp.up_proj.weight", _linear(e, f)),
      ("mlp", "w2", "kernel"): ("mlp.down_proj.weight", _linear(f, e)),
  }


def _tensors(cfg: LlamaConfig) -> dict[tuple, list[_Tensor]]:
  """Each of our parameter paths -> its HF tensors; a path stacked over layer groups
  (`scan_layers`) lists one tensor per group."""
  out = {("embed", "embedding"): [_Tensor("model.embed_tokens.weight", *_SAME)],
         ("norm", "scale"): [_Tensor("model.norm.weight", *_SAME)]}
  if not cfg.tie_embeddings:
    out[("lm_head", "kernel")] = [_Tensor("lm_head.weight", *_linear(cfg.dim, cfg.vocab_size))]
  period = cfg.period
  for path, (suffix, (to_ours, to_hf)) in _layer_tensors(cfg).items():
    if cfg.scan_layers:
      for j in range(period):
        out[("layers", "blocks", j) + path] = [
            _Tensor(f"model.layers.{g * period + j}.{suffix}", to_ours, to_hf)
            for g in range(cfg.n_layers // period)]
    else:
      for i in range(cfg.n_layers):
        out[("layers", i) + path] = [_Tensor(f"model.layers.{i}.{suffix}", to_ours, to_hf)]
  return out


# ---------------------------------------------------------------------------------------
# Loading


class _Files:
  """The safetensors files of a directory and which holds each tensor."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
      with open(index) as f:
        try:
          self.where = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
          raise CheckpointError(f"{index}: not a safetensors index ({e}).") from e
    elif os.path.exists(os.path.join(path, SINGLE)):
      with safe_open(os.path.join(path, SINGLE), framework="np") as f:
        self.where = {name: SINGLE for name in f.keys()}
    else:
      raise CheckpointError(f"{path}: neither {SINGLE} nor {INDEX} is there.")
    for file in sorted(set(self.where.values())):
      if not os.path.exists(os.path.join(path, file)):
        raise CheckpointError(f"{os.path.join(path, index if os.path.exists(index) else SINGLE)}:"
                              f" lists {file}, which is missing.")

  @functools.lru_cache(maxsize=2)
  def read(self, name: str) -> np.ndarray:
    if name not in self.where:
      raise CheckpointError(f"{self.path}: tensor {name!r} is missing (the config asks for it).")
    with safe_open(os.path.join(self.path, self.where[name]), framework="np") as f:
      return f.get_tensor(name)


def _checked(files: _Files, t: _Tensor, shape: tuple[int, ...]) -> np.ndarray:
  w = files.read(t.name)
  ours = t.to_ours(w) if w.size == int(np.prod(shape)) else None
  if ours is None or ours.shape != shape:
    raise CheckpointError(f"{os.path.join(files.path, files.where[t.name])}: tensor {t.name!r}"
                          f" has shape {list(w.shape)}, which does not fit the config (this"
                          f" model's parameter is {list(shape)}).")
  return ours.astype(np.float32)


def load(path: str, *, context_parallel: flaxattn.ContextParallel | None = None,
         **overrides) -> Llama:
  """The `Llama` of the HF checkpoint directory `path`, parameters float32.

  Call under `jax.set_mesh(mesh)` and `nnx.logical_axis_rules(rules)` to get parameters
  sharded by their logical names, each read once on the host and placed shard by shard.
  `overrides`: `LlamaConfig` fields to change (e.g. `dtype`, `scan_layers`, `max_seq_len`,
  `rope_scaling` for context extension).

  Raises:
    CheckpointError: unreadable config, unsupported field, missing file or tensor, or a
      tensor whose shape does not fit the config (naming the file and the tensor).
  """
  cfg = config_from_hf(read_config(path), os.path.join(path, "config.json"), **overrides)
  files = _Files(path)
  mesh = jax.sharding.get_abstract_mesh()
  make = lambda: Llama(cfg, context_parallel=context_parallel, rngs=nnx.Rngs(0))
  if mesh.empty:
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
  else:
    graphdef, abstract = nnx.get_abstract_model(make, jax.sharding.get_mesh())
  tensors = _tensors(cfg)
  flat = dict(nnx.to_flat_state(abstract))
  missing = set(flat) - set(tensors)
  if missing:
    raise CheckpointError(f"{path}: parameters {sorted(missing)} have no Hugging Face tensor.")

  def value(key, var):
    spec = var.get_value() if hasattr(var, "get_value") else var.value
    ts = tensors[key]
    shape = tuple(spec.shape)
    if len(ts) == 1:
      whole = _checked(files, ts[0], shape)  # converted once, sliced per shard
      host = lambda index: whole[index]
    else:  # stacked over layer groups: read only the groups of the shard
      def host(index):
        groups = range(len(ts))[index[0]]
        return np.stack([_checked(files, ts[g], shape[1:]) for g in groups])[(slice(None),) + index[1:]]
    sharding = getattr(spec, "sharding", None)
    if sharding is None:
      return jnp.asarray(host(tuple(slice(None) for _ in shape)))
    return jax.make_array_from_callback(shape, sharding, host)

  for key, var in flat.items():
    var.set_value(value(key, var)) if hasattr(var, "set_value") else setattr(var, "value", value(key, var))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def read_config(path: str) -> dict:
  """The `config.json` of checkpoint directory `path` (CheckpointError if unreadable)."""
  file = os.path.join(path, "config.json")
  try:
    with open(file) as f:
      return json.load(f)
  except FileNotFoundError as e:
    raise CheckpointError(f"{file}: missing; a Hugging Face checkpoint directory has one.") from e
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{file}: not JSON ({e}).") from e


# ---------------------------------------------------------------------------------------
# Saving


def save(model: Llama, path: str, *, dtype: str = "bfloat16",
         max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes `model` as an HF `LlamaForCausalLM` directory: `config.json` and safetensors
  (shards of at most `max_shard_bytes` with `model.safetensors.index.json` when larger),
  tensors as `dtype` ("bfloat16", "float16" or "float32").

  Raises:
    ValueError: unknown dtype.
  """
  if dtype not in DTYPES:
    raise ValueError(f"save(dtype=...) expects one of {tuple(DTYPES)}, got {dtype!r}.")
  cfg = model.config
  os.makedirs(path, exist_ok=True)
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  named = {}
  for key, tensors in _tensors(cfg).items():
    ours = np.asarray(jax.device_get(flat[key].get_value()), np.float32)
    for g, t in enumerate(tensors):
      named[t.name] = np.ascontiguousarray(t.to_hf(ours[g] if len(tensors) > 1 else ours)).astype(DTYPES[dtype])
  shards, size = [[]], 0
  for name in sorted(named):
    if shards[-1] and size + named[name].nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += named[name].nbytes
  metadata = {"format": "pt"}
  if len(shards) == 1:
    save_file(named, os.path.join(path, SINGLE), metadata=metadata)
  else:
    where = {}
    for i, names in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file({n: named[n] for n in names}, os.path.join(path, file), metadata=metadata)
      where.update({n: file for n in names})
    with open(os.path.join(path, INDEX), "w") as f:
      json.dump(dict(metadata=dict(total_size=sum(x.nbytes for x in named.values())),
                     weight_map=where), f, indent=2)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_hf(cfg, dtype), f, indent=2)


SIZES = {"tiny": LlamaConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=256, max_seq_len=1024, rope_theta=500000.0,
                             tie_embeddings=False)}


def main(argv=None):
  parser = argparse.ArgumentParser(description="Hugging Face Llama checkpoints.")
  sub = parser.add_subparsers(dest="command", required=True)
  random = sub.add_parser("random", help="write a randomly initialized Llama in HF format")
  random.add_argument("out_dir")
  random.add_argument("--size", choices=sorted(SIZES), default="tiny")
  random.add_argument("--seed", type=int, default=0)
  random.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
  args = parser.parse_args(argv)
  save(Llama(SIZES[args.size], rngs=nnx.Rngs(args.seed)), args.out_dir, dtype=args.dtype)
  print(f"wrote a random {args.size} Llama ({args.dtype}) to {args.out_dir}")


if __name__ == "__main__":
  main()
