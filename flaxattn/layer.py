"""`flaxattn.MultiHeadAttention`: a drop-in for `flax.nnx.MultiHeadAttention`.

Same constructor and call arguments, submodule names (`query`, `key`, `value`, `out`,
`query_ln`, `key_ln`) and kernel shapes as nnx, so `nnx.update(ours, nnx.state(theirs,
nnx.Param))` carries weights over (that replaces our Variables and so drops their logical
axis names; `nnx.update(ours, nnx.to_pure_dict(nnx.state(theirs, nnx.Param)))` keeps them).
Differences, all because attention here never builds a
`[T, S]` array:
  - masks are `flaxattn` masks on positions (constructor `mask=`, default `Full()` as nnx
    without a mask, or per call); a boolean mask array raises and says to pass
    `segment_ids`/`positions` instead;
  - no attention-probability dropout (`dropout_rate` must be 0) and no `sow_weights`;
  - `attention_fn` has `flaxattn.attention`'s signature, not `nnx.dot_product_attention`'s.
Additions: `num_kv_heads` (GQA), `backend`, `context_parallel`, `rope`, `sinks`,
`logit_soft_cap`, `v_head_dim`, and call-time `segment_ids`, `positions`, `kv_segment_ids`,
`kv_positions` for packed sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from flax.nnx.nn.linear import default_kernel_init

from flaxattn import checks
from flaxattn.attention import apply_sinks, attention, check_soft_cap
from flaxattn.kv_cache import KVCache, is_refused
from flaxattn.layout import Layout, resolve, shape_error
from flaxattn.masks import Causal, Full, Mask, check_mask
from flaxattn.mods import ScoreMod, check_score_mod
from flaxattn.rope import RoPE
from flaxattn.sharding import constrain, param_metadata

# Logical axis names of activations and parameters (see flaxattn.sharding).
Q_NAMES = ("batch", "seq", "heads", "head_dim")
KV_NAMES = ("batch", "seq", "kv_heads", "head_dim")
X_NAMES = ("batch", "seq", "embed")

_EMPTY = MappingProxyType({})


def _check_size(arg: str, value, optional: bool = False) -> None:
  checks.positive_int(f"MultiHeadAttention({arg}=...)", value, optional)


def _check_input(arg: str, x, features: int, features_arg: str) -> None:
  if getattr(x, "ndim", 0) < 2:
    raise ValueError(f"{arg} expects an array [..., seq, features] (any number of leading batch"
                     f" axes, as nnx), got shape {getattr(x, 'shape', None)}.")
  if x.shape[-1] != features:
    raise ValueError(f"{arg} expects {features} features ({features_arg}={features}), got shape"
                     f" {x.shape}.")
  if math.prod(x.shape[:-1]) == 0:
    raise ValueError(f"{arg} expects at least one token (axis -2) in every batch axis, got"
                     f" shape {x.shape}; skip the call for empty inputs.")


def _fold_batch(shape) -> tuple[int, ...]:
  """`(..., L, F)` -> `(B, L, F)`, B the product of the leading axes (1 when there are none):
  the kernels take one batch axis, nnx any number."""
  return (math.prod(shape[:-2]),) + tuple(shape[-2:])


def _fold_ids(arg: str, x, batch: tuple[int, ...], length: int):
  """Segment ids or positions `[..., L]` with the inputs' leading axes `batch`, as `[B, L]`."""
  if x is None or len(batch) == 1:  # one batch axis: checked as it is by `resolve`
    return x
  if getattr(x, "shape", None) != batch + (length,):
    raise shape_error(arg, x, f"shape {batch + (length,)} (the inputs' leading axes, then tokens)")
  return x.reshape(math.prod(batch), length)


