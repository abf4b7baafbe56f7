"""The ring as the chips' own compilers schedule it (libtpu for v5p, XLA's GPU compiler for
H100), with the overlap flags the trainer sets (`train.xla_flags`): every K/V transfer but
the last dK/dV's runs beside a kernel, and a device holds two K/V shards whatever the
number of devices; with the gradients summed in the inputs' dtype, no more at cp=8 than
at cp=2. Small sizes of `bench/ring_compiled.py`'s cases (8192 tokens per device, `RUNS`),
compiled in processes of their own:
XLA and libtpu read the flags once per process. Skipped, naming the package, without
libtpu / the CUDA plugin (`pip install "flaxattn[aot]"`)."""

import json
import os
import subprocess
import sys

import pytest

from helpers import target_devices
from train import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = 8192  # per device
HEADS = (4, 4)
# (platform, case, grad_dtype, cps) per compile of the bench, with 4 heads for queries and
# keys alike: splash's per-step metadata stays small beside the K/V shards and the ring's
# float32 dQ is no larger than its K/V (with 2 K/V heads, all_gather's 8 small shards plan
# less than the float32 dQ at this size). v5p causal: the ring summing its gradients in the
# inputs' dtype (`ContextParallel(grad_dtype=None)`), against cp=2; packed: float32 sums.
RUNS = [("v5p", "causal", "inputs", (2, 8)),
        ("v5p", "packed", "float32", (4, 8)),
        ("h100", "packed", "float32", (4, 8))]
# v5p packed, float32 sums, its heads round in 2 groups (`ContextParallel(head_groups=2)`;
# at this size the call's own choice is 1): against the same run in one group above.
GROUPED = ("v5p", "packed", "float32", (8,), 2)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
  """`python -m bench.ring_compiled` for each of `RUNS`: its rows by (platform, case,
  strategy, cp), and its output; `GROUPED`'s ring rows by cp."""
  for target in ("v5p-16", "8xh100"):
    target_devices(target)
  env = {k: v for k, v in os.environ.items() if k not in ("LIBTPU_INIT_ARGS", "XLA_FLAGS")}
  rows, grouped, out = {}, {}, ""
  # v5p: splash, causal and packed (its exact-path check); H100: mosaic_gpu, whose two
  # cases are one program where cuDNN's library is not installed (CI).
  for platform, case, grad_dtype, cps, *groups in [*RUNS, GROUPED]:
    path = tmp_path_factory.mktemp("ring") / "ring.json"
    child = subprocess.run(
        [sys.executable, "-m", "bench.ring_compiled", "--platforms", platform, "--cases",
         case, "--tokens", str(TOKENS), "--heads", *map(str, HEADS), "--cps", *map(str, cps),
         "--grad-dtype", grad_dtype, "--json", str(path), "--strategies", "ring",
         *([] if groups else ["all_gather"]),
         *(["--head-groups", str(groups[0])] if groups else [])], cwd=ROOT,
        env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=1200)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    found = json.loads(path.read_text())["rows"]
    if groups:
      grouped |= {r["cp"]: r for r in found}
    else:
      rows |= {(r["platform"], r["case"], r["strategy"], r["cp"]): r for r in found}
    out += child.stdout
  return dict(rows=rows, grouped=grouped, out=out)


def test_the_overlap_flags_are_known_to_the_installed_compilers(compiled):
  """libtpu and XLA abort on a flag they do not know: the compiles ran with every flag of
  the table (the child printed the variables it compiled with)."""
  for variable, flags in xla_flags.TABLE.values():
    line = next(x for x in compiled["out"].splitlines() if x.startswith("overlap flags"))
    for name, value in flags:
      assert f"--{name}={value}" in line, (variable, name)


@pytest.mark.parametrize("platform, case, grad_dtype, cp",
                         [(p, c, g, cp) for p, c, g, cps in RUNS for cp in cps if cp >= 4])
def test_every_kv_transfer_but_the_ring_ends_runs_beside_a_kernel(compiled, platform, case,
                                                                  grad_dtype, cp):
  r = compiled["rows"][(platform, case, "ring", cp)]
  assert r["grad_dtype"] == grad_dtype
  shard = TOKENS * HEADS[1] * 128 * 2  # one K shard: tokens x K/V heads x head dim, bfloat16
  # K and V forward and backward (cp - 1 steps each), and dK/dV to each device (float32 or
  # bfloat16 sums).
  dkv = 2 * shard * (2 if grad_dtype == "float32" else 1)
  assert r["kv_bytes"] >= 4 * (cp - 1) * shard + (cp - 1) * dkv, r
  assert r["without_kernel"] <= 2, r


@pytest.mark.parametrize("platform, case", [(p, c) for p, c, g, *_ in RUNS if g == "float32"])
def test_memory_per_device_stays_flat_as_the_ring_grows(compiled, platform, case):
  """Float32 sums. At a fixed length per device the temporaries barely grow from cp=4 to
  cp=8, and at cp=8 are below the all-gather strategy's. The buffers live at the plan's
  peak are the same at both (H100 here: 128.5 MiB, two K/V shards, in XLA's buffer
  assignment); the plan's total moves by how its heap is packed (0.125 and 0.141 GiB),
  hence 1.15x. (cp=2 plans less: its one dK/dV transfer carries a single partial in the
  kernel's dtype, and no float32 accumulator lives before the end; bench/README.md.)"""
  rows = compiled["rows"]
  ring = {cp: rows[(platform, case, "ring", cp)]["temporaries"] for cp in (4, 8)}
  assert ring[8] <= 1.15 * ring[4], ring
  assert ring[8] <= rows[(platform, case, "all_gather", 8)]["temporaries"], ring


def test_summed_in_the_inputs_dtype_the_ring_holds_no_more_at_cp8_than_at_cp2(compiled):
  """v5p causal, `grad_dtype=None`: cp=8 plans at most 1.1x cp=2 and less than all_gather.
  At cp=2 nothing is summed before the end, so float32 sums cannot meet this (1.197x here:
  0.234 against 0.196 GiB; bench/README.md has the bench's own sizes)."""
  rows = compiled["rows"]
  ring = {cp: rows[("v5p", "causal", "ring", cp)]["temporaries"] for cp in (2, 8)}
  assert ring[8] <= 1.1 * ring[2], ring
  assert ring[8] <= rows[("v5p", "causal", "all_gather", 8)]["temporaries"], ring


def test_heads_in_groups_hold_one_groups_blocks_and_sums_at_a_time(compiled):
  """v5p packed, float32 sums, cp=8: in 2 groups of heads, one ring after the other, the
  plan is at most 0.7x the one-group ring's (its K/V blocks, partial results and gradient
  sums halve), every K/V-sized transfer is half a group-free one, and, each group's last
  dK/dV going home beside the next group's first kernel, no more transfers than one ring's
  have no kernel beside them (one per direction at the ring's ends)."""
  one, two = compiled["rows"][("v5p", "packed", "ring", 8)], compiled["grouped"][8]
  assert (one["head_groups"], two["head_groups"]) == (1, 2)
  assert two["temporaries"] <= 0.7 * one["temporaries"], (one, two)
  assert two["kv_transfers"] == 2 * one["kv_transfers"] and two["kv_bytes"] == one["kv_bytes"]
  assert two["without_kernel"] <= 2, two
