"""The compiler flags that let a run hide its collectives behind compute, one table per
platform, as the published recipes set them, added to the process's environment before
the backend starts.

  added = xla_flags.apply(["tpu", "gpu"])   # before anything starts a jax backend

TPU (`LIBTPU_INIT_ARGS`, read by libtpu): MaxText's v5p recipes (configs/v5p/*.sh):
asynchronous collective fusion (all-gathers included, in several steps), overlap of
compute and collectives on the TensorCore, asynchronous collective-permutes and
all-gathers, the all-gathers of the backward pipelined, and the data-parallel all-reduce
optimization; and its flags for all-reduces in asynchronous collective fusion
(benchmarks/xla_flags_library.py, CF_FOR_ALL_REDUCE), without which libtpu runs an
all-reduce (the chunked loss's one reduction of the output projection's gradient, 2 GiB in
the 8B example) with nothing beside it.

GPU (`XLA_FLAGS`, read by XLA): MaxText's H100 (A3) recipes: the latency-hiding scheduler,
a collective stream of highest priority, pipelined all-gather, reduce-scatter and
all-reduce, loops double-buffered; and a limit of 4 collectives in flight at once instead
of XLA's 1, so that a ring's K, V and ids transfers all run beside its kernel.

With remat "offload" (layer inputs in the host's memory), TPU also takes the flags of
MaxText's host-offload set (benchmarks/xla_flags_library.py, HOST_OFFLOAD_FLAGS) that change
the 8B example's plan (configs/tpu_v5p_8b.yaml on v5p-128, `python -m train.compile`): host
transfers overlapped and more of them in flight, optimization barriers removed, loop
parameters in collective-fusion chains. The whole set took the collectives left with
nothing beside them from 10.55 to 8.97 GiB per step and the temporaries from 14.87 to 12.00
GiB. With the embedding's gradient reduced per device (`models.llama.embedding_rows`),
these five alone plan exactly as the whole set (7.87 GiB exposed, 12.11 GiB of
temporaries); the set's other five (the scheduler's experimental features, memory-pressure
tracking, second pass) alone give 6.06 GiB exposed but 15.59 GiB of temporaries.

Each flag is added only where its variable does not set it already: a flag the user set
keeps the user's value. XLA and libtpu read these variables once, when their backend
starts; an unknown flag aborts them, so every flag here is checked against the installed
libtpu and jaxlib (tests/test_ring_compiled.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, MutableMapping

log = logging.getLogger(__name__)

# platform: (the variable its compiler reads, ((flag, value), ...)).
TABLE: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "tpu": ("LIBTPU_INIT_ARGS", (
        ("xla_tpu_enable_async_collective_fusion", "true"),
        ("xla_tpu_enable_async_collective_fusion_fuse_all_gather", "true"),
        ("xla_tpu_enable_async_collective_fusion_multiple_steps", "true"),
        ("xla_tpu_overlap_compute_collective_tc", "true"),
        ("xla_enable_async_collective_permute", "true"),
        ("xla_enable_async_all_gather", "true"),
        ("xla_tpu_enable_async_collective_fusion_fuse_all_reduce", "true"),
        ("xla_enable_async_all_reduce", "true"),
        ("xla_tpu_enable_ag_backward_pipelining", "true"),
        ("xla_tpu_megacore_fusion_allow_ags", "false"),
        ("xla_tpu_enable_data_parallel_all_reduce_opt", "true"),
        ("xla_tpu_data_parallel_opt_different_sized_ops", "true"),
    )),
    "gpu": ("XLA_FLAGS", (
        ("xla_gpu_enable_latency_hiding_scheduler", "true"),
        ("xla_gpu_enable_highest_priority_async_stream", "true"),
        ("xla_gpu_enable_pipelined_all_gather", "true"),
        ("xla_gpu_enable_pipelined_reduce_scatter", "true"),
        ("xla_gpu_enable_pipelined_all_reduce", "true"),
        ("xla_gpu_enable_while_loop_double_buffering", "true"),
        ("xla_gpu_experimental_parallel_collective_overlap_limit", "4"),
    )),
}

# platform: ((flag, value), ...) added with remat "offload".
OFFLOAD: dict[str, tuple[tuple[str, str], ...]] = {
    "tpu": (
        ("xla_tpu_host_transfer_overlap_limit", "24"),
        ("xla_max_concurrent_host_send_recv", "100"),
        ("xla_tpu_aggressive_opt_barrier_removal", "ENABLED"),
        ("xla_should_allow_loop_variant_parameter_in_chain", "ENABLED"),
        ("xla_should_add_loop_invariant_op_in_chain", "ENABLED"),
    ),
}


def flags_for(platform: str, *, offload: bool = False) -> tuple[str, tuple[tuple[str, str], ...]]:
  """The variable `platform`'s compiler reads and the flags `apply` adds to it."""
  variable, table = TABLE[platform]
  return variable, table + (OFFLOAD.get(platform, ()) if offload else ())


def _set(value: str) -> set[str]:
  """The flag names a variable's value sets (`--name=value` or `--name`)."""
  return {word.removeprefix("--").split("=", 1)[0] for word in value.split()
          if word.startswith("--")}


def apply(platforms: Iterable[str], environ: MutableMapping[str, str] = os.environ, *,
          offload: bool = False) -> dict[str, list[str]]:
  """Adds the flags of each of `platforms` ("tpu", "gpu"; others have none) to its variable
  in `environ`, each flag only where the variable does not set it; with `offload` (remat
  "offload") also `OFFLOAD`'s. Call before jax starts a backend. Returns `{variable: [the
  flags added]}` and logs them; also the ones the user set, which are left as they are."""
  added: dict[str, list[str]] = {}
  for platform in dict.fromkeys(platforms):
    if platform not in TABLE:
      continue
    variable, flags = flags_for(platform, offload=offload)
    present = environ.get(variable, "")
    mine = [f"--{name}={value}" for name, value in flags if name not in _set(present)]
    kept = sorted(_set(present) & {name for name, _ in flags})
    if mine:
      environ[variable] = " ".join([*present.split(), *mine])
      added[variable] = mine
    log.info("overlap flags for %s: %s added to %s%s", platform,
             " ".join(mine) or "none", variable,
             f"; kept as set: {', '.join(kept)}" if kept else "")
  return added


def platforms_of(platform: str) -> tuple[str, ...]:
  """The platforms whose flags a run on config `platform` ("" for JAX's default) needs:
  that one, or with the default both TPU's and GPU's (each variable is read only by its own
  compiler, so the one not used changes nothing)."""
  return (platform,) if platform else ("tpu", "gpu")
