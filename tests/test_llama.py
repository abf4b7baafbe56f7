"""models.llama: full-size shapes, causality and document isolation by gradient, RoPE per
document, loss masking, chunked layers, scan/remat equivalence, bfloat16, KV-cache decode,
config errors."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import flaxattn
from flaxattn.sharding import logical_to_spec
from helpers import mesh, normal
from models.llama import (
  Llama,
  LlamaConfig,
  cross_entropy,
  embedding_rows,
  flops_per_token,
  layer_masks,
  loss_fn,
  make_targets,
  num_params,
  token_losses,
  unroll_layers,
)
from train import mesh as train_mesh

B, T = 2, 16
# Small and fast: the reference backend compiles quickest; flaxattn's own tests check that
# every kernel agrees with it.
SMALL = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                    max_seq_len=T, attention_backend="reference")


@nnx.jit
def forward(model, tokens, segment_ids, positions):
  return model(tokens, segment_ids=segment_ids, positions=positions)


@nnx.jit
def loss_and_grads(model, batch):
  (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
  return loss, aux, nnx.to_pure_dict(grads)


def _packed(doc_lens_per_row, length=T):
  """Segment ids and positions `[len(rows), length]`: documents in order, padding after."""
  seg = np.zeros((len(doc_lens_per_row), length), np.int32)
  pos = np.zeros_like(seg)
  for b, lens in enumerate(doc_lens_per_row):
    start = 0
    for i, n in enumerate(lens):
      seg[b, start:start + n], pos[b, start:start + n] = i + 1, np.arange(n)
      start += n
  return seg, pos


def _tokens(seed, shape=(B, T), vocab=SMALL.vocab_size):
  return np.random.default_rng(seed).integers(1, vocab, shape).astype(np.int32)


def _batch(tokens, seg, pos):
  targets, weights = make_targets(tokens, seg)
  return dict(tokens=tokens, targets=targets, segment_ids=seg, positions=pos, weights=weights)


@pytest.fixture(scope="module")
def small():
  return Llama(SMALL, rngs=nnx.Rngs(0))


# -- full-size shapes, no memory ------------------------------------------------------------

LLAMA3_8B = LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        ffn_dim=14336, rope_theta=500000.0, tie_embeddings=False,
                        max_seq_len=8192)


def _expected_params(c: LlamaConfig) -> int:
  hd = c.dim // c.n_heads
  attn = c.dim * c.n_heads * hd * 2 + c.dim * c.n_kv_heads * hd * 2  # q, o; k, v
  layer = attn + 3 * c.dim * c.ffn_dim + 2 * c.dim  # + SwiGLU, two norms
  heads = 1 if c.tie_embeddings else 2
  return c.n_layers * layer + heads * c.vocab_size * c.dim + c.dim  # + final norm


def test_8b_shapes_and_parameter_count():
  want = _expected_params(LLAMA3_8B)
  assert abs(want - 8.03e9) < 0.01e9  # Llama 3 8B: 8,030,261,248
  assert num_params(LLAMA3_8B) == want
  # Tracing a scanned model is one layer's work; the parameter count is the same.
  cfg = dataclasses.replace(LLAMA3_8B, scan_layers=True)
  assert num_params(cfg) == want
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
  assert state["layers"]["blocks"][0]["attn"]["key"]["kernel"].shape == (32, 4096, 8, 128)
  tokens = jax.ShapeDtypeStruct((1, 2048), jnp.int32)
  logits = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)
  assert logits.shape == (1, 2048, 128256) and logits.dtype == jnp.float32


def test_flops_per_token_counts_matmuls_and_causal_attention():
  c, t = LLAMA3_8B, 8192
  matmul = _expected_params(c) - c.vocab_size * c.dim - c.dim * (2 * c.n_layers + 1)
  assert flops_per_token(c, t) == pytest.approx(6 * matmul + 12 * c.n_layers * c.dim * t / 2)
  # Chunked layers see chunk_size / 2 keys on average; every 4th layer stays global.
  chunked = dataclasses.replace(c, chunk_size=1024)
  assert flops_per_token(chunked, t) == pytest.approx(
      6 * matmul + 12 * c.dim * (8 * t / 2 + 24 * 1024 / 2))


# -- causality and document isolation, by gradient ------------------------------------------

def _dependence(model, seg, pos):
  """`dep[b, t, c, s]`: |d logits[b, t] . r / d x[c, s]| summed over features."""
  x = normal((B, T, model.config.dim), 1)
  r = normal((model.config.vocab_size,), 2)

  @nnx.jit
  def jacobian(model, x):
    def f(x):
      return model.from_embeddings(x, segment_ids=seg, positions=pos) @ r
    return jnp.abs(jax.jacrev(f)(x)).sum(-1)

  return np.asarray(jacobian(model, x))


def _allowed(seg, pos, chunk=None):
  """Which (b, t) may depend on which (c, s): itself, and earlier tokens of its document."""
  same_row = np.eye(B, dtype=bool)[:, None, :, None]
  same_doc = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
  earlier = pos[:, None, :] <= pos[:, :, None]
  if chunk is not None:
    earlier &= pos[:, None, :] // chunk == pos[:, :, None] // chunk
  itself = np.eye(T, dtype=bool)[None]
  within = (same_doc & earlier) | itself  # [B, T, S]
  return same_row & within[:, :, None, :]


@pytest.mark.parametrize("chunk", [None, 4])
def test_causal_and_document_isolation_by_gradient(small, chunk):
  # Row 0: documents of 5 and 8 tokens, 3 padding; row 1: 3 and 13. With chunk 4 and
  # global_every 4, both layers are chunked: a token sees only its chunk of its document.
  seg, pos = _packed([[5, 8], [3, 13]])
  if chunk is None:
    model = small
  else:
    model = Llama(dataclasses.replace(SMALL, chunk_size=chunk, global_every=4), rngs=nnx.Rngs(0))
    assert layer_masks(model.config) == (flaxattn.Chunked(chunk),) * 2
  dep = _dependence(model, seg, pos)
  allowed = _allowed(seg, pos, chunk)
  assert np.all(dep[~allowed] == 0.0), np.argwhere((dep > 0) & ~allowed)[:5]
  assert np.all(dep[allowed] > 1e-6), np.argwhere((dep <= 1e-6) & allowed)[:5]


def test_rope_restarts_per_document():
  """A document gives the same logits packed after another one as alone at the row start.

  RoPE scores depend only on position differences, so the chunked layers (chunks aligned to
  positions inside the document) are what shows whether positions restart.
  """
  cfg = dataclasses.replace(SMALL, chunk_size=4, global_every=2, attention_backend="auto")
  model = Llama(cfg, rngs=nnx.Rngs(3))
  seg, pos = _packed([[5, 7], [7]])
  tokens = _tokens(4)
  tokens[1, :7] = tokens[0, 5:12]
  logits = forward(model, tokens, seg, pos)
  np.testing.assert_allclose(logits[1, :7], logits[0, 5:12], atol=1e-5)
  # Positions numbered on from the first document (the row index) move the chunk bounds.
  logits = forward(model, tokens, seg, np.where(seg == 2, pos + 5, pos))
  assert np.abs(logits[1, :7] - logits[0, 5:12]).max() > 1e-3


# -- targets and loss -----------------------------------------------------------------------

def test_make_targets_exact():
  tokens = np.array([[10, 11, 12, 13, 14, 15, 16, 17],
                     [20, 21, 22, 23, 24, 25, 26, 27]], np.int32)
  seg = np.array([[1, 1, 1, 2, 2, 0, 0, 0],
                  [1, 1, 2, 2, 2, 2, 2, 2]], np.int32)
  want_targets = np.array([[11, 12, 13, 14, 15, 16, 17, 0],
                           [21, 22, 23, 24, 25, 26, 27, 0]], np.int32)
  want_weights = np.array([[1, 1, 0, 1, 0, 0, 0, 0],
                           [1, 0, 1, 1, 1, 1, 1, 0]], np.float32)
  targets, weights = make_targets(tokens, seg)
  assert isinstance(targets, np.ndarray) and targets.dtype == np.int32
  assert isinstance(weights, np.ndarray) and weights.dtype == np.float32
  np.testing.assert_array_equal(targets, want_targets)
  np.testing.assert_array_equal(weights, want_weights)
  targets, weights = make_targets(jnp.asarray(tokens), jnp.asarray(seg))
  assert isinstance(targets, jax.Array) and isinstance(weights, jax.Array)
  np.testing.assert_array_equal(targets, want_targets)
  np.testing.assert_array_equal(weights, want_weights)
  with pytest.raises(ValueError, match="one shape"):
    make_targets(tokens, seg[:, :-1])


def _loss(logits, batch):
  """Weighted mean cross entropy in numpy float64."""
  logits = np.asarray(logits, np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ce = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
  return (ce * batch["weights"]).sum() / batch["weights"].sum()


def test_loss_is_weighted_cross_entropy_and_ignores_padding(small):
  seg, pos = _packed([[5, 8], [3, 9]])
  batch = _batch(_tokens(5), seg, pos)
  loss, aux, _ = loss_and_grads(small, batch)
  w = batch["weights"]
  assert float(aux["tokens"]) == w.sum() == 5 + 8 + 3 + 9 - 4
  np.testing.assert_allclose(loss, _loss(forward(small, batch["tokens"], seg, pos), batch),
                             rtol=1e-5)

  padding = seg == 0
  changed = dict(batch, tokens=np.where(padding, _tokens(6), batch["tokens"]),
                 targets=np.where(w == 0, _tokens(7), batch["targets"]))
  assert (changed["tokens"] != batch["tokens"]).any()
  changed_loss, _, grads = loss_and_grads(small, changed)
  np.testing.assert_allclose(changed_loss, loss, rtol=1e-6)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def _weighted_mean(ce_BT, batch):
  return jnp.sum(ce_BT * batch["weights"]) / jnp.sum(batch["weights"])


@nnx.jit(static_argnums=2)
def _chunked_and_plain(model, batch, chunk_tokens):
  """(loss, grads) of the weighted mean of `token_losses` in chunks of `chunk_tokens`, and
  of the plain cross entropy of the model's logits."""
  def chunked(model):
    return _weighted_mean(token_losses(model, batch, chunk_tokens=chunk_tokens), batch)
  def plain(model):
    logits = model(batch["tokens"], segment_ids=batch["segment_ids"],
                   positions=batch["positions"])
    return _weighted_mean(cross_entropy(logits, batch["targets"]), batch)
  return [(loss, nnx.to_pure_dict(g)) for loss, g in
          (nnx.value_and_grad(chunked)(model), nnx.value_and_grad(plain)(model))]


