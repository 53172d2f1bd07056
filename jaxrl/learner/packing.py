"""Sequence packing: several samples per learner row, each its own segment, and the per-segment arithmetic.

A packed row holds up to G samples back to back, each a segment (ids 1..G in order, 0 for padding) whose
positions restart at 0; the decoder's attention never crosses segments. The per-sample arrays of a packed
Batch (rewards, group ids, sample mask) are [B, G]: column g describes the sample with segment id g + 1 in that
row. An unpacked Batch is the special case G = 1 with [B] arrays (make_batch).

Train cost follows the packed tokens: rows are filled first-fit decreasing under the token budget L, and the
row count is rounded up to one of a few buckets so that the train step compiles once per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxrl.rollout import Batch, Rollout, check_fits, fill_batch


def row_buckets(batch_size: int, unit: int = 1) -> tuple[int, ...]:
  """Row counts a packed batch may have: unit x (1, 2, 3, 4, 6, 8, 12, ...) below batch_size, then batch_size.

  Steps of at most 1.5x waste at most a third of a bucket's rows; about 2 log2(batch_size / unit) compilations.
  """
  if unit < 1 or batch_size < unit or batch_size % unit:
    raise ValueError(f"batch_size={batch_size} must be a positive multiple of unit={unit}")
  sizes, p = set(), 1
  while unit * p < batch_size:
    sizes.update(n for n in (p, 3 * p // 2) if n and unit * n < batch_size)
    p *= 2
  return (*sorted(unit * n for n in sizes), batch_size)


def first_fit_decreasing(lengths: Sequence[int], budget: int, max_segments: int) -> list[list[int]]:
  """Sample indices per row: longest first, each into the first row with room (tokens and segment slots)."""
  rows: list[list[int]] = []
  room: list[int] = []
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    for r, free in enumerate(room):
      if free >= lengths[i] and len(rows[r]) < max_segments:
        rows[r].append(i)
        room[r] -= lengths[i]
        break
    else:
      rows.append([i])
      room.append(budget - lengths[i])
  return rows


def _bucket(rows: int, buckets: Sequence[int], seq_len: int) -> int:
  fits = [b for b in sorted(buckets) if b >= rows]
  if not fits:
    raise ValueError(f"the samples need {rows} packed rows of {seq_len} tokens, more than the largest row bucket "
                     f"{max(buckets, default=0)} that splits into its mini-batches")
  return fits[0]


def minibatch_members(num_samples: int, num_minibatches: int) -> list[list[int]]:
  """The samples of each mini-batch: sample i (in batch order) is in mini-batch i % num_minibatches, as row i of
  an unpacked batch is (jaxrl.learner.step)."""
  return [list(range(j, num_samples, num_minibatches)) for j in range(num_minibatches)]


def packed_rows(lengths: Sequence[int], seq_len: int, max_segments: int, buckets: Sequence[int],
                num_minibatches: int = 1) -> int:
  """Rows a batch of samples of these lengths (prompt + completion) takes packed: what a train step costs."""
  return _layout(lengths, seq_len, max_segments, buckets, num_minibatches)[1]


def _layout(lengths: Sequence[int], seq_len: int, max_segments: int, buckets: Sequence[int], num_minibatches: int):
  """(sample indices per row, rows): each mini-batch packed first-fit decreasing on its own and given the same
  number of rows; the rows interleaved so that row r holds mini-batch r % num_minibatches; as many rows as the
  smallest bucket (a multiple of num_minibatches) that holds them."""
  m = num_minibatches
  packs = [[[members[i] for i in row] for row in first_fit_decreasing([lengths[i] for i in members], seq_len,
                                                                      max_segments)]
           for members in minibatch_members(len(lengths), m)]
  rows = _bucket(m * max(map(len, packs)), [b for b in buckets if b % m == 0], seq_len)
  layout = [[] for _ in range(rows)]
  for j, pack in enumerate(packs):
    for i, row in enumerate(pack):
      layout[i * m + j] = row
  return layout, rows


def pack_batch(rollouts: Sequence[Rollout], seq_len: int, buckets: Sequence[int], max_segments: int,
               pad_id: int = 0, num_minibatches: int = 1) -> Batch:
  """Packs rollouts into rows of seq_len tokens, as many rows as the smallest bucket that holds them; per-sample
  arrays are [rows, max_segments]. Rollout i is in mini-batch i % num_minibatches, and each mini-batch is packed
  (first-fit decreasing) into rows of its own, row r holding mini-batch r % num_minibatches: the mini-batches of
  the unpacked batch of the same rollouts (make_batch). Raises ValueError naming a sample that does not fit a row
  or a batch that no bucket holds."""
  if max_segments < 1:
    raise ValueError(f"max_segments must be >= 1 (got {max_segments})")
  check_fits(rollouts, seq_len)
  layout, rows = _layout([r.num_tokens for r in rollouts], seq_len, max_segments, buckets, num_minibatches)
  placements = []
  for row, members in enumerate(layout):
    start = 0
    # Rollout order within a row (not length order) keeps a group's samples in index order, as make_batch does.
    for slot, i in enumerate(sorted(members)):
      placements.append((rollouts[i], row, start, slot + 1, (row, slot)))
      start += rollouts[i].num_tokens
  return fill_batch(placements, rows, seq_len, (rows, max_segments), pad_id)


def to_tokens(values_BxG: jax.Array, segment_ids_BxL: jax.Array, fill=0) -> jax.Array:
  """Each token's entry of its sample's value ([B] or [B, G] per-sample values); `fill` on padding."""
  values_BxG = values_BxG.reshape(values_BxG.shape[0], -1)
  slot = jnp.clip(segment_ids_BxL - 1, 0, values_BxG.shape[1] - 1)
  return jnp.where(segment_ids_BxL > 0, jnp.take_along_axis(values_BxG, slot, axis=1), fill)


def segment_sums(x_BxL: jax.Array, segment_ids_BxL: jax.Array | None) -> jax.Array:
  """Sum of x over each token's segment, at every token of it: the per-sample sums of a packed row.

  segment_ids None: one sample per row (the row sum, [B, 1]). All per-sample aggregation (sequence means,
  sequence-level ratios and importance weights) goes through here, so packed and unpacked rows agree.
  """
  if segment_ids_BxL is None:
    return x_BxL.sum(axis=1, keepdims=True)
  b, l = x_BxL.shape
  ids = (jnp.arange(b)[:, None] * (l + 1) + segment_ids_BxL).reshape(-1)
  return jax.ops.segment_sum(x_BxL.reshape(-1), ids, b * (l + 1))[ids].reshape(b, l)
