"""Context-parallel checks on N simulated CPU devices, run by test_context_parallel.py.

`XLA_FLAGS=--xla_force_host_platform_device_count=N python tests/cp_check.py N` runs the
cases of `cases(N)` and prints one `CASE {json}` line each: the largest error of the
output, lse and dq/dk/dv against `backend="reference"` without context parallelism,
relative to the largest reference magnitude, and the collectives of the compiled program.
With N == 4 it also prints a `LAYER` line, with N == 8 a `SPLASH` line. One process per N: JAX reads the device count
once, and every case shares the process so only compiling costs time.

`python tests/cp_check.py dist PORT I` (two processes, 2 devices each) prints `DIST`.
"""

from __future__ import annotations

import json
import re
import sys
import zlib

import numpy as np

import flaxattn
from packing import legal_layout, random_packing

MASKS = {"causal": flaxattn.Causal(), "local": flaxattn.Local(3), "chunked": flaxattn.Chunked(24),
         "full": flaxattn.Full()}


def case(mesh, strategy="ring", lb=True, mask="causal", hkv=2, packed=True, pipeline=False, t=64,
         backend="auto"):
  name = "-".join(([] if backend == "auto" else [backend])
                  + [strategy, "lb" if lb else "nolb", mask, f"hkv{hkv}",
                     {True: "packed", False: "default"}.get(packed, packed),
                     "x".join(f"{a}{s}" for a, s in mesh.items())] + (["pipeline"] if pipeline else []))
  return dict(name=name, mesh=mesh, strategy=strategy, lb=lb, mask=mask, hkv=hkv, packed=packed,
              pipeline=pipeline, t=t, backend=backend)


def cases(n: int) -> list[dict]:
  """A covering set, not the product (each ring compile costs seconds): every mask with ring
  and load balancing, each strategy x load balancing, GQA with 2 and 1 KV heads for 4 query
  heads, a Local window smaller than cp, 2-D and 3-D (heads over tensor) meshes, and the
  unpermute pipeline. Splash (Pallas interpret mode: slow, so few cases, T = 128 per shard)
  with the ring and all-gather strategies, every mask, packed and default layouts. `packed=
  "legal"`: random legal layouts no pipeline produces (`packing.legal_layout`), on which
  splash must take its exact path."""
  c2, c4, c8, dc2, dc4 = (dict(context=2), dict(context=4), dict(context=8), dict(data=2, context=2),
                          dict(data=2, context=4))
  return {
      2: [case(c2, mask="full", hkv=2), case(c2, "all_gather", lb=False, mask="causal", hkv=1, packed=False),
          case(c2, mask="causal", hkv=2, t=256, backend="splash"),
          case(c2, "all_gather", mask="local", hkv=1, t=256, backend="splash"),
          case(c2, mask="local", hkv=1, packed="legal", t=256, backend="splash"),
          case(c2, "all_gather", mask="chunked", hkv=2, packed="legal", t=256, backend="splash")],
      4: [case(c4, mask="causal", hkv=2), case(c4, "all_gather", mask="causal", hkv=2),
          case(c4, lb=False, mask="causal", hkv=1, packed=False),
          case(c4, mask="local", hkv=1, pipeline=True), case(dc2, mask="causal", hkv=1, packed=False),
          case(c4, mask="chunked", hkv=1, packed=False, t=512, backend="splash"),
          case(c4, lb=False, mask="local", hkv=2, t=512, backend="splash"),
          case(c4, mask="causal", hkv=2, packed="legal"),
          case(c4, "all_gather", mask="local", hkv=1, packed="legal")],
      8: [case(c8, mask="causal", hkv=2, t=128), case(dc4, mask="chunked", hkv=1, packed=False, pipeline=True),
          case(dc4, "all_gather", lb=False, mask="local", hkv=2),
          case(dict(data=2, tensor=2, context=2), mask="causal", hkv=2),
          case(dict(data=2, tensor=2, context=2), mask="causal", hkv=2, t=256, backend="splash")],
  }[n]


def _packing(b, t, cp, seed):
  """Packed rows whose documents cross shard and chunk edges, with a document shorter
  than 2 * cp tokens and a padding tail; the first seed that has all of these."""
  chunk = t // (2 * cp)
  for s in range(seed, seed + 1000):
    seg, pos = random_packing(np.random.default_rng(s), b, t, max_docs=8, pad_tail=3)
    lengths = [np.sum(row == d) for row in seg for d in np.unique(row[row > 0])]
    crosses = all(np.any(row[chunk - 1::chunk][:-1] == row[chunk::chunk]) for row in seg)
    if min(lengths) < 2 * cp and crosses:
      return seg, pos
  raise AssertionError("no packing found")


