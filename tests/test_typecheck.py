"""mypy over the files listed in pyproject.toml's ``[tool.mypy]`` (the packages' seams and
tests/typecheck_conformance.py, which checks every implementation against its protocol)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_reports_no_errors():
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed (it is in the [dev] extra)")
    # the cache lives under .pytest_cache (ignored by git); a warm run takes about a second, a cold one ~15 s
    cache = ROOT / ".pytest_cache" / "mypy"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, f"mypy found type errors:\n{out[-6000:]}"
    assert "Success" in out, out[-2000:]
