"""HF checkpoint directories: round trip, sharded placement, transformers opens what we save, bad input."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxrl import sharding
from jaxrl.models import Decoder, ModelConfig, hf

ARCHS = {
    "llama": dict(),
    "qwen2": dict(attention_bias=True, tie_embeddings=True, architecture="qwen2"),
    "qwen3": dict(qk_norm=True, head_dim=16, architecture="qwen3"),
    "qwen3_moe": dict(ModelConfig.tiny_moe().__dict__),
}


def _saved(tmp_path, **kw):
  cfg = ModelConfig.tiny(**kw)
  _, params = nnx.split(Decoder(cfg, nnx.Rngs(0)))
  return cfg, params, hf.save_params(tmp_path / "model", cfg, params)


def _equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=False))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_round_trip_and_transformers_opens_the_folder(tmp_path, arch):
  cfg, params, path = _saved(tmp_path, **ARCHS[arch])
  cfg2, _, params2 = hf.load_params(path)
  assert cfg2 == cfg and _equal(params, params2)
  again = hf.save_params(tmp_path / "again", cfg2, params2)
  _, _, params3 = hf.load_params(again)
  assert _equal(params, params3)
  auto = transformers.AutoConfig.from_pretrained(str(path))
  assert auto.model_type == arch and auto.num_hidden_layers == cfg.num_layers
  names = set(load_file(str(path / "model.safetensors")))
  assert "model.layers.1.self_attn.q_proj.weight" in names
  assert ("lm_head.weight" in names) == (not cfg.tie_embeddings)


def test_mixed_moe_checkpoint_saves_back_the_same_tensors(tmp_path):
  """The Hub's Qwen3-MoE layout (a router and per-expert projections on sparse layers, a dense MLP on the others)
  loads into the stacked layout and saves back tensor for tensor."""
  fixture = Path(__file__).parent / "fixtures" / "qwen3_moe"
  cfg, _, params = hf.load_params(fixture)
  assert cfg.sparse_layers == (True, False, True) and cfg.num_experts == 8
  original, saved = load_file(str(fixture / "model.safetensors")), load_file(str(hf.save_params(
      tmp_path / "again", cfg, params) / "model.safetensors"))
  assert sorted(saved) == sorted(original)
  assert "model.layers.2.mlp.experts.7.down_proj.weight" in saved and "model.layers.1.mlp.up_proj.weight" in saved
  assert all(np.array_equal(saved[name], original[name]) for name in original)


def test_tokenizer_files_are_copied_and_open(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers

  tok_dir = tmp_path / "tok"
  tok_dir.mkdir()
  vocab = {w: i for i, w in enumerate(["<unk>", "hello", "world", "</s>"])}
  t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  t.pre_tokenizer = pre_tokenizers.Whitespace()
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")
  fast.save_pretrained(str(tok_dir))
  cfg = ModelConfig.tiny()
  _, params = nnx.split(Decoder(cfg, nnx.Rngs(0)))
  path = hf.save_params(tmp_path / "model", cfg, params, tokenizer_dir=tok_dir)
  tok = transformers.AutoTokenizer.from_pretrained(str(path))
  assert tok("hello world")["input_ids"] == [1, 2]


def test_load_places_each_shard_directly(tmp_path):
  cfg, params, path = _saved(tmp_path)
  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  shardings = sharding.param_shardings(params, mesh, sharding.LEARNER_RULES)
  _, _, loaded = hf.load_params(path, shardings=shardings)
  q = loaded["blocks"]["attn"]["q_proj"][...]
  assert q.sharding == shardings["blocks"]["attn"]["q_proj"]
  assert q.addressable_shards[0].data.shape == (2, 8, 2, 8)  # (layers, embed/4, heads/2, head_dim)
  assert _equal(params, loaded)


def test_sharded_index(tmp_path):
  cfg, params, path = _saved(tmp_path)
  tensors = load_file(str(path / "model.safetensors"))
  names = sorted(tensors)
  half = len(names) // 2
  (path / "model.safetensors").unlink()
  save_file({n: tensors[n] for n in names[:half]}, str(path / "model-00001-of-00002.safetensors"))
  save_file({n: tensors[n] for n in names[half:]}, str(path / "model-00002-of-00002.safetensors"))
  weight_map = {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, n in enumerate(names)}
  (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  _, _, loaded = hf.load_params(path)
  assert _equal(params, loaded)


def test_missing_tensor_names_the_tensor(tmp_path):
  cfg, params, path = _saved(tmp_path)
  tensors = load_file(str(path / "model.safetensors"))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, str(path / "model.safetensors"))
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
    hf.load_params(path)


def test_shape_mismatch_names_file_and_tensor(tmp_path):
  cfg, params, path = _saved(tmp_path)
  tensors = load_file(str(path / "model.safetensors"))
  tensors["model.layers.0.mlp.down_proj.weight"] = np.zeros((32, 63), np.float32)
  save_file(tensors, str(path / "model.safetensors"))
  with pytest.raises(hf.CheckpointError, match=r"model\.safetensors.*down_proj\.weight.*\(32, 63\)"):
    hf.load_params(path)


def test_corrupt_safetensors_names_the_file(tmp_path):
  cfg, params, path = _saved(tmp_path)
  data = (path / "model.safetensors").read_bytes()
  (path / "model.safetensors").write_bytes(data[: len(data) // 3])
  with pytest.raises(hf.CheckpointError, match=r"model\.safetensors"):
    hf.load_params(path)


def test_unsupported_architecture_and_missing_config(tmp_path):
  cfg, params, path = _saved(tmp_path)
  conf = json.loads((path / "config.json").read_text())
  conf["model_type"] = "gpt2"
  conf["architectures"] = ["GPT2LMHeadModel"]
  (path / "config.json").write_text(json.dumps(conf))
  with pytest.raises(hf.CheckpointError, match=r"config\.json.*unsupported architecture.*gpt2"):
    hf.load_params(path)
  with pytest.raises(hf.CheckpointError, match="missing"):
    hf.load_params(tmp_path / "nowhere")


def test_failed_save_leaves_no_half_written_folder(tmp_path, monkeypatch):
  cfg = ModelConfig.tiny()
  _, params = nnx.split(Decoder(cfg, nnx.Rngs(0)))
  path = hf.save_params(tmp_path / "model", cfg, params)
  before = (path / "model.safetensors").read_bytes()

  def boom(*a, **k):
    raise OSError("disk full")

  monkeypatch.setattr(hf, "save_file", boom)
  with pytest.raises(OSError, match="disk full"):
    hf.save_params(tmp_path / "model", cfg, params)
  assert (path / "model.safetensors").read_bytes() == before  # the old checkpoint is intact
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp folder left
