"""Prefix cache of the embedded engine: multi-turn resumes pay for new tokens only, exactly."""

from __future__ import annotations

import pytest
import torch

from agentflow.engine.embedded import EmbeddedEngine, common_prefix
from agentflow.types import SamplingParams

pytest.importorskip("transformers")
from test_engine import prompt, wait_for  # noqa: E402
from test_engine_model import make_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix_qwen2")
    make_model_dir(path, "qwen2")
    return path


def full_logprobs(eng: EmbeddedEngine, seq: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    """Behaviour log-probs of ``seq[start:]`` from one full forward pass (no cache)."""
    logits = eng.model.forward_full(torch.tensor(seq))[start - 1 : len(seq) - 1]
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return logp.gather(1, torch.tensor(seq[start:])[:, None])[:, 0]


def test_common_prefix() -> None:
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 9], [1, 2, 3, 4]) == 3
    assert common_prefix(list(range(1000)), [*range(517), -1]) == 517


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_multi_turn_resume_pays_for_new_tokens_only(qwen_dir, temperature) -> None:
    sp = SamplingParams(temperature=temperature, max_new_tokens=10, seed=7)
    with EmbeddedEngine(qwen_dir, max_slots=3, max_len=256) as eng:
        context, previous_len = prompt(40, seed=1), 0
        for turn in range(4):
            before = eng.stats()["prefill_tokens"]
            res = eng.generate_sync(context, sp)
            paid = eng.stats()["prefill_tokens"] - before
            if turn == 0:
                assert res.cached_tokens == 0 and paid == len(context)
            else:
                # Everything but the previous turn's last sampled token (never fed back) was cached.
                assert res.cached_tokens == previous_len - 1 and paid == len(context) - res.cached_tokens
            seq = context + res.output_ids
            ref = full_logprobs(eng, seq, len(context), temperature)
            torch.testing.assert_close(torch.tensor(res.logprobs), ref, atol=1e-4, rtol=0)
            previous_len = len(seq)
            context = seq + prompt(7, seed=100 + turn)  # the environment's answer
        assert eng.stats()["prefix_hits"] == 3


def test_greedy_outputs_equal_without_cache(qwen_dir) -> None:
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    outs = []
    for cache in (True, False):
        with EmbeddedEngine(qwen_dir, max_slots=2, max_len=256, prefix_cache=cache) as eng:
            ctx, turns = prompt(20, seed=2), []
            for t in range(3):
                res = eng.generate_sync(ctx, sp)
                turns.append((res.output_ids, res.logprobs, res.cached_tokens))
                ctx = ctx + res.output_ids + prompt(5, seed=50 + t)
            outs.append(turns)
    for (ids_a, lp_a, _), (ids_b, lp_b, hit_b) in zip(*outs, strict=True):
        assert ids_a == ids_b and hit_b == 0
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4, rtol=0)
    assert [hit for _, _, hit in outs[0]][1:] == [27, 40]


def test_longest_prefix_slot_and_lru_eviction(qwen_dir) -> None:
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    with EmbeddedEngine(qwen_dir, max_slots=2, max_len=128) as eng:
        a, b = prompt(30, seed=3), prompt(30, seed=4)
        ra = eng.generate_sync(a, sp)
        eng.generate_sync(b, sp)  # takes the empty slot, keeps a's cache
        assert eng.stats()["cached_slots"] == 2
        # Shares 30 tokens with a: reuses a's slot, even though b's was used more recently.
        hit = eng.generate_sync(a + ra.output_ids[:2] + [5], sp)
        assert hit.cached_tokens == 32
        # No hit anywhere: evicts the least recently used slot (b's), a's stays reusable.
        assert eng.generate_sync(prompt(30, seed=5), sp).cached_tokens == 0
        assert eng.generate_sync(a[:20] + [1, 2], sp).cached_tokens == 20
        # An identical prompt still sends its last token through the model.
        assert eng.generate_sync(a[:20] + [1, 2], sp).cached_tokens == 21


