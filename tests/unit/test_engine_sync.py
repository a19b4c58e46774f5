"""EngineSync: the backlog held while waiting for an engine snapshot stays bounded."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.key_state import KeyState
from sidecar.shm_ring import layout as L
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment
from sidecar.shm_ring.writer import RingWriter
from sidecar.source.engine_sync import EngineSync, StepResult, Sync

# Over the C ring read and fold (sidecar/shm_ring/_accel.c) and their numpy forms.
pytestmark = pytest.mark.usefixtures("accel_backend")


def test_engine_sync_unanswered_snapshot_backlog_is_bounded(ring_name: str) -> None:
    writer = RingWriter(Segment(ring_name, 64))  # a producer that never answers snapshots
    sync = EngineSync(RingReader(Segment(ring_name)), KeyState())
    meta = L.pack_meta(L.KIND_STORED)
    peak = 0
    for i in range(20):
        writer.write(np.arange(i * 64, (i + 1) * 64, dtype=np.int64), meta)
        sync.step()
        peak = max(peak, sync._buffered)
        assert sync.status is Sync.WAITING
    assert sync.resyncs["buffer_overflow"] >= 1
    assert peak <= 4 * 64 + 64  # never more than the bound plus one read
    sync.reader.close()
    writer.close()


def test_engine_sync_records_of_an_unknown_medium_are_dropped_and_counted(ring_name: str) -> None:
    writer = RingWriter(Segment(ring_name, 64))
    sync = EngineSync(RingReader(Segment(ring_name)), KeyState())
    sync.n_mediums = 2  # the descriptor's medium table: (hbm, mem)
    recs = np.zeros((4, 4), np.uint64)
    for i, (kind, medium) in enumerate(
        [(L.KIND_STORED, 0), (L.KIND_STORED, 1), (L.KIND_STORED, 5), (L.KIND_CLEARED, 9)]
    ):
        recs[i] = (i + 1, 100 + i, L.pack_meta(kind, 0, medium), 0)
    kept = sync._known(recs)
    assert kept[:, 1].tolist() == [100, 101, 103]  # a clear names no medium: never dropped
    assert sync.unknown_medium == 1
    sync.reader.close()
    writer.close()


def test_engine_sync_step_folds_clears_and_mediums_and_drops_unknown_ones(ring_name: str) -> None:
    """Through step() (the read's flags decide whether records are filtered): a clear splits
    the batch, each known medium is folded, an unknown medium's records are dropped, counted."""
    writer = RingWriter(Segment(ring_name, 64))
    sync = EngineSync(RingReader(Segment(ring_name)), KeyState())
    sync.status, sync.boot_id, sync.n_mediums = Sync.SYNCED, writer.boot_id, 2
    sync._first = False
    ops = [
        (L.KIND_STORED, 0, 1),
        (L.KIND_STORED, 1, 2),
        (L.KIND_CLEARED, 0, 3),
        (L.KIND_STORED, 0, 4),
        (L.KIND_STORED, 1, 5),
        (L.KIND_STORED, 7, 6),  # no medium 7 in the table
        (L.KIND_REMOVED, 1, 5),
        (L.KIND_STORED, 1, 8),
    ]
    keys = np.array([k for *_x, k in ops], np.int64)
    writer.write(keys, np.array([L.pack_meta(kd, 0, m) for kd, m, _k in ops], np.uint64))
    assert sync.step().records == len(ops)
    assert sync.keys.published_keys(0).tolist() == [4]
    assert sync.keys.published_keys(1).tolist() == [8]
    assert sync.unknown_medium == 1 and sync.keys.mediums == 2
    writer.write(keys[:2], np.array([L.pack_meta(L.KIND_STORED, 0, 0)] * 2, np.uint64))
    sync.step()  # medium 0 only: the C fold's case
    assert sorted(sync.keys.published_keys(0).tolist()) == [1, 2, 4]
    assert sync.last_seq == len(ops) + 2 and sync.unknown_medium == 1
    sync.reader.close()
    writer.close()


def test_ring_source_keeps_snapshot_mediums_before_the_descriptor_is_loaded(ring_name: str) -> None:
    """The engine's snapshot can arrive before the publisher reads the descriptor (identity):
    the sync must already know the medium table then, or it drops every other tier's keys."""
    import engine_hook
    from sidecar import config as C
    from sidecar.source.ring import RingSource

    hook = engine_hook.attach(
        strict=True,
        env={},
        instance_id="i",
        ring_name=ring_name,
        ring_capacity_slots=64,
        mediums=("hbm", "mem", "disk"),
        start_flusher=False,
    )
    hook.stored([1, 2], medium="disk")
    hook.stored(3)
    hook.flush()
    env = {
        "KV_CACHE_EVENT_MANAGER_ENDPOINT": "http://127.0.0.1:9",
        "KV_CACHE_EVENT_INSTANCE_ID": "i",
        "KV_CACHE_EVENT_HOST_IP_PORT": "h:1",
    }
    cfg = C.load(env=env)
    keys = KeyState()
    src = RingSource(cfg, RingReader(Segment(ring_name)), keys)
    src.sync.step()  # sees the engine, asks for a snapshot
    hook.flush()  # the engine answers
    src.sync.step()
    assert src.sync.status is Sync.SYNCED
    assert keys.as_dict(2) == {1: 1, 2: 1} and keys.as_dict(0) == {3: 1}
    assert src.sync.unknown_medium == 0
    src.reader.close()
    hook.close()


def test_engine_sync_drop_after_the_fence_asks_once(ring_name: str) -> None:
    """A drop between the sidecar's read and its poll of the answer (two threads in real life,
    staged here): one new request covers it; the next read does not ask again for it."""
    import engine_hook

    hook = engine_hook.attach(
        strict=True,
        env={},
        instance_id="i",
        ring_name=ring_name,
        ring_capacity_slots=16,
        start_flusher=False,
    )
    sync = EngineSync(RingReader(Segment(ring_name)), KeyState())
    sync.step()  # sees the engine: asks
    hook.flush()  # answers (fence 0)
    hook.stored(list(range(40)))
    hook.flush()  # 16 accepted, 24 dropped after the fence
    sync._buffer.append(np.empty((0, 4), np.uint64))
    sync._poll_snapshot(StepResult())
    assert sync.resyncs["dropped_after_fence"] == 1 and sync.dropped_total == 24
    hook.flush()  # answers the new request from the resident set: all 40 keys
    sync.step()
    sync.step()
    assert sync.status is Sync.SYNCED
    assert sync.resyncs["dropped"] == 0  # the drops were not counted (and asked for) twice
    assert set(sync.keys.as_dict()) == set(range(40))
    sync.reader.close()
    hook.close()