@pytest.mark.parametrize("axes", [None, {"fsdp": 2, "tensor": 2, "context": 2},
                                  {"data": 2, "fsdp": 4}],
                         ids=["one_device", "vocab_and_sequence_sharded", "batch_not_over_fsdp"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "lm_head"])
def test_chunked_loss_and_gradient_equal_the_plain_cross_entropy(tie, axes):
  """Chunks of 2 tokens per device (the vocabulary over `tensor`, the sequence over
  `context`, the batch over `fsdp` on the mesh; or the batch of 2 over `data` alone, the
  head's `embed` over an `fsdp` whose devices share their tokens): the loss and every
  gradient within 1e-6 of the plain computation's, relative (gradients to their largest
  magnitude). The chunked loss runs per device and reduces the head's gradient itself."""
  cfg = dataclasses.replace(SMALL, tie_embeddings=tie)
  seg, pos = _packed([[5, 8], [3, 9]])
  batch = _batch(_tokens(8), seg, pos)
  if axes is None:
    results = _chunked_and_plain(Llama(cfg, rngs=nnx.Rngs(1)), batch, 2)
  else:
    m = mesh(axes)
    with jax.set_mesh(m), nnx.logical_axis_rules(train_mesh.rules(m, cfg)):
      model = nnx.jit(lambda: Llama(cfg, rngs=nnx.Rngs(1)))()
      sharding = str(model.head_EV().sharding)  # embed over fsdp, vocab over tensor
      assert all(a in sharding for a in ("fsdp", "tensor") if a in axes), sharding
      results = _chunked_and_plain(model, batch, 2)
  (loss, grads), (want_loss, want_grads) = results
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for path, want in nnx.traversals.flatten_mapping(want_grads).items():
    got = nnx.traversals.flatten_mapping(grads)[path]
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(np.asarray(got) / scale, np.asarray(want) / scale, atol=1e-6,
                               err_msg=str(path))


