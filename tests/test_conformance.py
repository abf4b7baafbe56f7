"""Every registered kernel, one set of cases: a kernel gets them all by registering.

Each kernel is asked about each case on its home platform (the first row of
`registry.BACKENDS` that holds it; cpu for a kernel in none): where it accepts, it runs
here (Pallas kernels in interpret mode, cuDNN through the CPU model of cuDNN) and must equal
attention written out from the definitions (`helpers.dense_oracle`) in out, lse and the
gradients of q, k, v and the sinks; where it declines, its reason must be a sentence and
the automatic choice of that platform must still serve the case. A kernel that takes only
some dtypes gets the other cases in its own by subclassing `KernelConformance`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxattn
from flaxattn import registry
from flaxattn.attention import apply_sinks
from flaxattn.cudnn import Cudnn
from helpers import TOL, as_layout, dense_oracle, grads_of, loss, normal, qkv, random_packing
from mod_gallery import PATTERNS

SCALE = 0.3
T = 256  # two of splash's 128-token blocks


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  mask: flaxattn.Mask = flaxattn.Causal()
  hkv: int = 2  # of 4 query heads
  packed: bool = True  # random documents with padding, else one document per row
  dv: int = 16  # of D = 16
  soft_cap: float | None = None
  sinks: bool = False
  dtype: object = jnp.float32
  empty_row: bool = False  # row 1 all padding: zeros, lse -inf, zero gradients
  # Decode-shaped: queries at these slots of the packed keys (their ids and positions), as
  # new tokens against a cache; slot 249 is padding (an empty row). None: self attention.
  query_slots: tuple[int, ...] | None = None


CASES = [
    Case("causal-packed-gqa"),
    Case("window-and-causal-mqa", flaxattn.Local(48) & flaxattn.Causal(), hkv=1),
    Case("chunked", flaxattn.Chunked(64)),
    Case("full-one-document", flaxattn.Full(), hkv=4, packed=False),
    Case("soft-cap-sinks-dv", soft_cap=2.0, sinks=True, dv=32),
    Case("bfloat16-empty-row", dtype=jnp.bfloat16, empty_row=True),
    Case("decode-three-queries-gqa", query_slots=(100, 180, 249)),
    Case("decode-one-query-window-soft-cap-dv-bfloat16", flaxattn.Local(48), hkv=1, dv=32,
         soft_cap=2.0, sinks=True, dtype=jnp.bfloat16, query_slots=(200,)),
]


def home(name: str) -> str:
  """The platform whose row of `registry.BACKENDS` first holds the kernel (cpu if none)."""
  return next((p for p in registry.PLATFORMS if name in registry.order(p)), "cpu")


def _data(case: Case, batch: int = 2):
  q, k, v = qkv(3, batch, T, T, 4, case.hkv, 16, case.dtype)
  if case.dv != 16:
    v = normal((batch, T, case.hkv, case.dv), 4, case.dtype)
  seg, pos = (random_packing(5, batch, T, max_docs=5, pad_tail=7) if case.packed
              else (None, None))
  if case.empty_row:
    seg = np.ones((2, T), np.int32) if seg is None else seg.copy()
    seg[1] = 0
  if case.query_slots is not None:
    assert seg is not None and pos is not None  # decode cases are packed
    slots = list(case.query_slots)
    q = normal((batch, len(slots), 4, 16), 7, case.dtype)
    return q, k, v, normal((4,), 6), as_layout(seg[:, slots], pos[:, slots], seg, pos)
  return q, k, v, normal((4,), 6), as_layout(seg, pos)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("name", registry.names())
def test_kernel_conforms(name, case, fake_cudnn):
  check_conforms(name, case)


class KernelConformance:
  """The other cases in the one dtype a kernel takes: a kernel's test file subclasses this
  as `Test...`, setting `name` and `dtype` (`test_kernel_conforms` runs the cases already
  in it), and `batch` rows (1 where a row costs much, as in an interpreter)."""

  name: str = ""
  dtype: object = jnp.bfloat16
  batch: int = 2

  def pytest_generate_tests(self, metafunc):
    cases = [dataclasses.replace(c, dtype=self.dtype) for c in CASES if c.dtype != self.dtype]
    metafunc.parametrize("case", cases, ids=lambda c: c.name)

  def test_conforms_in_its_dtype(self, case, fake_cudnn):
    check_conforms(self.name, case, 2 if case.empty_row else self.batch)  # it pads row 1


def _here(kernel: registry.Kernel, call: registry.Call) -> registry.Kernel:
  """`kernel` as it runs on this host (interpret mode for a Pallas kernel off its platform);
  skips where this host cannot run it so (mosaic_gpu under jax 0.10's GPU interpreter)."""
  here = kernel.on("cpu")
  if kernel.for_tests_on("cpu"):
    reason = here.unsupported_reason(dataclasses.replace(call, platform="cpu"))
    if reason is not None:
      pytest.skip(f"{kernel.name} cannot run on this host: {reason}")
  return here


def check_conforms(name: str, case: Case, batch: int = 2):
  """Kernel `name` on `case` (`batch` rows) against `dense_oracle` on its home platform,
  or its reason."""
  q, k, v, sinks, layout = _data(case, batch)
  call = dataclasses.replace(
      registry.Call.of(q, k, v, case.mask, layout, True, has_sinks=case.sinks,
                       soft_cap=case.soft_cap), platform=home(name))
  kernel = registry.get(name)
  reason = kernel.unsupported_reason(call)
  if reason is not None:  # declines: says why, and its platform still serves the case
    assert reason.endswith(".") and len(reason.split()) >= 5, reason
    assert registry.select("auto", call).name != name
    return
  kernel = _here(kernel, call)
  extra = {} if case.soft_cap is None else {"soft_cap": case.soft_cap}

  def attend(q, k, v, s):
    out, lse = kernel(q, k, v, layout, mask=case.mask, scale=SCALE, return_lse=True, **extra)
    return apply_sinks(out, lse, s) if case.sinks else (out, lse)

  def oracle(q, k, v, s):
    return dense_oracle(q, k, v, layout, case.mask, SCALE, s if case.sinks else None,
                        case.soft_cap)

  want_g, (want_o, want_l) = grads_of(oracle, 4)(q, k, v, sinks)
  got_g, (got_o, got_l) = grads_of(attend, 4)(q, k, v, sinks)
  tol = TOL[case.dtype]
  np.testing.assert_allclose(got_o, want_o, **tol)
  np.testing.assert_array_equal(np.isinf(got_l), np.isinf(want_l))
  np.testing.assert_allclose(np.where(np.isinf(got_l), 0, got_l),
                             np.where(np.isinf(want_l), 0, want_l), **tol)
  for arg, got, want in zip(("dq", "dk", "dv", "dsinks"), got_g, want_g, strict=True):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), arg
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got / scale, want / scale, err_msg=arg, **tol)
  if case.empty_row:
    np.testing.assert_array_equal(got_o[1], 0.0)
    assert np.isneginf(got_l[1]).all()


