"""Every example config compiled for the target its comments name (`python -m train.compile`,
one process per compile), and the longest seq_len that fits there.

  python -m bench.aot [--fit] [--only NAME ...] [--json PATH]

Prints a markdown table: config, target, per-device GiB (arguments, temporaries, total,
usable), fits, the longest seq_len that fits (with --fit: `train.compile --fit seq_len`, a
handful of compiles each), the attention kernels and the compile's seconds. Needs libtpu and
the CUDA plugin (`pip install "flaxattn[aot]"`). The 8B configs take minutes per compile.
The CPU demos are compiled for one H100 with their mesh cut to one device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

GIB = 2**30
ONE_DEVICE = ("mesh.fsdp=1", "mesh.context_ring=1", "mesh.context=1")
# (config, target, overrides): each example config on the target its comments name.
CASES = (
    ("configs/demo.yaml", "h100", ONE_DEVICE),
    ("configs/demo_usp.yaml", "h100", ONE_DEVICE),
    ("configs/extend_demo.yaml", "h100", ONE_DEVICE),
    ("configs/gpu_demo.yaml", "h100", ()),
    ("configs/tpu_demo.yaml", "v5e-8", ()),
    ("configs/tpu_demo.yaml", "v6e-8", ()),
    ("configs/gpu_8x_8b.yaml", "8xh100", ()),
    ("configs/tpu_v5p_8b.yaml", "v5p-128", ()),
    ("configs/tpu_v5p_8b_extend_128k.yaml", "v5p-128", ()),
)


def compile_case(config: str, target: str, overrides=(), fit: bool = False) -> list[dict]:
  """`python -m train.compile` of one case, in a process of its own: its JSON lines (with
  `fit`, one per compile of the search and the answer last)."""
  argv = [sys.executable, "-m", "train.compile", config, *overrides, "--target", target,
          "--json", *(["--fit", "seq_len"] if fit else [])]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  child = subprocess.run(argv, capture_output=True, text=True, env=env)
  lines = [json.loads(x) for x in child.stdout.splitlines() if x.startswith("{")]
  if child.returncode == 2 or not lines:
    raise RuntimeError(f"{' '.join(argv[2:])}: exit {child.returncode}: {child.stderr[-2000:]}")
  return lines


def _row(config: str, r: dict, longest) -> str:
  b = r["per_device_bytes"]
  gib = (lambda k: f"{b[k] / GIB:.2f}") if b else (lambda k: "-")
  kernels = ", ".join(sorted(r["kernels"])) or "-"
  fits = "yes" if r["fits"] else ("no (compiler: out of HBM)" if r["error"] else "no")
  return (f"| {config.removeprefix('configs/')} | {r['target']} | {r['seq_len']}"
          f" | {gib('arguments')} | {gib('temporaries')} | {gib('total')}"
          f" | {r['hbm_bytes'] / GIB:.2f} | {fits}"
          f" | {longest} | {kernels} | {r['compile_s']:.0f} |")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--fit", action="store_true", help="also the longest seq_len that fits")
  parser.add_argument("--only", nargs="+", help="configs whose path contains one of these")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  cases = [c for c in CASES if not args.only or any(o in c[0] + c[1] for o in args.only)]
  print("| config | target | seq_len | arguments GiB | temporaries GiB | total GiB | usable GiB"
        " | fits | longest seq_len | kernels | compile s |\n|" + "---|" * 11, flush=True)
  results = []
  for config, target, overrides in cases:
    r = compile_case(config, target, overrides)[0]
    longest = "-"
    if args.fit:
      longest = compile_case(config, target, overrides, fit=True)[-1]["longest_seq_len"]
    results.append({"config": config, "overrides": list(overrides), **r,
                    "longest_seq_len": longest})
    print(_row(config, r, longest), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
