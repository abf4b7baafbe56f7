"""cuDNN fused attention on NVIDIA GPUs: the `cudnn` kernel.

Owns the call into JAX's cuDNN SDPA (plain BTNH rows, or packed rows in the THD layout from
`seqlens_and_offsets`), the run-time check that cuDNN's index masks equal flaxattn's
position masks for a batch (else the blockwise kernel runs it), the exact lse and its
cotangent, and the zeros of padding and one-sided documents. Derivations: docs/design.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fsa

from flaxattn import aot, checked, checks, cudnn_ring, registry
from flaxattn.layout import Layout, index_check
from flaxattn.masks import Mask, NoBand, band
from flaxattn.segments import SeqlensOffsets, seqlens_and_offsets

DTYPES = ("bfloat16", "float16")
DEFAULT_MAX_SEGMENTS = 32
MAX_HEAD_DIM = 256  # Hopper and newer; 128 before (checked on a live device)
HOPPER = (9, 0)
# Temporaries of one forward+backward call, in bytes per element of B x T x H x D (query
# heads) x itemsize, measured on one H100 (jax 0.11.2, docs/design.md "cuDNN THD memory"):
# the packed (THD) call holds 4.06 to 4.28 per slot of its descriptor (M = 8, 16, 32; T =
# 8K, 32K, 128K; H = 16, 32), from JAX's own THD backward; the unpacked call 6.03.
THD_BYTES_PER_SLOT = 4.3
UNPACKED_BYTES = 6.0
GIB = 2**30


# ---------------------------------------------------------------------------------------
# What cuDNN can serve


def mask_band(mask: Mask) -> tuple[bool, int | None]:
  """`(causal, window)` of the cuDNN diagonal band equal to `mask`.

  Raises:
    NoBand: a mask cuDNN has no band for (Chunked, a window with keys after the query or
      not ending at it), with the reason.
  """
  normal = band(mask)
  if normal.chunk is not None:
    raise NoBand(f"cuDNN has no chunked mask ({mask!r}, Llama 4 chunked attention); the"
                 " pallas_gpu and blockwise kernels serve it.")
  if normal.hi is None and normal.lo is None:
    return False, None
  if normal.hi != 0 or (normal.lo is not None and normal.lo > 0):
    span = " .. ".join("unbounded" if x is None else f"{x:+d}" for x in (normal.lo, normal.hi))
    raise NoBand(f"cuDNN's masks are causal, with or without a window of earlier keys, but"
                 f" {mask!r} lets a query see keys at offsets {span} from its own; the"
                 " pallas_gpu and blockwise kernels serve it.")
  return True, None if normal.lo is None else 1 - normal.lo


@functools.lru_cache(maxsize=1)
def _cudnn_version() -> int | None:
  """The version of the cuDNN library this process loads (tracing checks it), or None."""
  try:
    return fsa.check_cudnn_version()
  except RuntimeError:
    return None


def missing_here() -> str | None:
  """Why cuDNN's calls cannot be traced on this host for a GPU target (its library, which
  JAX reads while tracing, is not installed), or None."""
  if _cudnn_version() is None:
    return ("cuDNN is not installed on this host (pip install nvidia-cudnn-cu12): any call a"
            " GPU would run with cuDNN was compiled with the next kernel of the GPU row"
            " (mosaic_gpu for Hopper, else pallas_gpu).")
  return None


@functools.lru_cache(maxsize=1)
def _local_gpu() -> tuple[bool, tuple[int, ...] | None, int | None, str]:
  """(CUDA?, compute capability, cuDNN version, device kind) of this process's first GPU."""
  device = jax.devices("gpu")[0]
  cuda = "cuda" in device.client.platform_version.lower()
  return cuda, aot.local_gpu_capability(), _cudnn_version(), device.device_kind


def _gpu() -> tuple[bool, tuple[int, ...] | None, int | None, str] | None:
  """`_local_gpu`'s answer for the GPU a program traced now is for: a target's
  (`aot.target_gpu_capability`, with this host's cuDNN, which traces it) or this process's; None
  when neither is known (an export from a host without a GPU: reason from the call)."""
  capability = aot.target_gpu_capability()
  if capability is not None:
    kind = jax.sharding.get_abstract_mesh().abstract_device.device_kind  # pyright: ignore[reportOptionalMemberAccess]
    return True, capability, _cudnn_version(), kind
  return _local_gpu() if jax.default_backend() == "gpu" else None


