"""Examples to prompt token ids: chat messages through the tokenizer's chat template, token prompts as they are.

Without a chat template, rendering fails at construction with a clear error unless chat_template=False, in which
case the documented plain-text fallback joins the message contents with blank lines (no role markers) and the
tokenizer adds its usual special tokens. A prompt over max_prompt_tokens (or an empty one) is a counted skip.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxrl.envs.task import Example


class SkipExample(ValueError):
  """An example whose prompt cannot be used; the caller skips it (the run goes on) and counts `reason`."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


class ChatTemplateError(ValueError):
  """A tokenizer without a chat template asked to render chat messages."""


@dataclasses.dataclass(frozen=True)
class Prompt:
  tokens: np.ndarray  # int32 [P]
  text: str  # the rendered prompt, passed to reward fns as `prompt` ("" for token prompts)


def plain_text(messages) -> str:
  """The fallback rendering: message contents joined by blank lines."""
  return "\n\n".join(m["content"] for m in messages)


class PromptRenderer:
  """Renders and tokenizes examples of one task; counts what it renders and what it skips (by reason)."""

  def __init__(self, tokenizer, max_prompt_tokens: int, *, chat_template: bool = True, text_prompts: bool = True,
               vocab_size: int | None = None):
    if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
      raise ValueError(f"max_prompt_tokens must be an int >= 1 (got {max_prompt_tokens!r})")
    if text_prompts and tokenizer is None:
      raise ValueError("this task has text prompts and needs a tokenizer (the 'tiny' model has none; use a "
                       "token-level task such as target_token)")
    if text_prompts and chat_template and not getattr(tokenizer, "chat_template", None):
      raise ChatTemplateError(f"tokenizer {type(tokenizer).__name__} has no chat template; set "
                              "task.chat_template=False to render prompts as plain text (contents joined by blank "
                              "lines, no role markers)")
    self.tokenizer, self.max_prompt_tokens = tokenizer, max_prompt_tokens
    self.chat_template, self.vocab_size = chat_template, vocab_size
    self.rendered = 0
    self.skipped: collections.Counter[str] = collections.Counter()

  def text(self, example: Example) -> str:
    if not example.messages:
      return ""
    if self.chat_template:
      return self.tokenizer.apply_chat_template(list(example.messages), add_generation_prompt=True, tokenize=False)
    return plain_text(example.messages)

  def __call__(self, example: Example) -> Prompt:
    """The example's prompt; raises SkipExample (counted) when it is empty or too long."""
    if example.prompt_tokens:
      text, ids = "", list(example.prompt_tokens)
    elif example.messages:
      if self.tokenizer is None:
        raise ValueError(f"{example.split} example {example.index} has a text prompt but the renderer no tokenizer")
      text = self.text(example)
      ids = self.tokenizer.encode(text, add_special_tokens=not self.chat_template)
    else:
      text, ids = "", []
    where = f"{example.split} example {example.index}"
    if not ids:
      self.skipped["empty"] += 1
      raise SkipExample("empty", f"{where}: empty prompt")
    if len(ids) > self.max_prompt_tokens:
      self.skipped["too_long"] += 1
      raise SkipExample("too_long", f"{where}: prompt has {len(ids)} tokens, max_prompt_tokens="
                                    f"{self.max_prompt_tokens}")
    tokens = np.asarray(ids, np.int32)
    if self.vocab_size is not None:
      bad = tokens[(tokens < 0) | (tokens >= self.vocab_size)]
      if bad.size:
        raise ValueError(f"{where}: token id {int(bad[0])} outside the model's vocab of {self.vocab_size}")
    self.rendered += 1
    return Prompt(tokens, text)
