"""Starting a run from trained weights (config key `init_from`): a Hugging Face checkpoint
directory (Llama, Mistral, Qwen2 or Qwen3: config.json + safetensors, read by
`models.hf.load`) or a run_dir of this trainer (the model of its newest checkpoint). The
optimizer starts fresh, at step 0.

The model config: the YAML's `model.*` keys must give the source's parameters (a change of
their shapes or tree is a config error naming the keys, found by `models.llama.param_changes`).
The run's choices (`RUN_OPTIONS`: compute dtype, remat, scan over layers, attention backend,
`max_seq_len`) come from the YAML. Every other option (rope_theta and rope_scaling,
norm_eps, sliding_window, chunk_size, global_every, logit_soft_cap, ...) comes from the YAML
where it sets it (a key in `set_keys`, or a value other than `LlamaConfig`'s default),
else from the source: a
Hugging Face Llama fine-tuned with a sliding window, or a Llama 3.1 extended with its own
`rope_scaling`.

The tokenizer (`data.tokenizer`) must be the checkpoint's: `check_tokenizer` refuses one
whose vocabulary is larger than the checkpoint's `vocab_size`, whose BOS or EOS ids differ
from its config.json's `bos_token_id` / `eos_token_id`, or that has neither where the
checkpoint names them.

`init_from` may be a `gs://` URL (`train.storage`): a run_dir there is read through orbax;
a Hugging Face checkpoint there is copied to a temporary local directory while it loads
(safetensors reads local files).

A run whose run_dir has checkpoints resumes from them and ignores `init_from` (logged);
its model config is the one its config.json was saved with, with the YAML's options.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from models import hf
from models.llama import LlamaConfig, param_changes
from train import run_dir as run_dir_lib
from train import storage
from train.config import ConfigError, TrainConfig, from_dict

log = logging.getLogger(__name__)

RUN_OPTIONS = ("dtype", "remat", "scan_layers", "attention_backend", "max_seq_len")


def resuming(cfg: TrainConfig) -> bool:
  """Whether the run resumes from checkpoints in its own run_dir (files only)."""
  directory = storage.path(cfg.run_dir) / "checkpoints"
  return cfg.resume and directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def is_hf(path: str) -> bool:
  """Whether `path` is a Hugging Face checkpoint directory (config.json + safetensors)."""
  p = storage.path(path)
  return (p / "config.json").is_file() and ((p / hf.SINGLE).is_file() or (p / hf.INDEX).is_file())


def _run_model(run_dir: str, what: str) -> LlamaConfig:
  """The model config a run_dir's checkpoints were saved with (its config.json)."""
  try:
    return run_dir_lib.saved_config(run_dir).model
  except ConfigError as e:
    raise ConfigError(f"{what}: {e}") from None


def _source_model(path: str) -> LlamaConfig:
  if not path or not storage.path(path).is_dir():
    raise ConfigError(f"config key 'init_from' expects a Hugging Face checkpoint directory or a"
                      f" run_dir of this trainer, got {path!r}, which is not a directory; fix"
                      " the path, or set init_from='' to start from random weights.")
  what = f"config key 'init_from' ({path!r})"
  if is_hf(path):
    try:
      return hf.config_from_hf(_hf_config(path), str(storage.path(path) / "config.json"))
    except hf.CheckpointError as e:
      raise ConfigError(f"{what}: {e}") from None
  if (storage.path(path) / "checkpoints").is_dir():
    return _run_model(path, what)
  raise ConfigError(f"{what} expects a Hugging Face checkpoint directory (config.json and"
                    f" {hf.SINGLE} or {hf.INDEX}) or a run_dir with checkpoints/, got a"
                    " directory with neither; fix the path.")


def _hf_config(path: str) -> dict:
  """`hf.read_config` of a Hugging Face checkpoint directory, local or on a bucket."""
  with storage.local_dir(path, ("config.json",)) as local:
    return hf.read_config(local)


