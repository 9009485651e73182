"""A trainer in this process updates 2 engine server processes (gloo broadcast and HTTP).

After every update each engine's prompt log-probs on a probe equal the trainer's within 1e-4 and its weights equal
the exported tensors within 1e-5; a corrupted bucket is refused and both engines stay on the old version.
"""

from __future__ import annotations

import pytest
import requests
import torch

from agentflow.engine.launch import start_servers, stop_servers
from agentflow.engine.sglang_client import SGLangEngine
from agentflow.model_init import ModelInitConfig, init_model
from transfer_mesh.transport import VersionRefused, make_transport

KEY = "tm-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROBE = [3, 17, 42, 99, 7, 250, 11, 64, 5, 301, 23, 8]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    from trainer.megatron_trainer import MegatronTrainer
    from trainer.types import Sample, TrainerSettings

    path = tmp_path_factory.mktemp("tm_e2e")
    init_model(path, ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176))
    procs, urls = start_servers(path, 2, KEY)
    trainer = MegatronTrainer(path, TrainerSettings(lr=1e-2, threads=1))
    ids = list(range(5, 45))
    samples = [Sample(ids, [0] * 8 + [1] * 32, [0.0] * 40, sample_id="s0")]
    clients = [SGLangEngine([u], api_key=KEY) for u in urls]
    both = SGLangEngine(urls, api_key=KEY)
    try:
        yield trainer, samples, urls, clients, both
    finally:
        for c in [*clients, both]:
            c.close()
        stop_servers(procs)


def model_version(url: str) -> str:
    return requests.get(url + "/model_info", timeout=10).json()["weight_version"]


def check_engines_match(trainer, urls: list[str], clients: list[SGLangEngine], named: dict) -> None:
    expected = trainer.sequence_logprobs(PROBE, temperature=1.0)
    for url, client in zip(urls, clients, strict=True):
        got = client.score(PROBE, 1).logprobs
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4, url
        for name in named:  # every tensor, read back from the engine process
            body = {"name": name, "truncate_size": 1 << 20}
            values = torch.tensor(requests.post(url + "/get_weights_by_name", json=body, headers=AUTH).json())
            assert torch.allclose(values, named[name].float(), atol=1e-5, rtol=0), (url, name)


@pytest.mark.parametrize("kind", ["gloo", "http"])
def test_two_engine_processes_follow_the_trainer(rig, kind: str) -> None:
    trainer, samples, urls, clients, both = rig
    cfg = {"type": kind, "bucket_bytes": 64 << 10, "pause_mode": "in_place"}
    tm = make_transport(cfg, [both])
    try:
        for _ in range(2):
            trainer.train_step(samples, "sft")
            named = trainer.export_weights()
            report = tm.send(trainer.version, named)
            assert report.buckets > 1 and len(report.engines) == 2 and report.stall_s > 0
            assert [model_version(u) for u in urls] == [str(trainer.version)] * 2
            check_engines_match(trainer, urls, clients, named)
        # a corrupted bucket: both engines refuse the version and keep serving the previous one
        before = [c.score(PROBE, 1).logprobs for c in clients]
        old = str(trainer.version)
        trainer.train_step(samples, "sft")
        tm._wire = lambda i, b: b.clone().index_fill_(0, torch.tensor([10]), 1) if i == 1 else b
        with pytest.raises(VersionRefused, match="checksum mismatch in bucket 1"):
            tm.send(trainer.version, trainer.export_weights())
        assert [model_version(u) for u in urls] == [old, old]
        assert [c.score(PROBE, 1).logprobs for c in clients] == before
        del tm._wire  # the next version goes through (the group stayed in step)
        named = trainer.export_weights()
        tm.send(trainer.version, named)
        check_engines_match(trainer, urls, clients, named)
    finally:
        tm.close()
