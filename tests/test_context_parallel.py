"""Context parallelism: ring, all-gather, Ulysses and Ulysses x ring attention on simulated
CPU devices, load balancing.

Multi-device checks run in process on the first n of the 8 devices conftest.py makes (the
checks themselves are in cp_check.py); only the two-process check starts processes.
"""

import functools
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import portpicker
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh

import cp_check
import flaxattn
import mod_gallery
from flaxattn import context_parallel
from helpers import (
  CP_BF16_TOL,
  as_layout,
  cp_cases,
  dense_oracle,
  grads_of,
  normal,
  qkv,
  random_packing,
  rel_error,
)
from helpers import mesh as helpers_mesh

TOL = 1e-5  # float32, relative to the largest reference magnitude
SCRIPT = os.path.join(os.path.dirname(__file__), "cp_check.py")
TIMEOUT = 600  # a hang (e.g. a collective waiting on a dead peer) fails instead of blocking CI
CASES = [(n, c["name"]) for n in (2, 4, 8) for c in cp_cases(n)]
# Each case compiles a sharded program and its gradient (seconds to a minute on 2 cores):
# the quick tier keeps the 2-device cases without splash (interpret mode), the slow tier
# has the rest.
SLOW = {name for n, name in CASES if n > 2 or name.startswith("splash")}


@functools.cache
def _case(n, name) -> dict:
  """One case of `cp_cases(n)`, run once per process (several tests read the same one)."""
  return cp_check.run_case({c["name"]: c for c in cp_cases(n)}[name])


@pytest.fixture(scope="module")
def two_processes():
  """Two processes of 2 devices each, one mesh across both: the process boundary is what
  this checks, so it stays a pair of subprocesses."""
  port = portpicker.pick_unused_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, SCRIPT, "dist", str(port), str(i)], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
           for i in range(2)]
  try:
    yield [r for p in procs for r in _finish(p)]
  finally:
    for p in procs:
      if p.poll() is None:  # a test failed before reading it
        p.kill()
        p.wait()


def _finish(proc) -> list[dict]:
  try:
    out, err = proc.communicate(timeout=TIMEOUT)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    pytest.fail(f"subprocess timed out after {TIMEOUT} s:\n{out[-2000:]}\n{err[-3000:]}")
  assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
  return [json.loads(line[len("DIST "):]) for line in out.splitlines() if line.startswith("DIST {")]


def _errors(r) -> dict:
  return {k: r[k] for k in ("out", "lse", "dq", "dk", "dv", "dsinks") if k in r}


def test_every_listed_case_is_collected():
  """Each case `cp_cases` lists has a name of its own, so none hides another, and is one of
  the parametrized cases below (a case the parametrization missed would never run)."""
  for n in (2, 4, 8):
    names = [c["name"] for c in cp_cases(n)]
    assert len(set(names)) == len(names), names
  (params,) = [m.args[1] for m in test_matches_reference_forward_and_gradients.pytestmark
               if m.name == "parametrize"]
  assert [tuple(p.values) for p in params] == CASES
  # The count of cases, so that one a comment or an edit swallows fails here.
  assert len(CASES) == 49


@pytest.mark.parametrize("n,name", [
    pytest.param(n, name, marks=[pytest.mark.slow] * (name in SLOW)) for n, name in CASES])
def test_matches_reference_forward_and_gradients(n, name):
  r = _case(n, name)
  errors = _errors(r)
  assert ("dsinks" in errors) == ("sinks" in name), errors
  assert max(errors.values()) < (CP_BF16_TOL if name.endswith("bfloat16") else TOL), errors
  if not name.endswith("pipeline"):  # the output stays sequence-sharded
    assert r["out_spec"][1] == (("context_ring", "context") if "context_ring" in name
                                else "context")


