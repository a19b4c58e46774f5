"""The ring across real processes: bursts, overflow, producer SIGKILL, reader restart."""

from __future__ import annotations

import numpy as np

from sidecar.shm_ring import layout as L
from sidecar.shm_ring.reader import RingReader
from sidecar.shm_ring.segment import Segment
from sidecar.testbed.proc import EngineProc


def _keys(records: np.ndarray) -> list[int]:
    return [int(k) for k in records[:, L.C_KEY].view(np.int64)]


def test_ring_cross_process_bursts_larger_than_ring(ring_name: str) -> None:
    reader = RingReader(Segment(ring_name, 256))
    eng = EngineProc("burst", {"ring": ring_name, "bursts": 20, "burst": 600, "pause_each": True})
    try:
        eng.recv()
        eng.send()
        got: list[int] = []
        dropped = 0
        for _ in range(20):
            eng.recv()  # the producer paused after one burst; drain what it accepted
            res = reader.read()
            assert not res.gap and not res.anomalies
            got += _keys(res.records)
            dropped += res.dropped
            eng.send()
        final = eng.recv()
        res = reader.read()
        got += _keys(res.records)
        dropped += res.dropped
        assert got == final["accepted"]
        assert dropped == final["dropped"] == 20 * 600 - len(final["accepted"])
        assert dropped > 0 and len(got) == 20 * 256
    finally:
        eng.close()
        reader.close()


def test_ring_producer_sigkill_mid_burst_leaves_readable_ring(ring_name: str) -> None:
    reader = RingReader(Segment(ring_name, 1024))
    eng = EngineProc("forever", {"ring": ring_name})
    try:
        first = eng.recv()
        eng.send()
        seen = 0
        while seen < 5000:  # let it run for a while, reading concurrently
            res = reader.read()
            assert not res.gap, res.anomalies
            seen += len(res.records)
        eng.kill()
        res = reader.read()
        assert not res.gap, res.anomalies
        keys = _keys(res.records)
        assert keys == sorted(keys)
        assert reader.incarnation is not None and reader.incarnation.boot_id == first["boot_id"]
        # A new engine incarnation attaches to the same segment and the reader follows it.
        eng2 = EngineProc("burst", {"ring": ring_name, "bursts": 1, "burst": 10})
        try:
            second = eng2.recv()
            eng2.send()
            done = eng2.recv()
            res = reader.read()
            assert res.new_incarnation and not res.gap
            assert reader.incarnation.boot_id == second["boot_id"] != first["boot_id"]
            assert _keys(res.records) == done["accepted"] == list(range(10))
            assert [int(s) for s in res.records[:, L.C_SEQ]] == list(range(1, 11))
        finally:
            eng2.close()
    finally:
        eng.close()
        reader.close()


def test_ring_reader_restart_resumes_without_loss(ring_name: str) -> None:
    seg = Segment(ring_name, 1024)
    reader = RingReader(seg)
    eng = EngineProc("burst", {"ring": ring_name, "bursts": 3, "burst": 100, "pause_each": True})
    try:
        eng.recv()
        eng.send()
        eng.recv()
        got = _keys(reader.read().records)
        reader.close()
        seg.close()  # the reader "dies"; the producer keeps writing
        eng.send()
        eng.recv()
        eng.send()
        eng.recv()
        eng.send()
        final = eng.recv()
        reader = RingReader(Segment(ring_name))
        got += _keys(reader.read().records)
        assert got == final["accepted"] == list(range(300))
        assert final["dropped"] == 0
    finally:
        eng.close()
        reader.close()
