"""The command lines refuse mistakes before anything is written: exit 2, one line naming
the key or file, no traceback (`trainer.refused`). The trainer's cases run one subprocess
each and refuse before compiling (seconds); export's run in process (`export.main`)."""

from __future__ import annotations

import pathlib
import sys

import jax
import pytest

from train import config, export
from train import run_dir as run_dir_lib
from trainer import MAIN_REPORTING_BACKEND, TINY, refused


@pytest.mark.parametrize("name, text, expected", [
    ("nowhere.yaml", None, "cannot be read (No such file or directory)"),
    ("", None, "cannot be read (Is a directory)"),
    ("bad.yaml", "steps: [1, 2\nseq_len: 3\n", "is not valid YAML"),
])
def test_config_file_that_does_not_load_exits_2_naming_it(tmp_path, name, text, expected):
  """A missing config file, a directory, a YAML syntax error: before jax starts."""
  path, run_dir = tmp_path / name, tmp_path / "run"
  if text is not None:
    path.write_text(text)
  proc = refused([sys.executable, "-c", MAIN_REPORTING_BACKEND, str(path), f"run_dir={run_dir}",
                  *TINY], "config error: config file", repr(str(path)), expected, run_dir=run_dir)
  assert "BACKEND_STARTED False" in proc.stdout


def _missing_platform() -> str:
  """A platform jax cannot start on this machine."""
  return "tpu" if jax.default_backend() == "gpu" else "gpu"


@pytest.mark.parametrize("overrides, names", [
    (["data.eval_batches=0"], ["'data.eval_batches'", "at least 1 when evals run", "got 0"]),
    (["data.eval_batches=-1"], ["'data.eval_batches'", "got -1"]),
    (["data.eval_fraction=0"], ["'eval_every' (4)", "data.eval_fraction=0.0 holds none out"]),
    (["platform=<missing>", "num_devices=0"], ["'platform' ('<missing>')",
                                                "jax cannot start it here"]),
    (["distributed=on"], ["'distributed' ('on')", "jax.distributed.initialize() failed"]),
    (["context_parallel.strategy=ulysses"], [
        "model.n_heads (2) and model.n_kv_heads (1) do not split over mesh",
        "context_parallel.strategy='ulysses'",
        "'ulysses' over 'context' (size 4)", "divisible by 4"]),
    (["data.tokenizer=<model file>", "--hide-sentencepiece"], [
        "'data.tokenizer'", "needs the sentencepiece package", "data.tokenizer=bytes"]),
    # Document order over 4 devices: died at step 1 ("divisible by 2 * cp = 8").
    (["seq_len=100"], ["seq_len (100) expects a multiple of 8", "data.balance=document",
                       "set seq_len=104 or 96"]),
    # An explicit kernel that declines the run's calls: a traceback at step 1 before.
    (["model.attention_backend=<declining>"], ["config key 'model.attention_backend'",
                                               "cannot serve this call"]),
    # Ring head groups that do not divide the K/V head: a traceback at step 1 before, after
    # checkpoints/, corpus.json and tensorboard/ were written.
    (["context_parallel.head_groups=2"], ["config key 'context_parallel.head_groups' (2)",
                                          "model.n_kv_heads (1)", "pass one of [1]"]),
])
def test_setup_errors_exit_2_before_anything_is_written(tmp_path, overrides, names):
  """Mistakes found once jax has started (held-out documents, eval batches, a platform
  without devices here, distributed=on without a coordinator, heads Ulysses cannot split,
  a SentencePiece tokenizer without the package, a seq_len document order cannot split, an
  attention kernel that declines the model's calls, ring head groups that do not divide
  the heads): a config error, no run_dir."""
  run_dir, model_file = tmp_path / "run", tmp_path / "tokenizer.model"
  model_file.write_bytes(b"\0")
  swap = {"<missing>": _missing_platform(), "<model file>": str(model_file),
          # cuDNN off a GPU; splash (on a GPU) with 64 tokens a device, not a multiple of 128.
          "<declining>": "cudnn" if jax.default_backend() != "gpu" else "splash"}

  def fill(text):
    for k, v in swap.items():
      text = text.replace(k, v)
    return text
  flags = [o for o in overrides if o.startswith("--")]
  cmd = [sys.executable, "-c", MAIN_REPORTING_BACKEND, *flags, "configs/demo.yaml",
         f"run_dir={run_dir}", *TINY, *(fill(o) for o in overrides if o not in flags)]
  refused(cmd, "config error: ", *map(fill, names), run_dir=run_dir)


# -- python -m train.export ------------------------------------------------------------------

