"""Hugging Face Llama checkpoints: bit-identical round trips, logits against a Llama forward
written here in numpy from the HF tensors, and clear errors for bad directories."""

import json
import os
import re

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from safetensors import safe_open
from safetensors.numpy import save_file

import flaxattn
from models import hf
from models.llama import LAYERS_AXIS, Llama, LlamaConfig, layer_masks

BF16 = ml_dtypes.bfloat16
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=97, hidden_size=64,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
              max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="bfloat16",
              rope_scaling=dict(rope_type="linear", factor=2.0), bos_token_id=1)


def _random_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """HF-named tensors of a random Llama (bfloat16, as checkpoints are published)."""
  rng = np.random.default_rng(seed)
  e, v, f = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
  h, hkv = config["num_attention_heads"], config["num_key_value_heads"]
  d = e // h
  def w(*shape):
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(BF16)
  def norm():
    return (1 + 0.1 * rng.standard_normal(e)).astype(BF16)
  out = {"model.embed_tokens.weight": w(v, e), "model.norm.weight": norm()}
  if not config["tie_word_embeddings"]:
    out["lm_head.weight"] = w(v, e)
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    out.update({p + "input_layernorm.weight": norm(),
                p + "post_attention_layernorm.weight": norm(),
                p + "self_attn.q_proj.weight": w(h * d, e),
                p + "self_attn.k_proj.weight": w(hkv * d, e),
                p + "self_attn.v_proj.weight": w(hkv * d, e),
                p + "self_attn.o_proj.weight": w(e, h * d),
                p + "mlp.gate_proj.weight": w(f, e), p + "mlp.up_proj.weight": w(f, e),
                p + "mlp.down_proj.weight": w(e, f)})
  return out


def write_checkpoint(path, config=CONFIG, shards: int = 3, seed: int = 0) -> dict:
  """A random HF Llama directory: config.json, `shards` safetensors files and their index."""
  os.makedirs(path, exist_ok=True)
  tensors = _random_tensors(config, seed)
  names = sorted(tensors)
  where = {}
  for i in range(shards):
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    part = names[i::shards]
    save_file({n: tensors[n] for n in part}, os.path.join(path, file), metadata={"format": "pt"})
    where.update({n: file for n in part})
  with open(os.path.join(path, hf.INDEX), "w") as f:
    json.dump(dict(metadata=dict(total_size=0), weight_map=where), f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  return tensors


def _read_all(path) -> dict[str, np.ndarray]:
  out = {}
  for file in os.listdir(path):
    if file.endswith(".safetensors"):
      with safe_open(os.path.join(path, file), framework="np") as f:
        out.update({n: f.get_tensor(n) for n in f.keys()})
  return out


@pytest.mark.parametrize("scan_layers", [False, True])
def test_round_trip_is_bit_identical(tmp_path, scan_layers):
  tensors = write_checkpoint(tmp_path / "in")
  model = hf.load(str(tmp_path / "in"), scan_layers=scan_layers)
  hf.save(model, str(tmp_path / "out"), dtype="bfloat16", max_shard_bytes=20_000)
  back = _read_all(tmp_path / "out")
  assert sorted(back) == sorted(tensors)
  for name, w in tensors.items():
    assert back[name].dtype == w.dtype and back[name].shape == w.shape, name
    assert np.array_equal(back[name].view(np.uint16), w.view(np.uint16)), name
  assert os.path.exists(tmp_path / "out" / hf.INDEX)  # several shards
  config = json.load(open(tmp_path / "out" / "config.json"))
  assert hf.config_from_hf(config) == hf.config_from_hf(CONFIG)


def _numpy_llama(tensors, config, tokens, segment_ids, positions):
  """Logits `[T, V]` of one row, straight from the HF formulas and tensors (float64)."""
  t64 = {n: np.asarray(w, np.float64) for n, w in tensors.items()}
  e, h, hkv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
  d, eps = e // h, config["rms_norm_eps"]
  inv_freq = (1.0 / config["rope_theta"] ** (np.arange(0, d, 2) / d)
              / config["rope_scaling"]["factor"])
  angles = positions[:, None] * inv_freq[None]  # [T, D/2]
  cos, sin = np.concatenate([np.cos(angles)] * 2, -1), np.concatenate([np.sin(angles)] * 2, -1)

  def rope(x):  # [T, heads, D], rotate_half
    half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos[:, None] + half * sin[:, None]

  def rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

  visible = ((segment_ids[:, None] == segment_ids[None, :])
             & (positions[None, :] <= positions[:, None])
             & (segment_ids[:, None] > 0))
  x = t64["model.embed_tokens.weight"][tokens]
  for i in range(config["num_hidden_layers"]):
    def p(n, i=i):
      return t64[f"model.layers.{i}.{n}"]
    y = rms(x, p("input_layernorm.weight"))
    q = rope((y @ p("self_attn.q_proj.weight").T).reshape(-1, h, d))
    k = rope((y @ p("self_attn.k_proj.weight").T).reshape(-1, hkv, d))
    v = (y @ p("self_attn.v_proj.weight").T).reshape(-1, hkv, d)
    k, v = np.repeat(k, h // hkv, 1), np.repeat(v, h // hkv, 1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = np.where(visible[None], probs / probs.sum(-1, keepdims=True), 0.0)
    attn = np.nan_to_num(np.einsum("hts,shd->thd", probs, v)).reshape(-1, h * d)
    x = x + attn @ p("self_attn.o_proj.weight").T
    y = rms(x, p("post_attention_layernorm.weight"))
    gate = y @ p("mlp.gate_proj.weight").T
    x = x + ((gate / (1 + np.exp(-gate)) * (y @ p("mlp.up_proj.weight").T))
             @ p("mlp.down_proj.weight").T)
  return rms(x, t64["model.norm.weight"]) @ t64["lm_head.weight"].T


def test_logits_match_a_numpy_llama_on_single_and_packed_rows(tmp_path):
  tensors = write_checkpoint(tmp_path)
  model = hf.load(str(tmp_path))
  t = 24
  tokens = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], (2, t))
  seg = np.stack([np.ones(t, np.int32), np.repeat([1, 2, 3], [10, 9, 5]).astype(np.int32)])
  pos = np.stack([np.arange(t),
                  np.concatenate([np.arange(10), np.arange(9), np.arange(5)])]).astype(np.int32)
  got = np.asarray(model(tokens, segment_ids=seg, positions=pos))
  for row in range(2):
    want = _numpy_llama(tensors, CONFIG, tokens[row], seg[row], pos[row])
    np.testing.assert_allclose(got[row], want, atol=2e-4 * np.abs(want).max())


