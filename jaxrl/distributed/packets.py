"""Finished rollout groups as one int32 array (a packet), so that they can cross hosts as a JAX array, bit for bit.

Row layout, one row per sample, T = the sampler's max_len:
  [prompt_len, completion_len, group_id, sample_index, finish_reason, correct, reward (float64 as 2 int32),
   temperature and top_p (float64 as 2 int32 each), top_k, greedy (the distribution the tokens were drawn from,
   which the learner checks against its own), left_out (LEFT_OUT index: the sampler side's reason to leave the group
   out), routed layers N and experts per token K (0 and 0: a dense model), tokens[T] (prompt then completion),
   logprobs[T] (float32 bits, on completion positions), versions[T], then, for a mixture-of-experts policy (routing
   replay), experts[T, N, K] (int16 pairs in int32 words, -1 where nothing was recorded), by input position: the
   prompt's inputs before its last token hold Rollout.prompt_experts, the last prompt token and the completion's
   Rollout.experts]
An environment's observation tokens (loss mask 0) carry version -1, which is how their mask crosses. A packet says
its own routing shape (every sample of a packet has the same), so its width is the same for every packet of a run.
Only what the learner reads crosses: the prompt text and reward metadata stay on the sampler.
"""

from __future__ import annotations

import numpy as np

from jaxrl.rollout import Rollout, SamplingParams

FINISH_REASONS = ("eos", "stop", "length", "cancelled")
LEFT_OUT = (None, "surplus")  # Rollout.left_out
_HEAD = 17  # columns before tokens


def packet_width(max_len: int, routing: tuple[int, int] | None = None) -> int:
  """Columns of a packet: routing is (layers, experts per token) of a mixture-of-experts policy, None for dense."""
  return _HEAD + 3 * max_len + _route_words(max_len, routing)


