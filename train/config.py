"""The trainer's configuration: one frozen dataclass tree; YAML files and `key=value`
overrides only set values of it.

  cfg = load("configs/demo.yaml", ["model.dim=128", "steps=20"])

Values are checked against the field types (an int where a float is expected is fine; a
bool is not an int). Unknown keys and wrong types raise `ConfigError` listing the valid
keys, before jax computes anything (importing `models.llama` imports jax but starts no
backend).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml

from flaxattn import registry
from flaxattn.context_parallel import STRATEGIES, ContextParallel
from models.llama import LlamaConfig


class ConfigError(ValueError):
  """A config key or value that the schema rejects. `keys`: the dotted config keys at fault
  where the check knows them (`("seq_len",)`, `("model.n_heads", "model.n_kv_heads")`), so
  that a caller can tell which failed without reading the message; () where it does not."""

  def __init__(self, message: str, keys: tuple[str, ...] = ()):
    super().__init__(message)
    self.keys = tuple(keys)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where documents come from and how they become packed rows.

  source: "stdlib" (the Python standard library's own `.py` files, on every machine) or a
    directory (local, or a `gs://` URL where gcsfs is installed) of `.txt` files (one
    document each), `.jsonl` files (one document per line, its `text_field`), `.json`
    files (JSON Lines, or a JSON array of objects), each of these also `.gz` or `.zst`
    compressed, and `.parquet` shards (one document per row, its column `text_field`;
    needs pyarrow), matched in any case and read recursively in sorted order
    (`train.data.sources`); other files are named in a warning.
  text_field: the JSON field and `.parquet` column that holds a document's text.
  tokenizer: "bytes" (UTF-8 bytes, ids 0..255); a Hugging Face `tokenizer.json` or a
    directory holding one (a model directory such as `init_from`'s; the `tokenizers`
    package), whose post-processor's special tokens (BOS, EOS) begin and end each
    document, as transformers adds them; or a SentencePiece `.model` (or a directory
    holding tokenizer.model). A run copies its files into the run_dir
    (`train.run_dir.save_tokenizer`), which resume, export and sample read.
  bad_records: what listing the corpus does with a record it cannot train on (a JSON
    record that is not a UTF-8 JSON object with a string `text_field`, a text with a lone
    surrogate, a null or invalid UTF-8 `.parquet` value, a file that is not parquet, a
    `.txt` file that is binary or mostly not UTF-8, a damaged compressed stream; the full
    list in `train.data.sources`): "skip" leaves it out and counts it in a warning;
    "error" stops with a config error that lists them.
  eval_fraction: the share of documents held out for eval, chosen by a hash of their text
    (so a document stays held out when the corpus grows, and duplicates are held out
    together; `train.data.sources.split_documents`: at least one when > 0); evals
    (`eval_every` > 0) need it > 0 (`train.data.make`).
  eval_batches: batches of held-out rows in each eval; at least 1 when evals run.
  packing_bins: rows the packer fills at once (more bins, less padding).
  read_threads: threads reading and tokenizing documents (0: read in the loop's thread).
  balance: the token order of packed rows under context parallelism (ignored without it),
    set on the host before the step: "document" (each document split over the devices,
    `flaxattn.balance_plan` weighed by the model's layer masks: the same attention work
    on every device), "row" (`flaxattn.load_balance` dual chunk of the whole row: even for
    one document per row) or "none" (the original order). The loss is the same in each.
    Under "document" and "row", seq_len is a multiple of twice the balanced shards
    (`train.mesh.seq_multiple`).
  """

  source: str = "stdlib"
  text_field: str = "text"
  tokenizer: str = "bytes"
  bad_records: str = "skip"
  eval_fraction: float = 0.02
  eval_batches: int = 2
  packing_bins: int = 16
  read_threads: int = 2
  balance: str = "document"

  def __post_init__(self):
    _check_at_least("data.read_threads", self.read_threads, 0)
    _check_at_least("data.packing_bins", self.packing_bins, 1)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with linear warmup then cosine decay to `lr * min_lr_ratio`, global-norm clipping.

  Weight decay applies to matrices only (not norm scales). Every value is finite: `lr`,
  `warmup_steps`, `weight_decay` >= 0 (lr 0: steps that change nothing); `min_lr_ratio` in
  [0, 1]; `b1`, `b2` in [0, 1); `eps` > 0; `clip_norm` >= 0 (0: no clipping).
  """

  lr: float = 3e-4
  warmup_steps: int = 100
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  clip_norm: float = 1.0

  def __post_init__(self):
    for name, (fits, expected) in _OPTIMIZER_RANGES.items():
      value = getattr(self, name)
      if not (math.isfinite(value) and fits(value)):
        raise ConfigError(f"config key 'optimizer.{name}' expects a finite number {expected},"
                          f" got {value!r}.")


# OptimizerConfig's fields: whether a finite value fits, and what is expected.
_OPTIMIZER_RANGES = {
    "lr": (lambda x: x >= 0, ">= 0 (0: steps that change nothing)"),
    "warmup_steps": (lambda x: x >= 0, ">= 0"),
    "min_lr_ratio": (lambda x: 0 <= x <= 1, "in [0, 1]"),
    "weight_decay": (lambda x: x >= 0, ">= 0"),
    "b1": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "b2": (lambda x: 0 <= x < 1, "in [0, 1)"),
    "eps": (lambda x: x > 0, "> 0"),
    "clip_norm": (lambda x: x >= 0, ">= 0 (0: no clipping)"),
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes; one may be -1 (fill with the remaining devices). Their product must
  equal the number of devices (`train.mesh` checks it). The sequence is sharded over
  (context_ring, context): context_ring > 1 runs a ring over it inside Ulysses over context
  (strategy "ulysses").

  fsdp_over_context: parameters and optimizer state sharded over the context axes too
  (their `embed` dimension over fsdp x context_ring x context), as MaxText shards them over
  its context axis: each device holds 1 / (fsdp x context_ring x context) of them, which
  is what lets batch 1 with the whole slice on the sequence fit; the layers gather their
  weights over those axes as FSDP does. The checkpoint is the same either way: a run
  resumes with it changed, or on another mesh."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  context_ring: int = 1
  context: int = 1
  fsdp_over_context: bool = False


MESH_AXES = ("data", "fsdp", "tensor", "context_ring", "context")
SEED_LIMIT = 2**32
# heartbeat_timeout_s's largest value: jax.distributed takes its own heartbeat timeout
# (`train.distributed.jax_heartbeat_timeout_s` of it: 2 x it + 60 s) as an int32 of seconds,
# and a larger one was a TypeError on every process of the job. The watchdog's waits
# (`time.sleep`, `threading.Event.wait`) take up to about 9.2e9 s: not the limit.
HEARTBEAT_TIMEOUT_MAX_S = (2**31 - 1 - 60) // 2
# data.balance -> ContextParallel(load_balance=...).
BALANCE = {"document": "document", "row": True, "none": False}
# context_parallel.grad_dtype -> ContextParallel(grad_dtype=...).
GRAD_DTYPES = {"float32": "float32", "inputs": None}
PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class ContextParallelConfig:
  """`flaxattn.ContextParallel` over the mesh's `context` axis (used when it or
  `context_ring` is > 1). strategy: "ring", "all_gather", "ulysses" or "auto" (below); with
  mesh `context_ring` > 1 it must be "ulysses" (or "auto", which then has only it), which
  runs a ring over `context_ring` (`ContextParallel(ring_axis="context_ring")`). Its token
  order (load balancing) is `data.balance`. grad_dtype: what a ring sums its steps' partial
  gradients in, "float32" (exact) or "inputs" (the compute dtype: half the gradient bytes
  held and sent; `ContextParallel(grad_dtype=None)`). head_groups: how many groups of heads
  a ring takes round one after the other (`ContextParallel(head_groups=...)`); null: chosen
  per layer call. It must divide the K/V heads each device's ring holds (`train.mesh.make`
  checks it, under "auto" too, which may choose the ring).

  "auto" chooses one strategy for the run when it starts, the fastest by an estimate of the
  whole step, and logs it with its reason (`train.strategy`): with auto_compile (default)
  on devices whose chip has published peak figures (`flaxattn.aot.TARGETS`), the step
  compiled once per strategy the mesh can run and `flaxattn.aot.estimate` read from each
  (as `python -m train.compile` reports it); else the attention's analytic model
  (`flaxattn.planner`, its TPU and GPU numbers calibrated against such estimates)."""

  strategy: str = "ring"
  grad_dtype: str = "float32"
  head_groups: int | None = None
  auto_compile: bool = True


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints in `{run_dir}/checkpoints`; the `max_to_keep` newest are kept (at
  least 1: a resume needs one)."""

  max_to_keep: int = 3
  async_save: bool = True

  def __post_init__(self):
    _check_at_least("checkpoint.max_to_keep", self.max_to_keep, 1)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A training run.

  run_dir: checkpoints, config.json (the config they were saved with), metrics.jsonl,
    TensorBoard events and loss.png go here; a rerun with the same run_dir resumes from
    its latest good checkpoint (see `train.run_dir`). A local path or a gs://BUCKET/PATH
    URL (`train.storage`; a multi-host run needs a bucket every host reaches).
  resume: true: continue from run_dir's checkpoints, refusing a config that changes the
    saved state's structure; false: start over at step 0 after moving the previous run's
    files to `{run_dir}/archive/<time>/` (nothing is deleted).
  steps: total optimizer steps (also the cosine schedule's length).
  seq_len: tokens per row; batch_size: rows per step, global (over all processes).
  checkpoint_every / eval_every: in steps; 0 = never (a checkpoint is still written at
    the end and on SIGTERM or SIGINT).
  platform: "" (JAX's default) or a JAX platform name (`PLATFORMS`); "gpu" asks JAX for
    CUDA (`train.distributed.jax_platforms`).
  num_devices: with platform "cpu", the number of simulated CPU devices; elsewhere 0 or
    the number of devices (checked). 0 = whatever is there.
  distributed: "auto", "on" or "off": whether to call `jax.distributed.initialize()`
    (see `train.distributed`).
  heartbeat_timeout_s: in a multi-process job, the seconds after which a process that has
    sent no heartbeat to the job's coordinator counts as lost (preempted, killed, crashed):
    every other process then exits with status 3, naming it, instead of waiting in a
    collective (jax.distributed's `heartbeat_timeout_seconds`, default 100); at most
    `HEARTBEAT_TIMEOUT_MAX_S` (about 34 years).
  init_from: "" (random initialization) or the weights to start from, with a fresh
    optimizer at step 0: a Hugging Face checkpoint directory (config.json + safetensors;
    Llama, Mistral, Qwen2, Qwen3) or a run_dir of this trainer (its newest checkpoint; a
    gs:// URL too). See `train.init_from`.
  peak_tflops_per_device: the dense peak TFLOP/s of one device in the compute dtype, for
    MFU; 0 = the chip's (`train.throughput.peak`; measured on CPU).
  overlap_flags: true: the platform's compiler flags for hiding collectives behind compute
    (`train.xla_flags`: LIBTPU_INIT_ARGS on TPU, XLA_FLAGS on GPU, as the published recipes
    set them) are added where the environment does not set them, and logged at start;
    `python -m train.compile` compiles with them too. false: none are added.
  """

  run_dir: str = "runs/default"
  resume: bool = True
  steps: int = 100
  seed: int = 0
  seq_len: int = 4096
  batch_size: int = 8
  checkpoint_every: int = 50
  eval_every: int = 50
  log_every: int = 1
  platform: str = ""
  num_devices: int = 0
  distributed: str = "auto"
  heartbeat_timeout_s: int = 100
  init_from: str = ""
  peak_tflops_per_device: float = 0.0
  overlap_flags: bool = True
  model: LlamaConfig = dataclasses.field(default_factory=LlamaConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  context_parallel: ContextParallelConfig = dataclasses.field(
      default_factory=ContextParallelConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

  def __post_init__(self):
    for name in ("steps", "seq_len", "batch_size", "log_every"):
      if getattr(self, name) < 1:
        raise ConfigError(f"{name} expects a positive int, got {getattr(self, name)}.",
                          keys=(name,))
    if not 0 <= self.seed < SEED_LIMIT:  # grain's shuffle and split take an unsigned 32-bit seed
      raise ConfigError(f"seed expects an int in [0, {SEED_LIMIT - 1}] (2**32 - 1), got"
                        f" {self.seed}.", keys=("seed",))
    for name in ("checkpoint_every", "eval_every", "num_devices", "peak_tflops_per_device"):
      if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
        raise ConfigError(f"{name} expects a number >= 0, got {getattr(self, name)}.")
    if not 1 <= self.heartbeat_timeout_s <= HEARTBEAT_TIMEOUT_MAX_S:
      raise ConfigError(f"config key 'heartbeat_timeout_s' expects an int in [1,"
                        f" {HEARTBEAT_TIMEOUT_MAX_S}] (seconds; jax.distributed takes twice it"
                        f" and a minute as a 32-bit int), got {self.heartbeat_timeout_s}.",
                        keys=("heartbeat_timeout_s",))
    if self.context_parallel.head_groups is not None:
      _check_at_least("context_parallel.head_groups", self.context_parallel.head_groups, 1)
    if self.seq_len > self.model.max_seq_len:
      raise ConfigError(f"seq_len ({self.seq_len}) expects at most model.max_seq_len"
                        f" ({self.model.max_seq_len}); raise model.max_seq_len.",
                        keys=("seq_len", "model.max_seq_len"))
    for key, choices in (("distributed", ("auto", "on", "off")),
                         ("context_parallel.strategy", STRATEGIES),
                         ("context_parallel.grad_dtype", tuple(GRAD_DTYPES)),
                         ("platform", ("",) + PLATFORMS),
                         ("model.attention_backend", tuple(registry.backend_names())),
                         ("data.bad_records", ("skip", "error")),
                         ("data.balance", tuple(BALANCE))):
      _check_choice(key, get(self, key), choices)
    try:
      context_parallel(self.context_parallel, self.data.balance,
                       ring=self.mesh.context_ring != 1)
    except ValueError as e:
      raise ConfigError(f"config key 'mesh.context_ring' ({self.mesh.context_ring}) with"
                        f" context_parallel.strategy {self.context_parallel.strategy!r}: {e}"
                        " For one context axis set mesh.context instead.") from None
    if not 0 <= self.data.eval_fraction < 1:
      raise ConfigError("data.eval_fraction expects a value in [0, 1), got"
                        f" {self.data.eval_fraction}.")


def context_parallel(options: ContextParallelConfig, balance: str,
                     ring: bool) -> ContextParallel:
  """The `flaxattn.ContextParallel` over the mesh's `context` axis with the strategy,
  gradient dtype and head groups of `options` (`context_parallel`), the token order of `balance`
  (`data.balance`), and with `ring` a ring over `context_ring` inside Ulysses over
  `context`.

  Raises:
    ValueError: options that `ContextParallel` refuses (a ring under a strategy other than
      "ulysses" or "auto").
  """
  return ContextParallel("context", options.strategy, BALANCE[balance],
                         "context_ring" if ring else None,
                         grad_dtype=GRAD_DTYPES[options.grad_dtype],
                         head_groups=options.head_groups)


def _check_at_least(key: str, value: int, least: int) -> None:
  if value < least:
    raise ConfigError(f"config key {key!r} expects an int >= {least}, got {value}.")


def get(cfg, key: str):
  """The value of dotted config key `key` (e.g. "data.source") in `cfg`."""
  for part in key.split("."):
    cfg = getattr(cfg, part)
  return cfg


def _check_choice(key: str, value, choices: tuple) -> None:
  if value not in choices:
    raise ConfigError(f"config key {key!r} expects one of {', '.join(map(repr, choices))};"
                      f" got {value!r}.")


def valid_keys(cls: type = TrainConfig, prefix: str = "") -> list[str]:
  """Every dotted key of the schema, e.g. `model.dim`."""
  keys = []
  for f in dataclasses.fields(cls):
    kind = _field_types(cls)[f.name]
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
      keys += valid_keys(kind, f"{prefix}{f.name}.")
    else:
      keys.append(f"{prefix}{f.name}")
  return keys


def _field_types(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _unknown(key: str) -> ConfigError:
  """One line: the closest valid keys, else the keys of the section `key` names."""
  keys = valid_keys()
  close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
  section = key.rpartition(".")[0]
  prefix = f"{section}." if section and any(k.startswith(f"{section}.") for k in keys) else ""
  names = dict.fromkeys(k[len(prefix):].split(".")[0] + (".*" if "." in k[len(prefix):] else "")
                        for k in keys if k.startswith(prefix))
  hint = (f"did you mean {', '.join(map(repr, close))}?" if close else
          f"valid keys{f' of {section!r}' if prefix else ''}: {', '.join(names)}"
          " (python -m train --help lists every key).")
  return ConfigError(f"unknown config key {key!r}; {hint}")


def _check_value(key: str, kind, value):
  """`value` if it fits type `kind` (ints widen to floats), else ConfigError."""
  options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
  for option in options:
    if option is type(None) and value is None:
      return None
    if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    if option is int and isinstance(value, int) and not isinstance(value, bool):
      return value
    if option in (bool, str) and isinstance(value, option):
      return value
  names = " | ".join(getattr(o, "__name__", str(o)) for o in options)
  raise ConfigError(f"config key {key!r} expects {names}, got {value!r}"
                    f" ({type(value).__name__}).")


def _parse_text(key: str, kind, text: str):
  """The value of override text `text` for a field of type `kind`."""
  options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
  if type(None) in options and text.lower() in ("none", "null", "~"):
    return None
  if str in options:
    return text
  parsed = yaml.safe_load(text)  # true/false, ints, floats (1e-3 too: handled below)
  if float in options and isinstance(parsed, str):
    try:
      parsed = float(text)
    except ValueError:
      pass
  return _check_value(key, kind, parsed)


def _build(cls, values: dict, prefix: str = ""):
  """An instance of dataclass `cls` from nested `values` (checked), defaults elsewhere."""
  if not isinstance(values, dict):
    raise ConfigError(f"config key {prefix.rstrip('.')!r} expects a mapping of its fields,"
                      f" got {values!r}.")
  kinds = _field_types(cls)
  kwargs = {}
  for name, value in values.items():
    key = f"{prefix}{name}"
    if name not in kinds:
      raise _unknown(key)
    kind = kinds[name]
    if dataclasses.is_dataclass(kind):
      kwargs[name] = _build(kind, value, f"{key}.")
    else:
      if isinstance(value, str) and kind is float:
        value = _parse_text(key, kind, value)  # YAML reads 1e-3 (no dot) as a string
      kwargs[name] = _check_value(key, kind, value)
  try:
    return cls(**kwargs)
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e


def _set(values: dict, override: str) -> None:
  """Applies `key=value` (dotted key, value parsed by the field's type) to nested `values`."""
  key, sep, text = override.partition("=")
  if not sep or not key:
    raise ConfigError(f"override {override!r} expects key=value, e.g. model.dim=128.")
  cls, node, parts = TrainConfig, values, key.split(".")
  for i, part in enumerate(parts):
    kinds = _field_types(cls)
    if part not in kinds:
      raise _unknown(key)
    kind = kinds[part]
    last = i == len(parts) - 1
    if last and dataclasses.is_dataclass(kind):
      raise ConfigError(f"config key {key!r} is a section; set its fields, e.g."
                        f" {key}.{dataclasses.fields(kind)[0].name}=...")
    if not last and not dataclasses.is_dataclass(kind):
      raise ConfigError(f"config key {key!r}: {part!r} is not a section.")
    if last:
      node[part] = _parse_text(key, kind, text)
    else:
      node = node.setdefault(part, {})
      if not isinstance(node, dict):
        raise ConfigError(f"config key {'.'.join(parts[:i + 1])!r} expects a mapping.")
      cls = kind


def load(path: str | None, overrides: Sequence[str] = ()) -> TrainConfig:
  """The `TrainConfig` of YAML file `path` (None: defaults) with `key=value` overrides.

  Raises:
    ConfigError: a file that cannot be read or is not YAML, unknown keys, wrong types,
      malformed overrides or invalid values.
  """
  return from_dict(_values(path, overrides))


def set_keys(path: str | None, overrides: Sequence[str] = ()) -> frozenset[str]:
  """The dotted keys that YAML file `path` and the overrides set (`model.sliding_window`),
  whether or not a value equals its default. Raises as `load`."""
  def walk(prefix, node):
    for key, value in node.items():
      if isinstance(value, dict):
        yield from walk(f"{prefix}{key}.", value)
      else:
        yield f"{prefix}{key}"
  return frozenset(walk("", _values(path, overrides)))


def _values(path: str | None, overrides: Sequence[str]) -> dict:
  values = {}
  if path is not None:
    values = _read_yaml(path)
    if not isinstance(values, dict):
      raise ConfigError(f"{path} expects a YAML mapping of config keys, got"
                        f" {type(values).__name__}.")
  for override in overrides:
    _set(values, override)
  return values


def _read_yaml(path: str):
  """The YAML of config file `path` (None when empty).

  Raises:
    ConfigError naming the file: it cannot be read (missing, a directory, no permission,
      not UTF-8) or is not YAML (with the line and column of the error).
  """
  try:
    with open(path, encoding="utf-8") as f:
      return yaml.safe_load(f)
  except OSError as e:
    raise ConfigError(f"config file {path!r} cannot be read ({e.strerror}); pass the path of a"
                      " YAML file such as configs/demo.yaml.") from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"config file {path!r} is not UTF-8 text ({e.reason} at byte {e.start})."
                      ) from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ConfigError(f"config file {path!r} is not valid YAML: {what}{where}.") from None


def from_dict(values: dict) -> TrainConfig:
  """The `TrainConfig` of nested plain `values` (as `to_dict` gives), defaults elsewhere.

  Raises:
    ConfigError: `values` not a mapping, unknown keys, wrong types or invalid values.
  """
  return _build(TrainConfig, _legacy(values))


def _legacy(values):
  """Reads `context_parallel.load_balance` (true / false), which configs and the config.json
  of runs saved before `data.balance` carry, as data.balance "row" / "none", so that those
  runs still resume."""
  section = values.get("context_parallel") if isinstance(values, dict) else None
  if not isinstance(section, dict) or "load_balance" not in section:
    return values
  old = section["load_balance"]
  if not isinstance(old, bool):
    raise ConfigError(f"config key 'context_parallel.load_balance' expects true or false (it is"
                      f" data.balance row / none now), got {old!r}.")
  data = values.get("data")
  if not isinstance(data, dict):
    data = {}
  if "balance" in data and data["balance"] != ("row" if old else "none"):
    raise ConfigError(f"config keys 'context_parallel.load_balance' ({old}) and 'data.balance'"
                      f" ({data['balance']!r}) disagree; set data.balance only.")
  section = {k: v for k, v in section.items() if k != "load_balance"}
  return {**values, "context_parallel": section,
          "data": {**data, "balance": "row" if old else "none"}}


def to_dict(cfg) -> dict:
  """The config as nested plain values (for logging next to the run)."""
  return dataclasses.asdict(cfg)