def _loss_fn(jax, jnp, attend):
  def loss(q, k, v):
    out, lse = attend(q, k, v)
    finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
    # Touch the output and the lse, so both cotangents reach the backward pass.
    return jnp.sum(out * jnp.cos(out)) + 0.5 * jnp.sum(jnp.sin(finite)), (out, lse)
  return jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  fin = np.isfinite(want)
  if not np.array_equal(np.isfinite(got), fin):
    return float("inf")
  got, want = np.where(fin, got, 0), np.where(fin, want, 0)
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _hlo_collectives(text: str) -> dict:
  """Result dtypes of every all-gather op line and the number of collective-permutes."""
  gathers = []
  for line in text.splitlines():
    if "all-gather(" in line or "all-gather-start(" in line:
      result = line.split("=", 1)[1].split("all-gather")[0]  # e.g. " f32[2,64,2,8]{3,2,1,0} "
      gathers += re.findall(r"\b([a-z]+[0-9]+)\[", result)
  return dict(all_gather_dtypes=sorted(set(gathers)), collective_permutes=text.count("collective-permute"))


def run_case(jax, jnp, c) -> dict:
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh(tuple(c["mesh"].values()), tuple(c["mesh"]), axis_types=(AxisType.Auto,) * len(c["mesh"]))
  cp = c["mesh"]["context"]
  b, t, h, d = 2, c["t"], 4, 8
  seed = zlib.crc32(c["name"].encode()) % 1000
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, h, d))
  k, v = (jax.random.normal(x, (b, t, c["hkv"], d)) for x in ks[1:])
  seg = pos = None
  if c["packed"] == "legal":
    seg, pos = legal_layout(np.random.default_rng(seed), b, t)
  elif c["packed"]:
    seg, pos = _packing(b, t, cp, seed)
  mask = MASKS[c["mask"]]
  if c["backend"] == "splash" and c["mask"] == "local":
    mask = flaxattn.Local(100)  # a window spanning several 128-token blocks
  cpar = flaxattn.ContextParallel(strategy=c["strategy"], load_balance=c["lb"])
  lb = lambda x: x if x is None else flaxattn.load_balance(x, cp)
  batch = "data" if "data" in c["mesh"] else None
  shard = lambda x: x if x is None else jax.device_put(x, NamedSharding(mesh, P(batch, "context")))

  def reference(q, k, v, seg, pos):
    return flaxattn.attention(q, k, v, mask=mask, segment_ids=seg, positions=pos, scale=0.3,
                              backend="reference", return_lse=True)

  def parallel(q, k, v, seg, pos):
    return flaxattn.attention(q, k, v, mask=mask, segment_ids=seg, positions=pos, scale=0.3,
                              context_parallel=cpar, return_lse=True, backend=c["backend"])

  if c["pipeline"]:
    # The data pipeline: every per-token array of the unpermuted batch goes through
    # load_balance, the result through unload_balance; the reference never sees a permutation.
    want = _loss_fn(jax, jnp, lambda q, k, v: reference(q, k, v, seg, pos))(q, k, v)
    un = lambda x: flaxattn.unload_balance(x, cp)
    with jax.set_mesh(mesh):
      got = _loss_fn(jax, jnp, lambda q, k, v: tuple(map(un, parallel(
          shard(lb(q)), shard(lb(k)), shard(lb(v)), shard(lb(seg)), shard(lb(pos))))))(q, k, v)
  else:
    if c["packed"] and c["lb"]:
      seg, pos = lb(seg), lb(pos)  # what a load-balanced pipeline feeds in
    # Default positions under load balancing are the permuted token indices.
    ref_pos = pos if pos is not None or not c["lb"] else lb(np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)))
    want = _loss_fn(jax, jnp, lambda q, k, v: reference(q, k, v, seg, ref_pos))(q, k, v)
    with jax.set_mesh(mesh):
      args = shard(q), shard(k), shard(v)
      # Compiled once, run and inspected: the program of the case is the one checked.
      compiled = _loss_fn(jax, jnp, lambda q, k, v: parallel(q, k, v, shard(seg), shard(pos))).lower(
          *args).compile()
      got = compiled(*args)
      hlo = _hlo_collectives(compiled.as_text())
  (gq, gk, gv), (go, gl) = got
  (wq, wk, wv), (wo, wl) = want
  return dict(name=c["name"], out=_rel(go, wo), lse=_rel(gl, wl), dq=_rel(gq, wq), dk=_rel(gk, wk),
              dv=_rel(gv, wv), out_spec=list(go.sharding.spec), **({} if c["pipeline"] else hlo))


