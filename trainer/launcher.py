"""Trainer groups: the Megatron trainer in its own process(es), driven over pipes.

The controller keeps its CPU for the engine and the envs; the trainer processes own the model, the optimizer and the
megatron parallel state. Calls are synchronous request/response; an exception in a trainer comes back as a
:class:`TrainerError` carrying the remote traceback, and a dead process is reported as such (never a hang).

- :class:`LocalTrainerGroup`: one process (world size 1).
- :class:`ParallelTrainerGroup`: ``tp * dp`` processes that the group spawns itself (no torchrun): torch.distributed
  over 127.0.0.1 on a free port (gloo on CPU, NCCL on GPUs), megatron parallel state TP=tp, DP=dp. Every command
  goes to every rank over its own pipe (collectives need all ranks); rank 0's answer is the result. Each rank runs in
  its own session and exits when the controller dies; close() and any failure kill every rank's process group.
- :func:`make_trainer_group`: the right one for ``tp`` x ``dp`` (and ``ep``, expert parallelism inside TP).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from trainer.types import Sample, TrainerSettings


class TrainerError(RuntimeError):
    """The trainer process raised or died."""


class TrainerCallError(TrainerError):
    """The trainer process is alive but the call raised (its traceback is in the message): e.g. a corrupt checkpoint
    file, which a caller may skip, unlike a trainer that died."""


# ------------------------------------------------------------------------------------------------ trainer side


def _watch_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """Exit this process as soon as the controller that started it is gone (no orphaned ranks)."""

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _resolve(trainer: Any, method: str) -> Any:
    """A trainer method, or a rank-level function of ``trainer.parallel.RANK_CALLS`` bound to the trainer."""
    from trainer.parallel import RANK_CALLS

    if method in RANK_CALLS:
        fn = RANK_CALLS[method]
        return lambda *a, **k: fn(trainer, *a, **k)
    if method.startswith("__"):
        raise AttributeError(f"refusing to call private attribute {method!r}")
    return getattr(trainer, method)


def _serve(
    conn: Connection,
    model_dir: str,
    settings: TrainerSettings,
    rank_env: dict[str, str] | None = None,
    tp: int = 1,
    dp: int = 1,
    device: str | None = None,
    ep: int = 1,
) -> None:
    """A trainer process: build the trainer, then answer ``(method, args, kwargs[, want_result])`` until close/EOF.

    ``rank_env`` (parallel groups): torchrun-style variables of this rank; the process then starts its own session
    and watches its parent.
    """
    if settings.cpus is not None:  # first: every thread started later (torch's included) inherits it
        os.sched_setaffinity(0, settings.cpus)
    if rank_env is not None:
        os.setsid()
        os.environ.update(rank_env)
        _watch_parent(os.getppid())
    os.environ["OMP_NUM_THREADS"] = str(settings.threads)
    # megatron-core warns at import about optional CUDA-only extras (Apex, TransformerEngine) we do not use on CPU
    warnings.filterwarnings("ignore", module=r"megatron(\..*)?$")
    try:
        from trainer.megatron_trainer import MegatronTrainer

        if rank_env is None and device is None:
            trainer = MegatronTrainer(model_dir, settings)
        else:
            trainer = MegatronTrainer(model_dir, settings, tp=tp, dp=dp, device=device, ep=ep)
        conn.send(("ok", trainer.version))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        method, args, kwargs = message[:3]
        want_result = message[3] if len(message) > 3 else True
        if method == "close":
            conn.send(("ok", None))
            return
        try:
            result = _resolve(trainer, method)(*args, **kwargs)
            conn.send(("ok", result if want_result else None))
        except Exception:
            conn.send(("err", traceback.format_exc()))


# ------------------------------------------------------------------------------------------------ local group


class _TrainerCalls:
    """The :class:`trainer.types.TrainerGroup` methods, as named calls over each group's ``call`` transport."""

    _version: int

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """The group's transport: run ``method`` in the trainer rank(s), return rank 0's answer (each group's own)."""
        raise NotImplementedError

    @property
    def version(self) -> int:
        return self._version

    def train_step(self, samples: list[Sample], loss: str | None = None) -> dict[str, float]:
        metrics = self.call("train_step", samples, loss)
        self._version += 1
        return metrics

    def export_weights(self) -> dict[str, Any]:
        """Full HF tensors (under TP the shards are all-gathered; rank 0's copy comes back)."""
        return self.call("export_weights")

    def export_buckets(self, bucket_bytes: int = 32 << 20) -> list[Any]:
        return self.call("export_buckets", bucket_bytes)

    def save_hf(self, path: str | Path) -> Path:
        """Write an HF model directory at ``path`` (a collective under TP; global rank 0 writes)."""
        return Path(self.call("save_hf", str(path)))

    def eval_nll(self, samples: list[Sample]) -> float:
        """Mean NLL of the samples' model tokens, without an update (SFT validation loss)."""
        return float(self.call("eval_nll", samples))


