"""Producer (engine) side of the ring: one writer per segment, never blocks, never locks.

Imports: stdlib, numpy, posix_ipc (via segment). Invariants: slots are written before their seq
column and the seq column before the tail, each cursor is one aligned 8-byte store (x86-64 TSO
keeps them in order; see docs/ring.md for weaker memory models); a full ring drops the newest
records and adds them to the exact `dropped` count; sequence numbers are dense per incarnation.
"""

from __future__ import annotations

import os
import secrets
import time
from array import array
from typing import Any

import numpy as np

from sidecar.shm_ring import compiled
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.doorbell import Bell
from sidecar.shm_ring.segment import Segment, pid_alive, pid_namespace

_U64 = (1 << 64) - 1
WORDS_MAX = 4096  # records per write_words()/write_runs() call (zero parents from one buffer)
_ZEROS = memoryview(array("Q", bytes(8 * WORDS_MAX)))
SEQ_BLOCK = 1 << 16  # sequence words made ahead, one numpy call per block (not per flush)
_W_ATTEMPTED, _W_LAST_SEQ, _W_TAIL, _W_READER_IDLE, _W_HEAD_SEEN = (
    L.W_ATTEMPTED,
    L.W_LAST_SEQ,
    L.W_TAIL,
    L.W_READER_IDLE,
    L.W_HEAD_SEEN,
)


class ProducerConflict(Exception):
    """Another live producer is attached to this ring (two engines for one dp_rank?)."""


