"""Shared test fixtures. `fake_cudnn`: JAX's cuDNN attention runs on CPU through the model
of cuDNN in cudnn_model.py."""

import pytest

import cudnn_model


@pytest.fixture(scope="module")
def fake_cudnn():
  with cudnn_model.installed():
    yield