def _merge(model: LlamaConfig, source: LlamaConfig, what: str, keep_layout: bool,
           set_keys=frozenset()) -> LlamaConfig:
  """`source` with `model`'s `RUN_OPTIONS` and the options it sets (named in `set_keys` as
  `model.<field>`, or other than their defaults); ConfigError naming
  every key whose value in `model` gives other parameters than the source's (with
  `keep_layout`, `scan_layers` too: a run_dir's checkpoint holds the tree of its choice)."""
  reference = source if keep_layout else dataclasses.replace(source, scan_layers=model.scan_layers)
  differ = param_changes(reference, model)
  if differ:
    raise ConfigError(
        f"{what} holds a model with "
        + ", ".join(f"model.{k}={getattr(source, k)!r}" for k in differ) + ", but the config has "
        + ", ".join(f"model.{k}={getattr(model, k)!r}" for k in differ)
        + ". These keys set the parameters' shapes: set them to the checkpoint's values.")
  default = LlamaConfig()
  options = {f.name: getattr(model, f.name) for f in dataclasses.fields(LlamaConfig)
             if f.name in RUN_OPTIONS or f"model.{f.name}" in set_keys
             or getattr(model, f.name) != getattr(default, f.name)}
  try:
    merged = dataclasses.replace(source, **options)
  except ValueError as e:
    raise ConfigError(f"{what} with the config's model options: {e}") from None
  changed = [f"model.{f.name} {getattr(model, f.name)!r} -> {getattr(merged, f.name)!r}"
             for f in dataclasses.fields(LlamaConfig)
             if getattr(model, f.name) != getattr(merged, f.name)]
  if changed:
    log.info("model config from %s: %s", what, ", ".join(changed))
  return merged


def resolve(cfg: TrainConfig, set_keys=frozenset()) -> TrainConfig:
  """`cfg` with the model config of its `init_from` source (unchanged without one). Reads
  files only; call before anything is written. `set_keys`: the dotted keys the YAML and
  overrides set (`config.set_keys`), so that a value set equal to its default (e.g.
  `model.sliding_window: null`) also overrides the source's.

  Raises:
    ConfigError: init_from is not a directory, not a Hugging Face checkpoint directory nor
      a run_dir, its config does not load, or the config's `model.*` give other parameters
      (naming each key, both values).
  """
  if not cfg.init_from:
    return cfg
  if resuming(cfg):
    log.info("run_dir %s has checkpoints: resuming from them; init_from %r is ignored.",
             cfg.run_dir, cfg.init_from)
    if not (storage.path(cfg.run_dir) / "config.json").is_file():
      return cfg
    what = f"run_dir {cfg.run_dir!r} (resuming)"
    return _replace_model(cfg, _merge(cfg.model, _run_model(cfg.run_dir, what), what, True,
                                      set_keys))
  source = _source_model(cfg.init_from)
  what = f"config key 'init_from' ({cfg.init_from!r})"
  return _replace_model(cfg, _merge(cfg.model, source, what, not is_hf(cfg.init_from), set_keys))


def resolve_from_copy(cfg: TrainConfig, path: str, set_keys=frozenset()) -> TrainConfig:
  """`resolve` for an `init_from` that is not on this host, from a copy of its config.json
  (`python -m train.compile --model_config PATH`): PATH is that file, under any name, or a
  directory holding config.json. A Hugging Face config.json gives the checkpoint's model; a
  run_dir's (a JSON object with a `model` section) the run's.

  Raises:
    ConfigError naming --model_config: the file does not read, is not a JSON object or its
      model does not load; as `resolve` where the config's `model.*` give other parameters.
  """
  file = storage.path(path)
  file = file / "config.json" if file.is_dir() else file
  what = f"--model_config {path!r} (init_from {cfg.init_from!r})"
  try:
    values = json.loads(file.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"{what} expects init_from's config.json, or a directory holding it;"
                      f" {file} does not read as JSON ({getattr(e, 'strerror', None) or e}).",
                      keys=("init_from",)) from None
  if not isinstance(values, dict):
    raise ConfigError(f"{what} expects a JSON object of the model's fields, got a JSON"
                      f" {type(values).__name__}.", keys=("init_from",))
  try:
    if isinstance(values.get("model"), dict):  # a run_dir's: the trainer's own keys
      source, hf_source = from_dict(values).model, False
    else:
      source, hf_source = hf.config_from_hf(values, str(file)), True
  except (ConfigError, hf.CheckpointError) as e:
    raise ConfigError(f"{what}: {e}", keys=("init_from",)) from None
  return _replace_model(cfg, _merge(cfg.model, source, what, not hf_source, set_keys))


def _replace_model(cfg: TrainConfig, model: LlamaConfig) -> TrainConfig:
  try:
    return dataclasses.replace(cfg, model=model)
  except ValueError as e:
    raise ConfigError(f"config key 'init_from' ({cfg.init_from!r}): {e}") from None


def load(cfg: TrainConfig, context_parallel, graphdef, abstract_state):
  """The `nnx.Param` state of the model of `cfg.init_from`, sharded like the run's; call
  under the run's `jax.set_mesh` and `nnx.logical_axis_rules`, with `cfg` from `resolve`.

  Args:
    context_parallel: the run's `flaxattn.ContextParallel` or None.
    graphdef, abstract_state: the run's `nnx.get_abstract_model` of its train state.

  Raises:
    ConfigError: the checkpoint does not read (naming the file and tensor, or the step).
  """
  from flax import nnx

  from train import checkpoint

  what = f"config key 'init_from' ({cfg.init_from!r})"
  if is_hf(cfg.init_from):
    try:
      with storage.local_dir(cfg.init_from) as local:
        model = hf.load(local, context_parallel=context_parallel, config=cfg.model)
    except hf.CheckpointError as e:
      raise ConfigError(f"{what}: {e}") from None
  else:
    try:
      _, state = checkpoint.restore_newest(cfg.init_from, abstract_state)
    except checkpoint.CheckpointError as e:
      raise ConfigError(f"{what}: {e}") from None
    model = nnx.merge(graphdef, state).model
  return nnx.state(model, nnx.Param)


