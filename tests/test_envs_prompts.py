"""Prompt rendering: a chat template from a small tokenizer built here, the plain-text fallback, counted skips."""

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from jaxrl.envs import ChatTemplateError, Example, PromptRenderer, RewardRunner, SkipExample, make_task

WORDS = ["<unk>", "<bos>", "<eos>", "<|user|>", "<|system|>", "<|assistant|>", "What", "is", "23", "+", "58", "?",
         "Be", "brief", "."]
ID = {w: i for i, w in enumerate(WORDS)}
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
EXAMPLE = Example(0, "train", ({"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "What is 23 + 58?"}), answer="81")


def make_tokenizer(chat_template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
  tok = Tokenizer(models.WordLevel(ID, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(WORDS[:6])  # matched whole, before the pre-tokenizer splits "<|user|>"
  tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", ID["<bos>"])])
  hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")
  if chat_template is not None:
    hf.chat_template = chat_template
  return hf


def _ids(text):
  return [ID[w] for w in text.replace("?", " ?").replace(".", " .").split()]


def test_chat_template_rendering():
  render = PromptRenderer(make_tokenizer(), 64)
  p = render(EXAMPLE)
  assert p.text == "<|system|> Be brief. <|user|> What is 23 + 58? <|assistant|>"
  # The template owns the special tokens: no <bos> is added on top of it.
  assert p.tokens.dtype == np.int32 and p.tokens.tolist() == _ids(p.text)
  assert render.rendered == 1 and not render.skipped


def test_missing_chat_template_is_a_clear_error_or_plain_text():
  tok = make_tokenizer(chat_template=None)
  with pytest.raises(ChatTemplateError, match="has no chat template; set task.chat_template=False"):
    PromptRenderer(tok, 64)
  p = PromptRenderer(tok, 64, chat_template=False)(EXAMPLE)
  assert p.text == "Be brief.\n\nWhat is 23 + 58?"  # the documented fallback: contents joined by blank lines
  assert p.tokens.tolist() == [ID["<bos>"], *_ids(p.text)]  # the tokenizer's own special tokens


def test_long_prompts_are_counted_skips():
  render = PromptRenderer(make_tokenizer(), 11)  # the rendered example has 12 tokens
  with pytest.raises(SkipExample, match="train example 0: prompt has 12 tokens, max_prompt_tokens=11") as info:
    render(EXAMPLE)
  assert info.value.reason == "too_long" and render.skipped == {"too_long": 1} and render.rendered == 0
  short = Example(1, "train", ({"role": "user", "content": "What is 23?"},))
  assert render(short).tokens.tolist() == _ids("<|user|> What is 23? <|assistant|>")
  with pytest.raises(SkipExample, match="empty prompt"):
    render(Example(2, "train"))
  assert render.skipped == {"too_long": 1, "empty": 1} and render.rendered == 1


def test_token_prompts_need_no_tokenizer():
  task = make_task("target_token", vocab_size=16, target_ids=(3,), prompt_len=6)
  render = PromptRenderer(None, 8, text_prompts=task.text_prompts, vocab_size=16)
  e = task.prompt(0)
  p = render(e)
  assert p.text == "" and p.tokens.tolist() == list(e.prompt_tokens)
  with pytest.raises(ValueError, match="token id 9 outside the model's vocab of 8"):
    PromptRenderer(None, 8, text_prompts=False, vocab_size=8)(Example(0, "train", prompt_tokens=(1, 9)))
  with pytest.raises(ValueError, match="needs a tokenizer"):
    PromptRenderer(None, 8)
  # The dense reward reads the completion's token ids from meta.
  runner = RewardRunner(task.reward)
  meta = {**e.reward_meta, "completion_ids": [3, 3, 0, 3]}
  assert runner.isolation == "inline" and runner.score([(p.text, "", meta)])[0].value == 0.75


def test_text_task_end_to_end():
  task = make_task("arithmetic", seed=0, digits=2, ops=("+",), instruction="")
  e = task.prompt(0)
  a, b = e.meta["expression"].split(" + ")
  p = PromptRenderer(make_tokenizer(), 64)(e)
  assert p.text == f"<|user|> What is {a} + {b}? <|assistant|>"
  results = RewardRunner(task.reward).score([(p.text, f"{a} + {b} = {e.answer}", e.reward_meta),
                                             (p.text, f"Answer: {int(e.answer) + 1}", e.reward_meta)])
  assert [r.value for r in results] == [1.0, 0.0]
