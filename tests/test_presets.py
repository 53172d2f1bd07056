"""Model presets by name: each one's decoder has the published parameter count, and `model.preset` replaces a
config's model shape without reading any weights."""

import math

import jax
import pytest

from jaxrl import config as config_lib
from jaxrl.controller import build as build_lib
from jaxrl.models.hf import abstract_params
from jaxrl.models.presets import PRESETS, PUBLISHED


def count(cfg, *, embedding=True) -> int:
  """Parameters of the decoder built from cfg (abstract: nothing allocated)."""
  params = abstract_params(cfg)[1]
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  return total if embedding else total - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)


def tolerance(published: float) -> float:
  """1%, or the published figure's own rounding where it says less (Qwen3-1.7B's "1.7B" is 1.72B)."""
  digits = len(f"{published:g}".split(".")[1]) if "." in f"{published:g}" else 0
  return max(0.01 * published, 0.5 * 10.0**-digits)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_has_the_published_parameter_count(name):
  c = config_lib.validate(config_lib.override(config_lib.base(), **{"model.preset": name}))
  cfg = build_lib.model_config(c.model, c.sampler.max_len, platform="tpu")
  total, non_embedding = PUBLISHED[name]
  assert abs(count(cfg) / 1e9 - total) <= tolerance(total)
  if non_embedding is not None:  # Qwen's cards: the count without the embedding (and a tied head), within 1%
    assert abs(count(cfg, embedding=False) / 1e9 / non_embedding - 1) <= 0.01


def test_preset_replaces_the_shape_and_keeps_the_run_settings():
  c = config_lib.validate(config_lib.override(config_lib.base(), **{"model.preset": "qwen2.5-7b", "model.remat": True}))
  cfg = build_lib.model_config(c.model, c.sampler.max_len, platform="tpu")
  assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (3584, 28, 28, 4,
                                                                                              152064)
  assert cfg.attention_bias and not cfg.tie_embeddings and cfg.architecture == "qwen2"
  assert cfg.remat and cfg.dtype == "bfloat16"  # the run's settings; "auto" dtype is bf16 on a TPU
  assert build_lib.model_config(c.model, c.sampler.max_len, platform="cpu").dtype == "float32"
  here = build_lib.model_config(c.model, c.sampler.max_len)
  assert build_lib.model_source(c.model, c.sampler.max_len) == (here, None, None)  # random weights: no folder read


def test_unknown_preset_is_one_line_naming_it():
  with pytest.raises(config_lib.ConfigError, match=r"model.preset='qwen9-1b'; known: \[.*'qwen2.5-0.5b'"):
    config_lib.validate(config_lib.override(config_lib.base(), **{"model.preset": "qwen9-1b"}))
