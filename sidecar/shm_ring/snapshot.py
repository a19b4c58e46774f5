"""Snapshot exchange through the ring header and a companion segment `<ring>.snap`.

Imports: stdlib, numpy, posix_ipc. Protocol: the reader bumps SNAP_REQ; the producer writes
(keys, group masks, medium indexes) into the companion segment, then SEQ/COUNT/DROPPED/BOOT_ID,
then SNAP_RESP = SNAP_REQ last. The snapshot equals the fold of every record with seq <= SEQ of
that incarnation (and of every record dropped before the answer), so the reader replaces its
state with it and applies only records after SEQ.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np
import posix_ipc

from sidecar.shm_ring import layout as L
from sidecar.shm_ring.doorbell import ring_engine
from sidecar.shm_ring.segment import Segment


@dataclass(frozen=True)
class Snapshot:
    req_id: int
    boot_id: int
    seq: int  # fence: the state after applying every record with seq <= this
    dropped_at: int  # the ring's dropped counter at the fence
    keys: np.ndarray  # int64
    masks: np.ndarray  # uint32 group bitmask per key
    mediums: np.ndarray  # uint8 medium index per key (0 from producers without mediums)


class SnapshotFailed(Exception):
    """The producer answered the request with an error status."""


class SnapshotWriter:
    """Producer side: owns the companion segment, reused across snapshots so pages stay warm."""

    def __init__(self, segment: Segment) -> None:
        self.seg = segment
        self.name = L.snapshot_segment_name(segment.name)
        self._mm: mmap.mmap | None = None
        self._cap = 0

    def pending_request(self) -> int:
        """The request id waiting for an answer, or 0."""
        h = self.seg.hdr
        req = int(h[L.W_SNAP_REQ])
        return req if req > int(h[L.W_SNAP_RESP]) else 0

    def _ensure(self, entries: int) -> mmap.mmap:
        if self._mm is not None and entries <= self._cap:
            return self._mm
        cap = max(entries, 1024, self._cap * 2)
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREAT, mode=0o600)
        try:
            os.fchmod(shm.fd, 0o600)
            if os.fstat(shm.fd).st_size < L.snapshot_bytes(cap):
                os.ftruncate(shm.fd, L.snapshot_bytes(cap))
            size = os.fstat(shm.fd).st_size
            self._mm = mmap.mmap(shm.fd, size)
        finally:
            os.close(shm.fd)
        self._cap = (size - L.SNAP_HEADER_SIZE) // L.SNAP_ENTRY_BYTES
        return self._mm

    def publish(
        self,
        req_id: int,
        seq: int,
        boot_id: int,
        dropped: int,
        keys: np.ndarray,
        masks: np.ndarray,
        mediums: np.ndarray | None = None,
    ) -> None:
        n = len(keys)
        mm = self._ensure(n)
        cap = self._cap
        hv = np.ndarray((8,), np.uint64, buffer=mm)
        np.ndarray((n,), np.int64, buffer=mm, offset=L.SNAP_HEADER_SIZE)[:] = keys
        np.ndarray((n,), np.uint32, buffer=mm, offset=L.SNAP_HEADER_SIZE + 8 * cap)[:] = masks
        med = np.ndarray((n,), np.uint8, buffer=mm, offset=L.SNAP_HEADER_SIZE + 12 * cap)
        med[:] = 0 if mediums is None else mediums
        del med
        hv[L.SW_COUNT] = n
        hv[L.SW_CAPACITY] = cap
        hv[L.SW_FLAGS] = L.SNAP_FLAG_MEDIUMS
        hv[L.SW_REQ] = req_id
        hv[L.SW_MAGIC] = L.SNAP_MAGIC
        del hv
        h = self.seg.hdr
        h[L.W_SNAP_SEQ] = seq
        h[L.W_SNAP_COUNT] = n
        h[L.W_SNAP_DROPPED] = dropped
        h[L.W_SNAP_BOOT_ID] = boot_id
        h[L.W_SNAP_BYTES] = L.snapshot_bytes(cap)
        h[L.W_SNAP_STATUS] = L.SNAP_OK
        h[L.W_SNAP_RESP] = req_id  # last: the answer is complete

    def fail(self, req_id: int) -> None:
        h = self.seg.hdr
        h[L.W_SNAP_STATUS] = L.SNAP_FAILED
        h[L.W_SNAP_RESP] = req_id

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def request(segment: Segment) -> int:
    """Reader side: ask for a snapshot; returns the request id to poll for."""
    h = segment.hdr
    req = max(int(h[L.W_SNAP_REQ]), int(h[L.W_SNAP_RESP])) + 1
    h[L.W_SNAP_REQ] = req
    ring_engine(segment.name)  # an idle engine's flusher sleeps up to its 1 s liveness stamp
    return req


def poll(segment: Segment, req_id: int) -> Snapshot | None:
    """Reader side: the answer to `req_id` once published, else None. Copies the data out."""
    h = segment.hdr
    if int(h[L.W_SNAP_RESP]) < req_id:
        return None
    if int(h[L.W_SNAP_RESP]) > req_id or int(h[L.W_SNAP_STATUS]) != L.SNAP_OK:
        raise SnapshotFailed(f"snapshot request {req_id} failed or was superseded")
    seq = int(h[L.W_SNAP_SEQ])
    n = int(h[L.W_SNAP_COUNT])
    boot_id = int(h[L.W_SNAP_BOOT_ID])
    dropped = int(h[L.W_SNAP_DROPPED])
    try:
        shm = posix_ipc.SharedMemory(L.snapshot_segment_name(segment.name), 0)
    except posix_ipc.ExistentialError as exc:
        raise SnapshotFailed(f"snapshot segment for {segment.name} is missing") from exc
    try:
        size = os.fstat(shm.fd).st_size
        mm = mmap.mmap(shm.fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(shm.fd)
    try:
        hv = np.ndarray((8,), np.uint64, buffer=mm)
        cap = int(hv[L.SW_CAPACITY])
        # The flags word outlives producers (the segment is reused across restarts): an older
        # producer after a newer one leaves flags set but writes 12-byte entries. Trust the
        # flags only if the size this answer's producer published matches them.
        flags = int(hv[L.SW_FLAGS])
        if int(h[L.W_SNAP_BYTES]) != L.snapshot_bytes(cap, flags):
            flags = 0
        ok = (
            int(hv[L.SW_MAGIC]) == L.SNAP_MAGIC
            and int(hv[L.SW_REQ]) == req_id
            and int(hv[L.SW_COUNT]) == n
            and int(h[L.W_SNAP_BYTES]) == L.snapshot_bytes(cap, flags)
            and L.snapshot_bytes(cap, flags) <= size
        )
        del hv
        if not ok:
            raise SnapshotFailed(f"snapshot segment does not hold the answer to request {req_id}")
        keys = np.ndarray((n,), np.int64, buffer=mm, offset=L.SNAP_HEADER_SIZE).copy()
        masks = np.ndarray((n,), np.uint32, buffer=mm, offset=L.SNAP_HEADER_SIZE + 8 * cap).copy()
        if flags & L.SNAP_FLAG_MEDIUMS:
            off = L.SNAP_HEADER_SIZE + 12 * cap
            mediums = np.ndarray((n,), np.uint8, buffer=mm, offset=off).copy()
        else:  # a producer from before mediums: everything is its default medium
            mediums = np.zeros(n, np.uint8)
    finally:
        mm.close()
    return Snapshot(req_id, boot_id, seq, dropped, keys, masks, mediums)
