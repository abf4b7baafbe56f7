"""A run_dir on a bucket that is odd, slow, damaged or restricted (the `gcs_emulator`
fixture, with `gcs.Proxy` in front of it where a role narrower than the emulator's matters):
each gives an exact resume or a one-line error that names the value and the fix, before
anything is written, within a bounded time. Most cases call `train.storage`,
`train.checkpoint`, `train.export` and `train.sample` in this process on a run saved
without training; one run of the trainer shows the same end to end.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import threading
import time

import jax
import pytest
from flax import nnx

from gcs import Proxy, checkpoints, create_bucket, delete, losses, objects, write
from train import checkpoint, config, export, run_dir, sample
from train.config import ConfigError
from train.data import list_documents
from train.state import make_state
from trainer import ROOT, TIMEOUT, TINY, clean_env, start, wait

# The bucket's own metadata (storage.buckets.get), which object roles do not grant.
BUCKET_METADATA = re.compile(r"/storage/v1/b/[^/?]+(\?.*)?$")


def metadata_refused(method: str, path: str) -> bool:
  """roles/storage.objectAdmin: objects listed, read, written and deleted; not the bucket."""
  return method == "GET" and bool(BUCKET_METADATA.match(path))


def uploads_refused(method: str, path: str) -> bool:
  """roles/storage.objectViewer: objects listed and read; no upload."""
  return path.startswith("/upload/")


def _saved_run(run: str, *overrides, steps=(2, 4)) -> config.TrainConfig:
  """Run `run` (a gs:// URL) as the trainer leaves it, without training: its config.json
  and a checkpoint of a fresh tiny model and optimizer at each of `steps`."""
  cfg = config.load(str(ROOT / "configs/demo.yaml"),
                    [f"run_dir={run}", *TINY, "checkpoint.async_save=false", *overrides])
  state = nnx.state(make_state(cfg.model, cfg.optimizer, cfg.steps))
  ckpts = checkpoint.Checkpoints(cfg)
  for step in steps:
    ckpts.save(step, state, {"step": step})
  ckpts.close()
  return cfg


def _abstract(cfg: config.TrainConfig):
  """The abstract state a resume of run `cfg` restores into, on this host's first device."""
  where = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = nnx.state(nnx.eval_shape(lambda: make_state(cfg.model, cfg.optimizer, cfg.steps)))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), abstract)


@pytest.fixture(scope="module")
def runs(gcs_emulator) -> str:
  """The emulator's URL, with an empty bucket "runs"."""
  create_bucket(gcs_emulator, "runs")
  return gcs_emulator


def _refused(check, location: str, key: str, match: str) -> str:
  """The message of the ConfigError that `check()`, a check of `location` as `key`, raises:
  one line that names both and matches `match`."""
  with pytest.raises(ConfigError, match=match) as e:
    check()
  message = str(e.value)
  assert "\n" not in message and message.startswith(f"{key} ") and repr(location) in message
  return message


@pytest.mark.parametrize("location, expected", [
    ("gs://runs/exp#1", r"'#'.*share their objects"),  # TensorStore's path ends at '#'
    ("gs://runs/exp?v=1", r"'\?'"),
    ("gs://runs/exp*", r"'\*'"),  # fsspec's glob: another run's files too
    ("gs://runs/exp[12]", r"'\[', '\]'"),
    ("gs://runs/exp\t1", r"'\\t'"),
    ("gs://runs/a/../exp", r"'\.\.'"),
    ("gs:/runs/exp", r"without '//' after 'gs:'.*local directory named 'gs:'"),
    ("gs:runs/exp", r"without '//' after 'gs:'"),
    ("GS://runs/exp", r"scheme 'GS'.*lowercase: gs://"),
    ("gs://Runs/exp", r"lowercase letters.*\(bucket 'Runs'\)"),
])
def test_locations_the_clients_read_differently_are_refused(runs, storage_env, monkeypatch,
                                                            location, expected):
  """A location that gcsfs, TensorStore (through orbax's URL parsing) or a local path would
  each take for other objects, or for a local directory, is refused in one line naming it,
  by `check` and by `path`, with no request to the bucket (which exists)."""
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", runs)
  _refused(lambda: storage_env.check(location, "config key 'run_dir'"), location,
           "config key 'run_dir'", expected)
  with pytest.raises(ConfigError, match=expected):
    storage_env.path(location)
  assert objects(runs, "runs") == []


