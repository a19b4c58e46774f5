"""Drive sidecar/testbed/ring_engine.py as a real child process with line-based handshakes.

Imports: stdlib. No sleeps: every wait is on a line the engine prints, with a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from queue import Empty, Queue
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent  # the source tree (tests, docs, deploy)


class EngineProc:
    def __init__(self, mode: str, args: dict[str, Any]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "sidecar.testbed.ring_engine", mode, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            text=True,
        )
        self._lines: Queue[str] = Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self._lines.put(line)
        self._lines.put("")

    def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except Empty:
            raise TimeoutError("engine process said nothing") from None
        if not line:
            raise EOFError(f"engine process exited rc={self.p.wait()}")
        out: dict[str, Any] = json.loads(line)
        return out

    def send(self, text: str = "go") -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def kill(self) -> None:
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=10)

    def wait(self, timeout: float = 30.0) -> int:
        return self.p.wait(timeout=timeout)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=10)
        for f in (self.p.stdin, self.p.stdout):
            if f is not None:
                f.close()


class Lines:
    """A child's stdout, line by line, collected by a thread: `log` keeps them all, `wait()`
    takes them in order until one holds the needle (a timeout or the child's exit raises)."""

    def __init__(self, p: subprocess.Popen[str], who: str = "child") -> None:
        self.p = p
        self.who = who
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
                tail = "".join(self.log[-10:])
                raise TimeoutError(f"{self.who} never printed {needle!r}: {tail}") from None
            if not line:
                tail = "".join(self.log[-20:])
                raise EOFError(f"{self.who} exited rc={self.p.wait()}: {tail}")
            if needle in line:
                return line
