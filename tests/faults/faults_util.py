"""Shared pieces of the fault tests: the tiny run they all use, child processes running the real CLI, fault
injection into a built Run, and the replay of a run's trace.jsonl across kills and resumes."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 6  # every run but the long load run: the optimizer schedule (and so the compiled step) depends on it
# The tiny config as every fault test runs it: one CPU device per role (the machine has two cores), a trace.
BASE = {"num_steps": NUM_STEPS, "mesh.num_devices": 2, "mesh.sampler_devices": 1, "checkpoint.every_steps": 2,
        "log.tensorboard": False, "log.progress": False, "log.trace": True}
# Child processes compile the same programs as the parent (same devices, same matmul precision) and share its
# persistent compilation cache (conftest.py fills in the folder).
CHILD_ENV = {"JAX_NUM_CPU_DEVICES": "8", "JAX_DEFAULT_MATMUL_PRECISION": "highest", "TF_CPP_MIN_LOG_LEVEL": "3",
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
             "JAXRL_RUN_SECRET": "f" * 64}  # a learner and its samplers started apart share the run's secret
TALLY: collections.Counter[str] = collections.Counter()  # printed at the end of the session


def _tiny_module():
  spec = importlib.util.spec_from_file_location("tiny_config", REPO / "configs" / "tiny.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# A text task for the tiny model: a word-level tokenizer, a chat template, questions that fit sampler.max_len=32
# (GOOD) and one that does not (LONG: skipped, counted).
WORDS = ["<unk>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "What", "is", "+", "?", "####", *"0123456789",
         "plus", "and", "then", "a", "lot", "more", "words", "here"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GOOD = [{"question": f"What is {a} + {b} ?", "answer": f"{a} plus {b} #### {a + b}"}
        for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (4, 4), (7, 1), (2, 5)]]
LONG = {"question": "What is 1 + 2 ? " + "and then a lot more words here " * 5, "answer": "#### 3"}  # > 32 tokens


def hf_folder(path: Path, chat_template: bool) -> Path:
  """A tiny random model as a HF folder, the same shapes as configs/tiny.py's, with a word-level tokenizer."""
  from flax import nnx
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  from jaxrl.models import Decoder, ModelConfig, hf

  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(WORDS[:5])
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")
  if chat_template:
    tokenizer.chat_template = TEMPLATE
  tokenizer.save_pretrained(path.parent / f"{path.name}-tokenizer")
  cfg = ModelConfig.tiny(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=32, eos_token_ids=(2,))
  hf.save_params(path, cfg, nnx.split(Decoder(cfg, nnx.Rngs(0)))[1], path.parent / f"{path.name}-tokenizer")
  return path


def tiny_variant(path: Path, **fields) -> Path:
  """A config file at `path`: configs/tiny.py with `fields` (dotted keys, `__` standing for `.`) set in Python,
  for what a command line cannot set (keys the tiny config's task.kwargs does not have)."""
  sets = "".join(f"  c.{k.replace('__', '.')} = {v!r}\n" for k, v in fields.items())
  path.write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'configs')!r})\nimport tiny\n\n\n"
                  f"def get_config(arg=None):\n  c = tiny.get_config(arg)\n{sets}  return c\n")
  return path


def tiny_config(mode: str = "pipeline", **overrides):
  """configs/tiny.py with BASE and `overrides` (dotted keys, `__` standing for `.`) applied."""
  from jaxrl.config import override

  return override(_tiny_module().get_config(mode), **{**BASE, **overrides})  # overrides applied last


def cli(workdir: Path, mode: str = "pipeline", **overrides) -> list[str]:
  """The `python -m jaxrl.train` command line of tiny_config(mode, **overrides)."""
  flags = {**BASE, **{k.replace("__", "."): v for k, v in overrides.items()}}
  return [sys.executable, "-m", "jaxrl.train", f"--config=configs/tiny.py:{mode}", f"--workdir={workdir}",
          *(f"--config.{k}={v}" for k, v in flags.items())]


def child_env() -> dict[str, str]:
  return {**os.environ, **CHILD_ENV, "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)])}


def inject(monkeypatch, fn=None) -> dict:
  """Makes train() build its Run (train.build_run) through `fn(run)`, which wraps pieces of it before the loop
  starts; the returned dict holds the last Run built under "run"."""
  from jaxrl import train as train_lib

  real, built = train_lib.build_run, {}

  def build(c, workdir):
    built["run"] = run = real(c, workdir)
    if fn is not None:
      fn(run)
    return run

  monkeypatch.setattr(train_lib, "build_run", build)
  return built


def run_cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run(args, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout)


def start_child(args: list[str], log: Path, **env) -> subprocess.Popen:
  """Starts a child with its stderr in `log` (a pipe nobody reads could fill up and block it)."""
  with open(log, "ab") as f:
    proc = subprocess.Popen(args, cwd=REPO, env={**child_env(), **env}, stdout=subprocess.DEVNULL, stderr=f)
  proc.log = log
  return proc


def kill(proc: subprocess.Popen) -> None:
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  TALLY["processes SIGKILLed"] += 1


def wait_for(cond, proc: subprocess.Popen | None = None, timeout: float = 180, what: str = "condition") -> None:
  deadline = time.monotonic() + timeout
  while not cond():
    if proc is not None and proc.poll() is not None:
      raise AssertionError(f"child exited ({proc.returncode}) before {what}: {proc.log.read_text()[-3000:]}")
    if time.monotonic() > deadline:
      raise AssertionError(f"no {what} within {timeout} s")
    time.sleep(0.01)


def count_lines(path: Path) -> int:
  try:
    with open(path, "rb") as f:
      return f.read().count(b"\n")
  except FileNotFoundError:
    return 0


def committed_steps(workdir: Path) -> list[int]:
  """Steps whose save completed: their commit marker is written (a kill between Orbax's rename and the marker
  leaves a step that a resume rejects)."""
  from jaxrl.integrity import MARKER

  d = Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / MARKER).exists()) if d.is_dir() else []


