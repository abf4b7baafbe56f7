"""Shared test fixtures. Every test process sees 8 simulated CPU devices, so multi-device
tests run in process on `jax.devices()[:n]`; processes the tests start get the environment
they were given. `fake_cudnn`: JAX's cuDNN attention runs on CPU through the model of cuDNN
in cudnn_model.py."""

import os

_DEVICES = "--xla_force_host_platform_device_count=8"
_flags = os.environ.get("XLA_FLAGS")
if "xla_force_host_platform_device_count" not in (_flags or ""):
  os.environ["XLA_FLAGS"] = f"{_flags or ''} {_DEVICES}".strip()

import jax  # noqa: E402  (after XLA_FLAGS: JAX reads it when its backend starts)

jax.devices()  # start the backend now, then give subprocesses the caller's environment
if _flags is None:
  os.environ.pop("XLA_FLAGS")
else:
  os.environ["XLA_FLAGS"] = _flags

import pytest  # noqa: E402

import cudnn_model  # noqa: E402


@pytest.fixture(scope="module")
def fake_cudnn():
  with cudnn_model.installed():
    yield
