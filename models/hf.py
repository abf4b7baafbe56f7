"""Hugging Face checkpoints <-> `models.llama`: `config.json` + safetensors.

Architectures (`ARCHITECTURES`), each a `LlamaConfig` with the options it needs:
`LlamaForCausalLM` (an explicit `head_dim`, `attention_bias`), `MistralForCausalLM` (a
sliding window in every layer, or in those its `layer_types` names: transformers reads such
a config as Ministral), `Qwen2ForCausalLM` (q/k/v biases, windowed layers by `layer_types`)
and `Qwen3ForCausalLM` (RMSNorm of each q/k head, a free `head_dim`). RoPE options are read
from both layouts: transformers 5's `rope_parameters` dict and the top-level `rope_theta` /
`rope_scaling` of earlier versions (most published checkpoints). A field this model cannot
represent (MoE, `hidden_act` other than silu, an unknown `rope_type`, `mlp_bias`, windowed
layers in a pattern other than `global_every`'s, ...) is refused, naming it, and so is a
field that transformers refuses (`"sliding_window": true`, a `hidden_size` of 64.5, an
integer `rms_norm_eps`, a llama3 RoPE without its frequency factors, a `layer_types` that is
no list of known names, one per layer) and a tensor missing, extra, or stored in another
shape than the config implies, even with as many elements (`gate_proj` transposed): each
would load as another model. Tensors are checked from the safetensors headers before the
model is built, so a wrong `num_hidden_layers` fails at once; an unreadable file (config,
index, safetensors) is a `CheckpointError` naming it.

`load(path)` reads a directory (one `model.safetensors` or shards listed in
`model.safetensors.index.json`) into `Llama`, one tensor at a time, each placed on the
mesh shard by shard (`jax.make_array_from_callback`), so no device ever holds more than its
shards and the host holds one tensor. `save(model, path)` writes the architecture that
holds the model's options (`architecture`), RoPE in both layouts, or raises `ExportError`
naming an option that no architecture here expresses (attention sinks, a logit soft cap,
chunked layers, a window pattern on a model without Qwen's `layer_types`): a checkpoint
never reads back as another model. Parameters are float32 in the model and written back in
the checkpoint's dtype, so a bfloat16 or float32 checkpoint round-trips bit for bit.

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
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

import flaxattn
from models.llama import Llama, LlamaConfig, layer_masks, param_changes

# Architecture -> its config.json defaults where they differ between architectures
# (transformers' config classes; a field missing from config.json takes these).
ARCHITECTURES = {
    "LlamaForCausalLM": dict(model_type="llama", max_position_embeddings=2048),
    "MistralForCausalLM": dict(model_type="mistral", max_position_embeddings=131072,
                               sliding_window=4096),
    "Qwen2ForCausalLM": dict(model_type="qwen2", max_position_embeddings=32768,
                             use_sliding_window=False, sliding_window=4096, max_window_layers=28),
    "Qwen3ForCausalLM": dict(model_type="qwen3", max_position_embeddings=32768, head_dim=128,
                             use_sliding_window=False, sliding_window=4096, max_window_layers=28),
}
# Fields of Mixture-of-Experts configs: none of these architectures has experts.
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
              "num_experts_per_tok")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be read as a `Llama`: the message names the file
  and the field or tensor."""


class ExportError(ValueError):
  """A model that no Hugging Face architecture here holds: the message names the option."""


# ---------------------------------------------------------------------------------------
# config.json


_REQUIRED = object()  # `_Fields.get` without a default: the field must be there
# A field that transformers' strict config classes declare `float` (`rms_norm_eps`): they
# refuse an integer there, though the numbers of the RoPE dicts may be integers.
_FLOAT_ONLY = "float, not int"
# The types config.json's fields have in transformers' config classes, named as JSON names them.
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
          dict: "an object", list[str]: "a list of strings",
          _FLOAT_ONLY: "a number with a decimal point or an exponent (1e-06, 1.0)"}


def _is(value, kind) -> bool:
  """Whether the JSON `value` is a `kind` (one of `_KINDS`)."""
  if kind == list[str]:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)
  if isinstance(value, bool) and kind is not bool:
    return False  # Python's bool is an int: JSON's true is no number
  if kind in (float, _FLOAT_ONLY):
    number = float if kind == _FLOAT_ONLY else (int, float)
    return isinstance(value, number) and math.isfinite(value)
  return isinstance(value, kind)


