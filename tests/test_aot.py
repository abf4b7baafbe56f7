"""Compile-only targets (flaxattn.aot): the target table, and programs compiled by the
targets' own compilers on this host (skipped, naming the package, where libtpu or the CUDA
plugin is not installed: `pip install "flaxattn[aot]"`)."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from flaxattn import aot
from helpers import compile_for, target_devices


@pytest.mark.parametrize("name, devices, topology", [
    ("v5p-8", 4, "v5p:2x2x1"), ("v5p-128", 64, "v5p:4x4x4"), ("v5p-512", 256, "v5p:4x8x8"),
    ("v5e-1", 1, "v5e:1x1"), ("v5e-8", 8, "v5e:2x4"), ("v6e-256", 256, "v6e:16x16"),
    ("h100", 1, "1x1x1"), ("8xH100", 8, "1x1x8"), ("a100-80g", 1, "1x1x1")])
def test_targets_name_their_topology(name, devices, topology):
  t = aot.target(name)
  assert (t.devices, t.topology) == (devices, topology)


def test_hosts_multiply_gpus():
  t = aot.target("8xh200", hosts=2)
  assert (t.devices, t.topology, t.platform) == (16, "1x2x8", "gpu")


@pytest.mark.parametrize("name, says", [
    ("v4-8", "v4 is not a compile target"), ("v5p-12", "power of two"),
    ("v5e-512", "power of two"), ("b200", "target expects one of"),
    ("v5p-9", "power of two"),
    ("v5p-3", "no v5p slice of 3 cores; expected a power of two from 8 to 4096 cores, e.g."
              " v5p-16."),
    ("v5p-8192", "from 8 to 4096 cores"), ("v5p-4", "from 8 to 4096 cores"),
    ("v5e-0", "no v5e slice of 0 chips; expected a power of two from 1 to 256 chips, e.g."
              " v5e-8."),
    ("v6e-512", "from 1 to 256 chips")])
def test_bad_targets_say_why(name, says):
  with pytest.raises(ValueError, match=re.escape(says)):
    aot.target(name)


def test_hbm_a_program_may_use():
  assert aot.target("v5e-8").hbm_bytes() == int(15.75 * aot.GIB)
  h100 = aot.target("h100")
  assert h100.hbm_bytes(0.9) == int(0.9 * 84978434048)


def test_gpu_fraction_from_the_environment(monkeypatch):
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  assert aot.target("h100").hbm_bytes() == 84978434048 // 2
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
  assert aot.target("h100").hbm_bytes() == int(0.75 * 84978434048)


@pytest.mark.parametrize("value", ["2", "abc", "nan", "0", "-0.5", "inf"])
def test_a_gpu_fraction_outside_0_1_is_refused_naming_the_variable(monkeypatch, value):
  """2 planned 158 GiB on an 80 GB H100; abc and nan were raw errors naming no variable."""
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", value)
  with pytest.raises(ValueError, match=rf"XLA_PYTHON_CLIENT_MEM_FRACTION expects .* in \(0, 1\]"
                                       rf".*got '{re.escape(value)}'"):
    aot.target("h100").hbm_bytes()
  assert aot.target("v5e-8").hbm_bytes() == int(15.75 * aot.GIB)  # a TPU reads no fraction


def test_the_gpu_clients_variables_as_jax_reads_them(monkeypatch):
  """JAX's new name XLA_CLIENT_MEM_FRACTION is read; both names at once are refused, as JAX
  refuses them; an empty value is unset; the platform allocator allocates from the whole
  memory; a value JAX's GPU client refuses or misreads is refused, naming it."""
  h100, memory = aot.target("h100"), 84978434048
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
  assert h100.hbm_bytes() == int(0.9 * memory)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
  with pytest.raises(ValueError, match="XLA_CLIENT_MEM_FRACTION='0.9' and"
                                       " XLA_PYTHON_CLIENT_MEM_FRACTION='0.8' are both set"):
    h100.hbm_bytes()
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "")
  assert h100.hbm_bytes() == int(0.8 * memory)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
  assert h100.hbm_bytes() == memory
  for name, value in (("XLA_PYTHON_CLIENT_ALLOCATOR", "bogus"),
                      ("XLA_PYTHON_CLIENT_PREALLOCATE", "no"),
                      ("XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB", "1.5"),
                      ("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", "yes")):
    with monkeypatch.context() as m:
      m.setenv(name, value)
      with pytest.raises(ValueError, match=rf"variable {name} expects .*, got '{value}'"):
        aot.gpu_mem_fraction()


