"""Runs of the trainer (`python -m train`) for tests, in subprocesses on simulated CPU devices.

A tiny model (dim 32, one layer) on 256-token rows, 4 simulated CPU devices with ring
context parallelism over a context axis of 4 (configs/demo.yaml with the `TINY`
overrides), so each run compiles and trains in seconds.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import portpicker
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 240  # per trainer run: a hang fails instead of blocking CI
STEPS = 12
TINY = [f"steps={STEPS}", "seq_len=256", "checkpoint_every=2", "eval_every=4",
        "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.ffn_dim=64", "optimizer.warmup_steps=2", "num_devices=4", "mesh.context=4",
        "context_parallel.strategy=ring"]
# Not inherited from the machine running the tests: variables that make `distributed: auto`
# start a multi-process job, and the machine's own compilation cache.
STRIPPED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                "MEGASCALE_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS",
                "OMPI_COMM_WORLD_SIZE", "JAX_COMPILATION_CACHE_DIR")
# Runs share a persistent compilation cache that lives as long as the test session
# (conftest.py names it): most compile the same tiny programs, and their compilation is not
# what they test. A run whose compilation is (a resume after a kill), and runs started
# together (which would write the same entries at once), pass `compile_cache=False`.
SESSION_CACHE = "FLAXATTN_TEST_COMPILATION_CACHE"


def clean_env(compile_cache: bool = True, **extra) -> dict:
  out = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
  out.update(PYTHONUNBUFFERED="1")
  if compile_cache and os.environ.get(SESSION_CACHE):
    out.update(JAX_COMPILATION_CACHE_DIR=os.environ[SESSION_CACHE],
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  out.update(extra)
  return out


def command(run_dir, *overrides) -> list[str]:
  return [sys.executable, "-m", "train", "configs/demo.yaml", f"run_dir={run_dir}", *TINY,
          *overrides]


def start(run_dir, *overrides, log: pathlib.Path, env=None, cmd=None) -> subprocess.Popen:
  """The trainer (or `cmd`) in its own process group (so a kill takes all of it), output
  to `log`."""
  with open(log, "w") as f:
    return subprocess.Popen(cmd or command(run_dir, *overrides), cwd=ROOT,
                            env=env or clean_env(), stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait(proc: subprocess.Popen, log: pathlib.Path, timeout=TIMEOUT) -> str:
  """`proc`'s exit, then its output; kills its process group on timeout (and fails)."""
  try:
    proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    kill_group(proc)
    pytest.fail(f"trainer timed out after {timeout} s:\n{log.read_text()[-4000:]}")
  return log.read_text()


def kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def train(run_dir, *overrides, log: pathlib.Path, env=None) -> str:
  """A run to completion; asserts exit 0 and returns its output."""
  proc = start(run_dir, *overrides, log=log, env=env)
  out = wait(proc, log)
  assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-4000:]}"
  return out


def train_together(tmp_path, overrides: dict[str, list[str]], config=None) -> dict[str, str]:
  """One run per name at once (run_dir `tmp_path / name`; `config` with the name's overrides,
  or without `config` the demo made tiny), to completion; asserts every exit is 0 and returns
  the outputs."""
  runs = {name: (tmp_path / name, tmp_path / f"{name}.txt") for name in overrides}
  procs = {}
  try:
    for name, (run_dir, log) in runs.items():
      cmd = None if config is None else [sys.executable, "-m", "train", config,
                                         f"run_dir={run_dir}", *overrides[name]]
      procs[name] = start(run_dir, *overrides[name], log=log, cmd=cmd,
                          env=clean_env(compile_cache=False))
    outs = {name: wait(p, runs[name][1]) for name, p in procs.items()}
  finally:
    for p in procs.values():
      if p.poll() is None:
        kill_group(p)
  for name, p in procs.items():
    assert p.returncode == 0, outs[name][-4000:]
  return outs


def start_job(run_dir, logs: list[pathlib.Path], *overrides, main: str | None = None, **env
              ) -> list[subprocess.Popen]:
  """The trainer (or the Python code `main`, which gets the trainer's arguments) as a job of
  one process per log, 2 CPU devices each, on a coordinator of a free local port (gloo
  collectives between them); `env` added to each one's."""
  port = portpicker.pick_unused_port()
  args = command(run_dir, "num_devices=2", *overrides)
  cmd = args if main is None else [sys.executable, "-c", main, *args[3:]]
  return [start(run_dir, log=log, cmd=cmd,
                env=clean_env(False, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                              JAX_NUM_PROCESSES=str(len(logs)), JAX_PROCESS_ID=str(i), **env))
          for i, log in enumerate(logs)]


