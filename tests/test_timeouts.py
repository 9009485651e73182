"""A hung env call (a tool, a verifier, a reset) ends its episode ``error`` with the reason; the job goes on."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from agentflow.config import load_config
from agentflow.store import Journal
from agentflow.threads import DaemonExecutor
from envs import register
from envs.core import AgentEnv
from envs.tasks import simple_task_set

KINDS = {1: "tool", 2: "verifier", 5: "reset"}
"""Task seed % 8 -> what hangs (the other five of eight tasks behave)."""


class HangEnv(AgentEnv):
    """Answer anything; by task seed, the step hangs as a stuck tool call would, the verifier hangs, or the reset."""

    system_prompt = "Answer anything."
    max_turns = 2
    task_sets = {"default": simple_task_set(task_types=("ok", "tool", "verifier", "reset"))}

    def reset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        split = options.get("split", "train")
        task_seed = self.task_sets["default"].task_seed(seed, split)
        self.kind = KINDS.get(task_seed % 8, "ok")
        if self.kind == "reset":
            threading.Event().wait()
        return "Say something.", {"task_id": f"hang-{task_seed}", "task_type": self.kind, "split": split}

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.kind == "tool":
            await asyncio.to_thread(threading.Event().wait)
        return await super().astep(action)

    def score_answer(self, text: str) -> tuple[float, bool]:
        if self.kind == "verifier":
            threading.Event().wait()
        return 1.0, True


register("test/Hang-v0", HangEnv)


def test_daemon_executor_never_waits_for_a_stuck_call():
    pool = DaemonExecutor(max_threads=2)
    stuck = pool.submit(threading.Event().wait)
    assert pool.submit(lambda: 7).result(timeout=5) == 7
    t0 = time.monotonic()
    pool.shutdown(wait=True)
    assert time.monotonic() - t0 < 1 and not stuck.done()


@pytest.mark.timeout(90)
def test_a_job_with_hung_tools_verifiers_and_resets_finishes(pair, tmp_path):
    from agentflow.recipes.rl import run_job

    student, _ = pair
    run = tmp_path / "run"
    cfg = load_config(None, [f"model.path={student}", "sft.enabled=false", "env.id=test_timeouts:test/Hang-v0",
                             f"run.dir={run}", "run.progress=false", "run.steps=3", "store.batch_groups=4",
                             "rollout.group_size=1", "rollout.max_new_tokens=8", "rollout.step_timeout_s=1",
                             "rollout.reset_timeout_s=2", "eval.episodes=8", "engine.max_len=256",
                             "trainer.micro_batch_tokens=2048", "trainer.drop_uniform_groups=false"])  # fmt: skip
    t0 = time.monotonic()
    summary = run_job(cfg, log=lambda *_: None)
    assert summary["rl_steps"] == 3 and time.monotonic() - t0 < 240
    faults = summary["faults"]
    assert faults["env_timeouts"] >= 1 and summary["eval_errors"]["before"] >= 1  # eval seeds 0-7 hit every kind
    reasons = " ".join(faults["env_timeout_reasons"])
    assert "rollout.step_timeout_s" in reasons and "rollout.reset_timeout_s" in reasons
    hung = [t for t in Journal.read(run / "journal.jsonl") if t.info.get("task_type") in ("tool", "verifier")]
    assert all(t.status == "error" and "took longer than 1 s" in (t.error or "") for t in hung)