class _Fields:
  """One JSON object of config.json, read field by field with the types transformers gives
  them; `prefix` places the object in the file (e.g. "rope_scaling.")."""

  def __init__(self, obj: dict, where: str, prefix: str = ""):
    self.obj, self.where, self.prefix = obj, where, prefix

  def get(self, name: str, kind: Any, default: Any = _REQUIRED, *, null: bool = False) -> Any:
    """Field `name` as a `kind` of `_KINDS`: `default` when absent, None when null and `null`
    allows it. An integer is a number (`10000` and `1e4` are the same theta), but no
    `_FLOAT_ONLY`; a number is returned as a float.

    Raises:
      CheckpointError: naming the file, the field, its value and the type expected: absent
        without `default`, null without `null`, or another type; in particular `true` is no
        integer and `1` no bool (Python's bool is an int), `64.0` is no integer (as in
        transformers), and NaN or an infinity is no number.
    """
    field = self.prefix + name
    if name not in self.obj:
      if default is _REQUIRED:
        raise CheckpointError(f"{self.where}: required field {field!r} is missing.")
      return default
    value = self.obj[name]
    if value is None:
      if null:
        return None
    elif _is(value, kind):
      return float(value) if kind in (float, _FLOAT_ONLY) else value
    raise CheckpointError(
        f"{self.where}: {field} expects {_KINDS[kind]}{' or null' if null else ''}, got"
        f" {json.dumps(value, default=repr)[:60]}; correct it in the file.")


def _rope(f: _Fields, max_position: int) -> tuple[float, flaxattn.RoPEScaling]:
  """`(rope_theta, scaling)` of either layout: transformers 5's `rope_parameters` or the
  top-level `rope_theta` / `rope_scaling` (both may be present; they must agree).
  `max_position`: the checkpoint's `max_position_embeddings` (yarn's default original)."""
  theta = f.get("rope_theta", float, 10000.0)
  scaling = _scaling(f, "rope_scaling", max_position)
  params = f.get("rope_parameters", dict, None, null=True)
  if params is None:
    return theta, scaling
  if any(isinstance(v, dict) for v in params.values()):
    raise CheckpointError(f"{f.where}: rope_parameters={params!r} is not supported; expected"
                          " one dict of rope_type, rope_theta and its scaling fields (not one"
                          " per layer type).")
  new_theta = _Fields(params, f.where, "rope_parameters.").get("rope_theta", float, theta)
  new_scaling = _scaling(f, "rope_parameters", max_position)
  if ("rope_theta" in f.obj and new_theta != theta) or (
      f.obj.get("rope_scaling") is not None and new_scaling != scaling):
    raise CheckpointError(f"{f.where}: rope_theta={f.obj.get('rope_theta')!r} and rope_scaling="
                          f"{f.obj.get('rope_scaling')!r} disagree with rope_parameters="
                          f"{params!r}; expected one RoPE: fix one of the two layouts.")
  return new_theta, new_scaling


def _scaling(f: _Fields, field: str, max_position: int) -> flaxattn.RoPEScaling:
  """The `RoPEScaling` of the dict `field` of `f` (`rope_scaling` or `rope_parameters`)."""
  rs = f.get(field, dict, None, null=True)
  if rs is None:
    return flaxattn.RoPEScaling()
  g = _Fields(rs, f.where, field + ".")
  kind = g.get("rope_type", str, g.get("type", str, "default"))
  partial = g.get("partial_rotary_factor", float, 1.0)
  if partial != 1.0:
    raise CheckpointError(f"{f.where}: {field}.partial_rotary_factor={partial!r} is not"
                          " supported (expected 1.0).")
  if kind not in ROPE_TYPES:
    raise CheckpointError(f"{f.where}: {field} rope_type {kind!r} is not supported; expected"
                          f" one of {', '.join(ROPE_TYPES)}.")
  if kind == "default":
    return flaxattn.RoPEScaling()
  factor = g.get("factor", float)
  options: dict[str, Any] = {}  # RoPEScaling's fields beyond kind and factor
  if kind == "llama3":
    # transformers requires both factors and takes max_position_embeddings for the length.
    options = dict(original_max_position=g.get("original_max_position_embeddings", int,
                                               max_position),
                   low_freq_factor=g.get("low_freq_factor", float),
                   high_freq_factor=g.get("high_freq_factor", float))
  elif kind == "yarn":
    attention = g.get("attention_factor", float, None, null=True)
    mscale = g.get("mscale", float, None, null=True)
    mscale_all = g.get("mscale_all_dim", float, None, null=True)
    if attention is None and mscale and mscale_all:
      def m(s):
        return 0.1 * s * math.log(factor) + 1.0 if factor > 1 else 1.0
      attention = m(mscale) / m(mscale_all)
    options = dict(original_max_position=g.get("original_max_position_embeddings", int,
                                               max_position),
                   beta_fast=g.get("beta_fast", float, 32.0),
                   beta_slow=g.get("beta_slow", float, 1.0), attention_factor=attention)
  try:
    return flaxattn.RoPEScaling(kind, factor, **options)
  except ValueError as e:
    raise CheckpointError(f"{f.where}: {field} {rs} is invalid: {e}") from e


