"""Checkpoints against transformers itself (the `hf` extra): written by transformers' own
`save_pretrained` and read by `models.hf.load`, written by `models.hf.save` and read by
`from_pretrained`; logits within 1e-4 relative (float32) on a single and a packed row
(`bench/hf_parity.py` builds the models and measures; `python -m bench.hf_parity` prints
the whole architecture x RoPE table). Attention runs on the reference backend: the
checkpoint mapping is under test here, the kernels against the reference elsewhere."""

from __future__ import annotations

import json
import os
import re

import pytest

pytestmark = pytest.mark.hf
pytest.importorskip("torch", reason="needs the hf extra (pip install -e '.[hf]'): torch")
pytest.importorskip("transformers", reason="needs the hf extra (pip install -e '.[hf]')")

from bench import hf_parity  # noqa: E402
from models import hf  # noqa: E402

TOL = 1e-4


@pytest.mark.parametrize("arch, rope, fields, save", [
    ("llama", "default", {}, {}),
    ("llama", "linear", dict(tie_word_embeddings=True), {}),
    ("llama", "llama3", {}, dict(max_shard_size="20KB")),
    ("llama head_dim=32", "yarn", {}, {}),
    ("mistral", "default", {}, {}),
    ("qwen2", "yarn", {}, {}),
    ("qwen3", "llama3", dict(attention_bias=True), {}),
    ("qwen3", "default", dict(use_sliding_window=True, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"]), {}),
])
def test_transformers_checkpoints_in_and_out(tmp_path, arch, rope, fields, save):
  model = hf_parity.hf_model(arch, rope, **fields)
  error, ours = hf_parity.import_error(model, str(tmp_path / "in"), "reference", **save)
  assert error < TOL, error
  if save:
    index = json.loads((tmp_path / "in" / hf.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
  assert ours.config.tie_embeddings == fields.get("tie_word_embeddings", False)
  error = hf_parity.export_error(ours, str(tmp_path / "out"))
  assert error < TOL, error
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["architectures"] == [type(model).__name__]


def test_the_old_config_layout_reads_the_same_model(tmp_path):
  """Most published checkpoints carry top-level `rope_theta` / `rope_scaling`: the same
  checkpoint with its config rewritten so gives transformers' logits too."""
  model = hf_parity.hf_model("llama", "llama3")
  _, new = hf_parity.import_error(model, str(tmp_path), "reference")
  path = tmp_path / "config.json"
  config = json.loads(path.read_text())
  rope = config.pop("rope_parameters")
  config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
  path.write_text(json.dumps(config))
  old = hf.load(str(tmp_path), attention_backend="reference")
  assert old.config == new.config and old.config.rope_theta == 500000.0
  tokens, seg, pos = hf_parity.rows(old.config.vocab_size)
  error = hf_parity.rel_error(hf_parity.logits(old, tokens, seg, pos),
                              hf_parity.hf_logits(model, tokens, seg))
  assert error < TOL, error


@pytest.mark.parametrize("change, field", [
    (dict(num_local_experts=4), "num_local_experts"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)), "'dynamic'"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_what_the_model_cannot_represent_is_refused(tmp_path, change, field):
  hf_parity.hf_model("llama", "default").save_pretrained(str(tmp_path))
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(dict(config, **change)))
  with pytest.raises(hf.CheckpointError, match=field):
    hf.load(str(tmp_path))
  assert os.path.exists(tmp_path / "model.safetensors")


def test_a_transposed_tensor_is_refused_as_transformers_refuses_it(tmp_path):
  """gate_proj stored transposed holds as many numbers as the right one: transformers refuses
  its size, and so does `hf.load`, naming the tensor."""
  from safetensors.numpy import load_file, save_file

  model = hf_parity.hf_model("llama", "default")
  model.save_pretrained(str(tmp_path))
  file, name = str(tmp_path / hf.SINGLE), "model.layers.0.mlp.gate_proj.weight"
  tensors = load_file(file)
  tensors[name] = tensors[name].T.copy()
  save_file(tensors, file, metadata={"format": "pt"})
  with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
    type(model).from_pretrained(str(tmp_path))
  with pytest.raises(hf.CheckpointError, match=f"{name}' has shape \\[64, 96\\]"):
    hf.load(str(tmp_path))


S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("layer_types", [[S, S], [F, F], [S, F], [F, S], ["attention", S], None])
def test_mistral_layer_types_give_the_model_transformers_reads(tmp_path, layer_types):
  """transformers reads a Mistral config that carries `layer_types` as Ministral, which
  windows exactly the layers it names (null: every layer, as Mistral); `hf.load` builds
  those layers or refuses a pattern it cannot build, naming it."""
  import torch
  import transformers

  hf_parity.hf_model("mistral", "default").save_pretrained(str(tmp_path))  # sliding_window=8
  path = tmp_path / "config.json"
  path.write_text(json.dumps(dict(json.loads(path.read_text()), layer_types=layer_types)))
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
  if layer_types and layer_types[0] != S and S in layer_types:  # full attention, then a window
    with pytest.raises(hf.CheckpointError, match=re.escape(f"layer_types={layer_types}")):
      hf.load(str(tmp_path))
    return
  ours = hf.load(str(tmp_path), attention_backend="reference")
  tokens, seg, pos = hf_parity.rows(ours.config.vocab_size)
  error = hf_parity.rel_error(hf_parity.logits(ours, tokens, seg, pos),
                              hf_parity.hf_logits(theirs, tokens, seg))
  assert error < TOL, error
