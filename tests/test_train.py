"""The trainer (`python -m train`) end to end, in subprocesses on simulated CPU devices
(`trainer.TINY`: a tiny model, ring context parallelism over 4 simulated devices).

One uninterrupted run (`reference`, module-scoped) is the baseline that the interrupted,
resumed, damaged and two-process runs are compared with: resuming on CPU is bit-identical,
so their losses must equal it exactly; the two-process run differs only in reduction order.
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import re
import shutil
import signal
import sys
import time

import pytest

from trainer import (
  MAIN_REPORTING_BACKEND,
  STEPS,
  checkpoints,
  clean_env,
  command,
  interrupt,
  kill_group,
  losses,
  metrics,
  poll,
  run,
  start,
  train,
  train_together,
  two_processes,
  wait,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run: (run_dir, output, env).

  `env` is the trainer's environment with the session's compilation cache (`clean_env`),
  for runs of the same programs whose compilation is not under test (the run that gets
  killed, the damaged-checkpoint rerun). The resumed run after the kill compiles afresh, as
  a user's resume does: its bit-identity includes the compiler's.
  """
  run_dir = tmp_path_factory.mktemp("reference") / "run"
  env = clean_env()
  out = train(run_dir, log=run_dir.parent / "log.txt", env=env)
  return run_dir, out, env


@pytest.mark.slow  # runs the trainer
def test_end_to_end_context_parallel(reference):
  run_dir, out, _ = reference
  train_losses = losses(run_dir)
  assert sorted(train_losses) == list(range(1, STEPS + 1))
  assert all(math.isfinite(v) for v in train_losses.values()), train_losses
  evals = losses(run_dir, "eval_loss")
  assert sorted(evals) == [4, 8, 12] and all(math.isfinite(v) for v in evals.values()), evals
  config = json.loads((run_dir / "config.json").read_text())
  assert config["mesh"]["context"] == 4 and config["num_devices"] == 4
  assert config["context_parallel"]["strategy"] == "ring"
  assert "'context': 4" in out  # the mesh the loop logged
  assert checkpoints(run_dir)[-1] == STEPS
  assert {"state", "data"} <= {p.name for p in (run_dir / "checkpoints" / str(STEPS)).iterdir()}
  assert (run_dir / "loss.png").stat().st_size > 0
  assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow  # runs the trainer
def test_kill_and_resume_is_bit_identical(reference, tmp_path):
  """SIGKILL after a finished checkpoint (step >= 2) and a logged step past it; the rerun
  (compiling afresh) must reproduce every loss and eval loss of the reference exactly, and
  append to metrics.jsonl: the killed run's lines past the checkpoint stay."""
  ref_dir, _, cached_env = reference
  run_dir, log = tmp_path / "run", tmp_path / "killed.txt"
  proc = start(run_dir, log=log, env=cached_env)  # the run to kill: no need to recompile
  killed_after = {}

  def checkpoint_and_a_step_after():
    done = [s for s in checkpoints(run_dir) if s >= 2]
    logged = [r["step"] for r in metrics(run_dir) if "loss" in r]
    if done and logged and max(logged) > done[-1]:
      killed_after.update(checkpoint=done[-1], logged=max(logged))
      return True
    return False

  try:
    poll(proc, log, checkpoint_and_a_step_after, "a checkpoint at step >= 2 and a later step")
  finally:
    kill_group(proc)
  assert proc.returncode == -signal.SIGKILL, log.read_text()[-4000:]
  assert killed_after["logged"] < STEPS, "the run finished before it was killed"

  out = train(run_dir, log=tmp_path / "resumed.txt", env=clean_env(compile_cache=False))
  assert "resumed from step " in out, out[-4000:]
  resumed = int(out.split("resumed from step ")[1].split()[0])
  assert resumed >= killed_after["checkpoint"], out[-4000:]
  assert losses(run_dir) == losses(ref_dir)  # exact: float equality, every step
  assert losses(run_dir, "eval_loss") == losses(ref_dir, "eval_loss")
  lines = collections.Counter(r["step"] for r in metrics(run_dir) if "loss" in r)
  assert all(lines[s] == 1 for s in range(1, resumed + 1)), lines
  assert all(lines[s] == 2 for s in range(resumed + 1, killed_after["logged"] + 1)), lines
  assert f"past the checkpoint at step {resumed}" in out


