"""The daemon's lifecycle: locks, source, one TaskGroup owning every loop, shutdown with a deadline.

Imports: stdlib, aiohttp, everything in `sidecar` except engine_hook's hook. Loops are thin; the
work is in Publisher and source steps (the source, ring or ZMQ, brings its own feed loops). A
crash in one loop cancels the rest and propagates (the CLI exits non-zero so systemd/k8s restart
the process). The stop event (set by the CLI's signal handlers) ends the group; then the final
drain, flush and HOST_DOWN run under the grace timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from sidecar.config import Config, parse_addr
from sidecar.key_state import KeyState
from sidecar.kvcm_client.client import KvcmClient, Result
from sidecar.kvcm_client.discovery import Discovery
from sidecar.malloc import trim
from sidecar.metrics.registry import Metrics
from sidecar.metrics.server import build_app
from sidecar.publisher import Publisher, State
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.reader import ReaderConflict, RingReader
from sidecar.shm_ring.segment import Segment
from sidecar.source.base import FlushPolicy, Source, next_tick
from sidecar.source.ring import RingSource
from sidecar.wakeups import RIDE_EARLY_S, Rides, Work

log = logging.getLogger(__name__)
Sleep = Callable[[float], Awaitable[None]]


class IdentityBusy(Exception):
    """Another sidecar already serves this reporter identity or ring on this host (exit 3)."""


class _Stop(Exception):
    """Raised inside the TaskGroup to end it when the stop event is set."""


def ring_name(cfg: Config) -> str:
    return cfg.ring.name or L.segment_name(cfg.identity.instance_id, cfg.identity.dp_rank)


def identity_lock(cfg: Config) -> int:
    """flock one file per reporter identity; held for the life of the process."""
    ident = f"{cfg.identity.instance_id}|{cfg.identity.storage_type}|{cfg.host_ip_port()}"
    digest = hashlib.sha1(ident.encode(), usedforsecurity=False).hexdigest()[:16]
    path = os.path.join(cfg.identity.lock_dir, f"kvcm-sidecar.{digest}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise IdentityBusy(
            f"another kvcm-sidecar already reports instance {cfg.identity.instance_id!r} "
            f"{cfg.identity.storage_type} as {cfg.host_ip_port()!r} on this host ({path})"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


class Daemon:
    def __init__(
        self,
        cfg: Config,
        stop: asyncio.Event,
        *,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.stop = stop
        self.sleep = sleep
        self.clock = clock
        # Periodic work rides the source's wake-ups (sidecar/wakeups.py): late by at most
        # one flush window (it may be late by this much when the engine is silent).
        r = cfg.report
        self.rides = Rides(min(max(r.flush_window_max_s, r.flush_window_s) + 0.01, 0.1), clock)
        self.work = Work(self.rides)
        self.metrics = Metrics()
        self.publisher: Publisher | None = None
        self.discovery: Discovery | None = None
        self.http_port = 0
        self.started = asyncio.Event()  # set once the HTTP endpoints listen (tests wait on it)
        self.watch_checks = 0  # engine watch checks run (tests count the loop's wake-ups)

    def status(self) -> dict[str, Any]:
        if self.publisher is None:
            return {
                "state": State.DISABLED.name,
                "state_code": 0,
                "reason": "publisher_type is none"
                if self.cfg.publisher_type == "none"
                else "starting",
            }
        extra = self.discovery.status() if self.discovery is not None else {}
        return {**self.publisher.status(), **extra}

    def ready(self) -> bool:
        p = self.publisher
        return p is not None and p.registered and not p.stopping and not p.engine_down

    async def run(self) -> int:
        lock_fd = identity_lock(self.cfg) if self.cfg.publisher_type == "kvcm" else None
        try:
            if self.cfg.publisher_type == "none":
                await self._serve_http_until_stop()
                return 0
            keys = KeyState(clock=self.clock)
            if self.cfg.source.kind == "zmq":
                from sidecar.source.zmq import ZmqSource

                zsrc = ZmqSource(self.cfg, keys, clock=self.clock)
                try:
                    return await self._run_with_source(zsrc)
                finally:
                    zsrc.close()
            seg = Segment(
                ring_name(self.cfg), self.cfg.ring.capacity_slots or None, lock_budget_s=1.0
            )
            try:
                reader = RingReader(seg)
            except ReaderConflict as exc:
                seg.close()
                raise IdentityBusy(str(exc)) from None
            try:
                src = RingSource(self.cfg, reader, keys, sleep=self.sleep, clock=self.clock)
                try:
                    return await self._run_with_source(src)
                finally:
                    src.unwatch_pid()  # a watch check may have run after the drain loop ended
            finally:
                reader.close()
                seg.close()
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    async def _serve_http_until_stop(self) -> None:
        runner = await self._start_http()
        try:
            await self.stop.wait()
        finally:
            await runner.cleanup()

    async def _start_http(self) -> web.AppRunner:
        host, port = parse_addr(self.cfg.http.metrics_addr)
        runner = web.AppRunner(build_app(self.metrics, self.status, self.ready), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        self.http_port = runner.addresses[0][1]
        log.info("http listening addr=%s:%d", host, self.http_port)
        self.started.set()
        return runner

    async def _run_with_source(self, source: Source) -> int:
        cfg = self.cfg
        timeout = aiohttp.ClientTimeout(total=None, connect=cfg.manager.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            seeds = cfg.manager.seeds
            client = KvcmClient(
                session,
                seeds[0],
                cfg.manager.max_response_bytes,
                lean_http=True,
                hold_s=cfg.report.response_hold_s,
            )
            self.work.also = client.poke  # a held answer is read at the next work signal
            disc = Discovery(
                seeds,
                session,
                client,
                timeout_s=cfg.manager.request_timeout_s,
                interval_s=cfg.manager.discovery_interval_s,
                clock=self.clock,
            )

            def on_request(op: str, result: Result) -> None:
                self.metrics.observe(op, result)
                disc.note(result)  # SERVER_NOT_LEADER, refused, timed out: find the leader

            p = Publisher(cfg, client, source, clock=self.clock, on_request=on_request)
            p.on_reregister = self.work.set

            def on_leader(_leader: object) -> None:
                p.leader_changed()
                self.work.set()

            disc.on_change = on_leader
            self.publisher, self.discovery = p, disc
            self.metrics.attach(p)
            self.metrics.attach_discovery(disc)
            self.metrics.attach_rides(self.rides)
            runner = await self._start_http()
            try:
                try:
                    async with asyncio.TaskGroup() as tg:
                        for name, loop in source.loops(self.work).items():
                            tg.create_task(loop, name=name)  # type: ignore[arg-type]
                        tg.create_task(disc.run(), name="discovery")
                        tg.create_task(self._report_loop(p, disc.first_round), name="report")
                        tg.create_task(self._heartbeat_loop(p), name="heartbeat")
                        tg.create_task(self._watch_loop(p), name="engine-watch")
                        tg.create_task(self._stop_waiter(), name="stop")
                        if self.cfg.memory.trim_interval_s:
                            tg.create_task(self._trim_loop(), name="malloc-trim")
                except* _Stop:
                    pass
                await self._shutdown(p, source)
            finally:
                client.close()
                await runner.cleanup()
        return 0

    async def _stop_waiter(self) -> None:
        await self.stop.wait()
        raise _Stop

    async def _report_loop(self, p: Publisher, discovered: asyncio.Event | None = None) -> None:
        if discovered is not None:
            await discovered.wait()  # register with the leader, not the first seed that answers
        policy = FlushPolicy.of(self.cfg.report)
        while True:
            while policy.window_s and p.state == State.READY and p.keys.dirty:
                # The flush window: let a batch fill up, but send once flush_at_keys are
                # waiting, and let no change wait longer than the window from when it became
                # dirty (not from when the last request ended); at low rates the window
                # stretches (FlushPolicy). Every source read that changed keys sets `work`.
                now = self.clock()
                if policy.ends_now(p.keys, now):  # a source's coalesced read just before the end
                    policy.sending(p.keys, now)
                    break
                wait = policy.due(p.keys) - now
                self.work.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self.work.wait()
            if await p.data_step():
                continue
            self.work.clear()
            # backoff/circuit/periodic timers; the 1 s bound on the shared tick (next_tick)
            wait = min(p.next_wakeup_s(), next_tick(self.clock(), 1.0))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self.work.wait()
            self.work.awake()  # the 1 s tick's wake-up: the heartbeat and watch ride it

    async def _heartbeat_loop(self, p: Publisher) -> None:
        # On the shared tick (next_tick): an idle sidecar's heartbeat, engine watch and polls
        # share their wake-ups. A heartbeat slower than the interval skips to the next tick.
        # The next tick is planned from the tick a beat was for, not from when it ended: a
        # beat that rode in late (Rides) or took most of the interval still has the next tick.
        # Ticks are counted (k * interval): a sum of intervals would drift off the shared grid.
        interval = self.cfg.report.heartbeat_interval_s
        rides = self.rides
        late = rides.late_for(interval)
        k: int | None = None  # the beat in progress was for tick k * interval (None: the first)
        while True:
            await p.heartbeat_step()
            now = rides.clock()
            if k is not None and 0 < (k + 1) * interval - now <= interval + RIDE_EARLY_S:
                k += 1
            else:  # the first beat, one slower than the interval, or a clock set back
                # the first tick past RIDE_EARLY_S from now: one a ride would take at once
                # (it may end that much early) would beat twice in a row
                k = math.floor(rides.now() / interval) + 1
            await rides.sleep(k * interval - now, late)

    async def _watch_loop(self, p: Publisher) -> None:
        # The source says when its next check is worth a wake-up (every watch interval while
        # a check can find death by polling; less often when the engine's exit or a health
        # probe wakes the loop through `watch_wake`), on the shared tick.
        wake = p.source.watch_wake
        late = self.rides.late_for(self.cfg.engine.watch_interval_s)
        while True:
            wake.clear()
            was_down = p.engine_down
            p.watch_step()
            self.watch_checks += 1
            if p.host_down_pending or was_down != p.engine_down:
                self.work.set()
            wait = p.source.watch_wait_s(p.engine_down, self.rides.now()) + RIDE_EARLY_S
            if wake.is_set():
                continue
            ride = self.rides.at(wait, wake.set, late)  # on a source's wake-up when it can
            try:
                await wake.wait()
            finally:
                self.rides.cancel(ride)

    async def _trim_loop(self) -> None:
        while True:
            await self.sleep(self.cfg.memory.trim_interval_s)
            trim()

    async def _shutdown(self, p: Publisher, source: Source) -> None:
        """Drain what the source holds, flush, then HOST_DOWN, all within the grace period."""
        p.stopping = True
        log.info("shutdown: draining dirty=%d", len(p.keys.dirty))
        cfg = self.cfg
        deadline = self.clock() + cfg.shutdown.grace_s - cfg.shutdown.host_down_budget_s - 0.2
        try:
            async with asyncio.timeout(max(deadline - self.clock(), 0.0)):
                await source.final_drain()
                while p.registered and p.keys.dirty and p.retry_at <= self.clock():
                    before = len(p.keys.dirty)
                    await p.send_deltas()
                    if p.state == State.DEGRADED or len(p.keys.dirty) >= before:
                        break  # the manager is failing: do not spend the grace on retries
        except TimeoutError:
            log.warning("shutdown: flush did not finish within the grace period")
        if p.ever_registered:
            ok = await p.host_down(cfg.shutdown.host_down_budget_s)
            log.info("shutdown: host_down sent ok=%s", ok)
        p.set_state(State.STOPPED, "shut down")