@pytest.mark.slow
def test_ring_program_passes_kv_with_collective_permute_not_all_gather():
  for name in ["ring-lb-causal-hkv2-packed-context4", "ring-nolb-causal-hkv1-default-context4"]:
    r = _case(4, name)
    assert r["collective_permutes"] > 0, r
    # Integer all-gathers (of per-block ids) would be cheap; gathering K/V would make it O(T).
    assert not {"f32", "bf16", "f16"} & set(r["all_gather_dtypes"]), r
  # The same parse does see K/V gathered in the baseline's program, so the check can fail.
  assert "f32" in _case(4, "all_gather-lb-causal-hkv2-packed-context4")["all_gather_dtypes"]


@pytest.mark.slow
def test_windowed_ring_moves_only_the_neighbouring_keys():
  """Local(16) and Chunked(16) reach one chunk back: load balanced, the ring fetches half a
  shard of K and of V from each neighbour (and sends their gradients back), contiguous one
  whole shard from the previous device; a window of 300 spans three contiguous shards, one
  of 100 two load-balanced chunks (two whole shards from each side). Per
  device, fwd+bwd, from the compiled programs at cp=8; outside any loop, so the bytes of
  each collective-permute are what moves."""
  rows = {(r["mask"], r["lb"]): r for r in cp_check.window_traffic(8)}
  r = rows["causal", True]
  shard = r["t"] // 8 * r["hkv"] * r["d"] * 4  # bytes of K (or V) on one device
  # K and V, there and back: 2 halves (balanced), 1 or 3 shards (contiguous).
  # Local(100) reaches 2 load-balanced chunks of 64: the whole shards of 2 devices each side.
  for (mask, lb), shards in {("local16", True): 1, ("chunked16", True): 1, ("local16", False): 1,
                             ("chunked16", False): 1, ("local300", False): 3,
                             ("local100", True): 4}.items():
    assert rows[mask, lb]["bytes"]["f32"] == 2 * 2 * shards * shard, (mask, lb, rows[mask, lb])
  # The causal ring (and a window longer than a chunk) permutes inside its loop over 7 steps.
  assert rows["local300", True]["bytes"] == rows["causal", True]["bytes"]


def test_ring_head_groups_send_one_group_of_heads_at_a_time():
  """head_groups=2 (B=2, 32 tokens per device, 2 K/V heads, D=8, Dv=12, float32): the
  largest transfer is the travelling dK/dV of one K/V head, half of all heads' buffer."""
  r = _case(2, "ring-lb-causal-hkv2-packed-context2-sinks-cap-dv-groups2")
  assert r["largest_permute"] == 2 * 32 * 1 * (8 + 12) * 4, r


def test_ring_head_groups_are_chosen_by_rows_per_group():
  cp = flaxattn.ContextParallel()
  choose = functools.partial(context_parallel.ring_head_groups, cp)
  # Up to 4 groups dividing the K/V heads, each of at least 65536 query rows per device.
  assert choose(32768, 16, 8) == 4 and choose(16384, 16, 8) == 4
  assert choose(8192, 16, 8) == 2 and choose(4096, 16, 8) == 1
  assert choose(32768, 12, 3) == 3 and choose(32768, 16, 1) == 1  # MQA: one group
  assert choose(1 << 20, 32, 8) == 4
  # What a call gets, and explain says: 32 query heads over 2 tensor shards; the ring over
  # "context" holds 16384 tokens and 16 query heads a device (4 groups), Ulysses x ring's
  # ring 16384 tokens and 8 query heads (2 groups of 65536 rows).
  mesh = helpers_mesh({"tensor": 2, "context_ring": 2, "context": 2})
  q = jax.ShapeDtypeStruct((1, 32768, 32, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 32768, 16, 128), jnp.bfloat16)
  for context, groups in [(flaxattn.ContextParallel(), 4),
                          (flaxattn.ContextParallel(strategy="ulysses", ring_axis="context_ring"),
                           2)]:
    with jax.set_mesh(mesh):
      said = flaxattn.explain(q, k, k, context_parallel=context, print_fn=None)
    assert context_parallel.head_groups_for(context, q.shape, k.shape, mesh) == groups
    assert (f"ring: the heads go round in {groups} groups, one after the other; a device holds"
            " one group's K/V blocks and gradient sums at a time (head_groups=None: chosen for"
            " these shapes)") in said, said
  fixed = functools.partial(context_parallel.ring_head_groups,
                            flaxattn.ContextParallel(head_groups=2))
  assert fixed(64, 4, 2) == 2
  with pytest.raises(ValueError, match=r"ContextParallel\(head_groups=2\) expects a divisor of"
                                       r" the 3 K/V heads each device's ring holds, got 2;"
                                       r" pass one of \[1, 3\] or None"):
    fixed(64, 6, 3)


