"""Training-step throughput of the demo model on 4 simulated CPU devices, every number from
the same run.

  python -m bench.training [--json bench/results/train_cpu.json] [--steps N] [--config PATH]
  python -m bench.training --trainer-only [--trainer-steps N]

Part 2 (`--trainer-steps`, 0 skips it; `--trainer-only` runs only it): `python -m train`
itself on configs/demo.yaml and configs/extend_demo.yaml (init_from a random tiny Llama
written by `python -m models.hf random`), no checkpoints or evals, and what its log and
metrics.jsonl report: tokens/s, tokens/s and TFLOP/s per device, MFU (the batches' model
FLOPs against the matmuls the trainer times at start, one on each of its devices at once),
step time, the host's own time per step outside the device step (data, metrics, logging:
`host_time`; it overlaps the device's work, since the loop reads and places step n + 1's
batch while the device runs step n) and the step call's own time (`dispatch_time`: the
loop calls it once the step before is done). Medians over the steps after the first two
(compile and warm-up).

The demo model (`configs/demo.yaml`: its model config, seq_len and global batch_size) is
trained with the trainer's own pieces (`bench.train_step`): `train.state.make_state` (Llama
+ AdamW from `train.optimizer`), `train.loop.train_step` (the jitted step `python -m train`
runs), `train.mesh.make` and `train.data.GlobalBatches`. Part 1 needs 4 devices (JAX_PLATFORMS
is cpu unless set; with fewer devices it is skipped, saying so). Variants,
all on the same global batch (`batch_size` rows of `seq_len`) and the same initial parameters:

  1. ring:        mesh context=4 (the demo config), ContextParallel("ring", load_balance);
  2. all_gather:  mesh context=4, ContextParallel("all_gather", load_balance) (the demo
                  config with context_parallel.strategy=all_gather);
  3. no CP:       no context parallelism, on ONE of the 4 simulated devices (a 1-device mesh
                  with every axis of size 1). The demo batch is 1 row, so a data axis > 1
                  cannot split it; replicating the step over 4 devices (an unused mesh axis)
                  would make each device repeat the whole step on the same 2 shared cores,
                  4x the work; one device is what a run without CP does;
  4. dense mask:  as 3, but every layer's attention is `jax.nn.dot_product_attention(...,
                  implementation="xla")` with a dense [B, 1, T, T] boolean mask from the
                  segment ids and positions (same segment, non-padding, key position <= query
                  position). `models.llama.Llama` does not expose `attention_fn`, so the
                  layers' `MultiHeadAttention.attention_fn` attribute is monkeypatched after
                  construction.

The batch is one packed batch from the trainer's data pipeline (`train.data.pipeline`: the
Python standard library's `.py` files, byte tokenizer, first-fit packed, shuffled with the
config's seed): by default the first batch whose rows hold at least `--min-docs` (3)
documents, real documents of uneven lengths plus padding (`--batch-index N` picks pipeline
batch N instead; at seq_len 4096 most demo batches are one piece of a long file). The CP
variants get it in the trainer's token order (`data.balance`, through `GlobalBatches`); the
others in the original order. The same batch is reused for every step (data loading is not
timed).

XLA_FLAGS gets `--xla_force_host_platform_device_count=4` and
`--xla_cpu_multi_thread_eigen=false` (what `train.distributed.setup` sets when simulating
devices) before jax is imported. The simulated devices share the host's cores, so wall time
compares total work and overheads, not the parallel speedup of real chips. The `cores`
column (process CPU time / wall time over the timed steps) shows how many cores a variant
kept busy: even one simulated device uses more than one for large matmuls.

Step time: after `--warmup` compile-and-warm-up steps per variant, `--steps` rounds that
each time one step of every variant in turn (interleaved, so that load from other users of
the machine hits the variants alike), each to `jax.block_until_ready` of the step's outputs.
tokens/s = batch_size x seq_len (padding included, as the trainer's tokens_per_s) / the
median step time (the best is also shown). MFU = the model FLOPs of the batch's documents
(`train.throughput.Flops`: matmuls of the tokens that are not padding, the query-key pairs
each layer's mask allows) / the median step time / this CPU's float32 matmul FLOP/s
(2048^3, `bench.attention`'s `matmul_gflops` on the default device), measured before and
after the steps, the higher taken. The loss of the first step (same initial parameters and
batch) is printed per variant as a consistency check.
"""

from __future__ import annotations

import os
import sys

_flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
_flags.append("--xla_force_host_platform_device_count=4")
if not any(f.startswith("--xla_cpu_multi_thread_eigen") for f in _flags):
  _flags.append("--xla_cpu_multi_thread_eigen=false")
