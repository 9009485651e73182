"""The agent environment gym: registry, environment contracts, tools, verifiers, task sets, sandboxes, and envs.

Importing ``envs`` is light: it registers the built-in ids (and their scripted experts) with string entry points, in
this registry and in Gymnasium's (so ``gymnasium.make("agentflow/Calc-v0")`` works), and imports nothing heavier
than Gymnasium.

Built-in environments (each multi-turn, sandboxed, with a verifier; ``sandbox_kind="process"`` where bubblewrap
is missing):

- ``agentflow/Calc-v0``: arithmetic with a sandboxed calculator (the demo task).
- ``agentflow/PyCode-v0``: write a Python function; hidden unit tests run in the sandbox.
- ``agentflow/Shell-v0``: questions and edits on files in the sandbox workdir with ``sh(command)``.
- ``agentflow/Trail-v0``: follow a trail of 3-15 notes through the sandbox workdir with ``sh`` (long horizon).
- ``agentflow/Retrieval-v0``: questions answered by searching a shipped document collection.
- ``agentflow/Browser-v0``: web tasks in shipped local web apps (Playwright + system Chromium; screenshots).
- ``agentflow/Desktop-v0``: Tk desktop apps on an Xvfb display, driven through XTEST (screenshots).

Adapted from other libraries (:mod:`envs.adapters`; their packages are the ``adapters`` extra):

- ``textarena/<Game>-v0``: TextArena's single-player games (``GuessTheNumber``, ``Mastermind``, ``TowerOfHanoi``,
  ``FifteenPuzzle``, ``LightsOut``; any other with ``game=``), multi-turn, the game's reward as the verifier.
- ``reasoning_gym/<dataset>-v0``: Reasoning Gym's procedural datasets (``chain_sum``, ``basic_arithmetic``, ``gcd``,
  ``count_bits``, ``spell_backward``, ``leg_counting``; any other with ``dataset=``), scored by their own verifiers.

MCP tool servers become tools of any env through :mod:`envs.mcp`.
"""

from __future__ import annotations

from envs.registry import EnvSpec, list_envs, make, register, spec

__all__ = ["EnvSpec", "list_envs", "make", "register", "spec"]

register("agentflow/Calc-v0", "envs.demo:CalcEnv", max_turns=3, expert="envs.demo:expert_action")
register("agentflow/PyCode-v0", "envs.pycode:PyCodeEnv", max_turns=4, expert="envs.pycode:expert_action")
register("agentflow/Shell-v0", "envs.shell:ShellEnv", max_turns=6, expert="envs.shell:expert_action")
register("agentflow/Trail-v0", "envs.trail:TrailEnv", max_turns=20, expert="envs.trail:expert_action")
register("agentflow/Retrieval-v0", "envs.retrieval:RetrievalEnv", max_turns=8, expert="envs.retrieval:expert_action")
register("agentflow/Browser-v0", "envs.browser.env:BrowserEnv", max_turns=16, expert="envs.browser.tasks:expert_action")
register("agentflow/Desktop-v0", "envs.desktop.env:DesktopEnv", max_turns=12, expert="envs.desktop.tasks:expert_action")
for _game in ("GuessTheNumber-v0", "Mastermind-v0", "TowerOfHanoi-v0", "FifteenPuzzle-v0", "LightsOut-v0"):
    _expert = "envs.adapters:guess_the_number_expert" if _game == "GuessTheNumber-v0" else None
    register(f"textarena/{_game}", "envs.adapters:TextArenaEnv", kwargs={"game": _game}, expert=_expert)
for _dataset in ("chain_sum", "basic_arithmetic", "gcd", "count_bits", "spell_backward", "leg_counting"):
    register(f"reasoning_gym/{_dataset}-v0", "envs.adapters:ReasoningGymEnv", kwargs={"dataset": _dataset})
