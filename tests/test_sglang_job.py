"""Whole jobs against the live SGLang server (tests/sglang_live.py): RL with warm-up, and distillation from a teacher
served by SGLang (seq-KD phase, then on-policy distillation).

After every weight sync of the RL job (the one at job start included) the server's log-probs of a fixed probe must
equal the trainer's exported weights' within 1e-4 and differ from the previous version's: the updates demonstrably
reach the server. The server starts each job at a version of its own (another job's), which the job's version 0
replaces before the first rollout or evaluation.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import agentflow.controller as controller
from agentflow.config import load_config
from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.sglang_client import SGLangEngine

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]
PROBE = [5, 17, 33, 101, 7, 250, 12, 64, 9, 300, 41, 8]


def _job_keys(server, run_dir: Path) -> list[str]:
    return [f"model.path={server.model_dir}", "model.init_if_missing=false", f"run.dir={run_dir}",
            "run.progress=false", "run.steps=3", "run.mode=async", "store.batch_groups=2", "store.stale_steps=1",
            "rollout.group_size=2", "rollout.max_new_tokens=12", "eval.episodes=2", "engine.max_len=384",
            "engine.type=sglang", f'engine.urls=["{server.url}"]', "trainer.micro_batch_tokens=2048",
            "trainer.drop_uniform_groups=false"]  # fmt: skip


def _leave_server_elsewhere(server) -> None:
    """What an earlier job leaves behind: other weights under a later version."""
    weights = load_file(str(server.model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    with SGLangEngine([server.url], model_dir=server.model_dir) as client:
        client.update_weights(7, {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in weights.items()})


def _trainer_probe(model_dir: Path, named: dict[str, torch.Tensor]) -> torch.Tensor:
    with EmbeddedEngine(model_dir, max_slots=1, max_len=64, prefix_cache=False) as ref:
        ref.update_weights(1, {k: v.float() for k, v in named.items()})
        return torch.tensor(ref.score(PROBE, 1).logprobs)


@pytest.mark.parametrize("kind", ["http", "gloo"])
def test_rl_job_updates_reach_the_server(sglang_server, tmp_path, monkeypatch, kind) -> None:
    from agentflow.recipes.rl import run_job

    _leave_server_elsewhere(sglang_server)
    seen: list[tuple[int, dict[str, torch.Tensor], torch.Tensor]] = []
    real_sync = controller.sync_weights

    async def sync_and_probe(trainer, transport):
        version, report = await real_sync(trainer, transport)
        named = await asyncio.to_thread(trainer.export_weights)
        served = await asyncio.to_thread(transport.engines[0].score, PROBE, 1)
        seen.append((version, {k: v.detach().clone() for k, v in named.items()}, torch.tensor(served.logprobs)))
        return version, report

    monkeypatch.setattr(controller, "sync_weights", sync_and_probe)
    keys = _job_keys(sglang_server, tmp_path / "run") + [f"transfer.type={kind}", "sft.enabled=true"]
    keys += ["trainer.loss=sft"]  # every step changes the weights (a GRPO step on equal rewards may not)
    keys += ["sft.episodes=16", "sft.val_episodes=4", "sft.max_epochs=1", "sft.batch_size=8"]
    summary = run_job(load_config(None, keys), log=lambda *_: None)
    assert summary["rl_steps"] == 3 and summary["sft"] is not None
    assert [v for v, _, _ in seen] == [0, 1, 2, 3]  # version 0 at job start, then one per step
    previous = None
    for version, named, served in seen:
        want = _trainer_probe(sglang_server.model_dir, named)
        torch.testing.assert_close(served, want, atol=1e-4, rtol=0, msg=f"version {version}")
        change = float((served - previous).abs().max()) if previous is not None else float("nan")
        print(
            f"{kind} v{version}: max |server - trainer| {float((served - want).abs().max()):.2e}, change {change:.2e}"
        )
        if previous is not None:
            assert (served - previous).abs().max() > 1e-6, f"version {version} served the same log-probs"
        previous = served
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["store"]["mean_staleness"] >= 0 for m in metrics if "store" in m)
    assert summary["mean_staleness"] >= 0


def test_distillation_from_a_teacher_served_by_sglang(sglang_server, tmp_path) -> None:
    """Seq-KD on episodes the SGLang-served teacher plays, then on-policy distillation scored by it (by ``url``)."""
    from agentflow.recipes.distill import run_distill

    student = tmp_path / "student"
    student.mkdir()
    for f in sglang_server.model_dir.iterdir():
        (student / f.name).write_bytes(f.read_bytes())
    run_dir = tmp_path / "distill"
    keys = [k for k in _job_keys(sglang_server, run_dir) if not k.startswith(("engine.", "model.path"))]
    keys += [f"model.path={student}", "sft.enabled=false", "run.steps=2"]
    teacher = {"name": "t", "url": sglang_server.url, "tokenizer": str(sglang_server.model_dir)}
    keys += [f"teachers.models=[{json.dumps(teacher)}]", 'teachers.routes={"default": "t"}', "teachers.reward_coef=0.5"]
    keys += ["teachers.seq_kd.episodes=10"]
    summary = run_distill(load_config(None, keys), log=lambda *_: None)
    assert summary["rl_steps"] == 2
    assert summary.get("seq_kd") is not None
