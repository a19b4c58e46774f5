"""The test bed's fault proxy against a real echo server on 127.0.0.1: it forwards, holds bytes
in a partition and delivers them on heal, cuts connections, refuses new ones, delays."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from sidecar.testbed.fault_proxy import FaultProxy


async def _echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while data := await r.read(4096):
        w.write(data)
        await w.drain()
    w.close()


@pytest.fixture
async def proxy() -> AsyncIterator[FaultProxy]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    p = await FaultProxy("127.0.0.1", server.sockets[0].getsockname()[1]).start()
    yield p
    for w in CLIENTS:
        w.close()
        with contextlib.suppress(ConnectionError):
            await w.wait_closed()
    CLIENTS.clear()
    await p.close()
    server.close()
    await server.wait_closed()


CLIENTS: list[asyncio.StreamWriter] = []


async def _client(p: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", p.port)
    CLIENTS.append(w)
    return r, w


async def test_fault_proxy_forwards_both_ways(proxy: FaultProxy) -> None:
    r, w = await _client(proxy)
    w.write(b"hello")
    async with asyncio.timeout(5):
        assert await r.readexactly(5) == b"hello"
    w.close()


async def test_fault_proxy_blackhole_holds_bytes_until_heal(proxy: FaultProxy) -> None:
    r, w = await _client(proxy)
    w.write(b"a")
    async with asyncio.timeout(5):
        assert await r.readexactly(1) == b"a"
    proxy.blackhole()
    w.write(b"held")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):  # nothing may arrive while partitioned
            await r.readexactly(4)
    proxy.heal()
    async with asyncio.timeout(5):
        assert await r.readexactly(4) == b"held"


async def test_fault_proxy_cut_closes_open_connections(proxy: FaultProxy) -> None:
    r, w = await _client(proxy)
    w.write(b"x")
    async with asyncio.timeout(5):
        await r.readexactly(1)
    proxy.cut()
    async with asyncio.timeout(5):
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await r.readexactly(1)
    r2, w2 = await _client(proxy)  # new connections work again
    w2.write(b"y")
    async with asyncio.timeout(5):
        assert await r2.readexactly(1) == b"y"


async def test_fault_proxy_refuse_closes_new_connections(proxy: FaultProxy) -> None:
    proxy.refuse()
    r, w = await _client(proxy)
    w.write(b"z")
    async with asyncio.timeout(5):
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await r.readexactly(1)


async def test_fault_proxy_latency_delays_every_chunk(proxy: FaultProxy) -> None:
    proxy.latency(0.2)
    r, w = await _client(proxy)
    t0 = time.monotonic()
    w.write(b"slow")
    async with asyncio.timeout(5):
        await r.readexactly(4)
    assert time.monotonic() - t0 >= 0.4  # both directions waited (a lower bound, not speed)
