"""Keeps the key state's engine view equal to the engine's truth through drops, gaps, restarts.

Imports: stdlib, numpy, sidecar.shm_ring, key_state. `step()` drains the ring once. Recovery
(DESIGN §5): request an engine snapshot fenced at seq S, buffer what is read meanwhile, replace
the view with the snapshot, apply only that incarnation's records after S. Records whose medium
index is outside the descriptor's medium table are dropped and counted.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sidecar.key_state import KeyState
from sidecar.shm_ring import layout as L
from sidecar.shm_ring import snapshot
from sidecar.shm_ring.reader import RingReader

log = logging.getLogger(__name__)


class Sync(enum.Enum):
    NO_ENGINE = "no_engine"  # no producer has attached yet
    WAITING = "waiting_snapshot"
    SYNCED = "synced"


@dataclass(slots=True)
class StepResult:
    records: int = 0
    resynced: bool = False  # the engine view was replaced by an engine snapshot in this step


class EngineSync:
    def __init__(
        self,
        reader: RingReader,
        keys: KeyState,
        *,
        snapshot_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        medium_count: Callable[[], int] | None = None,
    ) -> None:
        self.reader = reader
        self.keys = keys
        self.clock = clock
        self.snapshot_timeout_s = snapshot_timeout_s
        self.status = Sync.NO_ENGINE
        self.boot_id = 0
        self.last_seq = 0
        self.resyncs: Counter[str] = Counter()
        self.dropped_total = 0
        self.anomalies = 0
        self._req = 0
        self._req_at = 0.0
        self._buffer: list[np.ndarray] = []
        self._buffered = 0  # records in _buffer
        self._first = True
        self.n_mediums = 1  # the medium table's size, read from each incarnation's descriptor
        self._medium_count = medium_count
        self.unknown_medium = 0  # records dropped: medium index outside the table

    def request(self, reason: str) -> None:
        """Ask the engine for a snapshot (again); records read meanwhile are buffered."""
        self.resyncs[reason] += 1
        log.info("engine resync requested reason=%s boot_id=%x", reason, self.boot_id)
        self._req = snapshot.request(self.reader.seg)
        self._req_at = self.clock()
        self._buffer = []
        self._buffered = 0
        self.status = Sync.WAITING

    def step(self, max_records: int = 1 << 20, *, full: bool = True) -> StepResult:
        """Drain once. `full=False` returns at once when the ring is idle (no records, no drops)
        and no snapshot is awaited; a full step also re-reads the producer incarnation."""
        out = StepResult()
        if self.status is Sync.SYNCED:
            if not full and self.reader.idle():
                return out
            # The steady state in one C call (medium 0 records only, the whole lag); -1:
            # something to look at, read() below.
            fast = self.n_mediums and max_records >= self.reader.capacity
            m = self.reader.read_folded(self.keys.fold_ring, self.boot_id) if fast else -1
            if m >= 0:
                if m:
                    out.records = m
                    self.last_seq = self.reader.folded_seq
                return out
        res = self.reader.read(max_records)
        if res.incarnation is None:
            return out
        if res.anomalies:
            self.anomalies += len(res.anomalies)
            log.warning("ring anomaly detail=%s", res.anomalies[0])
        if res.incarnation.boot_id != self.boot_id:
            first = self._first
            self._first = False
            self.boot_id = res.incarnation.boot_id
            if self._medium_count is not None:
                # Before the snapshot and any record of this incarnation is applied: its
                # descriptor (written before the incarnation) says which mediums exist.
                self.n_mediums = self._medium_count()
            if not first:
                self.keys.clear_current()  # a new engine process starts with an empty cache
            self.request("sidecar_start" if first else "new_incarnation")
        if res.dropped:
            self.dropped_total += res.dropped
            self.request("dropped")
        elif res.gap:
            self.request("gap")
        records = res.records
        out.records = len(records)
        if len(records):
            self.last_seq = res.last_seq
        if self.status is Sync.WAITING:
            self._buffer.append(records)
            self._buffered += len(records)
            self._poll_snapshot(out)  # first: an answer already there empties the backlog
            if self.status is Sync.WAITING and self._buffered > 4 * self.reader.capacity:
                # The engine writes but does not answer: do not hold an unbounded backlog.
                self.request("buffer_overflow")
        elif res.max_medium < self.n_mediums:  # the read saw no unknown medium: nothing to drop
            self.keys.apply(records)
        else:
            self.keys.apply(self._known(records))
        return out

    def _known(self, records: np.ndarray) -> np.ndarray:
        """Drop (and count) records naming a medium outside the table; clears carry none."""
        if not len(records):
            return records
        meta = records[:, L.C_META]
        med = (meta >> np.uint64(16)) & np.uint64(0xFF)  # layout.meta_medium, vectorised
        bad = (med >= np.uint64(self.n_mediums)) & ((meta & np.uint64(0xFF)) != L.KIND_CLEARED)
        if not bad.any():
            return records
        self.unknown_medium += int(bad.sum())
        log.warning("ring records dropped reason=unknown_medium n=%d", int(bad.sum()))
        kept: np.ndarray = records[~bad]
        return kept

    def _poll_snapshot(self, out: StepResult) -> None:
        try:
            snap = snapshot.poll(self.reader.seg, self._req)
        except snapshot.SnapshotFailed as exc:
            log.warning("engine snapshot failed detail=%s", exc)
            self.request("snapshot_failed")
            return
        if snap is None:
            if self.clock() - self._req_at > self.snapshot_timeout_s:
                self.request("snapshot_timeout")
            return
        if snap.boot_id != self.boot_id:
            self.request("snapshot_incarnation_mismatch")
            return
        known = snap.mediums < self.n_mediums
        if not known.all():
            self.unknown_medium += int((~known).sum())
            log.warning("snapshot entries dropped reason=unknown_medium")
            self.keys.replace(snap.keys[known], snap.masks[known], snap.mediums[known])
        else:
            self.keys.replace(snap.keys, snap.masks, snap.mediums)
        for recs in self._buffer:
            if len(recs):
                self.keys.apply(self._known(recs[recs[:, L.C_SEQ] > snap.seq]))
        self._buffer = []
        dropped = int(self.reader.seg.hdr[L.W_DROPPED])
        if dropped > snap.dropped_at:
            # A record after S was lost: ask again. The new answer covers these drops, so the
            # next read must not count them (and ask) once more.
            self.dropped_total += max(dropped - self.reader.dropped_seen, 0)
            self.reader.dropped_seen = dropped
            self.request("dropped_after_fence")
            return
        self.status = Sync.SYNCED
        out.resynced = True
        log.info(
            "engine resync done seq=%d keys=%d published=%d",
            snap.seq,
            len(snap.keys),
            self.keys.published_count,
        )
