"""``run.cpus`` and ``run.trainer_cpus``: the job's process and the trainer's on separate cores, checked on the
real processes of a built job, and refused with one line naming the key when they cannot hold."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from agentflow.builder import JobError, build_job, refuse_unsupported
from agentflow.config import ConfigError, load_config
from agentflow.model_init import ModelInitConfig, init_model
from agentflow.types import SamplingParams

TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)
HAVE = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tiny"), TINY)


def _cfg(model, run_dir, *extra: str):
    return load_config(None, [f"model.path={model}", "sft.enabled=false", f"run.dir={run_dir}", "run.progress=false",
                              "engine.max_len=384", "engine.max_slots=4", *extra])  # fmt: skip


def _threads_cores() -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(len(HAVE) < 2, reason="needs two cores to tell the job's core from the trainer's")
def test_the_job_and_its_trainer_run_on_their_own_cores_until_the_job_ends(tiny_model, tmp_path):
    job_core, trainer_core = HAVE[0], HAVE[1]
    cfg = _cfg(tiny_model, tmp_path, f"run.cpus=[{job_core}]", f"run.trainer_cpus=[{trainer_core}]")
    started = threading.Event()
    stop = threading.Event()
    early = threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True)
    early.start()  # a thread that runs before the job starts is moved too
    started.wait()

    async def inside() -> tuple[dict[int, set[int]], list[set[int]], list[set[int]]]:
        async with build_job(cfg, tiny_model, tmp_path) as job:
            await job.engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))  # the decode thread runs
            here = _threads_cores()
            trainer = [os.sched_getaffinity(p) for p in job.trainer.pids()]
            sandbox = await asyncio.create_subprocess_exec("sleep", "5")
            child = [os.sched_getaffinity(sandbox.pid)]
            sandbox.kill()
            await sandbox.wait()
            return here, trainer, child

    here, trainer, child = asyncio.run(inside())
    assert all(c == {job_core} for c in here.values())  # every thread: main, decode, executor, the early one
    assert trainer == [{trainer_core}]
    assert child == [{job_core}]  # programs the job starts (sandboxes, tools) inherit its core
    assert all(c == set(HAVE) for c in _threads_cores().values())  # given back when the job ends
    stop.set()


def test_the_trainer_alone_pinned_leaves_the_job_on_every_core(tiny_model, tmp_path):
    cfg = _cfg(tiny_model, tmp_path, f"run.trainer_cpus=[{HAVE[-1]}]")

    async def inside() -> tuple[set[int], list[set[int]]]:
        async with build_job(cfg, tiny_model, tmp_path) as job:
            return os.sched_getaffinity(0), [os.sched_getaffinity(p) for p in job.trainer.pids()]

    mine, trainer = asyncio.run(inside())
    assert mine == set(HAVE) and trainer == [{HAVE[-1]}]


def test_a_job_pinned_alone_starts_its_trainer_on_every_core_it_had(tiny_model, tmp_path):
    cfg = _cfg(tiny_model, tmp_path, f"run.cpus=[{HAVE[0]}]")

    async def inside() -> list[set[int]]:
        async with build_job(cfg, tiny_model, tmp_path) as job:
            return [os.sched_getaffinity(p) for p in job.trainer.pids()]

    assert asyncio.run(inside()) == [set(HAVE)]  # not the job's one core, which a child would inherit


@pytest.mark.parametrize("key", ["cpus", "trainer_cpus"])
def test_cores_the_job_may_not_use_are_refused_before_anything_starts(tiny_model, tmp_path, key):
    absent = max(HAVE) + 1
    cfg = _cfg(tiny_model, tmp_path, f"run.{key}=[{absent}]")
    with pytest.raises(JobError, match=rf"^run\.{key}=\[{absent}\]: cores \[{absent}\] are not available"):
        refuse_unsupported(cfg, "rl")


@pytest.mark.parametrize("value", ["[]", "[0,0]", "[-1]"])
def test_an_empty_repeated_or_negative_core_list_is_a_config_error(value):
    with pytest.raises(ConfigError, match="distinct core numbers"):
        load_config(None, [f"run.cpus={value}"])


def test_pinning_is_refused_under_ray():
    with pytest.raises(ConfigError, match=r"run\.trainer_cpus pins local processes; under Ray"):
        load_config(None, ["run.trainer_cpus=[0]", "ray.enabled=true"])
