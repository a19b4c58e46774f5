"""A KVCM cluster on this machine, for tests and bench.failover: a real redis-server on
127.0.0.1 (temp dir, free port), `kvcm-sidecar kvcm-server --meta-storage` nodes and ranks (a
plain-hook ring engine + a `kvcm-sidecar run`) as real processes (SIGKILL, SIGSTOP work).

Imports: stdlib, sidecar.shm_ring, sidecar.testbed.proc. Every wait is on a line a process
printed or on a polled condition with a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.shm_ring.segment import unlink
from sidecar.testbed.ports import free_port
from sidecar.testbed.proc import ROOT, EngineProc, Lines

REDIS = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
)


class RedisProc:
    def __init__(self, tmp: Path) -> None:
        assert REDIS is not None
        for _ in range(5):
            self.port = free_port()
            self.p = subprocess.Popen(
                [
                    REDIS,
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--dir",
                    str(tmp),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                    "--logfile",
                    "",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            self.lines = Lines(self.p)
            try:
                self.lines.wait("Ready to accept connections", timeout=10)
                return
            except EOFError:  # the port was taken meanwhile: another one
                continue
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)
        if self.p.stdout is not None:
            self.p.stdout.close()


def post(base: str, route: str, body: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    req = urllib.request.Request(  # noqa: S310 - an http URL built for a node on 127.0.0.1
        f"{base}/api/{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - as above
        out: dict[str, Any] = json.loads(resp.read())
        return out


def get(base: str, path: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}{path}", timeout=timeout) as resp:  # noqa: S310 - loopback
        out: dict[str, Any] = json.loads(resp.read())
        return out


class Node:
    """One `kvcm-server --meta-storage` process."""

    def __init__(self, redis_url: str, node_id: str, lease_ms: int, *extra: str) -> None:
        self.node_id = node_id
        self.port = 0
        self.argv = [
            sys.executable,
            "-m",
            "sidecar.cli",
            "kvcm-server",
            "--meta-port",
            "0",
            "--bootstrap",
            "--meta-storage",
            redis_url,
            "--node-id",
            node_id,
            "--lease-ms",
            str(lease_ms),
            *extra,
        ]
        self.start()

    def start(self) -> None:
        argv = list(self.argv)
        if self.port:  # a restart keeps its port, so seeds stay valid
            argv[argv.index("--meta-port") + 1] = str(self.port)
        self.p = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines = Lines(self.p)
        line = self.lines.wait("kvcm-server meta listening on")
        self.port = int(line.rsplit(":", 1)[1])

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cluster(self) -> dict[str, Any]:
        return get(self.base, "/debug/cluster")

    def reporters(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = get(self.base, "/debug/reporters")["reporters"]
        return out

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)

    def terminate(self) -> int:
        """SIGTERM: a graceful stop (blocks saved, lease released); the exit code."""
        self.p.send_signal(signal.SIGTERM)
        try:
            rc = self.p.wait(timeout=20)
        except subprocess.TimeoutExpired:  # say where it was, not only that it hung
            tail = "".join(self.lines.log[-20:])
            node = self.argv[self.argv.index("--node-id") + 1]
            raise AssertionError(f"{node} still running 20 s after SIGTERM: {tail}") from None
        if self.p.stdout is not None:
            self.p.stdout.close()
        return rc

    def stop(self) -> None:
        os.kill(self.p.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.p.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
            self.p.kill()
        self.p.wait(timeout=10)
        if self.p.stdout is not None:
            self.p.stdout.close()


def leader_of(nodes: list[Node], within_s: float = 10.0) -> Node:
    """The node that says it leads, once exactly one does (bounded poll)."""
    deadline = time.monotonic() + within_s
    while True:
        leading = []
        for n in nodes:
            if n.p.poll() is not None:
                continue
            try:
                if n.cluster()["is_leader"]:
                    leading.append(n)
            except (urllib.error.URLError, OSError):
                continue
        if len(leading) == 1:
            return leading[0]
        assert time.monotonic() < deadline, f"no single leader: {[n.node_id for n in leading]}"
        time.sleep(0.02)  # polling other processes, bounded by the deadline


class Rank:
    """One engine (the README's plain hook: stored/removed) and its sidecar."""

    def __init__(self, seeds: str, settings: dict[str, str], seed: int) -> None:
        self.ring = f"/kvcm-cl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.instance_id = f"cl-{uuid.uuid4().hex[:6]}"
        self.host = f"127.0.0.1:{30000 + seed}"
        self.engine = EngineProc(
            "plain",
            {"ring": self.ring, "instance_id": self.instance_id, "capacity": 8192, "seed": seed},
        )
        self.engine.recv()
        self.published: set[int] = set()
        self.lock = threading.Lock()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CACHE_EVENT_")}
        env.update(
            {
                "KV_CACHE_EVENT_IDENTITY_LOCK_DIR": os.environ["KV_CACHE_EVENT_IDENTITY_LOCK_DIR"],
                "KV_CACHE_EVENT_MANAGER_ENDPOINT": seeds,
                "KV_CACHE_EVENT_INSTANCE_ID": self.instance_id,
                "KV_CACHE_EVENT_HOST_IP_PORT": self.host,
                "KV_CACHE_EVENT_RING_NAME": self.ring,
                "KV_CACHE_EVENT_METRICS_ADDR": "127.0.0.1:0",
                "KV_CACHE_EVENT_LOG_FORMAT": "json",
            }
        )
        argv = [sys.executable, "-m", "sidecar.cli", "run"]
        for k, v in settings.items():
            argv += ["--set", f"{k}={v}"]
        self.sidecar = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.sidecar_lines = Lines(self.sidecar)
        line = self.sidecar_lines.wait("http listening")
        self.metrics_port = int(json.loads(line)["msg"].rsplit(":", 1)[1])

    def work(self, n: int) -> None:
        with self.lock:
            self.engine.send(json.dumps({"op": "work", "n": n}))
            self.published = set(self.engine.recv(timeout=60)["published"])

    def status(self) -> dict[str, Any]:
        return get(f"http://127.0.0.1:{self.metrics_port}", "/status")

    def metric(self, name: str, label: str = "") -> float:
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and label in line
        )

    def close(self) -> None:
        if self.sidecar.poll() is None:
            self.sidecar.kill()
        self.sidecar.wait(timeout=10)
        if self.sidecar.stdout is not None:
            self.sidecar.stdout.close()
        self.engine.close()
        unlink(self.ring)


