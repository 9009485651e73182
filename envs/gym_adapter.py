"""A Gymnasium env with text observations and string actions, as an agentflow env (:class:`GymTextEnv`).

Ids registered only with ``gymnasium.register`` reach jobs through it (``envs.make`` and ``envs.spec`` fall back to
Gymnasium's registry). What the adapter adds to the Gymnasium env:

- the async twins (``areset``/``astep`` run ``reset``/``step`` in a worker thread);
- a task set: the ``default`` task set's train and eval seed ranges are disjoint, and the Gymnasium env is reset
  with the task seed, so its held-out episodes are ones it was never trained on;
- a verifier from its reward: the episode's return is the reward of its last step (earlier steps give 0; each
  step's own reward is in the info as ``env_reward``), and success is the env's own ``info["success"]`` when it
  gives one, else a terminated episode whose return reaches the spec's ``reward_threshold`` (above 0 when the
  spec sets none);
- the canonical action format: ``{"answer": TEXT}`` sends ``TEXT`` to the env's ``step`` (it takes no tools), and
  any other action, or text outside the env's action space, is an ``"Error: ..."`` observation.

An env whose observation or action space cannot carry text (``Box``, ``Discrete``, ...) is refused with the reason.
"""

from __future__ import annotations

import asyncio
from typing import Any

import gymnasium
from gymnasium import spaces

from envs.core import AgentEnv, AnyText, ToolAction
from envs.errors import EnvError
from envs.tasks import simple_task_set

DEFAULT_MAX_TURNS = 32
DEFAULT_PROMPT = "Reply with your next action as plain text."
_TEXT_SPACES = (spaces.Text, AnyText)


def text_space_problem(env: Any) -> str | None:
    """Why ``env``'s spaces cannot carry text (None when both are text spaces)."""
    for which in ("observation", "action"):
        space = getattr(env, f"{which}_space", None)
        if not isinstance(space, _TEXT_SPACES):
            return (
                f"its {which} space is {space!r}, which cannot carry text: agentflow envs take string actions "
                "and give text observations (gymnasium.spaces.Text)"
            )
    return None


def make_from_gymnasium(env_id: str, **kwargs: Any) -> AgentEnv:
    """``gymnasium.make(env_id, **kwargs)`` as an agentflow env; the adapter's own settings (``max_turns``,
    ``success_reward``, ``system_prompt``) are taken out of ``kwargs`` first."""
    own = {k: kwargs.pop(k) for k in ("max_turns", "success_reward", "system_prompt") if k in kwargs}
    inner = gymnasium.make(env_id, **kwargs)
    if isinstance(inner.unwrapped, AgentEnv):  # already one of ours (registered straight into Gymnasium's registry)
        return inner.unwrapped
    return GymTextEnv(inner, env_id, **own)


class GymTextEnv(AgentEnv):
    """An agentflow env around a Gymnasium env whose observations are text and whose actions are strings."""

    branching = "replay"  # a Gymnasium env reset with the same seed follows the same actions alike

    def __init__(
        self,
        env: gymnasium.Env[Any, Any],
        env_id: str = "",
        max_turns: int | None = None,
        success_reward: float | None = None,
        system_prompt: str | None = None,
    ) -> None:
        problem = text_space_problem(env)
        if problem is not None:
            env.close()
            raise EnvError(f"environment {env_id or type(env.unwrapped).__name__!r} cannot be used by agentflow: "
                           f"{problem}")  # fmt: skip
        gym_spec = env.spec
        turns = max_turns or (gym_spec.max_episode_steps if gym_spec else None) or DEFAULT_MAX_TURNS
        super().__init__(max_turns=turns)
        self.inner = env
        self.env_id = env_id or (gym_spec.id if gym_spec else type(env.unwrapped).__name__)
        self.name = self.env_id.rsplit("/", 1)[-1]
        threshold = success_reward if success_reward is not None else (gym_spec.reward_threshold if gym_spec else None)
        self.success_reward = threshold
        self.system_prompt = system_prompt or getattr(env.unwrapped, "system_prompt", None) or DEFAULT_PROMPT
        self.tools = []
        self.task_sets = {"default": simple_task_set(task_types=(self.name,))}
        self._return = 0.0

    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Reset the Gymnasium env with the task seed of ``seed`` in the options' split."""
        split = options.pop("split", "train")
        task_set = self.task_sets.get(options.pop("task_set", "default"), self.task_sets["default"])
        task_seed = task_set.task_seed(seed, split)
        obs, info = self.inner.reset(seed=task_seed, options=options or None)
        self._return = 0.0
        ids = {"task_id": f"{self.name}-{split}-{task_seed}", "task_type": self.name, "seed": task_seed}
        return self._text(obs, "reset"), {**ids, **dict(info), "split": split}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Send an ``{"answer": TEXT}`` action's text to the Gymnasium env; anything else is an error observation."""
        text = self._text_action(action)
        if not isinstance(text, tuple):
            return self._end_step(text)
        return self._after(*self.inner.step(text[0]))

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """:meth:`step` with the Gymnasium env's ``step`` in a worker thread."""
        text = self._text_action(action)
        if not isinstance(text, tuple):
            return self._end_step(text)
        return self._after(*(await asyncio.to_thread(self.inner.step, text[0])))

    def close(self) -> None:
        """Close the Gymnasium env."""
        self.inner.close()
        super().close()

    # -- internals ---------------------------------------------------------------------------------------------
    def _text_action(self, action: str) -> tuple[str] | str:
        """``(text,)`` to send, or the error observation for an action that cannot be sent."""
        parsed = self._begin_step(action)
        if isinstance(parsed, str):
            return parsed
        if isinstance(parsed, ToolAction):  # unreachable: with no tools, every tool is unknown
            return f"Error: {self.env_id} takes no tools; answer with the action text"
        if not self.inner.action_space.contains(parsed.text):
            return f"Error: the action is not in the env's action space {self.inner.action_space!r}"
        return (parsed.text,)

    def _after(
        self, obs: Any, reward: Any, terminated: bool, truncated: bool, info: dict[str, Any]
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._return += float(reward)
        out = {**dict(info), **self._task_info, "turn": self._turn, "env_reward": float(reward)}
        truncated = bool(truncated) or (not terminated and self._turn >= self.max_turns)
        if not (terminated or truncated):
            return self._clip(self._text(obs, "step")), 0.0, False, False, out
        self._done = True
        given = info.get("success")
        out["success"] = given if isinstance(given, bool) else bool(terminated) and self._reached()
        return self._clip(self._text(obs, "step")), self._return, bool(terminated), truncated, out

    def _reached(self) -> bool:
        return self._return >= self.success_reward if self.success_reward is not None else self._return > 0

    def _text(self, obs: Any, where: str) -> str:
        if not isinstance(obs, str):
            raise EnvError(f"{self.env_id}.{where} returned a {type(obs).__name__} observation, not text")
        return obs
