"""Snapshot exchange across processes: snapshot(S) + records after S == the engine's truth."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.shm_ring import layout as L
from sidecar.shm_ring import snapshot
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment, unlink
from sidecar.testbed.proc import EngineProc


def _fold(state: dict[int, int], records: np.ndarray) -> None:
    for _seq, key, meta in records[:, :3].tolist():
        k = key - (1 << 64) if key >= 1 << 63 else key
        kind, bit = meta & 0xFF, 1 << ((meta >> 8) & 0xFF)
        if kind == L.KIND_STORED:
            state[k] = state.get(k, 0) | bit
        elif kind == L.KIND_REMOVED:
            v = state.get(k, 0) & ~bit
            if v:
                state[k] = v
            else:
                state.pop(k, None)
        else:
            state.clear()


def _await_snapshot(
    seg: Segment, req: int, reader: RingReader, backlog: list[np.ndarray]
) -> snapshot.Snapshot:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        snap = snapshot.poll(seg, req)
        if snap is not None:
            return snap
        backlog.append(reader.read().records)  # keep draining while the engine answers
        time.sleep(0.0005)  # poll interval of a busy-wait on another process, not a sync point
    raise TimeoutError("no snapshot answer")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), snap_after=st.integers(0, 3000), ops=st.integers(500, 4000))
def test_snapshot_plus_later_records_equals_engine_truth(
    seed: int, snap_after: int, ops: int
) -> None:
    name = f"/kvcm-snap-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    seg = Segment(name, 1 << 16)
    reader = RingReader(seg)
    eng = EngineProc("workload", {"ring": name, "seed": seed, "ops": ops, "flush_every": 37})
    try:
        eng.recv()
        eng.send()
        backlog: list[np.ndarray] = []
        read = 0
        while read < min(snap_after, ops // 3):  # request while the producer keeps writing
            r = reader.read().records
            backlog.append(r)
            read += len(r) or 1
        req = snapshot.request(seg)
        snap = _await_snapshot(seg, req, reader, backlog)
        last_seq = eng.recv()["last_seq"]  # published with flush(wait=True); quiet from here on
        seen = max((int(r[-1, L.C_SEQ]) for r in backlog if len(r)), default=0)
        deadline = time.monotonic() + 30
        while seen < last_seq:
            assert time.monotonic() < deadline, "records never reached the ring"
            r = reader.read().records
            backlog.append(r)
            if len(r):
                seen = int(r[-1, L.C_SEQ])
        eng.send()
        truth = {k: v for k, v in eng.recv()["truth"]}
        state: dict[int, int] = {}
        for k, m in zip(snap.keys.tolist(), snap.masks.tolist(), strict=True):
            if m:  # mask-0 entries are keys no longer held
                state[k] = state.get(k, 0) | m
        records = np.concatenate(backlog)
        _fold(state, records[records[:, L.C_SEQ] > snap.seq])
        assert state == truth
        assert snap.dropped_at == 0 and reader.dropped_seen == 0
    finally:
        eng.close()
        reader.close()
        unlink(name)