@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "2"])
def test_head_groups_takes_none_or_a_positive_int(bad):
  with pytest.raises(ValueError, match=r"ContextParallel\(head_groups=\.\.\.\) expects None"
                                       rf" \(chosen per call\) or a positive int .*got"
                                       rf" {re.escape(repr(bad))}"):
    flaxattn.ContextParallel(head_groups=bad)


@pytest.mark.slow
def test_ring_keeps_batch_sharded_over_data():
  r = _case(4, "ring-lb-causal-hkv1-default-data2xcontext2")
  assert r["out_spec"] == ["data", "context"] and "f32" not in r["all_gather_dtypes"], r


@pytest.mark.slow
def test_ulysses_program_moves_qkv_with_all_to_all_not_all_gather():
  # q, k, v, out and lse each take one all-to-all forward and one backward; ids (int32)
  # may be gathered, floating-point values never. The ring inside the 2-D hybrid permutes.
  for n, name in [(2, "ulysses-lb-causal-hkv1-packed-context2"),
                  (4, "ulysses-lb-chunked-hkv2-packed-context4"),
                  (8, "ulysses-lb-local-hkv2-packed-data2xtensor2xcontext2"),
                  (4, "ulysses-lb-causal-hkv2-packed-context_ring2xcontext2"),
                  (8, "ulysses-lb-causal-hkv1-packed-context_ring2xcontext4")]:
    r = _case(n, name)
    assert r["all_to_alls"] >= 10 and set(r["all_gather_dtypes"]) <= {"s32"}, r
    assert (r["collective_permutes"] > 0) == ("context_ring" in name), r
  # Batch and heads stay sharded over data and tensor.
  assert _case(8, "ulysses-lb-local-hkv2-packed-data2xtensor2xcontext2")["out_spec"] == [
      "data", "context", "tensor"]


@pytest.mark.slow
def test_layer_matches_without_context_parallel():
  # Inputs through load_balance, output through unload_balance, vs. the plain layer on the
  # unpermuted inputs: with packed positions, and with default ones (RoPE must permute too).
  r = cp_check.layer()
  assert r["packed"] < TOL and r["default"] < TOL, r


@pytest.mark.slow
def test_model_with_windows_sinks_and_soft_cap_matches_without_context_parallel():
  r = cp_check.model()
  assert r["logits"] < TOL and r["grads"] < 1e-4 and r["dsinks"] < 1e-4, r
  assert r["dsinks_nonzero"] > 0, r


@pytest.mark.slow
def test_two_processes_two_devices_each(two_processes):
  # Each process checks its own shards of out, lse, dq, dk, dv: 5 arrays x 2 local devices,
  # for each strategy.
  results = two_processes
  assert sorted((r["strategy"], r["process"]) for r in results) == [
      (s, p) for s in sorted(("ring", "all_gather", "ulysses", "ulysses_ring")) for p in (0, 1)]
  for r in results:
    assert r["shards"] == 10 and max(_errors(r).values()) < TOL, r


# Load balancing: exact layout, round trips, no gather, errors.


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_load_balance_layout(cp):
  chunk = 3
  t = 2 * cp * chunk
  x = np.arange(t)[None]
  got = np.asarray(flaxattn.load_balance(x, cp))
  chunks = x[0].reshape(2 * cp, chunk)
  for r in range(cp):  # shard r of cp holds chunks r and 2cp-1-r, each in order
    np.testing.assert_array_equal(got[0, r * 2 * chunk:(r + 1) * 2 * chunk],
                                  np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]))
  np.testing.assert_array_equal(flaxattn.unload_balance(got, cp), x)


@pytest.mark.parametrize("shape,axis",
                         [((2, 24), 1), ((2, 24, 3, 4), 1), ((24, 5), 0), ((2, 3, 24), -1)])