def layer(jax, jnp) -> dict:
  """The layer with and without context parallelism on a 4-device context mesh, jitted, under
  the default sharding rules, fed through load_balance / unload_balance."""
  from flax import nnx
  from jax.sharding import AxisType
  b, t, e, cp = 2, 64, 16, 4
  x = jax.random.normal(jax.random.key(0), (b, t, e))
  seg, pos = _packing(b, t, cp, 0)
  # Same seed, same parameters; the plain layer runs the cheap-to-compile reference kernel.
  make = lambda cpar, backend="auto": flaxattn.MultiHeadAttention(
      4, e, num_kv_heads=2, rope=flaxattn.RoPE(), context_parallel=cpar, backend=backend,
      rngs=nnx.Rngs(0))
  lb = lambda a: flaxattn.load_balance(a, cp)
  plain = make(None, "reference")
  want_packed = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p))(plain, x, seg, pos)
  want_default = nnx.jit(lambda m, x: m(x))(plain, x)
  mesh = jax.make_mesh((cp,), ("context",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(flaxattn.sharding.rules(mesh, kv_heads=2)):
    m = nnx.jit(lambda: make(flaxattn.ContextParallel()))()
    call = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p))
    got_packed = flaxattn.unload_balance(call(m, lb(x), lb(seg), lb(pos)), cp)
    # Default positions: the layer's RoPE and the mask must both use the permuted indices.
    got_default = flaxattn.unload_balance(nnx.jit(lambda m, x: m(x))(m, lb(x)), cp)
  return dict(packed=_rel(got_packed, want_packed), default=_rel(got_default, want_default))


def splash_sharded(jax, jnp) -> dict:
  """Splash without context parallelism on a (data, fsdp, tensor) mesh: it runs per batch and
  head shard (shard_map), so nothing floating-point is gathered; fwd and grads vs reference."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  b, t, h, hkv, d = 4, 256, 4, 2, 8
  ks = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(ks[0], (b, t, h, d))
  k, v = (jax.random.normal(x, (b, t, hkv, d)) for x in ks[1:])
  seg, pos = random_packing(np.random.default_rng(7), b, t, max_docs=4, pad_tail=5)
  attend = lambda backend: lambda q, k, v: flaxattn.attention(
      q, k, v, segment_ids=seg, positions=pos, backend=backend, return_lse=True)
  want = _loss_fn(jax, jnp, attend("reference"))(q, k, v)
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
  with jax.set_mesh(mesh):
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")))
    args = shard(q), shard(k), shard(v)
    compiled = _loss_fn(jax, jnp, attend("splash")).lower(*args).compile()
    (gq, gk, gv), (go, gl) = compiled(*args)
    hlo = _hlo_collectives(compiled.as_text())
  (wq, wk, wv), (wo, wl) = want
  return dict(out=_rel(go, wo), lse=_rel(gl, wl), dq=_rel(gq, wq), dk=_rel(gk, wk), dv=_rel(gv, wv),
              out_spec=[str(a) for a in go.sharding.spec], **hlo)


def distributed(port: int, process_id: int) -> dict:
  """One of two processes with two CPU devices each: ring attention over a 4-device mesh that
  spans both, checked on this process's shards against the reference computed locally."""
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # before initialize
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, initialization_timeout=120)
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
  b, t, cp = 2, 64, 4
  rng = np.random.default_rng(0)  # the same data in both processes
  q = rng.standard_normal((b, t, 4, 8), np.float32)
  k, v = rng.standard_normal((2, b, t, 2, 8), np.float32)
  seg, pos = (np.asarray(flaxattn.load_balance(a, cp)) for a in _packing(b, t, cp, 0))
  mask = flaxattn.Causal()

  def attend(**kw):
    return lambda q, k, v: flaxattn.attention(q, k, v, mask=mask, segment_ids=seg, positions=pos,
                                              return_lse=True, **kw)

  want = _loss_fn(jax, jnp, attend(backend="reference"))(q, k, v)  # local devices only
  mesh = jax.make_mesh((cp,), ("context",), axis_types=(AxisType.Auto,))
  sharding = NamedSharding(mesh, P(None, "context"))
  glob = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])
  with jax.set_mesh(mesh):
    got = _loss_fn(jax, jnp, attend(context_parallel=flaxattn.ContextParallel()))(glob(q), glob(k), glob(v))
  errors, shards = {}, 0
  for name, g, w in zip(["dq", "dk", "dv", "out", "lse"], [*got[0], *got[1]], [*want[0], *want[1]]):
    for shard in g.addressable_shards:
      shards += 1
      errors[name] = max(errors.get(name, 0.0), _rel(shard.data, np.asarray(w)[shard.index]))
  return dict(process=jax.process_index(), shards=shards, **errors)


def main(n: int):
  import jax
  import jax.numpy as jnp
  assert jax.device_count() == n, jax.devices()
  for c in cases(n):
    print("CASE " + json.dumps(run_case(jax, jnp, c)), flush=True)
  if n == 4:
    print("LAYER " + json.dumps(layer(jax, jnp)), flush=True)
  if n == 8:
    print("SPLASH " + json.dumps(splash_sharded(jax, jnp)), flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "dist":
    print("DIST " + json.dumps(distributed(int(sys.argv[2]), int(sys.argv[3]))), flush=True)
  else:
    main(int(sys.argv[1]))
