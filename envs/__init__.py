"""The agent environment gym: registry, environment contracts, sandboxes and the demo environment.

Importing ``envs`` is light: it registers the built-in ids with string entry points and imports nothing heavy.
"""

from __future__ import annotations

from envs.registry import EnvSpec, list_envs, make, register, spec

__all__ = ["EnvSpec", "list_envs", "make", "register", "spec"]

register("agentflow/Calc-v0", "envs.demo:CalcEnv", max_turns=3)