class RingWriter:
    def __init__(self, segment: Segment, *, descriptor: bytes = b"") -> None:
        self.seg = segment
        h = segment.hdr
        other = int(h[L.W_PID])
        if (
            h[L.W_PRODUCER_STATE] == L.PRODUCER_ATTACHED
            and other != os.getpid()
            and int(h[L.W_PIDNS]) == pid_namespace()
            and pid_alive(other)
        ):
            raise ProducerConflict(f"ring {segment.name} already has a live producer pid={other}")
        self.capacity = segment.capacity
        self._bell = Bell(segment.name)  # wakes a reader that sleeps on it
        self._mask = self.capacity - 1
        self._slots = segment.slots
        self._words = segment.slot_words
        self.boot_id = secrets.randbits(64) | 1
        self._tail = int(h[L.W_TAIL])
        head = int(h[L.W_HEAD])
        # A reader cursor outside [tail - capacity, tail] is garbage (as in free_slots): trust it
        # and the free count could exceed the ring, overwriting unread slots. Start empty.
        self._head_cache = head if 0 <= self._tail - head <= self.capacity else self._tail
        h[L.W_HEAD_SEEN] = self._head_cache
        self._seq = 0
        self._dropped = int(h[L.W_DROPPED])
        self._attempted = int(h[L.W_ATTEMPTED])
        self._seq_base = 0  # _seq_block holds the seqs _seq_base + 1 ... _seq_base + SEQ_BLOCK
        self._seq_block = memoryview(array("Q"))
        self._meta_runs: dict[int, memoryview] = {}  # meta -> that word WORDS_MAX times
        self._closed = False
        if descriptor:
            segment.write_descriptor(descriptor)
        # Publish the new incarnation under the seqlock so the reader never sees a mix of two.
        h[L.W_INC_GEN] = int(h[L.W_INC_GEN]) | 1
        h[L.W_BOOT_ID] = self.boot_id
        h[L.W_PID] = os.getpid()
        h[L.W_START_NS] = time.time_ns()
        h[L.W_INC_START_POS] = self._tail
        h[L.W_PIDNS] = pid_namespace()
        h[L.W_LAST_SEQ] = 0
        h[L.W_INC_GEN] = int(h[L.W_INC_GEN]) + 1
        h[L.W_LIVENESS_NS] = time.monotonic_ns()
        h[L.W_PRODUCER_STATE] = L.PRODUCER_ATTACHED

    def _sync(self) -> None:
        """The producer cursors (and the cached reader cursor) from the header's own words,
        which every publish ends by storing: a flush in C (_accel.Publisher, the hook's)
        publishes without this object. Only at the start of a write, by whoever publishes
        (the hook's token holder): a write moves these fields ahead of the header until its
        last store, and a sync from another thread in between would roll them back."""
        h = self.seg.hdr
        self._tail, self._seq = h[_W_TAIL], h[_W_LAST_SEQ]
        self._attempted, self._head_cache = h[_W_ATTEMPTED], h[_W_HEAD_SEEN]

    @property
    def last_seq(self) -> int:
        """The last published seq (from any thread: it reads the header, syncs nothing)."""
        return self._seq if self._closed else int(self.seg.hdr[_W_LAST_SEQ])

    @property
    def dropped(self) -> int:
        return self._dropped

    def free_slots(self, wanted: int = 1) -> int:
        free = self.capacity - (self._tail - self._head_cache)
        if free < wanted:  # the cached head is stale at worst; one 8-byte load refreshes it
            head = int(self.seg.hdr[L.W_HEAD])
            # A reader cursor outside [tail - capacity, tail] is garbage; keep the cached one.
            if 0 <= self._tail - head <= self.capacity:
                self._head_cache = self.seg.hdr[_W_HEAD_SEEN] = head
            free = self.capacity - (self._tail - self._head_cache)
        return free

    def write(
        self, keys: np.ndarray, metas: np.ndarray | int, parents: np.ndarray | None = None
    ) -> int:
        """Append len(keys) records; returns how many were accepted (the rest count as dropped)."""
        n = len(keys)
        if n == 0:
            return 0
        m = self._room(n)
        if m:
            start = self._tail & self._mask
            first = min(m, self.capacity - start)
            seqs = np.arange(self._seq + 1, self._seq + 1 + m, dtype=np.uint64)
            kv = keys[:m].view(np.uint64) if keys.dtype == np.int64 else keys[:m].astype(np.uint64)
            mv = metas if isinstance(metas, int) else metas[:m].view(np.uint64)
            pv = 0 if parents is None else parents[:m].view(np.uint64)
            for dst, lo, hi in ((start, 0, first), (0, first, m)):
                if hi <= lo:
                    continue
                block = self._slots[dst : dst + hi - lo]
                block[:, L.C_KEY] = kv[lo:hi]
                block[:, L.C_META] = mv if isinstance(mv, int) else mv[lo:hi]
                block[:, L.C_PARENT] = pv if isinstance(pv, int) else pv[lo:hi]
                block[:, L.C_SEQ] = seqs[
                    lo:hi
                ]  # seq after the payload: a slot is valid once it matches
            self._seq += m
            self._tail += m
        self._publish(n, m)
        return m

    def write_words(self, keys: array[int], metas: array[int]) -> int:
        """write() for a step's worth of records (at most WORDS_MAX) given as 'Q' arrays: strided
        word copies, no numpy call (after an engine step's sleep each numpy call costs 10-30 us
        of cold caches on a VM, far more than the copy itself at this size)."""
        n = len(keys)
        if n == 0:
            return 0
        m = self._room(n)
        if m:
            self._put_words(memoryview(keys), memoryview(metas), m)
        self._publish(n, m)
        return m

    def write_step(self, runs: list[tuple[Any, int]]) -> tuple[int, int] | None:
        """An engine step's staged calls, if each staged a 'Q' word array (or, in C, one int
        key) with its meta: (records accepted, records). None: something else was staged,
        nothing is written (the caller takes the general path). The usual case (all fit, no
        wrap) is one C call (_accel.put_runs: slots and header stores); else write_runs()."""
        accel = compiled.accel
        if accel is None:
            n = 0
            for item, meta in runs:
                if type(item) is not array or item.typecode != "Q" or type(meta) is not int:
                    return None  # (single int keys too: the caller's scalar path takes them)
                if not 0 <= meta < 1 << 64:
                    return None
                n += len(item)
            # Past WORDS_MAX records: the caller's general path here, put_runs in C (the ring
            # and the resident set end the same either way).
            return (self.write_runs(runs, n), n) if n <= WORDS_MAX else None
        self._sync()  # (write_runs syncs itself)
        tail = self._tail
        start = tail & self._mask
        room = min(self.capacity - start, self.capacity - (tail - self._head_cache))
        h = self.seg.hdr
        n = accel.put_runs(runs, self._words, h, start, room, self._seq, self._attempted, tail)
        if n < 0:
            if n == -1:
                return None
            n = -2 - n  # a wrap, or too little room
            return (self._write_runs_slow(runs, n), n) if n <= WORDS_MAX else None
        # put_runs stored the slots, then attempted, last seq and (last) the tail
        self._seq += n
        self._tail = tail + n
        self._attempted += n
        if h[_W_READER_IDLE]:
            self._bell.ring_if_idle(h)
        return n, n

    def write_runs(self, runs: list[tuple[array[int], int]], n: int) -> int:
        """write() for an engine step's calls: `runs` of (keys as a 'Q' array, one meta for the
        run), n <= WORDS_MAX records in all. In the usual case (all fit, no wrap) each run's
        columns are copied straight into the slots, inline: no list, array or int per record
        and few calls (on a VM whose caches went cold during the engine's step each distinct
        call or object touched costs microseconds)."""
        self._sync()
        tail = self._tail
        start = tail & self._mask
        if start + n > self.capacity or (
            n > self.capacity - (tail - self._head_cache) and n > self.free_slots(n)
        ):
            return self._write_runs_slow(runs, n)  # a wrap, or too little room
        at = self._seq - self._seq_base
        if at + n > len(self._seq_block):
            at = self._next_seq_block(n)
        sw = self._words
        b = b0 = start << 2
        meta_runs = self._meta_runs
        for kw, meta in runs:
            k = len(kw)
            e = b + (k << 2)
            sw[b + 1 : e : 4] = kw
            sw[b + 2 : e : 4] = (meta_runs.get(meta) or self._meta_run(meta))[:k]
            sw[b + 3 : e : 4] = _ZEROS[:k]
            b = e
        sw[b0:b:4] = self._seq_block[at : at + n]  # seq after the payload, as in write()
        self._seq = seq = self._seq + n
        self._tail = tail = tail + n
        self._attempted = attempted = self._attempted + n
        h = self.seg.hdr
        h[_W_ATTEMPTED] = attempted
        h[_W_LAST_SEQ] = seq
        h[_W_TAIL] = tail  # the publishing store
        if h[_W_READER_IDLE]:
            self._bell.ring_if_idle(h)
        return n

    def _write_runs_slow(self, runs: list[tuple[Any, int]], n: int) -> int:
        m = self._room(n)
        if m:
            kw, mw = array("Q"), array("Q")
            for keys, meta in runs:
                if type(keys) is int:  # a single key (put_runs takes those; see write_step)
                    kw.append(keys & _U64)
                    mw.append(meta)
                    continue
                kw += keys
                mw.extend((self._meta_runs.get(meta) or self._meta_run(meta))[: len(keys)])
            self._put_words(memoryview(kw), memoryview(mw), m)
        self._publish(n, m)
        return m

    def _put_words(self, kv: memoryview, mv: memoryview, m: int) -> None:
        """Write the first m records (m <= the free slots) in at most two pieces."""
        start = self._tail & self._mask
        sw = self._words
        first = min(m, self.capacity - start)
        seqs = self._seqs(m)
        for dst, lo, hi in ((start, 0, first), (0, first, m)):
            if hi <= lo:
                continue
            b, e = dst << 2, (dst + hi - lo) << 2
            sw[b + 1 : e : 4] = kv[lo:hi]
            sw[b + 2 : e : 4] = mv[lo:hi]
            sw[b + 3 : e : 4] = _ZEROS[: hi - lo]
            sw[b:e:4] = seqs[lo:hi]  # seq after the payload
        self._seq += m
        self._tail += m

    def _seqs(self, m: int) -> memoryview:
        """Words self._seq + 1 ... self._seq + m (m <= WORDS_MAX), from the block made ahead."""
        at = self._seq - self._seq_base
        if at + m > len(self._seq_block):
            at = self._next_seq_block(m)
        return self._seq_block[at : at + m]

    def _next_seq_block(self, m: int) -> int:
        block = np.arange(self._seq + 1, self._seq + 1 + max(SEQ_BLOCK, m), dtype=np.uint64)
        self._seq_block = block.data.cast("B").cast("Q")
        self._seq_base = self._seq
        return 0

    def _meta_run(self, meta: int) -> memoryview:
        run = self._meta_runs[meta] = memoryview(array("Q", [meta]) * WORDS_MAX)
        return run

    def write_pairs(self, pairs: list[tuple[int, int]]) -> int:
        """Scalar path for a few records: plain word stores, no numpy call overhead.

        `pairs` are (key, meta) with key already in [-2^63, 2^64); same semantics as write().
        """
        n = len(pairs)
        m = self._room(n)
        sw = self._words
        mask = self._mask
        tail = self._tail
        seq = self._seq
        for k, meta in pairs[:m]:
            base = (tail & mask) << 2
            sw[base + 1] = k & _U64
            sw[base + 2] = meta
            sw[base + 3] = 0
            seq += 1
            sw[base] = seq  # seq after the payload, as in write()
            tail += 1
        self._seq = seq
        self._tail = tail
        self._publish(n, m)
        return m

    def _room(self, n: int) -> int:
        """How many of n records to write (drop-newest beyond the free slots); all n count as
        attempted."""
        self._sync()
        self._attempted += n
        free = self.free_slots(n)
        return n if n <= free else max(free, 0)

    def _publish(self, n: int, m: int) -> None:
        """After m of n records were written: counters, the tail (the publishing store), then
        the doorbell if the reader sleeps."""
        h = self.seg.hdr
        if m < n:
            self._dropped += n - m
            h[L.W_DROPPED] = self._dropped
        h[L.W_ATTEMPTED] = self._attempted
        h[L.W_LAST_SEQ] = self._seq
        h[L.W_TAIL] = self._tail  # the publishing store
        if m:
            self._bell.ring_if_idle(h)

    def ring_if_idle(self) -> None:
        """Ring the reader's doorbell if it sleeps on it."""
        self._bell.ring_if_idle(self.seg.hdr)

    def stamp(self) -> None:
        self.seg.hdr[L.W_LIVENESS_NS] = time.monotonic_ns()

    def close(self) -> None:
        self._sync()
        self._closed = True
        h = self.seg.hdr
        if int(h[L.W_BOOT_ID]) == self.boot_id:
            h[L.W_PRODUCER_STATE] = L.PRODUCER_CLOSED