@pytest.mark.parametrize("name, kind", [("v5p-8", "TPU v5"), ("h100", "NVIDIA H100 80GB HBM3"),
                                        ("a100-80g", "NVIDIA A100-SXM4-80GB")])
def test_compiles_and_reads_the_memory_plan(name, kind):
  assert target_devices(name)[0].device_kind == kind
  n = 1024
  x = jax.ShapeDtypeStruct((n, n), jnp.float32)
  # tanh(x @ x.T) is a temporary beside the argument and the output (4 MiB each).
  compiled = compile_for(name, lambda x: jnp.tanh(x @ x.T) @ x, x)
  plan = aot.memory(compiled)
  assert plan.arguments == plan.outputs == 4 * n * n
  assert 0 < plan.temporaries < 64 * n * n
  assert plan.total == plan.arguments + plan.temporaries + plan.outputs - plan.aliased
  assert plan.peak >= max(plan.arguments, plan.outputs)  # the compiler's own figure


@pytest.mark.parametrize("name", [None, "v5p-8", "h100"], ids=["here", "v5p-8", "h100"])
def test_host_syncs_finds_what_waits_for_the_host(name):
  """What the decode tests count to be none, found where it is: a conditional, a loop and a
  host callback, compiled for this process's platform and by the targets' compilers (no
  callback for a GPU: this host has no GPU runtime to compile one for)."""
  def f(x):
    x = lax.cond(x[0, 0] > 0, lambda x: jnp.tanh(x @ x), lambda x: x @ x.T, x)
    x = lax.while_loop(lambda x: x[0, 0] < 10.0, lambda x: jnp.tanh(x @ x) * 2 + 1, x)
    if name != "h100":
      jax.debug.callback(print, x[0])
    return x

  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  compiled = jax.jit(f).lower(x).compile() if name is None else compile_for(name, f, x)
  assert aot.host_syncs(compiled.as_text()) == {"conditional": 1, "while": 1,
                                                "host_callback": int(name != "h100")}


def test_reads_kernels():
  text = ('%splash_mha_fwd.3 = f32[2] custom-call(%a), custom_call_target="tpu_custom_call"\n'
          '%pallas_call.1 = f32[2] custom-call(%a), custom_call_target="__gpu$xla.gpu.triton",'
          ' backend_config={name = "flash_dq"}\n'
          '%c = f32[2] custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"\n'
          '%ag = f32[4] all-gather-start(%x), dimensions={0}\n')
  assert aot.kernels(text) == {"splash_mha_fwd": 1, "flash_dq": 1, "__cudnn$fmhaSoftmax": 1}


