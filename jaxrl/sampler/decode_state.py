"""What lives on the sampler's devices between calls: the decode state of every slot, a prefilled prompt, and
what one generate call returns. Both caches (dense, paged) share these types; only `DecodeState.cache` differs."""

from __future__ import annotations

import flax.struct
import jax

from jaxrl.models import KVCache, PagedKVCache


@flax.struct.dataclass
class SlotSettings:
  """Per-request decoding settings; in the decode state every field has a leading slot axis."""

  key: jax.Array  # uint32 raw key data of the request's rng; token t is drawn with fold_in(key, t)
  temperature: jax.Array  # float32
  top_k: jax.Array  # int32
  top_p: jax.Array  # float32
  greedy: jax.Array  # bool
  max_new: jax.Array  # int32, completion tokens allowed
  stop_ids: jax.Array  # int32 [..., max_stop_ids], -1 padded; generating one of them ends the sample


@flax.struct.dataclass
class DecodeState:
  cache: KVCache | PagedKVCache  # [N, S, T, K, D] | a pool of pages ([N, P, Z, K, D] or [K, N, P, Z, D]) + tables
  tokens_SxT: jax.Array  # int32, prompt then completion
  pos_S: jax.Array  # int32, position of the last token (its logits are computed next)
  active_S: jax.Array  # bool
  num_generated_S: jax.Array  # int32
  settings: SlotSettings


@flax.struct.dataclass
class Prefix:
  """A prefilled prompt: its keys/values over a length bucket, ready to be inserted into any number of slots."""

  cache: KVCache  # [L, 1, bucket, K, D]
  tokens_P: jax.Array  # int32 [bucket], the prompt right-padded with 0
  length: jax.Array  # int32 scalar, the true prompt length
  version: int = flax.struct.field(pytree_node=False, default=0)
  # int16 [bucket, N, k] of a mixture-of-experts model (None: dense): the experts each layer routed each prompt
  # position through, as the prefill computed the keys/values the slot reads (Rollout.prompt_experts)
  experts_PxNxK: jax.Array | None = None


@flax.struct.dataclass
class ResultTokens:
  """What one generate call produced: entry [s, i] is slot s's token from decode step i (if valid)."""

  tokens_SxK: jax.Array
  logprobs_SxK: jax.Array
  valid_SxK: jax.Array  # the slot was active at that step
  done_S: jax.Array  # the slot finished within this call (stop id or max tokens or full cache)
  version: jax.Array  # int32 scalar: the policy version of the params of this call
  # int16 [S, C, N, k] of a mixture-of-experts model (None: dense): the experts each layer routed the input of step
  # i through (the token before the one drawn), k per token, -1 on a dense layer
  experts_SxCxNxK: jax.Array | None = None
