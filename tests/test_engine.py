"""The embedded engine: HF parity, continuous batching, sampling, weights, pause/abort and errors."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from agentflow.engine.embedded import EmbeddedEngine
from agentflow.types import InferenceEngine, SamplingParams

transformers = pytest.importorskip("transformers")
from test_engine_model import make_model_dir  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def hf_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"engine_{request.param}")
    return make_model_dir(path, request.param), path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("engine_qwen2")
    make_model_dir(path, "qwen2")
    return path


@pytest.fixture
def engine(qwen_dir):
    eng = EmbeddedEngine(qwen_dir, max_slots=4, max_len=512, seed=0)
    yield eng
    eng.close()


def hf_logprobs(hf, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= start under the HF model."""
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    return logp[start - 1 : len(ids) - 1].gather(1, torch.tensor(ids[start:])[:, None])[:, 0]


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def test_protocol(engine) -> None:
    assert isinstance(engine, InferenceEngine)
    assert engine.weight_version == 0


def test_greedy_matches_hf_generate(hf_model) -> None:
    hf, path = hf_model
    ids = prompt(9, seed=3)
    with EmbeddedEngine(path, max_slots=2, max_len=128) as eng:
        res = eng.generate_sync(ids, SamplingParams(temperature=0.0, max_new_tokens=20))
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, 9, dtype=torch.long),
            do_sample=False,
            max_new_tokens=20,
            min_new_tokens=20,
            pad_token_id=0,
        )[0, 9:].tolist()
    assert res.output_ids == ref
    assert res.finish_reason == "length" and res.prompt_tokens == 9 and res.versions == [0] * 20
    torch.testing.assert_close(torch.tensor(res.logprobs), hf_logprobs(hf, ids + ref, 9), atol=1e-5, rtol=0)


def test_score_matches_hf(hf_model) -> None:
    hf, path = hf_model
    ids = prompt(30, seed=4)
    with EmbeddedEngine(path, max_slots=1, max_len=64) as eng:
        res = eng.score(ids, 1, top_k=3)
        tail = eng.score(ids, 25)
        with pytest.raises(ValueError, match="start"):
            eng.score(ids, 0)
    ref = hf_logprobs(hf, ids, 1)
    torch.testing.assert_close(torch.tensor(res.logprobs), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(tail.logprobs), ref[24:], atol=1e-5, rtol=0)
    assert tail.top_logprobs is None and res.weight_version == 0
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1], dim=-1)
    top = torch.topk(logp, 3, dim=-1)
    assert [[t for t, _ in row] for row in res.top_logprobs] == top.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([[v for _, v in row] for row in res.top_logprobs]), top.values, atol=1e-5, rtol=0
    )


def test_continuous_batching_is_exact(qwen_dir) -> None:
    prompts = [prompt(3 + 5 * i, seed=10 + i) for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=6 + 3 * i) for i in range(8)]
    with EmbeddedEngine(qwen_dir, max_slots=8, max_len=128) as eng:
        alone = [eng.generate_sync(p, s) for p, s in zip(prompts, params, strict=True)]

    async def together(eng: EmbeddedEngine):
        return await asyncio.gather(*(eng.generate(p, s) for p, s in zip(prompts, params, strict=True)))

    # max_slots=3 < 8 requests: some wait in the queue and join as others leave.
    with EmbeddedEngine(qwen_dir, max_slots=3, max_len=128) as eng:
        batched = asyncio.run(together(eng))
        assert eng.stats()["decode_steps"] < sum(s.max_new_tokens for s in params)
    for a, b in zip(alone, batched, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_seeded_sampling_reproducible_and_pre_truncation_logprobs(engine) -> None:
    ids = prompt(7, seed=5)
    sp = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=16, seed=123)
    first = engine.generate_sync(ids, sp)
    noise = [engine.submit(prompt(4, seed=s), SamplingParams(max_new_tokens=20)) for s in range(3)]
    again = engine.generate_sync(ids, sp)  # now batched with other requests
    [f.result() for f in noise]
    assert first.output_ids == again.output_ids and first.logprobs == pytest.approx(again.logprobs, abs=1e-5)
    other = engine.generate_sync(ids, SamplingParams(temperature=0.7, top_k=5, max_new_tokens=16, seed=124))
    assert other.output_ids != first.output_ids
    seq = ids + first.output_ids
    logits = engine.model.forward_full(torch.tensor(seq))[len(ids) - 1 : -1]
    scaled = torch.log_softmax(logits / 0.7, dim=-1)
    for i, tok in enumerate(first.output_ids):
        assert tok in torch.topk(logits[i], 5).indices.tolist()
        assert first.logprobs[i] == pytest.approx(float(scaled[i, tok]), abs=1e-5)
        truncated = torch.log_softmax(torch.topk(logits[i] / 0.7, 5).values, dim=-1).max()
        assert first.logprobs[i] < float(truncated) + 1e-6  # not the renormalised top-k distribution


