"""GRPO advantages and loss against numbers computed by hand."""

import math

import pytest
import torch

from trainer.batching import make_micro_batches
from trainer.losses import group_advantages, grpo_loss, sft_loss
from trainer.types import Sample


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


def test_grpo_loss_by_hand():
    logp, behaviour, adv, mask = _case()
    loss, m = grpo_loss(logp, logp.detach(), behaviour, adv, mask, denom=3.0, tis_cap=2.0)
    is_w = [math.exp(0.2), 1.0, math.exp(-1.5)]
    expected = (-is_w[0] - is_w[1] + is_w[2]) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # d/d logp of -tis * A * exp(logp - old) at logp = old is -tis * A / denom
    assert logp.grad.flatten().tolist() == pytest.approx([-is_w[0] / 3, -1 / 3, is_w[2] / 3, 0.0], abs=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in is_w)
    assert m["is_approx_k3_kl"].item() == pytest.approx(k3, abs=1e-6)


def test_grpo_truncation_and_clip():
    logp, behaviour, adv, mask = _case()
    loss, m = grpo_loss(logp, logp.detach(), behaviour, adv, mask, denom=3.0, tis_cap=1.1)
    expected = (-1.1 - 1.0 + math.exp(-1.5)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["tis_truncated_frac"].item() == 1.0
    # a ratio outside the clip range stops the gradient of tokens with positive advantage
    old = logp.detach() - 0.5  # ratio e^0.5 > 1.2
    loss, m = grpo_loss(logp, old, logp.detach(), adv, mask, denom=3.0, clip_eps=0.2, tis_cap=10.0)
    loss.backward()
    assert logp.grad[0].tolist() == [0.0, 0.0]
    assert logp.grad[1, 0].item() != 0.0  # negative advantage: min picks the unclipped term
    assert m["clip_frac"].item() == 3.0


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
    assert len(to_samples([mixed, uniform])) == 4
    assert to_samples([uniform], drop_uniform=True) == []
    with pytest.raises(RuntimeError, match="no trainable trajectories"):
        to_samples([Group("bad", 2, [traj("bad", 0, None, "error")])])
