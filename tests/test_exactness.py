"""Every kernel that accepts a call equals the reference on layouts no pipeline produces:
random legal segment ids and positions (`packing.legal_layout`), forward, lse and gradients.

Kernels that mask by token index (splash, cuDNN) are exact only where positions are the
index shifted per document; on everything else they must notice at run time and take an
exact path. Context-parallel strategies get the same layouts in cp_check.py.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import flaxattn
from flaxattn import cudnn, splash
from flaxattn.blockwise import blockwise_attention
from flaxattn.layout import Layout
from packing import legal_layout
from test_attention import _compare, _inputs

MASKS = [flaxattn.Full(), flaxattn.Causal(), flaxattn.Local(5), flaxattn.Chunked(8),
         flaxattn.Causal() & flaxattn.Local(12)]


def _layout(seed, b, t, s=None):
  arrays = legal_layout(np.random.default_rng(seed), b, t, s)
  seg, pos, *kv = map(jnp.asarray, arrays)
  return Layout(seg, seg, pos, pos) if s is None else Layout(seg, kv[0], pos, kv[1])


# T = 100 and S = 76 are multiples of no block size; blocks of 16 x 32 cross many documents.
@pytest.mark.parametrize("seed", range(10))
def test_blockwise(seed):
  mask = MASKS[seed % len(MASKS)]
  s = None if seed % 2 else 76
  q, k, v = _inputs(seed, 2, 100, s or 100, 4, (1, 2, 4)[seed % 3], 8, jnp.float32)
  small = functools.partial(blockwise_attention, block_q=16, block_kv=32)
  _compare(small, _layout(seed, 2, 100, s), mask, q, k, v, jnp.float32)


@pytest.mark.parametrize("seed", range(4))
def test_splash(seed):
  """Self attention (splash's only form), 128-blocks over T = 256 in interpret mode."""
  mask = MASKS[1 + seed % (len(MASKS) - 1)]  # every mask that reads positions
  q, k, v = _inputs(seed, 1, 256, 256, 2, 1, 16, jnp.float32)
  _compare(splash.Splash(block_q=128, block_kv=128), _layout(seed, 1, 256), mask, q, k, v,
           jnp.float32)


@pytest.mark.parametrize("seed", range(4))
def test_cudnn_model(fake_cudnn, seed):
  """cuDNN's glue against a CPU model of cuDNN: the run-time check sends these layouts to
  the blockwise kernel, and whatever it decides must be exact."""
  mask = [flaxattn.Full(), flaxattn.Causal(), flaxattn.Local(5), flaxattn.Causal()][seed]
  s = None if seed % 2 else 48
  q, k, v = _inputs(seed, 2, 64, s or 64, 4, 2, 16, jnp.bfloat16)
  kernel = functools.partial(cudnn.cudnn_attention, max_segments=8)
  _compare(kernel, _layout(seed, 2, 64, s), mask, q, k, v, jnp.bfloat16)
