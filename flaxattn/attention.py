"""`flaxattn.attention`: the one functional entry point, its input checks and `explain`."""

from __future__ import annotations

from typing import Any

import jax
import jax.core  # jax.core.Tracer: jax imports the module but does not export the name
import jax.numpy as jnp
import numpy as np

from flaxattn import blocks, checks, planner, registry
from flaxattn import blockwise as blockwise_blocks
from flaxattn import decode as cp_decode
from flaxattn.context_parallel import (
  ContextParallel,
  axis_size,
  choose,
  context_parallel_attention,
  head_groups_for,
)
from flaxattn.layout import Layout, resolve, shape_error
from flaxattn.masks import Causal, Mask, check_mask
from flaxattn.mods import ScoreMod, check_score_mod

# Each axis of q/k/v `[B, T, H, D]` and what one entry of it is, for the empty-axis error.
_AXES = (("batch", "row"), ("seq", "token"), ("heads", "head"), ("head_dim", "feature"))


def check_qkv(q, k, v) -> None:
  """Raises ValueError unless q `[B,T,H,D]`, k `[B,S,Hkv,D]`, v `[B,S,Hkv,Dv]` floating, same
  dtype, no axis empty, H % Hkv == 0."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise shape_error(name, x, "a 4-D array [batch, seq, heads, head_dim]")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise shape_error(name, x, "a floating dtype (float32, bfloat16, float16)")
    for i, (axis, entry) in enumerate(_AXES):
      if x.shape[i] == 0:  # kernels divide by these sizes; an empty result has no use
        raise ValueError(f"{name} expects at least one {entry} on axis {i} ({axis}), got shape"
                         f" {x.shape}; skip attention for empty inputs.")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v expect one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them"
                     " first.")
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(f"k and v expect the same [B, S, Hkv] (v may have its own head_dim), got"
                     f" {k.shape} and {v.shape}.")
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(f"q {q.shape} and k {k.shape} expect the same batch (dim 0) and head_dim"
                     " (dim 3).")
  if q.shape[2] % k.shape[2]:
    raise ValueError(
        f"q heads ({q.shape[2]}) expect a multiple of k/v heads ({k.shape[2]}) for grouped-query"
        f" attention; got q {q.shape}, k {k.shape}.")


def _check_sinks(q, sinks) -> None:
  if sinks is not None and (getattr(sinks, "shape", None) != (q.shape[2],)
                            or not jnp.issubdtype(sinks.dtype, jnp.floating)):
    raise shape_error("sinks", sinks, f"a floating array [H] = [{q.shape[2]}], one logit per query"
                      " head, or None")


# Bounds of the numbers that set up the scores. Past MAX_SCALE, float32 scores overflow to
# inf for ordinary inputs (and softmax gives NaN); past MAX_SOFT_CAP, scores divided by the
# cap fall below float32's normal range and flush to zero (a cap of 1e38 flattens
# attention). Scales in use are below 1 (head_dim ** -0.5), caps tens.
MAX_SCALE = 1e6
MAX_SOFT_CAP = 1e6


def check_soft_cap(logit_soft_cap) -> float | None:
  """`logit_soft_cap` as a float, or None.

  Raises:
    ValueError: not None nor a number (e.g. a bool or a string), not in (0, MAX_SOFT_CAP],
      inf or NaN (a cap of inf would give NaN, not "no cap").
  """
  if logit_soft_cap is None:
    return None
  return checks.number("logit_soft_cap", logit_soft_cap,
                       f"a positive number at most {MAX_SOFT_CAP:g} (e.g. 50.0) or None",
                       lambda x: 0 < x <= MAX_SOFT_CAP,
                       "caps in use are tens; larger ones lose float32 precision")


def check_scale(scale) -> float | None:
  """`scale` as a float, or None (the default, head_dim ** -0.5).

  Raises:
    ValueError: not None nor a number (e.g. a bool or a string), not in (0, MAX_SCALE], inf
      or NaN.
  """
  if scale is None:
    return None
  return checks.number("scale", scale,
                       f"a positive number at most {MAX_SCALE:g} (e.g. 0.125) or None for"
                       " head_dim ** -0.5", lambda x: 0 < x <= MAX_SCALE,
                       "larger scales overflow float32 scores")


def apply_sinks(out, lse, sinks):
  """One sink logit per head joined to each row's softmax (docs/design.md, "Attention sinks").

  A sink is a key of logit `sinks[h]` and value 0: it adds exp(sinks[h]) to the denominator,
  so out' = out * exp(lse - lse') with lse' = logaddexp(lse, sinks[h]). Applied once to the
  merged (out, lse) of any kernel or context-parallel strategy; autodiff gives d sinks and
  the lse cotangent the kernels' backward passes take.

  Args: out `[B, T, H, Dv]`, lse `[B, T, H]` float32 (-inf: no key), sinks `[H]`.
  Returns: out' in out's dtype (zeros where lse is -inf) and lse' `[B, T, H]` float32.
  """
  sinks_H = sinks.astype(jnp.float32)
  # exp(lse - lse') = sigmoid(lse - sink): finite, with finite gradients, when lse = -inf.
  keep_BTH = jax.nn.sigmoid(lse - sinks_H)
  out = (out.astype(jnp.float32) * keep_BTH[..., None]).astype(out.dtype)
  return out, jnp.logaddexp(lse, sinks_H)


def _call(q, k, v, mask, layout: Layout, return_lse: bool, context_parallel, has_sinks: bool,
          soft_cap, score_mod) -> registry.Call:
  if context_parallel is None:
    return registry.Call.of(q, k, v, mask, layout, return_lse, has_sinks=has_sinks,
                            soft_cap=soft_cap, score_mod=score_mod)
  cp = context_parallel
  ring = axis_size(cp, cp.ring_axis) if cp.ring_axis else None
  return registry.Call.of(q, k, v, mask, layout, return_lse, axis_size(cp) * (ring or 1),
                          cp.strategy, ring, has_sinks=has_sinks, soft_cap=soft_cap,
                          score_mod=score_mod)


def _layout(q, k, mask, segment_ids, positions, kv_segment_ids, kv_positions, context_parallel,
            layout):
  if context_parallel is not None and not isinstance(context_parallel, ContextParallel):
    raise TypeError(f"context_parallel expects a flaxattn.ContextParallel or None, got"
                    f" {context_parallel!r}.")
  if layout is None:
    return check_mask(mask), resolve(q.shape, k.shape, segment_ids, positions, kv_segment_ids,
                                     kv_positions, context_parallel)
  given = [name for name, x in (("segment_ids", segment_ids), ("positions", positions),
                                ("kv_segment_ids", kv_segment_ids),
                                ("kv_positions", kv_positions)) if x is not None]
  if not isinstance(layout, Layout) or given:
    raise TypeError(f"layout expects a flaxattn.layout.Layout from flaxattn.layout.resolve, in"
                    f" place of segment_ids/positions/kv_segment_ids/kv_positions; got"
                    f" {type(layout).__name__} with {given or 'no'} id arguments.")
  return check_mask(mask), layout


def attention(q, k, v, *, mask: Mask = Causal(), segment_ids=None, positions=None,
              kv_segment_ids=None, kv_positions=None, scale: float | None = None,
              backend: str = "auto", context_parallel=None, return_lse: bool = False,
              sinks=None, logit_soft_cap: float | None = None, layout: Layout | None = None,
              score_mod: ScoreMod | None = None):
  """Exact attention over packed sequences.

  Args:
    q: `[B, T, H, D]` float32/bfloat16/float16.
    k: `[B, S, Hkv, D]`, v: `[B, S, Hkv, Dv]` (Dv may differ from D, as in MLA), same dtype;
      H must be a multiple of Hkv (GQA/MQA).
    mask: a `flaxattn` mask (default `Causal()`): the built-ins on positions, a
      `flaxattn.MaskMod` on batch rows, heads and token indices, combined with &, |, ~.
    segment_ids: `[B, T]` int, 0 = padding, documents 1, 2, ...; None = one document.
    positions: `[B, T]` int, position of each token inside its document; None = token index.
    kv_segment_ids, kv_positions: `[B, S]` for keys; default to the query ones when S == T.
    scale: score scale, a positive finite number; None: `D ** -0.5`.
    backend: "auto", a kernel name ("blockwise", "cudnn", "pallas_gpu", "mosaic_gpu",
      "splash", "split_k", "reference"), "fused" (the first of cudnn, pallas_gpu,
      blockwise that serves the call; see `flaxattn.explain`), or a kernel object
      carrying options, e.g. `flaxattn.splash.Splash(block_q=256)`.
    context_parallel: a `flaxattn.ContextParallel` to run with the sequence axis sharded.
    return_lse: also return the log-sum-exp of each query row, `[B, T, H]` float32 (with
      `sinks`, the sink's term included).
    sinks: `[H]` float, one logit per query head that joins every row's softmax denominator
      with no value (attention sinks, as in gpt-oss); differentiable. None: no sinks.
    logit_soft_cap: scores become `cap * tanh(scale * q.k / cap)` before masking (Gemma 2:
      the scale is applied first), forward and backward; a positive finite number. None:
      no cap.
    score_mod: a `flaxattn.ScoreMod`: every score changed by a function of it and where
      it sits, after the soft cap and before masking; its float operands receive
      gradients. None: none.
    layout: the ids already resolved by `flaxattn.layout.resolve` (with this
      `context_parallel`), in place of the four id arguments: how `MultiHeadAttention`
      passes what it resolved for RoPE. Used as it is, unchecked.

  Returns:
    `[B, T, H, Dv]` in q's dtype (and the log-sum-exp if asked). A query with nothing to
    attend to gets zeros (lse -inf, or the sink's logit with `sinks`) and zero gradients.

  Raises:
    ValueError / TypeError naming the offending argument on malformed input (among them an
    empty axis of q, k or v, and a `scale` or `logit_soft_cap` that is not a positive finite
    number), and when an explicit backend cannot serve the call (e.g. cuDNN with
    `logit_soft_cap`).
  """
  check_qkv(q, k, v)
  _check_sinks(q, sinks)
  return_lse = checks.boolean("return_lse", return_lse)
  soft_cap = check_soft_cap(logit_soft_cap)
  scale = check_scale(scale)
  score_mod = check_score_mod(score_mod)
  mask, layout = _layout(q, k, mask, segment_ids, positions, kv_segment_ids, kv_positions,
                         context_parallel, layout)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  # A shared block map serves the calls of the ids it was built from, on one device.
  mask = blocks.bind(mask, layout, q.shape, k.shape, sharded=context_parallel is not None)
  if context_parallel is not None:  # strategy="auto": chosen per call
    context_parallel, _ = choose(context_parallel, q.shape, k.shape, np.dtype(q.dtype).itemsize,
                                 mask)
  # Sinks need every kernel's lse; they are applied once, to the merged result.
  with_lse = return_lse or sinks is not None
  call = _call(q, k, v, mask, layout, with_lse, context_parallel, sinks is not None, soft_cap,
               score_mod)
  kernels = registry.per_platform(backend, call)
  here = kernels[registry.lowering_name(call.platform)]
  options: dict[str, Any] = dict(mask=mask, scale=scale, return_lse=with_lse)
  if soft_cap is not None:  # only kernels with `soft_cap = True` take it (registry.Kernel)
    options["soft_cap"] = soft_cap
  if score_mod is not None:  # likewise `score_mod = True`
    options["score_mod"] = score_mod

  def run(kernel):
    cp = context_parallel
    if cp is None:
      return lambda q, k, v, layout: kernel(q, k, v, layout, **options)
    return lambda q, k, v, layout: context_parallel_attention(
        q, k, v, layout, cp=cp, kernel=kernel, **options)

  # The kernel of each platform the program is lowered for (one unless `lowering_for` names
  # several: then `platform_dependent`, and the lowering keeps its own).
  others = {p: run(kernel) for p, kernel in kernels.items() if kernel != here}
  if not others:
    result = run(here)(q, k, v, layout)
  else:
    result = jax.lax.platform_dependent(q, k, v, layout, default=run(here), **others)
  if sinks is None:
    return result
  out, lse = result
  out, lse = apply_sinks(out, lse, sinks)
  return (out, lse) if return_lse else out


def _block_map_text(mask: Mask, q, k, layout: Layout, backend, call: registry.Call) -> str:
  """The counts of a programmable mask's block map in the blocks of the kernel that runs
  it (where concrete values are given), or why they are not shown."""
  values = [*jax.tree.leaves(mask), *jax.tree.leaves(layout)]
  if any(isinstance(x, (jax.ShapeDtypeStruct, jax.core.Tracer)) for x in values):
    return ("block map: computed on device per call (concrete operands and ids give the"
            " counts here)")
  try:
    kernel = registry.select(backend, call)
  except ValueError:
    return "block map: no kernel serves the call"
  # The kernel's blocks where it has options for them (None: chosen per call), else 512.
  bq = getattr(kernel, "block_q", None) or blockwise_blocks.DEFAULT_BLOCK_Q
  bk = getattr(kernel, "block_kv", None) or blockwise_blocks.DEFAULT_BLOCK_KV
  kinds = blocks.block_map(mask, q.shape[1], k.shape[1], segment_ids=layout.q_segment_ids,
                           positions=layout.q_positions, kv_segment_ids=layout.kv_segment_ids,
                           kv_positions=layout.kv_positions, batch=q.shape[0],
                           heads=q.shape[2], block_q=bq, block_kv=bk)
  c = blocks.counts(kinds)
  return (f"block map ({kernel.name}'s {bq} x {bk} blocks, found on device): {c['empty']}"
          f" empty, {c['partial']} partial (masked in the kernel), {c['full']} full, of"
          f" {sum(c.values())} (flaxattn.blocks.draw pictures it)")


def explain(q, k, v, *, mask: Mask = Causal(), segment_ids=None, positions=None,
            kv_segment_ids=None, kv_positions=None, backend="auto", context_parallel=None,
            return_lse: bool = False, sinks=None, logit_soft_cap: float | None = None,
            decode: bool = False, balance_plan=None, score_mod: ScoreMod | None = None,
            print_fn=print) -> str:
  """Prints (and returns) which kernel `attention` would use for these arguments on this
  platform, why each registered kernel accepts or declines, and what `backend` would run
  on each platform (cpu, gpu, tpu) with the reasons of the kernels it passed over (e.g.
  "blockwise (cudnn declines: ...)"). Arrays or
  `jax.ShapeDtypeStruct`s work; with `context_parallel`, call it under the mesh.

  `decode=True`: q are a decode step's new tokens and k/v the layer's whole KV cache
  `[B, max_length, Hkv, D]` (`MultiHeadAttention.init_cache`), attended with the cached
  segment ids and positions, as the layer does: it says which kernel the step takes and
  why (decode-shaped calls take `split_k`, a prefill the training kernels). With
  `context_parallel` it describes the kernel each device runs on its shard of the cache
  and what a step moves between the shards (`flaxattn.decode`).

  `balance_plan`: the `flaxattn.BalancePlan` the per-token arrays were ordered by (with
  `ContextParallel(load_balance="document")`): the text then says which order each row
  took, document or row, and the balance of both (`BalancePlan.describe`).

  Raises:
    ValueError / TypeError naming the offending argument on malformed input, as `attention`
    does.
  """
  if decode and context_parallel is not None:
    n = cp_decode.shards(context_parallel)
    cp_decode.check_length(context_parallel, k.shape[1])
    def shard(x):
      return jax.ShapeDtypeStruct((x.shape[0], x.shape[1] // n, *x.shape[2:]), x.dtype)
    text = explain(q, shard(k), shard(v), mask=mask, segment_ids=segment_ids,
                   positions=positions, backend=backend, return_lse=True, sinks=sinks,
                   logit_soft_cap=logit_soft_cap, decode=True, score_mod=score_mod,
                   print_fn=None)
    text += "\n" + cp_decode.communication(context_parallel, q.shape, v.shape[-1], k.shape[1])
    if print_fn is not None:
      print_fn(text)
    return text
  if decode:  # the layer passes the cache's ids and positions, and the new tokens'
    def ids(x, length):
      return jax.ShapeDtypeStruct((q.shape[0], length), jnp.int32) if x is None else x
    segment_ids, positions = ids(segment_ids, q.shape[1]), ids(positions, q.shape[1])
    kv_segment_ids, kv_positions = ids(kv_segment_ids, k.shape[1]), ids(kv_positions, k.shape[1])
  check_qkv(q, k, v)
  _check_sinks(q, sinks)
  return_lse = checks.boolean("return_lse", return_lse)
  soft_cap = check_soft_cap(logit_soft_cap)
  score_mod = check_score_mod(score_mod)
  mask, layout = _layout(q, k, mask, segment_ids, positions, kv_segment_ids, kv_positions,
                         context_parallel, None)
  plan = None
  if context_parallel is not None:
    context_parallel, plan = choose(context_parallel, q.shape, k.shape,
                                    np.dtype(q.dtype).itemsize, mask)
  call = _call(q, k, v, mask, layout, return_lse or sinks is not None, context_parallel,
               sinks is not None, soft_cap, score_mod)
  text = registry.describe(backend, call)
  if plan is not None:
    text += "\n" + planner.describe_plan(*plan)
  if context_parallel is not None:
    cp = context_parallel
    text += "\n" + planner.communication(
        cp.strategy, cp.load_balance, mask, q.shape[1], axis_size(cp),
        layout.q_positions is not None, axis_size(cp, cp.ring_axis) if cp.ring_axis else None)
    if cp.strategy == "ring" or cp.ring_axis:  # a ring sums the steps' partial gradients
      sums = jnp.dtype(q.dtype if cp.grad_dtype is None else cp.grad_dtype).name
      text += (f"\nbackward: the ring sums dQ and the travelling dK/dV in {sums}"
               + (" (grad_dtype=None: the inputs' dtype)" if cp.grad_dtype is None else
                  " (grad_dtype)"))
      groups = head_groups_for(cp, q.shape, k.shape)
      how = "head_groups" if cp.head_groups else "head_groups=None: chosen for these shapes"
      text += ("\nring: all heads go round together" if groups == 1 else
               f"\nring: the heads go round in {groups} groups, one after the other; a device"
               f" holds one group's K/V blocks and gradient sums at a time") + f" ({how})"
  if mask.needs_tiles:
    text += "\n" + _block_map_text(mask, q, k, layout, backend, call)
  if balance_plan is not None:
    text += "\n" + balance_plan.describe()
  if decode:
    text += (f"\ndecode: q are {q.shape[1]} new token(s) attending to {k.shape[1]} cache slots"
             " (k/v), masked by the cached segment ids and positions (an empty slot has segment"
             " id 0).")
  if print_fn is not None:
    print_fn(text)
  return text