def test_loads_shard_by_shard_onto_a_mesh(tmp_path):
  write_checkpoint(tmp_path)
  mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(AxisType.Auto,))
  rules = tuple(flaxattn.sharding.rules(mesh, kv_heads=2)) + ((LAYERS_AXIS, None),)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    model = hf.load(str(tmp_path), scan_layers=True)
  kernel = model.layers.blocks[0].attn.query.kernel.get_value()
  assert kernel.shape == (2, 64, 4, 16) and isinstance(kernel.sharding, jax.sharding.NamedSharding)


def test_rope_scaling_and_overrides_reach_the_model(tmp_path):
  write_checkpoint(tmp_path, dict(CONFIG, rope_scaling=dict(
      rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=64)))
  cfg = hf.load(str(tmp_path), max_seq_len=512).config
  assert cfg.rope_scaling == flaxattn.RoPEScaling("llama3", 8.0, 64, 1.0, 4.0)
  assert cfg.max_seq_len == 512


def _rewrite(path, name: str, change) -> str:
  """Stores `change(tensor)` in place of tensor `name` of the checkpoint at `path`; the name
  of the file that holds it."""
  file = json.loads((path / hf.INDEX).read_text())["weight_map"][name]
  with safe_open(path / file, framework="np") as f:
    tensors = {n: f.get_tensor(n) for n in f.keys()}
  tensors[name] = np.ascontiguousarray(change(tensors[name]))
  save_file(tensors, path / file, metadata={"format": "pt"})
  return file


def _break(path, how):
  if how == "missing shard":
    os.remove(path / "model-00002-of-00003.safetensors")
  elif how == "wrong shape":
    name = "lm_head.weight"  # in model-00001-of-00003.safetensors
    _rewrite(path, name, lambda w: w[:-1])
    return name
  elif how in ("unknown architecture", "gelu"):
    change = (dict(architectures=["GPT2LMHeadModel"]) if how == "unknown architecture"
              else dict(hidden_act="gelu"))
    with open(path / "config.json", "w") as f:
      json.dump(dict(CONFIG, **change), f)


