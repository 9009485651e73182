"""``agentflow proxy serve`` as a user runs it: a subprocess on a tiny model directory, called with the ``openai``
client on the default trajectory and on one of its own, stopped with SIGTERM by its PID; the records it wrote."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from test_proxy_model import MODEL, TINY

from agentflow.cli import main
from agentflow.model_init import init_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("tiny-serve"), TINY)


class Served:
    """The command in a subprocess; its banner's ``name: value`` lines once it printed its base URL."""

    def __init__(self, argv: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "AGENTFLOW_PROXY_KEY"}
        env["PYTHONPATH"] = str(ROOT)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentflow.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.banner = self._wait_for("base_url", "api_key")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def _wait_for(self, *names: str, timeout: float = 120.0) -> dict[str, str]:
        got: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while not all(n in got for n in names):
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.stop()
                raise AssertionError(f"no {names} printed; stderr: {self.proc.stderr.read()}") from None  # type: ignore[union-attr]
            name, _, value = line.partition(": ")
            got[name.strip()] = value.strip()
        return got

    def stop(self) -> tuple[int, str]:
        os.kill(self.proc.pid, signal.SIGTERM)
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err


def test_serve_records_the_default_and_named_trajectories_and_flushes_on_sigterm(tiny_model, tmp_path):
    records = tmp_path / "records"
    served = Served(["proxy", "serve", str(tiny_model), "--port", "0", "--record", str(records),
                     "--max-new-tokens", "8"])  # fmt: skip
    try:
        base_url, key = served.banner["base_url"], served.banner["api_key"]
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1") and key.startswith("sk-")
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        first = [{"role": "user", "content": "What is 2 + 3?"}]
        r1 = client.chat.completions.create(model=MODEL, messages=first, temperature=0.0)
        assert json.loads((records / "default.json").read_text())["summary"]["calls"] == 1  # written per call
        follow = [*first, r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
        client.chat.completions.create(model=MODEL, messages=follow, temperature=0.0)
        outputs = []
        for tid in ("mine-1", "mine-2"):  # the client's temperature and seed decide the sampling
            own = openai.OpenAI(base_url=base_url.removesuffix("/v1") + f"/{tid}/0/v1", api_key=key, max_retries=0)
            r = own.chat.completions.create(model=MODEL, messages=first, temperature=1.0, seed=11, max_tokens=6)
            outputs.append(r.choices[0].message.content)
        with pytest.raises(openai.BadRequestError, match="must be 1-128 letters"):
            openai.OpenAI(base_url=base_url.removesuffix("/v1") + "/a.b/0/v1", api_key=key,
                          max_retries=0).chat.completions.create(model=MODEL, messages=first)  # fmt: skip
    finally:
        rc, err = served.stop()
    assert rc == 0 and "stopped; 3 trajectory record(s)" in err, err
    default = json.loads((records / "default.json").read_text())
    summary = default["summary"]
    assert summary["calls"] == 2 and summary["spliced_calls"] == 1 and summary["tito_mismatch"] == 0
    assert summary["segments"] == ["root"] and default["segments"][0]["trained"] is True
    seg = default["segments"][0]
    for call in default["calls"]:
        lo, hi = call["span"]
        assert call["prompt_tokens"] == lo and seg["token_ids"][lo:hi] == call["output_ids"]
        assert sum(seg["loss_mask"][lo:hi]) == hi - lo
    mine = [json.loads((records / f"mine-{i}.json").read_text()) for i in (1, 2)]
    assert [m["calls"][0]["output_ids"] for m in mine][0] == mine[1]["calls"][0]["output_ids"]  # the same seed
    assert outputs[0] == outputs[1] and all(len(m["calls"][0]["output_ids"]) <= 6 for m in mine)


def test_serve_refuses_a_missing_model_directory_with_one_line(tmp_path, capsys):
    assert main(["proxy", "serve", str(tmp_path / "nope"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model directory not found" in err[0] and "agentflow model init" in err[0]
