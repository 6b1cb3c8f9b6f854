"""`specserve cluster`: N `specserve serve` replicas on one host, each pinned to its own cores, behind a router users
already run: SGLang's model gateway (PyPI ``sglang-router``) or vLLM's router (PyPI ``vllm-router``), both Rust
binaries that route OpenAI requests to a conversation's replica (``cache_aware``: from the request text), take a dead
replica out by health checks and retry a request that never reached one.

Processes only, no container: every replica gets a config of its own (the given one with its port, and with its own
KV-event ports where ``server.kv_events`` is set) under the run directory, beside its log. A replica that exits is
started again. Stopping (SIGINT, SIGTERM) stops the router, then drains the replicas (SIGTERM: their streams
finish)."""
from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

ROUTERS = ("sglang", "vllm")
# Each router's policies: cache_aware routes by the request text's longest prefix among what each replica was sent;
# vllm-router's consistent_hash by a session key (the X-Session-ID header or the body's `user`), exact for
# conversations that send one.
POLICIES = {"sglang": ("cache_aware", "round_robin", "random", "power_of_two"),
            "vllm": ("cache_aware", "consistent_hash", "sticky_least_loaded", "round_robin", "random", "power_of_two")}
PIP_NAMES = {"sglang": "sglang-router", "vllm": "vllm-router"}


class ClusterError(RuntimeError):
    """The cluster cannot start (a missing router binary, a replica that died or never got ready)."""


def core_groups(cores: list[int], replicas: int) -> list[list[int]]:
    """The host's cores split into ``replicas`` contiguous groups, the first ones a core larger where they do not
    divide; with fewer cores than replicas each replica gets one core, shared in turn."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    cores = sorted(cores)
    if len(cores) < replicas:
        return [[cores[i % len(cores)]] for i in range(replicas)]
    base, extra = divmod(len(cores), replicas)
    out, start = [], 0
    for i in range(replicas):
        n = base + (1 if i < extra else 0)
        out.append(cores[start:start + n])
        start += n
    return out


def _shift_port(endpoint: str, by: int) -> str:
    """A ZMQ endpoint's port moved by ``by`` (tcp://*:5557 -> tcp://*:5558); a wildcard port stays."""
    m = re.fullmatch(r"(.*:)(\d+)", endpoint)
    return f"{m.group(1)}{int(m.group(2)) + by}" if m else endpoint


def replica_config(raw: dict, port: int, index: int) -> dict:
    """Replica ``index``'s config: the cluster's with its own port, and KV-event endpoints one port further per
    replica (the router or indexer subscribes to each)."""
    cfg = copy.deepcopy(raw)
    server = cfg.setdefault("server", {}) or {}
    cfg["server"] = server
    server["port"] = port
    events = server.get("kv_events")
    if isinstance(events, dict):
        for key, default in (("endpoint", "tcp://*:5557"), ("replay_endpoint", None)):
            value = events.get(key, default)
            if value:
                events[key] = _shift_port(value, index)
    return cfg


def router_command(router: str, binary: str, host: str, port: int, urls: list[str], policy: str,
                   metrics_port: int = 29000) -> list[str]:
    """The router's command line: ``urls`` behind ``host:port``; health checks every second, a replica out after
    two failures and back in after one success; a request that reached no replica retried up to 4 times over about
    3 s, long enough for the health check to take a dead one out."""
    cmd = [binary] + (["launch"] if router == "sglang" else [])
    cmd += ["--host", host, "--port", str(port), "--worker-urls", *urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--health-check-endpoint", "/health", "--health-check-interval-secs", "1",
            "--health-failure-threshold", "2", "--health-success-threshold", "1",
            "--disable-circuit-breaker",  # sglang-router's never let a restarted replica back in
            "--retry-max-retries", "4", "--retry-initial-backoff-ms", "200", "--retry-max-backoff-ms", "1600",
            "--request-timeout-secs", "600", "--log-level", "info"]
    return cmd


def find_router(router: str) -> str:
    """The router's executable: beside this Python (the project's venv), else on PATH."""
    name = f"{router}-router"
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if found is None:
        raise ClusterError(f"{name} is not installed: pip install {PIP_NAMES[router]} (or pip install "
                           "'specserve[cluster]'; `make cluster` does)")
    return found


@dataclass
class Replica:
    index: int
    port: int
    cores: list[int]
    config: Path
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.log.with_suffix(".pid")


