"""Periodic work rides the source's wake-ups (sidecar/wakeups.py): the heartbeat and the engine
watch run at the first wake-up of the loop from their due time on, or `late_s` after it on their
own timer when none comes, and a ride that ended a hair early is not due again at once.

The clock is injected (due times); the own-timer fallback is the only real wait, and the tests
that do not exercise it make it an hour long, so only a poke can end a ride while they run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from sidecar import config as C
from sidecar.daemon import Daemon
from sidecar.wakeups import RIDE_EARLY_S, Rides, Work

ENV = {
    "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://127.0.0.1:9",
    "KV_CACHE_EVENT_INSTANCE_ID": "i",
    "KV_CACHE_EVENT_HOST_IP_PORT": "h:1",
}


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def _settle() -> None:
    """Let the loop run until it blocks again (yields only: no time passes)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_ride_ends_at_the_first_poke_from_its_due_time_on() -> None:
    clock = Clock()
    rides = Rides(3600.0, clock)
    ran: list[float] = []
    rides.at(1.0, lambda: ran.append(clock()))
    rides.poke()
    clock.t = 100.5
    rides.poke()
    assert ran == []  # not due: the poke leaves it
    clock.t = 101.0 - RIDE_EARLY_S / 2  # a source's timer a hair early
    rides.poke()
    clock.t = 101.2
    rides.poke()
    assert ran == [101.0 - RIDE_EARLY_S / 2]  # once
    assert (rides.shared, rides.alone) == (1, 0)


async def test_a_ride_that_no_poke_ends_runs_late_s_after_it_is_due() -> None:
    rides = Rides(0.02)
    done = asyncio.Event()
    rides.at(0.01, done.set)
    async with asyncio.timeout(10):
        await done.wait()
    assert (rides.shared, rides.alone) == (0, 1)


async def test_a_cancelled_ride_never_runs() -> None:
    clock = Clock()
    rides = Rides(0.0, clock)
    ran: list[int] = []
    r = rides.at(0.0, lambda: ran.append(1))
    rides.cancel(r)
    clock.t += 1
    rides.poke()
    await asyncio.sleep(0.01)  # past its own timer (late_s 0): cancelled too
    assert ran == [] and (rides.shared, rides.alone) == (0, 0)


class _Beat:
    """What the heartbeat loop asks of the publisher: one heartbeat per step, counted."""

    def __init__(self) -> None:
        self.beats: asyncio.Queue[float] = asyncio.Queue()
        self.clock: Clock | None = None

    async def heartbeat_step(self) -> None:
        assert self.clock is not None
        self.beats.put_nowait(self.clock())


async def test_heartbeat_rides_a_source_wake_up_and_is_not_due_again_at_once() -> None:
    async with _heartbeat(100.0) as (clock, d, p):
        async with asyncio.timeout(10):
            assert await p.beats.get() == 100.0  # at once
        clock.t = 100.5
        d.work.awake()  # a window's read, not due yet (the tick at 101)
        await _settle()
        assert p.beats.empty()
        clock.t = 101.0 - RIDE_EARLY_S / 2  # the source's poll on that tick, a hair early
        d.work.awake()
        async with asyncio.timeout(10):
            assert await p.beats.get() == clock.t
        clock.t = 101.03  # the next window: this tick was served, the next is 102
        d.work.awake()
        await _settle()
        assert p.beats.empty()
        clock.t = 102.04  # busy: the first window after the tick carries it
        d.work.awake()
        async with asyncio.timeout(10):
            assert await p.beats.get() == 102.04
        assert d.rides.shared == 2 and d.rides.alone == 0


class _SlowBeat(_Beat):
    """A heartbeat that takes `took` seconds of the clock (a slow manager)."""

    def __init__(self, clock: Clock, took: float) -> None:
        super().__init__()
        self.clock, self.took = clock, took

    async def heartbeat_step(self) -> None:
        assert self.clock is not None
        self.beats.put_nowait(self.clock())
        self.clock.t += self.took


