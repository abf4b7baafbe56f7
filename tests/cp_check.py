"""Context-parallel checks on simulated CPU devices, which test_context_parallel.py runs in
process on the first devices of the 8 that conftest.py makes.

`run_case` runs one case of `helpers.cp_cases(N)`: the largest error of the output, lse and
dq/dk/dv against `backend="reference"` without context parallelism, relative to the largest
reference magnitude, and the collectives of the compiled program. `layer`, `model`,
`splash_sharded` and `window_traffic` check the layer, a model, splash on a 3-D mesh and the
bytes the windowed ring moves.

`python tests/cp_check.py dist PORT I` (two processes, 2 devices each: the process boundary is
the point) prints a `DIST` line per strategy.
"""

from __future__ import annotations

import json
import math
import re
import sys
import zlib

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flaxattn
import helpers
from helpers import CP_MASKS, grads_of, legal_layout, normal, qkv, random_packing, rel_error


def mesh_of(axes: dict[str, int]) -> jax.sharding.Mesh:
  """A mesh of `axes` (automatic sharding) on the first devices of this process."""
  return helpers.mesh(axes)

def _hlo_collectives(text: str) -> dict:
  """Result dtypes of every all-gather op line, the numbers of collective-permutes and
  all-to-alls, and the bytes of the largest collective-permute."""
  gathers = []
  for line in text.splitlines():
    if "all-gather(" in line or "all-gather-start(" in line:
      result = line.split("=", 1)[1].split("all-gather")[0]  # e.g. " f32[2,64,2,8]{3,2,1,0} "
      gathers += re.findall(r"\b([a-z]+[0-9]+)\[", result)
  return dict(all_gather_dtypes=sorted(set(gathers)),
              collective_permutes=text.count("collective-permute"),
              largest_permute=max(permute_bytes(text)["each"], default=0),
              all_to_alls=len(re.findall(r"\sall-to-all(?:-start)?\(", text)))


def permute_bytes(text: str) -> dict:
  """Bytes the collective-permutes of a compiled (per-device) program move, per result dtype,
  their number and each one's bytes (`each`)."""
  sizes = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1}
  moved, count, each = {}, 0, []
  for line in text.splitlines():
    if " collective-permute(" not in line and " collective-permute-start(" not in line:
      continue
    count += 1
    result = line.split("=", 1)[1].split("collective-permute")[0]
    dtype, dims = re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", result)[-1]
    each.append(sizes[dtype] * int(np.prod([int(x) for x in dims.split(",") if x])))
    moved[dtype] = moved.get(dtype, 0) + each[-1]
  return dict(permutes=count, bytes=moved, each=each)


def window_traffic(n: int) -> list[dict]:
  """What the ring moves per device, fwd+bwd, for windowed and chunked masks next to a causal
  mask, from the compiled programs (B=1, T=128n, 2 KV heads, D=8, float32, default positions)."""
  b, t, h, hkv, d = 1, 128 * n, 4, 2, 8
  q, k, v = qkv(3, b, t, t, h, hkv, d)
  mesh = mesh_of(dict(context=n))
  rows = []
  for lb in (True, False):
    for name, mask in (("causal", flaxattn.Causal()), ("local16", flaxattn.Local(16)),
                       ("chunked16", flaxattn.Chunked(16)), ("local100", flaxattn.Local(100)),
                       ("local300", flaxattn.Local(300))):
      cpar = flaxattn.ContextParallel(load_balance=lb)
      fn = grads_of(lambda q, k, v: flaxattn.attention(
          q, k, v, mask=mask, context_parallel=cpar,  # noqa: B023 (used in this iteration)
          backend="blockwise", return_lse=True))
      with jax.set_mesh(mesh):
        def shard(x):
          return jax.device_put(x, NamedSharding(mesh, P(None, "context")))
        text = fn.lower(shard(q), shard(k), shard(v)).compile().as_text()
      rows.append(dict(mask=name, lb=lb, t=t, hkv=hkv, d=d, **permute_bytes(text)))
  return rows


NAMES = ("dq", "dk", "dv", "out", "lse")  # the leaves of what `grads_of` returns, in order
FEATURE_NAMES = ("dq", "dk", "dv", "dsinks", "out", "lse")  # ... with the sinks' gradient


