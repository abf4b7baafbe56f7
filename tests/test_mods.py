"""Programmable masks and scores (`flaxattn.MaskMod`, `flaxattn.ScoreMod`): what they refuse,
that new operands never retrace, their block maps, `|` and `~`, and the layer with them
(trained operands, decode). Every kernel and strategy runs the gallery in
test_conformance.py and test_context_parallel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxattn
import mod_gallery
from flaxattn import MaskMod, ScoreMod, blocks
from helpers import as_layout, dense_oracle, qkv, random_packing


def causal(b, h, q_idx, kv_idx):
  return kv_idx <= q_idx


def prefix_lm(b, h, q_idx, kv_idx, prefix):
  return (kv_idx <= q_idx) | (kv_idx < prefix[b])


@pytest.mark.parametrize("fn, error, match", [
    (lambda b, h, q, k: q - k, TypeError, r"mask_mod <lambda> expects a bool result.*got int32"),
    (lambda b, h, q, k: jnp.zeros((4,), bool), ValueError,
     r"mask_mod <lambda> expects a result that broadcasts.*got shape \(4,\)"),
    (lambda b, h, q, k: q.undefined, TypeError, r"mask_mod <lambda> failed on int32 index"),
    ("not a function", TypeError, r"MaskMod expects a function fn\(b, h, q_idx, kv_idx"),
])
def test_a_mask_mod_that_returns_the_wrong_thing_is_refused_naming_it(fn, error, match):
  with pytest.raises(error, match=match):
    MaskMod(fn)


@pytest.mark.parametrize("fn, operands, match", [
    (lambda s, b, h, q, k: (q - k).astype(jnp.float32), (),
     r"score_mod <lambda> expects the new scores, a float array of the score's shape"
     r".*\(1, 1, 5, 7\)"),
    (lambda s, b, h, q, k: s > 0, (), r"score_mod <lambda> expects .* got bool"),
    (lambda s, b, h, q, k, t: s + t[h], ([1.0, 2.0],),
     r"ScoreMod expects operands that are arrays"),
])
def test_a_score_mod_that_returns_the_wrong_thing_is_refused_naming_it(fn, operands, match):
  with pytest.raises(TypeError, match=match):
    ScoreMod(fn, *operands)
  with pytest.raises(TypeError, match=r"score_mod expects a flaxattn.ScoreMod"):
    q = jnp.zeros((1, 8, 1, 4))
    flaxattn.attention(q, q, q, score_mod=lambda s, b, h, q, k: s)


def test_new_operands_never_retrace():
  """A prefix length that changes every batch, and a table that changes every step: one
  trace and one compiled program, whether the mods are built inside the step or passed
  in as arguments."""
  q, k, v = qkv(0, 2, 64, 64, 2, 1, 8)
  traces = []

  @jax.jit
  def step(q, k, v, prefix, table):
    traces.append(1)
    return flaxattn.attention(q, k, v, mask=MaskMod(prefix_lm, prefix),
                              score_mod=ScoreMod(lambda s, b, h, qi, ki, t: s + t[h], table))

  @jax.jit
  def passed(q, k, v, mask, score_mod):
    traces.append(2)
    return flaxattn.attention(q, k, v, mask=mask, score_mod=score_mod)

  add = lambda s, b, h, qi, ki, t: s + t[h]  # noqa: E731 (one function object for both calls)
  for i in range(3):
    prefix, table = jnp.array([i, 10 * i]), jnp.full((2,), 0.1 * i)
    step(q, k, v, prefix, table)
    passed(q, k, v, MaskMod(prefix_lm, prefix), ScoreMod(add, table))
  assert traces == [1, 2]
  assert step._cache_size() == passed._cache_size() == 1  # noqa: SLF001


def test_explain_counts_a_prefix_lm_block_map_at_32k():
  """The prefix-LM mask of one row at 32K in blockwise's 512-token blocks: the partial
  blocks are the diagonal's and the prefix edge's, O(T / b), not O(T^2 / b^2); the counts
  are the dense classification's."""
  t = 32768
  q = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.bfloat16)
  mask = MaskMod(prefix_lm, jnp.array([5000], jnp.int32))
  text = flaxattn.explain(q, q, q, mask=mask, print_fn=None)
  line = next(x for x in text.splitlines() if x.startswith("block map"))
  assert line.startswith("block map (blockwise's 512 x 512 blocks, found on device): 1971"
                         " empty, 64 partial (masked in the kernel), 2061 full, of 4096"), line
  # The same counts from the mask evaluated per element, block by block (numpy).
  qi = np.arange(t)[:, None]
  kinds = np.empty((64, 64), np.int32)
  for i in range(64):
    ok = (np.arange(t)[None] <= qi[i * 512:(i + 1) * 512]) | (np.arange(t)[None] < 5000)
    ok = ok.reshape(512, 64, 512)
    kinds[i] = np.where(ok.all((0, 2)), blocks.FULL, np.where(ok.any((0, 2)), blocks.PARTIAL,
                                                              blocks.EMPTY))
  assert blocks.counts(kinds) == {"empty": 1971, "partial": 64, "full": 2061}


