"""Padding-free packing in the Megatron trainer: a packed micro-batch gives the padded one's log-probs, losses,
gradients and weights (fp32, 1e-6), restricted-vocabulary positions and teacher top-k lists included.

Values above 1 in magnitude (log-probs and entropies near ln 1024 ~ 6.9, where one fp32 step is 4.8e-7) are compared
relative to their size; gradients, losses and weights absolutely.

GPU cases are marked ``gpu`` and skip without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from agentflow.model_init import ModelInitConfig, init_model
from trainer.batching import VocabMasks, make_micro_batches, pack_rows
from trainer.types import LossSettings, Sample, TrainerSettings

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron")

TOL = 1e-6
LR = 1e-5
# GQA (4 query heads, 2 KV groups) and a vocabulary of 1024 (32 mask words)
TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)
LENGTHS = (31, 6, 12, 2, 19, 9, 27, 12, 4)  # very different lengths (padded rows are mostly padding); two alike
K = 3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tiny"), TINY)


def _mask_bytes(allowed: list[int], vocab: int = 1024) -> bytes:
    words = [0] * (vocab // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).numpy().tobytes()


def _samples(lengths: tuple[int, ...] = LENGTHS) -> list[Sample]:
    """Mixed-length samples with every per-token signal: behaviour, reference and teacher log-probs, teacher top-k
    lists, turns, and restricted-vocabulary positions (each mask allows the sampled token and a few others)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, 1000, (n,), generator=g).tolist()
        mask = [0] * min(2, n - 1) + [1] * (n - min(2, n - 1))
        rand = torch.rand(4, n, generator=g)
        top = [[]] + [torch.randint(0, 1024, (K,), generator=g).tolist() for _ in range(n - 1)]
        top_lp = [[]] + [sorted((-1.0 - 3 * torch.rand(K, generator=g)).tolist(), reverse=True) for _ in range(n - 1)]
        masked = [p for p in range(1, n) if p % 3 == 1]
        vocab_masks = [(p, _mask_bytes([ids[p], *torch.randint(0, 1024, (40,), generator=g).tolist()])) for p in masked]
        half = max(1, n // 2)
        out.append(
            Sample(
                ids,
                mask,
                [(-1.0 - rand[0, t].item()) * m for t, m in enumerate(mask)],
                reward=float(i % 3),
                group_id=f"g{i // 4}",
                sample_id=f"s{i}",
                ref_logprobs=(-6.0 - rand[1]).tolist(),
                teacher_logprobs=(-5.0 - rand[2]).tolist(),
                teacher_top_ids=top,
                teacher_top_logprobs=top_lp,
                turn_spans=[(0, half), (half, n)],
                turn_rewards=[0.0, float(i % 3)],
                vocab_masks=vocab_masks,
            )
        )
    return out


def _trainer(model_dir, packing: bool, budget: int = 10_000, **loss):
    """lr ``LR``: Adam's first step is ``lr * g / (|g| + 1e-8)``, which turns fp32 noise in a gradient near 1e-8
    (a sum of cancelling terms, smaller still after clipping) into a good part of ``lr``: at 1e-4 one weight whose
    clipped gradient was 3.3e-9 in one run and 3.5e-9 in the other moved 1.2e-6 apart, though no gradient differed by
    more than 3e-8. The gradients themselves are compared too."""
    from trainer.megatron_trainer import MegatronTrainer

    settings = TrainerSettings(lr=LR, threads=1, micro_batch_tokens=budget, packing=packing, loss=LossSettings(**loss))
    return MegatronTrainer(model_dir, settings)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _max_scaled_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, relative where ``|a| > 1``."""
    return ((a - b).abs() / a.abs().clamp(min=1)).max().item() if a.numel() else 0.0


def test_pack_rows_layout():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11], [12, 0, 0, 0]])
    p = pack_rows(ids, torch.tensor([3, 4, 1]))
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert p.cu_seqlens.tolist() == [0, 3, 7, 8] and p.cu_seqlens.dtype == torch.int32 and p.max_seqlen == 4
    # target-aligned: stream position 2 (row 0's last token) would predict row 1's first token, so nothing maps to it
    assert p.index.tolist() == [0, 1, 3, 4, 5]
    grid = torch.arange(1.0, 10.0).reshape(3, 3) * (torch.arange(3) < torch.tensor([2, 3, 0])[:, None])
    stream = p.to_stream(grid)
    assert stream.tolist() == [[1.0, 2.0, 0.0, 4.0, 5.0, 6.0, 0.0]]
    assert torch.equal(p.to_grid(stream), grid)
    masks = p.stream_masks(VocabMasks(torch.tensor([1, 0]), torch.tensor([2, 1]), torch.zeros(2, 1, dtype=torch.int32)))
    assert masks.rows.tolist() == [0, 0] and masks.cols.tolist() == [5, 1]
    with pytest.raises(ValueError, match="at least one token"):
        pack_rows(ids, torch.tensor([3, 0, 1]))


def test_packed_budget_counts_real_tokens():
    samples = _samples()
    padded = make_micro_batches(samples, [0.0] * len(samples), 40)
    packed = make_micro_batches(samples, [0.0] * len(samples), 40, packing=True)
    assert all(mb.input_ids.numel() <= 40 or len(mb.rows) == 1 for mb in padded)
    assert all(mb.packing.input_ids.shape[1] <= 40 or len(mb.rows) == 1 for mb in packed)
    assert len(packed) < len(padded)
    assert sorted(i for mb in packed for i in mb.rows) == list(range(len(samples)))
    assert all(mb.packing is None for mb in padded)


def test_packed_logprobs_and_gradients_equal_padded(tiny_dir):
    """One micro-batch both ways: log-probs (temperature, restricted positions), entropies, the log-probs of the
    teacher's top-k tokens and the gradients of a loss over all three."""
    from trainer.model import token_logprobs, token_logprobs_and_entropy, token_logprobs_at

    t = _trainer(tiny_dir, packing=False)
    samples = _samples()
    (pad,) = make_micro_batches(samples, [0.0] * len(samples), 10_000)
    (pk,) = make_micro_batches(samples, [0.0] * len(samples), 10_000, packing=True)
    assert pk.rows == pad.rows and torch.equal(pk.input_ids, pad.input_ids)
    assert pk.vocab_masks is not None and pk.teacher_top_ids is not None
    mask = pad.target_mask

    def run(mb):
        t.model.zero_grad(set_to_none=True)
        am = mb.attention_mask()
        logp_t = token_logprobs(t.model, mb.input_ids, am, 0.7, mb.vocab_masks, mb.packing)
        logp, entropy = token_logprobs_and_entropy(t.model, mb.input_ids, am, mb.vocab_masks, mb.packing)
        logp_k, top = token_logprobs_at(t.model, mb.input_ids, mb.teacher_top_ids, am, mb.vocab_masks, mb.packing)
        n = mask.sum()
        loss = -(logp_t * mask).sum() / n - 0.1 * (entropy * mask).sum() / n - (top.exp().sum(-1) * mask).sum() / n
        loss.backward()
        grads = {name: p.grad.clone() for name, p in t.model.named_parameters()}
        return [x.detach() for x in (logp_t, logp, entropy, logp_k, top)], loss.detach(), grads

    (a, loss_a, grads_a), (b, loss_b, grads_b) = run(pad), run(pk)
    real = pad.attention_mask()[:, 1:].bool()
    for x, y in zip(a, b, strict=True):
        assert _max_scaled_diff(x[real], y[real]) <= TOL
        assert torch.all(y[~real] == 0)  # packed: nothing at padding
    assert torch.isfinite(a[0][real]).all() and (a[0][real] > -50).all()  # every restricted mask allows its token
    assert abs(loss_a.item() - loss_b.item()) <= TOL
    for name in grads_a:
        assert _max_diff(grads_a[name], grads_b[name]) <= TOL, name
    assert max(g.abs().max().item() for g in grads_a.values()) > 1e-3  # the gradients are not trivially small


@pytest.mark.parametrize(
    "loss",
    [
        {},
        {"name": "gspo", "off_policy": "seq_tis"},
        {"off_policy": "seq_mis", "is_low": 0.0, "is_cap": 100.0, "kl_coef": 0.1},
        {"entropy_coef": 0.01},
        {"distill_loss_coef": 0.5, "distill_loss_estimator": "topk"},
        {"distill_loss_coef": 0.5, "distill_loss_estimator": "k3", "distill_reward_coef": 0.1},
        {"turn_credit": True},
        {"minibatches": 2, "recompute_old": True},
        {"name": "sft"},
    ],
)
def test_packed_step_equals_padded_step(tiny_dir, loss):
    """One training step both ways under a budget that splits the batch: the same metrics, the same gradients at each
    optimizer step and, after it, the same weights."""
    samples = _samples()
    a, b = _trainer(tiny_dir, False, budget=64, **loss), _trainer(tiny_dir, True, budget=64, **loss)
    assert not a.packing and b.packing
    grads: dict[bool, list] = {False: [], True: []}
    for t in (a, b):
        step = t.optimizer.step

        def recording_step(*args, _t=t, _step=step, **kwargs):
            grads[_t.packing].append({n: p.grad.clone() for n, p in _t.model.named_parameters()})
            return _step(*args, **kwargs)

        t.optimizer.step = recording_step
    ma, mb = a.train_step(samples), b.train_step(samples)
    assert len(grads[False]) == len(grads[True]) == ma["optimizer_steps"]
    for ga, gb in zip(grads[False], grads[True], strict=True):
        for n in ga:
            assert _max_diff(ga[n], gb[n]) <= TOL, n
    assert mb["micro_batches"] < ma["micro_batches"]  # packing fits more rows into the same budget
    for k in ma:
        if k not in ("micro_batches", "train_s"):
            assert mb[k] == pytest.approx(ma[k], rel=TOL, abs=TOL), k
    # Adam's first step moves each weight by up to lr: a step applied twice, not at all or to other rows is ~lr off
    # nearly everywhere, while fp32 noise in a gradient near Adam's eps moves a few weights by a fraction of lr (0.15
    # lr measured on a CPU without AVX-512)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert _max_diff(p, q) <= LR / 2, n
    assert ma["grad_norm"] > 0


def test_old_logprobs_and_eval_nll_equal_padded(tiny_dir):
    samples = _samples()
    a, b = _trainer(tiny_dir, False, budget=64), _trainer(tiny_dir, True, budget=64)
    for x, y in zip(a._old_logprobs(samples), b._old_logprobs(samples), strict=True):
        assert len(x) == len(y) and _max_scaled_diff(torch.tensor(x), torch.tensor(y)) <= TOL
    assert b.eval_nll(samples) == pytest.approx(a.eval_nll(samples), rel=TOL)


_GPU_SCRIPT = """
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from test_trainer_packing import _samples
from trainer.megatron_trainer import MegatronTrainer
from trainer.types import TrainerSettings
runs = []
for packing in (False, True):
    settings = TrainerSettings(lr=1e-4, threads=1, micro_batch_tokens=64, packing=packing)
    t = MegatronTrainer(sys.argv[1], settings, device="cuda", layer_spec=sys.argv[2])
    assert t.packing == packing
    runs.append((t.train_step(_samples()), t.export_weights()))
(ma, wa), (mb, wb) = runs
weights = max((wa[k] - wb[k]).abs().max().item() for k in wa)
print(json.dumps({"loss": abs(ma["loss"] - mb["loss"]), "weights": weights}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("layer_spec", ["sdpa", "te"])
def test_packed_step_equals_padded_step_on_gpu(tiny_dir, tmp_path, layer_spec):
    """CUDA (in a fresh process, for NCCL): megatron's THD path (``PackedSeqParams``) through the SDPA spec, and
    through TransformerEngine's attention when it is installed; fp32 (TE's fused kernels get a looser bound)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if layer_spec == "te":
        pytest.importorskip("transformer_engine")
    tests = Path(__file__).resolve().parent
    (tmp_path / "gpu_packing.py").write_text(_GPU_SCRIPT)
    cmd = [sys.executable, str(tmp_path / "gpu_packing.py"), str(tiny_dir), layer_spec, str(tests)]
    proc = subprocess.run(cmd, cwd=tests.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    diff = json.loads(proc.stdout.strip().splitlines()[-1])
    bound = TOL if layer_spec == "sdpa" else 1e-4
    assert diff["loss"] <= bound and diff["weights"] <= bound, diff
