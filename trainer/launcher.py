"""Local trainer group: the Megatron trainer in its own process, driven over a pipe.

The controller keeps its CPU for the engine and the envs; the trainer process owns the model, the optimizer and the
megatron parallel state. Calls are synchronous request/response; an exception in the trainer comes back as a
:class:`TrainerError` carrying the remote traceback, and a dead process is reported as such (never a hang).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
import warnings
from pathlib import Path
from typing import Any

from trainer.types import Sample, TrainerSettings


class TrainerError(RuntimeError):
    """The trainer process raised or died."""


def _serve(conn: Any, model_dir: str, settings: TrainerSettings) -> None:
    os.environ["OMP_NUM_THREADS"] = str(settings.threads)
    # megatron-core warns at import about optional CUDA-only extras (Apex, TransformerEngine) we do not use on CPU
    warnings.filterwarnings("ignore", module=r"megatron(\..*)?$")
    try:
        from trainer.megatron_trainer import MegatronTrainer

        trainer = MegatronTrainer(model_dir, settings)
        conn.send(("ok", trainer.version))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            return
        if method == "close":
            conn.send(("ok", None))
            return
        try:
            result = getattr(trainer, method)(*args, **kwargs)
            conn.send(("ok", result))
        except Exception:
            conn.send(("err", traceback.format_exc()))


class LocalTrainerGroup:
    """A :class:`trainer.types.TrainerGroup` of one CPU process (world size 1)."""

    def __init__(self, model_dir: str | Path, settings: TrainerSettings, start_timeout: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, str(model_dir), settings), daemon=True, name="trainer")
        self._proc.start()
        child.close()
        self._version = self._wait(start_timeout, "start")

    def _wait(self, timeout: float | None, what: str) -> Any:
        if not self._conn.poll(timeout):
            raise TrainerError(f"trainer did not answer '{what}' within {timeout} s")
        try:
            status, payload = self._conn.recv()
        except EOFError:
            raise TrainerError(f"trainer process died during '{what}' (exit code {self._proc.exitcode})") from None
        if status == "err":
            raise TrainerError(f"trainer failed in '{what}':\n{payload}")
        return payload

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if not self._proc.is_alive():
            raise TrainerError(f"trainer process is not running (exit code {self._proc.exitcode})")
        self._conn.send((method, args, kwargs))
        return self._wait(timeout, method)

    @property
    def version(self) -> int:
        return self._version

    def train_step(self, samples: list[Sample], loss: str = "grpo") -> dict[str, float]:
        metrics = self.call("train_step", samples, loss)
        self._version += 1
        return metrics

    def export_weights(self) -> dict[str, Any]:
        return self.call("export_weights")

    def export_buckets(self, bucket_bytes: int = 32 << 20) -> list[Any]:
        return self.call("export_buckets", bucket_bytes)

    def save_checkpoint(self, path: str, extra: dict[str, Any] | None = None) -> None:
        self.call("save_checkpoint", path, extra)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("close", (), {}))
                self._conn.poll(10)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()
