"""A Llama-style decoder on `flaxattn`: packed rows, GQA, RoPE on positions, SwiGLU.

Every token carries a segment id (0 = padding, documents 1, 2, ...) and its position inside
its document, so packed documents never see each other and each restarts RoPE at 0: a
document gives the same logits packed or alone. Optional Llama-4-style chunked attention:
with `chunk_size`, layer i attends inside aligned chunks of `chunk_size` positions unless
`i % global_every == global_every - 1`, which is global causal (`layer_masks`). Sliding-window
layers (gpt-oss, Gemma 2/3) follow the same pattern with `sliding_window`: `Local(window)`
layers and every `global_every`-th global (`global_every=0`: every layer windowed, as
Mistral). Optional attention sinks (gpt-oss) and logit soft-capping (Gemma 2) in every
layer; projection biases (Qwen2: q/k/v, Llama/Qwen3 `attention_bias`: q/k/v/out), RMSNorm of
each query and key head before RoPE (Qwen3) and a head dim of its own (`head_dim`).

Parameters are float32 and carry logical axis names (`out_sharding` metadata); activations
get logical sharding constraints (no-ops without a mesh and rules, see `flaxattn.sharding`).
With `scan_layers`, layers are stacked along a leading `layers` axis and run by `nnx.scan`;
the stacked unit is one period of the mask pattern (`global_every` layers with
`chunk_size`, else one layer), so the pattern holds and `n_layers` must be a multiple of the
period. Parameter trees differ between the two layouts (`layers/<i>/...` vs
`layers/blocks/<j>/...` stacked over groups, layer i = group i // period, block i % period).

Decoding with a KV cache (`init_cache`, then calls with `decode=True`: a prompt of T tokens,
then one token at a time) runs the unrolled layout only: `unroll_layers` turns a
`scan_layers` model into one. Every layer caches all `max_length` keys and masks them by
position, so windowed, chunked, sink and soft-capped layers decode exactly as the full
forward computes them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import flaxattn
from flaxattn import checks
from flaxattn.attention import MAX_SOFT_CAP
from flaxattn.sharding import constrain, logical_to_spec, param_metadata

X_NAMES = ("batch", "seq", "embed")
HIDDEN_NAMES = ("batch", "seq", "mlp")
LOGITS_NAMES = ("batch", "seq", "vocab")
# Logical name of the stacked-layers axis under scan_layers. flaxattn's default rules do not
# name it, and an unnamed logical axis reaches the mesh as is: the caller's rules must map
# it (to None to replicate it, as the trainer does).
LAYERS_AXIS = "layers"

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The name of each block's input (`jax.ad_checkpoint.checkpoint_name`), what "offload" moves.
LAYER_INPUT = "layer_input"
# jax.checkpoint policies by name. "dots" keeps the outputs of the weight matmuls (no batch
# dimensions) and recomputes the rest, attention included; "full" keeps only block inputs;
# "offload" keeps those in the host's memory (`pinned_host`, as MaxText's offloading
# policies), copied back for the backward pass: the device holds one block's input at a
# time, not all of them (the 8B example on v5p-128 keeps 8 GiB of them under "full").
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src="device", offload_dst="pinned_host"),
}


def _check_positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"LlamaConfig({name}=...) expects a positive int, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Sizes and options of `Llama` (hashable; validated on construction).

  Fields beyond the sizes:
    head_dim: features per attention head; None: dim // n_heads (Qwen3, Gemma: set).
    qkv_bias, out_bias: biases of the q/k/v projections and of the output projection
      (Qwen2: q/k/v only; Hugging Face's `attention_bias`: all four).
    qk_norm: RMSNorm (eps `norm_eps`, one scale of head_dim) of each query and key head
      before RoPE (Qwen3).
    chunk_size: Llama-4-style chunked attention (`flaxattn.Chunked(chunk_size)`) in every
      layer but each `global_every`-th, which stays global causal (see `layer_masks`);
      `global_every=0`: no global layer.
    sliding_window: sliding-window attention (`flaxattn.Local(sliding_window)`) in the
      same pattern (gpt-oss alternates: global_every=2; Gemma 3: global_every=6). Not with
      `chunk_size`.
    attention_sinks: a learned sink logit per head in every attention layer (gpt-oss).
    logit_soft_cap: attention scores become `cap * tanh(scores / cap)` (Gemma 2), or None.
    remat: "none", "full" (keep only each layer's input), "offload" (keep it in host memory)
      or "dots" (also keep the weight matmul outputs, recompute attention and elementwise
      ops); `jax.checkpoint` policies (`REMAT_POLICIES`).
    scan_layers: stack layers and run them with `nnx.scan` (one compiled period of the mask
      pattern); parameter trees differ from the unrolled layout (see the module docstring).
    dtype: compute dtype, "float32" or "bfloat16", of matmuls and the residual stream;
      parameters, norm statistics and RoPE angles stay float32, and logits are returned
      as float32 (the output matmul runs in the compute dtype).
    attention_backend: passed to `flaxattn.MultiHeadAttention(backend=...)`.
    rope_scaling: `flaxattn.RoPEScaling` of the rotary frequencies (context extension:
      linear, llama3, yarn; Hugging Face's `rope_scaling`).

  Raises:
    ValueError naming the field and value: a size that is not a positive int, `dim` not a
    multiple of `n_heads` without `head_dim`, an odd head dim (RoPE), `n_heads` not a
    multiple of `n_kv_heads`,
    unknown `remat` or `dtype`, `norm_eps`/`rope_theta` out of range, both `chunk_size` and
    `sliding_window`, a `logit_soft_cap` that is not a positive number at most
    `flaxattn.attention.MAX_SOFT_CAP`, or `scan_layers`
    with a layer pattern and `n_layers` not a multiple of `global_every`.
  """

  vocab_size: int = 256
  dim: int = 256
  n_layers: int = 4
  n_heads: int = 8
  n_kv_heads: int = 2
  ffn_dim: int = 768
  head_dim: int | None = None
  qkv_bias: bool = False
  out_bias: bool = False
  qk_norm: bool = False
  rope_theta: float = 10000.0
  rope_scaling: flaxattn.RoPEScaling = dataclasses.field(default_factory=flaxattn.RoPEScaling)
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  max_seq_len: int = 4096
  chunk_size: int | None = None
  sliding_window: int | None = None
  global_every: int = 4
  attention_sinks: bool = False
  logit_soft_cap: float | None = None
  remat: str = "none"
  scan_layers: bool = False
  dtype: str = "float32"
  attention_backend: str = "auto"

  def __post_init__(self):
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                 "max_seq_len"):
      _check_positive_int(name, getattr(self, name))
    if isinstance(self.global_every, bool) or not isinstance(self.global_every, int) or (
        self.global_every < 0):
      raise ValueError(f"LlamaConfig(global_every=...) expects an int >= 0 (0: no global"
                       f" layer), got {self.global_every!r}.")
    for name in ("chunk_size", "sliding_window", "head_dim"):
      if getattr(self, name) is not None:
        _check_positive_int(name, getattr(self, name))
    if self.chunk_size is not None and self.sliding_window is not None:
      raise ValueError(f"LlamaConfig(sliding_window=...) expects None with chunk_size"
                       f" ({self.chunk_size}), got {self.sliding_window}: a layer is chunked or"
                       " windowed, not both. Set one of them.")
    if self.logit_soft_cap is not None:  # stored as a float: the config stays hashable
      object.__setattr__(self, "logit_soft_cap", checks.number(
          "LlamaConfig(logit_soft_cap=...)", self.logit_soft_cap,
          f"a positive number at most {MAX_SOFT_CAP:g} or None",
          lambda x: 0 < x <= MAX_SOFT_CAP))
    if self.head_dim is None and self.dim % self.n_heads:
      raise ValueError(f"LlamaConfig(dim=...) expects a multiple of n_heads ({self.n_heads}),"
                       f" got {self.dim}: head_dim = dim // n_heads (or set head_dim).")
    if self.head_dim is None and self.attn_head_dim % 2:
      raise ValueError(f"LlamaConfig(dim=...) expects an even head_dim for RoPE, got dim"
                       f" {self.dim} / n_heads {self.n_heads} = {self.attn_head_dim}.")
    if self.attn_head_dim % 2:
      raise ValueError(f"LlamaConfig(head_dim=...) expects an even number for RoPE, got"
                       f" {self.head_dim}.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"LlamaConfig(n_heads=...) expects a multiple of n_kv_heads"
                       f" ({self.n_kv_heads}), got {self.n_heads}: each KV head serves"
                       " n_heads // n_kv_heads query heads.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"LlamaConfig(remat=...) expects one of {tuple(REMAT_POLICIES)}, got"
                       f" {self.remat!r}.")
    if self.dtype not in DTYPES:
      raise ValueError(f"LlamaConfig(dtype=...) expects one of {tuple(DTYPES)}, got"
                       f" {self.dtype!r}; parameters are always float32.")
    object.__setattr__(self, "rope_theta", checks.number(
        "LlamaConfig(rope_theta=...)", self.rope_theta, "a number > 1 (finite)", lambda x: x > 1))
    object.__setattr__(self, "norm_eps", checks.number(
        "LlamaConfig(norm_eps=...)", self.norm_eps, "a number > 0 (finite)", lambda x: x > 0))
    if not isinstance(self.attention_backend, str) or not self.attention_backend:
      raise ValueError(f"LlamaConfig(attention_backend=...) expects a flaxattn backend name"
                       f" ('auto', 'fused', 'reference', ...), got {self.attention_backend!r}.")
    if self.scan_layers and self.n_layers % self.period:
      raise ValueError(f"LlamaConfig(n_layers=...) expects a multiple of global_every"
                       f" ({self.global_every}) with scan_layers and a layer pattern, got"
                       f" {self.n_layers}: the scan runs whole periods of the layer pattern."
                       " Change n_layers or global_every, or set scan_layers=False.")

  @property
  def attn_head_dim(self) -> int:
    """Features per attention head: `head_dim`, or dim // n_heads without it."""
    return self.dim // self.n_heads if self.head_dim is None else self.head_dim

  @property
  def period(self) -> int:
    """Layers in one repeat of the mask pattern (the unit `scan_layers` stacks)."""
    if self.chunk_size is None and self.sliding_window is None:
      return 1
    return self.global_every or 1