# A scheduled module as XLA prints it (shapes with TPU layouts, tuples, async pairs), small
# enough to know every answer: in the entry, a K/V transfer beside a kernel, one beside a
# fusion only, one with nothing between (exposed), a synchronous all-reduce, an async
# reduce-scatter beside a conditional that holds a kernel, a loop of 3 iterations whose
# body starts a transfer at its end that the next iteration finishes after its kernel (as
# XLA's pipelining of loops leaves them), and an all-gather as libtpu's asynchronous
# collective fusion makes it (fusions that start it, step it beside a matmul, finish it).
SCHEDULED = """HloModule jit_f, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_computation (p: bf16[8,128]) -> bf16[8,128] {
  %p = bf16[8,128]{1,0} parameter(0)
  ROOT %neg = bf16[8,128]{1,0} negate(%p)
}

%scatter (x: f32[64]) -> f32[16] {
  %x = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%x), dimensions={0}, to_apply=%add
}

%kernel_branch (k: bf16[8,128]) -> bf16[8,128] {
  %k = bf16[8,128]{1,0} parameter(0)
  ROOT %splash.1 = bf16[8,128]{1,0} custom-call(%k), custom_call_target="tpu_custom_call"
}

%empty_branch (e: bf16[8,128]) -> bf16[8,128] {
  ROOT %e = bf16[8,128]{1,0} parameter(0)
}

%ag_start (s: bf16[2,128]) -> (bf16[2,128], bf16[8,128]) {
  %s = bf16[2,128]{1,0} parameter(0)
  %ag.1 = bf16[8,128]{1,0} all-gather(%s), dimensions={0}
  ROOT %acs = (bf16[2,128]{1,0}, bf16[8,128]{1,0}) custom-call(%s, %ag.1), \
custom_call_target="AsyncCollectiveStart"
}

%ag_step (a: bf16[8,128], w: bf16[128,128]) -> (bf16[8,128], bf16[8,128]) {
  %a = bf16[8,128]{1,0} parameter(0)
  %w = bf16[128,128]{1,0} parameter(1)
  %ag.2 = bf16[8,128]{1,0} all-gather(%a), dimensions={0}
  %conv = bf16[8,128]{1,0} convolution(%a, %w), dim_labels=bf_io->bf
  ROOT %both = (bf16[8,128]{1,0}, bf16[8,128]{1,0}) tuple(%ag.2, %conv)
}

%ag_done (d: bf16[8,128]) -> bf16[8,128] {
  %d = bf16[8,128]{1,0} parameter(0)
  %ag.3 = bf16[8,128]{1,0} all-gather(%d), dimensions={0}
  ROOT %acd = bf16[8,128]{1,0} custom-call(%ag.3), custom_call_target="AsyncCollectiveDone"
}

%body (state: (bf16[8,128], bf16[8,128])) -> (bf16[8,128], bf16[8,128]) {
  %state = (bf16[8,128]{1,0}, bf16[8,128]{1,0}) parameter(0)
  %carried = bf16[8,128]{1,0} get-tuple-element(%state), index=0
  %visiting = bf16[8,128]{1,0} get-tuple-element(%state), index=1
  %splash.2 = bf16[8,128]{1,0} custom-call(%visiting), custom_call_target="tpu_custom_call"
  %arrived = bf16[8,128]{1,0} collective-permute-done(%carried)
  %sent = (bf16[8,128]{1,0:T(8,128)(2,1)}, bf16[8,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}, \
    u32[]{:S(2)}) collective-permute-start(%arrived), source_target_pairs={{0,1},{1,0}}
  ROOT %next = (bf16[8,128]{1,0}, bf16[8,128]{1,0}) tuple(%sent, %splash.2)
}

%cond (c: (bf16[8,128], bf16[8,128])) -> pred[] {
  %c = (bf16[8,128]{1,0}, bf16[8,128]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (x: bf16[8,128], f: f32[64], which: s32[]) -> bf16[8,128] {
  %x = bf16[8,128]{1,0} parameter(0)
  %f = f32[64]{0} parameter(1)
  %which = s32[] parameter(2)
  %cp-start.1 = (bf16[8,128], bf16[8,128], u32[], u32[]) collective-permute-start(%x)
  %splash.3 = bf16[8,128]{1,0} custom-call(%x), custom_call_target="tpu_custom_call"
  %cp-done.1 = bf16[8,128]{1,0} collective-permute-done(%cp-start.1)
  %cp-start.2 = (bf16[8,128], bf16[8,128], u32[], u32[]) collective-permute-start(%cp-done.1)
  %fusion.1 = bf16[8,128]{1,0} fusion(%splash.3), kind=kLoop, calls=%fused_computation
  %cp-done.2 = bf16[8,128]{1,0} collective-permute-done(%cp-start.2)
  %ag-start = (bf16[8,128]{1,0}, bf16[32,128]{1,0}) all-gather-start(%cp-done.2), dimensions={0}
  %bitcast.1 = bf16[128,8]{0,1} bitcast(%fusion.1)
  %ag-done = bf16[32,128]{1,0} all-gather-done(%ag-start)
  %ar = f32[64]{0} all-reduce(%f), replica_groups={{0,1,2,3}}, to_apply=%add
  %rs-start = ((f32[64]{0}), f32[16]{0}, u32[]) async-start(%ar), calls=%scatter
  %chosen = bf16[8,128]{1,0} conditional(%which, %fusion.1, %fusion.1), \
    branch_computations={%kernel_branch, %empty_branch}
  %rs-update = ((f32[64]{0}), f32[16]{0}, u32[]) async-update(%rs-start)
  %rs-done = f32[16]{0} async-done(%rs-update)
  %init = (bf16[8,128]{1,0}, bf16[8,128]{1,0}) tuple(%chosen, %x)
  %loop = (bf16[8,128]{1,0}, bf16[8,128]{1,0}) while(%init), condition=%cond, body=%body, \
    backend_config={"known_trip_count":{"n":"3"}}
  %w = bf16[128,128]{1,0} parameter(3)
  %shard = bf16[2,128]{1,0} slice(%x), slice={[0:2], [0:128]}
  %acf-start = (bf16[2,128]{1,0}, bf16[8,128]{1,0}) fusion(%shard), kind=kCustom, calls=%ag_start
  %acf-part = bf16[8,128]{1,0} get-tuple-element(%acf-start), index=1
  %acf-step = (bf16[8,128]{1,0}, bf16[8,128]{1,0}) fusion(%acf-part, %w), kind=kCustom, \
calls=%ag_step
  %acf-gathered = bf16[8,128]{1,0} get-tuple-element(%acf-step), index=0
  %acf-done = bf16[8,128]{1,0} fusion(%acf-gathered), kind=kCustom, calls=%ag_done
  ROOT %out = bf16[8,128]{1,0} get-tuple-element(%loop), index=0
}
"""


