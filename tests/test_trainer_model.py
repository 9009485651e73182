"""trainer.model: megatron-core GPTModel on CPU matches HF Qwen2/Llama; load/export/save; log-probs; backward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from trainer.model import (  # noqa: E402
    build_gpt_model,
    export_hf_state,
    init_distributed_cpu,
    load_hf_dir,
    load_into_model,
    model_parameters,
    save_hf_dir,
    token_logprobs,
    token_logprobs_and_entropy,
)
from transfer_mesh.layouts import LayoutError, ModelSpec  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron")

TOL = 1e-5
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session", autouse=True)
def megatron_world() -> None:
    """megatron's parallel state is process-global: initialize it once (TP=1, gloo world of 1)."""
    torch.set_num_threads(1)
    init_distributed_cpu(tp=1)


def _save_tiny(family: str, path: Path) -> Path:
    torch.manual_seed(1234)
    if family == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, vocab_size=128, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif family == "qwen3":  # a head_dim that is not hidden / heads, as in the released Qwen3 models
        cfg = transformers.Qwen3Config(**TINY, head_dim=24, vocab_size=112, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif family == "qwen3_moe":  # the top-k probabilities as the full softmax gives them (no renormalisation)
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False)
        cfg = transformers.Qwen3MoeConfig(**TINY, **moe, head_dim=24, vocab_size=112, tie_word_embeddings=False)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**TINY, vocab_size=96, tie_word_embeddings=False, rope_theta=50000.0)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # make norms non-trivial so a wrong norm mapping cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return path


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3", "qwen3_moe"])
def hf_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny(request.param, tmp_path_factory.mktemp(request.param))


def _hf_model(path: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def _hf_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()[:, :-1]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _loaded(hf_dir: Path) -> tuple[ModelSpec, dict[str, torch.Tensor], torch.nn.Module]:
    spec, state = load_hf_dir(hf_dir)
    model = build_gpt_model(spec, seed=7)
    load_into_model(model, state, spec)
    return spec, state, model.eval()


def _ids(spec: ModelSpec, b: int = 3, s: int = 17) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (b, s), generator=torch.Generator().manual_seed(5))


def test_spec_from_dir(hf_dir: Path) -> None:
    spec, state = load_hf_dir(hf_dir)
    assert hf_dir.name.startswith(spec.model_type)
    assert spec.tie_word_embeddings == (spec.model_type == "qwen2")
    assert spec.attention_bias == (spec.model_type == "qwen2")
    assert ("lm_head.weight" in state) == (not spec.tie_word_embeddings)


def test_logprobs_match_hf(hf_dir: Path) -> None:
    spec, _, model = _loaded(hf_dir)
    ids = _ids(spec)
    with torch.no_grad():
        logp = token_logprobs(model, ids)
        logp2, entropy = token_logprobs_and_entropy(model, ids)
    ref_logp, ref_entropy = _hf_logprobs(_hf_model(hf_dir), ids)
    assert logp.shape == (3, 16) and logp.dtype == torch.float32
    assert (logp - ref_logp).abs().max().item() < TOL
    assert (entropy - ref_entropy).abs().max().item() < TOL
    assert torch.equal(logp, logp2)
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, ids), logp), "forward must be deterministic"


def test_right_padding_and_explicit_mask(hf_dir: Path) -> None:
    spec, _, model = _loaded(hf_dir)
    ids = _ids(spec, b=2, s=12)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        full = token_logprobs(model, ids)
        padded = token_logprobs(model, ids, attention_mask=mask)
        short = token_logprobs(model, ids[1:, :7])
        assert torch.equal(padded[0], full[0])
        assert (padded[1, :6] - short[0]).abs().max().item() < 1e-6
        assert torch.all(padded[1, 6:] == 0)
        pos = torch.arange(12).expand(2, 12)
        causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]
        explicit = model(ids, pos, attention_mask=causal)
        implicit = model(ids, pos, attention_mask=None)
    assert (explicit - implicit).abs().max().item() < 1e-6
    with pytest.raises(ValueError, match="right-padded"):
        token_logprobs(model, ids, attention_mask=mask.flip(1))


