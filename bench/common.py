"""Pieces the CPU benchmarks share."""

from __future__ import annotations

import jax
from flax import nnx

from jaxrl.models import Decoder, ModelConfig


def random_model(hidden: int, max_len: int, layers: int = 4):
  """(cfg, params) of the benchmarks' random decoder: `layers` layers of width `hidden`, head_dim 32, vocab 512."""
  cfg = ModelConfig.tiny(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                         num_heads=hidden // 32, num_kv_heads=max(1, hidden // 64), head_dim=32,
                         max_position_embeddings=max_len)
  return cfg, jax.jit(lambda: nnx.split(Decoder(cfg, nnx.Rngs(0)))[1])()


def write_json(path, report: dict) -> None:
  """Writes a benchmark's report (numpy scalars as floats) and says where on stderr."""
  import json
  import sys
  from pathlib import Path

  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report, indent=2, default=float) + "\n")
  print(f"wrote {path}", file=sys.stderr)