# The trainer with document reads that block forever (as on a stalled file system) once the
# file named by the first argument exists; a read that blocks first creates `blocked` beside it.
BLOCKING_READS = ("import pathlib, sys, threading\n"
                  "from train import data\n"
                  "gate = pathlib.Path(sys.argv.pop(1))\n"
                  "read = data.Document.read\n"
                  "def blocking_read(doc):\n"
                  "  if gate.exists():\n"
                  "    gate.with_name('blocked').touch()\n"
                  "    threading.Event().wait()\n"
                  "  return read(doc)\n"
                  "data.Document.read = blocking_read\n"
                  "from train.__main__ import main\n"
                  "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.slow  # runs the trainer
@pytest.mark.parametrize("reads", ["flowing", "blocked after steps", "blocked from the start"])
def test_sigterm_saves_and_exits_zero(tmp_path, reads):
  """SIGTERM after some steps saves the last step done and exits 0, within seconds, also
  when the loop is waiting on document reads that never return; while the corpus is
  checked (reads blocked from the start) the run exits 0 at once with nothing to save."""
  steps = 100_000
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(40):  # about one 256-token row each: the read-ahead runs dry quickly
    (corpus / f"{i}.txt").write_text(f"document {i}: " + "lorem ipsum dolor sit amet " * 11)
  run_dir, log, gate = tmp_path / "run", tmp_path / "log.txt", tmp_path / "gate"
  blocked = gate.with_name("blocked")
  if reads == "blocked from the start":
    gate.touch()
  cmd = [sys.executable, "-c", BLOCKING_READS, str(gate),
         *command(run_dir, f"steps={steps}", "checkpoint_every=0", "eval_every=0",
                  f"data.source={corpus}")[3:]]
  proc = start(run_dir, log=log, cmd=cmd)
  try:
    if reads == "blocked from the start":
      poll(proc, log, blocked.exists, "a blocked read")
    else:
      poll(proc, log, lambda: any(r["step"] >= 2 for r in metrics(run_dir)), "step 2")
    if reads == "blocked after steps":
      gate.touch()
      seen = {}

      def loop_waits():  # reads blocked, and no step logged for 2 s
        n = len(metrics(run_dir))
        if n != seen.get("n"):
          seen.update(n=n, since=time.monotonic())
        return blocked.exists() and time.monotonic() - seen["since"] > 2
      poll(proc, log, loop_waits, "the loop to wait on blocked reads")
    proc.send_signal(signal.SIGTERM)
    out = wait(proc, log, timeout=30)
  finally:
    if proc.poll() is None:
      kill_group(proc)
  assert proc.returncode == 0, out[-4000:]
  if reads == "blocked from the start":
    assert "SIGTERM before the first step: nothing to save" in out
    assert not run_dir.exists()
  else:
    last = max(losses(run_dir))
    assert 2 <= last < steps
    assert checkpoints(run_dir) == [last]  # checkpoint_every=0: only the SIGTERM save
    assert f"SIGTERM: saved step {last}" in out


@pytest.mark.slow  # runs the trainer
def test_sigint_saves_like_sigterm(tmp_path):
  """Ctrl-C (SIGINT to the trainer's process group) while asynchronous saves are in flight
  (one after every step): exit 0 with one line naming SIGINT, every step done saved, no
  traceback and no temporary checkpoint directory left behind."""
  run_dir, log = tmp_path / "run", tmp_path / "log.txt"
  proc = start(run_dir, "steps=100000", "checkpoint_every=1", "eval_every=0", log=log)
  out = interrupt(proc, log, lambda: any(r["step"] >= 3 for r in metrics(run_dir)), "step 3",
                  signal.SIGINT, group=True, timeout=60)
  assert proc.returncode == 0, out[-4000:]
  assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
  last = max(losses(run_dir))
  assert checkpoints(run_dir)[-1] == last
  line, = [line for line in out.splitlines() if "SIGINT" in line]
  assert f"SIGINT: step {last} is saved already; exiting." in line, line
  assert not list(run_dir.rglob("*.orbax-checkpoint-tmp*"))


# The trainer whose second eval blocks on its held-out reads, as on a stalled file system:
# after the first eval returns, reads of held-out documents create `blocked` beside the
# file named by the first argument and wait forever.
BLOCKING_SECOND_EVAL = ("import pathlib, sys, threading\n"
                        "from train import data, loop\n"
                        "from train.data import sources\n"
                        "gate = pathlib.Path(sys.argv.pop(1))\n"
                        "split, read, evaluate, held = (sources.split_documents,"
                        " data.Document.read, loop._evaluate, set())\n"
                        "def remember(docs, fraction):\n"
                        "  train, held_out = split(docs, fraction)\n"
                        "  held.update(d.name for d in held_out)\n"
                        "  return train, held_out\n"
                        "def blocking_read(doc):\n"
                        "  if doc.name in held and gate.exists():\n"
                        "    gate.with_name('blocked').touch()\n"
                        "    threading.Event().wait()\n"
                        "  return read(doc)\n"
                        "def evaluate_then_close(*args):\n"
                        "  out = evaluate(*args)\n"
                        "  gate.touch()\n"
                        "  return out\n"
                        "sources.split_documents, data.Document.read = remember, blocking_read\n"
                        "loop._evaluate = evaluate_then_close\n"
                        "from train.__main__ import main\n"
                        "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.slow  # runs the trainer
def test_sigterm_during_an_eval_is_redone_on_resume(reference, tmp_path):
  """SIGTERM while the step-8 eval waits for its batches: step 8 is saved (before its
  eval), exit 0, no step-8 eval in the metrics. The resumed run evaluates step 8 first, so
  it has the uninterrupted run's evals at 4, 8 and 12, and its losses, exactly."""
  ref_dir, _, cached_env = reference
  run_dir, log, gate = tmp_path / "run", tmp_path / "log.txt", tmp_path / "gate"
  cmd = [sys.executable, "-c", BLOCKING_SECOND_EVAL, str(gate), *command(run_dir)[3:]]
  proc = start(run_dir, log=log, cmd=cmd, env=cached_env)
  out = interrupt(proc, log, gate.with_name("blocked").exists, "the step-8 eval to block")
  assert proc.returncode == 0, out[-4000:]
  assert "SIGTERM: step 8 is saved already; exiting." in out, out[-4000:]
  assert checkpoints(run_dir)[-1] == 8 and sorted(losses(run_dir, "eval_loss")) == [4]

  out = train(run_dir, log=tmp_path / "resumed.txt", env=cached_env)
  assert "resumed from step 8 " in out and "step 8 has no eval in metrics.jsonl" in out, out
  assert losses(run_dir, "eval_loss") == losses(ref_dir, "eval_loss")  # steps 4, 8, 12
  assert losses(run_dir) == losses(ref_dir)


@pytest.mark.parametrize("override, key, expected", [
    ("model.dimm=64", "model.dimm", ["did you mean", "'model.dim'"]),
    ("foo=1", "foo", ["valid keys: run_dir", "steps", "model.*", "context_parallel.*"]),
    ("model.zzzzzzzz=1", "model.zzzzzzzz", ["valid keys of 'model': vocab_size", "dim"]),
    ("data.packing_bins=0", "data.packing_bins", ["an int >= 1, got 0"]),
    ("steps=many", "steps", ["'many'"]),
    ("model.tie_embeddings=3", "model.tie_embeddings", ["bool"]),
    ("model.attention_backend=fusedd", "model.attention_backend", ["'fusedd'", "'fused'"]),
    ("data.tokenizer=byte", "data.tokenizer", ["'byte'", "'bytes'", ".model"]),
    ("platform=cpux", "platform", ["'cpux'", "'cpu'", "'gpu'", "'tpu'"]),
    ("mesh.context_ring=2", "mesh.context_ring", ["'ulysses'", "got 'ring'"]),
    ("checkpoint.max_to_keep=0", "checkpoint.max_to_keep", ["got 0"]),
    ("optimizer.lr=-1", "optimizer.lr", ["finite", "got -1.0"]),
    ("optimizer.lr=nan", "optimizer.lr", ["finite", "got nan"]),
    ("optimizer.clip_norm=-1", "optimizer.clip_norm", ["got -1.0"]),
    ("optimizer.warmup_steps=-5", "optimizer.warmup_steps", ["got -5"]),
])
def test_bad_config_fails_before_jax_starts(tmp_path, override, key, expected):
  """Exit 2 with one `config error` line naming the key, the value and what is valid (the
  closest keys for an unknown one, or its section's keys), no run_dir, and no jax backend
  started (the trainer's `main` in `MAIN_REPORTING_BACKEND`: nothing compiles without a
  backend)."""
  run_dir = tmp_path / "run"
  proc = run([sys.executable, "-c", MAIN_REPORTING_BACKEND, *command(run_dir, override)[3:]])
  assert proc.returncode == 2, proc.stdout + proc.stderr
  line = next(line for line in proc.stderr.splitlines() if "config error" in line)
  assert repr(key) in line and all(e in line for e in expected), proc.stderr  # one line
  assert "Traceback" not in proc.stderr
  assert "BACKEND_STARTED False" in proc.stdout, proc.stdout
  assert list(tmp_path.iterdir()) == []


def test_uncreatable_run_dir_is_a_config_error(tmp_path):
  """A run_dir below a file: exit 2 naming run_dir before anything is written."""
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  proc = run(command(blocker / "run"))
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "config error: config key 'run_dir'" in proc.stderr and str(blocker) in proc.stderr
  assert "Traceback" not in proc.stderr
  assert list(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "not a directory"


def test_bad_config_exit_status_of_module(tmp_path):
  """The same through `python -m train` itself: status 2, the message, no run_dir."""
  run_dir = tmp_path / "run"
  proc = run(command(run_dir, "model.dimm=64"))
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "config error: unknown config key 'model.dimm'" in proc.stderr
  assert not run_dir.exists()


def test_tensorboard_writer_does_not_import_torch():
  """tensorboardX imports torch where it is installed; the trainer's writer does not, and
  torch stays importable afterwards."""
  code = ("import importlib.util, sys\n"
          "from train import metrics\n"
          "metrics._summary_writer()\n"
          "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules\n"
          "if importlib.util.find_spec('torch'):\n"
          "  import torch\n"
          "print('ok')\n")
  proc = run([sys.executable, "-c", code])
  assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


@pytest.mark.slow  # runs the trainer
def test_ulysses_ring_demo_matches_ring(tmp_path):
  """configs/demo_usp.yaml (Ulysses x ring, 2 x 2, batch over fsdp 2, 8 simulated devices),
  made tiny, beside the same run with a ring over context=4: the same data and parameters
  (the data load-balanced over 2 ring shards in one, 4 in the other), so the same losses up
  to reduction order."""
  tiny = ["steps=3", "seq_len=256", "checkpoint_every=0", "eval_every=0", "model.dim=32",
          "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=64",
          "optimizer.warmup_steps=2"]
  ring = ["mesh.context_ring=1", "mesh.context=4", "context_parallel.strategy=ring"]
  outs = train_together(tmp_path, {"usp": tiny, "ring": tiny + ring},
                        config="configs/demo_usp.yaml")
  assert "'context_ring': 2, 'context': 2" in outs["usp"] and "'context': 4" in outs["ring"]
  got, want = losses(tmp_path / "usp"), losses(tmp_path / "ring")
  assert sorted(got) == [1, 2, 3] and all(math.isfinite(v) for v in got.values()), got
  assert all(got[s] == pytest.approx(want[s], abs=1e-4) for s in want), (got, want)


@pytest.mark.slow  # runs the trainer
def test_damaged_checkpoints_fall_back(reference, tmp_path):
  """The newest checkpoint lacks an item (the data position) and the one before has
  truncated array files: each is warned about as damaged and set aside, the third newest
  is resumed from, and the redone steps reproduce the uninterrupted run's losses."""
  ref_dir, _, cached_env = reference
  run_dir = tmp_path / "run"
  shutil.copytree(ref_dir, run_dir)
  *_, fallback, truncated, missing = checkpoints(run_dir)
  shutil.rmtree(run_dir / "checkpoints" / str(missing) / "data")
  state = run_dir / "checkpoints" / str(truncated) / "state"
  files = [p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files
  for p in files:
    with open(p, "r+b") as f:
      f.truncate(10)
  # Drop the metrics of the steps to redo, so that the equality below is the rerun's doing.
  rows = [r for r in metrics(run_dir) if r["step"] <= fallback]
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

  # The reference run's programs: its compilation cache saves the compile time.
  out = train(run_dir, log=tmp_path / "log.txt", env=cached_env)
  warned = [out.find(f"checkpoint step {s} in ") for s in (missing, truncated)]
  assert 0 <= warned[0] < warned[1], out[-4000:]
  assert out.count(" is damaged (") == 2, out[-4000:]
  assert f"resumed from step {fallback} " in out, out[-4000:]
  unusable = sorted(int(p.name.split("-")[0]) for p in (run_dir / "checkpoints_unusable").iterdir())
  assert unusable == [truncated, missing]
  assert checkpoints(run_dir)[-1] == STEPS
  assert losses(run_dir) == losses(ref_dir)
  assert losses(run_dir, "eval_loss") == losses(ref_dir, "eval_loss")


def _files(run_dir) -> dict:
  """Every file under `run_dir` (but TensorBoard's) -> its bytes."""
  return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*")
          if p.is_file() and "tensorboard" not in p.parts}


@pytest.mark.slow  # runs the trainer
def test_config_change_is_refused_and_nothing_is_lost(reference, tmp_path):
  """A finished run (checkpoints at steps 8, 10, 12) rerun with model.n_layers=2 by
  mistake: a config error naming the key, and nothing in the run_dir moved or rewritten.
  Without its config.json the same rerun fails to restore and leaves every checkpoint in
  place. After a kill past step 10 (simulated: step 12 removed), the original config with
  another eval_every (a change that is let through) resumes at step 10 and appends to the
  metrics. resume=false with the new shape starts over at step 0 and archives the
  earlier run whole."""
  ref_dir, _, cached_env = reference
  run_dir, log = tmp_path / "run", tmp_path / "log.txt"
  shutil.copytree(ref_dir, run_dir)
  before = _files(run_dir)

  proc = run(command(run_dir, "model.n_layers=2"))
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "config error" in proc.stderr and "model.n_layers (saved 1, now 2)" in proc.stderr
  assert "resume=false" in proc.stderr and "Traceback" not in proc.stderr
  assert _files(run_dir) == before

  bare = tmp_path / "bare"
  shutil.copytree(run_dir, bare)
  (bare / "config.json").unlink()
  proc = run(command(bare, "model.n_layers=2"))
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert f"checkpoint error: checkpoint step {STEPS} " in proc.stderr, proc.stderr
  assert "left in place" in proc.stderr and "Traceback" not in proc.stderr
  assert checkpoints(bare) == [8, 10, 12] and not (bare / "checkpoints_unusable").exists()

  shutil.rmtree(run_dir / "checkpoints" / str(STEPS))
  kept = metrics(run_dir)
  out = train(run_dir, "eval_every=6", log=log, env=cached_env)
  assert "resumed from step 10 " in out and "eval_every 4 -> 6" in out, out[-4000:]
  assert metrics(run_dir)[:len(kept)] == kept  # appended to, not truncated
  assert [r["step"] for r in metrics(run_dir)[len(kept):]] == [11, 12, 12]
  assert losses(run_dir) == losses(ref_dir)

  kept = metrics(run_dir)
  out = train(run_dir, "steps=1", "model.n_layers=2", "resume=false", log=log)
  archived, = (run_dir / "archive").iterdir()
  assert "moved the earlier run's " in out and str(archived) in out, out[-4000:]
  assert checkpoints(archived) == [8, 10, 12] and metrics(archived) == kept
  assert json.loads((archived / "config.json").read_text())["model"]["n_layers"] == 1
  assert checkpoints(run_dir) == [1] and list(losses(run_dir)) == [1]
  assert json.loads((run_dir / "config.json").read_text())["model"]["n_layers"] == 2


@pytest.mark.slow  # runs the trainer
def test_resume_sharded_over_the_context_axis_with_strategy_auto(reference, tmp_path):
  """The reference's checkpoint at step 8 resumed with parameters and optimizer state
  sharded over the context axis too (mesh.fsdp_over_context) and strategy auto: the
  checkpoint, saved over fsdp only, restores into the new sharding and the run goes on as
  the reference did (its losses, up to reduction order); the log names the strategy chosen
  and why (on CPU: the analytic model; Ulysses cannot split 2 heads over 4 devices)."""
  ref_dir, _, cached_env = reference
  run_dir = tmp_path / "run"
  shutil.copytree(ref_dir, run_dir)
  for step in checkpoints(run_dir)[1:]:  # 8, 10, 12 are kept
    shutil.rmtree(run_dir / "checkpoints" / str(step))
  out = train(run_dir, "mesh.fsdp_over_context=true", "context_parallel.strategy=auto",
              log=tmp_path / "log.txt", env=cached_env)
  assert "resumed from step 8 " in out, out[-4000:]
  line, = [x for x in out.splitlines() if "context_parallel.strategy auto: " in x]
  assert re.search(r"auto: (ring|all_gather) \(the fastest by the attention's analytic model,"
                   r" flaxattn.planner.PLATFORMS\['cpu'\]; no published peak figures for"
                   r" 'cpu' devices: (ring|all_gather) [\d.e-]+ s, (ring|all_gather)"
                   r" [\d.e-]+ s; ulysses cannot run \(", line), line
  got, want = losses(run_dir), losses(ref_dir)
  assert all(got[s] == pytest.approx(want[s], abs=1e-5) for s in range(9, STEPS + 1)), (
      got, want)


@pytest.mark.slow  # runs the trainer
def test_two_processes_context_parallel(reference, tmp_path):
  """Two processes, mesh context=4 spanning both; the losses match the single-process
  4-device run up to reduction order. Then the newest checkpoint loses process 1's data
  position only: both processes set it aside and resume from the one before, together."""
  ref_dir, _, _ = reference
  run_dir = tmp_path / "run"
  logs = [tmp_path / f"process{i}.txt" for i in range(2)]
  outs = two_processes(run_dir, logs)
  assert all("'context': 4" in out for out in outs)
  got, want = losses(run_dir), losses(ref_dir)
  assert sorted(got) == list(range(1, STEPS + 1))
  assert got[1] == pytest.approx(want[1], abs=1e-5)
  assert all(got[s] == pytest.approx(want[s], abs=1e-4) for s in want), (got, want)
  assert losses(run_dir, "eval_loss") == pytest.approx(losses(ref_dir, "eval_loss"), abs=1e-4)
  assert checkpoints(run_dir)[-1] == STEPS

  *_, fallback, newest = checkpoints(run_dir)
  (run_dir / "checkpoints" / str(newest) / "data" / "process_1-of-2.json").unlink()
  outs = two_processes(run_dir, logs)
  assert all(f"resumed from step {fallback} " in out for out in outs), outs[0][-4000:]
  assert f"checkpoint step {newest} in " in outs[0] and " is damaged (" in outs[0]
  assert [p.name.split("-")[0]
          for p in (run_dir / "checkpoints_unusable").iterdir()] == [str(newest)]
  assert checkpoints(run_dir)[-1] == STEPS
  assert all(losses(run_dir)[s] == pytest.approx(want[s], abs=1e-4) for s in want)


@pytest.mark.slow  # runs the trainer
def test_log_lines_and_summary_without_a_terminal(reference):
  """stdout is a file (`trainer.start`): each step's line and the summary reach it through
  `logging`, with throughput, MFU against the measured CPU peak, and the run's paths."""
  run_dir, out, _ = reference
  step_lines = [line for line in out.splitlines() if " | loss " in line and "step " in line]
  assert len(step_lines) == STEPS, out[-4000:]
  assert all(f in step_lines[-1] for f in (f"step {STEPS}/{STEPS}", "grad_norm", "lr ",
                                           "tokens/s ", "tokens/s/device", "TFLOP/s/device",
                                           "MFU", "measured", "host")), step_lines[-1]
  assert f"done: step {STEPS}/{STEPS}" in out and "final loss" in out
  assert "throughput after the first step, evals and saves left out: tokens/s" in out
  assert "MFU" in out.split("done:")[-1]
  for path in ("checkpoints", "metrics.jsonl", "tensorboard", "loss.png"):
    assert str(run_dir.absolute() / path) in out, path
  rows = [r for r in metrics(run_dir) if "loss" in r]
  assert all(r["mfu"] > 0 and r["tflops_per_device"] > 0 and 0 <= r["host_time"]
             and r["tokens_per_s_per_device"] * 4 == pytest.approx(r["tokens_per_s"])
             for r in rows), rows[-1]


@pytest.mark.slow  # runs the trainer
def test_step_times_add_up_and_mfu_is_at_most_one(reference):
  """Each step's time runs from the previous step's completion to its own (evals and saves
  between steps included), so the steps add up to the wall time between the log lines of
  the first and the last step (the clock of `logging`), and none reads below its own
  dispatch; with the FLOPs of each batch's documents (`train.throughput.Flops`) and the
  peak of devices sharing the cores, MFU stays <= 1."""
  run_dir, out, _ = reference
  rows = [r for r in metrics(run_dir) if "loss" in r]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert all(0 < r["mfu"] <= 1 for r in rows), [r["mfu"] for r in rows]
  assert all(r["step_time"] >= r["dispatch_time"] for r in rows), [
      (r["step"], r["step_time"], r["dispatch_time"]) for r in rows]
  logged = {}  # step -> the time its line was logged
  for line in out.splitlines():
    if " | loss " in line and "train.loop: step " in line:
      step = int(line.split("train.loop: step ")[1].split("/")[0])
      logged[step] = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
  assert sorted(logged) == list(range(1, STEPS + 1))
  between = logged[STEPS] - logged[1]  # evals at steps 4 and 8, saves every 2 steps in it
  assert sum(r["step_time"] for r in rows[1:]) == pytest.approx(between, rel=0.1, abs=0.01)
  steps = float(out.split("the steps ")[1].split(" s")[0])
  wall = float(out.split("wall time ")[1].split(" s")[0])
  assert sum(r["step_time"] for r in rows) == pytest.approx(steps, abs=0.01) and steps <= wall


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A random tiny Llama in Hugging Face format (`python -m models.hf random`), float32."""
  path = tmp_path_factory.mktemp("hf") / "tiny"
  proc = run([sys.executable, "-m", "models.hf", "random", str(path)])
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return path


def _tensors(hf_path) -> dict:
  from safetensors.numpy import load_file
  return load_file(str(hf_path / "model.safetensors"))


def _extend(run_dir, *overrides) -> list[str]:
  return [sys.executable, "-m", "train", "configs/extend_demo.yaml", f"run_dir={run_dir}",
          "seq_len=2048", "eval_every=0", "checkpoint_every=0", *overrides]


@pytest.mark.slow  # runs the trainer
def test_init_from_hf_extends_context_and_exports(hf_dir, tmp_path):
  """extend_demo from the HF directory at 2048 tokens (twice the checkpoint's 1024), one
  step at learning rate 0: the step-1 checkpoint, exported as float32, must hold the HF
  tensors bit for bit (random weights or a lost tensor fail)."""
  from train.export import export

  run_dir, log = tmp_path / "run", tmp_path / "log.txt"
  proc = start(run_dir, log=log, cmd=_extend(run_dir, f"init_from={hf_dir}", "steps=1",
                                                      "optimizer.lr=0"))
  out = wait(proc, log)
  assert proc.returncode == 0, out[-4000:]
  assert f"initialized the model from {hf_dir}" in out
  saved = json.loads((run_dir / "config.json").read_text())["model"]
  assert saved["rope_theta"] == 500000.0  # from the checkpoint, not the YAML's default
  assert saved["rope_scaling"]["kind"] == "llama3" and saved["max_seq_len"] == 8192
  assert export(str(run_dir), str(tmp_path / "out"), "float32") == 1
  want, got = _tensors(hf_dir), _tensors(tmp_path / "out")
  assert sorted(got) == sorted(want)
  for name in want:
    assert (got[name] == want[name]).all(), name


@pytest.mark.slow  # runs the trainer
def test_eval_loss_by_position_from_step_0_with_init_from(hf_dir, tmp_path):
  """extend_demo at 512 tokens from the HF directory: an eval at step 0 (the model of
  init_from, before training) and at step 2, each with the loss by position in the segment
  (buckets 64, 128, 256, 512), whose mean weighted by the buckets' tokens is eval_loss; in
  TensorBoard and in eval_loss_by_position.png. The resumed run (to step 4) keeps the
  step-0 eval and does not redo it."""
  run_dir = tmp_path / "run"
  steps = ["seq_len=512", "eval_every=2", "checkpoint_every=2"]
  proc = start(run_dir, log=tmp_path / "log.txt",
               cmd=_extend(run_dir, f"init_from={hf_dir}", "steps=2", *steps))
  out = wait(proc, tmp_path / "log.txt")
  assert proc.returncode == 0 and "evaluating the model of init_from" in out, out[-4000:]
  proc = start(run_dir, log=tmp_path / "resumed.txt",
               cmd=_extend(run_dir, f"init_from={hf_dir}", "steps=4", *steps))
  out = wait(proc, tmp_path / "resumed.txt")
  assert proc.returncode == 0 and "resumed from step 2 " in out, out[-4000:]
  assert "evaluating the model of init_from" not in out
  evals = [r for r in metrics(run_dir) if "eval_loss" in r]
  assert [r["step"] for r in evals] == [0, 2, 4], evals
  for r in evals:
    by_loss, by_tokens = r["eval_loss_by_position"], r["eval_tokens_by_position"]
    assert list(by_loss) == list(by_tokens) == ["64", "128", "256", "512"], r
    assert sum(by_tokens.values()) == r["eval_tokens"] > 0
    mean = sum(by_loss[b] * by_tokens[b] for b in by_loss) / r["eval_tokens"]
    assert mean == pytest.approx(r["eval_loss"], rel=1e-12), r
  assert evals[0]["eval_loss"] != evals[1]["eval_loss"]  # trained between them
  assert (run_dir / "eval_loss_by_position.png").stat().st_size > 0
  events = b"".join(p.read_bytes() for p in (run_dir / "tensorboard").iterdir())
  assert b"eval_loss_by_position/512" in events


@pytest.mark.slow  # runs the trainer
def test_init_from_run_dir_takes_its_newest_model(reference, tmp_path):
  """A run initialized from the reference run_dir, one step at learning rate 0: its step-1
  checkpoint holds the reference's step-12 model."""
  from train.export import export

  ref_dir = reference[0]
  run_dir = tmp_path / "run"
  out = train(run_dir, f"init_from={ref_dir}", "steps=1", "optimizer.lr=0", "eval_every=0",
              log=tmp_path / "log")
  assert "initialized the model from" in out and checkpoints(run_dir) == [1]
  assert export(str(ref_dir), str(tmp_path / "ref"), "float32") == STEPS
  assert export(str(run_dir), str(tmp_path / "new"), "float32") == 1
  want, got = _tensors(tmp_path / "ref"), _tensors(tmp_path / "new")
  assert all((got[n] == want[n]).all() for n in want)


@pytest.mark.slow  # runs the trainer
def test_export_logits_match_the_checkpoint(reference, tmp_path):
  """`python -m train.export` of the trained reference run, read back by `models.hf.load`:
  the same logits as the model restored from the run's checkpoint."""
  import numpy as np

  from models import hf
  from train.export import restore_model

  run_dir = reference[0]
  proc = run([sys.executable, "-m", "train.export", str(run_dir), str(tmp_path / "hf"),
              "--dtype", "float32"])
  assert proc.returncode == 0 and f"wrote step {STEPS}" in proc.stdout, proc.stderr
  _, trained = restore_model(str(run_dir))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 64))
  want = np.asarray(trained(tokens))
  got = np.asarray(hf.load(str(tmp_path / "hf"))(tokens))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("override, expected", [
    ("model.dim=64", ["model.dim=128", "model.dim=64", "shapes"]),
    ("model.n_layers=3", ["model.n_layers=2", "model.n_layers=3"]),
])
def test_init_from_shape_mismatch_is_a_config_error(hf_dir, tmp_path, override, expected):
  run_dir = tmp_path / "run"
  proc = run(_extend(run_dir, f"init_from={hf_dir}", override))
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "config error: config key 'init_from'" in proc.stderr
  assert all(e in proc.stderr for e in expected), proc.stderr
  assert not run_dir.exists()


def test_init_from_missing_or_bad_source_is_a_config_error(tmp_path):
  (tmp_path / "empty").mkdir()
  for source, expected in ((tmp_path / "nowhere", "not a directory"),
                           (tmp_path / "empty", "neither")):
    proc = run(_extend(tmp_path / "run", f"init_from={source}"))
    assert proc.returncode == 2 and expected in proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
