"""Full-vocabulary distillation terms (``full_rkl``, ``full_fkl``, ``jsd``): the divergences by hand, the chunked
evaluation against an in-trainer teacher (equal to the unchunked one, packed or padded, restricted positions
included), its memory bound, the trainer's use of it and the config checks around it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer.batching import VocabMasks, pack_rows
from trainer.losses import LossInputs, full_forward_kl, full_reverse_kl, generalized_jsd, policy_loss
from trainer.types import LossSettings, Sample, TrainerSettings
from transfer_mesh.layouts import ModelSpec

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron")

ESTIMATORS = {"full_rkl": full_reverse_kl, "full_fkl": full_forward_kl, "jsd": generalized_jsd}


# ------------------------------------------------------------------------------------------------ by hand


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def test_divergences_match_hand_computed_values_on_a_four_token_vocab():
    student = [[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]
    teacher = [[0.4, 0.3, 0.2, 0.1], [0.6, 0.2, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]
    s, t = torch.tensor(student).log(), torch.tensor(teacher).log()
    beta = 0.3
    # position 0 written out: KL(s || t) = sum s log(s / t)
    rkl0 = 0.1 * math.log(0.1 / 0.4) + 0.2 * math.log(0.2 / 0.3) + 0.3 * math.log(0.3 / 0.2) + 0.4 * math.log(4.0)
    assert rkl0 == pytest.approx(0.456, abs=1e-3)
    rkl = [_kl(a, b) for a, b in zip(student, teacher, strict=True)]
    fkl = [_kl(b, a) for a, b in zip(student, teacher, strict=True)]
    jsd = []
    for a, b in zip(student, teacher, strict=True):
        m = [beta * y + (1 - beta) * x for x, y in zip(a, b, strict=True)]
        jsd.append(beta * _kl(b, m) + (1 - beta) * _kl(a, m))
    assert rkl[0] == pytest.approx(rkl0)
    assert full_reverse_kl(s, t).tolist() == pytest.approx(rkl, abs=1e-6)
    assert full_forward_kl(s, t).tolist() == pytest.approx(fkl, abs=1e-6)
    assert generalized_jsd(s, t, beta).tolist() == pytest.approx(jsd, abs=1e-6)
    assert rkl[2] == fkl[2] == jsd[2] == 0.0  # equal distributions
    # the symmetric JSD is bounded by log 2; small beta approaches beta * forward KL, beta near 1 (1 - beta) * reverse
    assert (generalized_jsd(s, t, 0.5) <= math.log(2)).all()
    assert (generalized_jsd(s, t, 1e-4) / 1e-4).tolist() == pytest.approx(fkl, rel=1e-2, abs=1e-6)
    assert (generalized_jsd(s, t, 1 - 1e-4) / 1e-4).tolist() == pytest.approx(rkl, rel=1e-2, abs=1e-6)
    with pytest.raises(ValueError, match="0 < beta < 1"):
        generalized_jsd(s, t, 1.0)


def test_the_loss_term_is_the_masked_sum_of_the_divergence():
    logp = torch.full((1, 4), -1.0, requires_grad=True)
    zeros, mask = torch.zeros(1, 4), torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    x = LossInputs(logp, logp.detach(), logp.detach(), zeros, mask, divergence=torch.tensor([[9.0, 0.5, 0.25, 1.0]]))
    base, _ = policy_loss(x, LossSettings(off_policy="none"), 3.0, 1.0)
    cfg = LossSettings(off_policy="none", distill_loss_coef=2.0, distill_loss_estimator="jsd")
    loss, metrics = policy_loss(x, cfg, 3.0, 1.0)
    assert float(loss - base) == pytest.approx(2.0 * 1.75 / 3.0)
    assert float(metrics["distill_kl"]) == pytest.approx(1.75)
    x.divergence = None
    with pytest.raises(ValueError, match="in-trainer teacher"):
        policy_loss(x, cfg, 3.0, 1.0)


# ------------------------------------------------------------------------------------- chunked evaluation

SPEC = ModelSpec("qwen2", 64, 2, 4, 2, 176, 512, tie_word_embeddings=True)
TEACHER_SPEC = ModelSpec("qwen2", 32, 1, 2, 1, 96, 512)  # another size, untied: only the vocabulary is shared
LENGTHS = torch.tensor([11, 4, 9, 2, 7])


def _build(dtype: torch.dtype = torch.float32):
    """A student, two teachers and right-padded rows of ``LENGTHS``."""
    from trainer.model import build_gpt_model, init_distributed_cpu

    init_distributed_cpu()
    student = build_gpt_model(SPEC, seed=0).to(dtype)
    teachers = [build_gpt_model(TEACHER_SPEC, seed=1).to(dtype), build_gpt_model(SPEC, seed=2).to(dtype)]
    for t in teachers:
        t.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SPEC.vocab_size, (len(LENGTHS), int(LENGTHS.max())), generator=gen)
    for r, n in enumerate(LENGTHS.tolist()):
        ids[r, n:] = 0
    return student, teachers, ids


@pytest.fixture(scope="module")
def models():
    return _build()


@pytest.fixture(scope="module")
def models64():
    return _build(torch.float64)


def _masks(allowed: dict[tuple[int, int], list[int]]) -> VocabMasks:
    """Restricted grid positions ``(row, col)`` -> allowed tokens."""
    bits = torch.zeros(len(allowed), SPEC.vocab_size // 32, dtype=torch.int64)
    for k, toks in enumerate(allowed.values()):
        for tok in toks:
            bits[k, tok // 32] |= 1 << (tok % 32)
    rows = torch.tensor([r for r, _ in allowed])
    cols = torch.tensor([c for _, c in allowed])
    return VocabMasks(rows, cols, bits.to(torch.int32))


def _terms(models, estimator: str, chunk: int, packed: bool, masks: VocabMasks | None = None):
    """Values and the student's gradient of ``sum(divergence + logp + entropy)``."""
    from trainer.full_distill import full_vocab_terms

    student, teachers, ids = models
    groups = [(teachers[0], [0, 3, 4]), (teachers[1], [1, 2])]
    student.zero_grad(set_to_none=True)
    out = full_vocab_terms(student, groups, ids, LENGTHS, ESTIMATORS[estimator], 0.3, chunk, masks,
                           pack_rows(ids, LENGTHS) if packed else None, entropy=True)  # fmt: skip
    (out.divergence.sum() + out.logp.sum() + out.entropy.sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in student.parameters()])
    return out, grads


