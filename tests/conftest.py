"""GPU tests are a marked group, skipped (never faked) where jax sees no GPU."""
import os

# tests/test_sharding.py needs 8 CPU devices. The flag must be set before jax creates its CPU
# backend, and other test modules do that at import time, before test_sharding.py is imported.
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


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