def layer_masks(config: LlamaConfig) -> tuple[flaxattn.Mask, ...]:
  """The attention mask of each of the `n_layers` layers: `Chunked(chunk_size)` or
  `Local(sliding_window)`, except `Causal()` where `i % global_every == global_every - 1` (none
  with `global_every=0`) or without either."""
  if config.chunk_size is not None:
    local = flaxattn.Chunked(config.chunk_size)
  elif config.sliding_window is not None:
    local = flaxattn.Local(config.sliding_window)
  else:
    return (flaxattn.Causal(),) * config.n_layers
  g = config.global_every
  return tuple(flaxattn.Causal() if g and i % g == g - 1 else local
               for i in range(config.n_layers))


class RMSNorm(nnx.Module):
  """x / rms(x) * scale over the last axis (logical name `axis`), computed in float32,
  returned in the compute dtype."""

  def __init__(self, dim: int, *, eps: float, dtype, axis: str = "embed"):
    self.eps = eps
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), **param_metadata((axis,), {}))

  def __call__(self, x_BTE: jax.Array) -> jax.Array:
    x = x_BTE.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...]).astype(self.dtype)


class MLP(nnx.Module):
  """SwiGLU: w2(silu(w1 x) * w3 x), no biases."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=DTYPES[config.dtype],
                               param_dtype=jnp.float32, rngs=rngs)
    up = param_metadata(("embed", "mlp"), {})
    self.w1 = linear(config.dim, config.ffn_dim, kernel_metadata=up)
    self.w3 = linear(config.dim, config.ffn_dim, kernel_metadata=up)
    self.w2 = linear(config.ffn_dim, config.dim,
                     kernel_metadata=param_metadata(("mlp", "embed"), {}))

  def __call__(self, x_BTE: jax.Array) -> jax.Array:
    h_BTF = constrain(nnx.silu(self.w1(x_BTE)) * self.w3(x_BTE), HIDDEN_NAMES)
    return constrain(self.w2(h_BTF), X_NAMES)


class Block(nnx.Module):
  """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config: LlamaConfig, mask: flaxattn.Mask, *, context_parallel,
               rngs: nnx.Rngs):
    dtype = DTYPES[config.dtype]
    self.attn_norm = RMSNorm(config.dim, eps=config.norm_eps, dtype=dtype)
    d = config.attn_head_dim
    self.attn = flaxattn.MultiHeadAttention(
        config.n_heads, config.dim, config.n_heads * d, num_kv_heads=config.n_kv_heads,
        use_bias=config.qkv_bias or config.out_bias, normalize_qk=config.qk_norm,
        dtype=dtype, param_dtype=jnp.float32, decode=False, mask=mask,
        backend=config.attention_backend, context_parallel=context_parallel,
        rope=flaxattn.RoPE(config.rope_theta, config.rope_scaling), sinks=config.attention_sinks,
        logit_soft_cap=config.logit_soft_cap, rngs=rngs)
    # The layer has one use_bias for all four projections and normalizes q/k with nnx's
    # LayerNorm; Qwen2 biases q/k/v only and Qwen3 normalizes with RMSNorm. Its modules
    # are swapped here, under the same parameter names, and run where the layer runs them
    # (q/k norm after the projection, before RoPE).
    for name, used in (("query", config.qkv_bias), ("key", config.qkv_bias),
                       ("value", config.qkv_bias), ("out", config.out_bias)):
      if not used and getattr(self.attn, name).use_bias:
        getattr(self.attn, name).use_bias = False
        getattr(self.attn, name).bias = nnx.data(None)
    if config.qk_norm:
      # The layer declares nnx.LayerNorm here but only calls it on [..., head_dim].
      self.attn.query_ln = RMSNorm(  # pyright: ignore[reportAttributeAccessIssue]
          d, eps=config.norm_eps, dtype=dtype, axis="head_dim")
      self.attn.key_ln = RMSNorm(  # pyright: ignore[reportAttributeAccessIssue]
          d, eps=config.norm_eps, dtype=dtype, axis="head_dim")
    self.mlp_norm = RMSNorm(config.dim, eps=config.norm_eps, dtype=dtype)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x_BTE, segment_ids, positions, decode=False):
    x_BTE = x_BTE + self.attn(self.attn_norm(x_BTE), segment_ids=segment_ids,
                              positions=positions, decode=decode)
    return x_BTE + self.mlp(self.mlp_norm(x_BTE))