# `layer_types` entries this model runs -> whether the layer is windowed ("attention" is
# transformers' older name of "full_attention").
LAYER_TYPES = {"full_attention": False, "attention": False, "sliding_attention": True}


def _windows(f: _Fields, arch: str, n_layers: int) -> dict:
  """`sliding_window` and `global_every` of the layers the architecture windows, as
  transformers 5 reads them: Qwen2/Qwen3 from `layer_types`, else from `max_window_layers`
  (the layers from it on, with `use_sliding_window`); Mistral from `sliding_window` alone
  (every layer), or from `layer_types` where the config carries it (transformers then reads
  it as Ministral, which honours it); Llama has none. `layer_types` is checked in every
  architecture, as transformers checks it. Nothing of size `n_layers` is built unless
  `layer_types` lists it, so a config of 10**9 layers is read at once."""
  types = f.get("layer_types", list[str], None, null=True)
  if types is not None and (len(types) != n_layers or not set(types) <= set(LAYER_TYPES)):
    raise CheckpointError(
        f"{f.where}: layer_types expects one of {', '.join(map(repr, LAYER_TYPES))} per layer"
        f" (num_hidden_layers={n_layers}), got {_shown(types)}; correct it in the file.")
  defaults = ARCHITECTURES[arch]
  off = None  # why the architecture has no window, if it has none
  first = 0  # without layer_types, the layers from `first` on are windowed
  if arch == "LlamaForCausalLM":
    window, off = None, "LlamaForCausalLM has no windowed layers"
  else:
    window = f.get("sliding_window", int, defaults["sliding_window"], null=True)
    if window is None:
      off = "sliding_window is null"
  if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    first = f.get("max_window_layers", int, defaults["max_window_layers"])
    if not f.get("use_sliding_window", bool, defaults["use_sliding_window"]):
      window, off = None, "use_sliding_window is false"
  if types is None:
    if window is None or first >= n_layers:
      return {}
    if first <= 0:
      return dict(sliding_window=window, global_every=0)
    raise CheckpointError(
        f"{f.where}: max_window_layers={first} with use_sliding_window is not supported:"
        f" without layer_types it windows layers {first} to {n_layers - 1}, after {first} of"
        " full attention, and this model windows every layer but each global_every-th.")
  windowed = [LAYER_TYPES[t] for t in types]
  if any(windowed) and window is None:
    raise CheckpointError(
        f"{f.where}: layer_types={_shown(types)} windows layers"
        f" {[i for i, w in enumerate(windowed) if w][:8]}, but {off}: transformers has no"
        " window for them. Set the window or make them full_attention.")
  if not any(windowed):
    return {}
  if all(windowed):
    return dict(sliding_window=window, global_every=0)
  g = windowed.index(False) + 1  # the first full layer is global_every - 1
  if g >= 2 and all(w == (i % g != g - 1) for i, w in enumerate(windowed)):
    return dict(sliding_window=window, global_every=g)
  raise CheckpointError(
      f"{f.where}: layer_types={_shown(types)} is not supported: this model windows every"
      " layer but each global_every-th (layers global_every - 1, 2 * global_every - 1, ...),"
      " which attends fully; windowed layers in another pattern would load as another model.")