@pytest.mark.parametrize("how,words", [
    ("missing shard", "lists model-00002-of-00003.safetensors, which is missing"),
    ("wrong shape", "does not fit the config"),
    ("unknown architecture", "architectures ['GPT2LMHeadModel'] is not supported"),
    ("gelu", "hidden_act='gelu' is not supported"),
])
def test_bad_directories_name_the_file_and_the_field(tmp_path, how, words):
  write_checkpoint(tmp_path)
  name = _break(tmp_path, how)
  with pytest.raises(hf.CheckpointError, match=words.replace("[", r"\[").replace("]", r"\]")) as e:
    hf.load(str(tmp_path))
  if how == "wrong shape":
    assert name in str(e.value) and "model-00001-of-00003.safetensors" in str(e.value)
  if how in ("unknown architecture", "gelu"):
    assert "config.json" in str(e.value)


# Each keeps the element count, so only the stored shape tells it from the right tensor.
@pytest.mark.parametrize("name, change", [
    pytest.param("model.layers.0.mlp.gate_proj.weight", np.transpose, id="gate_proj transposed"),
    pytest.param("model.layers.1.self_attn.k_proj.weight", lambda w: w.reshape(64, 32),
                 id="k_proj reshaped"),
    pytest.param("lm_head.weight", np.transpose, id="lm_head transposed"),
    pytest.param("model.layers.0.self_attn.o_proj.weight", np.ravel, id="o_proj flattened"),
])
def test_a_tensor_stored_in_another_shape_is_refused(tmp_path, name, change):
  tensors = write_checkpoint(tmp_path)
  file = _rewrite(tmp_path, name, change)
  with pytest.raises(hf.CheckpointError) as e:
    hf.load(str(tmp_path))
  stored, expected = list(change(tensors[name]).shape), list(tensors[name].shape)
  for words in (os.path.join(tmp_path, file), repr(name), f"has shape {stored}",
                f"expected {expected}"):
    assert words in str(e.value)


MISTRAL = dict(architectures=["MistralForCausalLM"], model_type="mistral")


def _case(label, words, **change):
  return pytest.param(change, words, id=label)


@pytest.mark.parametrize("change, words", [
    _case("sliding_window true", "sliding_window expects an integer or null, got true",
          **MISTRAL, sliding_window=True),
    _case("hidden_size 64.5", "hidden_size expects an integer, got 64.5", hidden_size=64.5),
    # As transformers: an integer written as a float is not an integer.
    _case("hidden_size 64.0", "hidden_size expects an integer, got 64.0", hidden_size=64.0),
    _case("num_attention_heads 4.9", "num_attention_heads expects an integer, got 4.9",
          num_attention_heads=4.9),
    _case("hidden_size null", "hidden_size expects an integer, got null", hidden_size=None),
    _case("rms_norm_eps string", 'rms_norm_eps expects a number with a decimal point or an'
          ' exponent (1e-06, 1.0), got "abc"', rms_norm_eps="abc"),
    _case("rms_norm_eps integer", 'rms_norm_eps expects a number with a decimal point or an'
          ' exponent (1e-06, 1.0), got 1', rms_norm_eps=1),
    _case("bool for an int", "max_position_embeddings expects an integer, got true",
          max_position_embeddings=True),
    _case("int for a bool", "attention_bias expects true or false, got 0", attention_bias=0),
    _case("mlp_bias null", "mlp_bias expects true or false, got null", mlp_bias=None),
    _case("rope_theta string", 'rope_theta expects a number, got "500000"', rope_theta="500000"),
    _case("rope factor string", 'rope_scaling.factor expects a number, got "2"',
          rope_scaling=dict(rope_type="linear", factor="2")),
    _case("architectures string",
          'architectures expects a list of strings or null, got "LlamaForCausalLM"',
          architectures="LlamaForCausalLM"),
])
def test_config_values_of_the_wrong_type_are_refused(tmp_path, change, words):
  write_checkpoint(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(dict(CONFIG, **change)))
  with pytest.raises(hf.CheckpointError, match=re.escape(words)) as e:
    hf.load(str(tmp_path))
  assert os.path.join(tmp_path, "config.json") in str(e.value)


