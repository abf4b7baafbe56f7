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

A lost process never leaves the others waiting (`_Watchdog`): each process beats a counter
in the job's coordination service (process 0's); a process whose counter stands still for
`heartbeat_timeout_s` (config key, default 100 s) is lost, and every process that remains
prints one line naming it and exits with status `LOST_EXIT`, whether it was waiting in a
collective, a checkpoint's barrier or anywhere else. A collective that fails first (its
peer's connection closed) waits for that verdict (`await_lost`). A lost coordinator
(process 0) ends the others at once: jax's client aborts them when its connection to the
service closes (its message names "the leader task"), before any watchdog can speak.
Restarting every process resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import numpy as np

from train.config import ConfigError, TrainConfig

LOST_EXIT = 3  # the exit status of the processes that remain when one is lost
_ALIVE, _DONE = "flaxattn/alive/", "done"  # the watchdog's keys and a finished process's value
_watchdog: _Watchdog | None = None  # this job's, once `_initialize` started it


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
    _initialize(cfg.distributed, cfg.heartbeat_timeout_s)
  if cfg.num_devices and cfg.platform != "cpu":
    count = start_backend(cfg.platform)
    if count != cfg.num_devices:
      raise ConfigError(f"num_devices={cfg.num_devices} but jax sees {count} devices; set"
                        " num_devices=0 (use all) or platform=cpu to simulate.")


def _initialize(mode: str, heartbeat_timeout_s: int) -> None:
  """`jax.distributed.initialize()`, from `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`
  and `JAX_PROCESS_ID` where the first is set, else from what jax detects; then the
  watchdog that names a process silent for `heartbeat_timeout_s` seconds (`_Watchdog`).

  Raises:
    ConfigError: those variables incomplete, or jax finding no job to join.
  """
  import jax

  global _watchdog
  env = os.environ
  kwargs: dict = {"heartbeat_timeout_seconds": jax_heartbeat_timeout_s(heartbeat_timeout_s)}
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
  if jax.process_count() > 1:
    from jax._src import distributed as jax_distributed  # the client: no public name

    _watchdog = _Watchdog(jax_distributed.global_state.client, heartbeat_timeout_s)
    _watchdog.start()


def jax_heartbeat_timeout_s(heartbeat_timeout_s: int) -> int:
  """jax.distributed's own heartbeat timeout for config key `heartbeat_timeout_s` (an int32:
  `train.config.HEARTBEAT_TIMEOUT_MAX_S` bounds the key). jax's detection is the backstop:
  it aborts the process with a stack trace, so the watchdog, which names the lost process,
  comes first. jax's fired 82 s after a kill with its timeout at 100 s, 90 s at 130 s
  (measured here): twice ours and a minute is clear."""
  return 2 * heartbeat_timeout_s + 60


class _Watchdog(threading.Thread):
  """Names a lost process: every `period` seconds this process bumps its counter in the
  coordination service's key-value store and reads the others'; a counter unchanged for
  `timeout` seconds (by this process's clock) is a lost process, and one that cannot be
  read a lost coordinator: one line says which, and the process exits with `LOST_EXIT` at
  once (its main thread may be blocked in a collective that will never finish). A process
  that finishes marks its counter done first (`finish`)."""

  def __init__(self, client, timeout: float):
    super().__init__(name="train-lost-process-watchdog", daemon=True)
    self.client, self.timeout = client, timeout
    self.period = min(max(timeout / 10, 0.5), 5.0)
    self.done = threading.Event()

  def run(self):
    import jax

    me, count = jax.process_index(), jax.process_count()
    seen: dict[int, tuple[str, float]] = {}  # process -> (counter, when it last changed)
    beat = 0
    while not self.done.wait(self.period):
      beat += 1
      try:
        self.client.key_value_set(f"{_ALIVE}{me}", str(beat), allow_overwrite=True)
        values = dict(self.client.key_value_dir_get(_ALIVE))
      except Exception as e:  # the coordination service is gone
        if self.done.is_set():
          return
        _exit_lost(f"process 0 of {count} (the coordinator, which process {me} cannot reach:"
                   f" {_first_line(e).rstrip('.')})")
      now = time.monotonic()
      for i in range(count):
        value = values.get(f"{_ALIVE}{i}", "")
        if i == me or value == _DONE:
          continue
        if i not in seen or seen[i][0] != value:
          seen[i] = (value, now)
        elif now - seen[i][1] > self.timeout:
          _exit_lost(f"process {i} of {count} (no heartbeat from it for {self.timeout:g} s)")

  def finish(self):
    """Marks this process done (a peer that waits no longer counts it lost) and stops."""
    import jax

    self.done.set()
    with contextlib.suppress(Exception):
      self.client.key_value_set(f"{_ALIVE}{jax.process_index()}", _DONE, allow_overwrite=True)


def _exit_lost(who: str) -> None:
  import jax

  print(f"lost {who}: preempted, killed or crashed; process {jax.process_index()} exits with"
        f" status {LOST_EXIT}. Restart every process: the run resumes from its newest complete"
        " checkpoint.", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(LOST_EXIT)


def await_lost(error: BaseException) -> None:
  """Where a collective of a multi-process job failed with `error` (a peer's connection
  closed): waits for the watchdog to name the lost process (it exits within the heartbeat
  timeout), then returns for the caller to raise `error`. Returns at once in a one-process
  run."""
  if _watchdog is None:
    return
  print(f"a collective failed ({_first_line(error)[:300]}); waiting up to"
        f" {_watchdog.timeout:g} s for the lost process to be named", file=sys.stderr,
        flush=True)
  time.sleep(_watchdog.timeout + 2 * _watchdog.period)


def finish() -> None:
  """Tells the other processes of a job that this one is done: none counts it lost while
  it waits for them at exit (jax's shutdown). A no-op in a one-process run."""
  if _watchdog is not None:
    _watchdog.finish()


def shutdown() -> None:
  """Leaves a multi-process job before a process exits on its own (after a stop signal:
  `os._exit` skips jax's shutdown at exit): `finish`, then `jax.distributed.shutdown()`,
  which waits for every process, so that none loses the coordinator while it still needs
  it. A no-op in a one-process run."""
  if _watchdog is not None:
    import jax

    finish()
    jax.distributed.shutdown()


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
