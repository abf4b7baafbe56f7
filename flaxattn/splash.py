"""Splash attention (JAX's Pallas TPU kernel) behind the flaxattn kernel interface.

Masks are lazy splash masks (`CausalMask`, `LocalMask`, `ChunkedCausalMask`, `FullMask`,
combined with `&`): the kernel evaluates them inside each block, so building a kernel holds
O(T + (T / block)^2) host memory (the per-block MaskInfo; its host time still visits every
block once); a `NumpyMask` of the whole sequence (O(T^2) host memory and compile time) is
never built. Packed documents go through `SegmentIds`. Off TPU the kernel runs in Pallas
interpret mode, which is how it is tested on CPU.

Splash masks on token INDEX, flaxattn on POSITIONS, so the kernel is exact only when the
two agree up to a per-document shift. The contract (checked statically where possible,
stated in the decline reasons otherwise):
  - default positions (`positions=None`): every mask is exact;
  - explicit positions: `Full` always; `Causal`/`Local` only with `segment_ids`, and the
    caller guarantees that each document is contiguous with its own id and that positions
    restart at 0 at each document and increase by one token to token (what a packing
    pipeline produces; NOT load-balanced / permuted rows). Positions are traced data, so
    this is not checked;
  - `Chunked` with explicit positions declines: splash chunks by index, which matches
    only if every document starts at a multiple of the chunk size, unknowable at trace time.

GQA runs the MQA kernel once per KV head (vmapped) with that head's group of query heads,
so K/V are never repeated. The log-sum-exp comes from the kernel's residuals; gradients run
splash's fused dK/dV/dQ kernel with the lse cotangent folded into its row term `di`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from flaxattn import registry
from flaxattn.layout import Layout
from flaxattn.masks import And, Causal, Chunked, Full, Local, Mask

LANES = 128  # splash's blocks are multiples of the TPU lane width
DEFAULT_BLOCK = 512

# A mask as lazy parts: () is Full; otherwise ("causal",), ("local", window), ("chunked", size).
Parts = tuple[tuple, ...]


def lazy_parts(mask: Mask) -> Parts | str:
  """`mask` as the splash lazy masks whose intersection it is, or a reason it has none.

  Causal is absorbed by Local/Chunked (both are causal), windows intersect to the smallest.
  """
  causal, windows, sizes = False, set(), set()
  for m in (mask.masks if isinstance(mask, And) else (mask,)):
    if isinstance(m, Full):
      continue
    if isinstance(m, Causal):
      causal = True
    elif isinstance(m, Local):
      windows.add(m.window)
    elif isinstance(m, Chunked):
      sizes.add(m.size)
    else:
      return f"mask {m!r} has no lazy splash equivalent."
  if len(sizes) > 1:
    return f"splash has no lazy mask for Chunked masks of different sizes {sorted(sizes)} combined."
  parts = tuple([("local", min(windows))] if windows else []) + tuple(("chunked", s) for s in sizes)
  return parts or ((("causal",),) if causal else ())


def _splash_mask(parts: Parts, length: int) -> sm.Mask:
  shape = (length, length)
  build = {"causal": lambda: sm.CausalMask(shape),
           # ours: p - w < k <= p, i.e. w - 1 keys to the left and none to the right.
           "local": lambda w: sm.LocalMask(shape, window_size=(w - 1, 0), offset=0),
           "chunked": lambda s: sm.ChunkedCausalMask(shape, chunk_size=s)}
  masks = [build[kind](*args) for kind, *args in parts]
  if not masks:
    return sm.FullMask(shape)
  return functools.reduce(lambda a, b: a & b, masks)


def block_size(length: int, requested: int = DEFAULT_BLOCK) -> int:
  """The largest multiple of 128 that is at most `requested` and divides `length`."""
  for b in range(min(requested, length) // LANES * LANES, 0, -LANES):
    if length % b == 0:
      return b
  raise ValueError(f"splash needs a block size that is a multiple of {LANES}, at most"
                   f" {requested} and dividing the sequence length {length}; none exists.")


def splash_unsupported_reason(call: registry.Call) -> str | None:
  """None if splash serves `call` exactly (see the module docstring), else why not."""
  t, s = call.q_shape[1], call.kv_shape[1]
  if t != s:
    return (f"splash serves self attention only (masks on token index): query length {t} !="
            f" key length {s}. Use 'fused'.")
  if t % LANES:
    return (f"splash needs a sequence length that is a multiple of {LANES}, got {t}; pad the"
            " sequence (padding as segment 0) or use 'fused'.")
  parts = lazy_parts(call.mask)
  if isinstance(parts, str):
    return parts
  if call.has_positions and any(kind == "chunked" for kind, *_ in parts):
    return ("Chunked with explicit positions: splash chunks by token index, which equals"
            " chunking by position only if every document starts at a multiple of the chunk"
            " size, and that cannot be checked at trace time. Omit positions or use 'fused'.")
  if call.has_positions and parts and not call.has_segment_ids:
    return ("explicit positions without segment_ids: splash masks on token index, which"
            " matches the positions only for packed documents (segment_ids given) whose"
            " positions restart at 0 and increase by one; permuted (load-balanced) positions"
            " are not supported. Pass segment_ids, omit positions, or use 'fused'.")
  return None


@functools.lru_cache(maxsize=64)
def _kernel(parts: Parts, length: int, groups: int, bq: int, bkv: int, interpret: bool):
  """The MQA splash kernel for `groups` query heads per KV head (cached: built once)."""
  sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                        block_kv_dkv=bkv, block_kv_dkv_compute=bkv, use_fused_bwd_kernel=True)
  mask = sm.MultiHeadMask([_splash_mask(parts, length)] * groups)
  # Mask infos must be concrete constants even when first built inside a jit trace.
  with jax.ensure_compile_time_eval():
    return sk.make_splash_mqa(mask, block_sizes=sizes, save_residuals=True, head_shards=1,
                              q_seq_shards=1, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _splash(key, q, k, v, segment_ids):
  """q `[B, Hkv, G, T, D]` (scaled), k/v `[B, Hkv, T, D]`, segment_ids `SegmentIds` of
  `[B, T]` or None. Returns out `[B, Hkv, G, T, D]` and lse `[B, Hkv, G, T]` float32."""
  return _splash_fwd(key, q, k, v, segment_ids)[0]


def _splash_fwd(key, q, k, v, segment_ids):
  kernel = _kernel(*key)
  over_heads = jax.vmap(lambda q, k, v, seg: kernel(q, k, v, segment_ids=seg),
                        in_axes=(0, 0, 0, None))
  out, (lse,) = jax.vmap(over_heads)(q, k, v, segment_ids)
  return (out, lse), (q, k, v, segment_ids, out, lse)


def _splash_bwd(key, residuals, cotangents):
  kernel = _kernel(*key)
  q, k, v, segment_ids, out, lse = residuals
  dout, dlse = cotangents
  sizes, kw = kernel.kwargs["block_sizes"], kernel.kwargs

  def one(q, k, v, seg, out, lse, dout, dlse):
    # d lse / d s = p: an lse cotangent enters exactly as a shift of the row term di.
    di = jnp.einsum("htd,htd->ht", out.astype(jnp.float32), dout.astype(jnp.float32)) - dlse
    # Splash's own VJP cannot take an lse cotangent (it refuses to differentiate with
    # save_residuals), so call its fused backward kernel directly (jax 0.10 internals).
    dq, dk, dv = sk._splash_attention_bwd_dkv(  # pylint: disable=protected-access
        q, k, v, seg, None, lse, dout, di, bq=sizes.block_q_dkv, bkv=sizes.block_kv_dkv,
        bkv_compute=sizes.block_kv_dkv_compute, is_mqa=True, mask_info=kernel.dkv_mask_info,
        mask_value=kw["mask_value"], attn_logits_soft_cap=None, use_fused_bwd_kernel=True,
        q_layout=sizes.q_layout, k_layout=sizes.k_layout, v_layout=sizes.v_layout,
        mask_function=kw["mask_function"], interpret=kw["interpret"])
    return dq, dk, dv

  over_heads = jax.vmap(one, in_axes=(0, 0, 0, None, 0, 0, 0, 0))
  dq, dk, dv = jax.vmap(over_heads)(q, k, v, segment_ids, out, lse, dout, dlse.astype(jnp.float32))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_splash.defvjp(_splash_fwd, _splash_bwd)


def splash_attention(q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
                     block_q: int | None = None, block_kv: int | None = None):
  """Splash attention over packed sequences (self attention, T a multiple of 128).

  Args:
    q: `[B, T, H, D]`; k, v: `[B, T, Hkv, D]`, H a multiple of Hkv; float32/bfloat16.
    layout: segment ids (0 = padding) and positions; see the module docstring for which
      positions are exact. Padding queries get zeros, lse -inf and zero gradients.
    block_q, block_kv: block sizes, multiples of 128 dividing T (default: the largest such
      at most 512).
  Returns:
    `[B, T, H, D]` in q's dtype; with `return_lse` also lse `[B, T, H]` float32.
  Raises:
    ValueError: a call `splash_unsupported_reason` declines (mask without a lazy splash
      equivalent, T not a multiple of 128, query and key lengths differ).
  """
  b, t, h, d = q.shape
  hkv = k.shape[2]
  g = h // hkv
  parts = lazy_parts(mask)
  if isinstance(parts, str) or k.shape[1] != t:
    raise ValueError(f"splash cannot serve mask={mask!r} with q {q.shape}, k {k.shape}: "
                     f"{parts if isinstance(parts, str) else 'query and key lengths differ.'}")
  bq = block_size(t, block_q or DEFAULT_BLOCK)
  bkv = block_size(t, block_kv or DEFAULT_BLOCK)
  key = (parts, t, g, bq, bkv, registry.current_platform() != "tpu")
  q_BKGTD = (q * jnp.asarray(scale, q.dtype)).reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4)
  k_BKTD, v_BKTD = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  segment_ids = None
  if layout.q_segment_ids is not None:
    segment_ids = sk.SegmentIds(q=layout.q_segment_ids, kv=layout.kv_segment_ids)
  out_BKGTD, lse_BKGT = _splash(key, q_BKGTD, k_BKTD, v_BKTD, segment_ids)
  out = out_BKGTD.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
  lse = lse_BKGT.transpose(0, 3, 1, 2).reshape(b, t, h)
  if segment_ids is not None:
    # Splash lets padding (segment 0) attend to padding; ours gives it nothing to attend to.
    padding = (layout.q_segment_ids == 0)[:, :, None]
    out = jnp.where(padding[..., None], jnp.zeros((), out.dtype), out)
    lse = jnp.where(padding, -jnp.inf, lse)
  return (out, lse) if return_lse else out