@contextlib.contextmanager
def _jax_checks_on_target():
  """JAX's own cuDNN checks read the compute capability of this process's GPU; for a
  target's GPU (`aot.target_gpu_capability`) they answer from the target while the call is
  traced."""
  have = aot.target_gpu_capability()
  if have is None:
    yield
    return

  def parse(capability: str) -> tuple[int, ...]:
    return tuple(int(x) for x in capability.split("."))
  saved = fsa.check_compute_capability, fsa.is_cuda_compute_capability_equal
  fsa.check_compute_capability = lambda c: have >= parse(c)
  fsa.is_cuda_compute_capability_equal = lambda c: have == parse(c)
  try:
    yield
  finally:
    fsa.check_compute_capability, fsa.is_cuda_compute_capability_equal = saved


def _device_reason(gpu, head_dim: int, packed: bool) -> str | None:
  """Why GPU `gpu` (`_gpu`'s answer) cannot run the call."""
  cuda, capability, version, kind = gpu
  if not cuda or capability is None:
    return (f"cuDNN fused attention needs an NVIDIA (CUDA) GPU; this one is {kind}. Use the"
            " blockwise kernel.")
  if version is None or version < 90000:
    return (f"cuDNN fused attention needs cuDNN >= 9.0, found {version}; install a newer"
            " cuDNN (the nvidia-cudnn-cu12 wheel) or use the blockwise kernel.")
  if capability == (10, 3) and version < 91100:
    return f"compute capability 10.3 needs cuDNN >= 9.11, found {version}; upgrade cuDNN."
  if head_dim > 128 and capability < HOPPER:
    return (f"head_dim {head_dim} > 128 needs a Hopper or newer GPU for cuDNN; this is"
            f" {kind} (sm{capability[0]}{capability[1]}). Use the blockwise kernel.")
  if packed and capability < HOPPER:
    return (f"cuDNN's packed (THD) layout, used for segment_ids, needs a Hopper or newer GPU;"
            f" this is {kind} (sm{capability[0]}{capability[1]}). Use the blockwise kernel.")
  if packed and version < 90600:
    # The oldest cuDNN that JAX's own packed-layout test runs on.
    return (f"cuDNN's packed (THD) layout, used for segment_ids, needs cuDNN >= 9.6, found"
            f" {version}; upgrade cuDNN or use the blockwise kernel.")
  return None


def _reason(call: registry.Call) -> str | None:
  """None if cuDNN serves `call` exactly (docs/design.md), else one sentence why not.

  A pure function of `call` and the GPU it is for (compute capability, cuDNN version):
  this process's, or a compile-only target's under `jax.set_mesh` (`_gpu`); asking about
  "gpu" from a CPU machine without either reasons from the call alone (assuming Hopper).
  """
  if call.platform != "gpu":
    return f"cuDNN fused attention runs on NVIDIA GPUs; this call is on {call.platform}."
  if call.dtype not in DTYPES:
    return (f"cuDNN fused attention takes bfloat16 or float16, got {call.dtype}; cast q/k/v"
            " to bfloat16 or float16 (scores and softmax still accumulate in float32).")
  if call.soft_cap is not None:
    return (f"cuDNN fused attention (JAX's cuDNN SDPA) has no logit soft-capping, got"
            f" logit_soft_cap={call.soft_cap}; the pallas_gpu and blockwise kernels serve it.")
  d = call.q_shape[-1]
  if call.dv != d:
    return (f"flaxattn's cuDNN path takes v with q/k's head_dim ({d}), got v head_dim"
            f" {call.dv}; the pallas_gpu and blockwise kernels serve Dv != D.")
  if d % 8 or d > MAX_HEAD_DIM:
    return (f"cuDNN fused attention needs head_dim a multiple of 8 and at most {MAX_HEAD_DIM}"
            f" (128 before Hopper), got {d}; pad the head dimension or use the blockwise kernel.")
  try:
    causal, window = mask_band(call.mask)
  except NoBand as e:
    return str(e)
  if call.has_positions and (causal or window) and not call.has_segment_ids:
    return ("explicit positions without segment_ids: cuDNN masks on the token index within"
            " each document, which matches the positions only for packed documents"
            " (segment_ids given) whose positions restart at 0 and increase by one; permuted"
            " (load-balanced) positions are not supported. Pass segment_ids, omit positions,"
            " or use the blockwise kernel.")
  gpu = _gpu()
  return None if gpu is None else _device_reason(gpu, d, call.has_segment_ids)


# ---------------------------------------------------------------------------------------
# Static configuration of one call


