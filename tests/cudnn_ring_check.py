"""cuDNN as the ring's per-step kernel (and per gathered shard under all_gather), on N
simulated CPU devices with the CPU model of cuDNN (`cudnn_model.py`), which test_cudnn.py
runs in process. `run` returns the largest errors of the loss (of out and lse) and of dq,
dk, dv against the reference, relative to its largest magnitude. Cases named "only-cudnn"
run with the blockwise fallbacks poisoned with NaN, so they pass only if every step really
ran cuDNN."""

import jax
import jax.numpy as jnp
import numpy as np

import flaxattn
import helpers
from flaxattn import blockwise, cudnn
from flaxattn.context_parallel import context_parallel_attention
from flaxattn.layout import resolve
from flaxattn.reference import reference_attention
from helpers import random_packing, rel_error


def poison(monkeypatch):
  """Blockwise fallbacks that return NaN, until `monkeypatch` undoes them."""
  def nan(x):
    return jnp.full_like(x, jnp.nan)
  def forward(q, k, v, layout, **kw):
    return (nan(q), jnp.full(q.shape[:3], jnp.nan, jnp.float32))
  def backward(q, k, v, layout, out, lse, dout, dlse, **kw):
    return (nan(q), nan(k), nan(v), [])  # and no score mod's operands' gradients
  monkeypatch.setattr(blockwise, "forward", forward)
  monkeypatch.setattr(blockwise, "backward", backward)
  monkeypatch.setattr(blockwise.BlockwiseStep, "forward",
                      lambda self, step, q, k, v, layout: forward(q, k, v, layout))
  monkeypatch.setattr(blockwise.BlockwiseStep, "backward",
                      lambda self, step, q, k, v, layout, *a: backward(q, k, v, layout, *a)[:3])


def _loss(out, lse):
  finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
  out = out.astype(jnp.float32)
  return jnp.sum(out * jnp.cos(out)) + 0.5 * jnp.sum(jnp.sin(finite))


def run(n, mask, lb, layout_kind, hkv, strategy) -> list[float]:
  mesh = helpers.mesh({"context": n})
  b, t, h, d = 2, 64 * n, 4, 16
  rng = np.random.default_rng(n)
  q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)
             for s in ((b, t, h, d), (b, t, hkv, d), (b, t, hkv, d)))
  seg = pos = None
  if layout_kind == "packed":  # documents of random lengths, crossing chunk and shard edges
    seg, pos = random_packing(n, b, t, max_docs=2 * n, pad_tail=3, cp=n)
  elif layout_kind == "aligned":  # four documents per chunk: cuDNN serves every piece
    per = t // (8 * n)
    seg = np.repeat(np.arange(1, 8 * n + 1), per)[None].repeat(b, 0).astype(np.int32)
    pos = np.tile(np.arange(per), 8 * n)[None].repeat(b, 0).astype(np.int32)
  cp = flaxattn.ContextParallel(strategy=strategy, load_balance=lb)
  perm = (lambda x: flaxattn.load_balance(x, n)) if lb else (lambda x: x)
  index = perm(np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)))
  seg_p, pos_p = (None if x is None else perm(x) for x in (seg, pos))
  q, k, v = perm(q), perm(k), perm(v)

  def reference(q, k, v):
    lay = resolve(q.shape, k.shape, seg_p, index if pos_p is None else pos_p)
    return _loss(*reference_attention(q, k, v, lay, mask=mask, scale=0.25, return_lse=True))

  def ring(q, k, v):
    lay = resolve(q.shape, k.shape, seg_p, pos_p, context_parallel=cp)
    return _loss(*context_parallel_attention(q, k, v, lay, mask=mask, scale=0.25, cp=cp,
                                             kernel=cudnn.Cudnn(), return_lse=True))

  want = jax.jit(jax.value_and_grad(reference, (0, 1, 2)))(q, k, v)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(ring, (0, 1, 2)))(q, k, v)
  return [rel_error(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]


CAUSAL, FULL = flaxattn.Causal(), flaxattn.Full()
# (mask, load balancing, layout, KV heads of 4 query heads, strategy): exact with the real
# fallbacks on packings whose documents cross chunk and shard edges, then every step (every
# gathered shard) on cuDNN.
CASES = [(CAUSAL, True, "packed", 2, "ring"), (FULL, False, "packed", 1, "ring"),
         (CAUSAL, False, "packed", 2, "all_gather")]
ONLY_CUDNN = [(CAUSAL, True, "default", 2, "ring"), (CAUSAL, True, "aligned", 1, "ring"),
              (CAUSAL, False, "aligned", 2, "ring"), (FULL, True, "aligned", 2, "ring"),
              (CAUSAL, True, "aligned", 2, "all_gather"),
              (CAUSAL, False, "default", 1, "all_gather")]


def cases(n: int) -> list[tuple[str, bool, tuple]]:
  """(name, only cuDNN, `run`'s arguments after n) of each case on n devices."""
  # Unrolled steps compile slowly, so the longer rings run fewer cases: at cp=4 every
  # cuDNN-only case and the load-balanced ring with the real fallbacks (the other two
  # fallback cases run at cp=2: the same code with fewer steps); at cp=8 one cuDNN-only
  # case of each strategy.
  runs = {2: ((False, CASES), (True, ONLY_CUDNN)),
          4: ((False, CASES[:1]), (True, ONLY_CUDNN)),
          8: ((True, [ONLY_CUDNN[1], ONLY_CUDNN[4]]),)}[n]
  return [(f"{'only-cudnn-' if only_cudnn else ''}{strategy}-"
           f"{'causal' if mask == CAUSAL else 'full'}-{'lb' if lb else 'nolb'}-{kind}-hkv{hkv}",
           only_cudnn, (mask, lb, kind, hkv, strategy))
          for only_cudnn, group in runs for mask, lb, kind, hkv, strategy in group]
