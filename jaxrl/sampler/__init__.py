"""Rollout engine on the sampler submesh: decode slots with continuous batching, sampling, in-flight updates."""

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
