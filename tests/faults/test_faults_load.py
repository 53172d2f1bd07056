"""Load: a learner slower than the sampler leaves finished groups waiting, which stops admission (back-pressure), so
the samples held in memory and the process RSS stay bounded over a long run; a learner faster than the sampler waits
without spinning the CPU."""

import os
import threading
import time
import weakref

import pytest
from faults_util import NUM_STEPS, TALLY, inject, tiny_config

from jaxrl import train as train_lib

LONG_STEPS = 24
QUEUE_GROUPS = 8  # two shares: a put does not block, so the book's stop is what holds the sampler back
RSS_GROWTH_LIMIT_MIB = 64  # from the end of step 4 (everything compiled, buffers allocated) to the end of the run
# Process CPU seconds per wall second while every loop thread waits. A spinning loop costs ~1.0 (a core); the
# waiting process measured 8.2-10.1% on the 2-core box (2026-12-03, alone and in the full suite: the runtime's
# idle threads and the loops' 50 ms polls), so 0.10 failed on noise; 0.20 still catches any spin by 5x.
IDLE_CPU_LIMIT = 0.20


def _rss_mib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def slow_learner_run(tmp_path_factory):
  """24 steps with a learner slowed to ~0.25 s per step; the staleness bound is set loose (50) so that only the
  queue bound (finished groups waiting) holds the sampler back."""
  alive, lock, stats = [0], threading.Lock(), {"peak_alive": 0, "rss": [], "peak_waiting": 0}
  done = threading.Event()

  def forget():
    with lock:
      alive[0] -= 1

  def slow_learner(run):
    ctl, sampling = run.controller.learner_loop, run.controller.sampler_loop
    real_step, real_rollout = ctl.train_step, sampling.sampler._rollout

    def slow_step(state, batch, key):
      time.sleep(0.25)
      return real_step(state, batch, key)

    def counted_rollout(sample, reason):
      r = real_rollout(sample, reason)
      with lock:
        alive[0] += 1
        stats["peak_alive"] = max(stats["peak_alive"], alive[0])
      weakref.finalize(r, forget)
      return r

    # Finished groups not yet taken by the learner: in the book, the sampler's outbox or the queue. Counted on the
    # sampler loop's thread, the only one that moves a group between them (a watcher thread summing the three at
    # different instants counted a moving share twice: a peak of 10 against the bound of 8, once in a full suite).
    rollouts, real_put_all, real_sampler_step = run.controller.rollouts, run.controller.rollouts.put_all, \
        sampling.sampler.step

    def note_waiting():
      if sampling.book is not None:
        waiting = len(sampling.book.finished) + len(sampling._outbox) + rollouts.depth()
        stats["peak_waiting"] = max(stats["peak_waiting"], waiting)

    def noted_put_all(groups):  # the share has left the book for the outbox: the most that waits
      note_waiting()
      return real_put_all(groups)

    def noted_sampler_step():
      note_waiting()
      return real_sampler_step()

    def noted_finish(groups):  # the groups just finished are in the book
      real_finish(groups)
      note_waiting()

    ctl.train_step, sampling.sampler._rollout = slow_step, counted_rollout
    real_finish = sampling._finish
    rollouts.put_all, sampling.sampler.step, sampling._finish = noted_put_all, noted_sampler_step, noted_finish
    stats["ctl"], stats["rollouts"] = ctl, rollouts

  def watch():
    while not done.wait(0.02):
      ctl = stats.get("ctl")  # steps done, from a host list (the learner owns the device state)
      stats["rss"].append((len(ctl.step_times) if ctl is not None else 0, _rss_mib()))

  watcher = threading.Thread(target=watch, daemon=True)
  watcher.start()
  with pytest.MonkeyPatch.context() as mp:
    inject(mp, slow_learner)
    c = tiny_config("pipeline", num_steps=LONG_STEPS, rl__queue_groups=QUEUE_GROUPS, rl__max_staleness=50,
                    checkpoint__every_steps=8)
    t0 = time.monotonic()
    summary = train_lib.train(c, tmp_path_factory.mktemp("slow-learner"))
    stats["wall_s"] = time.monotonic() - t0
  done.set()
  watcher.join()
  TALLY["long runs under load"] += 1
  return summary, stats


