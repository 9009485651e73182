"""The Teacher Manager on real embedded engines: scoring parity, routing, budget, pre-flight errors."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agentflow.model_init import ModelInitConfig, _init_weights, init_model
from agentflow.teacher_scoring import EngineScorer
from teachers.manager import TeacherManager
from teachers.routing import Router, parse_routes
from teachers.teacher import check_teacher, tokenizer_fingerprint
from teachers.types import Route, ScoreRequest, TeacherError, TeacherSpec

TINY = ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176, num_attention_heads=4)


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> list[Path]:
    """A student and three teachers: one tokenizer, different random weights (each a real HF directory)."""
    root = tmp_path_factory.mktemp("family")
    first = init_model(root / "m0", TINY)
    dirs = [first]
    for i in range(1, 4):
        d = root / f"m{i}"
        shutil.copytree(first, d)
        weights = _init_weights(replace(TINY, seed=i))
        weights = {k: v * 10.0 if "proj" in k or "embed" in k else v for k, v in weights.items()}  # peaked outputs
        save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        dirs.append(d)
    return dirs


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _direct_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """A direct forward pass with Hugging Face transformers: log p(ids[t] | ids[:t]) for t >= 1, and the full rows."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1)


def test_teacher_logprobs_through_the_engine_equal_a_direct_forward_pass(family):
    student, teacher = family[0], family[1]
    specs = [TeacherSpec("t", path=str(teacher))]
    manager = TeacherManager(specs, Router(specs, [Route("all", (("t", 1.0),))]), lambda s: EngineScorer(s.path), 1)
    manager.top_k = 5
    ids = _ids(40, 0)
    try:
        (scores,) = manager.score([ScoreRequest("x", ids, ["all"], start=1)])
    finally:
        manager.close()
    rows = _direct_logprobs(teacher, ids)
    direct = rows.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(scores.logprobs, dtype=torch.float64), direct, atol=1e-4)
    top_vals, top_idx = torch.topk(rows, 5, dim=-1)
    assert scores.top_ids == top_idx.tolist()
    assert torch.allclose(torch.tensor(scores.top_logprobs, dtype=torch.float64), top_vals, atol=1e-4)
    assert tokenizer_fingerprint(student) == tokenizer_fingerprint(teacher)


def _manager(family, budget: int, mix: str = "probs") -> TeacherManager:
    specs = [TeacherSpec(f"t{i}", path=str(family[i])) for i in range(1, 4)] + [TeacherSpec("t0", path=str(family[0]))]
    routes = parse_routes({f"tag{i}": f"t{i}" for i in range(4)} | {"mixed": {"t1": 3.0, "t2": 1.0}}, mix)
    return TeacherManager(specs, Router(specs, routes), lambda s: EngineScorer(s.path), budget)


def test_budget_of_two_scores_like_all_resident_with_few_loads(family):
    requests = [ScoreRequest(f"r{i}", _ids(20 + i, i), [f"tag{i % 4}"]) for i in range(16)]  # interleaved
    everything = _manager(family, budget=4)
    budget = _manager(family, budget=2)
    try:
        want = everything.score(requests)
        got = budget.score(requests)
        assert budget.stats.peak_resident == 2 and budget.stats.loads == 4
        assert len(budget.resident()) == 2
        again = budget.score(requests)  # the two resident teachers go first: only the other two are loaded
        assert budget.stats.loads == 6 and budget.stats.releases == 4
    finally:
        everything.close()
        budget.close()
    for a, b, c in zip(want, got, again, strict=True):
        assert a.key == b.key == c.key and a.teachers == b.teachers
        assert a.logprobs == b.logprobs == c.logprobs  # same engine code, same weights: bit-identical


def test_weighted_mix_is_the_mixture_of_probabilities(family):
    ids = _ids(30, 5)
    manager = _manager(family, budget=2)
    try:
        (mixed, one, two) = manager.score(
            [ScoreRequest("m", ids, ["mixed"]), ScoreRequest("a", ids, ["tag1"]), ScoreRequest("b", ids, ["tag2"])]
        )
    finally:
        manager.close()
    assert mixed.teachers == {"t1": 0.75, "t2": 0.25}
    for m, a, b in zip(mixed.logprobs, one.logprobs, two.logprobs, strict=True):
        assert m == pytest.approx(math.log(0.75 * math.exp(a) + 0.25 * math.exp(b)), abs=1e-9)


