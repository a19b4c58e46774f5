"""The daemon's send decision: a delta goes out when the flush window has passed since its oldest
change, or at once when flush_at_keys keys are waiting, whichever comes first.

The publisher is a stand-in here (what it sends is tested end to end elsewhere); the loop under
test is the real `Daemon._report_loop`. Windows are an hour long, so only the key threshold or
the injected clock can release a send while the test runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from sidecar import config as C
from sidecar.daemon import Daemon
from sidecar.publisher import State

ENV = {
    "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://127.0.0.1:9",
    "KV_CACHE_EVENT_INSTANCE_ID": "i",
    "KV_CACHE_EVENT_HOST_IP_PORT": "h:1",
}


class Keys:
    def __init__(self) -> None:
        self.dirty: list[int] = []
        self.dirty_since = 0.0


class Sender:
    """What `_report_loop` asks of the publisher: its state, its keys, and one send per step."""

    def __init__(self) -> None:
        self.state = State.READY
        self.keys = Keys()
        self.sent: asyncio.Queue[list[int]] = asyncio.Queue()

    async def data_step(self) -> bool:
        if not self.keys.dirty:
            return False
        batch, self.keys.dirty = self.keys.dirty, []
        await self.sent.put(batch)
        return True

    def next_wakeup_s(self) -> float:
        return 3600.0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(
    params=[
        {"report.flush_at_keys": "4"},
        # a threshold above the request size acts as the request size
        {"report.flush_at_keys": "5000", "report.batch_max_keys": "4"},
    ]
)
async def loop_under_test(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[Daemon, Sender, Clock]]:
    cfg = C.load(env=ENV, overrides={"report.flush_window_s": "3600", **request.param})
    clock = Clock()
    d = Daemon(cfg, asyncio.Event(), clock=clock)
    p = Sender()
    task = asyncio.create_task(d._report_loop(p))  # type: ignore[arg-type]
    yield d, p, clock
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _settle() -> None:
    """Let the loop run until it blocks again (yields only: no time passes)."""
    for _ in range(20):
        await asyncio.sleep(0)


def _dirty(d: Daemon, p: Sender, clock: Clock, *keys: int) -> None:
    """What the drain loop does when ring records make keys dirty."""
    if not p.keys.dirty:
        p.keys.dirty_since = clock()
    p.keys.dirty.extend(keys)
    d.work.set()


async def test_fewer_than_flush_at_keys_wait_then_one_request_carries_them_all(
    loop_under_test: tuple[Daemon, Sender, Clock],
) -> None:
    d, p, clock = loop_under_test
    _dirty(d, p, clock, 1, 2, 3)
    await _settle()
    assert p.sent.empty()  # 3 < flush_at_keys and the window has an hour to go
    _dirty(d, p, clock, 4)
    assert await asyncio.wait_for(p.sent.get(), 10) == [1, 2, 3, 4]


async def test_the_window_releases_a_small_batch(
    loop_under_test: tuple[Daemon, Sender, Clock],
) -> None:
    d, p, clock = loop_under_test
    _dirty(d, p, clock, 7)
    await _settle()
    assert p.sent.empty()
    clock.t += 3600  # the oldest change has waited the whole window
    d.work.set()  # (any wake-up re-checks the window)
    assert await asyncio.wait_for(p.sent.get(), 10) == [7]