def test_load_balance_round_trip(shape, axis):
  x = np.asarray(normal(shape))
  y = flaxattn.load_balance(x, 3, axis=axis)
  assert y.shape == x.shape and not np.array_equal(y, x)
  np.testing.assert_array_equal(flaxattn.unload_balance(y, 3, axis=axis), x)
  # Along `axis` it is a permutation of whole slices: the other axes are untouched.
  moved = np.moveaxis(np.asarray(y), axis, 0)
  perm = np.asarray(flaxattn.load_balance(np.arange(shape[axis]), 3, axis=0))
  np.testing.assert_array_equal(moved, np.moveaxis(x, axis, 0)[perm])


@pytest.mark.parametrize("fn", [flaxattn.load_balance, flaxattn.unload_balance])
def test_load_balance_compiles_without_gather(fn):
  x = jax.ShapeDtypeStruct((2, 64, 4, 8), jnp.float32)
  text = jax.jit(lambda x: fn(x, 4)).lower(x).compile().as_text()
  assert not re.findall(r"\s(?:all-)?gather\(", text)  # op names, not the metadata


def test_load_balance_errors():
  with pytest.raises(ValueError, match=r"divisible by 2 \* cp = 6"):
    flaxattn.load_balance(np.zeros((1, 10)), 3)
  with pytest.raises(ValueError, match=r"divisible by 2 \* cp = 4"):
    flaxattn.unload_balance(np.zeros((1, 6)), 2)
  for cp in (0, -2, 2.0, True, "2"):
    with pytest.raises(ValueError, match="cp expects a positive int"):
      flaxattn.load_balance(np.zeros((1, 8)), cp)


# Errors, checked by tracing under an abstract mesh: no devices needed.


def _trace(t, mesh_axes, **kw):
  q = jax.ShapeDtypeStruct((1, t, 2, 8), jnp.float32)
  def f(q):
    return flaxattn.attention(q, q, q, **kw)
  if mesh_axes is None:
    return jax.eval_shape(f, q)
  mesh = AbstractMesh(tuple(mesh_axes.values()), tuple(mesh_axes),
                      axis_types=(AxisType.Auto,) * len(mesh_axes))
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.eval_shape(f, q)


def test_errors():
  ring = flaxattn.ContextParallel()
  with pytest.raises(ValueError, match="needs a mesh"):
    _trace(16, None, context_parallel=ring)
  with pytest.raises(ValueError, match="'context' is not in the mesh; mesh axes are \\('data',\\)"):
    _trace(16, dict(data=2), context_parallel=ring)
  with pytest.raises(ValueError,
                     match=r"length \(12\) divisible by 8 \(2 x axis size, load balancing\)"):
    _trace(12, dict(context=4), context_parallel=ring)
  with pytest.raises(ValueError, match=r"length \(6\) divisible by 4\."):
    _trace(6, dict(context=4), context_parallel=flaxattn.ContextParallel(load_balance=False))
  with pytest.raises(ValueError, match=r"reference has no per-block passes for the ring strategy"):
    _trace(16, dict(context=4), context_parallel=ring, backend="reference")
  with pytest.raises(ValueError, match=r"strategy=\.\.\.\) expects one of \('ring', 'all_gather',"
                                       r" 'ulysses', 'auto'\), got 'bogus'"):
    flaxattn.ContextParallel(strategy="bogus")
  # The same shapes trace fine when they fit, so the errors above are not from elsewhere.
  assert _trace(16, dict(data=2, context=4), context_parallel=ring).shape == (1, 16, 2, 8)
  gather = flaxattn.ContextParallel(strategy="all_gather")
  assert _trace(16, dict(context=4), context_parallel=gather,
                backend="reference").shape == (1, 16, 2, 8)