@pytest.mark.parametrize("mask", [flaxattn.Local(5), flaxattn.Chunked(8)], ids=str)
@pytest.mark.parametrize("name", registry.names())
def test_positions_at_the_int32_limits_mask_as_anywhere(name, mask, fake_cudnn):
  """A document whose positions start at -2**31, or end at 2**31 - 1, is masked as the same
  document at positions from 0: the window's and the chunk's arithmetic does not wrap."""
  q, k, v = qkv(13, 1, T, T, 4, 2, 16, jnp.bfloat16)
  queries = slice(0, 3) if name == "split_k" else slice(None)  # a decode step's
  q = q[:, queries]
  seg = np.ones((1, T), np.int32)

  def layout(first: int):
    pos = (np.arange(T) + first).astype(np.int32)[None]
    return as_layout(seg[:, queries], pos[:, queries], seg, pos)
  want = dense_oracle(q, k, v, layout(0), mask, SCALE)[0]
  call = dataclasses.replace(registry.Call.of(q, k, v, mask, layout(0), False),
                             platform=home(name))
  # cuDNN: one document, so two THD slots keep the row within its temporaries' budget.
  kernel = Cudnn(max_segments=2) if name == "cudnn" else registry.get(name)
  reason = kernel.unsupported_reason(call)
  if reason is not None:  # cuDNN has no chunked mask; an interpreter may be too old here
    assert reason.endswith("."), reason
    assert isinstance(mask, flaxattn.Chunked), reason
    return
  kernel = _here(kernel, call)
  for first in (np.iinfo(np.int32).min, np.iinfo(np.int32).max + 1 - T):
    got = kernel(q, k, v, layout(first), mask=mask, scale=SCALE, return_lse=False)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               err_msg=f"positions from {first}", **TOL[jnp.bfloat16])


