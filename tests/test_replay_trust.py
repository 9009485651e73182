"""The replay trust region: replayed tokens stop getting gradient once the policy has moved past PPO's clip from
the policy that sampled them, in their advantage's direction; fresh tokens are untouched."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.batching import make_micro_batches
from trainer.losses import LossInputs, policy_loss, replay_trust_region
from trainer.types import LossSettings, Sample


def _case():
    # row 0: A = +1, ratios pi/pi_b of e^0.3 (past 1.2) and 1; row 1: A = -1 at e^-1.5 (past 0.8), A = +1 at e^-1.5
    logp = torch.tensor([[-1.0, -0.5], [-2.0, -2.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.3, -0.5], [-0.5, -0.5]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, 1.0]])
    mask = torch.ones(2, 2)
    return logp, behaviour, adv, mask


def _loss(replayed: torch.Tensor | None, **cfg: object) -> tuple[torch.Tensor, dict, torch.Tensor]:
    logp, behaviour, adv, mask = _case()
    x = LossInputs(logp, logp.detach(), behaviour, adv, mask)
    x.replayed = replayed
    loss, metrics = policy_loss(x, LossSettings(off_policy="none", **cfg), denom_tokens=4.0, denom_seqs=2.0)
    loss.backward()
    assert logp.grad is not None
    return loss, metrics, logp.grad


def test_replayed_tokens_past_the_clip_in_their_advantages_direction_get_no_gradient():
    fresh_loss, fresh_m, fresh_grad = _loss(None)
    assert fresh_loss.item() == pytest.approx(-(1 + 1 - 1 + 1) / 4) and "replay_clipped" not in fresh_m
    loss, m, grad = _loss(torch.ones(2, 2))
    # kept: row 0's ratio-1 token and row 1's positive-advantage token (moving toward it is still allowed)
    assert loss.item() == pytest.approx(-(1 + 1) / 4)
    assert grad.flatten().tolist() == pytest.approx([0.0, -0.25, 0.0, -0.25])
    assert m["replay_tokens"].item() == 4 and m["replay_clipped"].item() == 2
    # only replayed rows are clipped; null turns the trust region off
    _, m, grad = _loss(torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert grad.flatten().tolist() == pytest.approx([0.0, -0.25, 0.25, -0.25]) and m["replay_clipped"].item() == 1
    _, m, grad = _loss(torch.ones(2, 2), replay_clip=None)
    assert grad.flatten().tolist() == pytest.approx(fresh_grad.flatten().tolist()) and "replay_clipped" not in m
    # a wider clip keeps row 0's first token (e^0.3 < 1.5) but not row 1's (e^-1.5 < 0.5)
    _, m, _ = _loss(torch.ones(2, 2), replay_clip=0.5)
    assert m["replay_clipped"].item() == 1


def test_the_clip_can_cover_fresh_stale_tokens_too():
    _, replay_m, replay_grad = _loss(torch.ones(2, 2))
    _, m, grad = _loss(None, replay_clip_fresh=True)  # no replayed row: every token is under the clip
    assert grad.flatten().tolist() == pytest.approx(replay_grad.flatten().tolist())
    assert m["replay_tokens"].item() == 4 and m["replay_clipped"].item() == 2
    _, m, grad = _loss(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), replay_clip_fresh=True)  # fresh rows as replayed
    assert grad.flatten().tolist() == pytest.approx(replay_grad.flatten().tolist())
    _, m, _ = _loss(None, replay_clip_fresh=True, replay_clip=None)  # null turns it off for both
    assert "replay_clipped" not in m


def test_trust_region_weights_by_hand():
    logp = torch.log(torch.tensor([[1.25, 1.1, 0.7, 0.9]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    keep = replay_trust_region(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), 0.2)
    assert keep.tolist() == [[0.0, 1.0, 0.0, 1.0]]
    assert replay_trust_region(logp, torch.zeros(1, 4), adv, torch.zeros(1, 4), 0.2).tolist() == [[1.0] * 4]
    assert math.isclose(float(replay_trust_region(logp, torch.zeros(1, 4), -adv, torch.ones(1, 4), 0.2).sum()), 4.0)


@pytest.mark.parametrize("packing", [False, True])
def test_micro_batches_carry_which_rows_are_replays(packing):
    samples = [Sample([5, 6, 7], [0, 1, 1], [0.0, -0.1, -0.2], 1.0, "g", "a"), Sample([5, 6], [0, 1], [0.0, -0.3])]
    (mb,) = make_micro_batches(samples, [1.0, -1.0], token_budget=64, packing=packing)
    assert mb.replayed is None
    samples[1].replayed = True
    (mb,) = make_micro_batches(samples, [1.0, -1.0], token_budget=64, packing=packing)
    assert mb.replayed is not None and mb.replayed.tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_to_samples_marks_the_replayed_groups_rows():
    from agentflow.controller import to_samples
    from agentflow.types import Group, Segment, Trajectory

    def group(gid: str) -> Group:
        trajs = []
        for i, r in enumerate((1.0, 0.0)):
            seg = Segment()
            seg.append_context([1, 2])
            seg.append_generated([3], [-0.5], [0])
            trajs.append(Trajectory(f"{gid}-{i}", "t", gid, "e", segments=[seg], reward=r))
        return Group(gid, 0, trajs)

    rows = to_samples([group("new"), group("old")], replayed={"old"})
    assert [(s.group_id, s.replayed) for s in rows] == [("new", False)] * 2 + [("old", True)] * 2


def test_a_real_trainer_step_reports_the_replay_trust_region(tmp_path):
    from agentflow.model_init import ModelInitConfig, init_model
    from trainer.megatron_trainer import MegatronTrainer
    from trainer.types import TrainerSettings

    tiny = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)
    model = init_model(tmp_path / "m", tiny)
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        ids = torch.randint(3, 500, (8,), generator=g).tolist()
        mask = [0] * 4 + [1] * 4
        # behaviour far more likely than the untrained model: every ratio pi / pi_b is far below 0.8
        samples.append(Sample(ids, mask, [-0.1 * m for m in mask], float(i % 2), "g", f"s{i}", replayed=i < 2))
    trainer = MegatronTrainer(model, TrainerSettings(lr=1e-3, threads=1))
    m = trainer.train_step(samples)
    # rows 0 and 1 are replays; row 0 has a negative advantage, so its 4 tokens are past the clip
    assert m["replay_tokens"] == pytest.approx(0.5) and m["replay_clipped"] == pytest.approx(0.25)
    # the clip on fresh tokens too: all 16 tokens covered, rows 0 and 2 (negative advantages) past it
    fresh_too = TrainerSettings(lr=1e-3, threads=1, loss=LossSettings(replay_clip_fresh=True))
    m = MegatronTrainer(model, fresh_too).train_step(samples)
    assert m["replay_tokens"] == pytest.approx(1.0) and m["replay_clipped"] == pytest.approx(0.5)
