"""Every kernel that accepts a call equals the reference on layouts no pipeline produces:
random legal segment ids and positions (`helpers.legal_layout`), forward, lse and gradients.

Kernels that mask by token index (splash, cuDNN) are exact only where positions are the
index shifted per document; on everything else they must notice at run time and take an
exact path. Context-parallel strategies get the same layouts in cp_check.py.
"""

import functools

import jax.numpy as jnp
import pytest

import flaxattn
from flaxattn import cudnn, splash
from flaxattn.blockwise import blockwise_attention
from helpers import as_layout, compare, legal_layout, qkv

MASKS = [flaxattn.Full(), flaxattn.Causal(), flaxattn.Local(5), flaxattn.Chunked(8),
         flaxattn.Causal() & flaxattn.Local(12)]


# T = 100 and S = 76 are multiples of no block size; blocks of 16 x 32 cross many documents.
@pytest.mark.parametrize("seed", range(10))
def test_blockwise(seed):
  mask = MASKS[seed % len(MASKS)]
  s = None if seed % 2 else 76
  q, k, v = qkv(seed, 2, 100, s or 100, 4, (1, 2, 4)[seed % 3], 8, jnp.float32)
  small = functools.partial(blockwise_attention, block_q=16, block_kv=32)
  compare(small, as_layout(*legal_layout(seed, 2, 100, s)), mask, q, k, v, jnp.float32)


@pytest.mark.parametrize("seed", range(4))
def test_splash(seed):
  """Self attention (splash's only form), 128-blocks over T = 256 in interpret mode."""
  mask = MASKS[1 + seed % (len(MASKS) - 1)]  # every mask that reads positions
  q, k, v = qkv(seed, 1, 256, 256, 2, 1, 16, jnp.float32)
  kernel = splash.Splash(block_q=128, block_kv=128)
  compare(kernel, as_layout(*legal_layout(seed, 1, 256)), mask, q, k, v, jnp.float32)


@pytest.mark.parametrize("seed", range(4))
def test_cudnn_model(fake_cudnn, seed):
  """cuDNN's glue against a CPU model of cuDNN: the run-time check sends these layouts to
  the blockwise kernel, and whatever it decides must be exact."""
  mask = [flaxattn.Full(), flaxattn.Causal(), flaxattn.Local(5), flaxattn.Causal()][seed]
  s = None if seed % 2 else 48
  q, k, v = qkv(seed, 2, 64, s or 64, 4, 2, 16, jnp.bfloat16)
  kernel = functools.partial(cudnn.cudnn_attention, max_segments=8)
  compare(kernel, as_layout(*legal_layout(seed, 2, 64, s)), mask, q, k, v, jnp.bfloat16)
