"""Logits against transformers itself: `models.hf.load` of checkpoints that transformers'
own `save_pretrained` writes, and transformers' `from_pretrained` of what `models.hf.save`
writes, per architecture and RoPE type.

    python -m bench.hf_parity [--json OUT]

Each cell is max |ours - transformers| / max |transformers| (float32, CPU) over two rows of
`T` tokens: one document, and three packed documents, which transformers runs one at a time
from position 0 (a packed document must give the logits it has alone). Tiny random models
(~40K parameters) whose every tensor is random (norm scales and biases included), so a
tensor read into the wrong place shows. Needs the `hf` extra (transformers, torch);
tests/test_hf_transformers.py asserts the same errors.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

T = 40
SIZES = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
             rms_norm_eps=1e-5, rope_theta=500000.0)
ROPES = {
    "default": None,
    "linear": dict(rope_type="linear", factor=2.0),
    "llama3": dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
}
# name -> (transformers config class, its fields beyond SIZES). Windows of 8 tokens on rows
# of documents up to 40 tokens long; Qwen2 windows its first layer only (`layer_types`).
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "llama head_dim=32": ("LlamaConfig", dict(head_dim=32)),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"])),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
}


def hf_model(arch: str, rope: str, seed: int = 0, **fields):
  """A transformers model of `ARCHITECTURES[arch]` with RoPE `ROPES[rope]`, float32, every
  parameter random."""
  import torch
  import transformers

  transformers.utils.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  cls_name, extra = ARCHITECTURES[arch]
  config_cls = getattr(transformers, cls_name)
  values = dict(SIZES, **extra, **fields)
  theta = values.pop("rope_theta")
  config = config_cls(**values, rope_parameters=dict(ROPES[rope] or dict(rope_type="default"),
                                                     rope_theta=theta))
  config._attn_implementation = "eager"
  model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
  torch.manual_seed(seed)
  model = model_cls(config).to(torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(hash(name) % 2**31))
      p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
  return model


def rows(vocab: int, seed: int = 0):
  """tokens, segment ids, positions `[2, T]`: one document; three packed documents."""
  tokens = np.random.default_rng(seed).integers(0, vocab, (2, T))
  lengths = (T - 17 - 9, 17, 9)
  seg = np.stack([np.ones(T), np.repeat([1, 2, 3], lengths)]).astype(np.int32)
  pos = np.stack([np.arange(T), np.concatenate([np.arange(n) for n in lengths])]).astype(np.int32)
  return tokens, seg, pos


def hf_logits(model, tokens, seg) -> np.ndarray:
  """transformers' logits `[2, T, V]`, each document of a row run alone from position 0."""
  import torch

  out = np.zeros(tokens.shape + (model.config.vocab_size,), np.float32)
  with torch.no_grad():
    for b in range(tokens.shape[0]):
      for d in np.unique(seg[b]):
        where = seg[b] == d
        ids = torch.tensor(tokens[b][where][None])
        out[b, where] = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]
                              ).logits[0].numpy()
  return out


def rel_error(got, want) -> float:
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def logits(ours, tokens, seg, pos) -> np.ndarray:
  """Our logits `[2, T, V]` (one compiled forward)."""
  from flax import nnx

  forward = nnx.jit(lambda m, t, s, p: m(t, segment_ids=s, positions=p))
  return np.asarray(forward(ours, tokens, seg, pos))


def import_error(model, path: str, backend: str = "auto", **save_kwargs) -> tuple[float, object]:
  """`(error, our model)`: `model` written by `save_pretrained(path, **save_kwargs)`, read
  by `models.hf.load` (attention on `backend`)."""
  from models import hf

  model.save_pretrained(path, **save_kwargs)
  ours = hf.load(path, attention_backend=backend)
  tokens, seg, pos = rows(ours.config.vocab_size)
  return rel_error(logits(ours, tokens, seg, pos), hf_logits(model, tokens, seg)), ours


def export_error(ours, path: str) -> float:
  """`ours` written by `models.hf.save` (float32), read by transformers' `from_pretrained`."""
  import torch
  import transformers

  from models import hf

  hf.save(ours, path, dtype="float32")
  back = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager").eval()
  tokens, seg, pos = rows(ours.config.vocab_size)
  return rel_error(logits(ours, tokens, seg, pos), hf_logits(back, tokens, seg))


def table() -> list[dict]:
  out = []
  with tempfile.TemporaryDirectory() as tmp:
    for arch in ARCHITECTURES:
      for rope in ROPES:
        where = os.path.join(tmp, f"{arch}-{rope}".replace(" ", "_").replace("=", ""))
        err_in, ours = import_error(hf_model(arch, rope), where + "-in")
        out.append(dict(architecture=arch, rope=rope, import_error=err_in,
                        export_error=export_error(ours, where + "-out")))
        print(f"| {arch:<17} | {rope:<7} | {err_in:9.2e} | {out[-1]['export_error']:9.2e} |",
              flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", help="also write the rows to this file")
  args = parser.parse_args()
  import transformers

  print(f"transformers {transformers.__version__}; max |ours - transformers| / max |transformers|,"
        f" float32, {T} tokens (one document; three packed)")
  print("| architecture      | rope    | import    | export    |")
  print("|-------------------|---------|-----------|-----------|")
  rows_ = table()
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows_, f, indent=1)


if __name__ == "__main__":
  main()
