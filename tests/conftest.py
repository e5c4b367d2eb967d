"""GPU tests are a marked group, skipped (never faked) where jax sees no GPU."""
import jax
import pytest


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to jax here")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