# Decode-shaped calls go to split_k (and blockwise where it declines): the other kernels
# take the gallery as self attention, which costs CI less in interpret mode.
DECODE_KERNELS = ("split_k", "blockwise")


@pytest.mark.parametrize("name, decode", [(n, d) for n in registry.names() for d in (False, True)
                                          if not d or n in DECODE_KERNELS],
                         ids=lambda x: {False: "self", True: "decode"}.get(x, x))
@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_kernel_runs_the_gallery(name, pattern, decode, fake_cudnn):
  """The gallery's programmable masks and scores (mod_gallery.py) on packed rows, as self
  attention and, for the decode kernels, as a decode step (three queries at cache slots,
  their indices the slots'):
  out, lse and the gradients of q, k, v and of the score mod's float operands against
  attention written out from the definitions; a kernel that declines says why, and its
  platform still serves the case."""
  q, k, v = qkv(11, 2, T, T, 4, 2, 16)
  mask, score_mod = pattern.make(2, 4, T, 3)
  seg, pos = random_packing(5, 2, T, max_docs=4, pad_tail=7) if pattern.packed else (None, None)
  if seg is None:
    seg, pos = np.ones((2, T), np.int32), np.arange(T, dtype=np.int32)[None].repeat(2, 0)
  layout = as_layout(seg, pos)
  if decode:
    slots = np.array([100, 180, 248])  # 248 is padding (an empty row) in every row
    q = q[:, slots]
    layout = dataclasses.replace(as_layout(seg[:, slots], pos[:, slots], seg, pos),
                                 q_index=jnp.asarray(np.broadcast_to(slots, (2, 3))))
  call = dataclasses.replace(registry.Call.of(q, k, v, mask, layout, True, score_mod=score_mod),
                             platform=home(name))
  kernel = registry.get(name)
  reason = kernel.unsupported_reason(call)
  if reason is not None:
    assert reason.endswith(".") and len(reason.split()) >= 5, reason
    assert registry.select("auto", call).name != name
    return
  kernel = _here(kernel, call)
  extra = {} if score_mod is None else {"score_mod": score_mod}

  def attend(q, k, v, mod):
    options = {} if mod is None else {"score_mod": mod}
    return kernel(q, k, v, layout, mask=mask, scale=SCALE, return_lse=True, **options)

  def oracle(q, k, v, mod):
    return dense_oracle(q, k, v, layout, mask, SCALE, score_mod=mod)

  def gradients(attend):
    def f(q, k, v, mod):
      out, lse = attend(q, k, v, mod)
      return loss(out.astype(jnp.float32), lse), (out, lse)
    return jax.jit(jax.grad(f, (0, 1, 2, 3), has_aux=True))(q, k, v, extra.get("score_mod"))

  want_g, (want_o, want_l) = gradients(oracle)
  got_g, (got_o, got_l) = gradients(attend)
  tol = TOL[jnp.float32]
  np.testing.assert_allclose(got_o, want_o, **tol)
  np.testing.assert_array_equal(np.isinf(got_l), np.isinf(want_l))
  np.testing.assert_allclose(np.where(np.isinf(got_l), 0, got_l),
                             np.where(np.isinf(want_l), 0, want_l), **tol)
  got_leaves, want_leaves = jax.tree.leaves(got_g), jax.tree.leaves(want_g)
  assert len(got_leaves) == len(want_leaves) == 3 + len(jax.tree.leaves(score_mod))
  for i, (got, want) in enumerate(zip(got_leaves, want_leaves, strict=True)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), i
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got / scale, want / scale, err_msg=f"gradient {i}", **tol)
