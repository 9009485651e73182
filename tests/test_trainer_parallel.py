"""Tensor and data parallelism of the Megatron trainer on gloo (CPU), launched by the trainer group itself.

Acceptance: TP=2 and DP=2 give the same loss and, after one optimizer step with gradient clipping active, the same
weights as one rank (1e-5); each TP rank holds half of each split tensor; DP ranks see disjoint samples.
GPU cases are marked ``gpu`` and skip without CUDA.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentflow.model_init import ModelInitConfig, init_model
from trainer.launcher import LocalTrainerGroup, ParallelTrainerGroup, TrainerError, make_trainer_group
from trainer.parallel import clip_grad_norm_tp, neutral_row, rank_checkpoint_path, shard_for_dp
from trainer.types import Sample, TrainerSettings
from transfer_mesh.layouts import ModelSpec, hf_to_megatron, megatron_shapes, split_for_tp, tp_split_dim

TOL = 1e-5
TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176)
# lr large enough that one Adam step moves every weight by ~1e-3 (100x the tolerance); clip far below the norm
SETTINGS = TrainerSettings(lr=1e-3, grad_clip=0.05, threads=1, micro_batch_tokens=64)  # 2 micro-batches


TINY_MOE = ModelInitConfig(
    hidden_size=64, num_hidden_layers=2, arch="qwen3_moe", num_experts=4, moe_intermediate_size=48
)


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense model, and an MoE one (under TP: sequence parallelism, experts split like dense MLPs)."""
    return init_model(tmp_path_factory.mktemp(request.param), TINY if request.param == "qwen2" else TINY_MOE)


def _batch(lengths: tuple[int, ...] = (14, 9, 20, 11, 17, 6)) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, 1000, (n,), generator=g).tolist()
        out.append(Sample(ids, [0] * 3 + [1] * (n - 3), [0.0] * n, sample_id=f"s{i}"))
    return out


