"""What every test shares: q/k/v, packed layouts, the comparison with the reference, mask and
bias arrays as MaskMods and ScoreMods, and the context-parallel cases that cp_check.py runs
and test_context_parallel.py reads.

Data is made on the host with numpy, so that each shape costs no compiled random-number
program (the tests are compile-bound on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import flaxattn
from flaxattn.layout import Layout
from flaxattn.masks import Coords
from flaxattn.reference import reference_attention
from flaxattn.selftest import relative_error as rel_error  # noqa: F401 (shared)


def devices(n: int) -> list:
  """`n` devices for a multi-device test: the default backend's where it has `n`, else the
  CPU backend's (conftest.py simulates 8 there, beside one GPU), else the test is skipped,
  naming how many it needs."""
  found = jax.devices()
  if len(found) < n:
    found = jax.devices("cpu")
  if len(found) < n:
    here = [f"{len(found)} cpu"]
    if jax.default_backend() != "cpu":
      here.insert(0, f"{jax.device_count()} {jax.default_backend()}")
    pytest.skip(f"needs {n} devices; this host has {' and '.join(here)} (XLA_FLAGS="
                f"--xla_force_host_platform_device_count={n} simulates {n} cpu devices)")
  return found[:n]


def needs_default_devices(n: int) -> None:
  """Skips the test unless the default backend itself has `n` devices (code under test that
  takes the process's devices, as the trainer and the self-test do)."""
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices of the default backend; this host's"
                f" {jax.default_backend()} backend has {jax.device_count()} (on a CPU host"
                f" XLA_FLAGS=--xla_force_host_platform_device_count={n} simulates them)")


def mesh(axes: dict[str, int]) -> jax.sharding.Mesh:
  """A mesh of `axes` (automatic sharding) on `devices` of their product."""
  return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes),
                       devices=devices(math.prod(axes.values())))


def target_devices(name: str) -> list:
  """The compile-only devices of target `name` (`flaxattn.aot`), or the test is skipped
  naming the package its compiler needs (libtpu, the CUDA 12 plugin)."""
  from flaxattn import aot
  try:
    return aot.devices(aot.target(name))
  except aot.MissingCompiler as e:
    pytest.skip(str(e))


def compile_for(name: str, fn, *args, axes: dict[str, int] | None = None):
  """`jax.jit(fn)` over `args` (arrays or `jax.ShapeDtypeStruct`s) compiled for target `name`
  on a mesh of `axes` (default one device) of its compile-only devices, set with
  `jax.set_mesh` so that flaxattn picks the target's kernels: the target's own compiler's
  `jax.stages.Compiled`. Skipped as `target_devices` where the compiler is missing."""
  axes = axes or {"data": 1}
  found = target_devices(name)
  mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes),
                       devices=found[:math.prod(axes.values())])
  with jax.set_mesh(mesh), target_precision():
    return jax.jit(fn).lower(*args).compile()


def target_precision():
  """JAX's default matmul precision, as a program compiled for a target has it: conftest.py
  sets "highest" for float32 comparisons, and Mosaic refuses bf16 matmuls at float32
  precision ("Bad lhs type")."""
  return jax.default_matmul_precision("default")


# float32 matches to rounding; bfloat16 and float16 inputs round q/k/v and p before the
# matmuls (float16 has 3 more mantissa bits).
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2),
       jnp.float16: dict(atol=2e-3, rtol=2e-3)}


