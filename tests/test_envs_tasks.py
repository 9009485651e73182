"""Task sets (disjoint splits), data sources (validated) and the weighted, deterministic data mixture."""

from collections import Counter

import pytest

import envs
from envs.demo import task_seed as calc_task_seed
from envs.errors import UnknownEnvError
from envs.tasks import DataMixture, DataSource, TaskSet, TaskSetError, env_task_sets, simple_task_set


def test_task_set_disjoint_and_mapping():
    ts = TaskSet("s", {"train": range(0, 100), "eval": range(100, 110)})
    assert ts.task_seed(5, "train") == 5 and ts.task_seed(105, "train") == 5
    assert ts.task_seed(3, "eval") == 103 and ts.task_seed(13, "eval") == 103
    assert ts.split_of(104) == "eval" and ts.split_of(0) == "train"
    with pytest.raises(TaskSetError, match=r"splits 'train' and 'eval' overlap on seeds \[50, 100\)"):
        TaskSet("s", {"train": range(0, 100), "eval": range(50, 150)})
    with pytest.raises(TaskSetError, match=r"lacks split\(s\) \['eval'\]"):
        TaskSet("s", {"train": range(0, 10)})
    with pytest.raises(TaskSetError, match="non-empty range"):
        TaskSet("s", {"train": range(0, 10), "eval": range(10, 10)})
    with pytest.raises(TaskSetError, match="has no split 'test'"):
        ts.task_seed(1, "test")
    with pytest.raises(TaskSetError, match="int >= 0"):
        ts.task_seed(-1)
    with pytest.raises(TaskSetError, match="in no split"):
        ts.split_of(500)


def test_every_registered_env_has_disjoint_task_sets():
    for env_id in envs.list_envs():
        if not env_id.startswith("agentflow/"):
            continue
        sets = env_task_sets(env_id)
        assert "default" in sets, env_id
        for ts in sets.values():
            assert set(ts.splits) >= {"train", "eval"}


def test_calc_task_set_matches_demo_seeds():
    ts = env_task_sets("agentflow/Calc-v0")["default"]
    for seed in (0, 7, 999_999, 1_000_003, 123_456_789):
        for split in ("train", "eval"):
            assert ts.task_seed(seed, split) == calc_task_seed(seed, split)


def test_data_source_validation():
    src = DataSource("agentflow/Retrieval-v0", "single_hop", weight=2, tags="qa")
    assert src.name == "agentflow/Retrieval-v0:single_hop" and src.tags == ("qa",) and src.weight == 2.0
    with pytest.raises(UnknownEnvError, match="Did you mean 'agentflow/Retrieval-v0'"):
        DataSource("agentflow/Retreival-v0")
    with pytest.raises(TaskSetError, match="has no task set 'singel_hop'.*Did you mean 'single_hop'"):
        DataSource("agentflow/Retrieval-v0", "singel_hop")
    for bad in (0, -1, float("nan"), True):
        with pytest.raises(TaskSetError, match="weight"):
            DataSource("agentflow/Calc-v0", weight=bad)
    with pytest.raises(TaskSetError, match="tags"):
        DataSource("agentflow/Calc-v0", tags=("",))


def test_mixture_is_deterministic_weighted_and_in_split():
    sources = [
        DataSource("agentflow/Calc-v0", weight=3, tags=("math",)),
        DataSource("agentflow/Retrieval-v0", weight=1, tags=("qa",)),
    ]
    mix = DataMixture(sources, seed=11)
    draws = mix.take(4000)
    assert draws == DataMixture(sources, seed=11).take(4000)
    assert [d.seed for d in draws[:20]] != [d.seed for d in DataMixture(sources, seed=12).take(20)]
    share = Counter(d.source.name for d in draws)["agentflow/Calc-v0:default"] / len(draws)
    assert abs(share - 0.75) < 0.03 and mix.probabilities["agentflow/Calc-v0:default"] == 0.75
    assert mix.draw(17) == draws[17]  # random access
    evals = mix.take(200, split="eval")
    assert mix.take(4000)[:5] == draws[:5]  # eval draws do not shift the train stream
    for d in draws[:200] + evals:
        ts = d.source.get_task_set()
        assert ts.split_of(d.task_seed) == d.split and d.reset_options()["split"] == d.split
    assert [s.name for s in mix.by_tag("qa")] == ["agentflow/Retrieval-v0:default"]
    with pytest.raises(TaskSetError, match="unique"):
        DataMixture([sources[0], sources[0]])
    with pytest.raises(TaskSetError, match="at least one"):
        DataMixture([])


def test_simple_task_set():
    ts = simple_task_set("x", eval_size=5, train_size=10, offset=100)
    assert ts.seed_range("train") == range(100, 110) and ts.seed_range("eval") == range(110, 115)