@dataclasses.dataclass(frozen=True)
class _Config:
  mask: Mask
  scale: float
  causal: bool  # also True with a window: Local is causal, and only then do positions matter
  window: int | None
  max_segments: int
  self_attention: bool  # keys carry the queries' segment ids (the same array) and T == S
  same_positions: bool  # keys carry the queries' positions (the same array, or both default)
  head_groups: int  # > 1: one cuDNN call per group of query heads (see _kv_offsets_per_key_head)

  def mask_type(self, packed: bool) -> fsa.MaskType:
    if packed:
      return fsa.MaskType.PADDING_CAUSAL if self.causal else fsa.MaskType.PADDING
    return fsa.MaskType.CAUSAL if self.causal else fsa.MaskType.NO_MASK


@functools.lru_cache(maxsize=1)
def _kv_offsets_per_key_head() -> bool:
  """Whether JAX turns THD key offsets into element offsets with the KEY's heads.

  jax 0.10's `_fix_seqlen_offsets` multiplies them by the query's heads, so with GQA
  cuDNN would read keys at offsets scaled by H / Hkv. Probed on a 1-token example.
  """
  q = jax.ShapeDtypeStruct((1, 2, 2, 8), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 2, 1, 8), jnp.bfloat16)
  seqlens = np.array([[1, 1]], np.int32)
  offsets = np.array([[0, 1, -1]], np.int32)
  try:
    with jax.ensure_compile_time_eval():
      *_, kv_offsets = fsa._fix_seqlen_offsets(  # pylint: disable=protected-access
          seqlens, seqlens, offsets, offsets, q, k)
      return int(kv_offsets[0, 1]) == 1 * 8
  except (AttributeError, TypeError):
    return False  # a JAX whose private helper changed: splitting heads is right either way


def _config(q, k, layout: Layout, mask: Mask, scale: float, max_segments: int | None) -> _Config:
  causal, window = mask_band(mask)
  t, s = q.shape[1], k.shape[1]
  self_attention = layout.kv_segment_ids is layout.q_segment_ids and t == s
  m = DEFAULT_MAX_SEGMENTS if max_segments is None else int(max_segments)
  # More slots than a row can hold runs cost memory for nothing; 2 keeps JAX in THD mode
  # (with one slot it treats the call as unpacked and ignores the offsets).
  m = max(2, min(m, t if self_attention else t + s))
  h, hkv = q.shape[2], k.shape[2]
  groups = 1 if h == hkv or layout.q_segment_ids is None or _kv_offsets_per_key_head() else h // hkv
  return _Config(mask=mask, scale=float(scale), causal=causal, window=window, max_segments=m,
                 self_attention=self_attention,
                 same_positions=layout.kv_positions is layout.q_positions,
                 head_groups=groups)


# ---------------------------------------------------------------------------------------
# The two cuDNN entry points (JAX private API)


def _sdpa_forward(q, k, v, desc: SeqlensOffsets | None, cfg: _Config):
  """One cuDNN forward: out `[B, T, Hq, D]` and the softmax stats (natural-log lse),
  `[B, Hq, T]` for dense rows, `[B * M, Hq, T]` (one slab per document) for packed rows."""
  # JAX's annotation does not narrow on return_residual=True, which returns (out, stats).
  with _jax_checks_on_target():
    out, stats = fsa.dot_product_attention(  # pyright: ignore[reportAssignmentType, reportGeneralTypeIssues]
      q, k, v, scale=cfg.scale, mask_type=cfg.mask_type(desc is not None),
      sliding_window_length=cfg.window, qkv_layout="BTNH", return_residual=True,
      q_seqlen=None if desc is None else desc.q_seqlens,
      kv_seqlen=None if desc is None else desc.kv_seqlens,
      q_offsets=None if desc is None else desc.q_offsets,
      kv_offsets=None if desc is None else desc.kv_offsets)
  return out, stats


_BWD_P = fsa._dot_product_attention_bwd_p_wrapper  # pylint: disable=protected-access
# jax 0.12 gave this primitive a `score_mod` parameter (flex attention's score function; None:
# plain attention) that jax 0.10 and 0.11 do not take: bind it only where the primitive has it.
_BWD_SCORE_MOD = (
    {"score_mod": None} if "score_mod" in inspect.signature(_BWD_P.impl).parameters else {})


