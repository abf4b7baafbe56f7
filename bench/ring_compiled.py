"""The ring compiled for TPU v5p and NVIDIA H100 from this host, read from the compiler's
schedule: whether each K/V transfer runs beside a kernel, and the memory per device.

  python -m bench.ring_compiled [--platforms v5p h100] [--cps 2 4 8] [--cases causal packed]
                                [--tokens N] [--heads 16 8] [--grad-dtype float32|inputs]
                                [--head-groups G] [--no-flags] [--json PATH]

Attention alone, forward+backward (the gradient of sum(out^2) in float32 w.r.t. q, k, v):
B=1, H=16 query heads on 8 K/V heads, D=128, bfloat16, `ContextParallel(strategy="ring")`
(and "all_gather" beside it), load balanced; "causal" is one document per row, "packed"
takes segment ids (the program is the same for 16 documents or any number); `--cases
local`: a causal window of a quarter of the tokens per device (the window-aware ring);
`--strategies ulysses`: Ulysses over cp; `ulysses_ring`: Ulysses over 2 devices around a
ring over cp / 2. Each compile's `flaxattn.aot.estimate` is in the JSON rows. Tokens per
device: 32768 on v5p, 16384 on H100 (`--tokens` sets both). cp devices of v5p-8 (cp 2, 4)
or v5p-16 (cp 8), of 4xh100 (cp 2, 4) or 8xh100 (cp 8). The kernels are the platform's:
splash on TPU; on H100 cuDNN where its library is installed on this host (pip install
nvidia-cudnn-cu12; else pallas_gpu, whose ring steps are scanned instead of unrolled).
The platform's overlap flags (`train.xla_flags`) are set unless `--no-flags` (XLA reads
them once per process). `--grad-dtype inputs`: the ring sums its partial gradients in the
inputs' dtype (`ContextParallel(grad_dtype=None)`); default float32. `--head-groups G`:
the ring takes its heads round in G groups (`ContextParallel(head_groups=G)`); default: as
the call chooses (`flaxattn.context_parallel.ring_head_groups`: 4 at these sizes). Needs
libtpu and the CUDA plugin (`pip install "flaxattn[aot]"`).

Per compile (`flaxattn.aot.collectives_in` on `compiled.as_text()`): the K/V transfers
(collective-permutes of at least half a K shard of one group of heads: K, V, and the dK/dV
that travel with them), how many have no kernel scheduled between their start and their
done, and how many nothing computed at all (exposed); all collective bytes and their
exposed share; XLA's temporaries per device (`memory_analysis`). The goals, printed after
the table: no K/V transfer without a kernel beside it except at most one per direction at
the ring's ends (2 in all); at a fixed length per device, the ring's temporaries at cp=8
at most 1.1x those at cp=2 (and, printed beside it, at cp=4), and at most all_gather's at
cp >= 4.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

GIB, MIB = 2**30, 2**20
# (compile target, its devices used) per platform and cp.
TARGETS = {"v5p": {2: "v5p-8", 4: "v5p-8", 8: "v5p-16"},
           "h100": {2: "4xh100", 4: "4xh100", 8: "8xh100"}}
TOKENS = {"v5p": 32768, "h100": 16384}
EXPOSED_ALLOWED = 2  # K/V transfers without a kernel: one per direction, at the ring's ends


@dataclasses.dataclass
class Row:
  """One compile (see the module docstring)."""

  platform: str
  target: str
  cp: int
  case: str
  strategy: str
  tokens: int
  kv_transfers: int
  kv_bytes: int
  without_kernel: int
  without_kernel_bytes: int
  exposed: int
  collective_bytes: int
  exposed_bytes: int
  temporaries: int
  kernels: dict
  compile_s: float
  grad_dtype: str = "float32"
  head_groups: int = 1  # the ring's (`ring_head_groups`); 1 for all_gather
  estimate: dict = dataclasses.field(default_factory=dict)  # `flaxattn.aot.estimate`'s


def compile_case(platform: str, cp: int, case: str, strategy: str, tokens: int,
                 heads: tuple[int, int] = (16, 8), head_dim: int = 128,
                 grad_dtype: str = "float32", head_groups: int | None = None) -> Row:
  """Compiles one case for its target (`TARGETS`) and reads its schedule and plan."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import flaxattn
  from flaxattn import aot, context_parallel, planner

  target = TARGETS[platform][cp]
  from train.config import GRAD_DTYPES

  options = dict(grad_dtype=GRAD_DTYPES[grad_dtype])
  devices = aot.devices(aot.target(target))[:cp]
  if strategy == "ulysses_ring":  # Ulysses over 2 devices around a ring over cp / 2
    mesh = jax.make_mesh((cp // 2, 2), ("context_ring", "context"), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    context = flaxattn.ContextParallel(axis="context", strategy="ulysses",
                                       ring_axis="context_ring", head_groups=head_groups,
                                       **options)
  else:
    mesh = jax.make_mesh((cp,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    context = flaxattn.ContextParallel(axis="context", strategy=strategy,
                                       head_groups=head_groups, **options)
  t = tokens * cp
  # "local": a window of half a load-balanced chunk, which the window-aware ring serves.
  mask = flaxattn.Local(tokens // 4) if case == "local" else flaxattn.Causal()

  def loss(q, k, v, segment_ids):
    out = flaxattn.attention(q, k, v, mask=mask, segment_ids=segment_ids,
                             context_parallel=context)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  h, hkv = heads
  # The ring's groups: Ulysses's ring sees 2 x the tokens and half the heads of a device.
  inner = 2 if strategy == "ulysses_ring" else 1
  groups = (1 if strategy in ("all_gather", "ulysses") else
            context_parallel.ring_head_groups(context, tokens * inner, h // inner, hkv // inner))
  # Mosaic refuses bf16 matmuls at float32 precision: the default, as a real run has it.
  with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
    sharded = NamedSharding(mesh, P(None, context.seq_axes))
    q = jax.ShapeDtypeStruct((1, t, h, head_dim), jnp.bfloat16, sharding=sharded)
    kv = jax.ShapeDtypeStruct((1, t, hkv, head_dim), jnp.bfloat16, sharding=sharded)
    # Segment ids are run-time data: one compiled program serves 16 documents or any number.
    segment_ids = (jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=sharded)
                   if case == "packed" else None)
    begin = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv, segment_ids).compile()
    seconds = time.perf_counter() - begin
  text = compiled.as_text()
  found = aot.collectives_in(text)
  # The FLOPs the program runs (`planner.Shapes.flops`: forward 2 matmuls, backward 5) and
  # the model's (backward 4), per visible (query, key) pair.
  runs = planner.Shapes(1, t, h, hkv, head_dim, 2, mask, True).flops()
  chip = aot.TARGETS[platform]
  estimate = aot.estimate(text, chip, list(mesh.devices.flat), flops=runs,
                          model_flops=runs * 12 / 14, tokens=t)
  shard = tokens * hkv * head_dim * 2 // groups  # one K shard's bytes, of one group of heads
  kv_moves = [c for c in found if c.kind == "collective-permute" and 2 * c.bytes >= shard]
  bare = [c for c in kv_moves if c.kernels == 0]
  return Row(platform, target, cp, case, strategy, tokens,
             kv_transfers=sum(c.times for c in kv_moves),
             kv_bytes=sum(c.bytes * c.times for c in kv_moves),
             without_kernel=sum(c.times for c in bare),
             without_kernel_bytes=sum(c.bytes * c.times for c in bare),
             exposed=sum(c.times for c in kv_moves if c.exposed),
             collective_bytes=sum(c.bytes * c.times for c in found),
             exposed_bytes=sum(c.bytes * c.times for c in found if c.exposed),
             temporaries=aot.memory(compiled).temporaries, kernels=aot.kernels(text),
             compile_s=seconds, grad_dtype=grad_dtype, head_groups=groups,
             estimate=dataclasses.asdict(estimate))


def goals(rows: list[Row]) -> list[str]:
  """One line per goal and (platform, case): the figure, the goal and whether it is met."""
  lines = []
  by = {(r.platform, r.case, r.strategy, r.cp): r for r in rows}
  for platform, case in dict.fromkeys((r.platform, r.case) for r in rows):
    ring = {cp: r for (p, c, s, cp), r in by.items() if (p, c, s) == (platform, case, "ring")}
    gathered = {cp: r for (p, c, s, cp), r in by.items()
                if (p, c, s) == (platform, case, "all_gather")}
    name = f"{platform} {case}"
    for cp, r in sorted(ring.items()):
      if cp >= 4:
        lines.append(f"{name} cp={cp}: {r.without_kernel} K/V transfers of {r.kv_transfers}"
                     f" without a kernel (goal <= {EXPOSED_ALLOWED}):"
                     f" {'met' if r.without_kernel <= EXPOSED_ALLOWED else 'NOT met'}")
    for low in (2, 4):
      if low in ring and 8 in ring:
        ratio = ring[8].temporaries / ring[low].temporaries
        lines.append(f"{name}: temporaries cp=8 / cp={low} = {ratio:.3f} (goal <= 1.1):"
                     f" {'met' if ratio <= 1.1 else 'NOT met'}")
    for cp in sorted(set(ring) & set(gathered)):
      if cp >= 4:
        ratio = ring[cp].temporaries / gathered[cp].temporaries
        lines.append(f"{name} cp={cp}: temporaries ring / all_gather = {ratio:.3f}"
                     f" (goal <= 1): {'met' if ratio <= 1 else 'NOT met'}")
  return lines


def _row(r: Row) -> str:
  return (f"| {r.platform} | {r.target} | {r.cp} | {r.case} | {r.strategy} | {r.head_groups}"
          f" | {r.kv_transfers}"
          f" | {r.without_kernel} ({r.without_kernel_bytes / MIB:.0f}) | {r.exposed}"
          f" | {r.collective_bytes / MIB:.0f} ({r.exposed_bytes / MIB:.0f})"
          f" | {r.temporaries / GIB:.3f} | {', '.join(sorted(r.kernels)) or '-'}"
          f" | {r.compile_s:.0f} |")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--platforms", nargs="+", default=list(TARGETS), choices=list(TARGETS))
  parser.add_argument("--cps", nargs="+", type=int, default=[2, 4, 8], choices=[2, 4, 8])
  parser.add_argument("--cases", nargs="+", default=["causal", "packed"],
                      choices=["causal", "packed", "local"])
  parser.add_argument("--strategies", nargs="+", default=["ring", "all_gather"],
                      choices=["ring", "all_gather", "ulysses", "ulysses_ring"])
  parser.add_argument("--tokens", type=int, help="tokens per device (default: per platform)")
  parser.add_argument("--heads", type=int, nargs=2, default=[16, 8], metavar=("H", "HKV"))
  parser.add_argument("--grad-dtype", default="float32", choices=["float32", "inputs"],
                      help="what the ring sums its partial gradients in")
  parser.add_argument("--head-groups", type=int, help="the ring's head groups (default: chosen)")
  parser.add_argument("--no-flags", action="store_true", help="without train.xla_flags")
  parser.add_argument("--json", help="write the rows and goal lines here")
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if not args.no_flags:
    from train import xla_flags
    xla_flags.apply(["tpu", "gpu"])
  print(f"overlap flags: {'none' if args.no_flags else 'train.xla_flags'};"
        f" LIBTPU_INIT_ARGS={os.environ.get('LIBTPU_INIT_ARGS', '')!r}"
        f" XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
  print("| platform | target | cp | case | strategy | head groups | K/V transfers"
        " | without a kernel (MiB) | exposed | collectives MiB (exposed) | temporaries GiB"
        " | kernels | compile s |\n|" + "---|" * 13, flush=True)
  rows = []
  for platform in args.platforms:
    for case in args.cases:
      for cp in args.cps:
        # all_gather is the memory baseline of the ring at cp >= 4.
        for strategy in [s for s in args.strategies if s == "ring" or cp >= 4]:
          rows.append(compile_case(platform, cp, case, strategy,
                                   args.tokens or TOKENS[platform], tuple(args.heads),
                                   grad_dtype=args.grad_dtype, head_groups=args.head_groups))
          print(_row(rows[-1]), flush=True)
  lines = goals(rows)
  print("\n".join(lines))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"flags": not args.no_flags, "rows": [dataclasses.asdict(r) for r in rows],
                 "goals": lines}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
