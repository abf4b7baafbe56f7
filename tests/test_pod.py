"""A run as on a pod: two processes (gloo collectives, 2 simulated CPU devices each, mesh
context=4 over both) whose run_dir is a bucket on a GCS emulator on loopback (the
`gcs_emulator` fixture; the processes get only `STORAGE_EMULATOR_HOST`). One process is
SIGKILLed mid-run: the other names it and exits within the heartbeat timeout; both restart,
resume, and are stopped by SIGTERM at once; started again, they finish with every loss of
an uninterrupted run. `train.export` and `train.sample` then read the run from the bucket.
Nothing of the runs reaches the local disk.
"""

from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys
import time
import uuid

import portpicker
import pytest

from gcs import checkpoints, create_bucket, losses, objects
from trainer import ROOT, STEPS, clean_env, finish, kill_group, poll, start_job

BUCKET = "pod"
HEARTBEAT_S = 8  # heartbeat_timeout_s of the runs that lose a process


@pytest.mark.slow  # runs the trainer
def test_pod_run_on_a_bucket_loses_a_process_stops_and_resumes(gcs_emulator, tmp_path):
  url = gcs_emulator
  create_bucket(url, BUCKET)
  name = f"run-{uuid.uuid4().hex[:8]}"  # no file of this name may appear on local disk
  logs = [tmp_path / f"process{i}.txt" for i in range(2)]

  # The uninterrupted run.
  finish(start_job(f"gs://{BUCKET}/{name}-whole", logs, STORAGE_EMULATOR_HOST=url), logs)
  want = losses(url, BUCKET, f"{name}-whole")
  assert sorted(want) == list(range(1, STEPS + 1))

  # Process 1 is killed mid-run: process 0 names it and exits with status 3.
  run = f"gs://{BUCKET}/{name}"
  procs = start_job(run, logs, f"heartbeat_timeout_s={HEARTBEAT_S}", STORAGE_EMULATOR_HOST=url)
  try:
    poll(procs[0], logs[0], lambda: len(checkpoints(url, BUCKET, name)) >= 2,
         "two finished checkpoints in the bucket")
    kill_group(procs[1])
    killed = time.monotonic()
    procs[0].wait(timeout=HEARTBEAT_S + 120)  # a hang fails the test here
    survivor_s = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        kill_group(p)
  out = logs[0].read_text()
  last = out.strip().splitlines()[-1]
  print(f"survivor: exit {procs[0].returncode} {survivor_s:.1f} s after the kill: {last}")
  assert procs[0].returncode == 3, out[-4000:]
  assert last.startswith("lost process 1 of 2 ("), out[-4000:]
  resumable = checkpoints(url, BUCKET, name)[-1]
  assert resumable < STEPS, "the run finished before it was killed"

  # Both restart and resume; SIGTERM to both at once: each saves once and exits 0.
  procs = start_job(run, logs, STORAGE_EMULATOR_HOST=url)
  try:
    poll(procs[0], logs[0], lambda: " | loss " in logs[0].read_text().partition(
        f"resumed from step {resumable} ")[2], "a step after resuming")
    for p in procs:
      p.send_signal(signal.SIGTERM)
  finally:
    outs = finish(procs, logs)
  stops = [re.findall(r"SIGTERM: (?:saved step (\d+)|step (\d+) is saved already)", out)
           for out in outs]
  assert all(len(s) == 1 for s in stops), outs[0][-4000:]  # one stop, at one step, on each
  stopped_at, = {int("".join(s[0])) for s in stops}  # the same step on both
  assert resumable < stopped_at < STEPS and checkpoints(url, BUCKET, name)[-1] == stopped_at
  print(f"resumed from step {resumable}; SIGTERM to both: each stopped at step {stopped_at}")

  # Started again, the run finishes: every loss equals the uninterrupted run's.
  outs = finish(start_job(run, logs, STORAGE_EMULATOR_HOST=url), logs)
  assert all(f"resumed from step {stopped_at} " in out for out in outs), outs[0][-4000:]
  got = losses(url, BUCKET, name)
  print("losses, killed and resumed twice:", got, "\nlosses, uninterrupted:", want, sep="\n")
  assert got == want  # exact: resuming on CPU is bit-identical
  assert losses(url, BUCKET, name, "eval_loss") == losses(url, BUCKET, f"{name}-whole", "eval_loss")

  # Export and sample read the run from the bucket; the export goes to the bucket too.
  env = clean_env(STORAGE_EMULATOR_HOST=url)
  export = subprocess.run([sys.executable, "-m", "train.export", run,
                           f"gs://{BUCKET}/{name}-export"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
  assert export.returncode == 0, export.stderr[-4000:]
  assert {"config.json", "model.safetensors"} <= {
      n.rsplit("/", 1)[1] for n in objects(url, BUCKET, f"{name}-export/")}
  sample = subprocess.run([sys.executable, "-m", "train.sample", run, "--prompt", "def ",
                           "--max_new_tokens", "4"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
  assert sample.returncode == 0 and sample.stdout.startswith("def "), sample.stderr[-4000:]

  listed = objects(url, BUCKET, f"{name}/")
  print(f"{len(listed)} objects under gs://{BUCKET}/{name}/:", *listed, sep="\n  ")
  assert {f"{name}/{f}" for f in ("config.json", "metrics.jsonl", "loss.png")} <= set(listed)
  assert any(n.startswith(f"{name}/tensorboard/events.out.tfevents.") for n in listed)
  assert any("/data/process_1-of-2.json" in n for n in listed)
  assert not (ROOT / "gs:").exists() and not pathlib.Path("gs:").exists()
  local = [p for where in (ROOT, tmp_path, pathlib.Path.cwd()) for p in where.rglob(f"*{name}*")]
  assert not local, local


def test_bad_bucket_urls_are_refused(gcs_emulator, storage_env, monkeypatch, tmp_path):
  """`storage.check`: a URL of another scheme, a missing bucket, no credentials (nothing to
  find, no metadata server but a closed port), an endpoint that does not answer."""
  from train.config import ConfigError

  closed = f"127.0.0.1:{portpicker.pick_unused_port()}"

  def refused(location, expected, **env):
    for var, value in env.items():
      monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=expected) as e:
      storage_env.check(location, "config key 'run_dir'")
    assert "\n" not in str(e.value) and str(e.value).startswith("config key 'run_dir' ")

  refused("s3://bucket/run", "scheme 's3'.*gs://")
  refused("gs://missing/run", "bucket 'missing' does not exist", STORAGE_EMULATOR_HOST=gcs_emulator)
  monkeypatch.delenv("STORAGE_EMULATOR_HOST")
  monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
  refused("gs://bucket/run", "no Google Cloud credentials", HOME=str(tmp_path),
          CLOUDSDK_CONFIG=str(tmp_path), GCE_METADATA_HOST=closed, GCE_METADATA_IP=closed)
  refused("gs://bucket/run", "does not answer", STORAGE_EMULATOR_HOST=closed)


def test_missing_bucket_is_a_config_error_before_anything_is_written(gcs_emulator, tmp_path):
  """The trainer's command line: one line, exit 2, nothing in the working directory (no
  local `gs:` directory)."""
  proc = subprocess.run([sys.executable, "-m", "train", str(ROOT / "configs/demo.yaml"),
                         "run_dir=gs://missing/run"], cwd=tmp_path,
                        env=clean_env(STORAGE_EMULATOR_HOST=gcs_emulator), capture_output=True,
                        text=True, timeout=120)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
  assert lines[-1] == (f"config error: config key 'run_dir' 'gs://missing/run': bucket"
                       f" 'missing' does not exist at {gcs_emulator}; create it (gcloud storage"
                       " buckets create gs://missing) or fix the name."), lines[-1]
  assert list(tmp_path.iterdir()) == []


def test_init_from_a_hugging_face_checkpoint_on_a_bucket(gcs_emulator, storage_env, monkeypatch,
                                                         tmp_path):
  """A Hugging Face directory in a bucket: init_from reads its model config as from the
  local directory it was uploaded from, and its files come back whole for loading."""
  from flax import nnx

  from models import hf
  from models.llama import Llama
  from train import config, init_from

  local = tmp_path / "tiny"
  hf.save(Llama(hf.SIZES["tiny"], rngs=nnx.Rngs(0)), str(local))
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
  create_bucket(gcs_emulator, "weights")
  url = "gs://weights/tiny"
  for file in local.iterdir():
    storage_env.upload(file, storage_env.path(url) / file.name)
  keys = [f"model.{k}={getattr(hf.SIZES['tiny'], k)}" for k in
          ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings")]
  resolved = [init_from.resolve(config.load(None, [f"init_from={source}", *keys]))
              for source in (url, str(local))]
  assert resolved[0].model == resolved[1].model
  with storage_env.local_dir(url) as copy:
    assert {p.name: p.read_bytes() for p in pathlib.Path(copy).iterdir()} == {
        p.name: p.read_bytes() for p in local.iterdir()}
  assert not pathlib.Path(copy).exists()  # removed after loading
