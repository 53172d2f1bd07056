"""A sampler request (n samples of one prompt) and its validation: bad input is refused when submitted."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl.rollout import SamplingParams


@dataclasses.dataclass(frozen=True)
class Request:
  """n samples of one prompt (a GRPO group)."""

  prompt_tokens: Sequence[int]
  group_id: int
  n: int = 1
  sampling: SamplingParams = SamplingParams()
  max_tokens: int | Sequence[int] | None = None  # None: until the cache is full; a sequence: one per sample
  # (a multi-turn episode: per model turn, the episode itself within its env's max_tokens)
  stop_token_ids: tuple[int, ...] = ()  # end the sample (finish_reason "stop"), kept in the completion
  stop_strings: tuple[str, ...] = ()  # needs the Sampler's `detokenize`
  ignore_eos: bool = False
  meta: dict = dataclasses.field(default_factory=dict)


def check_ids(ids, vocab_size: int, what: str) -> None:
  bad = [int(i) for i in ids if not 0 <= int(i) < vocab_size]
  if bad:
    raise ValueError(f"{what} ids {bad} are outside the vocabulary [0, {vocab_size})")


def check_request(r: Request, engine, eos_token_ids: Sequence[int], detokenize: Callable | None
                  ) -> tuple[Request, np.ndarray, tuple[int, ...], tuple[int, ...]]:
  """(request, prompt int32, per-sample token budgets, stop ids incl. eos) of a request the engine can serve, or a
  ValueError naming what is wrong. A multi-turn request (meta "episode") takes its env's stops and budget."""
  prompt = np.asarray(r.prompt_tokens).reshape(-1)
  vocab = engine.cfg.vocab_size
  if prompt.size == 0:
    raise ValueError(f"group {r.group_id}: empty prompt (a sample needs at least one prompt token)")
  if not np.issubdtype(prompt.dtype, np.integer):
    raise ValueError(f"group {r.group_id}: prompt tokens must be integers (got dtype {prompt.dtype})")
  room = engine.max_len - len(prompt)
  if room < 1:
    raise ValueError(f"group {r.group_id}: prompt of {len(prompt)} tokens does not fit the KV cache "
                     f"(max_len={engine.max_len} allows prompts of at most {engine.max_len - 1})")
  check_ids(prompt, vocab, f"group {r.group_id}: prompt token")
  check_ids(r.stop_token_ids, vocab, f"group {r.group_id}: stop token")
  if not isinstance(r.group_id, (int, np.integer)) or not 0 <= r.group_id < 2**31:
    raise ValueError(f"group_id must be an int in [0, 2**31) (got {r.group_id!r})")
  if not isinstance(r.n, (int, np.integer)) or r.n < 1:
    raise ValueError(f"group {r.group_id}: n must be a positive int (got {r.n!r})")
  budgets = np.atleast_1d(np.asarray(room if r.max_tokens is None else r.max_tokens))
  if budgets.ndim != 1 or len(budgets) not in (1, r.n) or not np.issubdtype(budgets.dtype, np.integer) \
      or budgets.min() < 1:
    raise ValueError(f"group {r.group_id}: max_tokens must be >= 1, or n={r.n} such ints (got {r.max_tokens})")
  if not isinstance(r.sampling, SamplingParams):
    raise ValueError(f"group {r.group_id}: sampling must be a SamplingParams (got {type(r.sampling).__name__})")
  start = r.meta.get("episode")
  if start is not None:  # the env's stops end a model turn; the env's budget bounds the episode
    d = start.driver
    r = dataclasses.replace(r, stop_strings=(*r.stop_strings, *d.stop_strings),
                            stop_token_ids=(*r.stop_token_ids, *d.stop_token_ids))
    check_ids(r.stop_token_ids, vocab, f"group {r.group_id}: env stop token")
    budgets = np.minimum(budgets, d.max_tokens)
  if r.stop_strings and detokenize is None:
    raise ValueError(f"group {r.group_id}: stop_strings need a Sampler built with detokenize=")
  stop_ids = tuple(dict.fromkeys(int(i) for i in (*(() if r.ignore_eos else eos_token_ids), *r.stop_token_ids)))
  if len(stop_ids) > engine.max_stop_ids:
    raise ValueError(f"group {r.group_id}: {len(stop_ids)} stop ids (eos included) exceed the engine's "
                     f"max_stop_ids={engine.max_stop_ids}")
  max_new = tuple(min(int(b), room) for b in np.broadcast_to(budgets, (r.n,)))
  return r, prompt.astype(np.int32), max_new, stop_ids