def _sdpa_backward(q, k, v, desc: SeqlensOffsets | None, stats, out, dout, cfg: _Config):
  """One cuDNN backward (dq, dk, dv) from the stats and output of the rows.

  JAX exposes it only as the VJP of a forward, so bind its primitive as that VJP does.
  """
  unused = jnp.zeros(0, q.dtype)
  packed = (unused,) * 4 if desc is None else (
      desc.q_seqlens, desc.kv_seqlens, desc.q_offsets, desc.kv_offsets)
  dq, dk, dv = _BWD_P.bind(
      q, k, v, unused, *packed, unused, unused, stats, out.astype(q.dtype),
      dout.astype(q.dtype), scale=cfg.scale, seed=0, dropout_rate=0.0,
      variadic_args=(False, False), mask_type=cfg.mask_type(desc is not None),
      layout=fsa.AttentionLayout.BTNH.value, sliding_window_length=cfg.window,
      **_BWD_SCORE_MOD)
  return dq, dk, dv


# ---------------------------------------------------------------------------------------
# Packed rows: per-token bookkeeping in O(T + M)


class _Packing(NamedTuple):
  desc: SeqlensOffsets
  q_sequence: jax.Array  # [B, T] int32: the cuDNN sequence of each query (B * M: none)
  q_index: jax.Array  # [B, T] int32: the query's index inside its document
  q_live: jax.Array  # [B, T] bool: a real query whose document has keys
  kv_live: jax.Array  # [B, S] bool: a real key whose document has queries
  exact: jax.Array  # [] bool: cuDNN's masks equal flaxattn's in every row (docs/design.md)


def _run_starts(ids):
  prev = jnp.pad(ids[:, :-1], ((0, 0), (1, 0)))
  return (ids != 0) & (ids != prev)


def _unique_run_ids(ids, offsets, lengths):
  """No id labels two runs of a row (cuDNN would split a document flaxattn sees whole)."""
  m = lengths.shape[1]
  start = jnp.clip(offsets[:, :m], 0, ids.shape[1] - 1)
  run_ids = jnp.where(lengths > 0, jnp.take_along_axis(ids, start, axis=1),
                      -1 - jnp.arange(m, dtype=ids.dtype))  # distinct non-ids for empty slots
  run_ids = jnp.sort(run_ids, axis=1)
  return ~jnp.any(run_ids[:, 1:] == run_ids[:, :-1])


def _steps_by_one(ids, positions, *, increasing: bool = False):
  """Positions increase by one (`increasing`: by at least one) from token to token inside
  every run."""
  prev = jnp.pad(positions[:, :-1], ((0, 0), (1, 0)))
  step = (positions > prev) if increasing else (positions == prev + 1)
  return jnp.all((ids == 0) | _run_starts(ids) | step)


def _query_slots(q_ids_BT, desc: SeqlensOffsets, m: int):
  """Each query's cuDNN sequence (B * M: none), index inside it, and whether it is live (a
  real token whose document fits the M slots and has keys). Query slots are the query runs
  in order, in self and cross attention alike."""
  b, t = q_ids_BT.shape
  first_BT = _run_starts(q_ids_BT)
  iota_T = jnp.arange(t, dtype=jnp.int32)
  slot_BT = jnp.cumsum(first_BT, axis=1, dtype=jnp.int32) - 1
  index_BT = iota_T - jax.lax.cummax(jnp.where(first_BT, iota_T, 0), axis=1)
  has_keys_BT = jnp.take_along_axis(desc.kv_seqlens, jnp.clip(slot_BT, 0, m - 1), axis=1) > 0
  live_BT = (q_ids_BT != 0) & (slot_BT < m) & has_keys_BT
  # JAX packs every row's used slots to the left before cuDNN sees them.
  used_B = jnp.sum(desc.q_seqlens >= 0, axis=1, dtype=jnp.int32)
  row_base_B = jnp.cumsum(used_B) - used_B
  sequence_BT = jnp.where(live_BT, row_base_B[:, None] + slot_BT, b * m)
  return sequence_BT, index_BT, live_BT


def _live_keys(desc: SeqlensOffsets, both_BM, s: int):
  """`[B, S]`: keys inside a key document that has queries (cross attention)."""
  b, m = both_BM.shape
  rows_B1 = jnp.arange(b)[:, None]
  # +1 where a key document with queries starts, -1 where it ends, then a running sum.
  start_BM = jnp.where(both_BM, desc.kv_offsets[:, :m], s + 1)
  marks = jnp.zeros((b, s + 1), jnp.int32).at[rows_B1, start_BM].add(1, mode="drop")
  ends_BM = jnp.where(both_BM, start_BM + desc.kv_seqlens, s + 1)
  marks = marks.at[rows_B1, ends_BM].add(-1, mode="drop")
  return jnp.cumsum(marks, axis=1)[:, :s] > 0


