"""The trainer (`python -m train`) end to end, in subprocesses on simulated CPU devices.

A tiny model (dim 32, one layer) on 256-token rows, 4 simulated CPU devices with ring
context parallelism over a context axis of 4 (configs/demo.yaml with overrides), so each
run compiles and trains in seconds. One uninterrupted run (`reference`, module-scoped) is
the baseline that the interrupted, resumed, damaged and two-process runs are compared with:
resuming on CPU is bit-identical, so their losses must equal it exactly; the two-process
run differs only in reduction order.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
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
# start a multi-process job, and a compilation cache (runs compile afresh unless a test
# passes one; see `reference`).
STRIPPED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                     "MEGASCALE_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS",
                     "OMPI_COMM_WORLD_SIZE", "JAX_COMPILATION_CACHE_DIR")


def _env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in STRIPPED_ENV}
  env.update(PYTHONUNBUFFERED="1", **extra)
  return env


def _command(run_dir, *overrides) -> list[str]:
  return [sys.executable, "-m", "train", "configs/demo.yaml", f"run_dir={run_dir}", *TINY,
          *overrides]


def _start(run_dir, *overrides, log: pathlib.Path, env=None) -> subprocess.Popen:
  """The trainer in its own process group (so a kill takes all of it), output to `log`."""
  with open(log, "w") as f:
    return subprocess.Popen(_command(run_dir, *overrides), cwd=ROOT, env=env or _env(),
                            stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(proc: subprocess.Popen, log: pathlib.Path, timeout=TIMEOUT) -> str:
  """`proc`'s exit, then its output; kills its process group on timeout (and fails)."""
  try:
    proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    _kill_group(proc)
    pytest.fail(f"trainer timed out after {timeout} s:\n{log.read_text()[-4000:]}")
  return log.read_text()


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def _train(run_dir, *overrides, log: pathlib.Path, env=None) -> str:
  """A run to completion; asserts exit 0 and returns its output."""
  proc = _start(run_dir, *overrides, log=log, env=env)
  out = _wait(proc, log)
  assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-4000:]}"
  return out


def _metrics(run_dir) -> list[dict]:
  """The complete lines of metrics.jsonl (a line being written may be cut short)."""
  path = pathlib.Path(run_dir) / "metrics.jsonl"
  rows = []
  if path.exists():
    for line in path.read_text().splitlines():
      try:
        rows.append(json.loads(line))
      except ValueError:
        pass
  return rows


def _losses(run_dir, key="loss") -> dict[int, float]:
  """step -> value of `key`; asserts each step appears once."""
  rows = [r for r in _metrics(run_dir) if key in r]
  steps = [r["step"] for r in rows]
  assert len(steps) == len(set(steps)), f"{key}: repeated steps {steps}"
  return {r["step"]: r[key] for r in rows}