def _shown(value, limit: int = 240) -> str:
  """`value` as the error messages show it, cut at `limit` characters."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + " ...]"


def config_from_hf(hf: dict, where: str = "config.json", **overrides) -> LlamaConfig:
  """The `LlamaConfig` of an HF `config.json` dict (`overrides`: our options, e.g.
  `dtype`, `scan_layers`, `max_seq_len`). Each field is read with the type of transformers'
  config classes; null only where they allow it (`head_dim` but Qwen3's,
  `num_key_value_heads`, `sliding_window`, `layer_types`, `rope_scaling`, ...).

  Raises:
    CheckpointError: not a JSON object, an architecture not in `ARCHITECTURES`, a field
      of another type (`true` for an integer, `64.0` for an integer, `1` for a bool, a
      string for a number, null where transformers has none, ...), a field with a value
      this model does not implement (`hidden_act`, `mlp_bias`, experts, an unknown
      `rope_type`, a window pattern without period, ...), or a missing size, naming
      `where` and the field.
  """
  if not isinstance(hf, dict):
    raise CheckpointError(f"{where}: expects a JSON object of the model's fields, got a JSON"
                          f" {type(hf).__name__} ({json.dumps(hf)[:60]}).")
  f = _Fields(hf, where)
  archs = f.get("architectures", list[str], None, null=True) or []
  arch = next((a for a in archs if a in ARCHITECTURES), None)
  if arch is None:
    raise CheckpointError(f"{where}: architectures {archs} is not supported; expected one of"
                          f" {tuple(ARCHITECTURES)}.")
  defaults = ARCHITECTURES[arch]
  # (field, type, values this model implements; the first is the one when absent)
  implemented = [("hidden_act", str, ("silu",)), ("mlp_bias", bool, (False,)),
                 ("partial_rotary_factor", float, (None, 1.0)),
                 *((name, int, (None, 0)) for name in MOE_FIELDS)]
  for name, kind, ok in implemented:
    value = f.get(name, kind, ok[0], null=None in ok)
    if value not in ok:
      raise CheckpointError(f"{where}: {name}={value!r} is not supported (expected"
                            f" {' or '.join(map(repr, ok))}).")
  dim, heads = f.get("hidden_size", int), f.get("num_attention_heads", int)
  n_layers = f.get("num_hidden_layers", int)
  kv_heads = f.get("num_key_value_heads", int, None, null=True)
  # Qwen3's head_dim has a default of its own, and transformers refuses it null.
  head_dim = f.get("head_dim", int, defaults.get("head_dim"), null="head_dim" not in defaults)
  bias = f.get("attention_bias", bool, False)
  max_position = f.get("max_position_embeddings", int, defaults["max_position_embeddings"])
  values: dict[str, Any]  # LlamaConfig's fields
  values = dict(vocab_size=f.get("vocab_size", int), dim=dim, n_layers=n_layers,
                n_heads=heads, n_kv_heads=heads if kv_heads is None else kv_heads,
                ffn_dim=f.get("intermediate_size", int),
                head_dim=None if head_dim is None or head_dim * heads == dim else head_dim,
                qkv_bias=bias or arch == "Qwen2ForCausalLM", out_bias=bias,
                qk_norm=arch == "Qwen3ForCausalLM",
                norm_eps=f.get("rms_norm_eps", _FLOAT_ONLY, 1e-6),
                tie_embeddings=f.get("tie_word_embeddings", bool, False),
                max_seq_len=max_position)
  values["rope_theta"], values["rope_scaling"] = _rope(f, max_position)
  values.update(_windows(f, arch, n_layers))
  values.update(overrides)
  try:
    return LlamaConfig(**values)
  except ValueError as e:
    raise CheckpointError(f"{where}: {e}") from e


def architecture(cfg: LlamaConfig) -> str:
  """The Hugging Face architecture that holds `cfg`'s model exactly: Llama, or Mistral
  for a sliding window in every layer, Qwen2 for q/k/v biases alone, Qwen3 for q/k norm.

  Raises:
    ExportError: naming the option none of them holds.
  """
  def refuse(option, why):
    return ExportError(
        f"model.{option}={getattr(cfg, option)!r} cannot be written as a Hugging Face"
        f" checkpoint: {why} A checkpoint without it would read back as another model; train"
        f" without it to export.")

  for option in ("attention_sinks", "logit_soft_cap", "chunk_size"):
    if getattr(cfg, option):
      raise refuse(option, "no architecture written here (Llama, Mistral, Qwen2, Qwen3) has it.")
  windowed = [m != flaxattn.Causal() for m in layer_masks(cfg)]
  if cfg.qk_norm:
    if cfg.qkv_bias != cfg.out_bias:
      raise refuse("out_bias", "Qwen3 (q/k norm) biases all four projections or none.")
    return "Qwen3ForCausalLM"
  if cfg.qkv_bias and not cfg.out_bias:
    return "Qwen2ForCausalLM"
  if cfg.out_bias and not cfg.qkv_bias:
    raise refuse("out_bias", "Llama biases all four projections or none.")
  if not any(windowed):
    return "LlamaForCausalLM"
  if not all(windowed):
    raise refuse("sliding_window", f"with global_every={cfg.global_every} some layers are"
                 " global; of the architectures written here only Qwen2 (q/k/v biases) and"
                 " Qwen3 (q/k norm) have per-layer windows.")
  if cfg.qkv_bias:
    raise refuse("sliding_window", "Mistral (a window in every layer) has no biases.")
  return "MistralForCausalLM"


def config_to_hf(cfg: LlamaConfig, dtype: str) -> dict:
  """The HF `config.json` dict of `cfg` (its `architecture`), tensors stored as `dtype`.
  RoPE is written in both layouts, so transformers 4 and 5 read the same model.

  Raises:
    ExportError: as `architecture`.
  """
  arch = architecture(cfg)
  hf: dict[str, Any]  # config.json's fields
  hf = dict(architectures=[arch], model_type=ARCHITECTURES[arch]["model_type"],
            vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
            intermediate_size=cfg.ffn_dim, head_dim=cfg.attn_head_dim, hidden_act="silu",
            rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
            max_position_embeddings=cfg.max_seq_len, mlp_bias=False, torch_dtype=dtype)
  if arch != "Qwen2ForCausalLM":
    hf["attention_bias"] = cfg.qkv_bias
  windowed = [m != flaxattn.Causal() for m in layer_masks(cfg)]
  if arch == "MistralForCausalLM":
    hf["sliding_window"] = cfg.sliding_window
  elif arch != "LlamaForCausalLM":
    hf.update(use_sliding_window=any(windowed), max_window_layers=0,
              sliding_window=cfg.sliding_window if any(windowed) else None,
              layer_types=["sliding_attention" if w else "full_attention" for w in windowed])
  rs = cfg.rope_scaling
  scaling: dict[str, Any] = dict(rope_type=rs.kind)
  if rs.kind == "linear":
    scaling.update(factor=rs.factor)
  elif rs.kind == "llama3":
    scaling.update(factor=rs.factor, original_max_position_embeddings=rs.original_max_position,
                   low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
  elif rs.kind == "yarn":
    scaling.update(factor=rs.factor, original_max_position_embeddings=rs.original_max_position,
                   beta_fast=rs.beta_fast, beta_slow=rs.beta_slow,
                   **({} if rs.attention_factor is None else
                      dict(attention_factor=rs.attention_factor)))
  hf.update(rope_theta=cfg.rope_theta, rope_parameters=dict(scaling, rope_theta=cfg.rope_theta))
  if rs.kind != "default":
    hf["rope_scaling"] = scaling
  return hf


# ---------------------------------------------------------------------------------------
# Tensor names and layouts


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One HF tensor: its name, its shape as stored (HF's layout, which the config
  determines), and the map between its layout and ours."""

  name: str
  shape: tuple[int, ...]
  to_ours: Callable[[np.ndarray], np.ndarray]  # HF layout -> ours
  to_hf: Callable[[np.ndarray], np.ndarray]


