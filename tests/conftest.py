"""Test configuration: Triton interpreter on CPU-only machines, a private disk cache, hypothesis
profiles, seeds."""

import atexit
import os
import shutil
import tempfile

import torch

# The interpreter must be chosen before the first `import triton` in the process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The disk cache on, as users run it, in a directory of this pytest run's own (mode 0700,
# removed at exit): the tests never read or write the user's cache. The first process of the
# session (pytest, or xdist's controller) makes it; its workers and child processes inherit it
# through the environment, so a kernel compiled by one of them is loaded by the others (the
# CuTe compile check's content cache included). A test of the cache points its own child
# processes elsewhere.
if "FLASH_MSA_TEST_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="flash_msa-test-cache-")  # (mkdtemp: mode 0700)
    os.environ["FLASH_MSA_TEST_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ["FLASH_MSA_CACHE_DIR"] = os.environ["FLASH_MSA_TEST_CACHE_DIR"]
os.environ.pop("FLASH_MSA_CACHE", None)  # on (the default)

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


@pytest.fixture
def torch_backend(monkeypatch):
    """Run every op on the torch backend (tests of the reference, the layers, the integrations):
    ``pytestmark = pytest.mark.usefixtures("torch_backend")``."""
    monkeypatch.setenv("FLASH_MSA_BACKEND", "torch")


@pytest.fixture
def one_thread():
    """One intra-op thread: these tests' tensors are tiny, and with the 2 CI cores busy two
    threads only contend (measured: the emulated-CP test 3.8 s with 2 threads, 0.44 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
