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
    ConfigError: `distributed` settings that do not start a job; with `num_devices` on
      another platform than "cpu", a platform that does not start or another device count
      (which starts the backend: `start_backend`, which `train.loop` calls otherwise).
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
    _initialize(cfg.distributed)
  if cfg.num_devices and cfg.platform != "cpu":
    count = start_backend(cfg.platform)
    if count != cfg.num_devices:
      raise ConfigError(f"num_devices={cfg.num_devices} but jax sees {count} devices; set"
                        " num_devices=0 (use all) or platform=cpu to simulate.")


def _initialize(mode: str) -> None:
  """`jax.distributed.initialize()`, from `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`
  and `JAX_PROCESS_ID` where the first is set, else from what jax detects.

  Raises:
    ConfigError: those variables incomplete, or jax finding no job to join.
  """
  import jax

  env = os.environ
  kwargs = {}
  if env.get("JAX_COORDINATOR_ADDRESS"):
    kwargs["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
    for name, arg in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
      try:
        kwargs[arg] = int(env[name])
      except (KeyError, ValueError):
        raise ConfigError(f"JAX_COORDINATOR_ADDRESS is set, and {name} expects an int beside"
                          f" it, got {env.get(name)!r}; set JAX_NUM_PROCESSES and"
                          " JAX_PROCESS_ID for each process.") from None
  try:
    jax.distributed.initialize(**kwargs)
  except (ValueError, RuntimeError) as e:
    raise ConfigError(f"config key 'distributed' ({mode!r}): jax.distributed.initialize() failed:"
                      f" {_first_line(e)} Set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and"
                      " JAX_PROCESS_ID, launch under a cluster jax detects (SLURM, Open MPI, a"
                      " multi-host TPU slice), or set distributed=off for one process.") from None


def start_backend(platform: str, setting: str = "config key 'platform'",
                  fix: str = "set a platform this machine has ('' for jax's default)") -> int:
  """Starts jax's backend for `platform` (set before as `jax_platforms`; "" for jax's
  default) and returns its device count; a no-op once started.

  Args:
    setting: where `platform` comes from, for the error; fix: what to do about it.

  Raises:
    ConfigError: the backend does not start (no such device here, a jax without its
      plugin), naming `setting`, `platform` and `fix`.
  """
  import jax

  install = (f" {fix[0].upper()}{fix[1:]}, or install jax's support for that platform (pip"
             " install -e '.[cuda12]', '.[cuda13]' or '.[tpu]'; see the README).")
  try:
    return jax.device_count()
  except RuntimeError as e:
    raise ConfigError(f"{setting} ({platform!r}): jax cannot start it here: {_first_line(e)}"
                      + install) from None
  except AssertionError:  # jax 0.10-0.12 assert when no backend of jax_platforms is installed
    raise ConfigError(f"{setting} ({platform!r}): jax cannot start it here: this jax has no"
                      f" backend for jax_platforms={jax_platforms(platform)!r} (CPU-only"
                      " jax, or its plugin missing)." + install) from None


def _first_line(error: BaseException) -> str:
  text = (str(error).strip().splitlines() or [type(error).__name__])[0]
  return text if text.endswith(".") else text + "."


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