def _check_config(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                  in_kv_features, dropout_rate, rope, v_head_dim) -> None:
  _check_size("num_heads", num_heads)
  _check_size("in_features", in_features)
  for arg, value in (("qkv_features", qkv_features), ("out_features", out_features),
                     ("num_kv_heads", num_kv_heads), ("in_kv_features", in_kv_features),
                     ("v_head_dim", v_head_dim)):
    _check_size(arg, value, optional=True)
  qkv_features = qkv_features or in_features
  num_kv_heads = num_kv_heads or num_heads
  if qkv_features % num_heads:
    raise ValueError(f"qkv_features ({qkv_features}) expects a multiple of num_heads"
                     f" ({num_heads}): head_dim = qkv_features // num_heads.")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_kv_heads ({num_kv_heads}) expects a divisor of num_heads"
                     f" ({num_heads}): each KV head serves num_heads // num_kv_heads query heads.")
  if dropout_rate != 0.0:
    raise ValueError(f"dropout_rate expects 0.0, got {dropout_rate!r}: flaxattn kernels never"
                     " form the attention probabilities to drop; apply nnx.Dropout to the output.")
  if rope is not None and not isinstance(rope, RoPE):
    raise TypeError(f"rope expects a flaxattn.RoPE or None, got {rope!r} ({type(rope).__name__}).")
  head_dim = qkv_features // num_heads
  if rope is not None and head_dim % 2:
    raise ValueError(f"rope expects an even head_dim, got head_dim {head_dim}"
                     f" (qkv_features {qkv_features} / num_heads {num_heads}).")