def waiting_bound(c) -> int:
  """The most finished groups that can wait for the learner: the queue's bound; the shares the learner asked for
  (one ahead of the one it waits on) in the sampler's outbox; and the book's stop (max(queue, a share) finished
  groups) plus every group open when admission stopped (decode slots and the waiting list, 2 * max_slots samples),
  which still finish."""
  return (QUEUE_GROUPS + 2 * c.rl.groups_per_step + max(QUEUE_GROUPS, c.rl.groups_per_step)
          + 2 * c.sampler.max_slots // c.rl.group_size)


def test_finished_groups_waiting_stop_admission(slow_learner_run):
  summary, stats = slow_learner_run
  c = tiny_config()
  assert summary["steps"] == LONG_STEPS
  assert stats["rollouts"].max_depth <= QUEUE_GROUPS  # never past its bound
  # The queue holds two shares, so the sampler is not held back by a blocked put: only the book's stop keeps it
  # from running the whole run's groups ahead of the learner under k = 50 (without it: 92 waiting, 2026-12-07).
  bound = waiting_bound(c)
  print(f"peak finished groups waiting {stats['peak_waiting']} (bound {bound})")
  assert c.rl.groups_per_step <= stats["peak_waiting"] <= bound, stats["peak_waiting"]


def test_samples_in_memory_and_rss_stay_bounded(slow_learner_run):
  summary, stats = slow_learner_run
  c = tiny_config()
  # Finished samples alive at once: the groups waiting, the learner's batch, and the open groups' samples.
  bound = (waiting_bound(c) + c.rl.groups_per_step) * c.rl.group_size + 2 * c.sampler.max_slots
  assert stats["peak_alive"] <= bound
  assert summary["ledger"]["samples_generated"] >= LONG_STEPS * 16  # many times what was ever held at once
  after_warmup = [rss for steps, rss in stats["rss"] if steps >= 4]
  growth = max(after_warmup) - after_warmup[0]
  print(f"peak samples alive {stats['peak_alive']} (bound {bound}); RSS growth {growth:.1f} MiB over "
        f"{LONG_STEPS - 4} steps ({after_warmup[0]:.0f} -> {max(after_warmup):.0f} MiB)")
  assert growth < RSS_GROWTH_LIMIT_MIB


def test_a_learner_faster_than_the_sampler_waits_without_spinning(tmp_path, monkeypatch):
  """The sampler sleeps 0.5 s before each decode call; over the sleeps during which the learner did no work (no
  train step, no publishing), the whole process (main thread, learner waiting on the queue, sampler) uses under
  IDLE_CPU_LIMIT of a core."""
  training, windows = [], []

  def slow_sampler(run):
    ctl, sampler = run.controller.learner_loop, run.controller.sampler_loop.sampler
    real_step, real_after_step, real_sampler_step = ctl.train_step, ctl._after_step, sampler.step

    def timed_train_step(state, batch, key):
      training.append([time.monotonic(), float("inf")])
      return real_step(state, batch, key)

    def timed_after_step(*args):  # publishing, metrics: the learner's work ends here
      real_after_step(*args)
      training[-1][1] = time.monotonic()

    def slow_sampler_step():
      w0, c0 = time.monotonic(), time.process_time()
      time.sleep(0.5)
      windows.append((w0, time.monotonic(), time.process_time() - c0))
      return real_sampler_step()

    ctl.train_step, ctl._after_step, sampler.step = timed_train_step, timed_after_step, slow_sampler_step

  inject(monkeypatch, slow_sampler)
  summary = train_lib.train(tiny_config("pipeline", checkpoint__every_steps=100), tmp_path)  # no saves mid-run
  assert summary["steps"] == NUM_STEPS
  idle = [(end - start, cpu) for start, end, cpu in windows
          if not any(t0 < end and start < t1 for t0, t1 in training)]
  wall, cpu = sum(w for w, _ in idle), sum(c for _, c in idle)
  print(f"{len(idle)} idle windows, {wall:.1f} s wall, {cpu:.3f} s CPU ({cpu / wall:.1%})")
  assert len(idle) >= 4
  assert cpu / wall < IDLE_CPU_LIMIT
