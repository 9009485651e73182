"""PPO with a value model: GAE and value clipping against numbers computed by hand, the critic's training, its
isolation from the policy, and exact resume of both."""

from __future__ import annotations

import pytest
import torch

from agentflow.model_init import ModelInitConfig, init_model
from trainer.critic import clipped_value_loss, gae, gae_plan, token_rewards
from trainer.losses import LossInputs, plan_advantages, policy_loss
from trainer.types import LossSettings, Sample, TrainerSettings

TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tiny"), TINY)


def _two_turns() -> Sample:
    """prompt 0-1 | turn 1: model tokens 2-3 | env tokens 4-5 | turn 2: model tokens 6-8."""
    mask = [0, 0, 1, 1, 0, 0, 1, 1, 1]
    return Sample(list(range(10, 19)), mask, [-1.0 * m for m in mask], reward=1.0, group_id="g", sample_id="s",
                  turn_spans=[(2, 4), (6, 9)], turn_rewards=[0.5, 1.0])  # fmt: skip


VALUES = [0.0, 0.0, 0.1, 0.2, 9.0, 9.0, 0.3, 0.4, 0.5]
"""V_t per token; the env tokens' 9.0 must never enter the recursion."""


def test_gae_two_turns_by_hand_skips_env_tokens():
    s = _two_turns()
    rewards = token_rewards(s, LossSettings(name="ppo", turn_credit=True))
    assert rewards == [0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0]  # each turn's reward at its last model token
    adv, ret = gae(rewards, VALUES, s.loss_mask, gamma=0.9, lam=0.8)
    # backwards over model tokens 8, 7, 6, 3, 2 (gamma * lam = 0.72); token 3's next state is token 6's
    # t=8: delta = 1.0 + 0.9 * 0 - 0.5 = 0.5                   A = 0.5
    # t=7: delta = 0 + 0.9 * 0.5 - 0.4 = 0.05                  A = 0.05 + 0.72 * 0.5 = 0.41
    # t=6: delta = 0 + 0.9 * 0.4 - 0.3 = 0.06                  A = 0.06 + 0.72 * 0.41 = 0.3552
    # t=3: delta = 0.5 + 0.9 * 0.3 - 0.2 = 0.57                A = 0.57 + 0.72 * 0.3552 = 0.825744
    # t=2: delta = 0 + 0.9 * 0.2 - 0.1 = 0.08                  A = 0.08 + 0.72 * 0.825744 = 0.67453568
    expected = [0.0, 0.0, 0.67453568, 0.825744, 0.0, 0.0, 0.3552, 0.41, 0.5]
    assert adv == pytest.approx(expected, abs=1e-12)
    # R = A + V on model tokens, 0 elsewhere
    assert ret == pytest.approx([0.0, 0.0, 0.77453568, 1.025744, 0.0, 0.0, 0.6552, 0.81, 1.0], abs=1e-12)


def test_episode_reward_sits_at_the_last_model_token():
    s = _two_turns()
    rewards = token_rewards(s, LossSettings(name="ppo", env_reward_coef=2.0))
    assert rewards == [0.0] * 8 + [2.0]
    adv, ret = gae(rewards, VALUES, s.loss_mask, gamma=1.0, lam=1.0)
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t, R_t = 2 on every model token
    assert adv == pytest.approx([0, 0, 1.9, 1.8, 0, 0, 1.7, 1.6, 1.5])
    assert ret == pytest.approx([0, 0, 2, 2, 0, 0, 2, 2, 2])


def test_gae_plan_whitens_advantages_and_reports_value_stats():
    s = _two_turns()
    cfg = LossSettings(name="ppo", gamma=1.0, lam=1.0)
    plan = gae_plan([s], ["g"], cfg, [VALUES])
    model = [2, 3, 6, 7, 8]
    raw = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5], dtype=torch.float64)  # 1 - V_t
    whitened = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-6)
    assert [plan.advantages[0][t] for t in model] == pytest.approx(whitened.tolist())
    assert plan.returns[0] == pytest.approx([0, 0, 1, 1, 0, 0, 1, 1, 1])  # raw, not whitened
    assert plan.phases == [[s.loss_mask]]
    # value_mean = (0.1 + 0.2 + 0.3 + 0.4 + 0.5) / 5; the returns do not vary: explained variance 0
    assert plan.stats == pytest.approx({"value_mean": 0.3, "return_mean": 1.0, "explained_variance": 0.0})
    raw_plan = gae_plan([s], ["g"], cfg.model_copy(update={"whiten_advantages": False}), [VALUES])
    assert [raw_plan.advantages[0][t] for t in model] == pytest.approx(raw.tolist())
    with pytest.raises(ValueError, match="critic"):
        plan_advantages([s], cfg)  # ppo's advantages need the critic's values