def test_nulls_and_integers_where_numbers_are_expected_are_read():
  """Null where transformers allows it takes the default; an integer where a number is
  expected is that number (published configs write `"rope_theta": 10000`)."""
  cfg = hf.config_from_hf(CONFIG)
  assert hf.config_from_hf(dict(CONFIG, head_dim=None)) == cfg
  assert hf.config_from_hf(dict(CONFIG, num_key_value_heads=None)).n_kv_heads == 4
  assert hf.config_from_hf(dict(CONFIG, rope_scaling=None)).rope_scaling == flaxattn.RoPEScaling()
  assert hf.config_from_hf(dict(CONFIG, **MISTRAL, sliding_window=None)).sliding_window is None
  ints = hf.config_from_hf(dict(CONFIG, rope_theta=10000,
                                rope_scaling=dict(rope_type="linear", factor=2)))
  assert ints == cfg
  assert type(ints.rope_theta) is float and type(ints.rope_scaling.factor) is float


# transformers 5 writes the RoPE options as one `rope_parameters` dict, older versions as
# top-level `rope_theta` / `rope_scaling`; both layouts must give the same model.
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)


def _layouts(theta, scaling):
  """The same RoPE options in the old layout and in transformers 5's."""
  base = {k: v for k, v in CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
  old = dict(base, rope_theta=theta, **({} if scaling is None else dict(rope_scaling=scaling)))
  new = dict(base, rope_parameters=dict(scaling or dict(rope_type="default"), rope_theta=theta))
  return old, new


@pytest.mark.parametrize("scaling", [None, dict(rope_type="linear", factor=2.0), LLAMA3,
                                     dict(rope_type="yarn", factor=4.0, beta_fast=16.0,
                                          original_max_position_embeddings=64)])
def test_both_rope_layouts_read_the_same_model(scaling):
  old, new = _layouts(500000.0, scaling)
  cfg = hf.config_from_hf(new)
  assert cfg == hf.config_from_hf(old)
  assert cfg.rope_theta == 500000.0
  assert cfg.rope_scaling.kind == (scaling or {}).get("rope_type", "default")


@pytest.mark.parametrize("layout", ["old", "new"])
def test_dynamic_and_unknown_rope_types_are_refused_in_both_layouts(layout):
  for kind in ("dynamic", "longrope"):
    config = _layouts(10000.0, dict(rope_type=kind, factor=2.0))[layout == "new"]
    with pytest.raises(hf.CheckpointError, match=f"{kind!r} is not supported"):
      hf.config_from_hf(config)


def test_config_json_that_is_not_an_object_is_refused(tmp_path):
  write_checkpoint(tmp_path)
  for text in ("[]", '"x"', "3"):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(hf.CheckpointError, match="config.json.*expects a JSON object"):
      hf.load(str(tmp_path))


TINY = dict(vocab_size=61, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48,
            max_seq_len=128)


@pytest.mark.parametrize("option, value", [
    ("attention_sinks", True), ("logit_soft_cap", 30.0), ("chunk_size", 16),
    ("sliding_window", 16),  # global every 4th layer: no Hugging Face Llama has that pattern
])
def test_save_refuses_what_the_checkpoint_cannot_hold(tmp_path, option, value):
  cfg = LlamaConfig(**dict(TINY, n_layers=4, **{option: value}))
  with pytest.raises(hf.ExportError, match=option) as e:
    hf.save(Llama(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "out"))
  assert repr(value) in str(e.value)
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch, fields", [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", dict(head_dim=32, qkv_bias=True, out_bias=True,
                              rope_scaling=flaxattn.RoPEScaling("yarn", 4.0, 32))),
    ("MistralForCausalLM", dict(sliding_window=8, global_every=0)),
    ("Qwen2ForCausalLM", dict(qkv_bias=True, sliding_window=8, global_every=2, n_layers=4)),
    ("Qwen3ForCausalLM", dict(qk_norm=True, head_dim=8, rope_theta=1e6,
                              rope_scaling=flaxattn.RoPEScaling("linear", 2.0))),
])
def test_each_model_is_written_as_the_architecture_that_reads_it_back(arch, fields):
  cfg = LlamaConfig(**dict(TINY, **fields))
  written = hf.config_to_hf(cfg, "float32")
  assert written["architectures"] == [arch]
  assert hf.config_from_hf(json.loads(json.dumps(written))) == cfg