def _linear(*our_shape):
  """HF Linear `[out, in]` <-> our kernel `[in, ...]` (reshaped to `our_shape`)."""
  return ((math.prod(our_shape[1:]), our_shape[0]), (lambda w: w.T.reshape(our_shape)),
          (lambda k: k.reshape(our_shape[0], -1).T))


def _out_proj(h, d, e):
  """HF o_proj `[E, H * D]` <-> ours `[H, D, E]`."""
  return (e, h * d), (lambda w: w.T.reshape(h, d, e)), (lambda k: k.reshape(h * d, e).T)


def _reshape(*our_shape):
  """HF bias `[H * D]` <-> ours `[H, D]`."""
  return (math.prod(our_shape),), (lambda b: b.reshape(our_shape)), (lambda b: b.reshape(-1))


def _same(*shape):
  """The same layout in both."""
  return shape, (lambda x: x), (lambda x: x)


def _layer_tensors(cfg: LlamaConfig) -> dict[tuple[str, ...], tuple[str, tuple]]:
  """Our path inside a block -> (HF name suffix inside layer i, (HF shape, to_ours, to_hf))."""
  e, h, hkv, d, f = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.ffn_dim
  extra = {}
  if cfg.qkv_bias:
    extra.update({("attn", "query", "bias"): ("self_attn.q_proj.bias", _reshape(h, d)),
                  ("attn", "key", "bias"): ("self_attn.k_proj.bias", _reshape(hkv, d)),
                  ("attn", "value", "bias"): ("self_attn.v_proj.bias", _reshape(hkv, d))})
  if cfg.out_bias:
    extra[("attn", "out", "bias")] = ("self_attn.o_proj.bias", _same(e))
  if cfg.qk_norm:
    extra.update({("attn", "query_ln", "scale"): ("self_attn.q_norm.weight", _same(d)),
                  ("attn", "key_ln", "scale"): ("self_attn.k_norm.weight", _same(d))})
  return extra | {
      ("attn_norm", "scale"): ("input_layernorm.weight", _same(e)),
      ("attn", "query", "kernel"): ("self_attn.q_proj.weight", _linear(e, h, d)),
      ("attn", "key", "kernel"): ("self_attn.k_proj.weight", _linear(e, hkv, d)),
      ("attn", "value", "kernel"): ("self_attn.v_proj.weight", _linear(e, hkv, d)),
      ("attn", "out", "kernel"): ("self_attn.o_proj.weight", _out_proj(h, d, e)),
      ("mlp_norm", "scale"): ("post_attention_layernorm.weight", _same(e)),
      ("mlp", "w1", "kernel"): ("mlp.gate_proj.weight", _linear(e, f)),
      ("mlp", "w3", "kernel"): ("mlp.up_proj.weight", _linear(e, f)),
      ("mlp", "w2", "kernel"): ("mlp.down_proj.weight", _linear(f, e)),
  }