def test_malformed_locations_are_refused_before_anything_is_written(runs, tmp_path):
  """The trainer's command line, and export's: exit 2 with one line naming the key and the
  value, and nothing written, neither in the working directory (no `gs:` directory) nor in
  the bucket."""
  env = clean_env(STORAGE_EMULATOR_HOST=runs)
  demo = str(ROOT / "configs/demo.yaml")
  cases = [(["train", demo, "run_dir=gs:/runs/exp"], "config error: config key 'run_dir'",
            "'gs:/runs/exp'"),
           (["train", demo, "run_dir=gs://runs/exp#1"], "config error: config key 'run_dir'",
            "'gs://runs/exp#1'"),
           (["train", demo, "run_dir=gs://runs/exp", "data.source=gs://runs/corpus#2"],
            "config error: config key 'data.source'", "'gs://runs/corpus#2'"),
           (["train.export", "gs://runs/exp", "gs://runs/export#3"], "export error: OUT_DIR",
            "'gs://runs/export#3'")]
  for args, prefix, value in cases:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert lines[-1].startswith(prefix) and value in lines[-1], lines[-1]
  assert list(tmp_path.iterdir()) == [] and objects(runs, "runs") == []


def test_object_roles_resume_export_and_sample(gcs_emulator, storage_env, monkeypatch,
                                               tmp_path):
  """Credentials with object roles only (roles/storage.objectAdmin, which the check
  recommends; no read of the bucket's metadata): checkpoints save and an old one is deleted,
  a resume restores the newest, export writes it and sample loads it."""
  create_bucket(gcs_emulator, "objects")
  with Proxy(gcs_emulator, metadata_refused) as proxy:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://{proxy.address}")
    cfg = _saved_run("gs://objects/run", "checkpoint.max_to_keep=1")
    assert checkpoints(gcs_emulator, "objects", "run") == [4]  # step 2 deleted
    ckpts = checkpoint.Checkpoints(cfg)
    step, _, position = ckpts.restore_latest(_abstract(cfg))
    ckpts.close()
    assert (step, position) == (4, {"step": 4})
    assert export.main(["gs://objects/run", str(tmp_path / "export")]) == 0
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert sample.load("gs://objects/run")[2] == 4
  assert proxy.refusals  # orbax asked for the bucket's metadata, and did without it


def test_an_emulator_address_without_scheme_serves_every_client(gcs_emulator, storage_env,
                                                                monkeypatch):
  """`STORAGE_EMULATOR_HOST=host:port`: checkpoints save, delete an old step and resume
  (orbax and TensorStore), and google-cloud-storage (which orbax uses for a bucket's
  metadata) reaches the emulator too."""
  from google.cloud import storage as cloud_storage

  create_bucket(gcs_emulator, "hostport")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.removeprefix("http://"))
  cfg = _saved_run("gs://hostport/run", "checkpoint.max_to_keep=1")
  ckpts = checkpoint.Checkpoints(cfg)
  assert ckpts.restore_latest(_abstract(cfg))[0] == 4
  ckpts.close()
  assert checkpoints(gcs_emulator, "hostport", "run") == [4]
  assert cloud_storage.Client().get_bucket("hostport").name == "hostport"


