"""pallas_gpu's Triton kernels compiled for NVIDIA GPUs on a host without one: shared memory
against each GPU's limit, registers, spills, and whether the loops' reads are pipelined.

  python -m bench.triton_compile [--arch 80 89 90] [--json PATH]

Each case's forward and backward are lowered for CUDA from this host (as
`flaxattn.lowering_for("gpu")` does for an export), once per architecture with a GPU of it
named on the abstract mesh (`KINDS`: pallas_gpu's default tiling depends on the GPU), and
each of the three kernels' Triton IR is taken as Pallas hands it to XLA. The `triton`
package (`pip install triton`, not a dependency of flaxattn) then compiles that IR for each
architecture to PTX and, with its bundled ptxas, to a cubin, in a process that never
imports JAX. Reported per kernel and architecture:
  smem      shared memory the kernel asks for, and the most one block may have on that
            architecture (a kernel above it fails to launch there);
  regs      registers per thread (255 at most) and bytes spilled to local memory;
  pipelined whether its loops read the next blocks asynchronously (`cp.async`) while
            computing: Triton pipelines a loop only when its loads and dots are not inside
            a branch;
  mma       wgmma (Hopper's asynchronous warpgroup matmul) or mma.sync.

XLA compiles the same IR with the Triton it was built with, which may differ from the
installed package's: these are that package's numbers for the same IR, not a measurement
on a GPU. Without the package the script prints the kernels' loop structure only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

# The most dynamic shared memory one thread block may use (CUDA programming guide, compute
# capabilities table): A100 (8.0) 163 KiB, consumer Ampere and Ada (8.6, 8.9) 99 KiB,
# H100 (9.0) 227 KiB.
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
# The GPU each architecture's kernels are lowered for (pallas_gpu's default tiling depends on
# it: `choose_tiling`): device kinds as JAX reports them.
KINDS = {80: "NVIDIA A100-SXM4-80GB", 86: "NVIDIA RTX A6000", 89: "NVIDIA L40S",
         90: "NVIDIA H100 80GB HBM3"}


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  dtype: str
  d: int
  dv: int
  mask: str  # "causal", "full", "chunked-local" or "local|prefix"
  soft_cap: float | None = None
  score: str | None = None  # None or "alibi-scaled"

  def attention_mask(self):
    """The flaxattn mask `mask` names ("local|prefix": a window OR'ed with a MaskMod, a
    prefix of 512 bidirectional tokens per row, its length an operand)."""
    import jax.numpy as jnp

    import flaxattn
    if self.mask == "local|prefix":
      return flaxattn.Local(300) | flaxattn.MaskMod(lambda b, h, q, k, n: k < n[b],
                                                    jnp.full((1,), 512, jnp.int32))
    return {"causal": flaxattn.Causal(), "full": flaxattn.Full(),
            "chunked-local": flaxattn.Chunked(1024) & flaxattn.Local(300)}[self.mask]

  def score_mod(self):
    """The flaxattn.ScoreMod `score` names, or None ("alibi-scaled": ALiBi's slopes from the
    head, times a learned scale read at one index, `w[()]`)."""
    import jax.numpy as jnp

    import flaxattn
    if self.score is None:
      return None
    return flaxattn.ScoreMod(lambda s, b, h, q, k, w: s - w[()] * jnp.exp2(-1.0 - h) * jnp.abs(
        q - k).astype(jnp.float32), jnp.float32(0.5))


CASES = (
    Case("causal bf16 D=64", "bfloat16", 64, 64, "causal"),
    Case("causal bf16 D=128", "bfloat16", 128, 128, "causal"),
    Case("causal bf16 D=256", "bfloat16", 256, 256, "causal"),
    Case("chunked&local f16 D=96 Dv=64 cap", "float16", 96, 64, "chunked-local", 30.0),
    Case("full f32 D=64", "float32", 64, 64, "full"),
    Case("full f32 D=128", "float32", 128, 128, "full"),
    Case("full f32 D=256", "float32", 256, 256, "full"),
)


TRITON_CALL = "__gpu$xla.gpu.triton"


def cuda_export(fn, *args, arch: int = 90):
  """`jax.export` of `jax.jit(fn)(*args)` for CUDA from this host: flaxattn's GPU kernels
  (`flaxattn.lowering_for("gpu")`), Triton's custom calls allowed, for the GPU of `arch`
  (`KINDS`; default an H100) named on the abstract mesh (jax 0.11 and later lower Triton for
  the GPU it names; 0.10 took sm90)."""
  import jax

  import flaxattn
  gpu = jax.sharding.AbstractDevice(device_kind=KINDS[arch], num_cores=132, platform="gpu")
  on_gpu = jax.sharding.get_abstract_mesh().update(abstract_device=gpu)
  with flaxattn.lowering_for("gpu"), jax.sharding.use_abstract_mesh(on_gpu):
    return jax.export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)


def triton_modules(fn, *args, arch: int = 90) -> list[tuple[str, str]]:
  """(kernel name, Triton IR text) of every Pallas Triton kernel in `fn(*args)` lowered for
  CUDA from this host (`cuda_export`). Reads Pallas's private lowering (jax 0.10 to 0.12):
  the IR is the module it builds before serializing it into the custom call."""
  from jax._src.pallas.triton import pallas_call_registration as registration
  found = []
  lower = registration.lowering.lower_jaxpr_to_triton_module

  def capture(*a, **kw):
    result = lower(*a, **kw)
    op = result.module.operation
    found.append((op.attributes["sym_name"].value, op.get_asm()))
    return result
  registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    cuda_export(fn, *args, arch=arch)
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower
  return found


def case_kernels(case: Case, t: int = 8192,
                 arch: int = 90) -> tuple[Any, list[tuple[str, str]]]:
  """The tiling and the (name, IR) of the forward, dQ and dK/dV kernels of `case` (B=1,
  8 query heads on 2 KV heads, packed segment ids and positions) lowered for `arch`."""
  import jax
  import jax.numpy as jnp

  import flaxattn
  from flaxattn.pallas_gpu import PallasGpu
  mask = case.attention_mask()
  dtype = jnp.dtype(case.dtype)
  q = jax.ShapeDtypeStruct((1, t, 8, case.d), dtype)
  k = jax.ShapeDtypeStruct((1, t, 2, case.d), dtype)
  v = jax.ShapeDtypeStruct((1, t, 2, case.dv), dtype)
  ids = jax.ShapeDtypeStruct((1, t), jnp.int32)

  def grads(q, k, v, seg, pos):
    def loss(q, k, v):
      out = flaxattn.attention(q, k, v, backend="pallas_gpu", mask=mask, segment_ids=seg,
                               positions=pos, logit_soft_cap=case.soft_cap)
      return jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.grad(loss, (0, 1, 2))(q, k, v)
  kernels = triton_modules(grads, q, k, v, ids, ids, arch=arch)
  gpu = jax.sharding.AbstractDevice(device_kind=KINDS[arch], num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.get_abstract_mesh().update(
      abstract_device=gpu)), flaxattn.lowering_for("gpu"):
    return PallasGpu(interpret=False).tiling(q, k, v), kernels


def loop_structure(ir: str) -> dict[str, int]:
  """Counts of the IR's loops, branches and dots."""
  return {op: len(re.findall(rf"\b{re.escape(op)}\b", ir))
          for op in ("scf.for", "scf.while", "scf.if", "tt.dot")}


