"""The trainer's step on a real megatron-core model: every objective runs, resume is exact, old log-probs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from agentflow.model_init import ModelInitConfig, init_model
from trainer.types import LossSettings, Sample, TrainerSettings

TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tiny"), TINY)


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(6):
        ids = torch.randint(3, 500, (14,), generator=g).tolist()
        mask = [0] * 5 + [1] * 4 + [0] * 2 + [1] * 3
        behaviour = [(-2.0 - 0.1 * t) * m for t, m in enumerate(mask)]
        out.append(
            Sample(
                ids,
                mask,
                behaviour,
                float(i % 2),
                f"g{i // 3}",
                f"s{i}",
                ref_logprobs=[-3.0] * 14,
                turn_spans=[(5, 9), (11, 14)],
                turn_rewards=[0.0, float(i % 2)],
                turn_nodes=[f"g{i // 3}:0", f"s{i}:1"],
            )  # fmt: skip
        )
    return out


def _trainer(model_dir, **loss):
    from trainer.megatron_trainer import MegatronTrainer

    return MegatronTrainer(model_dir, TrainerSettings(lr=1e-2, threads=1, loss=LossSettings(**loss)))


@pytest.mark.parametrize(
    "loss",
    [
        {},
        {"name": "dapo", "clip_high": 0.28},
        {"name": "gspo", "off_policy": "seq_tis"},
        {"off_policy": "mis", "is_low": 0.0, "is_cap": 100.0},  # synthetic behaviour is far from the model
        {"kl_coef": 0.1, "kl_estimator": "k2"},
        {"entropy_coef": 0.01},
        {"turn_credit": True, "gamma": 0.9},
        {"tree_credit": True},
        {"minibatches": 2, "recompute_old": True},
    ],
)
def test_every_objective_trains(tiny_model, loss):
    t = _trainer(tiny_model, **loss)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    m = t.train_step(_samples())
    assert t.version == 1 and all(torch.isfinite(torch.tensor(v)) for v in m.values())
    phased = loss.get("turn_credit") or loss.get("tree_credit") or loss.get("minibatches") == 2
    assert m["optimizer_steps"] == (2 if phased else 1)  # turn-level credit: one step per turn depth
    changed = any(not torch.equal(before[n], p) for n, p in t.model.named_parameters())
    assert changed


def test_recomputed_old_logprobs_equal_the_current_ones_before_the_update(tiny_model):
    t = _trainer(tiny_model)
    samples = _samples()
    old = t._old_logprobs(samples)
    for s, o in zip(samples, old, strict=True):
        assert o[1:] == pytest.approx(t.sequence_logprobs(s.token_ids), abs=1e-6)


def test_empty_batch_is_a_noop_step_that_counts(tiny_model):
    t = _trainer(tiny_model)
    before = [p.detach().clone() for p in t.model.parameters()]
    assert t.train_step([])["skipped"] == 1.0 and t.version == 1
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters(), strict=True))


def test_four_steps_equal_two_save_resume_two(tiny_model, tmp_path):
    samples = _samples()
    batches = [samples[:3], samples[3:], list(reversed(samples[:3])), samples[1:5]]
    a = _trainer(tiny_model, turn_credit=False)
    for b in batches:
        a.train_step(b)
    c = _trainer(tiny_model)
    for b in batches[:2]:
        c.train_step(b)
    c.save_checkpoint(tmp_path / "ck.pt", {"trained_ids": ["x"]})
    d = _trainer(tiny_model)
    assert d.load_checkpoint(tmp_path / "ck.pt") == {"trained_ids": ["x"]}
    for b in batches[2:]:
        d.train_step(b)
    assert d.version == a.version == 4 and d.step == 4
    for (n, p), (_, q) in zip(a.model.named_parameters(), d.model.named_parameters(), strict=True):
        assert (p - q).abs().max().item() <= 1e-6, n
    assert d.optimizer.state_dict()["state"].keys() == a.optimizer.state_dict()["state"].keys()


def test_bad_loss_settings_are_refused():
    with pytest.raises(ValueError, match="unknown loss"):
        LossSettings(name="ppo2")
    with pytest.raises(ValueError, match="off_policy"):
        LossSettings(off_policy="weird")
    with pytest.raises(ValueError, match="Did you mean 'gspo'"):
        LossSettings(name="gsp")
    with pytest.raises(ValueError, match="kl_estimator"):
        LossSettings().kl_estimator = "k4"  # assignment is validated too


def test_norm_tokens_scales_the_loss_average(tiny_model):
    """Rows that carry a larger batch token count (dropped zero-advantage groups) give a proportionally smaller loss."""
    samples = _samples()
    own = sum(sum(s.loss_mask) for s in samples)
    plain = _trainer(tiny_model).train_step(samples)
    diluted = _trainer(tiny_model).train_step([replace(s, norm_tokens=4 * own) for s in samples])
    assert diluted["loss"] == pytest.approx(plain["loss"] / 4, rel=1e-4)
    # the diagnostics stay means over the rows' own model tokens: the left-out groups were never measured
    for key in ("nll", "logprob_abs_diff", "is_approx_k3_kl", "is_weight_mean", "clip_frac"):
        assert diluted[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-9), key


def _uneven_samples() -> list[Sample]:
    """Two-turn samples and one-turn ones: the deepest phase has nothing to train in the one-turn samples."""
    out = _samples()
    for s in out[::2]:
        s.turn_spans, s.turn_rewards, s.turn_nodes = [(5, 9)], [s.reward], s.turn_nodes[:1]
        s.loss_mask = [0] * 5 + [1] * 4 + [0] * 5
    return out


def test_a_phase_skips_samples_with_nothing_to_train_and_matches_training_them_all(tiny_model):
    """Samples without a token in a phase add no gradient: leaving them out of that phase's pass (what the trainer
    does) gives the weights that passing every sample through every phase gives."""
    from trainer.losses import plan_advantages

    samples = _uneven_samples()
    skipped = _trainer(tiny_model, turn_credit=True)
    m = skipped.train_step(samples)
    assert m["optimizer_steps"] == 2
    every = _trainer(tiny_model, turn_credit=True)
    cfg = every.settings.loss
    plan = plan_advantages(samples, cfg)
    assert any(not any(plan.phases[0][i]) for i in range(len(samples)))  # the first phase skips someone
    for phase in plan.phases:
        every._update(samples, [(plan.advantages[i], phase[i], None) for i in range(len(samples))], cfg,
                      False)  # fmt: skip
    for (n, p), (_, q) in zip(skipped.model.named_parameters(), every.model.named_parameters(), strict=True):
        assert (p - q).abs().max().item() <= 1e-6, n


def test_turn_phases_bounds_the_reverse_order_updates(tiny_model):
    from trainer.losses import plan_advantages

    samples = _samples()
    per_depth = plan_advantages(samples, LossSettings(turn_credit=True))
    banded = plan_advantages(samples, LossSettings(turn_credit=True, turn_phases=1))
    assert len(per_depth.phases) == 2 and len(banded.phases) == 1 and banded.advantages == per_depth.advantages
    assert banded.phases[0] == [s.loss_mask for s in samples]  # one band: every trained token once
    assert _trainer(tiny_model, turn_credit=True, turn_phases=1).train_step(samples)["optimizer_steps"] == 1
    with pytest.raises(ValueError, match="turn_phases bounds"):
        LossSettings(turn_phases=2)


def _bounded(model_dir, bound):
    from trainer.megatron_trainer import MegatronTrainer

    return MegatronTrainer(model_dir, TrainerSettings(lr=1e-2, threads=1, max_step_kl=bound))


def test_max_step_kl_halves_the_step_along_its_direction_until_the_batch_kl_is_within_bound(tiny_model):
    """The bounded step is the plain step scaled by 1/2^k (same Adam direction), and its measured KL is in bound."""
    plain = _trainer(tiny_model)
    start = [p.detach().clone() for p in plain.model.parameters()]
    plain.train_step(_samples())
    full = [p.detach() - w for p, w in zip(plain.model.parameters(), start, strict=True)]
    loose = _bounded(tiny_model, 1e6).train_step(_samples())
    assert loose["step_scale"] == 1.0 and loose["step_kl"] > 0
    bound = loose["step_kl"] / 50  # the full step is far too large for this bound; some halving fits it
    t = _bounded(tiny_model, bound)
    m = t.train_step(_samples())
    assert 0 < m["step_scale"] < 1 and m["step_kl"] <= bound
    for p, w, d in zip(t.model.parameters(), start, full, strict=True):
        assert torch.allclose(p.detach(), w + m["step_scale"] * d, atol=1e-6)
    # the KL it reports is the batch's KL between the weights of before and after, measured again here
    after = t.sample_logprobs(_samples())
    before_t = _bounded(tiny_model, 1e6)
    before = before_t.sample_logprobs(_samples())
    k3 = [math.exp(a - b) - 1 - (a - b) for s, la, lb in zip(_samples(), after, before, strict=True)
          for a, b, k in zip(la, lb, s.loss_mask, strict=True) if k]  # fmt: skip
    assert sum(k3) / len(k3) == pytest.approx(m["step_kl"], rel=1e-3)


def test_max_step_kl_keeps_the_weights_when_even_a_32nd_of_the_step_is_too_far(tiny_model):
    t = _bounded(tiny_model, 1e-15)
    start = [p.detach().clone() for p in t.model.parameters()]
    m = t.train_step(_samples())
    assert m["step_scale"] == 0.0 and m["step_kl"] == 0.0 and t.version == 1
    assert all(torch.equal(p.detach(), w) for p, w in zip(t.model.parameters(), start, strict=True))