def test_top_p_keeps_the_nucleus(engine) -> None:
    ids = prompt(6, seed=6)
    res = engine.generate_sync(ids, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=8, seed=1))
    greedy = engine.generate_sync(ids, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert res.output_ids == greedy.output_ids  # a tiny nucleus is the argmax alone
    assert all(lp < 0 for lp in res.logprobs)


def test_stop_token_ids(engine) -> None:
    ids = prompt(8, seed=7)
    full = engine.generate_sync(ids, GREEDY).output_ids
    stop = full[4]
    res = engine.generate_sync(ids, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,)))
    k = full.index(stop)
    assert res.output_ids == full[: k + 1] and res.finish_reason == "stop"
    assert len(res.logprobs) == len(res.versions) == k + 1
    assert engine.generate_sync(ids, SamplingParams(max_new_tokens=0)).output_ids == []


def test_update_weights(engine, tmp_path) -> None:
    ids = prompt(8, seed=8)
    before = engine.generate_sync(ids, GREEDY)
    new = make_model_dir(tmp_path, "qwen2", seed=1).state_dict()
    new = {k: v.clone() for k, v in new.items()}
    bad = dict(new, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights(1, bad)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(1, {k: v for k, v in new.items() if "layers.1.mlp" not in k})
    with pytest.raises(ValueError, match="unknown"):
        engine.update_weights(1, dict(new, extra=torch.zeros(1)))
    assert engine.weight_version == 0 and engine.generate_sync(ids, GREEDY).output_ids == before.output_ids
    engine.update_weights(1, new)
    for t in new.values():
        t.fill_(0.0)  # the engine owns its copy
    after = engine.generate_sync(ids, GREEDY)
    assert engine.weight_version == 1 and after.versions == [1] * 12
    assert after.output_ids != before.output_ids
    assert engine.score(ids, 1).weight_version == 1


def test_pause_abort_returns_partial(engine) -> None:
    fut = engine.submit(prompt(5), SamplingParams(temperature=0.0, max_new_tokens=500))
    wait_for(lambda: engine.stats()["tokens_generated"] > 5)
    engine.pause("abort")
    res = fut.result(timeout=10)
    assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 500
    assert len(res.logprobs) == len(res.versions) == len(res.output_ids)
    queued = engine.submit(prompt(5), GREEDY)  # waits while paused
    time.sleep(0.05)
    assert not queued.done() and engine.stats()["waiting"] == 1
    engine.flush_cache()
    engine.resume()
    assert queued.result(timeout=10).finish_reason == "length"


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_then_resume_continues(engine, mode) -> None:
    ids = prompt(6, seed=9)
    sp = SamplingParams(temperature=0.0, max_new_tokens=300)
    reference = engine.generate_sync(ids, sp)
    base = engine.stats()["tokens_generated"]
    fut = engine.submit(ids, sp)
    wait_for(lambda: engine.stats()["tokens_generated"] > base + 5)
    engine.pause(mode)
    frozen = engine.stats()["tokens_generated"]
    time.sleep(0.05)
    assert engine.stats()["tokens_generated"] == frozen and not fut.done()
    assert engine.flush_cache()  # safe while paused: in-place requests keep their KV
    engine.resume()
    res = fut.result(timeout=20)
    assert res.output_ids == reference.output_ids and res.finish_reason == "length"
    torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(reference.logprobs), atol=1e-5, rtol=0)