def test_embedding_lookup_partitions_without_full_rematerialization(capfd):
  """The training gradient on fsdp 2 x tensor 2 x context 2: XLA's partitioner prints no
  "Involuntary full rematerialization" while compiling it (it did for a lookup whose
  E-sharded rows were constrained straight to the batch sharding)."""
  cfg = dataclasses.replace(SMALL, tie_embeddings=False, max_seq_len=64)
  m = mesh({"fsdp": 2, "tensor": 2, "context": 2})
  seg, pos = _packed([[64]] * 4, length=64)
  batch = _batch(_tokens(10, (4, 64)), seg, pos)
  with jax.set_mesh(m), nnx.logical_axis_rules(train_mesh.rules(m, cfg)):
    model = nnx.jit(lambda: Llama(cfg, rngs=nnx.Rngs(0)))()
    grads = nnx.jit(lambda model: nnx.grad(lambda m: loss_fn(m, batch)[0])(model))(model)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(nnx.to_pure_dict(grads)))
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.parametrize("axes", [None, {"fsdp": 2, "tensor": 2, "context": 2},
                                  {"fsdp": 8}, {"data": 2, "fsdp": 4},
                                  {"context": 4, "fsdp": 2}, {"tensor": 4, "fsdp": 2},
                                  {"data": 2, "tensor": 2, "context": 2}],
                         ids=["one_device", "vocab_features_and_sequence", "fsdp",
                              "data_and_fsdp", "sequence_and_fsdp", "vocab_over_4",
                              "no_fsdp"])
