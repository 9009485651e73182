"""The white-box agent loop: we own every token between the engine and the environment.

One episode = one root segment. The first prompt is encoded once; after that the segment grows only by the engine's
output ids (kept exactly) and encodings of new messages (tool results, errors). A malformed tool call becomes an error
message to the model and the episode continues; an exception from the env marks the trajectory ``error`` (never a
reward of 0).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from agentflow.chat import IM_END, ChatTokenizer, parse_reply
from agentflow.types import InferenceEngine, SamplingParams, Segment, Trajectory, Turn
from envs.core import answer_action, tool_action

_MAX_RECYCLES = 4


@dataclass
class EpisodeSpec:
    """What to run: a task seed of a split, and where the trajectory belongs."""

    traj_id: str
    group_id: str
    seed: int
    split: str = "train"
    data_source: str = "default"
    env_id: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra ``reset`` options (the data source's task set)."""
    tags: tuple[str, ...] = ()
    """The data source's tags (what teachers route on)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the env is made with."""


async def run_episode(
    engine: InferenceEngine,
    tokenizer: ChatTokenizer,
    env: Any,
    spec: EpisodeSpec,
    sampling: SamplingParams,
    max_len: int,
    context: str = "truncate",
    recycle: bool = False,
    unfinished_turn: str = "act",
) -> Trajectory:
    """Play one episode; always returns a trajectory (status says how it ended).

    ``context="compact"``: when the context is full, continue in a new ``compact`` segment (the first prompt plus
    the tool results so far) instead of ending ``truncated``. ``recycle``: a generation aborted because the weights
    changed under it is run again from the same input (partial rollouts recycled, counted in ``info["recycled"]``).
    ``unfinished_turn="end"``: a reply cut at the token budget ends the episode ``truncated`` with reward 0 (its
    tokens are kept as the last turn, with ``error`` saying so) instead of going to the env.
    """
    traj = Trajectory(id=spec.traj_id, task_id=f"{spec.split}:{spec.seed}", group_id=spec.group_id, env_id=spec.env_id)
    traj.data_source, traj.tags = spec.data_source, list(spec.tags)
    play = _play(engine, tokenizer, env, spec, sampling, max_len, traj, context, recycle, unfinished_turn)
    return await _guarded(traj, play)


async def _guarded(traj: Trajectory, play: Any) -> Trajectory:
    """Await ``play`` (which fills ``traj``); an exception from the env or engine keeps the tokens, says why and is
    never scored. Times the episode."""
    t0 = time.perf_counter()
    try:
        await play
    except Exception as e:
        traj.status, traj.reward = "error", None
        traj.error = f"{type(e).__name__}: {e}"
        traj.info["traceback"] = traceback.format_exc(limit=5)
    traj.timings["episode_s"] = time.perf_counter() - t0
    return traj


async def _play(
    engine, tokenizer, env, spec, sampling, max_len, traj: Trajectory, context, recycle, unfinished
) -> None:
    obs, info = await env.areset(seed=spec.seed, options={**spec.options, "split": spec.split})
    traj.info.update(task_type=info.get("task_type"), split=spec.split)
    seg = Segment(kind="root")
    traj.segments.append(seg)
    seg.append_context(tokenizer.prompt_ids(env.system_prompt, obs, [t.to_openai() for t in env.tools]))
    await _turns(engine, tokenizer, env, sampling, max_len, traj, context, recycle, unfinished, obs, 0)


async def run_branch(
    engine: InferenceEngine,
    tokenizer: ChatTokenizer,
    env: Any,
    spec: EpisodeSpec,
    sampling: SamplingParams,
    max_len: int,
    root: Trajectory,
    at_turn: int,
    unfinished_turn: str = "act",
) -> Trajectory:
    """Continue ``root`` from the state after its first ``at_turn`` turns: the env is brought there as it declares
    (:mod:`envs.branching`), the context is the root's token ids up to that turn (so the engine's prefix cache
    serves it), and the loop goes on from there. The shared prefix is the root's and is not trained again (loss mask
    0); ``info["branch_of"]``/``info["branch_turn"]`` say where the branch starts. Always returns a trajectory
    (``error`` with the reason when the env cannot be brought back)."""
    traj = Trajectory(id=spec.traj_id, task_id=root.task_id, group_id=spec.group_id, env_id=spec.env_id)
    traj.data_source, traj.tags = spec.data_source, list(spec.tags)
    traj.info.update(task_type=root.info.get("task_type"), split=spec.split, branch_of=root.id, branch_turn=at_turn)
    return await _guarded(traj, _branch(engine, tokenizer, env, spec, sampling, max_len, root, at_turn, unfinished_turn,
                                        traj))  # fmt: skip


async def _branch(engine, tokenizer, env, spec, sampling, max_len, root, at_turn, unfinished, traj) -> None:
    from envs.branching import branch

    if len(root.segments) != 1 or not 1 <= at_turn < len(root.turns):
        raise ValueError(f"branch at turn {at_turn} of a {len(root.turns)}-turn, {len(root.segments)}-segment root")
    shared = root.turns[:at_turn]
    seg = Segment(kind="root")
    seg.append_context(root.segments[0].token_ids[: root.turns[at_turn].span[0]])
    traj.segments.append(seg)
    traj.turns = [Turn(t.index, t.action, t.observation, t.reward, t.error, [], 0, t.span) for t in shared]
    actions = [t.action for t in shared if t.action is not None]  # malformed turns never reached the env
    await branch(env, spec.seed, {**spec.options, "split": spec.split}, actions)
    await _turns(engine, tokenizer, env, sampling, max_len, traj, "truncate", False, unfinished, shared[-1].observation,
                 at_turn)  # fmt: skip


