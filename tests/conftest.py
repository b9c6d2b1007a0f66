"""Test configuration: Triton interpreter on CPU-only machines, hypothesis profiles, seeds."""

import os

import torch

# The interpreter must be chosen before the first `import triton` in the process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The CuTe disk cache (on by default) off, whatever the caller's environment says: tests
# monkeypatch module constants that kernels read while tracing, which its key does not hold; a
# test of the cache turns it on for its own child processes.
os.environ["FLASH_MSA_CACHE"] = "0"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# "ci" (the default): derandomized, no deadline, few examples -> reproducible and fast.
# "thorough": random, more examples, for local bug hunting (HYPOTHESIS_PROFILE=thorough).
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=15,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("thorough", deadline=None, max_examples=200, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    """Tests start from FLASH_MSA_BACKEND=auto and FLASH_MSA_DEBUG unset unless they set them."""
    monkeypatch.delenv("FLASH_MSA_BACKEND", raising=False)
    monkeypatch.delenv("FLASH_MSA_DEBUG", raising=False)
