"""RoPE frequency tables against the published rope_scaling formulas, written out here one
frequency at a time, and the rotation itself."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from flaxattn import RoPE, RoPEScaling

D, THETA = 128, 500000.0


def _base(d=D, theta=THETA):
  return [1.0 / theta ** (2 * i / d) for i in range(d // 2)]


def _llama3(factor, low, high, old):
  out = []
  for f in _base():
    wavelength = 2 * math.pi / f
    if wavelength < old / high:
      out.append(f)
    elif wavelength > old / low:
      out.append(f / factor)
    else:
      smooth = (old / wavelength - low) / (high - low)
      out.append((1 - smooth) * f / factor + smooth * f)
  return out


def _yarn(factor, old, beta_fast=32, beta_slow=1, d=D, theta=THETA):
  def dim_of(rotations):
    return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))
  low, high = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), d - 1)
  if low == high:
    high += 0.001
  out = []
  for i, f in enumerate(_base(d, theta)):
    ramp = min(max((i - low) / (high - low), 0.0), 1.0)
    extrapolation = 1 - ramp
    out.append(f / factor * (1 - extrapolation) + f * extrapolation)
  return out


@pytest.mark.parametrize("scaling,want", [
    (None, _base()),
    (RoPEScaling("linear", factor=4.0), [f / 4 for f in _base()]),
    # Llama 3.1's published values.
    (RoPEScaling("llama3", factor=8.0, original_max_position=8192, low_freq_factor=1.0,
                 high_freq_factor=4.0), _llama3(8.0, 1.0, 4.0, 8192)),
    (RoPEScaling("yarn", factor=4.0, original_max_position=32768), _yarn(4.0, 32768)),
    (RoPEScaling("yarn", factor=16.0, original_max_position=4096, beta_fast=16, beta_slow=2),
     _yarn(16.0, 4096, 16, 2)),
])
def test_frequency_tables_match_the_published_formulas(scaling, want):
  got = RoPE(THETA, scaling).inv_freq(D)
  np.testing.assert_allclose(got, want, rtol=1e-12)


def test_llama3_keeps_short_wavelengths_and_divides_long_ones():
  got = RoPE(THETA, RoPEScaling("llama3", 8.0, 8192)).inv_freq(D)
  base = np.asarray(_base())
  assert got[0] == base[0] and got[-1] == base[-1] / 8
  assert np.all(np.diff(got) < 0)  # still monotone through the blend


def test_yarn_scales_cos_and_sin():
  x = jnp.ones((1, 3, 1, 8))
  pos = jnp.zeros((1, 3), jnp.int32)  # angle 0: cos = factor, sin = 0
  out = RoPE(10000.0, RoPEScaling("yarn", factor=4.0, original_max_position=64))(x, pos)
  np.testing.assert_allclose(out, 0.1 * math.log(4.0) + 1.0, rtol=1e-6)
  out = RoPE(10000.0, RoPEScaling("yarn", 4.0, 64, attention_factor=0.5))(x, pos)
  np.testing.assert_allclose(out, 0.5, rtol=1e-6)


def test_rotation_uses_the_scaled_frequencies():
  rope = RoPE(10000.0, RoPEScaling("linear", factor=2.0))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 2, 8)), jnp.float32)
  pos = jnp.arange(5)[None] * 2
  # Linear scaling by 2 at position 2p is the unscaled rotation at position p.
  np.testing.assert_allclose(rope(x, pos), RoPE(10000.0)(x, pos // 2), atol=1e-5)


@pytest.mark.parametrize("kwargs,words", [
    (dict(kind="ntk"), "kind=...) expects one of"),
    (dict(kind="linear", factor=0.5), "factor=...) expects a number >= 1 (finite), got 0.5"),
    (dict(kind="llama3", factor=8.0), "expects original_max_position"),
    (dict(kind="llama3", factor=8.0, original_max_position=8192, low_freq_factor=4.0,
          high_freq_factor=1.0), "high_freq_factor > low_freq_factor"),
])
def test_scaling_errors(kwargs, words):
  with pytest.raises(ValueError,
                     match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
    RoPEScaling(**kwargs)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("make,match", [
    (lambda: RoPE(NAN), r"RoPE\(theta=\.\.\.\) expects a number > 1.*got nan"),
    (lambda: RoPE(INF), r"RoPE\(theta=\.\.\.\) expects a number > 1.*got inf"),
    (lambda: RoPE(True), r"RoPE\(theta=\.\.\.\) expects .*got True \(bool\)"),
    (lambda: RoPE("1e4"), r"RoPE\(theta=\.\.\.\) expects .*got '1e4' \(str\)"),
    (lambda: RoPEScaling("linear", NAN), r"factor=\.\.\.\) expects a number >= 1"),
    (lambda: RoPEScaling("linear", INF), r"factor=\.\.\.\) expects a number >= 1"),
    (lambda: RoPEScaling("llama3", 8.0, NAN),
     r"original_max_position=\.\.\.\) expects a positive int.*got nan \(float\)"),
    (lambda: RoPEScaling("yarn", 8.0, -4096),
     r"original_max_position=\.\.\.\) expects a positive int.*got -4096"),
    (lambda: RoPEScaling("llama3", 8.0, 8192, high_freq_factor=INF),
     r"high_freq_factor=\.\.\.\) expects a positive number.*got inf"),
    (lambda: RoPEScaling("yarn", 8.0, 4096, beta_fast=NAN),
     r"beta_fast=\.\.\.\) expects a positive number.*got nan"),
    (lambda: RoPEScaling("yarn", 8.0, 4096, beta_fast=1.0, beta_slow=32.0),
     r"expects beta_fast >= beta_slow \(e.g. 32.0 and 1.0\), got 1.0 and 32.0"),
    (lambda: RoPEScaling("yarn", 8.0, 4096, attention_factor=NAN),
     r"attention_factor=\.\.\.\) expects a positive number.*got nan"),
    (lambda: RoPEScaling("yarn", 8.0, 4096, attention_factor=0.0),
     r"attention_factor=\.\.\.\) expects a positive number.*got 0.0"),
    # Finite, but the rotation would overflow float32 scores, or past int32 positions.
    (lambda: RoPEScaling("yarn", 8.0, 4096, attention_factor=1e39),
     r"attention_factor=\.\.\.\) expects a positive number at most 1000"),
    (lambda: RoPEScaling("yarn", 2.0, 10**400),
     r"original_max_position=\.\.\.\) expects a positive int at most 2147483647"),
    (lambda: RoPE(10**400), r"RoPE\(theta=\.\.\.\) expects a number > 1"),
])
def test_numbers_out_of_range_are_refused(make, match):
  with pytest.raises(ValueError, match=match):
    make()
