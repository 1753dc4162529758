import os

# Two CPU cores on CI: keep torch from oversubscribing them in every test process.
os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402  (after the thread count: torch reads it when imported)
import torch  # noqa: E402


@pytest.fixture
def float64():
    """Torch's default dtype float64 for one test (test_jagg and test_experts take it for every test): exactness
    then shows as ~1e-16, not fp32's ~1e-7."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