def test_versions_across_update_in_place(engine, tmp_path) -> None:
    new = make_model_dir(tmp_path, "qwen2", seed=2).state_dict()
    fut = engine.submit(prompt(6), SamplingParams(temperature=0.0, max_new_tokens=400))
    wait_for(lambda: engine.stats()["tokens_generated"] > 5)
    engine.pause("in_place")
    engine.update_weights(7, new)
    engine.resume()
    res = fut.result(timeout=20)
    k = res.versions.index(7)
    assert k > 0 and set(res.versions[:k]) == {0} and set(res.versions[k:]) == {7}


def test_abort_rid_and_async_cancel(engine) -> None:
    fut = engine.submit(prompt(5), SamplingParams(max_new_tokens=500), rid="r1")
    with pytest.raises(ValueError, match="in flight"):
        engine.submit(prompt(5), GREEDY, rid="r1").result()
    wait_for(lambda: engine.stats()["tokens_generated"] > 3)
    engine.abort("r1")
    engine.abort("unknown")
    assert fut.result(timeout=10).finish_reason == "abort"

    async def cancel() -> None:
        task = asyncio.ensure_future(engine.generate(prompt(5), SamplingParams(max_new_tokens=500), rid="r2"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel())
    wait_for(lambda: engine.stats()["running"] == 0)


def test_too_long_prompt_and_bad_ids_fail_cleanly(engine) -> None:
    with pytest.raises(ValueError, match="max_len"):
        engine.generate_sync(prompt(512), GREEDY)
    with pytest.raises(ValueError, match="max_len"):
        asyncio.run(engine.generate(prompt(600), GREEDY))
    with pytest.raises(ValueError, match="out of range"):
        engine.generate_sync([1, 500], GREEDY)
    res = engine.generate_sync(prompt(505), SamplingParams(temperature=0.0, max_new_tokens=50))
    assert res.finish_reason == "length" and len(res.output_ids) == 7  # capped by max_len


def test_loop_error_fails_pending_and_recovers(engine, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.model, "decode", broken)
    futs = [engine.submit(prompt(4, seed=s), GREEDY) for s in range(6)]
    for f in futs:
        with pytest.raises(RuntimeError, match="boom"):
            f.result(timeout=10)
    monkeypatch.undo()
    assert engine.generate_sync(prompt(4), GREEDY).finish_reason == "length"
    assert engine.stats()["errors"] >= 1


def test_close_aborts_in_flight(qwen_dir) -> None:
    eng = EmbeddedEngine(qwen_dir, max_slots=2, max_len=512)
    futs = [eng.submit(prompt(4, seed=s), SamplingParams(max_new_tokens=500)) for s in range(3)]
    wait_for(lambda: eng.stats()["tokens_generated"] > 3)
    eng.close()
    assert all(f.result(timeout=5).finish_reason == "abort" for f in futs)
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate_sync(prompt(4), GREEDY)
    with pytest.raises(RuntimeError, match="closed"):
        eng.pause()


def test_stats(engine) -> None:
    engine.generate_sync(prompt(4), GREEDY)
    s = engine.stats()
    assert s["tokens_generated"] == 12 and s["decode_steps"] == 11 and s["busy_seconds"] > 0
    assert s["running"] == 0 and s["waiting"] == 0 and s["kv_cache_bytes"] > 0