def test_reads_each_collective_of_a_schedule():
  found = {c.name: c for c in aot.collectives_in(SCHEDULED)}
  kv = 8 * 128 * 2  # bf16[8,128]
  assert found["cp-start.1"] == aot.Collective("collective-permute", kv, False, 1, 1,
                                               "cp-start.1", "main")
  assert (found["cp-start.2"].exposed, found["cp-start.2"].kernels) == (False, 0)  # a fusion
  assert found["ag-start"] == aot.Collective("all-gather", 4 * kv, True, 0, 1, "ag-start", "main")
  assert (found["ar"].kind, found["ar"].bytes, found["ar"].exposed) == ("all-reduce", 256, True)
  assert found["rs-start"] == aot.Collective("reduce-scatter", 64, False, 1, 1, "rs-start", "main")
  # Started at the end of one iteration, done in the next after its kernel; 3 iterations.
  assert found["sent"] == aot.Collective("collective-permute", kv, False, 1, 3, "sent", "body")
  assert found["acf-start"] == aot.Collective("all-gather", kv, False, 0, 1, "acf-start", "main")
  assert len(found) == 7


# A loop as libtpu prints a scan: no known trip count, a condition `i < 5` on a counter that
# starts at 1 (through a copy), and an all-reduce in its body.
COUNTED = """HloModule jit_g, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%step (s: (s32[], f32[64])) -> (s32[], f32[64]) {
  %s = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[64]{0} get-tuple-element(%s), index=1
  %summed = f32[64]{0} all-reduce(%x), to_apply=%add
  ROOT %next = (s32[], f32[64]{0}) tuple(%i, %summed)
}

%below (c: (s32[], f32[64])) -> pred[] {
  %c = (s32[], f32[64]{0}) parameter(0)
  %limit = s32[]{:T(128)} constant(5)
  %counter = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%counter, %limit), direction=LT
}

ENTRY %main (x: f32[64]) -> (s32[], f32[64]) {
  %x = f32[64]{0} parameter(0)
  %one = s32[] constant(1)
  %copy.1 = s32[] copy(%one)
  %init = (s32[], f32[64]{0}) tuple(%copy.1, %x)
  ROOT %loop = (s32[], f32[64]{0}) while(%init), condition=%below, body=%step
}
"""


def test_reads_a_loops_trip_count_from_its_condition():
  (summed,) = aot.collectives_in(COUNTED)
  assert (summed.kind, summed.times, summed.bytes) == ("all-reduce", 4, 256)