def test_grad_dtype_takes_none_or_a_floating_dtype_as_precise_as_bfloat16():
  """float8 sums were accepted, and the gradients came out 4-21% off."""
  assert flaxattn.ContextParallel().grad_dtype == jnp.float32
  assert flaxattn.ContextParallel(grad_dtype="bfloat16").grad_dtype == jnp.bfloat16
  assert flaxattn.ContextParallel(grad_dtype=None).grad_dtype is None
  for good in (jnp.float16, "float32", np.float64):
    assert flaxattn.ContextParallel(grad_dtype=good).grad_dtype == jnp.dtype(good)
  for bad in ("int32", "bogus", 3, jnp.float8_e4m3fn, "float8_e5m2", jnp.float8_e3m4):
    with pytest.raises(ValueError, match=r"ContextParallel\(grad_dtype=\.\.\.\) expects None"
                                         rf" \(the inputs' dtype\) or a floating dtype.*got"
                                         rf" {re.escape(repr(bad))}"):
      flaxattn.ContextParallel(grad_dtype=bad)


@pytest.mark.slow  # 4 devices: the quick tier keeps 2-device cases
@pytest.mark.parametrize("mask", [flaxattn.Causal(), flaxattn.Local(40)], ids=["full", "window"])
def test_ring_with_grad_dtype_none_sums_gradients_in_the_inputs_dtype(mask):
  """bfloat16 inputs, 4 devices, load balanced: with grad_dtype=None the full ring sends its
  travelling dK/dV (one `[B, T/4, Hkv, 2 D]` buffer) in bfloat16 where the default sends
  float32, and the gradients of either ring (the window-aware one holds its sums in
  bfloat16 too) match the reference and the float32 sums within the bfloat16 tolerance.
  The program is read as lowered: the CPU compiler computes bfloat16 collectives in
  float32."""
  mesh = helpers_mesh({"context": 4})
  t, hkv, d = 512, 2, 64
  q, k, v = (flaxattn.load_balance(x, 4) for x in qkv(3, 1, t, t, 4, hkv, d, jnp.bfloat16))
  positions = flaxattn.load_balance(np.arange(t)[None], 4)

  def run(grad_dtype):
    context = flaxattn.ContextParallel(grad_dtype=grad_dtype)
    def attend(q, k, v):
      return flaxattn.attention(q, k, v, mask=mask, context_parallel=context, return_lse=True)
    with jax.set_mesh(mesh):
      grads = grads_of(attend)
      sent = re.findall(r"collective_permute.*?: \(tensor<([^>]*)>", grads.lower(q, k, v).as_text())
      said = flaxattn.explain(q, k, v, mask=mask, context_parallel=context, print_fn=None)
      sums = "bfloat16 (grad_dtype=None" if grad_dtype is None else "float32 (grad_dtype)"
      assert f"the ring sums dQ and the travelling dK/dV in {sums}" in said, said
      return set(sent), grads(q, k, v)[0]

  def reference(q, k, v):
    return flaxattn.attention(q, k, v, mask=mask, positions=positions, backend="reference",
                              return_lse=True)
  want = grads_of(reference)(*(x.astype(jnp.float32) for x in (q, k, v)))[0]
  (exact_sent, exact), (sent, got) = run(jnp.float32), run(None)
  for name, g, e, w in zip("qkv", got, exact, want, strict=True):
    assert g.dtype == jnp.bfloat16, name
    assert rel_error(g, w) < CP_BF16_TOL and rel_error(g, e) < CP_BF16_TOL, name
  dkv = f"1x{t // 4}x{hkv}x{2 * d}"
  if isinstance(mask, flaxattn.Causal):
    assert f"{dkv}xf32" in exact_sent and f"{dkv}xbf16" not in exact_sent, exact_sent
    assert f"{dkv}xbf16" in sent and not any(x.endswith("f32") for x in sent), sent
  else:  # partial gradients go home as the kernel made them, either way
    assert sent == exact_sent and not any(x.endswith("f32") for x in sent), sent


@pytest.mark.parametrize("value,kind", [(1, "int"), (1.0, "float"), (np.True_, "numpy.bool"),
                                        (0, "int"), (None, "NoneType")])