def _index_masks_exact(layout: Layout, desc: SeqlensOffsets, both_BM, t: int, s: int,
                       cfg: _Config):
  """Scalar bool: cuDNN's index masks equal flaxattn's position masks in every row (the
  documents fit M slots, one run per id, and for causal masks positions step by one from
  paired document starts; docs/design.md)."""
  m = cfg.max_segments
  q_ids, kv_ids = layout.q_segment_ids, layout.kv_segment_ids
  assert q_ids is not None and kv_ids is not None, "called on packed rows only"
  exact = jnp.all(desc.valid) & _unique_run_ids(q_ids, desc.q_offsets, desc.q_seqlens)
  if not cfg.self_attention:
    exact &= _unique_run_ids(kv_ids, desc.kv_offsets, desc.kv_seqlens)
  default_positions = layout.q_positions is None and layout.kv_positions is None
  if cfg.causal and not (cfg.self_attention and default_positions):
    full = layout.materialize(q_ids.shape[0], t, s)
    assert full.q_positions is not None and full.kv_positions is not None  # materialized
    if layout.q_positions is not None:
      # Causal without a window compares positions only inside one run of one array, where
      # any increasing positions order pairs as their indices do; windows need differences.
      monotone = cfg.window is None and cfg.self_attention and cfg.same_positions
      exact &= _steps_by_one(q_ids, full.q_positions, increasing=monotone)
    if not (cfg.self_attention and cfg.same_positions):
      if layout.kv_positions is not None:
        exact &= _steps_by_one(kv_ids, full.kv_positions)
      q_first = jnp.take_along_axis(full.q_positions,
                                    jnp.clip(desc.q_offsets[:, :m], 0, t - 1), 1)
      kv_first = jnp.take_along_axis(full.kv_positions,
                                     jnp.clip(desc.kv_offsets[:, :m], 0, s - 1), 1)
      exact &= jnp.all(~both_BM | (q_first == kv_first))
  return exact


def _packing(layout: Layout, t: int, s: int, cfg: _Config) -> _Packing:
  q_ids = layout.q_segment_ids
  desc = seqlens_and_offsets(q_ids, cfg.max_segments,
                             None if cfg.self_attention else layout.kv_segment_ids)
  q_sequence, q_index, q_live = _query_slots(q_ids, desc, cfg.max_segments)
  both_BM = (desc.q_seqlens > 0) & (desc.kv_seqlens > 0)
  kv_live = q_live if cfg.self_attention else _live_keys(desc, both_BM, s)
  exact = _index_masks_exact(layout, desc, both_BM, t, s, cfg)
  return _Packing(desc, q_sequence, q_index, q_live, kv_live, exact)


def _stats_to_lse(stats, packing: _Packing | None):
  """cuDNN stats -> lse `[B, T, H]` (undefined where the query is not live)."""
  if packing is None:
    return stats.transpose(0, 2, 1)
  seq = jnp.clip(packing.q_sequence, 0, stats.shape[0] - 1)[..., None]
  return stats[seq, jnp.arange(stats.shape[1]), packing.q_index[..., None]]


def _lse_to_stats(lse, packing: _Packing | None):
  """lse `[B, T, H]` -> cuDNN stats (0 in slots no live query fills)."""
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0).astype(jnp.float32)
  if packing is None:
    return lse.transpose(0, 2, 1)
  b, t, h = lse.shape
  stats = jnp.zeros((b * packing.desc.q_seqlens.shape[1], h, t), jnp.float32)
  return stats.at[packing.q_sequence[..., None], jnp.arange(h), packing.q_index[..., None]].set(
      lse, mode="drop")


def _head_groups(x, groups: int):
  """Query-head slices `[..., H / groups, ...]` (axis 2) that each pair with all KV heads."""
  return [x] if groups == 1 else [x[:, :, g::groups] for g in range(groups)]


def _merge_head_groups(parts):
  if len(parts) == 1:
    return parts[0]
  x = jnp.stack(parts, axis=3)  # [B, T, Hkv, groups, ...]: head kv * groups + g
  return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])


def _lse_cotangent_rows(dlse, dtype, d: int):
  """O and dO rows with dO . O = -dlse (dlse split in two `dtype` parts for precision)."""
  hi = dlse.astype(dtype)
  lo = (dlse - hi.astype(jnp.float32)).astype(dtype)
  zeros = jnp.zeros(dlse.shape + (d,), dtype)
  return zeros.at[..., :2].set(-1), zeros.at[..., 0].set(hi).at[..., 1].set(lo)


