"""`python -m train.export RUN_DIR OUT_DIR [--dtype bfloat16] [--force]`: the model of a
run's newest checkpoint as a Hugging Face directory (`models.hf.save`: Llama, Mistral,
Qwen2 or Qwen3, whichever holds the model's options), which `models.hf.load` and
`transformers` read, with the run's tokenizer (`write_tokenizer`), which
`AutoTokenizer.from_pretrained` reads: it encodes a document as the run did.

The checkpoint is restored onto the host's CPU (whatever devices trained it), the model
config is the run's config.json. Export never overwrites: OUT_DIR must be new or an empty
directory, outside RUN_DIR (neither the run_dir nor inside it); `--force` replaces a
previous export (a directory holding only the files an export writes), never anything
else. The files are written beside OUT_DIR and moved into place when complete, so a failed
export leaves OUT_DIR as it was. Exit status 0, or 2 with a one-line message when OUT_DIR
is refused, RUN_DIR is not a run with a checkpoint, or its model has an option no Hugging
Face architecture here holds (`models.hf.ExportError`, naming it); nothing is written.
Exit status 1 with a one-line message when reading RUN_DIR fails (a permission, the
network; nothing is written) or writing fails midway (a full disk): OUT_DIR is as it was.

RUN_DIR and OUT_DIR may be `gs://` URLs (`train.storage`). An export to a bucket is written
to a local temporary directory first, then uploaded into OUT_DIR, file by file (a bucket
has no rename of a directory): a failed upload removes what it uploaded; with --force the
previous export's files are removed just before.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import uuid

# What `models.hf.save` writes: config.json and one safetensors file, or shards and their
# index; and the tokenizer's files (`write_tokenizer`). A directory of these only is a
# previous export, which --force may replace.
EXPORT_FILES = re.compile(r"config\.json|model\.safetensors(\.index\.json)?"
                          r"|model-\d{5}-of-\d{5}\.safetensors"
                          r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json"
                          r"|tokenizer\.model")


class ReadError(Exception):
  """RUN_DIR did not read (a permission, the network); nothing was written."""


def restore_model(run_dir: str, cfg=None, device=None):
  """`(step, model)`: the `models.llama.Llama` of `run_dir`'s newest checkpoint, read
  without changing anything in `run_dir` (a run may still be training there), with the
  run's model config.

  Args:
    cfg: the run's `TrainConfig` where the caller has loaded it; None: its config.json.
    device: where the parameters go (whatever devices trained them); None: the host's CPU.

  Raises:
    ConfigError: `run_dir` has no loadable config.json.
    CheckpointError: it has no checkpoint, or the newest does not restore.
  """
  import jax
  from flax import nnx

  from train import checkpoint, config, storage
  from train import run_dir as run_dir_lib
  from train.state import make_state

  if cfg is None:
    if not (storage.path(run_dir) / "config.json").is_file():
      raise config.ConfigError(f"export expects a run_dir with config.json (a run of this"
                               f" trainer), got {run_dir!r}, which has none.")
    cfg = run_dir_lib.saved_config(run_dir)
  # The trainer's state (model and optimizer), so the tree matches the checkpoint's.
  graphdef, abstract = nnx.split(nnx.eval_shape(
      lambda: make_state(cfg.model, cfg.optimizer, cfg.steps)))
  where = jax.sharding.SingleDeviceSharding(device or jax.devices("cpu")[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                          abstract)
  step, state = checkpoint.restore_newest(run_dir, abstract)
  return step, nnx.merge(graphdef, state).model


def check_out_dir(run_dir: str, out_dir: str, force: bool = False) -> None:
  """Refuses an `out_dir` that an export of `run_dir` would overwrite: the run_dir itself
  or a path inside it, a file, or a directory that is not empty (with `force`: one holding
  anything but a previous export's files, `EXPORT_FILES`).

  Raises:
    ConfigError naming OUT_DIR and why.
  """
  from train import storage
  from train.config import ConfigError

  run, out = storage.path(run_dir), storage.path(out_dir)
  if not storage.is_url(run_dir):
    run = run.resolve()
  if not storage.is_url(out_dir):
    out = out.resolve()
  if out == run or run in out.parents:
    raise ConfigError(f"OUT_DIR expects a directory outside RUN_DIR, got {out_dir!r}, which is"
                      f" {'the run_dir' if out == run else 'inside the run_dir'} {run_dir!r}"
                      " (an export there would overwrite or mix with the run's files); pass"
                      " another path.")
  if out.exists() and not out.is_dir():
    raise ConfigError(f"OUT_DIR expects a new or empty directory, got {out_dir!r}, which is a"
                      " file; pass another path.")
  # Where the new directories go (a bucket's directories need no creating).
  parent = out if storage.is_url(out_dir) else next(p for p in out.parents if p.exists())
  if not storage.is_url(out_dir) and (not parent.is_dir()
                                      or not os.access(parent, os.W_OK | os.X_OK)):
    raise ConfigError(f"OUT_DIR expects a path whose directories can be created, got"
                      f" {out_dir!r}, but {str(parent)!r} is"
                      f" {'not a directory' if not parent.is_dir() else 'not writable'};"
                      " pass another path.")
  entries = [p.name for p in storage.iterdir(out)] if out.is_dir() else []
  if not entries:
    return
  others = [n for n in entries if not (EXPORT_FILES.fullmatch(n) and (out / n).is_file())]
  if not force:
    raise ConfigError(f"OUT_DIR expects a new or empty directory, got {out_dir!r}, which holds"
                      f" {', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}; pass"
                      " another path, or --force to replace a previous export.")
  if others:
    raise ConfigError(f"--force replaces a previous export only, but OUT_DIR {out_dir!r} holds"
                      f" {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}, which an"
                      " export does not write; pass another path.")


def export(run_dir: str, out_dir: str, dtype: str = "bfloat16", force: bool = False) -> int:
  """Writes the model of `run_dir`'s newest checkpoint to `out_dir` in Hugging Face format,
  tensors as `dtype`; returns the checkpoint's step. The files are written to a new
  directory beside `out_dir`, then moved into place: on any failure `out_dir` is as it was.

  Args:
    force: replace a previous export in `out_dir` (see `check_out_dir`).

  Raises:
    ConfigError: a URL the export cannot use (`train.storage.check`), `out_dir` refused
      (`check_out_dir`); see also `restore_model`.
    CheckpointError: as `restore_model`.
    ReadError: reading `run_dir` failed otherwise (an OSError: a permission, the network).
    models.hf.ExportError: an option no architecture holds (before the checkpoint is read).
    ValueError: unknown dtype.
  """
  from models import hf
  from train import run_dir as run_dir_lib
  from train import storage

  storage.check(run_dir, "RUN_DIR")
  storage.check(out_dir, "OUT_DIR", write=True)
  check_out_dir(run_dir, out_dir, force)
  tok = None
  try:
    if (storage.path(run_dir) / "config.json").is_file():
      cfg = run_dir_lib.saved_config(run_dir)
      hf.architecture(cfg.model)  # refuse before restoring
      tok = run_dir_lib.load_tokenizer(run_dir, cfg)
    step, model = restore_model(run_dir)
  except OSError as e:
    raise ReadError(f"reading RUN_DIR {run_dir!r} failed: {_one_line(e)}") from e
  if storage.is_url(out_dir):
    with tempfile.TemporaryDirectory(prefix="flaxattn-export-") as local:
      hf.save(model, local, dtype=dtype)
      if tok is not None:
        write_tokenizer(tok, pathlib.Path(local))
      _upload(pathlib.Path(local), storage.path(out_dir))
    return step
  out = pathlib.Path(out_dir).absolute()
  out.parent.mkdir(parents=True, exist_ok=True)
  new = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:12]}"
  new.mkdir()  # the umask's permissions (tempfile.mkdtemp's would be the owner's only)
  old = None
  try:
    hf.save(model, str(new), dtype=dtype)
    if tok is not None:
      write_tokenizer(tok, new)
    if out.exists():  # empty, or a previous export with force: set aside until replaced
      old = out.rename(out.parent / f"{new.name}.old")
    new.rename(out)
  except BaseException:
    if old is not None and not out.exists():
      old.rename(out)
    shutil.rmtree(new, ignore_errors=True)
    raise
  if old is not None:
    shutil.rmtree(old)
  return step


def _one_line(error: BaseException) -> str:
  return " ".join(str(error).split()) or type(error).__name__


def _upload(local: pathlib.Path, out) -> None:
  """Copies the files of export `local` into `out` (an `epath.Path` on a bucket), after
  removing the files there (a previous export, which `check_out_dir` allowed); on failure
  removes what it uploaded."""
  from train import storage

  for old in storage.iterdir(out) if out.is_dir() else []:
    old.unlink()
  done = []
  try:
    for file in sorted(local.iterdir()):
      storage.upload(file, out / file.name)
      done.append(out / file.name)
  except BaseException:
    for target in done:
      target.unlink(missing_ok=True)
    raise


def write_tokenizer(tok, out: pathlib.Path) -> None:
  """Writes the files of the run's tokenizer `tok` into the export `out`, where transformers
  reads them, and its BOS / EOS ids into config.json (`bos_token_id`, `eos_token_id`).

  A Hugging Face tokenizer's files are copied as they are; without a tokenizer_config.json
  one is written (`PreTrainedTokenizerFast`, its BOS and EOS tokens, no add_bos_token /
  add_eos_token: the post-processor adds what the run added). A SentencePiece model is
  written as tokenizer.model with the tokenizer_config.json transformers reads for Llama 2
  (`LlamaTokenizer`), adding no BOS or EOS, as the run did. The bytes tokenizer has no
  transformers equivalent: nothing is written for it.
  """
  from train.data import tokenizers

  if not tok.files:
    return
  for name, data in tok.files.items():
    (out / name).write_bytes(data)
  special = {k: v for k, v in (("bos_token", tok.piece(tok.bos_id)),
                               ("eos_token", tok.piece(tok.eos_id))) if v is not None}
  config_file = out / tokenizers.HF_CONFIG_FILES[0]
  if isinstance(tok, tokenizers.SentencePieceTokenizer):
    config_file.write_text(json.dumps(dict(
        tokenizer_class="LlamaTokenizer", add_bos_token=False, add_eos_token=False,
        **special), indent=2))
  elif not config_file.exists():
    config_file.write_text(json.dumps(dict(tokenizer_class="PreTrainedTokenizerFast",
                                           **special), indent=2))
  model_config = json.loads((out / "config.json").read_text())
  model_config.update(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
  (out / "config.json").write_text(json.dumps(model_config, indent=2))


def main(argv: list[str]) -> int:
  from models.hf import DTYPES, ExportError
  from train import checkpoint, config

  parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dir")
  parser.add_argument("out_dir")
  parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
  parser.add_argument("--force", action="store_true",
                      help="replace a previous export in OUT_DIR (never other files)")
  args = parser.parse_args(argv)
  logging.getLogger("absl").setLevel(logging.ERROR)  # orbax notes that it reads read-only
  try:
    step = export(args.run_dir, args.out_dir, args.dtype, args.force)
  except (config.ConfigError, checkpoint.CheckpointError, ExportError) as e:
    print(f"export error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"export interrupted: {args.out_dir} is as it was.", file=sys.stderr)
    return 130
  except ReadError as e:
    print(f"export error: {e}; nothing was written.", file=sys.stderr)
    return 1
  except OSError as e:  # a disk full or a directory that went away while writing
    print(f"export error: writing {args.out_dir!r} failed: {_one_line(e)}; it is as it was.",
          file=sys.stderr)
    return 1
  print(f"wrote step {step} of {args.run_dir} to {args.out_dir} ({args.dtype})")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