def test_embedding_rows_and_their_gradient_equal_the_plain_lookup(axes):
  """`embedding_rows` per device (an all-to-all over fsdp, the vocab gathered, the table's
  gradient summed over the sequence's devices) gives the plain lookup's rows exactly and
  its table gradient within 1e-6 (float32, relative to the largest), with repeated tokens.
  On a mesh the gradient's program moves nothing of the whole table's size (the
  partitioner's own backward all-reduced the whole table)."""
  rng = np.random.default_rng(0)
  vocab, dim, b, t = 64, 16, 4, 16
  table = jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 12, (b, t)), jnp.int32)  # many repeats
  w = jnp.asarray(rng.normal(size=(b, t, dim)), jnp.float32)

  def plain(table, tokens):
    return jnp.take(table, tokens, axis=0)

  def ours(table, tokens):
    return embedding_rows(table, tokens, dtype=jnp.float32)

  def program(lookup):
    return jax.jit(lambda table: (lookup(table, tokens),
                                  jax.grad(lambda t: jnp.sum(lookup(t, tokens) * w))(table)))

  want_rows, want_grad = program(plain)(table)
  if axes is None:
    rows, grad = program(ours)(table)
  else:
    m = mesh(axes)
    cfg = dataclasses.replace(SMALL, vocab_size=vocab, dim=dim)
    with jax.set_mesh(m), nnx.logical_axis_rules(train_mesh.rules(m, cfg)):
      table = jax.device_put(table, NamedSharding(m, logical_to_spec(("vocab", "embed"),
                                                                     table.shape)))
      rows, grad = program(ours)(table)
      # As the model runs it: rows in bfloat16.
      gradient = jax.jit(jax.grad(lambda t: jnp.sum(
          embedding_rows(t, tokens, dtype=jnp.bfloat16) * w.astype(jnp.bfloat16))))
      text = gradient.lower(table).compile().as_text() or ""
    moved = [line for line in text.splitlines() if f"[{vocab},{dim}]" in line
             and re.search(r"all-reduce|all-gather|reduce-scatter", line)]
    assert not moved, moved
  np.testing.assert_array_equal(rows, want_rows)
  scale = float(np.abs(want_grad).max())
  np.testing.assert_allclose(np.asarray(grad) / scale, np.asarray(want_grad) / scale,
                             atol=1e-6)