def params_finite(params) -> bool:
  return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(params))


def params_digest(params) -> list[bytes]:
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(params)]


# ---- trace replay -----------------------------------------------------------------------------------------------


def read_trace(path: Path) -> list[dict]:
  """Events of workdir/trace.jsonl. A line a SIGKILL cut short (ended by the next attempt) is left out; it can only
  be the last line before a "start" event, or the last line of the file."""
  lines = Path(path).read_text().split("\n")
  events = []
  for i, line in enumerate(lines):
    try:
      events.append(json.loads(line))
    except json.JSONDecodeError:
      later = next((x for x in lines[i + 1 :] if x), None)
      assert later is None or json.loads(later)["event"] == "start", f"trace line {i + 1} is corrupt: {line!r}"
  return events


def replay(events: list[dict]) -> tuple[list[dict], list[tuple[dict, dict]]]:
  """(kept, rolled_back): the events that make up the run's history, and (train event, next start) pairs a kill
  undid. Each attempt starts with a "start" event; an attempt's events count up to the checkpoint the next
  attempt resumed from (all of them for the last attempt)."""
  attempts = []
  for e in events:
    if e["event"] == "start":
      attempts.append([])
    attempts[-1].append(e)
  kept, rolled_back = [], []
  for cur, nxt in zip(attempts, [*attempts[1:], None], strict=True):
    if nxt is None:
      kept += cur
      break
    start = nxt[0]
    resumed = {"version": start["version"], "next_group_id": start["next_group_id"],
               "pending": sorted(start["regenerate"])}
    cuts = [i for i, e in enumerate(cur) if e["event"] == "checkpoint"
            and {k: e[k] for k in ("version", "next_group_id", "pending")} == resumed]
    if cuts:
      cut = cuts[-1] + 1
    else:  # nothing saved by this attempt: the next one resumed from where this one had
      first = cur[0]
      assert (first["version"], first["next_group_id"], sorted(first["regenerate"])) == tuple(resumed.values()), (
          f"attempt resumed from {resumed}, which no earlier checkpoint or start matches")
      cut = 0
    kept += cur[:cut]
    rolled_back += [(e, start) for e in cur[cut:] if e["event"] == "train"]
  return kept, rolled_back


def groups_per_step(events: list[dict]) -> list[list[int]]:
  """The groups each applied step of a run's history trained (sorted), in step order."""
  kept, _ = replay(events)
  return [sorted({s[0] for s in e["samples"]}) for e in kept if e["event"] == "train" and e["applied"]]


def check_history(events: list[dict], summary: dict, group_size: int) -> dict[str, int]:
  """Asserts that a run's history (across kills) trained no sample twice and accounts for every group: trained,
  dropped with a reason, skipped, or pending (in flight) at the final checkpoint. Returns its counts."""
  kept, rolled_back = replay(events)
  trained = [tuple(s[:2]) for e in kept if e["event"] == "train" and e["applied"] for s in e["samples"]]
  assert len(trained) == len(set(trained)), "a sample was trained twice"
  trained_groups = collections.Counter(g for g, _ in trained)
  assert all(n == group_size for n in trained_groups.values()), "a group was trained in part"
  dropped = collections.Counter()
  dropped_groups = {}
  for e in kept:
    if e["event"] == "drop":
      dropped[e["reason"]] += group_size
      dropped_groups[e["group"]] = e["reason"]
    elif e["event"] == "train" and not e["applied"]:
      for g in {s[0] for s in e["samples"]}:
        dropped["update_skipped"] += group_size
        dropped_groups[g] = "update_skipped"
  skipped = {e["group"] for e in kept if e["event"] == "skip_prompt"}
  final = kept[-1]
  assert final["event"] == "end", "the last attempt did not end cleanly"
  pending = set(final["pending"])
  unadmitted = set(final["unadmitted"])  # positions no sampler reached yet (a job's samplers interleave)
  outcomes = [set(trained_groups), set(dropped_groups), skipped, pending, unadmitted]
  assert sum(map(len, outcomes)) == len(set().union(*outcomes)), "a group has two outcomes"
  assert set().union(*outcomes) == set(range(final["next_group_id"])), "a group was lost"
  for e, start in rolled_back:  # a kill undid this step: its groups are generated and trained again
    for g in {s[0] for s in e["samples"]}:
      assert g in start["regenerate"] or g in start["unadmitted"] or g >= start["next_group_id"], (
          f"group {g} was trained, then forgotten")
  led = summary["ledger"]
  assert led["samples_trained"] == len(trained)
  assert {k: v for k, v in led["dropped"].items() if v} == dict(dropped)
  assert led["skipped_prompts"] == len(skipped)
  regenerated = sum(len(e["regenerate"]) for e in kept if e["event"] == "start")
  assert led["samples_regenerated"] == regenerated * group_size
  assert led["groups_admitted"] == len(trained_groups) + len(dropped_groups) + len(pending)
  assert led["samples_generated"] == (led["samples_trained"] + sum(dropped.values()) + summary["samples_in_flight"]
                                     + led["samples_discarded_at_resume"] + sum(led["samples_refused"].values()))
  return {"attempts": sum(e["event"] == "start" for e in events), "trained": len(trained),
          "rolled_back_steps": len(rolled_back), "regenerated_groups": regenerated}
