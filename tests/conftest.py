"""Test-wide manners: one thread per process (2-core machines), components required in CI."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass


def require(condition: bool, what: str) -> None:
    """Skip when a component is missing, or fail when CI says every component must be present."""
    if condition:
        return
    if os.environ.get("AGENTFLOW_REQUIRE_ALL") == "1":
        pytest.fail(f"{what} is required in CI (AGENTFLOW_REQUIRE_ALL=1) but missing")
    pytest.skip(f"{what} not available")