def test_a_damaged_step_set_aside_on_a_bucket_is_saved_again(gcs_emulator, storage_env,
                                                             monkeypatch):
  """The newest checkpoint on a bucket lacks its data position: it is moved whole to
  checkpoints_unusable/, the run resumes from the one before, and the step saves again when
  the run reaches it (as on a local disk)."""
  create_bucket(gcs_emulator, "damaged")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
  cfg = _saved_run("gs://damaged/run")
  delete(gcs_emulator, "damaged", "run/checkpoints/4/data/process_0-of-1.json")
  ckpts = checkpoint.Checkpoints(cfg)
  step, state, _ = ckpts.restore_latest(_abstract(cfg))
  assert step == 2 and not objects(gcs_emulator, "damaged", "run/checkpoints/4/")
  assert {n.split("/")[2].split("-")[0] for n in objects(
      gcs_emulator, "damaged", "run/checkpoints_unusable/")} == {"4"}
  ckpts.save(4, state, {"step": 4})
  ckpts.close()
  assert checkpoints(gcs_emulator, "damaged", "run") == [2, 4]


@contextlib.contextmanager
def _silent_endpoint():
  """A server on loopback that accepts connections and never answers; yields its
  `host:port`."""
  server = socket.create_server(("127.0.0.1", 0))
  held, stop = [], threading.Event()

  def accept():
    while not stop.is_set():
      with contextlib.suppress(OSError):
        held.append(server.accept()[0])

  thread = threading.Thread(target=accept, daemon=True)
  thread.start()
  try:
    yield f"127.0.0.1:{server.getsockname()[1]}"
  finally:
    stop.set()
    server.close()
    for conn in held:
      conn.close()


def test_an_endpoint_that_never_answers_is_refused_in_bounded_time(storage_env, monkeypatch):
  """An endpoint that accepts the connection and never answers: the check ends within
  about 20 s with one line naming it (it used to wait forever)."""
  with _silent_endpoint() as address:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", address)
    began = time.monotonic()
    message = _refused(lambda: storage_env.check("gs://silent/run", "config key 'run_dir'"),
                       "gs://silent/run", "config key 'run_dir'",
                       "accepts connections but did not answer a request within 20 s")
    seconds = time.monotonic() - began
  print(f"refused after {seconds:.1f} s: {message}")
  assert f"http://{address}" in message and seconds < 30


def test_a_bucket_that_may_not_be_written_is_refused_before_anything_is_written(
    gcs_emulator, storage_env, monkeypatch, tmp_path):
  """Credentials that may list and read but not write (roles/storage.objectViewer): the
  check of a location the run writes refuses it in one line naming the role to grant, and
  writes nothing; the same location read only passes. The trainer and export refuse it
  before writing anything."""
  create_bucket(gcs_emulator, "viewer")
  with Proxy(gcs_emulator, uploads_refused) as proxy:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.address)
    env = clean_env(STORAGE_EMULATOR_HOST=proxy.address)
    for args, prefix in (
        (["-m", "train", str(ROOT / "configs/demo.yaml"), "run_dir=gs://viewer/run"],
         "config error: config key 'run_dir' 'gs://viewer/run': the credentials may list"),
        (["-m", "train.export", str(tmp_path), "gs://viewer/export"],
         "export error: OUT_DIR 'gs://viewer/export': the credentials may list")):
      proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
      assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
      assert proc.stderr.strip().splitlines()[-1].startswith(prefix), proc.stderr[-2000:]
    storage_env.check("gs://viewer/run", "config key 'data.source'")
    _refused(lambda: storage_env.check("gs://viewer/run", "config key 'run_dir'", write=True),
             "gs://viewer/run", "config key 'run_dir'",
             r"may list bucket 'viewer' but not write there .*roles/storage\.objectAdmin")
  assert objects(gcs_emulator, "viewer") == [] and list(tmp_path.iterdir()) == []
  assert proxy.refusals