def normal(shape, seed=0, dtype=jnp.float32) -> jax.Array:
  """A standard normal array of `shape` in `dtype`, drawn in float32 on the host; `seed` an
  int or a tuple of ints."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32).astype(dtype))


def qkv(seed, b, t, s, h, hkv, d, dtype=jnp.float32):
  """q `[b, t, h, d]`, k and v `[b, s, hkv, d]`, standard normal in `dtype`."""
  shapes = (b, t, h, d), (b, s, hkv, d), (b, s, hkv, d)
  return tuple(normal(shape, (seed, i), dtype) for i, shape in enumerate(shapes))


def random_packing(seed: int, batch: int, length: int, *, max_docs: int = 6, pad_tail: int = 0,
                   min_len: int = 1, cp: int | None = None):
  """Segment ids and positions `[batch, length]` int32 (numpy).

  Each row holds up to `max_docs` documents of random lengths (some as short as `min_len`)
  followed by `pad_tail` padding tokens (segment 0). Document ids count up from 1; positions
  restart at 0 in each document.

  With `cp` (context shards): the first seed from `seed` on which every row has a document
  crossing an edge of the 2 * cp load-balancing chunks (so of a shard, too) and some document
  is shorter than 2 * cp tokens. Raises AssertionError if none of 1000 seeds has them.
  """
  for s in range(seed, seed + (1 if cp is None else 1000)):
    seg, pos = _pack(np.random.default_rng(s), batch, length, max_docs, pad_tail, min_len)
    if cp is None:
      return seg, pos
    chunk = length // (2 * cp)
    lengths = [np.sum(row == d) for row in seg for d in np.unique(row[row > 0])]
    crosses = all(np.any(row[chunk - 1::chunk][:-1] == row[chunk::chunk]) for row in seg)
    if min(lengths) < 2 * cp and crosses:
      return seg, pos
  raise AssertionError(f"no packing of {batch} x {length} tokens crosses the chunks of cp={cp}")


def _pack(rng, batch, length, max_docs, pad_tail, min_len):
  """One draw of `random_packing`."""
  seg = np.zeros((batch, length), np.int32)
  pos = np.zeros((batch, length), np.int32)
  used = length - pad_tail
  for b in range(batch):
    n_docs = int(rng.integers(1, max_docs + 1))
    cuts = np.sort(rng.choice(np.arange(min_len, used), size=min(n_docs - 1, used - min_len),
                              replace=False)) if n_docs > 1 else np.array([], int)
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [used]])
    for n, (s, e) in enumerate(zip(starts, ends, strict=True)):
      seg[b, s:e] = n + 1
      pos[b, s:e] = np.arange(e - s)
  return seg, pos


# Ids a legal layout may use besides small positive ones: negative, the largest int32, and a
# few reused on separate runs of a row (one document to the mask, however far apart).
ODD_IDS = (1, 2, 3, -5, 2**31 - 1, 77)


def legal_layout(seed: int, batch: int, length: int, kv_length: int | None = None):
  """Segment ids and positions that `flaxattn.attention` accepts but no packing pipeline
  produces: ids from `ODD_IDS` (repeated on separate runs, negative, huge), padding runs
  anywhere, documents of one token, positions with gaps, restarts and offsets.

  Returns `(seg, pos)` `[batch, length]` int32 (numpy), or with `kv_length` also the keys'
  `(kv_seg, kv_pos)` `[batch, kv_length]`, whose ids only partly overlap the queries' (some
  documents have queries but no keys, others keys but no queries).
  """
  rng = np.random.default_rng(seed)

  def side(n, ids):
    seg = np.zeros((batch, n), np.int32)
    pos = np.zeros((batch, n), np.int32)
    for b in range(batch):
      i = 0
      while i < n:
        run = min(n - i, int(rng.choice([1, rng.integers(1, 9), rng.integers(8, 48)])))
        seg[b, i:i + run] = 0 if rng.random() < 0.15 else rng.choice(ids)
        steps = rng.integers(1, 4, run) if rng.random() < 0.3 else np.ones(run, np.int64)
        start = rng.integers(0, 40) if rng.random() < 0.3 else 0
        pos[b, i:i + run] = start + np.cumsum(steps) - steps[0]
        i += run
    return seg, pos

  if kv_length is None:
    return side(length, ODD_IDS)
  return side(length, ODD_IDS[:4]) + side(kv_length, ODD_IDS[2:])


def as_layout(seg, pos=None, kv_seg=None, kv_pos=None) -> Layout:
  """A Layout of these arrays (None: the default). Keys default to the queries' arrays, the
  same objects, as self attention passes them (kernels see that they are shared)."""
  def arr(x):
    return None if x is None else jnp.asarray(x)
  seg, pos = arr(seg), arr(pos)
  return Layout(seg, seg if kv_seg is None else arr(kv_seg), pos,
                pos if kv_pos is None else arr(kv_pos))


def loss(out, lse):
  """A scalar touching every output and the lse, so gradients test both cotangents."""
  finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  return jnp.sum(out * jnp.cos(out)) + 0.5 * jnp.sum(jnp.sin(finite_lse))


def grads_of(attend, n_args: int = 3):
  """Jitted `(q, k, v) -> ((dq, dk, dv), (out, lse))`: the gradients of `loss` for
  `attend(q, k, v) -> (out, lse)`, and its out (as float32) and lse. With `n_args` = 4 the
  fourth argument (the sinks) is differentiated too."""
  def f(*args):
    out, lse = attend(*args)
    out = out.astype(jnp.float32)
    return loss(out, lse), (out, lse)
  return jax.jit(jax.grad(f, tuple(range(n_args)), has_aux=True))


def dense_oracle(q, k, v, layout, mask, scale, sinks=None, soft_cap=None, score_mod=None):
  """Attention written out from the definitions, for the features the kernels add: scores
  `scale * q.k`, soft-capped, changed by `score_mod`, masked (the mask evaluated on every
  (batch row, head, query, key) with the token indices of `layout`, else 0..T-1), a sink
  column of logit `sinks[h]` (value 0) appended, softmax over keys and sink. Returns out
  `[B, T, H, Dv]` (q dtype) and lse `[B, T, H]`."""
  b, t, h, _ = q.shape
  s = k.shape[1]
  g = h // k.shape[2]
  k_BSHD, v_BSHD = (jnp.repeat(x.astype(jnp.float32), g, axis=2) for x in (k, v))
  full = layout.materialize(b, t, s)
  q_index = jnp.arange(t)[None] if layout.q_index is None else layout.q_index
  kv_index = jnp.arange(s)[None] if layout.kv_index is None else layout.kv_index
  where = Coords(jnp.arange(b)[:, None, None, None], jnp.arange(h)[None, :, None, None],
                 jnp.broadcast_to(q_index, (b, t))[:, None, :, None],
                 jnp.broadcast_to(kv_index, (b, s))[:, None, None, :],
                 full.q_positions[:, None, :, None], full.kv_positions[:, None, None, :])
  same_doc_B1TS = ((full.q_segment_ids[:, None, :, None] == full.kv_segment_ids[:, None, None, :])
                   & (full.q_segment_ids[:, None, :, None] != 0))
  allowed_BHTS = same_doc_B1TS & mask.evaluate(where)
  scores_BHTS = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k_BSHD) * scale
  if soft_cap is not None:
    scores_BHTS = soft_cap * jnp.tanh(scores_BHTS / soft_cap)
  if score_mod is not None:
    scores_BHTS = score_mod.fn(scores_BHTS, where.b, where.h, where.q_index, where.kv_index,
                               *score_mod.operands).astype(jnp.float32)
  scores_BHTS = jnp.where(allowed_BHTS, scores_BHTS, -jnp.inf)
  if sinks is not None:
    sink_BHT1 = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (b, h, t, 1))
    scores_BHTS = jnp.concatenate([scores_BHTS, sink_BHT1], axis=-1)
  lse_BHT = jax.nn.logsumexp(scores_BHTS, axis=-1)
  safe = jnp.where(jnp.isfinite(lse_BHT), lse_BHT, 0.0)[..., None]
  probs_BHTS = jnp.exp(scores_BHTS - safe)[..., :s]
  out = jnp.einsum("bhts,bshd->bthd", probs_BHTS, v_BSHD).astype(q.dtype)
  return out, lse_BHT.transpose(0, 2, 1)


def at(x, *index):
  """`x` read at broadcasting index arrays (b, h, q_idx, kv_idx, or the last of them) with
  numpy's broadcasting rules: x's axes align with the last `x.ndim` indices, and an axis of
  size 1 is read at 0. So a bias `[B|1, H|1, T|1, S|1]` or `[H, T, S]`, or bounds
  `[B|1, H|1, T]`, serve every score."""
  index = index[len(index) - x.ndim:]
  return x[tuple(i if n > 1 else 0 for i, n in zip(index, x.shape, strict=True))]


def _read_mask(b, h, q_idx, kv_idx, allowed):
  return at(allowed, b, h, q_idx, kv_idx)


def _add_bias(score, b, h, q_idx, kv_idx, bias, cap=None):
  score = score + at(bias, b, h, q_idx, kv_idx).astype(jnp.float32)
  return score if cap is None else cap * jnp.tanh(score / cap)


def array_mask(allowed) -> flaxattn.MaskMod:
  """The mask of a bool array that broadcasts to `[B, H, T, S]` (True: the key may be
  seen), as a `MaskMod` reading it."""
  return flaxattn.MaskMod(_read_mask, jnp.asarray(allowed, bool))


def array_bias(bias, cap: float | None = None) -> flaxattn.ScoreMod:
  """An additive logits bias that broadcasts to `[B, H, T, S]`, as a `ScoreMod` (its
  gradient is the bias's); with `cap`, a tanh soft cap of the biased score after it."""
  fn = _add_bias if cap is None else functools.partial(_add_bias, cap=cap)
  return flaxattn.ScoreMod(fn, bias)


def assert_results_close(got, want, dtype, names=("dq", "dk", "dv")):
  """`(grads, (out, lse))` of a kernel against the oracle's (as `grads_of` returns them),
  within `TOL[dtype]`: out; lse, infinite in the same places; each gradient (named by
  `names`) finite and relative to its largest magnitude (at least 1)."""
  (got_g, (got_o, got_l)), (want_g, (want_o, want_l)) = got, want
  tol = TOL[dtype]
  np.testing.assert_allclose(np.asarray(got_o, np.float32), np.asarray(want_o, np.float32),
                             err_msg="out", **tol)
  np.testing.assert_array_equal(np.isinf(got_l), np.isinf(want_l))
  np.testing.assert_allclose(np.where(np.isinf(got_l), 0, got_l),
                             np.where(np.isinf(want_l), 0, want_l), err_msg="lse", **tol)
  for name, g, w in zip(names, got_g, want_g, strict=True):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.isfinite(g).all(), name
    scale = max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(g / scale, w / scale, err_msg=name, **tol)


def compare(kernel, layout, mask, q, k, v, dtype):
  """`kernel` against `reference_attention` on out, lse and the gradients of `loss`, within
  `TOL[dtype]`; gradients relative to their largest magnitude (at least 1)."""
  def attend(kern):
    return lambda q, k, v: kern(q, k, v, layout, mask=mask, scale=0.3, return_lse=True)
  want_g, (want_o, want_l) = grads_of(attend(reference_attention))(q, k, v)
  got_g, (got_o, got_l) = grads_of(attend(kernel))(q, k, v)
  tol = TOL[dtype]
  np.testing.assert_allclose(got_o, want_o, **tol)
  np.testing.assert_array_equal(np.isinf(got_l), np.isinf(want_l))
  np.testing.assert_allclose(np.where(np.isinf(got_l), 0, got_l),
                             np.where(np.isinf(want_l), 0, want_l), **tol)
  for name, got, want in zip("qkv", got_g, want_g, strict=True):
    scale = max(1.0, float(jnp.abs(want.astype(jnp.float32)).max()))
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale,
                               np.asarray(want, np.float32) / scale, err_msg=f"d{name}", **tol)


