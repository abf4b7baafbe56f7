"""The command lines refuse mistakes before anything is written: exit 2, one line naming
the key or file, no traceback (`trainer.refused`). Export's cases run in process
(`export.main`), one in a subprocess."""

from __future__ import annotations

import pathlib
import sys

from train import config, export
from train import run_dir as run_dir_lib
from trainer import TINY, refused

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
  only), and an export that fails (here: the checkpoint does not restore) with --force over
  a previous export: each exits 2 with one line, and OUT is as it was, with nothing beside."""
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
      (previous, True, ["checkpoint step 4", "does not restore"])):
    _export_refused(capsys, [str(run_dir), str(out)] + ["--force"] * force, *expected)
  assert _files(tmp_path) == before


def test_export_that_fails_while_writing_leaves_out_as_it_was(tmp_path, monkeypatch):
  """The files are written beside OUT and moved into place when complete: a failure in the
  middle of writing (a full disk, Ctrl-C) leaves a previous export whole and nothing else."""
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

  monkeypatch.setattr(export, "restore_model", restore_model)
  monkeypatch.setattr(hf, "save", save)
  assert export.main([str(run_dir), str(previous), "--force"]) == 130
  assert _files(tmp_path) == before
  monkeypatch.setattr(hf, "save", lambda model, path, dtype: (pathlib.Path(path) / "config.json")
                      .write_text("new"))
  assert export.main([str(run_dir), str(previous), "--force"]) == 0
  assert sorted(p.name for p in tmp_path.iterdir()) == ["previous", "run"]
  assert [p.name for p in previous.iterdir()] == ["config.json"]
