"""An idle sidecar's wake-ups (issue #26, Goal 4): the engine watch checks less often while a
check cannot find death by polling (the engine's exit and health probes wake it instead), and the
ring drain proves the engine's doorbell while the engine writes, so that a silent engine is
polled rarely. Counted with an injected clock, counters and the ring header; never timed.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidecar import config as C
from sidecar.daemon import Daemon
from sidecar.key_state import KeyState
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.doorbell import Listener
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment
from sidecar.shm_ring.snapshot import SnapshotWriter
from sidecar.shm_ring.writer import RingWriter
from sidecar.source.base import WatchResult
from sidecar.source.ring import RingSource
from sidecar.source.zmq import WATCH_FALLBACK_S, ZmqSource
from sidecar.wakeups import Work

ROOT = Path(__file__).resolve().parents[2]
META = L.pack_meta(L.KIND_STORED)
ENV = {
    "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://127.0.0.1:9",
    "KV_CACHE_EVENT_INSTANCE_ID": "i",
    "KV_CACHE_EVENT_HOST_IP_PORT": "h:1",
    "KV_CACHE_EVENT_ENGINE_WATCH_INTERVAL_S": "0.25",
    "KV_CACHE_EVENT_ENGINE_DEAD_AFTER_CHECKS": "2",
    "KV_CACHE_EVENT_ENGINE_STALE_AFTER_S": "5",
}


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def watched(ring_name: str) -> AsyncIterator[tuple[RingWriter, RingSource, Clock]]:
    writer = RingWriter(Segment(ring_name, 64))
    reader = RingReader(Segment(ring_name))
    clock = Clock()
    src = RingSource(C.load(env=ENV), reader, KeyState(), clock=clock)
    yield writer, src, clock
    src.unwatch_pid()
    reader.close()
    writer.close()


async def test_ring_watch_of_a_healthy_engine_waits_for_the_close_bound(
    watched: tuple[RingWriter, RingSource, Clock],
) -> None:
    writer, src, clock = watched
    writer.stamp()
    assert src.watch(False) == WatchResult()
    # Its exit is watched (a pidfd): the next check is the next multiple of 0.25 x 2 s.
    assert src.watch_wait_s(False) == pytest.approx(0.5)
    clock.t = 100.6
    assert src.watch_wait_s(False) == pytest.approx(0.4)
    # Engine down: every watch interval, on its tick, as before.
    assert src.watch_wait_s(True) == pytest.approx(0.15)


async def test_ring_watch_checks_at_the_tick_after_the_stamp_could_turn_stale(
    watched: tuple[RingWriter, RingSource, Clock],
) -> None:
    writer, src, _ = watched
    writer.seg.hdr[L.W_LIVENESS_NS] = time.monotonic_ns() - int(4.9 * 1e9)  # 0.1 s left
    src.watch(False)
    wait = src.watch_wait_s(False)
    assert 0.1 <= wait <= 0.25 + 1e-9  # the first 0.25 s tick after the stamp turns stale
    writer.seg.hdr[L.W_LIVENESS_NS] = time.monotonic_ns() - 6 * 10**9
    assert src.watch(False) == WatchResult()  # one bad check is not death
    assert src.stale_checks == 1
    assert src.watch_wait_s(False) == pytest.approx(0.25)  # the next one at the next tick


async def test_ring_watch_polls_every_interval_where_the_exit_cannot_be_watched(
    ring_name: str,
) -> None:
    writer = RingWriter(Segment(ring_name, 64))
    reader = RingReader(Segment(ring_name))
    src = RingSource(C.load(env=ENV), reader, KeyState(), clock=Clock())
    try:
        writer.stamp()
        src._pidfd_pid = writer.seg.hdr[L.W_PID]  # as after a pidfd_open that failed
        src.watch(False)
        assert src.watch_wait_s(False) == pytest.approx(0.25)
    finally:
        reader.close()
        writer.close()


async def test_ring_watch_wakes_at_once_when_the_engine_process_exits(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    script = (
        "import sys, time\n"
        "from sidecar.shm_ring.segment import Segment\n"
        "from sidecar.shm_ring.writer import RingWriter\n"
        "RingWriter(Segment(sys.argv[1]))\n"
        "print('attached', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    engine = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        ring_name,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    reader = RingReader(Segment(ring_name))
    src = RingSource(C.load(env=ENV), reader, KeyState(), clock=Clock())
    try:
        assert engine.stdout is not None and engine.stdin is not None
        async with asyncio.timeout(60):
            assert (await engine.stdout.readline()).strip() == b"attached"
        assert src.watch(False) == WatchResult()
        assert src.watch_wait_s(False) == pytest.approx(0.5)
        assert not src.watch_wake.is_set()
        engine.stdin.close()  # the engine exits (without closing the ring)
        async with asyncio.timeout(30):
            await src.watch_wake.wait()
            await engine.wait()  # reaped (a zombie's pid still answers kill(pid, 0))
        assert src.watch(False).event.value == "same"  # pid gone: one bad check
        assert src.watch_wait_s(False) == pytest.approx(0.25)  # then every interval
        assert src.watch(False).event.value == "down"
    finally:
        if engine.returncode is None:
            engine.kill()
            await engine.wait()
        src.unwatch_pid()
        reader.close()
        seg.close()


class _Src:
    """What the watch loop asks of a source: a check, how long to wait, and its wake event."""

    def __init__(self) -> None:
        self.watch_wake = asyncio.Event()
        self.checked: asyncio.Queue[int] = asyncio.Queue()
        self.n = 0

    def watch_wait_s(self, engine_down: bool, now: float | None = None) -> float:
        return 3600.0


class _Pub:
    def __init__(self, src: _Src) -> None:
        self.source = src
        self.engine_down = False
        self.host_down_pending = False

    def watch_step(self) -> None:
        self.source.n += 1
        self.source.checked.put_nowait(self.source.n)


async def test_watch_loop_checks_once_then_only_when_woken() -> None:
    d = Daemon(C.load(env=ENV), asyncio.Event(), clock=Clock())
    src = _Src()
    task = asyncio.create_task(d._watch_loop(_Pub(src)))  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(10):
            assert await src.checked.get() == 1
        for _ in range(20):
            await asyncio.sleep(0)  # yields only: no time passes, no wake-up
        assert src.checked.empty() and d.watch_checks == 1
        src.watch_wake.set()  # the engine exited, or a health probe answered
        async with asyncio.timeout(10):
            assert await src.checked.get() == 2
        assert d.watch_checks == 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


ZMQ_ENV = {
    **ENV,
    "KV_CACHE_EVENT_SOURCE": "zmq",
    "KV_CACHE_EVENT_ZMQ_ENDPOINT": "tcp://127.0.0.1:9",
}


def test_zmq_watch_without_a_health_url_sleeps_to_the_fallback(tmp_path: Path) -> None:
    cfg = C.load(env={**ZMQ_ENV, "KV_CACHE_EVENT_STATE_DIR": str(tmp_path)})
    src = ZmqSource(cfg, KeyState(), clock=Clock(120.0))
    assert src.watch(False) == WatchResult()
    assert src.watch_wait_s(False) == pytest.approx(WATCH_FALLBACK_S)


async def test_zmq_health_probe_wakes_the_watch_and_sleeps_to_the_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        **ZMQ_ENV,
        "KV_CACHE_EVENT_STATE_DIR": str(tmp_path),
        "KV_CACHE_EVENT_ZMQ_HEALTH_URL": "http://127.0.0.1:9/health",
        "KV_CACHE_EVENT_ZMQ_HEALTH_INTERVAL_S": "1.0",
    }
    slept: asyncio.Queue[float] = asyncio.Queue()

    async def sleep(s: float) -> None:
        await slept.put(s)
        await asyncio.Event().wait()  # one probe only

    async def probe(url: str, timeout_s: float) -> bool:
        return False

    import sidecar.source.zmq as zmq_source

    monkeypatch.setattr(zmq_source, "probe", probe)
    src = ZmqSource(C.load(env=env), KeyState(), clock=Clock(100.25), sleep=sleep)
    task = asyncio.create_task(src.health_loop())
    try:
        async with asyncio.timeout(10):
            assert await slept.get() == pytest.approx(0.75)  # to the shared 1 s tick
        assert src.watch_wake.is_set() and src.health_failures == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_ring_nap_shows_the_reader_asleep_until_the_engine_has_rung(
    ring_name: str,
) -> None:
    seg = Segment(ring_name, 64)
    writer = RingWriter(Segment(ring_name))
    reader = RingReader(Segment(ring_name))
    flags: list[int] = []
    bell_rung = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def sleep(s: float) -> None:
        flags.append(int(seg.hdr[L.W_READER_IDLE]))
        writer.write(np.arange(3, dtype=np.int64), META)  # the engine writes meanwhile

    src = RingSource(C.load(env=ENV), reader, KeyState(), sleep=sleep, clock=Clock())

    def rung() -> None:  # on the doorbell's thread
        loop.call_soon_threadsafe(bell_rung.set)

    bell = Listener(ring_name, seg.hdr, rung)
    nap: Callable[[float, Any, bool], Awaitable[None]] = src._nap
    try:
        await nap(0.002, bell, False)
        assert flags == [1] and seg.hdr[L.W_READER_IDLE] == 0
        async with asyncio.timeout(30):
            await bell_rung.wait()  # the write during the nap rang: the bell is proven
        assert bell.rung == 1
        await nap(0.002, bell, True)  # once proven, naps leave the flag alone
        assert flags == [1, 0]
        await nap(0.002, None, False)  # no doorbell: nothing to prove
        assert flags == [1, 0, 0]
    finally:
        bell.close()
        reader.close()
        writer.close()
        seg.close()


async def _until(pred: Callable[[], bool]) -> None:
    """Yield until `pred` holds (yields only: the drain under test sleeps no real time but on
    its bell, and its doorbell thread's wake-up arrives through the loop)."""
    for _ in range(200_000):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError("the drain never got there")


async def test_ring_drain_of_a_silent_engine_is_woken_by_the_proven_doorbell(
    ring_name: str,
) -> None:
    # Fallback polls of ~an hour: only the doorbell can wake the drain while the test runs.
    env = {
        **ENV,
        "KV_CACHE_EVENT_ENGINE_WATCH_INTERVAL_S": "1000",
        "KV_CACHE_EVENT_RING_IDLE_POLL_INTERVAL_S": "3600",
        "KV_CACHE_EVENT_REPORT_FLUSH_WINDOW_S": "0",
    }
    seg = Segment(ring_name, 64)
    writer = RingWriter(Segment(ring_name))
    reader = RingReader(Segment(ring_name))
    keys = KeyState()

    async def no_time(s: float) -> None:
        await asyncio.sleep(0)

    src = RingSource(C.load(env=env), reader, keys, sleep=no_time, clock=Clock())
    work = Work()
    task = asyncio.create_task(src.run(work))
    try:
        await _until(lambda: src.sync.status.value == "waiting_snapshot")
        answer = SnapshotWriter(seg)
        empty = np.zeros(0, np.int64)
        answer.publish(answer.pending_request(), 0, writer.boot_id, 0, empty, empty)
        await _until(lambda: src.synced)
        await _until(lambda: bool(seg.hdr[L.W_READER_IDLE]))  # asleep on the bell, unproven
        assert src.doorbell == "unproven"
        work.clear()
        writer.write(np.arange(1, 4, dtype=np.int64), META)  # rings: the reader sleeps on it
        async with asyncio.timeout(30):
            await work.wait()
        await _until(lambda: src.doorbell == "proven" and bool(seg.hdr[L.W_READER_IDLE]))
        work.clear()
        writer.write(np.arange(7, 8, dtype=np.int64), META)  # silent until now
        async with asyncio.timeout(30):
            await work.wait()  # woken by the bell, not by a fallback poll an hour away
        assert keys.published_count == 4
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        reader.close()
        writer.close()
        seg.close()
