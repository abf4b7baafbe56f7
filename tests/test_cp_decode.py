"""The layer's KV cache under context parallelism: prefill and token-by-token decode on a
mesh equal the same layer on one device; the cache is sharded, balanced and bounded."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import helpers
from flaxattn import (
  Causal,
  Chunked,
  ContextParallel,
  Local,
  MultiHeadAttention,
  RoPE,
  aot,
  balance_plan,
  explain,
  load_balance,
  unload_balance,
)
from helpers import normal
from models.llama import Llama, LlamaConfig
from train import sample

E = 16


@dataclasses.dataclass(frozen=True)
class Case:
  n: int  # context axis size
  strategy: str
  mask: object
  load_balance: bool = True
  heads: int = 4
  kv_heads: int = 2
  ring: int = 1  # > 1: Ulysses over `context` x a ring over `context_ring` of this size
  data: int = 1  # a data axis beside the context axes (the batch is sharded over it)
  lengths: tuple[int, ...] = (16,)  # prompt tokens per row; shorter rows end in padding
  packed: bool = False  # explicit ids: two documents in row 0
  sinks: bool = False
  soft_cap: float | None = None
  prompt: int = 16  # the padded prompt length
  steps: tuple[int, ...] = (1, 1, 1)  # new tokens per decode call after the prompt


CASES = [
    # Default ids and load-balanced default positions; GQA with one K/V head for 2 devices;
    # a second prefill (4 tokens, load balanced) into the filled cache, then 1 and 3 tokens.
    pytest.param(Case(2, "ring", Local(6), kv_heads=1, steps=(4, 1, 3), prompt=8),
                 marks=pytest.mark.slow),
    pytest.param(Case(4, "all_gather", Local(5), data=2, lengths=(16, 9), packed=True,
                      sinks=True), marks=pytest.mark.slow),
    pytest.param(Case(8, "ring", Chunked(4), load_balance=False, soft_cap=3.0, lengths=(16, 11),
                      packed=True), marks=pytest.mark.slow),
    Case(4, "ulysses", Causal(), heads=8, sinks=True, soft_cap=5.0, lengths=(13, 16)),
    pytest.param(Case(2, "ulysses", Causal(), ring=2, steps=(8, 1)), marks=pytest.mark.slow),
]


def _ids(case: Case, b: int):
  """Segment ids and positions `[B, prompt]` of the prompts (None: the defaults), then of
  each decode call."""
  if len(case.lengths) == 1 and not case.packed:
    return (None, None), [(None, None)] * len(case.steps)
  seg = np.zeros((b, case.prompt), np.int32)
  pos = np.zeros((b, case.prompt), np.int32)
  for row, length in enumerate(case.lengths):
    seg[row, :length], pos[row, :length] = 1, np.arange(length)
  if case.packed:  # row 0: a second document from token 5
    seg[0, 5:case.lengths[0]], pos[0, 5:case.lengths[0]] = 2, np.arange(case.lengths[0] - 5)
  last_B = (np.arange(b), np.array(case.lengths) - 1)
  last_seg, next_pos = seg[last_B], pos[last_B] + 1
  calls = []
  for t in case.steps:
    calls.append((np.repeat(last_seg[:, None], t, 1), next_pos[:, None] + np.arange(t)))
    next_pos = next_pos + t
  return (seg, pos), calls


def _layer(case: Case, cp):
  m = MultiHeadAttention(case.heads, E, num_kv_heads=case.kv_heads, rope=RoPE(), mask=case.mask,
                         sinks=case.sinks, logit_soft_cap=case.soft_cap, context_parallel=cp,
                         backend="reference" if cp is None else "auto", rngs=nnx.Rngs(0))
  if case.sinks:
    m.sinks[...] = jnp.linspace(-1.0, 1.0, case.heads)
  return m


@nnx.jit
def _decode(m, x, seg, pos):
  return m(x, decode=True, segment_ids=seg, positions=pos)


def _run(m, prompt, steps, ids, calls, balance, unbalance, multiple=1):
  """Outputs `[B, T, E]` of the prompt then of each decode call, in the original order.
  Calls of a `multiple` of tokens are prefills: their arrays go in `balance`d order."""
  outs = []
  for x, (seg, pos) in [(prompt, ids)] + list(zip(steps, calls, strict=True)):
    order, back = (balance, unbalance) if x.shape[1] % multiple == 0 else (_same, _same)
    seg, pos = (None if a is None else jnp.asarray(order(a)) for a in (seg, pos))
    outs.append(np.asarray(back(_decode(m, order(x), seg, pos))))
  return outs


def _same(x):
  return x


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"cp{c.ring * c.n}-{c.strategy}"
                         f"{'-x-ring' if c.ring > 1 else ''}-{c.mask}")
def test_prefill_and_decode_equal_one_device(case):
  b, n = len(case.lengths), case.ring * case.n  # n: the sequence shards
  written = case.prompt + sum(case.steps)
  slots = written + (-written) % n
  prompt = normal((b, case.prompt, E), 1)
  steps = [normal((b, t, E), 2 + i) for i, t in enumerate(case.steps)]
  ids, calls = _ids(case, b)
  ref = _layer(case, None)
  ref.init_cache((b, slots, E))
  want = _run(ref, prompt, steps, ids, calls, _same, _same)

  mesh = helpers.mesh({"data": case.data, "context_ring": case.ring, "context": case.n})
  cp = ContextParallel(strategy=case.strategy, load_balance=case.load_balance,
                       ring_axis="context_ring" if case.ring > 1 else None)
  balanced = case.ring if case.ring > 1 else case.n  # ContextParallel.balanced_shards
  balance, unbalance = _same, _same
  if case.load_balance:
    def balance(x):
      return load_balance(x, balanced)
    def unbalance(x):
      return unload_balance(x, balanced)
  with jax.set_mesh(mesh):
    m = _layer(case, cp)
    nnx.update(m, nnx.state(ref, nnx.Param))
    m.init_cache((b, slots, E))
    got = _run(m, prompt, steps, ids, calls, balance, unbalance, math.lcm(n, 2 * balanced))
    shard = m.cache.keys[...].addressable_shards[0].data
  assert shard.shape == (b // case.data, slots // n, case.kv_heads, E // case.heads)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
  # Balanced: every device holds its share of the written tokens, within one.
  filled = np.asarray(m.cache.segment_ids[...] != 0).reshape(b, n, -1).sum(-1)
  if ids[0] is None:
    assert filled.min() >= written // n and filled.max() <= -(-written // n)
  assert int(m.cache.index[...]) == written


def _mesh(n):
  return helpers.mesh({"context": n})


def _values(m) -> list[np.ndarray]:
  """Every variable of `m` (parameters and cache) read back to the host."""
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(m))]


def test_cache_errors_name_the_numbers():
  with jax.set_mesh(_mesh(4)):
    m = MultiHeadAttention(2, E, context_parallel=ContextParallel(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"max_length divisible by the 4 sequence shards.*got"
                       r" max_length 10; round it up to 12"):
      m.init_cache((1, 10, E))
  with pytest.raises(ValueError, match=r"needs a mesh"):
    MultiHeadAttention(2, E, context_parallel=ContextParallel(), rngs=nnx.Rngs(0)).init_cache(
        (1, 8, E))


def test_a_refused_decode_on_a_mesh_writes_nothing_and_raises_at_the_next_read():
  """A compiled decode step past the end of a full sharded cache returns NaN and writes
  nothing; `check()` raises why, naming the cache index, and clears it, leaving every
  variable as it was; a new cache and prefill then run (before the refusals were recorded
  on the device, the variables failed when read and the second prefill hung in a
  collective)."""
  x = normal((1, 8, E))
  with jax.set_mesh(_mesh(4)):
    m = MultiHeadAttention(2, E, mask=Causal(), context_parallel=ContextParallel(),
                           rngs=nnx.Rngs(0))
    m.init_cache((1, 8, E))
    want = np.asarray(_decode(m, x, None, None))
    before = _values(m)
    out = np.asarray(_decode(m, normal((1, 1, E), 1), None, None))
    assert np.isnan(out).all()
    with pytest.raises(ValueError, match=r"writing 1 token\(s\) at cache index 8 needs 9 slots"):
      m.cache.check()
    for a, b in zip(_values(m), before, strict=True):
      np.testing.assert_array_equal(a, b)
    m.init_cache((1, 8, E))
    np.testing.assert_array_equal(_decode(m, x, None, None), want)
    assert int(m.cache.index[...]) == 8


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_a_decode_that_raises_on_a_mesh_writes_nothing_and_nnx_names_read_the_slots(jit):
  """A decode step whose kernel declines (cuDNN on CPU) raises and leaves every variable as
  it was. `cached_key` and `cache_index` read the sharded cache under nnx's names, in slot
  order: 4 tokens, then 1, over 4 devices of 2 slots each go round-robin to slots 0, 2, 4,
  6, then 1."""
  if jax.default_backend() == "gpu":
    pytest.skip("needs a platform where cuDNN declines; this host has a GPU")
  with jax.set_mesh(_mesh(4)):
    m = MultiHeadAttention(2, E, mask=Causal(), context_parallel=ContextParallel(),
                           rngs=nnx.Rngs(0))
    m.init_cache((1, 8, E))
    _decode(m, normal((1, 4, E)), None, None)
    before = _values(m)
    m.backend = "cudnn"
    def call(m, x):
      return m(x, decode=True)
    with pytest.raises(ValueError, match=r"backend='cudnn' cannot serve this call"):
      (nnx.jit(call) if jit else call)(m, normal((1, 1, E), 1))
    for a, b in zip(_values(m), before, strict=True):
      np.testing.assert_array_equal(a, b)
    m.backend = "auto"
    _decode(m, normal((1, 1, E), 1), None, None)
    assert int(m.cache_index) == 5
    keys = np.asarray(m.cached_key)
  np.testing.assert_array_equal(m.cache.segment_ids[...], [[1, 1, 1, 0, 1, 0, 1, 0]])
  np.testing.assert_array_equal(m.cache.positions[...], [[0, 4, 1, 0, 2, 0, 3, 0]])
  assert keys.shape == (1, 8, 2, 8)
  np.testing.assert_array_equal(np.abs(keys).sum((2, 3)) != 0, m.cache.segment_ids[...] != 0)


def test_document_order_decodes_with_explicit_ids_and_refuses_defaults():
  """Documents of 11 and 5 tokens in document order over 2 devices: decode with explicit
  ids equals one device; defaults, which would continue the wrong token (the plan moves
  the last one), are refused, in the prefill and after it."""
  seg = np.repeat(np.array([[1, 2]], np.int32), [11, 5], axis=1)
  pos = np.concatenate([np.arange(11), np.arange(5)])[None].astype(np.int32)
  x, steps = normal((1, 16, E)), [normal((1, 1, E), 2 + i) for i in range(3)]
  step_ids = [(np.array([[2]], np.int32), np.array([[5 + i]], np.int32)) for i in range(3)]

  def layer(cp):
    return MultiHeadAttention(4, E, num_kv_heads=2, rope=RoPE(), mask=Causal(),
                              context_parallel=cp, rngs=nnx.Rngs(0))

  ref = layer(None)
  ref.init_cache((1, 20, E))
  want = [_decode(ref, x, seg, pos)] + [_decode(ref, s, None, None) for s in steps]
  plan = balance_plan(seg, 2, block=1)
  with jax.set_mesh(_mesh(2)):
    m = layer(ContextParallel(load_balance="document"))
    m.init_cache((1, 20, E))
    assert m.cache.order == "document"
    with pytest.raises(ValueError, match=r"segment_ids and positions expect the new tokens'"
                       r" values in decode under ContextParallel\(load_balance='document'\),"
                       r" got segment_ids given and positions None"):
      _decode(m, x, seg, None)
    got = [plan.undo(_decode(m, plan.apply(x), plan.apply(seg), plan.apply(pos)))]
    with pytest.raises(ValueError, match=r"got segment_ids None and positions None.*Pass both"):
      _decode(m, steps[0], None, None)
    got += [_decode(m, s, *ids) for s, ids in zip(steps, step_ids, strict=True)]
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_the_cache_keeps_the_order_and_sharding_it_was_made_for():
  with jax.set_mesh(_mesh(2)):
    orders = []
    for balance in (True, False, "document"):
      m = MultiHeadAttention(2, E, context_parallel=ContextParallel(load_balance=balance),
                             rngs=nnx.Rngs(0))
      m.init_cache((1, 8, E))
      orders.append(m.cache.order)
    assert orders == ["row", "none", "document"]
    m.context_parallel = None
    with pytest.raises(ValueError, match=r"decode expects the context_parallel the KV cache"
                       r" was allocated with, ContextParallel\(.*got None.*Call init_cache"):
      m(normal((1, 1, E)), decode=True)


def test_explain_says_what_a_decode_step_moves():
  with jax.set_mesh(_mesh(4)):
    q = jax.ShapeDtypeStruct((2, 1, 8, 16), jnp.float32)
    cache = jax.ShapeDtypeStruct((2, 4096, 2, 16), jnp.float32)
    text = explain(q, cache, cache, decode=True, context_parallel=ContextParallel(),
                   print_fn=None)
  # 4 x [2, 1, 8] lse + [2, 1, 8, 16] partial output, float32
  assert "1024 of 4096 cache slots" in text and "256 bytes" in text and "1024 bytes" in text
  assert "k/v (2, 1024, 2, 16)" in text  # the kernel serves one shard of the cache


@pytest.mark.slow
def test_greedy_sample_on_a_mesh_gives_the_same_tokens(tmp_path):
  """Two prompts of 7 and 4 tokens, one batch, on 4 devices (the prefill padded to 8 and
  load balanced, the cache sharded) as on one."""
  cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                    max_seq_len=32, sliding_window=3, global_every=2, attention_sinks=True)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  for b in model.layers:
    b.attn.sinks[...] = normal(b.attn.sinks.shape, 5)
  prompts = [np.array([5, 17, 3, 40, 22, 9, 31], np.int32), np.array([9, 1, 60, 2], np.int32)]
  want = sample.generate(model, prompts, 8)
  assert all(len(set(w.tolist())) > 2 for w in want)  # not a degenerate model
  # As `python -m train.sample --context_parallel 4` does, with the run's strategy.
  from train import config  # pylint: disable=import-outside-toplevel
  saved = config.to_dict(config.load(None, ["context_parallel.strategy=all_gather"]))
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with sample.on_mesh(model, str(tmp_path), 4, helpers.devices(4)) as cp:
    got = sample.generate(model, prompts, 8, context_parallel=cp)
    assert model.layers[0].attn.cache.keys[...].addressable_shards[0].data.shape[1] == 16 // 4
  assert cp == ContextParallel(strategy="all_gather")
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)


def test_a_decode_step_moves_the_same_bytes_at_any_cache_length():
  """The compiled step's collectives: an lse all-gather (4 x [B, 1, H] float32) and one
  all-reduce of the partial output ([B, 1, H, D] float32), at 64 and 1024 slots; and nothing
  that waits for the host (a refusal is recorded on the device, no collective skipped)."""
  moved = []
  for slots in (64, 1024):
    with jax.set_mesh(_mesh(4)):
      m = MultiHeadAttention(4, E, num_kv_heads=2, mask=Causal(),
                             context_parallel=ContextParallel(), rngs=nnx.Rngs(0))
      m.init_cache((2, slots, E))
      graphdef, state = nnx.split(m)
      # Compiled and lowered in this iteration, with this iteration's graphdef.
      step = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, decode=True))  # noqa: B023
      text = step.lower(state, normal((2, 1, E))).compile().as_text()
      moved.append({k: (v["count"], v["bytes"]) for k, v in aot.collectives(text).items()})
      assert aot.host_syncs(text) == {"conditional": 0, "while": 0, "host_callback": 0}
  n, b, h, d, f32 = 4, 2, 4, E // 4, 4
  want = {"all-gather": (1, n * b * h * f32), "all-reduce": (1, b * h * d * f32)}
  assert moved == [want, want]


def test_a_low_precision_cache_gives_the_same_prefill_on_a_mesh():
  """With a bfloat16 cache the new tokens attend to their keys as the cache holds them, on
  a mesh as on one device (the mesh used the float32 keys: 2.6e-3 apart)."""
  x = normal((1, 8, E))

  def prefill(cp):
    m = MultiHeadAttention(2, E, mask=Causal(), context_parallel=cp, rngs=nnx.Rngs(0))
    m.init_cache((1, 8, E), jnp.bfloat16)
    return np.asarray(_decode(m, x, None, None))

  want = prefill(None)
  with jax.set_mesh(_mesh(2)):
    got = prefill(ContextParallel(strategy="all_gather", load_balance=False))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