def test_layouts_that_disagree_are_refused():
  old, new = _layouts(500000.0, LLAMA3)
  with pytest.raises(hf.CheckpointError, match="disagree with rope_parameters"):
    hf.config_from_hf(dict(new, rope_theta=10000.0))
  with pytest.raises(hf.CheckpointError, match="disagree with rope_parameters"):
    hf.config_from_hf(dict(new, rope_scaling=dict(rope_type="linear", factor=2.0)))
  assert hf.config_from_hf(dict(new, rope_theta=500000.0, rope_scaling=LLAMA3)) == \
      hf.config_from_hf(old)


def test_a_tensor_without_a_place_in_the_model_is_refused(tmp_path):
  """A q/k norm tensor in a checkpoint whose config says Llama: dropping it would compute
  another model. A tied head written out as a copy of the embedding is fine."""
  tied = dict(CONFIG, tie_word_embeddings=True)
  tensors = write_checkpoint(tmp_path, tied, shards=1)
  os.remove(tmp_path / "model-00001-of-00001.safetensors")
  os.remove(tmp_path / hf.INDEX)
  file = tmp_path / hf.SINGLE
  extra = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"]})
  save_file(extra, file)
  assert hf.load(str(tmp_path)).config.tie_embeddings
  save_file(dict(extra, **{"model.layers.0.self_attn.q_norm.weight": np.ones(16, BF16)}), file)
  with pytest.raises(hf.CheckpointError, match="q_norm.weight.*no place in the model"):
    hf.load(str(tmp_path))


# ---------------------------------------------------------------------------------------
# layer_types: which layers attend in a window (transformers 5: Qwen2/Qwen3 natively; a
# Mistral config that carries it is read by AutoConfig as Ministral, which honours it)

S, F = "sliding_attention", "full_attention"
QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16)
WINDOWED = dict(use_sliding_window=True, sliding_window=8)


@pytest.mark.parametrize("arch", [
    pytest.param({}, id="llama"), pytest.param(MISTRAL, id="mistral"),
    pytest.param(dict(QWEN2, **WINDOWED), id="qwen2"),
    pytest.param(QWEN3, id="qwen3 windows off")])
@pytest.mark.parametrize("layer_types", [True, 0, "2", {"a": 1}, [2], [S, "bogus"], [F],
                                         [F, F, F]], ids=json.dumps)
def test_layer_types_that_transformers_refuses_are_refused(arch, layer_types):
  with pytest.raises(hf.CheckpointError, match="layer_types") as e:
    hf.config_from_hf(dict(CONFIG, **arch, layer_types=layer_types))
  assert any(show(layer_types)[:20] in str(e.value) for show in (json.dumps, repr))


@pytest.mark.parametrize("fields, windowed", [
    (dict(MISTRAL, sliding_window=8), [True, True]),
    (dict(MISTRAL, sliding_window=8, layer_types=None), [True, True]),
    (dict(MISTRAL, sliding_window=8, layer_types=[S, S]), [True, True]),
    (dict(MISTRAL, sliding_window=8, layer_types=[F, F]), [False, False]),
    (dict(MISTRAL, sliding_window=8, layer_types=[S, F]), [True, False]),
    (dict(MISTRAL, sliding_window=8, layer_types=["attention", F]), [False, False]),  # legacy name
    (dict(MISTRAL, sliding_window=None, layer_types=[F, F]), [False, False]),
    (dict(QWEN2, **WINDOWED, max_window_layers=0), [True, True]),
    (dict(QWEN2, **WINDOWED), [False, False]),  # the first max_window_layers=28 attend fully
    (dict(QWEN2, **WINDOWED, layer_types=[S, F]), [True, False]),
    (dict(QWEN3, layer_types=[F, F]), [False, False]),
    (dict(QWEN3, **WINDOWED, layer_types=[S, S]), [True, True]),
    (dict(layer_types=[F, F], sliding_window=8), [False, False]),  # Llama has no window
])
def test_layer_types_give_each_layer_its_window(fields, windowed):
  cfg = hf.config_from_hf(dict(CONFIG, **fields))
  assert [m != flaxattn.Causal() for m in layer_masks(cfg)] == windowed
  assert all(m in (flaxattn.Causal(), flaxattn.Local(8)) for m in layer_masks(cfg))


