"""Warm-up SFT's stopping rules: patience, max_epochs and ``stop_val_loss``."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentflow.recipes.warmup import Imitation, train_epochs, weigh_observations
from trainer.batching import make_micro_batches
from trainer.types import Sample


class ScriptedLosses:
    """A trainer group whose validation loss follows a script (the stopping rule is what is under test)."""

    def __init__(self, val: list[float]) -> None:
        self.val, self.saved, self.steps = list(val), [], 0

    def eval_nll(self, samples: list[Sample]) -> float:
        return self.val.pop(0)

    def train_step(self, samples: list[Sample], loss: str | None = None) -> dict[str, float]:
        self.steps += 1
        return {"loss": 1.0}

    def save_hf(self, path: str | Path) -> Path:
        self.saved.append(len(self.saved))
        return Path(path)


SAMPLES = [Sample([1, 2, 3], [0, 1, 1], [0.0] * 3) for _ in range(4)]


def _how(**kw) -> Imitation:
    return Imitation(lr=1e-3, max_epochs=8, batch_size=2, patience=2, threads=1, warmup_steps_max=0, **kw)


def test_stop_val_loss_stops_at_the_first_epoch_at_or_below_it(tmp_path):
    group = ScriptedLosses([5.0, 0.5, 0.14, 0.019, 0.015, 0.01])
    logs: list[str] = []
    report = train_epochs(group, SAMPLES, SAMPLES, _how(stop_val_loss=0.02), 0, tmp_path, logs.append)
    assert report["epochs"] == 3 and report["best_val_loss"] == 0.019
    assert group.steps == 3 * 2 and len(group.saved) == 3  # the stopping epoch's weights are the ones kept
    assert "stop_val_loss" in logs[-1]


def test_without_stop_val_loss_patience_decides(tmp_path):
    group = ScriptedLosses([5.0, 0.5, 0.14, 0.019, 0.03, 0.02, 0.01])
    report = train_epochs(group, SAMPLES, SAMPLES, _how(), 0, tmp_path, lambda _: None)
    assert report["epochs"] == 5 and report["best_val_loss"] == 0.019 and len(group.saved) == 3


def test_observation_weight_puts_the_environments_tokens_in_the_loss_at_that_weight():
    sample = Sample([5, 6, 7, 8, 9], [0, 0, 1, 1, 0], [0.0] * 5)
    weighted = weigh_observations(sample, 0.25)
    assert weighted.loss_mask == [0.25, 0.25, 1.0, 1.0, 0.25] and sample.loss_mask == [0, 0, 1, 1, 0]
    (mb,) = make_micro_batches([weighted], [0.0], token_budget=64)
    # position t of the mask weighs the prediction of token t+1: the first token is never predicted
    assert mb.target_mask.tolist() == [[pytest.approx(0.25), 1.0, 1.0, pytest.approx(0.25)]]
    assert mb.num_tokens == 2  # the loss's denominator: 2.5 weighted tokens, counted whole


def test_the_cache_key_reads_the_source_of_modules_with_and_without_a_file():
    import sys
    import types

    from agentflow.recipes import warmup

    assert (
        warmup._module_source("envs.desktop.env")
        == Path(__file__).parents[1].joinpath("envs/desktop/env.py").read_bytes()
    )
    sys.modules["agentflow_test_no_file"] = types.ModuleType("agentflow_test_no_file")  # as a notebook's module
    try:
        assert warmup._module_source("agentflow_test_no_file") == b"agentflow_test_no_file"
    finally:
        del sys.modules["agentflow_test_no_file"]