def test_flush_and_weight_update_invalidate(qwen_dir, tmp_path) -> None:
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    new = make_model_dir(tmp_path, "qwen2", seed=3).state_dict()
    ids = prompt(25, seed=6)
    with EmbeddedEngine(qwen_dir, max_slots=2, max_len=128) as eng:
        eng.generate_sync(ids, sp)
        assert eng.flush_cache() and eng.stats()["cached_slots"] == 0
        assert eng.generate_sync(ids + [1], sp).cached_tokens == 0
        assert eng.generate_sync(ids + [1, 2], sp).cached_tokens == 26
        eng.update_weights(1, new)
        res = eng.generate_sync(ids + [1, 2, 3], sp)
        assert res.cached_tokens == 0 and res.versions == [1] * 4
        torch.testing.assert_close(
            torch.tensor(res.logprobs), full_logprobs(eng, ids + [1, 2, 3] + res.output_ids, 28), atol=1e-4, rtol=0
        )
    with EmbeddedEngine(qwen_dir, max_slots=2, max_len=128, kv_on_update="keep") as eng:
        eng.generate_sync(ids, sp)
        eng.update_weights(1, new)
        assert eng.generate_sync(ids + [1], sp).cached_tokens == 25  # stale KV kept, as configured
        assert eng.stats()["stale_prefix_hits"] == 1


def test_flush_drops_the_kv_of_a_request_that_decoded_across_the_update(qwen_dir, tmp_path) -> None:
    """``flush``: the update cannot drop a running request's KV, but once that request ends its KV (part of it the old
    weights') is not offered to the next request sharing its prefix; without the update the same sequence is reused."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=40)
    new = make_model_dir(tmp_path, "qwen2", seed=3).state_dict()
    ids = prompt(25, seed=6)
    with EmbeddedEngine(qwen_dir, max_slots=2, max_len=128) as eng:
        fut = eng.submit(ids, sp)
        wait_for(lambda: eng.stats()["tokens_generated"] > 5)
        eng.pause("in_place")
        eng.update_weights(1, new)
        eng.resume()
        res = fut.result(timeout=30)
        assert res.versions[0] == 0 and res.versions[-1] == 1  # it decoded across the update
        again = eng.generate_sync(ids + res.output_ids + [1], sp)
        assert again.cached_tokens == 0 and eng.stats()["stale_prefix_hits"] == 0
        torch.testing.assert_close(  # sampled exactly as a fresh forward of the new weights would
            torch.tensor(again.logprobs),
            full_logprobs(eng, ids + res.output_ids + [1] + again.output_ids, len(ids) + len(res.output_ids) + 1),
            atol=1e-4,
            rtol=0,
        )
        # a request that ran under one version leaves its KV to the next, as before
        last = eng.generate_sync(ids + res.output_ids + [1] + again.output_ids + [2], sp)
        assert last.cached_tokens > 0


def _stale_kv_logprob(qwen_dir, new: dict, prefix: list[int], rest: list[int], token: int) -> float:
    """The log-prob of ``token`` after ``prefix + rest`` where the prefix's KV came from the old weights and the
    rest's from the new ones: what an engine that keeps its cache across the update samples from."""
    from agentflow.engine.qwen2 import KVCache, load_hf_dir

    model = load_hf_dir(qwen_dir)
    cache = KVCache(model.config, 1, 128)
    model.prefill(cache, 0, torch.tensor(prefix), 0)
    model.load_(new)
    logits = model.prefill(cache, 0, torch.tensor(rest), len(prefix))
    return float(torch.log_softmax(logits.reshape(-1, logits.shape[-1])[-1], dim=-1)[token])