def _compile(jobs: list[dict], arch: int) -> list[dict]:
  """Run in a process of its own (no JAX): compile each job's IR file for `arch`."""
  import triton
  from triton.backends.compiler import GPUTarget
  bin_dir = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
  rows = []
  for job in jobs:
    kernel = triton.compile(job["file"], target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=job["warps"], num_stages=job["stages"]))
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
      cubin.write(kernel.asm["cubin"])
      cubin.flush()
      usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", cubin.name],
                             capture_output=True, text=True, check=True).stdout
    regs, stack = (re.search(rf"{key}:(\d+)", usage) for key in ("REG", "STACK"))
    rows.append(dict(job, arch=arch, triton=triton.__version__, smem=kernel.metadata.shared,
                     smem_limit=SMEM_LIMIT.get(arch), regs=int(regs.group(1)) if regs else None,
                     spill_bytes=int(stack.group(1)) if stack else None,
                     pipelined="cp.async" in ptx, wgmma="wgmma.mma_async" in ptx,
                     mma_sync="mma.sync" in ptx))
  return rows


def kernel_jobs(cases, directory: str | None, t: int = 8192, arch: int = 90) -> list[dict]:
  """Each case's three kernels lowered for `arch`: name, tiling, loop structure, and (with
  `directory`) the file its IR is written to."""
  jobs = []
  for case in cases:
    tiling, kernels = case_kernels(case, t, arch)
    for name, ir in kernels:
      job = dict(case=case.name, kernel=name, warps=tiling.num_warps, stages=tiling.num_stages,
                 rows=tiling.rows, keys=tiling.keys, **loop_structure(ir))
      if directory is not None:
        job["file"] = os.path.join(directory, f"{arch}-{len(jobs)}-{name}.ttir")
        with open(job["file"], "w") as f:
          f.write(ir)
      jobs.append(job)
  return jobs


