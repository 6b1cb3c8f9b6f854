"""A real `specserve serve` process on loopback (API process + worker process) for the server tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from server.cluster import terminate

API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def gtok(tokenizer, stops):
    """The default model's grammar tokenizer, for checking tool and format grammars with its matcher."""
    from core.grammar import GrammarTokenizer

    return GrammarTokenizer(tokenizer, len(tokenizer), stops)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, tmp: Path, drafter: str = "ngram", num_slots: int = 4, max_waiting: int = 4,
                 max_seq_len: int = 512, api_key: str | None = API_KEY, drain_timeout: float = 30.0,
                 server_options: dict | None = None, dtype: str = "float32", source: str = "embedded",
                 env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cfg = {"model": {"source": source, "dtype": dtype, "device": "cpu"},
               "cache": {"num_slots": num_slots, "max_seq_len": max_seq_len},
               "drafter": {"name": drafter, "ngram": {"num_tokens": 4}},
               # the tests run requests to a fixed length with `ignore_eos`, off by default
               "server": {"max_waiting": max_waiting, "allow_ignore_eos": True, **(server_options or {})}}
        self.config = tmp / f"server-{self.port}.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.log = open(tmp / f"server-{self.port}.log", "w+")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        env.pop("SPECSERVE_API_KEY", None)
        cmd = [sys.executable, "-m", "specserve", "serve", "--config", str(self.config), "--host", "127.0.0.1",
               "--port", str(self.port), "--drain-timeout", str(drain_timeout)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=Path(__file__).resolve().parents[2])

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        """Wait for /health. The first server of a test session measures kernels and step costs into the session's
        fresh cache (tests/conftest.py) before it answers, minutes on a loaded 2-core machine. A server that exits
        or never gets ready is stopped before the error is raised, so no fixture leaves it running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self._fail(f"server not ready in {timeout}s")

    def _fail(self, why: str) -> None:
        out = self.output()
        self.stop()
        raise RuntimeError(f"{why}:\n{out}")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def worker_pid(self) -> int:
        return httpx.get(self.url + "/health", timeout=10).json()["worker_pid"]

    def stop(self) -> None:
        terminate(self.proc, 60)
        self.log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory, target32):
    """The server most API tests share (one process for the session): ngram drafting, an API key, 4 slots of 1024
    tokens (room for the tools prompt), float32 (speculative steps and plain decoding give the same logprobs to
    ~1e-6). target32: makes sure the GGUF has been converted once before servers start."""
    s = ServerProcess(tmp_path_factory.mktemp("srv"), max_seq_len=1024).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    """The `openai` client of the session's server (a test module may define its own `client`)."""
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture
def make_server(tmp_path, target32):
    started = []

    def make(**kw) -> ServerProcess:
        s = ServerProcess(tmp_path, **kw).wait_ready()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def scrape(url: str) -> dict:
    """Parse /metrics into {(name, frozenset(labels)): value} with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lb), v in samples.items() if n == name and want <= lb)


OUTCOMES = ("completed", "client_error", "server_error", "aborted")


def wait_until(pred, timeout: float = 20.0, step: float = 0.1) -> bool:
    """True as soon as ``pred()`` is, polled every ``step`` seconds; False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False


def wait_balanced(url: str, timeout: float = 10.0) -> bool:
    """True once received == sum of outcomes and no request runs or waits (the last outcome is counted just after
    its response went out, so a scrape right after a reply can be one step early)."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(url)
        received = metric(s, "specserve_requests_received_total")
        done = sum(metric(s, "specserve_requests_total", outcome=o) for o in OUTCOMES)
        idle = metric(s, "specserve_requests_running") == 0 and metric(s, "specserve_requests_waiting") == 0
        if received == done and idle:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
