"""The CUDA IPC transport (trainer and 2 engine processes on one GPU). Needs CUDA: marked ``gpu``."""

from __future__ import annotations

import pytest
import torch

from transfer_mesh.transport import VersionRefused, make_transport

pytestmark = pytest.mark.gpu
PROBE = [3, 17, 42, 99, 7, 250, 11, 64, 5, 301, 23, 8]


def _engine_process(model_dir: str, conn) -> None:
    """An engine process: an embedded engine applying versions that arrive by CUDA IPC handle."""
    torch.set_num_threads(1)
    from agentflow.engine.embedded import EmbeddedEngine
    from transfer_mesh.transport_cuda_ipc import apply_ipc_message

    engine = EmbeddedEngine(model_dir, max_slots=1, max_len=64)
    conn.send("ready")
    try:
        while (cmd := conn.recv()) is not None:
            if cmd == "score":  # probe log-probs and every weight, for the test's comparisons
                conn.send((engine.score(PROBE, 1).logprobs, engine.weight_version, dict(engine.model.params)))
            else:
                conn.send(apply_ipc_message(engine, cmd))
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_engine_processes_on_one_gpu_follow_the_trainer(tmp_path) -> None:
    import torch.multiprocessing as mp

    from agentflow.engine.qwen2 import load_hf_dir
    from agentflow.model_init import ModelInitConfig, init_model
    from transfer_mesh.transport_cuda_ipc import IpcEngineLink

    init_model(tmp_path, ModelInitConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=176))
    reference = load_hf_dir(tmp_path)  # the trainer's stand-in: the same model, weights on the GPU
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_engine_process, args=(str(tmp_path), b)) for _, b in pipes]
    for p in procs:
        p.start()
    links = [IpcEngineLink(a) for a, _ in pipes]
    try:
        assert all(a.recv() == "ready" for a, _ in pipes)
        tm = make_transport({"type": "cuda_ipc", "bucket_bytes": 64 << 10}, links)
        g = torch.Generator().manual_seed(0)
        for version in (1, 2):
            named = {k: (v + 0.01 * torch.randn(v.shape, generator=g)).cuda() for k, v in reference.params.items()}
            report = tm.send(version, named)
            assert report.buckets > 1 and len(report.engines) == 2
            reference.load_({k: v.cpu() for k, v in named.items()})
            expected = reference.forward_full(torch.tensor(PROBE))
            lp = torch.log_softmax(expected[:-1], -1).gather(1, torch.tensor(PROBE[1:])[:, None])[:, 0].tolist()
            for a, _ in pipes:
                a.send("score")
                got, got_version, params = a.recv()
                assert got_version == version
                assert max(abs(x - y) for x, y in zip(got, lp, strict=True)) < 1e-4
                for k, v in named.items():
                    assert torch.allclose(params[k], v.cpu(), atol=1e-5, rtol=0)
        tm._wire = lambda i, b: b.clone().index_fill_(0, torch.tensor([10], device=b.device), 1) if i == 1 else b
        with pytest.raises(VersionRefused, match="checksum mismatch in bucket 1"):
            tm.send(3, {k: v * 2 for k, v in named.items()})
        for a, _ in pipes:
            a.send("score")
            assert a.recv()[1] == 2  # both engines kept the previous version
        tm.close()
    finally:
        for link in links:
            link.close()
        for p in procs:
            p.join(timeout=30)
