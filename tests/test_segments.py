"""seqlens_and_offsets against obviously-correct Python loops, and its memory bound."""

import collections
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from flaxattn import segments
from flaxattn.segments import SeqlensOffsets, seqlens_and_offsets


def naive_runs(row):
  """[id, start, length] of each maximal run of one non-zero id, in order."""
  runs = []
  for t, x in enumerate(int(v) for v in row):
    if x == 0:
      continue
    if runs and t > 0 and int(row[t - 1]) == x:
      runs[-1][2] += 1
    else:
      runs.append([x, t, 1])
  return runs


def naive(q_ids, m, kv_ids=None):
  """Reference descriptor and, per row, the run count of each side."""
  b = len(q_ids)
  q_len, kv_len = np.full((b, m), -1), np.full((b, m), -1)
  q_off, kv_off = np.full((b, m + 1), -1), np.full((b, m + 1), -1)
  num, side_counts = np.zeros(b, int), []
  for r in range(b):
    q_runs = naive_runs(q_ids[r])
    kv_runs = q_runs if kv_ids is None else naive_runs(kv_ids[r])
    side_counts.append((len(q_runs), len(kv_runs)))
    # Pair the k-th run of an id on one side with the k-th run of that id on the other.
    slots, slot_of, seen = [[run, None] for run in q_runs], {}, collections.Counter()
    for n, run in enumerate(q_runs):
      slot_of[(run[0], seen[run[0]])] = n
      seen[run[0]] += 1
    seen = collections.Counter()
    for run in kv_runs:
      key = (run[0], seen[run[0]])
      seen[run[0]] += 1
      if key in slot_of:
        slots[slot_of[key]][1] = run
      else:
        slots.append([None, run])
    num[r] = len(slots)
    for n, (q_run, kv_run) in enumerate(slots[:m]):
      q_len[r, n], q_off[r, n] = (q_run[2], q_run[1]) if q_run else (0, 0)
      kv_len[r, n], kv_off[r, n] = (kv_run[2], kv_run[1]) if kv_run else (0, 0)
  return SeqlensOffsets(q_len, q_off, kv_len, kv_off, num), side_counts


def assert_matches(got, want, side_counts, m):
  for field in got:
    assert field.dtype == jnp.int32
  np.testing.assert_array_equal(got.num_segments > m, want.num_segments > m)
  np.testing.assert_array_equal(got.valid, want.num_segments <= m)
  for r, (n_q, n_kv) in enumerate(side_counts):
    # Past m runs on one side, only "overflow" is promised (see the docstring).
    if n_q <= m and n_kv <= m:
      assert int(got.num_segments[r]) == want.num_segments[r], r
      for name, g, w in zip(got._fields, got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g)[r], w[r], err_msg=f"{name} row {r}")


@functools.cache
def jitted(m, blk):
  """seqlens_and_offsets jitted with a given block size; eager calls would recompile every op."""
  def f(q, kv):
    # The block size is read at trace time, which happens inside this call.
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(segments, "_BLOCK", blk)
      return seqlens_and_offsets(q, m, kv)
  return jax.jit(f)


def check(q_rows, m, kv_rows=None, blk=segments._BLOCK):
  q = np.asarray(q_rows, np.int32)
  kv = None if kv_rows is None else np.asarray(kv_rows, np.int32)
  got = jitted(m, blk)(q, kv)
  want, side_counts = naive(q, m, kv)
  assert_matches(got, want, side_counts, m)
  return got


# A tiny block makes runs cross block edges and the last block overlap the previous one.
BLOCKS = [3, segments._BLOCK]
block = pytest.mark.parametrize("blk", BLOCKS, ids=[f"block{b}" for b in BLOCKS])


@block
def test_docstring_example_and_conventions(blk):
  got = check([[3, 3, 1, 1, 0, 0]], 3, blk=blk)
  np.testing.assert_array_equal(got.q_seqlens, [[2, 2, -1]])
  np.testing.assert_array_equal(got.q_offsets, [[0, 2, -1, -1]])
  np.testing.assert_array_equal(got.kv_offsets, got.q_offsets)


@pytest.mark.parametrize("row", [
    [1, 1, 1, 2, 2, 0, 0, 0],        # padding tail
    [1, 1, 0, 0, 2, 2, 2, 0],        # padding in the middle
    [0, 0, 5, 5, 5, 5, 5, 5],        # padding head
    [7, 3, 3, 9, 1, 1, 1, 4],        # unsorted ids, length-1 documents
    [1, 2, 3, 4, 5, 6, 7, 8],        # every token its own document
    [1, 1, 2, 2, 1, 1, 0, 2],        # an id that comes back: separate runs
    [0, 0, 0, 0, 0, 0, 0, 0],        # all padding
    [4, 4, 4, 4, 4, 4, 4, 4],        # one document
])
@block
def test_self_rows(row, blk):
  check([row], 8, blk=blk)


