"""Run-directory logging: metrics as JSONL and TensorBoard event files, a progress bar, checkpoint paths."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _flatten(prefix: str, obj: Any, out: dict[str, float]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    elif isinstance(obj, bool | int | float):
        out[prefix] = float(obj)


class MetricsLogger:
    """Writes ``metrics.jsonl`` and TensorBoard events under ``run_dir``."""

    def __init__(self, run_dir: str | Path, show_progress: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self.show_progress = show_progress
        self.t0 = time.monotonic()

    def step(self, step: int, **groups: Any) -> dict[str, float]:
        flat: dict[str, float] = {}
        _flatten("", groups, flat)
        flat["time_s"] = time.monotonic() - self.t0
        self._jsonl.write(json.dumps({"step": step, **flat}) + "\n")
        self._jsonl.flush()
        for k, v in flat.items():
            self._tb.add_scalar(k, v, step)
        self._tb.flush()
        return flat

    def progress(self, it: Iterable[T], desc: str) -> Iterator[T]:
        if not self.show_progress:
            yield from it
            return
        from tqdm import tqdm

        yield from tqdm(it, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def checkpoint_path(self, step: int) -> str:
        return str(self.run_dir / "checkpoints" / f"step_{step:06d}.pt")

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()