def test_export_names_a_failure_to_read_the_run_as_such(gcs_emulator, storage_env,
                                                        monkeypatch, tmp_path, capsys):
  """Export of a run whose objects may be listed but not read: one line that says reading
  RUN_DIR failed and that nothing was written (it used to say that writing OUT_DIR
  failed)."""
  create_bucket(gcs_emulator, "unread")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
  _saved_run("gs://unread/run", steps=(2,))
  with Proxy(gcs_emulator, lambda method, path: method == "GET" and (
      "/o/run%2F" in path)) as proxy:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.address)
    assert export.main(["gs://unread/run", str(tmp_path / "export")]) == 1
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert last.startswith("export error: reading RUN_DIR 'gs://unread/run' failed: Forbidden")
  assert last.endswith("; nothing was written.") and list(tmp_path.iterdir()) == []
  assert proxy.refusals


def test_folder_placeholders_are_not_files(gcs_emulator, storage_env, monkeypatch, caplog):
  """A bucket's "create folder" placeholders (zero-byte objects named `folder/`, as the
  Cloud console writes them) are neither files of a corpus (no warning names them) nor
  entries of their folder: an empty tensorboard/ with one is not archived."""
  create_bucket(gcs_emulator, "folders")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
  for name in ("corpus/", "corpus/sub/", "corpus/empty/", "run/", "run/tensorboard/"):
    write(gcs_emulator, "folders", name, b"")
  write(gcs_emulator, "folders", "corpus/sub/a.txt", b"def f(): pass\n")
  write(gcs_emulator, "folders", "corpus/notes.md", b"# notes\n")
  write(gcs_emulator, "folders", "run/metrics.jsonl", b"{}\n")
  docs = list_documents("gs://folders/corpus")
  assert [d.name for d in docs] == ["sub/a.txt"]
  warned, = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert warned.startswith("data.source 'gs://folders/corpus': 1 file(s) not read"), warned
  assert warned.endswith(": notes.md"), warned
  caplog.clear()
  run_dir.archive("gs://folders/run", run_dir.OUTPUT_FILES, "resume=false")
  moved, = [r.getMessage() for r in caplog.records if "moved the earlier run's" in r.getMessage()]
  assert "moved the earlier run's metrics.jsonl to " in moved, moved


@pytest.mark.slow  # runs the trainer
def test_a_resume_on_a_bucket_with_object_roles_and_a_damaged_step(gcs_emulator, tmp_path):
  """The trainer on a bucket through credentials with object roles only, the emulator's
  address without scheme: 4 steps; the step-4 checkpoint loses a data position; a run of 6
  steps sets it aside, resumes at step 2, saves step 4 again and finishes with the losses of
  the first run; export and sample read it."""
  url, bucket, run = gcs_emulator, "resume", "gs://resume/run"
  create_bucket(url, bucket)
  log = tmp_path / "log.txt"
  constant_lr = ["optimizer.min_lr_ratio=1", "checkpoint.max_to_keep=2"]  # 4 or 6 steps alike
  with Proxy(url, metadata_refused) as proxy:
    env = clean_env(STORAGE_EMULATOR_HOST=proxy.address)
    proc = start(run, *constant_lr, "steps=4", log=log, env=env)
    out = wait(proc, log)
    assert proc.returncode == 0, out[-4000:]
    first = losses(url, bucket, "run")
    assert checkpoints(url, bucket, "run") == [2, 4]
    delete(url, bucket, "run/checkpoints/4/data/process_0-of-1.json")
    proc = start(run, *constant_lr, "steps=6", log=log, env=env)
    out = wait(proc, log)
    assert proc.returncode == 0, out[-4000:]
    assert "checkpoint step 4 in " in out and "resumed from step 2 " in out, out[-4000:]
    assert checkpoints(url, bucket, "run") == [4, 6]
    assert {s: v for s, v in losses(url, bucket, "run").items() if s <= 4} == first
    for args in (["train.export", run, "gs://resume/export"],
                 ["train.sample", run, "--prompt", "def ", "--max_new_tokens", "2"]):
      proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)
      assert proc.returncode == 0, proc.stderr[-4000:]
  assert "export/model.safetensors" in objects(url, bucket, "export/")
  assert proxy.refusals
