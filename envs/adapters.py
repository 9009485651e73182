"""Environments from other libraries as agentflow envs: TextArena's single-player games and Reasoning Gym's
procedural, verifier-scored datasets. Both libraries generate their tasks from a seed and ship what they need, so
nothing is downloaded when an episode runs.

:class:`TextArenaEnv` (``textarena/<Game>-v0``; ``pip install textarena``) plays one TextArena game per episode:

- the game is made in its ``-raw`` form (no observation wrappers): each observation is only what the game said since
  the last move, since the conversation already keeps the history;
- a move is the ``{"answer": TEXT}`` action: TEXT goes to the game as its action (e.g. ``[12]``); the episode ends
  when the game does (won, lost, out of turns, or too many invalid moves), or after ``max_turns`` of ours;
- the reward is TextArena's own reward for the player at the end (``reward="game"``; some games give partial
  credit: GuessTheNumber pays 0.95 for ending one away from the target) or 1 for a win and 0 otherwise
  (``reward="success"``, a sharper RL signal); success is a game reward of at least ``win_reward`` (1, a win, in
  the shipped games); the game's own reward is in the final info as ``game_reward``;
- the task seed of ``seed`` in the split (disjoint train/eval ranges) seeds the game's reset. Games draw from
  Python's global ``random``, so resets and moves of all TextArena envs in a process are serialised by one lock.

:class:`ReasoningGymEnv` (``reasoning_gym/<dataset>-v0``; ``pip install reasoning-gym``) asks one question of a
Reasoning Gym dataset per episode: entry 0 of the dataset built with the task seed as its seed; the answer is scored
by the dataset's own ``score_answer`` (the reward, in [0, 1]); success is a score of 1. Train and eval draw from
disjoint seed ranges; the library's generators may still produce the same small question from two seeds.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from envs.core import AgentEnv, AnswerAction
from envs.errors import EnvError
from envs.tasks import simple_task_set

TEXTARENA_GAMES = ("GuessTheNumber-v0", "Mastermind-v0", "TowerOfHanoi-v0", "FifteenPuzzle-v0", "LightsOut-v0")
"""The single-player games registered as ``textarena/<Game>``: ones that ship their data (no NLTK corpora)."""
REASONING_GYM_DATASETS = ("chain_sum", "basic_arithmetic", "gcd", "count_bits", "spell_backward", "leg_counting")
"""The datasets registered as ``reasoning_gym/<dataset>-v0``; any other is ``agentflow/ReasoningGym-v0`` with
``dataset=``."""
_TEXTARENA_LOCK = threading.Lock()


def _import(module: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise EnvError(f"this env needs the {package!r} package: pip install {package} ({e})") from e


class TextArenaEnv(AgentEnv):
    """One single-player TextArena game per episode (module doc)."""

    branching = "replay"  # TextArena games are seeded

    task_sets = {"default": simple_task_set()}  # per instance, the task type is the game

    def __init__(
        self,
        game: str = "GuessTheNumber-v0",
        max_turns: int | None = None,
        win_reward: float = 1.0,
        system_prompt: str | None = None,
        reward: str = "game",
        **game_kwargs: Any,
    ) -> None:
        ta = _import("textarena", "textarena")
        registry = ta.envs.registration.ENV_REGISTRY
        raw = f"{game}-raw"
        if raw not in registry:
            import difflib

            games = sorted(k for k in registry if not k.endswith(("-raw", "-train")))
            close = difflib.get_close_matches(game, games, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise EnvError(f"TextArena has no game {game!r}.{hint}")
        game_turns = dict(registry[raw].kwargs, **game_kwargs).get("max_turns")
        super().__init__(max_turns=max_turns or (2 * int(game_turns) + 2 if game_turns else 64))
        if reward not in ("game", "success"):
            raise EnvError(f"TextArenaEnv reward must be 'game' or 'success', got {reward!r}")
        self.game, self.win_reward, self.reward_kind = game, win_reward, reward
        self.inner = ta.make(raw, **game_kwargs)
        self.system_prompt = system_prompt or (
            f"You are playing the TextArena game {game}. Reply with your move as the answer each turn; the game "
            "says how moves are written."
        )
        self.tools = []
        self.task_sets = {"default": simple_task_set(task_types=(game,))}
        self._reward: float | None = None

    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        split = options.get("split", "train")
        task_seed = self.task_sets["default"].task_seed(seed, split)
        with _TEXTARENA_LOCK:
            try:
                self.inner.reset(num_players=1, seed=task_seed)
            except Exception as e:
                raise EnvError(f"TextArena game {self.game!r} did not reset for one player: {e}") from e
            _, messages = self.inner.get_observation()
        self._reward = None
        info = {"task_id": f"{self.game}-{split}-{task_seed}", "task_type": self.game, "split": split}
        return _render(messages), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        parsed = self._begin_step(action)
        if isinstance(parsed, str):
            return self._end_step(parsed)
        if not isinstance(parsed, AnswerAction):
            return self._end_step(f"Error: {self.game} takes no tools; answer with your move")
        return self._move(parsed.text)

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        parsed = self._begin_step(action)
        if isinstance(parsed, str):
            return self._end_step(parsed)
        if not isinstance(parsed, AnswerAction):
            return self._end_step(f"Error: {self.game} takes no tools; answer with your move")
        return await asyncio.to_thread(self._move, parsed.text)

    def _move(self, text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        with _TEXTARENA_LOCK:
            done, _ = self.inner.step(text)
            _, messages = self.inner.get_observation()
            rewards, game_info = self.inner.close() if done else (None, {})
        obs = _render(messages, skip_player=True)
        if not done:
            return self._end_step(obs or "(the game said nothing)")
        game_reward = float((rewards or {}).get(0, 0.0))
        reason = (game_info or {}).get(0, {}).get("reason", "")
        self._done = True
        success = game_reward >= self.win_reward
        reward = game_reward if self.reward_kind == "game" else float(success)
        info = {**self._task_info, "turn": self._turn, "success": success, "game_reward": game_reward}
        text_out = "\n".join(x for x in (obs, f"Game over: {reason}" if reason else "Game over.") if x)
        return self._clip(text_out), reward, True, False, info


def _render(messages: Any, skip_player: bool = False) -> str:
    """TextArena's raw observation (``(from_id, text, kind)`` tuples) as text; the player's own moves are left out
    of step observations (the conversation has them)."""
    if isinstance(messages, str):
        return messages.strip()
    lines = [str(text).strip() for sender, text, *_ in messages or [] if not (skip_player and sender == 0)]
    return "\n".join(line for line in lines if line)


class ReasoningGymEnv(AgentEnv):
    """One Reasoning Gym question per episode, scored by the dataset's own verifier (module doc)."""

    branching = "replay"  # one question per seed

    task_sets = {"default": simple_task_set()}  # per instance, the task type is the dataset
    max_turns = 3  # one answer ends the episode; the other turns leave room to fix a malformed action

    def __init__(
        self,
        dataset: str = "chain_sum",
        config: dict[str, Any] | None = None,
        max_turns: int | None = None,
        system_prompt: str | None = None,
    ) -> None:
        rg = _import("reasoning_gym", "reasoning-gym")
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            import difflib

            close = difflib.get_close_matches(dataset, list(DATASETS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise EnvError(f"Reasoning Gym has no dataset {dataset!r}.{hint}")
        super().__init__(max_turns=max_turns)
        self._create, self.dataset, self.config = rg.create_dataset, dataset, dict(config or {})
        self._make(0)  # a bad config fails here, not in the middle of a job
        self.system_prompt = system_prompt or "Answer the question. Give only the final answer as your answer."
        self.tools = []
        self.task_sets = {"default": simple_task_set(task_types=(dataset,))}
        self.entry: dict[str, Any] | None = None
        self._data: Any = None

    def _make(self, seed: int) -> Any:
        try:
            return self._create(self.dataset, seed=seed, size=1, **self.config)
        except Exception as e:
            raise EnvError(f"Reasoning Gym dataset {self.dataset!r} with config {self.config}: {e}") from e

    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        split = options.get("split", "train")
        task_seed = self.task_sets["default"].task_seed(seed, split)
        self._data = self._make(task_seed)
        self.entry = self._data[0]
        info = {"task_id": f"{self.dataset}-{split}-{task_seed}", "task_type": self.dataset, "split": split}
        return str(self.entry["question"]), info

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        raise EnvError(f"{self.dataset} takes no tools; answer the question")

    def score_answer(self, text: str) -> tuple[float, bool]:
        if self.entry is None:
            raise EnvError("no question: call reset() first")
        score = float(self._data.score_answer(answer=text, entry=self.entry))
        return score, score >= 1.0

    def answer_info(self) -> dict[str, Any]:
        return {"expected": str(self.entry["answer"])} if self.entry is not None else {}


def guess_the_number_expert(env: Any, history: list[tuple[str, str]]) -> str:
    """A scripted expert for ``textarena/GuessTheNumber-v0`` that warm-up SFT can imitate: bisection with an
    off-by-one flaw. After "higher" it keeps the guess as the new lower bound instead of the guess + 1, so on some
    targets it proposes a number it already tried (an invalid move); RL has that to unlearn."""
    import re

    from envs.core import answer_action

    game = env.unwrapped.inner
    lo, hi = int(game.min_number), int(game.max_number)
    for action, obs in history:
        guess = re.search(r"\[(\d+)\]", action)
        if guess is None:
            continue
        g = int(guess.group(1))
        if "higher" in obs:
            lo = max(lo, g)  # the flaw: g + 1 would be right
        elif "lower" in obs:
            hi = min(hi, g - 1)
    return answer_action(f"[{(lo + hi) // 2}]")