def test_chunked_loss_never_holds_the_whole_logits():
  """The gradient's program has float32 arrays of one chunk's logits, none `[B, T, V]`."""
  model = Llama(dataclasses.replace(SMALL, vocab_size=96), rngs=nnx.Rngs(0))
  seg, pos = _packed([[16], [16]])
  batch = _batch(_tokens(9), seg, pos)
  text = str(jax.make_jaxpr(lambda m: nnx.grad(
      lambda m: _weighted_mean(token_losses(m, batch, chunk_tokens=8), batch))(m))(model))
  assert "f32[2,4,96]" in text  # 8 tokens: 4 of each row
  assert f"f32[{B},{T},96]" not in text
  with pytest.raises(ValueError, match=r"chunk_tokens=\.\.\.\) expects a positive int, got 0"):
    token_losses(model, batch, chunk_tokens=0)


# -- layer pattern, scan, remat -------------------------------------------------------------

def test_chunked_layer_pattern_in_both_layouts():
  cfg = dataclasses.replace(SMALL, n_layers=8, chunk_size=4, global_every=4)
  c4, causal = flaxattn.Chunked(4), flaxattn.Causal()
  assert layer_masks(cfg) == (c4, c4, c4, causal) * 2
  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  assert tuple(b.attn.mask for b in model.layers) == layer_masks(cfg)
  scanned = nnx.eval_shape(lambda: Llama(dataclasses.replace(cfg, scan_layers=True),
                                         rngs=nnx.Rngs(0)))
  assert tuple(b.attn.mask for b in scanned.layers.blocks) == (c4, c4, c4, causal)
  assert scanned.layers.blocks[0].mlp.w1.kernel.shape == (2, 32, 64)  # 2 groups of 4
  assert layer_masks(SMALL) == (causal, causal)


def _to_scanned(model: Llama, scanned: Llama) -> None:
  """Copies `model`'s per-layer weights into `scanned` (layer i = group i // p, block i % p)."""
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  layers = params.pop("layers")
  p, n = model.config.period, model.config.n_layers
  params["layers"] = {"blocks": {
      j: jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in range(j, n, p)])
      for j in range(p)}}
  nnx.update(scanned, params)


def test_scan_layers_same_logits_as_unrolled():
  cfg = dataclasses.replace(SMALL, n_layers=4, chunk_size=4, global_every=2)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  scanned = Llama(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(1))
  _to_scanned(model, scanned)
  seg, pos = _packed([[6, 10], [16]])
  tokens = _tokens(8)
  np.testing.assert_allclose(forward(scanned, tokens, seg, pos), forward(model, tokens, seg, pos),
                             atol=1e-5)


@nnx.jit(static_argnames="decode")
def _logits(model, tokens, decode=False):
  return model(tokens, decode=decode)


