"""`python -m train.demo_tokenizer OUT_DIR [--vocab_size 512] [--max_bytes 4000000]`: a
Hugging Face model directory for the extension demo with its own tokenizer, made here (no
download): a byte-level BPE `tokenizer.json` trained with the `tokenizers` package on the
demo corpus (the Python standard library's `.py` files) whose post-processor adds BOS
`<s>` and EOS `</s>` to each document, its `tokenizer_config.json`, and a random tiny Llama
(`models.hf.SIZES["tiny"]`) with a vocabulary of the tokenizer's size, whose config.json
names the same BOS and EOS ids. `configs/extend_demo_bpe.yaml` starts from it
(`init_from`) and tokenizes with it (`data.tokenizer`).

Training reads the corpus's documents in their sorted order up to `max_bytes` of text.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Iterable

SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: transformers' LlamaConfig defaults for BOS/EOS


def train_bpe(texts: Iterable[str], vocab_size: int):
  """A byte-level BPE `tokenizers.Tokenizer` of at most `vocab_size` ids (`SPECIAL` first)
  trained on `texts`; without a post-processor (tokenizer_config.json says what is added)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def save_bpe(tok, out_dir: str, add_bos: bool = True, add_eos: bool = True) -> None:
  """Writes `tok` (from `train_bpe`) into `out_dir` as `tokenizer.json`, whose post-processor
  adds BOS `<s>` (with `add_bos`) and EOS `</s>` (with `add_eos`) to each text, and the
  `tokenizer_config.json` transformers reads (`PreTrainedTokenizerFast`, the special
  tokens' names)."""
  from tokenizers import processors

  marks = [t for t, on in ((SPECIAL[1], add_bos), (SPECIAL[2], add_eos)) if on]
  single = " ".join(([SPECIAL[1]] if add_bos else []) + ["$A"] + ([SPECIAL[2]] if add_eos else []))
  tok.post_processor = processors.TemplateProcessing(
      single=single, pair=f"{single} {single.replace('$A', '$B:1')}",
      special_tokens=[(t, SPECIAL.index(t)) for t in marks])
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  tok.save(str(out / "tokenizer.json"))
  (out / "tokenizer_config.json").write_text(json.dumps(dict(
      tokenizer_class="PreTrainedTokenizerFast", bos_token=SPECIAL[1], eos_token=SPECIAL[2],
      unk_token=SPECIAL[0]), indent=2))


def corpus(max_bytes: int) -> list[str]:
  """The texts of the demo corpus's documents in sorted order, up to `max_bytes` bytes."""
  from train import data

  texts, size = [], 0
  for doc in data.list_documents("stdlib"):
    if size >= max_bytes:
      break
    texts.append(doc.read())
    size += len(texts[-1].encode())
  return texts


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m train.demo_tokenizer", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("out_dir")
  parser.add_argument("--vocab_size", type=int, default=512)
  parser.add_argument("--max_bytes", type=int, default=4_000_000)
  parser.add_argument("--seed", type=int, default=0, help="of the random model's weights")
  args = parser.parse_args(argv)
  from train import storage
  if storage.is_url(args.out_dir):
    parser.error(f"out_dir expects a local directory, got the URL {args.out_dir!r}; write it"
                 " locally, then copy it (gcloud storage cp -r DIR gs://...)")
  if args.vocab_size < 256 + len(SPECIAL):
    parser.error(f"--vocab_size expects at least {256 + len(SPECIAL)} (the 256 bytes and"
                 f" {len(SPECIAL)} special tokens), got {args.vocab_size}")
  import dataclasses

  from flax import nnx

  from models import hf
  from models.llama import Llama

  tok = train_bpe(corpus(args.max_bytes), args.vocab_size)
  save_bpe(tok, args.out_dir)
  cfg = dataclasses.replace(hf.SIZES["tiny"], vocab_size=tok.get_vocab_size())
  hf.save(Llama(cfg, rngs=nnx.Rngs(args.seed)), args.out_dir, dtype="float32")
  config_file = pathlib.Path(args.out_dir) / "config.json"
  config = json.loads(config_file.read_text())
  config.update(bos_token_id=SPECIAL.index("<s>"), eos_token_id=SPECIAL.index("</s>"))
  config_file.write_text(json.dumps(config, indent=2))
  print(f"wrote a {tok.get_vocab_size()}-token BPE tokenizer and a random tiny Llama of that"
        f" vocabulary to {args.out_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
