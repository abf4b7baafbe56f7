"""Ulysses: an all-to-all turns sequence-sharded q/k/v into head-sharded ones, attention runs
on the whole sequence (or on a ring over a second axis), and a second all-to-all turns the
result back. Derivations: docs/design.md, "Context parallelism".
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from flaxattn import balance


def to_heads(axis: str, x):
  """`[B, T/n, H, ...]` sharded over `axis` on the sequence -> `[B, T, H/n, ...]`."""
  return jax.lax.all_to_all(x, axis, 2, 1, tiled=True)


def to_sequence(axis: str, x):
  """Inverse of `to_heads`: `[B, T, H/n, ...]` -> `[B, T/n, H, ...]` (lse `[B, T, H/n]` too)."""
  return jax.lax.all_to_all(x, axis, 1, 2, tiled=True)


def ulysses(axis: str, inner, kv_repeat: int, step, near, q, k, v, layout):
  """A `shard_map` body. Per device: q `[B, T/n, H, D]`, k/v `[B, T/n, Hkv, D]` (the n
  devices of `axis` together hold T tokens) -> `inner(step, near, q, k, v, layout)` on
  `[B, T, H/n, D]`, the n shards' tokens in device order, with `layout`'s ids `[B, T]` of
  those tokens -> (out `[B, T/n, H, D]`, lse `[B, T/n, H]`).
  K/V heads are repeated `kv_repeat` times first, each next to itself, so that every group
  of query heads keeps its key/value head when the heads are split."""
  k, v = (jnp.repeat(x, kv_repeat, axis=2) for x in (k, v))
  q, k, v = (to_heads(axis, x) for x in (q, k, v))
  if layout.head_offset is not None:  # read by programmable masks and scores
    layout = layout.shifted(heads=jax.lax.axis_index(axis) * q.shape[2])
  out, lse = inner(step, near, q, k, v, layout)
  return to_sequence(axis, out), to_sequence(axis, lse)


def whole_sequence(kernel, options, shards: int, step, near, q, k, v, layout):
  """Ulysses's inner computation without a ring (`step` and `near` are None): `kernel` with
  `options` (mask, scale, soft cap) on the whole sequence in the original token order (the
  load balancing over `shards` undone with reshapes and flips), so default positions stay
  None and index-masking kernels take their check-free path."""
  def unpermute(x):
    return balance.unload_balance(x, shards) if shards > 1 else x

  def permute(x):
    return balance.load_balance(x, shards) if shards > 1 else x

  layout = dataclasses.replace(layout.map_tokens(unpermute), shards=1)
  out, lse = kernel(unpermute(q), unpermute(k), unpermute(v), layout, return_lse=True,
                    **options)
  return permute(out), permute(lse)


def kv_repeat(axis: str, n: int, heads: int, kv_heads: int) -> int:
  """How many times Ulysses repeats each K/V head so that the n devices of `axis` split the q
  heads `heads` and the K/V heads `kv_heads` alike (counts per head shard):
  lcm(kv_heads, n) / kv_heads. Each group of queries keeps its K/V head, since
  lcm(kv_heads, n) divides `heads` whenever n and kv_heads do.

  Raises:
    ValueError: n does not divide `heads`.
  """
  if heads % n:
    raise ValueError(
        f"context_parallel strategy 'ulysses' over {axis!r} (size {n}) splits the query"
        f" heads over it and expects the heads per device ({heads}, of {kv_heads} K/V heads)"
        f" divisible by {n}; use strategy='ring' or 'all_gather', which do not split heads, or"
        f" a {axis!r} axis whose size divides the heads.")
  return math.lcm(kv_heads, n) // kv_heads