def _reference(models, estimator: str, masks: VocabMasks | None = None):
    """The same from the models' ordinary forward pass: full ``[b, s-1, V]`` logits of the whole batch."""
    from trainer.model import _logits, restrict

    student, teachers, ids = models
    attn = (torch.arange(ids.shape[1]) < LENGTHS[:, None]).long()
    student.zero_grad(set_to_none=True)
    logp_s = torch.log_softmax(restrict(_logits(student, ids, attn)[:, :-1], masks), -1)
    with torch.no_grad():
        rows_of = torch.tensor([0, 1, 1, 0, 0])  # row -> its teacher, as in _terms
        by_teacher = [torch.log_softmax(restrict(_logits(t, ids, attn)[:, :-1], masks), -1) for t in teachers]
        logp_t = torch.where(rows_of[:, None, None] == 0, by_teacher[0], by_teacher[1])
    on = attn[:, 1:].float()
    div = ESTIMATORS[estimator](logp_s, logp_t, 0.3) * on
    logp = logp_s.gather(-1, ids[:, 1:, None]).squeeze(-1) * on
    ent = -(logp_s.exp() * logp_s).sum(-1) * on
    (div.sum() + logp.sum() + ent.sum()).backward()
    return div, logp, ent, logp_t.gather(-1, ids[:, 1:, None]).squeeze(-1) * on, \
        torch.cat([p.grad.flatten() for p in student.parameters()])  # fmt: skip


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Within ``tol`` of the values' scale: fp32 holds about 7 digits, so log-probs near ln 512 ~ 6.2 and gradients
    up to ~5 are compared relative to their largest magnitude (at least 1)."""
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_chunked_terms_equal_the_unchunked_ones_packed_or_padded(models, models64, estimator):
    whole, whole_grads = _terms(models, estimator, 10_000, packed=False)
    div, logp, ent, teacher_logp, grads = _reference(models, estimator)
    for a, b in ((whole.divergence, div), (whole.logp, logp), (whole.entropy, ent), (whole.teacher_logp, teacher_logp),
                 (whole_grads, grads)):  # fmt: skip
        assert _close(a, b, 1e-6), float((a - b).abs().max())
    whole64, whole64_grads = _terms(models64, estimator, 10_000, packed=False)
    for chunk, packed in ((10_000, True), (1, False), (3, False), (3, True), (7, True)):
        got, got_grads = _terms(models, estimator, chunk, packed)
        for name in ("divergence", "logp", "entropy", "teacher_logp"):
            a, b = getattr(got, name), getattr(whole, name)
            assert _close(a, b, 1e-6), (name, chunk, packed, float((a - b).abs().max()))
        assert _close(got_grads, whole_grads, 1e-6), (chunk, packed, float((got_grads - whole_grads).abs().max()))
        got64, got64_grads = _terms(models64, estimator, chunk, packed)  # the same sums, only reordered
        assert torch.allclose(got64.divergence, whole64.divergence, atol=1e-12, rtol=0)
        assert torch.allclose(got64_grads, whole64_grads, atol=1e-12, rtol=0)
    assert bool((whole.divergence >= -1e-6).all())
    assert float(whole.divergence[3, 1:].abs().sum()) == 0.0  # row 3 has one target: the grid's rest is padding


def test_restricted_positions_compare_renormalised_distributions(models):
    allowed = {(0, 2): [5, 17, 300], (2, 0): [7, 8], (4, 5): [int(models[2][4, 6]), 1, 2, 3]}
    masks = _masks(allowed)
    got, grads = _terms(models, "full_fkl", 2, packed=True, masks=masks)
    div, logp, _, _, ref_grads = _reference(models, "full_fkl", masks)
    assert torch.allclose(got.divergence, div, atol=1e-6) and torch.allclose(grads, ref_grads, atol=2e-6)
    assert torch.isfinite(got.divergence).all()
    # restricted to [target, 1, 2, 3] the target token's log-prob is at least log(1/4)-ish of a 4-way choice
    assert float(got.logp[4, 5]) == pytest.approx(float(logp[4, 5]), abs=1e-5) and float(got.logp[4, 5]) > -20


class _PeakStorage(TorchDispatchMode):
    """Peak bytes of the tensor storages that ops create while it is active (forward and backward alike; storages
    that existed before, such as parameters, are not counted). Deterministic: it counts storages, not the
    allocator's pages."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                st = x.untyped_storage()
                self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def test_chunks_bound_the_memory_of_the_vocabulary_terms():
    from trainer.full_distill import full_vocab_terms
    from trainer.model import build_gpt_model, init_distributed_cpu

    init_distributed_cpu()
    spec = ModelSpec("qwen2", 32, 1, 2, 1, 64, 8192, tie_word_embeddings=True)
    student, teacher = build_gpt_model(spec, seed=0), build_gpt_model(spec, seed=1)
    teacher.requires_grad_(False)
    lengths = torch.tensor([256, 256])
    ids = torch.randint(3, spec.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    full_matrix = 2 * 255 * spec.vocab_size * 4  # one fp32 [targets, vocab] tensor: 16 MiB
    peaks = {}
    for chunk in (10_000, 32):
        student.zero_grad(set_to_none=True)
        with _PeakStorage() as mem:
            out = full_vocab_terms(student, [(teacher, [0, 1])], ids, lengths, full_reverse_kl, chunk=chunk)
            (out.divergence.sum() + out.logp.sum()).backward()
        peaks[chunk] = mem.peak
    assert peaks[10_000] > 4 * full_matrix, peaks  # unchunked: several [targets, vocab] tensors at once
    assert peaks[32] < 1.5 * full_matrix, peaks  # chunked: the trunk's activations and a few [32, vocab] ones


# ------------------------------------------------------------------------------------------------ trainer


def _samples(vocab: int, n: int = 6) -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        length = 8 + 3 * i
        ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
        mask = [0] * 3 + [1] * (length - 3)
        out.append(Sample(ids, mask, [0.0] * length, 0.0, f"g{i}", f"s{i}/0"))
    return out


def _vocab(model_dir) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_full_vocab_loss_steps_lower_the_divergence_from_the_teacher(pair, estimator):
    from trainer.megatron_trainer import MegatronTrainer

    student, teacher = pair
    loss = LossSettings(env_reward_coef=0.0, distill_loss_coef=1.0, distill_loss_estimator=estimator,
                        off_policy="none")  # fmt: skip
    settings = TrainerSettings(lr=3e-3, threads=1, loss=loss, teachers={"t": str(teacher)}, distill_chunk_tokens=16)
    trainer = MegatronTrainer(student, settings)
    samples = _samples(_vocab(student))
    steps = [trainer.train_step(samples) for _ in range(6)]
    kls = [m["distill_kl"] for m in steps]  # the batch's divergence before each update
    assert kls[-1] < 0.9 * kls[0] and all(b < a for a, b in zip(kls, kls[1:], strict=False)), kls
    assert all("teacher_k1" in m for m in steps)  # from the in-trainer teacher's own log-probs


def test_packed_and_padded_trainers_take_the_same_step(pair):
    from trainer.megatron_trainer import MegatronTrainer

    student, teacher = pair
    loss = LossSettings(distill_loss_coef=1.0, distill_loss_estimator="full_fkl", off_policy="none", entropy_coef=0.01)
    samples = _samples(_vocab(student))
    metrics, weights = [], []
    for packing in (True, False):
        settings = TrainerSettings(lr=1e-5, threads=1, loss=loss, teachers={"t": str(teacher)}, packing=packing,
                                   distill_chunk_tokens=8, micro_batch_tokens=64)  # fmt: skip
        trainer = MegatronTrainer(student, settings)
        metrics.append(trainer.train_step(samples))
        weights.append(torch.cat([t.flatten() for t in trainer.export_weights().values()]))
    for key in ("distill_kl", "loss", "grad_norm", "entropy", "teacher_k1"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-6), key
    assert torch.allclose(weights[0], weights[1], atol=1e-6)


def test_the_trainer_refuses_what_it_cannot_compute(pair, tmp_path):
    import shutil

    from trainer.megatron_trainer import MegatronTrainer

    student, teacher = pair
    loss = LossSettings(distill_loss_coef=1.0, distill_loss_estimator="full_rkl")
    trainer = MegatronTrainer(student, TrainerSettings(loss=loss))
    trainer.train_step(_samples(_vocab(student), 2), loss="sft")  # an imitation phase needs no teacher
    assert trainer.teachers is None
    with pytest.raises(ValueError, match="settings.teachers names none"):
        trainer.train_step(_samples(_vocab(student), 2))
    odd = tmp_path / "odd"
    shutil.copytree(teacher, odd)
    cfg = (odd / "config.json").read_text().replace(f'"vocab_size": {_vocab(teacher)}', '"vocab_size": 2048')
    (odd / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="vocabulary of 2048 tokens, the student 1024"):
        from trainer.full_distill import load_teachers
        from trainer.model import load_hf_dir

        load_teachers({"odd": str(odd)}, load_hf_dir(student)[0])
    trainer = MegatronTrainer(student, TrainerSettings(loss=loss, teachers={"t": str(teacher)}, temperature=0.7))
    with pytest.raises(ValueError, match="at temperature 1"):
        trainer.train_step(_samples(_vocab(student), 2))
    trainer = MegatronTrainer(student, TrainerSettings(loss=loss, teachers={"a": str(teacher), "b": str(teacher)}))
    with pytest.raises(ValueError, match="names no teacher and the trainer holds several"):
        trainer.train_step(_samples(_vocab(student), 2))
    samples = _samples(_vocab(student), 2)
    for s in samples:
        s.teacher = "c"
    with pytest.raises(ValueError, match="teacher 'c', which the trainer does not hold"):
        trainer.train_step(samples)


# ------------------------------------------------------------------------------------------------- config


def test_estimator_names_and_options_are_checked_with_suggestions():
    from pydantic import ValidationError

    from agentflow.config import ConfigError, load_config
    from trainer.config import TrainerConfig

    with pytest.raises(ValidationError, match="Did you mean 'full_rkl'"):
        LossSettings(distill_loss_estimator="ful_rkl")
    with pytest.raises(ConfigError, match="teachers.loss_estimator.*Did you mean 'jsd'"):
        load_config(None, ["teachers.loss_estimator=jds"])
    with pytest.raises(ConfigError, match="teachers.jsd_beta"):
        load_config(None, ["teachers.jsd_beta=1.0"])
    with pytest.raises(ValidationError, match="distill_chunk_tokens"):
        TrainerConfig(distill_chunk_tokens=0)
    with pytest.raises(ValidationError, match="distill_jsd_beta"):
        LossSettings(distill_jsd_beta=0.0)
    assert TrainerConfig().settings(1, 1.0).distill_chunk_tokens == 1024


def test_a_served_teacher_is_refused_for_full_vocabulary_estimators_in_one_line():
    from agentflow.config import ConfigError, load_config

    models = 'teachers.models=[{"name": "big", "url": "http://h:1", "tokenizer": "/t"}]'
    with pytest.raises(ConfigError) as e:
        load_config(None, [models, "teachers.loss_coef=1", "teachers.loss_estimator=full_fkl"])
    assert "teacher 'big' is a server URL" in str(e.value) and "\n" not in str(e.value).strip()
    load_config(None, [models, "teachers.loss_coef=1", "teachers.loss_estimator=topk"])  # a server can do top-k


def test_the_job_hands_the_trainer_its_teachers(pair):
    from agentflow.builder import trainer_settings
    from agentflow.config import load_config

    student, teacher = pair
    base = [f"model.path={student}", f'teachers.models=[{{"name": "t", "path": "{teacher}"}}]', "teachers.loss_coef=1"]
    cfg = load_config(None, [*base, "teachers.loss_estimator=jsd", "teachers.jsd_beta=0.2",
                             "trainer.distill_chunk_tokens=256"])  # fmt: skip
    settings = trainer_settings(cfg)
    assert settings.teachers == {"t": str(teacher)} and settings.distill_chunk_tokens == 256
    assert settings.loss.distill_loss_estimator == "jsd" and settings.loss.distill_jsd_beta == 0.2
    assert trainer_settings(load_config(None, [*base, "teachers.loss_estimator=topk"])).teachers == {}


def test_the_distill_job_checks_vocabularies_and_one_teacher_per_sequence(pair, tmp_path):
    import shutil

    from agentflow.builder import JobError
    from agentflow.config import load_config
    from agentflow.recipes.distill import check_teachers

    student, teacher = pair
    odd = tmp_path / "odd"
    shutil.copytree(teacher, odd)
    cfg_text = (odd / "config.json").read_text().replace(f'"vocab_size": {_vocab(teacher)}', '"vocab_size": 2048')
    (odd / "config.json").write_text(cfg_text)

    def job(models: str, routes: str, estimator: str = "full_rkl"):
        return load_config(None, [f"model.path={student}", "model.init_if_missing=false",
                                  "trainer.drop_uniform_groups=false",
                                  'data.sources=[{"env_id": "agentflow/Calc-v0", "tags": ["calc"]}]',
                                  f"teachers.models={models}", f"teachers.routes={routes}", "teachers.loss_coef=1",
                                  f"teachers.loss_estimator={estimator}"])  # fmt: skip

    with pytest.raises(JobError, match="teacher 'o' has a vocabulary of 2048 tokens, the student 1024"):
        check_teachers(job(f'[{{"name": "o", "path": "{odd}"}}]', '{"calc": "o"}'), student)
    two = f'[{{"name": "a", "path": "{teacher}"}}, {{"name": "b", "path": "{student}"}}]'
    with pytest.raises(JobError, match="the jsd loss needs one teacher per sequence: set teachers.mix=sample"):
        check_teachers(job(two, '{"calc": {"a": 1, "b": 1}}', "jsd"), student)
    check_teachers(job(two, '{"calc": "a"}', "jsd"), student)  # one teacher per source: fine


@pytest.mark.slow
def test_distill_job_with_a_full_vocabulary_loss_end_to_end(pair, tmp_path):
    """Two data sources routed to two teachers: every trained row is compared with its own source's teacher (the
    ``mul`` source's teacher is the student itself, so its rows diverge by ~0)."""
    import json

    from test_distill import _two_source_config

    from agentflow.recipes.distill import run_distill

    student, teacher = pair
    extra = ["run.steps=2", "store.batch_groups=2", "rollout.group_size=2", "eval.episodes=2"]
    extra += ["teachers.loss_coef=0.1", "teachers.loss_estimator=jsd", "trainer.distill_chunk_tokens=64"]
    summary = run_distill(_two_source_config(student, teacher, tmp_path / "run", extra), log=lambda *_: None)
    assert summary["steps"] == 2 and summary["teacher_stats"]["sequences_scored"] == summary["trajectories_trained"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/distill_kl"] >= 0 and "train/teacher_k1" in r for r in rows)