def _errors(got, want) -> dict:
  """`rel_error` of each of dq, dk, dv, (dsinks,) out and lse: `got` and `want` as `grads_of`
  returns them."""
  leaves = jax.tree.leaves(got)
  names = NAMES if len(leaves) == len(NAMES) else FEATURE_NAMES
  return {n: rel_error(g, w) for n, g, w in zip(names, leaves, jax.tree.leaves(want), strict=True)}


def run_case(c) -> dict:
  mesh = mesh_of(c["mesh"])
  ring_axis = "context_ring" if "context_ring" in c["mesh"] else None
  cpar = flaxattn.ContextParallel(strategy=c["strategy"], load_balance=c["lb"], ring_axis=ring_axis,
                                  head_groups=c.get("groups"))
  cp = cpar.balanced_shards(mesh) if c["lb"] else mesh.shape["context"]  # load_balance's shards
  shards = math.prod(mesh.shape[a] for a in cpar.seq_axes)
  b, t, h, d = 2, c["t"], c["h"], 8
  seed = zlib.crc32(c["name"].encode()) % 1000
  q, k, v = qkv(seed, b, t, t, h, c["hkv"], d, c["dtype"])
  # Sinks, soft cap and a value head dim of 12 (neither 8 nor a multiple of it) together.
  extra = {}
  if c["features"]:
    v = normal((b, t, c["hkv"], 12), (seed, 9), c["dtype"])
    extra = dict(sinks=normal((h,), (seed, 7)), logit_soft_cap=1.5)
  seg = pos = None
  if c["packed"] == "legal":
    seg, pos = legal_layout(seed, b, t)
  elif c["packed"]:
    seg, pos = random_packing(seed, b, t, max_docs=8, pad_tail=3, cp=shards)
  mask = CP_MASKS[c["mask"]]
  if c["backend"] == "splash" and c["mask"] == "local":
    mask = flaxattn.Local(100)  # a window spanning several 128-token blocks
  def lb(x):
    return x if x is None else flaxattn.load_balance(x, cp)
  batch = "data" if "data" in c["mesh"] else None
  seq = cpar.seq_axes if ring_axis else "context"
  def shard(x):
    return x if x is None else jax.device_put(x, NamedSharding(mesh, P(batch, seq)))

  def reference(q, k, v, seg, pos, sinks=None):
    return flaxattn.attention(q, k, v, mask=mask, segment_ids=seg, positions=pos, scale=0.3,
                              backend="reference", return_lse=True,
                              **{**extra, **({} if sinks is None else dict(sinks=sinks))})

  def parallel(q, k, v, seg, pos, sinks=None):
    return flaxattn.attention(q, k, v, mask=mask, segment_ids=seg, positions=pos, scale=0.3,
                              context_parallel=cpar, return_lse=True, backend=c["backend"],
                              **{**extra, **({} if sinks is None else dict(sinks=sinks))})

  if c["pipeline"]:
    # The data pipeline: every per-token array of the unpermuted batch goes through
    # load_balance, the result through unload_balance; the reference never sees a permutation.
    want = grads_of(lambda q, k, v: reference(q, k, v, seg, pos))(q, k, v)
    def un(x):
      return flaxattn.unload_balance(x, cp)
    with jax.set_mesh(mesh):
      got = grads_of(lambda q, k, v: tuple(map(un, parallel(
          shard(lb(q)), shard(lb(k)), shard(lb(v)), shard(lb(seg)), shard(lb(pos))))))(q, k, v)
  else:
    if c["packed"] and c["lb"]:
      seg, pos = lb(seg), lb(pos)  # what a load-balanced pipeline feeds in
    # Default positions under load balancing are the permuted token indices.
    ref_pos = (pos if pos is not None or not c["lb"]
               else lb(np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))))
    # With sinks, their gradient too: a replicated [H] array, summed over the context shards.
    n_args = 4 if c["features"] else 3
    sinks = (extra["sinks"],) if c["features"] else ()
    want = grads_of(lambda q, k, v, *s: reference(q, k, v, seg, ref_pos, *s),
                    n_args)(q, k, v, *sinks)
    with jax.set_mesh(mesh):
      args = shard(q), shard(k), shard(v), *sinks
      # Compiled once, run and inspected: the program of the case is the one checked.
      compiled = grads_of(lambda q, k, v, *s: parallel(q, k, v, shard(seg), shard(pos), *s),
                          n_args).lower(*args).compile()
      got = compiled(*args)
      hlo = _hlo_collectives(compiled.as_text())
  return dict(name=c["name"], **_errors(got, want), out_spec=list(got[1][0].sharding.spec),
              **({} if c["pipeline"] else hlo))