class LayerGroup(nnx.Module):
  """One period of the mask pattern; the unit that `scan_layers` stacks and scans."""

  def __init__(self, config: LlamaConfig, *, context_parallel, rngs: nnx.Rngs):
    masks = layer_masks(config)[:config.period]
    self.blocks = nnx.List([Block(config, m, context_parallel=context_parallel, rngs=rngs)
                            for m in masks])


def _call_block(block: Block, x_BTE, segment_ids, positions):
  return block(checkpoint_name(x_BTE, LAYER_INPUT), segment_ids, positions)


class Llama(nnx.Module):
  """Llama-style decoder: token embedding, `n_layers` blocks, final RMSNorm, output head.

  Args:
    config: a `LlamaConfig`.
    context_parallel: a `flaxattn.ContextParallel` for every attention layer (sequence axis
      sharded over its mesh axis); call the model under `jax.set_mesh`.
    rngs: parameter initialization.

  Create it under `jax.set_mesh(mesh)` and `nnx.logical_axis_rules(...)` (e.g. inside
  `nnx.jit`) to get sharded parameters.
  """

  def __init__(self, config: LlamaConfig, *,
               context_parallel: flaxattn.ContextParallel | None = None, rngs: nnx.Rngs):
    if not isinstance(config, LlamaConfig):
      raise TypeError(f"Llama(config=...) expects a LlamaConfig, got {type(config).__name__}.")
    self.config = config
    self.context_parallel = context_parallel
    dtype = DTYPES[config.dtype]
    self.embed = nnx.Embed(config.vocab_size, config.dim, dtype=dtype, param_dtype=jnp.float32,
                           embedding_metadata=param_metadata(("vocab", "embed"), {}), rngs=rngs)
    if config.scan_layers:
      @nnx.split_rngs(splits=config.n_layers // config.period)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
      def make_groups(rngs):
        return LayerGroup(config, context_parallel=context_parallel, rngs=rngs)

      self.layers = make_groups(rngs)
    else:
      self.layers = nnx.List([Block(config, m, context_parallel=context_parallel, rngs=rngs)
                              for m in layer_masks(config)])
    self.norm = RMSNorm(config.dim, eps=config.norm_eps, dtype=dtype)
    if config.tie_embeddings:
      self.lm_head = nnx.data(None)
    else:
      self.lm_head = nnx.Linear(config.dim, config.vocab_size, use_bias=False, dtype=dtype,
                                param_dtype=jnp.float32, rngs=rngs,
                                kernel_metadata=param_metadata(("embed", "vocab"), {}))

  def init_cache(self, batch_size: int, max_length: int, *,
                 context_parallel=dataclasses.MISSING) -> None:
    """Allocates an empty KV cache in every layer for `decode=True` calls.

    Each layer caches keys and values `[batch_size, max_length, n_kv_heads, head_dim]` in
    the compute dtype, with each slot's segment id and position (see
    `flaxattn.MultiHeadAttention.init_cache`). A new call starts over with an empty cache.

    Args:
      context_parallel: the `flaxattn.ContextParallel` to decode with (e.g. the run's), which
        the model keeps for later calls; None decodes on one device; left out, the model's.
        With one, call under the mesh: each layer's cache is sharded over its sequence axes
        (`max_length / n` slots per device), a prompt whose length splits over them is
        prefilled with its strategy, and later tokens merge the shards' results by lse.

    Raises:
      ValueError: `scan_layers` (decode the model of `unroll_layers(model)`), or
        `batch_size` / `max_length` not positive ints, or `max_length` > `max_seq_len`;
        with context parallelism, no mesh or `max_length` not divisible by its shards.
    """
    cfg = self.config
    self._check_unrolled()
    assert isinstance(self.layers, nnx.List)  # a list of Blocks, as just checked
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"Llama.init_cache({name}=...) expects a positive int, got {value!r}.")
    if max_length > cfg.max_seq_len:
      raise ValueError(f"Llama.init_cache(max_length=...) expects at most max_seq_len="
                       f"{cfg.max_seq_len}, got {max_length}; RoPE and the masks are defined"
                       " up to max_seq_len. Decode fewer tokens or raise LlamaConfig.max_seq_len.")
    if context_parallel is not dataclasses.MISSING:
      if context_parallel is not None and not isinstance(context_parallel,
                                                         flaxattn.ContextParallel):
        raise TypeError(f"Llama.init_cache(context_parallel=...) expects a"
                        f" flaxattn.ContextParallel or None, got {context_parallel!r}.")
      self.context_parallel = context_parallel
      for b in self.layers:
        b.attn.context_parallel = context_parallel
    for b in self.layers:
      b.attn.init_cache((batch_size, max_length, cfg.dim), DTYPES[cfg.dtype])

  def _check_unrolled(self) -> None:
    if self.config.scan_layers:
      raise ValueError("decode expects a Llama with scan_layers=False, got scan_layers=True:"
                       " the KV caches live in the unrolled layers. Decode"
                       " `unroll_layers(model)`, which holds the same parameters.")

  def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, decode: bool = False) -> jax.Array:
    """Logits `[B, T, vocab_size]` float32 of `tokens` `[B, T]` int.

    Args:
      tokens: token ids `[B, T]`.
      segment_ids: `[B, T]` int32, 0 = padding, documents 1, 2, ...; None = one document
        per row. Tokens attend only inside their own non-zero segment.
      positions: `[B, T]` int32, each token's position inside its document (RoPE and the
        causal/chunked masks use it); None = the token index (under load-balanced context
        parallelism, the permuted index, as `flaxattn.attention`). In decode they describe
        the new tokens; None continues the cached document (see
        `flaxattn.MultiHeadAttention`).
      decode: attend to the KV cache of `init_cache` and append the T new tokens to it
        (a prompt of T tokens, then one at a time). Remat is not applied in decode.

    Raises:
      ValueError: tokens not `[B, T]` or T > max_seq_len; in decode, `scan_layers`, a
        missing cache, or tokens that do not fit in it (see `flaxattn.MultiHeadAttention`).
    """
    return self.from_embeddings(self.embeddings(tokens), segment_ids=segment_ids,
                                positions=positions, decode=decode)

  def embeddings(self, tokens: jax.Array) -> jax.Array:
    """The embeddings `[B, T, dim]` of `tokens` `[B, T]`.

    Raises:
      ValueError: tokens not `[B, T]`.
    """
    if getattr(tokens, "ndim", None) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens expects integer ids of shape [batch, seq], got"
                       f" {getattr(tokens, 'shape', None)} {getattr(tokens, 'dtype', None)}.")
    return embedding_rows(self.embed.embedding[...], tokens, dtype=DTYPES[self.config.dtype])

  def from_embeddings(self, x_BTE: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None, decode: bool = False) -> jax.Array:
    """Logits `[B, T, vocab_size]` float32 of token embeddings `x_BTE` `[B, T, dim]`.

    The decoder after the embedding lookup, so that gradients with respect to the inputs
    exist (causality tests) and callers may feed their own embeddings. Arguments and
    errors as `__call__`.
    """
    return self.logits(self.hidden(x_BTE, segment_ids=segment_ids, positions=positions,
                                   decode=decode))

  def hidden(self, x_BTE: jax.Array, *, segment_ids: jax.Array | None = None,
             positions: jax.Array | None = None, decode: bool = False) -> jax.Array:
    """The final norm's output `[B, T, dim]` in the compute dtype for token embeddings
    `x_BTE`: every layer, then the norm, before the output projection (`logits`). Arguments
    and errors as `__call__`."""
    cfg = self.config
    t = x_BTE.shape[1]
    if t > cfg.max_seq_len:
      raise ValueError(f"tokens expects at most max_seq_len={cfg.max_seq_len} positions, got a"
                       f" sequence of {t}; raise LlamaConfig.max_seq_len.")
    if decode:
      self._check_unrolled()
    x_BTE = x_BTE.astype(DTYPES[cfg.dtype])
    if decode:  # nothing to differentiate, so no remat
      block = functools.partial(Block.__call__, decode=True)
    elif cfg.remat == "none":
      block = _call_block
    else:
      block = nnx.remat(_call_block, policy=REMAT_POLICIES[cfg.remat])
    if isinstance(self.layers, LayerGroup):  # scan_layers: the groups stacked in one
      def run_group(group: LayerGroup, x_BTE):
        for b in group.blocks:
          x_BTE = block(b, x_BTE, segment_ids, positions)
        return x_BTE

      x_BTE = nnx.scan(run_group, in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
                       transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})(self.layers, x_BTE)
    else:
      for b in self.layers:
        x_BTE = block(b, x_BTE, segment_ids, positions)
    return self.norm(x_BTE)

  def head_EV(self) -> jax.Array:
    """The output projection `[dim, vocab_size]` (float32 parameters): the embedding's
    transpose with `tie_embeddings`, else `lm_head`'s kernel."""
    if self.lm_head is None:
      return self.embed.embedding[...].T
    return self.lm_head.kernel[...]

  def logits(self, x_BTE: jax.Array) -> jax.Array:
    """Logits `[B, T, vocab_size]` float32 of the final norm's output `x_BTE` (`hidden`)."""
    return project(x_BTE, self.head_EV(), DTYPES[self.config.dtype])


