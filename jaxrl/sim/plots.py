"""PNG plots of simulated runs and plans (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from jaxrl.sim.planner import Plan  # noqa: E402
from jaxrl.sim.simulate import SimResult  # noqa: E402

_COLORS = {"decode": "tab:blue", "train": "tab:orange", "sync": "tab:gray"}


def timeline(result: SimResult, path: str, max_engines: int = 16):
  """Per-lane busy spans (engines and learner); white is idle."""
  lanes = [f"engine {i}" for i in range(min(result.engines, max_engines))] + ["learner"]
  fig, ax = plt.subplots(figsize=(11, 0.35 * len(lanes) + 1.5))
  for y, lane in enumerate(lanes):
    spans = [(s, e - s, k) for ln, k, s, e in result.timeline if ln == lane]
    for kind in _COLORS:
      bars = [(s, w) for s, w, k in spans if k == kind]
      if bars:
        ax.broken_barh(bars, (y - 0.4, 0.8), color=_COLORS[kind], label=kind)
  handles = {h.get_label(): h for h in ax.get_legend_handles_labels()[0]}
  ax.legend(handles.values(), handles.keys(), loc="upper right", fontsize=8)
  ax.axvspan(*result.window_s, color="tab:green", alpha=0.06)
  ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
  ax.set_xlabel("seconds")
  ax.set_title(f"{result.mode}: {result.spec.sampler_devices} sampler / {result.spec.learner_devices} learner "
               f"devices, step {result.step_time_s:.1f} s (shaded: measured window)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _by_split(plan: Plan, field: str):
  series = {}
  for r in plan.feasible:
    series.setdefault((r.batch_size, r.max_staleness), []).append((r.sampler_devices, getattr(r, field)))
  return series


def vs_split(plan: Plan, field: str, ylabel: str, path: str):
  """One line per (batch size, k): `field` of the plan rows against sampler devices."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for (b, k), pts in sorted(_by_split(plan, field).items()):
    xs, ys = zip(*sorted(pts), strict=True)
    ax.plot(xs, ys, marker="o", label=f"batch {b}, k={k}")
  if field == "speedup":
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_xlabel(f"sampler devices (of {plan.pool})")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def speedup_vs_length(mean_lengths: Sequence[float], speedups: Sequence[float], path: str, label: str = ""):
  """Best pipeline speedup over sync against the mean response length."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  ax.plot(mean_lengths, speedups, marker="o", label=label or None)
  ax.axhline(1.0, color="k", lw=0.8, ls="--")
  ax.set_xscale("log")
  ax.set_xlabel("mean response length (tokens)")
  ax.set_ylabel("best pipeline speedup over sync (trained tokens/s)")
  ax.grid(alpha=0.3)
  if label:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
