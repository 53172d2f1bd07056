"""The learner-to-sampler path inside one process: the weight publisher, newest versioned params only."""

from __future__ import annotations

import threading
from collections.abc import Callable

from jaxrl.sharding import Versioned, transfer


class WeightPublisher:
  """Holds the newest params for the sampler: the learner publishes, the sampler takes between decode steps."""

  def __init__(self, dst_shardings, dtype=None, on_publish: Callable[[Versioned], None] | None = None,
               weight_dtype: str = "float"):
    self._dst = dst_shardings
    self._dtype, self._weight_dtype = dtype, weight_dtype
    self._lock = threading.Lock()
    self._latest: Versioned | None = None
    self._on_publish = on_publish
    self.published = 0

  def publish(self, params, version: int) -> Versioned:
    moved = transfer(params, version, self._dst, self._dtype, self._weight_dtype)
    with self._lock:
      if self._latest is not None and version <= self._latest.version:
        raise ValueError(f"published version {version} is not newer than {self._latest.version}")
      self._latest = moved
      self.published += 1
    if self._on_publish is not None:
      self._on_publish(moved)
    return moved

  def take_newer(self, version: int) -> Versioned | None:
    """The latest params if newer than `version`, else None."""
    with self._lock:
      latest = self._latest
    return latest if latest is not None and latest.version > version else None