class LocalTrainerGroup(_TrainerCalls):
    """A :class:`trainer.types.TrainerGroup` of one process (world size 1)."""

    def __init__(
        self, model_dir: str | Path, settings: TrainerSettings, start_timeout: float = 300.0, device: str | None = None
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(child, str(model_dir), settings, None, 1, 1, device), daemon=True, name="trainer"
        )
        self._proc.start()
        child.close()
        self._version = self._wait(start_timeout, "start")

    def _wait(self, timeout: float | None, what: str) -> Any:
        if not self._conn.poll(timeout):
            raise TrainerError(f"trainer did not answer '{what}' within {timeout} s")
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):  # EOF or a reset pipe: the process is gone
            self._proc.join(5)
            raise TrainerError(f"trainer process died during '{what}' (exit code {self._proc.exitcode})") from None
        if status == "err":
            raise TrainerCallError(f"trainer failed in '{what}':\n{payload}")
        return payload

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``method`` (a trainer method, or a name in ``trainer.parallel.RANK_CALLS``) in the trainer."""
        if not self._proc.is_alive():
            raise TrainerError(f"trainer process is not running (exit code {self._proc.exitcode})")
        try:
            self._conn.send((method, args, kwargs))
        except OSError:
            self._proc.join(5)
            raise TrainerError(f"trainer process died before '{method}' (exit code {self._proc.exitcode})") from None
        return self._wait(timeout, method)

    def call_all(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """:meth:`call` as a list of every rank's answer (one rank here)."""
        return [self.call(method, *args, timeout=timeout, **kwargs)]

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        self.call("save_checkpoint", str(path), extra)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        extra = self.call("load_checkpoint", str(path))
        self._version = self.call("rank_info")["version"]
        return extra

    def pids(self) -> list[int]:
        """Process id of the trainer (for monitoring and crash tests)."""
        return [self._proc.pid] if self._proc.pid is not None else []

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


# --------------------------------------------------------------------------------------------- parallel group


