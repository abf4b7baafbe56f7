"""mosaic_gpu's kernels compiled for an H100 (sm_90a) on a host without a GPU: registers,
spills and shared memory per kernel, and XLA's memory plan of the forward and backward.

  JAX_PLATFORMS=cpu python -m bench.mosaic_compile [--t 32768] [--tilings] [--json PATH]

Each case's forward and backward (B=1, 16 query heads on 8 KV heads, 16 packed documents,
gradients of q, k and v) is compiled by XLA's GPU compiler for the `h100` target of
`flaxattn.aot` (the `aot` extra: the CUDA 12 plugin and ptxas), in a process of its own
with Mosaic GPU's dumps on, which its compiler prints as it builds each kernel:
  regs   registers a thread ptxas allocates at launch (the consumers raise theirs to 240
         with setmaxnreg, the producer lowers its to 24) and bytes spilled to local memory
         (MOSAIC_GPU_DUMP_PTXAS);
  smem   the dynamic shared memory the launch asks for (MOSAIC_GPU_DUMP_HOST_LLVM), against
         the 232,448 bytes an sm_90 thread block may have;
  plan   XLA's temporaries for the whole program (`aot.memory`).
These are the compiler's numbers, not a measurement on a GPU. `--tilings`: each of
`TILINGS` on the first case as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

from bench.gpu import MOSAIC_TILINGS
from bench.triton_compile import Case

SMEM_LIMIT = 232448  # an sm_90 thread block's dynamic shared memory (227 KiB)
KERNELS = ("mosaic_forward", "mosaic_dq", "mosaic_dkv")


CASES = (
    Case("causal bf16 D=128", "bfloat16", 128, 128, "causal"),
    Case("chunked&local f16 D=64 Dv=128 cap", "float16", 64, 128, "chunked-local", 30.0),
    Case("full bf16 D=128 Dv=64", "bfloat16", 128, 64, "full"),
    Case("local|prefix alibi*w bf16 D=128", "bfloat16", 128, 128, "local|prefix",
         score="alibi-scaled"),
)
# `--tilings`: (block_kv, block_kv_dq, block_q_dkv, stages) of `MosaicGpu`: those
# `bench.gpu --tilings` times (the first is the default), then two that do not fit.
TILINGS = (*MOSAIC_TILINGS, (64, 64, 128, 2), (128, 64, 64, 3))
_PTXAS_KERNEL = re.compile(r"Compiling entry function '(\w+?)_mosaic_gpu_kernel'")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_LAUNCH_SMEM = re.compile(r"@mosaic_gpu_get_function\(ptr %\w+, ptr @(\w+?)_mosaic_gpu_kernel_name,"
                          r" i32 (\d+)")


def compile_case(case: Case, t: int = 32768, tiling=TILINGS[0]) -> dict:
  """Compiles `case` for an H100 in a child process; returns its kernels' rows (name,
  regs, spill bytes stored and loaded, smem) and the plan's temporaries in bytes."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_PTXAS="1",
             MOSAIC_GPU_DUMP_HOST_LLVM="1")
  child = subprocess.run([sys.executable, "-m", "bench.mosaic_compile", "--child",
                          json.dumps([dataclasses.asdict(case), t, list(tiling)])],
                         capture_output=True, text=True, env=env, check=False)
  refused = re.search(r"ValueError: (Mosaic GPU kernel exceeds available shared memory: .*)",
                      child.stderr)
  if refused:  # JAX's own check, before ptxas
    return dict(case=case.name, t=t, tiling=list(tiling), kernels=[], refused=refused.group(1))
  if child.returncode:
    raise RuntimeError(f"compiling {case.name} failed:\n{child.stderr[-4000:]}")
  text = child.stdout + child.stderr
  rows: dict[str, dict] = {}
  for section in text.split("ptxas info    : Compiling entry function")[1:]:
    name = _PTXAS_KERNEL.search("Compiling entry function" + section).group(1)  # pyright: ignore[reportOptionalMemberAccess]
    stores, loads = _PTXAS_SPILLS.search(section).groups()  # pyright: ignore[reportOptionalMemberAccess]
    regs = _PTXAS_REGS.search(section).group(1)  # pyright: ignore[reportOptionalMemberAccess]
    rows[name] = dict(kernel=name, regs=int(regs), spill_stores=int(stores),
                      spill_loads=int(loads))
  for name, smem in _LAUNCH_SMEM.findall(text):
    rows[name]["smem"] = int(smem)
  plan = json.loads(text[text.rindex("PLAN ") + 5:].splitlines()[0])
  return dict(case=case.name, t=t, tiling=list(tiling), kernels=[rows[k] for k in sorted(rows)],
              **plan)


def _child(case: dict, t: int, tiling: list[int]) -> None:
  """In the child: compile the case for one H100 and print its plan (the dumps come from
  the compiler itself)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType

  import flaxattn
  from flaxattn import aot
  from flaxattn.mosaic_gpu import MosaicGpu
  c = Case(**case)
  mask = c.attention_mask()
  dtype = jnp.dtype(c.dtype)
  q = jax.ShapeDtypeStruct((1, t, 16, c.d), dtype)
  k = jax.ShapeDtypeStruct((1, t, 8, c.d), dtype)
  v = jax.ShapeDtypeStruct((1, t, 8, c.dv), dtype)
  seg = jnp.asarray(np.repeat(np.arange(1, 17), t // 16)[None], jnp.int32)
  kernel = MosaicGpu(block_kv=tiling[0], block_kv_dq=tiling[1], block_q_dkv=tiling[2],
                     stages=tiling[3])

  def loss(q, k, v):
    out = flaxattn.attention(q, k, v, mask=mask, segment_ids=seg, backend=kernel,
                             logit_soft_cap=c.soft_cap, score_mod=c.score_mod())
    return jnp.sum(out.astype(jnp.float32) ** 2)
  mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,),
                       devices=aot.devices(aot.target("h100"))[:1])
  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile()
  plan = dict(temporaries=aot.memory(compiled).temporaries, found=aot.kernels(compiled.as_text()))
  print("PLAN " + json.dumps(plan), flush=True)


def _table(results: list[dict]) -> str:
  lines = ["| case | tiling (kv, kv dQ, q dK/dV, stages) | kernel | regs | spilled bytes |"
           " smem / 232,448 | temporaries |", "|" + "---|" * 7]
  for r in results:
    if r.get("refused"):
      lines.append(f"| {r['case']} | {'x'.join(map(str, r['tiling']))} | | | | {r['refused']} | |")
    for row in r["kernels"]:
      over = "" if row["smem"] <= SMEM_LIMIT else " OVER"
      lines.append(f"| {r['case']} | {'x'.join(map(str, r['tiling']))} | {row['kernel']}"
                   f" | {row['regs']} | {row['spill_stores']} / {row['spill_loads']}"
                   f" | {row['smem']:,}{over} | {r['temporaries'] / 2**20:.0f} MiB |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--t", type=int, default=32768)
  parser.add_argument("--tilings", action="store_true")
  parser.add_argument("--json", default=None)
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    _child(*json.loads(args.child))
    return 0
  import jax
  print(f"jax {jax.__version__}; T={args.t}, 16 query heads on 8 KV heads, 16 packed"
        " documents, forward and backward, compiled for sm_90a on this host (no GPU)")
  results = [compile_case(case, args.t) for case in CASES]
  if args.tilings:
    results += [compile_case(CASES[0], args.t, tiling) for tiling in TILINGS[1:]]
  print(_table(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
