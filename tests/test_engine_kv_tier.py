"""KV across env pauses: eviction order, the second tier, learned time-to-live, resumed turns admitted first."""

from __future__ import annotations

import time

import pytest
import torch

from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.kv_tier import ResumeGaps, Spilled, SpillTier
from agentflow.types import SamplingParams

pytest.importorskip("transformers")
from test_engine import prompt, wait_for  # noqa: E402
from test_engine_model import make_model_dir  # noqa: E402
from test_engine_prefix import full_logprobs  # noqa: E402

SP = SamplingParams(temperature=0.0, max_new_tokens=3)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv_tier")
    make_model_dir(path, "qwen2")
    return path


def _cached(eng: EmbeddedEngine) -> dict[int, list[int]]:
    return {s: ids for s, ids in eng._idle.items() if ids}


def test_ended_entries_go_first_then_expired_then_live_ones_spill(qwen_dir) -> None:
    with EmbeddedEngine(
        qwen_dir, max_slots=2, max_len=128, kv_ttl_s=0.3, kv_spill_bytes=1 << 20, paused_aware=True
    ) as eng:
        a, b = prompt(20, seed=1), prompt(20, seed=2)
        eng.generate_sync(a, SP)
        rb = eng.generate_sync(b, SP)  # both slots hold an entry; a's is the least recently used
        eng.forget_prefix(b + rb.output_ids + [9])  # b's episode ended (its final context extends the cached ids)
        eng.generate_sync(prompt(20, seed=3), SP)
        s = eng.stats()
        assert s["evicted_ended"] == 1 and s["evicted_live"] == 0
        assert any(ids[:20] == a for ids in _cached(eng).values())  # a's paused episode kept its KV
        time.sleep(0.4)  # both entries idle past the time-to-live now
        eng.generate_sync(prompt(20, seed=4), SP)
        assert eng.stats()["evicted_expired"] == 1
        eng.generate_sync(prompt(20, seed=5), SP)  # the other expired entry
        assert eng.stats()["evicted_expired"] == 2 and eng.stats()["evicted_live"] == 0
        eng.generate_sync(prompt(20, seed=6), SP)  # now only live ones: the LRU one (seed 4's) is spilled
        s = eng.stats()
        assert s["evicted_live"] == 1 and s["kv_spilled"] == 1 and s["spilled_entries"] == 1 and s["spill_bytes"] > 0
        assert eng.generate_sync(prompt(20, seed=4) + [1], SP).cached_tokens == 20  # and it comes back


def test_a_spilled_entry_comes_back_exactly(qwen_dir) -> None:
    """The resumed turn reads its KV back from the second tier: the same log-probs as a fresh forward, no prefill
    of the restored positions."""
    with EmbeddedEngine(qwen_dir, max_slots=1, max_len=128, kv_ttl_s=60.0, kv_spill_bytes=1 << 20) as eng:
        a = prompt(30, seed=1)
        ra = eng.generate_sync(a, SP)
        eng.generate_sync(prompt(25, seed=2), SP)  # one slot: a's live entry is spilled
        assert eng.stats()["kv_spilled"] == 1
        before = eng.stats()["prefill_tokens"]
        turn = a + ra.output_ids + [5, 6]
        res = eng.generate_sync(turn, SP)
        s = eng.stats()
        assert res.cached_tokens == 32 and s["kv_restored"] == 1 and s["kv_restored_tokens"] == 32
        assert s["prefill_tokens"] - before == len(turn) - 32
        torch.testing.assert_close(
            torch.tensor(res.logprobs), full_logprobs(eng, turn + res.output_ids, len(turn)), atol=1e-4, rtol=0
        )


def test_spill_tier_bounds_and_ttl_learning() -> None:
    kv = torch.zeros(2, 2, 1, 10, 4)
    tier = SpillTier(max_bytes=2 * kv.numel() * 4)
    for k in range(3):
        tier.put(Spilled(list(range(k, k + 10)), kv.clone(), 0, released_at=float(k)))
    assert len(tier) == 2 and tier.nbytes == 2 * kv.numel() * 4  # the oldest went
    assert tier.take(list(range(1, 8)), None, 4) is not None and len(tier) == 1
    assert tier.expire(now=100.0, ttl_s=10.0) == 1 and len(tier) == 0
    gaps = ResumeGaps(30.0)
    for g in [0.1] * 7:
        gaps.add(g)
    assert gaps.ttl_s() == 30.0  # too few measured
    gaps.add(0.5)
    assert gaps.ttl_s() == pytest.approx(1.0)  # 2 x p90 of the gaps


def test_resumed_turns_are_admitted_ahead_of_new_episodes(qwen_dir) -> None:
    long = SamplingParams(temperature=0.0, max_new_tokens=40)
    with EmbeddedEngine(qwen_dir, max_slots=2, max_len=256, admission="resumed_first") as eng:
        a = prompt(20, seed=1)
        ra = eng.generate_sync(a, SP)
        eng.pause("in_place")
        blockers = [eng.submit(prompt(12, seed=10 + k), long) for k in range(2)]  # take both slots
        new = [eng.submit(prompt(12, seed=20 + k), SP) for k in range(3)]
        resumed = eng.submit(a + ra.output_ids + [7], SP)
        eng.resume()
        wait_for(lambda: eng.stats()["running"] == 2)
        order = []
        for fut, name in [(resumed, "resumed"), *((f, f"new{k}") for k, f in enumerate(new))]:
            fut.add_done_callback(lambda _f, n=name: order.append(n))
        for f in [*blockers, *new, resumed]:
            f.result(timeout=60)
        assert order[0] == "resumed" and eng.stats()["resumed_ahead"] >= 1


def test_a_shared_system_prompt_is_copied_not_cut_from_a_paused_context(qwen_dir) -> None:
    with EmbeddedEngine(qwen_dir, max_slots=2, max_len=128, paused_aware=True) as eng:
        system = prompt(10, seed=7)
        a = system + prompt(30, seed=1)
        ra = eng.generate_sync(a, SP)  # A pauses in its env with 42 tokens cached
        b = system + prompt(15, seed=2)
        rb = eng.generate_sync(b, SP)  # B shares the 10 system tokens: copied into the empty slot
        assert rb.cached_tokens == 10 and eng.stats()["prefix_copies"] == 1
        torch.testing.assert_close(
            torch.tensor(rb.logprobs), full_logprobs(eng, b + rb.output_ids, len(b)), atol=1e-4, rtol=0
        )
        resumed = eng.generate_sync(a + ra.output_ids + [3], SP)  # A's context survived B
        assert resumed.cached_tokens == len(a) + 2


def test_plain_lru_cuts_the_paused_context(qwen_dir) -> None:
    """``paused_aware=False``: the sibling's shared-prefix hit takes the paused entry's slot, as plain LRU does."""
    with EmbeddedEngine(qwen_dir, max_slots=2, max_len=128, paused_aware=False) as eng:
        system = prompt(10, seed=7)
        a = system + prompt(30, seed=1)
        ra = eng.generate_sync(a, SP)
        eng.generate_sync(system + prompt(15, seed=2), SP)
        assert eng.stats()["prefix_copies"] == 0
        assert eng.generate_sync(a + ra.output_ids + [3], SP).cached_tokens == 10  # only the system prompt is left
