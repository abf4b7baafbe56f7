"""Hugging Face tokenizers (`tokenizer.json`, the `tokenizers` package) in the trainer: the
special tokens transformers adds to one document, packed rows that keep documents apart,
config errors naming `data.tokenizer`, and the whole path: a tiny transformers Llama with
its own BPE tokenizer, trained with `init_from`, resumed and exported, read back by
transformers (the same ids, logits within 1e-5)."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="needs the tokenizers extra (pip install tokenizers)")

from tokenizers import processors  # noqa: E402

from train import config, data, demo_tokenizer, export, init_from  # noqa: E402
from train import run_dir as run_dir_lib  # noqa: E402
from train.data import tokenizers  # noqa: E402
from trainer import MAIN_REPORTING_BACKEND, TINY, refused, run, train  # noqa: E402

TEXTS = ["def main():\n    return 1  # é\n", "import os\n\nprint(os.sep)", "x", "",
         "  leading spaces\n", "日本語のテキスト"]
VOCAB = 400
BOS, EOS = demo_tokenizer.SPECIAL.index("<s>"), demo_tokenizer.SPECIAL.index("</s>")


@pytest.fixture(scope="module")
def bpe():
  """A byte-level BPE tokenizer trained on 200 KB of the standard library's `.py` files."""
  return demo_tokenizer.train_bpe(demo_tokenizer.corpus(200_000), VOCAB)


def _save(tok, path: pathlib.Path, kind: str) -> pathlib.Path:
  """`tok` written to `path` with the post-processor of `kind`: BOS and EOS, BOS only
  (Llama 3's), a template that adds nothing, or byte-level (Qwen's, adds nothing)."""
  if kind == "qwen":
    demo_tokenizer.save_bpe(tok, str(path), False, False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(path / "tokenizer.json"))
  else:
    demo_tokenizer.save_bpe(tok, str(path), kind in ("bos eos", "bos"), kind == "bos eos")
  return path


@pytest.mark.hf
@pytest.mark.parametrize("kind, begin, end", [
    ("bos eos", (BOS,), (EOS,)), ("bos", (BOS,), ()), ("none", (), ()), ("qwen", (), ())])
def test_documents_get_the_special_tokens_transformers_adds(tmp_path, bpe, kind, begin, end):
  transformers = pytest.importorskip("transformers", reason="needs the hf extra")
  path = _save(bpe, tmp_path, kind)
  ours, theirs = tokenizers.make(str(path)), transformers.AutoTokenizer.from_pretrained(path)
  assert (ours.begin, ours.end, ours.bos_id, ours.eos_id) == (begin, end, BOS, EOS)
  assert tokenizers.make(str(path / "tokenizer.json")).begin == begin  # the file itself
  for text in TEXTS:
    assert ours.document(text).tolist() == theirs(text)["input_ids"], text
    assert ours.document(text, end=False).tolist() == list(begin) + ours.encode(text).tolist()
    assert ours.decode(ours.document(text)) == theirs.decode(theirs(text)["input_ids"],
                                                             skip_special_tokens=True)


