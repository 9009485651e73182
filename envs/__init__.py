"""The agent environment gym: registry, environment contracts, tools, verifiers, task sets, sandboxes, and envs.

Importing ``envs`` is light: it registers the built-in ids with string entry points and imports nothing heavy.

Built-in environments (each multi-turn, sandboxed, with a verifier; ``sandbox_kind="process"`` where bubblewrap
is missing):

- ``agentflow/Calc-v0``: arithmetic with a sandboxed calculator (the demo task).
- ``agentflow/PyCode-v0``: write a Python function; hidden unit tests run in the sandbox.
- ``agentflow/Shell-v0``: questions and edits on files in the sandbox workdir with ``sh(command)``.
- ``agentflow/Retrieval-v0``: questions answered by searching a shipped document collection.
- ``agentflow/Browser-v0``: web tasks in shipped local web apps (Playwright + system Chromium; screenshots).
- ``agentflow/Desktop-v0``: Tk desktop apps on an Xvfb display, driven through XTEST (screenshots).
"""

from __future__ import annotations

from envs.registry import EnvSpec, list_envs, make, register, spec

__all__ = ["EnvSpec", "list_envs", "make", "register", "spec"]

register("agentflow/Calc-v0", "envs.demo:CalcEnv", max_turns=3)
register("agentflow/PyCode-v0", "envs.pycode:PyCodeEnv", max_turns=4)
register("agentflow/Shell-v0", "envs.shell:ShellEnv", max_turns=6)
register("agentflow/Retrieval-v0", "envs.retrieval:RetrievalEnv", max_turns=8)
register("agentflow/Browser-v0", "envs.browser.env:BrowserEnv", max_turns=16)
register("agentflow/Desktop-v0", "envs.desktop.env:DesktopEnv", max_turns=12)
