"""End-to-end harness: real engine process, real `kvcm-sidecar run` process, the project's
KVCM-compatible server on 127.0.0.1:0 in the test's event loop (so tests can inject faults).

Oracle: KVCM's visible keys for the reporter == the engine's published set.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from sidecar.kvcm_server.app import KvcmServer
from sidecar.shm_ring.segment import unlink
from sidecar.testbed.proc import ROOT, EngineProc, Lines

SIDECAR_SETTINGS = {
    "report.heartbeat_interval_s": "0.2",
    "report.flush_window_s": "0.01",
    "report.backoff_base_s": "0.05",
    "report.backoff_cap_s": "0.5",
    "report.circuit_retry_s": "1",
    "engine.watch_interval_s": "0.05",
    "engine.stale_after_s": "3",
    "manager.request_timeout_s": "0.5",
    "manager.snapshot_timeout_s": "10",
    "shutdown.grace_s": "5",
    "shutdown.host_down_budget_s": "0.5",
    "ring.idle_poll_interval_s": "0.005",
}


class SidecarProc:
    """`kvcm-sidecar run` as a child process; its JSON log lines are collected."""

    def __init__(self, env: dict[str, str], settings: dict[str, str]) -> None:
        argv = [sys.executable, "-m", "sidecar.cli", "run"]
        for k, v in settings.items():
            argv += ["--set", f"{k}={v}"]
        self.p = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.out = Lines(self.p, "sidecar")
        self.log = self.out.log

    def wait_line(self, needle: str, timeout: float = 20) -> str:
        return self.out.wait(needle, timeout)

    def terminate(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        if self.p.stdout is not None:
            self.p.stdout.close()


class Harness:
    def __init__(
        self,
        tmp: Path,
        *,
        capacity: int = 4096,
        event_report: dict[str, int] | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.tmp = tmp
        self.ring = f"/kvcm-e2e-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.instance_id = f"e2e-{uuid.uuid4().hex[:6]}"
        self.host = f"127.0.0.1:{20000 + os.getpid() % 20000}"
        self.capacity = capacity
        self.event_report = {"snapshot_min_interval_ms": 1000, **(event_report or {})}
        self.settings = {**SIDECAR_SETTINGS, **(settings or {})}
        self.server = KvcmServer(
            bootstrap=True, event_report=self.event_report, state_file=tmp / "kvcm.json"
        )
        self.runner: web.AppRunner | None = None
        self.listener: asyncio.Server | None = None
        self.handlers: list[web.RequestHandler] = []
        self.port = 0
        self.session: aiohttp.ClientSession | None = None
        self.engine: EngineProc | None = None
        self.sidecar: SidecarProc | None = None
        self.published: set[int] = set()
        self.seed = 1
        # "cache": the reference BlockCache answers snapshots with its provider; "plain": the
        # README's attach() + stored()/removed() engine, answered from the hook's resident set.
        self.engine_mode = "cache"

    # ---- KVCM server ------------------------------------------------------------------------
    async def start_server(self) -> None:
        self.runner = web.AppRunner(self.server.app())
        await self.runner.setup()
        # The listener is ours, not a TCPSite's: stop_server must stop it accepting before it
        # closes (see _close_listener), and the handlers it records let the stop check that
        # none outlived it.
        web_server = self.runner.server
        assert web_server is not None
        handlers = self.handlers

        def accept() -> web.RequestHandler:
            handler = web_server()
            handlers.append(handler)
            return handler

        loop = asyncio.get_running_loop()
        self.listener = await loop.create_server(accept, "127.0.0.1", self.port)
        self.port = self.listener.sockets[0].getsockname()[1]
        if self.session is None:
            self.session = aiohttp.ClientSession()

    async def stop_server(self) -> None:
        if self.runner is not None:
            self.server.faults.rules.clear()
            # A handler still inside a delay fault would be cut off by the shutdown and leave
            # its transport to the GC (an unraisable ResourceWarning in a later test).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await self.server.faults.settled.wait()
            await self._close_listener()
            await self.runner.cleanup()
            left = [h for h in self.handlers if h.transport is not None]
            assert not left, f"{len(left)} server connections outlived the shutdown"
            self.handlers.clear()
            self.runner = None

    async def _close_listener(self) -> None:
        """Stop accepting, let the accepts already made finish, then close. Python 3.11 loses
        a connection accepted in the turn before Server.close(): its transport fails to attach
        to the closed server and its socket is left open for the GC (the peer hangs; CI failed
        on the unraisable ResourceWarning). An accept's transport is made one turn after the
        accept and meets its protocol one turn later, so three turns after the last accept
        every connection is registered with aiohttp, whose cleanup() then closes it."""
        assert self.listener is not None
        loop = asyncio.get_running_loop()
        for sock in self.listener.sockets:
            loop.remove_reader(sock.fileno())
        for _ in range(3):
            await asyncio.sleep(0)
        self.listener.close()

    async def restart_server(self) -> None:
        """A KVCM restart: instances and blocks persist (state file); reporters do not."""
        await self.stop_server()
        self.server = KvcmServer(
            bootstrap=True, event_report=self.event_report, state_file=self.tmp / "kvcm.json"
        )
        await self.start_server()

    async def debug(self) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.get(f"http://127.0.0.1:{self.port}/debug/reporters") as r:
            data: dict[str, Any] = await r.json()
            return data

    async def reporter(self) -> dict[str, Any] | None:
        for r in (await self.debug())["reporters"]:
            if r["host_ip_port"] == self.host and r["instance_id"] == self.instance_id:
                return dict(r)
        return None

    async def visible(self) -> set[int]:
        r = await self.reporter()
        return {int(k) for k in r["visible_keys"]} if r else set()

    async def faults(self, **body: Any) -> None:
        assert self.session is not None
        data = io.BytesIO(json.dumps(body).encode())  # streamed: fault bodies may be large
        url = f"http://127.0.0.1:{self.port}/debug/faults"
        async with self.session.post(url, data=data) as r:
            assert r.status == 200

    # ---- engine -----------------------------------------------------------------------------
    def start_engine(self, blocks: int = 256) -> dict[str, Any]:
        if self.engine is not None:
            self.engine.close()
        self.engine = EngineProc(
            self.engine_mode,
            {
                "ring": self.ring,
                "instance_id": self.instance_id,
                "capacity": self.capacity,
                "seed": self.seed,
                "blocks": blocks,
            },
        )
        self.seed += 1
        return self.engine.recv()

    def engine_cmd(self, **cmd: Any) -> dict[str, Any]:
        assert self.engine is not None
        self.engine.send(json.dumps(cmd))
        out = self.engine.recv(timeout=60)
        self.published = set(out["published"])
        return out

    # ---- sidecar ----------------------------------------------------------------------------
    def sidecar_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CACHE_EVENT_")}
        lock_dir = os.environ.get("KV_CACHE_EVENT_IDENTITY_LOCK_DIR")  # tests/conftest.py
        if lock_dir:
            env["KV_CACHE_EVENT_IDENTITY_LOCK_DIR"] = lock_dir
        env.update(
            {
                "KV_CACHE_EVENT_MANAGER_ENDPOINT": f"http://127.0.0.1:{self.port}",
                "KV_CACHE_EVENT_INSTANCE_ID": self.instance_id,
                "KV_CACHE_EVENT_HOST_IP_PORT": self.host,
                "KV_CACHE_EVENT_RING_NAME": self.ring,
                "KV_CACHE_EVENT_METRICS_ADDR": "127.0.0.1:0",
                "KV_CACHE_EVENT_LOG_FORMAT": "json",
            }
        )
        return env

    def start_sidecar(self, **settings: str) -> SidecarProc:
        if self.sidecar is not None:
            self.sidecar.close()
        self.sidecar = SidecarProc(self.sidecar_env(), {**self.settings, **settings})
        line = self.sidecar.wait_line("http listening")
        self.metrics_port = int(json.loads(line)["msg"].rsplit(":", 1)[1])
        return self.sidecar

    async def metrics(self) -> str:
        assert self.session is not None
        async with self.session.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            return await r.text()

    async def status(self) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.get(f"http://127.0.0.1:{self.metrics_port}/status") as r:
            data: dict[str, Any] = await r.json()
            return data

    # ---- the oracle -------------------------------------------------------------------------
    async def start_converged(self, work: int) -> SidecarProc:
        """Engine and sidecar up, `work` engine requests served, KVCM caught up."""
        self.start_engine()
        side = self.start_sidecar()
        self.engine_cmd(op="work", n=work)
        await self.converge()
        return side

    async def converge(self, within_s: float = 20.0) -> None:
        """Wait (bounded) until KVCM shows exactly the engine's published set."""
        deadline = time.monotonic() + within_s
        seen: set[int] = set()
        while True:
            seen = await self.visible()
            if seen == self.published:
                return
            if time.monotonic() > deadline:
                missing = len(self.published - seen)
                extra = len(seen - self.published)
                tail = "".join(self.sidecar.log[-15:]) if self.sidecar else ""
                raise AssertionError(f"no convergence: missing={missing} extra={extra}\n{tail}")
            await asyncio.sleep(0.02)  # polling another process's state, bounded by deadline

    async def reporter_until(self, pred: Any, within_s: float = 10.0) -> dict[str, Any]:
        """Wait (bounded) until the reporter's debug view satisfies `pred`."""
        deadline = time.monotonic() + within_s
        while True:
            r = await self.reporter()
            if r is not None and pred(r):
                return r
            assert time.monotonic() < deadline, f"reporter never matched: {r}"
            await asyncio.sleep(0.02)  # polling another process's state, bounded by deadline

    async def close(self) -> None:
        for proc in (self.sidecar, self.engine):
            if proc is not None:
                proc.close()
        await self.stop_server()
        if self.session is not None:
            await self.session.close()
        unlink(self.ring)
