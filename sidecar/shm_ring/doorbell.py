"""Doorbells: POSIX semaphores each side posts to wake the other when it sleeps.

Imports: stdlib + posix_ipc + layout. An idle sidecar polls the ring at most every
`ring.idle_poll_interval_s` (each wake-up of its event loop costs ~0.2 ms of CPU, so it cannot
poll fast and stay within 1 % of a core), which delayed the first records after a quiet spell
by up to that interval. Now the reader sets `reader_idle` in the header before it sleeps, and a
producer that publishes records while the flag is set posts `<ring>.bell` (at most one pending
post: a reader killed while asleep costs each flush a userspace read, not a syscall). A thread
of the sidecar waits on the semaphore and wakes the event loop. The flag and the tail are plain
stores and loads, so on a rare interleaving both sides miss each other (Python has no fence):
then the poll interval bounds the delay, as before. The reader creates the semaphore; like the
ring segment it outlives both processes (`segment.unlink` removes it).
The other way round, the engine hook's flusher thread sleeps on `<ring>.snapbell` (up to the 1 s
liveness stamp); the reader posts it after writing a snapshot request so an idle engine answers
at once, and the hook posts it itself when an engine stages a record after a quiet spell.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
from collections.abc import Callable

import posix_ipc

from sidecar.shm_ring import layout as L


class Bell:
    """Producer side: post when the reader sleeps. Never raises (it runs in the engine)."""

    def __init__(self, ring_name: str) -> None:
        self.name = L.doorbell_name(ring_name)
        self._sem: posix_ipc.Semaphore | None = None

    def ring_if_idle(self, hdr: memoryview) -> None:
        if not hdr[L.W_READER_IDLE]:
            return
        try:
            if self._sem is None:
                self._sem = posix_ipc.Semaphore(self.name)  # created by the reader
            if self._sem.value == 0:
                self._sem.release()
        except (posix_ipc.Error, OSError, ValueError):
            self._sem = None  # no bell (an older sidecar): it polls, as before


class Listener:
    """Reader side: a thread that calls `on_ring` whenever the producer rings."""

    POLL_S = 30.0  # a safety net only: close() posts the semaphore to stop the thread

    def __init__(self, ring_name: str, hdr: memoryview, on_ring: Callable[[], None]) -> None:
        self.hdr = hdr
        hdr[L.W_READER_IDLE] = 0  # a reader killed while asleep left it set
        self.sem = posix_ipc.Semaphore(
            L.doorbell_name(ring_name), posix_ipc.O_CREAT, mode=0o600, initial_value=0
        )
        self.on_ring = on_ring
        self.rung = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcm-doorbell", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self.sem.acquire(self.POLL_S)
            except posix_ipc.BusyError:
                continue
            except posix_ipc.Error:
                return  # the semaphore went away: the reader polls, as before
            if self._closed.is_set():
                return
            self.rung += 1
            try:
                self.on_ring()
            except RuntimeError:
                return  # the event loop is closed

    def asleep(self, flag: bool) -> None:
        self.hdr[L.W_READER_IDLE] = 1 if flag else 0

    def close(self) -> None:
        """Stop the thread, then close the semaphore (never while the thread waits on it)."""
        self.asleep(False)
        self._closed.set()
        with contextlib.suppress(posix_ipc.Error):
            self.sem.release()  # wake the thread now rather than at its next timeout
        self._thread.join(5.0)
        if not self._thread.is_alive():
            with contextlib.suppress(posix_ipc.Error):
                self.sem.close()


class EngineBell:
    """Producer side of `<ring>.snapbell`: what the hook's flusher sleeps on. Never raises.

    Without POSIX semaphores it falls back to a process-local lock used as a binary semaphore:
    the hook still wakes itself, and a snapshot request waits for the next liveness stamp."""

    def __init__(self, ring_name: str) -> None:
        self.name = L.snapshot_bell_name(ring_name)
        self._sem: posix_ipc.Semaphore | None = None
        self._lock = _thread.allocate_lock()
        self._lock.acquire()  # held = nothing posted
        try:
            self._sem = posix_ipc.Semaphore(
                self.name, posix_ipc.O_CREAT, mode=0o600, initial_value=0
            )
            while self._sem.value:  # posts meant for an earlier incarnation
                self._sem.acquire(0)
        except (posix_ipc.Error, OSError, ValueError):
            self._sem = None

    def post(self) -> None:
        try:
            if self._sem is not None:
                self._sem.release()
            else:
                self._lock.release()
        except (posix_ipc.Error, RuntimeError, ValueError):
            pass  # already posted (the lock was free), or the semaphore went away

    def wait(self, timeout: float) -> bool:
        """Sleep until posted (True) or `timeout` seconds pass (False)."""
        timeout = max(timeout, 0.0)
        if self._sem is None:
            return self._lock.acquire(True, timeout)
        try:
            self._sem.acquire(timeout)
            return True
        except posix_ipc.BusyError:
            return False
        except (posix_ipc.Error, ValueError):
            self._sem = None  # removed under us: keep going on the local lock
            return self._lock.acquire(True, timeout)

    def close(self) -> None:
        if self._sem is not None:
            with contextlib.suppress(posix_ipc.Error):
                self._sem.close()
            self._sem = None


def ring_engine(ring_name: str) -> None:
    """Reader side: wake the producer's flusher (after a snapshot request). At most one post is
    pending; a producer without the semaphore (older, or a C producer that polls) is skipped."""
    try:
        sem = posix_ipc.Semaphore(L.snapshot_bell_name(ring_name))
    except (posix_ipc.Error, OSError, ValueError):
        return
    try:
        if sem.value == 0:
            sem.release()
    except (posix_ipc.Error, ValueError):
        pass
    finally:
        with contextlib.suppress(posix_ipc.Error):
            sem.close()