# libtpu's asynchronous collective fusion stepped through a loop: started before it, a step
# beside each iteration's matmul (the step's fusion outputs the matmul's result with the
# transfer's), done after it.
CHAINED = """HloModule jit_h, is_scheduled=true

%start (s: s32[1,8]) -> (s32[1,8], s32[1,32]) {
  %s = s32[1,8]{1,0} parameter(0)
  %ag.1 = s32[1,32]{1,0} all-gather(%s), channel_id=14, dimensions={1}, \
frontend_attributes={chain_id="0"}
  ROOT %acs = (s32[1,8]{1,0}, s32[1,32]{1,0}) custom-call(%s, %ag.1), \
custom_call_target="AsyncCollectiveStart"
}

%step (a: s32[1,8], w: f32[64,128], g: f32[64,128]) -> (f32[64,128], s32[1,32]) {
  %a = s32[1,8]{1,0} parameter(0)
  %w = f32[64,128]{1,0} parameter(1)
  %g = f32[64,128]{1,0} parameter(2)
  %ag.2 = s32[1,32]{1,0} all-gather(%a), channel_id=14, dimensions={1}, \
frontend_attributes={chain_id="0"}
  %sum = f32[64,128]{1,0} add(%w, %g)
  ROOT %both = (f32[64,128]{1,0}, s32[1,32]{1,0}) tuple(%sum, %ag.2)
}

%done (d: s32[1,8]) -> s32[1,32] {
  %d = s32[1,8]{1,0} parameter(0)
  %ag.3 = s32[1,32]{1,0} all-gather(%d), channel_id=14, dimensions={1}, \
frontend_attributes={chain_id="0"}
  ROOT %acd = s32[1,32]{1,0} custom-call(%ag.3), custom_call_target="AsyncCollectiveDone"
}

%body (state: (s32[1,8], f32[64,128])) -> (s32[1,8], f32[64,128]) {
  %state = (s32[1,8]{1,0}, f32[64,128]{1,0}) parameter(0)
  %part = s32[1,8]{1,0} get-tuple-element(%state), index=0
  %acc = f32[64,128]{1,0} get-tuple-element(%state), index=1
  %stepped = (f32[64,128]{1,0}, s32[1,32]{1,0}) fusion(%part, %acc, %acc), kind=kOutput, \
calls=%step
  %added = f32[64,128]{1,0} get-tuple-element(%stepped), index=0
  ROOT %next = (s32[1,8]{1,0}, f32[64,128]{1,0}) tuple(%part, %added)
}

%cond (c: (s32[1,8], f32[64,128])) -> pred[] {
  %c = (s32[1,8]{1,0}, f32[64,128]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (x: s32[1,8], y: f32[64,128]) -> s32[1,32] {
  %x = s32[1,8]{1,0} parameter(0)
  %y = f32[64,128]{1,0} parameter(1)
  %acf-start = (s32[1,8]{1,0}, s32[1,32]{1,0}) fusion(%x), kind=kCustom, calls=%start
  %acf-part = s32[1,8]{1,0} get-tuple-element(%acf-start), index=0
  %init = (s32[1,8]{1,0}, f32[64,128]{1,0}) tuple(%acf-part, %y)
  %loop = (s32[1,8]{1,0}, f32[64,128]{1,0}) while(%init), condition=%cond, body=%body, \
    backend_config={"known_trip_count":{"n":"4"}}
  %left = s32[1,8]{1,0} get-tuple-element(%loop), index=0
  ROOT %acf-done = s32[1,32]{1,0} fusion(%left), kind=kCustom, calls=%done
}
"""


def test_a_chain_stepped_through_a_loop_counts_once_at_its_start():
  """The steps in the loop's body move nothing of their own (their fusion's outputs are
  the matmul's): the chain is one all-gather of its result's bytes, hidden by the loop."""
  assert aot.collectives_in(CHAINED) == [
      aot.Collective("all-gather", 32 * 4, False, 0, 1, "acf-start", "main")]


def test_hbm_bytes_leave_a_chains_buffers_to_the_links():
  """The chain's step fusion: the add's operands and result in each of 4 iterations; the
  all-gather's operand and result, stepped through it, are the collective's."""
  assert aot.hbm_bytes(CHAINED) == 4 * 3 * 64 * 128 * 4


def test_sums_collectives_by_kind():
  kv = 8 * 128 * 2
  assert aot.collectives(SCHEDULED) == {
      "collective-permute": {"count": 5, "bytes": 5 * kv, "exposed_bytes": 0},
      "all-gather": {"count": 2, "bytes": 5 * kv, "exposed_bytes": 4 * kv},
      "all-reduce": {"count": 1, "bytes": 256, "exposed_bytes": 256},
      "reduce-scatter": {"count": 1, "bytes": 64, "exposed_bytes": 0}}