@pytest.mark.parametrize("fields, words", [
    # Full attention first, then a window: no global_every gives it.
    (dict(MISTRAL, sliding_window=8, layer_types=[F, S]),
     "layer_types=['full_attention', 'sliding_attention']"),
    (dict(QWEN2, **WINDOWED, max_window_layers=1), "max_window_layers=1"),
    # Windowed layers without a window: transformers fails on them.
    (dict(MISTRAL, sliding_window=None, layer_types=[S, S]), "sliding_window is null"),
    (dict(QWEN3, layer_types=[F, S]), "use_sliding_window is false"),
    (dict(QWEN2, use_sliding_window=True, sliding_window=None, layer_types=[S, F]),
     "sliding_window is null"),
    (dict(layer_types=[S, S], sliding_window=8), "LlamaForCausalLM has no windowed layers"),
])
def test_layer_patterns_this_model_does_not_run_are_refused(fields, words):
  with pytest.raises(hf.CheckpointError, match=re.escape(words)) as e:
    hf.config_from_hf(dict(CONFIG, **fields))
  assert "layer_types" in str(e.value) or "max_window_layers" in str(e.value)


@pytest.mark.parametrize("cfg", [
    LlamaConfig(**TINY),
    LlamaConfig(**dict(TINY, sliding_window=8, global_every=0)),
    LlamaConfig(**dict(TINY, n_layers=4, qkv_bias=True, sliding_window=8, global_every=2)),
    LlamaConfig(**dict(TINY, n_layers=4, qk_norm=True, sliding_window=8, global_every=4)),
    LlamaConfig(**dict(TINY, qk_norm=True, sliding_window=8, global_every=1)),  # none windowed
], ids=["llama", "mistral", "qwen2 alternating", "qwen3 3:1", "qwen3 no window"])
def test_the_written_layer_types_are_the_models_windows(cfg):
  """What `save` writes for the window and for `layer_types` agree, and read back as the
  same layers: Qwen's own `layer_types`; none for Mistral, whose `sliding_window` alone
  windows every layer (a `layer_types` would make transformers read it as Ministral)."""
  written = hf.config_to_hf(cfg, "float32")
  windowed = [m != flaxattn.Causal() for m in layer_masks(cfg)]
  if written["architectures"][0].startswith("Qwen"):
    assert written["layer_types"] == [S if w else F for w in windowed]
    assert written["use_sliding_window"] == any(windowed)
    assert (written["sliding_window"] is None) == (not any(windowed))
  else:
    assert "layer_types" not in written
  back = hf.config_from_hf(json.loads(json.dumps(written)))
  assert layer_masks(back) == layer_masks(cfg)


# ---------------------------------------------------------------------------------------
# Tensors are checked against the config from the safetensors headers, before the model
# (whose size the config sets) is built


def _no_model(monkeypatch):
  def built(*args, **kwargs):
    raise AssertionError("hf.load built the model before checking the tensors")
  monkeypatch.setattr(hf, "Llama", built)


@pytest.mark.parametrize("layers", [200, 10**9])
def test_a_config_with_more_layers_than_tensors_is_refused_at_once(tmp_path, monkeypatch, layers):
  write_checkpoint(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(dict(CONFIG, num_hidden_layers=layers)))
  _no_model(monkeypatch)
  with pytest.raises(hf.CheckpointError, match=r"'model\.layers\.2\.[a-z_.]+'.* missing") as e:
    hf.load(str(tmp_path))
  assert f"{layers * 9 + 3} tensors" in str(e.value)  # as many as the config asks for
  assert "config.json" in str(e.value)