# Every layer kind: windowed layers with sinks and soft-capped scores (global every 2nd), and
# chunked layers; windows and chunks shorter than the sequence.
DECODE_CONFIGS = [
    dataclasses.replace(SMALL, n_layers=4, sliding_window=3, global_every=2,
                        attention_sinks=True, logit_soft_cap=2.0),
    dataclasses.replace(SMALL, chunk_size=4, global_every=2, remat="full"),
]


@pytest.mark.parametrize("cfg", DECODE_CONFIGS, ids=["window-sinks-softcap", "chunked"])
def test_decode_prefill_then_token_by_token_matches_full_forward(cfg):
  model = Llama(cfg, rngs=nnx.Rngs(0))
  # Sinks start at zero; random ones make the test see them.
  for b in model.layers:
    if b.attn.sinks is not None:
      b.attn.sinks[...] = normal(b.attn.sinks.shape, 5)
  tokens = _tokens(3, (2, T))
  full = _logits(model, tokens)
  model.init_cache(2, T)
  steps = [_logits(model, tokens[:, :5], decode=True)]
  steps += [_logits(model, tokens[:, t:t + 1], decode=True) for t in range(5, T)]
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def test_unroll_layers_keeps_logits_and_decodes():
  cfg = dataclasses.replace(SMALL, n_layers=4, sliding_window=3, global_every=2,
                            scan_layers=True)
  scanned = Llama(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"scan_layers=False, got scan_layers=True.*unroll_layers"):
    scanned.init_cache(1, T)
  model = unroll_layers(scanned)
  assert not model.config.scan_layers and unroll_layers(model) is model
  tokens = _tokens(4, (1, T))
  np.testing.assert_allclose(_logits(model, tokens), _logits(scanned, tokens), atol=1e-5)
  model.init_cache(1, T)
  np.testing.assert_allclose(_logits(model, tokens, decode=True), _logits(scanned, tokens),
                             atol=1e-5)


def test_init_cache_errors(small):
  with pytest.raises(ValueError, match=r"max_length=.*at most max_seq_len=16, got 17"):
    small.init_cache(1, T + 1)
  with pytest.raises(ValueError, match=r"batch_size=.*positive int, got 0"):
    small.init_cache(0, T)


def test_remat_policies_same_loss_and_grads(small):
  seg, pos = _packed([[6, 7], [16]])
  batch = _batch(_tokens(9), seg, pos)
  want_loss, _, want_grads = loss_and_grads(small, batch)
  for remat in ("full", "dots", "offload"):
    model = Llama(dataclasses.replace(SMALL, remat=remat), rngs=nnx.Rngs(0))  # same weights
    loss, _, grads = loss_and_grads(model, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 grads, want_grads)
  # Scanned layers: the layer inputs the scan stacks are what "offload" moves to the host.
  scanned = {remat: Llama(dataclasses.replace(SMALL, remat=remat, scan_layers=True),
                          rngs=nnx.Rngs(0)) for remat in ("none", "offload")}
  (want_loss, _, want_grads), (loss, _, grads) = (loss_and_grads(m, batch)
                                                  for m in scanned.values())
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               grads, want_grads)


# -- dtype, sharding names, errors ----------------------------------------------------------

def test_bfloat16_compute_close_to_float32(small):
  bf16 = Llama(dataclasses.replace(SMALL, dtype="bfloat16"), rngs=nnx.Rngs(0))
  params = jax.tree.leaves(nnx.state(bf16, nnx.Param))
  assert all(p.dtype == jnp.float32 for p in params)
  seg, pos = _packed([[5, 8], [16]])
  batch = _batch(_tokens(10), seg, pos)
  want = forward(small, batch["tokens"], seg, pos)
  got = forward(bf16, batch["tokens"], seg, pos)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=0.05 * float(jnp.abs(want).max()))
  np.testing.assert_allclose(_loss(got, batch), _loss(want, batch), rtol=1e-2)