@block
def test_exactly_max_and_overflow(blk):
  rows = [[1, 2, 3, 0, 0, 0], [1, 2, 3, 4, 0, 0], [1, 1, 0, 0, 0, 2]]
  got = check(rows, 3, blk=blk)
  np.testing.assert_array_equal(got.num_segments, [3, 4, 2])
  np.testing.assert_array_equal(got.valid, [True, False, True])
  np.testing.assert_array_equal(got.q_offsets[0], [0, 1, 2, -1])
  with pytest.raises(checkify.JaxRuntimeError, match="row 1 has 4 documents but max_segments=3"):
    seqlens_and_offsets(jnp.asarray(rows), 3, check=True)
  seqlens_and_offsets(jnp.asarray(rows), 4, check=True)  # fits: no error


def test_check_under_jit_with_checkify():
  f = checkify.checkify(jax.jit(lambda ids: seqlens_and_offsets(ids, 2, check=True)))
  err, _ = f(jnp.asarray([[1, 2, 0, 0], [1, 2, 3, 0]]))
  with pytest.raises(checkify.JaxRuntimeError, match="row 1 has 3 documents"):
    err.throw()
  err, out = f(jnp.asarray([[1, 2, 0, 0], [1, 1, 0, 0]]))
  err.throw()
  np.testing.assert_array_equal(out.num_segments, [2, 1])


@block
def test_cross_pairs_by_id_not_rank(blk):
  q = [[1, 1, 2, 2, 3, 0]]          # 3 only on the q side
  kv = [[4, 2, 2, 2, 1, 0, 5]]      # 4 and 5 only on the kv side, 1 and 2 swapped
  got = check(q, 5, kv, blk=blk)
  # Slots: q order (1, 2, 3), then kv-only in kv order (4, 5).
  np.testing.assert_array_equal(got.q_seqlens, [[2, 2, 1, 0, 0]])
  np.testing.assert_array_equal(got.kv_seqlens, [[1, 3, 0, 1, 1]])
  np.testing.assert_array_equal(got.kv_offsets, [[4, 1, 0, 0, 6, -1]])
  got = check(q, 4, kv, blk=blk)  # union of 5 documents does not fit although each side does
  np.testing.assert_array_equal(got.num_segments, [5])


@pytest.mark.parametrize("q,kv", [
    ([[1, 1, 0, 0]], [[0, 0, 2, 2]]),               # nothing shared
    ([[0, 0, 0, 0]], [[1, 1, 2, 0]]),               # q all padding
    ([[1, 2, 1, 2]], [[2, 1, 2, 1, 0]]),            # repeated ids: k-th run pairs with k-th
    ([[3, 3, 3, 1]], [[1, 1, 3, 3]]),
])
@block
def test_cross_rows(q, kv, blk):
  check(q, 4, kv, blk=blk)


def test_cross_with_same_ids_is_self_attention():
  ids = jnp.asarray([[2, 2, 5, 1, 1, 0, 2], [0, 1, 1, 1, 2, 2, 0]])
  for g, w in zip(jitted(4, segments._BLOCK)(ids, ids), jitted(4, segments._BLOCK)(ids, None),
                  strict=True):
    np.testing.assert_array_equal(g, w)


@pytest.mark.slow
def test_jit_matches_eager():
  q = jnp.asarray([[1, 1, 2, 0, 3, 3, 3, 0]])
  kv = jnp.asarray([[3, 3, 1, 0, 4]])
  for args in [(q,), (q, kv)]:
    got = jax.jit(seqlens_and_offsets, static_argnums=1)(args[0], 3, *args[1:])
    for g, w in zip(got, seqlens_and_offsets(args[0], 3, *args[1:]), strict=True):
      np.testing.assert_array_equal(g, w)


