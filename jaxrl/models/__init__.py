"""Decoder models (Flax NNX) and checkpoint loaders."""

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import (
           Decoder,
           KVCache,
           PagedKVCache,
           forward,
           forward_cached,
           init_cache,
           init_paged_cache,
           init_params,
)

__all__ = ["Decoder", "KVCache", "ModelConfig", "PagedKVCache", "forward", "forward_cached", "init_cache",
           "init_paged_cache", "init_params"]
