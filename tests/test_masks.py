"""Masks: values, hashing, errors, and the block classification kernels rely on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxattn
from flaxattn.masks import And, Band, NoBand, band, reach

W = flaxattn.Window
MASKS = [flaxattn.Full(), flaxattn.Causal(), flaxattn.Local(5), flaxattn.Chunked(4),
         flaxattn.Causal() & flaxattn.Local(3), flaxattn.Chunked(8) & flaxattn.Local(6),
         W(3, 2), W(0, 4), W(None, 0, -2), W(2, None, 5), flaxattn.Chunked(8) & W(4, 1, -1)]


def test_masks_are_hashable_static_values():
  assert (flaxattn.Local(5) == flaxattn.Local(5)
          and hash(flaxattn.Local(5)) == hash(flaxattn.Local(5)))
  assert flaxattn.Local(5) != flaxattn.Local(6)
  assert flaxattn.Causal() & flaxattn.Local(3) == And((flaxattn.Causal(), flaxattn.Local(3)))
  # & flattens: (a & b) & c is one And of three.
  assert len((flaxattn.Causal() & flaxattn.Local(3) & flaxattn.Chunked(2)).masks) == 3
  f = jax.jit(lambda x, mask: mask.allows(x, x[::-1]), static_argnums=1)
  np.testing.assert_array_equal(f(jnp.arange(6), flaxattn.Causal()),
                                np.arange(6)[::-1] <= np.arange(6))


@pytest.mark.parametrize("make,arg", [(flaxattn.Local, "window"), (flaxattn.Chunked, "size")])
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_invalid_parameters_name_the_argument(make, arg, bad):
  with pytest.raises(ValueError,
                     match=rf"{make.__name__}\({arg}=.*expects a positive int.*{bad!r}"):
    make(bad)


def test_mask_semantics():
  q = np.arange(12)[:, None]
  k = np.arange(12)[None, :]
  np.testing.assert_array_equal(flaxattn.Local(3).allows(q, k), (k <= q) & (k > q - 3))
  np.testing.assert_array_equal(W(3, 2).allows(q, k), (k >= q - 3) & (k <= q + 2))
  np.testing.assert_array_equal(W(1, 2, offset=4).allows(q, k), (k >= q + 3) & (k <= q + 6))
  np.testing.assert_array_equal(W(None, 0, -1).allows(q, k), k < q)
  np.testing.assert_array_equal(W(0, None).allows(q, k), k >= q)
  assert W(None, None).allows(q, k).all()
  np.testing.assert_array_equal(W(4, 0).allows(q, k), flaxattn.Local(5).allows(q, k))
  assert [m.is_causal for m in (W(4, 0), W(3, 1), W(3, 1, -1), W(None, None))] == [
      True, False, True, False]
  np.testing.assert_array_equal(flaxattn.Chunked(4).allows(q, k), (k <= q) & (k // 4 == q // 4))
  assert flaxattn.Full().allows(q, k).all()


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_block_kinds_are_conservative(mask):
  """For random position ranges, `skip` holds only if no pair is allowed and `full` only if
  every pair is: checked against every pair in the ranges."""
  rng = np.random.default_rng(0)
  for _ in range(300):
    q_lo, k_lo = rng.integers(0, 30, 2)
    q_hi, k_hi = q_lo + rng.integers(0, 8), k_lo + rng.integers(0, 8)
    allowed = mask.allows(np.arange(q_lo, q_hi + 1)[:, None], np.arange(k_lo, k_hi + 1)[None, :])
    skip, full = mask.block_kinds(q_lo, q_hi, k_lo, k_hi)
    assert not (skip and allowed.any()), (q_lo, q_hi, k_lo, k_hi)
    assert not (full and not allowed.all()), (q_lo, q_hi, k_lo, k_hi)
    if not allowed.any() and isinstance(mask, (flaxattn.Causal, flaxattn.Local, W)):
      assert skip  # exact for single masks of one interval: no wasted blocks


def test_band_is_the_one_normal_form():
  C, L, K = flaxattn.Causal(), flaxattn.Local, flaxattn.Chunked
  assert band(flaxattn.Full()) == Band()
  assert band(flaxattn.Full() & C) == Band(hi=0)
  assert band(C & L(8) & L(4)) == Band(-3, 0)
  assert band(K(16) & C) == Band(hi=0, chunk=16)
  assert band(L(5) & K(16)) == Band(-4, 0, 16)
  assert band(W(3, 2)) == Band(-3, 2) and band(W(3, 2, offset=-5)) == Band(-8, -3)
  assert band(W(3, 2) & C) == Band(-3, 0) == band(L(4))  # one normal form, one kernel
  assert band(W(None, 6) & W(2, None, 1)) == Band(-1, 6)
  with pytest.raises(NoBand, match=r"different sizes \[16, 32\]"):
    band(K(16) & K(32))
  with pytest.raises(NoBand, match="no normal form"):
    band(W(1, 1) | W(2, 0, 9))
  # The band's mask is the same rule as the mask it came from.
  q, k = np.arange(64)[:, None], np.arange(64)[None, :]
  for mask in (flaxattn.Full(), C, C & L(8) & L(4), L(5) & K(16) & C, W(3, 2), W(2, 3, 9),
               W(1, 0, -20), W(None, 3), W(0, None, -2), W(1, 1) & W(1, 1, 5), K(8) & W(6, 9, -2)):
    np.testing.assert_array_equal(band(mask).mask.allows(q, k), mask.allows(q, k), str(mask))


def test_reach_bounds_both_sides():
  assert reach(flaxattn.Local(65)) == (64, 0) and reach(W(3, 2)) == (3, 2)
  assert reach(W(2, 3, offset=9)) == (0, 12) and reach(W(1, 0, offset=-20)) == (21, 0)
  assert reach(flaxattn.Chunked(40) & flaxattn.Local(200)) == (39, 0)
  assert reach(flaxattn.Causal()) is None and reach(W(0, None)) is None


@pytest.mark.parametrize("args, match", [
    ((-1, 0), r"Window\(left=...\) expects an int in \[0, 2147483647\] or None.*got -1"),
    ((0, 2.0), r"Window\(right=...\) expects an int.*got 2.0"),
    ((1, 1, None), r"Window\(offset=...\) expects an int.*got None"),
    ((2**31 - 1, 0, -5), r"expects offset - left in \[-2147483647, 2147483647\].*got -2147483652;"
                         r" pass None")])
def test_window_parameters_name_the_argument(args, match):
  with pytest.raises(ValueError, match=match):
    W(*args)


INT32 = np.iinfo(np.int32)
EDGES = np.concatenate([np.arange(INT32.min, INT32.min + 12), np.arange(-6, 6),
                        np.arange(INT32.max - 11, INT32.max + 1)])


@pytest.mark.parametrize("mask", [flaxattn.Local(1), flaxattn.Local(5), flaxattn.Chunked(4),
                                  flaxattn.Chunked(7), flaxattn.Local(2**31 - 1),
                                  flaxattn.Chunked(2**31 - 1), W(3, 2), W(0, 5, 4), W(2, 0, -7),
                                  W(None, 2**31 - 1, 0), W(2**31 - 1, None, 0),
                                  W(2**31 - 2, 2**31 - 2, 1)], ids=str)
def test_masks_on_int32_positions_at_the_limits_are_exact(mask):
  """allows and block_kinds on int32 (numpy and jax, traced as in the kernels) against the
  same rule on Python ints, for positions within 12 of both int32 limits and of 0."""
  q, k = np.meshgrid(EDGES, EDGES, indexing="ij")
  want = np.vectorize(lambda q, k: bool(mask.allows(int(q), int(k))))(q, k)
  q32, k32 = q.astype(np.int32), k.astype(np.int32)
  np.testing.assert_array_equal(mask.allows(q32, k32), want)
  np.testing.assert_array_equal(jax.jit(mask.allows)(q32, k32), want)
  # One block per pair of 3-position runs: skip only if nothing is allowed, full only if all.
  lo = EDGES[::3].astype(np.int32)
  blocks = np.stack([want[i:i + 3, j:j + 3] for i in range(0, len(EDGES), 3)
                     for j in range(0, len(EDGES), 3)])
  q_lo, k_lo = (x.ravel() for x in np.meshgrid(lo, lo, indexing="ij"))
  for xp_kinds in (mask.block_kinds, jax.jit(mask.block_kinds)):
    skip, full = (np.asarray(x) for x in xp_kinds(q_lo, q_lo + 2, k_lo, k_lo + 2))
    assert not blocks[skip].any() and blocks[full].all()
    assert skip[~blocks.any((1, 2))].mean() > 0.9  # and not merely conservative