def _full_megatron(model_dir: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    spec = ModelSpec.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    return spec, hf_to_megatron(load_file(str(model_dir / "model.safetensors")), spec)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One rank (LocalTrainerGroup from the factory): validation NLL, then metrics and weights after one SFT step."""
    group = make_trainer_group(tiny_dir, SETTINGS, device="cpu")
    try:
        assert isinstance(group, LocalTrainerGroup)
        before = group.export_weights()
        nll = group.eval_nll(_batch())
        metrics = group.train_step(_batch(), "sft")
        assert group.version == 1
        after = group.export_weights()
        hf = group.save_hf(tmp_path_factory.mktemp("hf") / "model")
        _check_hf_dir(hf, after)
        return {"metrics": metrics, "before": before, "after": after, "nll": nll}
    finally:
        group.close()


def _check_hf_dir(out: Path, weights: dict[str, torch.Tensor]) -> None:
    """``save_hf`` wrote a loadable HF directory holding exactly ``weights``."""
    assert (out / "config.json").is_file()
    assert _max_diff(load_file(str(out / "model.safetensors")), weights) < TOL


def _check_same_step(metrics: dict, weights: dict, reference: dict) -> None:
    ref = reference["metrics"]
    assert ref["grad_norm"] > 10 * SETTINGS.grad_clip, "clipping must be active for the test to mean anything"
    assert abs(metrics["loss"] - ref["loss"]) < TOL, (metrics["loss"], ref["loss"])
    assert abs(metrics["grad_norm"] - ref["grad_norm"]) < TOL * ref["grad_norm"], (
        f"global grad norm {metrics['grad_norm']} != one rank's {ref['grad_norm']}: under TP the step must clip "
        "with self.optimizer.clip_grad_norm_(...) (TP-aware), not torch.nn.utils.clip_grad_norm_"
    )
    assert _max_diff(reference["after"], reference["before"]) > 50 * TOL, "the step must move the weights"
    assert _max_diff(weights, reference["after"]) < TOL


def _check_tp_shards(shards: list[dict[str, torch.Tensor]], full: dict[str, torch.Tensor], tp: int) -> None:
    """Rank r holds exactly ``split_for_tp(full, r)``: half of each split tensor, the whole of replicated ones."""
    assert len(shards) == tp
    for name, tensor in full.items():
        dim = tp_split_dim(name)
        for rank, mine in enumerate(shards):
            expected = split_for_tp(name, tensor, tp, rank)
            if dim is not None:
                assert mine[name].shape[dim] * tp == tensor.shape[dim], name
            else:
                assert mine[name].shape == tensor.shape, name
            assert (mine[name] - expected).abs().max().item() < TOL, (name, rank)


def test_tensor_parallel_2_matches_one_rank(tiny_dir: Path, reference: dict, tmp_path: Path) -> None:
    spec, full = _full_megatron(tiny_dir)
    with make_trainer_group(tiny_dir, SETTINGS, tp=2, dp=1, device="cpu") as group:
        assert isinstance(group, ParallelTrainerGroup)
        info = group.call_all("rank_info")
        assert [(i["tp_rank"], i["tp_size"], i["dp_size"]) for i in info] == [(0, 2, 1), (1, 2, 1)]
        _check_tp_shards(group.call_all("rank_shards"), full, 2)
        assert set(full) == set(megatron_shapes(spec))
        assert abs(group.eval_nll(_batch()) - reference["nll"]) < TOL  # a collective under TP, like the step
        metrics = group.train_step(_batch(), "sft")
        weights = group.export_weights()
        _check_same_step(metrics, weights, reference)
        _check_hf_dir(group.save_hf(tmp_path / "hf"), weights)  # the shards gathered, rank 0 writes
        # after the step the shards are still those of the (gathered) full weights: replicated ones stayed equal
        _check_tp_shards(group.call_all("rank_shards"), hf_to_megatron(weights, spec), 2)
        assert [i["last_dp_shard"] for i in group.call_all("rank_info")] == [list(range(6))] * 2
        group.save_checkpoint(str(tmp_path / "ck.pt"), {"trained_ids": ["a"]})
        assert all(rank_checkpoint_path(tmp_path / "ck.pt", r, 2).is_file() for r in range(2))
        assert group.load_checkpoint(str(tmp_path / "ck.pt")) == {"trained_ids": ["a"]}
        assert group.version == 1


def _check_ep_shards(shards: list[dict[str, torch.Tensor]], full: dict[str, torch.Tensor], ep: int) -> None:
    """Under TP=ep: rank r holds experts r*n/ep .. (r+1)*n/ep - 1 whole, under local indices; the rest as under TP."""
    experts = re.compile(r"^(.*local_experts\.)(\d+)(\..+)$")
    for rank, mine in enumerate(shards):
        seen = set()
        for name, tensor in full.items():
            m = experts.match(name)
            if m is None:
                assert (mine[name] - split_for_tp(name, tensor, ep, rank)).abs().max().item() < TOL, (name, rank)
                seen.add(name)
                continue
            owner, j = divmod(int(m.group(2)), TINY_MOE.num_experts // ep)
            if owner == rank:
                local = f"{m.group(1)}{j}{m.group(3)}"
                assert (mine[local] - tensor).abs().max().item() < TOL, (name, rank)
                seen.add(local)
        assert seen == set(mine), set(mine) - seen


def test_expert_parallel_2_matches_one_rank(tiny_dir: Path, reference: dict, tmp_path: Path) -> None:
    """TP=2 with EP=2: each rank holds half of the experts whole; loss, clipped step and weights as one rank's. A
    dense model with ``ep`` > 1 is refused."""
    spec, full = _full_megatron(tiny_dir)
    if not spec.is_moe:
        with pytest.raises(TrainerError, match="expert parallelism .* needs a mixture-of-experts model"):
            make_trainer_group(tiny_dir, SETTINGS, tp=2, dp=1, ep=2, device="cpu")
        return
    with make_trainer_group(tiny_dir, SETTINGS, tp=2, dp=1, ep=2, device="cpu") as group:
        _check_ep_shards(group.call_all("rank_shards"), full, 2)
        assert abs(group.eval_nll(_batch()) - reference["nll"]) < TOL
        metrics = group.train_step(_batch(), "sft")
        weights = group.export_weights()
        _check_same_step(metrics, weights, reference)
        _check_hf_dir(group.save_hf(tmp_path / "hf"), weights)
        _check_ep_shards(group.call_all("rank_shards"), hf_to_megatron(weights, spec), 2)
        group.save_checkpoint(str(tmp_path / "ck.pt"), {"trained_ids": ["a"]})
        assert group.load_checkpoint(str(tmp_path / "ck.pt")) == {"trained_ids": ["a"]}
        assert _max_diff(group.export_weights(), weights) == 0.0
    with pytest.raises(ValueError, match="ep=2 must divide tp=1"):
        make_trainer_group(tiny_dir, SETTINGS, tp=1, dp=2, ep=2, device="cpu")


def test_what_sequence_parallelism_cannot_run_is_refused(tmp_path: Path) -> None:
    """Under TP an MoE model runs sequence-parallel; the full-vocabulary distillation head cannot, and says so."""
    from trainer.config import LossSettings

    moe_dir = init_model(tmp_path / "moe", TINY_MOE)
    loss = LossSettings(distill_loss_coef=1.0, distill_loss_estimator="full_rkl")
    with pytest.raises(TrainerError, match="does not run under sequence parallelism"):
        make_trainer_group(moe_dir, SETTINGS.model_copy(update={"loss": loss}), tp=2, dp=1, device="cpu")


def test_data_parallel_2_matches_one_rank(tiny_dir: Path, reference: dict) -> None:
    group = make_trainer_group(tiny_dir, SETTINGS, tp=1, dp=2, device="cpu")
    pids = group.pids()
    try:
        metrics = group.train_step(_batch(), "sft")
        _check_same_step(metrics, group.export_weights(), reference)
        info = group.call_all("rank_info")
        assert [(i["dp_rank"], i["dp_size"], i["tp_size"]) for i in info] == [(0, 2, 1), (1, 2, 1)]
        shards = [set(i["last_dp_shard"]) for i in info]
        assert shards[0] and shards[1] and not shards[0] & shards[1], shards
        assert shards[0] | shards[1] == set(range(6))
        # fewer samples than DP ranks: the empty rank trains on a zero-mask padding sample, nobody hangs
        one = group.call("train_step", _batch((12,)), "sft", timeout=120)
        assert one["tokens"] == 9
        with pytest.raises(TrainerError, match=r"(?s)rank 0:.*rank 1:"):
            group.call("no_such_method", timeout=60)
        assert len(group.call_all("rank_info", timeout=60)) == 2, "an error on every rank leaves the group usable"
    finally:
        group.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_tp2_dp2_matches_one_rank(tiny_dir: Path, reference: dict) -> None:
    spec, full = _full_megatron(tiny_dir)
    with make_trainer_group(tiny_dir, SETTINGS, tp=2, dp=2, device="cpu") as group:
        shards = group.call_all("rank_shards")
        _check_tp_shards(shards[:2], full, 2)
        _check_tp_shards(shards[2:], full, 2)
        metrics = group.train_step(_batch(), "sft")
        _check_same_step(metrics, group.export_weights(), reference)
        info = group.call_all("rank_info")
        assert [(i["tp_rank"], i["dp_rank"]) for i in info] == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert info[0]["last_dp_shard"] == info[1]["last_dp_shard"] != info[2]["last_dp_shard"]
        assert set(info[0]["last_dp_shard"]) | set(info[2]["last_dp_shard"]) == set(range(6))
    if spec.is_moe:  # experts spread over each TP group; their gradients summed over DP like the rest
        with make_trainer_group(tiny_dir, SETTINGS, tp=2, dp=2, ep=2, device="cpu") as group:
            shards = group.call_all("rank_shards")
            _check_ep_shards(shards[:2], full, 2)
            _check_ep_shards(shards[2:], full, 2)
            metrics = group.train_step(_batch(), "sft")
            _check_same_step(metrics, group.export_weights(), reference)


# ---------------------------------------------------------------------------------------------- no processes


def test_shard_for_dp_disjoint_balanced_and_padded() -> None:
    batch = _batch()
    rows = [(float(i), [1] * len(s.token_ids), None) for i, s in enumerate(batch)]
    parts = [shard_for_dp(batch, rows, r, 2) for r in range(2)]
    idx = [p[2] for p in parts]
    assert sorted(idx[0] + idx[1]) == list(range(6)) and not set(idx[0]) & set(idx[1])
    assert all(i == sorted(i) for i in idx), "shares keep the batch order"
    loads = [sum(len(batch[i].token_ids) for i in ix) for ix in idx]
    assert abs(loads[0] - loads[1]) <= max(len(s.token_ids) for s in batch)
    for mine, my_rows, ix in parts:
        assert [s.sample_id for s in mine] == [batch[i].sample_id for i in ix]
        assert my_rows == [rows[i] for i in ix]
    assert shard_for_dp(batch, rows, 0, 1)[2] == list(range(6))
    samples, pad_rows, ix = shard_for_dp(batch[:1], rows[:1], 1, 2)
    assert ix == [] and len(samples) == 1 and samples[0].extra["dp_padding"]
    assert sum(samples[0].loss_mask) == 0 and samples[0].token_ids == batch[0].token_ids
    assert pad_rows == [(0.0, [0] * 14, None)]
    with pytest.raises(ValueError):
        shard_for_dp(batch, rows[:2], 0, 2)


def test_neutral_row_and_checkpoint_paths() -> None:
    assert neutral_row(2.5) == 0.0 and neutral_row(None) is None
    assert neutral_row(([1.0, 2.0], [1, 1], [0.5])) == ([0.0, 0.0], [0, 0], [0.0])
    assert rank_checkpoint_path("a/ck.pt", 0, 1) == Path("a/ck.pt")
    assert rank_checkpoint_path("a/ck.pt", 1, 2) == Path("a/ck.tp1.pt")


def test_clip_without_tp_is_torch_clip() -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    norm = clip_grad_norm_tp(a, 0.1)
    ref = torch.nn.utils.clip_grad_norm_(b, 0.1)
    assert torch.equal(norm, ref)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a, b, strict=True))


def test_process_group_is_destroyed_before_interpreter_shutdown() -> None:
    """A process that made a group and exits has it destroyed by then: gloo torn down during interpreter
    finalisation can abort the rank (SIGABRT, "terminate called without an active exception")."""
    code = (
        "import atexit, torch.distributed as dist\n"
        "atexit.register(lambda: print('alive at exit:', dist.is_initialized()))\n"  # runs after ours (LIFO)
        "from trainer.dist import init_process_group\n"
        "init_process_group('gloo')\n"
        "init_process_group('gloo')\n"  # a second call is a no-op
        "print('alive:', dist.is_initialized())\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["alive: True", "alive at exit: False"], out.stdout


def _fake_group(world: int, grace_s: float) -> tuple[ParallelTrainerGroup, list]:
    """A group whose 'ranks' are the far ends of pipes held by the test (no processes)."""
    import multiprocessing as mp
    from types import SimpleNamespace

    group = object.__new__(ParallelTrainerGroup)
    pipes = [mp.Pipe() for _ in range(world)]
    group.world, group.tp, group.dp, group.grace_s, group._broken = world, 1, world, grace_s, ""
    group._conns = [a for a, _ in pipes]
    group._procs = [SimpleNamespace(pid=None, exitcode=None, is_alive=lambda: False) for _ in range(world)]
    return group, [b for _, b in pipes]


def test_group_stops_when_a_rank_fails_and_another_hangs() -> None:
    group, ranks = _fake_group(2, grace_s=0.3)
    ranks[0].send(("err", "boom"))  # rank 1 never answers: it waits in a collective
    with pytest.raises(TrainerError, match=r"(?s)ranks \[1\] did not answer.*stopped.*rank 0: boom"):
        group._collect("train_step", timeout=None)
    with pytest.raises(TrainerError, match="stopped"):
        group.call("rank_info")
    group, ranks = _fake_group(2, grace_s=5.0)
    ranks[0].send(("ok", 1))
    ranks[1].close()  # rank 1 died
    with pytest.raises(TrainerError, match=r"(?s)failed in 'start'.*rank 1: process exited"):
        group._collect("start", timeout=10)


# -------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_trainer_matches_cpu(tiny_dir: Path, reference: dict) -> None:
    """Megatron DDP + distributed optimizer on CUDA: same step as the CPU rank (fp32, 1e-4)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    group = make_trainer_group(tiny_dir, SETTINGS, device="cuda")
    try:
        metrics = group.train_step(_batch(), "sft")
        assert abs(metrics["loss"] - reference["metrics"]["loss"]) < 1e-4
        assert abs(metrics["grad_norm"] - reference["metrics"]["grad_norm"]) < 1e-4 * reference["metrics"]["grad_norm"]
        assert _max_diff(group.export_weights(), reference["after"]) < 1e-4
        assert group.call("rank_info")["device"].startswith("cuda")
    finally:
        group.close()


@pytest.mark.gpu
def test_gpu_check_script() -> None:
    """benchmarks/gpu_check.py --quick passes on a GPU machine."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--quick"],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail("gpu_check.py did not finish within 540 s")
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    assert json.loads(out.strip().splitlines()[-1])["ok"] is True
