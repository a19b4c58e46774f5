"""Wake-ups of the event loop, shared: the report loop's signal, and periodic work that runs on
a wake-up the process has anyway.

Imports: stdlib only (sources and the daemon both use it). Each wake-up of the event loop costs
~0.2-0.3 ms of CPU on a VM however little it does (bench.wake_floor). While an engine writes,
its source's loop wakes at least once per flush window; the heartbeat (every second) and the
ring's engine watch (every half second) each took wake-ups of their own besides: at 5 k events/s,
~1.8 a second on top of ~23 (bench.pace, counted with strace).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# A ride this close to its due time ends at the wake-up at hand: the event loop's timers fire a
# hair early (libuv counts whole milliseconds from the clock read when the loop's turn began),
# so a source's poll due on the same tick as the heartbeat can come just before it.
RIDE_EARLY_S = 0.002


class Ride:
    """One periodic wait (Rides.at); `fn` runs once when it ends, unless cancelled."""

    __slots__ = ("due", "fn", "timer")

    def __init__(self, due: float, fn: Callable[[], None]) -> None:
        self.due = due
        self.fn = fn
        self.timer: asyncio.TimerHandle | None = None


class Rides:
    """Periodic waits that end at the first wake-up of the loop from their due time on (a
    source's loop calls `Work.awake`, which pokes, at every turn), or `late_s` after it when
    none comes.

    With `late_s` above the longest flush window, a busy sidecar's heartbeat and engine watch
    take no wake-up of their own; an idle one's end on their own timers (the periodic loops
    share the tick, next_tick, and the source's idle poll, which pokes, is on it too). A ride
    may end up to RIDE_EARLY_S before it is due: callers schedule from `now()`, that much
    ahead, or from the tick the ride was for, so a ride that ended early is not due again at
    once. A periodic job's lateness is also bounded by `share` of its period (`late_for`):
    with a period shorter than a window, a ride ended by its own timer late_s after the tick
    would be past the next tick, and every other tick would be lost."""

    def __init__(self, late_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.late_s = late_s
        self.share = 0.25
        self.clock = clock
        self._rides: set[Ride] = set()
        self.shared = 0  # rides ended by a poke (no wake-up of their own)
        self.alone = 0  # rides ended by their own timer

    def now(self) -> float:
        """The time to schedule the next ride from (RIDE_EARLY_S ahead: see the class)."""
        return self.clock() + RIDE_EARLY_S

    def late_for(self, period: float) -> float:
        """How late a ride of a job run every `period` may end: late_s, or `share` of it."""
        return min(self.late_s, period * self.share)

    def at(self, delay: float, fn: Callable[[], None], late_s: float | None = None) -> Ride:
        """Run `fn` at the first poke `delay` from now on, or `late_s` (default: the Rides')
        later on its own."""
        r = Ride(self.clock() + delay, fn)
        late = self.late_s if late_s is None else late_s
        r.timer = asyncio.get_running_loop().call_later(max(delay, 0.0) + late, self._end, r, False)
        self._rides.add(r)
        return r

    def cancel(self, r: Ride) -> None:
        self._rides.discard(r)
        if r.timer is not None:
            r.timer.cancel()

    def poke(self) -> None:
        """The loop is awake anyway: end the rides due by now."""
        if not self._rides:
            return
        t = self.clock() + RIDE_EARLY_S
        for r in [r for r in self._rides if r.due <= t]:
            self._end(r, True)

    def _end(self, r: Ride, shared: bool) -> None:
        if r not in self._rides:
            return
        self.cancel(r)
        if shared:
            self.shared += 1
        else:
            self.alone += 1
        r.fn()

    async def sleep(self, delay: float, late_s: float | None = None) -> None:
        """Sleep as a ride: at least `delay` (less RIDE_EARLY_S), at most `delay + late_s`."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        r = self.at(delay, lambda: _wake(fut), late_s)
        try:
            await fut
        finally:
            self.cancel(r)


class Work(asyncio.Event):
    """The report loop's signal (a source read changed keys, the engine watch, a leader
    change); each set also calls `also` (the client's poke: a held answer is read while the
    loop is awake anyway, kvcm_client/transport.py Hold). `awake()`: a source's loop turn,
    on which periodic work that is due rides (Rides)."""

    def __init__(self, rides: Rides | None = None) -> None:
        super().__init__()
        self.also: Callable[[], None] | None = None
        self.rides = rides

    def set(self) -> None:
        super().set()
        if self.also is not None:
            self.also()

    def awake(self) -> None:
        if self.rides is not None:
            self.rides.poke()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
