"""Imported first by every benchmark script: run as a script, a benchmark's folder leads sys.path, and
``benchmarks/trainer.py`` would shadow the ``trainer`` package. Put the repository root there instead."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