def test_feeds_cudnn_packing():
  """JAX's cuDNN path packs non-negative slots of all rows left; pairs must stay aligned."""
  fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
  q_ids = jnp.asarray([[1, 1, 2, 0, 0, 0], [3, 3, 3, 0, 4, 4]])
  kv_ids = jnp.asarray([[2, 2, 2, 1, 0, 0, 0, 0], [5, 4, 4, 4, 0, 0, 0, 0]])
  d = jitted(3, segments._BLOCK)(q_ids, kv_ids)
  n_heads, head_dim = 2, 4
  query = jnp.zeros((2, 6, n_heads, head_dim), jnp.bfloat16)
  key = jnp.zeros((2, 8, n_heads, head_dim), jnp.bfloat16)
  fa.check_layout(query, key, key, None, d.q_seqlens, d.kv_seqlens, d.q_offsets, d.kv_offsets,
                  None, None, fa.AttentionLayout.BTNH)
  q_len, kv_len, q_off, kv_off = (x.reshape(-1) for x in jax.jit(fa._fix_seqlen_offsets)(
      d.q_seqlens, d.kv_seqlens, d.q_offsets, d.kv_offsets, query, key))
  stride = n_heads * head_dim
  # Row 0: docs 1, 2; row 1: docs 3, 4, then 5 (kv only). Offsets are flat token * stride.
  np.testing.assert_array_equal(q_len[:5], [2, 1, 3, 2, 0])
  np.testing.assert_array_equal(q_off[:5] // stride, [0, 2, 6, 10, 6])
  np.testing.assert_array_equal(kv_len[:5], [1, 3, 0, 3, 1])
  np.testing.assert_array_equal(kv_off[:5] // stride, [3, 0, 8, 9, 8])


@st.composite
def packed_rows(draw, batch, length, max_id):
  """Rows of random runs: ids drawn from a small pool (so ids repeat), 0 = padding."""
  rows = []
  for _ in range(batch):
    row = []
    while len(row) < length:
      row += [draw(st.integers(0, max_id))] * draw(st.integers(1, 5))
    rows.append(row[:length])
  return rows


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(data=st.data(), m=st.sampled_from([1, 3, 6]), length=st.sampled_from([1, 16]),
                  blk=st.sampled_from(BLOCKS))
def test_property_self(data, m, length, blk):
  rows = data.draw(packed_rows(2, length, 9))
  check(rows, m, blk=blk)


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(data=st.data(), m=st.sampled_from([1, 3, 6]), blk=st.sampled_from(BLOCKS))
def test_property_cross(data, m, blk):
  # Few distinct shapes and m keep compiles few; short documents come from padding runs.
  q = data.draw(packed_rows(2, 16, 5))
  kv = data.draw(packed_rows(2, 11, 5))
  check(q, m, kv, blk=blk)


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_compiled_temp_memory_is_small(cross):
  t, m = 131072, 256
  ids = jax.ShapeDtypeStruct((1, t), jnp.int32)
  args = (ids, ids) if cross else (ids,)
  f = jax.jit(lambda q, *kv: seqlens_and_offsets(q, m, *kv))
  temp = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
  # A [T, T] bool mask would be 16 GiB; one int32 [T] buffer is 512 KiB.
  assert temp < 4 * 2**20, temp


@pytest.mark.parametrize("args,err,match", [
    ((np.zeros((4,), np.int32), 2), ValueError, r"segment_ids must be 2-D .*shape \(4,\)"),
    ((np.zeros((1, 4), np.float32), 2), TypeError, "segment_ids must be an integer array.*float32"),
    ((np.zeros((1, 4), bool), 2), TypeError, "segment_ids must be an integer array.*bool"),
    ((np.zeros((1, 4), np.int32), 0), ValueError, "max_segments must be > 0, got 0"),
    ((np.zeros((1, 4), np.int32), 2.0), TypeError,
     r"max_segments must be a static Python int, got 2\.0"),
    ((np.zeros((1, 4), np.int32), True), TypeError,
     "max_segments must be a static Python int, got True"),
    ((np.zeros((1, 4), np.int32), jnp.asarray(2)), TypeError,
     "max_segments must be a static Python int"),
    ((np.zeros((1, 4), np.int32), 2, np.zeros((1, 2, 3), np.int32)), ValueError,
     r"kv_segment_ids must be 2-D .*\(1, 2, 3\)"),
    ((np.zeros((1, 4), np.int32), 2, np.zeros((1, 4), np.float16)), TypeError,
     "kv_segment_ids must be an integer array"),
    ((np.zeros((2, 4), np.int32), 2, np.zeros((3, 4), np.int32)), ValueError,
     r"kv_segment_ids has batch 3 .* segment_ids has batch 2"),
])
def test_bad_input(args, err, match):
  with pytest.raises(err, match=match):
    seqlens_and_offsets(*args)