def test_export_round_trip_exact_and_unshared(hf_dir: Path) -> None:
    spec, state, model = _loaded(hf_dir)
    exported = export_hf_state(model, spec)
    assert set(exported) == set(state)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for name, tensor in exported.items():
        assert tensor.dtype == torch.float32 and not tensor.requires_grad
        assert torch.equal(tensor, state[name]), name
        assert tensor.untyped_storage().data_ptr() not in storages, name
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert torch.equal(exported["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_save_hf_dir_reloads_in_transformers(hf_dir: Path, tmp_path: Path) -> None:
    spec, _, model = _loaded(hf_dir)
    out = save_hf_dir(model, spec, hf_dir, tmp_path / "out")
    assert (out / "tokenizer_config.json").is_file() and (out / "model.safetensors").is_file()
    ids = _ids(spec)
    ref, _ = _hf_logprobs(_hf_model(hf_dir), ids)
    again, _ = _hf_logprobs(_hf_model(out), ids)
    assert torch.equal(ref, again)


def test_backward_grads_finite(hf_dir: Path) -> None:
    spec, _, model = _loaded(hf_dir)
    model.train()
    logp, entropy = token_logprobs_and_entropy(model, _ids(spec))
    (-logp.mean() - 0.01 * entropy.mean()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_load_errors(tmp_path: Path, hf_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_dir(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"safetensors.*" + tmp_path.name):
        load_hf_dir(tmp_path)
    spec, state = load_hf_dir(hf_dir)
    model = build_gpt_model(spec)
    del state["model.norm.weight"]
    with pytest.raises(LayoutError, match="model.norm.weight"):
        load_into_model(model, state, spec)


_TP_WORKER = """
import sys, torch
torch.set_num_threads(1)
from trainer.model import *
from trainer.dist import init_distributed
init_distributed(tp=2, backend="gloo", ep=int(sys.argv[4]))
spec, state = load_hf_dir(sys.argv[1])
model = build_gpt_model(spec)
load_into_model(model, state, spec)
if int(sys.argv[4]) > 1:  # each rank holds its own experts, whole
    local = [n for n in model_parameters(model) if "local_experts" in n]
    assert len(local) == spec.num_hidden_layers * 2 * spec.num_experts // 2, local
ids = torch.load(sys.argv[2])
logp, entropy = token_logprobs_and_entropy(model, ids)
(-logp.mean()).backward()
from megatron.core import parallel_state
from trainer.model import full_megatron_state, model_parameters
from trainer.parallel import allreduce_tp_partial_grads
allreduce_tp_partial_grads(model, parallel_state.get_tensor_model_parallel_group())
assert all(torch.isfinite(p.grad).all() for p in model.parameters())
grads = full_megatron_state(model, spec, {n: p.grad for n, p in model_parameters(model).items()})  # collective
for n, g in grads.items():  # every rank holds the same whole gradient
    peers = [torch.empty_like(g) for _ in range(2)]
    torch.distributed.all_gather(peers, g.contiguous())
    assert torch.equal(peers[0], peers[1]), f"{n}: the TP ranks' gradients differ"
exported = export_hf_state(model, spec)
assert all(torch.equal(exported[k], state[k]) for k in state), "TP export differs"
logp_only = token_logprobs(model, ids).detach()  # collective: every rank calls it
assert (logp_only - logp).abs().max() < 1e-6
out = {"logp": logp_only, "entropy": entropy.detach(), "grads": grads}
from trainer.batching import pack_rows
lengths = torch.tensor([17, 12, 9])  # packed: 38 tokens (19 per rank under sequence parallelism)
mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
out["packed"] = token_logprobs(model, ids, mask, packing=pack_rows(ids, lengths)).detach()
if spec.is_moe:  # replayed routes: a fixed choice for every (row, position, layer), other than the router's own
    from trainer import moe
    b, s, n = ids.shape[0], ids.shape[1], spec.num_hidden_layers
    t = torch.arange(b * s * n).reshape(b, s, n, 1)
    routes = torch.cat([t % spec.num_experts, (t + 1) % spec.num_experts], dim=-1)
    with torch.no_grad(), moe.replaying(model, moe.token_order(routes), replay=True):
        out["replayed"] = token_logprobs(model, ids, mask)
    with torch.no_grad(), moe.replaying(model, moe.token_order(routes, pack_rows(ids, lengths), lengths), replay=True):
        out["replayed_packed"] = token_logprobs(model, ids, mask, packing=pack_rows(ids, lengths))
    differing, compared = moe.take_mismatch(model)
    counts = torch.tensor([float(differing), float(compared)])
    torch.distributed.all_reduce(counts)
    out["mismatch"] = counts
if torch.distributed.get_rank() == 0:
    torch.save(out, sys.argv[3])
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hf_dir", "ep"), [("qwen2", 1), ("qwen3", 1), ("qwen3_moe", 1), ("qwen3_moe", 2)], indirect=["hf_dir"]
)
def test_tensor_parallel_2_matches_hf(hf_dir: Path, ep: int, tmp_path: Path) -> None:
    """TP=2 under torchrun (2 gloo ranks): shard load, vocab-parallel log-probs, gathered export, and the gradient
    of every parameter equal to TP=1's (Qwen3-MoE: under sequence parallelism, 17 positions padded to 18; with
    ``ep=2`` each rank holds two of the four experts whole)."""
    import os
    import subprocess
    import sys

    spec, _ = load_hf_dir(hf_dir)
    ids = _ids(spec)
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "worker.py").write_text(_TP_WORKER)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    from trainer.dist import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    cmd += [str(tmp_path / "worker.py"), str(hf_dir), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"), str(ep)]
    # own session: on a timeout the whole group (torchrun and its worker ranks) is killed, nothing is left behind
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail("TP=2 workers did not finish within 120 s")
    assert proc.returncode == 0, stderr[-4000:]
    out = torch.load(tmp_path / "out.pt")
    ref_logp, ref_entropy = _hf_logprobs(_hf_model(hf_dir), ids)
    assert (out["logp"] - ref_logp).abs().max().item() < TOL
    assert (out["entropy"] - ref_entropy).abs().max().item() < TOL
    _, _, model = _loaded(hf_dir)  # TP=1
    (-token_logprobs(model, ids).mean()).backward()
    one = model_parameters(model)
    assert set(one) == set(out["grads"])
    for name, p in one.items():
        assert (out["grads"][name] - p.grad).abs().max().item() < TOL, name
    lengths = torch.tensor([17, 12, 9])
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    with torch.no_grad():
        padded = token_logprobs(model, ids, mask)
    assert (out["packed"] - padded).abs().max().item() < TOL
    if spec.is_moe:
        from trainer import moe

        b, s, n = ids.shape[0], ids.shape[1], spec.num_hidden_layers
        t = torch.arange(b * s * n).reshape(b, s, n, 1)
        routes = torch.cat([t % spec.num_experts, (t + 1) % spec.num_experts], dim=-1)
        with torch.no_grad(), moe.replaying(model, moe.token_order(routes), replay=True):
            replayed = token_logprobs(model, ids, mask)
        assert (replayed - padded).abs().max().item() > 1e-3  # the replay was followed
        assert (out["replayed"] - replayed).abs().max().item() < TOL
        assert (out["replayed_packed"] - replayed).abs().max().item() < TOL
        assert out["mismatch"][1].item() == (3 * 17 + 38) * n  # every token's routes compared once, padding not


@pytest.mark.parametrize("hf_dir", ["qwen3_moe"], indirect=True)
def test_routing_replay(hf_dir: Path) -> None:
    """The engine's recorded experts, replayed: its own choice changes nothing; another choice is followed (and
    counted as a mismatch), with the gradient still reaching the router."""
    from agentflow.engine.qwen2 import load_hf_dir as load_engine
    from trainer import moe

    spec, _, model = _loaded(hf_dir)
    ids = _ids(spec, b=2, s=9)
    engine = load_engine(hf_dir)
    rows = []
    for row in ids:
        engine.route_log = []
        engine.forward_full(row)
        rows.append(torch.stack(engine.route_log, dim=1).long())  # [s, layers, k]
    engine.route_log = None
    routes = torch.stack(rows)  # [b, s, layers, k]
    with torch.no_grad():
        plain = token_logprobs(model, ids)
    moe.take_mismatch(model)
    with torch.no_grad(), moe.replaying(model, moe.token_order(routes), replay=True):
        same = token_logprobs(model, ids)
    assert (same - plain).abs().max().item() < 1e-5
    assert moe.take_mismatch(model) == (0, 2 * 9 * spec.num_hidden_layers)
    other = (routes + 1) % spec.num_experts  # a different pair of experts for every token and layer
    with moe.replaying(model, moe.token_order(other), replay=True):
        forced = token_logprobs(model, ids)
        forced.sum().backward()
    assert (forced.detach() - plain).abs().max().item() > 1e-3
    differing, compared = moe.take_mismatch(model)
    assert compared == 2 * 9 * spec.num_hidden_layers and differing == compared
    router = moe.routers(model)[0]
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with torch.no_grad(), moe.replaying(model, moe.token_order(other), replay=False):  # measured, not replayed
        again = token_logprobs(model, ids)
    assert (again - plain).abs().max().item() < 1e-6 and moe.take_mismatch(model)[0] == compared
    # packed rows (the second one shorter): the routes follow the stream's token order
    from trainer.batching import pack_rows

    lengths = torch.tensor([9, 6])
    mask = (torch.arange(9) < lengths[:, None]).long()
    packing = pack_rows(ids, lengths)
    with torch.no_grad():
        with moe.replaying(model, moe.token_order(other), replay=True):
            padded = token_logprobs(model, ids, mask)
        with moe.replaying(model, moe.token_order(other, packing, lengths), replay=True):
            packed = token_logprobs(model, ids, mask, packing=packing)
    assert (padded - packed).abs().max().item() < 1e-5
