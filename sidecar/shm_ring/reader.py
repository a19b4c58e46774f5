"""Reader (sidecar) side of the ring: copies records out, validates them, reports losses.

Imports: stdlib, numpy, posix_ipc (via segment). Invariants: the slot at ring position p of an
incarnation that started at position s carries seq p - s + 1, so every record is checked against
its position and a torn or foreign slot is never accepted; the tail is loaded before the
incarnation so a record is never attributed to an older incarnation than its own. The copy is
one C pass when built (_accel.ring_copy: each slot's seq loaded first, with acquire semantics,
then its payload), else numpy (the reference).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sidecar.shm_ring import compiled
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.segment import Segment

# KeyState.fold_ring: (hdr, slots, head, base, generation, dropped seen) -> records or -1
Fold = Callable[["memoryview[int]", np.ndarray, int, int, int, int], int]
_NO_RECORDS = np.empty((0, 4), np.uint64)
_NO_RECORDS.flags.writeable = False


class ReaderConflict(Exception):
    """Another process already reads this ring (a second sidecar for the same replica)."""


@dataclass(frozen=True)
class Incarnation:
    boot_id: int
    pid: int
    start_ns: int
    start_pos: int
    pidns: int


@dataclass(slots=True)
class ReadResult:
    records: np.ndarray  # (n, 4) uint64 copy: seq, key, meta, parent
    incarnation: Incarnation | None
    new_incarnation: bool = False  # records (if any) all belong to a producer not seen before
    dropped: int = 0  # records the producer dropped since the previous read
    gap: bool = False  # a slot failed validation; the rest of the published range was skipped
    anomalies: list[str] = field(default_factory=list)
    last_seq: int = 0  # the seq of the last record (when there are records)
    # What the records hold, when the read could tell (the C copy): the highest medium index of
    # a record that is not a clear (255: not known), and whether any is a clear.
    max_medium: int = 255
    clears: bool = True


class RingReader:
    def __init__(self, segment: Segment, *, exclusive: bool = True) -> None:
        self.seg = segment
        self.capacity = segment.capacity
        self._mask = self.capacity - 1
        self._lock_fd: int | None = None
        if exclusive:
            self._lock_fd = self._take_reader_lock(segment.name)
        h = segment.hdr
        self.incarnation_id = secrets.randbits(64) | 1
        h[L.W_READER_PID] = os.getpid()
        h[L.W_READER_INCARNATION] = self.incarnation_id
        h[L.W_READER_LIVENESS_NS] = time.monotonic_ns()
        head = int(h[L.W_HEAD])
        tail = int(h[L.W_TAIL])
        if not 0 <= tail - head <= self.capacity:
            head = tail
        self.head = head
        self.dropped_seen = int(h[L.W_DROPPED])
        self.incarnation: Incarnation | None = None
        self.records_read = 0
        self.folded_seq = 0  # the seq of the last record read_folded() read
        self._inc_gen = -1  # the seqlock generation _inc was read at
        self._inc: Incarnation | None = None

    @staticmethod
    def _take_reader_lock(ring_name: str) -> int:
        fd = os.open(L.reader_lock_path(ring_name), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ReaderConflict(f"another process already reads ring {ring_name}") from None
        return fd

    def read_incarnation(self) -> Incarnation | None:
        """Seqlock read of the producer identity; None while no producer ever attached."""
        h = self.seg.hdr
        for _ in range(100):
            g1 = int(h[L.W_INC_GEN])
            if g1 & 1:
                continue
            if g1 == self._inc_gen and self._inc is not None:
                return self._inc  # unchanged since the last read (the writer bumps it twice)
            inc = Incarnation(
                int(h[L.W_BOOT_ID]),
                int(h[L.W_PID]),
                int(h[L.W_START_NS]),
                int(h[L.W_INC_START_POS]),
                int(h[L.W_PIDNS]),
            )
            if int(h[L.W_INC_GEN]) == g1:
                if not inc.boot_id:
                    return None
                self._inc_gen, self._inc = g1, inc
                return inc
        return None

    def lag(self) -> int:
        lag = int(self.seg.hdr[L.W_TAIL]) - self.head
        return lag if 0 <= lag <= self.capacity else 0

    def idle(self) -> bool:
        """True when nothing new was published and nothing was dropped (two 8-byte loads)."""
        h = self.seg.hdr
        return int(h[L.W_TAIL]) == self.head and int(h[L.W_DROPPED]) == self.dropped_seen

    def read(self, max_records: int = 1 << 20) -> ReadResult:
        h = self.seg.hdr
        tail = int(h[L.W_TAIL])  # before the incarnation: see the module invariant
        # read_incarnation(), whose usual answer is this (an even generation seen before).
        inc = self._inc if int(h[L.W_INC_GEN]) == self._inc_gen else self.read_incarnation()
        h[L.W_READER_LIVENESS_NS] = time.monotonic_ns()
        result = ReadResult(_NO_RECORDS, inc)
        dropped = int(h[L.W_DROPPED])
        if dropped != self.dropped_seen:
            result.dropped = max(dropped - self.dropped_seen, 0)
            self.dropped_seen = dropped
        if inc is None:
            return result
        if self.incarnation is None or inc.boot_id != self.incarnation.boot_id:
            result.new_incarnation = self.incarnation is not None
            self.incarnation = inc
            if self.head < inc.start_pos:
                self._advance(inc.start_pos)  # older incarnations' records describe a dead cache
        head = self.head
        n = tail - head
        if not 0 <= n <= self.capacity:
            result.anomalies.append(f"cursor out of range: head={head} tail={tail}")
            result.gap = True
            self._advance(tail)
            return result
        n = min(n, max_records)
        if n == 0:
            return result
        start = head & self._mask
        out = np.empty((n, 4), np.uint64)
        base = head - inc.start_pos + 1
        c = compiled.accel
        copy = getattr(c, "ring_copy", None) if c is not None and base >= 1 else None
        if copy is not None:  # one pass in C; None: no build, or a stale one
            got, clears, result.max_medium = copy(self.seg.slots, start, n, base, out)
            result.clears = bool(clears)
            bad = got if got < n else -1
        else:
            first = min(n, self.capacity - start)
            out[:first] = self.seg.slots[start : start + first]
            if first < n:
                out[first:] = self.seg.slots[: n - first]
            good = out[:, L.C_SEQ] == np.arange(base, base + n, dtype=np.uint64)
            bad = -1 if good.all() else int(np.argmin(good))
        if bad >= 0:
            # The C copy stops before the bad slot: its seq is read again, for the message.
            row = out[bad] if copy is None else self.seg.slots[(head + bad) & self._mask]
            seq = int(row[L.C_SEQ])
            result.anomalies.append(
                f"slot seq mismatch at position {head + bad}: seq={seq} expected={base + bad}"
            )
            result.gap = True
            out = out[:bad]
            self._advance(tail)
        else:
            self.head = h[L.W_HEAD] = head + n  # _advance()
        result.records = out
        result.last_seq = base + len(out) - 1
        self.records_read += len(out)
        return result

    def read_folded(self, fold: Fold, boot_id: int) -> int:
        """read() and its fold in one call (KeyState.fold_ring) when nothing is unusual: the
        incarnation `boot_id`, seen before at the generation still in the header, no new
        drops, every record valid. Records read, or -1 with nothing read (then read())."""
        inc = self._inc
        cur = self.incarnation
        head = self.head
        if (
            inc is None
            or cur is None
            or inc.boot_id != boot_id
            or cur.boot_id != boot_id
            or head < inc.start_pos
        ):
            return -1
        base = head - inc.start_pos + 1
        seg = self.seg
        m = fold(seg.hdr, seg.slots, head, base, self._inc_gen, self.dropped_seen)
        if m > 0:  # folded and queued: only now may the producer reuse their slots
            self._advance(head + m)
            self.records_read += m
            self.folded_seq = base + m - 1
        return m

    def _advance(self, pos: int) -> None:
        self.head = pos
        self.seg.hdr[L.W_HEAD] = pos

    def skip_to_tail(self) -> None:
        """Discard everything published so far (used after a reader restart before a resync)."""
        self._advance(int(self.seg.hdr[L.W_TAIL]))

    def producer_state(self) -> int:
        return int(self.seg.hdr[L.W_PRODUCER_STATE])

    def producer_liveness_ns(self) -> int:
        return int(self.seg.hdr[L.W_LIVENESS_NS])

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