def unroll_layers(model: Llama) -> Llama:
  """A `Llama` of the unrolled layout (`scan_layers=False`) with `model`'s parameters.

  Layer i gets slice i // period of block i % period's stacked parameters (a copy); the
  embedding, final norm and output head are shared with `model`. `model` itself is returned
  when it is unrolled already. Used to decode a `scan_layers` model (`Llama.init_cache`).
  """
  cfg = model.config
  if not cfg.scan_layers:
    return model
  unrolled = nnx.eval_shape(lambda: Llama(dataclasses.replace(cfg, scan_layers=False),
                                          context_parallel=model.context_parallel,
                                          rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  blocks = params.pop("layers")["blocks"]
  params["layers"] = {i: jax.tree.map(lambda a, g=i // cfg.period: a[g], blocks[i % cfg.period])
                      for i in range(cfg.n_layers)}
  state = nnx.state(unrolled, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(unrolled, state)
  return unrolled


def make_targets(tokens, segment_ids):
  """Next-token targets and loss weights of packed rows.

  Args:
    tokens: `[..., T]` int token ids (numpy or jax).
    segment_ids: `[..., T]` int, 0 = padding, documents 1, 2, ...

  Returns:
    `(targets, weights)`: `targets[..., t] = tokens[..., t + 1]` (0 at the last position),
    int32; `weights[..., t]` float32, 1.0 where tokens t and t + 1 are in the same non-zero
    segment, else 0.0 (padding, a document's last token, the row's last token). numpy in,
    numpy out; jax in, jax out. Apply before any load-balance permutation: it needs the
    original order.

  Raises:
    ValueError: shapes differ or T is missing.
  """
  xp = jnp if isinstance(tokens, jax.Array) or isinstance(segment_ids, jax.Array) else np
  tokens, segment_ids = xp.asarray(tokens), xp.asarray(segment_ids)
  if tokens.shape != segment_ids.shape or tokens.ndim < 1:
    raise ValueError(f"make_targets expects tokens and segment_ids of one shape [..., T], got"
                     f" {tokens.shape} and {segment_ids.shape}.")
  last = xp.zeros_like(tokens[..., :1])
  targets = xp.concatenate([tokens[..., 1:], last], axis=-1).astype(xp.int32)
  same = (segment_ids[..., :-1] == segment_ids[..., 1:]) & (segment_ids[..., :-1] != 0)
  weights = xp.concatenate([same, xp.zeros_like(same[..., :1])], axis=-1).astype(xp.float32)
  return targets, weights


def project(x_BTE: jax.Array, head_EV: jax.Array, dtype) -> jax.Array:
  """Logits `[B, T, V]` float32: `x_BTE` times the output projection `head_EV` `[E, V]`, both
  in the compute `dtype` (as `nnx.Linear` and `nnx.Embed.attend` compute them)."""
  logits_BTV = jnp.dot(x_BTE.astype(dtype), head_EV.astype(dtype))
  return constrain(logits_BTV.astype(jnp.float32), LOGITS_NAMES)


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """logsumexp(logits) - logits[target] per token, `[B, T]` float32."""
  log_z_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
  # A masked sum rather than a gather keeps a vocab-sharded logits array sharded, and
  # unlike a one-hot product it fuses into one pass over the logits.
  vocab_V = jnp.arange(logits_BTV.shape[-1], dtype=targets_BT.dtype)
  hit_BTV = vocab_V == targets_BT[..., None]
  return log_z_BT - jnp.sum(jnp.where(hit_BTV, logits_BTV, 0.0), axis=-1)


# Tokens per device whose float32 logits one step of the chunked loss holds: 1024 x 128256
# x 4 bytes = 0.49 GiB for Llama 3's vocabulary (the whole row's would be O(T x V)).
LOSS_CHUNK_TOKENS = 1024


def loss_chunks(batch: int, length: int, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> int:
  """How many chunks `chunked_token_losses` cuts a `[batch, length]` batch's sequence into:
  the fewest that divide each device's share of the sequence (under the current mesh and
  logical rules) with at most `chunk_tokens` of its tokens per chunk."""
  spec = logical_to_spec(("batch", "seq"), (batch, length))
  shape = dict(jax.sharding.get_abstract_mesh().shape)
  def shards(entry) -> int:
    return math.prod(shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ()))
  local_b, local_t = batch // shards(spec[0]), length // shards(spec[1])
  return next((n for n in range(1, local_t + 1)
               if local_t % n == 0 and local_b * (local_t // n) <= chunk_tokens), local_t)


def _spec_axes(*entries) -> tuple[str, ...]:
  """The mesh axes named by `PartitionSpec` entries (None, an axis, or a tuple of them)."""
  return tuple(a for entry in entries if entry
               for a in ((entry,) if isinstance(entry, str) else entry))


def _per_device(manual: tuple[str, ...], body, out_specs, *in_specs):
  """`body` run per device, a `shard_map` manual over mesh axes `manual` (the others stay
  with the partitioner), or `body` itself when there are none (no mesh)."""
  if not manual:
    return body
  return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs,
                       axis_names=frozenset(manual), check_vma=False)


def embedding_rows(table_VE: jax.Array, tokens_BT: jax.Array, *, dtype) -> jax.Array:
  """`table_VE[tokens_BT]` `[B, T, E]` in the compute `dtype`, sharded as the activations
  (`X_NAMES`); its gradient with respect to the table is summed in float32.

  Under a mesh, each device looks up its own share (a `shard_map` over the mesh axes of the
  table and of the tokens), as the partitioner does the forward: the table's `vocab`
  shards are gathered in `dtype`; along the table's `embed` axes, which also split the
  batch (fsdp), each device looks up its features for the tokens of all the devices there,
  and an all-to-all gives every device its own tokens' whole rows. The backward is the
  reverse: an all-to-all of the rows' gradient, a scatter-add into the device's own block of
  the table, and a sum over the devices that hold that block for other tokens (the context
  axes). Left to the partitioner, the backward scattered into the whole table and
  all-reduced it over every axis (0.98 GiB per step in the v5p-128 8B example).

  Meshes where the activations' features are split, or where the table's `embed` axes
  split the batch only in part or split the sequence, are left to the partitioner.
  """
  plan = _EmbedPlan(dtype, logical_to_spec(("vocab", "embed"), table_VE.shape),
                    logical_to_spec(("batch", "seq"), tokens_BT.shape),
                    logical_to_spec(X_NAMES, (*tokens_BT.shape, table_VE.shape[1])))
  if not plan.per_device_ok:
    # The table's features are sharded over fsdp, as every weight's are, so its rows come
    # out of the lookup sharded on E. Moved to the activations' sharding (batch over fsdp)
    # in one step, the partitioner replicates the whole [B, T, E / fsdp] lookup
    # ("Involuntary full rematerialization"); in two (first the sequence over its axes, the
    # features as they come, then features for batch: an all-to-all), each is one it
    # partitions well.
    rows_BTE = constrain(jnp.take(table_VE.astype(dtype), tokens_BT, axis=0),
                         (None, "seq", "embed"))
    return constrain(rows_BTE, X_NAMES)
  return constrain(_embedding_rows(table_VE, tokens_BT, plan), X_NAMES)


@dataclasses.dataclass(frozen=True)
class _EmbedPlan:
  """How `embedding_rows` runs per device: the compute `dtype`, and the specs of the table
  `[V, E]`, of the tokens `[B, T]` and of the activations `[B, T, E]`."""

  dtype: Any
  table_spec: jax.sharding.PartitionSpec
  tokens_spec: jax.sharding.PartitionSpec
  x_spec: jax.sharding.PartitionSpec

  @property
  def vocab_axes(self) -> tuple[str, ...]:
    return _spec_axes(self.table_spec[0])

  @property
  def embed_axes(self) -> tuple[str, ...]:
    return _spec_axes(self.table_spec[1])

  @property
  def token_axes(self) -> tuple[str, ...]:
    return _spec_axes(*self.tokens_spec)

  @property
  def shares_tokens(self) -> bool:
    """The table's `embed` axes split the batch: the devices along them hold different
    tokens (fsdp), so their rows are exchanged by an all-to-all."""
    return bool(self.embed_axes) and set(self.embed_axes) <= set(_spec_axes(self.tokens_spec[0]))

  @property
  def distinct_vocab(self) -> bool:
    """The devices along the table's `vocab` axes hold different tokens."""
    return bool(self.vocab_axes) and set(self.vocab_axes) <= set(self.token_axes)

  @property
  def per_device_ok(self) -> bool:
    tokens, embed, vocab = set(self.token_axes), set(self.embed_axes), set(self.vocab_axes)
    return (tuple(self.x_spec) == (*self.tokens_spec, None)
            and (self.shares_tokens or not embed & tokens)
            and (self.distinct_vocab or not vocab & tokens))

  def per_device(self, body, out_specs, *specs):
    return _per_device(self.token_axes + self.embed_axes + self.vocab_axes, body, out_specs,
                       *specs)

  def ids(self, tokens_BT: jax.Array) -> jax.Array:
    """The tokens whose rows this device looks up its features of: those of every device
    along the `embed` axes when they hold different tokens, else its own."""
    if self.shares_tokens:
      return jax.lax.all_gather(tokens_BT, self.embed_axes, axis=0, tiled=True)
    return tokens_BT


def _embedding_rows_fwd(table_VE, tokens_BT, plan: _EmbedPlan):
  def body(table_VE, tokens_BT):
    table_VE = table_VE.astype(plan.dtype)
    if plan.vocab_axes:
      table_VE = jax.lax.all_gather(table_VE, plan.vocab_axes, axis=0, tiled=True)
    rows_BTE = jnp.take(table_VE, plan.ids(tokens_BT), axis=0)
    if plan.shares_tokens:  # [devices x B, T, E / devices] -> [B, T, E]
      return jax.lax.all_to_all(rows_BTE, plan.embed_axes, 0, 2, tiled=True)
    if plan.embed_axes:
      return jax.lax.all_gather(rows_BTE, plan.embed_axes, axis=2, tiled=True)
    return rows_BTE

  rows_BTE = plan.per_device(body, plan.x_spec, plan.table_spec, plan.tokens_spec)(
      table_VE, tokens_BT)
  return rows_BTE, (table_VE, tokens_BT)


def _embedding_rows_bwd(plan: _EmbedPlan, residuals, ct_BTE):
  table_VE, tokens_BT = residuals
  vocab = table_VE.shape[0]

  def body(tokens_BT, ct_BTE):
    ids_BT = plan.ids(tokens_BT)
    if plan.shares_tokens:  # [B, T, E] -> [devices x B, T, E / devices]
      ct_BTE = jax.lax.all_to_all(ct_BTE, plan.embed_axes, 2, 0, tiled=True)
    elif plan.embed_axes:  # the same tokens along them: each keeps its features
      width = ct_BTE.shape[2] // jax.lax.axis_size(plan.embed_axes)
      ct_BTE = jax.lax.dynamic_slice_in_dim(
          ct_BTE, jax.lax.axis_index(plan.embed_axes) * width, width, axis=2)
    ct_BTE = ct_BTE.astype(jnp.float32)
    if plan.distinct_vocab:  # every device's tokens reach every vocab shard
      grad_VE = jnp.zeros((vocab, ct_BTE.shape[2]), jnp.float32).at[ids_BT].add(ct_BTE)
      grad_VE = jax.lax.psum_scatter(grad_VE, plan.vocab_axes, scatter_dimension=0,
                                     tiled=True)
    elif plan.vocab_axes:  # the same tokens along them: each adds to its own vocab shard
      rows = vocab // jax.lax.axis_size(plan.vocab_axes)
      local_BT = ids_BT - jax.lax.axis_index(plan.vocab_axes) * rows
      local_BT = jnp.where((local_BT >= 0) & (local_BT < rows), local_BT, rows)
      grad_VE = jnp.zeros((rows, ct_BTE.shape[2]), jnp.float32).at[local_BT].add(
          ct_BTE, mode="drop")
    else:
      grad_VE = jnp.zeros((vocab, ct_BTE.shape[2]), jnp.float32).at[ids_BT].add(ct_BTE)
    # The devices that hold this block of the table for other tokens: the token axes not
    # already summed over above (the sequence's, and the batch's beyond the table's).
    others = tuple(a for a in plan.token_axes
                   if a not in plan.embed_axes and a not in plan.vocab_axes)
    if others:
      grad_VE = jax.lax.psum(grad_VE, others)
    return grad_VE

  grad_VE = plan.per_device(body, plan.table_spec, plan.tokens_spec, plan.x_spec)(
      tokens_BT, ct_BTE)
  return grad_VE.astype(table_VE.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _embedding_rows(table_VE, tokens_BT, plan: _EmbedPlan):
  return _embedding_rows_fwd(table_VE, tokens_BT, plan)[0]


_embedding_rows.defvjp(_embedding_rows_fwd, _embedding_rows_bwd)


def chunked_token_losses(x_BTE: jax.Array, head_EV: jax.Array, targets_BT: jax.Array, *,
                         dtype, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> jax.Array:
  """`cross_entropy(project(x_BTE, head_EV, dtype), targets_BT)`, `[B, T]` float32, without
  the `[B, T, V]` logits: a loop over chunks of the tokens (`loss_chunks`), each chunk's
  logits computed, reduced to its losses and dropped, and recomputed in the backward, so the
  loss holds one chunk's logits at a time.

  Chunk j takes the tokens t with t % n == j (n chunks) of each device's share of the
  sequence. Under a mesh, each device runs the loop on its own tokens (a `shard_map` over
  the mesh axes of the batch, the sequence and the head's `embed`; `vocab` stays with the
  partitioner): the head is gathered once in the compute `dtype` before the loop, forward
  and backward, and its float32 gradient, summed over the chunks on the device, is reduced
  once after the loop (a reduce-scatter to the head's `embed` shards), not in every chunk.

  Raises:
    ValueError: `chunk_tokens` not a positive int.
  """
  if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
    raise ValueError(f"chunked_token_losses(chunk_tokens=...) expects a positive int, got"
                     f" {chunk_tokens!r}.")
  b, t, _ = x_BTE.shape
  n = loss_chunks(b, t, chunk_tokens)
  x_spec = logical_to_spec(("batch", "seq", None), x_BTE.shape)
  head_spec = logical_to_spec(("embed", None), head_EV.shape)
  return _chunked_losses(head_EV, x_BTE, targets_BT, _LossPlan(n, dtype, x_spec, head_spec))


@dataclasses.dataclass(frozen=True)
class _LossPlan:
  """How `chunked_token_losses` runs: `n` chunks per device, the compute `dtype`, and the
  specs of the tokens `[B, T, ...]` and of the head `[E, V]` over the mesh's manual axes."""

  n: int
  dtype: Any
  x_spec: jax.sharding.PartitionSpec
  head_spec: jax.sharding.PartitionSpec

  @property
  def token_axes(self) -> tuple[str, ...]:
    return _spec_axes(*self.x_spec)

  @property
  def embed_axes(self) -> tuple[str, ...]:
    return _spec_axes(*self.head_spec)

  def per_device(self, body, out_specs, *specs):
    """`body` run per device under the current mesh (manual over the token and embed
    axes), or `body` itself without a mesh."""
    return _per_device(self.token_axes + self.embed_axes, body, out_specs, *specs)

  def gathered(self, head_EV: jax.Array) -> jax.Array:
    """The whole head `[E, V]` (vocab as the partitioner shards it) in the compute dtype."""
    head_EV = head_EV.astype(self.dtype)
    if self.embed_axes:
      head_EV = jax.lax.all_gather(head_EV, self.embed_axes, axis=0, tiled=True)
    return constrain(head_EV, (None, "vocab"))

  def chunks(self, a_BT: jax.Array) -> jax.Array:
    """`[B, T, ...]` -> `[n, B, T / n, ...]`, chunk j the tokens t % n == j."""
    b, t, *rest = a_BT.shape
    return jnp.moveaxis(a_BT.reshape(b, t // self.n, self.n, *rest), 2, 0)

  def unchunked(self, a_NBL: jax.Array) -> jax.Array:
    n, b, length, *rest = a_NBL.shape
    return jnp.moveaxis(a_NBL, 0, 2).reshape(b, length * n, *rest)

  def chunk_losses(self, head_EV, x_BLE, targets_BL):
    return cross_entropy(project(constrain(x_BLE, X_NAMES), head_EV, self.dtype), targets_BL)


def _losses_and_head(head_EV, x_BTE, targets_BT, plan: _LossPlan):
  """The chunked loop's losses `[B, T]`, and the head it gathered (whole on each device)."""
  def body(head_EV, x_BTE, targets_BT):
    head_EV = plan.gathered(head_EV)
    ce_NBL = jax.lax.map(lambda xs: plan.chunk_losses(head_EV, *xs),
                         (plan.chunks(x_BTE), plan.chunks(targets_BT)))
    return plan.unchunked(ce_NBL), head_EV

  tokens, whole = jax.sharding.PartitionSpec(*plan.x_spec[:2]), jax.sharding.PartitionSpec()
  return plan.per_device(body, (tokens, whole), plan.head_spec, plan.x_spec, tokens)(
      head_EV, x_BTE, targets_BT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked_losses(head_EV, x_BTE, targets_BT, plan: _LossPlan):
  return _losses_and_head(head_EV, x_BTE, targets_BT, plan)[0]


def _chunked_losses_fwd(head_EV, x_BTE, targets_BT, plan: _LossPlan):
  # The gathered head is kept for the backward: the loss's backward runs right after its
  # forward, so holding it costs no more than gathering it again, which nothing would hide.
  ce_BT, gathered_EV = _losses_and_head(head_EV, x_BTE, targets_BT, plan)
  return ce_BT, (head_EV, gathered_EV, x_BTE, targets_BT)


def _chunked_losses_bwd(plan: _LossPlan, residuals, ct_BT):
  head_EV, gathered_EV, x_BTE, targets_BT = residuals
  param_dtype = head_EV.dtype

  def body(head_EV, x_BTE, targets_BT, ct_BT):  # head_EV: the gathered head
    def step(grad_EV, xs):
      x_BLE, targets_BL, ct_BL = xs
      _, vjp = jax.vjp(lambda h, x: plan.chunk_losses(h, x, targets_BL), head_EV, x_BLE)
      d_head_EV, dx_BLE = vjp(ct_BL)
      return grad_EV + d_head_EV.astype(jnp.float32), dx_BLE

    # Chunks in reverse order, as the transpose of a loop over them sums its gradients.
    grad_EV = constrain(jnp.zeros(head_EV.shape, jnp.float32), (None, "vocab"))
    grad_EV, dx_NBLE = jax.lax.scan(
        step, grad_EV, (plan.chunks(x_BTE), plan.chunks(targets_BT), plan.chunks(ct_BT)),
        reverse=True)
    # Each device holds the sum over its own tokens. A device that shares its tokens with
    # others along an embed axis (the batch not split over it) adds nothing twice.
    copies = tuple(a for a in plan.embed_axes if a not in plan.token_axes)
    if copies:
      grad_EV = jnp.where(jax.lax.axis_index(copies) == 0, grad_EV, 0.0)
    if plan.embed_axes:
      grad_EV = jax.lax.psum_scatter(grad_EV, plan.embed_axes, scatter_dimension=0,
                                     tiled=True)
    others = tuple(a for a in plan.token_axes if a not in plan.embed_axes)
    if others:
      grad_EV = jax.lax.psum(grad_EV, others)
    return grad_EV.astype(param_dtype), plan.unchunked(dx_NBLE)

  tokens, whole = jax.sharding.PartitionSpec(*plan.x_spec[:2]), jax.sharding.PartitionSpec()
  d_head_EV, dx_BTE = plan.per_device(body, (plan.head_spec, plan.x_spec), whole,
                                      plan.x_spec, tokens, tokens)(
      gathered_EV, x_BTE, targets_BT, ct_BT)
  return d_head_EV, dx_BTE, None


_chunked_losses.defvjp(_chunked_losses_fwd, _chunked_losses_bwd)


def token_losses(model: Llama, batch: dict, *,
                 chunk_tokens: int = LOSS_CHUNK_TOKENS) -> jax.Array:
  """Next-token cross entropy of every token of a batch, `[B, T]` float32 (unweighted).

  The same numbers as `cross_entropy(model(tokens, ...), targets)`, computed from the final
  norm's output in chunks of at most `chunk_tokens` tokens per device
  (`chunked_token_losses`): the `[B, T, vocab]` float32 logits are never materialized.

  Args:
    model: a `Llama`.
    batch: `[B, T]` int32 `tokens`, `targets`, `segment_ids` and `positions`.
    chunk_tokens: tokens per device in one chunk of the loss.

  Returns:
    `ce_BT`: logsumexp(logits) - logits[target] per token; padding and last tokens of a
    document included (weight them with `make_targets`'s weights).

  Raises:
    ValueError: as `Llama.__call__`, or `chunk_tokens` not a positive int.
  """
  x_BTE = model.hidden(model.embeddings(batch["tokens"]), segment_ids=batch["segment_ids"],
                       positions=batch["positions"])
  return chunked_token_losses(x_BTE, model.head_EV(), batch["targets"],
                              dtype=DTYPES[model.config.dtype], chunk_tokens=chunk_tokens)


def loss_fn(model: Llama, batch: dict) -> tuple[jax.Array, dict]:
  """Weighted mean next-token cross entropy (float32) of a batch.

  Args:
    model: a `Llama`.
    batch: `[B, T]` arrays: int32 `tokens`, `targets`, `segment_ids`, `positions`, and
      float32 `weights` (from `make_targets`, then permuted with the rest).

  Returns:
    `(loss, {"tokens": sum of weights})`; loss is sum(weights * ce) / max(sum(weights), 1),
    so a batch without targets gives 0, not NaN.
  """
  ce_BT = token_losses(model, batch)
  weights_BT = batch["weights"].astype(jnp.float32)
  tokens = jnp.sum(weights_BT)
  loss = jnp.sum(ce_BT * weights_BT) / jnp.maximum(tokens, 1.0)
  return loss, {"tokens": tokens}


def param_shapes(config: LlamaConfig) -> dict:
  """The parameters of `Llama(config)`: a nested dict (`nnx.to_pure_dict` paths) of
  `jax.ShapeDtypeStruct`, from shapes only (no memory used, no jax backend started)."""
  return jax.eval_shape(
      lambda: nnx.to_pure_dict(nnx.state(Llama(config, rngs=nnx.Rngs(0)), nnx.Param)))


def param_changes(old: LlamaConfig, new: LlamaConfig) -> list[str]:
  """The fields of `new` that give `Llama` other parameters (tree or shapes) than `old`.

  Derived from the model itself: each differing field is set alone on `old` and the
  parameter shapes compared, so a new option that changes them is found without a list.
  Fields that change them only together (or that cannot be set alone) are all named.
  Empty when both configs give the same parameters.
  """
  def same(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.shape == y.shape for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

  shapes = param_shapes(old)
  if same(shapes, param_shapes(new)):
    return []
  differ = [f.name for f in dataclasses.fields(LlamaConfig)
            if getattr(old, f.name) != getattr(new, f.name)]

  def changes(name):
    try:
      alone = dataclasses.replace(old, **{name: getattr(new, name)})
    except ValueError:
      return True
    return not same(shapes, param_shapes(alone))

  return [n for n in differ if changes(n)] or differ


def num_params(config: LlamaConfig) -> int:
  """Number of parameters of `Llama(config)`, from shapes only (`param_shapes`)."""
  return sum(math.prod(p.shape) for p in jax.tree.leaves(param_shapes(config)))


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
  """Training FLOPs (forward + backward) per token for rows of `seq_len` tokens.

  Counted: 6 x the matmul parameters (2 FLOPs per multiply-add, backward twice the
  forward): per layer the q, k, v, out and w1, w2, w3 kernels, plus the output projection
  (`vocab_size x dim`, tied or not). Attention scores and values (QK^T, PV):
  12 x dim x (keys a query sees on average) per layer, with seq_len / 2 keys for causal
  layers, min(chunk_size, seq_len) / 2 for chunked ones and about the window for
  sliding-window ones. Each row is counted as one
  document: packed rows do less attention work, so the attention term is an upper bound.
  Not counted: the embedding lookup, norms, RoPE, softmax, activations, residual adds.

  Raises:
    ValueError: seq_len not a positive int.
  """
  layers, head, attention = _per_token(config, seq_len)
  return 6.0 * (layers + head) + 12.0 * attention


def step_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
  """The FLOPs a training step runs per token, `flops_per_token`'s and what it recomputes:
  under remat "full" or "offload" each layer's forward again (its matmuls, 2 x their
  parameters, and its attention's QK^T and PV, 4 x dim x keys), under "dots" the
  attention's; and in every attention's backward the scores again (QK^T, 2 x dim x keys:
  flash attention keeps no [T, T] probabilities). The count `python -m train.compile`'s
  estimate takes its compute time from.

  Raises:
    ValueError: seq_len not a positive int.
  """
  layers, _, attention = _per_token(config, seq_len)
  again = {"none": 0.0, "dots": 4.0 * attention}.get(config.remat,
                                                      2.0 * layers + 4.0 * attention)
  return flops_per_token(config, seq_len) + again + 2.0 * attention


def _per_token(config: LlamaConfig, seq_len: int) -> tuple[float, float, float]:
  """(the layers' matmul parameters, the output projection's, and heads x head_dim x the
  keys a query sees on average summed over the layers) for rows of `seq_len` tokens."""
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
    raise ValueError(f"flops_per_token(seq_len=...) expects a positive int, got {seq_len!r}.")
  d, hd = config.dim, config.attn_head_dim
  attn = d * config.n_heads * hd * 2 + d * config.n_kv_heads * hd * 2
  mlp = 3 * d * config.ffn_dim
  def mean_keys(m):  # keys a query sees, on average over a row
    if isinstance(m, flaxattn.Local):
      w = min(m.window, seq_len)
      return w - w * (w - 1) / (2 * seq_len)  # w keys, fewer in the first w - 1 rows
    return seq_len / 2 if m == flaxattn.Causal() else min(m.size, seq_len) / 2

  keys = sum(mean_keys(m) for m in layer_masks(config))
  return (float(config.n_layers * (attn + mlp)), float(config.vocab_size * d),
          config.n_heads * hd * keys)