os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import devices  # noqa: E402
from bench.attention import matmul_gflops  # noqa: E402
from bench.train_step import Variant, one_batch  # noqa: E402
from models.llama import layer_masks, num_params  # noqa: E402
from train import config as config_lib  # noqa: E402
from train.throughput import Flops  # noqa: E402


def trainer_runs(steps: int) -> list[dict]:
  """Part 2: `python -m train` on the demo and extend_demo configs for `steps` steps; per
  config the medians of its metrics.jsonl over the steps after the first two."""
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    hf_dir = os.path.join(tmp, "tiny_llama_hf")
    subprocess.run([sys.executable, "-m", "models.hf", "random", hf_dir], check=True,
                   capture_output=True)
    for config, extra in (("configs/demo.yaml", []),
                          ("configs/extend_demo.yaml", [f"init_from={hf_dir}"])):
      run_dir = os.path.join(tmp, os.path.basename(config).removesuffix(".yaml"))
      cmd = [sys.executable, "-m", "train", config, f"run_dir={run_dir}", f"steps={steps}",
             "checkpoint_every=0", "eval_every=0", *extra]
      proc = subprocess.run(cmd, capture_output=True, text=True)
      if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
                         f"{proc.stderr[-3000:]}")
      with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
      timed = [r for r in lines if "loss" in r and r["step"] > 2]

      def med(key, timed=timed):
        return statistics.median(r[key] for r in timed)
      summary = [line.strip() for line in proc.stderr.splitlines() if "throughput after" in line]
      cfg = config_lib.load(config)
      rows.append(dict(config=config, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                       steps=steps, timed_steps=len(timed),
                       **{k: med(k) for k in ("tokens_per_s", "tokens_per_s_per_device",
                                              "tflops_per_device", "mfu", "step_time",
                                              "host_time", "dispatch_time")},
                       host_fraction=med("host_time") / med("step_time"),
                       last_step_line=[line for line in proc.stderr.splitlines()
                                       if " | loss " in line][-1],
                       summary=summary[-1] if summary else None))
  return rows


def print_trainer_rows(rows: list[dict]) -> list[str]:
  """Prints part 2's table; returns its lines."""
  lines = [f"{'config':<28} {'seq_len':>7} {'tokens/s':>9} {'tok/s/dev':>9} {'TFLOP/s/dev':>11}"
           f" {'MFU':>7} {'step s':>7} {'host s':>7} {'host %':>7} {'dispatch s':>10}"] + [
      f"{r['config']:<28} {r['seq_len']:>7} {r['tokens_per_s']:>9.0f}"
      f" {r['tokens_per_s_per_device']:>9.0f} {r['tflops_per_device']:>11.4f}"
      f" {100 * r['mfu']:>6.2f}% {r['step_time']:>7.3f} {r['host_time']:>7.3f}"
      f" {100 * r['host_fraction']:>6.1f}% {r['dispatch_time']:>10.3f}" for r in rows]
  print("\n" + "\n".join(lines))
  for r in rows:
    print(f"  {r['config']}: {r['last_step_line'].split('train.loop: ')[-1]}")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", help="write the results to this file")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
  parser.add_argument("--warmup", type=int, default=2,
                      help="untimed steps first per variant (the first compiles)")
  parser.add_argument("--repeats", type=int, default=3, help="matmul timing repeats")
  parser.add_argument("--batch-index", type=int, default=None,
                      help="pipeline batch to use (default: the first with >= --min-docs"
                           " documents per row)")
  parser.add_argument("--min-docs", type=int, default=3)
  parser.add_argument("--config", default="configs/demo.yaml")
  parser.add_argument("--trainer-steps", type=int, default=12,
                      help="steps of each `python -m train` run in part 2 (0: skip part 2)")
  parser.add_argument("--trainer-only", action="store_true", help="run only part 2")
  args = parser.parse_args()
  if args.steps < 1 or args.warmup < 1:
    parser.error("--steps and --warmup expect >= 1")
  if args.trainer_only and args.trainer_steps < 3:
    parser.error("--trainer-only expects --trainer-steps >= 3 (two untimed steps, then timed)")
  wall = time.perf_counter()
  if args.trainer_only:
    rows = trainer_runs(args.trainer_steps)
    lines = print_trainer_rows(rows)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(dict(cpu_cores=os.cpu_count(), jax=jax.__version__,
                       command=" ".join(["python -m bench.training"] + sys.argv[1:]),
                       trainer=rows, trainer_table=lines,
                       wall_s=time.perf_counter() - wall), f, indent=2)
    return

  base = config_lib.load(args.config)
  if base.mesh.context != 4:
    raise SystemExit(f"expects a config with mesh.context=4, got {base.mesh}")
  results = {}
  if devices.enough(4, "part 1 (the variants on 4 devices)"):
    results = variants(args)
    print(f"total {time.perf_counter() - wall:.0f} s")
  trainer_rows = trainer_lines = None
  if args.trainer_steps >= 3:
    trainer_rows = trainer_runs(args.trainer_steps)
    trainer_lines = print_trainer_rows(trainer_rows)

  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(devices=jax.device_count(), cpu_cores=os.cpu_count(),
                     machine=platform.machine(), jax=jax.__version__,
                     xla_flags=os.environ["XLA_FLAGS"], config=args.config,
                     command=" ".join(["python -m bench.training"] + sys.argv[1:]),
                     **results, trainer=trainer_rows, trainer_table=trainer_lines,
                     wall_s=time.perf_counter() - wall), f, indent=2)