@contextlib.asynccontextmanager
async def _heartbeat(t0: float) -> AsyncIterator[tuple[Clock, Daemon, _SlowBeat]]:
    """The daemon's heartbeat loop on a clock at `t0`, beats queued; only pokes end its waits."""
    clock = Clock(t0)
    d = Daemon(C.load(env=ENV), asyncio.Event(), clock=clock)
    d.rides.late_s = d.rides.share = 3600.0
    p = _SlowBeat(clock, 0.0)
    task = asyncio.create_task(d._heartbeat_loop(p))  # type: ignore[arg-type]
    try:
        yield clock, d, p
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_heartbeat_that_took_most_of_its_interval_keeps_the_next_tick() -> None:
    # Planned from its tick, not from when it ended (review of 77b0b69: a beat that rode in
    # late and then took the rest of the interval, or ended within RIDE_EARLY_S of the next
    # tick, skipped it: beats 2 s apart at a 1 s interval).
    async with _heartbeat(100.0) as (clock, d, p):
        async with asyncio.timeout(10):
            assert await p.beats.get() == 100.0
        p.took = 1.0 - 0.04 - RIDE_EARLY_S / 2  # rode in 40 ms late, ends a hair before 102
        clock.t = 101.04
        d.work.awake()
        async with asyncio.timeout(10):
            assert await p.beats.get() == 101.04
        await _settle()
        assert clock.t < 102.0
        clock.t = 102.0
        p.took = 1.5  # this one is slower than the interval: 103 passes, the next is 104
        d.work.awake()  # the tick at 102 is still this beat's to take
        async with asyncio.timeout(10):
            assert await p.beats.get() == 102.0
        await _settle()
        assert clock.t == 103.5
        clock.t = 103.9
        d.work.awake()
        await _settle()
        assert p.beats.empty()
        clock.t = 104.0
        d.work.awake()
        async with asyncio.timeout(10):
            assert await p.beats.get() == 104.0


async def test_a_heartbeat_ending_just_before_a_tick_does_not_beat_again_at_once() -> None:
    # The first beat (or one slower than the interval) ends within RIDE_EARLY_S of a tick: a
    # ride for that tick would end at the next wake-up, a second beat straight after the first.
    async with _heartbeat(100.999) as (clock, d, p):
        async with asyncio.timeout(10):
            assert await p.beats.get() == 100.999
        d.work.awake()
        clock.t = 101.0
        d.work.awake()
        await _settle()
        assert p.beats.empty()  # 101 is taken by the beat just ended
        clock.t = 102.0
        d.work.awake()
        async with asyncio.timeout(10):
            assert await p.beats.get() == 102.0


def test_a_short_period_bounds_how_late_its_ride_may_end() -> None:
    rides = Rides(0.055)
    assert rides.late_for(1.0) == 0.055  # a window late at most
    assert rides.late_for(0.05) == 0.05 * rides.share  # not past the next tick


async def test_engine_watch_with_a_short_interval_falls_back_within_its_share() -> None:
    # A silent engine pokes nothing: each check ends on its own timer; with watch_interval_s
    # under late_s that once came after the next tick, and every other check was lost.
    env = {**ENV, "KV_CACHE_EVENT_ENGINE_WATCH_INTERVAL_S": "0.05"}
    d = Daemon(C.load(env=env), asyncio.Event())
    assert d.rides.late_s > 0.05
    p = _Watched(_Src(d.clock))
    task = asyncio.create_task(d._watch_loop(p))  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(10):
            await p.checks.get()
        (ride,) = d.rides._rides
        assert ride.timer is not None
        loop = asyncio.get_running_loop()
        late = ride.timer.when() - loop.time() - (ride.due - d.clock())
        assert late <= 0.05 * d.rides.share + 0.001  # the loop clock vs monotonic: 1 ms
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


class _Src:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.watch_wake = asyncio.Event()
        self.clock = clock
        self.asked: list[float | None] = []

    def watch_wait_s(self, engine_down: bool, now: float | None = None) -> float:
        self.asked.append(now)
        t = self.clock() if now is None else now
        return 0.5 - (t % 0.5)  # next_tick(t, 0.5)


class _Watched:
    def __init__(self, src: _Src) -> None:
        self.source = src
        self.engine_down = False
        self.host_down_pending = False
        self.checks: asyncio.Queue[float] = asyncio.Queue()

    def watch_step(self) -> None:
        self.checks.put_nowait(self.source.clock())


async def test_engine_watch_rides_a_source_wake_up_and_its_wake_still_cuts_it_short() -> None:
    clock = Clock(100.0)
    d = Daemon(C.load(env=ENV), asyncio.Event(), clock=clock)
    d.rides.late_s = d.rides.share = 3600.0
    src = _Src(clock)
    p = _Watched(src)
    task = asyncio.create_task(d._watch_loop(p))  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(10):
            assert await p.checks.get() == 100.0
        assert src.asked == [100.0 + RIDE_EARLY_S]  # scheduled from RIDE_EARLY_S ahead
        clock.t = 100.2
        d.work.awake()
        await _settle()
        assert p.checks.empty()
        clock.t = 100.5 - RIDE_EARLY_S / 2
        d.work.awake()
        async with asyncio.timeout(10):
            assert await p.checks.get() == clock.t
        clock.t = 100.51  # that tick was served: the next check is at 101
        d.work.awake()
        await _settle()
        assert p.checks.empty()
        src.watch_wake.set()  # the engine exited: checked at once, ride or not
        async with asyncio.timeout(10):
            assert await p.checks.get() == 100.51
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_work_without_rides_is_awake_for_nothing() -> None:
    Work().awake()  # a source driven alone (tests, tools): no periodic work to run
