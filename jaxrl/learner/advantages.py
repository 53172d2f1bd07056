"""Per-sample advantages from rewards: GRPO, Dr.GRPO, RLOO, REINFORCE with a batch-mean baseline.

Groups are the samples sharing a group id (any int32 values, in any row order). Rows with sample_mask 0 are
padding: they get advantage 0 and never enter a group statistic, whatever their reward holds (NaN included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.learner.config import LossConfig


def _dense_groups(group_ids_B: jax.Array) -> jax.Array:
  """Maps arbitrary group ids to segment ids 0..G-1 (sort based: O(B log B), no BxB matrix)."""
  order = jnp.argsort(group_ids_B, stable=True)
  ids = group_ids_B[order]
  starts = jnp.concatenate([jnp.ones((1,), jnp.int32), (ids[1:] != ids[:-1]).astype(jnp.int32)])
  return jnp.zeros_like(group_ids_B).at[order].set(jnp.cumsum(starts) - 1)


def _group_moments(rewards_B, group_ids_B, sample_mask_B):
  """Per-row (group size, group mean, group variance with ddof=0), over valid rows only."""
  valid = sample_mask_B > 0
  seg = _dense_groups(group_ids_B)
  n = rewards_B.shape[0]
  r = jnp.where(valid, rewards_B, 0.0)
  count = jax.ops.segment_sum(valid.astype(jnp.float32), seg, n)[seg]
  mean = jax.ops.segment_sum(r, seg, n)[seg] / jnp.maximum(count, 1.0)
  var = jax.ops.segment_sum(jnp.where(valid, (r - mean) ** 2, 0.0), seg, n)[seg] / jnp.maximum(count, 1.0)
  return count, mean, var


def grpo_advantages(rewards_B, group_ids_B, sample_mask_B, eps: float = 1e-6):
  """(r - group mean) / (group std + eps)."""
  _, mean, var = _group_moments(rewards_B, group_ids_B, sample_mask_B)
  return jnp.where(sample_mask_B > 0, (rewards_B - mean) / (jnp.sqrt(var) + eps), 0.0)


def dr_grpo_advantages(rewards_B, group_ids_B, sample_mask_B):
  """r - group mean (Dr.GRPO drops the std division)."""
  _, mean, _ = _group_moments(rewards_B, group_ids_B, sample_mask_B)
  return jnp.where(sample_mask_B > 0, rewards_B - mean, 0.0)


def rloo_advantages(rewards_B, group_ids_B, sample_mask_B):
  """r - mean of the group's other samples = n / (n - 1) * (r - group mean); 0 for a group of one."""
  count, mean, _ = _group_moments(rewards_B, group_ids_B, sample_mask_B)
  scale = jnp.where(count > 1, count / jnp.maximum(count - 1, 1.0), 0.0)
  return jnp.where(sample_mask_B > 0, scale * (rewards_B - mean), 0.0)


def reinforce_advantages(rewards_B, sample_mask_B):
  """r - mean reward of the batch's valid samples."""
  valid = sample_mask_B > 0
  r = jnp.where(valid, rewards_B, 0.0)
  mean = r.sum() / jnp.maximum(valid.sum(), 1)
  return jnp.where(valid, rewards_B - mean, 0.0)


def compute_advantages(rewards_B, group_ids_B, sample_mask_B, cfg: LossConfig):
  rewards_B = rewards_B.astype(jnp.float32)
  if cfg.advantage == "grpo":
    return grpo_advantages(rewards_B, group_ids_B, sample_mask_B, cfg.adv_eps)
  if cfg.advantage == "dr_grpo":
    return dr_grpo_advantages(rewards_B, group_ids_B, sample_mask_B)
  if cfg.advantage == "rloo":
    return rloo_advantages(rewards_B, group_ids_B, sample_mask_B)
  return reinforce_advantages(rewards_B, sample_mask_B)
