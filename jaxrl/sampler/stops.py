"""How a sample's model turn ends: the reason the device gave (a stop id, eos, the token budget) and stop strings,
which only the host can see (they need the detokenized text)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxrl.sampler.samples import Sample

# Tokens of text re-decoded per new token for stop strings, past the longest stop string's length in characters
# (a token decodes to at least one character except for a few partial UTF-8 bytes).
STOP_WINDOW = 8


class Stops:
  """The finish reason of a sample the device stopped, and where a stop string ends one."""

  def __init__(self, eos_token_ids: Sequence[int], detokenize: Callable[[Sequence[int]], str] | None):
    self.eos_token_ids, self.detokenize = tuple(eos_token_ids), detokenize

  def finish_reason(self, sample: Sample) -> str:
    last = sample.tokens[-1]
    if last in sample.group.stop_ids:
      return "eos" if last in self.eos_token_ids and not sample.group.request.ignore_eos else "stop"
    return "length"

  def stop_string_end(self, sample: Sample, before: int) -> int | None:
    """Number of tokens up to the one that completes a stop string, if a token after `before` completed one.

    Each new token re-decodes only a window of the last tokens long enough to hold any stop string, so the cost
    is proportional to the new tokens (re-decoding the whole completion per token was quadratic)."""
    stops = sample.group.request.stop_strings
    if not stops:
      return None
    window = max(len(s) for s in stops) + STOP_WINDOW
    first = sample.episode.turn_start if sample.episode is not None else 0  # never match in an earlier turn
    for end in range(before + 1, len(sample.tokens) + 1):
      text = self.detokenize(sample.tokens[max(first, end - window) : end])
      if any(s in text for s in stops):
        return end
    return None