@dataclass
class Cluster:
    """The replicas and the router of one run; ``start`` brings all up, ``stop`` takes all down."""
    config: dict
    replicas: int
    router: str = "sglang"
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 8000
    base_port: int | None = None  # the first replica's port (default: port + 1)
    run_dir: Path = Path("cluster-run")
    drain_timeout: float = 30.0
    cores: list[int] | None = None  # the cores to split (default: those this process may run on)
    router_metrics_port: int = 29000  # the router's own Prometheus metrics (both routers' default port)
    members: list[Replica] = field(default_factory=list)
    router_proc: subprocess.Popen | None = None

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.policy not in POLICIES[self.router]:
            raise ValueError(f"{self.router}-router's policy must be one of {', '.join(POLICIES[self.router])}, "
                             f"got {self.policy!r}")
        self.run_dir = Path(self.run_dir)
        cores = self.cores if self.cores is not None else sorted(os.sched_getaffinity(0))
        first = self.base_port if self.base_port is not None else self.port + 1
        for i, group in enumerate(core_groups(cores, self.replicas)):
            self.members.append(Replica(i, first + i, group, self.run_dir / f"replica-{i}.yaml",
                                        self.run_dir / f"replica-{i}.log"))

    @property
    def url(self) -> str:
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"

    def start(self, timeout: float = 600.0, log=print) -> "Cluster":
        binary = find_router(self.router)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            for r in self.members:
                self.start_replica(r)
                log(f"replica {r.index}: {r.url} on cores {','.join(map(str, r.cores))} (pid {r.proc.pid}, log "
                    f"{r.log})")
            deadline = time.monotonic() + timeout
            for r in self.members:
                self._wait(r.url, deadline, r.proc, f"replica {r.index}", r.log)
            urls = [r.url for r in self.members]
            router_log = self.run_dir / "router.log"
            with open(router_log, "w") as out:  # the router holds its own copy of the file
                self.router_proc = subprocess.Popen(
                    router_command(self.router, binary, self.host, self.port, urls, self.policy,
                                   self.router_metrics_port),
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self._wait(self.url, deadline, self.router_proc, f"{self.router}-router", router_log)
            log(f"{self.router}-router ({self.policy}): {self.url} -> {', '.join(urls)} (log {router_log})")
        except BaseException:
            self.stop()
            raise
        return self

    def start_replica(self, r: Replica) -> None:
        """Start (or restart) replica ``r``: its config written, the process pinned to its cores with as many
        compute threads."""
        r.config.write_text(yaml.safe_dump(replica_config(self.config, r.port, r.index), sort_keys=False))
        threads = str(len(r.cores))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPECSERVE_WORKER_THREADS": threads, "OMP_NUM_THREADS": threads}
        cores = set(r.cores)
        with open(r.log, "a") as out:  # the replica holds its own copy: none left open here per restart
            r.proc = subprocess.Popen(
                [sys.executable, "-m", "specserve", "serve", "--config", str(r.config), "--host", "127.0.0.1",
                 "--port", str(r.port), "--drain-timeout", str(self.drain_timeout)],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=lambda: os.sched_setaffinity(0, cores))  # the worker it starts inherits the cores
        r.pid_file.write_text(f"{r.proc.pid}\n")  # its process group: the API process and its worker

    @staticmethod
    def _wait(url: str, deadline: float, proc: subprocess.Popen, what: str, log: Path) -> None:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClusterError(f"{what} exited with status {proc.returncode}:\n{_tail(log)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise ClusterError(f"{what} not ready at {url}/health in time:\n{_tail(log)}")

    def stop(self) -> None:
        """The router first (no new requests), then every replica drained (SIGTERM), killed past the timeout."""
        terminate(self.router_proc, 10)
        for r in self.members:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in self.members:
            terminate(r.proc, self.drain_timeout + 10)

    def serve_forever(self, restart_after: float = 2.0) -> int:
        """Block until SIGINT / SIGTERM, then stop all. A replica that exits is started again (the router's health
        checks take it out meanwhile and back in once it answers); the router exiting ends the cluster."""
        stopping = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopping.append(1))
        down: dict[int, float] = {}  # replica index -> when it was seen exited
        try:
            while not stopping:
                if self.router_proc.poll() is not None:
                    print(f"specserve cluster: {self.router}-router exited with status {self.router_proc.returncode}"
                          f"; stopping (log {self.run_dir / 'router.log'})", file=sys.stderr)
                    return 1
                for r in self.members:
                    if r.proc.poll() is None:
                        continue
                    if r.index not in down:
                        down[r.index] = time.monotonic()
                        print(f"specserve cluster: replica {r.index} exited with status {r.proc.returncode}; "
                              f"starting it again (log {r.log})", file=sys.stderr)
                    elif time.monotonic() - down[r.index] >= restart_after:
                        del down[r.index]
                        self.start_replica(r)
                time.sleep(0.2)
            return 0
        finally:
            self.stop()


def terminate(proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM to a running process, SIGKILL past ``timeout`` seconds; returns once it has exited."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text()[-chars:]
    except OSError:
        return ""


def load_raw_config(path: str | None) -> dict:
    """The cluster's config as YAML data (validated as a server config), the defaults where no file is given."""
    from server.config import config_from_dict

    raw = {}
    if path is not None:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    config_from_dict(copy.deepcopy(raw))  # a bad config fails here, once, not in every replica
    return raw
