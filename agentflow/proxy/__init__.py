"""Black-box agents: an OpenAI-compatible recording proxy in front of the inference engine, and the runner that
plays one episode with an agent program (a Python callable or a subprocess) against it."""

from agentflow.proxy.recorder import Recorder
from agentflow.proxy.server import ProxyServer
from agentflow.proxy.types import SEGMENT_HEADER, BlackBoxTask, CallRecord, ProxyError

__all__ = ["SEGMENT_HEADER", "BlackBoxTask", "CallRecord", "ProxyError", "ProxyServer", "Recorder"]