def _kill_process_group(proc: mp.process.BaseProcess) -> None:
    """SIGKILL the rank's session (it called setsid) or, before that, the process itself; then reap it."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.is_alive():
        proc.kill()
    proc.join(5)


class ParallelTrainerGroup(_TrainerCalls):
    """``tp * dp`` trainer ranks spawned by the group itself; the same call interface as :class:`LocalTrainerGroup`.

    Every command runs on every rank; :meth:`call` returns rank 0's answer and :meth:`call_all` every rank's (in
    global rank order: megatron puts TP innermost, so rank = dp_rank * tp + tp_rank). When one rank fails while the
    others wait in a collective, the others are given ``grace_s`` to answer, then the whole group is killed.
    """

    def __init__(
        self,
        model_dir: str | Path,
        settings: TrainerSettings,
        tp: int = 1,
        dp: int = 1,
        device: str | None = None,
        start_timeout: float = 300.0,
        grace_s: float = 30.0,
        ep: int = 1,
    ) -> None:
        from trainer.dist import free_port

        if tp < 1 or dp < 1:
            raise ValueError(f"tp and dp must be >= 1, got tp={tp} dp={dp}")
        if ep < 1 or tp % ep:
            raise ValueError(f"ep={ep} must divide tp={tp}: experts are spread over the ranks of a TP group")
        self.tp, self.dp, self.world = tp, dp, tp * dp
        self.grace_s = grace_s
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        self._broken = ""
        ctx = mp.get_context("spawn")
        port = free_port()
        try:
            for rank in range(self.world):
                env = {"RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(rank)}
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                parent, child = ctx.Pipe()
                args = (child, str(model_dir), settings, env, tp, dp, device, ep)
                proc = ctx.Process(target=_serve, args=args, daemon=True, name=f"trainer-rank{rank}")
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            self._version = self._collect("start", start_timeout)[0]
        except BaseException:
            self._kill_all()
            raise

    # -- plumbing ------------------------------------------------------------------------------------------------
    def _kill_all(self) -> None:
        for proc in self._procs:
            _kill_process_group(proc)
        for conn in self._conns:
            conn.close()
        self._conns = []

    def _fail(self, why: str) -> TrainerError:
        """Kill the group (its collectives are in an unknown state) and the error to raise."""
        self._broken = why
        self._kill_all()
        return TrainerError(why)

    def _collect(self, what: str, timeout: float | None) -> list[Any]:
        """Every rank's answer to the last command; raises TrainerError naming the failing ranks."""
        replies: dict[int, tuple[str, Any]] = {}
        index = {id(c): r for r, c in enumerate(self._conns)}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < self.world:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([c for r, c in enumerate(self._conns) if r not in replies], left)
            for obj in ready:
                rank = index[id(obj)]
                try:
                    replies[rank] = self._conns[rank].recv()
                except EOFError:
                    replies[rank] = ("dead", f"process exited (exit code {self._procs[rank].exitcode})")
            if any(s != "ok" for s, _ in replies.values()):
                grace = time.monotonic() + self.grace_s
                deadline = grace if deadline is None else min(deadline, grace)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                break
        return self._results(what, replies, timeout)

    def _results(self, what: str, replies: dict[int, tuple[str, Any]], timeout: float | None) -> list[Any]:
        failed = [f"rank {r}: {p}" for r, (s, p) in sorted(replies.items()) if s != "ok"]
        missing = [r for r in range(self.world) if r not in replies]
        dead = any(s == "dead" for s, _ in replies.values())
        if missing or dead:
            parts = [f"trainer group failed in '{what}'"]
            if missing:
                parts.append(f"ranks {missing} did not answer" + ("" if failed else f" within {timeout} s"))
            parts.append("the group was stopped")
            raise self._fail("; ".join(parts) + "".join(f"\n{f}" for f in failed))
        if failed:
            raise TrainerCallError(f"trainer failed in '{what}':\n" + "\n".join(failed))
        return [p for _, (_, p) in sorted(replies.items())]

    def _send(self, method: str, args: tuple, kwargs: dict, want_all: bool) -> None:
        if self._broken:
            raise TrainerError(f"trainer group is stopped: {self._broken}")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(ForkingPickler.dumps((method, args, kwargs, want_all or rank == 0)))
            except (BrokenPipeError, OSError) as exc:
                raise self._fail(f"trainer rank {rank} is not running ({exc}); group stopped") from None

    # -- calls ---------------------------------------------------------------------------------------------------
    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``method`` on every rank (a trainer method or a ``trainer.parallel.RANK_CALLS`` name).

        Returns rank 0's answer.
        """
        self._send(method, args, kwargs, want_all=False)
        return self._collect(method, timeout)[0]

    def call_all(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``method`` on every rank; every rank's answer, in global rank order."""
        self._send(method, args, kwargs, want_all=True)
        return self._collect(method, timeout)

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """One file per TP rank (``path`` itself at TP=1, else ``stem.tpR.suffix``), written by DP rank 0's ranks."""
        self.call("rank_save_checkpoint", str(path), extra)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Every rank loads its TP rank's file; returns the saved ``extra``."""
        extra = self.call("load_checkpoint" if self.tp == 1 else "rank_load_checkpoint", str(path))
        self._version = self.call("rank_info")["version"]
        return extra

    def pids(self) -> list[int]:
        """Process ids of the ranks (for tests and monitoring)."""
        return [p.pid for p in self._procs if p.pid is not None]

    def close(self) -> None:
        """Ask every rank to exit, then kill whatever is left (each rank's whole process group)."""
        if not self._broken and self._conns:
            for conn in self._conns:
                try:
                    conn.send(("close", (), {}, True))
                except (BrokenPipeError, OSError):
                    pass
            for conn in self._conns:
                try:
                    conn.poll(10)
                except (BrokenPipeError, OSError):
                    pass
            for proc in self._procs:
                proc.join(10)
        self._broken = self._broken or "closed"
        self._kill_all()

    def __enter__(self) -> ParallelTrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_trainer_group(
    model_dir: str | Path, settings: TrainerSettings, tp: int = 1, dp: int = 1, ep: int = 1, **kwargs: Any
) -> LocalTrainerGroup | ParallelTrainerGroup:
    """A :class:`LocalTrainerGroup` for 1 x 1, else a :class:`ParallelTrainerGroup` of ``tp * dp`` ranks (``ep`` of
    each TP group's ranks holding a mixture-of-experts model's experts)."""
    if tp == 1 and dp == 1 and ep == 1:
        kwargs.pop("grace_s", None)
        return LocalTrainerGroup(model_dir, settings, **kwargs)
    return ParallelTrainerGroup(model_dir, settings, tp=tp, dp=dp, ep=ep, **kwargs)