def _run(tmp_path):
  """A run_dir with its config.json and an empty checkpoint directory: enough for every
  refusal (they come before the checkpoint is read), and a restore that fails."""
  run_dir = tmp_path / "run"
  cfg = config.load("configs/demo.yaml", [f"run_dir={run_dir}", *TINY])
  run_dir_lib.create(cfg.run_dir)
  run_dir_lib.save_config(cfg)
  (run_dir / "checkpoints" / "4").mkdir(parents=True)
  return run_dir


def _files(root) -> dict:
  return {p.relative_to(root): p.read_bytes() if p.is_file() else None
          for p in sorted(root.rglob("*"))}


def test_export_into_the_run_dir_is_refused(tmp_path, capsys):
  """`python -m train.export RUN RUN` (also with --force) and RUN/hf: the run's files stay."""
  run_dir = _run(tmp_path)
  before = _files(run_dir)
  refused([sys.executable, "-m", "train.export", str(run_dir), str(run_dir)],
          "export error: OUT_DIR expects a directory outside RUN_DIR", "which is the run_dir")
  for out, where in ((run_dir, "which is the run_dir"), (run_dir / "hf", "inside the run_dir"),
                     (run_dir / "checkpoints", "inside the run_dir")):
    for force in ([], ["--force"]):
      _export_refused(capsys, [str(run_dir), str(out), *force], where)
  assert _files(run_dir) == before


def _export_refused(capsys, argv, *expected) -> None:
  assert export.main(argv) == 2
  line, = capsys.readouterr().err.strip().splitlines()
  assert line.startswith("export error: ") and all(e in line for e in expected), line


def test_export_never_overwrites(tmp_path, capsys):
  """An existing file, a directory that is not empty (--force replaces a previous export
  only), a path below a file, and an export that fails (here: the checkpoint does not
  restore) with --force over a previous export: each exits 2 with one line, and OUT is as
  it was, with nothing beside."""
  run_dir = _run(tmp_path)
  file, notes, previous = tmp_path / "file", tmp_path / "notes", tmp_path / "previous"
  file.write_text("keep")
  notes.mkdir()
  (notes / "notes.txt").write_text("keep")
  previous.mkdir()
  (previous / "config.json").write_text("{}")
  (previous / "model.safetensors").write_bytes(b"weights")
  before = _files(tmp_path)
  for out, force, expected in (
      (file, False, ["which is a file"]), (notes, False, ["which holds notes.txt", "--force"]),
      (notes, True, ["previous export only", "notes.txt"]),
      (previous, False, ["which holds config.json, model.safetensors"]),
      (previous, True, ["checkpoint step 4", "does not restore"]),
      (file / "out", False, [repr(str(file)), "is not a directory"])):
    _export_refused(capsys, [str(run_dir), str(out)] + ["--force"] * force, *expected)
  assert _files(tmp_path) == before


def test_export_that_fails_while_writing_leaves_out_as_it_was(tmp_path, monkeypatch, capsys):
  """The files are written beside OUT and moved into place when complete: a failure in the
  middle of writing (Ctrl-C: exit 130; a full disk: exit 1, one line) leaves a previous
  export whole and nothing else."""
  from models import hf

  run_dir = _run(tmp_path)
  previous = tmp_path / "previous"
  previous.mkdir()
  (previous / "model.safetensors").write_bytes(b"weights")
  before = _files(tmp_path)

  def restore_model(run_dir):
    return 4, None

  def save(model, path, dtype):
    (pathlib.Path(path) / "model.safetensors").write_bytes(b"half")
    raise KeyboardInterrupt

  def disk_full(model, path, dtype):
    (pathlib.Path(path) / "model.safetensors").write_bytes(b"half")
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(export, "restore_model", restore_model)
  monkeypatch.setattr(hf, "save", save)
  assert export.main([str(run_dir), str(previous), "--force"]) == 130
  assert _files(tmp_path) == before
  capsys.readouterr()
  monkeypatch.setattr(hf, "save", disk_full)
  assert export.main([str(run_dir), str(previous), "--force"]) == 1
  line, = capsys.readouterr().err.strip().splitlines()
  assert "No space left on device" in line and "it is as it was" in line, line
  assert _files(tmp_path) == before
  monkeypatch.setattr(hf, "save", lambda model, path, dtype: (pathlib.Path(path) / "config.json")
                      .write_text("new"))
  assert export.main([str(run_dir), str(previous), "--force"]) == 0
  assert sorted(p.name for p in tmp_path.iterdir()) == ["previous", "run"]
  assert [p.name for p in previous.iterdir()] == ["config.json"]