def test_packed_documents_start_with_bos_once_and_hold_no_other_document(tmp_path, bpe):
  """Each segment of a packed row is one piece of one document, its tokens exactly those
  of the document encoded alone: BOS only at the start of a document's first piece, EOS
  only at the end of its last, no token of another document."""
  tok = tokenizers.make(str(_save(bpe, tmp_path / "tok", "bos eos")))
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  # Documents of 20 to 800 characters, from the starts of different files.
  texts = [t[:20 + 97 * i % 780] for i, t in enumerate(demo_tokenizer.corpus(200_000))
           if "<s>" not in t and "</s>" not in t]
  seq_len = 64
  pieces = {}  # a piece's tokens -> (document, piece index, pieces in the document)
  for i, text in enumerate(texts[:40]):
    (corpus / f"{i:03d}.txt").write_text(text)
    ids = tok.document(text).tolist()
    n = -(-len(ids) // seq_len)
    for k in range(n):
      pieces.setdefault(tuple(ids[k * seq_len:(k + 1) * seq_len]), (i, k, n))
  docs = data.list_documents(str(corpus))
  cfg = config.DataConfig(source=str(corpus), read_threads=0, packing_bins=4)
  batches = iter(data.pipeline(docs, tok, cfg, seq_len=seq_len, batch=2, seed=0, shard_index=0,
                               shard_count=1, shuffle=True))
  seen, split = set(), 0
  for _ in range(40):
    batch = next(batches)
    for tokens, seg, pos in zip(batch["tokens"], batch["segment_ids"], batch["positions"],
                                strict=True):
      for s in set(seg.tolist()) - {0}:
        piece = tokens[seg == s].tolist()
        assert pos[seg == s].tolist() == list(range(len(piece)))
        assert tuple(piece) in pieces, "a segment that is no piece of one document"
        doc, k, n = pieces[tuple(piece)]
        assert piece.count(BOS) == (k == 0) and (k > 0 or piece[0] == BOS), (doc, k, piece)
        assert piece.count(EOS) == (k == n - 1) and (k < n - 1 or piece[-1] == EOS), (doc, k)
        seen.add(doc)
        split += n > 1
  assert len(seen) > 10 and split > 0  # many documents, some of them split over rows


def _model_dir(path: pathlib.Path, bpe, **fields) -> pathlib.Path:
  """A tiny transformers Llama (TINY's sizes) of `bpe`'s vocabulary, saved with `bpe` (BOS
  and EOS added) and its tokenizer_config.json. Skips the test without the hf extra."""
  torch = pytest.importorskip("torch", reason="needs the hf extra")
  transformers = pytest.importorskip("transformers", reason="needs the hf extra")

  hf_config = transformers.LlamaConfig(**dict(dict(
      vocab_size=bpe.get_vocab_size(), hidden_size=32, intermediate_size=64,
      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
      max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=BOS,
      eos_token_id=EOS), **fields))
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(hf_config).save_pretrained(path)
  return _save(bpe, path, "bos eos")


@pytest.mark.slow
@pytest.mark.hf
def test_init_from_a_transformers_llama_to_an_export_transformers_reads(tmp_path, bpe):
  """Train with `init_from` and the checkpoint's directory as the tokenizer; resume, sample
  and export (twice: --force) after the tokenizer's own files went bad (they read the
  run's copy); then transformers reads the export: the tokenizer gives our ids, the model
  our logits."""
  torch = pytest.importorskip("torch", reason="needs the hf extra")
  transformers = pytest.importorskip("transformers", reason="needs the hf extra")
  from bench import hf_parity

  source, run_dir, out = _model_dir(tmp_path / "llama", bpe), tmp_path / "run", tmp_path / "hf"
  args = [f"init_from={source}", f"data.tokenizer={source}",
          f"model.vocab_size={bpe.get_vocab_size()}", "steps=4", "eval_every=2"]
  train(run_dir, *args, log=tmp_path / "train.txt")
  copy = run_dir / "tokenizer"
  assert (copy / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
  (source / "tokenizer.json").write_text("{broken")
  resumed = train(run_dir, *args[:-2], "steps=6", "eval_every=2", log=tmp_path / "resume.txt")
  assert "resumed from step 4" in resumed
  sample = run([sys.executable, "-m", "train.sample", str(run_dir), "--prompt", "def ",
                "--max_new_tokens", "4"])
  assert sample.returncode == 0 and sample.stdout.startswith("def "), sample.stderr[-2000:]
  for force in (False, True):
    assert export.export(str(run_dir), str(out), dtype="float32", force=force) == 6
  assert sorted(p.name for p in out.iterdir()) == [
      "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]

  theirs = transformers.AutoTokenizer.from_pretrained(out)
  ours = tokenizers.make(str(copy))
  texts = [*TEXTS, *demo_tokenizer.corpus(20_000)[:3]]
  for text in texts:
    assert ours.document(text).tolist() == theirs(text)["input_ids"], text[:40]
  model = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32, attn_implementation="eager").eval()
  _, ours_model = export.restore_model(str(run_dir))
  ids = ours.document(texts[-1])[:200]
  tokens, seg = ids[None], np.ones((1, ids.size), np.int32)
  pos = np.arange(ids.size, dtype=np.int32)[None]
  error = hf_parity.rel_error(hf_parity.logits(ours_model, tokens, seg, pos),
                              hf_parity.hf_logits(model, tokens, seg))
  assert error < 1e-5, error
  written = json.loads((out / "config.json").read_text())
  assert (written["bos_token_id"], written["eos_token_id"]) == (BOS, EOS)


@pytest.fixture(scope="module")
def bad_tokenizers(tmp_path_factory, bpe):
  """name -> a data.tokenizer path that does not read, or fits no checkpoint."""
  root = tmp_path_factory.mktemp("bad")
  good = _save(bpe, root / "good", "bos eos")
  paths = {"missing": root / "nowhere" / "tokenizer.json", "empty dir": root / "empty",
           "good": good, "bytes": "bytes"}
  paths["empty dir"].mkdir()
  for name, files in {
      "corrupt": {"tokenizer.json": "{not json"},
      "config not json": {"tokenizer_config.json": "[1, 2"},
      "bos not in vocabulary": {"tokenizer_config.json": json.dumps({"bos_token": "<bos>"})},
  }.items():
    _save(bpe, root / name, "bos eos")
    for file, text in files.items():
      (root / name / file).write_text(text)
    paths[name] = root / name
  return paths


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, bpe):
  """name -> an init_from checkpoint written by transformers (skips without the hf extra)."""
  root = tmp_path_factory.mktemp("checkpoints")
  return {"llama bos 5": _model_dir(root / "llama", bpe, bos_token_id=5),
          "llama of 300 ids": _model_dir(root / "llama300", bpe, vocab_size=300)}


@pytest.mark.parametrize("tok, init_from, names", [
    ("missing", None, ["'data.tokenizer'", "tokenizer.json", "which is not a file"]),
    ("empty dir", None, ["'data.tokenizer'", "neither tokenizer.json nor tokenizer.model"]),
    ("corrupt", None, ["'data.tokenizer'", "tokenizer.json", "tokenizers package cannot read"]),
    ("config not json", None, ["'data.tokenizer'", "tokenizer_config.json", "is not JSON"]),
    ("bos not in vocabulary", None, ["'data.tokenizer'", "bos_token '<bos>'", "vocabulary"]),
    pytest.param("good", "llama bos 5", ["'data.tokenizer'", "BOS id 1", "bos_token_id 5",
                                         "init_from"], marks=pytest.mark.hf),
    pytest.param("bytes", "llama bos 5", ["'data.tokenizer' ('bytes')", "no BOS or EOS token",
                                          "bos_token_id 5, eos_token_id 2", "init_from"],
                 marks=pytest.mark.hf),
    pytest.param("good", "llama of 300 ids", ["'data.tokenizer'", f"has {VOCAB} ids",
                                              "vocab_size 300", "init_from"],
                 marks=pytest.mark.hf),
])
def test_a_tokenizer_that_does_not_read_or_fit_is_a_config_error(request, tmp_path, bpe,
                                                                  bad_tokenizers, tok,
                                                                  init_from, names):
  """One line naming data.tokenizer (and init_from where the checkpoint disagrees), before
  anything is written or a jax backend starts."""
  run_dir = tmp_path / "run"
  more = [] if init_from is None else [
      f"init_from={request.getfixturevalue('checkpoints')[init_from]}"]
  vocab = 300 if init_from == "llama of 300 ids" else bpe.get_vocab_size()
  proc = refused([sys.executable, "-c", MAIN_REPORTING_BACKEND, "configs/demo.yaml",
                  f"run_dir={run_dir}", *TINY, f"data.tokenizer={bad_tokenizers[tok]}", *more,
                  f"model.vocab_size={vocab}"], "config error: ", *names, run_dir=run_dir)
  assert "BACKEND_STARTED False" in proc.stdout


@pytest.mark.hf
def test_a_tokenizer_without_bos_fits_a_checkpoint_that_names_one(tmp_path, bpe):
  """Qwen's config.json has a bos_token_id, its tokenizer no BOS token: accepted. An EOS
  that is not the checkpoint's is refused."""
  source = _model_dir(tmp_path / "qwen", bpe)
  _save(bpe, source, "qwen")
  cfg = config.load("configs/demo.yaml", [f"init_from={source}", f"run_dir={tmp_path / 'run'}",
                                          f"data.tokenizer={source}"])
  for eos, error in (("</s>", None), ("<unk>", "EOS id 0, but the checkpoint")):
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": eos}))
    tok = tokenizers.make(str(source))
    assert tok.bos_id is None and tok.begin == tok.end == ()
    if error is None:
      init_from.check_tokenizer(cfg, tok)
    else:
      with pytest.raises(config.ConfigError, match=error):
        init_from.check_tokenizer(cfg, tok)


def test_init_from_a_run_dir_takes_that_runs_tokenizer(tmp_path, bpe):
  """From a run_dir: its tokenizer (its copy, else its data.tokenizer) is accepted, another
  one is refused naming what differs. Reads the run's config.json and tokenizer only."""
  source = _save(bpe, tmp_path / "tok", "bos eos")
  run_dir = tmp_path / "run"
  earlier = config.load("configs/demo.yaml", [f"run_dir={run_dir}", "data.tokenizer=bytes"])
  run_dir_lib.create(earlier.run_dir)
  run_dir_lib.save_config(earlier)
  (run_dir / "checkpoints" / "4").mkdir(parents=True)
  cfg = config.load("configs/demo.yaml", [f"init_from={run_dir}", f"run_dir={tmp_path / 'new'}"])
  init_from.check_tokenizer(cfg, tokenizers.make("bytes"))
  with pytest.raises(config.ConfigError, match=r"vocabulary 40\d \(the run's 256\), bos_id 1"):
    init_from.check_tokenizer(cfg, tokenizers.make(str(source)))
  run_dir_lib.save_tokenizer(str(run_dir), tokenizers.make(str(source)))  # the run's copy
  init_from.check_tokenizer(cfg, tokenizers.make(str(source)))


@pytest.mark.hf
def test_a_sentencepiece_export_reads_back_in_transformers(tmp_path):
  """A SentencePiece model (Llama 2's normalization: none, whitespace kept) exported as
  tokenizer.model with the tokenizer_config.json of Llama 2: transformers' LlamaTokenizer
  gives the ids the run trained on, for texts that do not start with whitespace (there
  transformers' conversion of the model differs from sentencepiece itself)."""
  spm = pytest.importorskip("sentencepiece", reason="needs the sentencepiece extra")
  transformers = pytest.importorskip("transformers", reason="needs the hf extra")
  texts = demo_tokenizer.corpus(100_000)
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter("\n".join(texts).splitlines()), model_prefix=str(tmp_path / "sp"),
      vocab_size=500, model_type="bpe", byte_fallback=True, minloglevel=2,
      normalization_rule_name="identity", remove_extra_whitespaces=False)
  ours = tokenizers.make(str(tmp_path / "sp.model"))
  out = tmp_path / "out"
  out.mkdir()
  (out / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 500}))
  export.write_tokenizer(ours, out)
  assert (out / "tokenizer.model").read_bytes() == (tmp_path / "sp.model").read_bytes()
  theirs = transformers.AutoTokenizer.from_pretrained(out)
  for text in [t for t in TEXTS if t and not t[0].isspace()] + [texts[1][:2000]]:
    assert ours.document(text).tolist() == theirs(text)["input_ids"], text[:40]
