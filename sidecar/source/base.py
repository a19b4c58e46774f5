"""What the publisher asks of a source: the replica's identity, liveness, sync and counters.

Imports: stdlib + key_state. A source feeds (key, medium, group, kind) transitions into the one
KeyState, keeps it equal to the engine's truth (or, when it cannot, empties it and asks for an
authoritative snapshot: a forget), and tells the publisher who the engine is and whether it lives.
The publisher knows nothing else about rings or sockets.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sidecar.key_state import KeyState

Sleep = Callable[[float], Awaitable[None]]
# While changes wait for their flush window, a source reads its engine once, this long before
# the window ends, rather than at every engine step (each wake-up of the event loop costs more
# than a step's records): the report loop, woken by that read, sends at once whatever is this
# close to its window's end, so read and send share one wake-up. A change still never waits
# longer than the window; it may go out up to this much sooner.
WINDOW_EARLY_S = 0.002


def coalesce_until(keys: KeyState, window_s: float, now: float) -> float:
    """When a source that has just read changes should read next, or 0.0 for "as usual"
    (no flush window, or nothing waiting). A window that ends with this read (the report loop
    sends now) gives the next one, which starts now."""
    if not window_s or not keys.dirty:
        return 0.0
    until = keys.dirty_since + window_s - WINDOW_EARLY_S
    if until <= now:
        until = now + window_s - WINDOW_EARLY_S
    return until


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
        """One liveness check (the engine watch loop calls it every watch interval)."""
        ...

    def take_forget(self) -> bool:
        """True once after the source emptied the key state because it lost track of the
        engine: KVCM must get an authoritative snapshot (forget the replica's keys)."""
        ...

    def loops(self, work: asyncio.Event) -> dict[str, Awaitable[None]]:
        """The source's long-lived loops (named), run in the daemon's TaskGroup: they feed the
        key state until cancelled and set `work` when it changed."""
        ...

    async def final_drain(self) -> None:
        """At shutdown: apply what is already there, persist what must survive a restart."""
        ...

    def status(self) -> dict[str, Any]: ...