# Programmable masks and scores (flaxattn.mods): patterns of attention-gym's gallery, their
# operands drawn on the host.


def t5_bucket(distance, buckets: int = 8, max_distance: int = 64):
  """T5's relative-position bucket of `distance` = q_idx - kv_idx (int32, keys before the
  query): exact up to buckets / 2, then logarithmic up to `max_distance`."""
  exact = buckets // 2
  d = jnp.maximum(distance, 0)
  scaled = jnp.log(jnp.maximum(d, 1).astype(jnp.float32) / exact) / np.log(max_distance / exact)
  far = exact + (scaled * (buckets - exact)).astype(jnp.int32)
  return jnp.where(d < exact, d, jnp.minimum(far, buckets - 1))


def mod_patterns(batch: int, heads: int, length: int, seed: int = 0) -> dict:
  """name -> (mask, score_mod or None) for `batch` rows, `heads` query heads and rows of
  `length` tokens: prefix-LM with a prefix length per row (an int operand), a window per
  head, `Local | MaskMod`, ALiBi (slopes an operand, `slopes[h]`), a T5 bias table
  (`table[bucket, h]`), and two whose operands are read at one index per block (what
  kernels without gathers run): ALiBi slopes computed from the head times a learned scale
  `w[()]`, and a bias per batch row `bias[b]`."""
  rng = np.random.default_rng(seed)
  prefix = jnp.asarray(rng.integers(1, length // 2, batch), jnp.int32)
  slopes = jnp.asarray(2.0 ** -rng.uniform(1, 8, heads), jnp.float32)
  table = jnp.asarray(rng.standard_normal((8, heads)), jnp.float32)
  scale, bias = jnp.float32(0.7), jnp.asarray(rng.standard_normal(batch), jnp.float32)

  def distance(q, k):
    return jnp.abs(q - k).astype(jnp.float32)
  prefix_lm = flaxattn.MaskMod(lambda b, h, q, k, n: (k <= q) | (k < n[b]), prefix)
  return {
      "prefix_lm": (prefix_lm, None),
      "per_head_window": (flaxattn.MaskMod(lambda b, h, q, k: (k <= q) & (k > q - 4 * (h + 1))),
                          None),
      "local_or_prefix": (flaxattn.Local(5) | flaxattn.MaskMod(
          lambda b, h, q, k, n: k < n[b], prefix), None),
      "alibi": (flaxattn.Causal(), flaxattn.ScoreMod(
          lambda s, b, h, q, k, m: s - m[h] * distance(q, k), slopes)),
      "t5": (flaxattn.Causal(), flaxattn.ScoreMod(
          lambda s, b, h, q, k, t: s + t[t5_bucket(q - k), h], table)),
      "alibi_scaled": (flaxattn.Causal(), flaxattn.ScoreMod(
          lambda s, b, h, q, k, w: s - w[()] * jnp.exp2(-1.0 - h) * distance(q, k), scale)),
      "row_bias": (prefix_lm, flaxattn.ScoreMod(
          lambda s, b, h, q, k, c: s + c[b] * (q - k).astype(jnp.float32) / length, bias)),
  }


def compare_mods(backend, layout, mask, score_mod, q, k, v, dtype=jnp.float32):
  """`backend` against `backend="reference"` with `mask` and `score_mod` on out, lse, the
  gradients of `loss` for q, k, v and the score mod's (float) operands, within
  `TOL[dtype]`; gradients relative to their largest magnitude (at least 1)."""
  def attend(backend):
    def run(q, k, v, score_mod):
      return flaxattn.attention(q, k, v, mask=mask, layout=layout, scale=0.3, backend=backend,
                                score_mod=score_mod, return_lse=True)
    return run
  want_g, (want_o, want_l) = grads_of(attend("reference"), 4)(q, k, v, score_mod)
  got_g, (got_o, got_l) = grads_of(attend(backend), 4)(q, k, v, score_mod)
  tol = TOL[dtype]
  np.testing.assert_allclose(got_o, want_o, **tol)
  np.testing.assert_array_equal(np.isinf(got_l), np.isinf(want_l))
  np.testing.assert_allclose(np.where(np.isinf(got_l), 0, got_l),
                             np.where(np.isinf(want_l), 0, want_l), **tol)
  names = ["dq", "dk", "dv"] + [f"d operand {i}" for i in range(len(jax.tree.leaves(want_g[3])))]
  for name, got, want in zip(names, jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
    scale = max(1.0, float(jnp.abs(want.astype(jnp.float32)).max()))
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale,
                               np.asarray(want, np.float32) / scale, err_msg=name, **tol)


# Context parallelism: the cases cp_check.py runs on N simulated devices, one process per N,
# and test_context_parallel.py collects by name.

CP_BF16_TOL = 2e-2  # bfloat16 inputs, relative to the largest reference magnitude
CP_MASKS = {"causal": flaxattn.Causal(), "local": flaxattn.Local(3),
            "chunked": flaxattn.Chunked(24), "full": flaxattn.Full(),
            "window": flaxattn.Window(1, 4, offset=1)}  # keys p .. p + 5


def cp_cases(n: int) -> list[dict]:
  """A covering set, not the product (each ring compile costs seconds): every mask with ring
  and load balancing, each strategy x load balancing, GQA with 2 and 1 KV heads for 4 query
  heads, a Local window smaller than cp, 2-D and 3-D (heads over tensor) meshes, and the
  unpermute pipeline. Ulysses on 2, 4 and 8 devices and Ulysses x ring on 2x2, 2x4 and 4x2
  meshes (a "context_ring" axis), every mask, GQA down to fewer K/V heads than devices,
  heads over tensor, batch over data. Splash (Pallas interpret mode: slow, so few cases,
  T = 128 per shard) with the ring and all-gather strategies, every mask, packed and default
  layouts. `packed="legal"`: random legal layouts no pipeline produces (`legal_layout`), on
  which splash must take its exact path. `features`: sinks, a logit soft cap and Dv != D
  together (their gradients include d sinks), `dtype` "bfloat16" compared with
  `CP_BF16_TOL`. `groups`: the ring's `head_groups` (the full ring, the window-aware
  ring, Ulysses x ring's), the default letting the call choose (one group at these
  sizes)."""
  # A case's name says all of its parameters.
  def case(mesh, strategy="ring", lb=True, mask="causal", hkv=2, packed=True, pipeline=False, t=64,
           backend="auto", h=4, features=False, dtype="float32", groups=None):
    name = "-".join(([] if backend == "auto" else [backend])
                    + [strategy, "lb" if lb else "nolb", mask]
                    + ([] if h == 4 else [f"h{h}"])
                    + [f"hkv{hkv}", {True: "packed", False: "default"}.get(packed, packed),
                       "x".join(f"{a}{s}" for a, s in mesh.items())]
                    + (["pipeline"] if pipeline else [])
                    + (["sinks-cap-dv"] if features else [])
                    + ([] if dtype == "float32" else [dtype])
                    + ([] if groups is None else [f"groups{groups}"]))
    return dict(name=name, mesh=mesh, strategy=strategy, lb=lb, mask=mask, h=h, hkv=hkv,
                packed=packed, pipeline=pipeline, t=t, backend=backend, features=features,
                dtype=dtype, groups=groups)

  c2, c4, c8, dc2, dc4 = (dict(context=2), dict(context=4), dict(context=8),
                          dict(data=2, context=2), dict(data=2, context=4))
  # Ulysses x ring (2-D): a mesh with "context_ring" runs the ring over it inside Ulysses.
  r2c2, r2c4, r4c2 = (dict(context_ring=2, context=2), dict(context_ring=2, context=4),
                      dict(context_ring=4, context=2))
  u = "ulysses"
  return {
      2: [case(c2, mask="full", hkv=2),
          case(c2, "all_gather", lb=False, mask="causal", hkv=1, packed=False),
          case(c2, mask="causal", hkv=2, t=256, backend="splash"),
          case(c2, "all_gather", mask="local", hkv=1, t=256, backend="splash"),
          case(c2, mask="local", hkv=1, packed="legal", t=256, backend="splash"),
          case(c2, "all_gather", mask="chunked", hkv=2, packed="legal", t=256, backend="splash"),
          case(c2, u, mask="causal", hkv=1),
          case(c2, u, lb=False, mask="full", hkv=2, packed=False),
          case(c2, u, mask="local", hkv=1, t=256, backend="splash"),
          case(c2, mask="causal", hkv=1, t=256, backend="splash", features=True),
          case(c2, mask="causal", hkv=2, features=True, groups=2)],
      4: [case(c4, mask="causal", hkv=2), case(c4, "all_gather", mask="causal", hkv=2),
          case(c4, lb=False, mask="causal", hkv=1, packed=False),
          case(c4, mask="local", hkv=1, pipeline=True),
          case(dc2, mask="causal", hkv=1, packed=False),
          case(c4, mask="chunked", hkv=1, packed=False, t=512, backend="splash"),
          case(c4, lb=False, mask="local", hkv=2, t=512, backend="splash"),
          case(c4, mask="causal", hkv=2, packed="legal"),
          case(c4, "all_gather", mask="local", hkv=1, packed="legal"),
          case(c4, mask="local", hkv=2, packed="legal"),  # window ring, or every step
          case(c4, "auto", mask="chunked", hkv=1),
          case(c4, u, mask="chunked", hkv=2),
          case(c4, u, lb=False, mask="local", hkv=1, packed="legal"),
          case(dc2, u, mask="causal", hkv=2, packed=False),
          case(r2c2, u, mask="causal", hkv=2), case(r2c2, u, mask="full", hkv=1, packed=False),
          case(r2c2, u, lb=False, mask="local", hkv=2),
          case(r2c2, u, mask="chunked", hkv=1, pipeline=True),
          case(r2c2, u, mask="causal", hkv=2, t=256, backend="splash"),
          case(c4, mask="local", hkv=1, features=True),
          case(c4, "all_gather", hkv=2, features=True),
          case(c4, u, mask="local", hkv=2, features=True),
          case(c4, mask="causal", hkv=2, features=True, dtype="bfloat16"),
          case(c4, mask="local", h=8, hkv=4, groups=4),  # the window-aware ring
          case(c4, mask="window", hkv=2),  # the window-aware ring, keys ahead too
          case(c4, lb=False, mask="window", hkv=1, t=512, backend="splash"),
          case(r2c2, u, mask="causal", h=8, hkv=4, groups=2)],
      8: [case(c8, mask="causal", hkv=2, t=128),
          case(c8, mask="local", hkv=2, packed=False, t=16),  # Local(3) reaches 2 chunks of 1
          case(dc4, mask="chunked", hkv=1, packed=False, pipeline=True),
          case(dc4, "all_gather", lb=False, mask="local", hkv=2),
          case(dict(data=2, tensor=2, context=2), mask="causal", hkv=2),
          case(dict(data=2, tensor=2, context=2), mask="causal", hkv=2, t=256, backend="splash"),
          case(c8, u, mask="causal", h=8, hkv=2, t=128),
          case(dict(data=2, tensor=2, context=2), u, mask="local", hkv=2),
          case(r2c4, u, mask="causal", hkv=1),
          case(r4c2, u, lb=False, mask="chunked", hkv=2, t=128),
          case(dict(data=2, context_ring=2, context=2), u, mask="local", hkv=1, packed=False)],
  }[n]
