"""The learner's hub for independent sampler programs (distributed.sampler_main): the coordinator and the learner's
end of the rollouts channel of a run whose samplers are not part of its job, served over rpc. Samplers register,
renew a lease with every call, take data positions, deliver finished groups and leave (or are lost) at any time.

  register     a new sampler id, the pass-rate table resumed from, the lease; the sampler then pulls weights
  heartbeat    renews the lease; waits up to hold_s for a new ask and answers the learner's asks (Asks), or done
  admit        the next data position (a group pending at the checkpoint resumed from, or lost by another sampler,
               first) with a fencing token: the group's current assignment
  skipped      the position's prompt was skipped by the sampler (counted, settled for good)
  deliver      finished groups as a packet (distributed.packets) with their tokens: a group is accepted only from the
               sampler holding its current assignment (else refused: "fenced", or "forged" from a sampler id this
               hub never gave) and only if it is what that assignment could have produced (refusal): the run's
               sampling settings ("sampling_mismatch"), the data's prompt ("wrong_prompt"), finite values, versions
               the learner published, the run's lengths and vocabulary ("bad_values"); such a group is counted under
               its reason and generated again
  goodbye      the sampler leaves (SIGTERM): its groups go back at once

A sampler not heard from for lease_s (killed, preempted, stopped) is dropped: the groups it holds go back to be
generated again by the others, each with a new admission and so a new deadline. The hub splits each step's
groups_per_step groups over the samplers (`split`: each sampler's part, re-made when one joins, leaves or is
dropped, told with every ask); each hears every ask and assembles its part of every share by deadline as one
sampler of a job does (controller.assembly), so the samplers together generate what the learner trains. The
learner takes each step's groups from whatever has arrived, oldest version first, and a group whose oldest token
would be trained past max_staleness is refused ("late") and generated again: the bound holds for every trained
token. The learner's loop stops for no sampler: it waits on a stalled sampler's part at most until its lease
expires (its part goes to the others), and gives up (one line naming the samplers registered) only if no group has
been delivered for orphan_s.

Every rpc peer proved the run's secret (distributed.rpc). A registered sampler holds at most max_held groups (admit
answers expired past it: a sampler that admits without delivering is dropped and its groups generated again).
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from jaxrl.controller.assembly import reject_reason
from jaxrl.controller.coordinator import Coordination
from jaxrl.controller.interfaces import Asks
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.distributed import packets
from jaxrl.rollout import Rollout

PAUSED = -(1 << 30)  # an admission bound under which no group fits (controller.assembly.DeadlineBook.room)
_LOGPROB_SLACK = 1e-4  # a log-probability is <= 0; float rounding never takes an honest one past this


def refusal(group: list[Rollout], spec: RunSpec, max_len: int, version: int, prompt=None,
            vocab_size: int | None = None) -> str | None:
  """Why the hub refuses a delivered group held by its sender, or None: what no honest sampler of this run can
  produce. The reward is the sampler's to compute (NaN: its reward failed, which the learner drops and counts)."""
  if any(r.sampling != spec.sampler.sampling for r in group):
    return "sampling_mismatch"
  if len(group) != spec.rl.group_size or sorted(r.sample_index for r in group) != list(range(len(group))):
    return "bad_values"
  for r in group:
    model = np.asarray(r.versions) >= 0  # observation tokens of an episode carry -1
    tokens = np.concatenate([r.prompt_tokens, r.completion_tokens])
    if (np.isinf(r.reward) or len(r.prompt_tokens) < 1 or len(tokens) > max_len
        or np.any(np.asarray(r.versions) < -1) or np.any(np.asarray(r.versions)[model] > version)
        or not np.all(np.isfinite(r.logprobs)) or np.any(np.asarray(r.logprobs)[model] > _LOGPROB_SLACK)
        or np.any(tokens < 0) or (vocab_size is not None and np.any(tokens >= vocab_size))):
      return "bad_values"
  if prompt is not None and any(not np.array_equal(r.prompt_tokens, prompt) for r in group):
    return "wrong_prompt"
  return None


