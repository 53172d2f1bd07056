"""For the tests that compare the learner with the sampler: small random params, and groups of two samples of
random prompts run through a Sampler to the end."""

import jax
import jax.numpy as jnp
import numpy as np


def random_params(tree, seed: int, std: float):
  """Every leaf of a params tree (arrays or ShapeDtypeStructs) drawn anew, norm scales near 1. Small weights keep
  the logits small: the sampler's decode path and the learner's full forward then agree to float32 rounding."""
  rng = np.random.default_rng(seed)
  leaf = lambda path, x: jnp.asarray(("scale" in jax.tree_util.keystr(path)) + std * rng.standard_normal(x.shape),
                                     x.dtype)
  return jax.tree_util.tree_map_with_path(leaf, tree)


def run_groups(sampler, sampling, *, groups: int, vocab_size: int, seed: int, max_prompt: int, max_tokens: int,
               rewards: bool = True) -> list:
  """The finished rollouts of `groups` groups (prompts of 2 to max_prompt - 1 tokens drawn from `seed`), sorted by
  (group, sample); with `rewards`, sample i in finishing order is rewarded i % 3."""
  rng = np.random.default_rng(seed)
  for g in range(groups):
    sampler.submit(rng.integers(2, vocab_size, rng.integers(2, max_prompt)).tolist(), group_id=g, n=2,
                   sampling=sampling, max_tokens=max_tokens)
  out = []
  while sampler.num_active or sampler.num_waiting:
    out += sampler.step()
  if rewards:
    for i, r in enumerate(out):
      r.reward = float(i % 3)
  return sorted(out, key=lambda r: (r.group_id, r.sample_index))