def _model_tensors(cfg: LlamaConfig) -> dict[tuple, _Tensor]:
  """Our parameter path -> HF tensor, for the parameters outside the layers."""
  out = {("embed", "embedding"): _Tensor("model.embed_tokens.weight",
                                         *_same(cfg.vocab_size, cfg.dim)),
         ("norm", "scale"): _Tensor("model.norm.weight", *_same(cfg.dim))}
  if not cfg.tie_embeddings:
    out[("lm_head", "kernel")] = _Tensor("lm_head.weight", *_linear(cfg.dim, cfg.vocab_size))
  return out


def _tensors(cfg: LlamaConfig) -> dict[tuple, list[_Tensor]]:
  """Each of our parameter paths -> its HF tensors; a path stacked over layer groups
  (`scan_layers`) lists one tensor per group."""
  out = {path: [t] for path, t in _model_tensors(cfg).items()}
  period = cfg.period
  for path, (suffix, layout) in _layer_tensors(cfg).items():
    if cfg.scan_layers:
      for j in range(period):
        out[("layers", "blocks", j) + path] = [_in_layer(g * period + j, suffix, layout)
                                               for g in range(cfg.n_layers // period)]
    else:
      for i in range(cfg.n_layers):
        out[("layers", i) + path] = [_in_layer(i, suffix, layout)]
  return out


def _hf_tensors(cfg: LlamaConfig) -> Iterator[_Tensor]:
  """The HF tensors of `cfg`, one by one: those outside the layers, then layer by layer."""
  yield from _model_tensors(cfg).values()
  layer = _layer_tensors(cfg).values()
  for i in range(cfg.n_layers):
    for suffix, layout in layer:
      yield _in_layer(i, suffix, layout)


def _in_layer(i: int, suffix: str, layout: tuple) -> _Tensor:
  """The tensor `suffix` (of `_layer_tensors`) of layer `i`."""
  return _Tensor(f"model.layers.{i}.{suffix}", *layout)


# ---------------------------------------------------------------------------------------
# Loading


class _Files:
  """The safetensors files of a directory: which file holds each tensor and its stored
  shape, from the files' headers (no tensor data is read)."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
      listed = _index(index)
      headers = {}
      for file in sorted(set(listed.values())):
        if not os.path.exists(os.path.join(path, file)):
          raise CheckpointError(f"{index}: lists {file}, which is missing.")
        headers[file] = _header(os.path.join(path, file))
      for name, file in listed.items():
        if name not in headers[file]:
          raise CheckpointError(f"{index}: puts tensor {name!r} in {file}, which does not hold"
                                " it; correct the index's weight_map.")
      self.where = listed
      self.shapes = {name: headers[file][name] for name, file in listed.items()}
    elif os.path.exists(os.path.join(path, SINGLE)):
      self.shapes = _header(os.path.join(path, SINGLE))
      self.where = dict.fromkeys(self.shapes, SINGLE)
    else:
      raise CheckpointError(f"{path}: neither {SINGLE} nor {INDEX} is there.")
    # Per instance: a cache on the method itself would keep its last tensors (and this
    # object) alive after loading.
    self.read = functools.lru_cache(maxsize=2)(self._read)

  def _read(self, name: str) -> np.ndarray:
    with safe_open(os.path.join(self.path, self.where[name]), framework="np") as f:
      return f.get_tensor(name)


def _index(file: str) -> dict[str, str]:
  """The `weight_map` (tensor name -> file name) of the safetensors index `file`."""
  try:
    with open(file) as f:
      index = json.load(f)
  except (OSError, ValueError) as e:  # ValueError: not JSON, or not text
    raise CheckpointError(f"{file}: not a safetensors index ({e}).") from e
  where = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(where, dict) or not all(isinstance(v, str) for v in where.values()):
    raise CheckpointError(f"{file}: expects a JSON object whose weight_map maps each tensor"
                          f" name to the name of its file, got {_shown(index, 80)}; correct"
                          " the index or remove it (one model.safetensors needs none).")
  # Shards lie beside the index: a path elsewhere would read another checkpoint's tensors.
  outside = sorted({v for v in where.values() if os.path.basename(v) != v or v in ("", ".", "..")})
  if outside:
    raise CheckpointError(f"{file}: expects weight_map files in the checkpoint's directory (a"
                          f" file name, no path), got {outside[:3]}; correct the index.")
  return where


def _header(file: str) -> dict[str, tuple[int, ...]]:
  """Tensor name -> stored shape of the safetensors `file`, from its header."""
  try:
    with safe_open(file, framework="np") as f:
      return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
  except (SafetensorError, OSError) as e:
    raise CheckpointError(f"{file}: not a readable safetensors file ({e}); write it again.") from e


def _check_tensors(files: _Files, cfg: LlamaConfig, where: str) -> None:
  """That the checkpoint stores the tensors `cfg` asks for, each in the shape it implies
  (a tensor of the same size in another shape, transposed or flattened, would load into a
  wrong model), and no other: from the headers, before anything of the config's size is
  built, so a config of 10**9 layers fails at once.

  Raises:
    CheckpointError: a missing tensor (the first few), one in another shape (naming its
      file and both shapes), or one the model has no place for.
  """
  missing, used, more = [], set(), ""
  for t in _hf_tensors(cfg):
    if t.name not in files.shapes:
      if len(missing) == 4:  # the config may ask for far more than the files hold
        more = " ..."
        break
      missing.append(t.name)
      continue
    used.add(t.name)
    if files.shapes[t.name] != t.shape:
      raise CheckpointError(
          f"{os.path.join(files.path, files.where[t.name])}: tensor {t.name!r} has shape"
          f" {list(files.shapes[t.name])}, which does not fit the config: expected"
          f" {list(t.shape)} (Hugging Face's layout, [out_features, in_features] for a Linear"
          " weight). Fix the tensor or config.json.")
  if missing:
    asked = len(_model_tensors(cfg)) + cfg.n_layers * len(_layer_tensors(cfg))
    names = (f"tensor {missing[0]!r} is" if len(missing) == 1 else
             f"tensors {missing}{more} are")
    raise CheckpointError(
        f"{files.path}: {names} missing: {where} (num_hidden_layers={cfg.n_layers}) asks for"
        f" {asked} tensors, the checkpoint holds {len(files.shapes)}. Fix config.json or the"
        " tensors.")
  # Some checkpoints carry RoPE's inverse frequencies, which the config determines.
  unused = sorted(n for n in files.where if n not in used and not n.endswith("rotary_emb.inv_freq"))
  if cfg.tie_embeddings and "lm_head.weight" in unused and np.array_equal(
      files.read("lm_head.weight"), files.read("model.embed_tokens.weight")):
    unused.remove("lm_head.weight")  # a tied head written out as a copy
  if unused:
    raise CheckpointError(
        f"{files.path}: tensors {unused[:4]}{' ...' if len(unused) > 4 else ''} have no place"
        f" in the model that {where} describes; a model without them would compute something"
        " else.")


def _ours(files: _Files, t: _Tensor) -> np.ndarray:
  """Tensor `t` in our layout, float32 (its shape checked by `_check_tensors`)."""
  return t.to_ours(files.read(t.name)).astype(np.float32)


def load(path: str, *, context_parallel: flaxattn.ContextParallel | None = None,
         config: LlamaConfig | None = None, **overrides) -> Llama:
  """The `Llama` of the HF checkpoint directory `path`, parameters float32.

  Call under `jax.set_mesh(mesh)` and `nnx.logical_axis_rules(rules)` to get parameters
  sharded by their logical names, each read once on the host and placed shard by shard.
  `overrides`: `LlamaConfig` fields to change (e.g. `dtype`, `scan_layers`, `max_seq_len`,
  `rope_scaling` for context extension). `config`: the model to build instead of the
  checkpoint's, e.g. with a sliding window (`train.init_from`); its parameters must be
  the checkpoint's.

  Raises:
    CheckpointError: unreadable config, a field of the wrong type or unsupported value
      (as `config_from_hf`), missing file or tensor, a tensor the model has no place for, a
      tensor whose stored shape is not the config's (naming the file, the tensor and both
      shapes), or a `config` with other parameters.
  """
  where = os.path.join(path, "config.json")
  cfg = config_from_hf(read_config(path), where, **overrides)
  files = _Files(path)
  _check_tensors(files, cfg, where)
  if config is not None:
    differ = param_changes(dataclasses.replace(cfg, scan_layers=config.scan_layers), config)
    if differ:
      raise CheckpointError(f"{where}: the checkpoint's " + ", ".join(
          f"{k}={getattr(cfg, k)!r}" for k in differ) + " give other parameters than config's "
          + ", ".join(f"{k}={getattr(config, k)!r}" for k in differ) + ".")
    cfg = config
  mesh = jax.sharding.get_abstract_mesh()

  def make():
    return Llama(cfg, context_parallel=context_parallel, rngs=nnx.Rngs(0))

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
      whole = _ours(files, ts[0])  # converted once, sliced per shard
      def host(index):
        return whole[index]
    else:  # stacked over layer groups: read only the groups of the shard
      def host(index):
        groups = range(len(ts))[index[0]]
        stacked = np.stack([_ours(files, ts[g]) for g in groups])
        return stacked[(slice(None),) + index[1:]]
    sharding = getattr(spec, "sharding", None)
    if sharding is None:
      return jnp.asarray(host(tuple(slice(None) for _ in shape)))
    return jax.make_array_from_callback(shape, sharding, host)

  for key, var in flat.items():
    if hasattr(var, "set_value"):
      var.set_value(value(key, var))
    else:
      var.value = value(key, var)
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def read_config(path: str) -> dict:
  """The `config.json` of checkpoint directory `path` (CheckpointError if unreadable or
  not a JSON object)."""
  file = os.path.join(path, "config.json")
  try:
    with open(file) as f:
      hf = json.load(f)
  except FileNotFoundError as e:
    raise CheckpointError(f"{file}: missing; a Hugging Face checkpoint directory has one.") from e
  except OSError as e:  # a directory, no permission, ...
    raise CheckpointError(f"{file}: cannot be read ({e.strerror or e}); expected the JSON file"
                          " of the model's fields.") from e
  except ValueError as e:  # not JSON, or not text
    raise CheckpointError(f"{file}: not JSON ({e}).") from e
  if not isinstance(hf, dict):
    raise CheckpointError(f"{file}: expects a JSON object of the model's fields, got a JSON"
                          f" {type(hf).__name__} ({json.dumps(hf)[:60]}).")
  return hf


# ---------------------------------------------------------------------------------------
# Saving


def save(model: Llama, path: str, *, dtype: str = "bfloat16",
         max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes `model` as an HF directory of its `architecture`: `config.json` and safetensors
  (shards of at most `max_shard_bytes` with `model.safetensors.index.json` when larger),
  tensors as `dtype` ("bfloat16", "float16" or "float32").

  Raises:
    ExportError: an option no architecture holds (naming it); nothing is written.
    ValueError: unknown dtype.
  """
  if dtype not in DTYPES:
    raise ValueError(f"save(dtype=...) expects one of {tuple(DTYPES)}, got {dtype!r}.")
  cfg = model.config
  hf_config = config_to_hf(cfg, dtype)
  os.makedirs(path, exist_ok=True)
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  named = {}
  for key, tensors in _tensors(cfg).items():
    ours = np.asarray(jax.device_get(flat[key].get_value()), np.float32)
    for g, t in enumerate(tensors):
      hf_tensor = t.to_hf(ours[g] if len(tensors) > 1 else ours)
      named[t.name] = np.ascontiguousarray(hf_tensor).astype(DTYPES[dtype])
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
    json.dump(hf_config, f, indent=2)


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
