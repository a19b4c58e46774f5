"""The shm ring as a source: records + engine snapshots (EngineSync), descriptor, engine watch.

Imports: stdlib, numpy, posix_ipc, engine_hook.descriptor (the ring header's JSON format),
sidecar.shm_ring, key_state, source.*. The drain loop polls the ring, backs off while it is empty
and sleeps on the engine's doorbell; death needs several consecutive bad checks (DESIGN §9), and
the counter lives here, with the ring it judges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import posix_ipc

from engine_hook.descriptor import Descriptor
from sidecar.config import Config
from sidecar.key_state import KeyState
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.doorbell import Listener
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import pid_alive, pid_namespace
from sidecar.source.base import (
    FlushPolicy,
    Identity,
    Sleep,
    SourceRejected,
    Watch,
    WatchResult,
    next_tick,
)
from sidecar.source.engine_sync import EngineSync, Sync
from sidecar.wakeups import Work

log = logging.getLogger(__name__)
BELL_IDLE_POLLS = 4  # each idle wake-up of the event loop costs ~0.2-0.5 ms of CPU on a VM


class RingSource:
    kind = "ring"

    def __init__(
        self,
        cfg: Config,
        reader: RingReader,
        keys: KeyState,
        *,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.reader = reader
        self.keys = keys
        self.sleep = sleep
        self.clock = clock
        self.sync = EngineSync(
            reader,
            keys,
            snapshot_timeout_s=cfg.ring.engine_snapshot_timeout_s,
            clock=clock,
            medium_count=self._medium_count,
        )
        self._identity: Identity | None = None
        self.stale_checks = 0
        self.dead_boot_id = 0
        # The engine watch (watch_wait_s): set when the engine's process exits (a pidfd).
        self.watch_wake = asyncio.Event()
        self._pidfd = -1  # watched for the engine's exit (-1: none)
        self._pidfd_pid = 0  # whose (or which pid could not be watched)
        self._relaxed = False  # the last check was healthy and the pid is watched (or moot)
        self._stale_in_s = 0.0  # at the last check: until the liveness stamp turns stale
        self.doorbell = "none"  # /status: none (polling), unproven, proven (this engine rang it)

    # ---- what the publisher reads ----------------------------------------------------------
    @property
    def incarnation(self) -> int:
        return self.sync.boot_id

    @property
    def last_seq(self) -> int:
        return self.sync.last_seq

    @property
    def dropped_total(self) -> int:
        return self.sync.dropped_total

    @property
    def resyncs(self) -> Counter[str]:
        return self.sync.resyncs

    @property
    def synced(self) -> bool:
        return self.sync.status is Sync.SYNCED

    @property
    def sync_state(self) -> str:
        return self.sync.status.value

    def lag(self) -> int:
        return self.reader.lag()

    def take_forget(self) -> bool:
        return False  # the engine's own snapshot rebuilds the truth: never a forget

    def _medium_count(self) -> int:
        """The current producer's medium table size (1 while its descriptor is unreadable)."""
        raw = self.reader.seg.read_descriptor()
        try:
            return len(Descriptor.from_json(raw).medium_table()) if raw else 1
        except (ValueError, TypeError):
            return 1

    def identity(self) -> Identity | None:
        if self._identity is not None:
            return self._identity
        raw = self.reader.seg.read_descriptor()
        if not raw:
            return None
        try:
            d = Descriptor.from_json(raw)
        except (ValueError, TypeError) as exc:
            raise SourceRejected(f"engine descriptor unreadable: {exc}") from None
        ident = self.cfg.identity
        if d.instance_id != ident.instance_id or d.dp_rank != ident.dp_rank:
            raise SourceRejected(
                f"engine is instance {d.instance_id!r} dp_rank "
                f"{d.dp_rank}, this sidecar is {ident.instance_id!r} "
                f"dp_rank {ident.dp_rank}"
            )
        mediums = d.medium_table()
        self._identity = Identity(
            instance_id=d.instance_id,
            dp_rank=d.dp_rank,
            model_name=d.model_name,
            dtype=d.dtype,
            use_mla=d.use_mla,
            tp_size=d.tp_size,
            dp_size=d.dp_size,
            pp_size=d.pp_size,
            block_size_tokens=d.block_size_tokens,
            block_bytes=d.block_bytes(),
            required_groups=tuple(d.required_groups),
            mediums=mediums,
        )
        self.sync.n_mediums = len(mediums)
        self.keys.set_required(d.required_groups)
        return self._identity

    def watch(self, engine_down: bool) -> WatchResult:
        """Engine liveness: pid (same pid namespace), liveness stamp, clean close."""
        reader = self.reader
        self._relaxed = False
        inc = reader.read_incarnation()
        if inc is None:
            return WatchResult()
        closed = reader.producer_state() == L.PRODUCER_CLOSED
        same_ns = inc.pidns == pid_namespace()
        gone = same_ns and not pid_alive(inc.pid)
        age_s = (time.monotonic_ns() - reader.producer_liveness_ns()) / 1e9
        stale = age_s > self.cfg.engine.stale_after_s
        if not (engine_down or closed or gone or stale):
            self._stale_in_s = self.cfg.engine.stale_after_s - age_s
            self._relaxed = not same_ns or self._watch_pid(inc.pid)
        if engine_down:
            healthy = not closed and not gone and not stale
            new_engine = inc.boot_id != self.dead_boot_id
            if healthy and (new_engine or reader.producer_state() == L.PRODUCER_ATTACHED):
                # A new incarnation, or the same engine fresh again after a stall: the drain
                # loop kept the engine view exact either way, so register again and resnapshot.
                log.info("engine back boot_id=%x new=%s", inc.boot_id, new_engine)
                self.stale_checks = 0
                self._identity = None  # a new engine may bring a new descriptor
                return WatchResult(Watch.BACK, "new" if new_engine else "fresh", inc.boot_id)
            return WatchResult()
        if closed or gone or stale:
            self.stale_checks += 1
        else:
            self.stale_checks = 0
        if closed or self.stale_checks >= self.cfg.engine.dead_after_checks:
            why = "closed" if closed else "pid gone" if gone else f"stale {age_s:.1f}s"
            log.warning("engine down boot_id=%x reason=%s", inc.boot_id, why)
            self.dead_boot_id = inc.boot_id
            return WatchResult(Watch.DOWN, why, inc.boot_id)
        return WatchResult()

    def watch_wait_s(self, engine_down: bool, now: float | None = None) -> float:
        """Until the next engine watch check, on the shared tick (next_tick). Every
        `engine.watch_interval_s` while a check can find death: the engine is down, a check
        was bad, none attached, or its pid cannot be watched. Otherwise the pid's exit wakes
        the loop at once (`watch_wake`), the first tick after the liveness stamp could turn
        stale is checked, and a clean close is seen within `engine.watch_interval_s x
        engine.dead_after_checks` (the bound for a death seen from the pid), plus how late
        the check may ride (Rides.late_for: a flush window, or a quarter interval)."""
        interval = self.cfg.engine.watch_interval_s
        now = self.clock() if now is None else now
        if engine_down or self.stale_checks or not self._relaxed:
            return next_tick(now, interval)
        stale_in = max(self._stale_in_s, 0.0)
        until_stale = stale_in + next_tick(now + stale_in, interval)
        return min(next_tick(now, interval * self.cfg.engine.dead_after_checks), until_stale)

    def _watch_pid(self, pid: int) -> bool:
        """Watch the engine's process for its exit (a pidfd on the event loop); False when it
        cannot be watched (no running loop, no pidfd_open): then it is polled, as before."""
        if pid == self._pidfd_pid:
            return self._pidfd >= 0
        self.unwatch_pid()
        self._pidfd_pid = pid
        try:
            loop = asyncio.get_running_loop()
            fd = os.pidfd_open(pid)
        except (RuntimeError, OSError, AttributeError):
            return False
        try:
            loop.add_reader(fd, self._pid_exited, loop)
        except (OSError, ValueError, NotImplementedError):
            os.close(fd)
            return False
        self._pidfd = fd
        return True

    def _pid_exited(self, loop: asyncio.AbstractEventLoop) -> None:
        # Readable once the process has exited (and from then on): stop watching, check now.
        if self._pidfd >= 0:
            loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        self._relaxed = False
        self.watch_wake.set()

    def unwatch_pid(self) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(RuntimeError, OSError, ValueError):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        self._pidfd_pid = 0

    def status(self) -> dict[str, Any]:
        return {
            "source": self.kind,
            "ring_lag": self.reader.lag(),
            "unknown_medium": self.sync.unknown_medium,
            "doorbell": self.doorbell,
        }

    # ---- the drain loop --------------------------------------------------------------------
    def loops(self, work: Work) -> dict[str, Awaitable[None]]:
        return {"drain": self.run(work)}

    async def run(self, work: Work) -> None:
        # Idle polls cost two 8-byte loads; a full step (which also notices a new engine
        # incarnation that has not written yet) runs at the first poll after each engine watch
        # interval. The poll period doubles while the ring stays empty, up to
        # idle_poll_interval_s (BELL_IDLE_POLLS watch intervals once the engine has rung), and
        # drops back to poll_interval_s on the first record: each wake-up of the event loop
        # costs far more than the poll itself, so an idle sidecar must not spin; instead it
        # sleeps on the engine's doorbell (shm_ring/doorbell.py), so a quiet spell does not
        # delay the next records by a poll interval.
        wake = asyncio.Event()
        loop = asyncio.get_running_loop()

        def rung() -> None:  # on the doorbell's thread
            loop.call_soon_threadsafe(wake.set)

        try:
            bell: Listener | None = Listener(self.reader.seg.name, self.reader.seg.hdr, rung)
        except (posix_ipc.Error, OSError) as exc:  # an optimisation only: poll instead
            log.warning("doorbell unavailable, polling the ring instead: %r", exc)
            bell = None
        try:
            await self._drain(bell, wake, work)
        finally:
            self.unwatch_pid()
            if bell is not None:
                bell.close()

    async def _drain(self, bell: Listener | None, wake: asyncio.Event, work: Work) -> None:
        sync = self.sync
        busy = self.cfg.ring.poll_interval_s
        idle = max(self.cfg.ring.idle_poll_interval_s, busy)
        bell_after = max(self.cfg.ring.bell_after_s, busy)
        full_every = self.cfg.engine.watch_interval_s
        policy = FlushPolicy.of(self.cfg.report)
        send_at = policy.at_keys
        room = self.reader.capacity // 4  # records a coalesced wait leaves the engine
        last_full = 0.0
        delay = busy
        last_poll = self.clock()
        rung_seen = 0  # bell.rung when last looked
        bell_boot = 0  # the engine incarnation that has rung the doorbell (0: none yet)
        while True:
            work.awake()  # the heartbeat and the engine watch, when due, ride this wake-up
            now = self.clock()
            full = now - last_full >= full_every
            if full:
                last_full = now
            was_dirty = bool(sync.keys.dirty)
            r = sync.step(full=full)
            if r.records and not was_dirty and sync.keys.dirty:
                # These records reached the ring after the previous poll: start the flush
                # window there, so it bounds the time a change waits in ring + sidecar.
                sync.keys.dirty_since = last_poll
            since, last_poll = last_poll, now
            if r.records or r.resynced:
                work.set()
            # An engine that has rung the doorbell rings it again when it writes: its fallback
            # poll can wait BELL_IDLE_POLLS engine watch intervals (the watch loop sees its
            # death meanwhile); an engine without a bell is polled every idle, as before. The
            # proof is per incarnation (a new engine may be an older one, without a bell).
            if bell is not None and bell.rung != rung_seen:
                rung_seen, bell_boot = bell.rung, sync.boot_id
            proven = bell is not None and bell_boot != 0 and bell_boot == sync.boot_id
            self.doorbell = "none" if bell is None else "proven" if proven else "unproven"
            limit = max(idle, BELL_IDLE_POLLS * full_every) if proven else idle
            delay = busy if r.records else min(delay * 2, limit)
            until = policy.read_at(sync.keys, now) if r.records else 0.0
            if until and not self.reader.lag():
                # Changes wait for the flush window: read again just before it ends (or when
                # flush_at_keys or a quarter of the ring would fill at the rate just seen), not
                # at every engine step, and without the doorbell (the engine posts nothing).
                rate = r.records / max(now - since, busy)
                fill = min(max(send_at - len(sync.keys.dirty), 0), room) / rate
                await self._nap(max(min(until - now, fill), busy), bell, proven)
                continue
            if delay <= bell_after or bell is None:
                await self._nap(delay, bell, proven)
                continue
            # Idle: sleep until the engine rings the doorbell or the poll interval passes.
            wake.clear()
            bell.asleep(True)
            # The longest fallback poll ends on the shared tick (next_tick).
            wait = next_tick(self.clock(), limit) if delay >= limit else delay
            try:
                if sync.reader.idle():  # re-check once the flag is visible
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):
                            await wake.wait()
            finally:
                bell.asleep(False)

    async def _nap(self, wait: float, bell: Listener | None, proven: bool) -> None:
        """A short sleep while the engine writes. Until this incarnation has rung the doorbell,
        the reader shows itself asleep meanwhile: the engine's next write then rings it (one
        post, once), which proves the bell, so that a silent engine can be polled every
        BELL_IDLE_POLLS watch intervals rather than every `ring.idle_poll_interval_s` (an
        engine filled at full speed and then silent would otherwise never ring it)."""
        if bell is None or proven:
            await self.sleep(wait)
            return
        bell.asleep(True)
        try:
            await self.sleep(wait)
        finally:
            bell.asleep(False)

    async def final_drain(self) -> None:
        self.sync.step()
