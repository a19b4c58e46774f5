"""Segment creation, layout validation and the written upgrade policy."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from sidecar.shm_ring import layout as L
from sidecar.shm_ring.reader import ReaderConflict, RingReader
from sidecar.shm_ring.segment import Segment
from sidecar.shm_ring.writer import ProducerConflict, RingWriter


def test_segment_created_with_mode_0600(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    mode = Path("/dev/shm" + ring_name).stat().st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert seg.created and seg.capacity == 64
    seg.close()


def test_segment_second_opener_attaches_to_same_ring(ring_name: str) -> None:
    a = Segment(ring_name, 64)
    b = Segment(ring_name)
    assert not b.created and b.capacity == 64
    a.hdr[L.W_TAIL] = 7
    assert b.hdr[L.W_TAIL] == 7
    a.close()
    b.close()


def test_segment_capacity_mismatch_is_clear_error(ring_name: str) -> None:
    Segment(ring_name, 64).close()
    with pytest.raises(L.LayoutError, match=r"capacity 64.*asked for 128"):
        Segment(ring_name, 128)


def test_segment_bad_magic_refused(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    seg.hdr[L.W_MAGIC] = 0x1234
    with pytest.raises(L.LayoutError, match="bad magic"):
        Segment(ring_name)
    seg.close()


def test_segment_newer_layout_says_upgrade_sidecar(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    seg.hdr[L.W_VERSION_SLOT] = (L.LAYOUT_VERSION + 1) | (L.SLOT_SIZE << 32)
    with pytest.raises(L.LayoutError, match="upgrade the sidecar"):
        Segment(ring_name)
    seg.close()


@pytest.mark.parametrize(
    ("version", "outcome"),
    [
        (L.LAYOUT_VERSION, None),
        (L.LAYOUT_VERSION + 1, "upgrade the sidecar"),
        (L.LAYOUT_VERSION + 5, "upgrade the sidecar"),
        (L.LAYOUT_VERSION - 2, "upgrade the engine"),
        (0, "upgrade the engine"),
    ],
)
def test_layout_upgrade_policy(version: int, outcome: str | None) -> None:
    """Pinned policy: the sidecar reads layout N and N-1 (N-1 exists from v2 on)."""
    if outcome is None:
        L.check_readable(version, L.SLOT_SIZE)
    else:
        with pytest.raises(L.LayoutError, match=outcome):
            L.check_readable(version, L.SLOT_SIZE)


def test_layout_previous_version_readable_once_it_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "LAYOUT_VERSION", 2)
    L.check_readable(1, L.SLOT_SIZE)
    with pytest.raises(L.LayoutError, match="upgrade the sidecar"):
        L.check_readable(3, L.SLOT_SIZE)


def test_segment_name_distinct_per_instance_and_rank() -> None:
    names = {L.segment_name(i, r) for i in ("a/b", "a_b", "a b") for r in (0, 1)}
    assert len(names) == 6
    assert all(re.fullmatch(r"/kvcm\.[A-Za-z0-9_-]+\.[0-9a-f]{10}\.dp\d+", n) for n in names)


def test_second_live_producer_refused(ring_name: str) -> None:
    seg = Segment(ring_name, 64)
    seg.hdr[L.W_PRODUCER_STATE] = L.PRODUCER_ATTACHED
    seg.hdr[L.W_PID] = 1  # pid 1 is alive in this namespace
    from sidecar.shm_ring.segment import pid_namespace

    seg.hdr[L.W_PIDNS] = pid_namespace()
    with pytest.raises(ProducerConflict):
        RingWriter(seg)
    seg.close()


def test_second_reader_refused(ring_name: str) -> None:
    a = RingReader(Segment(ring_name, 64))
    seg = Segment(ring_name)
    with pytest.raises(ReaderConflict):
        RingReader(seg)
    a.close()
    RingReader(seg).close()  # released with the first reader


def test_ring_docs_match_layout_offsets() -> None:
    """docs/ring.md lists every header word at the byte offset layout.py uses."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "ring.md").read_text()
    for name in dir(L):
        if name.startswith("W_"):
            off = 8 * getattr(L, name)
            assert re.search(rf"\|\s*{off}\s*\|\s*`{name[2:].lower()}`", doc), name