def test_keep_records_what_the_stale_kv_sampled_and_ages_out(qwen_dir, tmp_path) -> None:
    """``keep``: the recorded log-prob is the one sampled over the old weights' KV (not a fresh forward's), which is
    what the trainer's importance ratio needs to correct for it; entries older than ``kv_max_age`` are dropped."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=1)
    new = make_model_dir(tmp_path, "qwen2", seed=3).state_dict()
    ids = prompt(25, seed=6)
    with EmbeddedEngine(qwen_dir, max_slots=2, max_len=128, kv_on_update="keep", kv_max_age=2) as eng:
        eng.generate_sync(ids, sp)
        eng.update_weights(1, new)
        res = eng.generate_sync(ids + [1, 2], sp)
        assert res.cached_tokens == 25 and res.versions == [1]
        stale = _stale_kv_logprob(qwen_dir, new, ids, [1, 2], res.output_ids[0])
        fresh = float(full_logprobs(eng, ids + [1, 2] + res.output_ids, 27)[0])
        assert res.logprobs[0] == pytest.approx(stale, abs=1e-4)
        assert abs(stale - fresh) > 1e-3  # the correction has something to correct
        eng.update_weights(2, new)
        assert eng.generate_sync(ids + [1, 2, 3], sp).cached_tokens == 27  # its oldest KV two versions old: kept
        assert eng.stats()["kv_dropped_too_old"] == 0
        eng.update_weights(3, new)  # the entry still holds version 0's KV, three versions back now: dropped
        assert eng.stats()["kv_dropped_too_old"] == 1
        assert eng.generate_sync(ids + [1, 2, 3, 4], sp).cached_tokens == 0


def test_recompute_refreshes_idle_entries_and_on_admission(qwen_dir, tmp_path) -> None:
    """``recompute``: an idle engine prefills kept entries again under the new weights, so a resumed request reuses
    them and samples exactly as a fresh forward would; an entry reached before that is prefilled on admission."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=3)
    new = make_model_dir(tmp_path, "qwen2", seed=3).state_dict()
    ids = prompt(25, seed=6)
    with EmbeddedEngine(qwen_dir, max_slots=2, max_len=128, kv_on_update="recompute") as eng:
        eng.generate_sync(ids, sp)
        eng.update_weights(1, new)
        wait_for(lambda: eng.stats()["stale_slots"] == 0)
        assert eng.stats()["kv_recomputed_tokens"] > 0 and eng.stats()["kv_recomputed_on_admit"] == 0
        res = eng.generate_sync(ids + [1], sp)
        assert res.cached_tokens == 25 and eng.stats()["stale_prefix_hits"] == 0
        torch.testing.assert_close(
            torch.tensor(res.logprobs), full_logprobs(eng, ids + [1] + res.output_ids, 26), atol=1e-4, rtol=0
        )
        eng.pause("in_place")  # no idle steps: the entry is still stale when the next turn arrives
        eng.update_weights(2, make_model_dir(tmp_path / "b", "qwen2", seed=4).state_dict())
        assert eng.stats()["stale_slots"] == 1  # the second request took the first one's slot (plain LRU)
        fut = eng.submit(ids + [1] + res.output_ids + [2], sp)
        eng.resume()
        again = fut.result(timeout=30)
        assert again.cached_tokens == 0 and eng.stats()["kv_recomputed_on_admit"] == 1
        seq = ids + [1] + res.output_ids + [2]
        torch.testing.assert_close(
            torch.tensor(again.logprobs), full_logprobs(eng, seq + again.output_ids, len(seq)), atol=1e-4, rtol=0
        )


def test_release_and_resume_memory(qwen_dir) -> None:
    sp = SamplingParams(temperature=0.0, max_new_tokens=300)
    with EmbeddedEngine(qwen_dir, max_slots=2, max_len=512) as eng:
        reference = eng.generate_sync(prompt(6), sp)
        fut = eng.submit(prompt(6), sp, rid="long")
        wait_for(lambda: eng.stats()["tokens_generated"] > len(reference.output_ids) + 5)
        eng.release_memory()
        assert eng.stats()["kv_cache_bytes"] == 0 and eng.stats()["released"]
        assert eng.retractions("long") == 1 and not fut.done()
        eng.resume_memory()
        res = fut.result(timeout=30)
        assert res.output_ids == reference.output_ids and eng.stats()["kv_cache_bytes"] > 0


def test_slots_stay_compact_and_a_coincidental_prefix_takes_no_cached_slot(qwen_dir) -> None:
    """New requests take the lowest-numbered empty slots (a decode step attends over the slot range), also after a
    flush; a one-token prefix match does not evict a cached sequence."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=2)
    with EmbeddedEngine(qwen_dir, max_slots=8, max_len=64) as eng:
        eng.generate_sync([5, 6, 7, 8, 9], sp)  # cached in slot 0
        eng.flush_cache()
        first = [11, 12, 13, 14, 15, 16]
        eng.generate_sync(first, sp)  # after the flush every slot is empty: slot 0 again
        assert [s for s, ids in eng._idle.items() if ids] == [0]
        eng.generate_sync([11, 40, 41], sp)  # shares 1 token with slot 0's sequence: takes empty slot 1
        cached = {s: ids[:3] for s, ids in eng._idle.items() if ids}
        assert cached == {0: [11, 12, 13], 1: [11, 40, 41]}
        res = eng.generate_sync([*first, 20, 21], sp)  # a real prefix hit reuses slot 0
        assert res.cached_tokens == len(first)
