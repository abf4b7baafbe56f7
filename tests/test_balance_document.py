"""Per-document load balancing: the plan (`balance_plan`, `load_balance(segment_ids=)`), and
every context-parallel strategy on per-document balanced rows against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import flaxattn
from flaxattn import balance, planner, ring
from helpers import devices, grads_of, qkv, random_packing

TOL = 1e-5  # float32, relative to the largest reference magnitude


def lognormal_rows(seed, rows, t, median, sigma):
  """`[rows, t]` segment ids: log-normal document lengths, packed first-fit, padding last."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((rows, t), np.int32)
  free = np.full(rows, t)
  count = np.zeros(rows, int)
  for _ in range(50 * rows * t // median):
    n = int(np.clip(rng.lognormal(np.log(median), sigma), 1, t))
    fits = np.flatnonzero(free >= n)
    if not fits.size:
      if free.max() < 16:
        break
      continue
    r = fits[0]
    count[r] += 1
    seg[r, t - free[r]:t - free[r] + n] = count[r]
    free[r] -= n
  return seg


def test_round_trip_padding_last_numpy_and_jax():
  seg = lognormal_rows(0, 3, 960, 40, 1.0)
  x = np.random.default_rng(1).normal(size=(3, 960, 2)).astype(np.float32)
  y = flaxattn.load_balance(x, 8, segment_ids=seg)
  assert isinstance(y, np.ndarray)  # on the host, no device round trip
  np.testing.assert_array_equal(flaxattn.unload_balance(y, 8, segment_ids=seg), x)
  y_jax = flaxattn.load_balance(jnp.asarray(x), 8, segment_ids=jnp.asarray(seg))
  assert isinstance(y_jax, jax.Array)
  np.testing.assert_array_equal(np.asarray(y_jax), y)
  # A permutation per row; on every shard the padding comes after the tokens.
  order = balance.balance_plan(seg, 8).order
  np.testing.assert_array_equal(np.sort(order, axis=1), np.broadcast_to(np.arange(960), (3, 960)))
  pad = flaxattn.load_balance(seg, 8, segment_ids=seg).reshape(3, 8, 120) == 0
  assert not np.any(pad[..., :-1] & ~pad[..., 1:])
  # Without segment ids nothing changes: the row order.
  np.testing.assert_array_equal(flaxattn.load_balance(x, 8), balance.load_balance(x, 8, axis=1))


def test_head_tail_pieces_and_even_work():
  # One document of 3 x 2cp tokens + 5, one short document, padding: cp = 4, pieces of
  # whole tokens (block=1).
  seg = np.zeros((1, 64), np.int32)
  seg[0, :29], seg[0, 29:32] = 1, 2
  plan = balance.balance_plan(seg, 4, block=1)
  shard_of = np.empty(64, int)
  shard_of[plan.order[0]] = np.arange(64) // 16
  # Pieces of 3 tokens: i and 7-i on shard i (the causal pairs weigh the same).
  for i in range(4):
    assert set(shard_of[3 * i:3 * i + 3]) == {i}
    assert set(shard_of[26 - 3 * i:29 - 3 * i]) == {i}
  work = balance.token_work(seg)
  np.testing.assert_array_equal(plan.shard_work[0], np.bincount(shard_of, work[0], 4))
  assert plan.max_over_mean()[0] < 1.1
  # Pieces of whole blocks: cp 2, block 4, a document of 2cp blocks + 3 tokens: pieces
  # 0..3 and 15..18 form a pair, 4..7 and 11..14 the other, the middle 3 tokens a unit.
  seg = np.ones((1, 20), np.int32)
  seg[0, -1] = 0
  shard_of = np.empty(20, int)
  shard_of[balance.balance_plan(seg, 2, block=4).order[0]] = np.arange(20) // 10
  pairs = [set(shard_of[np.r_[0:4, 15:19]]), set(shard_of[np.r_[4:8, 11:15]])]
  assert pairs == [{0}, {1}], shard_of


def test_renumbered_segment_ids_are_the_same_documents():
  seg = lognormal_rows(2, 2, 1024, 30, 1.0)
  seg[0, 500:520] = 3  # an id on two separate runs is one document
  plan = balance.balance_plan(seg, 4)
  got, moved = plan.segment_ids(seg), plan.apply(seg)
  for row_got, row_moved in zip(got, moved, strict=True):
    assert np.array_equal(row_got == 0, row_moved == 0)
    def same(ids):
      return ids[:, None] == ids[None, :]
    np.testing.assert_array_equal(same(row_got), same(row_moved))
    starts = row_got[np.r_[True, row_got[1:] != row_got[:-1]] & (row_got > 0)]
    assert np.all(np.maximum.accumulate(starts) <= np.arange(1, len(starts) + 1))


@pytest.mark.parametrize("cp,median,sigma", [(8, 200, 1.2), (4, 1000, 1.0)])
def test_causal_work_even_on_packed_rows(cp, median, sigma):
  seg = lognormal_rows(cp, 4, 8192, median, sigma)
  doc = balance.balance_plan(seg, cp, block=16).max_over_mean()  # 64 blocks a shard
  work = balance.token_work(seg)
  row = flaxattn.load_balance(work, cp).reshape(4, cp, -1).sum(-1)
  assert doc.max() <= 1.02, doc
  assert (row.max(-1) / row.mean(-1)).mean() > 1.2  # what the row order leaves on these rows


def test_mixed_masks_weigh_every_layer():
  seg = lognormal_rows(3, 4, 16384, 400, 1.2)
  masks = [flaxattn.Local(256)] * 3 + [flaxattn.Causal()]
  mixed = balance.balance_plan(seg, 8, masks, block=16)
  assert mixed.max_over_mean().max() <= 1.05, mixed.max_over_mean()
  # The per-layer work is the normal form's: a window caps each token's keys.
  w = balance.token_work(np.r_[[1] * 300, [2] * 4][None], [flaxattn.Local(256),
                                                           flaxattn.Chunked(100)])
  np.testing.assert_array_equal(w[0, [0, 99, 100, 299, 300, 303]],
                                [2, 200, 101 + 1, 256 + 100, 2, 8])


def row_order_work(seg, cp, masks=None):
  """`[rows, cp]` each shard's work in row order, from the row order's definition."""
  work = balance.token_work(seg, masks)
  return flaxattn.load_balance(work, cp).reshape(len(seg), cp, -1).sum(-1)


def test_one_document_takes_row_order_where_pieces_are_coarse():
  # 4096 tokens over 8 shards of one 512-token block: whole-block pieces cannot pair up.
  seg = np.ones((1, 4096), np.int32)
  plan = balance.balance_plan(seg, 8, block=512)
  assert plan.max_over_mean()[0] == 1.0, plan.max_over_mean()
  assert plan.row_order.tolist() == [True]
  assert plan.document_work.max() / plan.document_work.mean() > 1.8  # what it passed over
  np.testing.assert_array_equal(plan.order[0], flaxattn.load_balance(np.arange(4096), 8, 0))
  np.testing.assert_array_equal(plan.shard_work, row_order_work(seg, 8))
  assert plan.describe().splitlines()[1] == ("row 0: row order, max/mean 1.000 (document order"
                                             " 1.875)")


@pytest.mark.parametrize("masks", [None, [flaxattn.Local(256), flaxattn.Causal()]])
def test_plan_never_balances_worse_than_row_order(masks):
  taken = []
  for cp, block, median, sigma in [(8, 512, 500, 1.2), (2, 512, 300, 1.0), (4, 128, 1000, 1.5),
                                   (8, 16, 200, 1.2), (16, 128, 2000, 1.0)]:
    seg = lognormal_rows(cp + block, 6, 4096, median, sigma)
    seg[0] = 1  # one document filling the row
    plan = balance.balance_plan(seg, cp, masks, block=block)
    row = row_order_work(seg, cp, masks)
    assert np.all(plan.max_over_mean() <= row.max(-1) / row.mean(-1)), (cp, block)
    # The recorded order is the order taken, and the work is that order's.
    arange = flaxattn.load_balance(np.arange(4096), cp, 0)
    for r in range(len(seg)):
      assert np.array_equal(plan.order[r], arange) == plan.row_order[r], (cp, block, r)
    shard_of = np.empty(seg.shape, int)
    np.put_along_axis(shard_of, plan.order, np.arange(4096) // (4096 // cp), axis=1)
    work = balance.token_work(seg, masks)
    for r in range(len(seg)):
      np.testing.assert_array_equal(plan.shard_work[r], np.bincount(shard_of[r], work[r], cp))
    np.testing.assert_array_equal(plan.row_work, row)
    np.testing.assert_array_equal(plan.undo(plan.apply(seg)), seg)
    taken += plan.row_order.tolist()
  assert any(taken) and not all(taken), taken  # both orders occur


def test_row_order_needs_t_divisible_by_2cp():
  seg = lognormal_rows(4, 2, 4092, 300, 1.0)  # 4092 = 4 x 1023: document order only
  plan = balance.balance_plan(seg, 4, block=512)
  assert plan.row_work is None and not plan.row_order.any()
  np.testing.assert_array_equal(plan.shard_work, plan.document_work)
  assert "row 1: document order, max/mean" in plan.describe()
  assert "(row order: T = 4092 not divisible by 2 * cp = 8)" in plan.describe()


def test_plan_errors():
  seg = np.ones((1, 12), np.int32)
  with pytest.raises(ValueError, match=r"divisible by cp = 5"):
    flaxattn.load_balance(seg, 5, segment_ids=seg)
  with pytest.raises(TypeError, match="masks expects"):
    balance.balance_plan(seg, 2, flaxattn.Causal())
  with pytest.raises(ValueError, match="expects segment_ids"):
    flaxattn.load_balance(seg, 2, masks=[flaxattn.Causal()])
  with pytest.raises(ValueError, match=r"x expects its first 2 dims"):
    flaxattn.load_balance(np.ones((1, 6)), 2, segment_ids=seg)
  with pytest.raises(TypeError, match="traced"):
    jax.jit(lambda s: flaxattn.load_balance(s, 2, segment_ids=s))(seg)
  with pytest.raises(ValueError, match=r"at least one token on the last axis of segment_ids,"
                     r" got shape \(1, 0\)"):
    flaxattn.balance_plan(np.ones((1, 0), np.int32), 2)


def _mesh(shape, names):
  n = int(np.prod(shape))
  return jax.sharding.Mesh(np.array(devices(n)).reshape(shape), names,
                           axis_types=(AxisType.Auto,) * len(names))


CASES = [  # strategy, mesh shape, ring axis, mask, heads, backend
    ("ring", (2,), None, flaxattn.Causal(), 2, "auto"),
    ("ring", (4,), None, flaxattn.Local(7), 2, "auto"),
    ("ring", (8,), None, flaxattn.Causal(), 2, "auto"),
    ("all_gather", (4,), None, flaxattn.Chunked(24), 2, "auto"),
    ("ulysses", (4,), None, flaxattn.Causal(), 4, "auto"),
    ("ulysses", (2, 2), "context_ring", flaxattn.Local(7), 4, "auto"),
    # Splash masks on the token index: its per-batch check sends these rows to blockwise.
    ("ring", (2,), None, flaxattn.Causal(), 2, "splash"),
]


@pytest.mark.parametrize("strategy,shape,ring_axis,mask,heads,backend", CASES)
def test_document_order_matches_reference(strategy, shape, ring_axis, mask, heads, backend):
  names = ("context_ring", "context") if ring_axis else ("context",)
  mesh = _mesh(shape, names)
  cp = flaxattn.ContextParallel(strategy=strategy, load_balance="document", ring_axis=ring_axis)
  shards = cp.balanced_shards(mesh)
  assert shards == shape[0]
  t = 256
  seg, pos = random_packing(11, 2, t, max_docs=7, cp=shards)
  plan = balance.balance_plan(seg, shards, [mask], block=1)  # split documents finely
  q, k, v = qkv(5, 2, t, t, heads, 2, 16)

  def reference(q, k, v):
    return flaxattn.attention(q, k, v, mask=mask, segment_ids=seg, positions=pos,
                              backend="reference", return_lse=True)

  def parallel(q, k, v):
    out, lse = flaxattn.attention(
        plan.apply(q), plan.apply(k), plan.apply(v), mask=mask, segment_ids=plan.apply(seg),
        positions=plan.apply(pos), context_parallel=cp, return_lse=True, backend=backend)
    return plan.undo(out), plan.undo(lse)

  want_grads, (want_out, want_lse) = grads_of(reference)(q, k, v)
  with jax.set_mesh(mesh):
    got_grads, (got_out, got_lse) = grads_of(parallel)(q, k, v)
  def scale(x):
    return np.abs(np.asarray(x)).max()
  np.testing.assert_allclose(got_out, want_out, atol=TOL * scale(want_out))
  np.testing.assert_allclose(got_lse, want_lse, atol=TOL * scale(want_lse))
  for got, want in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(got, want, atol=TOL * scale(want))


def test_document_order_needs_positions_and_explains():
  mesh = _mesh((4,), ("context",))
  cp = flaxattn.ContextParallel(load_balance="document")
  q, k, v = qkv(0, 1, 64, 64, 2, 2, 8)
  seg = np.ones((1, 64), np.int32)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="expects explicit positions"):
      flaxattn.attention(q, k, v, segment_ids=seg, context_parallel=cp)
    plan = balance.balance_plan(seg, 4, block=16)  # pieces too coarse: row order balances
    text = flaxattn.explain(q, k, v, mask=flaxattn.Local(4), segment_ids=seg,
                            positions=np.arange(64)[None], context_parallel=cp,
                            balance_plan=plan, print_fn=None)
  assert "window-aware ring's neighbour fetches do not apply" in text
  assert "token order: per document" in text
  assert text.endswith("row 0: row order, max/mean 1.000 (document order 1.738)")
  assert ring.ring_fetches(flaxattn.Local(4), 64, 4, "document") is None
  assert ring.ring_fetches(flaxattn.Local(4), 64, 4, True) is not None
  with pytest.raises(ValueError, match="load_balance"):
    flaxattn.ContextParallel(load_balance="rows")


def test_planner_counts_the_document_order():
  shapes = (1, 131072, 8, 128), (1, 131072, 8, 128)
  local = flaxattn.Local(4096)
  best, costs = planner.plan(*shapes, 2, local, "document", 8, "tpu")
  by_name = {c.strategy: c for c in costs}
  row_best, row_costs = planner.plan(*shapes, 2, local, True, 8, "tpu")
  # Document order: every ring step moves (3n - 2) shards; row order two half shards.
  assert by_name["ring"].bytes_moved > {c.strategy: c for c in row_costs}["ring"].bytes_moved
  assert by_name["ring, row order"].seconds is None
  assert "window-aware ring would take" in by_name["ring, row order"].why_not
  assert best.strategy in ("ring", "all_gather", "ulysses")
  causal = planner.plan(*shapes, 2, flaxattn.Causal(), "document", 8, "tpu")[1]
  unbalanced = planner.plan(*shapes, 2, flaxattn.Causal(), False, 8, "tpu")[1]
  assert [c.strategy for c in causal] == ["ring", "all_gather", "ulysses"]
  assert causal[0].compute_s < unbalanced[0].compute_s  # balanced: no 2x imbalance