def layer() -> dict:
  """The layer with and without context parallelism on a 4-device context mesh, jitted, under
  the default sharding rules, fed through load_balance / unload_balance."""
  from flax import nnx
  b, t, e, cp = 2, 64, 16, 4
  x = normal((b, t, e))
  seg, pos = random_packing(0, b, t, max_docs=8, pad_tail=3, cp=cp)
  # Same seed, same parameters; the plain layer runs the cheap-to-compile reference kernel.
  def make(cpar, backend="auto"):
    return flaxattn.MultiHeadAttention(
        4, e, num_kv_heads=2, rope=flaxattn.RoPE(), context_parallel=cpar, backend=backend,
        rngs=nnx.Rngs(0))
  def lb(a):
    return flaxattn.load_balance(a, cp)
  plain = make(None, "reference")
  want_packed = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p))(plain, x, seg, pos)
  want_default = nnx.jit(lambda m, x: m(x))(plain, x)
  mesh = mesh_of(dict(context=cp))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(flaxattn.sharding.rules(mesh, kv_heads=2)):
    m = nnx.jit(lambda: make(flaxattn.ContextParallel()))()
    call = nnx.jit(lambda m, x, s, p: m(x, segment_ids=s, positions=p))
    got_packed = flaxattn.unload_balance(call(m, lb(x), lb(seg), lb(pos)), cp)
    # Default positions: the layer's RoPE and the mask must both use the permuted indices.
    got_default = flaxattn.unload_balance(nnx.jit(lambda m, x: m(x))(m, lb(x)), cp)
  return dict(packed=rel_error(got_packed, want_packed),
              default=rel_error(got_default, want_default))


def model() -> dict:
  """A small Llama with alternating sliding-window and global layers, attention sinks and a
  logit soft cap, ring over a 4-device context mesh (load-balanced packed rows in, logits
  out through unload_balance), against the same model without context parallelism:
  logits and the gradients of every parameter (sinks included)."""
  import jax.numpy as jnp
  from flax import nnx

  from models import llama
  b, t, cp = 2, 64, 4
  config = llama.LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=64, max_seq_len=t, sliding_window=6, global_every=2,
                             attention_sinks=True, logit_soft_cap=2.0)
  tokens = np.random.default_rng(0).integers(0, 64, (b, t), dtype=np.int32)
  seg, pos = random_packing(1, b, t, max_docs=6, pad_tail=3, cp=cp)

  def make(cpar):
    m = llama.Llama(config, context_parallel=cpar, rngs=nnx.Rngs(0))
    for i, block in enumerate(m.layers):
      block.attn.sinks[...] = normal((4,), (i, 5))  # not the zeros of a fresh model
    return m

  def logits_and_grads(m, tokens, seg, pos, un=lambda x: x):
    def loss(m):
      logits = un(m(tokens, segment_ids=seg, positions=pos))
      return jnp.sum(jnp.sin(logits)), logits
    grads, logits = nnx.grad(loss, has_aux=True)(m)
    return logits, nnx.to_pure_dict(grads)

  want = nnx.jit(logits_and_grads)(make(None), tokens, seg, pos)
  def lb(a):
    return flaxattn.load_balance(a, cp)
  def un(a):
    return flaxattn.unload_balance(a, cp)
  mesh = mesh_of(dict(context=cp))
  with jax.set_mesh(mesh):
    got = nnx.jit(lambda m, *a: logits_and_grads(m, *a, un=un))(
        make(flaxattn.ContextParallel()), lb(tokens), lb(seg), lb(pos))
  sinks = [(g["attn"]["sinks"], w["attn"]["sinks"]) for g, w in
           zip(got[1]["layers"].values(), want[1]["layers"].values(), strict=True)]
  return dict(logits=rel_error(got[0], want[0]),
              grads=max(rel_error(g, w) for g, w in zip(jax.tree.leaves(got[1]),
                                                        jax.tree.leaves(want[1]), strict=True)),
              dsinks=max(rel_error(g, w) for g, w in sinks),
              dsinks_nonzero=min(float(np.abs(w).max()) for _, w in sinks))


