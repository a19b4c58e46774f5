"""A KVCM cluster for tests: a real redis-server on 127.0.0.1 (temp dir, free port) and
`kvcm-sidecar kvcm-server --meta-storage` nodes as real processes (SIGKILL, SIGSTOP work).

Every wait is on a line a process printed or on a polled condition with a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from queue import Empty, Queue
from typing import Any

import pytest

from tests.proc import ROOT

REDIS = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
)
needs_redis = pytest.mark.skipif(
    REDIS is None, reason="redis-server is not installed (.ci/run installs Debian's)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Lines:
    """A child's stdout, line by line, collected by a thread."""

    def __init__(self, p: subprocess.Popen[str]) -> None:
        self.p = p
        self.q: Queue[str] = Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.log.append(line)
            self.q.put(line)
        self.q.put("")

    def wait(self, needle: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.q.get(timeout=max(deadline - time.monotonic(), 0.01))
            except Empty:
                raise TimeoutError(f"never printed {needle!r}: {''.join(self.log[-10:])}") from None
            if not line:
                raise EOFError(f"exited rc={self.p.wait()}: {''.join(self.log[-20:])}")
            if needle in line:
                return line


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
    req = urllib.request.Request(
        f"{base}/api/{route}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def get(base: str, path: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}{path}", timeout=timeout) as resp:
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
        rc = self.p.wait(timeout=20)
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