def _checkpoints(run_dir) -> list[int]:
  """Steps of finished checkpoints (orbax renames a step's temporary directory into
  `checkpoints/<step>` when the save is complete)."""
  d = pathlib.Path(run_dir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _poll(proc, log, condition, what: str, timeout=TIMEOUT) -> None:
  """Waits until `condition()` holds while `proc` runs; fails if it exits or times out."""
  deadline = time.monotonic() + timeout
  while not condition():
    if proc.poll() is not None:
      pytest.fail(f"trainer exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
    if time.monotonic() > deadline:
      _kill_group(proc)
      pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")
    time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run: (run_dir, output, env).

  `env` names a persistent compilation cache that this run fills, for runs of the same
  programs whose compilation is not under test (the run that gets killed, the
  damaged-checkpoint rerun). The resumed run after the kill compiles afresh, as a user's
  resume does: its bit-identity includes the compiler's.
  """
  run_dir = tmp_path_factory.mktemp("reference") / "run"
  env = _env(JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  out = _train(run_dir, log=run_dir.parent / "log.txt", env=env)
  return run_dir, out, env


def test_end_to_end_context_parallel(reference):
  run_dir, out, _ = reference
  losses = _losses(run_dir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  assert all(math.isfinite(v) for v in losses.values()), losses
  evals = _losses(run_dir, "eval_loss")
  assert sorted(evals) == [4, 8, 12] and all(math.isfinite(v) for v in evals.values()), evals
  config = json.loads((run_dir / "config.json").read_text())
  assert config["mesh"]["context"] == 4 and config["num_devices"] == 4
  assert config["context_parallel"]["strategy"] == "ring"
  assert "'context': 4" in out  # the mesh the loop logged
  assert _checkpoints(run_dir)[-1] == STEPS
  assert {"state", "data"} <= {p.name for p in (run_dir / "checkpoints" / str(STEPS)).iterdir()}
  assert (run_dir / "loss.png").stat().st_size > 0
  assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_kill_and_resume_is_bit_identical(reference, tmp_path):
  """SIGKILL after a finished checkpoint (step >= 2) and a logged step past it; the rerun
  (compiling afresh) must reproduce every loss and eval loss of the reference exactly."""
  ref_dir, _, cached_env = reference
  run_dir, log = tmp_path / "run", tmp_path / "killed.txt"
  proc = _start(run_dir, log=log, env=cached_env)  # the run to kill: no need to recompile
  killed_after = {}

  def checkpoint_and_a_step_after():
    done = [s for s in _checkpoints(run_dir) if s >= 2]
    logged = [r["step"] for r in _metrics(run_dir) if "loss" in r]
    if done and logged and max(logged) > done[-1]:
      killed_after.update(checkpoint=done[-1], logged=max(logged))
      return True
    return False

  try:
    _poll(proc, log, checkpoint_and_a_step_after, "a checkpoint at step >= 2 and a later step")
  finally:
    _kill_group(proc)
  assert proc.returncode == -signal.SIGKILL, log.read_text()[-4000:]
  assert killed_after["logged"] < STEPS, "the run finished before it was killed"

  out = _train(run_dir, log=tmp_path / "resumed.txt")
  assert "resumed from step " in out, out[-4000:]
  resumed = int(out.split("resumed from step ")[1].split()[0])
  assert resumed >= killed_after["checkpoint"], out[-4000:]
  assert _losses(run_dir) == _losses(ref_dir)  # exact: float equality, every step
  assert _losses(run_dir, "eval_loss") == _losses(ref_dir, "eval_loss")


def test_sigterm_saves_and_exits_zero(tmp_path):
  steps = 100_000
  run_dir, log = tmp_path / "run", tmp_path / "log.txt"
  proc = _start(run_dir, f"steps={steps}", "checkpoint_every=0", "eval_every=0", log=log)
  try:
    _poll(proc, log, lambda: any(r["step"] >= 2 for r in _metrics(run_dir)), "step 2")
    proc.send_signal(signal.SIGTERM)
    out = _wait(proc, log, timeout=120)
  finally:
    if proc.poll() is None:
      _kill_group(proc)
  assert proc.returncode == 0, out[-4000:]
  last = max(_losses(run_dir))
  assert 2 <= last < steps
  assert _checkpoints(run_dir) == [last]  # checkpoint_every=0: only the SIGTERM save
  assert f"SIGTERM: saved step {last}" in out


@pytest.mark.parametrize("override, names", [
    ("model.dimm=64", "model.dimm"),
    ("steps=many", "steps"),
    ("model.tie_embeddings=3", "model.tie_embeddings"),
])
def test_bad_config_fails_before_jax_starts(tmp_path, override, names):
  """Exit 2 with `config error` naming the key (and listing the valid keys for an unknown
  one), no run_dir, and no jax backend started: the trainer's `main` runs in a wrapper
  that reports whether XLA started a backend (nothing compiles without one)."""
  run_dir = tmp_path / "run"
  wrapper = ("import sys\n"
             "from train.__main__ import main\n"
             "rc = main(sys.argv[1:])\n"
             "from jax._src import xla_bridge\n"
             "print('BACKEND_STARTED', xla_bridge.backends_are_initialized())\n"
             "sys.exit(rc)\n")
  cmd = _command(run_dir, override)
  proc = subprocess.run([sys.executable, "-c", wrapper, *cmd[3:]], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "config error" in proc.stderr and repr(names) in proc.stderr, proc.stderr
  if override.startswith("model.dimm"):
    assert "Valid keys" in proc.stderr
    assert all(k in proc.stderr for k in ("model.dim", "steps", "mesh.context", "run_dir"))
  assert "BACKEND_STARTED False" in proc.stdout, proc.stdout
  assert not run_dir.exists()


def test_bad_config_exit_status_of_module(tmp_path):
  """The same through `python -m train` itself: status 2, the message, no run_dir."""
  run_dir = tmp_path / "run"
  proc = subprocess.run(_command(run_dir, "model.dimm=64"), cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "config error: unknown config key 'model.dimm'" in proc.stderr
  assert not run_dir.exists()


def test_damaged_checkpoints_fall_back(reference, tmp_path):
  """The newest checkpoint lacks an item (the data position) and the one before has
  truncated array files: each is warned about and set aside, the third newest is resumed
  from, and the redone steps reproduce the uninterrupted run's losses."""
  ref_dir, _, cached_env = reference
  run_dir = tmp_path / "run"
  shutil.copytree(ref_dir, run_dir)
  *_, fallback, truncated, missing = _checkpoints(run_dir)
  shutil.rmtree(run_dir / "checkpoints" / str(missing) / "data")
  state = run_dir / "checkpoints" / str(truncated) / "state"
  files = [p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files
  for p in files:
    with open(p, "r+b") as f:
      f.truncate(10)
  # Drop the metrics of the steps to redo, so that the equality below is the rerun's doing.
  rows = [r for r in _metrics(run_dir) if r["step"] <= fallback]
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

  # The reference run's programs: its compilation cache saves the compile time.
  out = _train(run_dir, log=tmp_path / "log.txt", env=cached_env)
  warned = [out.find(f"checkpoint step {s} in ") for s in (missing, truncated)]
  assert 0 <= warned[0] < warned[1], out[-4000:]
  assert out.count("failed to restore") == 2, out[-4000:]
  assert f"resumed from step {fallback} " in out, out[-4000:]
  unusable = sorted(int(p.name.split("-")[0]) for p in (run_dir / "checkpoints_unusable").iterdir())
  assert unusable == [truncated, missing]
  assert _checkpoints(run_dir)[-1] == STEPS
  assert _losses(run_dir) == _losses(ref_dir)
  assert _losses(run_dir, "eval_loss") == _losses(ref_dir, "eval_loss")


def test_two_processes_context_parallel(reference, tmp_path):
  """Two processes with 2 CPU devices each (gloo collectives), mesh context=4 spanning
  both; the losses match the single-process 4-device run up to reduction order."""
  ref_dir, _, _ = reference
  run_dir = tmp_path / "run"
  port = portpicker.pick_unused_port()
  procs, logs = [], []
  for i in range(2):
    env = _env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(i))
    logs.append(tmp_path / f"process{i}.txt")
    procs.append(_start(run_dir, "num_devices=2", log=logs[-1], env=env))
  try:
    outs = [_wait(p, log) for p, log in zip(procs, logs)]
  finally:
    for p in procs:
      if p.poll() is None:
        _kill_group(p)
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
    assert "'context': 4" in out
  got, want = _losses(run_dir), _losses(ref_dir)
  assert sorted(got) == list(range(1, STEPS + 1))
  assert got[1] == pytest.approx(want[1], abs=1e-5)
  assert all(got[s] == pytest.approx(want[s], abs=1e-4) for s in want), (got, want)
  assert _losses(run_dir, "eval_loss") == pytest.approx(_losses(ref_dir, "eval_loss"), abs=1e-4)
  assert _checkpoints(run_dir)[-1] == STEPS