# A scanned layer as XLA compiles one: each of 3 iterations slices its layer of a stacked
# weight `[3, 128, 128]`, and writes its row of a stacked result in place; after the loop a
# conditional whose kernel branch runs (its other branch is a kernel-free fallback), and an
# array in on-chip memory (S(1)), which costs no HBM traffic.
STACKED = """HloModule jit_s, is_scheduled=true

%layer (p0: f32[3,128,128], p1: s32[], p2: f32[128,128]) -> f32[128,128] {
  %p0 = f32[3,128,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = f32[1,128,128]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), \
dynamic_slice_sizes={1,128,128}
  %w = f32[128,128]{1,0} bitcast(%ds)
  %p2 = f32[128,128]{1,0} parameter(2)
  ROOT %d = f32[128,128]{1,0} dot(%p2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%row (q0: f32[3,128,128], q1: f32[128,128], q2: s32[]) -> f32[3,128,128] {
  %q0 = f32[3,128,128]{2,1,0} parameter(0)
  %q1 = f32[128,128]{1,0} parameter(1)
  %u = f32[1,128,128]{2,1,0} bitcast(%q1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[3,128,128]{2,1,0} dynamic-update-slice(%q0, %u, %q2, %z, %z)
}

%body (s: (s32[], f32[3,128,128], f32[128,128], f32[3,128,128])) -> (s32[], f32[3,128,128], \
f32[128,128], f32[3,128,128]) {
  %s = (s32[], f32[3,128,128]{2,1,0}, f32[128,128]{1,0}, f32[3,128,128]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %w = f32[3,128,128]{2,1,0} get-tuple-element(%s), index=1
  %x = f32[128,128]{1,0} get-tuple-element(%s), index=2
  %out = f32[3,128,128]{2,1,0} get-tuple-element(%s), index=3
  %y = f32[128,128]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%layer
  %o = f32[3,128,128]{2,1,0} fusion(%out, %y, %i), kind=kLoop, calls=%row
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[3,128,128]{2,1,0}, f32[128,128]{1,0}, f32[3,128,128]{2,1,0}) \
tuple(%next, %w, %y, %o)
}

%cond (c: (s32[], f32[3,128,128], f32[128,128], f32[3,128,128])) -> pred[] {
  %c = (s32[], f32[3,128,128]{2,1,0}, f32[128,128]{1,0}, f32[3,128,128]{2,1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

%kernel (k: f32[128,128]) -> f32[128,128] {
  %k = f32[128,128]{1,0} parameter(0)
  ROOT %splash = f32[128,128]{1,0} custom-call(%k), custom_call_target="tpu_custom_call"
}

%fallback (f: f32[128,128]) -> f32[128,128] {
  %f = f32[128,128]{1,0} parameter(0)
  %e = f32[128,128]{1,0} exponential(%f)
  %l = f32[128,128]{1,0} log(%e)
  ROOT %n = f32[128,128]{1,0} negate(%l)
}

ENTRY %main (w: f32[3,128,128], x: f32[128,128], out: f32[3,128,128], ok: pred[]) -> \
f32[3,128,128] {
  %w = f32[3,128,128]{2,1,0} parameter(0)
  %x = f32[128,128]{1,0} parameter(1)
  %out = f32[3,128,128]{2,1,0} parameter(2)
  %ok = pred[] parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], f32[3,128,128]{2,1,0}, f32[128,128]{1,0}, f32[3,128,128]{2,1,0}) \
tuple(%zero, %w, %x, %out)
  %loop = (s32[], f32[3,128,128]{2,1,0}, f32[128,128]{1,0}, f32[3,128,128]{2,1,0}) \
while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %last = f32[128,128]{1,0} get-tuple-element(%loop), index=2
  %chosen = f32[128,128]{1,0} conditional(%ok, %last, %last), \
branch_computations={%kernel, %fallback}
  %near = f32[128,128]{1,0:S(1)} copy(%chosen)
  %r = f32[128,128]{1,0} negate(%near)
  %row0 = f32[1,128,128]{2,1,0} bitcast(%r)
  ROOT %put = f32[3,128,128]{2,1,0} dynamic-update-slice(%out, %row0, %zero, %zero, %zero)
}
"""


