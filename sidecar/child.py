"""Child processes of the demo and the replay: stdout lines as a queue, stdin commands, and the
launchers for a KVCM-compatible server and a sidecar.

Imports: stdlib, aiohttp. Lines that parse as JSON objects arrive as dicts, others as text; a
line with `"stats": true` only updates `last` (progress displays read it). Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import aiohttp

PY = sys.executable


class ChildExited(EOFError):
    """A child process ended before printing what it was expected to."""


@dataclass
class Proc:
    name: str
    p: asyncio.subprocess.Process
    lines: asyncio.Queue[dict[str, Any] | str] = field(default_factory=asyncio.Queue)
    last: dict[str, Any] = field(default_factory=dict)
    new_stats: asyncio.Event = field(default_factory=asyncio.Event)  # set at each `last` update
    eof: asyncio.Event = field(default_factory=asyncio.Event)  # its stdout closed (it exited)

    async def pump(self) -> None:
        assert self.p.stdout is not None
        try:
            await self._pump(self.p.stdout)
        finally:
            self.eof.set()

    async def _pump(self, stdout: asyncio.StreamReader) -> None:
        async for raw in stdout:
            text = raw.decode(errors="replace").strip()
            try:
                obj = json.loads(text)
            except ValueError:
                obj = text
            if isinstance(obj, dict) and obj.get("stats"):
                self.last = obj
                self.new_stats.set()
            else:
                await self.lines.put(obj)

    async def expect(self, pred: Any, within_s: float = 30.0) -> Any:
        """The first line matching `pred`; raises ChildExited at once if the child ends first
        (with the lines it printed meanwhile), TimeoutError after `within_s`."""
        skipped: collections.deque[Any] = collections.deque(maxlen=12)
        async with asyncio.timeout(within_s):
            while True:
                if self.lines.empty() and self.eof.is_set():
                    rc = await self.p.wait()
                    raise ChildExited(
                        f"{self.name} exited (rc={rc}) before the line expected of it;"
                        f" its last lines: {list(skipped)}"
                    )
                get = asyncio.ensure_future(self.lines.get())
                ended = asyncio.ensure_future(self.eof.wait())
                await asyncio.wait({get, ended}, return_when=asyncio.FIRST_COMPLETED)
                ended.cancel()
                if not get.done():
                    get.cancel()
                    continue
                item = get.result()
                if pred(item):
                    return item
                skipped.append(item)

    async def send(self, text: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write((text + "\n").encode())
        await self.p.stdin.drain()

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.p.returncode is None:
            self.p.send_signal(sig)
        return await asyncio.wait_for(self.p.wait(), 15)


async def spawn(
    name: str, *argv: str, env: dict[str, str] | None = None, tasks: list[asyncio.Task[None]]
) -> Proc:
    p = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        limit=64 * 1024 * 1024,  # the engine's final line lists every published key
    )
    proc = Proc(name, p)
    tasks.append(asyncio.create_task(proc.pump()))  # cancelled in run()'s finally
    return proc


async def start_kvcm_server(tasks: list[asyncio.Task[None]], *extra: str) -> tuple[Proc, str]:
    """`kvcm-sidecar kvcm-server` on a free port, bootstrapped; returns it and its base URL."""
    server = await spawn(
        "kvcm",
        PY,
        "-m",
        "sidecar.cli",
        "kvcm-server",
        "--meta-port",
        "0",
        "--bootstrap",
        "--snapshot-min-interval-ms",
        "1000",
        *extra,
        tasks=tasks,
    )
    line = await server.expect(lambda x: isinstance(x, str) and "listening on" in x)
    return server, str(line.rsplit(" ", 1)[1])


async def start_sidecar(
    tasks: list[asyncio.Task[None]],
    *,
    endpoint: str,
    instance_id: str,
    dp_rank: int,
    host: str,
    ring: str,
    env: dict[str, str] | None = None,
) -> tuple[Proc, int]:
    """`kvcm-sidecar run` for one rank's ring; returns it and its bound metrics port."""
    full = {
        **os.environ,
        "KV_CACHE_EVENT_MANAGER_ENDPOINT": endpoint,
        "KV_CACHE_EVENT_INSTANCE_ID": instance_id,
        "KV_CACHE_EVENT_DP_RANK": str(dp_rank),
        "KV_CACHE_EVENT_HOST_IP_PORT": host,
        "KV_CACHE_EVENT_RING_NAME": ring,
        "KV_CACHE_EVENT_METRICS_ADDR": "127.0.0.1:0",
        "KV_CACHE_EVENT_LOG_FORMAT": "json",
        **(env or {}),
    }
    proc = await spawn(f"sidecar{dp_rank}", PY, "-m", "sidecar.cli", "run", env=full, tasks=tasks)
    line = await proc.expect(
        lambda x: isinstance(x, dict) and "http listening" in str(x.get("msg", ""))
    )
    return proc, int(line["msg"].rsplit(":", 1)[1])


async def await_ready(s: aiohttp.ClientSession, metrics_port: int, within_s: float = 30) -> None:
    """Bounded wait until a sidecar answers /readyz 200 (registered, synced); TimeoutError."""
    async with asyncio.timeout(within_s):
        while True:
            try:
                async with s.get(f"http://127.0.0.1:{metrics_port}/readyz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)  # polling another process, bounded by the timeout
