"""A TCP proxy on loopback that misbehaves on demand: one per link of the test bed.

Imports: stdlib (asyncio). It listens on 127.0.0.1 (port 0 by default) and forwards every
connection to one upstream address. Faults, each until `heal()`:
  latency(s)    every chunk waits `s` before it is forwarded, both ways
  throttle(bps) at most `bps` bytes per second per direction and connection
  blackhole()   a partition: connections are accepted and held, nothing is forwarded either way
                (bytes stay in the kernel's buffers, as behind a dead route); heal resumes them
  cut()         every open connection is closed at once (both sides see a reset or EOF)
  refuse()      new connections are closed as soon as they are accepted
It speaks no protocol: HTTP (sidecar <-> KVCM) and ZMTP (publisher <-> sidecar) pass alike.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

CHUNK = 64 * 1024


@dataclass
class Faults:
    latency_s: float = 0.0
    rate_bps: float = 0.0  # 0: unthrottled
    blackhole: bool = False
    refuse: bool = False


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, *, port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.want_port = port
        self.port = 0
        self.faults = Faults()
        self.flowing = asyncio.Event()  # set while not blackholed
        self.flowing.set()
        self.connections = 0  # accepted so far
        self.cuts = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.want_port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._server is not None:
            await self._server.wait_closed()

    # ---- faults ------------------------------------------------------------------------
    def latency(self, seconds: float) -> None:
        self.faults.latency_s = seconds

    def throttle(self, bytes_per_s: float) -> None:
        self.faults.rate_bps = bytes_per_s

    def blackhole(self) -> None:
        self.faults.blackhole = True
        self.flowing.clear()

    def refuse(self) -> None:
        self.faults.refuse = True

    def cut(self) -> None:
        """Close every open connection (new ones are accepted as usual)."""
        self.cuts += 1
        for w in list(self._writers):
            with contextlib.suppress(OSError, RuntimeError):
                w.transport.abort()
                w.close()
        self._writers.clear()

    def heal(self) -> None:
        self.faults = Faults()
        self.flowing.set()

    # ---- forwarding --------------------------------------------------------------------
    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.faults.refuse:
            w.transport.abort()
            w.close()
            return
        try:
            ur, uw = await asyncio.open_connection(*self.upstream)
        except OSError:
            w.transport.abort()  # upstream down: the client sees the connection fail
            w.close()
            return
        self._writers.update((w, uw))
        up = asyncio.create_task(self._pump(r, uw))
        down = asyncio.create_task(self._pump(ur, w))
        self._tasks.update((up, down))
        try:
            await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (up, down):
                t.cancel()
            for x in (w, uw):
                self._writers.discard(x)
                with contextlib.suppress(OSError, RuntimeError):
                    x.transport.abort()
                    x.close()
            self._tasks.difference_update((up, down))

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await self.flowing.wait()  # a partition holds the bytes where they are
            data = await r.read(CHUNK)
            if not data:
                return
            f = self.faults
            if f.latency_s:
                await asyncio.sleep(f.latency_s)
            if f.rate_bps:
                await asyncio.sleep(len(data) / f.rate_bps)
            await self.flowing.wait()
            try:
                w.write(data)
                await w.drain()
            except (ConnectionError, RuntimeError):
                return
