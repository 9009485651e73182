"""RLOO, REINFORCE++, CISPO and the geometric-mean, M2PO and OPSM corrections against numbers computed by hand."""

import math

import pytest
import torch

from trainer import registry
from trainer.losses import (
    LossInputs,
    _extra_inputs,
    batch_normalise,
    off_policy_weights,
    plan_advantages,
    policy_loss,
    rloo_advantages,
    weights_m2po,
    weights_tis,
)
from trainer.types import LossSettings, Sample


def _case():
    # as in test_losses.py: A = +1 on two tokens of row 0, A = -1 on the one model token of row 1
    logp = torch.tensor([[-1.0, -0.5], [-2.0, -7.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.2, -0.5], [-0.5, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return logp, behaviour, adv, mask


def _loss(logp, old, behaviour, adv, mask, denom_tokens=3.0, **cfg):
    x = LossInputs(logp, old, behaviour, adv, mask, cfg.pop("ref", None))
    return policy_loss(x, LossSettings(**cfg), denom_tokens=denom_tokens, denom_seqs=2.0)


def _sample(reward, group, mask, behaviour=None, ref=None, sid=""):
    n = len(mask)
    return Sample([1] * n, mask, behaviour or [0.0] * n, reward, group, sid, ref_logprobs=ref)


# -- advantages ---------------------------------------------------------------------------------------------------


def test_rloo_leave_one_out_by_hand():
    adv = rloo_advantages([1.0, 0.0, 0.0, 1.0, 2.0, 4.0], ["a", "a", "a", "b", "c", "c"])
    # a: 1 - (0 + 0) / 2 = 1, 0 - (1 + 0) / 2 = -0.5 (twice); b alone: 0; c: 2 - 4 = -2, 4 - 2 = 2
    assert adv == pytest.approx([1.0, -0.5, -0.5, 0.0, -2.0, 2.0])
    samples = [_sample(1.0, "a", [0, 1, 1]), _sample(0.0, "a", [0, 1, 1]), _sample(0.0, "a", [0, 1, 0])]
    plan = plan_advantages(samples, LossSettings(name="rloo"))
    assert plan.advantages == [[1.0] * 3, [-0.5] * 3, [-0.5] * 3]  # no std division (GRPO would give 1.414)


def test_rloo_with_turn_credit_uses_leave_one_out_per_turn_index():
    a = Sample([9, 1, 7, 3], [0, 1, 0, 1], [0.0] * 4, 1.0, "g", "a", turn_spans=[(1, 2), (3, 4)],
               turn_rewards=[0.0, 1.0])  # fmt: skip
    b = Sample([9, 1, 7, 3], [0, 1, 0, 1], [0.0] * 4, 0.0, "g", "b", turn_spans=[(1, 2), (3, 4)],
               turn_rewards=[0.0, 3.0])  # fmt: skip
    plan = plan_advantages([a, b], LossSettings(name="rloo", turn_credit=True, gamma=1.0))
    # returns (gamma 1): a = [1, 1], b = [3, 3]; each turn index: a - b = -2, b - a = +2
    assert plan.advantages == [[0, -2, 0, -2], [0, 2, 0, 2]]


def test_reinforce_pp_normalises_over_the_batch_tokens():
    samples = [
        _sample(1.0, "g", [0, 1, 1]),
        _sample(0.0, "g", [0, 1, 0]),
        _sample(0.0, "h", [0, 1, 1]),  # another group: a group baseline would give it zeros
    ]
    plan = plan_advantages(samples, LossSettings(name="reinforce_pp"))
    # model-token returns [1, 1 | 0 | 0, 0]: mean 0.4, population variance (2 * 0.6^2 + 3 * 0.4^2) / 5 = 0.24
    std = math.sqrt(0.24)
    hi, lo = 0.6 / std, -0.4 / std  # 1.2247, -0.8165
    assert plan.advantages[0] == pytest.approx([0.0, hi, hi], abs=1e-5)
    assert plan.advantages[1] == pytest.approx([0.0, lo, 0.0], abs=1e-5)
    assert plan.advantages[2] == pytest.approx([0.0, lo, lo], abs=1e-5)
    uniform = plan_advantages([_sample(1.0, "g", [0, 1]), _sample(1.0, "h", [1, 1])], LossSettings(name="reinforce_pp"))
    assert uniform.advantages == [[0.0, 0.0], [0.0, 0.0]]
    assert batch_normalise([[5.0, 7.0]], [[0, 1]]) == [[0.0, 0.0]]  # a single token: nothing to normalise by


def test_reinforce_pp_with_turn_credit_normalises_turn_returns_over_the_batch():
    spans, rewards = [(1, 2), (3, 4)], [[0.0, 1.0], [0.0, 3.0]]
    a, b = (Sample([9, 1, 7, 3], [0, 1, 0, 1], [0.0] * 4, r[-1], "g", sid, turn_spans=spans, turn_rewards=r)
            for sid, r in zip("ab", rewards, strict=True))  # fmt: skip
    plan = plan_advantages([a, b], LossSettings(name="reinforce_pp", turn_credit=True, gamma=1.0))
    # per-token returns [1, 1 | 3, 3]: mean 2, population std 1 -> -1 on a's tokens, +1 on b's
    assert plan.advantages[0] == pytest.approx([0, -1, 0, -1], abs=1e-5)
    assert plan.advantages[1] == pytest.approx([0, 1, 0, 1], abs=1e-5)
    assert plan.phases[0][0] == [0, 0, 0, 1]


def test_reinforce_pp_kl_in_reward_by_hand():
    cfg = LossSettings(name="reinforce_pp", kl_coef=0.1, kl_in_reward=True, kl_estimator="k1")
    a = _sample(1.0, "g", [0, 1, 1], behaviour=[0.0, -1.0, -2.0], ref=[0.0, -1.5, -1.0])
    b = _sample(0.0, "g", [0, 1, 1], behaviour=[0.0, -1.0, -1.0], ref=[0.0, -1.0, -1.0])
    plan = plan_advantages([a, b], cfg)
    # a: k1 = behaviour - ref = [-, 0.5, -1.0]; KL to go [-0.5, -1.0]; returns 1 - 0.1 * that = [1.05, 1.10]
    # b: k1 = 0, returns [0, 0]. Mean 2.15 / 4 = 0.5375; population variance over the four tokens:
    g = [1.05, 1.10, 0.0, 0.0]
    mean = sum(g) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in g) / 4)  # 0.53779
    expected = [(v - mean) / std for v in g]
    assert plan.advantages[0][1:] + plan.advantages[1][1:] == pytest.approx(expected, abs=1e-5)
    assert plan.advantages[0][2] > plan.advantages[0][1]  # the first token carries the second token's KL too
    with pytest.raises(ValueError, match="reference log-probs"):
        plan_advantages([_sample(1.0, "g", [0, 1]), _sample(0.0, "g", [0, 1])], cfg)


def test_kl_in_reward_leaves_the_kl_loss_term_out():
    logp, _, adv, mask = _case()
    ref = torch.tensor([[-1.5, -0.5], [-1.0, 0.0]])
    plain, _ = _loss(logp, logp.detach(), logp.detach(), adv, mask, name="reinforce_pp", off_policy="none")
    with_kl, m = _loss(logp, logp.detach(), logp.detach(), adv, mask, name="reinforce_pp", off_policy="none",
                       kl_coef=0.5, kl_in_reward=True, ref=ref)  # fmt: skip
    assert with_kl.item() == pytest.approx(plain.item())
    assert "kl_ref" not in m


# -- CISPO --------------------------------------------------------------------------------------------------------


def test_cispo_clips_the_weight_but_keeps_every_gradient():
    logp, _, adv, mask = _case()
    old = logp.detach() - torch.tensor([[0.5, 0.1], [-0.5, 0.0]])  # ratios e^0.5 = 1.649, e^0.1 = 1.105, e^-0.5
    cfg = dict(name="cispo", clip_low=0.2, clip_high=0.28, off_policy="none")
    loss, m = _loss(logp, old, old, adv, mask, **cfg)
    w = [1.28, math.exp(0.1), 0.8]  # 1.649 clipped to 1.28; 0.607 clipped to 0.8
    # -sum(w * A * logp) / 3 over the three model tokens: A = 1, 1, -1; logp = -1, -0.5, -2
    expected = -(w[0] * 1 * -1.0 + w[1] * 1 * -0.5 + w[2] * -1 * -2.0) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["clip_frac"].item() == 2.0
    loss.backward()
    # d/dlogp = -w * A / 3: the clipped first token still moves (PPO's clip would give it no gradient)
    assert logp.grad.flatten().tolist() == pytest.approx([-1.28 / 3, -w[1] / 3, 0.8 / 3, 0.0], abs=1e-6)
    # the paper's upper-only clip: clip_low >= 1 leaves the low ratio e^-0.5 as it is
    _, m = _loss(logp, old, old, adv, mask, **{**cfg, "clip_low": 1.0})
    assert m["clip_frac"].item() == 1.0


# -- off-policy corrections -----------------------------------------------------------------------------------------


def test_geo_seq_tis_truncates_the_geometric_mean():
    logp, behaviour, adv, mask = _case()
    # log r: row 0 [0.2, 0.0] -> geometric mean e^0.1; row 1 [-1.5] -> e^-1.5; ratio to old 1, so loss -sum(w A) / 3
    loss, _ = _loss(logp, logp.detach(), behaviour, adv, mask, off_policy="geo_seq_tis", is_cap=2.0)
    assert loss.item() == pytest.approx((-2 * math.exp(0.1) + math.exp(-1.5)) / 3, abs=1e-6)
    loss, _ = _loss(logp, logp.detach(), behaviour, adv, mask, off_policy="geo_seq_tis", is_cap=1.05)
    assert loss.item() == pytest.approx((-2 * 1.05 + math.exp(-1.5)) / 3, abs=1e-6)
    # geo_seq_mis is seq_mis: row 0 e^0.1 kept, row 1 e^-1.5 < 0.5 masked
    loss, _ = _loss(logp, logp.detach(), behaviour, adv, mask, off_policy="geo_seq_mis", is_low=0.5)
    assert loss.item() == pytest.approx(-2 / 3, abs=1e-6)


def test_m2po_drops_the_largest_squares_until_the_second_moment_fits():
    log_r = torch.tensor([[0.5, 0.1, 2.0], [-0.3, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the 2.0 is off the mask: ignored
    r = torch.exp(log_r)
    capped = torch.clamp(r, max=2.0)  # kept tokens weigh min(r, is_cap), as under tis

    def expect(kept):
        return torch.tensor(kept) * capped

    # squares 0.25, 0.01, 0.09, 0: mean 0.35 / 4 = 0.0875; without 0.25: 0.10 / 3 = 0.033; without 0.09 too: 0.005
    keep = weights_m2po(r, log_r, mask, LossSettings(m2po_tau=0.04))
    assert torch.allclose(keep, expect([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    keep = weights_m2po(r, log_r, mask, LossSettings(m2po_tau=0.02))
    assert torch.allclose(keep, expect([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]))
    assert torch.allclose(weights_m2po(r, log_r, mask, LossSettings(m2po_tau=0.1)), capped)  # 0.0875 fits
    # a tie: squares 0.09, 0.09, 0, 0 have mean 0.045; dropping one (the earlier) leaves 0.03
    tie = torch.tensor([[0.3, -0.3, 0.0, 0.0]])
    got = weights_m2po(tie.exp(), tie, torch.ones(1, 4), LossSettings())
    assert torch.allclose(got, torch.tensor([[0.0, math.exp(-0.3), 1.0, 1.0]]))
    empty = weights_m2po(r, log_r, torch.zeros(2, 3), LossSettings())
    assert torch.allclose(empty, capped)


def test_m2po_through_the_loss():
    logp, behaviour, adv, mask = _case()
    # log r = [0.2, 0 | -1.5]: squares 0.04, 0, 2.25 (mean 0.763); dropping 2.25 leaves 0.02 <= 0.04
    loss, m = _loss(logp, logp.detach(), behaviour, adv, mask, off_policy="m2po", m2po_tau=0.04)
    assert loss.item() == pytest.approx(-(math.exp(0.2) + 1.0) / 3, abs=1e-6)  # row 0 weighs r; row 1 dropped
    assert m["is_weight_zero_frac"].item() == 1.0
    tis, _ = _loss(logp, logp.detach(), behaviour, adv, mask, off_policy="tis")
    assert tis.item() == pytest.approx(-(math.exp(0.2) + 1.0 - math.exp(-1.5)) / 3, abs=1e-6)


def test_opsm_masks_negative_drifted_sequences():
    logp = torch.full((3, 2), -1.0)
    behaviour = torch.tensor([[-0.8, -0.9], [-1.0, -0.95], [-0.5, -0.5]])
    adv = torch.tensor([[-1.0, 0.5], [-1.0, -1.0], [2.0, 2.0]])
    mask = torch.ones(3, 2)
    cfg = LossSettings(off_policy="opsm", opsm_delta=0.1)
    # mean log(behaviour / current): row 0 (0.2 + 0.1) / 2 = 0.15 > 0.1 with mean A -0.25 < 0: masked;
    # row 1 (0 + 0.05) / 2 = 0.025 <= 0.1: kept; row 2 drifted by 0.5 but A > 0: kept
    w, m = off_policy_weights(logp, behaviour, mask, cfg, adv, logp)
    assert w.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert m["is_weight_zero_frac"].item() == 2.0
    # the drift is measured against the current policy: old == behaviour (no drift) but current moved by -0.2
    w, _ = off_policy_weights(behaviour, behaviour, mask, cfg, adv, behaviour - 0.2)
    assert w.tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    # through the loss (old = current): rows 1 and 2 give -A per token, (1 + 1 - 2 - 2) / 6
    x = LossInputs(logp.clone().requires_grad_(), logp, behaviour, adv, mask)
    loss, _ = policy_loss(x, cfg, denom_tokens=6.0, denom_seqs=3.0)
    assert loss.item() == pytest.approx(-2 / 6, abs=1e-6)
    with pytest.raises(ValueError, match="needs the advantages"):
        off_policy_weights(logp, behaviour, mask, cfg)


def test_corrections_with_the_basic_signature_get_no_extra_inputs():
    assert _extra_inputs(weights_tis) == frozenset()
    assert _extra_inputs(registry.resolve("off_policy", "opsm")) == {"advantages", "log_r_current"}


# -- config ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["rloo", "reinforce_pp", "cispo"])
def test_new_losses_are_accepted(loss):
    from trainer.config import TrainerConfig

    cfg = TrainerConfig(loss=loss)
    assert cfg.loss_settings().name == loss
    assert registry.resolve("loss", loss) is not None and loss in registry.ADVANTAGES


@pytest.mark.parametrize("name", ["geo_seq_tis", "geo_seq_mis", "m2po", "opsm"])
def test_new_corrections_are_accepted(name):
    from trainer.config import TrainerConfig

    settings = TrainerConfig(off_policy=name, m2po_tau=0.1, opsm_delta=0.01).loss_settings()
    assert (settings.off_policy, settings.m2po_tau, settings.opsm_delta) == (name, 0.1, 0.01)


def test_typos_and_bad_combinations_are_refused():
    from agentflow.config import ConfigError, load_config
    from trainer.config import TrainerConfig

    for key, typo, meant in [("loss", "cispoo", "cispo"), ("loss", "reinforce_p", "reinforce_pp"),
                             ("off_policy", "geo_seq_ti", "geo_seq_tis"), ("off_policy", "opsn", "opsm")]:  # fmt: skip
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"trainer.{key}={typo}"])
        assert f"Did you mean {meant!r}?" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="Did you mean 'rloo'"):
        LossSettings(name="rlo")
    with pytest.raises(ValueError, match="needs loss 'reinforce_pp'"):
        TrainerConfig(kl_in_reward=True, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef > 0"):
        LossSettings(name="reinforce_pp", kl_in_reward=True)
    with pytest.raises(ConfigError, match="m2po_tau"):
        load_config(None, ["trainer.m2po_tau=0"])
    with pytest.raises(ConfigError, match="opsm_delta"):
        load_config(None, ["trainer.opsm_delta=-1"])
    ok = TrainerConfig(loss="reinforce_pp", kl_in_reward=True, kl_coef=0.1).loss_settings()
    assert ok.kl_in_reward and ok.name == "reinforce_pp"