def test_block_map_is_the_dense_classification_and_keeps_built_in_and_segment_kinds():
  """On packed rows, every block kind of a MaskMod combined with built-ins equals the
  classification of the dense mask (segments included); blocks across documents are EMPTY
  even where the MaskMod allows everything."""
  t, b = 256, 2
  seg, pos = random_packing(3, b, t, max_docs=4, pad_tail=9)
  prefix = jnp.array([40, 90], jnp.int32)
  for mask in (MaskMod(prefix_lm, prefix), flaxattn.Local(32) | MaskMod(prefix_lm, prefix),
               flaxattn.Causal() & ~MaskMod(lambda b, h, q, k: (q - k) % 3 == 0),
               MaskMod(lambda b, h, q, k: q == q)):
    kinds = np.asarray(blocks.block_map(mask, t, segment_ids=seg, positions=pos, batch=b,
                                        block_q=32, block_kv=32))
    dense = np.asarray(flaxattn.reference.dense_mask(mask, as_layout(seg, pos).materialize(
        b, t, t)))[:, 0].reshape(b, t // 32, 32, t // 32, 32)
    want = np.where(dense.all((2, 4)), blocks.FULL,
                    np.where(dense.any((2, 4)), blocks.PARTIAL, blocks.EMPTY))
    np.testing.assert_array_equal(kinds, want, err_msg=str(mask))


def test_draw_pictures_a_block_map(tmp_path):
  kinds = blocks.block_map(MaskMod(prefix_lm, jnp.array([300])), 1024, block_q=128,
                           block_kv=128)
  text = blocks.draw(kinds, str(tmp_path / "map.png"))
  rows = text.splitlines()
  assert len(rows) == 8 and all(len(r) == 10 for r in rows)
  assert rows[0] == "|##+     |" and rows[7] == "|#######+|", text
  assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_or_and_not_combine_built_ins_exactly():
  """`|` and `~` of built-in masks on positions, and with MaskMods, against their truth
  tables; `|` of causal masks stays causal."""
  q_pos, k_pos = np.arange(-40, 40)[:, None], np.arange(-40, 40)[None]
  local, chunked = flaxattn.Local(5), flaxattn.Chunked(8)
  np.testing.assert_array_equal((local | chunked).allows(q_pos, k_pos),
                                local.allows(q_pos, k_pos) | chunked.allows(q_pos, k_pos))
  np.testing.assert_array_equal((~flaxattn.Causal()).allows(q_pos, k_pos), k_pos > q_pos)
  assert (local | chunked).is_causal and not (local | flaxattn.Full()).is_causal
  assert ~~local == local
  for lo, hi in ((-40, -33), (-8, 7), (0, 31)):  # block kinds stay conservative
    for mask in (local | chunked, ~local, ~(local | chunked)):
      skip, full = mask.block_kinds(*np.array([lo, hi, lo - 6, hi - 6]))
      allowed = mask.allows(np.arange(lo, hi + 1)[:, None], np.arange(lo - 6, hi - 5)[None])
      assert not (skip and allowed.any()) and not (full and not allowed.all()), (mask, lo)


def test_the_layer_trains_a_score_mod_table_and_decodes_with_mods():
  """A layer with a MaskMod and a ScoreMod whose table is an nnx.Param: the table gets
  the gradient of the written-out attention, and decoding token by token from a cache
  gives the full forward's outputs (the mods read the cache's slots as token indices)."""
  b, t, h, e = 2, 24, 4, 32
  table = nnx.Param(jnp.asarray(np.random.default_rng(0).standard_normal((16, h)), jnp.float32))
  score_mod = ScoreMod(lambda s, b, h, qi, ki, table: s + table[mod_gallery.t5_bucket(qi - ki), h],
                       table)
  mask = MaskMod(prefix_lm, jnp.array([5, 9], jnp.int32))
  layer = flaxattn.MultiHeadAttention(h, e, num_kv_heads=2, mask=mask, score_mod=score_mod,
                                      rope=flaxattn.RoPE(10000.0), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (b, t, e))
  full = layer(x)

  def oracle_loss(values):
    q = layer.query(x)
    k, v = layer.key(x), layer.value(x)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    q, k = layer.rope(q, positions), layer.rope(k, positions)
    mod = ScoreMod(score_mod.fn, values)
    out, _ = dense_oracle(q, k, v, as_layout(None), mask, 8 ** -0.5, score_mod=mod)
    return jnp.sum(layer.out(out) ** 2)

  got = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)["score_mod"]
  want = jax.grad(oracle_loss)(table[...])
  np.testing.assert_allclose(jax.tree.leaves(got)[0], want, rtol=1e-4, atol=1e-4)

  layer.init_cache((b, 32, e))  # the prefill holds each row's bidirectional prefix
  steps = [layer(x[:, :10], decode=True)] + [layer(x[:, i:i + 1], decode=True)
                                             for i in range(10, t)]
  np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=2e-5, rtol=2e-5)


def test_layers_share_one_block_map(monkeypatch):
  """Four layers of one step with a `blocks.share`d mask: the block map is built once (in
  `share`), where each layer would build its own; a layer given other ids builds its own
  again; all outputs equal the unshared ones."""
  built = []
  refine = blocks.refine
  monkeypatch.setattr(blocks, "refine", lambda *a, **k: built.append(1) or refine(*a, **k))
  b, t, h = 2, 1024, 2
  q, k, v = qkv(5, b, t, t, h, 1, 8)
  seg, pos = (jnp.asarray(x) for x in random_packing(7, b, t, max_docs=3))
  prefix = jnp.array([100, 700], jnp.int32)

  def step(q, k, v, seg, pos, shared: bool):
    mask = MaskMod(prefix_lm, prefix)
    if shared:
      mask = blocks.share(mask, t, segment_ids=seg, positions=pos, batch=b, heads=h)
    x = q
    for _ in range(4):
      x = flaxattn.attention(x, k, v, mask=mask, segment_ids=seg, positions=pos)
    other = flaxattn.attention(x, k, v, mask=mask, segment_ids=seg + 0, positions=pos)
    return x, other

  outs = {}
  for shared in (False, True):
    built.clear()
    outs[shared] = jax.jit(step, static_argnums=5)(q, k, v, seg, pos, shared)
    assert len(built) == (2 if shared else 5), (shared, len(built))
  for got, want in zip(outs[True], outs[False], strict=True):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
