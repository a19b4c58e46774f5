"""Create-or-attach one ring segment (POSIX shm, mode 0600) and expose typed views of it.

Imports: stdlib, numpy, posix_ipc. Invariants: either side may create the segment; the creator
initialises it under a non-blocking flock that no one holds in steady state, so a crashed creator
never wedges the other side; nobody ever shrinks or unlinks a segment the other side may map.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import time

import numpy as np
import posix_ipc

from sidecar.shm_ring import layout as L


class SegmentBusy(Exception):
    """The segment is being initialised by another process; try again shortly."""


def _flock_nb(fd: int, budget_s: float) -> bool:
    deadline = time.monotonic() + budget_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            # Initialisation holds the lock for microseconds; this loop only runs at attach.
            time.sleep(0.0005)


class Segment:
    """A mapped ring segment. `hdr` is the u64 header view; `slots` the (capacity, 4) u64 view."""

    def __init__(
        self,
        name: str,
        capacity: int | None = None,
        *,
        create: bool = True,
        lock_budget_s: float = 0.05,
    ) -> None:
        if capacity is not None and not L.valid_capacity(capacity):
            raise L.LayoutError(f"ring capacity {capacity} must be a power of two in [8, 2^26]")
        self.name = name
        flags = posix_ipc.O_CREAT if create else 0
        try:
            shm = posix_ipc.SharedMemory(name, flags, mode=0o600)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(errno.ENOENT, f"no ring segment {name}") from exc
        fd = shm.fd
        try:
            if not _flock_nb(fd, lock_budget_s):
                raise SegmentBusy(f"ring segment {name} is being initialised by another process")
            try:
                size = os.fstat(fd).st_size
                created = size == 0
                if created:
                    if not create:
                        raise SegmentBusy(f"ring segment {name} is not initialised yet")
                    cap = capacity or L.DEFAULT_CAPACITY_SLOTS
                    os.fchmod(fd, 0o600)
                    os.ftruncate(fd, L.segment_bytes(cap))
                    size = L.segment_bytes(cap)
                self._mm = mmap.mmap(fd, size)
                self.hdr = memoryview(self._mm).cast("B")[: L.HEADER_SIZE].cast("Q")
                if created or self.hdr[L.W_MAGIC] == 0:
                    # An empty or half-initialised segment (its creator died inside this block).
                    cap = (size - L.HEADER_SIZE) // L.SLOT_SIZE
                    self._init_header(cap)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self.created = created
        try:
            self._validate(size, capacity)
        except L.LayoutError:
            self.close()
            raise
        self.capacity = int(self.hdr[L.W_CAPACITY])
        self.slots: np.ndarray = np.ndarray(
            (self.capacity, 4), dtype=np.uint64, buffer=self._mm, offset=L.HEADER_SIZE
        )
        # Word view of the slots for the writer's scalar path (single 8-byte stores).
        self.slot_words = memoryview(self._mm).cast("B")[L.HEADER_SIZE :].cast("Q")
        if created:
            # Fault every page in now, once, so no engine step ever pays first-touch faults.
            self.slots[:] = 0

    def _init_header(self, capacity: int) -> None:
        h = self.hdr
        for i in range(len(h)):
            h[i] = 0
        h[L.W_VERSION_SLOT] = L.LAYOUT_VERSION | (L.SLOT_SIZE << 32)
        h[L.W_CAPACITY] = capacity
        h[L.W_HEADER_SIZE] = L.HEADER_SIZE
        h[L.W_CREATED_NS] = time.time_ns()
        h[L.W_MAGIC] = L.MAGIC  # last: a non-zero magic means the header is complete

    def _validate(self, size: int, capacity: int | None) -> None:
        h = self.hdr
        if h[L.W_MAGIC] != L.MAGIC:
            raise L.LayoutError(f"ring segment {self.name}: bad magic {h[L.W_MAGIC]:#x}")
        version = int(h[L.W_VERSION_SLOT]) & 0xFFFFFFFF
        slot_size = int(h[L.W_VERSION_SLOT]) >> 32
        L.check_readable(version, slot_size)
        cap = int(h[L.W_CAPACITY])
        if int(h[L.W_HEADER_SIZE]) != L.HEADER_SIZE or not L.valid_capacity(cap):
            raise L.LayoutError(f"ring segment {self.name}: corrupt header (capacity {cap})")
        if size < L.segment_bytes(cap):
            raise L.LayoutError(f"ring segment {self.name}: {size} bytes < capacity {cap}")
        if capacity is not None and capacity != cap:
            raise L.LayoutError(
                f"ring segment {self.name} has capacity {cap}, this side asked for {capacity}: "
                "set the same ring capacity on both sides"
            )

    @property
    def version(self) -> int:
        return int(self.hdr[L.W_VERSION_SLOT]) & 0xFFFFFFFF

    def read_descriptor(self) -> bytes:
        n = int(self.hdr[L.W_DESCRIPTOR_LEN])
        if n <= 0 or n > L.DESCRIPTOR_MAX:
            return b""
        return bytes(self._mm[L.DESCRIPTOR_OFFSET : L.DESCRIPTOR_OFFSET + n])

    def write_descriptor(self, data: bytes) -> None:
        if len(data) > L.DESCRIPTOR_MAX:
            raise ValueError(f"descriptor is {len(data)} bytes, max {L.DESCRIPTOR_MAX}")
        self._mm[L.DESCRIPTOR_OFFSET : L.DESCRIPTOR_OFFSET + len(data)] = data
        self.hdr[L.W_DESCRIPTOR_LEN] = len(data)

    def close(self) -> None:
        """Unmap (never unlink: the other side may still use the segment)."""
        slots = getattr(self, "slots", None)
        if slots is not None:
            del self.slots
            self.slot_words.release()
        self.hdr.release()
        # A caller may still hold a view into the mapping; it is unmapped when that view dies.
        with contextlib.suppress(BufferError):
            self._mm.close()


def unlink(name: str) -> None:
    """Remove a ring segment, its snapshot segment and its doorbells; for tests and cleanup."""
    for n in (name, L.snapshot_segment_name(name)):
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(n)
    for n in (L.doorbell_name(name), L.snapshot_bell_name(name)):
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore(n)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(L.reader_lock_path(name))


def pid_namespace() -> int:
    """Inode of this process's pid namespace: pids are comparable only within one namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