def visible(nodes: list[Node], r: Rank) -> dict[str, set[int]]:
    """node id -> the reporter's visible keys there (unreachable nodes left out)."""
    out: dict[str, set[int]] = {}
    for n in nodes:
        if n.p.poll() is not None:
            continue
        try:
            reps = n.reporters()
        except (urllib.error.URLError, OSError):
            continue
        keys: set[int] = set()
        for rep in reps:
            if rep["instance_id"] == r.instance_id and rep["host_ip_port"] == r.host:
                keys = {int(k) for k in rep["visible_keys"]}
        out[n.node_id] = keys
    return out


def converged(nodes: list[Node], leader: Node, ranks: list[Rank]) -> bool:
    for r in ranks:
        view = visible(nodes, r)
        if view.get(leader.node_id) != r.published:
            return False
        if any(keys for node_id, keys in view.items() if node_id != leader.node_id):
            return False
    return True


def until(pred: Callable[[], bool], within_s: float, what: str) -> float:
    """Poll `pred` (other processes' state) until true; returns when (monotonic)."""
    deadline = time.monotonic() + within_s
    while not pred():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)  # polling other processes, bounded by the deadline
    return time.monotonic()


class Workload:
    """Engines store and remove on a thread until stopped (and after it, one last batch)."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks
        self.stop = threading.Event()
        self.batches = 0
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for r in self.ranks:
                r.work(15)
            self.batches += 1

    def join(self) -> None:
        self.stop.set()
        self.t.join(timeout=60)
