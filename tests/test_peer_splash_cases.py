"""The kinds of case JAX's own splash kernel tests draw (jax's
tests/pallas/tpu_splash_attention_kernel_test.py, jax 0.10: hypothesis strategies over masks,
head counts, segment ids, soft caps and sequence lengths, checked forward with the lse and
backward), each written here once with flaxattn's masks and run on blockwise and on splash
(Pallas interpret mode) against the reference: out, lse and the gradients of q, k and v.

How their masks read here (their masks are on token indices; here segment ids only, so
positions are the index too):
  full, causal, chunked causal         Full(), Causal(), Chunked(size)
  local, window sizes (left, right)    Window(left, right, offset), None for a side without
    and an offset, OR-ed with the        a bound; OR-ed with Window(0, 0), the diagonal,
    diagonal so no row is empty          where the window may miss it
  a random (numpy) mask, first key     MaskMod reading the array as an operand (a traced
    always allowed; the same as a        array: the dynamic-mask case is the same case)
    dynamic (runtime) mask
  a different mask per head            MaskMod reading the head
  masks combined with OR / AND         |, &
  MHA, MQA, GQA (1, 1) .. (8, 4)       H query heads on Hkv key/value heads
  segment ids                          packed documents (segment_ids)
  soft cap                             logit_soft_cap
  q and kv of different lengths        blockwise only: splash serves self attention
Shapes are small (T = 256: 2 x 2 splash blocks of 128; documents cross block edges).
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import pytest

import flaxattn
from flaxattn import blockwise, registry, splash
from helpers import TOL, grads_of, qkv, random_packing

W = flaxattn.Window
T = 256


def _random_mask(seed: int, t: int, s: int, sparsity: float = 0.5):
  """A random `[t, s]` mask with the first key always allowed, as a MaskMod operand."""
  allowed = np.random.default_rng(seed).random((t, s)) >= sparsity
  allowed[:, 0] = True
  return flaxattn.MaskMod(lambda b, h, q, k, m: m[q, k], jnp.asarray(allowed))


def _per_head():
  """Causal on even heads, a window of 8 on each side on odd ones."""
  return flaxattn.MaskMod(lambda b, h, q, k: jnp.where(h % 2 == 0, k <= q, abs(q - k) <= 8))


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  mask: Callable[[], flaxattn.Mask]
  heads: tuple[int, int] = (2, 1)  # (H, Hkv)
  segments: bool = False
  soft_cap: float | None = None
  kv_len: int = T


CASES = [
    Case("full-mha", flaxattn.Full, (2, 2)),
    Case("causal-mqa-segments", flaxattn.Causal, (4, 1), segments=True),
    Case("causal-gqa-soft-cap", flaxattn.Causal, (6, 2), soft_cap=20.0),
    Case("chunked-segments", lambda: flaxattn.Chunked(64), segments=True),
    Case("window-two-sided-segments-soft-cap", lambda: W(64, 32), segments=True, soft_cap=8.0),
    Case("window-left-only", lambda: W(40, None)),
    Case("window-right-only-segments", lambda: W(None, 24), segments=True),
    Case("window-shifted-or-diagonal", lambda: W(16, 16, offset=100) | W(0, 0), (2, 2)),
    Case("window-shifted-back-or-diagonal-segments", lambda: W(10, 5, offset=-40) | W(0, 0),
         segments=True),
    Case("random-mask-segments-soft-cap", lambda: _random_mask(1, T, T, 0.3), (4, 1),
         segments=True, soft_cap=8.0),
    Case("mask-per-head", _per_head, (4, 2)),
    Case("causal-and-window", lambda: flaxattn.Causal() & W(32, 32), (8, 4), segments=True),
    Case("causal-or-shifted-window", lambda: flaxattn.Causal() | W(8, 8, offset=100)),
    Case("causal-rectangular", flaxattn.Causal, (4, 1), kv_len=2 * T),
]
KERNELS = (blockwise.Blockwise(block_q=64, block_kv=64), splash.Splash(block_q=128, block_kv=128))


def _run(case: Case, backend, q, k, v, seg):
  def attend(q, k, v):
    return flaxattn.attention(q, k, v, mask=case.mask(), segment_ids=seg, kv_segment_ids=seg,
                              logit_soft_cap=case.soft_cap, scale=0.3, backend=backend,
                              return_lse=True)
  return grads_of(attend)(q, k, v)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_peer_case_matches_reference(case):
  """Blockwise and splash against the reference (splash declines q and kv of different
  lengths, saying why)."""
  h, hkv = case.heads
  q, k, v = qkv(7, 1, T, case.kv_len, h, hkv, 32, jnp.float32)
  seg = jnp.asarray(random_packing(7, 1, T, max_docs=4)[0]) if case.segments else None
  want_g, (want_out, want_lse) = _run(case, "reference", q, k, v, seg)
  for kernel in KERNELS:
    if kernel.name == "splash" and case.kv_len != T:
      call = registry.Call(platform="tpu", q_shape=q.shape, kv_shape=k.shape, dtype="float32",
                           mask=case.mask(), has_segment_ids=False, has_positions=False,
                           return_lse=True)
      assert "self attention only" in (kernel.unsupported_reason(call) or "")
      continue
    got_g, (got_out, got_lse) = _run(case, kernel, q, k, v, seg)
    tol = dict(TOL[jnp.float32], err_msg=kernel.name)
    np.testing.assert_allclose(got_out, want_out, **tol)
    np.testing.assert_array_equal(np.isinf(got_lse), np.isinf(want_lse))
    np.testing.assert_allclose(np.where(np.isinf(got_lse), 0, got_lse),
                               np.where(np.isinf(want_lse), 0, want_lse), **tol)
    for name, got, want in zip("qkv", got_g, want_g, strict=True):
      scale = max(1.0, float(jnp.abs(want).max()))
      np.testing.assert_allclose(got / scale, want / scale,
                                 **dict(tol, err_msg=f"{kernel.name} d{name}"))


def test_every_case_kind_is_listed():
  """The case kinds the docstring names, each present (a case an edit swallows fails here)."""
  names = " ".join(c.name for c in CASES)
  for kind in ("full", "causal", "chunked", "window-two-sided", "window-left-only",
               "window-right-only", "or-diagonal", "random-mask", "per-head", "and-window",
               "or-shifted", "rectangular", "mqa", "gqa", "mha", "segments", "soft-cap"):
    assert kind in names, kind
  assert len({c.name for c in CASES}) == len(CASES)
