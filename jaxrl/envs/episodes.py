"""Host side of multi-turn episodes: env steps off the sampler's thread, observations to tokens, the outcome.

The sampler holds one `Episode` per multi-turn sample. When a model turn ends it calls `Episodes.step`, which
returns at once: the env step runs on a thread pool (in the calling thread of a pool worker for trusted envs, else
in an isolating runner's worker process with a timeout), while the slot waits and the other slots decode. Once
the step is done, `Episodes.observation` says how the episode goes on: the observation's tokens to append to the
slot, or None when the episode is over (its `outcome` then holds the reward, the turns and any env failure).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np

from jaxrl.envs import guard
from jaxrl.envs.env import Env, EnvTask, call_env_step, call_env_step_data, env_from_data, step_env
from jaxrl.envs.rewards import Check
from jaxrl.envs.runner import RewardResult, RewardRunner
from jaxrl.envs.task import Example

_MARK_TURN, _MARK_OBS = "\x00turn\x00", "\x00obs\x00"


def tool_turn_template(tokenizer) -> tuple[str, str]:
  """(before, after): the text the tokenizer's chat template puts around a tool message that follows a model
  turn, up to the generation prompt of the model's next turn (e.g. "<|im_end|>\\n<|im_start|>tool\\n" and
  "<|im_end|>\\n<|im_start|>assistant\\n")."""
  messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK_TURN},
              {"role": "tool", "content": _MARK_OBS}]
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  if _MARK_TURN not in text or _MARK_OBS not in text:
    raise ValueError("the tokenizer's chat template does not render assistant and tool messages")
  i, j = text.index(_MARK_TURN) + len(_MARK_TURN), text.index(_MARK_OBS)
  return text[i:j], text[j + len(_MARK_OBS):]


@dataclasses.dataclass
class EpisodeStart:
  """What a multi-turn request carries (Request.meta["episode"]): the driver and the example of its episodes."""

  driver: Episodes
  example: Example


@dataclasses.dataclass
class Episode:
  """One sample's episode: its env (the state after the last step), turns so far, where the current model turn
  starts in the sample's tokens, and the observation tokens' spans [start, end) in them."""

  env: Env
  turn_start: int = 0
  turns: int = 0
  observed: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  future: concurrent.futures.Future | None = None  # the env step under way
  outcome: dict | None = None  # set when the episode is over: reward, turns, end, error

  @property
  def observed_tokens(self) -> int:
    return sum(end - start for start, end in self.observed)

  def loss_mask(self, length: int) -> np.ndarray:
    """float32 [length] over the sample's completion: 0 on observation tokens, 1 on the model's."""
    mask = np.ones(length, np.float32)
    for start, end in self.observed:
      mask[start:end] = 0.0
    return mask


class EnvRunner:
  """Env steps on `workers` threads; untrusted envs through one single-worker isolating runner per thread."""

  def __init__(self, trusted: bool, *, timeout_s: float = 10.0, workers: int = 4):
    self.trusted, self.timeout_s = trusted, timeout_s
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxrl-env")
    self._runners: queue.SimpleQueue[RewardRunner] = queue.SimpleQueue()
    self._all: list[RewardRunner] = []
    self._lock = threading.Lock()
    self.steps = 0
    self.failures: collections.Counter[str] = collections.Counter()
    self.seconds = 0.0  # env time summed over steps (they overlap one another and decoding)

  def submit(self, env: Env, text: str, ids: Sequence[int], count: bool = True) -> concurrent.futures.Future:
    """The step's RewardResult, in the future; `count` False leaves it out of the stats (the self-check)."""
    return self._pool.submit(self._run, env, text, list(ids), count)

  def _run(self, env, text, ids, count) -> RewardResult:
    t0 = time.perf_counter()
    if self.trusted:
      result = call_env_step(step_env, env, text, ids)
    else:
      try:
        runner = self._runners.get_nowait()
      except queue.Empty:  # started on first use: one worker process per pool thread
        runner = RewardRunner(step_env, timeout_s=self.timeout_s, workers=1, isolation="process", sandbox=None,
                              call=call_env_step_data)
        with self._lock:
          self._all.append(runner)
      try:
        result = env_from_data(env, runner.score([(env, text, ids)])[0])
      finally:
        self._runners.put(runner)
    if count:
      self.count(result, time.perf_counter() - t0)
    return result

  def count(self, result: RewardResult, seconds: float = 0.0) -> None:
    with self._lock:
      self.steps += 1
      self.seconds += seconds
      if not result.ok:
        self.failures[result.reason] += 1

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)
    for runner in self._all:
      runner.close()


