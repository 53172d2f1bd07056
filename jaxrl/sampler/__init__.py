"""Rollout engine on the sampler submesh: decode slots with continuous batching, sampling, in-flight updates.

Read in the order a request flows: requests.py (a request, checked) -> sampler.py (the host loop) -> admission.py
(into a free slot) -> page_policy.py (where its keys/values go; page_allocator.py the pages) -> engine.py (the
device: dense_engine.py or paged_engine.py over slot_engine.py; decode.py, paged_kv.py, continuation.py the
programs; sampling.py the draw) -> stops.py (how a turn ends) -> multi_turn.py (episodes) -> samples.py (the
host's records, the rollout out). forced.py forces lengths for benchmarks.
"""

from jaxrl.sampler.engine import (
           DecodeState,
           DenseEngine,
           Engine,
           PagedEngine,
           Prefix,
           ResultTokens,
           SlotSettings,
           make_engine,
)
from jaxrl.sampler.requests import Request
from jaxrl.sampler.sampler import Sampler, SamplerStats
from jaxrl.sampler.sampling import filtered_logprobs, sample, sampling_logprobs

__all__ = ["DecodeState", "DenseEngine", "Engine", "PagedEngine", "Prefix", "Request", "ResultTokens", "Sampler",
           "SamplerStats", "SlotSettings", "filtered_logprobs", "make_engine", "sample", "sampling_logprobs"]