def test_hbm_bytes_count_slices_updates_in_place_and_the_kernel_branch():
  tile = 128 * 128 * 4
  layer = tile + 4 + tile + tile  # its slice of the stacked weight, the index, x, the product
  row = tile + 4 + tile  # the row written in place (of 3), the index; the stacked array: 0
  step = layer + row + 3 * 4  # and the counter's add
  # The kernel branch (its operand and result), not the fallback's three passes; the copy
  # into on-chip memory reads HBM only; the negate reads on-chip memory and writes HBM; the
  # unfused update in place reads and writes its row.
  after = 2 * tile + tile + tile + 2 * tile
  assert aot.hbm_bytes(STACKED) == 3 * step + after


@pytest.mark.parametrize("attributes, group", [
    ("replica_groups={{0,2},{1,3}}, to_apply=%add", (0, 2)),
    ("replica_groups={}, to_apply=%add", ()),
    ("replica_groups=[2,4]<=[8], dimensions={0}", (0, 1, 2, 3)),
    ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", (0, 4)),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0','axis_2'}, dimensions={1}",
     (0, 1, 4, 5)),
    ("source_target_pairs={{0,1},{1,0}}", None),
])
def test_reads_replica_groups_in_each_spelling(attributes, group):
  assert aot._first_group(attributes) == group


class _Device:
  def __init__(self, coords):
    self.coords = coords


def test_estimate_is_a_roofline_of_its_parts():
  """On v5p figures, 4 devices of a 2 x 2 torus face: the all-reduce of `SCHEDULED` spans
  both dimensions (4 ICI ports), its collective-permutes one port each."""
  chip = aot.TARGETS["v5p"]
  devices = [_Device(c) for c in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0))]
  e = aot.estimate(SCHEDULED, chip, devices, flops=4 * 459e12 * 1e-6,
                   model_flops=2 * 459e12 * 1e-6, tokens=1000)
  assert e.compute_s == pytest.approx(1e-6)
  assert e.memory_s == pytest.approx(aot.hbm_bytes(SCHEDULED) / 2765e9)
  assert 0 < e.exposed_comm_s < e.comm_s
  assert e.step_s == pytest.approx(
      max(e.compute_s, e.memory_s, e.comm_s - e.exposed_comm_s) + e.exposed_comm_s)
  assert e.mfu == pytest.approx(2 * 459e12 * 1e-6 / (e.step_s * 459e12 * 4))
  assert e.tokens_per_s == pytest.approx(1000 / e.step_s)
  port = 1200e9 / 2 / 6
  assert aot.link_bandwidth(chip, devices, (0, 3)) == 4 * port
  assert aot.link_bandwidth(chip, devices, (0, 1)) == 2 * port


def test_chips_by_device_kind():
  assert aot.chip_of("TPU v5").name == "v5p" and aot.chip_of("TPU v5 lite").name == "v5e"
  assert aot.chip_of("TPU v6 lite").name == "v6e"
  assert aot.chip_of("NVIDIA H100 80GB HBM3").name == "h100"
  assert aot.chip_of("cpu") is None


def test_reads_a_compiled_ring():
  """The reader on a real schedule (v5p, 2 devices): the ring's forward sends K and V, its
  backward K, V, the dK/dV that travel with them (one buffer, first as the kernel made them,
  bfloat16), then home (bfloat16 too: XLA casts to the result's dtype before the transfer);
  a splash kernel runs beside some. (Whether each transfer runs beside a kernel depends on
  the overlap flags: tests/test_ring_compiled.py.)"""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import flaxattn
  from helpers import target_precision

  devices = target_devices("v5p-8")[:2]
  mesh = jax.make_mesh((2,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices)
  context = flaxattn.ContextParallel(axis="context")

  def loss(q, k, v):
    return jnp.sum(flaxattn.attention(q, k, v, context_parallel=context).astype(jnp.float32))

  with jax.set_mesh(mesh), target_precision():
    x = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "context")))
    text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile().as_text()
  shard = 1024 * 2 * 128 * 2
  moves = [c for c in aot.collectives_in(text) if c.kind == "collective-permute"]
  big = sorted(c.bytes for c in moves if c.bytes >= shard)
  # K and V forward and backward; dK/dV to the device of the last step's block, then home.
  assert big == [shard] * 4 + [2 * shard] * 2, big
  assert any(c.kernels > 0 and not c.exposed for c in moves if c.bytes == shard), moves
