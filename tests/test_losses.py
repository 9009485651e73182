"""GRPO advantages and loss against numbers computed by hand."""

import math

import pytest
import torch

from trainer.batching import make_micro_batches
from trainer.losses import LossInputs, group_advantages, policy_loss, sft_loss
from trainer.types import LossSettings, Sample


def test_group_advantages_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 3.0, 3.0], ["a", "a", "b", "b", "c", "c"], eps=0.0)
    # group a: mean 0.5, population std 0.5 -> +1, -1; group c: zero variance -> zeros
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0, 0.0, 0.0])
    three = group_advantages([2.0, 0.0, 1.0], ["g"] * 3, eps=0.0)
    std = math.sqrt(2 / 3)
    assert three == pytest.approx([1 / std, -1 / std, 0.0])


def _case():
    # two samples: A = +1 on two tokens, A = -1 on one token (padding position masked)
    logp = torch.tensor([[-1.0, -0.5], [-2.0, -7.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.2, -0.5], [-0.5, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logp, behaviour, adv, mask


def _loss(logp, old, behaviour, adv, mask, **cfg):
    x = LossInputs(logp, old, behaviour, adv, mask, cfg.pop("ref", None), cfg.pop("entropy", None))
    return policy_loss(x, LossSettings(**cfg), denom_tokens=3.0, denom_seqs=2.0)


def test_grpo_loss_by_hand():
    logp, behaviour, adv, mask = _case()
    loss, m = _loss(logp, logp.detach(), behaviour, adv, mask, is_cap=2.0)
    is_w = [math.exp(0.2), 1.0, math.exp(-1.5)]
    expected = (-is_w[0] - is_w[1] + is_w[2]) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # d/d logp of -tis * A * exp(logp - old) at logp = old is -tis * A / denom
    assert logp.grad.flatten().tolist() == pytest.approx([-is_w[0] / 3, -1 / 3, is_w[2] / 3, 0.0], abs=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in is_w)
    assert m["is_approx_k3_kl"].item() == pytest.approx(k3, abs=1e-6)


def test_truncated_and_masked_importance_weights():
    logp, behaviour, adv, mask = _case()
    loss, m = _loss(logp, logp.detach(), behaviour, adv, mask, is_cap=1.1)
    assert loss.item() == pytest.approx((-1.1 - 1.0 + math.exp(-1.5)) / 3, abs=1e-6)
    # masking keeps only tokens with 0.5 <= r <= 1.1: the middle one (r = 1)
    loss, m = _loss(logp, logp.detach(), behaviour, adv, mask, off_policy="mis", is_cap=1.1, is_low=0.5)
    assert loss.item() == pytest.approx(-1.0 / 3, abs=1e-6)
    assert m["is_weight_zero_frac"].item() == 2.0
    loss, _ = _loss(logp, logp.detach(), behaviour, adv, mask, off_policy="none")
    assert loss.item() == pytest.approx((-1 - 1 + 1) / 3, abs=1e-6)


def test_sequence_level_importance_weights():
    logp, behaviour, adv, mask = _case()
    # seq_tis: product of ratios per sequence, truncated: row 0 -> min(e^0.2, 2), row 1 -> e^-1.5
    loss, _ = _loss(logp, logp.detach(), behaviour, adv, mask, off_policy="seq_tis", is_cap=2.0)
    assert loss.item() == pytest.approx((-2 * math.exp(0.2) + math.exp(-1.5)) / 3, abs=1e-6)
    # seq_mis on the geometric mean: row 0 e^0.1 kept, row 1 e^-1.5 < 0.5 dropped
    loss, _ = _loss(logp, logp.detach(), behaviour, adv, mask, off_policy="seq_mis", is_cap=2.0, is_low=0.5)
    assert loss.item() == pytest.approx(-2 / 3, abs=1e-6)


def test_asymmetric_clip_dapo():
    logp, _, adv, mask = _case()
    old = logp.detach() - 0.24  # ratio e^0.24 = 1.271 on every token
    r = math.exp(0.24)
    # clip-higher 0.28 leaves 1.271 unclipped; symmetric 0.2 clips the positive-advantage tokens at 1.2
    loss, m = _loss(logp, old, logp.detach() - 0.24, adv, mask, name="dapo", clip_high=0.28, off_policy="none")
    assert loss.item() == pytest.approx((-2 * r + r) / 3, abs=1e-6)
    assert m["clip_frac"].item() == 0.0
    loss, m = _loss(logp, old, logp.detach() - 0.24, adv, mask, clip_high=0.2, off_policy="none")
    assert loss.item() == pytest.approx((-2 * 1.2 + r) / 3, abs=1e-6)  # A<0: min picks the unclipped r*A
    assert m["clip_frac"].item() == 3.0


def test_gspo_sequence_ratio_by_hand():
    logp, _, adv, mask = _case()
    old = torch.tensor([[-1.1, -0.7], [-1.0, 0.0]])
    loss, _ = _loss(logp, old, old, adv, mask, name="gspo", clip_low=0.2, clip_high=0.2, off_policy="none")
    s0 = math.exp(((-1.0 + 1.1) + (-0.5 + 0.7)) / 2)  # e^0.15 = 1.162, inside the clip range
    s1 = math.exp(-1.0)  # 0.368 < 0.8: clipped, but A < 0 so min picks the clipped 0.8 * -(-1)... = max loss
    expected = (-(s0 * 1.0) + max(s1 * 1.0, 0.8 * 1.0)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # gradient of row 0 flows through the sequence ratio: d/dlogp_t (-s0) = -s0 / 2 / denom_seqs
    assert logp.grad[0].tolist() == pytest.approx([-s0 / 4, -s0 / 4], abs=1e-6)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_to_reference_estimators(est):
    logp, _, adv, mask = _case()
    ref = torch.tensor([[-1.5, -0.5], [-1.0, 0.0]])
    zero_adv = torch.zeros_like(adv)
    loss, m = _loss(logp, logp.detach(), logp.detach(), zero_adv, mask, kl_coef=0.5, kl_estimator=est, ref=ref)
    d = [0.5, 0.0, -1.0]  # logp - ref on the three model tokens
    per = {"k1": d, "k2": [x * x / 2 for x in d], "k3": [math.exp(-x) - 1 + x for x in d]}[est]
    assert loss.item() == pytest.approx(0.5 * sum(per) / 3, abs=1e-6)
    assert m["kl_ref"].item() == pytest.approx(sum(per), abs=1e-6)
    with pytest.raises(ValueError, match="reference log-probs"):
        _loss(logp, logp.detach(), logp.detach(), zero_adv, mask, kl_coef=0.5)


def test_entropy_bonus():
    logp, _, adv, mask = _case()
    ent = torch.tensor([[1.0, 2.0], [3.0, 9.0]])
    loss, m = _loss(logp, logp.detach(), logp.detach(), torch.zeros_like(adv), mask, entropy_coef=0.1, entropy=ent)
    assert loss.item() == pytest.approx(-0.1 * 6.0 / 3, abs=1e-6)
    assert m["entropy"].item() == pytest.approx(6.0)


def test_turn_credit_plan_reverse_order_and_returns():
    from trainer.losses import plan_advantages, turn_returns

    assert turn_returns([0.0, 0.5, 1.0], 0.5) == pytest.approx([0.5, 1.0, 1.0])
    # two trajectories of one group, two turns each: tokens 1-2 turn 0, tokens 3-4 turn 1
    a = Sample([9, 1, 2, 7, 3, 4], [0, 1, 1, 0, 1, 1], [0.0] * 6, 1.0, "g", "a", turn_spans=[(1, 3), (4, 6)],
               turn_rewards=[0.0, 1.0])  # fmt: skip
    b = Sample([9, 1, 2, 7, 3, 4], [0, 1, 1, 0, 1, 1], [0.0] * 6, 0.0, "g", "b", turn_spans=[(1, 3), (4, 6)],
               turn_rewards=[1.0, 0.0])  # fmt: skip
    plan = plan_advantages([a, b], LossSettings(turn_credit=True, gamma=1.0))
    # returns: a = [1, 1], b = [1, 0]; turn 0 equal -> 0; turn 1 normalised -> +1 / -1
    assert plan.advantages[0] == pytest.approx([0, 0, 0, 0, 1, 1], abs=1e-5)
    assert plan.advantages[1] == pytest.approx([0, 0, 0, 0, -1, -1], abs=1e-5)
    assert plan.phases[0][0] == [0, 0, 0, 0, 1, 1]  # the last turn is updated first
    assert plan.phases[1][0] == [0, 1, 1, 0, 0, 0]


def test_sft_loss_token_mean():
    logp = torch.tensor([[-1.0, -3.0, -5.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    assert sft_loss(logp, mask, denom=2.0).item() == pytest.approx(3.0)


def test_micro_batches_respect_budget_and_align_targets():
    samples = [
        Sample([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.1, -0.2], 1.0, "g", "a"),
        Sample([5, 6], [0, 1], [0.0, -0.3], 0.0, "g", "b"),
        Sample([5, 6, 7], [0, 1, 1], [0.0, -0.4, -0.5], 0.0, "g", "c"),
    ]
    mbs = make_micro_batches(samples, [1.0, -1.0, 0.5], token_budget=7)
    assert sum(len(mb.input_ids) for mb in mbs) == 3
    for mb in mbs:
        assert mb.input_ids.numel() <= 7
    first = mbs[0]  # longest first: sample a alone (2 rows * 4 > 7)
    assert first.rows == [0]
    assert first.input_ids.tolist() == [[5, 6, 7, 8]]
    assert first.target_mask.tolist() == [[0.0, 1.0, 1.0]]
    assert first.behaviour_logprobs[0].tolist() == pytest.approx([0.0, -0.1, -0.2])
    assert first.advantages.tolist() == [[0.0, 1.0, 1.0]]
    assert sum(mb.num_tokens for mb in mbs) == 5


def test_sample_rejects_misaligned_arrays():
    with pytest.raises(ValueError, match="3 ids"):
        Sample([1, 2, 3], [0, 1], [0.0, 0.0, 0.0])


def test_lr_schedule_warmup_then_cosine_to_floor():
    from trainer.megatron_trainer import lr_factor
    from trainer.types import TrainerSettings

    s = TrainerSettings(warmup_steps=4, decay_steps=10, min_lr_ratio=0.1)
    assert [lr_factor(i, s) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_factor(4, s) == pytest.approx(1.0)
    assert lr_factor(9, s) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(14, s) == pytest.approx(0.1) and lr_factor(100, s) == pytest.approx(0.1)
    assert lr_factor(50, TrainerSettings()) == 1.0


def test_uniform_groups_are_dropped_and_errors_never_scored():
    from agentflow.controller import to_samples
    from agentflow.types import Group, Segment, Trajectory

    def traj(gid, i, reward, status="ok"):
        seg = Segment()
        seg.append_context([1, 2])
        seg.append_generated([3], [-0.5], [0])
        return Trajectory(f"{gid}-{i}", "t", gid, "e", segments=[seg], reward=reward, status=status)

    mixed = Group("mixed", 0, [traj("mixed", 0, 1.0), traj("mixed", 1, 0.0), traj("mixed", 2, None, "error")])
    uniform = Group("uniform", 1, [traj("uniform", 0, 1.0), traj("uniform", 1, 1.0)])
    kept = to_samples([mixed, uniform], drop_uniform=True)
    assert [s.sample_id for s in kept] == ["mixed-0/0", "mixed-1/0"]
    assert [s.norm_tokens for s in kept] == [4, 4]  # the dropped group's 2 model tokens still count
    assert len(to_samples([mixed, uniform])) == 4
    assert to_samples([uniform], drop_uniform=True) == []
    with pytest.raises(RuntimeError, match="no trainable trajectories"):
        to_samples([Group("bad", 2, [traj("bad", 0, None, "error")])])