# ---------------------------------------------------------------------------------------
# Forward and backward on the public layout


def _cudnn_forward(q, k, v, packing: _Packing | None, cfg: _Config):
  desc = None if packing is None else packing.desc
  outs, lses = [], []
  for q_g in _head_groups(q, cfg.head_groups):
    out, stats = _sdpa_forward(q_g, k, v, desc, cfg)
    outs.append(out)
    lses.append(_stats_to_lse(stats, packing))
  out, lse = _merge_head_groups(outs), _merge_head_groups(lses).astype(jnp.float32)
  if packing is not None:
    live = packing.q_live[..., None]
    out = jnp.where(live[..., None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(live, lse, -jnp.inf)
  return out.astype(q.dtype), lse


def _cudnn_backward(q, k, v, out, lse, dout, dlse, packing: _Packing | None, cfg: _Config):
  desc = None if packing is None else packing.desc
  d = q.shape[-1]
  dqs, dk, dv = [], jnp.float32(0.0), jnp.float32(0.0)

  def group(x):
    return _head_groups(x, cfg.head_groups)
  dlses = group(dlse) if dlse is not None else [None] * cfg.head_groups
  for q_g, out_g, lse_g, dout_g, dlse_g in zip(group(q), group(out), group(lse), group(dout),
                                               dlses, strict=True):
    stats = _lse_to_stats(lse_g, packing)
    dq_g, dk_g, dv_g = _sdpa_backward(q_g, k, v, desc, stats, out_g, dout_g, cfg)
    dq_g, dk_g = dq_g.astype(jnp.float32), dk_g.astype(jnp.float32)
    if dlse_g is not None:
      o_rows, do_rows = _lse_cotangent_rows(dlse_g.astype(jnp.float32), q.dtype, d)
      dq_l, dk_l, _ = _sdpa_backward(q_g, k, jnp.zeros_like(v), desc, stats, o_rows, do_rows, cfg)
      dq_g, dk_g = dq_g + dq_l, dk_g + dk_l
    dqs.append(dq_g)
    dk, dv = dk + dk_g, dv + dv_g.astype(jnp.float32)
  dq = _merge_head_groups(dqs)
  if packing is not None:
    dq = jnp.where(packing.q_live[..., None, None], dq, 0.0)
    kv_live = packing.kv_live[..., None, None]
    dk, dv = jnp.where(kv_live, dk, 0.0), jnp.where(kv_live, dv, 0.0)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _with_kv_ids(layout: Layout) -> Layout:
  if layout.q_segment_ids is None or layout.kv_segment_ids is not None:
    return layout
  return dataclasses.replace(layout, kv_segment_ids=layout.q_segment_ids)


@dataclasses.dataclass(frozen=True)
class _Passes:
  """cuDNN's forward and backward as `checked.Passes`; `operands` is the packing of the
  rows (None: one sequence per row)."""

  cfg: _Config

  def forward(self, packing, q, k, v, layout: Layout):
    return _cudnn_forward(q, k, v, packing, self.cfg)

  def backward(self, packing, q, k, v, layout: Layout, out, lse, dout, dlse):
    return _cudnn_backward(q, k, v, out, lse, dout, dlse, packing, self.cfg)


def _checked(q, k, layout: Layout, cfg: _Config):
  """The arguments of `checked.forward` / `backward` / `attention` before q, k, v: cuDNN's
  passes, the blockwise fallback, and the run-time check with the packing it comes from
  (None for rows of one sequence, which are always exact)."""
  packing = None
  if layout.q_segment_ids is not None:
    packing = _packing(layout, q.shape[1], k.shape[1], cfg)
  fallback = _fallback().passes(cfg.mask, cfg.scale)
  assert fallback is not None  # pallas_gpu and blockwise have passes
  return (_Passes(cfg), fallback, None if packing is None else packing.exact, packing)


def _fallback() -> registry.Kernel:
  """The kernel a batch cuDNN cannot serve exactly runs (more documents than slots, ids on
  two runs, positions that are not the index): pallas_gpu where the program is lowered for
  a GPU, blockwise elsewhere (cuDNN's CPU model in tests)."""
  return registry.get("pallas_gpu" if registry.lowering_platforms()[0] == "gpu" else "blockwise")


def forward(q, k, v, layout: Layout, *, mask: Mask, scale: float,
                  max_segments: int | None = None):
  """Forward pass without autodiff rules: out `[B, T, H, D]` (q dtype), lse `[B, T, H]` f32.

  Arguments as `cudnn_attention`.
  """
  layout = _with_kv_ids(layout)
  cfg = _config(q, k, layout, mask, scale, max_segments)
  return checked.forward(*_checked(q, k, layout, cfg), q, k, v, layout)


def backward(q, k, v, layout: Layout, out, lse, dout, dlse, *, mask: Mask, scale: float,
                   max_segments: int | None = None):
  """Gradients (dq, dk, dv) of the attention of q against k/v, given the output `out` and
  lse `[B, T, H]` of the rows (which may cover more keys than k/v, as in ring attention:
  pass the merged result) and their cotangents `dout` and `dlse` (float32, or None for no
  lse cotangent, which saves a cuDNN call)."""
  layout = _with_kv_ids(layout)
  cfg = _config(q, k, layout, mask, scale, max_segments)
  return checked.backward(*_checked(q, k, layout, cfg), q, k, v, layout, out, lse, dout, dlse)


def served_by_cudnn(q, k, layout: Layout, *, mask: Mask, max_segments: int | None = None):
  """Scalar bool array: whether `cudnn_attention` runs these rows on cuDNN (True), or on the
  blockwise kernel because a run-time condition (docs/design.md) fails (too many
  documents for `max_segments`, an id on two runs, positions that differ from indices).

  Only shapes of q `[B, T, H, D]` and k `[B, S, Hkv, D]` are used; O(T + M log M).
  """
  layout = _with_kv_ids(layout)
  if layout.q_segment_ids is None:
    return jnp.asarray(True)
  cfg = _config(q, k, layout, mask, 1.0, max_segments)
  return _packing(layout, q.shape[1], k.shape[1], cfg).exact


def cudnn_attention(q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool,
                    max_segments: int | None = None):
  """cuDNN fused attention over packed sequences (GPU; docs/design.md).

  Args:
    q: `[B, T, H, D]`; k, v: `[B, S, Hkv, D]`, H a multiple of Hkv; bfloat16 or float16,
      D a multiple of 8 and at most 256 (128 before Hopper).
    layout: segment ids (0 = padding) and positions (None = defaults). With segment ids
      the rows go to cuDNN in the THD layout (Hopper or newer).
    mask: Full, Causal, Local(w) or an `&` of them.
    scale: score scale.
    max_segments: slots per row in the THD descriptor (default `DEFAULT_MAX_SEGMENTS`);
      rows with more documents run the blockwise kernel instead.
  Returns:
    `[B, T, H, D]` in q's dtype; with `return_lse` also the natural-log lse `[B, T, H]`
    float32. Queries with nothing to attend to get zeros, lse -inf and zero gradients.
  Raises:
    NoBand (a ValueError): a mask cuDNN has no equivalent for (Chunked).
  """
  layout = _with_kv_ids(layout)
  cfg = _config(q, k, layout, mask, scale, max_segments)
  out, lse = checked.attention(*_checked(q, k, layout, cfg), q, k, v, layout)
  return (out, lse) if return_lse else out


def thd_bytes(call: registry.Call, slots: int) -> tuple[int, int]:
  """(packed, unpacked): the forward+backward temporaries of `call` through cuDNN's THD
  layout with `slots` documents per row, and of the same call unpacked (one sequence per
  row), per device, from the fit above."""
  b, t, h, d = call.q_shape
  elements = b * (t // call.cp_size) * h * d * np.dtype(call.dtype).itemsize
  return int(THD_BYTES_PER_SLOT * slots * elements), int(UNPACKED_BYTES * elements)


def _ring_reason(call: registry.Call) -> str | None:
  """Why cuDNN cannot serve `call` under context parallelism, or None (docs/design.md,
  "cuDNN in the ring"): with positions that follow the token index, each ring step (and
  each shard of the gathered keys) is one causal call on the device's own tokens or
  unmasked calls on halves of them."""
  causal, window = mask_band(call.mask)
  if window is not None:
    return ("a sliding window straddles the context shards' chunks, which cuDNN's index"
            " masks cannot express per shard; the pallas_gpu and blockwise kernels serve it.")
  return None


@dataclasses.dataclass(frozen=True)
class Cudnn(registry.Kernel):
  """`backend="cudnn"`: cuDNN fused attention on NVIDIA GPUs (docs/design.md).

  `max_segments`: documents per row of the packed (THD) descriptor (None:
  `DEFAULT_MAX_SEGMENTS`); a batch with more runs the fallback. `thd_budget`: the bytes of
  temporaries a packed call may hold (`thd_bytes`, which grow with the slots); above it
  cuDNN declines packed rows and the next kernel serves them. None: twice the unpacked
  call's.
  """

  max_segments: int | None = None
  thd_budget: int | None = None
  name: str = "cudnn"
  ring: bool = True

  @property
  def traces_anywhere(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride]
    """JAX checks cuDNN and the GPU while tracing: on a host without the GPU only for a
    target's compile-only GPU (`aot.target_gpu_capability`), whose checks `_jax_checks_on_target`
    answers (the cuDNN library must be here: `_reason` says so)."""
    return aot.target_gpu_capability() is not None

  def __post_init__(self):
    if self.max_segments is not None:
      checks.integer("Cudnn(max_segments=...)", self.max_segments, "a positive int or None",
                     lambda x: x > 0, f"None: {DEFAULT_MAX_SEGMENTS}")
    if self.thd_budget is not None:
      checks.number("Cudnn(thd_budget=...)", self.thd_budget, "a positive number of bytes"
                    " (finite) or None", lambda x: x > 0, "None: twice the unpacked call's")

  def reason(self, call: registry.Call) -> str | None:
    reason = _reason(call)
    if reason is None and call.cp_strategy is not None:
      reason = _ring_reason(call)
    if reason is None and call.has_segment_ids:
      packed, budget, slots = self._thd(call)
      if packed > budget:
        reason = (f"cuDNN's packed (THD) layout with {slots} slots would hold about"
                  f" {packed / GIB:.2f} GiB of temporaries ({THD_BYTES_PER_SLOT} x slots x B x"
                  f" T x H x D x bytes, measured on an H100), over its budget of"
                  f" {budget / GIB:.2f} GiB ({self._budget_text()}); the mosaic_gpu (Hopper)"
                  " and pallas_gpu kernels serve packed rows with O(T) memory.")
    return reason

  def _thd(self, call: registry.Call) -> tuple[int, int, int]:
    """(packed bytes, budget, slots) of a packed call (`thd_bytes`)."""
    slots = DEFAULT_MAX_SEGMENTS if self.max_segments is None else self.max_segments
    packed, unpacked = thd_bytes(call, slots)
    return packed, 2 * unpacked if self.thd_budget is None else self.thd_budget, slots

  def _budget_text(self) -> str:
    if self.thd_budget is None:
      return "twice the unpacked call's; Cudnn(thd_budget=...) sets it"
    return "Cudnn(thd_budget=...)"

  def describe(self, call: registry.Call) -> str | None:
    if call.cp_strategy is not None:
      per = "per ring step" if call.cp_strategy == "ring" else "per gathered shard"
      what = f"{per}: causal on the device's own tokens, unmasked on earlier chunks"
      return what + ("; positions checked per batch at run time" if call.has_positions else "")
    if call.has_segment_ids:
      packed, budget, slots = self._thd(call)
      return (f"packed rows, {slots} slots, about {packed / GIB:.2f} GiB of THD temporaries"
              f" (budget {budget / GIB:.2f} GiB); checked per batch at run time, a batch"
              f" cuDNN cannot mask exactly runs {_fallback().name}")
    return None

  def __call__(self, q, k, v, layout: Layout, *, mask: Mask, scale: float, return_lse: bool):
    return cudnn_attention(q, k, v, layout, mask=mask, scale=scale, return_lse=return_lse,
                           max_segments=self.max_segments)

  def ring_step(self, *, strategy: str, mask: Mask, scale: float, shards: int, axis: str,
                load_balance: bool, q_shape, kv_shape, layout: Layout,
                soft_cap: float | None = None) -> cudnn_ring.CudnnStep:
    """cuDNN calls per ring step or gathered shard (`flaxattn.cudnn_ring`), with the global
    run-time check that positions follow the token index; a batch that fails it runs the
    fallback's step (`_fallback`)."""
    _kv_offsets_per_key_head()  # probed here, outside the shard_map (it evaluates eagerly)
    index = layout.index(q_shape[0], q_shape[1])
    return cudnn_ring.CudnnStep(
        exact=index_check(mask, layout, index, index), mask=mask, causal=mask_band(mask)[0],
        scale=scale, axis=axis, shards=shards, load_balance=load_balance,
        packed=layout.q_segment_ids is not None, max_segments=self.max_segments,
        fused_forward=forward, fused_backward=backward,
        fallback=_fallback().ring_step(strategy="ring", mask=mask, scale=scale, shards=shards,
                                       axis=axis, load_balance=load_balance, q_shape=q_shape,
                                       kv_shape=kv_shape, layout=layout))