def test_load_balance_takes_exactly_true_false_or_document(value, kind):
  # 1 == True, but the kernels read the order by identity (`row_balanced`): a look-alike
  # would pass one test and fail the other, and the ring would read the order wrongly.
  with pytest.raises(TypeError, match=rf"load_balance=\.\.\.\) expects True \(row order\),"
                                      rf" False or 'document' .*, got {re.escape(repr(value))}"
                                      rf" \({kind}\); pass a Python bool"):
    flaxattn.ContextParallel(load_balance=value)
  assert [flaxattn.ContextParallel(load_balance=x).row_balanced
          for x in (True, False, "document")] == [True, False, False]


def test_ulysses_errors():
  ulysses = flaxattn.ContextParallel(strategy="ulysses")
  hybrid = flaxattn.ContextParallel(strategy="ulysses", ring_axis="context_ring")
  # 2 query heads do not split over 4 devices, nor 1 head per tensor shard over 2.
  with pytest.raises(ValueError, match=r"'ulysses' over 'context' \(size 4\) .* heads per device"
                                       r" \(2, of 2 K/V heads\) divisible by 4; use strategy='ring'"
                                       r" or 'all_gather'"):
    _trace(16, dict(context=4), context_parallel=ulysses)
  with pytest.raises(ValueError, match=r"heads per device \(1, of 1 K/V heads\) divisible by 2"):
    _trace(16, dict(tensor=2, context=2), context_parallel=ulysses)
  with pytest.raises(ValueError,
                     match=r"'context_ring' is not in the mesh.*ContextParallel\(ring_axis="):
    _trace(16, dict(context=2), context_parallel=hybrid)
  with pytest.raises(ValueError, match=r"length \(10\) divisible by 4 \(2 x 2 shards over"
                                       r" \('context_ring', 'context'\), each ring shard 2 chunks,"
                                       r" load balancing\)"):
    _trace(10, dict(context_ring=2, context=2), context_parallel=hybrid)
  with pytest.raises(ValueError, match=r"reference has no per-block passes for the ring strategy;"
                                       r" use strategy='ulysses' without ring_axis"):
    _trace(16, dict(context_ring=2, context=2), context_parallel=hybrid, backend="reference")
  with pytest.raises(ValueError, match=r"ring_axis='context_ring'\) runs a ring inside Ulysses and"
                                       r" expects strategy='ulysses' \(or 'auto'\), got 'ring'"):
    flaxattn.ContextParallel(ring_axis="context_ring")
  with pytest.raises(ValueError, match=r"ring_axis=\.\.\.\) expects None or a mesh axis name other"
                                       r" than axis='context', got 'context'"):
    flaxattn.ContextParallel(strategy="ulysses", ring_axis="context")
  # Fitting shapes trace; any kernel serves Ulysses alone (a plain call per device).
  assert _trace(16, dict(data=2, context=2), context_parallel=ulysses,
                backend="reference").shape == (1, 16, 2, 8)
  assert _trace(16, dict(context_ring=2, context=2), context_parallel=hybrid).shape == (1, 16, 2, 8)
  q = jax.ShapeDtypeStruct((1, 16, 2, 8), jnp.float32)
  mesh = AbstractMesh((2, 2), ("context_ring", "context"), axis_types=(AxisType.Auto,) * 2)
  with jax.sharding.use_abstract_mesh(mesh):
    text = flaxattn.explain(q, q, q, context_parallel=hybrid, print_fn=None)
    assert "context parallel: ulysses over 2 x ring over 2 devices" in text, text
    text = flaxattn.explain(q, q, q, context_parallel=ulysses, backend="reference", print_fn=None)
    assert ("context parallel: ulysses over 2 devices" in text
            and "backend='reference' -> reference" in text), text