def variants(args) -> dict:
  """Part 1: the variants timed side by side; prints their table, returns the JSON fields."""
  specs = [  # (name, overrides, cp_size, dense)
      ("ring (context=4, LB)", ["context_parallel.strategy=ring"], 4, False),
      ("all_gather (context=4, LB)", ["context_parallel.strategy=all_gather"], 4, False),
      ("no CP (1 device)", [], 1, False),
      ("dense mask jax.nn (1 device)", [], 1, True),
  ]
  cfg0 = config_lib.load(args.config, specs[0][1])
  batch_index, local = one_batch(cfg0, args.batch_index, args.min_docs)
  seg = local["segment_ids"]
  lengths = [[int(np.sum(r == s)) for s in np.unique(r[r > 0])] for r in seg]
  padding = int(np.sum(seg == 0))
  print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()} (simulated),"
        f" host cpus: {os.cpu_count()}; XLA_FLAGS={os.environ['XLA_FLAGS']}")
  print(f"model: {num_params(cfg0.model) / 1e6:.3f}M params, {cfg0.model}")

  mm_before = matmul_gflops(args.repeats)
  variants = []
  for name, overrides, cp_size, dense in specs:
    v = Variant(name, config_lib.load(args.config, overrides), local, cp_size=cp_size,
                dense=dense, warmup=args.warmup)
    print(f"  {name}: first step (compile) {v.first_step_s:.1f} s, loss {v.first_loss:.5f}",
          flush=True)
    variants.append(v)
  flops = Flops(variants[0].state.model, layer_masks(cfg0.model)).of(seg)
  print(f"batch: pipeline batch {batch_index}, {cfg0.batch_size} x {cfg0.seq_len} tokens,"
        f" document lengths per row {lengths}, {padding} padding tokens; model FLOPs of the"
        f" batch's documents {flops / 1e9:.3f} GFLOP")
  for _ in range(args.steps):  # interleaved, so that load from other users hits all alike
    for v in variants:
      v.step()
  mm_after = matmul_gflops(args.repeats)
  mm = max(mm_before, mm_after)
  print(f"float32 matmul 2048^3 on one simulated device: {mm_before:.1f} GFLOP/s before,"
        f" {mm_after:.1f} after the steps; MFU uses the higher")

  rows = [v.result() for v in variants]
  for r in rows:
    r["ratio_to_ring"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    r["mfu"] = flops / r["median_step_s"] / (mm * 1e9)
  head = (f"{'variant':<30} {'tokens/s':>9} {'step s':>8} {'best s':>8} {'x ring':>7}"
          f" {'MFU':>6} {'cores':>6} {'loss@0':>8}")
  lines = [head] + [
      f"{r['variant']:<30} {r['tokens_per_s']:>9.0f} {r['median_step_s']:>8.3f}"
      f" {r['best_step_s']:>8.3f} {r['ratio_to_ring']:>7.2f} {r['mfu']:>6.3f}"
      f" {r['cores_used']:>6.2f} {r['first_loss']:>8.4f}" for r in rows]
  print("\n" + "\n".join(lines))
  print(f"\ntokens/s and step s: median of {args.steps} interleaved steps after {args.warmup}"
        f" warm-up; x ring: tokens/s ratio; MFU: the batch's model FLOPs per second against"
        f" {mm:.1f} GFLOP/s; cores: process CPU time / wall time over the timed steps")
  return dict(model=config_lib.to_dict(cfg0)["model"], seq_len=cfg0.seq_len,
              batch_size=cfg0.batch_size, steps=args.steps, warmup=args.warmup,
              batch_source=f"train.data.pipeline (stdlib .py files, bytes tokenizer,"
                           f" first-fit packed, seed {cfg0.seed}), batch {batch_index}",
              document_lengths=lengths, padding_tokens=padding, model_flops=flops,
              matmul_gflops=mm, matmul_gflops_before=mm_before, matmul_gflops_after=mm_after,
              variants=rows, table=lines)


if __name__ == "__main__":
  main()