class MultiHeadAttention(nnx.Module):
  """Multi-head (and grouped-query) attention over packed sequences.

  Args (beyond `nnx.MultiHeadAttention`'s, whose meaning is unchanged):
    num_kv_heads: heads of `key`/`value` (GQA/MQA); must divide `num_heads`. Default num_heads.
    backend: `flaxattn.attention` backend: "auto", a kernel name, or a kernel object with
      options (e.g. `flaxattn.splash.Splash(block_q=256)`).
    mask: a `flaxattn` mask (default `Full()`, as nnx without a mask; pass `Causal()` for
      a decoder, or `is_causal=True` per call).
    context_parallel: a `flaxattn.ContextParallel`, passed to `flaxattn.attention`.
    rope: a `flaxattn.RoPE` applied to queries and keys at their positions, or None.
    sinks: a learned sink logit per query head (`sinks` Param `[num_heads]`, zeros at init,
      logical axis `heads`) joining every row's softmax (see `flaxattn.attention`).
    logit_soft_cap: scores become `cap * tanh(scores / cap)` (after the scale), or None.
    score_mod: a `flaxattn.ScoreMod` applied to the scores after the soft cap (or per call);
      operands that are `nnx.Param`s (ALiBi slopes, a relative-position bias table) are
      the layer's parameters and train.
    v_head_dim: head dim of the values (and of the out projection's input); default
      head_dim. The value kernel is `(embed, kv_heads, v_head_dim)`.
    attention_fn: called as `flaxattn.attention` is (default), e.g. a `functools.partial` of
      it with `scale=`. `flaxattn.attention` (or a partial of it) gets the layout the layer
      resolved as `layout=`; any other function the four id arrays.
    dropout_rate: must be 0; attention dropout needs the `[T, S]` probabilities.
    broadcast_dropout, deterministic, keep_rngs: accepted for compatibility; unused.

  Parameters carry logical axis names as `out_sharding` metadata: query kernel
  `(embed, heads, head_dim)`, key/value kernels `(embed, kv_heads, head_dim)`, out kernel
  `(heads, head_dim, embed)`; pass `kernel_metadata` etc. to override.

  Raises:
    ValueError: a size that is not a positive int (`v_head_dim` included), a `logit_soft_cap`
      that is not a positive number, `qkv_features` not divisible by
      `num_heads`, `num_heads` not divisible by `num_kv_heads`, `dropout_rate` != 0, or an
      odd head_dim with `rope`.
    TypeError: `mask` not a flaxattn mask, `rope` not a `RoPE`.
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      qkv_features: int | None = None,
      out_features: int | None = None,
      num_kv_heads: int | None = None,
      in_kv_features: int | None = None,
      *,
      dtype=None,
      param_dtype=jnp.float32,
      broadcast_dropout: bool = True,
      dropout_rate: float = 0.0,
      deterministic: bool | None = None,
      precision=None,
      kernel_init=default_kernel_init,
      out_kernel_init=None,
      bias_init=initializers.zeros_init(),
      out_bias_init=None,
      use_bias: bool = True,
      attention_fn: Callable[..., Any] = attention,
      decode: bool | None = None,
      normalize_qk: bool = False,
      qkv_promote_dtype=dtypes.promote_dtype,
      out_promote_dtype=dtypes.promote_dtype,
      ln_promote_dtype=dtypes.promote_dtype,
      rngs: nnx.Rngs,
      keep_rngs: bool = True,
      kernel_metadata: Mapping[str, Any] = _EMPTY,
      out_kernel_metadata: Mapping[str, Any] = _EMPTY,
      bias_metadata: Mapping[str, Any] = _EMPTY,
      out_bias_metadata: Mapping[str, Any] = _EMPTY,
      query_ln_scale_metadata: Mapping[str, Any] = _EMPTY,
      key_ln_scale_metadata: Mapping[str, Any] = _EMPTY,
      backend="auto",
      mask: Mask = Full(),
      context_parallel=None,
      rope: RoPE | None = None,
      sinks: bool = False,
      logit_soft_cap: float | None = None,
      v_head_dim: int | None = None,
      score_mod: ScoreMod | None = None,
  ):
    _check_config(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                  in_kv_features, dropout_rate, rope, v_head_dim)
    self.num_heads = num_heads
    self.in_features = in_features
    self.qkv_features = qkv_features or in_features
    self.out_features = out_features or in_features
    self.num_kv_heads = num_kv_heads or num_heads
    self.in_kv_features = in_kv_features or in_features
    self.head_dim = self.qkv_features // num_heads
    self.v_head_dim = v_head_dim or self.head_dim
    self.logit_soft_cap = check_soft_cap(logit_soft_cap)
    # Pytrees: a MaskMod's operands are data (the built-ins have none).
    self.mask = nnx.data(check_mask(mask))
    # A pytree whose nnx.Param operands nnx sees (and trains), read by `_score_mod`.
    self.score_mod = nnx.data(check_score_mod(score_mod))
    self.backend = backend
    self.context_parallel = context_parallel
    self.rope = rope
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.broadcast_dropout = broadcast_dropout
    self.dropout_rate = dropout_rate
    self.deterministic = deterministic
    self.precision = precision
    self.use_bias = use_bias
    self.attention_fn = attention_fn
    self.decode = decode
    self.normalize_qk = normalize_qk

    qkv = functools.partial(
        nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
        bias_init=bias_init, use_bias=use_bias, precision=precision,
        promote_dtype=qkv_promote_dtype, rngs=rngs)
    heads = (num_heads, self.head_dim)
    self.query = qkv(
        in_features, heads,
        kernel_metadata=param_metadata(("embed", "heads", "head_dim"), kernel_metadata),
        bias_metadata=param_metadata(("heads", "head_dim"), bias_metadata))
    # K/V get their own logical name so that rules can replicate them when there are fewer
    # KV heads than the tensor axis has devices (see flaxattn.sharding.rules).
    kv_kernel = param_metadata(("embed", "kv_heads", "head_dim"), kernel_metadata)
    kv_bias = param_metadata(("kv_heads", "head_dim"), bias_metadata)
    self.key = qkv(self.in_kv_features, (self.num_kv_heads, self.head_dim),
                   kernel_metadata=kv_kernel, bias_metadata=kv_bias)
    self.value = qkv(self.in_kv_features, (self.num_kv_heads, self.v_head_dim),
                     kernel_metadata=kv_kernel, bias_metadata=kv_bias)
    # A sink is a logit with no value, one per query head; zeros start it at one extra key.
    self.sinks = (nnx.Param(jnp.zeros((num_heads,), param_dtype), **param_metadata(("heads",), {}))
                  if sinks else nnx.data(None))

    if normalize_qk:
      # QK normalization (arxiv.org/abs/2302.05442), as nnx: LayerNorm over head_dim.
      ln = functools.partial(nnx.LayerNorm, self.head_dim, use_bias=False, dtype=dtype,
                             param_dtype=param_dtype, promote_dtype=ln_promote_dtype, rngs=rngs)
      self.query_ln = ln(scale_metadata=param_metadata(("head_dim",), query_ln_scale_metadata))
      self.key_ln = ln(scale_metadata=param_metadata(("head_dim",), key_ln_scale_metadata))
    else:
      self.query_ln = nnx.data(None)
      self.key_ln = nnx.data(None)

    self.out = nnx.LinearGeneral(
        (num_heads, self.v_head_dim), self.out_features, axis=(-2, -1), dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=out_kernel_init or kernel_init, bias_init=out_bias_init or bias_init,
        use_bias=use_bias, precision=precision, promote_dtype=out_promote_dtype, rngs=rngs,
        kernel_metadata=param_metadata(("heads", "head_dim", "embed"),
                                       out_kernel_metadata or kernel_metadata),
        bias_metadata=param_metadata(("embed",), out_bias_metadata or bias_metadata))

    self.cache: KVCache | None = nnx.data(None)  # `init_cache`

  def __call__(
      self,
      inputs_q: jax.Array,
      inputs_k: jax.Array | None = None,
      inputs_v: jax.Array | None = None,
      *,
      mask: Mask | None = None,
      deterministic: bool | None = None,
      rngs=None,
      sow_weights: bool = False,
      decode: bool | None = None,
      is_causal: bool = False,
      out_sharding=None,
      qkv_sharding=None,
      segment_ids: jax.Array | None = None,
      positions: jax.Array | None = None,
      kv_segment_ids: jax.Array | None = None,
      kv_positions: jax.Array | None = None,
      score_mod: ScoreMod | None = None,
  ) -> jax.Array:
    """Attention of `inputs_q` `[..., T, in_features]` over `inputs_k`/`inputs_v`
    `[..., S, in_kv_features]`: any leading batch axes (none or several, as nnx), the same
    for all three; below, `B` stands for them.

    Args:
      inputs_q: queries; `inputs_k` defaults to `inputs_q`, `inputs_v` to `inputs_k`.
      mask: a `flaxattn` mask overriding the constructor's for this call (a `MaskMod` with
        this batch's operands, e.g. prefix lengths: new values do not recompile).
      score_mod: a `flaxattn.ScoreMod` overriding the constructor's for this call.
      is_causal: also apply `Causal()` (as nnx).
      decode: use the KV cache (see `init_cache`); T may be > 1 (prefill). Default: the
        constructor's `decode`, else False. With `context_parallel` the cache is sharded
        (`flaxattn.decode`): T a multiple of the strategy's split is a prefill, sequence
        sharded like a training batch (in `load_balance`'s order), run with the strategy;
        any other T is a decode step in the original order, merged across the shards by
        lse. `attention_fn` must then take `return_lse=True`.
      segment_ids, positions: `[B, T]` int (packed documents; see `flaxattn.attention`).
        In decode they describe the new tokens. Left out, the new tokens continue the last
        cached token's document (its segment id) and position (+1, +2, ...); from an empty
        cache they are one document from position 0. Positions left out with segment ids
        given count up inside each run of equal ids, the first run continuing the cached
        document when it has the same id. Under `load_balance="document"` both are
        required: a prefill in document order does not say which token came last.
      kv_segment_ids, kv_positions: `[B, S]` for cross attention; not allowed in decode.
      deterministic, rngs: accepted for compatibility; there is no dropout.
      out_sharding, qkv_sharding: passed to the output / QKV `LinearGeneral` calls.

    Returns:
      `[B, T, out_features]`.

    Raises:
      ValueError: inputs of rank < 2, with the wrong feature size or other leading axes than
        inputs_q, a boolean `mask` array,
        `sow_weights=True`, ids or positions not `[B, T]` integers that fit in int32, decode
        without `init_cache` or with a mismatched cache (shape or context_parallel), default
        ids or positions in decode under `load_balance="document"`. Decode that would write
        past the cache, or default segment ids after a cache that ends in padding: a
        ValueError before anything is written when the cache is concrete; inside a compiled
        program the call writes nothing, returns NaN and records the error in the cache,
        raised at the next eager decode call or `self.cache.check()` (`flaxattn.kv_cache`).
    """
    inputs_k, inputs_v = self._check_inputs(inputs_q, inputs_k, inputs_v)
    # Any leading batch axes (none, or several) fold into one, and unfold on the way out.
    batch, t, s = inputs_q.shape[:-2], inputs_q.shape[-2], inputs_k.shape[-2]
    inputs_q, inputs_k, inputs_v = (x.reshape(_fold_batch(x.shape))
                                    for x in (inputs_q, inputs_k, inputs_v))
    segment_ids, positions = (_fold_ids(a, x, batch, t) for a, x in
                              (("segment_ids", segment_ids), ("positions", positions)))
    kv_segment_ids, kv_positions = (_fold_ids(a, x, batch, s) for a, x in
                                    (("kv_segment_ids", kv_segment_ids),
                                     ("kv_positions", kv_positions)))
    mask = self._call_mask(mask, is_causal)
    score_mod = self._score_mod(score_mod)
    if sow_weights:
      raise ValueError("sow_weights expects False: flaxattn never materializes the [T, S]"
                       " attention weights; use nnx.MultiHeadAttention to inspect them.")
    decode = bool(self.decode if decode is None else decode)
    if decode and s != t:
      raise ValueError(f"inputs_k and inputs_v expect inputs_q's length in decode, {t} new"
                       f" token(s), got {s} (inputs_k shape {inputs_k.shape}): the cache writes"
                       " one key and value per new query, with its segment id and position."
                       " Pass the new tokens' inputs_k/inputs_v, or decode=False for cross"
                       " attention.")
    if decode and (kv_segment_ids is not None or kv_positions is not None):
      raise ValueError("kv_segment_ids and kv_positions expect None in decode: the cache holds"
                       " the keys' segments and positions; pass segment_ids/positions of the"
                       " new tokens instead.")

    q_BTHD, k_BSKD, v_BSKD = self._project(inputs_q, inputs_k, inputs_v, qkv_sharding)
    # The same resolution as flaxattn.attention's, so RoPE rotates by the positions the
    # kernel masks with (under load balancing, default positions are the permuted index).
    layout = resolve(q_BTHD.shape, k_BSKD.shape, segment_ids, positions, kv_segment_ids,
                     kv_positions, self.context_parallel)
    b = q_BTHD.shape[0]  # the batch axes folded into one
    cache = self._cache(k_BSKD) if decode else None
    error = None  # the cache's error record after a call inside a program: see kv_cache
    update = None  # the cache after the call, written last: a call that raises writes nothing
    prefill = False
    if cache is not None:
      prefill = cache.is_prefill(t)
      ids_BT, pos_BT, error = cache.new_tokens(t, layout.q_segment_ids, layout.q_positions,
                                               prefill)
      layout = Layout(ids_BT, ids_BT, pos_BT, pos_BT)
    if self.rope is not None:
      q_pos_BT, k_pos_BS = layout.positions(b, t, s)
      q_BTHD, k_BSKD = self.rope(q_BTHD, q_pos_BT), self.rope(k_BSKD, k_pos_BS)
    # Passed only when set, so an `attention_fn` without them keeps working.
    extras = {}
    if self.sinks is not None:
      extras["sinks"] = self.sinks[...]
    if self.logit_soft_cap is not None:
      extras["logit_soft_cap"] = self.logit_soft_cap
    if score_mod is not None:
      extras["score_mod"] = score_mod
    if cache is not None and self.context_parallel is not None:  # the cache is sharded
      if score_mod is not None or mask.reads_index:
        raise ValueError(
            f"decode with context_parallel expects a mask and score_mod of positions (the"
            f" built-ins), got mask {mask} and score_mod {score_mod}: the sharded cache keeps"
            " no token indices for a MaskMod or ScoreMod to read. Decode on one device, or"
            " pass built-in masks.")
      q_BTHD, k_BSKD, v_BSKD = dtypes.promote_dtype((q_BTHD, k_BSKD, v_BSKD), dtype=self.dtype)
      options = {"mask": mask, "backend": self.backend, "return_lse": True}
      if "logit_soft_cap" in extras:
        options["logit_soft_cap"] = extras["logit_soft_cap"]
      out, lse, update = cache.attend_sharded(
          q_BTHD, k_BSKD, v_BSKD, layout.q_segment_ids, layout.q_positions, error,
          self.attention_fn, options, prefill)
      if "sinks" in extras:
        out, lse = apply_sinks(out, lse, extras["sinks"])
      x_BTHD = out.astype(q_BTHD.dtype)
    else:
      if cache is not None:  # attend to the whole cache, the new tokens included
        k_BSKD, v_BSKD, kv_ids_BS, kv_pos_BS, update = cache.append(
            k_BSKD, v_BSKD, layout.q_segment_ids, layout.q_positions, error)
        layout = dataclasses.replace(layout, kv_segment_ids=kv_ids_BS, kv_positions=kv_pos_BS,
                                     **cache.indices(t))
      q_BTHD, k_BSKD, v_BSKD = dtypes.promote_dtype((q_BTHD, k_BSKD, v_BSKD), dtype=self.dtype)
      x_BTHD = self.attention_fn(q_BTHD, k_BSKD, v_BSKD, mask=mask, backend=self.backend,
                                 context_parallel=self.context_parallel,
                                 **self._ids(layout), **extras)
    if (refused := is_refused(error)) is not None:
      x_BTHD = jnp.where(refused, jnp.nan, x_BTHD)
    x_BTHD = constrain(x_BTHD, Q_NAMES)
    out_BTE = constrain(self.out(x_BTHD, out_sharding=out_sharding), X_NAMES)
    if cache is not None and update is not None:
      cache.commit(update)
    return out_BTE.reshape(batch + out_BTE.shape[1:])

  def _ids(self, layout: Layout) -> dict:
    """The ids argument(s) of `attention_fn`: `flaxattn.attention` (or a partial of it) takes
    the layout resolved here as it is; any other function the four arrays."""
    if getattr(self.attention_fn, "func", self.attention_fn) is attention:
      return {"layout": layout}
    return dict(segment_ids=layout.q_segment_ids, positions=layout.q_positions,
                kv_segment_ids=layout.kv_segment_ids, kv_positions=layout.kv_positions)

  def _check_inputs(self, inputs_q, inputs_k, inputs_v):
    """`inputs_k` and `inputs_v` with nnx's defaults, all three checked."""
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("inputs_k expects an array when inputs_v is given; to use one array for"
                         " both, pass it as inputs_k and leave inputs_v None.")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    _check_input("inputs_q", inputs_q, self.in_features, "in_features")
    _check_input("inputs_k", inputs_k, self.in_kv_features, "in_kv_features")
    _check_input("inputs_v", inputs_v, self.in_kv_features, "in_kv_features")
    for arg, x in (("inputs_k", inputs_k), ("inputs_v", inputs_v)):
      if x.shape[:-2] != inputs_q.shape[:-2]:
        raise ValueError(f"{arg} expects the leading (batch) axes of inputs_q,"
                         f" {inputs_q.shape[:-2]}, got shape {x.shape}.")
    if inputs_v.shape[-2] != inputs_k.shape[-2]:
      raise ValueError(f"inputs_v expects as many tokens as inputs_k ({inputs_k.shape[-2]}), got"
                       f" shape {inputs_v.shape}.")
    return inputs_k, inputs_v

  def _project(self, inputs_q, inputs_k, inputs_v, qkv_sharding):
    """q `[B, T, H, D]`, k and v `[B, S, K, D]`, QK-normalized if asked."""
    q_BTHD = constrain(self.query(inputs_q, out_sharding=qkv_sharding), Q_NAMES)
    k_BSKD = constrain(self.key(inputs_k, out_sharding=qkv_sharding), KV_NAMES)
    v_BSKD = constrain(self.value(inputs_v, out_sharding=qkv_sharding), KV_NAMES)
    if self.query_ln is not None and self.key_ln is not None:  # normalize_qk
      q_BTHD, k_BSKD = self.query_ln(q_BTHD), self.key_ln(k_BSKD)
    return q_BTHD, k_BSKD, v_BSKD

  def _score_mod(self, score_mod) -> ScoreMod | None:
    """The call's score mod (else the constructor's), its `nnx.Variable` operands read."""
    score_mod = self.score_mod if score_mod is None else check_score_mod(score_mod)
    return jax.tree.map(lambda x: x[...] if isinstance(x, nnx.Variable) else x, score_mod,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))

  def _call_mask(self, mask, is_causal: bool) -> Mask:
    if mask is None:
      mask = self.mask
    elif not isinstance(mask, Mask):
      raise ValueError(
          f"mask expects a flaxattn mask (Full(), Causal(), Local(w), Window(left, right),"
          f" Chunked(n), MaskMod(fn, *operands)) or None, got"
          f" {type(mask).__name__} of shape {getattr(mask, 'shape', None)}. flaxattn never"
          " materializes [T, S] masks: describe padding and packed documents with"
          " segment_ids=[B, T] (0 = padding) and positions=[B, T], and the pattern with a mask.")
    if is_causal and not mask.is_causal:
      mask = Causal() if mask == Full() else mask & Causal()
    return mask

  def init_cache(self, input_shape, dtype=jnp.float32) -> None:
    """Allocates an empty KV cache (`self.cache`, a `flaxattn.KVCache`) for `decode=True`
    calls.

    Args:
      input_shape: `(..., max_length, features)`, the shape of the longest input, with the
        leading batch axes of the decode calls (none, one or several, as nnx) and
        `features` = in_features.
      dtype: dtype of the cached keys and values: float32, bfloat16 or float16 (float64
        under `jax.enable_x64`); new keys and values are cast to it on write.

    The cache holds the unrepeated GQA keys/values `[B, max_length, num_kv_heads, head_dim]`
    and each slot's segment id (0 = empty, never attended) and position; B is the product
    of the leading axes. A decode call that would write past `max_length` is refused and
    writes nothing (see `flaxattn.kv_cache`).

    With `context_parallel`, call it under the mesh (`jax.set_mesh`): the slots are sharded
    over the sequence axes (`max_length / n` per device), the batch and heads as inside
    `flaxattn.attention`'s context parallelism; where tokens go is `flaxattn.decode`'s
    placement. Decode then expects the same `context_parallel`.

    After it, `cached_key`, `cached_value` and `cache_index` read the cache under nnx's
    names and shapes (read-only).

    Raises:
      ValueError: `input_shape` is not `(..., max_length, in_features)` of positive ints;
        `dtype` not one of the floating dtypes above; with `context_parallel`, no mesh, or
        `max_length` not divisible by the sequence shards.
    """
    if (not isinstance(input_shape, (tuple, list)) or len(input_shape) < 2
        or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in input_shape)
        or input_shape[-1] != self.in_features):
      raise ValueError(f"init_cache(input_shape=...) expects (..., max_length, features) of"
                       f" positive ints, rank 2 or more, with features = in_features"
                       f" ({self.in_features}), got {input_shape!r}; pass the shape of the"
                       " longest input, features last.")
    self.cache = KVCache(tuple(input_shape[:-2]), input_shape[-2], self.num_kv_heads,
                         self.head_dim, self.v_head_dim, dtype, heads=self.num_heads,
                         context_parallel=self.context_parallel)

  # nnx.MultiHeadAttention's names for its cache, read from `self.cache`.

  @property
  def cached_key(self) -> jax.Array | None:
    """The cached keys `[..., max_length, num_kv_heads, head_dim]` with the leading axes
    `init_cache` was given (nnx's `cached_key`), in the cache's dtype; None before
    `init_cache`. Read-only: assigning to it, or into it, raises (writing means
    `self.cache.keys`, whose batch axes are folded into one, and its segment ids).

    On one device slot j holds the j-th token written. Under `context_parallel` the slots
    are the sharded cache's: device d of the n sequence shards holds slots
    `[d max_length/n, (d+1) max_length/n)`, filled in `flaxattn.decode`'s placement
    (decode steps round-robin over the devices, a prefill's tokens in the strategy's
    order), so slot order is not token order; `self.cache.segment_ids` and
    `self.cache.positions` say which token each slot holds (segment id 0: empty)."""
    return None if self.cache is None else self._unfold(self.cache.keys[...])

  @property
  def cached_value(self) -> jax.Array | None:
    """The cached values `[..., max_length, num_kv_heads, v_head_dim]` (nnx's
    `cached_value`), as `cached_key`: read-only, in the same slot order."""
    return None if self.cache is None else self._unfold(self.cache.values[...])

  @property
  def cache_index(self) -> jax.Array | None:
    """int32 scalar: the tokens written so far (nnx's `cache_index`); None before
    `init_cache`. On one device it is the next token's slot; under `context_parallel` the
    next token's slot is `flaxattn.decode`'s placement of that index. Read-only."""
    return None if self.cache is None else self.cache.index[...]

  def _unfold(self, x_BS):
    """A cache array `[B, S, ...]` as `[*batch_axes, S, ...]`."""
    assert self.cache is not None
    return x_BS.reshape(self.cache.batch_axes + x_BS.shape[1:])

  def _cache(self, k) -> KVCache:
    """The cache, checked against new keys `k` `[B, T, Hkv, D]` (see `KVCache.check_keys`)."""
    if self.cache is None:
      raise ValueError("decode=True expects a KV cache: call init_cache((batch, max_length,"
                       " features)) first.")
    self.cache.check_keys(k, self.context_parallel)
    return self.cache

  def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
               batch_size: int | None = None, max_length: int | None = None):
    """For `nnx.view`, as nnx: sets the modes; `decode=True` allocates a missing cache.

    Raises:
      TypeError: `decode=True` without a cache and without `batch_size` and `max_length`.
    """
    if deterministic is not None:
      self.deterministic = deterministic
    if decode is not None:
      self.decode = decode
      if decode and self.cache is None:
        if batch_size is None or max_length is None:
          raise TypeError("set_view(decode=True) expects batch_size and max_length to allocate"
                          " the cache.")
        self.init_cache((batch_size, max_length, self.in_features), self.dtype or jnp.float32)
