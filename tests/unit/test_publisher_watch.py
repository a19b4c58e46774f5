"""Engine watch: death needs consecutive bad checks; a stalled engine that recovers revives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import pytest

from sidecar import config as C
from sidecar.key_state import KeyState
from sidecar.kvcm_client.client import KvcmClient, Result
from sidecar.publisher import Publisher, State
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment
from sidecar.shm_ring.writer import RingWriter
from sidecar.source.base import Identity
from sidecar.source.ring import RingSource


def down(p: Publisher) -> bool:
    """Read through a call: mypy would keep an attribute narrowed across watch_step()."""
    return p.engine_down


def state(p: Publisher) -> State:
    return p.state  # a call, as down()


ENV = {
    "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://127.0.0.1:9",
    "KV_CACHE_EVENT_INSTANCE_ID": "i",
    "KV_CACHE_EVENT_HOST_IP_PORT": "h:1",
    "KV_CACHE_EVENT_ENGINE_STALE_AFTER_S": "1",
    "KV_CACHE_EVENT_ENGINE_DEAD_AFTER_CHECKS": "2",
}


@pytest.fixture
async def engine(ring_name: str) -> AsyncIterator[tuple[RingWriter, Publisher]]:
    """A producer on the ring and a publisher watching it (its client is never used)."""
    writer = RingWriter(Segment(ring_name, 64))
    reader = RingReader(Segment(ring_name))
    async with aiohttp.ClientSession() as session:
        cfg = C.load(env=ENV)
        yield (
            writer,
            Publisher(
                cfg,
                KvcmClient(session, "http://127.0.0.1:9", 1024),
                RingSource(cfg, reader, KeyState()),
            ),
        )
    reader.close()
    writer.close()


async def test_watch_stale_engine_goes_down_then_revives_when_fresh(
    engine: tuple[RingWriter, Publisher],
) -> None:
    writer, p = engine
    p.registered = True
    writer.seg.hdr[L.W_LIVENESS_NS] = time.monotonic_ns() - 5 * 10**9  # a 5 s stall
    p.watch_step()
    assert not down(p)  # one bad check is not death
    p.watch_step()
    assert down(p) and p.state == State.ENGINE_DOWN and p.host_down_pending
    writer.stamp()  # the same engine is fresh again
    p.watch_step()
    assert not down(p) and p.need_snapshot and not p.registered


async def test_watch_clean_close_is_engine_down_at_once(
    ring_name: str, engine: tuple[RingWriter, Publisher]
) -> None:
    writer, p = engine
    writer.close()
    p.watch_step()
    assert down(p)
    p.watch_step()
    assert down(p)  # closed stays down until a new incarnation attaches
    RingWriter(Segment(ring_name))
    p.watch_step()
    assert not down(p)


async def test_a_request_ending_after_the_engine_went_down_keeps_engine_down(
    engine: tuple[RingWriter, Publisher],
) -> None:
    """A delta in flight (its answer held, read when the watch's signal pokes it) that ends
    after the engine was found down must not show the reporter READY again: ENGINE_DOWN
    stands until the engine is back (HOST_DOWN has hidden its keys)."""
    writer, p = engine
    p.registered = True
    p.set_state(State.READY, "in sync")
    writer.close()
    p.watch_step()
    assert down(p) and p.state == State.ENGINE_DOWN
    for live in (State.READY, State.DEGRADED, State.RESYNCING, State.REGISTERING):
        p.set_state(live, "a request that was in flight ended")
        assert state(p) == State.ENGINE_DOWN
    p.set_state(State.STOPPED, "shut down")
    assert state(p) == State.STOPPED


class _Unanswered(KvcmClient):
    """A manager that takes the request and never answers (the answer held, or lost)."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        super().__init__(session, "http://127.0.0.1:9", 1024)
        self.entered = asyncio.Event()

    async def post(
        self, route: str, payload: bytes | memoryview, timeout_s: float, *, hold: bool = False
    ) -> Result:
        self.entered.set()
        await asyncio.Event().wait()  # until cancelled
        raise AssertionError("unreachable")


async def test_a_delta_cancelled_in_flight_puts_its_keys_back_in_front(ring_name: str) -> None:
    """Shutdown cancels the report loop while a delta is in flight (at engine pace its answer
    is held for most of each window): the taken keys are neither acked nor lost, they are dirty
    again, so the shutdown flush sends them."""
    writer = RingWriter(Segment(ring_name, 64))
    reader = RingReader(Segment(ring_name))
    try:
        async with aiohttp.ClientSession() as session:
            cfg = C.load(env=ENV)
            client = _Unanswered(session)
            p = Publisher(cfg, client, RingSource(cfg, reader, KeyState()))
            p.identity = Identity("i", 0, "m", "fp16", False, 1, 1, 1, 16, 4096, (0,), ("hbm",))
            p.registered = True
            keys = np.arange(1, 11, dtype=np.int64)
            p.keys.apply_bits(0, keys, np.ones(10, np.int64), np.zeros(10, np.int64))
            assert len(p.keys.dirty) == 10
            task = asyncio.create_task(p.send_deltas())
            await asyncio.wait_for(client.entered.wait(), 10)
            assert len(p.keys.dirty) == 0  # taken: in flight
            assert p.status()["in_flight"] == 10  # /status accounts for them meanwhile
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(p.keys.dirty) == 10 and len(p.keys.acked) == 0
            assert p.status()["in_flight"] == 0
            again = p.keys.take_batch(100)
            assert sorted(again.keys.tolist()) == keys.tolist()
    finally:
        reader.close()
        writer.close()