class Episodes:
  """Runs the episodes of one EnvTask for a Sampler: starts them, steps their envs, renders observations."""

  def __init__(self, task: EnvTask, tokenizer=None, *, vocab_size: int, chat_template: bool = True,
               timeout_s: float = 10.0, workers: int = 4):
    env = task.env_class
    if not env.max_turns >= 1 or not env.max_tokens >= 2:
      raise ValueError(f"{env.__name__}: max_turns must be >= 1 and max_tokens >= 2 "
                       f"(got {env.max_turns}, {env.max_tokens})")
    if task.text_prompts and tokenizer is None:
      raise ValueError(f"env task {task.name!r} has text turns and needs a tokenizer")
    self.task, self.tokenizer, self.vocab_size = task, tokenizer, vocab_size
    self.stop_strings, self.stop_token_ids = tuple(env.stop_strings), tuple(env.stop_token_ids)
    self.max_turns, self.max_tokens = env.max_turns, env.max_tokens
    self.wrap = tool_turn_template(tokenizer) if task.text_prompts and chat_template else ("\n", "\n")
    self.runner = EnvRunner(task.trusted, timeout_s=timeout_s, workers=workers)
    self.episodes = 0
    self.ends: collections.Counter[str] = collections.Counter()  # how episodes ended: done, max_turns, ...

  def self_check(self) -> None:
    """Plays the task's scripted episodes (EnvTask.check_episodes) through the real env runner, before the run's
    first prompt: one that ends otherwise than its script says raises guard.RewardsBroken."""
    example = self.task.prompt(0)
    for turns, right in self.task.check_episodes(example):
      env = self.task.env(example)
      env.reset(example)
      for text in turns:
        ids = self.tokenizer.encode(text, add_special_tokens=False) if self.tokenizer is not None else []
        result = self.runner.submit(env, text, ids, count=False).result()
        if not result.ok or result.payload[1].done:
          break
        env = result.payload[0]
      why = guard.verdict(Check(" / ".join(turns), {}, right), result)
      if why is not None:
        where = "the sampler's threads" if self.task.trusted else "its worker process"
        raise guard.RewardsBroken(f"env task {self.task.name!r} failed its start-up self-check in {where}: {why} "
                                  "(task.self_check=False skips the check)")

  def start(self, example: Example) -> EpisodeStart:
    return EpisodeStart(self, example)

  def open(self, start: EpisodeStart) -> Episode:
    """A sample's episode: a fresh env, reset on the example (the prompt the sampler holds is its first turn)."""
    env = self.task.env(start.example)
    env.reset(start.example)
    self.episodes += 1
    return Episode(env)

  def text(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""

  def step(self, episode: Episode, turn_ids: Sequence[int]) -> None:
    """Starts the env's step on the model turn that just ended (the sampler polls episode.future)."""
    episode.future = self.runner.submit(episode.env, self.text(turn_ids), turn_ids)

  def observation(self, episode: Episode, ended_by_eos: bool, room: int) -> list[int] | None:
    """After episode.future is done: the observation's tokens (at most `room`, at least one), or None when the
    episode is over (episode.outcome says why)."""
    result, episode.future = episode.future.result(), None
    if not result.ok:
      return self._end(episode, "env_error", error=f"{result.reason}: {result.error}")
    episode.env, turn = result.payload
    episode.turns += 1
    if turn.done:
      return self._end(episode, "done", result.value)
    if episode.turns >= self.max_turns:
      return self._end(episode, "max_turns", result.value)
    tokens = self.encode(turn.observation, ended_by_eos)
    bad = [t for t in tokens if not 0 <= t < self.vocab_size]
    if not tokens or bad:
      self.runner.count(RewardResult(float("nan"), False, reason="bad_value"))
      what = f"token ids {bad[:4]} outside the vocabulary [0, {self.vocab_size})" if bad else "no tokens"
      return self._end(episode, "env_error", error=f"bad_value: the observation has {what}")
    if len(tokens) > room:
      return self._end(episode, "max_tokens", 0.0)
    return tokens

  def encode(self, observation, ended_by_eos: bool) -> list[int]:
    """Observation tokens: ids as given; text as a tool turn of the chat template, closing the model's turn
    first unless its eos token already did."""
    if not isinstance(observation, str):
      return [int(t) for t in observation]
    if self.tokenizer is None:
      raise ValueError("a text observation needs a tokenizer")
    before, after = self.wrap
    eos = self.tokenizer.eos_token or ""
    if ended_by_eos and eos and before.startswith(eos):
      before = before[len(eos):]
    return self.tokenizer.encode(before + observation + after, add_special_tokens=False)

  def _end(self, episode: Episode, end: str, reward: float = float("nan"), error: str | None = None) -> None:
    episode.outcome = {"reward": reward, "turns": episode.turns, "end": end, "error": error}
    self.ends[end] += 1
    return None

  def stats(self) -> dict:
    return {"episodes": self.episodes, "ends": dict(self.ends), "env_steps": self.runner.steps,
            "env_failures": dict(self.runner.failures), "env_seconds": round(self.runner.seconds, 3)}

  def close(self) -> None:
    self.runner.close()
