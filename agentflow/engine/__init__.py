"""The embedded CPU inference engine: a pure-torch Qwen2/Llama decoder with continuous batching."""

from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.qwen2 import DecoderModel, KVCache, load_hf_dir

__all__ = ["DecoderModel", "EmbeddedEngine", "KVCache", "load_hf_dir"]