@pytest.mark.parametrize("tie, scan", [(True, False), (False, True)])
def test_every_parameter_has_logical_axis_names(tie, scan):
  cfg = dataclasses.replace(SMALL, tie_embeddings=tie, scan_layers=scan)
  model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  names = {"/".join(map(str, path)): (v.shape, v.get_metadata().get("out_sharding"))
           for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  for path, (shape, axes) in names.items():
    assert axes is not None and len(axes) == len(shape), (path, shape, axes)
  stack = ("layers",) if scan else ()
  layer = "layers/blocks/0" if scan else "layers/1"
  assert names["embed/embedding"][1] == ("vocab", "embed")
  assert names[f"{layer}/mlp/w1/kernel"][1] == stack + ("embed", "mlp")
  assert names[f"{layer}/mlp/w2/kernel"][1] == stack + ("mlp", "embed")
  assert names[f"{layer}/attn_norm/scale"][1] == stack + ("embed",)
  assert names["norm/scale"][1] == ("embed",)
  assert ("lm_head/kernel" in names) == (not tie)
  if not tie:
    assert names["lm_head/kernel"][1] == ("embed", "vocab")


@pytest.mark.parametrize("change, match", [
    (dict(n_heads=8, n_kv_heads=3), r"n_heads=.*multiple of n_kv_heads \(3\), got 8"),
    (dict(dim=30), r"dim=.*multiple of n_heads \(4\), got 30"),
    (dict(dim=36, n_heads=12, n_kv_heads=4), r"dim=.*even head_dim.*= 3"),
    (dict(remat="some"), r"remat=.*got 'some'"),
    (dict(dtype="float16"), r"dtype=.*got 'float16'"),
    (dict(n_layers=0), r"n_layers=.*positive int, got 0"),
    (dict(chunk_size=0), r"chunk_size=.*positive int, got 0"),
    (dict(scan_layers=True, chunk_size=4, global_every=4, n_layers=6),
     r"n_layers=.*multiple of global_every \(4\).*got 6"),
    (dict(rope_theta=float("nan")), r"rope_theta=.*number > 1 \(finite\), got nan"),
    (dict(rope_theta=True), r"rope_theta=.*got True \(bool\)"),
    (dict(norm_eps=float("inf")), r"norm_eps=.*number > 0 \(finite\), got inf"),
    (dict(logit_soft_cap=float("inf")), r"logit_soft_cap=.*positive number at most 1e\+06"),
    (dict(logit_soft_cap=1e39), r"logit_soft_cap=.*positive number at most 1e\+06"),
    (dict(norm_eps=10**400), r"norm_eps=.*number > 0 \(finite\), got 1000"),
])
def test_bad_config_raises_naming_field_and_value(change, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(SMALL, **change)


def test_config_numbers_are_stored_as_floats():
  """A numpy or 0-d array value is checked and kept as a float: the config stays hashable
  (it is a static argument) and equal to the one made with floats."""
  cfg = dataclasses.replace(SMALL, norm_eps=np.array(1e-5), rope_theta=jnp.array(1e4),
                            logit_soft_cap=np.float32(30.0))
  assert hash(cfg) == hash(dataclasses.replace(SMALL, norm_eps=1e-5, rope_theta=1e4,
                                               logit_soft_cap=30.0))
  assert type(cfg.norm_eps) is float and type(cfg.rope_theta) is float


def test_call_errors(small):
  with pytest.raises(ValueError, match=r"max_seq_len=16.*got a sequence of 17"):
    small(jnp.zeros((1, T + 1), jnp.int32))
  with pytest.raises(ValueError, match=r"tokens expects integer ids of shape \[batch, seq\]"):
    small(jnp.zeros((T,), jnp.int32))
  with pytest.raises(ValueError, match=r"integer ids .*got \(1, 16\) float32"):
    small(jnp.zeros((1, T), jnp.float32))
