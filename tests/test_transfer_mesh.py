"""TransferMesh units: the plan, the transport factory, in-process delivery, integrity, the gloo framing."""

from __future__ import annotations

import threading

import pytest
import torch

from transfer_mesh.buckets import IntegrityError
from transfer_mesh.layouts import ModelSpec, hf_to_megatron, split_for_tp
from transfer_mesh.plan import TransferPlan, megatron_shards_to_hf
from transfer_mesh.transport import VersionRefused, make_transport, parse_transport_config
from transfer_mesh.transport_gloo import END, GlooReceiver, broadcast, header, make_group


def _named(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g),
        "b.bias": torch.randn(7, generator=g),
        "c.weight": torch.randn(128, 16, generator=g).to(torch.bfloat16),
    }


def _pack(plan: TransferPlan, named: dict) -> tuple[dict, dict]:
    bufs = dict(enumerate(plan.new_buffers()))
    return bufs, {i: plan.pack_bucket(i, named, b) for i, b in bufs.items()}


@pytest.mark.parametrize("algo", ["xxh3", "crc32", "sha256"])
def test_plan_round_trip_wire_and_no_shared_storage(algo: str) -> None:
    src = _named()
    plan = TransferPlan.for_tensors(src, bucket_bytes=4096, checksum=algo)
    assert plan.num_buckets >= 2 and plan.total_bytes == sum(t.numel() * t.element_size() for t in src.values())
    assert TransferPlan.from_wire(plan.to_wire()) == plan
    bufs, digests = _pack(plan, src)
    out = plan.decode_version(3, bufs, digests)
    for k, v in src.items():
        assert torch.equal(out[k], v) and out[k].dtype == v.dtype
        assert out[k].untyped_storage().data_ptr() != v.untyped_storage().data_ptr()


def test_plan_refuses_corrupt_missing_misshaped_and_foreign_plans() -> None:
    src = _named()
    plan = TransferPlan.for_tensors(src, bucket_bytes=4096)
    bufs, digests = _pack(plan, src)
    bad = dict(bufs)
    bad[1] = bufs[1].clone()
    bad[1][5] ^= 0xFF
    with pytest.raises(IntegrityError, match="checksum mismatch in bucket 1"):
        plan.decode_version(1, bad, digests)
    with pytest.raises(IntegrityError, match=r"missing buckets \[0\]"):
        plan.decode_version(1, {i: b for i, b in bufs.items() if i}, digests)
    with pytest.raises(IntegrityError, match="a.weight"):
        plan.check_tensors({**src, "a.weight": torch.zeros(32, 64)})
    wire = plan.to_wire()
    wire["shapes"][0] = [32, 64]
    with pytest.raises(IntegrityError, match="fingerprint"):
        TransferPlan.from_wire(wire)


def test_tp_shards_merge_to_the_hf_tensors() -> None:
    spec = ModelSpec("qwen2", 64, 2, 4, 2, 176, 512, attention_bias=True)
    g = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(*s, generator=g) for k, s in TransferPlan.for_spec(spec).shapes.items()}
    mg = hf_to_megatron(hf, spec)
    shards = [{k: split_for_tp(k, v, 2, r) for k, v in mg.items()} for r in range(2)]
    out = megatron_shards_to_hf(spec, shards)
    assert list(out) == list(hf) and all(torch.equal(out[k], hf[k]) for k in hf)


def test_tagged_config_and_factory() -> None:
    cfg = parse_transport_config({"type": "gloo", "bucket_bytes": 1 << 20, "pause_mode": "retract"})
    assert cfg.type == "gloo" and cfg.group_name == "transfer_mesh"
    with pytest.raises(ValueError, match="unknown transport type 'carrier_pigeon'"):
        parse_transport_config({"type": "carrier_pigeon"})
    with pytest.raises(ValueError):
        parse_transport_config({"type": "inprocess", "bucket_size": 3})  # misspelt key


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from agentflow.model_init import ModelInitConfig, init_model

    path = tmp_path_factory.mktemp("tm_tiny")
    init_model(path, ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176))
    return path


def test_inprocess_updates_copy_verify_and_refuse(tiny) -> None:
    from agentflow.engine.embedded import EmbeddedEngine
    from agentflow.types import SamplingParams

    engines = [EmbeddedEngine(tiny, max_slots=2, max_len=64, seed=i) for i in range(2)]
    try:
        new = {k: v + 0.01 * torch.randn_like(v) for k, v in engines[0].model.params.items()}
        tm = make_transport({"type": "inprocess", "bucket_bytes": 1 << 16, "flush_cache": False}, engines)
        report = tm.send(1, new)
        assert report.buckets > 1 and report.stall_s > 0 and [e.weight_version for e in engines] == [1, 1]
        for e in engines:
            for k, v in new.items():
                assert torch.allclose(e.model.params[k], v, atol=1e-5)
                assert e.model.params[k].untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
            assert e.keep_cache_on_update is False  # restored after the update
        probe = engines[0].score(list(range(1, 20)), 1).logprobs
        tm._wire = lambda i, b: b.clone().index_fill_(0, torch.tensor([3]), 7) if i == 2 else b
        with pytest.raises(VersionRefused, match="checksum mismatch in bucket 2"):
            tm.send(2, {k: v * 2 for k, v in new.items()})
        assert [e.weight_version for e in engines] == [1, 1]
        assert engines[0].score(list(range(1, 20)), 1).logprobs == probe
        del tm._wire
        with pytest.raises(IntegrityError, match="does not match the plan"):
            tm.send(2, {**new, "model.norm.weight": torch.ones(3)})
        engines[0].generate_sync([1, 2, 3], SamplingParams(max_new_tokens=2))  # still serving
        tm.close()
    finally:
        for e in engines:
            e.close()