def split(groups_per_step: int, samplers: list[str], joining: set[str]) -> dict[str, int]:
  """Each sampler's part of every step's groups: groups_per_step split evenly over the samplers (in order of
  registration, the first ones take the remainder; past groups_per_step samplers, the later ones stand by with
  none). A joining sampler (one that registered while others delivered, and has delivered nothing yet: it is
  pulling weights and compiling) gets its part on top: the others keep the whole step among themselves until it
  delivers, so the learner does not wait for a joiner's start-up."""
  def even(names: list[str]) -> dict[str, int]:
    each, extra = divmod(groups_per_step, len(names)) if names else (0, 0)
    return {s: each + (i < extra) for i, s in enumerate(names)}

  ready = [s for s in samplers if s not in joining]
  return {**even(samplers), **(even(ready) if ready else {})}


class Hub(Coordination):
  """The coordinator (controller.interfaces.Coordinator, learner side) and the learner's Rollouts of a run with
  independent samplers; `handlers` are the rpc methods the samplers call."""

  def __init__(self, record: RunRecord, spec: RunSpec, max_len: int, resumed_from: int | None = None, *,
               lease_s: float = 10.0, hold_s: float = 1.0, orphan_s: float = 600.0, poll_s: float = 0.05,
               prompt_of: Callable[[int], np.ndarray] | None = None, vocab_size: int | None = None,
               max_held: int | None = None):
    """prompt_of: group id -> the prompt tokens of its data position (controller.data; None: not checked);
    max_held: groups one sampler may hold (None: from the run's shares, far past what an honest sampler holds)."""
    super().__init__(record, spec.rl.max_failures_in_a_row, resumed_from, spec.rl.max_filtered_in_a_row)
    self.spec, self.max_len, self.lease_s, self.hold_s, self.orphan_s = spec, max_len, lease_s, hold_s, orphan_s
    self.poll_s, self.prompt_of, self.vocab_size = poll_s, prompt_of, vocab_size
    rl = spec.rl
    self.max_held = max_held or max(64, 4 * ((spec.max_staleness + 2) * rl.groups_per_step + rl.queue_groups))
    self._issued: set[str] = set()  # every sampler id this hub gave: a lost one's late results are "fenced"
    self.incarnation = uuid.uuid4().hex  # a restarted learner is another: its samplers start over
    self._changed = threading.Condition(self._lock)  # asks, the pool, the samplers
    self._resume_here(spec.rl.group_size)
    self._asks = Asks(0, 0, None)
    self._version = 0  # the learner's, as of its last go_on: the step it trains next
    self._published = -1  # the newest version published (published): a delivered token may carry it before go_on
    self._seen: dict[str, float] = {}  # registered sampler -> when it last called (monotonic), in order of joining
    self._delivering: set[str] = set()  # registered samplers that delivered a group
    self._joining: set[str] = set()  # registered while others delivered, nothing delivered yet (split)
    self._parts: dict[str, int] = {}  # sampler -> its part of each share (split, re-made by _resplit)
    self._held: dict[int, tuple[str, int]] = {}  # group -> (sampler, token): its current assignment
    self._tokens = 0
    self._pool: list[list[Rollout]] = []  # accepted, waiting for the learner
    self._costs: dict[str, dict] = {}
    self._book_steps: dict[str, int | None] = {}  # the step each sampler's deadline book counts in (heartbeat)
    # (shares it was asked for and has not taken, when it said so): each sampler's (heartbeat), for _nothing_coming
    self._pending: dict[str, tuple[int | None, float]] = {}
    self._asked_at = time.monotonic()  # the last change of the shares asked
    # Shares asked of every sampler beyond the learner's, each counted as a skipped update (the book's step stays the
    # learner's): the groups of a share part of which was lost (a dropped sampler's, a late group) are asked again.
    self._extra = 0
    self._skips: list[tuple[int, str]] = []
    self._delivered_at = time.monotonic()  # the last accepted delivery (or the hub's start)
    # A lease counts only the time the hub itself ran: a learner process that did not run its threads for a while
    # (a long compile holding the GIL, a stopped host) would otherwise drop every sampler whose calls were waiting.
    self._tick = time.monotonic()
    self.samplers = {"joined": 0, "lost": 0, "left": 0}
    self.done = False  # the learner trained its last step: samplers are told to end
    threading.Thread(target=self._ticking, name="jaxrl-hub-tick", daemon=True).start()

  def handlers(self) -> dict:
    return {"register": self._register, "heartbeat": self._heartbeat, "admit": self._admit,
            "skipped": self._skipped_prompt, "deliver": self._deliver, "goodbye": self._goodbye}

  # learner side: the Coordinator's verbs
  def go_on(self, version: int) -> bool:
    with self._lock:
      self._version = version
    return version < self.spec.num_steps and not self.stop.is_set()

  def published(self, version: int) -> None:
    """The learner is publishing `version` (told before the samplers can pull it): the newest version a delivered
    token may carry."""
    with self._lock:
      self._published = max(self._published, int(version))

  def ask(self) -> None:
    with self._changed:
      self._asks = self._asks._replace(shares=self._asks.shares + 1)
      self._asked_at = time.monotonic()
      self._changed.notify_all()

  def bound(self, admit_k: int | None) -> None:
    with self._lock:
      self._asks = self._asks._replace(admit_k=admit_k)

  def update_done(self, applied: bool, partial: bool = False) -> None:
    if applied:
      self._applied(partial)
      return
    with self._lock:
      self.ledger.skipped_updates += 1
      self._asks = self._asks._replace(updates_skipped=self._asks.updates_skipped + 1)
    self.fail("update_skipped")

  def sampler_costs(self) -> list[dict]:
    with self._lock:
      return list(self._costs.values())

  def skips_to_trace(self) -> list[tuple[int, str]]:
    with self._lock:
      out, self._skips = self._skips, []
    return out

  def checkpoint_record(self) -> dict:
    with self._lock:
      self._record.unadmitted_group_ids = list(self._unadmitted)
      self._record.pending_group_ids = sorted(self._live | set(self._regenerate))
      return self._record.to_json()

  def registered(self) -> int:
    """Samplers holding a lease now."""
    with self._lock:
      self._expire()
      return len(self._seen)

  def finish(self) -> None:
    """The run is over: heartbeats answer done, so that every sampler ends."""
    with self._changed:
      self.done = True
      self._changed.notify_all()

  # learner side: the Rollouts' verbs (rank is ignored: a step's groups come from whoever delivered them)
  def get(self, rank: int = 0) -> list[Rollout]:
    waiting_since = time.monotonic()
    with self._changed:
      while True:
        if self.stop.is_set():
          raise Stopped
        self._expire()
        group = self._take_trainable()
        if group is not None:
          self._changed.notify_all()  # room for a delivery
          return group
        if self._nothing_coming(max(waiting_since, self._delivered_at, self._asked_at)):
          self._extra += 1  # one more share of every sampler: the learner's step takes what it lacks
          self._asked_at = time.monotonic()
          self._changed.notify_all()
        if time.monotonic() - max(waiting_since, self._delivered_at) > self.orphan_s:
          raise TimeoutError(f"hub: no group delivered for {self.orphan_s:g}s while the learner waited for step "
                             f"{self._version}'s groups; samplers registered: {sorted(self._seen) or 'none'} "
                             "(start jaxrl-sampler --learner=...)")
        self._changed.wait(self.poll_s)

  def _take_trainable(self) -> list[Rollout] | None:
    """The pooled group with the oldest token first; groups that would be trained past max_staleness at this step
    are refused as late and generated again (call under the lock)."""
    self._pool.sort(key=self._oldest)
    while self._pool:
      group = self._pool.pop(0)
      if (self._version - self._oldest(group) <= self.spec.max_staleness
          or reject_reason(group, self.spec.rl.seq_len, self.spec.rl.filter_groups) is not None):
        return group  # a group the learner will not train it drops with its own reason
      self._refuse(group, "late")
      self._generate_again(group[0].group_id, "late")
    return None

  def _nothing_coming(self, since: float) -> bool:
    """The learner has waited two heartbeats since `since` for groups that no sampler generates: every sampler said,
    after the last ask, that it has taken every share it was asked for (call under the lock)."""
    now = time.monotonic()
    caught_up = lambda sid: self._pending.get(sid, (None, 0.0))[0] == 0 and self._pending[sid][1] > self._asked_at
    return bool(self._seen) and now - since > 2 * self.hold_s and all(map(caught_up, self._seen))

  def _oldest(self, group: list[Rollout]) -> int:
    """The version of the group's oldest model token (the learner's check: samples without one are fresh)."""
    return min((r.min_version for r in group if len(r.versions)), default=self._version)

  def put(self, group: list[Rollout]) -> None:
    raise TypeError("the hub is the learner's end: samplers deliver over rpc")

  def put_all(self, groups: list[list[Rollout]]) -> None:
    raise TypeError("the hub is the learner's end: samplers deliver over rpc")

  send_s = 0.0

  def drain(self) -> list[list[Rollout]]:
    with self._lock:
      out, self._pool = self._pool, []
    return out

  def depth(self) -> int:
    with self._lock:
      return len(self._pool)

  def unsent(self) -> int:
    return 0

  # the samplers' calls (rpc handlers)
  def _register(self, request: dict) -> dict:
    with self._changed:
      if self.stop.is_set() and not self.done:  # saving its last checkpoint: the sampler tries again
        return {"stopping": True}
      sid = f"s{self.samplers['joined']}-{uuid.uuid4().hex[:6]}"
      self.samplers["joined"] += 1
      self._issued.add(sid)
      self._seen[sid] = time.monotonic()
      if self._delivering:
        self._joining.add(sid)
      self._resplit()
      print(f"jaxrl hub: sampler {sid} joined ({request.get('host', '?')}) at learner version {self._version}",
            file=sys.stderr, flush=True)
      return {"sampler": sid, "incarnation": self.incarnation, "lease_s": self.lease_s,
              "pass_rate": self._record.pass_rate, "filter": list(self.resumed_filter), "asks": self._asks_of(sid),
              "done": self.done}

  def _known(self, request: dict) -> str | None:
    """The calling sampler's id if it still holds a lease with this learner (renewed now), else None. Once the
    learner loop has stopped, none does: the run record (and ledger) of its last checkpoint is final."""
    sid = request.get("sampler")
    if self.stop.is_set():
      return None
    self._expire()
    if request.get("incarnation") != self.incarnation or sid not in self._seen:
      return None
    self._seen[sid] = time.monotonic()
    return sid

  def known(self, request: dict) -> bool:
    """Whether the caller is a registered sampler (its lease renewed): the weights are described only to one."""
    with self._lock:
      return self._known(request) is not None

  def _heartbeat(self, request: dict) -> dict:
    """Holds the call up to hold_s until the sampler's asks change (request "seen": the asks it has), then answers
    them. request "book_step": the step its deadline book counts in (controller.assembly), for its admission bound;
    "pending": the shares it was asked for and has not taken yet."""
    with self._changed:
      sid = self._known(request)
      if sid is None:
        return {"expired": not self.done, "done": self.done}
      self._book_steps[sid] = request.get("book_step")
      self._pending[sid] = (request.get("pending"), time.monotonic())
      deadline = time.monotonic() + self.hold_s
      while (self._asks_of(sid) == request.get("seen") and not self.done and not self.stop.is_set()
             and time.monotonic() < deadline):
        self._changed.wait(deadline - time.monotonic())
      sid = self._known(request)  # renewed again at the answer: a long wait is no silence
      return {"expired": sid is None, "asks": self._asks_of(sid) if sid else None, "done": self.done}

  def _asks_of(self, sid: str) -> list:
    """What this sampler is told (call under the lock): the learner's asks, with an admission bound and a part of
    each share of its own (split). Every sampler hears every ask and counts its deadlines in steps of its own shares
    (its book step); one that fell behind the learner's step by L (the learner took others' groups in its stead) is
    told k - L, which makes its room and deadlines in its own count those of the learner's steps. While a whole step
    of trainable groups waits in the pool, no sampler admits (bound PAUSED): more would only be refused as late."""
    k = self.spec.max_staleness if self._asks.admit_k is None else min(self._asks.admit_k, self.spec.max_staleness)
    trainable = sum(self._version - self._oldest(g) <= self.spec.max_staleness for g in self._pool)
    if trainable >= self.spec.rl.groups_per_step:
      k = PAUSED
    elif self._book_steps.get(sid) is not None:
      k -= max(0, self._version - self._book_steps[sid])
    return [self._asks.shares + self._extra, self._asks.updates_skipped + self._extra, k, self._parts[sid]]

  def _resplit(self) -> None:
    """Re-makes the samplers' parts (split) when one joins, delivers its first group, leaves or is dropped (call
    under the lock)."""
    new = split(self.spec.rl.groups_per_step, list(self._seen), self._joining)
    if new != self._parts:
      self._parts = new
      self._changed.notify_all()
      print(f"jaxrl hub: each step's {self.spec.rl.groups_per_step} groups split as {new} (joining: "
            f"{sorted(self._joining) or 'none'})", file=sys.stderr, flush=True)

  def _admit(self, request: dict) -> dict:
    with self._lock:
      sid = self._known(request)
      if sid is None:
        return {"expired": True}
      if sum(s == sid for s, _ in self._held.values()) >= self.max_held:
        self._drop(sid, "sampler_lost")  # admits without delivering: its groups go to the others
        return {"expired": True}
      gid, again = self._next_group()
      self._tokens += 1
      self._held[gid] = (sid, self._tokens)
      self._admitted(gid, again)
      return {"expired": False, "group": gid, "again": again, "token": self._tokens}

  def _skipped_prompt(self, request: dict) -> dict:
    with self._lock:
      gid = request["group"]
      if self._known(request) is None or self._held.get(gid, (None, None))[1] != request["token"]:
        return {"expired": True}  # the group went to another sampler: its skip is that one's to report
      del self._held[gid]
      self._live.discard(gid)
      self._skip(gid, request["reason"], request["set_aside"])
      self._skips.append((gid, request["reason"]))
      return {"expired": False}

  def _deliver(self, request: dict) -> dict:
    """Accepts the groups this sampler holds (back-pressure: waits up to hold_s while the pool is full, then answers
    full, and the sampler sends again); refuses, counted, those it no longer holds."""
    groups = packets.decode(np.asarray(request["packet"]), self.max_len)
    tokens = {int(g): t for g, t in request["tokens"]}  # [[group, token], ...]
    def held(sid):  # the groups this sampler holds the current assignment of
      return [g for g in groups if sid is not None and self._held.get(g[0].group_id) == (sid, tokens.get(
          g[0].group_id))]

    with self._lock:
      peek = [g[0].group_id for g in held(self._known(request))]
    prompts = {gid: self._prompt(gid) for gid in peek}  # outside the lock: rendering a prompt takes a while
    with self._changed:
      sid = self._known(request)
      mine = held(sid)
      deadline = time.monotonic() + self.hold_s
      while mine and self._pool and len(self._pool) + len(mine) > self.spec.rl.queue_groups:
        if time.monotonic() >= deadline:
          return {"expired": False, "full": True}
        self._changed.wait(deadline - time.monotonic())
        sid = self._known(request)
        mine = held(sid)
      if self.stop.is_set():  # nothing counts past the final record: the groups are pending in it
        return {"expired": True, "full": False}
      issued = request.get("incarnation") == self.incarnation and request.get("sampler") in self._issued
      accepted = 0
      for g in groups:
        gid = g[0].group_id
        self.ledger.generated(g)
        if not any(g is m for m in mine) or gid not in self._held:  # not its own, or twice in one packet
          self._refuse(g, "fenced" if issued else "forged")
          continue
        del self._held[gid]
        prompt = prompts[gid] if gid in prompts else self._prompt(gid)  # held since the peek: rare
        reason = refusal(g, self.spec, self.max_len, max(self._version, self._published), prompt, self.vocab_size)
        if reason is not None:
          self._refuse(g, reason)
          self._generate_again(gid, reason)
          print(f"jaxrl hub: group {gid} from sampler {sid} refused ({reason}): it will be generated again",
                file=sys.stderr, flush=True)
          continue
        accepted += 1
        self._pool.append(g)
        self._delivered_at = time.monotonic()
      if accepted and sid not in self._delivering:  # the others' parts shrink to make room for its own
        self._delivering.add(sid)
        self._joining.discard(sid)
        self._resplit()
      if sid is not None and "costs" in request:
        self._costs[sid] = request["costs"]
      self._changed.notify_all()
      return {"expired": sid is None, "full": False, "accepted": accepted, "refused": len(groups) - accepted}

  def _prompt(self, gid: int):
    """The prompt tokens of the group's data position (None: not checked, or the data skips it: then no prompt
    matches)."""
    if self.prompt_of is None:
      return None
    try:
      return np.asarray(self.prompt_of(gid))
    except Exception:  # noqa: BLE001 - a position the data skips: no delivered prompt can be its
      return np.zeros(0, np.int32)

  def _goodbye(self, request: dict) -> dict:
    with self._changed:
      if self.stop.is_set():  # the final record is taken: nothing to hand back, nothing counted
        if request.get("incarnation") == self.incarnation:
          self._seen.pop(request.get("sampler"), None)
        return {}
      sid = self._known(request)
      if sid is not None:
        self._drop(sid, "sampler_left")
      return {}

  # leases
  def _ticking(self, every_s: float = 0.25) -> None:
    while not self.stop.is_set():
      with self._lock:
        self._expire()
      time.sleep(every_s)

  def _expire(self) -> None:
    """Drops the samplers silent for lease_s of the hub's own running time (call under the lock)."""
    now = time.monotonic()
    paused, self._tick = now - self._tick, now
    # The ticker runs every 0.25 s: a gap of half a lease is this process not running (not a loaded machine's
    # scheduling, under which the samplers are as late as the hub), and nobody could call it meanwhile.
    if paused > self.lease_s / 2:
      self._seen = {sid: seen + paused for sid, seen in self._seen.items()}
    for sid in [s for s, seen in self._seen.items() if now - seen > self.lease_s]:
      self._drop(sid, "sampler_lost")

  def _drop(self, sid: str, reason: str) -> None:
    """The sampler is gone: the groups it held are generated again by the others (call under the lock)."""
    del self._seen[sid]
    self._delivering.discard(sid)
    self._joining.discard(sid)
    self._resplit()  # its part goes to the others
    self.samplers["lost" if reason == "sampler_lost" else "left"] += 1
    held = sorted(g for g, (s, _) in self._held.items() if s == sid)
    for gid in held:
      del self._held[gid]
      self._generate_again(gid, reason)
    self._costs.pop(sid, None)
    self._changed.notify_all()
    how = f"lost (silent for more than {self.lease_s:g}s)" if reason == "sampler_lost" else "left"
    print(f"jaxrl hub: sampler {sid} {how}: its {len(held)} unfinished groups will be generated again",
          file=sys.stderr, flush=True)

  def _generate_again(self, gid: int, reason: str) -> None:
    """The group (admitted, still pending) is admitted again, first, with a new deadline."""
    self._regenerate.insert(0, gid)
    self.ledger.groups_generated_again[reason] += 1

  def _refuse(self, group: list[Rollout], reason: str) -> None:
    self.ledger.samples_refused[reason] += len(group)