async def _turns(
    engine, tokenizer, env, sampling, max_len, traj: Trajectory, context, recycle, unfinished, obs, first: int
) -> None:
    """The token loop from turn ``first`` on, extending ``traj``'s last segment (``obs``: the last observation)."""
    seg = traj.segments[-1]
    tools = [t.to_openai() for t in env.tools]
    gen_s = env_s = 0.0
    for turn_idx in range(first, env.max_turns):
        budget = min(sampling.max_new_tokens, max_len - len(seg.token_ids))
        if budget <= 0 and context == "compact":
            seg = _compact(tokenizer, env, obs, tools, traj)
            budget = min(sampling.max_new_tokens, max_len - len(seg.token_ids))
        if budget <= 0:
            traj.status, traj.reward = "truncated", 0.0
            break
        t = time.perf_counter()
        req = _with_budget(sampling, budget, tokenizer.stop_ids)
        res = await _generate(engine, list(seg.token_ids), req, f"{traj.id}:{turn_idx}", recycle, traj)
        gen_s += time.perf_counter() - t
        start = len(seg.token_ids)
        seg.append_generated(res.output_ids, res.logprobs, res.versions)
        seg.routes.extend(res.routed_experts or ())
        if res.finish_reason == "abort":
            traj.status, traj.reward = "aborted", None
            break
        span = (start, start + len(res.output_ids))
        if res.finish_reason == "length":  # close the unfinished message so the next turn stays well-formed
            seg.append_context(tokenizer.encode(IM_END))
            if unfinished == "end":
                cut = f"reply cut at {len(res.output_ids)} tokens before its end token"
                traj.turns.append(Turn(turn_idx, None, "", error=cut, segment=len(traj.segments) - 1, span=span))
                traj.status, traj.reward = "truncated", 0.0
                break
        t = time.perf_counter()
        turn, done, step_info = await _act(env, tokenizer.decode(res.output_ids), turn_idx, span)
        turn.segment = len(traj.segments) - 1
        env_s += time.perf_counter() - t
        traj.turns.append(turn)
        if done:
            traj.reward = turn.reward
            if step_info.get("truncated"):
                traj.status = "truncated"
            traj.info["success"] = bool(step_info.get("success", turn.reward > 0))
            break
        seg.append_context(tokenizer.continuation_ids([{"role": "tool", "content": turn.observation}]))
    else:
        traj.status, traj.reward = "truncated", 0.0
    if traj.status == "truncated":
        traj.info["success"] = False
    traj.timings.update(generate_s=gen_s, env_s=env_s)


async def _generate(engine, ids: list[int], req: SamplingParams, rid: str, recycle: bool, traj: Trajectory):
    """One generation; with ``recycle``, one aborted by a weight update is discarded and run again."""
    for attempt in range(_MAX_RECYCLES + 1):
        version = engine.weight_version
        res = await engine.generate(ids, req, rid=f"{rid}:{attempt}" if attempt else rid)
        if not (recycle and res.finish_reason == "abort" and engine.weight_version != version):
            break
        traj.info["recycled"] = traj.info.get("recycled", 0) + 1
    return res


def _compact(tokenizer: ChatTokenizer, env, first_obs: str, tools: list, traj: Trajectory) -> Segment:
    """A new ``compact`` segment: the first prompt plus the tool results so far (env text only: the model's own
    tokens stay in the segment that generated them and are never re-encoded)."""
    results = [t.observation for t in traj.turns if t.action is not None and t.observation]
    user = first_obs + ("\n\nTool results so far:\n" + "\n".join(results) if results else "")
    seg = Segment(kind="compact")
    seg.append_context(tokenizer.prompt_ids(env.system_prompt, user, tools))
    traj.segments.append(seg)
    return seg


async def _act(env, text: str, idx: int, span: tuple[int, int]) -> tuple[Turn, bool, dict]:
    """Turn model text into a canonical action and step the env (or answer with an error message)."""
    reply = parse_reply(text)
    if reply.error is not None:
        turn = Turn(index=idx, action=None, observation=f"Error: {reply.error}", error=reply.error, span=span)
        return turn, False, {}
    if reply.tool_calls:
        call = reply.tool_calls[0]  # one tool call per turn: the env answers each turn once
        action = tool_action(call.name, call.arguments)
    else:
        action = answer_action(reply.content)
    obs, reward, terminated, truncated, info = await env.astep(action)
    turn = Turn(index=idx, action=action, observation=obs, reward=float(reward), span=span)
    turn.images = list(info.get("images", []))
    return turn, bool(terminated or truncated), {**info, "truncated": bool(truncated and not terminated)}


def _with_budget(sampling: SamplingParams, budget: int, stop_ids: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_new_tokens=budget,
        stop_token_ids=tuple(sampling.stop_token_ids) or stop_ids,
        seed=sampling.seed,
        weight_version=sampling.weight_version,
    )
