"""Process-level setup before the first jax computation (the platform, simulated CPU
devices, `jax.distributed.initialize` for multi-host jobs), and the agreements between the
processes of a job: decisions that each process makes from what it sees (a SIGTERM, a
checkpoint that fails to restore) are combined, so that all take the same branch.

`jax.distributed.initialize()` is called when `distributed` is "on", or when it is "auto"
and the environment describes a multi-process job:
  - `JAX_COORDINATOR_ADDRESS` is set (with `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`,
    passed on explicitly; e.g. a hand-launched GPU cluster);
  - a multi-host TPU slice: `TPU_WORKER_HOSTNAMES` lists more than one host (or
    `MEGASCALE_COORDINATOR_ADDRESS` is set for multislice);
  - SLURM with more than one task (`SLURM_NTASKS` > 1) or Open MPI with more than one rank
    (`OMPI_COMM_WORLD_SIZE` > 1), which jax detects by itself.
"""

from __future__ import annotations

import os

import numpy as np

from train.config import ConfigError, TrainConfig


def _multi_process_env() -> bool:
  env = os.environ
  if env.get("JAX_COORDINATOR_ADDRESS") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return True
  if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
    return True
  return any(int(env.get(name, "1") or 1) > 1 for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))


def jax_platforms(platform: str) -> str:
  """JAX's `jax_platforms` value for the config's `platform` (`config.PLATFORMS`): the same
  name, but "gpu" is "cuda". JAX expands "gpu" to every GPU platform it knows (CUDA and
  ROCm) and fails when one does not start (jax 0.11: "Unable to initialize backend 'rocm'"
  on an NVIDIA host); flaxattn's GPU kernels are NVIDIA's. A ROCm host names "rocm"."""
  return "cuda" if platform == "gpu" else platform


def setup(cfg: TrainConfig) -> None:
  """Applies `cfg.platform`, `cfg.num_devices` and `cfg.distributed`; call before any
  other jax use (XLA reads `XLA_FLAGS` when its backend starts).

  Raises:
    RuntimeError: simulated devices requested after a jax backend already started.
    ConfigError: the device count differs from `num_devices` (non-CPU platforms).
  """
  import jax  # imported (not initialized) by the config's model import already
  from jax._src import xla_bridge

  if cfg.platform:
    jax.config.update("jax_platforms", jax_platforms(cfg.platform))
  if cfg.platform == "cpu" and cfg.num_devices:
    if xla_bridge.backends_are_initialized():
      raise RuntimeError("num_devices needs XLA_FLAGS set before jax starts its backend, but"
                         " it has started; run the trainer as `python -m train ...`.")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={cfg.num_devices}")
    if not any(f.startswith("--xla_cpu_multi_thread_eigen") for f in flags):
      # Simulated devices share the host's cores; a thread pool per device oversubscribes
      # them (2x slower steps on 2 cores with 4 devices).
      flags.append("--xla_cpu_multi_thread_eigen=false")
    os.environ["XLA_FLAGS"] = " ".join(flags)
  if cfg.distributed == "on" or (cfg.distributed == "auto" and _multi_process_env()):
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
      jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                                 num_processes=int(env["JAX_NUM_PROCESSES"]),
                                 process_id=int(env["JAX_PROCESS_ID"]))
    else:
      jax.distributed.initialize()
  if cfg.num_devices and cfg.platform != "cpu" and jax.device_count() != cfg.num_devices:
    raise ConfigError(f"num_devices={cfg.num_devices} but jax sees {jax.device_count()}"
                      " devices; set num_devices=0 (use all) or platform=cpu to simulate.")


def process_max(value: int) -> int:
  """The largest `value` over the job's processes. A collective: every process calls it
  at the same point."""
  import jax
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils
  return int(multihost_utils.process_allgather(np.int32(value)).max())


def barrier(name: str) -> None:
  """Returns on each process once every process has reached `barrier(name)`."""
  import jax
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
