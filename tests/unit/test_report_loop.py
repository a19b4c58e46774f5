"""The daemon's send decision: a delta goes out when the flush window has passed since its oldest
change, or at once when flush_at_keys keys are waiting, whichever comes first; below
flush_min_keys the window stretches up to flush_window_max_s (FlushPolicy, which also tells the
sources when to read ahead of the send).

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
from sidecar.source.base import SEND_AHEAD_S, WINDOW_EARLY_S, FlushPolicy, next_tick

ENV = {
    "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://127.0.0.1:9",
    "KV_CACHE_EVENT_INSTANCE_ID": "i",
    "KV_CACHE_EVENT_HOST_IP_PORT": "h:1",
}


class Keys:
    def __init__(self) -> None:
        self.dirty: list[int] = []
        self.dirty_since = 0.0
        self.window_s = 0.0


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


@pytest.fixture
async def stretching_loop() -> AsyncIterator[tuple[Daemon, Sender, Clock]]:
    """Window 10 s, stretched up to 30 s while fewer than 4 keys wait; 8 keys go at once."""
    overrides = {
        "report.flush_window_s": "10",
        "report.flush_window_max_s": "30",
        "report.flush_min_keys": "4",
        "report.flush_at_keys": "8",
    }
    cfg = C.load(env=ENV, overrides=overrides)
    clock = Clock()
    d = Daemon(cfg, asyncio.Event(), clock=clock)
    p = Sender()
    task = asyncio.create_task(d._report_loop(p))  # type: ignore[arg-type]
    yield d, p, clock
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_report_loop_fewer_than_flush_min_keys_wait_the_stretched_window(
    stretching_loop: tuple[Daemon, Sender, Clock],
) -> None:
    d, p, clock = stretching_loop
    _dirty(d, p, clock, 1, 2, 3)
    clock.t += 10  # the plain window has passed: 3 < flush_min_keys, so it stretches
    d.work.set()
    await _settle()
    assert p.sent.empty()
    clock.t += 20  # flush_window_max_s since the oldest change
    d.work.set()
    assert await asyncio.wait_for(p.sent.get(), 10) == [1, 2, 3]


async def test_report_loop_flush_min_keys_go_at_the_plain_window(
    stretching_loop: tuple[Daemon, Sender, Clock],
) -> None:
    d, p, clock = stretching_loop
    _dirty(d, p, clock, 1, 2, 3, 4)
    await _settle()
    assert p.sent.empty()
    clock.t += 10
    d.work.set()
    assert await asyncio.wait_for(p.sent.get(), 10) == [1, 2, 3, 4]


def _policy(**over: str) -> FlushPolicy:
    base = {"report.flush_window_s": "0.02", "report.flush_window_max_s": "0.04"}
    return FlushPolicy.of(C.load(env=ENV, overrides={**base, **over}).report)


def _waiting(n: int, since: float) -> Keys:
    k = Keys()
    k.dirty, k.dirty_since = list(range(n)), since
    return k


def test_flush_policy_stretches_only_below_flush_min_keys() -> None:
    pol = _policy(**{"report.flush_min_keys": "512"})
    assert pol.due(_waiting(100, 5.0)) == pytest.approx(5.04)
    assert pol.due(_waiting(600, 5.0)) == pytest.approx(5.02)
    assert pol.due(_waiting(1000, 5.0)) == 0.0  # flush_at_keys: at once
    plain = _policy(**{"report.flush_window_max_s": "0.01"})  # at or below the window: off
    assert plain.due(_waiting(1, 5.0)) == pytest.approx(5.02)


def test_flush_policy_next_window_is_what_the_last_rate_takes_to_bring_flush_min_keys() -> None:
    pol = _policy(**{"report.flush_min_keys": "512"})
    # 100 keys in 40 ms (2 500 keys/s): 512 would take 205 ms -> the stretched maximum
    assert pol.next_window(_waiting(100, 5.0), 5.04) == pytest.approx(0.04)
    # 400 keys in 20 ms (20 k keys/s): 512 take 25.6 ms
    assert pol.next_window(_waiting(400, 5.0), 5.02) == pytest.approx(0.0256)
    # 1 000 keys in 10 ms: above flush_min_keys within the plain window
    assert pol.next_window(_waiting(1000, 5.0), 5.01) == pytest.approx(0.02)


def test_flush_policy_the_window_sized_at_a_send_is_the_next_batch_s() -> None:
    pol = _policy(**{"report.flush_min_keys": "512"})
    keys = _waiting(400, 5.0)
    pol.sending(keys, 5.02)  # the report loop sends 400 keys 20 ms old
    keys.dirty, keys.dirty_since = [1, 2, 3], 5.03
    assert pol.due(keys) == pytest.approx(5.03 + 0.0256)
    keys.dirty = list(range(600))  # a burst: flush_min_keys reached, the plain window
    assert pol.due(keys) == pytest.approx(5.03 + 0.02)


def test_flush_policy_source_reads_just_before_the_batch_is_due() -> None:
    pol = _policy(**{"report.flush_min_keys": "512"})
    keys = _waiting(64, 5.0)
    assert pol.read_at(keys, 5.001) == pytest.approx(5.04 - WINDOW_EARLY_S)  # no rate yet
    keys.window_s = 0.03
    assert pol.read_at(keys, 5.001) == pytest.approx(5.03 - WINDOW_EARLY_S)
    assert pol.read_at(_waiting(0, 5.0), 5.001) == 0.0  # nothing waits: as usual


def test_flush_policy_a_batch_due_at_this_read_starts_the_next_window_now() -> None:
    pol = _policy(**{"report.flush_min_keys": "512"})
    slow = _waiting(100, 5.0)
    now = 5.04 - WINDOW_EARLY_S  # the report loop sends at this read
    assert pol.read_at(slow, now) == pytest.approx(now + 0.04 - WINDOW_EARLY_S)
    fast = _waiting(400, 5.0)
    fast.window_s = 0.025
    now = 5.025 - WINDOW_EARLY_S  # 400 keys in 23 ms: 512 would take 29.44 ms
    assert pol.read_at(fast, now) == pytest.approx(now + 0.02944 - WINDOW_EARLY_S)


def test_flush_policy_a_read_a_hair_early_still_ends_the_window() -> None:
    # The event loop's timer wakes the source's read ahead a little before it was asked for:
    # the read and the report loop (a moment later) must both take the window as ended, or
    # the read is repeated 2 ms later, the send has its own wake-up, and the next windows
    # fall out of step with the reads (bench.pace counted ~9 extra wake-ups a second).
    pol = _policy(**{"report.flush_min_keys": "512"})
    keys = _waiting(100, 5.0)
    read = pol.read_at(keys, 5.001)
    early = read - 0.00005
    assert pol.ends_now(keys, early)
    assert pol.ends_now(keys, early + 0.0005)  # the report loop, woken by that read
    assert pol.read_at(keys, early) == pytest.approx(early + 0.04 - WINDOW_EARLY_S)
    # further ahead than SEND_AHEAD_S: not yet, and the source reads again just before
    ahead = 5.04 - SEND_AHEAD_S - 0.0005
    assert not pol.ends_now(keys, ahead)
    assert pol.read_at(keys, ahead) == pytest.approx(5.04 - WINDOW_EARLY_S)


async def test_report_loop_sends_at_a_read_a_hair_before_the_read_ahead_point(
    stretching_loop: tuple[Daemon, Sender, Clock],
) -> None:
    d, p, clock = stretching_loop
    _dirty(d, p, clock, 1, 2, 3, 4)
    await _settle()
    clock.t += 10 - WINDOW_EARLY_S - 0.0001  # the source's read, its timer a little early
    d.work.set()
    assert await asyncio.wait_for(p.sent.get(), 10) == [1, 2, 3, 4]
    _dirty(d, p, clock, 5, 6, 7, 8)
    await _settle()
    clock.t += 10 - SEND_AHEAD_S - 0.001  # well before: the window goes on
    d.work.set()
    await _settle()
    assert p.sent.empty()


def test_next_tick_lands_loops_of_dividing_intervals_on_one_instant() -> None:
    # the engine watch (0.25 s) and the heartbeat (1 s), asked at different moments
    assert 12.0 + next_tick(12.0, 1.0) == pytest.approx(13.0)
    assert 12.9 + next_tick(12.9, 0.25) == pytest.approx(13.0)
    assert 12.7 + next_tick(12.7, 1.0) == pytest.approx(13.0)