def test_value_clipping_by_hand():
    v = torch.tensor([[1.0, 0.2, 0.5]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[0.6, 0.0, 2.0]])
    mask = torch.ones(1, 3)
    loss, clipped = clipped_value_loss(v, old, returns, mask, clip=0.2)
    # token 0: (1.0 - 0.6)^2 = 0.16 vs clipped v 0.7: 0.01   -> 0.16 (unclipped larger)
    # token 1: (0.2 - 0.0)^2 = 0.04 vs clipped v 0.3: 0.09   -> 0.09 (clipped larger)
    # token 2: v = old: both 2.25
    assert float(loss) == pytest.approx(0.5 * (0.16 + 0.09 + 2.25))
    assert float(clipped) == 1.0
    loss.backward()
    # gradient of 0.5 * (v - R)^2 where the unclipped term wins; none through a clipped value past the range
    assert v.grad[0].tolist() == pytest.approx([0.4, 0.0, -1.5])
    unclipped, none = clipped_value_loss(v.detach(), old, returns, mask, clip=None)
    assert float(unclipped) == pytest.approx(0.5 * (0.16 + 0.04 + 2.25)) and float(none) == 0.0


def test_ppo_policy_loss_is_the_clipped_surrogate():
    logp = torch.tensor([[-1.0, -0.5], [-2.0, -7.0]])
    old = torch.tensor([[-1.3, -0.5], [-1.0, 0.0]])
    adv = torch.tensor([[0.7, -0.2], [1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    x = LossInputs(logp, old, old, adv, mask)
    ppo, m = policy_loss(x, LossSettings(name="ppo"), 3.0, 2.0)
    ratio = torch.exp(logp - old)
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    assert float(ppo) == pytest.approx(float((surrogate * mask).sum() / 3.0))
    assert float(m["clip_frac"]) == 2.0  # ratios e^0.3 and e^-1 leave [0.8, 1.2]


# ---------------------------------------------------------------------------------------------- on the model


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    mask = [0] * 5 + [1] * 4 + [0] * 2 + [1] * 3
    out = []
    for i in range(6):
        ids = torch.randint(3, 500, (14,), generator=g).tolist()
        behaviour = [(-2.0 - 0.1 * t) * m for t, m in enumerate(mask)]
        out.append(Sample(ids, mask, behaviour, float(i % 2), f"g{i // 3}", f"s{i}", turn_spans=[(5, 9), (11, 14)],
                          turn_rewards=[0.25, float(i % 2)]))  # fmt: skip
    return out


def _trainer(model_dir, lr: float = 1e-2, **loss):
    from trainer.megatron_trainer import MegatronTrainer

    return MegatronTrainer(model_dir, TrainerSettings(lr=lr, threads=1, loss=LossSettings(name="ppo", **loss)))


def test_ppo_trains_the_critic_on_a_fixed_batch(tiny_model):
    t = _trainer(tiny_model, lr=1e-3)  # gamma = lam = 1: the returns are the rewards to go, fixed targets
    samples = _samples()
    history = [t.train_step(samples) for _ in range(8)]
    losses = [m["value_loss"] for m in history]
    assert losses[0] == pytest.approx(0.25, abs=1e-6)  # values start at 0; half the rows return 1: 0.5 * 0.5
    assert all(x > y for x, y in zip(losses, losses[1:], strict=False)) and losses[-1] < 0.4 * losses[0], losses
    for m in history:
        assert {"value_loss", "value_mean", "explained_variance", "value_clip_frac", "critic_grad_norm"} <= set(m)
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    assert history[-1]["explained_variance"] > 0.5 > history[0]["explained_variance"] == 0.0


def test_critic_warmup_steps_train_the_critic_alone(tiny_model):
    from trainer.model import model_parameters

    t = _trainer(tiny_model, lr=1e-3, critic_warmup_steps=2)
    policy = {k: v.detach().clone() for k, v in model_parameters(t.model).items()}
    samples = _samples()
    first = [t.train_step(samples) for _ in range(2)]
    assert all(m["policy_frozen"] == 1.0 and "grad_norm" not in m and "critic_grad_norm" in m for m in first)
    assert all(torch.equal(v, policy[k]) for k, v in model_parameters(t.model).items())  # the policy stayed
    assert first[1]["value_loss"] < first[0]["value_loss"] and t.version == 2  # the critic learned; versions count
    third = t.train_step(samples)
    assert third["policy_frozen"] == 0.0 and third["grad_norm"] > 0
    assert any(not torch.equal(v, policy[k]) for k, v in model_parameters(t.model).items())


def test_the_critic_reaches_the_policy_only_through_the_advantages(tiny_model, monkeypatch):
    samples = _samples()
    fixed = [[0.05 * (t % 7) for t in range(len(s.token_ids))] for s in samples]
    a, b = _trainer(tiny_model, turn_credit=True, gamma=0.9, lam=0.8), _trainer(tiny_model, turn_credit=True,
                                                                                  gamma=0.9, lam=0.8)  # fmt: skip
    with torch.no_grad():  # a different value head on b ...
        head = b.critic.model.output_layer.proj
        head.weight.normal_(generator=torch.Generator().manual_seed(1))
        head.bias.fill_(0.3)
    for t in (a, b):  # ... but the same values for the advantages
        monkeypatch.setattr(t.critic, "values", lambda _samples: [list(v) for v in fixed])
    ma, mb = a.train_step(samples), b.train_step(samples)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert ma["value_loss"] != mb["value_loss"]  # the critics themselves did differ
    policy = {p.data_ptr() for p in a.model.parameters()}
    assert policy.isdisjoint(p.data_ptr() for p in a.critic.model.parameters())


def test_the_policy_loss_sends_no_gradient_into_the_critic(tiny_model):
    t = _trainer(tiny_model, value_coef=0.0)
    critic = {n: p.detach().clone() for n, p in t.critic.model.named_parameters()}
    policy = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    m = t.train_step(_samples())
    assert m["critic_grad_norm"] == 0.0
    assert all(torch.equal(critic[n], p) for n, p in t.critic.model.named_parameters())
    assert any(not torch.equal(policy[n], p) for n, p in t.model.named_parameters())


def test_two_steps_save_load_then_one_more_is_exact(tiny_model, tmp_path):
    samples = _samples()
    batches = [samples[:3], samples[3:], samples[1:5]]
    cfg = {"minibatches": 2, "recompute_old": True, "lam": 0.9}  # the second minibatch exercises value clipping
    a = _trainer(tiny_model, **cfg)
    for batch in batches[:2]:
        a.train_step(batch)
    a.save_checkpoint(tmp_path / "ck.pt", {"trained_ids": ["x"]})
    b = _trainer(tiny_model, **cfg)
    assert b.load_checkpoint(tmp_path / "ck.pt") == {"trained_ids": ["x"]}
    ma, mb = a.train_step(batches[2]), b.train_step(batches[2])
    assert ma == {**mb, "train_s": ma["train_s"]}
    for x, y in ((a.model, b.model), (a.critic.model, b.critic.model)):
        for (n, p), (_, q) in zip(x.named_parameters(), y.named_parameters(), strict=True):
            assert torch.equal(p, q), n
    from trainer.megatron_trainer import MegatronTrainer

    grpo = MegatronTrainer(tiny_model, TrainerSettings(lr=1e-2, threads=1))
    grpo.save_checkpoint(tmp_path / "grpo.pt")
    with pytest.raises(ValueError, match="no critic"):
        _trainer(tiny_model).load_checkpoint(tmp_path / "grpo.pt")


def test_ppo_needs_its_critic(tiny_model):
    from trainer.megatron_trainer import MegatronTrainer

    t = MegatronTrainer(tiny_model, TrainerSettings(lr=1e-2, threads=1))
    assert t.critic is None
    with pytest.raises(ValueError, match="critic"):
        t.train_step(_samples(), "ppo")


def test_a_ppo_job_logs_the_critic_and_checkpoints_it(tiny_model, tmp_path):
    """The async loop with the trainer in its own process: value metrics every step, the critic in the checkpoint."""
    import json

    from agentflow.config import load_config
    from agentflow.recipes.rl import run_job

    overrides = [
        *(f"model.path={tiny_model}", "sft.enabled=false", "run.mode=async", "run.steps=2", "run.progress=false"),
        *(f"run.dir={tmp_path / 'run'}", "store.batch_groups=2", "store.stale_steps=1", "rollout.group_size=2"),
        *("rollout.max_new_tokens=12", "eval.episodes=2", "engine.max_len=384", "trainer.micro_batch_tokens=2048"),
        *("trainer.drop_uniform_groups=false", "trainer.loss=ppo"),
    ]
    summary = run_job(load_config(None, overrides), log=lambda *_: None)
    assert summary["rl_steps"] == 2
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ("train/value_loss", "train/value_mean", "train/explained_variance", "train/critic_grad_norm"):
        assert all(key in line for line in lines), key
    checkpoint = torch.load(sorted((tmp_path / "run" / "checkpoints").glob("step_*.pt"))[-1], weights_only=False)
    assert {"model", "optimizer", "scheduler"} <= set(checkpoint["critic"])


def test_critic_values_are_the_same_packed_or_padded(tiny_model):
    from trainer.megatron_trainer import MegatronTrainer

    samples = _samples()
    samples[0] = Sample(samples[0].token_ids[:9], samples[0].loss_mask[:9], samples[0].behaviour_logprobs[:9], 1.0)
    trainers = [
        MegatronTrainer(tiny_model, TrainerSettings(threads=1, packing=p, loss=LossSettings(name="ppo")))
        for p in (True, False)
    ]
    for t in trainers:  # a non-zero head, so the values depend on the hidden states
        with torch.no_grad():
            t.critic.model.output_layer.proj.weight.normal_(generator=torch.Generator().manual_seed(2))
    packed, padded = (t.critic.values(samples) for t in trainers)
    assert trainers[0].packing and not trainers[1].packing
    for a, b in zip(packed, padded, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
