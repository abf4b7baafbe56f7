"""`flaxattn.selftest`: a mismatching kernel fails it (exit 1); matching kernels pass."""

import pytest

import flaxattn
import helpers
from flaxattn import registry, selftest


class _Broken(registry.Kernel):
  name = "broken"

  def __call__(self, q, k, v, layout, *, mask, scale, return_lse):
    out = flaxattn.blockwise.blockwise_attention(q, k, v, layout, mask=mask, scale=scale,
                                                 return_lse=return_lse)
    return (out[0] * 1.01, out[1]) if return_lse else out * 1.01


@pytest.fixture
def only(monkeypatch):
  """Runs the self-test on the given kernels' cases only, without the timings; with
  `context_parallel`, also its context-parallel cases on this process's 8 devices."""
  monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
  monkeypatch.setattr(selftest, "_timings", lambda *args: None)

  def run(*names, context_parallel=False):
    cases = [selftest.Case(n, flaxattn.Causal(), "float32", True) for n in names]
    monkeypatch.setattr(selftest, "_cases", lambda *args: iter(cases))
    if not context_parallel:
      monkeypatch.setattr(selftest, "_cp_cases", lambda *args: iter(()))
  return run


def test_mismatch_fails_with_exit_status_1(only, capsys):
  registry.register(_Broken())
  only("blockwise", "broken")
  assert selftest.main(["--quick"]) == 1
  out = capsys.readouterr().out
  assert "ok   blockwise: Causal(), float32, packed" in out
  assert "FAIL broken: Causal(), float32, packed" in out and "MISMATCH" in out


@pytest.mark.slow  # the context-parallel cases on 8 devices
def test_matching_kernels_pass(only):
  """With 8 devices the self-test also checks every strategy that splits its heads."""
  helpers.needs_default_devices(8)
  only("blockwise", context_parallel=True)
  lines = []
  assert flaxattn.selftest(quick=True, print_fn=lines.append) is True
  strategies = [s for s in selftest.STRATEGIES if s != "ulysses" or selftest.HEADS % 8 == 0]
  for strategy in ["blockwise", *strategies]:
    case = ("blockwise: Causal(), float32, packed" if strategy == "blockwise" else
            f"auto: Causal(), float32, packed, {strategy} over 8 devices")
    assert any(line.startswith(f"  ok   {case}: ") for line in lines), (case, lines)


def test_timings_name_their_yardstick():
  """The "of matmul" column is against a matmul large enough to reach the device's rate,
  timed in the same run, and the output says which."""
  lines = []
  selftest._timings((256,), "float32", 1, lines.append)
  assert lines[-1].startswith("(of matmul: against a 2048^3 float32 matmul timed in the same"
                              " run after a warm-up, best of 3: ")
  assert [line.split()[0] for line in lines[1:-1]] == ["causal", "16"]
