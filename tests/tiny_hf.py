"""A tiny random model as a HF folder with a word-level tokenizer and a chat template: text tasks end to end in
seconds (words outside the vocabulary become <unk>)."""

from pathlib import Path

from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxrl.models import Decoder, ModelConfig, hf

WORDS = ["<unk>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "What", "is", "+", "-", "*", "?",
         "Answer", ":", "<", ">", "answer", "/", *"0123456789"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def hf_folder(path: Path) -> Path:
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(WORDS[:6])
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")
  tokenizer.chat_template = TEMPLATE
  tokenizer.save_pretrained(path.parent / f"{path.name}-tokenizer")
  cfg = ModelConfig.tiny(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=256, eos_token_ids=(2,))
  hf.save_params(path, cfg, nnx.split(Decoder(cfg, nnx.Rngs(0)))[1], path.parent / f"{path.name}-tokenizer")
  return path