def two_processes(run_dir, logs, *overrides, returncode: int = 0, main: str | None = None
                  ) -> list[str]:
  """`start_job` of two processes, then `finish`."""
  return finish(start_job(run_dir, logs, *overrides, main=main), logs, returncode)


def finish(procs: list[subprocess.Popen], logs: list[pathlib.Path], returncode: int = 0
           ) -> list[str]:
  """Waits for every process of a job (`start_job`); asserts each exits with `returncode`;
  returns their outputs."""
  try:
    outs = [wait(p, log) for p, log in zip(procs, logs, strict=True)]
  finally:
    for p in procs:
      if p.poll() is None:
        kill_group(p)
  for p, out in zip(procs, outs, strict=True):
    assert p.returncode == returncode, out[-4000:]
  return outs


def run(cmd: list[str], timeout=120) -> subprocess.CompletedProcess:
  """`cmd` (e.g. a trainer run expected to fail fast) to completion, output captured."""
  return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                        timeout=timeout)


# The trainer's `main`, then a line saying whether XLA started a backend (nothing compiles
# without one); with `--hide-sentencepiece` first, as on a machine without the package.
MAIN_REPORTING_BACKEND = (
    "import sys\n"
    "if sys.argv[1:2] == ['--hide-sentencepiece']:\n"
    "  sys.argv.pop(1)\n"
    "  sys.modules['sentencepiece'] = None  # `import sentencepiece` raises ImportError\n"
    "from train.__main__ import main\n"
    "rc = main(sys.argv[1:])\n"
    "from jax._src import xla_bridge\n"
    "print('BACKEND_STARTED', xla_bridge.backends_are_initialized())\n"
    "sys.exit(rc)\n")


def refused(cmd: list[str], prefix: str, *names, run_dir=None) -> subprocess.CompletedProcess:
  """Runs `cmd`, a command expected to refuse its arguments: asserts exit 2, no traceback,
  the last line of stderr starting with `prefix` and naming each of `names`, and, with
  `run_dir`, that it was not created."""
  proc = run(cmd)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and lines, proc.stdout + proc.stderr
  assert "Traceback" not in proc.stderr and lines[-1].startswith(prefix), proc.stderr
  assert all(str(n) in lines[-1] for n in names), (names, lines[-1])
  assert run_dir is None or not pathlib.Path(run_dir).exists(), f"{run_dir} was written"
  return proc


def metrics(run_dir) -> list[dict]:
  """Every complete line of metrics.jsonl, in file order (a line being written may be cut
  short; a resumed run appends lines for steps it redoes)."""
  path = pathlib.Path(run_dir) / "metrics.jsonl"
  rows = []
  if path.exists():
    for line in path.read_text().splitlines():
      try:
        rows.append(json.loads(line))
      except ValueError:
        pass
  return rows


def losses(run_dir, key="loss") -> dict[int, float]:
  """step -> value of `key` in the step's last line (the current one)."""
  return {r["step"]: r[key] for r in metrics(run_dir) if key in r}


def checkpoints(run_dir) -> list[int]:
  """Steps of finished checkpoints (orbax renames a step's temporary directory into
  `checkpoints/<step>` when the save is complete)."""
  d = pathlib.Path(run_dir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def interrupt(proc, log, condition, what: str, sig=signal.SIGTERM, group=False,
              timeout=30) -> str:
  """Waits for `condition()` (`poll`), sends `sig` to the trainer (to its process group
  with `group`, as Ctrl-C in a terminal does), and returns its output once it exits; the
  process group is killed if anything on the way fails."""
  try:
    poll(proc, log, condition, what)
    if group:
      os.killpg(proc.pid, sig)
    else:
      proc.send_signal(sig)
    return wait(proc, log, timeout=timeout)
  finally:
    if proc.poll() is None:
      kill_group(proc)


def poll(proc, log, condition, what: str, timeout=TIMEOUT) -> None:
  """Waits until `condition()` holds while `proc` runs; fails if it exits or times out."""
  deadline = time.monotonic() + timeout
  while not condition():
    if proc.poll() is not None:
      pytest.fail(f"trainer exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
    if time.monotonic() > deadline:
      kill_group(proc)
      pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")
    time.sleep(0.02)