def _loopback_group(timeout: float = 20.0) -> tuple:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("r", make_group("127.0.0.1", store.port, 1, 2, "t", timeout)))
    th.start()
    pg0 = make_group("127.0.0.1", 0, 0, 2, "t", timeout, store)
    th.join()
    return store, pg0, GlooReceiver(box["r"], "t")


def test_gloo_framing_detects_missing_and_foreign_buckets_and_stays_in_step() -> None:
    store, pg0, receiver = _loopback_group()
    src = _named()
    plan = TransferPlan.for_tensors(src, bucket_bytes=4096)
    bufs, digests = _pack(plan, src)

    def send(version: int, skip: int | None = None, stamp: int | None = None) -> None:
        for i, b in bufs.items():
            if i != skip:
                broadcast(pg0, header(stamp or version, i, b.numel(), digests[i])).wait()
                broadcast(pg0, b).wait()
        broadcast(pg0, header(version, END, 0)).wait()

    for kwargs, match in (({"skip": 1}, r"missing buckets \[1\]"), ({"stamp": 9}, "is version 9, expected 4")):
        th = threading.Thread(target=send, args=(4,), kwargs=kwargs)
        th.start()
        with pytest.raises(IntegrityError, match=match):
            receiver.receive_version(plan, 4)
        th.join()
    th = threading.Thread(target=send, args=(5,))
    th.start()
    out = receiver.receive_version(plan, 5)  # the stream stayed in step: the next version arrives whole
    th.join()
    assert all(torch.equal(out[k], v) for k, v in src.items())
    receiver.close()


@pytest.mark.parametrize("algo", ["xxh3", "crc32", "sha256"])
def test_fused_pack_digest_equals_one_shot_digest_over_any_layout(algo: str, monkeypatch) -> None:
    import transfer_mesh.checksum as ck
    import transfer_mesh.plan as pl

    monkeypatch.setattr(pl, "chunks", lambda a, b, step=256: ck.chunks(a, b, step))  # many chunks per tensor
    src = _named()
    src["t.weight"] = torch.randn(40, 24).t()  # strided: the converting-copy path
    src["e.bias"] = torch.zeros(0)
    plan = TransferPlan.for_tensors(src, bucket_bytes=4096, checksum=algo)
    bufs, digests = _pack(plan, src)
    for i, b in bufs.items():
        assert digests[i] == ck.digest(b, algo)  # the chunked hash is the one-shot hash of the bucket
        plan.verify_bucket(0, i, b, digests[i], check_finite=True)
    out = plan.decode_version(0, bufs, digests, check_finite=True)
    assert all(torch.equal(out[k], v) for k, v in src.items())


def test_verify_refuses_non_finite_values_after_the_checksum() -> None:
    src = _named()
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = {**src, "b.bias": src["b.bias"].clone().index_fill_(0, torch.tensor([3]), bad)}
        plan = TransferPlan.for_tensors(poisoned, bucket_bytes=4096)
        bufs, digests = _pack(plan, poisoned)
        plan.decode_version(1, bufs, digests)  # without the scan the bytes are intact
        with pytest.raises(IntegrityError, match="b.bias contains NaN or inf"):
            plan.decode_version(1, bufs, digests, check_finite=True)
    big = {"h": torch.full((8,), 3e38)}  # the sum overflows to inf though every value is finite
    plan = TransferPlan.for_tensors(big)
    bufs, digests = _pack(plan, big)
    assert torch.equal(plan.decode_version(1, bufs, digests, check_finite=True)["h"], big["h"])
    bufs[0][1] ^= 0xFF  # corruption that makes a NaN is reported as what it is
    with pytest.raises(IntegrityError, match="checksum mismatch in bucket 0"):
        plan.decode_version(1, bufs, digests, check_finite=True)


def test_inprocess_refuses_nan_and_engines_keep_their_version(tiny) -> None:
    from agentflow.engine.embedded import EmbeddedEngine

    engine = EmbeddedEngine(tiny, max_slots=1, max_len=32)
    try:
        tm = make_transport({"type": "inprocess"}, [engine])
        named = {k: v + 0.5 for k, v in engine.model.params.items()}
        tm.send(1, named)
        before = {k: v.clone() for k, v in engine.model.params.items()}
        named["model.norm.weight"][0] = float("nan")
        with pytest.raises(VersionRefused, match="model.norm.weight contains NaN or inf"):
            tm.send(2, named)
        assert engine.weight_version == 1
        assert all(torch.equal(engine.model.params[k], v) for k, v in before.items())
        tm.close()
    finally:
        engine.close()


def test_cuda_ipc_device_checksum_and_checks_run_on_any_device() -> None:
    from transfer_mesh.transport_cuda_ipc import device_digest, verify_device_buckets

    src = _named()
    plan = TransferPlan.for_tensors(src, bucket_bytes=4096)
    bufs, _ = _pack(plan, src)
    digests = {i: device_digest(b) for i, b in bufs.items()}
    out = verify_device_buckets(plan, 1, bufs, digests)
    assert all(torch.equal(out[k], v) for k, v in src.items())
    swapped = bufs[0].clone()
    swapped[:8], swapped[8:16] = bufs[0][8:16].clone(), bufs[0][:8].clone()  # two words trade places
    for bad in (swapped, bufs[0].clone().index_fill_(0, torch.tensor([5]), 0)):
        assert device_digest(bad) != digests[0]
        with pytest.raises(IntegrityError, match="checksum mismatch in bucket 0"):
            verify_device_buckets(plan, 1, {**bufs, 0: bad}, digests)
    with pytest.raises(IntegrityError, match=r"missing buckets \[1\]"):
        verify_device_buckets(plan, 1, {i: b for i, b in bufs.items() if i != 1}, digests)
