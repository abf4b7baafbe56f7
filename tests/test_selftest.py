"""`flaxattn.selftest`: a mismatching kernel fails it (exit 1); matching kernels pass."""

import pytest

import flaxattn
from flaxattn import registry, selftest


class _Broken(registry.Kernel):
  name = "broken"

  def __call__(self, q, k, v, layout, *, mask, scale, return_lse):
    out = flaxattn.blockwise.blockwise_attention(q, k, v, layout, mask=mask, scale=scale,
                                                 return_lse=return_lse)
    return (out[0] * 1.01, out[1]) if return_lse else out * 1.01


@pytest.fixture
def only(monkeypatch):
  """Runs the self-test on the given kernels' cases only, without the timings."""
  monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
  monkeypatch.setattr(selftest, "_timings", lambda *args: None)

  def run(*names):
    cases = [selftest.Case(n, flaxattn.Causal(), "float32", True) for n in names]
    monkeypatch.setattr(selftest, "_cases", lambda *args: iter(cases))
  return run


def test_mismatch_fails_with_exit_status_1(only, capsys):
  registry.register(_Broken())
  only("blockwise", "broken")
  assert selftest.main(["--quick"]) == 1
  out = capsys.readouterr().out
  assert "ok   blockwise: Causal(), float32, packed" in out
  assert "FAIL broken: Causal(), float32, packed" in out and "MISMATCH" in out


def test_matching_kernels_pass(only):
  only("blockwise")
  assert flaxattn.selftest(quick=True, print_fn=lambda *a: None) is True
