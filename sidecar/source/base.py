"""What the publisher asks of a source: the replica's identity, liveness, sync and counters.

Imports: stdlib, config, key_state, wakeups. A source feeds (key, medium, group, kind)
transitions into the one KeyState, keeps it equal to the engine's truth (or, when it cannot,
empties it and asks for an authoritative snapshot: a forget), and tells the publisher who the
engine is and whether it lives. FlushPolicy says when the report loop sends, so that a source
reads just before. The publisher knows nothing else about rings or sockets.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Awaitable, Callable, Sized
from dataclasses import dataclass
from typing import Any, Protocol

from sidecar.config import ReportConfig
from sidecar.key_state import KeyState
from sidecar.wakeups import Work

Sleep = Callable[[float], Awaitable[None]]
# While changes wait for their flush window, a source reads its engine once, this long before
# the window ends, rather than at every engine step (each wake-up of the event loop costs more
# than a step's records): the report loop, woken by that read, sends at once whatever is this
# close to its window's end, so read and send share one wake-up. A change still never waits
# longer than the window (FlushPolicy); it may go out up to SEND_AHEAD_S sooner.
WINDOW_EARLY_S = 0.002
# What counts as "the window ends now", for the source's read and the report loop alike. The
# event loop's timers fire a little early (libuv counts whole milliseconds from the clock read
# when the loop's turn began), so the read meant for WINDOW_EARLY_S before the end can come a
# hair before it. With WINDOW_EARLY_S as the bound, that read judged the window not yet ended
# (and read again 2 ms later) while the report loop, a moment later, sent it: the next window
# then fell out of step with the reads, ~9 extra wake-ups a second at 5 k events/s (bench.pace).
SEND_AHEAD_S = WINDOW_EARLY_S + 0.001


def next_tick(now: float, interval: float) -> float:
    """Seconds until the next multiple of `interval` on the clock. Periodic loops that sleep so
    (heartbeat, engine watch, the idle polls, whose intervals divide one another) wake up
    together: one wake-up of an idle event loop instead of one each, each costing ~0.2-0.5 ms
    of CPU on a VM, on caches gone cold."""
    return interval - (now % interval)


class _Dirty(Protocol):
    """What the flush policy reads of the key state (KeyState; the report loop's tests stub it)."""

    dirty_since: float
    window_s: float

    @property
    def dirty(self) -> Sized: ...


@dataclass(frozen=True)
class FlushPolicy:
    """When the report loop sends the dirty keys, and so when a source should read ahead of it.

    A delta goes out `window_s` after its oldest change, or at once when `at_keys` wait. While
    fewer than `min_keys` wait, the window stretches up to `max_s` (each request costs the
    sidecar far more than its keys: at low rates it carries more of them): to the time the last
    batch's rate would take to bring `min_keys` (`keys.window_s`, set at each send; `max_s`
    before the first). No change waits longer than `max_s`; `window_s` 0 sends at once;
    `max_s` <= `window_s` never stretches.
    """

    window_s: float
    max_s: float
    min_keys: int
    at_keys: int

    @classmethod
    def of(cls, report: ReportConfig) -> FlushPolicy:
        w = report.flush_window_s
        return cls(
            w,
            max(report.flush_window_max_s, w),
            report.flush_min_keys,
            min(report.flush_at_keys, report.batch_max_keys),
        )

    def due(self, keys: _Dirty) -> float:
        """When what is dirty now is sent (the report loop sends within SEND_AHEAD_S of it);
        0.0 when at once (no window, or at_keys wait)."""
        n = len(keys.dirty)
        if not self.window_s or n >= self.at_keys:
            return 0.0
        if n >= self.min_keys or self.max_s <= self.window_s:
            return keys.dirty_since + self.window_s
        stretched = keys.window_s or self.max_s
        return keys.dirty_since + min(max(stretched, self.window_s), self.max_s)

    def next_window(self, keys: _Dirty, now: float) -> float:
        """The window of the batch after the one due now: as long as the rate of this one
        (its keys over its age) takes to bring min_keys, within [window_s, max_s]."""
        n = len(keys.dirty)
        age = now - keys.dirty_since
        if self.max_s <= self.window_s or not n or age <= 0:
            return self.window_s
        return min(max(self.min_keys * age / n, self.window_s), self.max_s)

    def ends_now(self, keys: _Dirty, now: float) -> bool:
        """Whether the report loop sends what is dirty now (its window ends within
        SEND_AHEAD_S); a source's read ahead of the window asks the same question."""
        return self.due(keys) - now <= SEND_AHEAD_S

    def sending(self, keys: _Dirty, now: float) -> None:
        """The report loop sends what is dirty because its window ended: size the next one."""
        keys.window_s = self.next_window(keys, now)

    def read_at(self, keys: _Dirty, now: float) -> float:
        """When a source that has just read changes should read next, or 0.0 for "as usual"
        (no flush window, or nothing waiting): just before the batch is due. A batch due at
        this read (the report loop sends now) gives the next one, which starts now."""
        if not self.window_s or not keys.dirty:
            return 0.0
        if self.ends_now(keys, now):
            return now + self.next_window(keys, now) - WINDOW_EARLY_S
        return self.due(keys) - WINDOW_EARLY_S


class SourceRejected(Exception):
    """The engine on the other side is not the one this sidecar serves (config is wrong)."""


@dataclass(frozen=True)
class Identity:
    """What KVCM registration needs; `mediums` is the medium table (index -> KVCM medium)."""

    instance_id: str
    dp_rank: int
    model_name: str
    dtype: str
    use_mla: bool
    tp_size: int
    dp_size: int
    pp_size: int
    block_size_tokens: int
    block_bytes: int
    required_groups: tuple[int, ...]
    mediums: tuple[str, ...]


class Watch(enum.Enum):
    SAME = "same"  # nothing changed
    DOWN = "down"  # the engine died, closed, or stopped answering
    BACK = "back"  # the engine is alive again (maybe a new incarnation): register again


@dataclass
class WatchResult:
    event: Watch = Watch.SAME
    why: str = ""
    incarnation: int = 0


class Source(Protocol):
    kind: str
    keys: KeyState
    # Set by the source when a watch check may find something new (the engine's process
    # exited, a health probe answered): the engine watch loop checks at once.
    watch_wake: asyncio.Event

    @property
    def last_seq(self) -> int:
        """The last engine sequence number applied."""
        ...

    @property
    def dropped_total(self) -> int:
        """Transitions known lost (ring drops, stream gaps not covered)."""
        ...

    @property
    def resyncs(self) -> Counter[str]:
        """Recoveries by reason (engine snapshots on the ring; replays and forgets on ZMQ)."""
        ...

    @property
    def incarnation(self) -> int:
        """The engine life the key state belongs to (0 before one is seen)."""
        ...

    @property
    def synced(self) -> bool:
        """The key state equals the engine's truth (no snapshot awaited, no replay pending)."""
        ...

    @property
    def sync_state(self) -> str: ...

    def identity(self) -> Identity | None:
        """The replica's identity once known; raises SourceRejected if it is not ours."""
        ...

    def lag(self) -> int:
        """Transitions the engine published that the key state does not reflect yet."""
        ...

    def watch(self, engine_down: bool) -> WatchResult:
        """One liveness check (the engine watch loop calls it when `watch_wait_s` has passed
        or `watch_wake` was set)."""
        ...

    def watch_wait_s(self, engine_down: bool, now: float | None = None) -> float:
        """How long the engine watch loop may sleep after a check before the next one, on the
        shared tick (next_tick), from `now` (None: the source's clock); `watch_wake` cuts it
        short."""
        ...

    def take_forget(self) -> bool:
        """True once after the source emptied the key state because it lost track of the
        engine: KVCM must get an authoritative snapshot (forget the replica's keys)."""
        ...

    def loops(self, work: Work) -> dict[str, Awaitable[None]]:
        """The source's long-lived loops (named), run in the daemon's TaskGroup: they feed the
        key state until cancelled, set `work` when it changed, and call `work.awake()` at every
        turn (periodic work rides those wake-ups: sidecar/wakeups.py)."""
        ...

    async def final_drain(self) -> None:
        """At shutdown: apply what is already there, persist what must survive a restart."""
        ...

    def status(self) -> dict[str, Any]: ...
