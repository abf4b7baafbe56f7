"""Bad input raises an error naming the argument, what was received and what was expected;
the registry explains and refuses what it cannot serve."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxattn
from flaxattn import registry

Q = jnp.zeros((2, 16, 4, 8))
K = jnp.zeros((2, 16, 2, 8))


@pytest.mark.parametrize("kwargs,match", [
    (dict(q=jnp.zeros((16, 4, 8))), r"q expects a 4-D array .*shape \(16, 4, 8\)"),
    (dict(q=jnp.zeros((2, 16, 3, 8))), r"q heads \(3\) expect a multiple of k/v heads \(2\)"),
    (dict(k=jnp.zeros((2, 16, 2, 4)), v=jnp.zeros((2, 16, 2, 4))), r"head_dim"),
    (dict(v=jnp.zeros((2, 15, 2, 8))), r"k and v expect the same \[B, S, Hkv\]"),
    (dict(q=jnp.zeros((2, 16, 4, 8), jnp.int32)), r"q expects a floating dtype.*int32"),
    (dict(q=jnp.zeros((2, 16, 4, 8), jnp.bfloat16)), r"q, k, v expect one dtype"),
    (dict(segment_ids=jnp.ones((2, 15), jnp.int32)),
     r"segment_ids expects an integer array of shape \(2, 16\).*\(2, 15\)"),
    (dict(segment_ids=jnp.ones((2, 16), jnp.float32)),
     r"segment_ids expects an integer array.*float32"),
    (dict(positions=jnp.ones((16,), jnp.int32)),
     r"positions expects an integer array of shape \(2, 16\)"),
    (dict(kv_positions=jnp.ones((2, 8), jnp.int32)), r"kv_positions expects .*\(2, 16\)"),
    (dict(kv_segment_ids=jnp.ones((2, 16), jnp.int32)), r"segment_ids is required"),
    (dict(backend="nope"),
     r"backend expects one of \['auto', 'fused', 'blockwise', 'cudnn', 'mosaic_gpu', 'pallas_gpu',"
     r" 'reference', 'splash', 'split_k'\]"),
])
def test_bad_input_names_the_argument(kwargs, match):
  args = dict(q=Q, k=K, v=K)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    flaxattn.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("kwargs,match", [
    # Empty axes: refused by name before any kernel divides by them.
    (dict(q=jnp.zeros((2, 0, 4, 8))),
     r"q expects at least one token on axis 1 \(seq\), got shape \(2, 0, 4, 8\)"),
    (dict(k=jnp.zeros((2, 0, 2, 8)), v=jnp.zeros((2, 0, 2, 8))),
     r"k expects at least one token on axis 1 \(seq\), got shape \(2, 0, 2, 8\)"),
    (dict(q=jnp.zeros((0, 16, 4, 8)), k=jnp.zeros((0, 16, 2, 8)), v=jnp.zeros((0, 16, 2, 8))),
     r"q expects at least one row on axis 0 \(batch\)"),
    (dict(q=jnp.zeros((2, 16, 0, 8))), r"q expects at least one head on axis 2"),
    (dict(k=jnp.zeros((2, 16, 0, 8)), v=jnp.zeros((2, 16, 0, 8))),
     r"k expects at least one head on axis 2 \(heads\)"),
    (dict(q=jnp.zeros((2, 16, 4, 0)), k=jnp.zeros((2, 16, 2, 0)), v=jnp.zeros((2, 16, 2, 0))),
     r"q expects at least one feature on axis 3 \(head_dim\)"),
    (dict(v=jnp.zeros((2, 16, 2, 0))), r"v expects at least one feature on axis 3"),
    # Numbers: finite and positive, named, with the value and its type.
    (dict(logit_soft_cap=INF), r"logit_soft_cap expects a positive number.*got inf"),
    (dict(logit_soft_cap=NAN), r"logit_soft_cap expects a positive number.*got nan"),
    (dict(logit_soft_cap=-1.0), r"logit_soft_cap expects a positive number.*got -1"),
    (dict(logit_soft_cap=True), r"logit_soft_cap expects .*got True \(bool\)"),
    (dict(scale=NAN), r"scale expects a positive number.*got nan"),
    (dict(scale=INF), r"scale expects a positive number.*got inf"),
    (dict(scale=0.0), r"scale expects a positive number.*got 0.0"),
    (dict(scale=-0.5), r"scale expects a positive number.*got -0.5"),
    (dict(scale="a"), r"scale expects .*got 'a' \(str\)"),
    (dict(scale=True), r"scale expects .*got True \(bool\)"),
    (dict(scale=np.ones(2)), r"scale expects .*\(numpy.ndarray\)"),
    # Finite but past float32: scores overflow (scale) or flush to zero (cap), so NaN or
    # flattened attention; an int past float's range is refused the same way.
    (dict(scale=1e38), r"scale expects a positive number at most 1e\+06.*got 1e\+38"),
    (dict(scale=10**400), r"scale expects a positive number at most 1e\+06"),
    (dict(logit_soft_cap=1e38), r"logit_soft_cap expects a positive number at most 1e\+06"),
    (dict(logit_soft_cap=10**400), r"logit_soft_cap expects a positive number at most"),
])
def test_bad_sizes_and_numbers_name_the_argument(kwargs, match):
  args = dict(q=Q, k=K, v=K)
  args.update(kwargs)
  q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
  for backend in ("blockwise", "reference"):
    with pytest.raises(ValueError, match=match):
      flaxattn.attention(q, k, v, backend=backend, **args)
  if "scale" not in args:  # explain takes no scale
    with pytest.raises(ValueError, match=match):
      flaxattn.explain(q, k, v, print_fn=None, **args)


def test_numbers_of_numpy_types_are_taken():
  want = flaxattn.attention(Q + 1, K, K, scale=0.5, logit_soft_cap=2.0, backend="reference")
  got = flaxattn.attention(Q + 1, K, K, scale=np.float32(0.5), logit_soft_cap=np.float64(2),
                           backend="reference")
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kwargs,match", [
    (dict(scale=NAN), r"scale expects a positive number.*got nan"),
    (dict(logit_soft_cap=INF), r"logit_soft_cap expects a positive number.*got inf"),
])
def test_nnx_attention_fn_checks_its_numbers_when_made(kwargs, match):
  with pytest.raises(ValueError, match=match):
    flaxattn.nnx_attention_fn(**kwargs)


def test_mask_type_error():
  with pytest.raises(TypeError, match=r"mask expects a flaxattn mask .*got array"):
    flaxattn.attention(Q, K, K, mask=np.ones((16, 16), bool))


def test_cross_attention_needs_kv_segments():
  with pytest.raises(ValueError,
                     match=r"kv_segment_ids is required when keys \(9\) and queries \(16\)"):
    flaxattn.attention(Q, K[:, :9], K[:, :9], segment_ids=jnp.ones((2, 16), jnp.int32))


class _Picky(registry.Kernel):
  name = "picky"

  def reason(self, call):
    return None if call.dtype == "bfloat16" else "needs bfloat16."

  def __call__(self, q, k, v, layout, *, mask, scale, return_lse):
    return q


@pytest.fixture
def picky(monkeypatch):
  """A registered kernel first on cpu, undone after the test."""
  monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
  monkeypatch.setattr(registry, "BACKENDS", {p: list(r) for p, r in registry.BACKENDS.items()})
  registry.register(_Picky(), platforms=("cpu",), before="blockwise")


def test_explicit_backend_that_declines_names_reason_and_alternatives(picky):
  with pytest.raises(ValueError, match=r"backend='picky' cannot serve this call: needs bfloat16\..*"
                                       r"Kernels that can: \['blockwise', 'pallas_gpu',"
                                       r" 'reference'\]"):
    flaxattn.attention(Q, K, K, backend="picky")
  text = flaxattn.explain(Q, K, K, print_fn=None)
  assert "picky: declines: needs bfloat16." in text
  assert ("backend='auto' -> blockwise (split_k declines: split_k serves a few queries against"
          " more keys; this call has 16 keys for 16 queries.; picky declines: needs bfloat16.)"
          in text)
  text = flaxattn.explain(Q.astype(jnp.bfloat16), K.astype(jnp.bfloat16), K.astype(jnp.bfloat16),
                          print_fn=None)
  assert "backend='auto' -> picky" in text


def test_registry_order_is_pinned_and_extended_by_name(picky):
  assert registry.order("cpu") == ["split_k", "picky", "blockwise"]
  assert registry.order("tpu") == ["split_k", "splash", "blockwise"]
  assert registry.order("gpu") == ["split_k", "cudnn", "mosaic_gpu", "pallas_gpu", "blockwise"]
  assert registry.ALIASES == {"fused": ("cudnn", "mosaic_gpu", "pallas_gpu", "blockwise")}
  registry.register(_Picky(), platforms=("cpu", "gpu"), after="blockwise")
  assert registry.order("cpu") == ["split_k", "blockwise", "picky"]
  assert registry.order("gpu") == ["split_k", "cudnn", "mosaic_gpu", "pallas_gpu", "blockwise",
                                   "picky"]
  registry.register(_Picky(), platforms=("tpu",), before="splash")
  assert registry.order("tpu") == ["split_k", "picky", "splash", "blockwise"]
  with pytest.raises(ValueError, match=r"after='nope'\) expects a kernel of the cpu row"):
    registry.register(_Picky(), platforms=("cpu",), after="nope")
  with pytest.raises(ValueError, match="not both"):
    registry.register(_Picky(), platforms=("cpu",), before="blockwise", after="blockwise")


def test_explain_and_call_agree_under_context_parallelism():
  mesh = jax.make_mesh((1,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
  ring = flaxattn.ContextParallel(strategy="ring")
  with jax.set_mesh(mesh):
    text = flaxattn.explain(Q, K, K, backend="reference", context_parallel=ring, print_fn=None)
    assert "backend='reference' -> error: backend='reference' cannot serve this call:" in text
    with pytest.raises(ValueError, match=r"reference has no per-block passes for the ring"
                                         r" strategy; use strategy='all_gather'"):
      flaxattn.attention(Q, K, K, backend="reference", context_parallel=ring)
    gather = flaxattn.ContextParallel(strategy="all_gather")
    text = flaxattn.explain(Q, K, K, backend="reference", context_parallel=gather, print_fn=None)
    assert "backend='reference' -> reference" in text
    assert flaxattn.attention(Q, K, K, backend="reference",
                              context_parallel=gather).shape == Q.shape


def test_import_loads_no_kernel_that_uses_private_jax():
  code = ("import sys, flaxattn; loaded = [m for m in sys.modules if m in ('flaxattn.cudnn',"
          " 'flaxattn.splash') or m.startswith('jax.experimental.pallas')]; print(loaded)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr
  # They load when first consulted, e.g. by explain or as flaxattn.splash.
  assert flaxattn.splash.Splash(block_q=256).block_q == 256


def test_explain_takes_shapes_only(capsys):
  def shape(*s):
    return jax.ShapeDtypeStruct(s, jnp.float32)
  flaxattn.explain(shape(1, 4096, 8, 64), shape(1, 4096, 2, 64), shape(1, 4096, 2, 64),
                   mask=flaxattn.Local(128))
  out = capsys.readouterr().out
  assert "mask Local(window=128)" in out and "backend='auto' -> blockwise" in out


def test_explain_shows_each_platform():
  def shape(*s, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(s, dtype)
  q, kv = shape(1, 4096, 8, 128), shape(1, 4096, 2, 128)
  text = flaxattn.explain(q, kv, kv, segment_ids=shape(1, 4096, dtype=jnp.int32), print_fn=None)
  # Packed rows: cuDNN's THD temporaries, 4.3 x 32 slots x 4096 x 8 x 128 x 2 bytes, pass
  # its budget, twice the unpacked call's (2 x 6.0 x 4096 x 8 x 128 x 2 bytes).
  # split_k, first everywhere, serves decode steps only.
  decline = "split_k declines: split_k serves decode steps of at most 16 queries; this call has"
  assert (f"  cpu: blockwise ({decline} 4096.)\n  gpu: mosaic_gpu ({decline} 4096.; cudnn declines:"
          " cuDNN's packed (THD) layout with 32 slots would hold about 1.07 GiB of"
          " temporaries") in text
  assert "over its budget of 0.09 GiB" in text
  # splash: its backward (8 heads x 4096 x 4096 / 512 x 128 bf16 of dq partials, within the
  # default budget), then why split_k declined.
  assert ("\n  tpu: splash (backward fused dK/dV/dQ: its dq partials take 67108864 bytes,"
          " within fused_dq_budget 268435456 bytes") in text
  assert f"; {decline} 4096.)\n" in text.split("\n  tpu: ")[1]
  # Chunked: no cuDNN mask, so GPU takes the next kernel (Hopper's, for a GPU not named) and
  # says why; splash chunks lazily on TPU.
  text = flaxattn.explain(q, kv, kv, mask=flaxattn.Chunked(1024), print_fn=None)
  assert f"gpu: mosaic_gpu ({decline} 4096.; cudnn declines: cuDNN has no chunked mask" in text
  assert "tpu: splash" in text
  text = flaxattn.explain(q, kv, kv, mask=flaxattn.Chunked(1024), backend="fused", print_fn=None)
  assert "gpu: mosaic_gpu (cudnn declines: cuDNN has no chunked mask" in text  # split_k: not fused
  # 4000 tokens: not a multiple of splash's 128-token blocks, so TPU takes the blockwise kernel.
  q, kv = shape(1, 4000, 8, 128, dtype=jnp.float32), shape(1, 4000, 2, 128, dtype=jnp.float32)
  text = flaxattn.explain(q, kv, kv, print_fn=None)
  assert f"tpu: blockwise ({decline} 4000.; splash declines: splash needs a sequence length" in text
  assert f"gpu: pallas_gpu ({decline} 4000.; cudnn declines:" in text  # float32
  assert "; mosaic_gpu declines: mosaic_gpu takes bfloat16 or float16" in text
  text = flaxattn.explain(q, kv, kv, backend="splash", print_fn=None)
  assert ("  tpu: error: backend='splash' cannot serve this call: splash needs a sequence length"
          in text)


# Odd values at every public constructor (the options of flaxattn's exports and of the
# kernels' objects): each is refused where it is made, with an error that names the option,
# unless it is listed as taken.
ODD = {"0": 0, "-3": -3, "2.5": 2.5, "True": True, "'64'": "64", "None": None,
       "nan": float("nan"), "inf": float("inf"), "2**64": 2**64}
# (constructor, option, other options, the odd values it takes and why)
OPTIONS = [
    (flaxattn.Local, "window", {}, ()), (flaxattn.Chunked, "size", {}, ()),
    ("split_k:SplitK", "chunk", {}, ("2**64",)),  # one chunk of all the keys
    ("split_k:SplitK", "score_budget", {}, ("2.5", "2**64")),  # bytes: any positive amount
    *[("pallas_gpu:PallasGpu", arg, {}, ("None", "2**64")) for arg in ("block_q", "block_kv")],
    ("pallas_gpu:PallasGpu", "num_warps", {}, ("None",)),
    ("pallas_gpu:PallasGpu", "num_stages", {}, ("2**64",)),
    ("pallas_gpu:PallasGpu", "interpret", {}, ("True", "None")),
    *[("splash:Splash", arg, {}, ("None", "2**64")) for arg in ("block_q", "block_kv")],
    ("splash:Splash", "interpret", {}, ("True", "None")),
    *[("blockwise:Blockwise", arg, {}, ("2**64",)) for arg in ("block_q", "block_kv")],
    ("cudnn:Cudnn", "max_segments", {}, ("None", "2**64")),
    ("cudnn:Cudnn", "thd_budget", {}, ("None", "2.5", "2**64")),
    (flaxattn.ContextParallel, "axis", {}, ("'64'",)),  # a mesh axis name
    (flaxattn.ContextParallel, "strategy", {}, ()),
    (flaxattn.ContextParallel, "load_balance", {}, ("True",)),
    (flaxattn.ContextParallel, "ring_axis", {"strategy": "ulysses"}, ("'64'", "None")),
    (flaxattn.ContextParallel, "batch_axes", {}, ()),
    (flaxattn.ContextParallel, "head_axes", {}, ()),
    (flaxattn.ContextParallel, "cost_model", {}, ("None",)),
    (flaxattn.RoPE, "theta", {}, ("2.5", "2**64")), (flaxattn.RoPE, "scaling", {}, ("None",)),
    (flaxattn.RoPEScaling, "kind", {}, ()),
    (flaxattn.RoPEScaling, "factor", {"kind": "linear"}, ("2.5", "2**64")),
    (flaxattn.RoPEScaling, "original_max_position", {"kind": "llama3"}, ()),
    *[(flaxattn.RoPEScaling, arg, {}, ("2.5", "2**64"))
      for arg in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow")],
    (flaxattn.RoPEScaling, "attention_factor", {}, ("2.5", "None")),
]


def _maker(spec):
  if isinstance(spec, str):  # a kernel's options, in its module (loaded on first use)
    module, name = spec.split(":")
    return getattr(getattr(flaxattn, module), name)
  return spec


@pytest.mark.parametrize("label", ODD)
@pytest.mark.parametrize("spec,arg,others,taken", OPTIONS,
                         ids=[f"{getattr(o[0], '__name__', o[0])}.{o[1]}" for o in OPTIONS])
def test_odd_values_at_every_public_constructor(spec, arg, others, taken, label):
  make = _maker(spec)
  kwargs = {**others, arg: ODD[label]}
  if make is flaxattn.RoPEScaling and "kind" in others and arg != "original_max_position":
    kwargs.setdefault("original_max_position", 8192)
  if label in taken:
    make(**kwargs)
    return
  with pytest.raises((ValueError, TypeError), match=arg) as raised:
    make(**kwargs)
  assert repr(ODD[label]) in str(raised.value) or label == "None" and "original" in arg


@pytest.mark.parametrize("label", [x for x in ODD if x != "True"])
def test_return_lse_takes_a_bool_only(label):
  with pytest.raises(ValueError, match=r"return_lse expects True or False, got"):
    flaxattn.attention(Q, K, K, return_lse=ODD[label], backend="reference")
  with pytest.raises(ValueError, match="return_lse"):
    flaxattn.explain(Q, K, K, return_lse=ODD[label], print_fn=None)