@pytest.mark.parametrize("how, words", [
    ("wrong shape", "has shape [96, 64], which does not fit the config"),
    ("extra tensor", "no place in the model"),
    ("missing tensor", "'model.norm.weight' is missing"),
])
def test_tensors_are_checked_before_the_model_is_built(tmp_path, monkeypatch, how, words):
  tensors = write_checkpoint(tmp_path, shards=1)
  if how == "wrong shape":
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1]
  elif how == "extra tensor":
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, BF16)
  else:
    del tensors["model.norm.weight"]
  _single(tmp_path, tensors)
  _no_model(monkeypatch)
  with pytest.raises(hf.CheckpointError, match=re.escape(words)):
    hf.load(str(tmp_path))


def _single(path, tensors):
  """The checkpoint at `path` as one model.safetensors holding `tensors`, no index."""
  for file in os.listdir(path):
    if file.endswith(".safetensors") or file == hf.INDEX:
      os.remove(path / file)
  save_file(tensors, path / hf.SINGLE, metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------
# RoPE and numbers as transformers 5's config classes read them


@pytest.mark.parametrize("layout", ["old", "new"])
@pytest.mark.parametrize("drop", ["low_freq_factor", "high_freq_factor"])
def test_llama3_rope_without_its_frequency_factors_is_refused(layout, drop):
  scaling = {k: v for k, v in LLAMA3.items() if k != drop}
  with pytest.raises(hf.CheckpointError, match=f"{drop}' is missing"):
    hf.config_from_hf(_layouts(500000.0, scaling)[layout == "new"])


def test_llama3_rope_takes_max_position_embeddings_as_its_original_length():
  """As transformers, which sets `original_max_position_embeddings` from it when absent."""
  scaling = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
  for config in _layouts(500000.0, scaling):
    assert hf.config_from_hf(config).rope_scaling.original_max_position == 256


def test_an_integer_rms_norm_eps_is_refused_as_transformers_refuses_it():
  """transformers 5 declares `rms_norm_eps: float` and refuses 1; its RoPE numbers take
  integers (`"rope_theta": 10000`, a llama3 `"factor": 8`)."""
  with pytest.raises(hf.CheckpointError, match="rms_norm_eps expects a number with a"):
    hf.config_from_hf(dict(CONFIG, rms_norm_eps=1))
  ints = dict(LLAMA3, factor=8, low_freq_factor=1, high_freq_factor=4)
  assert hf.config_from_hf(_layouts(500000, ints)[1]) == hf.config_from_hf(_layouts(5e5, LLAMA3)[1])


# ---------------------------------------------------------------------------------------
# Unreadable files: a CheckpointError naming the file


def _corrupt(path, how) -> str:
  """Breaks the checkpoint at `path` (three shards and an index) as `how` says; the file the
  error must name."""
  index = path / hf.INDEX
  where = json.loads(index.read_text())["weight_map"]
  if how in ("garbage", "truncated"):
    _single(path, _read_all(path))
    file = path / hf.SINGLE
    if how == "garbage":
      file.write_bytes(b"\0" * 100)
    else:
      os.truncate(file, file.stat().st_size // 2)
    return hf.SINGLE
  if how == "config.json a directory":
    os.remove(path / "config.json")
    os.mkdir(path / "config.json")
    return "config.json"
  if how == "tensor not in its file":  # model.norm.weight is in shard 3
    where["model.norm.weight"] = "model-00001-of-00003.safetensors"
  if how == "weight_map entry outside the directory":  # another checkpoint's shard
    where["model.norm.weight"] = "../other/model-00003-of-00003.safetensors"
  index.write_text(json.dumps({
      "index a list": [1],
      "weight_map a list": dict(weight_map=list(where)),
      "weight_map null": dict(weight_map=None),
      "weight_map entry an integer": dict(weight_map=dict(where, **{"model.norm.weight": 3})),
      "tensor not in its file": dict(weight_map=where),
      "weight_map entry outside the directory": dict(weight_map=where)}[how]))
  return hf.INDEX


@pytest.mark.parametrize("how", ["garbage", "truncated", "index a list", "weight_map a list",
                                 "weight_map null", "weight_map entry an integer",
                                 "tensor not in its file", "config.json a directory",
                                 "weight_map entry outside the directory"])
def test_unreadable_files_are_refused_naming_the_file(tmp_path, how):
  write_checkpoint(tmp_path)
  file = _corrupt(tmp_path, how)
  with pytest.raises(hf.CheckpointError) as e:
    hf.load(str(tmp_path))
  assert os.path.join(tmp_path, file) in str(e.value)