def test_context_axis_of_size_one_is_plain_attention():
  t = 48
  q, k, v = qkv(0, 2, t, t, 4, 2, 8)
  seg, pos = random_packing(0, 2, t, pad_tail=2)

  def grads(**kw):
    return grads_of(lambda q, k, v: flaxattn.attention(
        q, k, v, segment_ids=seg, positions=pos, return_lse=True, **kw))(q, k, v)

  want = grads()
  mesh = Mesh(np.array(jax.devices()[:1]), ("context",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    got = grads(context_parallel=flaxattn.ContextParallel())  # ring: a scan of length 0
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert rel_error(g, w) < TOL


@pytest.mark.slow
def test_splash_runs_per_batch_and_head_shard():
  """Splash without context parallelism on a (data, fsdp, tensor) mesh: shard_map keeps the
  batch and heads sharded (no floating-point all-gather) and matches the reference."""
  r = cp_check.splash_sharded()
  assert max(_errors(r).values()) < TOL, _errors(r)
  assert r["out_spec"] == ["('data', 'fsdp')", "None", "tensor"]
  assert r["all_gather_dtypes"] == []


def _mods(b: int, h: int, t: int):
  """A mask reading every coordinate, the gallery's prefix-LM per row AND its window per
  head, and the gallery's T5 bias table (trained: its gradient is checked)."""
  prefix, _ = mod_gallery.prefix_lm(b, h, t, 1)
  window, _ = mod_gallery.per_head_window(b, h, t, 2)
  return prefix & window, mod_gallery.t5_bias(b, h, t, 3)[1]


MOD_CASES = [  # (mesh, strategy, load_balance, ring axis)
    (dict(context=2), "ring", True, None),
    (dict(context=4), "ring", False, None),
    (dict(data=2, context=4), "ring", "document", None),
    (dict(context=4), "all_gather", True, None),
    (dict(tensor=2, context=2), "ulysses", True, None),
    (dict(tensor=2, context=2, context_ring=2), "ulysses", True, "context_ring"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id="-".join(
    ["x".join(f"{a}{s}" for a, s in c[0].items()), c[1], str(c[2])]),
    marks=[pytest.mark.slow] if math.prod(c[0].values()) > 2 else []) for c in MOD_CASES])
def test_programmable_masks_and_scores_under_every_strategy(case):
  """A MaskMod that reads the batch row, the head and the token indices, and a ScoreMod
  with a trained table, over the sequence sharded by each strategy (batch over data, heads
  over tensor where the mesh has them): out and the gradients of q, k, v and of the table
  equal attention written out from the definitions on the unsharded, unpermuted call;
  the indices the functions see are the caller's order before load balancing."""
  axes, strategy, lb, ring_axis = case
  b, t, h, hkv = 2, 128, 4, 2
  q, k, v = qkv(21, b, t, t, h, hkv, 8)
  seg, pos = random_packing(4, b, t, max_docs=4, pad_tail=5)
  mask, score_mod = _mods(b, h, t)
  layout = as_layout(seg, pos)

  def oracle(q, k, v, mod):
    return dense_oracle(q, k, v, layout, mask, 0.3, score_mod=mod)[0]

  cp = flaxattn.ContextParallel(axis="context", strategy=strategy, load_balance=lb,
                                ring_axis=ring_axis)
  shards = axes[ring_axis or "context"]
  plan = flaxattn.balance_plan(seg, shards) if lb == "document" else None

  def order(x):
    if plan is not None:
      return plan.apply(x)
    return flaxattn.load_balance(x, shards) if lb else x

  def unorder(x):
    if plan is not None:
      return plan.undo(x)
    return flaxattn.unload_balance(x, shards) if lb else x

  def sharded(q, k, v, mod):
    out = flaxattn.attention(q, k, v, mask=mask, segment_ids=order(seg), positions=order(pos),
                             scale=0.3, context_parallel=cp, score_mod=mod)
    return unorder(out)

  def grads(f, *args):
    def scalar(q, k, v, mod):
      out = f(q, k, v, mod).astype(jnp.float32)
      return jnp.sum(out * jnp.cos(out)), out
    return jax.jit(jax.grad(scalar, (0, 1, 2, 3), has_aux=True))(*args)

  want_g, want = grads(oracle, q, k, v, score_mod)
  with jax.set_mesh(helpers_mesh(axes)):
    got_g, got = grads(sharded, *(order(x) for x in (q, k, v)), score_mod)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  for name, g, w in zip(("dq", "dk", "dv"), got_g[:3], want_g[:3], strict=True):
    assert rel_error(unorder(g), w) < TOL, name
  assert rel_error(got_g[3].operands[0], want_g[3].operands[0]) < TOL, "d table"
