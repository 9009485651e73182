"""Version pinning in the embedded engine: one weight version per request from first token to last."""

from __future__ import annotations

import pytest
import torch

from agentflow.engine.embedded import EmbeddedEngine
from agentflow.engine.versions import VersionGone
from agentflow.types import SamplingParams

pytest.importorskip("transformers")
from test_engine import prompt, wait_for  # noqa: E402
from test_engine_model import make_model_dir  # noqa: E402
from test_engine_prefix import full_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    make_model_dir(root / "v0", "qwen2", seed=0)
    new = [make_model_dir(root / f"v{k}", "qwen2", seed=k).state_dict() for k in (1, 2)]
    return root / "v0", new


def test_a_pinned_request_keeps_its_version_across_updates(dirs) -> None:
    base, (w1, w2) = dirs
    long = SamplingParams(temperature=0.0, max_new_tokens=60)
    with EmbeddedEngine(base, max_slots=4, max_len=256) as ref, EmbeddedEngine(base, max_slots=4, max_len=256) as eng:
        eng.keep_versions = 2
        ids = prompt(12, seed=1)
        pinned = eng.submit(ids, SamplingParams(temperature=0.0, max_new_tokens=60, weight_version=0))
        free = eng.submit(prompt(12, seed=2), long)
        wait_for(lambda: eng.stats()["tokens_generated"] >= 20)
        eng.update_weights(1, w1)
        res, mixed = pinned.result(timeout=60), free.result(timeout=60)
        assert set(res.versions) == {0} and set(mixed.versions) == {0, 1}  # unpinned: continues under version 1
        # every token as the old weights alone would have sampled it
        torch.testing.assert_close(
            torch.tensor(res.logprobs), full_logprobs(ref, ids + res.output_ids, len(ids)), atol=1e-4, rtol=0
        )
        stats = eng.stats()
        assert stats["versions_served"] == [0, 1] and stats["held_weights_bytes"] > 0


def test_kv_stays_with_its_version_and_a_dropped_version_is_refused(dirs) -> None:
    base, (w1, w2) = dirs
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    with EmbeddedEngine(base, max_slots=4, max_len=256) as eng:
        eng.keep_versions = 2
        ids = prompt(30, seed=3)
        first = eng.generate_sync(ids, SamplingParams(temperature=0.0, max_new_tokens=4, weight_version=0))
        eng.update_weights(1, w1)  # version 0's KV stays for the episodes pinned to it
        turn = ids + first.output_ids + [7]
        again = eng.generate_sync(turn, SamplingParams(temperature=0.0, max_new_tokens=4, weight_version=0))
        assert again.cached_tokens == 33 and set(again.versions) == {0}
        newer = eng.generate_sync(turn, sp)  # the newest version does not read version 0's KV
        assert newer.cached_tokens == 0 and set(newer.versions) == {1}
        hanging = eng.submit(prompt(10, seed=4), SamplingParams(temperature=0.0, max_new_tokens=200, weight_version=0))
        wait_for(lambda: eng.stats()["running"] == 1)
        eng.update_weights(2, w2)  # keeps versions 1 and 2: what version 0 still generates ends with a clear error
        with pytest.raises(VersionGone, match="weight version 0 is no longer served"):
            hanging.result(timeout=30)
        with pytest.raises(VersionGone, match=r"weight version 0 is not served \(held: \[1, 2\]\)"):
            eng.generate_sync(ids, SamplingParams(weight_version=0))
        assert eng.stats()["requests_version_gone"] == 1
        assert eng.generate_sync(
            turn, SamplingParams(temperature=0.0, max_new_tokens=2, weight_version=1)
        ).versions == [1, 1]
