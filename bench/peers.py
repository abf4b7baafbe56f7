"""Other libraries' attention on q `[B, T, H, D]`, k/v `[B, T, Hkv, D]`, for the GPU
benchmarks to set beside flaxattn's kernels: JAX's own cuDNN call, the same documents as
batch rows (what packed rows would cost if every document were its own row), tokamax and
torch's scaled_dot_product_attention where they are installed.

Each takes the causal band of a mask: `window` None (causal) or w (flaxattn's `Local(w)`:
keys p - w < k <= p). None of them takes segment ids.
"""

from __future__ import annotations

import importlib

import jax


def jax_nn_cudnn(q, k, v, *, window: int | None = None, **kwargs):
  """`jax.nn.dot_product_attention(..., implementation="cudnn")`, causal unless `kwargs`
  say otherwise (`is_causal=False`, `mask=`), with a sliding window of `window` keys."""
  kwargs.setdefault("is_causal", True)
  local = None if window is None else (window - 1, 0)
  return jax.nn.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5,
                                      implementation="cudnn", local_window_size=local, **kwargs)


def docs_as_rows(docs: int, length: int | None = None):
  """Attention of q, k, v `[1, T, ...]` whose row starts with `docs` equal causal documents
  of `length` tokens (default T / docs: filling the row; the rest is padding, which has no
  work), run as `docs` batch rows through `jax_nn_cudnn`: the same attention with no packing
  to pay for (the ideal of a packed row). Returns the documents' output `[1, docs x length,
  H, D]`."""
  def attn(q, k, v):
    n = q.shape[1] // docs if length is None else length
    def rows(x):
      return x[:, :docs * n].reshape((docs, n) + x.shape[2:])
    return jax_nn_cudnn(rows(q), rows(k), rows(v)).reshape((1, docs * n) + q.shape[2:])
  return attn


def missing(module: str) -> str | None:
  """Why a peer library cannot run here ("tokamax is not installed", torch without CUDA),
  or None."""
  try:
    lib = importlib.import_module(module)
  except ImportError as e:
    return f"{module} is not installed ({e})"
  if module == "torch" and not lib.cuda.is_available():
    return f"torch {lib.__version__} has no CUDA device (a CPU build?)"
  return None


def tokamax_attention(implementation: str):
  """tokamax's `dot_product_attention` with `implementation` ("mosaic": its Mosaic GPU
  kernel, "triton": its Pallas Triton kernel), as `jax_nn_cudnn` takes arguments."""
  tokamax = importlib.import_module("tokamax")

  def attn(q, k, v, *, window: int | None = None):
    local = None if window is None else (window - 1, 0)
    return tokamax.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=True,
                                         local_window_size=local, implementation=implementation)
  return attn


def torch_sdpa(t: int, heads: int, kv_heads: int, head_dim: int):
  """(forward, forward+backward): argument-free functions that run torch's
  `scaled_dot_product_attention` (causal, GQA, its own choice of backend) on bfloat16
  inputs of T = t on the GPU, and wait for it; forward+backward is the gradient of the sum
  of the output (float32) w.r.t. q, k, v."""
  torch = importlib.import_module("torch")
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def tensor(h):
    return torch.randn((1, h, t, head_dim), device="cuda", dtype=torch.bfloat16,
                       requires_grad=True)
  q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)

  def forward():
    with torch.no_grad():
      sdpa(q, k, v, is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()

  def forward_backward():
    out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    torch.autograd.grad(out.float().sum(), (q, k, v))
    torch.cuda.synchronize()
  return forward, forward_backward