def _ids(value) -> list[int]:
  """config.json's `bos_token_id` / `eos_token_id`: an int, a list of them (Llama 3.1's
  EOS ids), or null."""
  values = value if isinstance(value, list) else [value]
  return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def check_tokenizer(cfg: TrainConfig, tok) -> None:
  """Refuses a tokenizer that does not fit the checkpoint `cfg.init_from` starts from
  (nothing to check without one, or when resuming). A Hugging Face checkpoint: more ids
  than its config.json's `vocab_size`; BOS / EOS ids other than its `bos_token_id` /
  `eos_token_id` (one of them, where it lists several); or no BOS or EOS token at all where
  it names some (a tokenizer that names no BOS is fine: Qwen's). A run_dir: a tokenizer
  other than the run's (`train.run_dir.load_tokenizer`) in its vocabulary size, its BOS or
  EOS, or the special tokens it adds to a document. Reads files only.

  Raises:
    ConfigError naming data.tokenizer and init_from, with both values.
  """
  if not cfg.init_from or resuming(cfg):
    return
  if not is_hf(cfg.init_from):
    _check_run_tokenizer(cfg, tok)
    return
  try:
    source = _hf_config(cfg.init_from)
  except hf.CheckpointError as e:
    raise ConfigError(f"config key 'init_from' ({cfg.init_from!r}): {e}") from None
  where = f"the checkpoint of init_from {cfg.init_from!r} has"
  fix = ("use the checkpoint's own tokenizer: data.tokenizer=<the init_from directory>, or its"
         " tokenizer.json")
  vocab = source.get("vocab_size")
  if isinstance(vocab, int) and tok.vocab_size > vocab:
    raise ConfigError(f"config key 'data.tokenizer' ({cfg.data.tokenizer!r}) has"
                      f" {tok.vocab_size} ids, but {where} vocab_size {vocab} (its config.json);"
                      f" {fix}.")
  theirs = {name: _ids(source.get(f"{name}_token_id")) for name in ("bos", "eos")}
  ours = {"bos": tok.bos_id, "eos": tok.eos_id}
  # A tokenizer that names no BOS while the config does is fine (Qwen's config.json has a
  # bos_token_id, its tokenizer none); one that names neither is not the checkpoint's.
  named = [n for n in ours if ours[n] is not None]
  differ = [n for n in named if theirs[n] and ours[n] not in theirs[n]]
  if differ or (not named and (theirs["bos"] or theirs["eos"])):
    has = (", ".join(f"{n.upper()} id {ours[n]}" for n in differ) if differ
           else "no BOS or EOS token")
    want = ", ".join(f"{n}_token_id {v[0] if len(v) == 1 else f'one of {v}'}"
                     for n in (differ or ["bos", "eos"]) if (v := theirs[n]))
    raise ConfigError(f"config key 'data.tokenizer' ({cfg.data.tokenizer!r}) has {has}, but"
                      f" {where} {want} (its config.json), so it was trained with other"
                      f" special tokens; {fix}.")


def _check_run_tokenizer(cfg: TrainConfig, tok) -> None:
  """`check_tokenizer` for an `init_from` that is a run_dir of this trainer."""
  what = f"config key 'init_from' ({cfg.init_from!r})"
  try:
    theirs = run_dir_lib.load_tokenizer(cfg.init_from, run_dir_lib.saved_config(cfg.init_from))
  except ConfigError as e:
    raise ConfigError(f"{what}: {e}") from None

  def facts(t):
    return dict(vocabulary=t.vocab_size, bos_id=t.bos_id, eos_id=t.eos_id, begin=t.begin,
                end=t.end)
  ours, source = facts(tok), facts(theirs)
  if differ := [k for k in ours if ours[k] != source[k]]:
    raise ConfigError(
        f"config key 'data.tokenizer' ({cfg.data.tokenizer!r}) is not the tokenizer of the run"
        f" {cfg.init_from!r} that init_from starts from: "
        + ", ".join(f"{k} {ours[k]} (the run's {source[k]})" for k in differ)
        + "; set data.tokenizer to that run's (its config.json's data.tokenizer, or its"
        " tokenizer/ copy).")