def splash_sharded() -> dict:
  """Splash without context parallelism on a (data, fsdp, tensor) mesh: it runs per batch and
  head shard (shard_map), so nothing floating-point is gathered; fwd and grads vs reference."""
  b, t, h, hkv, d = 4, 256, 4, 2, 8
  q, k, v = qkv(7, b, t, t, h, hkv, d)
  seg, pos = random_packing(7, b, t, max_docs=4, pad_tail=5)
  def attend(backend):
    return lambda q, k, v: flaxattn.attention(
        q, k, v, segment_ids=seg, positions=pos, backend=backend, return_lse=True)
  want = grads_of(attend("reference"))(q, k, v)
  mesh = mesh_of(dict(data=2, fsdp=2, tensor=2))
  with jax.set_mesh(mesh):
    def shard(x):
      return jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")))
    args = shard(q), shard(k), shard(v)
    compiled = grads_of(attend("splash")).lower(*args).compile()
    got = compiled(*args)
    hlo = _hlo_collectives(compiled.as_text())
  return dict(**_errors(got, want), out_spec=[str(a) for a in got[1][0].sharding.spec], **hlo)


def distributed(port: int, process_id: int) -> list[dict]:
  """One of two processes with two CPU devices each: ring, all-gather, Ulysses and Ulysses x
  ring (ring across the processes, Ulysses inside each) over a 4-device mesh that spans
  both, checked on this process's shards against the reference computed locally."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # before initialize
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, initialization_timeout=120)
  assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
  b, t = 2, 64
  q, k, v = map(np.asarray, qkv(0, b, t, t, 4, 2, 8))  # the same data in both processes
  packing = random_packing(0, b, t, max_docs=8, pad_tail=3, cp=4)
  mask = flaxattn.Causal()
  results = []
  for name, mesh_axes, cpar in [
      ("ring", dict(context=4), flaxattn.ContextParallel()),
      ("all_gather", dict(context=4), flaxattn.ContextParallel(strategy="all_gather")),
      ("ulysses", dict(context=4), flaxattn.ContextParallel(strategy="ulysses")),
      ("ulysses_ring", dict(context_ring=2, context=2),
       flaxattn.ContextParallel(strategy="ulysses", ring_axis="context_ring"))]:
    mesh = jax.make_mesh(tuple(mesh_axes.values()), tuple(mesh_axes),
                         axis_types=(AxisType.Auto,) * len(mesh_axes))
    seg, pos = (np.asarray(flaxattn.load_balance(a, cpar.balanced_shards(mesh))) for a in packing)

    def attend(**kw):
      return lambda q, k, v: flaxattn.attention(
          q, k, v, mask=mask, segment_ids=seg, positions=pos,  # noqa: B023 (used in this iteration)
          return_lse=True, **kw)

    want = grads_of(attend(backend="reference"))(q, k, v)  # local devices only
    sharding = NamedSharding(mesh, P(None, cpar.seq_axes))
    def glob(a):
      return jax.make_array_from_callback(a.shape, sharding,  # noqa: B023 (used in this iteration)
                                          lambda i: a[i])
    with jax.set_mesh(mesh):
      got = grads_of(attend(context_parallel=cpar))(glob(q), glob(k), glob(v))
    errors, shards = {}, 0
    for key, g, w in zip(NAMES, jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      for shard in g.addressable_shards:
        shards += 1
        errors[key] = max(errors.get(key, 0.0), rel_error(shard.data, np.asarray(w)[shard.index]))
    results.append(dict(strategy=name, process=jax.process_index(), shards=shards, **errors))
  return results


if __name__ == "__main__":
  assert sys.argv[1] == "dist", sys.argv
  for r in distributed(int(sys.argv[2]), int(sys.argv[3])):
    print("DIST " + json.dumps(r), flush=True)
