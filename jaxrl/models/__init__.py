"""Decoder models (Flax NNX) and checkpoint loaders."""

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder, KVCache, forward, forward_cached, init_cache, init_params

__all__ = ["Decoder", "KVCache", "ModelConfig", "forward", "forward_cached", "init_cache", "init_params"]