def test_sample_mix_gives_each_sequence_one_teacher_by_weight(family):
    specs = [TeacherSpec(f"t{i}", path=str(family[i])) for i in (1, 2)]
    router = Router(specs, parse_routes({"mixed": {"t1": 3.0, "t2": 1.0}}, "sample"))
    picks = [router.assign(f"seq{i}", ["mixed"]) for i in range(400)]
    assert all(len(p) == 1 and next(iter(p.values())) == 1.0 for p in picks)
    share = sum("t1" in p for p in picks) / len(picks)
    assert 0.68 < share < 0.82
    assert router.assign("seq7", ["mixed"]) == picks[7]  # stable per sequence


def test_top_k_with_a_per_token_mixture_is_refused():
    specs = [TeacherSpec("t1", path="x"), TeacherSpec("t2", path="y")]
    router = Router(specs, parse_routes({"m": {"t1": 1, "t2": 1}}))
    with pytest.raises(TeacherError, match="mix: sample"):
        TeacherManager(specs, router, lambda s: EngineScorer(s.path), 2, top_k=4)


def test_route_to_unknown_teacher_names_the_known_ones():
    specs = [TeacherSpec("calc", path="a"), TeacherSpec("qa", path="b")]
    with pytest.raises(TeacherError, match=r"unknown teacher 'calk'.*\['calc', 'qa'\].*Did you mean 'calc'"):
        Router(specs, parse_routes({"math": "calk"}))


def test_source_without_route_is_an_error_unless_a_default_exists():
    specs = [TeacherSpec("calc", path="a")]
    with pytest.raises(TeacherError, match=r"data source 'web' with tags \['browse'\] has no teacher route"):
        Router(specs, parse_routes({"math": "calc"})).check_sources({"web": ["browse"]})
    Router(specs, parse_routes({"default": "calc"})).check_sources({"web": ["browse"]})


def test_missing_teacher_directory_is_named(family, tmp_path):
    with pytest.raises(TeacherError, match="teacher 'ghost': model directory not found: .*nowhere"):
        check_teacher(TeacherSpec("ghost", path=str(tmp_path / "nowhere")), family[0])
    with pytest.raises(TeacherError, match="needs `tokenizer:`"):
        check_teacher(TeacherSpec("srv", url="http://127.0.0.1:1"), family[0])


def test_teacher_with_another_tokenizer_is_refused(family, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(family[1], other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same strings, two ids swapped: scores would be silently wrong
    (other / "tokenizer.json").write_text(json.dumps(data))
    check_teacher(TeacherSpec("same", path=str(family[1])), family[0])
    with pytest.raises(TeacherError, match=r"teacher 'odd': its tokenizer .* differs .* 2 tokens have other ids"):
        check_teacher(TeacherSpec("odd", path=str(other)), family[0])


def test_spec_needs_exactly_one_location():
    with pytest.raises(TeacherError, match="exactly one of path"):
        TeacherSpec("t")
    with pytest.raises(TeacherError, match="exactly one of path"):
        TeacherSpec("t", path="a", url="http://x")


@pytest.mark.slow
def test_server_teacher_scores_like_the_embedded_one(family):
    """A teacher behind the SGLang protocol (our server, the same client as for SGLang) through the job's factory."""
    from agentflow.config import load_config
    from agentflow.engine.launch import start_servers, stop_servers
    from agentflow.teacher_scoring import make_scorer_factory

    procs, urls = start_servers(family[1], 1, "k", max_slots=1, max_len=128)
    try:
        specs = [TeacherSpec("srv", url=urls[0], tokenizer=str(family[1])), TeacherSpec("local", path=str(family[1]))]
        check_teacher(specs[0], family[0])
        router = Router(specs, parse_routes({"a": "srv", "b": "local"}))
        manager = TeacherManager(specs, router, make_scorer_factory(load_config(None)), 1, top_k=3)
        ids = _ids(25, 3)
        try:
            remote, local = manager.score([ScoreRequest("r", ids, ["a"]), ScoreRequest("l", ids, ["b"])])
        finally:
            manager.close()
    finally:
        stop_servers(procs)
    assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-5)
    assert remote.top_ids == local.top_ids