def _route_words(max_len: int, routing: tuple[int, int] | None) -> int:
  return 0 if routing is None else -(-max_len * routing[0] * routing[1] // 2)  # int16 pairs, the last padded


def _routing_of(rows) -> tuple[int, int] | None:
  """The one routing shape of these samples (None: dense); ValueError if they disagree."""
  shapes = set()
  for r in rows:
    routed = [e for e in (r.experts, r.prompt_experts) if e is not None]
    shapes |= {tuple(np.shape(e)[1:]) for e in routed} if routed else {None}
  if len(shapes) > 1:
    raise ValueError(f"samples of one packet must share a routing shape (layers, experts per token): {shapes}")
  return shapes.pop() if shapes else None


def encode(groups: list[list[Rollout]], max_len: int) -> np.ndarray:
  """int32 [samples, packet_width(max_len, routing)] (routing: the samples' Rollout.experts shape, None if they carry
  none); raises ValueError for a sample longer than max_len."""
  rows = [r for g in groups for r in g]
  routing = _routing_of(rows)
  out = np.zeros((len(rows), packet_width(max_len, routing)), np.int32)
  tok, lp, ver = _HEAD, _HEAD + max_len, _HEAD + 2 * max_len  # first column of each per-token block
  experts = None if routing is None else np.full((max_len, *routing), -1, np.int16)
  for i, r in enumerate(rows):
    p, c = len(r.prompt_tokens), len(r.completion_tokens)
    if p + c > max_len:
      raise ValueError(f"group {r.group_id} sample {r.sample_index} has {p + c} tokens, more than max_len={max_len}")
    if np.any((np.asarray(r.versions) < 0) != ~r.model_mask):
      raise ValueError(f"group {r.group_id} sample {r.sample_index}: exactly the observation tokens (loss mask 0) "
                       "must carry version -1")
    correct = -1 if "correct" not in r.meta else int(bool(r.meta["correct"]))
    out[i, :6] = (p, c, r.group_id, r.sample_index, FINISH_REASONS.index(r.finish_reason), correct)
    out[i, 6:8] = np.array([r.reward], np.float64).view(np.int32)
    sp = r.sampling
    out[i, 8:12] = np.array([sp.temperature, sp.top_p], np.float64).view(np.int32)
    out[i, 12:17] = (sp.top_k, int(sp.greedy), LEFT_OUT.index(r.left_out), *(routing or (0, 0)))
    out[i, tok : tok + p] = r.prompt_tokens
    out[i, tok + p : tok + p + c] = r.completion_tokens
    out[i, lp + p : lp + p + c] = np.asarray(r.logprobs, np.float32).view(np.int32)
    out[i, ver + p : ver + p + c] = r.versions
    if experts is not None:  # the learner's routing replay reads them: dropped, it would silently route afresh
      experts[:] = -1
      if r.prompt_experts is not None:
        experts[: p - 1] = r.prompt_experts
      if r.experts is not None:
        experts[p - 1 : p - 1 + c] = r.experts
      out[i, ver + max_len :] = _int16_words(experts)
  return out


def _int16_words(x: np.ndarray) -> np.ndarray:
  flat = x.reshape(-1)
  if flat.size % 2:
    flat = np.concatenate([flat, np.full(1, -1, np.int16)])
  return flat.view(np.int32)


def decode(packet: np.ndarray, max_len: int) -> list[list[Rollout]]:
  """The groups of a packet, in order (consecutive rows of one group id form a group)."""
  packet = np.asarray(packet, np.int32)
  routing = None
  if packet.ndim == 2 and len(packet) and packet.shape[1] >= _HEAD:  # the first row says the packet's routing
    layers, k = (int(v) for v in packet[0, 15:17])
    routing = (layers, k) if layers else None
  if packet.ndim != 2 or packet.shape[1] != packet_width(max_len, routing):
    raise ValueError(f"packet of shape {packet.shape} does not match max_len={max_len} "
                     f"(expected [rows, {packet_width(max_len, routing)}], routing {routing})")
  groups: list[list[Rollout]] = []
  for row in packet:
    p, c, gid, index, reason, correct = (int(v) for v in row[:6])
    temperature, top_p = row[8:12].copy().view(np.float64)
    tokens = row[_HEAD : _HEAD + max_len]
    logprobs = row[_HEAD + max_len : _HEAD + 2 * max_len].view(np.float32)
    versions = row[_HEAD + 2 * max_len : _HEAD + 3 * max_len]
    experts = prompt_experts = None
    if routing is not None:
      if tuple(row[15:17]) != routing:
        raise ValueError(f"group {gid} sample {index}: routing shape {tuple(row[15:17])} in a packet of {routing}")
      words = row[_HEAD + 3 * max_len :].view(np.int16)
      block = words[: max_len * routing[0] * routing[1]].reshape(max_len, *routing)
      experts = block[p - 1 : p - 1 + c].copy()
      prompt_experts = block[: p - 1].copy() if (block[: p - 1] >= 0).any() else None  # none recorded: None
    meta = {} if correct < 0 else {"correct": bool(correct)}
    observed = versions[p : p + c] < 0  # observation tokens of a multi-turn episode
    r = Rollout(prompt_tokens=tokens[:p].copy(), completion_tokens=tokens[p : p + c].copy(),
                logprobs=logprobs[p : p + c].copy(), versions=versions[p : p + c].copy(),
                finish_reason=FINISH_REASONS[reason], group_id=gid, sample_index=index,
                reward=float(row[6:8].copy().view(np.float64)[0]), meta=meta,
                loss_mask=(~observed).astype(np.float32) if observed.any() else None,
                sampling=SamplingParams(temperature=float(temperature), top_k=int(row[12]), top_p=float(top_p),
                                        greedy=bool(row[13])), left_out=LEFT_OUT[int(row[14])], experts=experts,
                prompt_experts=prompt_experts)
    if groups and groups[-1][0].group_id == gid:
      groups[-1].append(r)
    else:
      groups.append([r])
  return groups