def compile_cases(cases, archs, t: int = 8192) -> list[dict]:
  """`kernel_jobs` compiled for each architecture in `archs` (needs the triton package),
  one row per kernel and architecture (see the module's docstring)."""
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for arch in archs:
      jobs_file = os.path.join(tmp, f"jobs-{arch}.json")
      with open(jobs_file, "w") as f:
        json.dump(kernel_jobs(cases, tmp, t, arch), f)
      child = subprocess.run([sys.executable, "-m", "bench.triton_compile", "--compile",
                              jobs_file, str(arch)], capture_output=True, text=True, check=True)
      rows += json.loads(child.stdout)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--arch", type=int, nargs="+", default=[80, 89, 90])
  parser.add_argument("--json", default=None)
  parser.add_argument("--compile", nargs=2, metavar=("JOBS", "ARCH"), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.compile:  # the child process
    jobs = json.load(open(args.compile[0]))
    json.dump(_compile(jobs, int(args.compile[1])), sys.stdout)
    return 0

  import jax
  print(f"jax {jax.__version__}; each case at T=8192, 8 query heads on 2 KV heads, packed")
  try:
    import triton  # noqa: F401
  except ImportError:
    print("The triton package is not installed (pip install triton): the kernels' loop"
          " structure only, nothing compiled.")
    for job in kernel_jobs(CASES, None):
      print(f"{job['case']:34s} {job['kernel']:14s} blocks {job['rows']}x{job['keys']}"
            f" loops {job['scf.for']} branches {job['scf.if']} dots {job['tt.dot']}")
    return 0
  rows = compile_cases(CASES, args.arch)
  print(f"triton {rows[0]['triton']} (compiled here, no GPU); smem in bytes against the"
        " architecture's per-block limit")
  print(f"| case | kernel | blocks | warps/stages | sm | smem / limit | regs | spilled bytes"
        f" | pipelined | mma |\n|{'---|' * 10}")
  for r in rows:
    fits = "" if r["smem_limit"] is None or r["smem"] <= r["smem_limit"] else " OVER"
    limit = r["smem_limit"] or "?"
    print(f"| {r['case']} | {r['kernel']} | {r['rows']}x{r['keys']} | {r['warps']}/{r['stages']}"
          f" | {r['arch']} | {r['smem']} / {limit}{fits} | {r['regs']} | {r['spill_bytes']}"
          f" | {'yes' if r['pipelined'] else 'no'} | {'wgmma' if r['wgmma'] else 'mma.sync'} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump([{k: v for k, v in r.items() if k != "file"} for r in rows], f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
