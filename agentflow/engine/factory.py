"""Engine choice by config: ``engine.type`` ``embedded`` (in-process CPU engine) or ``sglang`` (HTTP servers)."""

from __future__ import annotations

import os
from pathlib import Path

from agentflow.config import EngineConfig
from agentflow.types import InferenceEngine


def make_engine(cfg: EngineConfig, model_dir: str | Path, seed: int = 0) -> InferenceEngine:
    """Build the configured engine. ``model_dir`` loads the embedded engine; SGLang servers serve their own copy
    (started outside this process with the same model), and the key comes from ``cfg.api_key`` or the variable
    named by ``cfg.api_key_env``."""
    if cfg.type == "embedded":
        from agentflow.engine.embedded import EmbeddedEngine

        return EmbeddedEngine(
            model_dir,
            max_slots=cfg.max_slots,
            max_len=cfg.max_len,
            seed=seed,
            prefix_cache=cfg.prefix_cache,
            kv_on_update=cfg.kv_on_update,
            kv_max_age=cfg.kv_max_age,
            admission=cfg.admission,
            kv_ttl_s=cfg.kv_ttl_s,
            kv_spill_bytes=cfg.kv_spill_bytes,
            paused_aware=cfg.kv_paused_aware,
        )
    if cfg.type == "sglang":
        from agentflow.engine.sglang_client import SGLangEngine

        if not cfg.urls:
            raise ValueError("engine.type=sglang needs engine.urls (e.g. ['http://127.0.0.1:30000'])")
        key = cfg.api_key or (os.environ.get(cfg.api_key_env) if cfg.api_key_env else None)
        return SGLangEngine(
            list(cfg.urls),
            api_key=key,
            request_timeout=cfg.request_timeout,
            max_retries=cfg.max_retries,
            health_interval=cfg.health_interval,
            model_dir=model_dir,
            routed_experts=cfg.routed_experts,
        )
    raise ValueError(f"unknown engine.type {cfg.type!r}")
