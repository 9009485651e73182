"""Imported first by every benchmark script: run as a script, a benchmark's folder leads sys.path, and
``benchmarks/trainer.py`` would shadow the ``trainer`` package. Put the repository root ahead of it (the folder stays
on the path, last, so spawned worker processes that re-import the script still find this module)."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]
