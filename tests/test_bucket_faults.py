"""A run_dir on a bucket that is odd, slow, damaged or restricted (the `gcs_emulator`
fixture): each gives an exact resume or a one-line error that names the value and the fix,
before anything is written. The cases call `train.storage` and `train.checkpoint` in this
process on a run saved without training, or the command lines that would otherwise write.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest
from flax import nnx

from gcs import checkpoints, create_bucket, delete, objects
from train import checkpoint, config
from train.config import ConfigError
from train.state import make_state
from trainer import ROOT, TINY, clean_env


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
