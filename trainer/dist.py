"""torch.distributed + megatron-core parallel-state setup: gloo on CPU, NCCL on GPUs.

A trainer rank learns its place from torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, optional ``LOCAL_RANK``), which :class:`trainer.launcher.ParallelTrainerGroup` sets for the processes
it spawns; without them the world is a single process on a free port of 127.0.0.1. ``torchrun --master-port=0``
hangs, hence :func:`free_port`.
"""

from __future__ import annotations

import atexit
import os
import socket

import torch
import torch.distributed as dist

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def default_backend() -> str:
    """``nccl`` when CUDA is present, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(backend: str = "gloo") -> None:
    """Initialize the default process group unless one exists.

    Under torchrun-style variables the environment decides rank and world; otherwise a single-process world on a free
    port of 127.0.0.1. With ``nccl`` the rank first binds to GPU ``LOCAL_RANK`` (default: rank modulo the GPU count).
    """
    if dist.is_initialized():
        return
    if backend == "nccl":
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
    if all(v in os.environ for v in _TORCHRUN_VARS):
        dist.init_process_group(backend=backend, init_method="env://")
    else:
        port = free_port()
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    atexit.unregister(destroy_process_group)  # once, however many times a group is made and destroyed
    atexit.register(destroy_process_group)


def destroy_process_group() -> None:
    """Destroy the default process group if one exists (registered at exit by :func:`init_process_group`).

    A process that exits with a live gloo group can abort during interpreter shutdown ("terminate called without an
    active exception", SIGABRT): gloo's worker threads still hold tensors whose release needs the interpreter. Tearing
    the group down while the interpreter is whole makes a rank's clean exit clean.
    """
    if dist.is_initialized():
        dist.destroy_process_group()


def init_process_group_cpu() -> None:
    """Initialize the default gloo process group unless one exists (see :func:`init_process_group`)."""
    init_process_group("gloo")


def init_distributed(tp: int = 1, dp: int | None = None, backend: str | None = None, ep: int = 1) -> None:
    """Initialize torch.distributed and megatron's model-parallel state (TP=tp, PP=1, DP=world/tp, EP=ep).

    ``dp`` (optional) is checked against the world size: ``tp * dp`` must equal it. ``ep`` spreads a mixture-of-experts
    model's experts over ``ep`` ranks of each TP group, each expert TP-split over the other ``tp / ep`` (megatron's
    expert tensor parallelism): the ranks of one expert-parallel group see the same tokens, so every rank runs the
    same number of forward passes of the same length, as megatron's token exchange needs, and experts' gradients are
    summed over the DP group like every other parameter's. Idempotent for the same ``tp`` and ``ep``; megatron's
    parallel state is process-global, so a different one after the first call raises RuntimeError.
    """
    from megatron.core import parallel_state

    init_process_group(backend or default_backend())
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise RuntimeError(f"tensor-parallel size {tp} does not divide the world size {world}")
    if dp is not None and tp * dp != world:
        raise RuntimeError(f"tp={tp} x dp={dp} = {tp * dp} ranks, but the world has {world}")
    if ep < 1 or tp % ep:
        raise RuntimeError(f"expert-parallel size {ep} does not divide the tensor-parallel size {tp}")
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(), ep_rank_and_size()[1])
        if current != (tp, ep):
            raise RuntimeError(
                f"model parallel state already initialized with tp={current[0]} ep={current[1]}, asked for tp={tp} "
                f"ep={ep}"
            )
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp // ep,
    )


def init_distributed_cpu(tp: int = 1) -> None:
    """Initialize gloo (world size 1 unless torchrun says otherwise) and megatron's model-parallel state (TP=tp, PP=1).

    Idempotent for the same ``tp``; megatron's parallel state is process-global, so a different ``tp`` after the
    first call raises RuntimeError.
    """
    init_distributed(tp=tp, backend="gloo")


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and the TP world size (megatron's parallel state must be initialized)."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def ep_rank_and_size() -> tuple[int, int]:
    """This process's expert-parallel rank and the EP world size (megatron's parallel state must be initialized)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def etp_rank_and_size() -> tuple[int, int]:
    """This process's expert-tensor-parallel rank and size: the ranks each expert is TP-split over (``tp / ep``)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size()


def dp_rank_and_size() -> tuple[int, int]:
    """This process's data-parallel rank and the DP world size (megatron's parallel state must be initialized)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def is_rank_zero() -> bool:
    """True on global rank 0, or when torch.distributed is not initialized."""
    return not dist.is_initialized() or dist.get_rank() == 0
