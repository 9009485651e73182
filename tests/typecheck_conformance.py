"""Static checks that every implementation matches its protocol (read by mypy through tests/test_typecheck.py).

Nothing here runs: each function hands implementations to a parameter or return typed with the protocol, so
mypy reports the member that is missing or whose signature drifted when an implementation stops matching.
Add a line when a new implementation of one of these seams appears.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentflow.engine.embedded import EmbeddedEngine
    from agentflow.engine.sglang_client import SGLangEngine
    from agentflow.ray_envs import RemoteEnvPool
    from agentflow.ray_runtime import RayEngine, RayTrainerGroup
    from agentflow.rollout import EnvPool
    from agentflow.types import EnvProvider, InferenceEngine, RecyclingEngine, StreamingEngine, SupervisedEngine
    from trainer.launcher import LocalTrainerGroup, ParallelTrainerGroup
    from trainer.types import TrainerGroup
    from transfer_mesh.transport import KeepsCacheOnUpdate, LocalEngine, WeightTransport
    from transfer_mesh.transport_cuda_ipc import CudaIpcTransport
    from transfer_mesh.transport_gloo import DistributedControl, GlooTransport
    from transfer_mesh.transport_http import HttpTransport
    from transfer_mesh.transport_inprocess import InProcessTransport


def trainer_groups(
    local: LocalTrainerGroup, parallel: ParallelTrainerGroup, ray: RayTrainerGroup
) -> list[TrainerGroup]:
    return [local, parallel, ray]


def inference_engines(embedded: EmbeddedEngine, sglang: SGLangEngine, ray: RayEngine) -> list[InferenceEngine]:
    return [embedded, sglang, ray]


def engine_extras(
    embedded: EmbeddedEngine, ray: RayEngine
) -> tuple[StreamingEngine, RecyclingEngine, SupervisedEngine]:
    return embedded, embedded, ray


def weight_receivers(embedded: EmbeddedEngine, sglang: SGLangEngine, ray: RayEngine) -> list[LocalEngine]:
    """What the in-process and HTTP transports' choreography calls on an engine."""
    return [embedded, sglang, ray]


def cache_keepers(embedded: EmbeddedEngine) -> KeepsCacheOnUpdate:
    return embedded


def distributed_controls(sglang: SGLangEngine) -> DistributedControl:
    return sglang


def weight_transports(
    inprocess: InProcessTransport, http: HttpTransport, gloo: GlooTransport, cuda_ipc: CudaIpcTransport
) -> list[WeightTransport]:
    return [inprocess, http, gloo, cuda_ipc]


def env_providers(local: EnvPool, remote: RemoteEnvPool) -> list[EnvProvider]:
    return [local, remote]
