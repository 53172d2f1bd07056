"""The simulator's model of one sampler engine: continuous batching over decode slots, jumping from event to event.

Between events an engine's live batch is fixed and every context grows by one token per step, so the time of n
decode steps has the closed form n * t(B, C) + kv_s_per_token * B * n (n - 1) / 2.
"""

from __future__ import annotations

import collections
import heapq
import math

from jaxrl.sim.costs import Costs, smoothmax


class SamplerTimeline:
  """One simulated sampler engine: live decode slots, a pending list, a clock and the version of its weights.

  Live samples sit in a heap keyed by the value of the engine's decode-step counter at which they finish, so
  an event costs O(log B); a live sample's context is prompt_len + (counter - its start counter).
  """

  def __init__(self, index: int, costs: Costs, prompt_len: int):
    d = costs.decode
    self.index, self.max_batch, self.prompt_len, self.costs = index, costs.max_batch, prompt_len, costs
    self.curve = d
    self.o, self.kv, self.c, self.p = d.overhead_s, d.kv_s_per_token, d.compute_s_per_seq, d.knee_sharpness
    self.prefill_s = costs.prefill_s_per_token * prompt_len
    self.clock, self.version = 0.0, 0
    self.update_due: tuple[float, int] | None = None  # (publish time, version) waiting for a step boundary
    self.counter = 0  # decode steps run so far
    self.live: list[tuple[int, int, int]] = []  # heap of (finish counter, sample id, start counter)
    self.start_sum = 0  # sum of the live samples' start counters
    self.pending: collections.deque[tuple[int, int]] = collections.deque()  # (sample id, length)
    self.busy: list[list] = []  # [kind, start, end], contiguous spans of one kind merged
    self.tokens = 0

  @property
  def batch(self) -> int:
    return len(self.live)

  @property
  def load(self) -> int:
    return len(self.live) + len(self.pending)

  def _mark(self, kind: str, start: float, end: float):
    if end <= start:
      return
    if self.busy and self.busy[-1][0] == kind and abs(self.busy[-1][2] - start) < 1e-12:
      self.busy[-1][2] = end
    else:
      self.busy.append([kind, start, end])

  def _first_step(self) -> tuple[float, float]:
    """(time of the next decode step, growth of each later step): contexts grow by B tokens per step."""
    b = len(self.live)
    ctx_sum = b * (self.prompt_len + self.counter) - self.start_sum
    w = self.curve.weights_read_s(b)
    linear = max(w, self.c * b) if math.isinf(self.p) else float(smoothmax(w, self.c * b, self.p))
    return self.o + self.kv * ctx_sum + linear, self.kv * b

  def _span(self, n: int) -> float:
    a, s = self._first_step()
    return n * a + s * n * (n - 1) / 2

  def steps_to_finish(self) -> int:
    return self.live[0][0] - self.counter

  def next_finish(self) -> float:
    return self.clock + self._span(self.steps_to_finish()) if self.live else math.inf

  def steps_to_reach(self, t: float) -> int:
    """Fewest decode steps that take the clock to t or past it (at most until the next sample finishes)."""
    n_max = self.steps_to_finish()
    tau = t - self.clock
    if tau <= 0:
      return 0
    a, s = self._first_step()
    if s == 0:
      n = math.ceil(tau / a)
    else:
      h = a - s / 2
      n = math.ceil((-h + math.sqrt(h * h + 2 * s * tau)) / s)
    n = max(0, min(n, n_max))
    while n > 0 and self._span(n - 1) >= tau:  # float round-off in the root
      n -= 1
    while n < n_max and self._span(n) < tau:
      n += 1
    return n

  def decode(self, n: int) -> list[int]:
    """Runs n decode steps; returns the ids of samples that finished."""
    if n <= 0 or not self.live:
      return []
    dt = self._span(n)
    self._mark("decode", self.clock, self.clock + dt)
    self.clock += dt
    self.tokens += n * len(self.live)
    self.counter += n
    finished = []
    while self.live and self.live[0][0] == self.counter:
      _, sid, start = heapq.heappop(self.live)
      self.start_sum -= start
      finished.append(sid)
    return finished

  def start_pending(self) -> list[int]:
    """Prefills pending samples into free slots (one after another); returns the ids started."""
    started = []
    while self.pending and len(self.live) < self.max_batch:
      sid, length = self.pending.popleft()
      self._mark("decode", self.clock, self.clock + self.prefill_s)
      self.clock += self.prefill_s
      heapq.heappush(self.live, (self.counter + length, sid, self.counter))
      self.start_sum += self.counter
      started.append(sid)
    return started

  def contexts(self) -> tuple[int, int]:
    """(total, longest) context of the live samples."""
    if not self.live:
      return 0, 0
    top = self.prompt_len + self.counter
    return len(self.live) * top - self.start_sum, top - min(start for _, _, start in self.live)

  def stall(self, start: float, seconds: float):
    self.clock = max(self.clock, start)
    self._mark("sync", self.clock, self.clock + seconds)
    self.clock += seconds


def busy_in(spans, lo: float, hi: float, kinds=("decode",)) -> float:
  return sum(max(0.0, min(e, hi) - max(s, lo)) for k, s, e in spans if k in kinds)
